"""The prepared GPU check (launch/gpu_check.sh): one GPU, 9 minutes by default, one JSON summary on stdout, every
step's log in OUT/logs (docs/gpu.md, "The prepared GPU check").

Steps, most important first: the reducers on two processes over gloo with CUDA tensors (launch/gpu_reducers.py);
one-rank NCCL training at SmolLM2-135M's shapes with random weights through every path a GPU user runs (bf16 stage-0
PowerSGD, ZeRO-2 bf16 PowerSGD with 4-bit delta sync, ZeRO-1 fp32 PowerSGD summing microbatches into the error
memory, the 4-expert Mixtral grown from the 135M at ZeRO-2, fp32 and bf16 dense); a one-rank dense bf16 step of
SmolLM2-1.7B's shapes with its peak memory beside the memory model's plan; PowerSGD's and delta sync's phases at
1.7B shapes as shares of that step (launch/bench_phases.py); the CUDA test set. Each training step is checked
against its receipts: a step about compression fails unless updates were compressed, a delta step unless delta
syncs ran. --dry-run checks every step's inputs and arguments here, on any machine, and runs nothing on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from nshard.cli import toml_text  # noqa: E402 -- the checkout's nshard, found through the line above
from nshard.files import write_text_atomic  # noqa: E402 -- the checkout's nshard, found through the line above
from nshard.phases import DETAIL  # noqa: E402 -- the checkout's nshard, found through the line above
BUDGET_S = 540
PLAN = REPO / "launch/plans/gpu-check.toml"
WARMUP = 2
"""Dense warm-up updates of every PowerSGD step: the rest of the plan's updates must be compressed."""
MODELS = {"mixtral": "random:mixtral-4x135m", "1.7b": "random:smollm2-1.7b"}
LARGE = {"updates": 4, "global_batch_docs": 32, "microbatch_docs": 4}
"""The 1.7B step's [train]: the reference study's batch (launch/plans/study.toml), four updates."""
DRY = "dry-run: listed and checked, not run"
UNSYNCED = "train-bf16-powersgd-unsynced"
CLOCK_BOUND = 0.01
"""What the phase breakdown may add to an update on CUDA (issue 38): its synchronized median compressed update over the
unsynchronized twin's, minus one."""
PHASE_SUM_TOLERANCE = 0.02
"""Each update's phases, rest included, sum to its time within this share (the receipt's arithmetic)."""
REST_BOUND = 0.10
"""On a synchronized clock the named phases claim all but this share of every update: `rest` (building microbatches,
the closing wait) stays below it, so a phase clock that misses where the time goes fails the step."""
TARGET_GPU = "H200"
"""The GPU the check is sized for: the dry run asks the memory model whether every training step fits one."""


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


@dataclass
class Step:
    name: str
    what: str
    """What the step proves, one line (docs/gpu.md lists the same)."""
    command: list[str]
    timeout_s: int
    min_s: int = 30
    """Started only with at least this much of the budget left; else reported as skipped for the budget."""
    env: dict = field(default_factory=dict)
    run_dir: Path | None = None
    expect: Expect | None = None
    result: Path | None = None
    """A script step's JSON summary (its --out)."""
    inputs: tuple[Path, Path] | None = None
    """A training step's (plan, ds_config)."""


# ---------------------------------------------------------------- inputs


