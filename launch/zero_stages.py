"""ZeRO stage comparison: stages 0, 1, 2 x {DeepSpeed's dense all-reduce, nshard PowerSGD} on one plan,
2 ranks through the deepspeed launcher, one run directory per arm, then analysis/zero_table.py.

    .venv/bin/python -m launch.zero_stages [--plan launch/plans/tiny.toml] [--out runs/zero-stages]
        [--rank R] [--warmup W] [--lr LR] [--stages 0 1 2] [--overwrite]

Short plans need --warmup below the plan's updates (and, for the tiny model, a small --rank) to
reach compressed updates: e.g. --rank 2 --warmup 1 on the tiny plan.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from nshard.cli import SPELLING_NOTE, ArgumentParser  # noqa: E402 -- after sys.path takes the checkout
from nshard.analysis.zero_table import TableError, write_table  # noqa: E402 -- after sys.path takes the checkout
from nshard.seam.launch_env import free_port  # noqa: E402 -- after sys.path takes the checkout
from nshard.run.plan import PlanError, load_plan  # noqa: E402 -- after sys.path takes the checkout (plan.py imports no torch)

STAGE_CONFIGS = {0: "dense.json", 1: "zero1.json", 2: "zero2.json"}
REDUCERS = ("dense", "powersgd")
LOG_TAIL_CHARS = 6000


def at_least(low: int):
    """An argparse type: an integer >= low, refused before any arm runs."""
    def parse(text: str) -> int:
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}")
        return int(text)
    return parse


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes one run directory per arm under --out, then --out/zero_table.md and zero_table.json. "
              + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--plan", default=str(REPO / "launch/plans/tiny.toml"), help="experiment plan TOML")
    parser.add_argument("--out", default=str(REPO / "runs/zero-stages"), help="comparison directory")
    parser.add_argument("--rank", type=at_least(1), default=None,
                        help="PowerSGD rank (default: ds_configs/powersgd.json's)")
    parser.add_argument("--warmup", type=at_least(0), default=None,
                        help="PowerSGD dense_warmup_updates (default: ds_configs/powersgd.json's)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate for every arm (default: the ds_configs' own); warm-up starts at lr/10")
    parser.add_argument("--stages", type=int, nargs="+", choices=sorted(STAGE_CONFIGS), default=sorted(STAGE_CONFIGS),
                        help="the ZeRO stages to compare (default 0 1 2)")
    parser.add_argument("--overwrite", action="store_true", help="replace arms already in --out")
    parser.add_argument("--timeout_s", type=float, default=3600, help="wall-clock limit per arm")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_config(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / name).read_text())


def arm_config(stage: int, reducer: str, args) -> dict:
    """The stage's ds_config; PowerSGD adds ds_configs/powersgd.json's "nshard" section with --rank/--warmup."""
    config = read_config(STAGE_CONFIGS[stage])
    if reducer == "powersgd":
        section = copy.deepcopy(read_config("powersgd.json")["nshard"])
        if args.rank is not None:
            section["rank"] = args.rank
        if args.warmup is not None:
            section["dense_warmup_updates"] = args.warmup
        config["nshard"] = section
    if args.lr is not None:
        config["optimizer"]["params"]["lr"] = args.lr
        config["scheduler"]["params"].update(warmup_min_lr=args.lr / 10, warmup_max_lr=args.lr)
    return config


def launch(run_dir: Path, config_path: Path, log_path: Path, args, ranks: int = 2,
           wrapper: Path | None = None, extra_env: dict | None = None, port: int | None = None) -> int:
    """`ranks` ranks on this host; the launcher and its ranks share a session so a timeout ends them all.

    wrapper: a program the launcher starts instead of `python nshard/train.py` (deepspeed --no_python),
    given the trainer's arguments (launch/capped.sh joins a memory cgroup first).
    """
    program = ["--no_python", str(wrapper)] if wrapper else [str(REPO / "nshard/train.py")]
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--hostfile", str(REPO / "hostfile"), "--no_ssh_check",
           "--num_gpus", str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(port or free_port()), *program,
           "--ds_config", str(config_path), "--plan", args.plan, "--out", str(run_dir),
           *(["--overwrite"] if args.overwrite else [])]
    # Two ranks x several OpenMP threads on a few cores spin 50-200x slower in collectives.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        plan = load_plan(args.plan)
    except (PlanError, FileNotFoundError) as exc:
        print(f"zero_stages: error: {exc}", file=sys.stderr)
        return 2
    arms = [(stage, reducer, out / f"stage{stage}-{reducer}") for stage in sorted(set(args.stages))
            for reducer in REDUCERS]
    taken = [str(d) for _, _, d in arms if d.exists() and any(d.iterdir())]
    if taken and not args.overwrite:
        print(f"zero_stages: error: {taken} already exist; pass --overwrite or another --out", file=sys.stderr)
        return 2
    warmup = args.warmup if args.warmup is not None else read_config("powersgd.json")["nshard"]["dense_warmup_updates"]
    if warmup >= plan.train.updates:
        print(f"zero_stages: note: dense_warmup_updates={warmup} >= the plan's {plan.train.updates} updates, so "
              "no PowerSGD update will be compressed; pass --warmup", file=sys.stderr)
    for sub in ("ds_configs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for stage, reducer, run_dir in arms:
        config_path = out / "ds_configs" / f"{run_dir.name}.json"
        config_path.write_text(json.dumps(arm_config(stage, reducer, args), indent=1) + "\n")
        log_path = out / "logs" / f"{run_dir.name}.log"
        t0 = time.perf_counter()
        code = launch(run_dir, config_path, log_path, args)
        if code != 0:
            tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            print(f"{tail}\nzero_stages: error: arm {run_dir.name} failed (exit {code}); log {log_path}",
                  file=sys.stderr)
            return 1
        # The arm's resumable state (GBs per arm on the embedded model) serves no comparison; it filled the disk.
        shutil.rmtree(run_dir / "state", ignore_errors=True)
        print(f"{run_dir.name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        write_table(out)
    except TableError as exc:
        print(f"zero_stages: error: {exc}", file=sys.stderr)
        return 1
    print((out / "zero_table.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
