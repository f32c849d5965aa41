"""Which peer a failed collective lost: every rank's address, and a probe of each when a collective fails.

gloo reports a cut link or a lost node as "Timed out waiting <ms> for recv operation" (no peer named) or
"Connection reset by peer [address]:port". To name the peer, each rank listens on a socket of its own
(``listen`` without ``accept``: the kernel completes a connection while the process lives) on the address
it reaches rank 0's node from, and the ranks exchange these addresses once, when the process group starts.
When a collective fails, :func:`collective_failure` probes every peer's socket (a TCP connect, a few
seconds at most): a refused connection is a process gone, no answer is a node or link lost.

A failed collective becomes :class:`PeerLostError`, a user error whose message names
``trainer.collective_timeout_s``, the peers not answering and the last complete checkpoint, with the hint
to restart with ``trainer.resume=auto``.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from modules.host_collectives import host_group

from pipeline.runtime.errors import UserError

PROBE_TIMEOUT_S = 3.0
# how gloo words a peer that stopped answering (it raises a plain RuntimeError; c10d raises Dist*Error)
LOST_PEER_WORDS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
                   "Application timeout caused pair closure")  # gloo: a pair timed out inside an all-to-all


class PeerLostError(UserError, RuntimeError,
                    hint="bring the node or link back and start the job again with trainer.resume=auto: it resumes "
                         "from the last complete checkpoint"):
    """A collective failed: a peer stopped answering (a node lost, a link cut, a process killed)."""


@dataclass
class Peers:
    """Every rank's probe address ``(host, port)``, indexed by rank, and this rank's listening socket."""

    rank: int
    addresses: list[tuple[str, int]]
    listener: socket.socket

    @classmethod
    def exchange(cls) -> Optional["Peers"]:
        """Listen, and all-gather the ranks' probe addresses (a collective: every rank calls it); None
        without a process group of two ranks or more."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        host = _own_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(64)
        addresses: list = [None] * dist.get_world_size()
        dist.all_gather_object(addresses, (host, listener.getsockname()[1]), group=host_group())
        return cls(dist.get_rank(), [tuple(a) for a in addresses], listener)

    def not_answering(self) -> dict[int, str]:
        """Peers whose probe socket does not take a connection within ``PROBE_TIMEOUT_S``: rank → why."""
        others = [r for r in range(len(self.addresses)) if r != self.rank]
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(others)))) as pool:
            answers = dict(zip(others, pool.map(lambda r: _probe(*self.addresses[r]), others)))
        return {r: why for r, why in answers.items() if why is not None}


def _own_address(toward: str) -> str:
    """The local address this host reaches ``toward`` from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _probe(host: str, port: int) -> Optional[str]:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except ConnectionRefusedError:
        return "refuses connections: its process is gone"
    except (socket.timeout, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:.0f} s: its node or link is down"
    except OSError as e:
        return f"unreachable ({e.strerror or e})"


def is_lost_peer(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a collective that lost a peer."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)) or (
                isinstance(err, RuntimeError) and any(w in str(err) for w in LOST_PEER_WORDS)):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def collective_failure(err: BaseException, peers: Optional[Peers], timeout_s: float,
                       last_checkpoint: Optional[Path]) -> PeerLostError:
    """The :class:`PeerLostError` for a collective that failed with ``err``, naming the peers that do not
    answer and ``last_checkpoint`` (the newest complete one, or None)."""
    rank = peers.rank if peers else (dist.get_rank() if dist.is_initialized() else 0)
    lost = peers.not_answering() if peers else {}
    who = "; ".join(f"rank {r} at {peers.addresses[r][0]} {why}" for r, why in sorted(lost.items())) if lost else \
        "every peer still answers a probe (a peer's process may have failed on its own: see its log)"
    first = " ".join(str(err).split())[:300]
    where = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no complete checkpoint was written"
    return PeerLostError(f"rank {rank}: a collective failed (trainer.collective_timeout_s={timeout_s:g}): {who}; "
                         f"{where}. gloo said: {first}")
