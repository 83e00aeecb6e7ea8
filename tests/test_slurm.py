"""SLURM variables -> node layout, and the sbatch script: pure functions, no processes."""

from __future__ import annotations

import os
import re

import pytest

from lockstep.launch.launcher import parse_launch_args, slurm_script_main
from lockstep.slurm import expand_nodelist, port_from_job_id, sbatch_script, slurm_launch_env

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "allreduce.py")


def test_expand_nodelist_brackets_ranges_padding_and_plain_hosts():
    assert expand_nodelist("node[01-03,07],login") == ["node01", "node02", "node03", "node07", "login"]
    assert expand_nodelist("gpu[8-10]") == ["gpu8", "gpu9", "gpu10"]
    assert expand_nodelist("a[1-2]-ib[3,5]") == ["a1-ib3", "a1-ib5", "a2-ib3", "a2-ib5"]
    assert expand_nodelist("single") == ["single"]
    for bad in ("node[3-1]", "node[01-03", "node]", "node[x]", ""):
        with pytest.raises(ValueError, match="node list"):
            expand_nodelist(bad)


def test_slurm_launch_env_derives_layout_from_bracketed_list():
    env = {"SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}
    s = slurm_launch_env(env)
    assert s.hosts == ("gpu07", "gpu08", "gpu09", "gpu12")
    assert (s.nnodes, s.node_rank, s.master_addr) == (4, 2, "gpu07")
    assert s.master_port == port_from_job_id("123456") == 20000 + 123456 % 20000
    # every node computes the same master and port from the same job variables
    other = slurm_launch_env({**env, "SLURM_NODEID": "0"})
    assert (other.master_addr, other.master_port) == (s.master_addr, s.master_port)


def test_slurm_launch_env_fallbacks_and_overrides():
    base = {"SLURM_JOB_ID": "77", "SLURM_NODELIST": "n[1-3]"}  # older variable name, no node count
    s = slurm_launch_env(base)
    assert (s.nnodes, s.node_rank, s.master_addr) == (3, 0, "n1")
    s = slurm_launch_env({**base, "SLURM_JOB_NUM_NODES": "2", "MASTER_PORT": "31000", "MASTER_ADDR": "n3-ib"})
    assert (s.nnodes, s.master_port, s.master_addr) == (2, 31000, "n3-ib")
    assert slurm_launch_env({"SLURM_JOB_ID": "1"}) is None  # no node list: not an allocation
    assert slurm_launch_env({"SLURM_JOB_NODELIST": "n1"}) is None
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        slurm_launch_env({**base, "SLURM_NODEID": "3"})
    with pytest.raises(ValueError, match="SLURM_NNODES"):
        slurm_launch_env({**base, "SLURM_NNODES": "5"})
    with pytest.raises(ValueError, match="SLURM_NNODES"):
        slurm_launch_env({**base, "SLURM_NNODES": "two"})


def test_parse_launch_args_takes_layout_from_slurm_and_flags_win():
    env = {"SLURM_JOB_ID": "900", "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    opts, script, args = parse_launch_args(["--nproc-per-node", "4", SCRIPT, "--lr", "0.1"], env=env)
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port) == (2, 1, "node001", 20900)
    assert (opts.source, opts.world_size, opts.run_id) == ("slurm", 8, "lockstep-slurm-900")
    assert (script, args) == (SCRIPT, ["--lr", "0.1"])
    opts, _, _ = parse_launch_args(["--nproc-per-node", "1", "--master-port", "29999", SCRIPT], env=env)
    assert opts.master_port == 29999
    # a one-node allocation runs like a plain single node: loopback and an OS-chosen port
    one = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node7", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    opts, _, _ = parse_launch_args(["--nproc-per-node", "2", SCRIPT], env=one)
    assert (opts.nnodes, opts.master_addr, opts.master_port, opts.source) == (1, "127.0.0.1", 0, "single")


def test_parse_launch_args_rejects_bad_input_naming_the_flag():
    cases = [
        (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", SCRIPT], "--node-rank"),
        (["--nnodes", "2", SCRIPT], "--master-addr"),
        (["--max-restarts", "-1", SCRIPT], "--max-restarts"),
        (["--nproc-per-node", "2", "--log-rank", "2", SCRIPT], "--log-rank"),
        (["--master-port", "70000", SCRIPT], "--master-port"),
        (["--rdzv-timeout", "0", SCRIPT], "--rdzv-timeout"),
        (["--nproc-per-node", "2", "no_such_script.py"], "no_such_script.py"),
    ]
    for argv, needle in cases:
        with pytest.raises(ValueError, match=needle):
            parse_launch_args(argv, env={})
    with pytest.raises(SystemExit):
        parse_launch_args(["--nproc-per-node", "many", SCRIPT], env={})


def test_sbatch_script_runs_one_launch_agent_per_node(capsys):
    text = sbatch_script(["train.py", "--epochs", "3", "--name", "a b"], nodes=4, gpus_per_node=8, time="02:00:00",
                         job_name="big", max_restarts=2)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for expected in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --time=02:00:00", "#SBATCH --job-name=big"):
        assert expected in lines
    srun = [line for line in lines if line.startswith("srun ")]
    assert srun == ["srun --ntasks-per-node=1 lockstep launch --nproc-per-node 8 --max-restarts 2 "
                    "train.py --epochs 3 --name 'a b' && rc=0 || rc=$?"]
    # preemption: SIGTERM 120 s ahead, and the job requeued when the workers exit 75 after their checkpoint
    assert "#SBATCH --signal=TERM@120" in lines and "#SBATCH --requeue" in lines
    assert 'if [ "$rc" -eq 75 ]; then' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert lines[-1] == 'exit "$rc"'
    from lockstep.train.preempt import REQUEUE_EXIT_CODE
    assert REQUEUE_EXIT_CODE == 75
    cpu = sbatch_script(["t.py"], nodes=2)
    assert not any("gpus-per-node" in line for line in cpu.splitlines())
    assert "srun --ntasks-per-node=1 lockstep launch --nproc-per-node auto t.py && rc=0 || rc=$?" in cpu.splitlines()
    with pytest.raises(ValueError, match="--nodes"):
        sbatch_script(["t.py"], nodes=0)
    # the CLI prints the same script
    assert slurm_script_main(["--nodes", "4", "--gpus-per-node", "8", "--time", "02:00:00", "--job-name", "big",
                              "--max-restarts", "2", "train.py", "--epochs", "3", "--name", "a b"]) == 0
    assert capsys.readouterr().out == text
    assert slurm_script_main(["--nodes", "0", "t.py"]) == 2
    assert "--nodes must be >= 1" in capsys.readouterr().err


def test_two_slurm_nodes_rendezvous_and_restart_together(tmp_path):
    """Two agents on this machine posing as two SLURM nodes: layout from SLURM variables alone.

    Rank 1 fails once; both agents must restart the group together and finish. torch counts
    restarts per agent, so the other node may re-form the group without spending a restart.
    """
    import subprocess
    import sys

    from lockstep.process_group import free_port

    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    base.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost,localhost", SLURM_NNODES="2", MASTER_PORT=str(port))
    flaky = os.path.join(os.path.dirname(__file__), "launch_scripts", "flaky.py")
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "1", "--max-restarts", "1",
           flaky, str(tmp_path / "failures"), "1"]
    agents = [subprocess.Popen(cmd, env={**base, "SLURM_NODEID": str(node)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        outputs = [a.communicate(timeout=90) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for node, (agent, (out, err)) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, err[-3000:]
        assert f"lockstep launch: node {node} of 2 (slurm), 1 workers here; rendezvous at localhost:{port}" in err
        assert ("restarting the workers (restart 1 of 1)" in err
                or "re-forming the group because another node restarted" in err)
    assert sum("restarting the workers (restart 1 of 1)" in err for _, err in outputs) >= 1
    stdout = outputs[0][0] + outputs[1][0]
    # world size 2 across the two agents: each global rank ran on exactly one of them, twice (attempts 0 and 1)
    for rank in (0, 1):
        assert sum(f"[rank{rank}]: attempt restart=" in out for out, _ in outputs) == 1
        # two attempts per rank, each a working 2-rank group
        assert len(re.findall(rf"\[rank{rank}\]: attempt restart=\d rank={rank} sum=3\n", stdout)) == 2
        assert re.search(rf"\[rank{rank}\]: completed rank={rank} after restart=\d", stdout)
    assert (tmp_path / "failures").read_text() == "1"


def test_agent_config_nodes_share_a_rendezvous_and_only_node_0_hosts_it(tmp_path):
    from lockstep.launch.agent import LaunchOptions, _launch_config
    from lockstep.launch.output import RankLogsSpecs

    configs = [
        _launch_config(LaunchOptions(nproc_per_node=4, nnodes=2, node_rank=r, master_addr="node001", master_port=29500),
                       RankLogsSpecs(str(tmp_path)))
        for r in (0, 1)
    ]
    assert configs[0].run_id == configs[1].run_id  # without a shared id the two agents would never meet
    assert [c.rdzv_configs["is_host"] for c in configs] == [True, False]
    assert {c.rdzv_endpoint for c in configs} == {"node001:29500"}
    assert all((c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 2, 4) for c in configs)
    single = [_launch_config(LaunchOptions(nproc_per_node=2), RankLogsSpecs(str(tmp_path))) for _ in range(2)]
    assert single[0].run_id != single[1].run_id  # two single-node jobs on one host must not collide
    assert single[0].rdzv_endpoint == "127.0.0.1:0" and single[0].local_addr == "127.0.0.1"
