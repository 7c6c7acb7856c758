"""Update seconds and bytes per update between two emulated hosts, by link rate, arms side by side.

    .venv/bin/python -m launch.bench_link [--rates 100mbit,1gbit] [--models embedded,1.7b] [--updates 3]

Arms, on the real DeepSpeed engine (stage 0, fp32, torch AdamW), 1 x --tokens tokens per rank:
  one     one rank computes and steps, no communication (the other waits): the compute bound
  local   both ranks compute and step at once, no communication (a diagnostic: shared cores)
  dense   nshard's dense reducer: one flat fp32 all-reduce (the bytes of DeepSpeed's own stage-0 one)
  nshard  nshard's PowerSGD reducer at --rank, no dense warm-up
  hook    PyTorch's powerSGD_hook under DDP at the same rank. As shipped it aborts on gloo (its
          collectives are issued from callbacks whose order differs between ranks, FACTS.md); the
          wrapper here waits on each bucket's future before returning, which changes neither maths
          nor bytes but removes the overlap, so its times are an upper bound for that hook.
All arms share one model, one optimizer and one engine (memory: two hosts on one machine). The
script brings the hosts up (launch/hosts.sh, no limit), runs one worker per host and model, started
with `ip netns exec` (not ssh: the only traffic on the link is the benchmark's), warms every arm up,
then for each rate sets the tbf limit and runs --updates rounds, each round every arm once in a
rotated order, so that machine noise hits all arms alike. Gradient clipping is off: its norm
all-reduce would make the one-rank arm wait for the idle rank. Writes --out/bench_link.json and
bench_link.png and tears the hosts down. The "1.7b" model has SmolLM2-1.7B's layer shapes, --layers of them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from nshard.cli import SPELLING_NOTE, ArgumentParser

REPO = Path(__file__).resolve().parent.parent
HOSTS_SH = REPO / "launch" / "hosts.sh"
HOSTS_TSV = REPO / "runs" / "hosts" / "hosts.tsv"
ARM_NOTES = {
    "one": "one rank computes and steps, no communication (the other waits): the compute bound",
    "local": "both ranks compute and step at once, no communication: the compute bound when the two "
             "hosts share this machine's cores (a diagnostic; the limit uses 'one')",
    "dense": "nshard's dense reducer: one flat fp32 all-reduce",
    "nshard": "nshard's PowerSGD reducer, no dense warm-up",
    "hook": "torch's powerSGD_hook under DDP, each bucket's future waited on before the hook returns "
            "(as shipped it aborts on gloo): same maths and bytes, no overlap, an upper bound for that hook",
}
ARMS = tuple(ARM_NOTES)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates, comma-separated")
    parser.add_argument("--models", default="embedded,1.7b",
                        help="comma-separated: 135m or 1.7b (SmolLM2 shapes, random) or an nshard model spec (embedded, tiny)")
    parser.add_argument("--layers", type=int, default=1, help="layers of a shape-built model (135m, 1.7b)")
    parser.add_argument("--rank", type=int, default=32, help="PowerSGD rank of both implementations")
    parser.add_argument("--updates", type=int, default=3, help="timed rounds per rate (median reported)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per rank per update")
    parser.add_argument("--out", default="runs/bench_link", help="directory for the JSON, plot and logs")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the model a worker runs
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def rate_bits(rate: str) -> float:
    """tc's rate units (SI, as tc reads them): 100mbit -> 1e8 bit/s."""
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use tc's bit units, e.g. 100mbit or 1gbit")


# ------------------------------------------------------------------------------------ worker side

def build_model(name: str, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from launch.bench_powersgd import MODELS

    from nshard.run.models import load_model, resolve_model

    if name not in MODELS:
        return load_model(resolve_model(name))
    s = MODELS[name]
    config = LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                         vocab_size=s.vocab, tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)  # the engine broadcasts rank 0's parameters anyway
    return LlamaForCausalLM(config)


def ds_config(world: int) -> dict:
    config = json.loads((REPO / "ds_configs" / "dense.json").read_text())
    config.pop("scheduler")
    config.update(gradient_clipping=0.0, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  train_batch_size=world)
    return config


