"""The reducer's pinned numerics: its fp32 matmuls run in full fp32 unless its config asks for TF32, whatever torch's
global matmul precision says (the model's own matmuls keep that), and its error memory is fp32. Both go into the
receipts (`numerics`)."""

from __future__ import annotations

import functools

import torch

ERROR_MEMORY_DTYPE = torch.float32
"""PowerSGD's error memory, always: a residual below a bf16 gradient's rounding must survive to the next update."""


class PinnedMatmuls:
    """A context that sets the fp32 matmul precision of CUDA (TF32 or full fp32) and of the CPU (full fp32) for the code
    inside, and puts back what was set before. Reentrant; a few attribute writes per use."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32
        self._saved: list = []

    def __enter__(self):
        self._saved.append(_read())
        _write(("tf32" if self.tf32 else "ieee", "ieee"))
        return self

    def __exit__(self, *exc):
        _write(self._saved.pop())
        return False


def _read() -> tuple:
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision
    return torch.backends.cuda.matmul.allow_tf32, None


def _write(values: tuple) -> None:
    cuda, cpu = values
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = cuda
        torch.backends.mkldnn.matmul.fp32_precision = cpu
    else:
        torch.backends.cuda.matmul.allow_tf32 = cuda in (True, "tf32")


def pinned(fn):
    """Decorator for a PowerSGD step whose first argument is its state: the step's matmuls run at state.matmuls."""
    @functools.wraps(fn)
    def inner(state, *args, **kwargs):
        with state.matmuls:
            return fn(state, *args, **kwargs)
    return inner


def record(tf32: bool) -> dict:
    """For the receipts: the reducer's matmul precision and error-memory dtype, and torch's global settings beside them
    (what the model's own matmuls used)."""
    global_cuda, _ = _read()
    return {"reducer_fp32_matmuls": "tf32 (nshard.tf32 = true)" if tf32 else "full fp32 (ieee), pinned",
            "error_memory_dtype": str(ERROR_MEMORY_DTYPE).removeprefix("torch."),
            "torch_float32_matmul_precision": global_precision(),
            "torch_cuda_matmul_tf32": global_cuda in (True, "tf32"),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def global_precision() -> str:
    """torch's global fp32 matmul setting: the new API's where torch has it (its legacy getter raises once both APIs
    were used), else torch.get_float32_matmul_precision()."""
    if hasattr(torch.backends, "fp32_precision"):
        return (f"backends {torch.backends.fp32_precision}, cuda.matmul {torch.backends.cuda.matmul.fp32_precision}, "
                f"mkldnn.matmul {torch.backends.mkldnn.matmul.fp32_precision}")
    return torch.get_float32_matmul_precision()