def write_inputs(out: Path) -> dict[str, Path]:
    """The plans and ds_configs of the training steps, derived from launch/plans/gpu-check.toml and the shipped
    ds_configs, written into out/inputs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    inputs = out / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    base = tomllib.loads(PLAN.read_text())
    plans = {"135m": base,
             "mixtral": {**base, "name": "gpu-check-mixtral", "model": {**base["model"], "spec": MODELS["mixtral"]}},
             "1.7b": {**base, "name": "gpu-check-1.7b", "model": {**base["model"], "spec": MODELS["1.7b"]},
                      "data": {**base["data"], "train_cases_per_family": 32}, "train": {**base["train"], **LARGE}}}
    shipped = {name: json.loads((REPO / f"ds_configs/{name}.json").read_text())
               for name in ("dense", "powersgd", "zero1", "zero2-powersgd")}
    powersgd = {**shipped["powersgd"]["nshard"], "dense_warmup_updates": WARMUP}
    configs = {
        "fp32": shipped["dense"],
        "bf16": {**shipped["dense"], "bf16": {"enabled": True}},
        "bf16-powersgd": {**shipped["powersgd"], "bf16": {"enabled": True}, "nshard": powersgd},
        "zero1-fp32-powersgd-error-sums": {**shipped["zero1"], "bf16": {"enabled": False},
                                           "nshard": {**powersgd, "microbatch_sums": "error"}},
        "zero2-bf16-powersgd-delta4": {**shipped["zero2-powersgd"], "nshard": {
            **shipped["zero2-powersgd"]["nshard"], "dense_warmup_updates": WARMUP, "parameter_sync": "delta",
            "delta_bits": 4, "delta_block": 256}},
        "zero2-bf16-powersgd": {**shipped["zero2-powersgd"], "nshard": {
            **shipped["zero2-powersgd"]["nshard"], "dense_warmup_updates": WARMUP}},
    }
    paths = {}
    for name, plan in plans.items():
        paths[f"plan-{name}"] = _write(inputs / f"plan-{name}.toml", toml_text(plan))
    for name, config in configs.items():
        paths[name] = _write(inputs / f"{name}.json", json.dumps(config, indent=2) + "\n")
    return paths


def _write(path: Path, text: str) -> Path:
    write_text_atomic(path, text)
    return path


# ---------------------------------------------------------------- steps


def steps(out: Path, inputs: dict[str, Path]) -> list[Step]:
    from nshard.seam.launch_env import free_port

    py = sys.executable
    deepspeed = str(Path(py).with_name("deepspeed"))
    results = out / "results"

    def train(name: str, what: str, config: str, expect: Expect, plan: str = "135m", timeout_s: int = 150,
              min_s: int = 45, env: dict | None = None) -> Step:
        run_dir = out / name
        plan_path, ds_config = inputs[f"plan-{plan}"], inputs[config]
        return Step(name, what, [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()),
                                 str(REPO / "nshard/train.py"), "--ds_config", str(ds_config), "--plan", str(plan_path),
                                 "--out", str(run_dir), "--overwrite"],
                    timeout_s, min_s, env=env or {}, run_dir=run_dir, expect=expect, inputs=(plan_path, ds_config))

    zero, unfused = "DeepSpeedZeroOptimizer", "FP16_UnfusedOptimizer"
    return [
        Step("environment", "torch sees a CUDA device: its name, memory, torch and CUDA versions",
             [py, "-c", "import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({'torch': "
                        "torch.__version__, 'cuda': torch.version.cuda, 'gpu': p.name, 'memory_bytes': p.total_memory}))"],
             60, 10),
        Step("reducers-two-processes", "dense and PowerSGD reducers on 2 processes over gloo with CUDA tensors at real "
             "shapes: ranks bit-identical, CPU within fp32 tolerance, delta codec bits equal to the CPU's",
             [py, str(REPO / "launch/gpu_reducers.py"), "--device", "cuda", "--out", str(results / "reducers.json")],
             150, 40, result=results / "reducers.json"),
        train("train-bf16-powersgd", "bf16 stage 0 through nshard's PowerSGD (ingest seam, HandOver)", "bf16-powersgd",
              Expect("powersgd", 0, "bfloat16", unfused, compressed=True)),
        train(UNSYNCED, "train-bf16-powersgd again with NSHARD_PHASE_SYNC=0 (the phase clock neither waits for the "
              "device nor records events): what the breakdown costs an update", "bf16-powersgd",
              Expect("powersgd", 0, "bfloat16", unfused, compressed=True, phase_sync=False),
              env={"NSHARD_PHASE_SYNC": "0"}),
        train("train-zero2-bf16-powersgd-delta4", "ZeRO-2 bf16 PowerSGD (partition writer) with 4-bit delta sync",
              "zero2-bf16-powersgd-delta4", Expect("powersgd", 2, "bfloat16", zero, compressed=True, delta_bits=4)),
        train("train-zero1-fp32-powersgd-error-sums", "ZeRO-1 fp32 PowerSGD, microbatch_sums = \"error\" (SummedUpdate)",
              "zero1-fp32-powersgd-error-sums", Expect("powersgd", 1, "float32", zero, compressed=True, error_sums=True)),
        train("train-mixtral-zero2-powersgd", "the 4-expert Mixtral grown from the 135M, ZeRO-2 bf16 PowerSGD", "zero2-bf16-powersgd",
              Expect("powersgd", 2, "bfloat16", zero, compressed=True, experts=4), plan="mixtral", timeout_s=180),
        train("train-fp32", "fp32 dense, DeepSpeed's all-reduce: the baseline step", "fp32",
              Expect("deepspeed", 0, "float32", "AdamW")),
        train("train-bf16", "bf16 dense, DeepSpeed's all-reduce: the baseline step", "bf16",
              Expect("deepspeed", 0, "bfloat16", unfused)),
        train("train-1.7b-bf16", "SmolLM2-1.7B shapes, one rank, bf16 dense: peak memory against the memory model's "
              "plan, and the dense step the phases are shares of", "bf16", Expect("deepspeed", 0, "bfloat16", unfused),
              plan="1.7b", timeout_s=300, min_s=150),
        Step("bench-phases-1.7b", "PowerSGD's phases and delta encode/apply (850M elements) at 1.7B shapes, "
             "synchronized, as shares of the 1.7B dense bf16 step",
             [py, str(REPO / "launch/bench_phases.py"), "--device", "cuda", "--dense-step-receipt",
              str(out / "train-1.7b-bf16/receipts/rank-0.json"), "--out", str(results / "bench-phases.json")],
             180, 45, result=results / "bench-phases.json"),
        Step("cuda-tests", "the CUDA test set (tests/test_cuda.py), with the time that is left",
             [py, "-m", "pytest", "-n", "0", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"],
             300, 60, env={"NSHARD_CUDA_TESTS": "1"}),
    ]


# ---------------------------------------------------------------- what each step must show


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


def training_checks(expect: Expect, receipt: dict, metrics: list[dict], updates: int, cuda: bool = True
                    ) -> tuple[list[str], list[str]]:
    """(what held, what failed) of one training step's receipt and metrics against what the step is about."""
    held, failed = [], []

    def check(ok: bool, text: str) -> None:
        (held if ok else failed).append(text)

    compressed = sum(bool(c) for c in receipt.get("update_compressed", []))
    ran = receipt.get("reduction_ran") or {}
    check(receipt.get("updates") == updates == len(metrics), f"{updates} updates in the receipt and metrics.jsonl "
          f"(receipt {receipt.get('updates')}, metrics {len(metrics)})")
    check(all(math.isfinite(m.get("loss", math.nan)) for m in metrics), "every update's loss is finite")
    device, backend = ("cuda", "nccl") if cuda else ("cpu", "gloo")
    check(str(receipt.get("device")).startswith(device), f"trained on {device} (receipt: {receipt.get('device')})")
    check((receipt.get("link") or {}).get("backend") == backend, f"process group {backend}")
    if cuda:
        check((receipt.get("peak_allocated_bytes") or 0) > 0, "GPU peak memory recorded")
    check(receipt.get("zero_stage") == expect.stage, f"ZeRO stage {expect.stage} (receipt: {receipt.get('zero_stage')})")
    check(receipt.get("reducer") == expect.reducer, f"reducer {expect.reducer} (receipt: {receipt.get('reducer')})")
    check((receipt.get("precision") or {}).get("compute") == expect.compute, f"computed in {expect.compute}")
    check((receipt.get("optimizer") or {}).get("wrapper") == expect.wrapper,
          f"optimizer {expect.wrapper} (receipt: {receipt.get('optimizer')})")
    link = receipt.get("link") or {}
    compared = [link.get(k) for k in ("ledger_matches_logger", "delta_matches_logger") if link.get(k) is not None]
    if compared:
        check(all(compared), "the reducer ledger and delta bytes agree with DeepSpeed's comms logger")
    else:
        held.append("the reducer ledger and delta bytes: not compared (DeepSpeed's comms logger is off)")
    if expect.compressed:
        want = updates - WARMUP
        check(compressed == want > 0, f"compressed updates {compressed}, expected {want} (> 0)")
        calls = ran.get("nshard_compressed_calls")
        check(calls == compressed and (calls or 0) > 0, f"reducer ledger: {calls} compressed calls (> 0)")
    else:
        check(compressed == 0, f"no compressed update (receipt: {compressed})")
    if expect.error_sums:
        sums = {m.get("microbatch_sums") for m in metrics if m.get("compressed")}
        check(sums == {"error memory"}, f"compressed updates summed their microbatches in the error memory ({sums})")
    if expect.delta_bits is not None:
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
    if cuda:
        clocked = (receipt.get("phases") or {}).get("synchronized", "")
        want = "torch.cuda.synchronize()" if expect.phase_sync else "none (NSHARD_PHASE_SYNC=0)"
        check(clocked.startswith(want), f"phase clock: {want} (receipt: {clocked!r})")
    phases, detail = receipt.get("update_phases") or [], receipt.get("update_phase_detail") or []
    check(len(phases) == len(detail) == updates and all(
        abs(math.fsum(p.values()) - s) <= PHASE_SUM_TOLERANCE * s and min(p.values()) >= 0
        for s, p in zip(receipt["update_s"], phases)),
        f"every update's phases sum to its time within {PHASE_SUM_TOLERANCE:.0%}, none negative")
    if expect.phase_sync:
        rest = max((p.get("rest", 0) / s for s, p in zip(receipt["update_s"], phases) if s > 0), default=None)
        check(rest is not None and rest <= REST_BOUND, f"the named phases claim all but at most {REST_BOUND:.0%} of "
              f"every update (largest rest: {'none' if rest is None else f'{rest:.1%}'})")
        check(all(d[name] <= p[parent] for p, d in zip(phases, detail) for name, parent in DETAIL.items()),
              "no detail longer than its phase")
    if expect.compressed and expect.phase_sync:
        timed = [d for d, c in zip(detail, receipt["update_compressed"]) if c]
        check(bool(timed) and all(d["powersgd_pq"] > 0 and d["orthogonalize"] > 0 for d in timed),
              "every compressed update timed its P/Q products and orthogonalization (> 0 s)")
    if expect.experts is not None:
        experts = receipt.get("experts") or {}
        check(experts.get("experts") == expect.experts and (experts.get("layers") or 0) > 0,
              f"a sparse model with {expect.experts} experts per layer (receipt: {experts.get('experts')})")
    return held, failed


