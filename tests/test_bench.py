"""``lockstep bench allreduce`` end to end on a tiny size range, plus its parsing
and summary arithmetic on hand-made rows."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
from levels import full_only
import torch

from lockstep.perf.bench import cli_main, parse_size, sizes_between, summarise
from lockstep.costmodel import Link, allreduce_time_s

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmarks_importable():
    """benchmarks/ on sys.path while a benchmark's main() runs here (its spawned ranks import it by that path):
    in this process, which imported torch already, instead of a fresh ``python benchmarks/X.py`` (~1.2 CPU-s)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli_main(["allreduce", "--min-size", "4KiB", "--max-size", "64KiB", "--factor", "4", "--iters", "3",
                       "--budget-s", "1", "--out", str(out)])
    return rc, out, printed.getvalue()


def test_bench_writes_json_markdown_and_png(bench_run, capsys):
    rc, out, _ = bench_run
    assert rc == 0
    (json_path,) = out.glob("allreduce_*_n2.json")
    data = json.loads(json_path.read_text())
    rows = data["rows"]
    assert {(r["algorithm"], r["nbytes"]) for r in rows} == {
        (a, n) for a in ("native", "ring", "tree") for n in (4096, 16384, 65536)
    }
    for r in rows:
        assert r["iters"] >= 3 and 0 < r["min_s"] <= r["median_s"]
        # 2 ranks: bus bandwidth = size * 2(N-1)/N / time = algorithm bandwidth.
        assert r["busbw_gb_s"] == pytest.approx(r["nbytes"] / r["median_s"] / 1e9)
        assert r["algbw_gb_s"] == pytest.approx(r["busbw_gb_s"])
    assert set(data["summary"]["fits"]) == {"median", "min"}
    assert set(data["summary"]["fits"]["median"]) == {"native", "ring", "tree"}
    assert data["meta"]["world_size"] == 2 and len(data["meta"]["load_average_1_5_15"]) == 3
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = json_path.with_suffix(".md").read_text()
    assert "| 64 KiB | ring |" in md and "alpha-beta fit" in md


def test_parse_and_sizes():
    assert parse_size("4KiB") == 4096 and parse_size("256MiB") == 256 << 20 and parse_size("1048576") == 1 << 20
    assert parse_size("1.5k") == 1536
    with pytest.raises(Exception, match="size"):
        parse_size("lots")
    assert sizes_between(4 << 10, 256 << 20, 4) == [4 << (10 + 2 * k) for k in range(9)]


def test_bad_arguments_exit_2(capsys):
    for argv in (["allreduce", "--algorithms", "ring,carrier"], ["allreduce", "--nproc", "1"], ["frobnicate"]):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2
    assert "carrier" in capsys.readouterr().err


def test_summary_fits_the_model_and_ratios_only_at_4mib_and_up():
    link = Link("truth", alpha_s=100e-6, bandwidth_gb_s=1.0)
    rows = []
    for n in (1 << 16, 1 << 20, 4 << 20, 16 << 20):
        for algo, slowdown in (("native", 1.0), ("ring", 1.25)):
            t = allreduce_time_s(n, 2, link, "ring") * slowdown
            rows.append({"algorithm": algo, "nbytes": n, "median_s": t, "min_s": t / 2, "busbw_gb_s": n / t / 1e9})
    s = summarise(rows, 2)
    native = s["fits"]["median"]["native"]
    assert native["alpha_us"] == pytest.approx(100.0) and native["bandwidth_gb_s"] == pytest.approx(1.0)
    fastest = s["fits"]["min"]["native"]
    assert fastest["alpha_us"] == pytest.approx(50.0) and fastest["bandwidth_gb_s"] == pytest.approx(2.0)
    assert sorted(s["ring_over_native_busbw"]) == [4 << 20, 16 << 20]
    assert s["ring_over_native_median"] == pytest.approx(0.8)


