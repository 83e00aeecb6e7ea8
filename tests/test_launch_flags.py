"""``lockstep launch`` takes torchrun's command line: every torchrun option, with torchrun's meaning.

In process and without workers (cheap): the two argparse parsers are compared, so an option that a new
torch adds to ``torch.distributed.run`` fails ``test_every_torchrun_option_is_handled`` until
``launch/flags.py`` handles it or lists why not. What the flags do to a running job is checked end to
end in test_launch_reports.py; the one launch here (~15 s) is two agents meeting on loopback with torchrun's
``is_host``, which the parser alone cannot show.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from lockstep.launch import flags
from lockstep.launch.launcher import _parse, cli_main, parse_launch_args

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_scripts", "allreduce.py")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_every_torchrun_option_is_handled():
    ours, theirs = _options(flags.build_parser()), _options(get_args_parser())
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun options lockstep launch does not accept: {missing} (handle them in launch/flags.py)"
    for name, action in theirs.items():
        # Same form: a flag that takes a value in torchrun takes one here, and a switch stays a switch,
        # so a torchrun command line splits into the same options and the same script arguments.
        assert (action.nargs == 0) == (ours[name].nargs == 0), name
    # The two torchrun options refused have a reason, given as a one-line error (not "unrecognized arguments").
    for flag, argv in (("--run-path", ["--run-path"]), ("--logs-specs", ["--logs-specs", "x"])):
        with pytest.raises(ValueError, match=f"{flag} is not supported: .+"):
            parse_launch_args([*argv, SCRIPT], env={})
    # Positionals: the script, then everything after it goes to the script.
    opts, script, args = parse_launch_args(["--nproc-per-node", "1", SCRIPT, "--nproc-per-node", "7"], env={})
    assert (opts.nproc_per_node, script, args) == (1, SCRIPT, ["--nproc-per-node", "7"])


def test_torchrun_rendezvous_flags_mean_what_they_mean_in_torchrun():
    # --standalone: one node on loopback, a free port and a fresh id; explicit --rdzv-* are ignored, as torchrun does
    opts, _, _ = parse_launch_args(["--standalone", "--rdzv-endpoint", "10.0.0.9:1234", "--rdzv-id", "x",
                                    "--nproc-per-node", "2", SCRIPT], env={})
    assert (opts.nnodes, opts.master_addr, opts.master_port, opts.run_id) == (1, "127.0.0.1", 0, "")
    with pytest.raises(ValueError, match="--standalone runs one node"):
        parse_launch_args(["--standalone", "--nnodes", "2", SCRIPT], env={})
    # --rdzv-endpoint HOST:PORT is node 0's address; --rdzv-id is the shared run id; join_timeout is --rdzv-timeout
    opts, _, _ = parse_launch_args(["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                    "node0:29400", "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=12,read_timeout=30",
                                    SCRIPT], env={})
    assert (opts.master_addr, opts.master_port, opts.run_id, opts.rdzv_timeout_s) == ("node0", 29400, "job7", 12)
    assert opts.rdzv_conf == (("read_timeout", "30"),)
    # torch's is_host (this node serves the c10d store): lockstep's node 0 does; passed through when it agrees
    for value, node_rank, said in (("true", None, "true"), ("Yes", "0", "true"), ("0", "1", "false")):
        extra = [] if node_rank is None else ["--node-rank", node_rank]
        opts, _, _ = parse_launch_args(["--nnodes", "2", "--master-addr", "h", "--rdzv-conf", f"is_host={value}",
                                        *extra, SCRIPT], env={})
        assert opts.rdzv_conf == (("is_host", said),) and opts.node_rank == int(node_rank or 0)
    bad = [
        (["--nnodes", "2", "--master-addr", "h", "--node-rank", "1", "--rdzv-conf", "is_host=true"],
         "--rdzv-conf is_host=true, but this node is --node-rank 1: lockstep launch serves the rendezvous store on"),
        (["--nnodes", "2", "--master-addr", "h", "--rdzv-conf", "is_host=false"],
         "--rdzv-conf is_host=false, but this node is --node-rank 0, .+ give this node its --node-rank"),
        (["--rdzv-conf", "is_host=maybe"], "--rdzv-conf is_host takes true or false"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not supported"),
        (["--rdzv-conf", "colour=red"], "--rdzv-conf: unknown key 'colour'"),
        (["--rdzv-endpoint", "node0"], "--rdzv-endpoint must be HOST:PORT"),
        (["--local-ranks-filter", "5", "--nproc-per-node", "2"], "--local-ranks-filter: local ranks \\[5\\]"),
        (["--redirects", "9"], "--redirects must be 0-3"),
        (["-m", "--no-python"], "-m/--module and --no-python"),
        (["--nproc-per-node", "gpu"], "--nproc-per-node gpu: CUDA is not available"),
    ]
    for argv, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_launch_args([*argv, SCRIPT], env={})
    # --nnodes N:N is a fixed size and MIN:MAX an elastic one (torchrun's forms, launch/elastic.py)
    opts, _, _ = parse_launch_args(["--nnodes", "2:2", "--master-addr", "h", SCRIPT], env={})
    assert (opts.nnodes, opts.min_nodes) == (2, None)
    opts, _, _ = parse_launch_args(["--nnodes", "1:2", "--master-addr", "h", SCRIPT], env={})
    assert (opts.nnodes, opts.min_nodes) == (2, 1)


def test_torchrun_worker_and_output_flags_reach_the_options():
    opts, ns = _parse(["--nproc-per-node", "cpu", "--monitor-interval", "0.5", "--start-method", "fork", "--role", "trainer",
                       "--local-addr", "10.1.1.1", "-r", "3", "-t", "0:2", "--local-ranks-filter", "0",
                       "--signals-to-handle", "SIGTERM,SIGUSR1", "--duplicate-stdout-filters", "loss,,acc,step",
                       "--virtual-local-rank", "-m", "json.tool", "--sort-keys"], env={})
    assert opts.nproc_per_node == (os.cpu_count() or 1)
    assert (opts.monitor_interval_s, opts.start_method, opts.role, opts.local_addr) == (0.5, "fork", "trainer", "10.1.1.1")
    assert (opts.redirects, opts.tee, opts.local_ranks_filter) == ("3", "0:2", frozenset({0}))
    assert opts.signals_to_handle == "SIGTERM,SIGUSR1" and opts.virtual_local_rank
    assert opts.duplicate_stdout_filters == ("loss,acc", "step")  # a double comma is a literal comma, as torchrun
    # -m runs a module the way torchrun does (python -u -m MODULE ARGS); --no-python runs the executable itself
    import sys

    assert flags.worker_command(ns, sys.executable) == (sys.executable, ["-u", "-m", "json.tool", "--sort-keys"])
    _, ns = _parse(["--no-python", "/bin/echo", "hi"], env={})
    assert flags.worker_command(ns, sys.executable) == ("/bin/echo", ["hi"])


def test_bad_log_dir_is_one_line_exit_2_before_any_worker(capsys, tmp_path):
    for bad in ("/proc/nope", str(tmp_path / "file")):
        (tmp_path / "file").write_text("")
        assert cli_main(["--log-dir", bad, "--nproc-per-node", "2", SCRIPT]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"lockstep launch: error: --log-dir {bad!r} cannot be created"), err


def test_master_addr_given_as_loopback_is_taken_for_several_nodes(capsys):
    # torchrun takes --master-addr/--master-port as the rendezvous endpoint when --rdzv-endpoint is absent, 127.0.0.1
    # included (several agents on one host); it was refused as "--master-addr is required" although it was given.
    for nnodes, low in (("1:2", 1), ("2", None)):
        opts, _, _ = parse_launch_args(["--nnodes", nnodes, "--master-addr", "127.0.0.1", "--master-port", "29500",
                                        SCRIPT], env={})
        assert (opts.master_addr, opts.master_port, opts.nnodes, opts.min_nodes) == ("127.0.0.1", 29500, 2, low)
    opts, _, _ = parse_launch_args(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", SCRIPT], env={})
    assert (opts.master_addr, opts.master_port) == ("127.0.0.1", 29400)
    # not given at all: still one line naming the flag
    assert cli_main(["--nnodes", "1:2", SCRIPT]) == 2
    assert capsys.readouterr().err == ("lockstep launch: error: --master-addr (or --rdzv-endpoint) is required with "
                                       "--nnodes > 1: the address of node 0\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_host_meet_with_torchruns_is_host(tmp_path):
    # Two agents on one machine (one host name, as containers that share it): torchrun's users say which one
    # hosts the c10d store with is_host; lockstep launch used to refuse the key, and 127.0.0.1 as --master-addr.
    # Real launches (~15 s): node 0 gives no --node-rank (is_host=true means node 0), node 1 gives its own.
    # A fixed --nnodes 2: with 1:2 a node 1 slow to start on a loaded machine would miss the first round.
    common = [sys.executable, "-m", "lockstep", "launch", "--nnodes", "2", "--nproc-per-node", "1",
              "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    nodes = [common + ["--rdzv-conf", "is_host=true", SCRIPT],
             common + ["--node-rank", "1", "--rdzv-conf", "is_host=false", SCRIPT]]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in nodes]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    assert "allreduce rank=0 world=2 local_rank=0 master=127.0.0.1 sum=3" in outs[0][0], outs[0]
    assert "allreduce rank=1 world=2 local_rank=0 master=127.0.0.1 sum=3" in outs[1][0], outs[1]


def test_a_bare_launch_names_only_the_script_as_missing(capsys):
    # script_args is argparse.REMAINDER: nothing after the script is fine, so only SCRIPT may be called required
    # (it said "required: script, script_args"); the `lockstep` command's one-line form, as a user sees it
    from lockstep.cli import main

    assert main(["launch"]) == 2
    assert capsys.readouterr().err == ("lockstep launch: error: the following arguments are required: script\n"
                                       "  see lockstep launch --help\n")
    assert flags.build_parser().parse_args([SCRIPT]).script_args == []
