"""The lent GPU machine's procedure, rehearsed here without the package index (launch/gpu_rehearse.sh, docs/gpu.md):
an environment holding only what the GPU image holds (Python 3.12, torch 2.11, transformers 5.17, ...), the offline
bundle installed into a venv that sees it with pip --no-index, then the check's dry run and its CPU steps through the
very script the device runs. The image stand-in is built once into ~/.cache/nshard-gpu-rehearsal (from the package
index: ~2.7 GB of wheels) and reused offline afterwards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from runs import REPO
from spawn import require

pytestmark = pytest.mark.slow


def python312() -> str | None:
    candidates = [os.environ.get("NSHARD_PYTHON312"), "python3.12", *map(str, sorted(
        Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), "/usr/bin/python3.12"]
    for candidate in filter(None, candidates):
        try:
            if subprocess.run([candidate, "-V"], capture_output=True, timeout=60).returncode == 0:
                return candidate
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def test_the_device_procedure_runs_offline_in_an_image_like_environment(tmp_path):
    py312 = python312()
    require(py312 is not None, "Python 3.12, the GPU image's (NSHARD_PYTHON312 names one)")
    proc = subprocess.run(["bash", "launch/gpu_rehearse.sh", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "NSHARD_PYTHON312": py312}, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "gpu_rehearse: ok: torch 2.11.0" in proc.stdout and "transformers 5.17.0 deepspeed 0.19.8" in proc.stdout
    dry = json.loads((tmp_path / "out-dry" / "gpu-check.json").read_text())
    assert dry["ok"] and all(s["status"].startswith("dry-run") for s in dry["steps"].values())
    environment = dry["steps"]["environment"]["checked"]
    assert environment["python"].startswith("3.12") and environment["versions"]["deepspeed"]["installed"] == "0.19.8"
    assert environment["offline"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cpu = json.loads((tmp_path / "out-cpu" / "gpu-check.json").read_text())
    assert cpu["ok"] and set(cpu["steps"]) == {"environment", "train-powersgd-shipped-two-processes",
                                               "train-powersgd-shipped-two-processes-all-dense",
                                               "reducers-two-processes"}
    proof = cpu["derived"]["compressed_gradient_applied"]
    assert proof["verdict"] == "proved" and proof["equal_losses"][:9] == [True] * 9, proof
    assert (tmp_path / "out-cpu" / "gpu-check-logs.tar.gz").is_file()
