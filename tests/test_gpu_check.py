"""launchers/gpu-check on the CPU: its quick path end to end, its budget, its per-step limit, its report, and the
pieces that only a GPU exercises fully (the verdicts of the GPU-only checks, the comparison with the CPU run)."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import labkit
from ownjobs import own_jobs  # noqa: F401 - the fixture: every job a test starts is recorded and checked
from lablib.gpucheck import exercise_files, gpu_checks, runner, steps
from lablib.jobs import config as cfg
from lablib.jobs import launch

REPO = Path(__file__).resolve().parents[1]
# The quick path may take at most 2 minutes on the 2-core CI machine (stretched by the load now, as every start-up
# timeout of the suite is: labkit.scaled_timeout). Measured on 2 cores shared with other work: 89 s at a load of 11
# (with a third step since dropped), 163 s at a load of 24.
QUICK_LIMIT_S = 120


def test_quick_path_on_the_cpu_runs_and_reports(tmp_path):
    t0, factor = time.monotonic(), labkit.load_factor()
    # its own limits stretched by the load too: a step slowed by other work must not fail here as a hang would
    limits = ["--step-limit", str(labkit.scaled_timeout(120)), "--budget", str(labkit.scaled_timeout(480))]
    done = subprocess.run([str(REPO / "launchers" / "gpu-check"), "--out-dir", str(tmp_path), *limits],
                          env={**os.environ, "LABLIB_DEVICE": "cpu"}, capture_output=True, text=True,
                          timeout=labkit.scaled_timeout(QUICK_LIMIT_S) + 60)
    wall, factor = time.monotonic() - t0, max(factor, labkit.load_factor())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (report_path,) = tmp_path.glob("gpu-check-*.json")
    report = json.loads(report_path.read_text())
    markdown = report_path.with_suffix(".md").read_text()
    by_name = {o["name"]: o for o in report["steps"]}
    quick = [s.name for s in steps.lab_steps(False) if s.quick]
    gpu_only = [s.name for s in steps.GPU_ONLY]
    assert list(by_name) == gpu_only + quick, "GPU-only checks first, then the quick path's steps, nothing else"
    for name in gpu_only:        # never skipped silently: each says why it did not run
        assert by_name[name]["status"] == "not run" and "LABLIB_DEVICE=cpu" in by_name[name]["error"], by_name[name]
        assert f"| {name} |" in markdown and "not run: LABLIB_DEVICE=cpu forces the CPU" in markdown
    for name in quick:
        o = by_name[name]
        assert (o["status"], o["device"], o["backend"], o["error"]) == ("pass", "cpu", "gloo", ""), o
        assert 0 < o["seconds"] < report["total_s"]
        assert f"| {name} | {o['nproc']} | cpu | gloo | pass ({o['judged_by']}) |" in markdown
    assert by_name["01 grad_accum"]["judged_by"] == "lab checks"
    assert report["finished"] and "unfinished" not in markdown
    assert report["machine"]["gpus"] == 0 and report["quick"] and report["total_s"] <= report["budget_s"]
    assert report["sources"]["01_gradient_accumulation"]["files_from"].startswith("solutions/")
    assert not list(tmp_path.glob("*-work")), "the steps' working folder is removed"
    # The figures compared with the CPU on a GPU, taken from this real run: lab 04's byte counts and losses.
    zero = by_name["04 zero_memory x2"]["figures"]
    exact = [p for p in zero if ".memory_per_rank." in p]
    assert exact and any(p.endswith("losses.0") for p in zero)
    same = runner.compare_figures(zero, dict(zero), ("params", "grads", "optimizer"))
    assert same["agree"] and same["exact"] == len(exact) and same["max_rel_diff"] == 0.0
    off = {**zero, exact[0]: zero[exact[0]] + 4}
    worse = runner.compare_figures(off, zero, ("params", "grads", "optimizer"))
    assert not worse["agree"] and worse["unequal"] == [exact[0]]
    assert wall < QUICK_LIMIT_S * factor, (f"the quick path took {wall:.0f} s; CI allows {QUICK_LIMIT_S} s on an idle "
                                           f"machine, {QUICK_LIMIT_S * factor:.0f} s at this load")


HANG_S = 613.0     # longer than any limit here: only the step's limit can end it


def test_a_hanging_step_costs_its_limit_and_the_run_goes_on(tmp_path, monkeypatch, own_jobs):
    monkeypatch.setenv("LABLIB_DEVICE", "cpu")
    limit = 12.0
    hang = steps.Step("00 hang", steps.L00, "hello", {"hang_rank": 1, "hang_s": HANG_S}, 2, quick=True, limit_s=limit)
    hello = steps.Step("00 hello", steps.L00, "hello", {}, 2, quick=True)
    monkeypatch.setattr(runner, "lab_steps", lambda gpu: [hang, hello])
    monkeypatch.setattr(runner, "GPU_ONLY", [])
    # hello's start-up (three interpreters importing torch) gets the run's limit, stretched by the load
    report = runner.run_all(REPO, tmp_path, True, (), budget_s=labkit.scaled_timeout(200),
                            step_limit_s=labkit.scaled_timeout(60), echo=lambda *_: None)
    hung, after = report["steps"]
    assert hung["status"] == "fail" and f"limit of {limit:.0f} s" in hung["error"], hung
    assert limit <= hung["seconds"] < limit + labkit.scaled_timeout(15)   # stopped at its limit, not at the budget
    assert after["status"] == "pass", after["error"]
    assert not own_jobs.remaining(), "the hung step's ranks were stopped (the launcher's own record of its jobs)"


def test_a_spent_budget_reports_every_step_as_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LABLIB_DEVICE", "cpu")
    t0 = time.monotonic()
    report = runner.run_all(REPO, tmp_path, True, (), budget_s=runner.MIN_START_S - 1, step_limit_s=60,
                            echo=lambda *_: None)
    assert time.monotonic() - t0 < 10, "nothing was started"
    lab = [o for o in report["steps"] if not o["name"].startswith("gpu:")]
    assert lab and all(o["status"] == "not run" and "budget" in o["error"] for o in lab), lab


def test_step_selection_and_bad_selection():
    chosen = runner.select(1, False, ("04",))
    assert {s.lab for s in chosen} == {steps.L04} and any(s.needs for s in chosen)
    assert [s.name for s in runner.select(0, False, ("hello",))] == ["00 hello"]
    assert [s.name for s in runner.select(0, True, ("01",))] == ["01 grad_accum"]
    with pytest.raises(ValueError, match="matches no step"):
        runner.select(0, False, ("99",))
    full = runner.select(2, False)
    assert sorted({s.number for s in full}) == [f"{n:02d}" for n in range(14)], "every lab has its steps"
    assert len({s.name for s in full}) == len(full)


def test_every_step_is_a_valid_launch_of_its_run_script(tmp_path):
    """Each step's options pass its run script's Config (and world size check) with the lab's exercise files."""
    r = runner.Runner(REPO, tmp_path, 10, 10, 0)
    r.prepare_labs()
    here = os.getcwd()
    try:
        for s in steps.lab_steps(False) + steps.lab_steps(True) + steps.GPU_ONLY:
            os.chdir(r.folder(s.lab))
            if s.script:
                cfg.from_options(gpu_checks.Config, {"check": s.step, **s.options})
                continue
            config = cfg.from_options(launch.load_step(s.step).Config, r.options(s))
            if hasattr(config, "validate_world"):
                config.validate_world(s.nproc)
            launch.refuse_unwritten_exercises(config)
    finally:
        os.chdir(here)