def receipt_summary(receipt: dict) -> dict:
    gib = lambda b: None if b is None else round(b / 2**30, 3)
    ran = receipt.get("reduction_ran") or {}
    phases = receipt.get("gpu_memory_by_phase") or {}
    return {"median_dense_update_s": median_updates(receipt, False),
            "median_compressed_update_s": median_updates(receipt, True),
            "compressed_update_s": update_times(receipt, True),
            "median_phase_s": {kind: (receipt.get("by_phase") or {}).get(kind, {}).get("median_phase_s")
                               for kind in ("dense", "compressed")},
            "compressed_updates": sum(bool(c) for c in receipt["update_compressed"]),
            "nshard_compressed_calls": ran.get("nshard_compressed_calls"),
            "active_s": receipt.get("active_s"), "startup_s": (receipt.get("startup") or {}).get("s"),
            "optimizer": receipt.get("optimizer"), "device": receipt.get("device"),
            "peak_allocated_gib": gib(receipt.get("peak_allocated_bytes")),
            "updates_peak_allocated_gib": gib((phases.get("updates") or {}).get("peak_allocated_bytes")),
            "peak_reserved_gib": gib(receipt.get("peak_reserved_bytes")),
            "expandable_segments": (receipt.get("expandable_segments") or {}).get("in_effect"),
            "parameter_all_gather": (receipt.get("parameter_all_gather") or {}).get("call"),
            "throughput": {k: ((receipt.get("throughput") or {}).get("run") or {}).get(k)
                           for k in ("tokens_per_s", "achieved_tflops", "mfu")},
            "link": {k: (receipt.get("link") or {}).get(k) for k in ("backend", "not_counted", "agree")}}


