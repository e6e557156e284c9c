"""``python -m lablib.gpucheck`` (what ``launchers/gpu-check`` runs); see ``lablib.gpucheck``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lablib.gpucheck import runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launchers/gpu-check", description=(
        "Run every lab's multi-process steps on this machine's GPUs (NCCL with one rank per GPU, or all ranks sharing "
        "GPU 0 over gloo), and the GPU-only checks; write one report under results/. Without a GPU, or with "
        "LABLIB_DEVICE=cpu, the quick path runs on the CPU."))
    parser.add_argument("--quick", action="store_true", help="only the quick path's steps (the default without a GPU)")
    parser.add_argument("--full", action="store_true", help="every step even without a GPU (minutes of CPU per lab)")
    parser.add_argument("--steps", default="", help="comma-separated lab numbers or step names, e.g. 04,11 or gpu:")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    parser.add_argument("--step-limit", type=float, default=120.0, help="seconds at most for one step (default 120)")
    parser.add_argument("--no-compare", action="store_true", help="skip the CPU runs the GPU figures are compared with")
    parser.add_argument("--out-dir", default="", help="where the report goes (default: results/ in the repository)")
    args = parser.parse_args(argv)
    if args.quick and args.full:
        parser.error("--quick and --full exclude each other")
    if args.budget <= 0 or args.step_limit <= 0:
        parser.error(f"--budget ({args.budget}) and --step-limit ({args.step_limit}) must be positive seconds")
    repo = Path(__file__).resolve().parents[2]
    quick = args.quick or (not args.full and runner.visible_gpus() == 0)
    only = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    try:
        report = runner.run_all(repo, Path(args.out_dir) if args.out_dir else repo / "results", quick, only,
                                args.budget, args.step_limit, compare=not args.no_compare)
    except ValueError as exc:
        parser.error(str(exc))
    print(Path(report["paths"][1]).read_text())
    print(f"[gpu-check] report: {report['paths'][0]} and {report['paths'][1]}")
    failed = [o for o in report["steps"] if o["status"] == "fail" or (o["compare"] and o["compare"].get("n_unequal"))]
    if report["machine"]["cuda_problem"]:
        print(f"[gpu-check] not a GPU check: {report['machine']['cuda_problem']}", file=sys.stderr)
    return 1 if failed or report["machine"]["cuda_problem"] else 0


if __name__ == "__main__":
    sys.exit(main())
