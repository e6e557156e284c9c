"""What machine a lab's figures were measured on, written by the first cell of every book page.

The book prepends this file's text to each lab as a hidden code cell, so the description is measured in the
kernel that executes the lab, at execution time (the call at the end names who executed it). Standalone on
purpose: it runs in a kernel whose working directory is a temporary folder.
"""

import os
import platform
import time


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_markdown(executed_by: str) -> str:
    """One markdown paragraph: CPU, cores, memory, torch, GPUs, the backend the labs pick, load, date."""
    import psutil
    import torch

    from lablib.jobs.distenv import select_backend_and_device

    backend, device = select_backend_and_device(local_rank=0, local_world_size=2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_text = (f"{gpus} × {torch.cuda.get_device_name(0)}" if gpus else "no GPU")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"**Measured on:** {cpu_model()}, {psutil.cpu_count(logical=False) or '?'} cores "
            f"({os.cpu_count()} logical), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {gpu_text}; "
            f"torch {torch.__version__}, Python {platform.python_version()}; 2 ranks use **{backend}** on "
            f"`{device}`. Load average {load} when the run started. "
            f"{executed_by}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