def script_checks(step: Step, body: dict) -> list[str]:
    """What a script step's JSON must show, beyond its own exit status."""
    if step.name.startswith("reducers"):
        failed = list(body.get("problems", ["no problems list in its output"]))
        if not body.get("compressed_matrices"):
            failed.append("PowerSGD compressed no matrix")
        if body.get("ranks_bit_identical") is not True:
            failed.append("the ranks' outputs or Q are not bit-identical")
        return failed
    failed = []
    if body.get("shrunk"):
        failed.append(f"shapes shrunk: {body['shrunk']}")
    if not isinstance(body.get("share_of_dense_step"), dict):
        failed.append(f"no shares: {body.get('share_of_dense_step')}")
    if not (body.get("powersgd") or {}).get("compressed_matrices"):
        failed.append("no compressed matrix timed")
    return failed


def tests_checks(log_text: str) -> list[str]:
    summary = next((line for line in reversed(log_text.splitlines()) if " in " in line and ("passed" in line
                    or "failed" in line or "error" in line or "skipped" in line)), "")
    words = summary.split()
    passed = next((int(w) for w, n in zip(words, words[1:]) if w.isdigit() and n.startswith("passed")), 0)
    return [] if passed > 0 else [f"no CUDA test passed ({summary or 'no summary line'})"]


