"""Throughput and MFU (nshard/run/throughput.py): the GPU peak table, the CPU probe's cache, the arithmetic, the
receipt's summary, the monitor stand-in's filtering and the gradient norm (nshard/seam/observe.py)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from nshard.run import budget, throughput
from nshard.run.data import Prepared
from nshard.run.receipts import Receipt
from nshard.seam import observe


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
    ("NVIDIA H100 PCIe", "bfloat16", 756.0),
    ("NVIDIA H100 NVL", "float32", 60.0),
    ("NVIDIA H200", "bfloat16", 989.0),
    ("NVIDIA A100-SXM4-40GB", "bfloat16", 312.0),
    ("NVIDIA A100 80GB PCIe", "float32", 19.5),
    ("NVIDIA L4", "bfloat16", 121.0),
    ("NVIDIA L40S", "bfloat16", 362.0),
    ("NVIDIA GeForce RTX 4090", "float16", 165.2),
    ("Tesla V100-SXM2-16GB", "float16", 125.0),
    ("Tesla V100-PCIE-32GB", "float32", 14.0),
])
def test_the_peak_table_finds_each_gpu_by_its_torch_name(name, dtype, tflops):
    assert throughput.gpu_peak(name, dtype)[0] == tflops


@pytest.mark.parametrize("name, dtype", [("Tesla V100-SXM2-16GB", "bfloat16"), ("NVIDIA A10G", "bfloat16"),
                                         ("Some Future GPU", "float32")])
def test_a_gpu_or_dtype_the_table_lacks_has_no_peak(name, dtype):
    assert throughput.gpu_peak(name, dtype) is None


def test_a_longer_name_is_matched_before_its_prefix():
    # "L4" is a prefix of "L40S", "A10" of "A100" and "A10G", "H100" of "H100 PCIe": each gets its own row.
    assert throughput.gpu_peak("NVIDIA L40S", "float32")[1] == "NVIDIA L40S"
    assert throughput.gpu_peak("NVIDIA A100-PCIE-40GB", "float32")[1].startswith("NVIDIA A100")
    assert throughput.gpu_peak("NVIDIA H100 PCIe", "float32")[1] == "NVIDIA H100 PCIe"


def test_the_cpu_probe_is_measured_once_and_then_read_from_the_cache(tmp_path):
    first = throughput.cpu_peak("float32", seconds=0.05, root=tmp_path)
    assert first["tflops"] > 0 and first["threads"] == torch.get_num_threads()
    [cached] = list((tmp_path / "peak").glob("cpu-*.json"))
    # The second call reads the file: a value written there comes back, and nothing is measured again.
    cached.write_text(json.dumps({**first, "tflops": 1234.5}))
    assert throughput.cpu_peak("float32", seconds=0.05, root=tmp_path)["tflops"] == 1234.5
    # Another dtype is another key, measured on its own.
    other = throughput.cpu_peak("bfloat16", seconds=0.05, root=tmp_path)
    assert other["dtype"] == "bfloat16" and len(list((tmp_path / "peak").glob("cpu-*.json"))) == 2


def test_the_user_peak_overrides_the_probe_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv(throughput.PEAK_VARIABLE, "2.5")
    peak = throughput.device_peak(torch.device("cpu"), "float32")
    assert peak.tflops_per_device == 2.5 and peak.source == throughput.PEAK_VARIABLE
    for bad in ("fast", "0", "-3", "inf"):
        monkeypatch.setenv(throughput.PEAK_VARIABLE, bad)
        with pytest.raises(ValueError, match=throughput.PEAK_VARIABLE):
            throughput.device_peak(torch.device("cpu"), "float32")


def _docs():
    # weights[0] is never a target; response tokens are the other tokens of non-zero weight.
    return [Prepared("a", [1, 2, 3, 4], [0.0, 0.0, 1.0, 1.0]), Prepared("b", [5, 6, 7], [0.0, 1.0, 0.5]),
            Prepared("c", [8, 9], [0.0, 1.0])]


def test_the_meter_counts_tokens_flops_and_mfu_from_the_batch():
    peak = throughput.Peak(0.5, "float32", "cpu", "test")
    meter = throughput.Meter(_docs(), active=1000, peak=peak, devices=2)
    got = meter.figures([0, 1], seconds=0.25)
    assert got["tokens"] == 7 and got["response_tokens"] == 4
    assert got["tokens_per_s"] == 7 / 0.25 and got["response_tokens_per_s"] == 4 / 0.25
    assert got["flops"] == budget.flops(1000, [7]) == 6 * 1000 * 7
    assert got["achieved_tflops"] == 6 * 1000 * 7 / 0.25 / 1e12
    assert got["peak_tflops"] == 1.0  # two devices of 0.5
    assert got["mfu"] == got["achieved_tflops"] / 1.0
    record = meter.record()
    assert record["flops_count"] == budget.HOW and record["peak"]["source"] == "test"


def test_an_unknown_peak_gives_no_mfu_but_the_other_figures():
    meter = throughput.Meter(_docs(), active=10, peak=throughput.Peak(None, "bfloat16", "gpu", "unknown"), devices=1)
    got = meter.figures([2], seconds=1.0)
    assert got["mfu"] is None and got["peak_tflops"] is None and got["tokens"] == 2


def test_active_parameters_counts_full_shapes_like_the_budget():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert throughput.active_parameters(model) == budget.active_parameters(model) == 4 * 3 + 3 + 3 * 2 + 2
    # A ZeRO-3 partition (an empty local tensor) counts at the full shape DeepSpeed keeps in ds_shape.
    model[0].weight.data = torch.empty(0)
    model[0].weight.ds_shape = torch.Size([3, 4])
    assert throughput.active_parameters(model) == 4 * 3 + 3 + 3 * 2 + 2


def test_the_receipt_summary_is_over_the_updates_own_seconds():
    receipt = Receipt(0, 1)
    meter = throughput.Meter(_docs(), active=100, peak=throughput.Peak(1.0, "float32", "cpu", "t"), devices=1)
    receipt.throughput = meter.record()
    for batch, seconds in (([0], 0.5), ([1, 2], 1.5)):
        receipt.record_update(seconds, 0, 0, False)
        receipt.record_throughput(meter.figures(batch, seconds))
    run = receipt.throughput_summary()["run"]
    assert run["tokens"] == 9 and run["update_s"] == 2.0 and run["tokens_per_s"] == 4.5
    assert math.isclose(run["mfu"], 6 * 100 * 9 / 2.0 / 1e12)
    assert Receipt.from_state_dict(receipt.state_dict()).update_throughput == receipt.update_throughput


class _Recorder:
    """A monitor that keeps what it is given (DeepSpeed's MonitorMaster has the same two members)."""

    def __init__(self):
        self.enabled, self.events = True, []

    def write_events(self, events):
        self.events += events


def test_the_monitor_keeps_deepspeeds_events_on_nshards_step_and_drops_the_ones_nshard_writes():
    inner = _Recorder()
    engine = types.SimpleNamespace(monitor=inner)
    monitor = observe.Monitor.install(engine)
    assert engine.monitor is monitor
    monitor.samples = 12
    monitor.write_events([("Train/Samples/lr", 0.5, 99), ("Train/Samples/loss_scale", 4.0, 99),
                          ("Train/Samples/train_loss", 7.0, 99)])
    assert inner.events == [("Train/Samples/loss_scale", 4.0, 12)]
    record = {"loss": 1.25, "lr": 3e-4, "update_s": 0.5, "mfu": None, "grad_norm": 2.0, "update": 1}
    monitor.write(record, 12)
    assert inner.events[1:] == [("Train/Samples/train_loss", 1.25, 12), ("Train/Samples/lr", 3e-4, 12),
                                ("Train/Samples/update_s", 0.5, 12), ("Train/Samples/grad_norm", 2.0, 12)]


def test_no_monitor_is_installed_when_the_ds_config_enables_none():
    inner = _Recorder()
    inner.enabled = False
    engine = types.SimpleNamespace(monitor=inner)
    assert observe.Monitor.install(engine) is None and engine.monitor is inner


def test_the_report_shows_the_slowest_ranks_throughput_with_its_peak_and_count():
    from nshard.analysis.report import _mfu_cell, _tokens_cell, throughput_block

    def receipt(update_s, tokens_per_s, mfu):
        return {"throughput": {"flops_count": budget.HOW, "devices": 2,
                               "peak": {"tflops_per_device": 0.5, "source": "matmul probe (512x512 ...), cached"},
                               "run": {"update_s": update_s, "tokens_per_s": tokens_per_s, "response_tokens_per_s": 10.0,
                                       "achieved_tflops": 0.25, "peak_tflops": 1.0, "mfu": mfu}}}

    block = throughput_block([receipt(2.0, 100.0, 0.25), receipt(3.0, 66.0, 0.2)])
    assert block["update_s"] == 3.0 and block["flops_count"] == budget.HOW
    assert _tokens_cell({"throughput": block}) == "66 (10)"
    assert _mfu_cell({"throughput": block}) == "20.00% of 1 TFLOP/s (2 x 0.5, matmul probe)"
    assert throughput_block([receipt(2.0, 1.0, 0.1), {"rank": 1}]) is None  # an older receipt: no figure
    assert _tokens_cell({"throughput": None}) == "—"


def test_without_clipping_stage_0_s_norm_is_taken_from_the_reduced_grads_at_the_boundary():
    """fp32 stage 0 with gradient_clipping 0: DeepSpeed computes no norm, so GradNorm takes it from .grad when step()
    runs at the accumulation boundary (not between microbatches), before the step changes anything."""
    import types

    from nshard.seam.observe import GradNorm

    module = torch.nn.Linear(3, 2)
    module.weight.grad, module.bias.grad = torch.full((2, 3), 2.0), torch.tensor([1.0, -2.0])
    boundary, stepped = [False], []
    engine = types.SimpleNamespace(
        zero_optimization_stage=lambda: 0, bfloat16_enabled=lambda: False, fp16_enabled=lambda: False,
        gradient_clipping=lambda: 0.0, is_gradient_accumulation_boundary=lambda: boundary[0], module=module,
        step=lambda: stepped.append(True))
    norm = GradNorm(engine)
    assert norm.source.startswith("nshard")
    engine.step()  # not at the boundary: no norm
    assert norm.take() is None and stepped == [True]
    boundary[0] = True
    engine.step()
    assert norm.take() == pytest.approx(math.sqrt(6 * 4 + 1 + 4)) and len(stepped) == 2


def test_an_achieved_rate_above_the_probes_peak_gives_no_mfu_and_the_next_run_probes_again(tmp_path):
    """A CPU probe that read low (measured under load) would make MFU exceed 100%: the figure is then null, and the
    run removes the cached probe so that the next run measures it again."""
    cached = tmp_path / "cpu-x.json"
    cached.write_text("{}")
    peak = throughput.Peak(1e-9, "float32", "cpu", "matmul probe (test), cached", probe_path=str(cached))
    meter = throughput.Meter(_docs(), active=1000, peak=peak, devices=1)
    got = meter.figures([0, 1], seconds=0.25)
    assert got["achieved_tflops"] > got["peak_tflops"] and got["mfu"] is None
    assert not cached.exists()
    assert throughput.mfu(0.5, 1.0) == 0.5 and throughput.mfu(1.5, 1.0) is None
