"""Checks nshard.predict against measured runs on the two emulated hosts (root; launch/hosts.sh, one core each).

    .venv/bin/python -m launch.check_predict --out runs/check-predict

In order, so that every prediction is written before the runs it predicts:
  1. launch/bench_link.py measures the link at each of --rates (its own pair of hosts, SmolLM2-135M's shapes with
     --bench_layers layers, --bench_updates rounds);
  2. a random Llama with SmolLM2-135M's layer shapes, --layers layers and the tiny tokenizer's vocabulary is built
     into --out/model, and a plan of --updates updates of --global_batch_docs documents (the tiny plan's data)
     into --out/plan.toml; fp32 ds_configs, stage 0: nshard's dense reducer and PowerSGD at --rank with --warmup
     dense updates;
  3. the pair comes up (one core per host) and the one-rank run trains on the first host (the short run);
  4. nshard.predict, from that run and bench_link's JSON, predicts dense and PowerSGD on two hosts at each rate
     (--out/predicted-RATE.json);
  5. at each rate the dense and the PowerSGD run train across both hosts;
  6. predicted against measured: the median update (PowerSGD: of its compressed updates) and the run (the sum of
     its updates), each with its relative error. It writes --out/check_predict.json: all of it, the CPU included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "nshard" / "train.py"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--out", default="runs/check-predict", help="directory for runs, predictions and the report")
    parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates, comma-separated")
    parser.add_argument("--layers", type=int, default=8, help="layers of the trained model (SmolLM2-135M's shapes)")
    parser.add_argument("--updates", type=int, default=6, help="updates of every run")
    parser.add_argument("--global_batch_docs", type=int, default=8, help="documents per update")
    parser.add_argument("--microbatch_docs", type=int, default=2, help="documents per microbatch")
    parser.add_argument("--rank", type=int, default=32, help="PowerSGD rank")
    parser.add_argument("--warmup", type=int, default=1, help="PowerSGD's dense warm-up updates")
    parser.add_argument("--bench_layers", type=int, default=2, help="bench_link's layers of SmolLM2-135M's shapes")
    parser.add_argument("--bench_updates", type=int, default=3, help="bench_link's timed rounds per rate")
    parser.add_argument("--link", type=Path, help="bench_link's JSON from an earlier run: skips step 1")
    parser.add_argument("--report_only", action="store_true",
                        help="run nothing: print predicted against measured from the files in --out")
    parser.add_argument("--tolerance", type=float, default=0.15, help="relative error each prediction must meet")
    return parser


def cpu() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"model": model, **{flag: flag in flags for flag in ("avx2", "avx512_bf16", "amx_bf16", "amx_tile")},
            "cpus": os.cpu_count(), "kernel": platform.release()}


def build_model(out: Path, layers: int) -> Path:
    """SmolLM2-135M's layer shapes, `layers` of them, the tiny tokenizer's vocabulary, nshard's seeded init."""
    target = out / "model"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nshard.run.models import resolve_model, seeded_init

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny").path)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=len(tokenizer), tie_word_embeddings=True,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    seeded_init(LlamaForCausalLM(config), 0).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def write_inputs(out: Path, args) -> tuple[Path, Path, Path]:
    model = build_model(out, args.layers)
    plan = out / "plan.toml"
    plan.write_text(f"""# nshard.predict's check (launch/check_predict.py): the tiny plan's data, a larger model
name = "check-predict"

[model]
spec = "{model}"
max_length = 256

[data]
seed = 7
eval_seed = 7007
train_cases_per_family = 6
eval_cases_per_family = 4
replay_docs = 8
replay_file = "launch/data/replay_general.jsonl"
retention_docs = 4

[train]
updates = {args.updates}
global_batch_docs = {args.global_batch_docs}
microbatch_docs = {args.microbatch_docs}
seed = 0
""")
    base = json.loads((REPO / "ds_configs" / "powersgd.json").read_text())
    dense, powersgd = out / "dense.json", out / "powersgd.json"
    dense.write_text(json.dumps({**base, "nshard": {"reducer": "dense"}}, indent=1))
    powersgd.write_text(json.dumps({**base, "nshard": {**base["nshard"], "rank": args.rank,
                                                       "dense_warmup_updates": args.warmup}}, indent=1))
    return plan, dense, powersgd