def test_exercise_files_from_a_students_copy(tmp_path):
    lab = steps.L01
    (tmp_path / "labs" / lab).mkdir(parents=True)
    stub = 'def accumulation_step(model, batches):\n    """doc"""\n    raise NotImplementedError()\n'
    (tmp_path / "labs" / lab / "accum_impl.py").write_text(stub)
    source, missing = exercise_files.prepare(tmp_path, lab, ("accum_impl.py",), tmp_path / "work")
    assert not source and "still hold the released stubs" in missing
    (tmp_path / "labs" / lab / "accum_impl.py").write_text(stub.replace("raise NotImplementedError()", "return 1"))
    source, missing = exercise_files.prepare(tmp_path, lab, ("accum_impl.py",), tmp_path / "work")
    assert (source, missing) == (f"labs/{lab} (your files)", "") and (tmp_path / "work" / "accum_impl.py").is_file()
    source, missing = exercise_files.prepare(tmp_path, steps.L02, ("ring_impl.py",), tmp_path / "work2")
    assert "ring_impl.py not written yet" in missing


def test_gpu_only_verdicts_fail_where_they_should():
    on_gpu = {"device": "cuda:0", "backend": "nccl", "fallback": ""}
    cp = {"env": on_gpu, "metrics": {"max_abs_diff": 0.01, "bound": 0.05}}
    assert steps._cp_verdict(cp) == []
    assert "bound" in steps._cp_verdict({**cp, "metrics": {"max_abs_diff": 0.1, "bound": 0.05}})[0]
    assert "not on a GPU" in steps._cp_verdict({**cp, "env": {"device": "cpu", "fallback": "gloo"}})[0]
    row = {"counted_peak": 100, "allocator_peak": 120, "moments": {"after_step": {"counted": 100, "allocated": 120}}}
    assert steps._memory_verdict({"env": on_gpu, "metrics": {"variants": {"ddp": [row]}}}) == []
    row = {**row, "moments": {"after_step": {"counted": 100, "allocated": 99}}}
    assert "allocated then" in steps._memory_verdict({"env": on_gpu, "metrics": {"variants": {"ddp": [row]}}})[0]
    assert "peak" in steps._memory_verdict({"env": on_gpu, "metrics": {"variants": {"ddp": [{**row, "allocator_peak": 99,
                                                                                              "moments": {}}]}}})[0]
    resumed = {"env": on_gpu, "metrics": {"attempts": [{}, {}], "reference": [{"step": 1, "loss": 2.5}],
                                          "steps": [{"step": 1, "loss": 2.5}]}}
    assert steps._resume_verdict(resumed) == []
    resumed["metrics"]["steps"] = [{"step": 1, "loss": 2.5000002}]
    assert "differ" in steps._resume_verdict(resumed)[0]
    # a lab step's verdict is the lab's own check of its result (lab 01: DDP + accumulation vs one process)
    accum = next(s for s in steps.lab_steps(True) if s.step == "grad_accum")
    metrics = {"no_sync": {"weight_spread_across_ranks": 0.0}, "max_abs_diff_vs_single_process": 2e-7,
               "rounding_bound": 1e-6}
    assert accum.verdict({"metrics": metrics}) == []
    assert "the lab's check" in accum.verdict({"metrics": {**metrics, "max_abs_diff_vs_single_process": 1e-5}})[0]
    # the bound of lab 12's check: three bf16 roundings of max|V| and the fp32 sums (gpu_checks.cp_bound)
    assert gpu_checks.cp_bound(4.0, 1024) == pytest.approx(4.0 * (3 / 256 + 1024 / 2 ** 24))


