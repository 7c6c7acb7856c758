"""Per-rank receipts of time, memory and bytes, the per-update metrics log, and the parameter root."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from nshard.files import write_json_atomic, write_text_atomic

PROCESS_START = psutil.Process().create_time()
"""When the kernel started this process (psutil; a DeepSpeed dependency), imports included."""

_MARKS: list[tuple[str, float]] = []


def mark(phase: str) -> None:
    """The end of one start-up phase of this process (imports, process group, inputs, engine), in wall time."""
    _MARKS.append((phase, time.time()))


def startup(first_update_at: float) -> dict:
    """This process's start-up: from the kernel starting it to its first update, by phase, and the one-time work
    (shared caches filled) it did meanwhile; what a timed arm paid before it trained."""
    from nshard.files import ONE_TIME_WORK

    phases, before = {}, PROCESS_START
    for phase, at in _MARKS:
        phases[phase] = at - before
        before = at
    phases["to first update"] = first_update_at - before
    return {"s": first_update_at - PROCESS_START, "phases": phases, "one_time_work": list(ONE_TIME_WORK)}


def parameter_root(named_params) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(named_params, key=lambda kv: kv[0]):
        t = p.detach().contiguous().cpu()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():  # hashlib reads the tensor's own memory (a host tensor is not copied)
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started its program. Linux's VmHWM belongs to the address space
    that exec made; ru_maxrss does not: exec keeps the larger of the parent's resident set at fork and its own, so
    a small process started by a large one (a serving measurement started by the study) reports the parent's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; the fallback elsewhere


def peak_memory_bytes(gpu_phases: dict) -> dict:
    """The process's peak resident set (peak_rss_bytes) and, on a GPU, the peak allocated and reserved GPU memory
    over the phases (GpuPeaks resets the peaks at each one), with each phase's own peaks."""
    out = {"peak_rss_bytes": peak_rss_bytes()}
    if gpu_phases:
        for key in GpuPeaks.KEYS:
            out[key] = max(phase[key] for phase in gpu_phases.values())
        out["gpu_memory_by_phase"] = gpu_phases
        out["expandable_segments"] = expandable_segments()
    return out


