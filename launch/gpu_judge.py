"""What each step of the GPU check (launch/gpu_check.py) must show, and the figures it exists for, each judged: a
training step against its receipts, a script against its JSON, and the derived figures with a stated bound or band, so
that no figure is printed without a verdict and no check passes without the work done (docs/gpu.md)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from nshard.phases import DETAIL

WARMUP = 2
"""Dense warm-up updates of the check's own PowerSGD ds_configs: the rest of the plan's updates must be compressed."""
UNSYNCED = "train-bf16-powersgd-unsynced"
TWO = "train-powersgd-shipped-two-processes"
"""ds_configs/powersgd.json as shipped (fp32 stage 0, rank 32, 8 dense warm-up updates) in two processes on one GPU
over gloo."""
TWIN = "train-powersgd-shipped-two-processes-all-dense"
"""TWO's twin: the same ds_config with every update a dense warm-up update."""
CLOCK_BOUND = 0.01
"""What the phase breakdown may add to an update on CUDA (issue 38): its synchronized median compressed update over the
unsynchronized twin's, minus one."""
PHASE_SUM_TOLERANCE = 0.02
"""Each update's phases, rest included, sum to its time within this share (the receipt's arithmetic)."""
REST_BOUND = 0.10
"""On a synchronized clock the named phases claim all but this share of every update: `rest` (building microbatches,
the closing wait) stays below it, so a phase clock that misses where the time goes fails the step."""
UPDATES_SHARE_OF_ACTIVE = 0.70
"""The updates' own seconds (update_s, each timed from its start to the device's end) are at least this share of the
run's active seconds (the whole training loop, state saves and replica checks excluded) and at most all of it: an
update timer that stops before the device has finished leaves its kernels to the loop around it, and fails here."""
MAX_FALLBACK_SHARE = 0.05
"""PowerSGD's orthogonalizations that CholeskyQR2 may hand to Householder QR: past 5% the fast path is not the path
that ran, and the orthogonalize figures describe Householder."""
MEMORY_BAND = (0.90, 1.10)
"""The 1.7B step's measured peak allocation against analysis/memory_model.py: at least 90% of the parts the model
counts exactly (weights, gradients, fp32 masters, AdamW moments: everything but the activations, which it bounds from
above with every document at max_length) and at most 110% of its whole prediction (the 10% a plan must leave free)."""


@dataclass(frozen=True)
class Expect:
    """What a training step's receipts must show: what it is about."""

    reducer: str
    """receipt "reducer": "deepspeed" (DeepSpeed's all-reduce) or "powersgd"."""
    stage: int
    compute: str
    """receipt precision.compute: "float32" or "bfloat16"."""
    wrapper: str
    """The optimizer DeepSpeed wraps around torch's AdamW."""
    compressed: bool = False
    """Every update after the warm-up compressed (and none otherwise)."""
    error_sums: bool = False
    """microbatch_sums = "error": each compressed update's microbatches summed in the error memory."""
    delta_bits: int | None = None
    """Delta parameter sync at these bits: a sync per update, its gap recorded."""
    experts: int | None = None
    """A sparse model with this many experts per layer."""
    phase_sync: bool = True
    """The phase clock synchronized the device at each phase boundary (false: NSHARD_PHASE_SYNC=0, the clock's cost
    measured against it)."""
    warmup: int = WARMUP
    """The ds_config's dense warm-up updates."""
    world: int = 1
    """Ranks: each writes a receipt, and all must hold the same parameter root."""
    backend: str | None = None
    """The process group's backend; None: NCCL on CUDA, gloo on the CPU."""


def update_times(receipt: dict, compressed: bool) -> list[float]:
    return [s for s, c in zip(receipt["update_s"], receipt["update_compressed"]) if c == compressed]


