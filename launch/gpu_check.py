"""The prepared GPU check: one GPU, 420 s by default, each step's verdict printed as it ends, the summary (one JSON)
and the logs (one tar) written to --results (docs/gpu.md, "The prepared GPU check"). On a lent machine it runs through
launch/gpu_device.sh, which installs the offline bundle first.

Steps, most important first: the environment (imports, versions, launcher, nvcc, ninja, disk, TF32, the GPU:
launch/gpu_env.py), and nothing else if it fails; ds_configs/powersgd.json as shipped, trained by two processes on the
one GPU over gloo with CUDA tensors, and its all-dense twin (the proof that the optimizer applied the compressed
gradient); the reducers on two processes (launch/gpu_reducers.py); one-rank NCCL training at SmolLM2-135M's shapes
with random weights through the paths a GPU user runs; a dense bf16 step of SmolLM2-1.7B's shapes at 1,024 tokens with
its peak memory judged against the memory model; PowerSGD's and delta sync's phases at 1.7B shapes
(launch/bench_phases.py); the CUDA test set. What the budget leaves is listed with the --steps that runs it in a second
call (on the same warm machine, which keeps the first call's runs in --out). Checks and figures: launch/gpu_judge.py.
--dry-run checks every step's inputs and arguments here, on any machine; --cpu runs the steps a CPU can.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from nshard.files import write_text_atomic  # noqa: E402 -- the checkout's nshard, found through the line above
from launch.gpu_judge import (TWIN, TWO, UNSYNCED, WARMUP, Expect, derived, judged, memory_verdict,  # noqa: E402
                              read_roots, read_run, receipt_summary, script_checks, tests_checks, training_checks)

BUDGET_S = 420
PLAN = REPO / "launch/plans/gpu-check.toml"
SHIPPED_POWERSGD = REPO / "ds_configs/powersgd.json"
MODELS = {"mixtral": "random:mixtral-4x135m", "1.7b": "random:smollm2-1.7b"}
LARGE = {"updates": 4, "global_batch_docs": 32, "microbatch_docs": 4}
"""The 1.7B step's [train]: the reference study's batch (launch/plans/study.toml), four updates, at its 1,024 tokens."""
TWO_UPDATES = 12
"""TWO's updates: the shipped ds_config's 8 dense warm-up updates, then 4 compressed."""
CPU_TWO = {"updates": 10, "global_batch_docs": 4, "microbatch_docs": 1}
"""--cpu: TWO on the CPU (8 warm-up updates, 2 compressed) on the tiny model at PowerSGD rank 4, its shipped ds_config
otherwise: two 135M ranks (~3 GB each) do not fit beside the other work of a shared 2-core machine, and rank 32
compresses none of the tiny model's matrices."""
CPU_TIMEOUT_S = 1800
"""--cpu: a step's timeout (a 135M update takes seconds on a CPU, and a rehearsal builds DeepSpeed's CPU collective)."""
DRY_TIMEOUT_S = 1800
"""A dry run's subprocess (the environment step, a script's --check-only, pytest's collection): generous, since a dry
run may share a loaded CPU (seen: the environment's imports past 300 s at a load of 23 on 2 cores)."""
DRY = "dry-run: listed and checked, not run"
TARGET_GPU = "H200"
"""The GPU the check is sized for: the dry run asks the memory model whether every training step fits one."""
SUMMARY, LOGS = "gpu-check.json", "gpu-check-logs.tar.gz"


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
    """A script step's JSON summary (its --out); the environment's is its last stdout line."""
    inputs: tuple[Path, Path] | None = None
    """A training step's (plan, ds_config)."""


# ---------------------------------------------------------------- inputs


