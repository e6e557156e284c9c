"""Lab 06's run scripts: ddp_scratch (the graded probe of the students' DDP classes) and ddp_overlap (the
measurements). Pure pieces on numbers, the probe at world size 1 in this process, then one real torchrun run.

The implementations below are the test's own, written for these tests (a compact all-after-backward wrapper
and a hook-based one): the probe must tell them apart by the order of events.
"""

from __future__ import annotations

import pytest

from lablib.jobs import config as cfg
from lablib.jobs import launch
from lablib.labs.ddp_from_scratch import order as ddp_order
from lablib.labs.ddp_from_scratch import probe as ddp_probes
from lablib.labs.ddp_from_scratch import run_ddp_overlap as ddp_overlap
from lablib.labs.ddp_from_scratch import run_ddp_scratch as ddp_scratch

HOOKED = '''
import torch, torch.distributed as dist


class DDPIndividualParameters(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.pending = module, []
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, 0)
        n = dist.get_world_size()

        def hook(p):
            p.grad.mul_(1.0 / n)
            self.pending.append(dist.all_reduce(p.grad, async_op=True))
        for p in {id(q): q for q in module.parameters() if q.requires_grad}.values():
            p.register_post_accumulate_grad_hook(hook)

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def finish_gradient_synchronization(self):
        while self.pending:
            self.pending.pop().wait()
'''

AFTER_BACKWARD = HOOKED.replace("p.register_post_accumulate_grad_hook(hook)", "pass").replace(
    "        while self.pending:", "        for p in self.module.parameters():\n"
    "            if p.grad is not None:\n"
    "                p.grad.mul_(1.0 / dist.get_world_size())\n"
    "                self.pending.append(dist.all_reduce(p.grad, async_op=True))\n"
    "        while self.pending:")


def _impl(tmp_path, source, name="individual_impl.py"):
    path = tmp_path / name
    path.write_text(source)
    return ddp_probes.load_impl(str(path), ("DDPIndividualParameters",)), path


def test_torch_bucket_assignment_is_ddps_and_records_its_calls():
    calls = []
    assign = ddp_probes.torch_bucket_assignment(calls)
    # DDP closes a bucket once it reaches the cap: the 40-byte tensor joins the 4-byte one at a 16-byte cap.
    assert assign([4, 40, 8, 8, 8], 16 / 2**20) == [[0, 1], [2, 3], [4]]
    assert assign([8, 8], 100.0) == [[0, 1]]
    assert calls[0] == {"param_bytes": [4, 40, 8, 8, 8], "bucket_size_mb": 16 / 2**20}


def test_overlap_fraction_uses_ddps_definition():
    comm = [(1.0, 2.0), (2.0, 5.0)]                 # communication from t=1 to t=5
    assert ddp_overlap.overlap_fraction(comm, 3.0) == pytest.approx(0.5)
    assert ddp_overlap.overlap_fraction(comm, 0.5) == 0.0
    assert ddp_overlap.overlap_fraction(comm, 9.0) == 1.0


def test_bucketed_backward_takes_a_measured_bucket_count():
    """The sweep draws each cap at its mean bucket size g / n; in floating point ceil(g / (g / 29)) is 30 at the
    run's g = 1,653,248 B, and the model then charged a 30th latency. Given the count, it charges 29."""
    from lablib.course import scaling

    g, latency = 1_653_248, lambda n: 1.0            # every all-reduce 1 s: "comm" counts the all-reduces
    assert scaling.bucketed_backward(0.0, g, g / 29, latency)["n_buckets"] == 30    # the trap, still there
    got = scaling.bucketed_backward(0.0, g, g / 29, latency, n_buckets=29)
    assert got["n_buckets"] == 29 and got["comm"] == 29.0
    with pytest.raises(ValueError, match="n_buckets=0"):
        scaling.bucketed_backward(0.0, g, g, latency, n_buckets=0)