def waited_powerSGD_hook(state, bucket):
    """The stock hook, waited on before it returns: the least change that keeps gloo's collectives
    in the same order on every rank (FACTS.md); same maths and bytes, no overlap."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    future = powerSGD_hook(state, bucket)
    future.wait()
    return future


class Stopwatch:
    """Seconds spent inside wrapped calls since the last read: the reduction within an update."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)  # DDP checks a comm hook's signature
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def read(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def build_arms(model, rank: int, tokens: int, watch: Stopwatch):
    """{arm: one update} on one engine: nshard's reducers through their seams, the hook through DDP."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    from torch.nn.parallel import DistributedDataParallel

    from nshard.seam import engine as engine_mod
    from nshard.comm.config import parse_config
    from nshard.seam.reduction import DeepSpeedReduction

    engine = engine_mod.build_engine(model, ds_config(dist.get_world_size()))
    seams = {"dense": engine_mod.install_reducer(engine, parse_config({"reducer": "dense"})),
             "nshard": engine_mod.install_reducer(engine, parse_config({"reducer": "powersgd", "rank": rank,
                                                                        "dense_warmup_updates": 0})),
             # install_reducer switched DeepSpeed's own all-reduce off: this seam computes and steps only
             "one": DeepSpeedReduction(), "local": DeepSpeedReduction()}
    for arm in ("dense", "nshard"):
        seams[arm].reducer.reduce = watch.wrap(seams[arm].reducer.reduce)
    ddp = DistributedDataParallel(engine.module, forward_sync_buffers=False)
    # Its first 2 updates are plain all-reduces (the least it allows): DDP rebuilds its buckets after
    # the first, and the hook keys its error buffers by bucket index. The warm-up rounds run them.
    state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, watch.wrap(waited_powerSGD_hook))
    vocab, me = model.config.vocab_size, dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + me)

    def batch():
        return torch.randint(0, vocab, (1, tokens), generator=generator)

    def through_seam(seam):
        ids = batch()
        seam.backward_and_step(engine, seam.forward(engine, input_ids=ids, labels=ids).loss, last=True)

    def hook_update():
        ids = batch()
        ddp(input_ids=ids, labels=ids).loss.backward()
        engine.step()

    updates = {arm: functools.partial(through_seam, seam) for arm, seam in seams.items()}
    if me != 0:
        updates["one"] = lambda: None  # one rank computes; this one only meets it at the barriers
    updates["hook"] = hook_update
    ledgers = {arm: seams[arm].last_update_bytes for arm in ("dense", "nshard")}
    return updates, ledgers, state


def measure(update, ledger, counters) -> dict:
    """One update between barriers: this rank's seconds (and those inside the reduction), and the bytes
    three ways (plus what dist.all_reduce was handed)."""
    import torch.distributed as dist

    from nshard.run.netcount import tx_bytes

    logged, counted, watch = counters
    logged.take()
    watch.read()
    counted_before = counted.bytes
    dist.barrier()
    tx_start, start = tx_bytes("eth0"), time.perf_counter()
    update()
    seconds = time.perf_counter() - start
    dist.barrier()  # the peer has received everything this rank sent
    tx_end = tx_bytes("eth0")
    return {"seconds": seconds, "reduce_s": watch.read(), "kernel_tx_bytes": tx_end - tx_start,
            "comms_logger_bytes": collective_bytes(logged.take()), "ledger_bytes": ledger() if ledger else None,
            "all_reduce_bytes": counted.bytes - counted_before}


def collective_bytes(taken: dict) -> int:
    """What CollectiveCounter.take() counted this rank handing to collectives: DeepSpeed's gradient bytes, nshard's
    reducer (as the logger saw it; None with the logger off) and the rest (delta sync's bytes are inside other_bytes)."""
    return taken["deepspeed_grad_bytes"] + (taken["logged_reducer_bytes"] or 0) + taken["other_bytes"]


def worker(args) -> None:
    from nshard.seam.launch_env import prepare_process_env

    # Each worker holds ~8 copies of the gradient size (parameters, gradients, AdamW, both error
    # buffers, DDP's buckets): on a shared machine the OOM killer is to take the benchmark, not others' work.
    Path("/proc/self/oom_score_adj").write_text("1000")
    prepare_process_env()
    import torch.distributed as dist

    from launch.bench_powersgd import CountingAllReduce, floor_bytes
    from nshard.seam import engine as engine_mod
    from nshard.seam import patches

    engine_mod.init_distributed()
    dist.all_reduce = CountingAllReduce()  # what every arm hands to torch.distributed, the hook's included
    model = build_model(args.worker, args.layers)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    watch = Stopwatch()
    updates, ledgers, hook_state = build_arms(model, args.rank, args.tokens, watch)
    counters = (patches.CollectiveCounter(), dist.all_reduce, watch)
    me, samples = dist.get_rank(), []
    for _ in range(hook_state.start_powerSGD_iter):  # unshaped warm-up: allocations, first Q draws, DDP's buckets
        for arm in ARMS:
            measure(updates[arm], ledgers.get(arm), counters)
    assert hook_state.iter >= hook_state.start_powerSGD_iter, "the hook would still be in its dense warm-up"
    for rate in args.rates.split(","):
        if me == 0:
            subprocess.run(["bash", str(HOSTS_SH), "rate", rate], check=True)
        dist.barrier()
        for round_ in range(args.updates):
            for arm in ARMS[round_ % len(ARMS):] + ARMS[: round_ % len(ARMS)]:
                samples.append({"rate": rate, "arm": arm, "round": round_,
                                **measure(updates[arm], ledgers.get(arm), counters)})
                if me == 0:
                    print(f"{args.worker} {rate} round {round_} {arm}: {samples[-1]}", flush=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, samples)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if me == 0:
        subprocess.run(["bash", str(HOSTS_SH), "rate", "none"], check=True)
        count, low_rank, remainder = floor_bytes(shapes, args.rank, min_compression_rate=2)
        raw = {"params": sum(math.prod(s) for s in shapes.values()), "compressed_matrices": count,
               "floor_bytes": low_rank + remainder, "peak_rss_bytes_by_rank": peaks, "samples_by_rank": every}
        Path(args.out, f"{args.worker}.raw.json").write_text(json.dumps(raw))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ orchestrator side

def hosts() -> list[tuple[str, str]]:
    """(namespace, address) per host, as launch/hosts.sh wrote them; rank 0 on the first."""
    return [tuple(line.split("\t")[:2]) for line in HOSTS_TSV.read_text().splitlines()]


def run_model(name: str, args, out: Path) -> dict:
    """Both workers of one model, each in its host's namespace; a failed one takes the other down."""
    pairs = hosts()
    port = random.randint(20000, 60000)  # inside the namespaces: nothing else listens there
    procs = []
    for rank, (ns, _) in enumerate(pairs):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "launch.bench_link", "--worker", name, "--out", str(out),
               *[f"--{k}={getattr(args, k)}" for k in ("rates", "layers", "rank", "updates", "tokens")]]
        log = (out / f"{name}.rank{rank}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=worker_env(rank, pairs, port), stdout=log, stderr=subprocess.STDOUT,
                                      cwd=REPO))
    wait_workers(procs, f"a {name} worker failed: see {out}/{name}.rank*.log")
    return json.loads((out / f"{name}.raw.json").read_text())


