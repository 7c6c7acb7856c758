"""A two-rank ring step over the emulated link: one gloo connection for both directions, against one per direction.

    .venv/bin/python -m launch.bench_duplex [--link 100mbit] [--mib 30] [--repeats 10] [--idle_s 3]
        [--out runs/bench-duplex]

Two emulated hosts (launch/hosts.sh, a core each) run one gloo rank each. Every repeat waits --idle_s (the
compute between two updates), then times one exchange of --mib MiB each way, three ways, in the same run:
- "one": nshard/comm/ring.py's ring_step with NSHARD_RING_LANES=one (isend and irecv on one group: the path
  nshard's rings took before);
- "two": ring_step with each direction on its own group (the default);
- "all_reduce": gloo's own all_reduce of the same bytes each way, for reference.
Prints and writes (bench_duplex.json, bench_duplex.md) per way, from the slower rank's exchanges: the mean, the
fastest and slowest, the repeats that took over 1.5x the fastest exchange of "two", the mean rate per direction,
and the mean over "two"'s. (One connection is bimodal: a repeat runs at either the link's rate or half of it.)
Needs root; brings the hosts up and down.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser
from nshard.files import write_text_atomic
from nshard.seam.launch_env import free_port
from nshard.study.placement import emulated_hosts, emulation_unavailable

REPO = Path(__file__).resolve().parent.parent
WAYS = ("one", "two", "all_reduce")


def worker(rank: int, master: str, port: int, way: str, mib: int, repeats: int, idle_s: float) -> None:
    """One rank: prints a JSON list of the seconds each repeat's exchange took on this rank."""
    import torch
    import torch.distributed as dist

    os.environ["NSHARD_RING_LANES"] = "one" if way == "one" else "two"
    from nshard.comm.ring import open_second_lane, ring_step

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
    open_second_lane()
    nbytes = mib * 2**20
    outgoing, incoming = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    summed = torch.ones(nbytes // 4)  # a two-rank ring all_reduce sends its whole size each way
    times = []
    for _ in range(repeats):
        time.sleep(idle_s)
        dist.barrier()
        t0 = time.perf_counter()
        if way == "all_reduce":
            dist.all_reduce(summed)
        else:
            ring_step(outgoing, incoming, None)
        times.append(time.perf_counter() - t0)
    if way != "all_reduce" and not bool((incoming == 1).all()):
        raise SystemExit("bench_duplex: error: the exchange delivered other bytes than were sent")
    dist.destroy_process_group()
    print(json.dumps(times), flush=True)


def run_way(way: str, hosts: list[str], args) -> list[float]:
    port = free_port()
    procs = []
    for rank, host in enumerate(hosts):
        inner = [sys.executable, "-m", "launch.bench_duplex", "--worker", str(rank), "--master", hosts[0],
                 "--port", str(port), "--way", way, "--mib", str(args.mib), "--repeats", str(args.repeats),
                 "--idle_s", str(args.idle_s)]
        remote = f"cd {shlex.quote(str(REPO))} && {' '.join(shlex.quote(a) for a in inner)}"
        procs.append(subprocess.Popen(["ssh", host, remote], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=args.timeout_s)
        if proc.returncode != 0:
            raise SystemExit(f"{err[-3000:]}\nbench_duplex: error: way {way} failed on a host (exit {proc.returncode})")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return [max(per) for per in zip(*outputs)]  # the slower rank's exchange, repeat by repeat


def table(rows: dict, args) -> str:
    base, slow = statistics.mean(rows["two"]), 1.5 * min(rows["two"])
    lines = [f"Link {args.link}, two emulated hosts of one core each, {args.mib} MiB each way after {args.idle_s:g} s "
             f"idle, {args.repeats} repeats (the slower rank)", "",
             "| way | mean | fastest | slowest | repeats over 1.5x two's fastest | MB/s each way (mean) | mean vs two |",
             "|---|---|---|---|---|---|---|"]
    for way in WAYS:
        t = rows[way]
        mean = statistics.mean(t)
        lines.append(f"| {way} | {mean:.2f} s | {min(t):.2f} s | {max(t):.2f} s | {sum(x > slow for x in t)} of {len(t)} | "
                     f"{args.mib * 2**20 / mean / 1e6:.2f} | {mean / base:.2f}x |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--mib", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--idle_s", type=float, default=3.0)
    parser.add_argument("--out", default=str(REPO / "runs/bench-duplex"))
    parser.add_argument("--timeout_s", type=float, default=600)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or args.idle_s < 0:
        parser.error("--mib and --repeats must be at least 1, --idle_s not negative")
    if args.worker is not None:
        worker(args.worker, args.master, args.port, args.way, args.mib, args.repeats, args.idle_s)
        return 0
    why = emulation_unavailable()
    if why:
        print(f"bench_duplex: error: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with emulated_hosts(args.link, 1, out) as hosts:
        rows = {way: run_way(way, hosts["hosts"], args) for way in WAYS}
    body = {"link": args.link, "mib": args.mib, "repeats": args.repeats, "idle_s": args.idle_s, "seconds": rows}
    for name, text in (("bench_duplex.json", json.dumps(body, indent=1) + "\n"), ("bench_duplex.md", table(rows, args))):
        write_text_atomic(out / name, text)
    print(table(rows, args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
