"""Pooled memory over a slow link: ZeRO-2 + PowerSGD with and without delta parameter sync, against stage-0 PowerSGD,
on two emulated hosts (a core each) joined by a shaped link, each arm through DeepSpeed's own launcher.

    .venv/bin/python -m launch.bench_pooled [--link 100mbit] [--plan launch/plans/cpu-study.toml] [--updates 4]
        [--arms s0-powersgd,s2-powersgd,s2-powersgd-delta4,s2-powersgd-delta2] [--out runs/bench-pooled]

Every arm compresses from its first update (no dense warm-up), on the plan's data with --updates updates. Prints
and writes (bench_pooled.json, bench_pooled.md) per arm: the median update seconds of the slowest rank, the
bytes each rank handed to collectives per update (gradient + parameter sync), the kernel-counted bytes that
crossed each host's link over the run against what the collectives imply, and each arm's update time over the
first arm's. An arm name ending in "@one" runs that arm with NSHARD_RING_LANES=one: its rings of isend/irecv on
one gloo connection for both directions, the path nshard/comm/ring.py replaced. Needs root (network namespaces,
cpusets); brings the hosts up and tears them down itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser
from launch.memory_probe import arm_ds_config, parse_arm
from nshard.seam.launch_env import free_port
from nshard.study.placement import emulated_hosts, emulation_unavailable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARMS = "s0-powersgd,s2-powersgd,s2-powersgd-delta4,s2-powersgd-delta2"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--link", default="100mbit", help="tc rate of the link between the hosts")
    parser.add_argument("--plan", default=str(REPO / "launch/plans/cpu-study.toml"), help="plan the arms train on")
    parser.add_argument("--updates", type=int, default=4, help="updates per arm (the plan's are replaced)")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated, launch/memory_probe.py names; the "
                                                             "first is the baseline of the ratios")
    parser.add_argument("--rank", type=int, default=32, help="PowerSGD rank")
    parser.add_argument("--out", default=str(REPO / "runs/bench-pooled"))
    parser.add_argument("--timeout_s", type=float, default=1800, help="wall-clock limit per arm")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def short_plan(plan: Path, updates: int, out: Path) -> Path:
    """The plan with its updates replaced (and paths kept absolute, so it reads the same files from --out)."""
    import re

    text = plan.read_text()
    text, n = re.subn(r"(?m)^updates\s*=\s*\d+", f"updates = {updates}", text)
    if n != 1:
        raise SystemExit(f"bench_pooled: error: {plan} has no single 'updates = N' line under [train]")
    path = out / "plan.toml"
    path.write_text(text + "\n[checkpoint]\nreplica_check_every = 1\n")
    return path


def arm_lanes(name: str) -> tuple[str, dict]:
    """(memory_probe arm name, environment) of a bench arm name: "X@one" is arm X on one connection per pair."""
    base, at, lanes = name.partition("@")
    if at and lanes != "one":
        raise SystemExit(f"bench_pooled: error: arm {name!r}: the only suffix is @one (rings on one connection)")
    return base, ({"NSHARD_RING_LANES": "one"} if at else {})


def run_arm(name: str, plan: Path, hostfile: Path, args, out: Path) -> dict:
    base, env = arm_lanes(name)
    config = arm_ds_config(parse_arm(base), rank=args.rank, warmup=0)
    config_path = out / "ds_configs" / f"{name}.json"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=1) + "\n")
    run_dir, log = out / name, out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--hostfile", str(hostfile), "--master_port",
           str(free_port()), str(REPO / "nshard/train.py"), "--ds_config", str(config_path), "--plan", str(plan),
           "--out", str(run_dir), "--overwrite"]
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s,
                              env={**os.environ, **env}).returncode
    if code != 0:
        raise SystemExit(f"{log.read_text(errors='replace')[-4000:]}\nbench_pooled: error: arm {name} failed "
                         f"(exit {code}); log {log}")
    subprocess.run(["rm", "-rf", str(run_dir / "state")], check=True)  # GBs; no comparison needs them
    return summarize(name, run_dir, time.perf_counter() - t0)


def summarize(name: str, run_dir: Path, wall_s: float) -> dict:
    receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
    slowest = [max(per) for per in zip(*(r["update_s"] for r in receipts))]
    links = [r.get("link") or {} for r in receipts]
    return {"arm": name, "wall_s": wall_s, "updates": len(slowest),
            "median_update_s": statistics.median(slowest[1:] or slowest),  # the first update pays start-up
            "grad_bytes_per_update": statistics.median(receipts[0]["update_grad_bytes"]),
            "parameter_bytes_per_update": statistics.median(receipts[0]["update_parameter_bytes"]),
            "kernel_tx_bytes": [link.get("kernel_tx_bytes") for link in links],
            "expected_wire_bytes": [link.get("expected_wire_bytes") for link in links],
            "kernel_over_expected": [link.get("kernel_over_expected") for link in links],
            "ranks_agree": len({r["parameter_root"] for r in receipts}) == 1,
            "ring_connections": sorted({(r.get("parameter_all_gather") or {}).get("ring_connections", "n/a")
                                        for r in receipts}),
            "delta_gap_max": max((g for r in receipts for g in r.get("update_delta_gap", [])), default=None)}


def table(rows: list[dict], link: str) -> str:
    base = rows[0]
    lines = [f"Link {link}, two emulated hosts of one core each; ratios against {base['arm']}", "",
             "| arm | median update | vs first | grad MB / update | parameter MB / update | all MB / update | "
             "kernel tx / expected | replicas agree | largest gap |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["grad_bytes_per_update"] + r["parameter_bytes_per_update"]
        ratio = " / ".join(f"{x:.3f}" if x is not None else "n/a" for x in r["kernel_over_expected"])
        gap = f"{r['delta_gap_max']:.2e}" if r["delta_gap_max"] is not None else "—"
        lines.append(f"| {r['arm']} | {r['median_update_s']:.2f} s | {r['median_update_s'] / base['median_update_s']:.2f}x "
                     f"| {r['grad_bytes_per_update'] / 1e6:.1f} | {r['parameter_bytes_per_update'] / 1e6:.1f} | "
                     f"{total / 1e6:.1f} | {ratio} | {r['ranks_agree']} | {gap} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    why = emulation_unavailable()
    if why:
        print(f"bench_pooled: error: {why}", file=sys.stderr)
        return 2
    arms = [a for a in args.arms.split(",") if a]
    for name in arms:
        parse_arm(arm_lanes(name)[0])  # a bad name fails before any host comes up
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = short_plan(Path(args.plan), args.updates, out)
    rows = []
    with emulated_hosts(args.link, 1, out) as hosts:
        for name in arms:
            rows.append(run_arm(name, plan, hosts["all"], args, out))
            print(f"{name}: {rows[-1]['median_update_s']:.2f} s per update", flush=True)
    (out / "bench_pooled.json").write_text(json.dumps({"link": args.link, "plan": args.plan, "arms": rows},
                                                      indent=1) + "\n")
    text = table(rows, args.link)
    (out / "bench_pooled.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
