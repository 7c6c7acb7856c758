"""One-rank training throughput by microbatch size, on the real DeepSpeed engine and the plan's documents.

    .venv/bin/python launch/bench_microbatch.py [--plan launch/plans/demo.toml] [--sizes 1 2 4 8] [--updates 3]

Prints response-weighted tokens/s (all non-padding tokens) per microbatch size and the ratio to
microbatch 1. The global batch is fixed (the largest size), so every size does the same work.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="launch/plans/demo.toml")
    parser.add_argument("--ds_config", default="ds_configs/dense.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--updates", type=int, default=3, help="timed updates per size (after one warm-up)")
    args = parser.parse_args()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")}.items():
        os.environ.setdefault(key, value)
    from nshard.launch_env import prepare_process_env

    prepare_process_env()
    from nshard import engine as engine_mod
    from nshard.data import prepare
    from nshard.models import load_model, load_tokenizer, resolve_model
    from nshard.plan import load_plan
    from nshard.replay import replay_documents
    from nshard.seam import DeepSpeedReduction
    from nshard.trainer import Run, train_update

    engine_mod.init_distributed()
    base = load_plan(args.plan)
    batch_docs = max(args.sizes)
    ref = resolve_model(base.model.spec)
    tok = load_tokenizer(ref)
    _, prepared, _, _, _ = prepare(base, tok, replay_documents(base, ref, tok))
    batch = sorted(range(len(prepared)), key=lambda i: len(prepared[i].input_ids))[-batch_docs:]
    tokens = sum(len(prepared[i].input_ids) for i in batch)
    ds_config = engine_mod.load_ds_config(args.ds_config)
    rows = []
    for size in args.sizes:
        plan = dataclasses.replace(base, train=dataclasses.replace(
            base.train, microbatch_docs=size, global_batch_docs=batch_docs, updates=args.updates + 1))
        engine = engine_mod.build_engine(load_model(ref), engine_mod.complete_ds_config(ds_config, plan, 1))
        run = Run(plan, Path(args.plan), Path(args.ds_config), ds_config, Path("/nonexistent"), 0, 1)
        seconds = []
        for update in range(args.updates + 1):
            t0 = time.perf_counter()
            train_update(engine, DeepSpeedReduction(), run, prepared, batch, tok.pad_token_id)
            if update:  # the first update warms allocator and kernels
                seconds.append(time.perf_counter() - t0)
        median = statistics.median(seconds)
        rows.append((size, median, tokens / median))
        print(f"microbatch {size}: {median:.3f} s/update, {tokens / median:.1f} tokens/s", flush=True)
        del engine
    print(f"\n{tokens} tokens per update ({batch_docs} documents), one rank, {os.environ.get('OMP_NUM_THREADS', 'auto')} threads")
    print("| microbatch | s/update (median) | tokens/s | ratio to microbatch 1 |")
    print("|---|---|---|---|")
    for size, median, tps in rows:
        print(f"| {size} | {median:.3f} | {tps:.1f} | {tps / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
