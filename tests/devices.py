"""Which device a test session uses. A plain session pins every test (and every process it starts) to the CPU,
GPUs present or not; NSHARD_CUDA_TESTS=1 starts the CUDA session, which runs only the tests marked `cuda`.
Imports no torch: conftest pins the environment before torch is imported."""

from __future__ import annotations

import glob
import os
import shutil

CUDA_SESSION_VARIABLE = "NSHARD_CUDA_TESTS"


def cuda_session() -> bool:
    return os.environ.get(CUDA_SESSION_VARIABLE) == "1"


def pin_to_cpu(env) -> None:
    """Hide the GPUs and pick DeepSpeed's CPU accelerator: torch.cuda.is_available() is then False here and in
    every child, so the engine takes gloo and torch's AdamW, as the CPU tests expect."""
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["DS_ACCELERATOR"] = "cpu"


def gpu_present() -> bool:
    """An NVIDIA device node or driver tool on this machine (without initializing CUDA in this process)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def cuda_skip_reason() -> str | None:
    """Why a `cuda` test does not run in this session (None: it runs)."""
    if not cuda_session():
        where = "a GPU is present, but" if gpu_present() else "no GPU on this machine, and"
        return (f"CUDA test: {where} this session pins tests to the CPU; on a GPU host run "
                f"{CUDA_SESSION_VARIABLE}=1 pytest -m cuda (launch/gpu_check.sh does)")
    import torch

    if not torch.cuda.is_available():
        return f"CUDA test: {CUDA_SESSION_VARIABLE}=1 but torch sees no CUDA device (a CPU-only torch wheel?)"
    return None
