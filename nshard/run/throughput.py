"""Per-update throughput: tokens/s, achieved FLOP/s by the budget's count (nshard/run/budget.py: 6 x active
parameters per token x document tokens), MFU against the device's peak (a datasheet table for GPUs, a cached
matmul probe on a CPU, or NSHARD_PEAK_TFLOPS), and the PowerSGD residual's global norm."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock

from nshard.files import cache_root, note_one_time_work, write_json_atomic
from nshard.run import budget as budget_mod

PEAK_VARIABLE = "NSHARD_PEAK_TFLOPS"
"""A user's per-device peak in TFLOP/s (dense, the run's dtype); it overrides the table and the probe."""

# Dense (no structured sparsity) peak TFLOP/s per GPU, from the vendors' datasheets: NVIDIA H100 Tensor Core GPU
# datasheet (SXM, PCIe, NVL), H200 datasheet (SXM, NVL), A100 datasheet (40/80 GB, SXM and PCIe alike), L4, L40,
# L40S datasheets, NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090: FP16/BF16 tensor with FP32
# accumulate, which torch uses), A10 datasheet, V100 datasheet (SXM2, PCIe; V100S); a datasheet's "with sparsity"
# figure is halved. fp32 is the non-tensor FP32 rate: torch leaves TF32 matmuls off by default. V100 has no bf16
# units. The A10G has no NVIDIA datasheet (AWS's part, not the A10) and is left out rather than guessed: give its
# peak with NSHARD_PEAK_TFLOPS, as for any GPU not listed. First match of the name wins, so a longer name comes first.
GPU_PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H100 NVL", "NVIDIA H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H100 PCIe", "NVIDIA H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    ("H100", "NVIDIA H100 SXM", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H200 NVL", "NVIDIA H200 NVL", {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0}),
    ("H200", "NVIDIA H200 SXM", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("A100", "NVIDIA A100 (40/80 GB)", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", "NVIDIA L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("L40", "NVIDIA L40", {"bfloat16": 181.0, "float16": 181.0, "float32": 90.5}),
    ("L4", "NVIDIA L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    ("A10G", "NVIDIA A10G", {}),
    ("A10", "NVIDIA A10", {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
    ("RTX 4090", "NVIDIA GeForce RTX 4090", {"bfloat16": 165.2, "float16": 165.2, "float32": 82.6}),
    ("V100S", "NVIDIA V100S PCIe", {"float16": 130.0, "float32": 16.4}),
    ("V100-SXM", "NVIDIA V100 SXM2", {"float16": 125.0, "float32": 15.7}),
    ("V100", "NVIDIA V100 PCIe", {"float16": 112.0, "float32": 14.0}),
)

PROBE_SECONDS = 2.0
PROBE_SIZE = 512  # square fp32 matmuls this size ran at the machine's best rate (256 to 1024 alike, AVX2 EPYC)


@dataclass(frozen=True)
class Peak:
    """What MFU divides by: one device's dense peak in the run's dtype, and where the figure came from."""
    tflops_per_device: float | None
    """None: unknown (a GPU the table lacks); MFU is then null and the source says how to give it."""
    dtype: str
    device: str
    source: str
    probe_path: str | None = None
    """The CPU probe's cached record, which a run whose achieved rate exceeds it removes (the probe read low, e.g.
    under load), so that the next run measures it again."""


def gpu_peak(name: str, dtype: str) -> tuple[float, str] | None:
    """(TFLOP/s, the table's entry) for a CUDA device name as torch.cuda.get_device_name() gives it."""
    for pattern, label, peaks in GPU_PEAK_TFLOPS:
        if pattern.lower() in name.lower():
            return (peaks[dtype], label) if dtype in peaks else None
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_key(dtype: str) -> dict:
    """What a CPU probe's figure depends on: the CPU, torch's kernels and its thread count, the dtype."""
    return {"cpu": _cpu_name(), "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "dtype": dtype}


def probe_matmul_tflops(dtype: str, seconds: float = PROBE_SECONDS, size: int = PROBE_SIZE) -> float:
    """The best rate of square matmuls in `dtype` on this process's threads over about `seconds` (TFLOP/s)."""
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)  # not torch's global state: a resumed run has just restored it
    a = torch.randn(size, size, generator=generator).to(torch_dtype)
    b = torch.randn(size, size, generator=generator).to(torch_dtype)
    a @ b  # first call: kernel selection, page faults
    best, ends = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < ends or best == 0.0:
        t0, k = time.perf_counter(), 0
        while k < 4 or time.perf_counter() - t0 < 0.05:
            a @ b
            k += 1
        best = max(best, 2 * size ** 3 * k / (time.perf_counter() - t0) / 1e12)
    return best


def cpu_peak(dtype: str, seconds: float = PROBE_SECONDS, root: Path | None = None) -> dict:
    """The probe's record for this CPU, measured once and kept under the cache root (peak/cpu-<key>.json); ranks
    on one host wait on one lock, so one measures while the others are idle and then read its record."""
    key = probe_key(dtype)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = (root or cache_root()) / "peak"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cpu-{digest}.json"
    with FileLock(folder / f"cpu-{digest}.lock"):
        if path.is_file():
            return {**json.loads(path.read_text()), "path": str(path)}
        record = {**key, "tflops": probe_matmul_tflops(dtype, seconds), "matmul": f"{PROBE_SIZE}x{PROBE_SIZE}",
                  "seconds": seconds, "measured_at": time.time()}
        write_json_atomic(path, record)
        note_one_time_work(f"measured this CPU's {dtype} matmul peak ({path})")
        return {**record, "path": str(path)}


def device_peak(device: torch.device, dtype: str) -> Peak:
    """The peak MFU divides by for one device of this run: NSHARD_PEAK_TFLOPS, else the GPU table, else (CPU) the
    cached matmul probe."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    given = os.environ.get(PEAK_VARIABLE)
    if given:
        try:
            value = float(given)
        except ValueError:
            value = -1.0
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{PEAK_VARIABLE}={given!r}: give one device's dense peak in TFLOP/s, a positive "
                             "number such as 989 (or unset it to use the table or the CPU probe)")
        return Peak(value, dtype, name, f"{PEAK_VARIABLE}")
    if device.type == "cuda":
        found = gpu_peak(name, dtype)
        if found is None:
            return Peak(None, dtype, name, f"no datasheet entry for {name!r} in {dtype}: set {PEAK_VARIABLE}")
        return Peak(found[0], dtype, name, f"datasheet: {found[1]}, dense {dtype} (nshard/run/throughput.py)")
    record = cpu_peak(dtype)
    return Peak(record["tflops"], dtype, name, f"matmul probe ({record['matmul']} {dtype}, {record['threads']} "
                                               f"threads, best rate over {record['seconds']} s), cached",
                probe_path=record.get("path"))


def active_parameters(module: torch.nn.Module) -> int:
    """budget.active_parameters with every parameter at its full shape (a ZeRO-3 partition counts as the whole
    parameter: DeepSpeed keeps that shape in ds_shape), counted on the meta device."""
    named = [(n, torch.empty(tuple(getattr(p, "ds_shape", p.shape)), device="meta"))
             for n, p in module.named_parameters()]

    class FullShapes:
        config = getattr(module, "config", None)

        def parameters(self):
            return (p for _, p in named)

        def named_parameters(self):
            return iter(named)

    return budget_mod.active_parameters(FullShapes())


def mfu(achieved_tflops: float, peak_tflops: float | None) -> float | None:
    """achieved / peak; None without a peak, or when the achieved rate exceeds it (the peak is then wrong, not the
    run: a CPU probe that read low)."""
    if not peak_tflops or achieved_tflops > peak_tflops:
        return None
    return achieved_tflops / peak_tflops


class Meter:
    """One update's figures from its batch and seconds: every rank computes the same counts from the schedule."""

    def __init__(self, prepared, active: int, peak: Peak, devices: int):
        self.tokens = [len(p.input_ids) for p in prepared]
        # A response token is a target: weights[0] is never one (nothing predicts the first token).
        self.response = [sum(1 for w in p.weights[1:] if w) for p in prepared]
        self.active, self.peak, self.devices = active, peak, devices
        self.peak_tflops = peak.tflops_per_device * devices if peak.tflops_per_device else None

    def figures(self, batch: list[int], seconds: float) -> dict:
        tokens = sum(self.tokens[i] for i in batch)
        flops = budget_mod.flops(self.active, [tokens])
        achieved = flops / seconds / 1e12
        if self.peak_tflops and achieved > self.peak_tflops and self.peak.probe_path:
            Path(self.peak.probe_path).unlink(missing_ok=True)  # it read low: the next run measures it again
        return {"tokens": tokens, "response_tokens": sum(self.response[i] for i in batch),
                "tokens_per_s": tokens / seconds,
                "response_tokens_per_s": sum(self.response[i] for i in batch) / seconds,
                "flops": flops, "achieved_tflops": achieved, "peak_tflops": self.peak_tflops,
                "mfu": mfu(achieved, self.peak_tflops)}

    def record(self) -> dict:
        """How the figures were counted, for the receipts."""
        return {"flops_count": budget_mod.HOW, "active_parameters_per_token": self.active, "devices": self.devices,
                "peak": asdict(self.peak), "peak_tflops": self.peak_tflops,
                "mfu": "achieved_tflops / peak_tflops: the count's FLOPs / update seconds / (devices x one device's "
                       "dense peak)"}


def meter(engine, prepared, world: int) -> Meter:
    """The run's Meter: the engine's module counted at full shape, one device per rank at its dtype's peak."""
    dtype = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
    return Meter(prepared, active_parameters(engine.module), device_peak(engine.device, dtype), world)


def compression_error(seam, device) -> dict:
    """{"compression_error_norm": ...} after an update that compressed, else {} (see compression_error_norm)."""
    norm = compression_error_norm(seam, device)
    return {} if norm is None else {"compression_error_norm": norm}


def compression_error_norm(seam, device) -> float | None:
    """PowerSGD's residual after an update: the global 2-norm, over every rank and compressed matrix, of the
    error memory once it settled, which is M - the delivered output (M = the summed gradient plus the previous
    error). None for a reducer without error memory, or an update that compressed nothing. One scalar
    all-reduce (torch.distributed, outside the gradient byte count)."""
    state = getattr(getattr(seam, "reducer", None), "state", None)
    errors = getattr(getattr(state, "errors", None), "tensors", None)
    if not errors or not seam.last_update_compressed():
        return None
    import torch.distributed as dist

    local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(errors.values())))).double() ** 2
    total = local.to(device).reshape(1)
    dist.all_reduce(total)
    return math.sqrt(total.item())


def summary(update_s: list[float], tokens: list[int], response_tokens: list[int], flops: list[int],
            peak_tflops: float | None) -> dict:
    """Whole-run throughput over the updates' own seconds (state saves and checks excluded)."""
    seconds = math.fsum(update_s)
    if not seconds:
        return {}
    achieved = sum(flops) / seconds / 1e12
    return {"tokens": sum(tokens), "response_tokens": sum(response_tokens), "flops": sum(flops),
            "update_s": seconds, "tokens_per_s": sum(tokens) / seconds,
            "response_tokens_per_s": sum(response_tokens) / seconds, "achieved_tflops": achieved,
            "peak_tflops": peak_tflops, "mfu": mfu(achieved, peak_tflops)}
