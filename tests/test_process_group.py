"""lockstep.init(): the launcher's environment read right, bad environments named, real groups started."""

import os
import random
import socket

import pytest
import torch

from dist_utils import run_ranks
from lockstep.process_group import detect_launch_env


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29501"}
    launch = detect_launch_env(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 3, 8, 1)
    assert (launch.master_addr, launch.master_port) == ("node01", 29501)


def test_slurm_env_bracketed_nodelist_and_derived_port():
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu-node[07-09,12]", "SLURM_JOB_ID": "123456",
    }
    launch = detect_launch_env(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 5, 8, 1)
    assert launch.master_addr == "gpu-node07"
    assert launch.master_port == 20000 + 123456 % 20000
    assert detect_launch_env({**env, "MASTER_PORT": "4242"}).master_port == 4242


def test_openmpi_env():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    launch = detect_launch_env(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("openmpi", 2, 4, 0)


def test_no_launcher_is_single_process():
    launch = detect_launch_env({})
    assert (launch.launcher, launch.rank, launch.world_size) == ("single", 0, 1)


@pytest.mark.parametrize(
    "env,pattern",
    [
        ({"RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"WORLD_SIZE is missing; it is set by torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"MASTER_ADDR is missing"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"rank 2 is outside \[0, world size 2\)"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"local rank 1 contradicts rank 0"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1"}, r"SLURM_LOCALID is missing; it is set by srun"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"}, r"SLURM_JOB_NODELIST is missing"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, r"MASTER_ADDR is missing; OpenMPI does not set it"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "a", "MASTER_PORT": "70000"}, r"master port 70000"),
    ],
)
def test_bad_env_names_the_variable(env, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        detect_launch_env(env)


def _port_in(lo, hi):
    for _ in range(200):
        port = random.randint(lo, hi - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _init_from_each_launcher(rank, world_size, slurm_port, mpi_port):
    import torch.distributed as dist

    import lockstep

    def check(expected_launcher_env):
        env = lockstep.init(timeout_s=60)
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        info = (env.rank, env.world_size, env.local_rank, env.backend, str(env.device), t.item(), lockstep.is_main())
        lockstep.shutdown()
        return info

    results = {"torchrun": check("torchrun")}
    import io
    import logging

    lockstep.init(timeout_s=60)
    stream = io.StringIO()
    logging.getLogger("lockstep").handlers[0].setStream(stream)
    log = lockstep.get_logger("trainer")
    log.info("step 1")
    log.warning("slow rank")
    results["log"] = stream.getvalue()
    lockstep.shutdown()
    saved = {k: os.environ.pop(k) for k in _TORCHRUN_VARS}
    os.environ.update(
        SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank),
        SLURM_JOB_NODELIST="127.0.0.[1-4]", SLURM_JOB_ID=str(slurm_port - 20000),
    )
    results["slurm"] = check("slurm")
    for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"):
        del os.environ[k]
    os.environ.update(
        OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world_size), OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mpi_port),
    )
    results["openmpi"] = check("openmpi")
    os.environ.update(saved)
    return results


def test_real_groups_from_each_launcher():
    slurm_port = _port_in(20000, 40000)
    mpi_port = _port_in(40000, 50000)
    results = run_ranks(_init_from_each_launcher, 2, args=(slurm_port, mpi_port), init=False, timeout_s=120)
    assert results[0]["log"] == "[rank0] INFO lockstep.trainer: step 1\n[rank0] WARNING lockstep.trainer: slow rank\n"
    assert results[1]["log"] == "[rank1] WARNING lockstep.trainer: slow rank\n"  # INFO is rank 0's alone
    for rank, per_launcher in enumerate(results):
        for launcher in ("torchrun", "slurm", "openmpi"):
            r, ws, local_rank, backend, device, total, main = per_launcher[launcher]
            assert (r, ws, local_rank, backend, device, total, main) == (rank, 2, rank, "gloo", "cpu", 3.0, rank == 0)
