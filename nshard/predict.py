"""Will two hosts beat one? An answer before the run, from one short run's phase receipts and a measured link.

    .venv/bin/python -m nshard.predict runs/short --link runs/bench_link/bench_link.json --link_rate 1gbit
    .venv/bin/python -m nshard.predict runs/short --link_mbit 1000 --rtt_ms 0.2 --powersgd_ranks 4,32 --json -

The short run (any world size, ZeRO-0; its metrics.jsonl must hold each update's `phases` and `microbatch_s`) gives
each update's seconds by phase. Each option's update on --hosts hosts (one rank each) is modelled as:

    forward_backward  the slowest rank's microbatches. Microbatches are the one-rank arm's on every world size
                      (nshard/run/data.py deal), so each rank's share is the short run's own microbatch seconds
                      (a microbatch the short run's rank 0 did not run: its padded tokens at the update's seconds
                      per padded token; a rank short of microbatches reruns its first one, as the trainer does)
    reducer_compute   dense: the short run's own (flattening and copying back do not shrink with more ranks);
                      PowerSGD at rank r: the median of a PowerSGD run's compressed updates at that rank
                      (--powersgd_run, or the short run itself), else a probe here that times nshard's own
                      PowerSGDReducer.reduce on gradients of the model's shapes, with no wire (--probe_threads)
    communication     bytes per rank on a ring all-reduce, 2(W-1)/W x payload, over the link's goodput, plus
                      (W-1) round trips per all-reduce; the payload and the all-reduces from the reducer's layout
                      (nshard/comm/layout.py build_layout: dense remainder, P, Q) and one more 4-byte all-reduce
                      when the short run had DeepSpeed's scalar one
    optimizer_step, parameter_sync, rest: the short run's, unchanged (at ZeRO-0 every rank steps the whole model)

Every phase but the communication is multiplied by --concurrent_compute (default 1.0: hosts that share nothing).

The short run's own collective_wait is left out: the modelled communication takes its place, after the compute (a
short run or PowerSGD ds_config with nshard.overlap_backward true, the reduction during backward, is refused). A
PowerSGD option runs its first dense_warmup_updates updates dense. The link is bench_link's JSON (launch/bench_link.py: the dense
arm's payload over the seconds inside its reduction, less the short run's flatten-and-copy seconds per byte; the
faster rank of each round, so the wait for the slower one's compute is left out), or --link_mbit and --rtt_ms as
given (the rate then stands for goodput as it is). It prints a table, each option's run and speedup over one host,
and a recommendation: the fastest option, "stay on one host" when no two-host option beats it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser

REPO = Path(__file__).resolve().parent.parent
KEPT = ("optimizer_step", "parameter_sync", "rest")
"""Phases a two-host update keeps as the short run measured them."""
DEFAULT_POWERSGD = REPO / "ds_configs" / "powersgd.json"


class PredictError(ValueError):
    """Bad input to the predictor: the message names the input and the fix."""


# ------------------------------------------------------------------------------------------------ inputs

@dataclass
class ShortRun:
    """What the model needs from one short run."""

    path: Path
    world: int
    reducer: str
    device: str
    zero_stage: int
    updates: list[dict]
    """metrics.jsonl's lines, in order."""
    shapes: dict[str, tuple[int, ...]]
    """The trained parameters' shapes (what a reducer reduces)."""
    microbatch_docs: int | None = None
    schedule: list[list[int]] | None = None
    lengths: list[int] | None = None
    powersgd: dict | None = None
    """The run's own nshard section when its reducer is PowerSGD."""
    notes: list[str] = field(default_factory=list)