def median_updates(receipt: dict, compressed: bool) -> float | None:
    times = update_times(receipt, compressed)
    return statistics.median(times) if times else None


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """rank 0's receipt and metrics.jsonl's records (OSError or ValueError if either is missing or broken)."""
    receipt = json.loads((run_dir / "receipts" / "rank-0.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return receipt, metrics


def read_roots(run_dir: Path) -> list[str]:
    """Every rank's parameter root, from its receipt, in rank order."""
    paths = sorted((run_dir / "receipts").glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()).get("parameter_root") for p in paths]


def training_checks(expect: Expect, receipt: dict, metrics: list[dict], updates: int, cuda: bool = True,
                    roots: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(what held, what failed) of one training step's receipt and metrics against what the step is about; `roots`:
    every rank's parameter root (read_roots), which must be `expect.world` equal ones."""
    held, failed = [], []

    def check(ok: bool, text: str) -> None:
        (held if ok else failed).append(text)

    compressed = sum(bool(c) for c in receipt.get("update_compressed", []))
    ran = receipt.get("reduction_ran") or {}
    check(receipt.get("updates") == updates == len(metrics), f"{updates} updates in the receipt and metrics.jsonl "
          f"(receipt {receipt.get('updates')}, metrics {len(metrics)})")
    check(all(math.isfinite(m.get("loss", math.nan)) for m in metrics), "every update's loss is finite")
    device = "cuda" if cuda else "cpu"
    backend = expect.backend or ("nccl" if cuda else "gloo")
    check(str(receipt.get("device")).startswith(device), f"trained on {device} (receipt: {receipt.get('device')})")
    check((receipt.get("link") or {}).get("backend") == backend, f"process group {backend}")
    check(receipt.get("world_size", 1) == expect.world,
          f"{expect.world} rank(s) (receipt: {receipt.get('world_size')})")
    if roots is not None:
        check(len(roots) == expect.world and len(set(roots)) == 1 and None not in roots,
              f"every rank's receipt holds the same parameter root ({[str(r)[:12] for r in roots]})")
    if cuda:
        check((receipt.get("peak_allocated_bytes") or 0) > 0, "GPU peak memory recorded")
    check(receipt.get("zero_stage") == expect.stage, f"ZeRO stage {expect.stage} (receipt: {receipt.get('zero_stage')})")
    check(receipt.get("reducer") == expect.reducer, f"reducer {expect.reducer} (receipt: {receipt.get('reducer')})")
    check((receipt.get("precision") or {}).get("compute") == expect.compute, f"computed in {expect.compute}")
    check((receipt.get("optimizer") or {}).get("wrapper") == expect.wrapper,
          f"optimizer {expect.wrapper} (receipt: {receipt.get('optimizer')})")
    check(not receipt.get("state_saves"), "no complete state saved (checkpoint.final = false: the check keeps no "
          f"state of the model's size; receipt: {len(receipt.get('state_saves') or [])})")
    link = receipt.get("link") or {}
    compared = [link.get(k) for k in ("ledger_matches_logger", "delta_matches_logger") if link.get(k) is not None]
    if compared:
        check(all(compared), "the reducer ledger and delta bytes agree with DeepSpeed's comms logger")
    else:
        held.append("the reducer ledger and delta bytes: not compared (DeepSpeed's comms logger is off)")
    if expect.reducer == "powersgd":
        numerics = receipt.get("numerics") or {}
        check(numerics.get("error_memory_dtype") == "float32" and str(numerics.get("reducer_fp32_matmuls", ""))
              .startswith("full fp32"), f"the reducer's numerics pinned: fp32 error memory, full-fp32 matmuls "
              f"(receipt: {numerics or None})")
    if expect.compressed:
        want = updates - expect.warmup
        check(compressed == want > 0, f"compressed updates {compressed}, expected {want} (> 0)")
        calls = ran.get("nshard_compressed_calls")
        check(calls == compressed and (calls or 0) > 0, f"reducer ledger: {calls} compressed calls (> 0)")
        check((receipt.get("compression_error_norm_after_last_update") or 0) > 0,
              f"a compression error after the last update, > 0 (receipt: "
              f"{receipt.get('compression_error_norm_after_last_update')})")
        orth = receipt.get("orthogonalization") or {}
        matrices, fallbacks = orth.get("matrices") or 0, orth.get("fallbacks")
        check(matrices > 0 and fallbacks is not None and fallbacks <= MAX_FALLBACK_SHARE * matrices,
              f"orthogonalization fallbacks {fallbacks} of {matrices} matrices, at most {MAX_FALLBACK_SHARE:.0%}")
    else:
        check(compressed == 0, f"no compressed update (receipt: {compressed})")
    if expect.error_sums:
        sums = {m.get("microbatch_sums") for m in metrics if m.get("compressed")}
        check(sums == {"error memory"}, f"compressed updates summed their microbatches in the error memory ({sums})")
    if expect.delta_bits is not None:
        delta_checks(expect, receipt, updates, check)
    phase_checks(expect, receipt, updates, cuda, check)
    if expect.experts is not None:
        experts = receipt.get("experts") or {}
        check(experts.get("experts") == expect.experts and (experts.get("layers") or 0) > 0,
              f"a sparse model with {expect.experts} experts per layer (receipt: {experts.get('experts')})")
    return held, failed


def delta_checks(expect: Expect, receipt: dict, updates: int, check) -> None:
    gather = receipt.get("parameter_all_gather") or {}
    calls = ((gather.get("calls") or {}).get("delta") or {}).get("calls", 0)
    check(calls > 0, f"delta syncs ran ({calls} calls, > 0)")
    sent = ((gather.get("calls") or {}).get("delta") or {}).get("bytes_sent", 0)
    world = receipt.get("world_size", 1)
    # One rank has no peer: the codec encodes and applies on the device, nothing is exchanged (delta's exchange
    # on NCCL needs two GPUs; its gloo twin runs in the suite, tests/test_delta_sync.py).
    check(sent > 0 if world > 1 else sent == 0,
          f"delta bytes exchanged: {sent} ({'> 0' if world > 1 else '0 on one rank: codec only, no exchange'})")
    check((gather.get("delta_codec") or {}).get("bits") == expect.delta_bits, f"delta codec at {expect.delta_bits} bits")
    gaps = receipt.get("update_delta_gap") or []
    check(len(gaps) == updates and all(math.isfinite(g) for g in gaps), "a finite delta gap after each update")
    check(any(g > 0 for g in gaps), "the codec quantized real changes (a gap > 0 after some update)")


def phase_checks(expect: Expect, receipt: dict, updates: int, cuda: bool, check) -> None:
    """The phase clock against the update's wall time: the phases (rest included) sum to each update, the named ones
    claim all but REST_BOUND of it on a synchronized clock, no detail outgrows its phase, and the updates' own seconds
    account for the training loop's (UPDATES_SHARE_OF_ACTIVE)."""
    if cuda:
        clocked = (receipt.get("phases") or {}).get("synchronized", "")
        want = "torch.cuda.synchronize()" if expect.phase_sync else "none (NSHARD_PHASE_SYNC=0)"
        check(clocked.startswith(want), f"phase clock: {want} (receipt: {clocked!r})")
    phases, detail = receipt.get("update_phases") or [], receipt.get("update_phase_detail") or []
    check(len(phases) == len(detail) == updates and all(
        abs(math.fsum(p.values()) - s) <= PHASE_SUM_TOLERANCE * s and min(p.values()) >= 0
        for s, p in zip(receipt["update_s"], phases)),
        f"every update's phases sum to its time within {PHASE_SUM_TOLERANCE:.0%}, none negative")
    updates_s, active_s = math.fsum(receipt.get("update_s") or []), receipt.get("active_s") or 0.0
    check(UPDATES_SHARE_OF_ACTIVE * active_s <= updates_s <= active_s * 1.001 and updates_s > 0,
          f"the updates' seconds ({updates_s:.3f}) are {UPDATES_SHARE_OF_ACTIVE:.0%} to 100% of the training loop's "
          f"active seconds ({active_s:.3f})")
    if expect.phase_sync:
        shares = [p.get("rest", 0) / s for s, p in zip(receipt["update_s"], phases) if s > 0]
        # On a GPU every update; on the CPU rehearsal the median one: there a rank preempted between two phases (the
        # suite's other worker on two cores: 11.4% in one update) is the machine's noise, not the clock's error.
        rest = (max(shares) if cuda else statistics.median(shares)) if shares else None
        which, label = ("every update", "largest rest") if cuda else ("the median update (CPU)", "median rest")
        check(rest is not None and rest <= REST_BOUND, f"the named phases claim all but at most {REST_BOUND:.0%} of "
              f"{which} ({label}: {'none' if rest is None else f'{rest:.1%}'})")
        check(all(d[name] <= p[parent] for p, d in zip(phases, detail) for name, parent in DETAIL.items()),
              "no detail longer than its phase")
    if expect.compressed and expect.phase_sync:
        timed = [d for d, c in zip(detail, receipt["update_compressed"]) if c]
        check(bool(timed) and all(d["powersgd_pq"] > 0 and d["orthogonalize"] > 0 for d in timed),
              "every compressed update timed its P/Q products and orthogonalization (> 0 s)")


def receipt_summary(receipt: dict) -> dict:
    gib = lambda b: None if b is None else round(b / 2**30, 3)  # noqa: E731
    ran = receipt.get("reduction_ran") or {}
    phases = receipt.get("gpu_memory_by_phase") or {}
    tokens = [u.get("tokens") for u in receipt.get("update_throughput") or [] if u.get("tokens") is not None]
    return {"median_dense_update_s": median_updates(receipt, False),
            "median_compressed_update_s": median_updates(receipt, True),
            "compressed_update_s": update_times(receipt, True),
            "median_phase_s": {kind: (receipt.get("by_phase") or {}).get(kind, {}).get("median_phase_s")
                               for kind in ("dense", "compressed")},
            "compressed_updates": sum(bool(c) for c in receipt["update_compressed"]),
            "nshard_compressed_calls": ran.get("nshard_compressed_calls"),
            "tokens_per_update": statistics.median(tokens) if tokens else None,
            "active_s": receipt.get("active_s"), "startup_s": (receipt.get("startup") or {}).get("s"),
            "optimizer": receipt.get("optimizer"), "device": receipt.get("device"),
            "world_size": receipt.get("world_size"), "parameter_root": receipt.get("parameter_root"),
            "numerics": receipt.get("numerics"), "orthogonalization": receipt.get("orthogonalization"),
            "compression_error_norm": receipt.get("compression_error_norm_after_last_update"),
            "peak_allocated_gib": gib(receipt.get("peak_allocated_bytes")),
            "updates_peak_allocated_gib": gib((phases.get("updates") or {}).get("peak_allocated_bytes")),
            "peak_reserved_gib": gib(receipt.get("peak_reserved_bytes")),
            "expandable_segments": (receipt.get("expandable_segments") or {}).get("in_effect"),
            "parameter_all_gather": (receipt.get("parameter_all_gather") or {}).get("call"),
            "throughput": {k: ((receipt.get("throughput") or {}).get("run") or {}).get(k)
                           for k in ("tokens_per_s", "achieved_tflops", "mfu")},
            "link": {k: (receipt.get("link") or {}).get(k) for k in ("backend", "not_counted", "agree")}}


def script_checks(name: str, body: dict) -> list[str]:
    """What a script step's JSON must show, beyond its own exit status."""
    if name.startswith("reducers"):
        failed = list(body.get("problems", ["no problems list in its output"]))
        if not body.get("compressed_matrices"):
            failed.append("PowerSGD compressed no matrix")
        if body.get("ranks_bit_identical") is not True:
            failed.append("the ranks' outputs or Q are not bit-identical")
        return failed
    if name == "environment":
        return list(body.get("problems", ["no problems list in its output"]))
    failed = []
    if body.get("shrunk"):
        failed.append(f"shapes shrunk: {body['shrunk']}")
    if not isinstance(body.get("share_of_dense_step"), dict):
        failed.append(f"no shares: {body.get('share_of_dense_step')}")
    powersgd = body.get("powersgd") or {}
    if not powersgd.get("compressed_matrices"):
        failed.append("no compressed matrix timed")
    fallbacks = powersgd.get("orthogonal_fallbacks")
    if fallbacks is None or fallbacks > MAX_FALLBACK_SHARE * (powersgd.get("compressed_matrices") or 0):
        failed.append(f"orthogonalization fallbacks {fallbacks} of {powersgd.get('compressed_matrices')} matrices, "
                      f"more than {MAX_FALLBACK_SHARE:.0%}")
    return failed


def tests_checks(log_text: str) -> list[str]:
    summary = next((line for line in reversed(log_text.splitlines()) if " in " in line and ("passed" in line
                    or "failed" in line or "error" in line or "skipped" in line)), "")
    words = summary.split()
    passed = next((int(w) for w, n in zip(words, words[1:]) if w.isdigit() and n.startswith("passed")), 0)
    failed = [f"{w} {n.rstrip(',')}" for w, n in zip(words, words[1:]) if w.isdigit() and n.rstrip(",") in
              ("failed", "error", "errors")]
    return ([] if passed > 0 else [f"no CUDA test passed ({summary or 'no summary line'})"]) + failed


# ---------------------------------------------------------------- derived figures


def status_of(results: dict, name: str) -> str:
    return results.get(name, {}).get("status", "not run")


def overhead(results: dict, compressed_step: str, dense_step: str) -> float | str:
    """A compressed step's median compressed update over the dense step's median update, minus one."""
    c = (results.get(compressed_step, {}).get("receipt") or {}).get("median_compressed_update_s")
    d = (results.get(dense_step, {}).get("receipt") or {}).get("median_dense_update_s")
    if not (c and d):
        return (f"missing: {compressed_step} ({status_of(results, compressed_step)}) and "
                f"{dense_step} ({status_of(results, dense_step)}) both needed")
    return c / d - 1


def clock_overhead(results: dict) -> dict | str:
    """What the phase breakdown adds to a compressed update on CUDA: train-bf16-powersgd (synchronized phases, event-
    timed detail) against its twin without either, each its median compressed update."""
    synced = (results.get("train-bf16-powersgd", {}).get("receipt") or {}).get("median_compressed_update_s")
    unsynced = (results.get(UNSYNCED, {}).get("receipt") or {}).get("median_compressed_update_s")
    if not (synced and unsynced):
        return (f"missing: train-bf16-powersgd ({status_of(results, 'train-bf16-powersgd')}) "
                f"and {UNSYNCED} ({status_of(results, UNSYNCED)}) both needed")
    overhead = synced / unsynced - 1
    # How far a median of these few updates may sit from the truth: each step's median absolute deviation of its
    # compressed updates over its median, the larger of the two. The bound is decided only past it.
    noise = max(spread(results, name) for name in ("train-bf16-powersgd", UNSYNCED))
    verdict = ("within" if overhead + noise <= CLOCK_BOUND else "over" if overhead - noise > CLOCK_BOUND
               else "undecided: the difference is within the updates' spread")
    return {"synchronized_median_s": synced, "unsynchronized_median_s": unsynced, "overhead": overhead,
            "spread": noise, "bound": CLOCK_BOUND, "verdict": verdict}


def spread(results: dict, step: str) -> float:
    times = (results.get(step, {}).get("receipt") or {}).get("compressed_update_s") or []
    if len(times) < 2:
        return 0.0
    middle = statistics.median(times)
    return statistics.median(abs(x - middle) for x in times) / middle


def memory_verdict(measured: int, predicted: dict) -> dict:
    """The 1.7B step's peak allocation against the memory model's prediction, in MEMORY_BAND (see there)."""
    exact = predicted["allocated_bytes"] - (predicted.get("parts") or {}).get("activations", 0)
    low, high = MEMORY_BAND[0] * exact, MEMORY_BAND[1] * predicted["allocated_bytes"]
    verdict = "within" if low <= measured <= high else "below" if measured < low else "over"
    return {"band_bytes": [round(low), round(high)], "band": f"{MEMORY_BAND[0]:.0%} of the exact parts to "
            f"{MEMORY_BAND[1]:.0%} of the whole prediction", "verdict": verdict}


def compressed_gradient_applied(results: dict, metrics: dict[str, list[dict]]) -> dict | str:
    """Proof that the optimizer applied the compressed gradient, from TWO and its all-dense TWIN (same plan, same
    deterministic settings): the losses agree bit for bit through the warm-up (each update's loss is measured before
    its step, so through update warmup + 1), part after the first compressed step, the parameter roots differ at the
    end, and TWO's receipt holds a compression error > 0. `metrics`: each step's metrics.jsonl records."""
    for name in (TWO, TWIN):
        if not status_of(results, name).startswith("ok"):
            return f"missing: {name} did not pass ({status_of(results, name)})"
    compressed, dense = metrics.get(TWO) or [], metrics.get(TWIN) or []
    warm = next((i for i, m in enumerate(compressed) if m.get("compressed")), None)
    if warm is None or len(dense) != len(compressed) or warm + 1 >= len(compressed):
        return f"missing: {TWO} has no compressed update followed by another ({len(compressed)} updates)"
    same = [a["loss"] == b["loss"] for a, b in zip(compressed, dense)]
    roots = [(results[n].get("receipt") or {}).get("parameter_root") for n in (TWO, TWIN)]
    error = (results[TWO].get("receipt") or {}).get("compression_error_norm")
    checks = {"losses_equal_through_warmup": all(same[:warm + 1]),
              "losses_part_after_the_first_compressed_step": not all(same[warm + 1:]),
              "parameter_roots_differ": roots[0] != roots[1] and None not in roots,
              "compression_error_after_last_update_positive": (error or 0) > 0}
    return {**checks, "first_compressed_update": warm + 1, "equal_losses": same, "compression_error_norm": error,
            "verdict": "proved" if all(checks.values()) else
            "not proved: " + ", ".join(k for k, v in checks.items() if not v)}


def derived(results: dict, memory: dict | str, metrics: dict[str, list[dict]]) -> dict:
    """The figures the check exists for, each a number (or a dict of them, with its verdict) or 'missing: why'.
    `memory`: the 1.7B step's measured peaks beside the memory model's prediction (gpu_check.memory_against_plan)."""
    bench = (results.get("bench-phases-1.7b") or {}).get("result") or {}
    shares = bench.get("share_of_dense_step")
    return {
        "compressed_gradient_applied": compressed_gradient_applied(results, metrics),
        "bf16_powersgd_update_over_bf16_dense_update_minus_1": overhead(results, "train-bf16-powersgd", "train-bf16"),
        "zero1_fp32_powersgd_update_over_fp32_dense_update_minus_1":
            overhead(results, "train-zero1-fp32-powersgd-error-sums", "train-fp32"),
        "zero2_bf16_delta4_update_over_bf16_dense_update_minus_1":
            overhead(results, "train-zero2-bf16-powersgd-delta4", "train-bf16"),
        "memory_1_7b": memory,
        "phase_clock_overhead": clock_overhead(results),
        "phase_share_of_1_7b_dense_bf16_step": shares if isinstance(shares, dict) else
            f"missing: bench-phases-1.7b gave no shares ({shares or status_of(results, 'bench-phases-1.7b')})",
    }


def judged(derived_figures: dict) -> tuple[list[str], list[str]]:
    """(not ok, not decided): a figure missing or with a failing verdict; a verdict that says undecided."""
    bad, undecided = [], []
    for name, value in derived_figures.items():
        verdict = value.get("verdict", "") if isinstance(value, dict) else ""
        if isinstance(value, str) or verdict.startswith(("over", "below", "not proved")):
            bad.append(f"derived.{name}")
        elif verdict.startswith("undecided"):
            undecided.append(f"derived.{name}")
    return bad, undecided
