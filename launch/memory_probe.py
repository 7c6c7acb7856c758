"""Measure each rank's peak memory per configuration, each rank under its own memory cgroup cap, then print
the memory model's prediction against it (analysis/memory_model.py).

    .venv/bin/python -m launch.memory_probe [--model embedded|1.7b:LAYERS|tiny] [--arms s0-dense,s2-powersgd,...]
        [--cap_gib 6] [--updates 3] [--microbatch_docs 1] [--out runs/memory-probe] [--overwrite]

Arms are named s<stage>-<reducer>[-bf16][-host][-ckpt] (host: PowerSGD's error memory in host memory, which
on CPU is the same memory: it only matters on GPU; ckpt: the ds_config's activation_checkpointing section).
Each arm runs 2 ranks (s0-…-1r: one rank) through the deepspeed launcher with a short plan: 3 updates, 1 dense
warm-up, so updates 2-3 are compressed. A baseline arm (`base`: the tiny model, stage 0, dense) measures what a
rank holds without a model. Each arm measured beside its -ckpt twin gives a row of <out>/<model>/checkpointing.json
and of the table printed at the end: peak RSS and seconds per update without and with checkpointing, the ratios,
and whether both trained the same weights (parameter root).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from launch import zero_stages  # noqa: E402 -- after sys.path takes the checkout
from nshard.cli import SPELLING_NOTE, ArgumentParser  # noqa: E402 -- after sys.path takes the checkout
from launch.memcap import RankCaps, WRAPPER, warm_extensions  # noqa: E402 -- after sys.path takes the checkout
from nshard.files import rename_durably, write_json_atomic  # noqa: E402 -- after sys.path takes the checkout
from nshard.seam.launch_env import free_port, shm_workspace  # noqa: E402 -- after sys.path takes the checkout

ALL_ARMS = ("base", "s0-dense", "s0-powersgd", "s1-dense", "s1-powersgd", "s2-dense", "s2-powersgd")
SMOLLM2_1_7B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
                    vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=130000.0)
PLAN_TEMPLATE = """# Written by launch/memory_probe.py: a short plan that reaches compressed updates.
name = "{name}"

[model]
spec = "{spec}"
max_length = 512

[data]
seed = 7
eval_seed = 7007
train_cases_per_family = 2
eval_cases_per_family = 1
replay_docs = 2
replay_file = "{replay}"
retention_docs = 1

[train]
updates = {updates}
global_batch_docs = {global_batch_docs}
microbatch_docs = {microbatch_docs}
seed = 0
"""


def parse_arm(name: str) -> dict:
    """'s2-powersgd-bf16-host' -> stage 2, powersgd, bf16, host error memory, 2 ranks ('-1r': one rank);
    '-delta4' (or 8, 2): delta parameter sync at that many bits."""
    if name == "base":
        return {"stage": 0, "reducer": "dense", "bf16": False, "host": False, "ranks": 2, "delta_bits": None,
                "checkpointing": False}
    parts = name.split("-")
    deltas = {f"delta{b}": b for b in (8, 4, 2)}
    if not (parts[0] in ("s0", "s1", "s2") and len(parts) >= 2 and parts[1] in ("dense", "powersgd")
            and set(parts[2:]) <= {"bf16", "host", "1r", "ckpt", *deltas}):
        raise ValueError(f"arm {name!r}: use s<0|1|2>-<dense|powersgd>[-bf16][-host][-1r][-delta<8|4|2>][-ckpt]")
    return {"stage": int(parts[0][1]), "reducer": parts[1], "bf16": "bf16" in parts, "host": "host" in parts,
            "ranks": 1 if "1r" in parts else 2, "delta_bits": next((deltas[p] for p in parts if p in deltas), None),
            "checkpointing": "ckpt" in parts}


def arm_ds_config(arm: dict, rank: int = 32, warmup: int = 1) -> dict:
    """The stage's ds_config from ds_configs/, with the PowerSGD section, bf16 and the error memory's place."""
    args = argparse.Namespace(rank=rank, warmup=warmup, lr=None)
    config = zero_stages.arm_config(arm["stage"], arm["reducer"], args)
    if arm["bf16"]:
        config["bf16"] = {"enabled": True}
    if arm["host"]:
        config["nshard"]["error_feedback"] = "host"
    if arm.get("delta_bits"):
        config.setdefault("nshard", {"reducer": "dense"}).update(parameter_sync="delta", delta_bits=arm["delta_bits"])
    if arm.get("checkpointing"):
        config["activation_checkpointing"] = {}  # its presence switches it on (docs/configuration.md)
    return config


def build_1_7b_shaped(layers: int, models_dir: Path) -> Path:
    """A randomly initialised SmolLM2-1.7B-shaped LlamaForCausalLM with `layers` layers and the embedded
    model's tokenizer (same vocabulary), saved once (in a child process, so this one never holds it)."""
    out = models_dir / f"smollm2-1.7b-shaped-L{layers}"
    if (out / "config.json").is_file():
        return out
    code = f"""
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from nshard.run.models import resolve_model
torch.manual_seed(0)
config = LlamaConfig(num_hidden_layers={layers}, **{SMOLLM2_1_7B!r})
tokenizer = AutoTokenizer.from_pretrained(resolve_model("embedded").path, local_files_only=True)
config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                 tokenizer.pad_token_id)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
"""
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, "-c", code, str(tmp)], check=True, cwd=REPO)
    rename_durably(tmp, out)
    return out


