"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-node tests (needs root).

``two_nodes()`` builds namespaces A (10.201.0.1/24) and B (10.201.0.2/24), each with its own
loopback, joined by one veth pair; /etc/netns/<ns>/hosts (which ``ip netns exec`` mounts over
/etc/hosts) names them ``lsnode1`` / ``lsnode2`` and keeps this machine's host name on 127.0.0.1,
as in containers whose host name resolves to loopback. Names are unique per call (several test
runs can build pairs at once: namespaces do not share addresses), and the namespaces, the pair and
the hosts files are removed on exit, on error, and at interpreter exit as a last resort.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import Iterator

ADDRS = ("10.201.0.1", "10.201.0.2")
HOSTNAMES = ("lsnode1", "lsnode2")


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "multi-node tests need root (ip netns, ip link); run them as root, as CI does"
    if shutil.which("ip") is None:
        return "multi-node tests need the `ip` command (apt-get install iproute2)"
    probe = f"lsprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Node:
    namespace: str
    interface: str  # the veth end inside the namespace
    addr: str
    hostname: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore this node's end of the link; its address stays configured."""
        _ip("-n", self.namespace, "link", "set", self.interface, "up" if up else "down")

    def shape(self, rate: str) -> None:
        """Limit what this node sends over the link to ``rate`` (tc's syntax: ``100mbit``, ``2.5gbit``).

        A token bucket (tbf) on the veth end inside the namespace; ``replace`` re-shapes an end shaped before.
        tbf, not netem: netem is missing from some kernels (this one's), tbf is always built in.
        """
        subprocess.run(["tc", "-n", self.namespace, "qdisc", "replace", "dev", self.interface, "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "100ms"], check=True, capture_output=True, text=True)


def _remove(namespaces: list[str]) -> None:
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth end, and so the pair
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    tag = uuid.uuid4().hex[:6]
    nodes = (Node(f"ls{tag}a", f"lsv{tag}a", ADDRS[0], HOSTNAMES[0]),
             Node(f"ls{tag}b", f"lsv{tag}b", ADDRS[1], HOSTNAMES[1]))
    names = [n.namespace for n in nodes]
    def cleanup() -> None:
        _remove(names)

    atexit.register(cleanup)
    try:
        hosts = open("/etc/hosts").read() if os.path.exists("/etc/hosts") else "127.0.0.1 localhost\n"
        hosts += "".join(f"{n.addr} {n.hostname}\n" for n in nodes)
        for n in nodes:
            _ip("netns", "add", n.namespace)
            os.makedirs(f"/etc/netns/{n.namespace}", exist_ok=True)
            with open(f"/etc/netns/{n.namespace}/hosts", "w") as f:
                f.write(hosts)
        _ip("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)
        for n in nodes:
            _ip("link", "set", n.interface, "netns", n.namespace)
            _ip("-n", n.namespace, "addr", "add", f"{n.addr}/24", "dev", n.interface)
            _ip("-n", n.namespace, "link", "set", n.interface, "up")
            _ip("-n", n.namespace, "link", "set", "lo", "up")
        yield nodes
    finally:
        cleanup()
        atexit.unregister(cleanup)