def test_cuda_trace_ends_the_compute_at_the_last_gradient_not_at_backwards_return():
    """PyTorch's DDP finishes inside backward(): its reducer copies the buckets back into .grad after the last NCCL
    kernel. Ending the compute at backward()'s return read DDP as 100 % hidden on GPUs; the last gradient's
    annotation does not. A synthetic trace (microseconds): compute kernel launched at 10 runs 20-40, the last
    gradient final at 15, NCCL 30-60 (launched 16), the copy-back launched at 17 runs 60-62, backward() returns at 18."""
    from lablib.labs.ddp_from_scratch import timeline

    def annotation(name, ts, dur=0.0):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    def kernel(name, corr, launch, ts, dur):
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 0.1,
                 "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}]

    events = [annotation(timeline.MARK[0], 0.0, 100.0), annotation(timeline.MARK[1], 5.0, 13.0),
              annotation(timeline.GRAD_READY, 12.0), annotation(timeline.GRAD_READY, 15.0),
              *kernel("gemm", 1, 10.0, 20.0, 20.0), *kernel("ncclDevKernel_AllReduce", 2, 16.0, 30.0, 30.0),
              *kernel("copy_", 3, 17.0, 60.0, 2.0)]
    got = timeline.read_cuda_trace(events)
    assert got["compute_end"] == pytest.approx(40e-6) and got["comm"] == [pytest.approx((30e-6, 60e-6))]
    assert timeline.overlap_fraction(got["comm"], got["compute_end"]) == pytest.approx(1 / 3)
    # Without the annotations the old bound (backward()'s return at 18) takes the copy-back in: all hidden.
    old = timeline.read_cuda_trace([e for e in events if e["name"] != timeline.GRAD_READY])
    assert old["compute_end"] == pytest.approx(62e-6)
    assert timeline.overlap_fraction(old["comm"], old["compute_end"]) == 1.0


def test_probe_sees_overlap_and_the_tied_weight_once(tmp_path):
    impl, _ = _impl(tmp_path, HOOKED)
    for r in ddp_probes.probe_without_processes(impl, "individual", ("mlp", "tied", "frozen", "unused")):
        ddp_probes.check_probe(r, "individual")
        assert r["world_size"] == 1 and r["steps_recorded"]


def test_probe_without_processes_checks_each_case_as_it_ends(tmp_path):
    """With check, the first wrong case ends the probe (later cases are not run) and the group of one is gone."""
    import torch.distributed as dist

    impl, _ = _impl(tmp_path, AFTER_BACKWARD, "after_check_impl.py")
    seen = []

    def check(r):
        seen.append(r["case"])
        ddp_probes.check_probe(r, "individual")

    with pytest.raises(AssertionError, match="overlap"):
        ddp_probes.probe_without_processes(impl, "individual", ("mlp", "tied", "frozen"), check=check)
    assert seen == ["mlp"] and not dist.is_initialized()


def test_probe_fails_an_all_reduce_after_backward(tmp_path):
    impl, _ = _impl(tmp_path, AFTER_BACKWARD, "after_impl.py")
    r = ddp_probes.probe_without_processes(impl, "individual", ("mlp",))[0]
    assert r["error"] is None and r["max_abs_diff_vs_single_process"] < 1e-6   # right numbers...
    with pytest.raises(AssertionError, match="overlap"):                         # ...no overlap
        ddp_probes.check_probe(r, "individual")


WAIT_IN_HOOK = HOOKED.replace("self.pending.append(dist.all_reduce(p.grad, async_op=True))",
                              "self.pending.append(dist.all_reduce(p.grad, async_op=True))\n"
                              "            self.pending[-1].get_future().wait()")
FROM_LAST_HOOK = HOOKED.replace("""        def hook(p):
            p.grad.mul_(1.0 / n)
            self.pending.append(dist.all_reduce(p.grad, async_op=True))""", """        first = next(q for q in module.parameters() if q.requires_grad)

        def hook(p):
            if p is not first:
                return
            for q in module.parameters():
                if q.grad is not None:
                    q.grad.mul_(1.0 / n)
                    self.pending.append(dist.all_reduce(q.grad, async_op=True))""")