def write_plan(out: Path, name: str, spec: str, updates: int = 3, microbatch_docs: int = 1) -> Path:
    """Two microbatches of `microbatch_docs` documents per update: one per rank on two ranks, both on one."""
    path = out / "plans" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PLAN_TEMPLATE.format(name=name, spec=spec, updates=updates, microbatch_docs=microbatch_docs,
                                         global_batch_docs=2 * microbatch_docs,
                                         replay=REPO / "launch/data/replay_general.jsonl"))
    return path


def run_capped(arm: dict, config: dict, plan: Path, run_dir: Path, cap_bytes: int, timeout_s: float,
               overwrite: bool = False) -> dict:
    """One arm under a per-rank cap. outcome: "complete", "out of memory" (a group OOM-killed a rank),
    "timeout" or "failed" (any other exit), with the groups' peak charge and the log's path."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an earlier attempt of this arm; every arm starts from nothing
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.ds_config.json"
    config_path.write_text(json.dumps(config, indent=1) + "\n")
    log_path = run_dir.parent / f"{run_dir.name}.log"
    args = argparse.Namespace(plan=str(plan), overwrite=overwrite, timeout_s=timeout_s)
    t0 = time.perf_counter()
    port = free_port()
    try:
        with RankCaps(cap_bytes, arm["ranks"], tag=run_dir.name[:40]) as caps:
            code = zero_stages.launch(run_dir, config_path, log_path, args, ranks=arm["ranks"], wrapper=WRAPPER,
                                      extra_env={**warm_extensions(), **caps.env}, port=port)
            usage = caps.usage()
    finally:
        remove_shm_workspaces(port)
    oom = any(u.oom_kills for u in usage)
    outcome = ("out of memory" if oom else "complete" if code == 0 else "timeout" if code == 124 else "failed")
    receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
    return {"outcome": outcome, "exit_code": code, "wall_s": time.perf_counter() - t0, "cap_bytes": cap_bytes,
            "cgroup_max_usage_bytes": [u.max_usage_bytes for u in usage], "oom_kills": [u.oom_kills for u in usage],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in receipts],
            "update_s": [r["update_s"] for r in receipts], "parameter_root": receipts[0]["parameter_root"] if receipts
            else None, "log": str(log_path)}


def checkpointing_rows(measured: Path) -> list[dict]:
    """Each arm measured beside its -ckpt twin under `measured` (<out>/<model>): the largest rank's peak RSS and the
    median seconds per update (updates after the first) without and with activation checkpointing."""
    rows = []
    for on_path in sorted(measured.glob("*-ckpt/probe.json")):
        off_path = measured / on_path.parent.name.removesuffix("-ckpt") / "probe.json"
        if not off_path.is_file():
            continue
        off, on = (json.loads(p.read_text()) for p in (off_path, on_path))
        if {off["outcome"], on["outcome"]} != {"complete"}:
            continue
        peak_off, peak_on = max(off["peak_rss_bytes"]), max(on["peak_rss_bytes"])
        s_off, s_on = (statistics.median(r["update_s"][0][1:] or r["update_s"][0]) for r in (off, on))
        rows.append({"arm": off["arm"], "peak_rss_bytes_off": peak_off, "peak_rss_bytes_on": peak_on,
                     "peak_ratio": peak_on / peak_off, "update_s_off": s_off, "update_s_on": s_on,
                     "update_s_ratio": s_on / s_off,
                     "same_parameter_root": off.get("parameter_root") is not None
                     and off["parameter_root"] == on.get("parameter_root")})
    return rows


def checkpointing_table(rows: list[dict]) -> str:
    lines = ["| arm | peak RSS off (MiB) | on (MiB) | on/off | s/update off | on | on/off | same weights |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['peak_rss_bytes_off'] / 2**20:.0f} | {r['peak_rss_bytes_on'] / 2**20:.0f} | "
              f"{r['peak_ratio']:.3f} | {r['update_s_off']:.2f} | {r['update_s_on']:.2f} | {r['update_s_ratio']:.2f} | "
              f"{'yes' if r['same_parameter_root'] else 'no'} |" for r in rows]
    return "\n".join(lines)


def remove_shm_workspaces(port: int) -> None:
    """A rank killed before its workspace name is unlinked (nshard/seam/engine.py does it once every rank has
    mapped it) leaves DeepSpeed's workspace behind: remove this launch's own (its port identifies them;
    no other run uses that port)."""
    pattern = shm_workspace("127.0.0.1", port, "*")
    for path in pattern.parent.glob(pattern.name):
        path.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes one run directory per arm under --out/<model>/, and --out/<model>/checkpointing.json. "
              + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--model", default="embedded", help="embedded, tiny, or 1.7b:LAYERS")
    parser.add_argument("--arms", default=",".join(ALL_ARMS), help="comma-separated arm names")
    parser.add_argument("--cap_gib", type=float, default=6.0, help="per-rank memory cap")
    parser.add_argument("--out", default=str(REPO / "runs/memory-probe"))
    parser.add_argument("--timeout_s", type=float, default=900)
    parser.add_argument("--updates", type=int, default=3, help="updates per arm (1 dense warm-up, then compressed)")
    parser.add_argument("--microbatch_docs", type=int, default=1,
                        help="documents per microbatch (two microbatches per update): activations grow with it")
    parser.add_argument("--overwrite", action="store_true")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.model.startswith("1.7b:"):
        spec = str(build_1_7b_shaped(int(args.model.split(":")[1]), out / "models"))
    else:
        spec = args.model
    label = args.model.replace(":", "-L")
    for name in args.arms.split(","):
        arm = parse_arm(name)
        plan = write_plan(out, f"probe-{label}", "tiny" if name == "base" else spec, updates=args.updates,
                          microbatch_docs=args.microbatch_docs)
        run_dir = out / label / name
        if (run_dir / "probe.json").is_file() and not args.overwrite:
            print(f"{run_dir}: already measured", flush=True)
            continue
        result = run_capped(arm, arm_ds_config(arm), plan, run_dir, int(args.cap_gib * 2**30), args.timeout_s,
                            overwrite=True)
        result.update(arm=name, model=args.model, spec=spec, **arm)
        shutil.rmtree(run_dir / "state", ignore_errors=True)  # the resumable state: GBs, not measured here
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{label}/{name}: {result['outcome']} in {result['wall_s']:.0f} s", flush=True)
    rows = checkpointing_rows(out / label)
    if rows:
        write_json_atomic(out / label / "checkpointing.json", rows)
        print(f"activation checkpointing, {label} (peak RSS of the largest rank):\n{checkpointing_table(rows)}")
    print(f"then: python -m nshard.analysis.memory_model --measured {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
