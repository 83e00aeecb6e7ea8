"""What a job listens on, and the rendezvous faults of several nodes, on this machine's loopback.

* One node: nothing ``lockstep launch`` or ``lockstep.init()`` starts may listen beyond loopback.
  The test lists the job's listening sockets while it runs (/proc/net/tcp and tcp6, mapped to the
  job's processes through the socket inodes in /proc/PID/fd) and fails on any other address.
* Several nodes (two agents here, both on 127.0.0.1): node 0's port already taken; node 1 dialling a
  master nobody listens on; the nodes launched with different --nnodes. Each ends within a bound,
  with an error naming the cause.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HOLD = os.path.join(HERE, "launch_scripts", "hold.py")
ALLREDUCE = os.path.join(HERE, "launch_scripts", "allreduce.py")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- listening sockets

def _family_tree(root_pids: list[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), list(root_pids)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[int(target[8:-1])] = pid
        except OSError:
            continue
    return inodes


def _decode(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return addr, int(port, 16)


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: TCP_LISTEN
                    addr, port = _decode(fields[1])
                    found.append((inodes[int(fields[9])], addr, port))
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _hold_and_list(procs: list[subprocess.Popen], release: str, nranks: int) -> list[tuple[int, str, int]]:
    """Wait until every rank says ready, list the job's listeners, release the job."""
    ready, deadline = 0, time.monotonic() + 120
    lines = []
    while ready < nranks and time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"the job ended early: {p.stdout.read()} {p.stderr.read()}")
        line = procs[0].stdout.readline() if len(procs) == 1 else ""
        if len(procs) > 1:
            line = "".join(p.stdout.readline() for p in procs)
        lines.append(line)
        ready += line.count("ready rank=")
    assert ready == nranks, lines
    found = listening(_family_tree([p.pid for p in procs]))
    open(release, "w").close()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
    return found