def train(hostfile: Path, force_multi: bool, ds_config: Path, plan: Path, run: Path) -> dict:
    """One run through DeepSpeed's multi-node launcher; its wall seconds."""
    command = [str(Path(sys.executable).with_name("deepspeed")), "--hostfile", str(hostfile),
               *(["--force_multi"] if force_multi else []), "--master_port", str(random.randint(20000, 60000)),
               str(TRAIN), "--ds_config", str(ds_config), "--plan", str(plan), "--out", str(run), "--overwrite"]
    started, load = time.perf_counter(), os.getloadavg()[0]
    with (run.parent / f"{run.name}.log").open("w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode:
        raise RuntimeError(f"run {run} failed (exit {done.returncode}): see {run.parent / (run.name + '.log')}")
    wall, after = time.perf_counter() - started, os.getloadavg()[0]
    print(f"  {run.name}: {wall:.0f} s (load average {load:.1f} before, {after:.1f} after)", flush=True)
    return {"wall_s": wall, "loadavg_1min": [load, after]}


def measured(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    compressed = [r["update_s"] for r in rows if r["compressed"]]
    return {"update_s": [r["update_s"] for r in rows], "run_s": sum(r["update_s"] for r in rows),
            "median_update_s": statistics.median(compressed or [r["update_s"] for r in rows]),
            "median_phase_s": {k: statistics.median(r["phases"][k] for r in rows if r["compressed"] == bool(compressed))
                               for k in rows[0]["phases"]}}


def predict(one: Path, bench: Path, rate: str, powersgd: Path, rank: int) -> dict:
    from nshard import predict as p

    run = p.read_run(one)
    per_byte = p.dense_reducer_compute(run) / p.payload(run.shapes, "dense")[0]
    link = p.link_from_bench(bench, rate, per_byte, 0.0)
    return p.predict(run, link, 2, [rank], p.powersgd_section(run, powersgd), probe_threads=1)


def compute_ratio(one: Path, two: Path) -> float:
    """The median, over every microbatch of a two-host run, of its seconds over the same microbatch's seconds in the
    one-rank run (microbatches are the one-rank run's on any world size): how much slower the hosts computed than the
    short run did. The model assumes 1.0 (--concurrent_compute)."""
    from nshard import predict as p
    from nshard.run.data import deal

    short = p.read_run(one)
    ratios = []
    receipts = [json.loads((two / "receipts" / f"rank-{r}.json").read_text()) for r in range(2)]
    for u, batch in enumerate(short.schedule[: len(short.updates)]):
        alone = {tuple(m): t for m, t in zip(deal(batch, short.lengths, 1, short.microbatch_docs)[0],
                                             short.updates[u]["microbatch_s"])}
        for rank, share in enumerate(deal(batch, short.lengths, 2, short.microbatch_docs)):
            for micro, seconds in zip(share, receipts[rank]["update_microbatch_s"][u]):
                if micro:
                    ratios.append(seconds / alone[tuple(micro)])
    return statistics.median(ratios)


def compare(predicted: dict, one: Path, runs: dict[str, Path], tolerance: float) -> list[dict]:
    rows = []
    alone = measured(one)["run_s"]
    for option in predicted["options"][1:]:
        got = measured(runs[option["reducer"]])
        want = option["median_compressed_update_s"] or option["median_update_s"]
        rows.append({"option": option["name"], "predicted_update_s": want, "measured_update_s": got["median_update_s"],
                     "update_error": want / got["median_update_s"] - 1,
                     "predicted_run_s": option["run_s"], "measured_run_s": got["run_s"],
                     "run_error": option["run_s"] / got["run_s"] - 1,
                     "predicted_speedup": option["speedup"], "measured_speedup": alone / got["run_s"],
                     "compute_ratio": compute_ratio(one, runs[option["reducer"]]),
                     "predicted_phase_s": option["median_phase_s"], "measured_phase_s": got["median_phase_s"]})
        rows[-1]["within"] = abs(rows[-1]["update_error"]) <= tolerance and abs(rows[-1]["run_error"]) <= tolerance
    return rows


def summarize(out: Path, rates: list[str], tolerance: float) -> dict:
    """Predicted (written before the runs) against measured, from the files in `out`."""
    one = out / "one"
    result = {"one_rank": measured(one), "rates": {}}
    for rate in rates:
        predicted = json.loads((out / f"predicted-{rate}.json").read_text())
        runs = {"dense": out / f"dense-{rate}", "powersgd": out / f"powersgd-{rate}"}
        result["rates"][rate] = {"predicted": predicted, "compare": compare(predicted, one, runs, tolerance)}
    return result


def print_summary(result: dict, cpu_info: dict, tolerance: float) -> None:
    print(f"\nCPU: {cpu_info['model']} (avx2 {cpu_info['avx2']}, avx512_bf16 {cpu_info['avx512_bf16']}, "
          f"amx {cpu_info['amx_bf16']}); one rank: median update {result['one_rank']['median_update_s']:.3f} s, "
          f"run {result['one_rank']['run_s']:.2f} s")
    print("| link | option | predicted update s | measured update s | error | predicted run s | measured run s | "
          "error | speedup predicted / measured | microbatch ÷ one rank's | recommendation |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rate, row in result["rates"].items():
        link = row["predicted"]["link"]["bits_per_s"] / 1e6
        for c in row["compare"]:
            print(f"| {rate} ({link:.0f} Mbit/s goodput) | {c['option']} | {c['predicted_update_s']:.3f} | "
                  f"{c['measured_update_s']:.3f} | {c['update_error']:+.1%} | {c['predicted_run_s']:.2f} | "
                  f"{c['measured_run_s']:.2f} | {c['run_error']:+.1%} | {c['predicted_speedup']:.2f}x / "
                  f"{c['measured_speedup']:.2f}x | {c['compute_ratio']:.2f}x | "
                  f"{row['predicted']['recommendation']['choice']} |")
    worst = max(abs(c[k]) for row in result["rates"].values() for c in row["compare"]
                for k in ("update_error", "run_error"))
    print(f"\nworst error {worst:.1%} (tolerance {tolerance:.0%})")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    out = (REPO / args.out).resolve()
    rates = args.rates.split(",")
    if args.report_only:
        return print_summary(summarize(out, rates, args.tolerance), cpu(), args.tolerance)
    if os.geteuid() != 0:
        sys.exit("launch/check_predict.py: the emulated hosts need root (launch/hosts.sh); run it as root")
    from nshard.files import write_json_atomic
    from nshard.study.placement import emulated_hosts

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"command": " ".join([Path(sys.executable).name, "-m", "launch.check_predict", *sys.argv[1:]]),
              "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(), "cpu": cpu(),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "walls": {}}
    bench = args.link or out / "bench_link" / "bench_link.json"
    if args.link is None:
        print("bench_link ...", flush=True)
        subprocess.run([sys.executable, "-m", "launch.bench_link", "--rates", args.rates, "--models", "135m",
                        "--layers", str(args.bench_layers), "--updates", str(args.bench_updates),
                        "--rank", str(args.rank), "--out", str(out / "bench_link")],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    plan, dense, powersgd = write_inputs(out, args)
    with emulated_hosts(rates[0], 1, out) as hosts:
        print("one rank on the first host ...", flush=True)
        report["walls"]["one"] = train(hosts["first"], True, dense, plan, out / "one")
        for rate in rates:
            write_json_atomic(out / f"predicted-{rate}.json", predict(out / "one", bench, rate, powersgd, args.rank))
            subprocess.run(["bash", str(REPO / "launch" / "hosts.sh"), "rate", rate], check=True)
            print(f"two hosts at {rate} ...", flush=True)
            for name, config in (("dense", dense), ("powersgd", powersgd)):
                report["walls"][f"{name}-{rate}"] = train(hosts["all"], False, config, plan, out / f"{name}-{rate}")
    report.update(summarize(out, rates, args.tolerance), wall_s=time.perf_counter() - started)
    write_json_atomic(out / "check_predict.json", report)
    print_summary(report, report["cpu"], args.tolerance)
    print(f"{out / 'check_predict.json'} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
