"""Capacity under a per-rank memory cap: for each configuration, the deepest SmolLM2-1.7B-shaped model
(layers added one at a time, starting from the memory model's guess) that completes a short plan
with every rank inside its own memory cgroup (launch/memcap.py).

    .venv/bin/python -m launch.capacity [--cap_gib 6] [--configs s0-dense-1r,s1-dense,...] [--out runs/capacity]

An attempt ends "complete", "out of memory" (the kernel OOM-killed a rank: its group's oom_kill count
moved; DeepSpeed's launcher then kills the other rank), "timeout" or "failed". Writes capacity.json,
capacity.md and capacity.png (trainable parameters against the per-rank cap, one line per configuration)
into --out; every run directory keeps its receipts (peak RSS, bytes per update).

With --plan it launches nothing: it prints, for every arm of each plan, the memory model's predicted per-rank peak
(analysis/memory_model.py plan_peak, what nshard/train.py checks before launch) on each GPU of --devices, and the
fix for each that does not fit:

    .venv/bin/python -m launch.capacity --plan launch/plans/study.toml --plan launch/plans/gpu-check.toml
    .venv/bin/python -m launch.capacity --plan launch/plans/growth.toml --model HuggingFaceTB/SmolLM2-1.7B-Instruct
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from nshard.cli import SPELLING_NOTE, ArgumentParser  # noqa: E402 -- after sys.path takes the checkout
from nshard.analysis.memory_model import (DEFAULT_BASELINE_BYTES, GPUS, Config, capacity, measured_bytes,  # noqa: E402 -- after sys.path takes the checkout
                                          plan_peak, smollm2_1_7b)
from launch.memory_probe import arm_ds_config, build_1_7b_shaped, parse_arm, run_capped, write_plan  # noqa: E402 -- after sys.path takes the checkout

DEFAULT_CONFIGS = ("s0-dense-1r", "s2-dense", "s2-powersgd", "s1-dense", "s1-powersgd")


def attempt(name: str, spec: str, label: str, cap_bytes: int, out: Path, timeout_s: float, updates: int = 3,
            rank: int = 32) -> dict:
    """One capped run of configuration `name` on model `spec`; the run directory is out/label/name."""
    arm = parse_arm(name)
    plan = write_plan(out, f"capacity-{label}", spec, updates)
    run_dir = out / label / name
    result = run_capped(arm, arm_ds_config(arm, rank=rank), plan, run_dir, cap_bytes, timeout_s, overwrite=True)
    result.update(arm=name, model=label, spec=spec, **arm)
    if result["outcome"] == "complete":
        receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
        result["peak_rss_bytes"] = [r["peak_rss_bytes"] for r in receipts]
        # What the memory model's prediction is set against: the GPU's allocated peak on a GPU run, else RSS.
        result["peak_measured_bytes"] = [measured_bytes(r) for r in receipts]
        result["peak_measured"] = "host RSS" if result["peak_measured_bytes"] == result["peak_rss_bytes"] else "GPU allocated"
        per_update = [(b, c) for r in receipts for b, c in zip(r["update_grad_bytes"], r["update_compressed"])]
        result["bytes_per_compressed_update"] = _median([b for b, c in per_update if c])
        result["bytes_per_dense_update"] = _median([b for b, c in per_update if not c])
        # ZeRO-1/2's all-gather of the updated parameters: every update, compressed or not.
        result["parameter_bytes_per_update"] = _median([b for r in receipts for b in r.get("update_parameter_bytes", [])])
        for weights in (run_dir / "model").glob("*.safetensors"):  # GBs each; config.json keeps the shapes
            weights.unlink()
    shutil.rmtree(run_dir / "state", ignore_errors=True)  # the resumable state: GBs, not needed for the table
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _median(values):
    return statistics.median(values) if values else None


def deepest(name: str, cap_bytes: int, out: Path, timeout_s: float, max_layers: int, log) -> dict:
    """Start at the memory model's predicted depth, then step one layer up while runs complete, or down
    while they run out of memory; any other outcome stops the search and is reported as such."""
    arm = parse_arm(name)
    config = Config(stage=arm["stage"], reducer=arm["reducer"], bf16=arm["bf16"], world=arm["ranks"])
    guess = max(1, min(max_layers, capacity(config, cap_bytes, DEFAULT_BASELINE_BYTES)))
    tried: dict[int, dict] = {}
    layers = guess
    while 1 <= layers <= max_layers and layers not in tried:
        spec = str(build_1_7b_shaped(layers, out / "models"))
        tried[layers] = attempt(name, spec, f"1.7b-L{layers}", cap_bytes, out, timeout_s)
        log(f"{name} L={layers}: {tried[layers]['outcome']} ({tried[layers]['wall_s']:.0f} s)")
        outcome = tried[layers]["outcome"]
        if outcome == "complete":
            layers += 1
        elif outcome == "out of memory":
            layers -= 1
        else:
            break
    fits = [d for d, r in tried.items() if r["outcome"] == "complete"]
    best = max(fits) if fits else 0
    ooms = [d for d, r in tried.items() if r["outcome"] == "out of memory"]
    errors = {d: r["outcome"] for d, r in tried.items() if r["outcome"] not in ("complete", "out of memory")}
    return {"config": name, "cap_bytes": cap_bytes, "predicted_layers": guess, "layers": best,
            "params": smollm2_1_7b(best).params if best else 0, "first_oom_layers": min(ooms) if ooms else None,
            "errors": errors, "attempts": {str(d): r for d, r in sorted(tried.items())}, "run": tried.get(best)}


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def peak_cell(run: dict) -> str:
    """Each rank's measured peak; marked when it is the GPU's allocated figure rather than host RSS."""
    peaks = run.get("peak_measured_bytes", run.get("peak_rss_bytes", []))
    mark = " (GPU allocated)" if run.get("peak_measured") == "GPU allocated" else ""
    return (" / ".join(gib(b) for b in peaks) + mark) if peaks else "n/a"


def render(rows: list[dict]) -> str:
    head = ["config", "cap / rank (GiB)", "depth (layers)", "parameters (M)", "predicted depth",
            "first OOM depth", "peak / rank (GiB; host RSS unless marked)", "bytes / compressed update (MiB)",
            "bytes / dense update (MiB)", "parameter all-gather / update (MiB)", "vs one rank at stage 0",
            "other outcomes"]
    # Like with like: fp32 rows against one fp32 rank at stage 0, bf16 rows against one bf16 rank.
    ref = {(r["cap_bytes"], "bf16" in r["config"]): r["params"] for r in rows
           if r["config"] in ("s0-dense-1r", "s0-dense-bf16-1r")}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        run = r["run"] or {}
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"
        one = ref.get((r["cap_bytes"], "bf16" in r["config"]))
        ratio = f"{r['params'] / one:.2f}x" if one else "n/a"
        lines.append("| " + " | ".join([
            r["config"], gib(r["cap_bytes"]), str(r["layers"]), f"{r['params'] / 1e6:.0f}", str(r["predicted_layers"]),
            str(r["first_oom_layers"]), peak_cell(run),
            mib(run.get("bytes_per_compressed_update")), mib(run.get("bytes_per_dense_update")),
            mib(run.get("parameter_bytes_per_update")), ratio,
            json.dumps(r["errors"]) if r["errors"] else ""]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, name in enumerate(dict.fromkeys(r["config"] for r in rows)):
        pts = sorted((r["cap_bytes"] / 2**30, r["params"] / 1e6) for r in rows if r["config"] == name)
        # Configurations that reach the same depths overlap: a line style and marker each keeps them apart.
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vDx*"[k % 7], linestyle=("-", "--", ":", "-.")[k % 4],
                label=name)
    ax.set_xlabel("per-rank memory cap (GiB)")
    ax.set_ylabel("trainable parameters (M), SmolLM2-1.7B-shaped")
    ax.set_title("Deepest model that completes under the cap")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_rows(plan_path: Path, model: str | None, devices: list[str]) -> list[dict]:
    """One row per arm of the plan and device: the predicted peak, whether it fits, and the fix if not."""
    from nshard.run.plan import load_plan
    from nshard.seam.ds_config import load_ds_config

    plan = load_plan(plan_path)
    if plan.cohort.enabled and model is None:
        source = Path(plan.cohort.from_study) / "plan.toml"  # the accepted study's own plan names its model
        if not source.is_file():
            raise ValueError(f"{plan_path}: its model is the accepted candidate of {plan.cohort.from_study}, which is not "
                             "here: give --model (the study's model.spec)")
        model = load_plan(source).model.spec
    rows = []
    for arm in plan.study.arms:
        ds_path = Path(arm.ds_config) if Path(arm.ds_config).is_file() else REPO / arm.ds_config
        for device in devices:
            report = plan_peak(plan, load_ds_config(ds_path), arm.ranks, device, spec=model, grown=arm.grown)
            rows.append({"plan": plan_path.name, "arm": arm.name, "ranks": arm.ranks, "ds_config": arm.ds_config,
                         "device": report["device"], **{k: report[k] for k in (
                             "config", "params", "peak_phase", "peak_bytes", "usable_bytes", "fits", "fix", "parts")}})
    return rows


def render_plans(rows: list[dict]) -> str:
    head = ["plan", "arm", "ranks", "config", "params (M)", "device", "predicted peak / rank (GiB)", "usable (GiB)",
            "fits", "fix"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["plan"], r["arm"], str(r["ranks"]), r["config"], f"{r['params'] / 1e6:.0f}",
                                        r["device"], gib(r["peak_bytes"]), gib(r["usable_bytes"]),
                                        "yes" if r["fits"] else "no", r["fix"] or ""]) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--cap_gib", default="6", help="per-rank cap(s), comma-separated; none: only --also's rows")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--out", default=str(REPO / "runs/capacity"))
    parser.add_argument("--max_layers", type=int, default=8)
    parser.add_argument("--timeout_s", type=float, default=900, help="wall-clock limit per attempt")
    parser.add_argument("--keep_models", action="store_true", help="keep the built models (GBs each)")
    parser.add_argument("--also", action="append", default=[],
                        help="another capacity directory whose rows join the table and plot (repeatable)")
    parser.add_argument("--plan", action="append", default=[],
                        help="print the predicted per-rank peak of every arm of this plan instead (repeatable)")
    parser.add_argument("--model", default=None, help="with --plan: the model spec, for a plan whose model is a "
                                                      "cohort's accepted candidate")
    parser.add_argument("--devices", default=",".join(GPUS), help=f"with --plan: GPUs ({', '.join(GPUS)}) or cpu")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plan:
        try:
            rows = [r for p in args.plan for r in plan_rows(Path(p), args.model, args.devices.split(","))]
        except (OSError, ValueError) as exc:
            print(f"capacity: error: {exc}", file=sys.stderr)
            return 2
        print(render_plans(rows), end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for other in args.also for row in json.loads((Path(other) / "capacity.json").read_text())]
    caps = [] if args.cap_gib == "none" else [float(c) for c in args.cap_gib.split(",")]
    try:
        for cap in caps:
            for name in args.configs.split(","):
                rows.append(deepest(name, int(cap * 2**30), out, args.timeout_s, args.max_layers,
                                    lambda msg: print(msg, flush=True)))
                (out / "capacity.json").write_text(json.dumps(rows, indent=1) + "\n")
    finally:
        if not args.keep_models:
            shutil.rmtree(out / "models", ignore_errors=True)
    (out / "capacity.md").write_text(render(rows))
    plot(rows, out / "capacity.png")
    print(render(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
