"""One-rank training time per update in fp32, bf16 and autocast, in one run, on the real DeepSpeed engine.

    .venv/bin/python -m launch.bench_precision [--plan launch/plans/cpu-study.toml]
        [--ds_config ds_configs/cpu-dense.json] [--modes fp32 bf16 autocast] [--sizes 1 4] [--updates 2]

Each mode is the ds_config with its precision set: fp32 (no bf16), bf16 (DeepSpeed's "bf16": bf16 weights and
compute, fp32 masters, AdamW moments and, under an nshard reducer, fp32 error memory), autocast (DeepSpeed's
"torch_autocast" to bf16 over fp32 weights; nshard's reducers refuse it, so it is measured under DeepSpeed's own
reduction only). Every (mode, microbatch size) trains the same global batch (the plan's longest documents,
--batch_docs) in a fresh process (launch/bench_microbatch.py's worker) and prints the median seconds per update
after one warm-up update, then the ratio to fp32 at the same microbatch size and to fp32 at the first size.
On a CPU, run it with OMP_NUM_THREADS=1 to time one emulated host's core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser

MODES = ("fp32", "bf16", "autocast")


def mode_config(base: dict, mode: str) -> dict:
    config = json.loads(json.dumps(base))
    for key in ("bf16", "bfloat16", "torch_autocast"):
        config.pop(key, None)
    if mode == "bf16":
        config["bf16"] = {"enabled": True}
    elif mode == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16"}
        config.pop("nshard", None)
    return config


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing unless --json FILE is given: prints a table. " + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--plan", default="launch/plans/cpu-study.toml")
    parser.add_argument("--ds_config", default="ds_configs/cpu-dense.json")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4], help="microbatch sizes (documents)")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per point (after one warm-up)")
    parser.add_argument("--batch_docs", type=int, default=8, help="documents per update (the plan's longest)")
    parser.add_argument("--json", help="also write the rows here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from nshard.seam.ds_config import bf16_units

    base = json.loads(Path(args.ds_config).read_text())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp:
        for size in args.sizes:
            for mode in args.modes:
                path = Path(tmp) / f"{mode}.json"
                path.write_text(json.dumps(mode_config(base, mode)))
                cmd = [sys.executable, "-m", "launch.bench_microbatch", "--one", "--plan", args.plan, "--ds_config",
                       str(path), "--updates", str(args.updates), "--sizes", str(size), "--batch_docs",
                       str(args.batch_docs)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"bench_precision: {mode} at microbatch {size} failed (exit {proc.returncode})")
                row = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
                rows.append({"mode": mode, **row})
                print(f"{mode} microbatch {size}: {row['median_s']:.3f} s/update", flush=True)
    first = {r["mode"]: r for r in rows if r["size"] == args.sizes[0]}
    fp32 = {r["size"]: r["median_s"] for r in rows if r["mode"] == "fp32"}
    units, why = bf16_units()
    print(f"\n{rows[0]['tokens']} tokens per update ({args.batch_docs} documents), one rank, "
          f"{os.environ.get('OMP_NUM_THREADS', 'all')} thread(s); bf16 units: {why}")
    print("| mode | microbatch | s/update (median) | fp32 at this size / this | fp32 at microbatch "
          f"{args.sizes[0]} / this |")
    print("|---|---|---|---|---|")
    for r in rows:
        same = f"{fp32[r['size']] / r['median_s']:.2f}x" if r["size"] in fp32 else "—"
        base_s = first.get("fp32", {}).get("median_s")
        print(f"| {r['mode']} | {r['size']} | {r['median_s']:.3f} | {same} | "
              + (f"{base_s / r['median_s']:.2f}x |" if base_s else "— |"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "bf16_units": units, "why": why}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