class GpuPeaks:
    """Peak GPU memory allocated (tensors) and reserved (the caching allocator's segments) since the last start();
    take() is None without CUDA."""

    KEYS = ("peak_allocated_bytes", "peak_reserved_bytes")

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def take(self) -> dict | None:
        if not self.cuda:
            return None
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def expandable_segments() -> dict:
    """Whether PYTORCH_CUDA_ALLOC_CONF asked for expandable segments and whether the allocator's segments are
    expandable (None: no segment to look at); a torch build without them ignores the setting with a warning."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    segments = torch.cuda.memory_snapshot()
    return {"alloc_conf": conf, "requested": "expandable_segments:true" in conf.replace(" ", "").lower(),
            "in_effect": all(s.get("is_expandable", False) for s in segments) if segments else None,
            "segments": len(segments)}


@dataclass
class Receipt:
    rank: int
    world_size: int
    update_s: list[float] = field(default_factory=list)
    update_grad_bytes: list[int] = field(default_factory=list)
    update_compressed: list[bool] = field(default_factory=list)
    update_parameter_bytes: list[int] = field(default_factory=list)
    """Bytes of other collectives per update: under ZeRO-1/2, the all-gather of the updated parameters."""
    active_s: float = 0.0
    other_collective_bytes: int = 0
    state_s: float = 0.0
    """Seconds spent saving complete states and comparing replicas (kept out of active_s)."""
    state_saves: list[dict] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)
    """The update each --resume continued from (empty: one uninterrupted process)."""
    elastic: list[dict] = field(default_factory=list)
    """Each resume onto another world size (nshard/run/elastic.py): the world sizes, ZeRO stage, the rule applied to
    the error memory and the error-feedback total before and after, the gathered optimizer state's SHA-256."""
    where_and_link: dict = field(default_factory=dict)  # host, net_namespace, link byte counts (nshard/run/netcount.py)
    update_peak_allocated_bytes: list[int] = field(default_factory=list)
    update_peak_reserved_bytes: list[int] = field(default_factory=list)
    """GPU runs: each update's peaks (reset at its start); empty on the CPU."""
    gpu_phases: dict = field(default_factory=dict)
    """GPU runs: peak allocated and reserved bytes per phase ("setup", "updates", "export"), max over resumes."""
    deepspeed_grad_bytes: int = 0
    """Bytes DeepSpeed's own gradient collectives carried (its comms logger's count), whatever seam was installed."""
    update_delta_gap: list[float] = field(default_factory=list)
    """Delta parameter sync: the largest |master − replica| over all ranks after each update (empty otherwise)."""
    update_experts: list[dict] = field(default_factory=list)
    """A sparse model: each update's router load per layer and expert (all ranks), dead experts, dropped tokens and
    the probe's routing digest, identical on every rank (nshard/run/experts.py); empty for a dense model."""
    update_throughput: list[dict] = field(default_factory=list)
    """Each update's tokens, response tokens, FLOPs by the budget's count, tokens/s, achieved TFLOP/s, MFU and
    the global gradient norm after reduction (nshard/run/throughput.py), as metrics.jsonl has them."""
    throughput: dict = field(default_factory=dict)
    """How those were counted: the FLOP count, active parameters per token, the peak MFU divides by and its source,
    where the gradient norm comes from."""
    update_phases: list[dict] = field(default_factory=list)
    """Each update's seconds by phase (nshard/phases.py PHASES and "rest", summing to its update_s), as metrics.jsonl
    has them; a state saved before phases were recorded leaves its updates out (the lists end with update_s)."""
    update_phase_detail: list[dict] = field(default_factory=list)
    """Each update's named parts of its phases (nshard/phases.py DETAIL: PowerSGD's P/Q products,
    orthogonalization and error update within reducer_compute; the parameters' collectives within collective_wait)."""
    update_microbatch_s: list[list[float]] = field(default_factory=list)
    """Each update's forward_backward seconds per microbatch of this rank (summing to its forward_backward)."""
    compression_error_norm: float | None = None
    """After the last update, the global 2-norm of PowerSGD's error memory: what the optimizer did not receive of the
    summed gradient (nshard/run/throughput.py compression_error_norm); None when that update did not compress."""

    def record_update(self, seconds: float, grad_bytes: int, other_bytes: int, compressed: bool,
                      gpu: dict | None = None, deepspeed_grad_bytes: int = 0, timing: dict | None = None) -> None:
        """One update's figures; `timing` is nshard.phases.PhaseClock.stop()'s split of its seconds."""
        self.update_s.append(seconds)
        if timing is not None:
            self.update_phases.append(timing["phases"])
            self.update_phase_detail.append(timing["detail"])
            self.update_microbatch_s.append(timing["microbatch_s"])
        self.deepspeed_grad_bytes += deepspeed_grad_bytes
        self.update_grad_bytes.append(grad_bytes)
        self.update_compressed.append(compressed)
        self.update_parameter_bytes.append(other_bytes)
        self.other_collective_bytes += other_bytes
        if gpu is not None:
            self.update_peak_allocated_bytes.append(gpu["peak_allocated_bytes"])
            self.update_peak_reserved_bytes.append(gpu["peak_reserved_bytes"])
            self.record_gpu_phase("updates", gpu)

    def record_gpu_phase(self, phase: str, gpu: dict | None) -> None:
        if gpu is not None:
            before = self.gpu_phases.get(phase, {})
            self.gpu_phases[phase] = {key: max(gpu[key], before.get(key, 0)) for key in GpuPeaks.KEYS}

    def record_throughput(self, figures: dict) -> None:
        self.update_throughput.append(figures)

    def throughput_summary(self) -> dict:
        """The whole run's figures over its updates' own seconds (a state saved before throughput was recorded
        leaves its updates out)."""
        from nshard.run.throughput import summary

        done = self.update_throughput
        seconds = self.update_s[len(self.update_s) - len(done):]
        return {**self.throughput, "run": summary(seconds, [f["tokens"] for f in done],
                                                  [f["response_tokens"] for f in done], [f["flops"] for f in done],
                                                  self.throughput.get("peak_tflops"))}

    def state_dict(self) -> dict:
        """The counters so far, saved with every complete state so a resumed run's receipt covers the whole run."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> "Receipt":
        return cls(**state)

    def by_phase(self) -> dict:
        """Dense (warm-up or uncompressed) and compressed updates apart: count, median seconds, median bytes, and
        where the seconds went (the updates that recorded phases): each phase's median (median_phase_s, PHASES and
        "rest"), its detail's (median_phase_detail_s), and largest_phase, the phase with the largest median."""
        out = {}
        first = len(self.update_s) - len(self.update_phases)  # the first update with phases
        for phase, flag in (("dense", False), ("compressed", True)):
            idx = [i for i, c in enumerate(self.update_compressed) if c == flag]
            out[phase] = {"updates": len(idx),
                          "median_update_s": statistics.median(self.update_s[i] for i in idx) if idx else None,
                          "median_grad_bytes": statistics.median(self.update_grad_bytes[i] for i in idx) if idx else None,
                          **phase_medians([self.update_phases[i - first] for i in idx if i >= first],
                                          [self.update_phase_detail[i - first] for i in idx if i >= first])}
        return out

    def finish(self, path: Path, root: str, active_plus_checkpoint_s: float, extra: dict) -> dict:
        body = {
            "rank": self.rank,
            "world_size": self.world_size,
            "updates": len(self.update_s),
            "active_s": self.active_s,
            "active_plus_checkpoint_s": active_plus_checkpoint_s,
            "process_s": time.time() - PROCESS_START,
            "process_start_at": PROCESS_START,
            "update_s": self.update_s,
            "grad_collective_bytes": sum(self.update_grad_bytes),
            "update_grad_bytes": self.update_grad_bytes,
            "update_compressed": self.update_compressed,
            "other_collective_bytes": self.other_collective_bytes,
            "update_parameter_bytes": self.update_parameter_bytes,
            "update_delta_gap": self.update_delta_gap,
            "update_experts": self.update_experts,
            "update_throughput": self.update_throughput,
            "throughput": self.throughput_summary(),
            "by_phase": self.by_phase(),
            "phases": phases_record(),
            "update_phases": self.update_phases,
            "update_phase_detail": self.update_phase_detail,
            "update_microbatch_s": self.update_microbatch_s,
            "state_s": self.state_s,
            "state_saves": self.state_saves,
            "resumed_from_update": self.resumed_from[-1] if self.resumed_from else None,
            "resumed_from_updates": self.resumed_from,
            "elastic": self.elastic,
            "parameter_root": root,
            **peak_memory_bytes(self.gpu_phases),
            "update_peak_allocated_bytes": self.update_peak_allocated_bytes,
            "update_peak_reserved_bytes": self.update_peak_reserved_bytes,
            **self.where_and_link,
            **extra,
        }
        write_json_atomic(path, body)
        return body


