"""The store a ``torchrun`` job's process group is made in: a new one for every start of the workers, the
same on every node.

torchrun's agents share one TCP store with their workers for the whole job (the rendezvous's server, kept
across restarts), and the process group's keys carry no attempt prefix: a restarted rank can read the
address of a peer of the killed start and fail to connect. Prefixing the keys with
``TORCHELASTIC_RESTART_COUNT`` is not enough across nodes: an agent that restarts its healthy workers
because another node failed and rejoined does not count a restart (``torch.distributed.elastic.agent.
server.api``: a membership change restarts without using one of ``--max-restarts``), so the nodes' counts
differ, each node waits under its own prefix, and the job hangs in process-group creation.

Here global rank 0 opens a TCP store server of its own for each start (on ``MASTER_ADDR``, which is its
node's address, at a free port) and announces ``host:port:token`` under one key of the agent's store; the
other ranks read the key and connect. An announcement left by an earlier start names a server that is gone
(every worker of an earlier start is stopped before the next rendezvous completes), so it refuses the
connection, or a reused port answers with another token, and the rank reads the key again until this
start's announcement is there.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from pipeline.runtime.peers import PeerLostError

KEY = "ctr/process_group_store"
CONNECT_TIMEOUT = timedelta(seconds=5)


def agent_store_used() -> bool:
    """Whether torchrun's agent hosts the store for this worker (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def start_store(rank: int, timeout: timedelta) -> dist.Store:
    """This start's store for rank ``rank``; a rank other than 0 waits up to ``timeout`` for rank 0's."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        server = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        server.set("token", token)
        agent.set(KEY, f"{host}:{server.port}:{token}")
        return server
    deadline = time.monotonic() + timeout.total_seconds()
    last_error = "none announced"
    while time.monotonic() < deadline:
        s_host, s_port, token = agent.get(KEY).decode().rsplit(":", 2)
        try:
            client = dist.TCPStore(s_host, int(s_port), is_master=False, timeout=CONNECT_TIMEOUT)
            if client.get("token").decode() == token:
                client.set_timeout(timeout)
                return client
            last_error = f"{s_host}:{s_port} answers with another token"
        except (RuntimeError, dist.DistStoreError) as e:  # refused or timed out: a store of an earlier start
            last_error = f"{s_host}:{s_port}: {str(e).splitlines()[0]}"
        time.sleep(0.2)
    raise PeerLostError(f"rank {rank}: rank 0's process-group store was not reachable within "
                        f"{timeout.total_seconds():g} s (trainer.collective_timeout_s); last tried: {last_error}")