def read_run(path: str | Path) -> ShortRun:
    """The short run's directory, refused with one error naming the missing piece and the fix."""
    path = Path(path)
    if not path.is_dir():
        raise PredictError(f"run directory {path} does not exist: give the --out directory of a finished short run "
                           "(nshard/train.py or the study's arms/NAME)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise PredictError(f"{path} has no metrics.jsonl: give the --out directory of a short run that trained "
                           "at least one update")
    updates = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not updates:
        raise PredictError(f"{metrics} is empty: the short run trained no update; run it for a few updates")
    for row in updates:
        if "phases" not in row or "microbatch_s" not in row:
            raise PredictError(f"{metrics} update {row.get('update')} has no phases (update_phases): it was written "
                               "by an nshard that did not split updates into phases; rerun the short run with this "
                               "nshard")
    run_json = _json(path / "run.json", "run.json", "a run directory nshard/train.py wrote")
    receipt = _json(path / "receipts" / "rank-0.json", "receipts/rank-0.json",
                    "a finished run (receipts are written at its end)")
    stage = int(run_json.get("zero_stage") or 0)
    if stage != 0:
        raise PredictError(f"{path} ran ZeRO stage {stage}; the model covers stage 0 (every rank steps the whole "
                           "model); predict from a stage-0 short run")
    run = ShortRun(path=path, world=int(run_json.get("world_size") or receipt.get("world_size") or 1),
                   reducer=str(run_json.get("reducer") or "deepspeed"), device=str(receipt.get("device") or "cpu"),
                   zero_stage=stage, updates=updates, shapes=model_shapes(path, run_json))
    ds_config = path / "ds_config.json"
    section = (json.loads(ds_config.read_text()).get("nshard") or {}) if ds_config.is_file() else {}
    refuse_overlap(section, f"{path} ran with nshard.overlap_backward true (its ds_config.json)",
                   "predict from a short run with overlap_backward false")
    if run.reducer == "powersgd" and section:
        run.powersgd = section
    _read_schedule(run)
    return run


def refuse_overlap(section: dict, what: str, fix: str) -> None:
    """The model times the communication after the compute (nshard.overlap_backward off): a run or an option with
    the reduction started during backward is refused, not predicted wrongly."""
    if section.get("overlap_backward") is True:
        raise PredictError(f"{what}: the predictor models the reduction after the backward, not during it "
                           f"(overlap_backward); {fix}")


def _json(path: Path, name: str, what: str) -> dict:
    if not path.is_file():
        raise PredictError(f"{path.parent if name == 'run.json' else path.parent.parent} has no {name}: give "
                           f"{what}")
    return json.loads(path.read_text())