def test_ddp_step_benchmark_runs_and_reports_every_contender(tmp_path, capsys):
    """``benchmarks/ddp_step.py`` end to end at its smallest (its main() here, its ranks spawned as it spawns them):
    every asked contender timed, the paired ratios and the floor written, as markdown and json."""
    with benchmarks_importable():
        import ddp_step

        rc = ddp_step.main(
            ["--models", "cnn", "--contenders", "compute,floor,torch,lockstep_25,lockstep_zero2,lockstep_zero2_pair",
             "--blocks", "1", "--block-steps", "2", "--warmup", "1", "--allreduce-reps", "1", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    (json_path,) = tmp_path.glob("ddp_step_*_n2_t1.json")
    result = json.loads(json_path.read_text())["results"]["cnn"]
    assert set(result["median_ms"]) == {"compute", "floor", "torch", "lockstep_25", "lockstep_zero2",
                                        "lockstep_zero2_pair"}
    assert all(v > 0 for v in result["median_ms"].values())
    assert {"lockstep_25/torch", "floor/torch", "lockstep_25/floor", "torch/compute",
            "lockstep_zero2/lockstep_25"} <= set(result["ratios"])
    md = json_path.with_suffix(".md").read_text()
    assert "| cnn |" in md and "floor/torch" in md


@full_only("~80 s: the GPU benchmark's code on a tiny CPU model (gpu_session.sh runs it where it counts)")
def test_gpu_step_benchmark_runs_on_cpu_tiny(tmp_path, capsys):
    """``benchmarks/gpu_step.py`` (the GPU sessions' benchmark, issue #13) at tiny shapes on CPU (its main() here,
    its rank spawned as it spawns it): every contender timed, the paired ratios written, and the full-size models
    are the shapes the issue names (GPT >= 100M parameters in >= 100 tensors, ResNet-50)."""
    with benchmarks_importable():
        import gpu_step

        rc = gpu_step.main(
            ["--device", "cpu", "--tiny", "--contenders",
             "compute,torch,torch_view,lockstep,lockstep_view,lockstep_alias", "--blocks", "1", "--block-steps", "2",
             "--warmup", "1", "--out", str(tmp_path)])
        assert rc == 0, capsys.readouterr().err
        with pytest.raises(SystemExit) as bad:
            gpu_step.main(["--models", "vgg", "--out", ""])
    assert bad.value.code == 2 and "unknown model 'vgg'" in capsys.readouterr().err
    (json_path,) = tmp_path.glob("gpu_step_*_cpu_n1_tiny.json")
    results = json.loads(json_path.read_text())["results"]
    assert set(results) == {"gpt", "resnet50"}
    for r in results.values():
        assert set(r["median_ms"]) == {"compute", "torch", "torch_view", "lockstep", "lockstep_view", "lockstep_alias"}
        assert {"lockstep/torch", "lockstep_view/torch_view", "torch/compute"} <= set(r["ratios"])
    assert "lockstep_view/torch_view" in json_path.with_suffix(".md").read_text()
    with torch.device("meta"):  # shapes only
        gpt, resnet = gpu_step.GPT(), gpu_step.resnet50()
    for model, (numel, tensors) in ((gpt, (124_475_904, 148)), (resnet, (25_557_032, 161))):
        params = list(model.parameters())
        assert (sum(p.numel() for p in params), len(params)) == (numel, tensors)


def test_bench_says_where_its_results_go_before_it_runs(bench_run, tmp_path, monkeypatch, capsys):
    rc, out, printed = bench_run
    first = printed.splitlines()[0]
    assert first == f"lockstep bench allreduce: results go to {out.resolve()} (--out DIR to change)"
    [wrote] = [line for line in printed.splitlines() if line.startswith("wrote ")]
    assert wrote.startswith(f"wrote {out.resolve()}/allreduce_")
    # The default is relative to the current directory: said as the absolute path it is.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli_main(["allreduce", "--help"])
    assert "default: lockstep-bench under the current directory" in " ".join(capsys.readouterr().out.split())


def test_the_default_out_is_untracked_in_a_checkout(tmp_path, monkeypatch, capsys):
    # issue 34, item 6: run from the repository, `lockstep bench` wrote into the tracked benchmarks/results/
    import argparse
    import subprocess
    from pathlib import Path

    from lockstep.perf.spawn import DEFAULT_OUT, results_dir

    repo = Path(__file__).resolve().parent.parent
    assert DEFAULT_OUT == "lockstep-bench"
    assert subprocess.run(["git", "ls-files", DEFAULT_OUT], cwd=repo, capture_output=True, text=True).stdout == ""
    assert subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT}/allreduce_x.json"], cwd=repo).returncode == 0
    monkeypatch.chdir(tmp_path)
    assert results_dir(argparse.ArgumentParser(prog="lockstep bench allreduce"), DEFAULT_OUT) == \
        tmp_path / "lockstep-bench"
    assert capsys.readouterr().out == (f"lockstep bench allreduce: results go to {tmp_path / 'lockstep-bench'} "
                                       f"(--out DIR to change)\n")


@pytest.mark.parametrize("argv, flag", [
    (["--factor", "1"], "--factor"), (["--iters", "0"], "--iters"), (["--budget-s", "-1"], "--budget-s"),
    (["--min-size", "8KiB", "--max-size", "4KiB"], "--max-size"), (["--nproc", "1"], "--nproc"),
    (["--algorithms", "ring,carrier"], "--algorithms"),
])
def test_bad_values_name_their_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli_main(["allreduce", *argv])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith(f"lockstep bench allreduce: error: argument {flag}: "), last


def test_an_unwritable_out_fails_before_the_benchmark_runs(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker / "results", blocker):
        with pytest.raises(SystemExit) as e:
            cli_main(["allreduce", "--max-size", "4KiB", "--out", str(out)])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and last.startswith("lockstep bench allreduce: error: argument --out: "), last
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SystemExit):
            cli_main(["allreduce", "--max-size", "4KiB", "--out", str(locked)])