@pytest.mark.parametrize("source, message", [(WAIT_IN_HOOK, "wait\\(\\) call"), (FROM_LAST_HOOK, "overlap: all-reduce 0")])
def test_probe_fails_launches_that_do_not_overlap(tmp_path, source, message):
    """Async and launched before backward() returned, yet nothing overlaps: a wait in the hook, or every
    all-reduce launched from the last hook. The order of events tells."""
    impl, _ = _impl(tmp_path, source, "late_impl.py")
    r = ddp_probes.probe_without_processes(impl, "individual", ("mlp",))[0]
    assert r["error"] is None and r["max_abs_diff_vs_single_process"] < 1e-6
    with pytest.raises(AssertionError, match=message):
        ddp_probes.check_probe(r, "individual")


def test_bucket_order_rule_on_a_record():
    """Readiness order differs from bucket order: bucket 1's gradient is final first, bucket 0's second. In index
    order both go right after the second gradient; launching bucket 1 first breaks the order."""
    step = {"ready": [(1.0, 1), (2.0, 0)], "backward_done": 3.0, "waits_in_backward": 0}
    buckets, sizes = [[0], [1]], [40, 8]
    assert ddp_order.bucket_problems({**step, "bytes": [40, 8], "launched": [2.1, 2.2]}, buckets, sizes, 2) == []
    assert "index order" in ddp_order.bucket_problems({**step, "bytes": [8, 40], "launched": [1.1, 2.1]},
                                                      buckets, sizes, 2)[0]
    late = ddp_order.bucket_problems({**step, "bytes": [40, 8], "launched": [2.1, 3.5]}, buckets, sizes, 2)
    assert "bucket 1" in late[0]
    # one usage map (2 flags, 4 bytes each) anywhere is allowed, a second extra all-reduce is not
    assert ddp_order.split_usage_map([40, 8, 8], sizes, 2) == ([0, 1], 2)
    assert ddp_order.split_usage_map([40, 8, 8, 8], sizes, 2) == ([], None)


def test_probe_reports_a_stub_as_an_error(tmp_path):
    stub = "class DDPIndividualParameters:\n    def __init__(self, module):\n        raise NotImplementedError()\n"
    impl, _ = _impl(tmp_path, stub, "stub_impl.py")
    r = ddp_probes.probe_without_processes(impl, "individual", ("mlp",))[0]
    assert r["error"].startswith("NotImplementedError")
    with pytest.raises(AssertionError, match="raised NotImplementedError"):
        ddp_probes.check_probe(r, "individual")