def toml_text(data: dict) -> str:
    """A plan dict (scalars and lists at the top, then one table per section) as TOML. Written by hand, not by
    nshard.cli.toml_text: this runs before the bundle's packages are known to import on the GPU image."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"plan value {v!r}: only scalars and lists are written")

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, body in data.items():
        if isinstance(body, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def write_inputs(out: Path, cpu: bool = False) -> dict[str, Path]:
    """The plans and ds_configs of the training steps, derived from launch/plans/gpu-check.toml and the shipped
    ds_configs, written into out/inputs (ds_configs/powersgd.json is used as it is)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    inputs = out / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    base = tomllib.loads(PLAN.read_text())
    two_train = {**base["train"], **(CPU_TWO if cpu else {"updates": TWO_UPDATES})}
    plans = {"135m": base,
             "mixtral": {**base, "name": "gpu-check-mixtral", "model": {**base["model"], "spec": MODELS["mixtral"]}},
             "1.7b": {**base, "name": "gpu-check-1.7b", "model": {**base["model"], "spec": MODELS["1.7b"],
                                                                  "max_length": 1024},
                      "data": {**base["data"], "train_cases_per_family": 32}, "train": {**base["train"], **LARGE}},
             # Bit-identical twins need CUDA's deterministic kernels (the CPU's are deterministic already).
             "two": {**base, "name": "gpu-check-two", "train": two_train,
                     "model": {**base["model"], **({"spec": "tiny", "max_length": 256} if cpu else {})},
                     "checkpoint": {**base["checkpoint"], "deterministic_cuda": True}}}
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
        "powersgd-all-dense": {**shipped["powersgd"], "nshard": {
            **shipped["powersgd"]["nshard"], "dense_warmup_updates": two_train["updates"]}},
    }
    paths = {"powersgd-shipped": SHIPPED_POWERSGD}
    if cpu:  # the tiny model's matrices compress at rank 4 only
        for name in ("powersgd-shipped", "powersgd-all-dense"):
            config = configs.get(name, shipped["powersgd"])
            configs[name] = {**config, "nshard": {**config["nshard"], "rank": 4}}
    for name, plan in plans.items():
        paths[f"plan-{name}"] = _write(inputs / f"plan-{name}.toml", toml_text(plan))
    for name, config in configs.items():
        paths[name] = _write(inputs / f"{name}.json", json.dumps(config, indent=2) + "\n")
    return paths


def _write(path: Path, text: str) -> Path:
    write_text_atomic(path, text)
    return path


# ---------------------------------------------------------------- steps


def launcher() -> str:
    """DeepSpeed's launcher: beside this Python (a venv's), else on PATH; the name itself if neither (the environment
    step then fails, naming it, before any training step runs)."""
    beside = Path(sys.executable).with_name("deepspeed")
    return str(beside) if beside.is_file() else shutil.which("deepspeed") or "deepspeed"