# ---------------------------------------------------------------- running


def run_step(step: Step, logs: Path, left_s: float, updates: dict[Path, int]) -> dict:
    if left_s < step.min_s:
        return {"status": f"skipped: the budget has {left_s:.0f} s left, the step needs about {step.min_s} s"}
    t0 = time.perf_counter()
    log = logs / f"{step.name}.log"
    timeout = min(step.timeout_s, left_s)
    with log.open("w") as f:
        rc = run_in_own_group(step.command, {**os.environ, **step.env}, f, timeout)
    if rc is None:
        rc = (f"timeout after {timeout:.0f} s" if timeout >= step.timeout_s else
              f"stopped after {timeout:.0f} s, what the budget had left (its own timeout: {step.timeout_s} s)")
    result = {"seconds": round(time.perf_counter() - t0, 1), "log": str(log)}
    text = log.read_text(errors="replace") if log.is_file() else ""
    tail = text.strip().splitlines()[-1:]
    result["last_line"] = tail[0][-300:] if tail else ""
    failed = [] if rc == 0 else [f"exit {rc}" if isinstance(rc, int) else str(rc)]
    if step.expect is not None:
        try:
            receipt, metrics = read_run(step.run_dir)
        except (OSError, ValueError) as exc:
            failed.append(f"no receipts to check ({exc})")
        else:
            held, wrong = training_checks(step.expect, receipt, metrics, updates[step.inputs[0]])
            result.update(receipt=receipt_summary(receipt), held=held)
            failed += wrong
        result["removed"] = remove_bulk(step.run_dir)
    elif step.result is not None:
        try:
            body = json.loads(step.result.read_text())
        except (OSError, ValueError) as exc:
            failed.append(f"no JSON summary ({exc})")
        else:
            result["result"] = body
            failed += script_checks(step, body)
    elif step.name == "cuda-tests":
        failed += tests_checks(text)
    else:
        body = next((line for line in reversed(text.splitlines()) if line.startswith("{")), None)
        result["result"] = json.loads(body) if body else None
    result["status"] = "ok" if not failed else f"failed: {'; '.join(failed)}"
    return {"status": result.pop("status"), **result}


def run_in_own_group(command: list[str], env: dict, log, timeout: float) -> int | None:
    """The command's exit status, or None if it ran past `timeout`: then its whole process group (the deepspeed
    launcher and the rank it started, a script and its spawned ranks) is stopped, so nothing it started holds the
    GPU while the next step runs."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # TERM lets DeepSpeed's launcher stop its rank; KILL what is left
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        return None


def clear_outputs(plan: list[Step]) -> None:
    """An earlier check's run directories and script results in OUT: removed before any step runs, so no step (or
    the benchmark reading the 1.7B step's receipt) can read what another check left."""
    for step in plan:
        if step.run_dir is not None:
            shutil.rmtree(step.run_dir, ignore_errors=True)
        if step.result is not None:
            step.result.unlink(missing_ok=True)


def remove_bulk(run_dir: Path) -> list[str]:
    """A training step's complete state and export (GBs; the check reads the receipts): removed, so the steps fit
    a lent machine's disk."""
    removed = []
    for name in ("state", "model"):
        if (run_dir / name).exists():
            shutil.rmtree(run_dir / name, ignore_errors=True)
            removed.append(name)
    return removed


