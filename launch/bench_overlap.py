"""The reduction after backward against the reduction started during it (nshard.overlap_backward), in one run.

    .venv/bin/python -m launch.bench_overlap [--link 1gbit] [--cores 1] [--model embedded] [--updates 5]

Two emulated hosts (launch/hosts.sh, root), one worker each started with `ip netns exec` (only the benchmark's
traffic crosses the link), pinned to a core of its own with --cores 1 (the main job's one core per host). One
DeepSpeed engine (stage 0, fp32, torch AdamW) per worker and four seams on it, the same model, data and optimizer:
  dense             nshard's dense reducer, reduced after the last backward
  dense+overlap     the same, each bucket's all-reduce started during the last backward
  powersgd          nshard's PowerSGD at --rank (no dense warm-up), after the last backward
  powersgd+overlap  the same, started during the last backward
Each update runs --microbatches microbatches of 1 x --tokens tokens per rank. Every arm runs one unmeasured
update, then --updates rounds, each round every arm once in a rotated order so machine noise hits all alike.
Per arm: the median update seconds (the slower rank of each update), each phase's median on rank 0
(nshard/phases.py) and the ledger's bytes; per reducer: old ÷ new. Writes --out/bench_overlap.json and the
workers' logs, prints the table, and tears the hosts down.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser
from nshard.files import write_json_atomic

REPO = Path(__file__).resolve().parent.parent
ARMS = {"dense": {"reducer": "dense"},
        "dense+overlap": {"reducer": "dense", "overlap_backward": True},
        "powersgd": {"reducer": "powersgd", "dense_warmup_updates": 0},
        "powersgd+overlap": {"reducer": "powersgd", "dense_warmup_updates": 0, "overlap_backward": True}}
PAIRS = {"dense": ("dense", "dense+overlap"), "powersgd": ("powersgd", "powersgd+overlap")}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--link", default="1gbit",
                        help="tc rate of the link between the hosts (none: no limit); local: no hosts, both workers "
                             "on this machine's loopback (the smoke test; needs no root)")
    parser.add_argument("--cores", type=int, default=1, choices=(0, 1),
                        help="1: each worker on a core of its own (taskset); 0: both on every core")
    parser.add_argument("--model", default="embedded",
                        help="135m or 1.7b (SmolLM2 shapes, random) or an nshard model spec (embedded, tiny)")
    parser.add_argument("--layers", type=int, default=1, help="layers of a shape-built model (135m, 1.7b)")
    parser.add_argument("--rank", type=int, default=32, help="PowerSGD rank")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per update per rank")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per microbatch")
    parser.add_argument("--updates", type=int, default=5, help="measured rounds (median reported)")
    parser.add_argument("--out", default="runs/bench_overlap", help="directory for the JSON and the workers' logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def worker(args) -> None:
    Path("/proc/self/oom_score_adj").write_text("1000")  # on a full machine the OOM killer takes the benchmark
    from nshard.seam.launch_env import prepare_process_env

    prepare_process_env()
    import torch
    import torch.distributed as dist

    from launch.bench_link import build_model, ds_config
    from nshard.comm.config import parse_config
    from nshard.phases import CLOCK
    from nshard.seam import engine as engine_mod

    engine_mod.init_distributed()
    world, me = dist.get_world_size(), dist.get_rank()
    config = {**ds_config(world), "gradient_accumulation_steps": args.microbatches,
              "train_batch_size": world * args.microbatches}
    engine = engine_mod.build_engine(build_model(args.model, args.layers), config)
    seams = {arm: engine_mod.install_reducer(engine, parse_config({**section, "rank": args.rank}))
             for arm, section in ARMS.items()}
    CLOCK.use_device(engine.device)
    vocab, generator = engine.module.config.vocab_size, torch.Generator().manual_seed(1000 + me)

    def update(seam) -> dict:
        dist.barrier()
        CLOCK.start()
        start = time.perf_counter()
        for step in range(args.microbatches):
            with CLOCK.microbatch():
                ids = torch.randint(0, vocab, (1, args.tokens), generator=generator)
                loss = seam.forward(engine, input_ids=ids, labels=ids).loss
                seam.backward_and_step(engine, loss, last=step == args.microbatches - 1)
        seconds = time.perf_counter() - start
        timing = CLOCK.stop(seconds)
        dist.barrier()
        return {"seconds": seconds, "phases": timing["phases"], "bytes": seam.last_update_bytes(),
                "buckets_in_backward": seam.overlap.launched_in_backward if seam.overlap else None}

    for arm in ARMS:  # unmeasured: allocations, first Q draws, gloo's first buffers
        update(seams[arm])
    names, samples = list(ARMS), []
    for round_ in range(args.updates):
        for arm in names[round_ % len(names):] + names[: round_ % len(names)]:
            samples.append({"arm": arm, "round": round_, **update(seams[arm])})
            if me == 0:
                print(f"round {round_} {arm}: {samples[-1]['seconds']:.3f} s", flush=True)
    every = [None] * world
    dist.all_gather_object(every, samples)
    if me == 0:
        buckets = {arm: len(seam.overlap.buckets) for arm, seam in seams.items() if seam.overlap is not None}
        Path(args.out, "raw.json").write_text(json.dumps({"samples_by_rank": every, "buckets": buckets}))
    dist.barrier()
    dist.destroy_process_group()


def summarize(raw: dict) -> dict:
    """Per arm: median of each update's slower rank, rank 0's median phases, bytes; per reducer: old ÷ new."""
    by_rank = raw["samples_by_rank"]
    arms = {}
    for arm in ARMS:
        rounds = [[s for s in samples if s["arm"] == arm] for samples in by_rank]
        slower = [max(column) for column in zip(*[[s["seconds"] for s in r] for r in rounds])]
        phases = {name: statistics.median(s["phases"][name] for s in rounds[0]) for name in rounds[0][0]["phases"]}
        arms[arm] = {"median_update_s": statistics.median(slower), "update_s": slower, "median_phases_rank0_s": phases,
                     "bytes_per_update": sorted({s["bytes"] for s in rounds[0]}),
                     "buckets": raw["buckets"].get(arm),
                     "buckets_started_in_backward": sorted({s["buckets_in_backward"] for s in rounds[0]} - {None})}
    ratios = {reducer: arms[old]["median_update_s"] / arms[new]["median_update_s"]
              for reducer, (old, new) in PAIRS.items()}
    return {"arms": arms, "old_over_new": ratios}


def print_table(report: dict) -> None:
    arms = report["arms"]
    phases = list(next(iter(arms.values()))["median_phases_rank0_s"])
    print("\n| arm | median update s | " + " | ".join(phases) + " | bytes per update |")
    print("|---|---|" + "---|" * len(phases) + "---|")
    for arm, a in arms.items():
        cells = " | ".join(f"{a['median_phases_rank0_s'][p]:.3f}" for p in phases)
        print(f"| {arm} | {a['median_update_s']:.3f} | {cells} | {','.join(map(str, a['bytes_per_update']))} |")
    for reducer, ratio in report["old_over_new"].items():
        old, new = PAIRS[reducer]
        print(f"{reducer}: after backward {arms[old]['median_update_s']:.3f} s, during backward "
              f"{arms[new]['median_update_s']:.3f} s, old / new {ratio:.3f}x")


def run_workers(args, out: Path) -> dict:
    """Both workers, each in its host's namespace (rank 0 on the first); a failed one takes the other down."""
    from launch.bench_link import hosts, wait_workers, worker_env
    from nshard.seam.launch_env import free_port

    local = args.link == "local"
    pairs = [("", "127.0.0.1")] * 2 if local else hosts()
    port, procs = free_port() if local else random.randint(20000, 60000), []
    for rank, (ns, _) in enumerate(pairs):
        env = worker_env(rank, pairs, port, ifname=None if local else "eth0")
        pin = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[rank])] if args.cores else []
        where = [] if local else ["ip", "netns", "exec", ns]
        cmd = [*where, *pin, sys.executable, "-m", "launch.bench_overlap", "--worker",
               *[f"--{k}={getattr(args, k)}" for k in ("model", "layers", "rank", "microbatches", "tokens", "updates")],
               f"--out={out}"]
        log = (out / f"rank{rank}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    wait_workers(procs, f"a worker failed: see {out}/rank*.log")
    return json.loads((out / "raw.json").read_text())


def command_line(argv: list[str]) -> str:
    """The command as it can be rerun from the repository root (recorded in the JSON beside the figures)."""
    return " ".join([".venv/bin/python", "-m", "launch.bench_overlap", *(shlex.quote(a) for a in argv)])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    from launch.bench_link import HOSTS_SH

    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), os.getloadavg()
    local = args.link == "local"
    if not local:
        subprocess.run(["bash", str(HOSTS_SH), "up", args.link], check=True, stdout=subprocess.DEVNULL)
    try:
        raw = run_workers(args, out)
    finally:
        if not local:
            subprocess.run(["bash", str(HOSTS_SH), "down"], check=False)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    report = {"command": command_line(argv), "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "settings": {k: getattr(args, k) for k in ("link", "cores", "model", "layers", "rank", "microbatches",
                                                         "tokens", "updates")},
              "machine": {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release()},
              "load_before": load_before, "load_after": os.getloadavg(), "arms_run": ARMS, **summarize(raw),
              "wall_s": time.perf_counter() - started}
    write_json_atomic(out / "bench_overlap.json", report)
    print_table(report)
    print(f"\nwrote {out / 'bench_overlap.json'} ({report['wall_s']:.0f} s; load before {load_before}, "
          f"after {report['load_after']})")


if __name__ == "__main__":
    main()
