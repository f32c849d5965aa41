"""Naming a lost peer (pipeline/runtime/peers.py): which errors are a peer lost, and the probe's answers."""

from __future__ import annotations

import socket
from pathlib import Path

import torch.distributed as dist

from pipeline.runtime.peers import Peers, collective_failure, is_lost_peer

GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for "
                "recv operation to complete")


def test_gloo_and_c10d_failures_are_a_lost_peer_and_other_errors_are_not():
    assert is_lost_peer(RuntimeError(GLOO_TIMEOUT))
    assert is_lost_peer(dist.DistNetworkError("Broken pipe"))
    try:  # raised from one: Lightning and the callbacks may wrap it
        try:
            raise RuntimeError("Read error [198.18.0.2]:49287: Connection reset by peer")
        except RuntimeError as e:
            raise ValueError("while saving") from e
    except ValueError as wrapped:
        assert is_lost_peer(wrapped)
    assert not is_lost_peer(RuntimeError("the request timed out after 5 s"))
    assert not is_lost_peer(ValueError("bad value"))


def test_the_probe_tells_a_live_peer_from_a_gone_one():
    with socket.socket() as live, socket.socket() as gone:
        live.bind(("127.0.0.1", 0))
        live.listen(4)
        gone.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        peers = Peers(0, [("127.0.0.1", 1), live.getsockname(), gone.getsockname()], live)
        assert peers.not_answering() == {2: "refuses connections: its process is gone"}
        error = collective_failure(RuntimeError(GLOO_TIMEOUT), peers, 15, Path("/ckpt/step-000000005"))
    assert str(error).startswith("rank 0: a collective failed (trainer.collective_timeout_s=15): rank 2 at 127.0.0.1 "
                                 "refuses connections: its process is gone; the last complete checkpoint is "
                                 "/ckpt/step-000000005. gloo said: [")