def memory_against_plan(step: Step, results: dict) -> dict | str:
    """The 1.7B step's measured GPU peaks beside analysis/memory_model.py's plan_peak for its plan and ds_config on this
    GPU: its tensors (allocated_bytes, what torch.cuda.max_memory_allocated measures) and its whole peak."""
    result = results.get(step.name, {})
    if not result.get("status", "").startswith("ok"):
        return f"missing: {step.name} did not pass ({result.get('status', 'not run')})"
    receipt, _ = read_run(step.run_dir)
    predicted = plan_for(step, "cuda")
    if isinstance(predicted, str):
        return predicted
    measured = receipt.get("peak_allocated_bytes")
    updates = ((receipt.get("gpu_memory_by_phase") or {}).get("updates") or {}).get("peak_allocated_bytes")
    if not (measured and updates and predicted.get("allocated_bytes")):
        return (f"missing: measured peak {measured}, updates' peak {updates}, predicted allocation "
                f"{predicted.get('allocated_bytes')}")
    return {"measured_peak_allocated_bytes": measured, "updates_peak_allocated_bytes": updates,
            "measured_peak_reserved_bytes": receipt.get("peak_reserved_bytes"),
            "predicted_allocated_bytes": predicted["allocated_bytes"], "predicted_peak_bytes": predicted.get("peak_bytes"),
            "predicted_peak_phase": predicted.get("peak_phase"), "device": predicted.get("device"),
            "capacity_bytes": predicted.get("capacity_bytes"), "fits": predicted.get("fits"),
            "updates_peak_over_predicted_allocated": updates / predicted["allocated_bytes"]}


def plan_for(step: Step, device) -> dict | str:
    """plan_peak(plan, ds_config, 1, device) for a training step, or 'missing: why'."""
    try:
        from nshard.analysis.memory_model import plan_peak
    except ImportError as exc:
        return f"missing: analysis/memory_model.py has no plan_peak ({exc})"
    from nshard.run.models import resolve_model
    from nshard.run.plan import load_plan
    from nshard.seam.ds_config import load_ds_config

    plan_path, ds_path = step.inputs
    try:
        plan = load_plan(plan_path)
        model_dir = resolve_model(plan.model.spec).path  # a random model's directory: its config.json, no weights
        return plan_peak(plan, load_ds_config(ds_path), 1, device=device, model_dir=model_dir)
    except Exception as exc:  # noqa: BLE001 -- reported as the figure's absence, with the reason
        return f"missing: plan_peak failed ({type(exc).__name__}: {exc})"


def overhead(results: dict, compressed_step: str, dense_step: str) -> float | str:
    """A compressed step's median compressed update over the dense step's median update, minus one."""
    c = (results.get(compressed_step, {}).get("receipt") or {}).get("median_compressed_update_s")
    d = (results.get(dense_step, {}).get("receipt") or {}).get("median_dense_update_s")
    if not (c and d):
        return (f"missing: {compressed_step} ({results.get(compressed_step, {}).get('status', 'not run')}) and "
                f"{dense_step} ({results.get(dense_step, {}).get('status', 'not run')}) both needed")
    return c / d - 1


def clock_overhead(results: dict) -> dict | str:
    """What the phase breakdown adds to a compressed update on CUDA: train-bf16-powersgd (synchronized phases, event-
    timed detail) against its twin without either, each its median compressed update."""
    synced = (results.get("train-bf16-powersgd", {}).get("receipt") or {}).get("median_compressed_update_s")
    unsynced = (results.get(UNSYNCED, {}).get("receipt") or {}).get("median_compressed_update_s")
    if not (synced and unsynced):
        return (f"missing: train-bf16-powersgd ({results.get('train-bf16-powersgd', {}).get('status', 'not run')}) "
                f"and {UNSYNCED} ({results.get(UNSYNCED, {}).get('status', 'not run')}) both needed")
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


def derived(results: dict, plan: list[Step]) -> dict:
    """The figures the check exists for, each a number (or a dict of them) or 'missing: why'."""
    by_name = {s.name: s for s in plan}
    bench = (results.get("bench-phases-1.7b") or {}).get("result") or {}
    shares = bench.get("share_of_dense_step")
    return {
        "bf16_powersgd_update_over_bf16_dense_update_minus_1": overhead(results, "train-bf16-powersgd", "train-bf16"),
        "zero1_fp32_powersgd_update_over_fp32_dense_update_minus_1":
            overhead(results, "train-zero1-fp32-powersgd-error-sums", "train-fp32"),
        "zero2_bf16_delta4_update_over_bf16_dense_update_minus_1":
            overhead(results, "train-zero2-bf16-powersgd-delta4", "train-bf16"),
        "memory_1_7b": memory_against_plan(by_name["train-1.7b-bf16"], results),
        "phase_clock_overhead": clock_overhead(results),
        "phase_share_of_1_7b_dense_bf16_step": shares if isinstance(shares, dict) else
            f"missing: bench-phases-1.7b gave no shares ({shares or results.get('bench-phases-1.7b', {}).get('status', 'not run')})",
    }


# ---------------------------------------------------------------- dry run


