"""One-rank training throughput by microbatch size, on the real DeepSpeed engine and the plan's documents.

    .venv/bin/python -m launch.bench_microbatch [--plan launch/plans/demo.toml] [--sizes 1 2 4 8] [--updates 3]

Prints tokens/s (every non-padding token of the batch) per microbatch size and the ratio to
microbatch 1. The global batch is fixed (--batch_docs, default the plan's 8 longest documents), so
every size does the same work; each size runs in a fresh process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing: prints one line per size and a table. " + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--plan", default="launch/plans/demo.toml")
    parser.add_argument("--ds_config", default="ds_configs/dense.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--updates", type=int, default=3, help="timed updates per size (after one warm-up)")
    parser.add_argument("--batch_docs", type=int, default=8, help="documents per update (the longest of the plan)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not args.one:
        return compare(args)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")}.items():
        os.environ.setdefault(key, value)
    from nshard.seam.launch_env import prepare_process_env

    prepare_process_env()
    from nshard.seam import ds_config as ds_config_mod
    from nshard.seam import engine as engine_mod
    from nshard.run.data import prepare
    from nshard.run.models import load_model, load_tokenizer, resolve_model
    from nshard.run.plan import load_plan
    from nshard.run.replay import replay_documents
    from nshard.seam.reduction import DeepSpeedReduction
    from nshard.run.training import Run, train_update

    engine_mod.init_distributed()
    base = load_plan(args.plan)
    batch_docs = args.batch_docs
    ref = resolve_model(base.model.spec)
    tok = load_tokenizer(ref)
    _, prepared, _, _, _ = prepare(base, tok, replay_documents(base, ref, tok))
    batch = sorted(range(len(prepared)), key=lambda i: len(prepared[i].input_ids))[-batch_docs:]
    tokens = sum(len(prepared[i].input_ids) for i in batch)
    ds_config = ds_config_mod.load_ds_config(args.ds_config)
    size = args.sizes[0]
    plan = dataclasses.replace(base, train=dataclasses.replace(
        base.train, microbatch_docs=size, global_batch_docs=batch_docs, updates=args.updates + 1))
    engine = engine_mod.build_engine(load_model(ref), ds_config_mod.complete_ds_config(ds_config, plan, 1))
    run = Run(plan, Path(args.plan), Path(args.ds_config), ds_config, Path("/nonexistent"), 0, 1)
    seconds = []
    for update in range(args.updates + 1):
        t0 = time.perf_counter()
        train_update(engine, DeepSpeedReduction(), run, prepared, batch, tok.pad_token_id)
        if update:  # the first update warms allocator and kernels
            seconds.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"size": size, "tokens": tokens, "median_s": statistics.median(seconds)}), flush=True)


def compare(args) -> None:
    """Each size in a fresh process: one engine per process, so memory and allocator state do not carry over."""
    rows = []
    for size in args.sizes:
        cmd = [sys.executable, "-m", "launch.bench_microbatch", "--plan", args.plan, "--ds_config", args.ds_config,
               "--updates", str(args.updates), "--sizes", str(size), "--one"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        row = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
        rows.append(row)
        print(f"microbatch {size}: {row['median_s']:.3f} s/update, {row['tokens'] / row['median_s']:.1f} tokens/s",
              flush=True)
    tokens = rows[0]["tokens"]
    print(f"\n{tokens} tokens per update ({max(args.sizes)} documents), one rank, "
          f"{os.environ.get('OMP_NUM_THREADS', 'auto')} threads")
    print("| microbatch | s/update (median) | tokens/s | ratio to microbatch 1 |")
    print("|---|---|---|---|")
    for row in rows:
        tps = tokens / row["median_s"]
        print(f"| {row['size']} | {row['median_s']:.3f} | {tps:.1f} | {tps * rows[0]['median_s'] / tokens:.2f}x |")


if __name__ == "__main__":
    main()