def steps(out: Path, inputs: dict[str, Path], cpu: bool = False) -> list[Step]:
    """Every step, most important first; with cpu, those a CPU runs (the environment without the device, TWO and its
    twin, the reducers), on the CPU."""
    from nshard.seam.launch_env import free_port

    py = sys.executable
    deepspeed = launcher()
    results = out / "results"

    def train(name: str, what: str, config: str, expect: Expect, plan: str = "135m", timeout_s: int = 150,
              min_s: int = 35, env: dict | None = None) -> Step:
        run_dir = out / name
        timeout_s = CPU_TIMEOUT_S if cpu else timeout_s
        plan_path, ds_config = inputs[f"plan-{plan}"], inputs[config]
        return Step(name, what, [deepspeed, "--num_gpus", str(expect.world), "--master_port", str(free_port()),
                                 str(REPO / "nshard/train.py"), "--ds_config", str(ds_config), "--plan", str(plan_path),
                                 "--out", str(run_dir), "--overwrite"],
                    timeout_s, min_s, env=env or {}, run_dir=run_dir, expect=expect, inputs=(plan_path, ds_config))

    zero, unfused = "DeepSpeedZeroOptimizer", "FP16_UnfusedOptimizer"
    shared = {"NSHARD_DIST_BACKEND": "gloo"}  # two ranks on one GPU: gloo with CUDA tensors (NCCL refuses)
    two = {"world": 2, "backend": "gloo", "warmup": 8}
    environment = Step("environment", "imports (torch, DeepSpeed, transformers, nshard.analysis), versions against "
                       "pyproject.toml, the launcher, nvcc, ninja, free disk, TF32, the GPU", [
                           py, str(REPO / "launch/gpu_env.py"), "--out", str(out), *(["--no-device"] if cpu else [])],
                       120, 10)
    first = [
        environment,
        train(TWO, "ds_configs/powersgd.json as shipped (fp32 stage 0, rank 32, 8 dense warm-up updates), two "
              "processes on the one GPU over gloo with CUDA tensors: real updates, both ranks' roots equal",
              "powersgd-shipped", Expect("powersgd", 0, "float32", "AdamW", compressed=True, **two), plan="two",
              env=shared, min_s=45),
        train(TWIN, f"{TWO} with every update dense: its losses equal through the warm-up, its root apart after the "
              "compressed updates (the optimizer applied the compressed gradient)", "powersgd-all-dense",
              Expect("powersgd", 0, "float32", "AdamW", **two), plan="two", env=shared, min_s=45),
        Step("reducers-two-processes", "dense and PowerSGD reducers on 2 processes over gloo with CUDA tensors at real "
             "shapes: ranks bit-identical, CPU within fp32 tolerance, delta codec bits equal to the CPU's",
             [py, str(REPO / "launch/gpu_reducers.py"), "--device", "cpu" if cpu else "cuda",
              *(["--updates", "2"] if cpu else []), "--out", str(results / "reducers.json")],
             CPU_TIMEOUT_S if cpu else 150, 40, result=results / "reducers.json"),
    ]
    if cpu:
        return first
    return first + [
        train("train-bf16-powersgd", "bf16 stage 0 through nshard's PowerSGD (ingest seam, HandOver)", "bf16-powersgd",
              Expect("powersgd", 0, "bfloat16", unfused, compressed=True)),
        train(UNSYNCED, "train-bf16-powersgd again with NSHARD_PHASE_SYNC=0 (the phase clock neither waits for the "
              "device nor records events): what the breakdown costs an update", "bf16-powersgd",
              Expect("powersgd", 0, "bfloat16", unfused, compressed=True, phase_sync=False),
              env={"NSHARD_PHASE_SYNC": "0"}),
        train("train-1.7b-bf16", "SmolLM2-1.7B shapes at 1,024 tokens, one rank, bf16 dense: peak memory judged "
              "against the memory model, tokens per update, and the dense step the phases are shares of", "bf16",
              Expect("deepspeed", 0, "bfloat16", unfused), plan="1.7b", timeout_s=300, min_s=120),
        Step("bench-phases-1.7b", "PowerSGD's phases and delta encode/apply (850M elements) at 1.7B shapes, "
             "synchronized, as shares of the 1.7B dense bf16 step",
             [py, str(REPO / "launch/bench_phases.py"), "--device", "cuda", "--dense-step-receipt",
              str(out / "train-1.7b-bf16/receipts/rank-0.json"), "--out", str(results / "bench-phases.json")],
             180, 45, result=results / "bench-phases.json"),
        train("train-bf16", "bf16 dense, DeepSpeed's all-reduce: the baseline step", "bf16",
              Expect("deepspeed", 0, "bfloat16", unfused)),
        train("train-zero2-bf16-powersgd-delta4", "ZeRO-2 bf16 PowerSGD (partition writer) with 4-bit delta sync",
              "zero2-bf16-powersgd-delta4", Expect("powersgd", 2, "bfloat16", zero, compressed=True, delta_bits=4)),
        train("train-zero1-fp32-powersgd-error-sums", "ZeRO-1 fp32 PowerSGD, microbatch_sums = \"error\" (SummedUpdate)",
              "zero1-fp32-powersgd-error-sums", Expect("powersgd", 1, "float32", zero, compressed=True, error_sums=True)),
        train("train-mixtral-zero2-powersgd", "the 4-expert Mixtral grown from the 135M, ZeRO-2 bf16 PowerSGD",
              "zero2-bf16-powersgd", Expect("powersgd", 2, "bfloat16", zero, compressed=True, experts=4),
              plan="mixtral", timeout_s=180),
        train("train-fp32", "fp32 dense, DeepSpeed's all-reduce: the baseline step", "fp32",
              Expect("deepspeed", 0, "float32", "AdamW")),
        Step("cuda-tests", "the CUDA test set (tests/test_cuda.py), with the time that is left",
             [py, "-m", "pytest", "-n", "0", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"],
             300, 60, env={"NSHARD_CUDA_TESTS": "1"}),
    ]


# ---------------------------------------------------------------- running


def run_step(step: Step, logs: Path, left_s: float, updates: dict[Path, int], cpu: bool = False) -> dict:
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
            roots = read_roots(step.run_dir)
        except (OSError, ValueError) as exc:
            failed.append(f"no receipts to check ({exc})")
        else:
            held, wrong = training_checks(step.expect, receipt, metrics, updates[step.inputs[0]], cuda=not cpu,
                                          roots=roots)
            result.update(receipt=receipt_summary(receipt), held=held)
            failed += wrong
        result["removed"] = remove_bulk(step.run_dir)
    elif step.result is not None or step.name == "environment":
        try:
            body = (json.loads(step.result.read_text()) if step.result is not None else
                    json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{"))))
        except (OSError, ValueError, StopIteration) as exc:
            failed.append(f"no JSON summary ({type(exc).__name__}: {exc})")
        else:
            result["result"] = body
            failed += script_checks(step.name, body)
    elif step.name == "cuda-tests":
        failed += tests_checks(text)
    result["status"] = "ok" if not failed else f"failed: {'; '.join(failed)}"
    return {"status": result.pop("status"), **result}


def run_in_own_group(command: list[str], env: dict, log, timeout: float) -> int | str | None:
    """The command's exit status, None if it ran past `timeout` (then its whole process group, the deepspeed launcher
    and the ranks it started, is stopped, so nothing holds the GPU while the next step runs), or why it could not
    start (a missing launcher, say)."""
    try:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        return f"could not start {command[0]} ({exc})"
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
    """The run directories and script results of the steps about to run, left in OUT by an earlier check: removed
    before any step runs, so no step (or the benchmark reading the 1.7B step's receipt) reads what another left."""
    for step in plan:
        if step.run_dir is not None:
            shutil.rmtree(step.run_dir, ignore_errors=True)
        if step.result is not None:
            step.result.unlink(missing_ok=True)


def remove_bulk(run_dir: Path) -> list[str]:
    """A training step's export (the 1.7B's is 3.4 GB; the check reads the receipts) and any state: removed, so the
    steps fit a lent machine's disk."""
    removed = []
    for name in ("state", "model"):
        if (run_dir / name).exists():
            shutil.rmtree(run_dir / name, ignore_errors=True)
            removed.append(name)
    return removed


def memory_against_plan(step: Step, results: dict) -> dict | str:
    """The 1.7B step's measured GPU peaks beside analysis/memory_model.py's plan_peak for its plan and ds_config on this
    GPU (allocated_bytes: what torch.cuda.max_memory_allocated measures), judged in gpu_judge.MEMORY_BAND."""
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
            "predicted_activations_bytes": (predicted.get("parts") or {}).get("activations"),
            "predicted_peak_phase": predicted.get("peak_phase"), "device": predicted.get("device"),
            "capacity_bytes": predicted.get("capacity_bytes"), "fits": predicted.get("fits"),
            "tokens_per_update": (result.get("receipt") or {}).get("tokens_per_update"),
            "updates_peak_over_predicted_allocated": updates / predicted["allocated_bytes"],
            **memory_verdict(measured, predicted)}


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


def step_metrics(plan: list[Step], names: tuple[str, ...]) -> dict[str, list[dict]]:
    """metrics.jsonl of the named training steps that left one."""
    found = {}
    for step in plan:
        if step.name in names and step.run_dir is not None:
            try:
                found[step.name] = read_run(step.run_dir)[1]
            except (OSError, ValueError):
                pass
    return found


# ---------------------------------------------------------------- dry run


def dry_check(step: Step) -> dict:
    """A step's inputs and arguments, checked as far as a machine without a GPU can: a training step's plan and
    ds_config through the trainer's own checks with CUDA assumed (the model spec resolved, the data prepared with its
    tokenizer, the memory plan); a script with --check-only; the environment without the device."""
    if step.expect is not None:
        return check_training_inputs(step)
    if step.name == "environment":
        proc = subprocess.run(step.command + ["--no-device"], cwd=REPO, capture_output=True, text=True,
                              timeout=DRY_TIMEOUT_S)
        body = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
        if proc.returncode != 0:
            raise RuntimeError(f"environment: {'; '.join(body.get('problems', [])) or proc.stderr[-800:]}")
        return body
    if step.result is not None:
        proc = subprocess.run(step.command + ["--check-only"], cwd=REPO, capture_output=True, text=True,
                              timeout=DRY_TIMEOUT_S)
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
    preflight(plan, config, step.expect.world)
    ref = resolve_model(plan.model.spec)
    tokenizer = load_tokenizer(ref)
    docs, prepared, schedule, _, _ = data_mod.prepare(plan, tokenizer, replay_documents(plan, ref, tokenizer))
    memory = plan_for(step, TARGET_GPU)
    if isinstance(memory, str):
        raise RuntimeError(f"memory plan {memory}")
    if not memory.get("fits"):
        raise RuntimeError(f"the memory model says it does not fit one {memory.get('device')}: "
                           f"{memory.get('peak_bytes')} bytes predicted; fix: {memory.get('fix')}")
    return {"model": plan.model.spec, "documents": len(docs), "updates": len(schedule), "world": step.expect.world,
            "longest_document_tokens": max(len(p.input_ids) for p in prepared),
            "tokens_per_update": [sum(len(prepared[i].input_ids) for i in batch) for batch in schedule],
            "memory_plan": {k: memory.get(k) for k in ("device", "allocated_bytes", "peak_bytes", "fits")}}


def listed_cuda_tests() -> list[str]:
    """The CUDA test set's test ids, as pytest collects them here (where each is skipped with its reason)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "--collect-only", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=DRY_TIMEOUT_S)
    return [line for line in proc.stdout.splitlines() if "::" in line]


# ---------------------------------------------------------------- the summary


def compact(name: str, entry: dict) -> str:
    """One line per step as it ends: its status and the figures a reader looks for first."""
    receipt = entry.get("receipt") or {}
    figures = {k: receipt.get(k) for k in ("median_dense_update_s", "median_compressed_update_s", "compressed_updates",
                                            "tokens_per_update", "updates_peak_allocated_gib") if receipt.get(k)}
    return json.dumps({"step": name, "status": entry["status"][:600], "seconds": entry.get("seconds"), **figures})


def write_results(results: Path, out: Path, summary: dict) -> None:
    """The summary JSON and one tar of the logs, inputs, script results and each run's receipts and metrics, written
    atomically into `results` (the device tool returns what is under $OUT): after every step, so a call stopped at its
    limit still returns what it did."""
    results.mkdir(parents=True, exist_ok=True)
    text = json.dumps(summary, indent=1) + "\n"
    _write(out / SUMMARY, text)  # where a later call with --steps finds it ($OUT is emptied between device calls)
    if results != out:
        _write(results / SUMMARY, text)
    tmp = results / (LOGS + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            rel = path.relative_to(out)
            keep = rel.parts[0] in ("logs", "inputs", "results") or rel.name in ("metrics.jsonl", "run.json") \
                or (len(rel.parts) > 1 and rel.parts[-2] == "receipts")
            if path.is_file() and keep and not path.name.endswith(".tmp"):
                tar.add(path, arcname=str(Path("gpu-check") / rel))
    tmp.replace(results / LOGS)


def earlier_steps(out: Path, names: set[str]) -> dict:
    """An earlier call's entries for steps this call does not run (--steps): kept, so the derived figures combine both
    calls (the runs they read stay in --out on a warm machine)."""
    try:
        earlier = json.loads((out / SUMMARY).read_text()).get("steps", {})
    except (OSError, ValueError):
        return {}
    return {n: {**e, "from_an_earlier_call": True} for n, e in earlier.items() if n not in names}


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="directory for runs and logs")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"where {SUMMARY} and {LOGS} go (default: --out); launch/gpu_device.sh gives $OUT")
    parser.add_argument("--dry_run", action="store_true", help="list and check every step; run nothing on a GPU")
    parser.add_argument("--cpu", action="store_true", help="run the steps a CPU can, on the CPU (the rehearsal)")
    parser.add_argument("--budget_s", type=int, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    parser.add_argument("--steps", default=None, help="comma-separated step names: run only these (what an earlier "
                        "call left: its summary's `next`), keeping that call's results in the summary")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out.resolve()
    results = (args.results or out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(out, cpu=args.cpu)
    every = steps(out, inputs, cpu=args.cpu)
    names = [s.name for s in every]
    chosen = names if args.steps is None else [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown or not chosen:
        print(f"gpu_check: error: --steps {args.steps!r}: unknown {unknown}; the steps are {', '.join(names)}",
              file=sys.stderr)
        return 2
    plan = [s for s in every if s.name in chosen]
    from nshard.run.plan import load_plan

    updates = {p: load_plan(p).train.updates for k, p in inputs.items() if k.startswith("plan-")}
    summary = {"dry_run": args.dry_run, "cpu": args.cpu, "budget_s": args.budget_s, "out": str(out),
               "steps": {} if args.steps is None else earlier_steps(out, set(chosen))}
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
        environment = summary["steps"].get("environment", {}).get("status", "ok")
        if step.name != "environment" and not environment.startswith("ok"):
            entry = {"status": "skipped: the environment step failed (its problems say what to install)"}
        else:
            entry = run_step(step, logs, args.budget_s - (time.perf_counter() - began), updates, cpu=args.cpu)
        summary["steps"][step.name] = entry
        print(compact(step.name, entry), flush=True)
        write_results(results, out, summary)
    if args.dry_run:
        if not args.cpu:
            summary["cuda_tests"] = listed_cuda_tests()
            if not summary["cuda_tests"]:
                summary["steps"]["cuda-tests"]["status"] = "failed: pytest collected no CUDA test"
    else:
        memory = (memory_against_plan(next(s for s in every if s.name == "train-1.7b-bf16"), summary["steps"])
                  if not args.cpu else "missing: not run on the CPU")
        figures = derived(summary["steps"], memory, step_metrics(every, (TWO, TWIN)))
        summary["derived"] = figures if not args.cpu else {"compressed_gradient_applied":
                                                           figures["compressed_gradient_applied"]}
        summary["total_s"] = round(time.perf_counter() - began, 1)
    bad, undecided = judged(summary.get("derived", {}))
    failed = [n for n, s in summary["steps"].items() if not s["status"].startswith(("ok", "dry-run", "skipped"))]
    left = [n for n in names if not summary["steps"].get(n, {}).get("status", "skipped").startswith(("ok", "dry-run"))
            and n not in failed]
    summary["not_ok"] = failed + bad
    summary["not_decided"] = undecided
    summary["left"] = left
    summary["next"] = f"--steps {','.join(left)}" if left else None
    summary["ok"] = not summary["not_ok"] and not undecided and not left
    write_results(results, out, summary)
    print(json.dumps({k: summary[k] for k in ("ok", "not_ok", "not_decided", "left", "next", "total_s") if k in summary}
                     | {"steps": {n: s["status"][:200] for n, s in summary["steps"].items()},
                        "summary": str(results / SUMMARY), "logs": str(results / LOGS)}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