def test_gpu_checks_script_runs_under_torchrun_and_declines_the_cpu(tmp_path):
    out = tmp_path / "out.json"
    run = launch.run_script(gpu_checks.__file__, ["--out", str(out), "--check", "zero_memory"], nproc=1,
                            timeout_s=120, env={"LABLIB_DEVICE": "cpu"}, quiet=True)
    assert run.returncode == 0, run.output
    assert json.loads(out.read_text())["metrics"] == {"not_run": "this rank runs on cpu"}


def test_a_gpu_machine_whose_torch_has_no_cuda_says_so(monkeypatch):
    monkeypatch.delenv("LABLIB_DEVICE", raising=False)
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runner.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    monkeypatch.setattr(runner.torch.version, "cuda", None)
    assert "CPU-only build" in runner.cuda_problem()
    assert "CPU-only build" in runner.why_not_run(steps.GPU_ONLY[0], 0)
    monkeypatch.setattr(runner.torch.version, "cuda", "12.8")
    assert "is_available() is False" in runner.cuda_problem()
    monkeypatch.setattr(runner.shutil, "which", lambda name: None)
    monkeypatch.setattr(runner.Path, "exists", lambda self: False)
    assert runner.cuda_problem() == ""


def test_zero_memory_check_runs_lab_04s_variants_with_a_stand_in_allocator(monkeypatch):
    """gpu_checks.zero_memory_on_gpu's loop on the CPU (world size 1): torch.cuda's memory figures stand in as 0, so
    only the loop and what it records are checked here; the comparison itself needs a GPU."""
    import torch
    import torch.distributed as dist
    from lablib.jobs.distenv import DistEnv

    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = gpu_checks.zero_memory_on_gpu(DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"), gpu_checks.Config(steps=2))
    finally:
        dist.destroy_process_group()
    assert list(out["variants"]) == ["ddp", "zero1", "fsdp_grad_op", "fsdp_full"]
    for variant, (row,) in out["variants"].items():
        assert list(row["moments"]) == ["after_forward", "after_backward", "after_step"]
        assert row["counted_peak"] == max(m["counted"] for m in row["moments"].values()) > 0
    # with nothing allocated, the verdict must say that the counts exceed it
    result = {"env": {"device": "cuda:0"}, "metrics": out}
    assert len(steps._memory_verdict(result)) == 4 * 4      # every variant: its peak and its three moments