@pytest.mark.parametrize("options, message", [
    ({"wrapper": "zero"}, "wrapper="),
    ({"cases": ("mlp", "nope")}, "unknown"),
    ({"bucket_size_mb": 0.0}, "must be positive"),
    ({"impl": "no_such_file.py"}, "does not exist"),
])
def test_scratch_config_is_validated_up_front(options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cfg.from_options(ddp_scratch.Config, options)


def test_overlap_config_is_validated_up_front(tmp_path):
    with pytest.raises(ValueError, match="at least 11"):
        cfg.from_options(ddp_overlap.Config, {"timeline_steps": 5})
    with pytest.raises(ValueError, match="each must be one of"):
        cfg.from_options(ddp_overlap.Config, {"parts": ("gantt",)})
    with pytest.raises(ValueError, match="twice, as its noise floor"):
        cfg.from_options(ddp_overlap.Config, {"bucket_size_mb": 0.3})


def test_ddp_style_fraction_is_a_ratio_of_means_not_a_median():
    """DDP's logger divides its mean overlap by its mean communication time: a long step weighs more. Step 1
    hides 1 of 2 s (50 %), step 2 hides 9 of 10 s (90 %), step 3 hides 0 of 2 s: the median of the per-step
    fractions is 50 %, DDP's statistic (1 + 9 + 0) / (2 + 10 + 2) = 10/14."""
    steps = [{"comm": [(0.0, 1.0, 4), (1.0, 2.0, 4)], "compute_end": 1.0},
             {"comm": [(0.0, 10.0, 4)], "compute_end": 9.0},
             {"comm": [(3.0, 5.0, 4)], "compute_end": 1.0},
             {"comm": [], "compute_end": 1.0}]                  # a step without communication is not counted
    assert ddp_overlap.ddp_style_fraction(steps) == pytest.approx(10 / 14)
    assert ddp_overlap.ddp_style_fraction(steps[3:]) is None


@pytest.mark.slow
def test_real_ranks_take_turns_at_two_world_sizes(tmp_path, monkeypatch):
    """One 3-rank job checks world sizes 2 and 3 (the default group swapped for a sub-group): the hooked
    wrapper ends where one process does, identical on every rank, all-reduces launched during backward."""
    _, path = _impl(tmp_path, HOOKED)
    monkeypatch.chdir(tmp_path)
    result = launch.run("ddp_scratch", {"impl": str(path), "wrapper": "individual", "world_sizes": (2, 3),
                                        "cases": ("mlp", "frozen")}, nproc=3, timeout_s=240, quiet=True,
                        show_progress=False)
    runs = result.metrics.runs
    assert sorted(runs) == ["2:frozen", "2:mlp", "3:frozen", "3:mlp"]
    for r in runs.values():
        ddp_probes.check_probe(r, "individual")
    assert runs["3:mlp"].world_size == 3 and runs["2:mlp"].world_size == 2


def test_exercise_3_does_not_depend_on_exercise_2(tmp_path):
    """A broken buckets_impl.py (exercise 2) must not cost DDPBucketed (exercise 3) its points: the graded
    load imports a stand-in, and the probe uses PyTorch's assignment."""
    (tmp_path / "buckets_impl.py").write_text("def assign_buckets(:\n")
    (tmp_path / "bucketed_impl.py").write_text(
        "import torch.distributed as dist\nfrom buckets_impl import assign_buckets\n\n\n"
        "class DDPBucketed:\n    def __init__(self, module, cap):\n        self.buckets = assign_buckets([1], cap)\n")
    impl = ddp_probes.load_bucketed_impl(str(tmp_path / "bucketed_impl.py"))
    assert impl.DDPBucketed(None, 1.0).buckets == [[0]]
    with pytest.raises(SyntaxError):
        ddp_probes.load_impl(str(tmp_path / "bucketed_impl.py"))


def test_exercise_3_may_import_the_module_of_exercise_2(tmp_path):
    """``import buckets_impl`` then ``buckets_impl.assign_buckets(...)`` reaches PyTorch's assignment and is recorded."""
    (tmp_path / "bucketed_impl.py").write_text(
        "import buckets_impl\n\n\nclass DDPBucketed:\n    def __init__(self, module, cap):\n"
        "        self.buckets = buckets_impl.assign_buckets([4, 40], cap)\n")
    impl = ddp_probes.load_bucketed_impl(str(tmp_path / "bucketed_impl.py"))
    calls = []
    ddp_probes.use_torch_assignment(impl, calls)
    assert impl.DDPBucketed(None, 1.0).buckets == [[0, 1]] and calls[0]["param_bytes"] == [4, 40]


def test_buckets_and_the_usage_map_are_told_apart_by_their_bytes():
    """The measurement counts buckets apart from the usage map: the buckets carry every gradient byte once, the
    map is one all-reduce of one flag per parameter (any 1-8 byte dtype)."""
    assert ddp_order.buckets_and_usage_map([40, 60, 12], 100, 3) == ([0, 1], 2)      # 3 float32 flags, last
    assert ddp_order.buckets_and_usage_map([3, 40, 60], 100, 3) == ([1, 2], 0)       # 3 uint8 flags, first
    assert ddp_order.buckets_and_usage_map([40, 60], 100, 3) == ([0, 1], None)       # no map
    assert ddp_order.buckets_and_usage_map([40, 60, 7], 100, 3) == ([0, 1, 2], None)  # 7 bytes is no map of 3 flags


def test_an_out_of_order_launch_is_reported_as_the_launch_order_not_as_overlap():
    step = {"bytes": [20, 10], "launched": [0.1, 0.2], "ready": [(0.05, 0), (0.06, 1)], "backward_done": 0.3}
    problems = ddp_order.launch_order_problems(step, [10, 20], 2)
    assert problems and "in index order" in problems[0]
    assert ddp_order.launch_order_problems({**step, "bytes": [10, 20, 8]}, [10, 20], 2) == []   # + a usage map
    assert ddp_order.plural(1, "all-reduce") == "1 all-reduce" and ddp_order.plural(2, "bucket") == "2 buckets"


def test_the_timeline_takes_the_usage_map_out_of_the_buckets_hidden_fraction():
    """The bucketed class's map (sent after the backward) is shown apart and left out of the hidden fraction, as
    DDP's own timer leaves out everything but its buckets."""
    step = {"comm": [(1.0, 2.0, 60), (2.0, 3.0, 40), (4.0, 5.0, 12)], "compute_end": 3.0, "overlap_fraction": 0.5}
    out = ddp_overlap.without_usage_map(dict(step), grad_bytes=100, n_params=3)
    assert out["usage_map"] == (4.0, 5.0, 12) and len(out["comm"]) == 2
    assert out["overlap_fraction"] == 1.0                      # both buckets done by the compute's end
    same = ddp_overlap.without_usage_map(dict(step, comm=step["comm"][:2]), grad_bytes=100, n_params=3)
    assert same["usage_map"] is None and same["overlap_fraction"] == 0.5   # nothing to take out: left as it was


def test_readiness_case_makes_gradients_final_in_the_order_given():
    import torch

    from lablib.labs.ddp_from_scratch.cases import global_batch, loss_of, readiness_case

    for order in ([3, 2, 1, 0], [2, 0, 1, 3]):
        case = readiness_case(order)
        model, seen = case.build(), []
        for i, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(lambda _, i=i: seen.append(i))
        x, y = global_batch(case, 0, 1, 4, 0)
        loss_of(model, case, x, y).backward()
        assert seen == order
    with pytest.raises(ValueError, match="once each"):
        readiness_case([0, 0, 1]).build()


def test_stepping_sees_handles_kept_from_earlier_steps_and_each_loop_clearing(tmp_path):
    """The same wrapper one step at a time: handles never cleared are waited for again (a check from step 2 on);
    the loop's zero tensors and accumulated gradients are followed by the reference too (a right wrapper passes)."""
    kept = HOOKED.replace("        while self.pending:\n            self.pending.pop().wait()",
                          "        for work in self.pending:\n            work.wait()")
    right, _ = _impl(tmp_path, HOOKED)
    wrong, _ = _impl(tmp_path, kept, "kept_impl.py")
    with ddp_probes.one_rank() as env:
        with ddp_probes.stepping(wrong, "individual", "mlp", env, steps=3) as next_step:
            ddp_probes.check_probe(next_step(), "individual")
            with pytest.raises(AssertionError, match="waited 12 times for 6 all-reduces"):
                ddp_probes.check_probe(next_step(), "individual")
        for clear in ("set_to_none=False", "accumulated"):
            r = ddp_probes.probe_case(right, "individual", "mlp", env, steps=3, clear=clear)
            ddp_probes.check_probe(r, "individual")
            assert r["clear"] == clear and r["steps_done"] == 3
    with pytest.raises(ValueError, match="clear="):
        next(ddp_probes.probe_steps(right, "individual", "mlp", None, clear="zeros"))
