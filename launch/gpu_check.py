"""The prepared GPU check (launch/gpu_check.sh): one GPU, at most 10 minutes, one JSON summary on stdout.

Steps: one-rank training of the embedded model on CUDA in fp32, bf16, fp32 with deterministic_cuda (its cost)
and fp32 PowerSGD (the compression overhead per update against the dense step), with their receipts; greedy
evaluation of 64 cases on the GPU, timed; the CUDA test set (NSHARD_CUDA_TESTS=1 pytest -m cuda). Logs go to
OUT/logs/. --dry-run lists every step with its command and checks every plan and ds_config as the GPU would
take it (nshard.trainer.preflight with CUDA present), running nothing that needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BUDGET_S = 600
PLAN = REPO / "launch/plans/gpu-check.toml"


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: int
    env: dict = field(default_factory=dict)
    run_dir: Path | None = None
    """A training step's run directory (its receipts are summarized)."""


def write_inputs(out: Path, model: str | None = None) -> dict[str, Path]:
    """The ds_configs and plan the steps use, derived from the shipped ones and written into out/inputs; with `model`,
    the plan's model spec replaced by it (a GPU host that cannot hold the embedded model's GGUF: "tiny")."""
    inputs = out / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    plan_text = PLAN.read_text()
    if model is not None:
        plan_text = plan_text.replace('spec = "embedded"', f"spec = {json.dumps(model)}", 1)
        (inputs / "plan.toml").write_text(plan_text)
    dense = json.loads((REPO / "ds_configs/dense.json").read_text())
    powersgd = json.loads((REPO / "ds_configs/powersgd.json").read_text())
    powersgd["nshard"]["dense_warmup_updates"] = 2
    paths = {"fp32": REPO / "ds_configs/dense.json", "bf16": inputs / "dense-bf16.json",
             "powersgd": inputs / "powersgd-warmup2.json", "plan": PLAN if model is None else inputs / "plan.toml",
             "deterministic": inputs / "deterministic.toml"}
    paths["bf16"].write_text(json.dumps({**dense, "bf16": {"enabled": True}}, indent=2))
    paths["powersgd"].write_text(json.dumps(powersgd, indent=2))
    paths["deterministic"].write_text(plan_text.replace('name = "gpu-check"', 'name = "gpu-check-deterministic"')
                                      + "\n[checkpoint]\ndeterministic_cuda = true\n")
    return paths