def _one_node_launch(tmp_path) -> tuple[int, list]:
    release = str(tmp_path / "release")
    proc = subprocess.Popen([sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", HOLD, release],
                            env=clean_env(), cwd=HERE, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        return proc.pid, _hold_and_list([proc], release, 2)
    finally:
        proc.kill()


def _init_without_agent(tmp_path) -> tuple[int, int, list]:
    release, port = str(tmp_path / "release"), free_port()
    procs = [subprocess.Popen([sys.executable, HOLD, release, "lockstep"], cwd=HERE, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in (0, 1)]
    try:
        return procs[0].pid, port, _hold_and_list(procs, release, 2)
    finally:
        for p in procs:
            p.kill()


def test_one_node_launch_listens_on_loopback_only(faults):
    agent_pid, found = faults["one_node_launch"]
    # the agent's rendezvous store, the workers' store (served by the agent) and gloo's listeners: all there...
    assert len(found) >= 3, found
    assert any(pid == agent_pid for pid, _, _ in found)  # the agent's stores are among them
    # ...and none beyond loopback
    assert [f for f in found if not _is_loopback(f[1])] == [], found


def test_lockstep_init_with_every_rank_local_listens_on_loopback_only(faults):
    """No agent (ranks started by hand, as mp.spawn or a torchrun without a shared store would): init's own store."""
    rank0_pid, port, found = faults["init_without_agent"]
    assert (rank0_pid, "127.0.0.1", port) in found  # rank 0 serves the store, on loopback
    assert [f for f in found if not _is_loopback(f[1])] == [], found


# ---------------------------------------------------------------- several nodes: rendezvous faults (and the fixture)

def _launch(argv: list[str], timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lockstep", "launch", *argv], env=clean_env(), cwd=HERE,
                          capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """Every job of this file side by side: each is mostly start-up and waiting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, silent, shared = taken.getsockname()[1], free_port(), free_port()
        two = ["--nproc-per-node", "1", "--master-addr", "localhost"]  # 127.0.0.1 is refused with --nnodes > 1
        jobs = {
            "busy": two + ["--nnodes", "2", "--node-rank", "0", "--master-port", str(busy), ALLREDUCE],
            "silent": two + ["--nnodes", "2", "--node-rank", "1", "--master-port", str(silent), "--rdzv-timeout", "5",
                             ALLREDUCE],
            "nnodes_2": two + ["--nnodes", "2", "--node-rank", "0", "--master-port", str(shared),
                               "--rdzv-timeout", "60", ALLREDUCE],
            "nnodes_3": two + ["--nnodes", "3", "--node-rank", "1", "--master-port", str(shared),
                               "--rdzv-timeout", "60", ALLREDUCE],
        }
        with ThreadPoolExecutor(len(jobs) + 2) as pool:
            futures = {name: pool.submit(_launch, argv) for name, argv in jobs.items()}
            futures["one_node_launch"] = pool.submit(_one_node_launch, tmp_path_factory.mktemp("launch"))
            futures["init_without_agent"] = pool.submit(_init_without_agent, tmp_path_factory.mktemp("init"))
            results = {name: f.result() for name, f in futures.items()}
    results["ports"] = {"busy": busy, "silent": silent, "shared": shared}
    return results


def test_master_port_in_use_on_node_0_names_address_and_port(faults):
    proc, elapsed_s = faults["busy"]
    port = faults["ports"]["busy"]
    assert proc.returncode == 1 and elapsed_s < 60, proc.stderr
    assert (f"lockstep launch: the rendezvous at localhost:{port} (--master-addr/--master-port) failed: "
            f"RendezvousConnectionError: node 0 cannot serve the rendezvous store: cannot listen on localhost:{port}"
            in proc.stderr), proc.stderr
    assert "address already in use" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_master_nobody_listens_on_times_out_naming_address_and_port(faults):
    proc, elapsed_s = faults["silent"]
    port = faults["ports"]["silent"]
    assert proc.returncode == 1 and elapsed_s < 60, proc.stderr
    assert (f"nobody answered at localhost:{port} (--master-addr/--master-port) within --rdzv-timeout 5s: "
            f"is `lockstep launch --node-rank 0` running there?" in proc.stderr), proc.stderr
    assert "allreduce rank=" not in proc.stdout


def test_nodes_launched_with_different_nnodes_both_fail_naming_both(faults):
    for name in ("nnodes_2", "nnodes_3"):
        proc, elapsed_s = faults[name]
        assert proc.returncode == 1 and elapsed_s < 90, (name, proc.stderr)
        assert "NodesDisagree: the nodes disagree on --nnodes:" in proc.stderr, (name, proc.stderr)
        assert "--nnodes 2" in proc.stderr and "--nnodes 3" in proc.stderr
        assert "allreduce rank=" not in proc.stdout  # no worker started with the wrong world size


def test_node_0_finding_the_disagreement_stays_until_the_other_node_read_it():
    """The order the flaky launch above could not force: node 1 (--nnodes 3) records its count first, node 0
    (--nnodes 2, serving the store) finds the disagreement. Node 0's process then ends, and its store with it;
    node 1 must have read the message by then (it failed with a bare "Broken pipe" when node 0 left at once).
    Two real handlers on a real TCPStore, in one process: node 0's end is dropping its store."""
    import gc
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from lockstep.launch import rendezvous

    port = free_port()
    run_id = f"lockstep-localhost-{port}"

    def handler(nnodes, node_rank):
        return rendezvous.create_handler(RendezvousParameters(
            backend=rendezvous.BACKEND, endpoint=f"localhost:{port}", run_id=run_id, min_nodes=nnodes,
            max_nodes=nnodes, is_host=node_rank == 0, join_timeout=30, timeout=30, lockstep_node_rank=node_rank,
            lockstep_nproc=1, lockstep_master_addr="localhost", lockstep_port=port, lockstep_node_timeout=10))

    def outcome(h):
        try:
            h.next_rendezvous()
            return "no error"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    node0, node1 = handler(2, 0), handler(3, 1)
    out = {}
    thread = threading.Thread(target=lambda: out.update(node1=outcome(node1)))
    thread.start()
    deadline = time.monotonic() + 30
    while not node0._store.check([f"lockstep/{run_id}/nnodes"]) and time.monotonic() < deadline:
        time.sleep(0.01)  # node 1 recorded --nnodes 3 first
    out["node0"] = outcome(node0)
    rendezvous._handlers.clear()  # node 0's process ends: nothing holds its store any more
    node0._inner = node0._store = None
    del node0
    gc.collect()
    thread.join(30)
    for name in ("node0", "node1"):
        assert out[name].startswith("NodesDisagree: the nodes disagree on --nnodes:"), out
        assert "--nnodes 3" in out[name] and "--nnodes 2" in out[name], out


def test_a_node_lost_between_torchs_round_and_the_node_exchange_is_a_named_error_not_the_stores():
    """Node 1 completed torch's round and died before it wrote who it is: node 0's exchange waited the store's
    timeout and ended in a raw DistStoreError traceback (seen by hand, 2026-11-29). Now a RendezvousConnectionError
    that names the missing rendezvous rank, which the launcher prints in one line. A real store, two-node round."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from lockstep.launch.rendezvous import LockstepRendezvous
    from lockstep.launch.store_takeover import Takeover

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=1), wait_for_workers=False)
    handler = object.__new__(LockstepRendezvous)
    handler.node_rank, handler.nnodes_spec, handler.local_addr, handler._takeover = 0, "2", "127.0.0.1", Takeover()
    handler.min_nodes = handler.max_nodes = 2
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"^node 0: the round's node\(s\) of rendezvous rank \[1\] "
                                                        r"never said who they are \(lost during the rendezvous\?\)"):
        handler._exchange(store, 0, 2)
    assert time.monotonic() - started < 10
