"""SIGKILL one rank of a two-rank PowerSGD run (tiny model, fp32, CPU) at random points, continue it with
--resume, and count how many trials end bit-identical to an uninterrupted run of the same plan.

    .venv/bin/python -m launch.kill_resume --trials 10 [--stages 0 1 2] [--updates 8] [--every 2] [--seed 0]

Kill points come from the trainer's test-only fault hook (NSHARD_FAULT=RANK:UPDATE[:PHASE], nshard/run/fault.py):
a random rank, after a random update or in the middle of a state save. Prints one line per trial and
`matched M/N`; exits 0 only when every trial matched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from nshard.cli import SPELLING_NOTE, ArgumentParser  # noqa: E402 -- after sys.path takes the checkout
from nshard.seam.launch_env import free_port  # noqa: E402 -- after sys.path takes the checkout
POWERSGD = {"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1}


def ds_config(stage: int) -> dict:
    """tests/runs.py's tiny_config: a learning rate that visibly moves the random tiny model."""
    config = json.loads((REPO / "ds_configs/dense.json").read_text())
    config["optimizer"]["params"].update(lr=2e-3, eps=1e-4)
    config["scheduler"]["params"].update(warmup_min_lr=2e-4, warmup_max_lr=2e-3)
    config["zero_optimization"] = {"stage": stage, "reduce_scatter": False, "overlap_comm": False}
    config["zero_allow_untested_optimizer"] = True
    config["nshard"] = POWERSGD
    return config


def launch(out: Path, config: Path, plan: Path, fault: str = "", resume: bool = False) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NSHARD_FAULT=fault)
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--hostfile", str(REPO / "hostfile"), "--no_ssh_check",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(REPO / "nshard/train.py"),
           "--ds_config", str(config), "--plan", str(plan), "--out", str(out), *(["--resume"] if resume else [])]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode and not fault:
        sys.stderr.write(done.stderr[-4000:])
    return done.returncode


def root_of(out: Path) -> str | None:
    run = json.loads((out / "run.json").read_text())
    return run.get("parameter_root") if run["status"] == "complete" else None


def kill_point(rng: random.Random, updates: int, every: int) -> tuple[int, int, str]:
    """A rank and a point after the first complete state exists: after an update, or inside a later save."""
    if rng.random() < 1 / 3 and updates >= 2 * every:
        return rng.randrange(2), rng.randrange(2 * every, updates + 1, every), "save"
    return rng.randrange(2), rng.randint(every + 1, updates), "update"


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing that stays (its runs live in a temporary directory): prints one line per trial. "
              + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2], help="ZeRO stages, taken in turn")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="updates between complete states")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    rng = random.Random(args.seed)
    plan_text = (REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", f"updates = {args.updates}")
    plan_text += f"\n[checkpoint]\nevery = {args.every}\nreplica_check_every = 1\n"
    with tempfile.TemporaryDirectory(prefix="kill_resume-") as tmp:
        work = Path(tmp)
        plan = work / "plan.toml"
        plan.write_text(plan_text)
        whole = {}
        for stage in sorted(set(args.stages)):
            config = work / f"z{stage}.json"
            config.write_text(json.dumps(ds_config(stage)))
            if launch(work / f"whole-z{stage}", config, plan):
                raise SystemExit(f"the uninterrupted stage-{stage} run failed")
            whole[stage] = root_of(work / f"whole-z{stage}")
        matched = 0
        for trial in range(args.trials):
            stage = args.stages[trial % len(args.stages)]
            rank, update, phase = kill_point(rng, args.updates, args.every)
            out, config = work / f"trial-{trial}", work / f"z{stage}.json"
            killed = launch(out, config, plan, fault=f"{rank}:{update}:{phase}")
            resumed = launch(out, config, plan, resume=True) if killed else None
            root = root_of(out) if resumed == 0 else None
            same = killed != 0 and root == whole[stage]
            matched += same
            print(f"trial {trial}: ZeRO-{stage}, rank {rank} killed at update {update} ({phase}), exit {killed}; "
                  f"resume exit {resumed}: {'match' if same else 'MISMATCH'}", flush=True)
    print(f"matched {matched}/{args.trials}", flush=True)
    return 0 if matched == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
