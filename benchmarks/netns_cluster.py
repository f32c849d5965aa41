"""A cluster on one machine: N nodes, each a Linux network namespace whose link into a shared bridge is
shaped both ways to a rate, with one ``torchrun`` agent per node.

    with Cluster(nodes=2, rate_mbit=100) as cluster:
        agents = [cluster.torchrun(n, nproc=1, args=["-m", "pipeline.commands.train", ...]) for n in range(2)]

Layout (all of it inside namespaces this process creates, nothing in the machine's own network):

    node i: namespace <prefix>n<i>, interface eth0 = 198.18.0.<i+1>/24, a tbf qdisc of rate R on eth0
        │ veth
    switch: namespace <prefix>sw, bridge br0, port p<i> with a tbf qdisc of rate R (traffic toward node i)

198.18.0.0/15 is the block reserved for network benchmarks (RFC 2544); the nodes have no route out of
their bridge. ``tbf`` (token bucket: ``rate``, a ``burst`` of 5 ms of traffic, at least 16 KiB, and a
queue of 100 ms) stands for a link of that rate; ``netem`` (delay, loss) is not in this kernel.

torchrun inside namespaces needs (checked here): ``--local_addr=<node address>`` on every node, since
the host name is the same in every namespace; ``--rdzv_conf=is_host=true`` on node 0, which hosts the
c10d rendezvous store; and ``GLOO_SOCKET_IFNAME=eth0`` so gloo binds the node's own interface. Each node's
``/etc/hosts`` (``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` puts in its place) names every node's
address ``ctr-node<i>``, also as an IPv4-mapped IPv6 address (``::ffff:198.18.0.<i+1>``: c10d's store listens on a
dual-stack socket, and glibc does not look the IPv4 address up for it): without a name c10d's store prints "The
hostname of the client socket cannot be retrieved" (in C++, from the agents and the workers) for every peer that
connects, as on a real cluster whose addresses have no reverse DNS entry.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc`` commands; :func:`unavailable`
says why not otherwise. Everything is removed on exit, failures included; namespaces left by a process
that died (its pid is in their names) are removed by the next cluster made.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
NAME_PREFIX = "ctrnet"
SUBNET = "198.18.0"
RDZV_PORT = 29400
_made = 0


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``/``tc``, or the kernel refused)."""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable() -> Optional[str]:
    """Why a cluster cannot be made on this machine, or None if it can (tries a namespace)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); this process is not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"{NAME_PREFIX}-{os.getpid()}-probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _remove_orphans() -> None:
    """Delete namespaces of clusters whose making process is gone (named ``ctrnet-<pid>-...``)."""
    listed = _sh("ip", "netns", "list", check=False).stdout.split()
    for name in listed:
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == NAME_PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            _kill_namespace(name)
            _sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _kill_namespace(name: str) -> None:
    """SIGKILL every process inside namespace ``name``."""
    pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _shape(namespace: str, device: str, rate_mbit: float) -> None:
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(rate_bytes * 0.005))
    _sh("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
        "burst", str(burst), "latency", "100ms")


@dataclass
class Cluster:
    """``nodes`` namespaces on one bridge, each link shaped to ``rate_mbit`` both ways (None: unshaped)."""

    nodes: int
    rate_mbit: Optional[float] = None
    names: list[str] = field(default_factory=list, init=False)
    switch: str = field(default="", init=False)
    procs: list[subprocess.Popen] = field(default_factory=list, init=False)

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "Cluster":
        reason = unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        _remove_orphans()
        global _made
        _made += 1
        base = f"{NAME_PREFIX}-{os.getpid()}-{_made}"
        self.switch = f"{base}-sw"
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.nodes):
                ns = f"{base}-n{i}"
                _sh("ip", "netns", "add", ns)
                self.names.append(ns)
                _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                    "netns", self.switch)
                _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                if self.rate_mbit:
                    _shape(ns, "eth0", self.rate_mbit)
                    _shape(self.switch, f"p{i}", self.rate_mbit)
            self._name_nodes()
        except BaseException:
            self.close()
            raise
        return self

    def _name_nodes(self) -> None:
        """Every node's address in each node's own ``/etc/hosts`` (see the module doc)."""
        names = "".join(f"{a}{self.address(i)} ctr-node{i}\n" for i in range(self.nodes) for a in ("", "::ffff:"))
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        for ns in self.names:
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts.rstrip("\n") + "\n" + names)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process in the nodes and remove the namespaces (idempotent)."""
        for ns in self.names:
            _kill_namespace(ns)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.names, self.switch]:
            if ns:
                _sh("ip", "netns", "del", ns, check=False)
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.names, self.switch = [], ""

    def popen(self, node: int, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[node], *argv], env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def torchrun_argv(self, node: int, nproc: int, run_id: str, args: list[str], max_restarts: int = 0,
                      rdzv_timeout_s: int = 120) -> list[str]:
        """torchrun of node ``node`` (c10d rendezvous hosted by node 0), then ``args`` (e.g. ``-m module ...``)."""
        conf = f"join_timeout={rdzv_timeout_s},read_timeout={rdzv_timeout_s}"
        if node == 0:
            conf += ",is_host=true"
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}", f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={self.address(0)}:{RDZV_PORT}", f"--rdzv_id={run_id}",
                f"--rdzv_conf={conf}", f"--local_addr={self.address(node)}", f"--max-restarts={max_restarts}",
                "--monitor-interval=1", *args]

    def torchrun(self, node: int, nproc: int, run_id: str, args: list[str], env: dict[str, str],
                 max_restarts: int = 0, rdzv_timeout_s: int = 120, **kwargs) -> subprocess.Popen:
        """One torchrun agent on node ``node`` with ``GLOO_SOCKET_IFNAME`` set to the node's interface."""
        env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
        argv = self.torchrun_argv(node, nproc, run_id, args, max_restarts, rdzv_timeout_s)
        return self.popen(node, argv, env, **kwargs)

    def set_link(self, node: int, up: bool) -> None:
        """Bring node ``node``'s link up or down (a cut cable: packets on it are lost)."""
        _sh("ip", "-n", self.names[node], "link", "set", "eth0", "up" if up else "down")

    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node``'s interface has sent (its kernel counter)."""
        out = _sh("ip", "-n", self.names[node], "-s", "-j", "link", "show", "eth0").stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of node ``node`` (a machine lost: its agent and its workers)."""
        _kill_namespace(self.names[node])


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[Optional[int]]:
    """Wait for every process up to ``timeout_s`` in all; exit codes (None for one still running)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]
