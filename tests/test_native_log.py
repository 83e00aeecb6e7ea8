"""torch's C++ warnings (c10d's store dumps, its hostname warning) stay off the launcher's console: a worker's stay
in its log file, the launcher process's own go to launcher-HOST-PID.log in the log folder (launch/native_log.py).

The launches use launch_scripts/cpp_warning.py, whose ranks drop a TCPStore under a client, so that c10d writes a
``[W... TCPStore.cpp:...]`` record and its C++ stack to fd 2 (measured: every run). In a network namespace the
launcher's own store connection also makes c10d print ``The hostname of the client socket cannot be retrieved``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import netns
import pytest

from lockstep.launch.native_log import NativeRecords, native_records_to

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launch_scripts", "cpp_warning.py")
RECORD = ("[W1129 02:51:38.038073908 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=28, addr=[::]:49663, "
          "remote=[::]:26562): Broken pipe")
STACK = ["Exception raised from sendBytes at /w/torch/csrc/distributed/c10d/Utils.hpp:758 (most recent call first):",
         "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fc100979b8d in libc10.so)",
         "<omitting python frames>",
         "frame #18: <unknown function> + 0x1098ec (0x7fc102d278ec in /lib/x86_64-linux-gnu/libc.so.6)",
         ""]
HOSTNAME = ("[W1129 02:50:10.112632881 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. "
            "err=-3")
# What reaching the console would show: c10's record line, its stack, the hostname warning
NATIVE_MARKS = ("TCPStore.cpp", "Exception raised from", "frame #", "The hostname of the client socket")


def test_a_record_is_its_warning_line_its_stack_and_the_blank_line_that_ends_it():
    records = NativeRecords()
    error = "[E1129 02:51:38.1 ProcessGroupGloo.cpp:1] an error"
    lines = ["before", RECORD, *STACK, "after", HOSTNAME, "next", "", error]
    taken = [line for line in lines if records.take("fd2", line)]
    assert taken == [RECORD, *STACK, HOSTNAME]  # a blank line ends a stack only; an error record is news
    # a rank's: c10 puts its own "[rankN]:" before the record once the group exists; sources keep their own state
    assert records.take("3", f"[rank3]:{RECORD}") and records.take("2", "[rank2]: " + HOSTNAME)
    assert records.take("3", STACK[0]) and not records.take("1", STACK[0])  # rank 1 printed no record
    # torch's Python logging has its own format (no bracket): not a C++ record
    assert not records.take("fd2", "W1129 02:51:38.726000 6085 site-packages/torch/x.py:1346] The node ...")


def test_fd2_records_go_to_the_file_and_every_other_byte_on_in_order(tmp_path, capfd):
    path = str(tmp_path / "launcher.log")
    with native_records_to(path):
        sys.stderr.write("a python line\n")
        sys.stderr.flush()
        os.write(2, RECORD[:30].encode())  # C++'s std::cerr writes a record in pieces
        os.write(2, (RECORD[30:] + "\n").encode())
        os.write(2, "\n".join(STACK).encode() + b"\n")
        os.write(2, b"a line of C's own\n")
        os.write(2, b"a prompt with no newline ")
        time.sleep(0.3)  # idle longer than the pump waits for a line's end
        os.write(2, (HOSTNAME + "\n").encode())  # a whole line again: a record
    os.write(2, (HOSTNAME + "\n").encode())  # after the block: fd 2 is the console again
    err = capfd.readouterr().err
    assert err == f"a python line\na line of C's own\na prompt with no newline {HOSTNAME}\n"
    assert open(path).read() == "\n".join([RECORD, *STACK, HOSTNAME]) + "\n"


def _launch(argv: list[str], log_dir: str, node=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    command = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", "--log-dir", log_dir, *argv, SCRIPT]
    return subprocess.run(node.command(command) if node else command, capture_output=True, text=True, timeout=120,
                          env=env, cwd=HERE)


def _files(log_dir: str, pattern: str) -> str:
    return "".join(open(p).read() for p in sorted(glob.glob(os.path.join(log_dir, "**", pattern), recursive=True)))


def _check_console(proc: subprocess.CompletedProcess) -> None:
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console
    for rank in (0, 1):  # the ranks' own lines around the record still reach the console
        assert f"[rank{rank}]: rank {rank} before the store goes away" in console, console
        assert f"[rank{rank}]: rank {rank} after the store went away: DistNetworkError" in console, console
    shown = [mark for mark in NATIVE_MARKS if mark in console]
    assert not shown, f"C++ records on the console ({shown}):\n{console}"


def test_a_workers_c10d_warning_is_in_its_log_file_not_on_the_console(tmp_path):
    proc = _launch([], str(tmp_path))
    _check_console(proc)
    ranks = _files(str(tmp_path), "stderr.log")
    assert ranks.count("TCPStore.cpp") >= 2 and ranks.count("Exception raised from") >= 2, ranks


@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))
def test_in_a_namespace_the_launchers_own_c10d_warning_goes_to_its_file_in_the_log_folder(tmp_path):
    # One node in a namespace, with the address of a multi-node run: the launcher's store connection there makes
    # c10d print the hostname warning from the launcher's own process (fd 2, not through Python).
    with netns.two_nodes() as (node, _):
        proc = _launch(["--nnodes", "1", "--master-addr", netns.ADDRS[0], "--master-port", "29555"], str(tmp_path),
                       node)
    _check_console(proc)
    launcher = _files(str(tmp_path), "launcher-*.log")
    assert "The hostname of the client socket cannot be retrieved" in launcher, (launcher, os.listdir(tmp_path))
    assert _files(str(tmp_path), "stderr.log").count("TCPStore.cpp") >= 2