def dry_check(step: Step) -> dict:
    """A step's inputs and arguments, checked as far as a machine without a GPU can: a training step's plan and
    ds_config through the trainer's own checks with CUDA assumed (the model spec resolved, the data prepared with its
    tokenizer, the memory plan); a script with --check-only."""
    if step.expect is not None:
        return check_training_inputs(step)
    if step.result is not None:
        proc = subprocess.run(step.command + ["--check-only"], cwd=REPO, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{step.command[1]} --check-only exit {proc.returncode}: {proc.stderr[-800:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return {}


def check_training_inputs(step: Step) -> dict:
    from nshard.run import data as data_mod
    from nshard.run.models import load_tokenizer, resolve_model
    from nshard.run.plan import load_plan
    from nshard.run.replay import replay_documents
    from nshard.run.training import preflight
    from nshard.seam.ds_config import check_optimizer_path, load_ds_config, reducer_config

    plan_path, ds_path = step.inputs
    plan, config = load_plan(plan_path), load_ds_config(ds_path)
    reducer_config(config)
    check_optimizer_path(config, cuda=True)
    preflight(plan, config, 1)
    ref = resolve_model(plan.model.spec)
    tokenizer = load_tokenizer(ref)
    docs, prepared, schedule, _, _ = data_mod.prepare(plan, tokenizer, replay_documents(plan, ref, tokenizer))
    memory = plan_for(step, TARGET_GPU)
    if isinstance(memory, str):
        raise RuntimeError(f"memory plan {memory}")
    if not memory.get("fits"):
        raise RuntimeError(f"the memory model says it does not fit one {memory.get('device')}: "
                           f"{memory.get('peak_bytes')} bytes predicted; fix: {memory.get('fix')}")
    return {"model": plan.model.spec, "documents": len(docs), "updates": len(schedule),
            "longest_document_tokens": max(len(p.input_ids) for p in prepared),
            "memory_plan": {k: memory.get(k) for k in ("device", "allocated_bytes", "peak_bytes", "fits")}}


def listed_cuda_tests() -> list[str]:
    """The CUDA test set's test ids, as pytest collects them here (where each is skipped with its reason)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "--collect-only", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    return [line for line in proc.stdout.splitlines() if "::" in line]


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="directory for runs and logs")
    parser.add_argument("--dry_run", action="store_true", help="list and check every step; run nothing on a GPU")
    parser.add_argument("--budget_s", type=int, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(out)
    plan = steps(out, inputs)
    from nshard.run.plan import load_plan

    updates = {p: load_plan(p).train.updates for k, p in inputs.items() if k.startswith("plan-")}
    summary = {"dry_run": args.dry_run, "budget_s": args.budget_s, "out": str(out), "steps": {}}
    if not args.dry_run:
        clear_outputs(plan)
    began = time.perf_counter()
    for step in plan:
        print(f"gpu_check: {step.name}: {' '.join(step.command)}", file=sys.stderr, flush=True)
        if args.dry_run:
            entry = {"what": step.what, "command": step.command, "env": step.env, "timeout_s": step.timeout_s}
            try:
                entry["checked"] = dry_check(step)
                entry["status"] = DRY
            except Exception as exc:  # noqa: BLE001 -- every step is checked; each failure is reported with its cause
                entry["status"] = f"failed: {type(exc).__name__}: {str(exc)[:600]}"
            summary["steps"][step.name] = {"status": entry.pop("status"), **entry}
            continue
        summary["steps"][step.name] = run_step(step, logs, args.budget_s - (time.perf_counter() - began), updates)
        print(f"gpu_check: {step.name}: {summary['steps'][step.name]['status']}", file=sys.stderr, flush=True)
    if args.dry_run:
        summary["cuda_tests"] = listed_cuda_tests()
        if not summary["cuda_tests"]:
            summary["steps"]["cuda-tests"]["status"] = "failed: pytest collected no CUDA test"
    else:
        summary["derived"] = derived(summary["steps"], plan)
        summary["total_s"] = round(time.perf_counter() - began, 1)
    missing = [k for k, v in summary.get("derived", {}).items() if isinstance(v, str)
               or (isinstance(v, dict) and v.get("verdict") == "over")]
    failed = [n for n, s in summary["steps"].items() if not s["status"].startswith(("ok", "dry-run"))]
    summary["ok"] = not failed and not missing
    summary["not_ok"] = failed + [f"derived.{k}" for k in missing]
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