def model_shapes(path: Path, run_json: dict) -> dict[str, tuple[int, ...]]:
    """The trained parameters' shapes, from the exported model's config (built on the meta device: no weights are
    read), else from the model the run names."""
    from transformers import AutoConfig

    from nshard.run.models import resolve_model, shaped_model

    model_dir = path / "model"
    if not (model_dir / "config.json").is_file():
        spec = (run_json.get("model") or {}).get("spec")
        if not spec:
            raise PredictError(f"{path} has neither model/config.json nor a model spec in run.json: give a run that "
                               "finished (it exports its model)")
        model_dir = Path(resolve_model(spec).path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = shaped_model(config, materialize=False)
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def _read_schedule(run: ShortRun) -> None:
    """The plan's microbatch size and the prepared schedule and lengths, which fix each rank's microbatches; without
    them forward_backward is scaled by the share of documents (said in the notes)."""
    import tomllib

    plan, prepared = run.path / "plan.toml", run.path / "prepared"
    try:
        run.microbatch_docs = int(tomllib.loads(plan.read_text())["train"]["microbatch_docs"])
        run.schedule = json.loads((prepared / "schedule.json").read_text())
        run.lengths = [len(json.loads(line)["input_ids"])
                       for line in (prepared / "documents.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, KeyError, ValueError):
        run.microbatch_docs = run.schedule = run.lengths = None
        run.notes.append("no plan.toml or prepared/ in the run: forward_backward scaled by ranks, not by microbatch")


@dataclass
class Link:
    """Goodput in bits/s and the round-trip time, and how much slower a rank computes while every host computes at
    once (1.0 on hosts that share nothing; bench_link's `local` arm over its `one` arm); where they came from."""

    bits_per_s: float
    rtt_s: float
    source: str
    concurrent_compute: float = 1.0


def link_from_bench(path: str | Path, rate: str | None, local_s_per_byte: float, rtt_s: float,
                    concurrent_compute: float | None = None) -> Link:
    """The link bench_link measured at `rate`: the dense arm's payload over its seconds inside the reduction, less
    the flatten-and-copy work (`local_s_per_byte` x payload). Each round's faster rank (bench_link's <model>.raw.json
    beside the JSON) did not wait for the other's compute; without the raw file, rank 0's median. The bench's `local`
    arm (both ranks compute at once) over its `one` arm is reported, not applied: its 32-token updates are bound by
    memory, training's microbatches by arithmetic, and the two slow down differently when they share a machine;
    concurrent_compute (default 1.0, hosts that share nothing) is what the prediction applies."""
    path = Path(path)
    if not path.is_file():
        raise PredictError(f"--link {path} does not exist: run launch/bench_link.py first (it writes "
                           "runs/bench_link/bench_link.json) or give --link_mbit")
    report = json.loads(path.read_text())
    rates = [r for r in report.get("settings", {}).get("rates", "").split(",") if r]
    if rate is None:
        if len(rates) != 1:
            raise PredictError(f"--link {path} measured rates {', '.join(rates)}: pick one with --link_rate")
        rate = rates[0]
    if rate not in rates:
        raise PredictError(f"--link_rate {rate}: {path} measured {', '.join(rates) or 'no rate'}; use one of those")
    best = None
    for name, model in report.get("models", {}).items():
        dense = model["rates"][rate]["arms"]["dense"]
        payload = dense["bytes_per_update"]["ledger"]
        raw = path.with_name(f"{name}.raw.json")
        if raw.is_file():
            by_rank = json.loads(raw.read_text())["samples_by_rank"]
            rows = [[s["reduce_s"] for s in samples if s["rate"] == rate and s["arm"] == "dense"]
                    for samples in by_rank]
            seconds = statistics.median(min(pair) for pair in zip(*rows))
            how = "the faster rank's"
        else:
            seconds, how = dense["median_reduce_s_rank0"], "rank 0's"
        wire_s = seconds - local_s_per_byte * payload
        arms = model["rates"][rate]["arms"]
        shared = (arms["local"]["median_update_s"] / arms["one"]["median_update_s"]
                  if "local" in arms and "one" in arms else 1.0)
        if payload and wire_s > 0 and (best is None or payload > best[0]):
            best = (payload, wire_s, name, how, shared)
    if best is None:
        raise PredictError(f"--link {path} has no dense arm with bytes at {rate}: rerun launch/bench_link.py")
    payload, wire_s, name, how, shared = best
    bits = payload * 8 / wire_s
    factor = 1.0 if concurrent_compute is None else concurrent_compute
    return Link(bits, rtt_s, f"{path} at {rate}: model {name}'s dense arm, {payload:,} B in {wire_s:.3f} s ({how} "
                             f"median inside the reduction less {local_s_per_byte * payload:.3f} s of flatten and "
                             f"copy) = {bits / 1e6:.1f} Mbit/s; its local arm over its one arm {shared:.2f}x (not "
                             f"applied; concurrent compute {factor:.2f}x "
                             f"{'as given' if concurrent_compute is not None else 'by default'})", factor)


# ------------------------------------------------------------------------------------------------ the model

def payload(shapes: dict, reducer: str, rank: int | None = None, min_compression_rate: float = 2) -> tuple[int, int]:
    """(payload bytes, gradient all-reduces) of one update: dense, one flat fp32 all-reduce; PowerSGD, the dense
    remainder, P and Q (nshard/comm/layout.py's plan, as nshard/comm/powersgd.py sends it)."""
    from nshard.comm.layout import build_layout

    if reducer == "dense":
        return 4 * sum(math.prod(s) for s in shapes.values()), 1
    layout = build_layout(shapes, rank, min_compression_rate)
    remainder = sum(math.prod(layout.shapes[name]) for name in layout.dense_names)
    rounds = (1 if layout.dense_names else 0) + (2 if layout.matrices else 0)
    return 4 * (remainder + layout.p_numel + layout.q_numel), rounds


def comm_s(payload_bytes: int, rounds: int, hosts: int, link: Link) -> float:
    """A ring all-reduce: each rank sends 2(W-1)/W of the payload, each all-reduce 2(W-1) steps of half a round
    trip."""
    if hosts < 2:
        return 0.0
    wire = 2 * (hosts - 1) / hosts * payload_bytes
    return wire * 8 / link.bits_per_s + rounds * (hosts - 1) * link.rtt_s


def rank_forward_backward(run: ShortRun, index: int, hosts: int) -> float:
    """The slowest rank's forward_backward in update `index` on `hosts` ranks (module docstring)."""
    from nshard.run.data import deal

    row = run.updates[index]
    measured = row["phases"]["forward_backward"]
    if run.schedule is None or index >= len(run.schedule):
        return measured * run.world / hosts
    batch, mb = run.schedule[index], run.microbatch_docs
    padded = lambda micro: len(micro) * max(run.lengths[i] for i in micro)
    mine = [m for m in deal(batch, run.lengths, run.world, mb)[0] if m]
    times = row["microbatch_s"][: len(mine)]
    per_token = math.fsum(times) / max(1, sum(padded(m) for m in mine))
    known = {tuple(m): t for m, t in zip(mine, times)}
    slowest = 0.0
    for share in deal(batch, run.lengths, hosts, mb):
        real = [m for m in share if m]
        seconds = [known.get(tuple(m), per_token * padded(m)) for m in real]
        seconds += [seconds[0]] * (len(share) - len(real))  # fillers rerun the rank's first microbatch
        slowest = max(slowest, math.fsum(seconds))
    return slowest


@dataclass
class Option:
    name: str
    reducer: str
    rank: int | None
    payload_bytes: int
    rounds: int
    warmup: int
    reducer_compute_s: float
    reducer_compute_from: str
    update_s: list[float] = field(default_factory=list)
    compressed: list[bool] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)


def predict_updates(run: ShortRun, hosts: int, link: Link, option: Option, dense: Option | None,
                    updates: int) -> None:
    """The `updates` updates of a run of `option` on `hosts` hosts (filled into option): the short run's updates in
    order, then its later ones again in turn (not its first, which paid one-time costs); a PowerSGD option's first
    `warmup` updates as the dense option runs them. One host from a one-rank short run is that run as measured."""
    factor = link.concurrent_compute if hosts > 1 else 1.0  # every phase but the wire computes
    per_source = []
    for index, row in enumerate(run.updates):
        variants = {}
        for compressed in ((False, True) if option.reducer == "powersgd" else (False,)):
            use = option if compressed or dense is None else dense
            if hosts == 1 and run.world == 1:
                variants[compressed] = {**row["phases"]}
                continue
            variants[compressed] = {"forward_backward": factor * rank_forward_backward(run, index, hosts),
                                    "reducer_compute": factor * use.reducer_compute_s,
                                    "collective_wait": comm_s(use.payload_bytes, use.rounds, hosts, link),
                                    **{k: factor * row["phases"].get(k, 0.0) for k in KEPT}}
        per_source.append(variants)
    n = len(per_source)
    for i in range(updates):
        j = i if i < n else 1 + (i - n) % (n - 1) if n > 1 else 0
        compressed = option.reducer == "powersgd" and i >= option.warmup
        option.phases.append(per_source[j][compressed])
        option.update_s.append(math.fsum(option.phases[-1].values()))
        option.compressed.append(compressed)


def phase_medians(option: Option) -> dict:
    """Each phase's median over the compressed updates (over all, for an option that never compresses)."""
    picked = [p for p, c in zip(option.phases, option.compressed) if c == any(option.compressed)]
    return {k: statistics.median(p[k] for p in picked) for k in picked[0]}


def median_of(option: Option, compressed: bool | None = None) -> float | None:
    picked = [s for s, c in zip(option.update_s, option.compressed) if compressed is None or c == compressed]
    return statistics.median(picked) if picked else None


# ------------------------------------------------------------------------------------------------ compute sources

class LocalTransport:
    """A transport with no wire, for the probe: every all-reduce returns at once (its bytes are still counted)."""

    def __init__(self, world_size: int):
        self.world_size, self.rank = world_size, 0

    def all_reduce_sum_(self, tensor) -> int:
        from nshard.comm.transport import payload_bytes

        return payload_bytes(tensor)

    def all_gather_object(self, obj) -> list:
        return [obj] * self.world_size


def probe_powersgd(shapes: dict, config: dict, hosts: int, threads: int, repeats: int) -> dict:
    """reducer_compute of nshard's PowerSGDReducer.reduce at `config` on fp32 CPU gradients of `shapes`, through
    the phase clock (median of `repeats` after one untimed update that allocates and draws Q)."""
    import torch

    from nshard.comm.config import parse_config
    from nshard.comm.powersgd import PowerSGDReducer
    from nshard.phases import CLOCK

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reducer = PowerSGDReducer(parse_config({**config, "dense_warmup_updates": 0}), LocalTransport(hosts))
        generator = torch.Generator().manual_seed(0)
        grads = {name: torch.randn(shape, generator=generator) for name, shape in sorted(shapes.items())}
        runs = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            CLOCK.start()
            reducer.reduce(grads)
            split = CLOCK.stop(time.perf_counter() - start)
            if i:
                runs.append(split)
        del grads, reducer
    finally:
        torch.set_num_threads(before)
    return {"reducer_compute_s": statistics.median(r["phases"]["reducer_compute"] for r in runs),
            "detail_s": {k: statistics.median(r["detail"][k] for r in runs)
                         for k in ("powersgd_pq", "orthogonalize", "error_update")}}


def receipts_powersgd(run: ShortRun, rank: int) -> float | None:
    """The median reducer_compute of a PowerSGD run's compressed updates, when it ran at `rank`."""
    if run.reducer != "powersgd" or not run.powersgd or int(run.powersgd.get("rank", 0)) != rank:
        return None
    seconds = [row["phases"]["reducer_compute"] for row in run.updates if row.get("compressed")]
    return statistics.median(seconds) if seconds else None


def dense_reducer_compute(run: ShortRun) -> float:
    """The short run's reducer_compute over its dense updates (the flatten, average and copy back that a dense
    two-host update keeps)."""
    seconds = [row["phases"]["reducer_compute"] for row in run.updates if not row.get("compressed")]
    if not seconds:
        raise PredictError(f"{run.path} has no dense update to take the dense reducer's own compute from: give a "
                           "short run with at least one dense update (a one-rank run, or PowerSGD with a warm-up)")
    return statistics.median(seconds)


# ------------------------------------------------------------------------------------------------ the answer

def predict(run: ShortRun, link: Link, hosts: int = 2, ranks: list[int] | None = None,
            powersgd_config: dict | None = None, updates: int | None = None, powersgd_run: ShortRun | None = None,
            probe=probe_powersgd, probe_threads: int = 1, probe_repeats: int = 3) -> dict:
    """Every option's predicted updates, run and speedup over one host, and the recommendation (a JSON-able dict)."""
    config = {**(powersgd_config or {}), "reducer": "powersgd"}
    ranks = ranks or [int(config.get("rank", 32))]
    warmup = int(config.get("dense_warmup_updates", 0))
    rate = float(config.get("min_compression_rate", 2))
    updates = updates or len(run.updates)
    scalar = any(row.get("deepspeed_grad_bytes") for row in run.updates)
    extra = 1 if scalar else 0

    dense_bytes, dense_rounds = payload(run.shapes, "dense")
    dense_compute = dense_reducer_compute(run)
    one = Option("one host", "dense", None, 0, 0, 0, dense_compute, "the short run's dense updates")
    predict_updates(run, 1, link, one, None, updates)
    dense = Option("dense", "dense", None, dense_bytes, dense_rounds + extra, 0, dense_compute,
                   "the short run's dense updates")
    predict_updates(run, hosts, link, dense, None, updates)
    options, probes = [one, dense], {}
    for r in ranks:
        sent, rounds = payload(run.shapes, "powersgd", r, rate)
        from_receipts = next((s for s in (receipts_powersgd(source, r) for source in (powersgd_run, run)
                                          if source is not None) if s is not None), None)
        if from_receipts is not None:
            compute, where = from_receipts, "a PowerSGD run's compressed updates"
        else:
            if run.device != "cpu":
                raise PredictError(f"{run.path} trained on {run.device}; the probe times PowerSGD on this CPU: give "
                                   f"--powersgd_run with a PowerSGD run at rank {r} on that device")
            probed = probe(run.shapes, {**config, "rank": r}, hosts, probe_threads, probe_repeats)
            compute, where = probed["reducer_compute_s"], f"probe ({probe_threads} thread(s) here)"
            probes[r] = probed
        option = Option(f"powersgd r={r}", "powersgd", r, sent, rounds + extra, warmup, compute, where)
        predict_updates(run, hosts, link, option, dense, updates)
        options.append(option)
    notes = list(run.notes)
    if ranks and warmup >= updates:
        notes.append(f"PowerSGD's {warmup} dense warm-up updates cover all {updates} updates predicted: give "
                         "--updates the length of the real run")
    base = math.fsum(one.update_s)
    rows = []
    for option in options:
        total = math.fsum(option.update_s)
        rows.append({"name": option.name, "reducer": option.reducer, "rank": option.rank,
                     "hosts": 1 if option is one else hosts,
                     "payload_bytes": option.payload_bytes,
                     "wire_bytes_per_rank": 0 if option is one else 2 * (hosts - 1) / hosts * option.payload_bytes,
                     "all_reduces": option.rounds, "warmup_updates": option.warmup,
                     "reducer_compute_s": None if option is one and run.world == 1 else option.reducer_compute_s,
                     "reducer_compute_from": option.reducer_compute_from,
                     "median_update_s": median_of(option),
                     "median_compressed_update_s": median_of(option, True),
                     "median_dense_update_s": median_of(option, False),
                     "median_phase_s": phase_medians(option),
                     "update_s": option.update_s, "compressed": option.compressed, "run_s": total,
                     "speedup": base / total})
    return {"run": str(run.path), "short_run": {"world_size": run.world, "reducer": run.reducer, "device": run.device,
                                                "updates": len(run.updates),
                                                "parameters": sum(math.prod(s) for s in run.shapes.values())},
            "hosts": hosts, "updates": updates,
            "link": {"bits_per_s": link.bits_per_s, "rtt_s": link.rtt_s, "concurrent_compute": link.concurrent_compute,
                     "source": link.source},
            "options": rows, "recommendation": recommend(rows), "probes": {str(r): v for r, v in probes.items()},
            "notes": notes}


def recommend(rows: list[dict]) -> dict:
    """The fastest option; with the margin over the runner-up (or, staying on one host, how far the best two-host
    option falls short)."""
    ranked = sorted(rows, key=lambda r: r["run_s"])
    best, second = ranked[0], ranked[1]
    margin = second["run_s"] / best["run_s"]
    if best["name"] == "one host":
        text = (f"stay on one host: the best two-host option, {second['name']}, would run at {second['speedup']:.2f}x "
                f"one host's speed ({(1 - second['speedup']) * 100:.0f}% slower)")
    else:
        what = "dense" if best["reducer"] == "dense" else f"PowerSGD at rank {best['rank']}"
        text = (f"{what} on {best['hosts']} hosts: {best['speedup']:.2f}x one host, {margin:.2f}x faster than "
                f"the next best ({second['name']})")
    return {"choice": best["name"], "speedup": best["speedup"], "margin_over_next": margin, "next": second["name"],
            "text": text}


def print_table(result: dict) -> None:
    link = result["link"]
    print(f"short run {result['run']}: {result['short_run']['updates']} updates on {result['short_run']['world_size']} "
          f"rank(s), {result['short_run']['parameters']:,} parameters")
    print(f"link: {link['bits_per_s'] / 1e6:.1f} Mbit/s goodput, {link['rtt_s'] * 1e3:g} ms round trip, concurrent "
          f"compute {link['concurrent_compute']:.2f}x ({link['source']})")
    print(f"predicted for {result['updates']} updates on {result['hosts']} hosts:\n")
    print("| option | payload B/update | all-reduces | dense warm-up | reducer compute s | median update s | "
          "fwd+bwd / comm s | run s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["options"]:
        med = r["median_compressed_update_s"] or r["median_update_s"]
        p = r["median_phase_s"]
        compute = "—" if r["reducer_compute_s"] is None else f"{r['reducer_compute_s']:.3f}"
        print(f"| {r['name']} | {r['payload_bytes']:,} | {r['all_reduces']} | {r['warmup_updates']} | {compute} | "
              f"{med:.3f} | "
              f"{p['forward_backward']:.3f} / {p['collective_wait']:.3f} | {r['run_s']:.1f} | {r['speedup']:.2f}x |")
    print(f"\nrecommendation: {result['recommendation']['text']}")
    for note in result["notes"]:
        print(f"note: {note}")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("run", help="the short run's directory (its metrics.jsonl, run.json, receipts/)")
    link = parser.add_mutually_exclusive_group(required=True)
    link.add_argument("--link", type=Path, help="bench_link's JSON (launch/bench_link.py --out DIR writes "
                                                "DIR/bench_link.json)")
    link.add_argument("--link_mbit", type=float, help="the link's goodput in Mbit/s, as given")
    parser.add_argument("--link_rate", help="with --link: which measured rate (e.g. 1gbit); needed when it has several")
    parser.add_argument("--rtt_ms", type=float, default=0.0,
                        help="round trip between the hosts in ms (default 0: the emulated hosts add none)")
    parser.add_argument("--concurrent_compute", type=float,
                        help="how much slower a rank computes while every host computes at once (default 1.0: hosts "
                             "that share nothing; hosts emulated on one machine share its memory and caches)")
    parser.add_argument("--hosts", type=int, default=2, help="hosts of one rank each (default 2)")
    parser.add_argument("--powersgd_ranks", help="PowerSGD ranks to predict, comma-separated (default: the "
                                                 "PowerSGD ds_config's rank)")
    parser.add_argument("--powersgd_ds_config", type=Path,
                        help="the ds_config whose nshard section the PowerSGD options run (warm-up, compression "
                             "rule; default: the short run's own when it ran PowerSGD, else ds_configs/powersgd.json)")
    parser.add_argument("--powersgd_run", help="a PowerSGD run's directory: its compressed updates' reducer_compute "
                                               "at its rank stands in for the probe")
    parser.add_argument("--updates", type=int, help="updates of the run to predict (default: the short run's)")
    parser.add_argument("--probe_threads", type=int, default=1,
                        help="threads of the PowerSGD probe: a rank's threads on the hosts (default 1)")
    parser.add_argument("--probe_repeats", type=int, default=3, help="timed probe updates per rank (default 3)")
    parser.add_argument("--json", help="also write the prediction as JSON to this path ('-': stdout, no table)")
    return parser


def powersgd_section(run: ShortRun, path: Path | None) -> dict:
    if path is None and run.powersgd:
        return run.powersgd
    from nshard.seam.ds_config import load_ds_config

    section = load_ds_config(path or DEFAULT_POWERSGD).get("nshard") or {}
    if section.get("reducer") != "powersgd":
        raise PredictError(f"--powersgd_ds_config {path}: its nshard section has no reducer \"powersgd\"; give a "
                           "PowerSGD ds_config such as ds_configs/powersgd.json")
    refuse_overlap(section, f"--powersgd_ds_config {path} sets nshard.overlap_backward true",
                   "give a ds_config with overlap_backward false")
    return section


def parse_ranks(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        ranks = [int(t) for t in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise PredictError(f"--powersgd_ranks {text!r}: give positive whole numbers, comma-separated (e.g. 4,32)")
    return ranks


def run_cli(args: argparse.Namespace) -> dict:
    if args.hosts < 2:
        raise PredictError(f"--hosts {args.hosts}: give 2 or more (one host is the baseline every option is "
                           "compared with)")
    if args.concurrent_compute is not None and args.concurrent_compute <= 0:
        raise PredictError(f"--concurrent_compute {args.concurrent_compute}: give a factor above 0 (1.0: hosts that "
                           "share nothing)")
    if args.link_rate and args.link is None:
        raise PredictError("--link_rate picks a rate of --link's JSON: give --link too, or leave it out")
    run = read_run(args.run)
    other = read_run(args.powersgd_run) if args.powersgd_run else None
    rtt = args.rtt_ms / 1e3
    if args.link is not None:
        per_byte = dense_reducer_compute(run) / payload(run.shapes, "dense")[0]
        link = link_from_bench(args.link, args.link_rate, per_byte, rtt, args.concurrent_compute)
    else:
        if args.link_mbit <= 0:
            raise PredictError(f"--link_mbit {args.link_mbit}: give the link's rate in Mbit/s, above 0")
        link = Link(args.link_mbit * 1e6, rtt, "--link_mbit as given", args.concurrent_compute or 1.0)
    return predict(run, link, args.hosts, parse_ranks(args.powersgd_ranks),
                   powersgd_section(run, args.powersgd_ds_config), args.updates, other,
                   probe_threads=args.probe_threads, probe_repeats=args.probe_repeats)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        result = run_cli(args)
    except PredictError as error:
        sys.exit(f"nshard.predict: {error}")
    if args.json == "-":
        print(json.dumps(result, indent=1))
        return
    print_table(result)
    if args.json:
        from nshard.files import write_json_atomic

        write_json_atomic(Path(args.json), result)


if __name__ == "__main__":
    main()
