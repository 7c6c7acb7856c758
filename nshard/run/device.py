"""Where a process computes: the process-group backend, the device and dtype that evaluation and replay
generation use, and CUDA's deterministic mode when a plan asks for bit-identical resume (docs/gpu.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""What cuBLAS needs to be deterministic (CUDA >= 10.2); ":16:8" also works, with less memory and speed."""
DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def cuda_available() -> bool:
    return torch.cuda.is_available()


BACKEND_VARIABLE = "NSHARD_DIST_BACKEND"
"""gloo on GPUs: ranks that share a GPU (NCCL refuses two ranks on one) over gloo, which takes CUDA tensors for
all_reduce and broadcast (staged through the host), not for send/recv or all_gather: stage 0 only (the GPU check's
two-process step). Unset: NCCL on GPUs, gloo on the CPU."""


def dist_backend(cuda: bool) -> str:
    """NCCL where the ranks hold GPUs, gloo otherwise (nshard's ring all-gather runs on gloo only), unless
    NSHARD_DIST_BACKEND says gloo."""
    chosen = os.environ.get(BACKEND_VARIABLE, "")
    if chosen not in ("", "nccl", "gloo") or (chosen == "nccl" and not cuda):
        raise ValueError(f"{BACKEND_VARIABLE}={chosen!r}: set it to gloo (ranks may share a GPU), or nccl on GPUs, "
                         "or leave it unset (NCCL on GPUs, gloo on the CPU)")
    return chosen or ("nccl" if cuda else "gloo")


def shared_device_index(local_rank: int, devices: int) -> int:
    """The GPU of a rank when ranks share the visible GPUs (gloo): local rank modulo their count."""
    return local_rank % devices if devices > 0 else local_rank


def share_gpus(env) -> None:
    """Under NSHARD_DIST_BACKEND=gloo with GPUs visible, point LOCAL_RANK (which DeepSpeed's engine, nshard and
    inference placement read as the rank's device) at a GPU that exists, keeping the launcher's in
    NSHARD_LAUNCH_LOCAL_RANK: two ranks on one GPU both compute on cuda:0. Nothing otherwise."""
    if env.get(BACKEND_VARIABLE) != "gloo" or "LOCAL_RANK" not in env or not cuda_available():
        return
    env.setdefault("NSHARD_LAUNCH_LOCAL_RANK", env["LOCAL_RANK"])
    env["LOCAL_RANK"] = str(shared_device_index(int(env["NSHARD_LAUNCH_LOCAL_RANK"]), torch.cuda.device_count()))


def bind_local_gpu() -> None:
    """Make this rank's GPU (LOCAL_RANK) the current device before NCCL or any CUDA call: otherwise the first
    barrier, peak-memory reset or allocation of every rank lands on GPU 0."""
    if cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0") or 0))


@dataclass(frozen=True)
class Placement:
    """Where a model for inference (evaluation, replay generation) lives and in which dtype."""

    device: str
    """"cpu" or "cuda:N" (N: the process's local rank)."""
    dtype: str
    """"float32" or "bfloat16"."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kind(self) -> str:
        """"cpu" or "cuda": the same on every rank of a run (the device index is not)."""
        return self.device.split(":")[0]


CPU_FP32 = Placement("cpu", "float32")


def inference_placement(bf16: bool, cuda: bool, local_rank: int = 0, cpu_bf16: bool = False) -> Placement:
    """The run's device and dtype: on a GPU, this rank's GPU in bf16 when the run trains in bf16; on the CPU, fp32,
    or bf16 for a run that trains in bf16 where the caller asks (`cpu_bf16`: scoring, where bf16 halves greedy
    generation time on a CPU with AVX512-BF16/AMX; launch/recipe/history-benchmarks.md). Replay answers stay fp32 on the CPU, so a
    plan's prepared identity does not depend on the CPU's bf16 units."""
    if not cuda:
        return Placement("cpu", "bfloat16") if bf16 and cpu_bf16 else CPU_FP32
    return Placement(f"cuda:{local_rank}", "bfloat16" if bf16 else "float32")


def run_placement(ds_config: dict) -> Placement:
    """inference_placement for this process and a run's ds_config."""
    from nshard.seam.ds_config import _bf16

    return inference_placement(_bf16(ds_config), cuda_available(), int(os.environ.get("LOCAL_RANK", "0") or 0))


def load_for_inference(ref, placement: Placement):
    """The model of `ref` in eval mode, on the placement's device and in its dtype."""
    from nshard.run.models import load_model

    return load_model(ref, placement.torch_dtype).to(placement.device).eval()


def free_cached_gpu_memory() -> None:
    """Hand the caching allocator's free blocks back (after an inference model is dropped, before training)."""
    if cuda_available():
        torch.cuda.empty_cache()


def apply_determinism(requested: bool, cuda: bool) -> dict:
    """On CUDA, when asked: deterministic algorithms (an op without one raises) and a cuBLAS workspace that
    makes its reductions repeatable. CPU runs are deterministic for one kernel set without it (FACTS.md).
    Returns what is in effect, for the receipts."""
    if requested and cuda:
        workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        if workspace not in DETERMINISTIC_WORKSPACES:
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG={workspace!r} does not make cuBLAS deterministic, which "
                             "checkpoint.deterministic_cuda asks for: unset it or set it to :4096:8 (or :16:8)")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {"requested": requested, "cuda": cuda,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
