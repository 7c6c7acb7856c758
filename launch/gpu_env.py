"""The GPU check's first step (launch/gpu_check.py): is this Python ready to run the check? It imports what the check
runs (torch, DeepSpeed, transformers, nshard with nshard.analysis), sets every installed version against
pyproject.toml, finds DeepSpeed's launcher, nvcc and ninja, reads the free disk and the TF32 settings, and (unless
--no-device) the GPU. Prints one JSON line; exit 1 with `problems` naming each thing missing and its fix, before any
GPU time is spent on a step that would fail for it. Imports nothing of nshard before it has checked that it can.

    python launch/gpu_env.py [--no-device] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
FIX = "build the bundle (bash launch/gpu_bundle.sh) and install it (launch/gpu_device.sh), or bash launch/setup.sh"
IMPORTS = ("torch", "deepspeed", "transformers", "safetensors", "tokenizers", "numpy", "psutil", "tqdm",
           "nshard", "nshard.analysis.memory_model", "nshard.run.training", "nshard.seam.patches", "pytest")
"""What the check's steps import, each tried alone (found by running the check in an environment holding only what
the GPU image holds: launch/gpu_rehearse.sh)."""
NEEDED = ("torch", "deepspeed", "transformers", "safetensors", "tokenizers", "numpy", "psutil", "tqdm")
"""pyproject.toml's dependencies the check needs installed within their specifiers; the others (the embedded model's
gguf and accelerate, S3's boto3, own data's datasets, mpi4py, scipy and matplotlib for the study's analysis) are
reported, not required."""
MIN_FREE_BYTES = 10 * 2**30
"""On the device: the 1.7B step's export (3.4 GB) and model files, the 135M steps' exports (0.3-0.5 GB each, removed
after each step), logs."""


def requirements() -> list:
    """pyproject.toml's [project] dependencies, as packaging Requirements, those whose marker applies here."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from packaging.requirements import Requirement

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, listed) if r.marker is None or r.marker.evaluate()]


def versions(problems: list[str]) -> dict:
    """Every dependency's installed version against its specifier: ok, or why not."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for req in requirements():
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out[req.name] = {"installed": None, "wants": str(req.specifier) or "any"}
            if req.name in NEEDED:
                problems.append(f"{req.name} is not installed (pyproject.toml wants {req}); {FIX}")
            continue
        ok = req.specifier.contains(have.split("+")[0], prereleases=True)
        out[req.name] = {"installed": have, "wants": str(req.specifier) or "any", "ok": ok}
        if not ok and req.name in NEEDED:
            problems.append(f"{req.name} {have} is outside pyproject.toml's {req}; install a version it allows")
    return out


def imports(problems: list[str]) -> dict:
    """Each module the check imports, imported here: its version or file, or the error."""
    out = {}
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any failure to import is the finding, named with its cause
            out[name] = f"failed: {type(exc).__name__}: {exc}"
            problems.append(f"import {name} failed ({type(exc).__name__}: {exc}); {FIX}")
            continue
        out[name] = getattr(module, "__version__", None) or getattr(module, "__file__", None) or "ok"
    return out


def program(name: str, version_args: list[str], beside: Path | None = None) -> dict | None:
    """A program beside `beside` (a Python's bin folder) or on PATH: its path and first version line, or None."""
    found = beside / name if beside is not None and (beside / name).is_file() else shutil.which(name)
    if found is None and name == "nvcc":
        home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        found = Path(home) / "bin" / "nvcc" if (Path(home) / "bin" / "nvcc").is_file() else None
    if found is None:
        return None
    try:
        text = subprocess.run([str(found), *version_args], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"path": str(found), "version": f"failed: {exc}"}
    lines = [line for line in text.splitlines() if line.strip()]
    return {"path": str(found), "version": lines[-1] if lines else ""}


def tf32_state() -> dict:
    """torch's TF32 settings as this process starts (the model's matmuls use them; nshard's reducer pins its own:
    the receipts' `numerics`)."""
    import torch

    from nshard.comm.numerics import global_precision

    matmul = torch.backends.cuda.matmul
    return {"float32_matmul_precision": global_precision(),
            "cuda_matmul": getattr(matmul, "fp32_precision", None) or f"allow_tf32={matmul.allow_tf32}",
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}


def device(problems: list[str]) -> dict:
    import torch

    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False); run the check on a GPU "
                        "machine, or --dry-run here")
        return {"cuda": False, "torch_cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    return {"cuda": True, "torch_cuda": torch.version.cuda, "gpu": props.name, "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "devices": torch.cuda.device_count(),
            "multiprocessors": props.multi_processor_count}


def check(with_device: bool, out: Path) -> dict:
    problems: list[str] = []
    report = {"python": sys.version.split()[0], "executable": sys.executable, "imports": imports(problems)}
    report["versions"] = versions(problems)
    bin_dir = Path(sys.executable).parent
    launcher = program("deepspeed", ["--help"], bin_dir)
    report["launcher"] = launcher and launcher["path"]
    if launcher is None:
        problems.append(f"DeepSpeed's launcher `deepspeed` is neither beside {sys.executable} nor on PATH; install "
                        f"DeepSpeed into this Python ({FIX})")
    report["ninja"] = program("ninja", ["--version"], bin_dir)
    report["nvcc"] = program("nvcc", ["--version"])
    if with_device:  # DeepSpeed's JIT builds (FusedAdam in the CUDA tests) need both
        problems += [f"{name} not found: DeepSpeed's JIT builds need it (the GPU image has it: is this the image's "
                     f"Python?)" for name in ("ninja", "nvcc") if report[name] is None]
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    report["free_disk_bytes"] = free
    if with_device and free < MIN_FREE_BYTES:
        problems.append(f"{free / 2**30:.1f} GiB free under {out}: the check writes up to ~{MIN_FREE_BYTES / 2**30:.0f}"
                        f" GiB; give --out a folder on a larger disk")
    if "failed" not in str(report["imports"].get("torch")):
        report["tf32"] = tf32_state()
        report["device"] = device(problems) if with_device else "not checked (--no-device)"
    report["offline"] = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    report["problems"] = problems
    report["ok"] = not problems
    return report


def build_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(REPO))  # run as a script: the checkout's nshard.cli (the standard library only)
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(prog="python launch/gpu_env.py", description=__doc__.split("\n\n")[0],
                            epilog="Writes nothing: prints the report as one JSON line (exit 1: a problem). "
                                   + SPELLING_NOTE)
    parser.add_argument("--no_device", action="store_true", help="check everything but the GPU (the dry run)")
    parser.add_argument("--out", type=Path, default=REPO / "runs", help="where the check writes (free disk)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    report = check(not args.no_device, args.out)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