def steps(out: Path, inputs: dict[str, Path]) -> list[Step]:
    from nshard.seam.launch_env import free_port

    py = sys.executable
    deepspeed = str(Path(py).with_name("deepspeed"))

    def train(name: str, ds_config: Path, plan: Path = inputs["plan"]) -> Step:
        run_dir = out / name
        return Step(name, [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()), str(REPO / "nshard/train.py"),
                           "--ds_config", str(ds_config), "--plan", str(plan), "--out", str(run_dir), "--overwrite"],
                    120, run_dir=run_dir)

    fp32 = out / "train-fp32"
    return [
        Step("environment", [py, "-c", "import json, torch; print(json.dumps({'torch': torch.__version__, "
                                       "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0)}))"], 60),
        train("train-fp32", inputs["fp32"]),
        train("train-bf16", inputs["bf16"]),
        Step("evaluate-64", [py, "-m", "nshard.study.evaluate", "--run", str(fp32), "--model", str(fp32 / "model"),
                             "--label", "gpu-check", "--out", str(out / "eval"), "--exploratory", "--batch-size", "64"],
             90),
        train("train-powersgd", inputs["powersgd"]),
        train("train-fp32-deterministic", inputs["fp32"], inputs["deterministic"]),
        Step("cuda-tests", [py, "-m", "pytest", "-n", "0", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"],
             300, env={"NSHARD_CUDA_TESTS": "1"}),
    ]


def check_inputs(inputs: dict[str, Path]) -> list[str]:
    """Every training step's plan and ds_config through the trainer's own preflight, and the optimizer rule as a
    CUDA host applies it (no GPU needed)."""
    from nshard.seam.ds_config import check_optimizer_path, load_ds_config
    from nshard.run.plan import load_plan
    from nshard.run.training import preflight

    checked = []
    for ds in ("fp32", "bf16", "powersgd"):
        config = load_ds_config(inputs[ds])
        check_optimizer_path(config, cuda=True)
        for plan in ("plan", "deterministic"):
            preflight(load_plan(inputs[plan]), config, 1)
            checked.append(f"{inputs[plan].name} + {inputs[ds].name}")
    return checked


def listed_cuda_tests() -> list[str]:
    """The CUDA test set's test ids, as pytest collects them here (where each is skipped with its reason)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           "tests/test_cuda.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    return [line for line in proc.stdout.splitlines() if "::" in line]


def run_step(step: Step, logs: Path, left_s: float) -> dict:
    if left_s < 30:
        return {"status": "skipped: the 10-minute budget ran out before this step"}
    t0 = time.perf_counter()
    log = logs / f"{step.name}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(step.command, cwd=REPO, env={**os.environ, **step.env}, stdout=f,
                                stderr=subprocess.STDOUT, timeout=min(step.timeout_s, left_s)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"status": "ok" if rc == 0 else f"failed ({rc}): see {log}", "seconds": round(time.perf_counter() - t0, 1)}
    tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
    result["last_line"] = tail[0][-300:] if tail else ""
    return result


def receipt_summary(run_dir: Path) -> dict:
    receipt = json.loads((run_dir / "receipts" / "rank-0.json").read_text())
    dense = [s for s, c in zip(receipt["update_s"], receipt["update_compressed"]) if not c]
    compressed = [s for s, c in zip(receipt["update_s"], receipt["update_compressed"]) if c]
    gib = lambda b: None if b is None else round(b / 2**30, 3)  # noqa: E731
    return {"median_dense_update_s": statistics.median(dense) if dense else None,
            "median_compressed_update_s": statistics.median(compressed) if compressed else None,
            "active_s": receipt["active_s"], "optimizer": receipt.get("optimizer"), "device": receipt.get("device"),
            "peak_allocated_gib": gib(receipt.get("peak_allocated_bytes")),
            "peak_reserved_gib": gib(receipt.get("peak_reserved_bytes")),
            "gpu_memory_by_phase": receipt.get("gpu_memory_by_phase"),
            "expandable_segments": receipt.get("expandable_segments"), "determinism": receipt.get("determinism"),
            "link": {k: receipt.get("link", {}).get(k) for k in ("backend", "interface", "not_counted", "agree")}}


def derived(results: dict) -> dict:
    """The two costs the check exists for, from the training steps' receipts."""
    def median(step: str, key: str):
        return (results.get(step, {}).get("receipt") or {}).get(key)

    dense, det = median("train-fp32", "median_dense_update_s"), median("train-fp32-deterministic", "median_dense_update_s")
    compressed = median("train-powersgd", "median_compressed_update_s")
    out = {"deterministic_over_default_step": det / dense if dense and det else None}
    if dense and compressed:
        out["compression_overhead_s_per_update"] = compressed - dense
        out["compression_overhead_over_dense_step"] = (compressed - dense) / dense
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="directory for runs and logs")
    parser.add_argument("--dry-run", action="store_true", help="list and check every step; run nothing on a GPU")
    parser.add_argument("--budget_s", type=int, default=BUDGET_S, help="seconds for all steps (default 600)")
    parser.add_argument("--model", help="the training steps' model spec instead of the plan's embedded model (tiny, a "
                                        "local directory, a hub id): for a host that cannot install the embedded one")
    args = parser.parse_args(argv)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(args.out, args.model)
    plan = steps(args.out, inputs)
    summary = {"dry_run": args.dry_run, "budget_s": args.budget_s, "out": str(args.out), "model": args.model or "embedded",
               "steps": {}}
    if args.dry_run:
        summary["checked_inputs"] = check_inputs(inputs)
        summary["cuda_tests"] = listed_cuda_tests()
    began = time.perf_counter()
    for step in plan:
        print(f"gpu_check: {step.name}: {' '.join(step.command)}", file=sys.stderr, flush=True)
        if args.dry_run:
            summary["steps"][step.name] = {"status": "dry-run: listed, not run", "command": step.command,
                                           "env": step.env, "timeout_s": step.timeout_s}
            continue
        result = run_step(step, logs, args.budget_s - (time.perf_counter() - began))
        if step.run_dir is not None and result["status"] == "ok":
            result["receipt"] = receipt_summary(step.run_dir)
        summary["steps"][step.name] = result
    if not args.dry_run:
        evaluation = args.out / "eval" / "summary.json"
        if evaluation.is_file():
            e = json.loads(evaluation.read_text())
            summary["evaluation"] = {k: e.get(k) for k in ("cases", "correct", "generate_s", "retention_s", "device",
                                                            "dtype", "batch_size")}
        summary["derived"] = derived(summary["steps"])
        summary["total_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(summary))
    failed = [n for n, s in summary["steps"].items() if not s["status"].startswith(("ok", "dry-run"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