def phase_medians(phases: list[dict], detail: list[dict]) -> dict:
    """The median of each phase and detail over some updates' splits, and the phase with the largest median (None
    without any update)."""
    if not phases:
        return {"median_phase_s": None, "median_phase_detail_s": None, "largest_phase": None}
    medians = {name: statistics.median(p[name] for p in phases) for name in phases[0]}
    return {"median_phase_s": medians,
            "median_phase_detail_s": {name: statistics.median(d[name] for d in detail) for name in detail[0]},
            "largest_phase": max(medians, key=medians.get)}


def synchronized(clock) -> str:
    """How the clock met the device: waited at every boundary, or not (the CPU, or CUDA with NSHARD_PHASE_SYNC=0)."""
    from nshard.phases import SYNC_VARIABLE

    if clock.sync is not None:
        return ("torch.cuda.synchronize() at every phase boundary; the reducer's detail (powersgd_pq, orthogonalize, "
                "error_update) by CUDA events on the stream, without a wait")
    if clock.on_cuda:
        return (f"none ({SYNC_VARIABLE}=0): each phase is the host's time in it; the update's time is exact (one "
                f"synchronization at its end)")
    return "no device synchronization (the CPU)"


def phases_record() -> dict:
    """For the receipt: what each phase holds and how it was clocked."""
    from nshard.phases import CLOCK, DETAIL, PHASES, REST, WHAT

    return {"order": [*PHASES, REST], "what": WHAT, "detail_of": DETAIL,
            "synchronized": synchronized(CLOCK),
            "exclusive": "a phase entered inside another is taken out of it; rest is what no phase claims, so "
                         "the phases sum to update_s"}


def metrics_through(path: Path, update: int) -> list[str]:
    """The lines of metrics.jsonl for updates 1..update, which must be its first lines, in order (later ones came
    from updates a crashed run did not save). ValueError names the first line that breaks this."""
    lines = path.read_text().splitlines()[:update] if path.exists() else []
    for number, line in enumerate(lines, start=1):
        try:
            found = f"update {json.loads(line)['update']!r}"
        except (ValueError, KeyError, TypeError):
            found = "no metrics record"
        if found != f"update {number}":
            raise ValueError(f"line {number} of {path.name} is {found}, not update {number}")
    if len(lines) < update:
        raise ValueError(f"{path.name} holds only {len(lines)} update lines")
    return lines


class MetricsLog:
    """metrics.jsonl, one line per update, written by rank 0 only; other ranks get a null log with the same calls.

    A resumed run keeps the lines up to its resume point and drops any written after it (they came
    from updates the crashed run did not save), so the file covers the whole run once.
    """

    def __init__(self, path: Path | None, resume_after: int = 0):
        if path and resume_after:  # the kept lines, byte for byte, replace the file in one rename
            write_text_atomic(path, "".join(line + "\n" for line in metrics_through(path, resume_after)))
        self._file = path.open("a" if resume_after else "w") if path else None

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