def worker_env(rank: int, pairs: list[tuple[str, str]], port: int, ifname: str | None = "eth0") -> dict:
    """A benchmark worker's environment: one rank per host, rank 0's address the master, one thread."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(len(pairs)), LOCAL_WORLD_SIZE="1",
                MASTER_ADDR=pairs[0][1], MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                PYTHONUNBUFFERED="1", **({"GLOO_SOCKET_IFNAME": ifname} if ifname else {}))


def wait_workers(procs: list[subprocess.Popen], failure: str) -> None:
    """Wait for every worker; the first that fails stops the others and raises `failure`."""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(failure)
            time.sleep(1)
        if any(p.returncode for p in procs):
            raise RuntimeError(failure)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def summarize(raw: dict, rates: list[str]) -> dict:
    """Per rate: each arm's median update seconds (the slower rank's, per update) and bytes, the limit, ratios."""
    by_rank = raw["samples_by_rank"]
    out = {}
    for rate in rates:
        arms = {}
        for arm in ARMS:
            rows = [[s for s in samples if s["rate"] == rate and s["arm"] == arm] for samples in by_rank]
            seconds = [max(pair) for pair in zip(*[[s["seconds"] for s in r] for r in rows])]
            med = lambda key, r=rows[0]: (statistics.median(s[key] for s in r)
                                          if r and r[0][key] is not None else None)
            arms[arm] = {"median_update_s": statistics.median(seconds), "update_s": seconds,
                         "median_reduce_s_rank0": med("reduce_s"),
                         "bytes_per_update": {"ledger": med("ledger_bytes"), "comms_logger": med("comms_logger_bytes"),
                                              "at_dist_all_reduce": med("all_reduce_bytes"),
                                              "kernel_tx_by_rank": [statistics.median(s["kernel_tx_bytes"] for s in r)
                                                                    for r in rows]}}
        out[rate] = {"arms": arms, **ratios(arms, raw["floor_bytes"], rate)}
    return out


def ratios(arms: dict, floor: int, rate: str) -> dict:
    t = {arm: arms[arm]["median_update_s"] for arm in ARMS}
    limit = max(t["one"], floor * 8 / rate_bits(rate))
    local_limit = max(t["local"], floor * 8 / rate_bits(rate))
    r = {"dense_over_nshard": t["dense"] / t["nshard"], "nshard_over_limit": t["nshard"] / limit,
         "nshard_over_limit_with_local_compute": t["nshard"] / local_limit,
         "hook_over_nshard": t["hook"] / t["nshard"], "hook_over_limit": t["hook"] / limit,
         "dense_over_hook": t["dense"] / t["hook"]}
    targets = {"nshard_3x_faster_than_dense": r["dense_over_nshard"] >= 3,
               "nshard_within_1.3x_of_limit": r["nshard_over_limit"] <= 1.3,
               "nshard_faster_than_hook": r["hook_over_nshard"] > 1}
    return {"physical_limit_s": limit, "floor_over_link_s": floor * 8 / rate_bits(rate), "ratios": r,
            "targets_met": targets}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items()):
        rates = list(model["rates"])
        x = [rate_bits(r) / 1e6 for r in rates]
        for arm in ARMS:
            ax.plot(x, [model["rates"][r]["arms"][arm]["median_update_s"] for r in rates], marker="o", label=arm)
        ax.plot(x, [model["rates"][r]["physical_limit_s"] for r in rates], "k--", label="physical limit")
        ax.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="median update (s)",
               title=f"{name}: {model['params'] / 1e6:.1f}M params, rank {report['settings']['rank']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(report: dict) -> None:
    print("| model | rate | " + " | ".join(f"{arm} s" for arm in ARMS) + " | limit s | dense/nshard | nshard/limit | "
          "hook/nshard | B/update dense (ledger, logger, kernel r0/r1) | B/update nshard (ledger, logger, kernel r0/r1) "
          "| B/update hook (at dist.all_reduce, kernel r0/r1) |")
    print("|" + "---|" * (len(ARMS) + 9))
    for name, model in report["models"].items():
        for rate, row in model["rates"].items():
            a, r = row["arms"], row["ratios"]
            b = {arm: a[arm]["bytes_per_update"] for arm in ARMS}
            k = {arm: "/".join(f"{v:,.0f}" for v in b[arm]["kernel_tx_by_rank"]) for arm in ARMS}
            print(f"| {name} | {rate} | " + " | ".join(f"{a[arm]['median_update_s']:.2f}" for arm in ARMS) +
                  f" | {row['physical_limit_s']:.2f} | {r['dense_over_nshard']:.2f}x | {r['nshard_over_limit']:.2f}x | "
                  f"{r['hook_over_nshard']:.2f}x | {b['dense']['ledger']:,.0f}, {b['dense']['comms_logger']:,.0f}, "
                  f"{k['dense']} | {b['nshard']['ledger']:,.0f}, {b['nshard']['comms_logger']:,.0f}, {k['nshard']} | "
                  f"{b['hook']['at_dist_all_reduce']:,.0f}, {k['hook']} |")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rates, started, load_before = args.rates.split(","), time.perf_counter(), uptime()
    for rate in rates:
        rate_bits(rate)
    subprocess.run(["bash", str(HOSTS_SH), "up"], check=True, stdout=subprocess.DEVNULL)
    report = {"command": " ".join(sys.argv), "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "settings": {k: getattr(args, k) for k in ("rates", "models", "layers", "rank", "updates", "tokens")},
              "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
              "arms": ARM_NOTES,
              "load": {"uptime_before": load_before}, "models": {}}
    try:
        for name in args.models.split(","):
            raw = run_model(name, args, out)
            report["models"][name] = {"params": raw["params"], "dense_bytes": 4 * raw["params"],
                                      "floor_bytes": raw["floor_bytes"], "compressed_matrices": raw["compressed_matrices"],
                                      "peak_rss_bytes_by_rank": raw["peak_rss_bytes_by_rank"],
                                      "rates": summarize(raw, rates)}
            report["load"][f"uptime_after_{name}"] = uptime()
            (out / "bench_link.json").write_text(json.dumps(report, indent=1))  # what a later failure leaves
    finally:
        subprocess.run(["bash", str(HOSTS_SH), "down"], check=False)
    report["wall_s"] = time.perf_counter() - started
    (out / "bench_link.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "bench_link.png")
    print_table(report)
    print(f"\nwrote {out / 'bench_link.json'} and {out / 'bench_link.png'} ({report['wall_s']:.0f} s; "
          f"load before: {load_before})")


if __name__ == "__main__":
    main()
