"""What a bare GPU machine needs of a plain checkout, checked on the CPU: nshard.analysis without an install, one
clear line for a package the trainer cannot import, ranks that share a GPU over gloo, and the reducer's numerics pinned
whatever torch's global settings say (docs/gpu.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runs import REPO

from nshard.run import device


def test_a_plain_checkout_imports_nshard_analysis():
    """No site-packages at all (-S: no install, no editable finder): nshard.analysis is the checkout's analysis/."""
    proc = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                           "import nshard.analysis.memory_model as m; print(m.__file__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(REPO / "analysis" / "memory_model.py")


@pytest.mark.parametrize("missing", ["deepspeed", "transformers"])
def test_the_trainer_names_a_package_it_cannot_import_in_one_line(missing):
    probe = (f"import sys; sys.modules[{missing!r}] = None; sys.path.insert(0, {str(REPO)!r}); "
             "from nshard import train; sys.exit(train.main(['--ds_config', 'ds_configs/dense.json', "
             "'--plan', 'launch/plans/tiny.toml']))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nshard: error:")]
    assert len(errors) == 1 and f"cannot import {missing}" in errors[0] and "gpu.md#the-offline-bundle" in errors[0]
    assert "Traceback" not in proc.stderr


def test_ranks_share_the_visible_gpus_only_over_gloo(monkeypatch):
    monkeypatch.delenv(device.BACKEND_VARIABLE, raising=False)
    assert device.dist_backend(True) == "nccl" and device.dist_backend(False) == "gloo"
    monkeypatch.setenv(device.BACKEND_VARIABLE, "gloo")
    assert device.dist_backend(True) == "gloo"
    for bad in ("mpi", "NCCL"):
        monkeypatch.setenv(device.BACKEND_VARIABLE, bad)
        with pytest.raises(ValueError, match="NSHARD_DIST_BACKEND=.*set it to gloo"):
            device.dist_backend(True)
    monkeypatch.setenv(device.BACKEND_VARIABLE, "nccl")
    with pytest.raises(ValueError):
        device.dist_backend(False)  # NCCL needs GPUs
    assert [device.shared_device_index(r, 1) for r in range(3)] == [0, 0, 0]
    assert [device.shared_device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]
    env = {device.BACKEND_VARIABLE: "gloo", "LOCAL_RANK": "1"}
    device.share_gpus(env)  # no GPU here: nothing to share, LOCAL_RANK stays
    assert env == {device.BACKEND_VARIABLE: "gloo", "LOCAL_RANK": "1"}
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    device.share_gpus(env)
    assert env["LOCAL_RANK"] == "0" and env["NSHARD_LAUNCH_LOCAL_RANK"] == "1"
    device.share_gpus(env)  # again (a second call in the same process): still the launcher's rank 1 on GPU 0
    assert env["LOCAL_RANK"] == "0" and env["NSHARD_LAUNCH_LOCAL_RANK"] == "1"
    nccl = {device.BACKEND_VARIABLE: "nccl", "LOCAL_RANK": "1"}
    device.share_gpus(nccl)
    assert nccl["LOCAL_RANK"] == "1"


def test_the_reducers_matmuls_run_in_full_fp32_whatever_the_global_setting_and_put_it_back():
    from nshard.comm.numerics import PinnedMatmuls, record

    cuda = torch.backends.cuda.matmul
    before = cuda.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision
    try:
        cuda.fp32_precision = "tf32"  # a user (or a library) allowed TF32 for the model's matmuls
        with PinnedMatmuls(False):
            assert (cuda.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision) == ("ieee", "ieee")
            with PinnedMatmuls(True):
                assert cuda.fp32_precision == "tf32"
            assert cuda.fp32_precision == "ieee"
        assert cuda.fp32_precision == "tf32"
        assert record(False)["torch_cuda_matmul_tf32"] is True
        assert record(False)["reducer_fp32_matmuls"].startswith("full fp32")
    finally:
        cuda.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = before


def test_nshard_tf32_is_a_boolean_and_reaches_the_reducer():
    from nshard.comm.config import ConfigError, ReducerConfig
    from nshard.comm.powersgd import PowerSGDReducer

    with pytest.raises(ConfigError, match="nshard.tf32 is 'yes'; set it to true or false"):
        ReducerConfig(reducer="powersgd", tf32="yes")
    assert PowerSGDReducer(ReducerConfig(reducer="powersgd", tf32=True), transport=None).state.matmuls.tf32 is True
    assert PowerSGDReducer(ReducerConfig(reducer="powersgd"), transport=None).state.matmuls.tf32 is False


def test_fresh_error_memory_is_fp32_whatever_the_default_dtype():
    from nshard.comm.feedback import build_error_memory
    from nshard.comm.layout import build_layout

    layout = build_layout({"w": (64, 48), "experts": (3, 64, 48)}, 4, 2.0)
    torch.set_default_dtype(torch.float64)
    try:
        for where in ("device", "host"):
            memory = build_error_memory(where)
            memory.ensure(layout.matrices, torch.device("cpu"))
            assert {t.dtype for t in memory.tensors.values()} == {torch.float32}, where
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("synchronized", ["1", "0"])
def test_the_phase_clock_waits_for_the_device_at_deepspeeds_collectives_only_when_phases_are_synchronized(
        monkeypatch, synchronized):
    """A DeepSpeed collective inside a microbatch's backward, as install_grad_count wraps it (a collective_wait frame
    on the process's clock): on CUDA with NSHARD_PHASE_SYNC=1 each boundary waits for the device; with 0, none does."""
    from nshard.phases import PhaseClock

    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(a))
    monkeypatch.setenv("NSHARD_PHASE_SYNC", synchronized)
    clock = PhaseClock()
    clock.use_device("cuda:0")  # sets how it waits; nothing runs on a device here
    clock.start()
    with clock.microbatch():
        for _ in range(3):
            with clock.phase("collective_wait"):
                pass
    clock.running = False
    assert len(waits) == (2 + 3 * 2 if synchronized == "1" else 0)