def test_under_a_launcher_the_launchers_ranks_measure_and_plan_reads_the_result(tmp_path):
    # issue #35 item 6: the plan "given the measured link": `lockstep bench allreduce` run by the launcher's ranks
    # (across nodes, over the link the job will use), its result file given to `lockstep plan --link-from`
    import glob
    import subprocess
    import sys

    out = tmp_path / "link"
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", "-m", "lockstep", "bench",
           "allreduce", "--min-size", "256KiB", "--max-size", "16MiB", "--iters", "3", "--budget-s", "0.2",
           "--algorithms", "native", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("| 16 MiB | native |") == 1, proc.stdout  # rank 0 reports, once
    assert "2 gloo ranks started by a launcher (1 node(s))" in proc.stdout, proc.stdout
    [result] = glob.glob(str(out / "allreduce_*_n2.json"))
    assert json.load(open(result))["meta"]["where"].startswith("gloo ranks started by a launcher")
    plan = subprocess.run([sys.executable, "-m", "lockstep", "plan", "--params", "1e7", "--world-size", "2",
                           "--compute-ms", "50", "--link-from", result], capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert f"link measured ({os.path.basename(result)})" in plan.stdout, plan.stdout
    twice = subprocess.run(cmd[:-2] + ["--nproc", "2", "--out", ""], capture_output=True, text=True, timeout=180,
                           stdin=subprocess.DEVNULL)
    assert twice.returncode != 0
    assert "argument --nproc: under a launcher its 2 ranks run the benchmark (WORLD_SIZE); leave --nproc out" \
        in twice.stdout + twice.stderr


@pytest.mark.parametrize("argv, message", [
    (["--link-from", "README.md"], "argument --link-from: README.md: not a `lockstep bench allreduce` result"),
    (["--link-from", "no/such.json"], "argument --link-from: no/such.json: No such file or directory"),
    (["--link", "10gbe", "--link-from", "x.json"], "argument --link-from: give --link or --link-from, not both"),
])
@pytest.mark.parametrize("command", ["plan", "scaling"])
def test_link_from_a_bad_file_is_one_line_naming_the_flag(command, argv, message, capsys, monkeypatch):
    from lockstep.perf.plan import cli_main as plan_main
    from lockstep.perf.scaling import cli_main as scaling_main

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main, extra = (plan_main, ["--params", "1e6"]) if command == "plan" else (scaling_main, ["--out", ""])
    with pytest.raises(SystemExit) as exit_info:
        main(extra + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
