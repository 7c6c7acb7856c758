"""The one-rank bf16 update's fixed costs after backward, old way against new way in one run, on DeepSpeed's real engine.

    .venv/bin/python -m launch.bench_bf16_step [--models 135m 1.7b] [--layers_1_7b 2] [--updates 3] [--out FILE]

What is timed is what follows an update's last backward on the one-rank arm (ds_configs/cpu-dense.json's dense reducer,
bf16 at stage 0, one gloo process): nshard's reduction and hand-over to DeepSpeed (reducer_compute) and DeepSpeed's
step (optimizer_step), by the phase clock (nshard/phases.py), as the receipts split an update, but in this thread's
CPU seconds (--clock cpu, the default: torch computes on this thread with --threads 1, so the load of other
processes on a shared machine does not enter them; --clock wall times wall seconds, as the receipts do; the update's
wall seconds are printed either way). The microbatch sums
are filled with the same random gradients (N(0, --grad_std): norms over the clip of 1.0, so the clip applies) in
both ways. Old: the reduction with itself (NSHARD_ONE_RANK_REDUCTION=run) and HandOver into DeepSpeed's per-parameter
FP16_UnfusedOptimizer step (NSHARD_BF16_STEP=deepspeed). New (the default): no reduction on one rank, and the
flat fp32 gradient step (nshard/seam/patches.py install_flat_master_step). After --updates timed updates (and one
untimed) the bf16 weights, fp32 masters and AdamW moments of both ways are hashed and compared: bit-identical or not.

bf16 is forced (bf16.enabled true): on a CPU without bf16 units it runs, slowly, and the output says so. Each way
builds its own engine in turn (one at a time, to bound memory). SmolLM2-135M is timed whole. SmolLM2-1.7B's full
state (about 40 GB on this path) does not fit a 24 GiB machine: --layers_1_7b of its 24 decoder layers are trained,
with the embedding frozen (not stepped), and the seconds are scaled by the full model's trained parameters over the
slice's, which the output says (every timed operation is a pass over the gradients, masters or moments). The
machine's load average is printed before and after. Exits 1 when the two ways do not end bit-identical. Writes
nothing unless --out names a file.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {"135m": "smollm2-135m", "1.7b": "smollm2-1.7b"}
WAYS = {"old": {"NSHARD_ONE_RANK_REDUCTION": "run", "NSHARD_BF16_STEP": "deepspeed"},
        "new": {"NSHARD_ONE_RANK_REDUCTION": "skip", "NSHARD_BF16_STEP": "flat"}}
TIMED = ("reducer_compute", "collective_wait", "optimizer_step")
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def build_parser():
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["135m", "1.7b"])
    parser.add_argument("--layers_135m", type=int, default=None, help="decoder layers of SmolLM2-135M (default: all "
                        "30, the embedding trained; fewer: a slice, scaled)")
    parser.add_argument("--layers_1_7b", type=int, default=2, help="decoder layers of SmolLM2-1.7B's 24 in the "
                        "slice (default 2)")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per way, after one untimed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one per rank, as the study runs)")
    parser.add_argument("--grad_std", type=float, default=2e-4, help="standard deviation of the random gradients")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="what the phases are timed by: cpu, "
                        "this thread's CPU seconds (time.thread_time: another process's load does not enter them; "
                        "torch runs on this thread with --threads 1), or wall (time.perf_counter, as the receipts)")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    return parser


def model_config(name: str, layers: int | None):
    from transformers import AutoConfig

    from nshard.run.models import RANDOM_CONFIGS

    raw = json.loads((RANDOM_CONFIGS / f"{MODELS[name]}.json").read_text())
    full = AutoConfig.for_model(**raw)
    sliced = AutoConfig.for_model(**{**raw, "num_hidden_layers": layers or raw["num_hidden_layers"]})
    return full, sliced, layers is not None and layers < raw["num_hidden_layers"]


def trained_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_model(config, sliced: bool):
    """The architecture with N(0, 0.02) weights; a slice freezes the (tied) embedding, which stays out of the step."""
    import torch

    from nshard.run.models import shaped_model

    model = shaped_model(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    if sliced:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def ds_config() -> dict:
    config = json.loads((REPO / "ds_configs/cpu-dense.json").read_text())
    config.pop("nshard")  # install_reducer takes it (as nshard/seam/ds_config.py complete_ds_config does)
    config.update(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  bf16={"enabled": True})
    config["scheduler"]["params"]["total_num_steps"] = 100
    return config


def fill(sums: dict, update: int, std: float) -> None:
    """The update's microbatch sums, the same in both ways (one generator per tensor, seeded by update and name)."""
    import torch

    for i, name in enumerate(sorted(sums)):
        sums[name].normal_(0, std, generator=torch.Generator().manual_seed(update * 100_003 + i))


def one_way(way: str, config, sliced: bool, args) -> dict:
    """Build the engine and seam with the way's switches, run 1 + --updates updates after filled sums, and hash
    the final state."""
    from nshard.comm.config import parse_config
    from nshard.phases import CLOCK
    from nshard.run.receipts import parameter_root
    from nshard.seam import engine as engine_mod

    os.environ.update(WAYS[way])
    section = json.loads((REPO / "ds_configs/cpu-dense.json").read_text())["nshard"]
    engine = engine_mod.build_engine(build_model(config, sliced), ds_config())
    seam = engine_mod.install_reducer(engine, parse_config(section))
    phases, norms = [], []
    now = CLOCK.now = CLOCKS[args.clock]
    for update in range(1 + args.updates):
        fill(seam.microbatch_sums(), update, args.grad_std)
        CLOCK.start()
        t0, wall = now(), time.perf_counter()
        seam.finish_update(engine)
        seconds, wall = now() - t0, time.perf_counter() - wall
        timing = CLOCK.stop(seconds)["phases"]
        norms.append(float(engine.get_global_grad_norm()))
        if update:
            phases.append({**{k: timing[k] for k in TIMED}, "update_s": seconds, "wall_s": wall})
    state = engine_mod.full_optimizer_state(engine)
    roots = {"weights": parameter_root(engine.module.named_parameters()),
             "optimizer": parameter_root((f"{n}.{k}", t) for n, kept in state.items() for k, t in kept.items())}
    record = {"way": way, "master_step": engine_mod.optimizer_record(engine, ds_config())["master_step"],
              "one_rank_skip": seam.one_rank_skip, "grad_norms": norms, "roots": roots,
              "median_s": {k: statistics.median(p[k] for p in phases) for k in (*TIMED, "update_s", "wall_s")},
              "updates": phases}
    record["median_s"]["fixed"] = record["median_s"]["reducer_compute"] + record["median_s"]["optimizer_step"]
    del engine, seam, state
    gc.collect()
    return record


def bench_model(name: str, args) -> dict:
    from nshard.run.models import shaped_model

    layers = {"135m": args.layers_135m, "1.7b": args.layers_1_7b}[name]
    full, config, sliced = model_config(name, layers)
    full_trained = trained_parameters(shaped_model(full, materialize=False))
    slice_trained = trained_parameters(build_model_meta(config, sliced))
    scale = full_trained / slice_trained
    ways = {way: one_way(way, config, sliced, args) for way in WAYS}
    old, new = ways["old"]["median_s"], ways["new"]["median_s"]
    same = ways["old"]["roots"] == ways["new"]["roots"]
    return {"model": MODELS[name], "layers": config.num_hidden_layers, "model_layers": full.num_hidden_layers,
            "sliced": sliced, "trained_parameters": slice_trained, "model_trained_parameters": full_trained,
            "scale": scale, "ways": ways, "bit_identical": same,
            "old_over_new": old["fixed"] / new["fixed"], "new_over_old": new["fixed"] / old["fixed"]}


def build_model_meta(config, sliced: bool):
    from nshard.run.models import shaped_model

    model = shaped_model(config, materialize=False)
    if sliced:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def report(body: dict) -> None:
    cpu = body["cpu"]
    print(f"bf16 at stage 0, one rank, {body['threads']} thread(s), {cpu['model']} (family {cpu['family']} model "
          f"{cpu['model_number']}; {', '.join(cpu['flags']) or 'no listed flags'}); torch {body['torch']}")
    print(f"bf16 units: {body['bf16_units']}" + ("" if body["bf16_native"] else
          " -> bf16 FORCED on a CPU without bf16 units (bf16.enabled true): the seconds are not this CPU's bf16 path"))
    clock = ("this thread's CPU seconds (time.thread_time; torch on this thread)" if body["clock"] == "cpu" else
             "wall seconds (time.perf_counter)")
    print(f"phases timed in {clock}; load average before {tuple(round(x, 1) for x in body['load_before'])}, after "
          f"{tuple(round(x, 1) for x in body['load_after'])} (on a shared machine wall seconds move with the load; old "
          "and new ran one after the other in this process)")
    print("| model (trained parameters) | way | reducer_compute s | collective_wait s | optimizer_step s | "
          "reducer_compute + optimizer_step s | new / old | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for m in body["models"]:
        label = f"{m['model']} ({m['trained_parameters']:,})"
        if m["sliced"]:
            label = (f"{m['model']}, {m['layers']} of {m['model_layers']} layers, embedding frozen "
                     f"({m['trained_parameters']:,}; x{m['scale']:.2f} -> {m['model_trained_parameters']:,})")
        for way in WAYS:
            s = m["ways"][way]["median_s"]
            ratio = f"{m['new_over_old']:.1%}" if way == "new" else ""
            print(f"| {label} | {way} | {s['reducer_compute']:.3f} | {s['collective_wait']:.3f} | "
                  f"{s['optimizer_step']:.3f} | {s['fixed']:.3f}"
                  + (f" (scaled: {s['fixed'] * m['scale']:.3f})" if m["sliced"] else "")
                  + f" | {ratio} | {s['wall_s']:.3f} |")
    for m in body["models"]:
        norms = m["ways"]["new"]["grad_norms"]
        print(f"{m['model']}: old / new {m['old_over_new']:.2f}x; final bf16 weights, fp32 masters and AdamW moments "
              f"{'BIT-IDENTICAL' if m['bit_identical'] else 'DIFFERENT'} (weights root "
              f"{m['ways']['new']['roots']['weights'][:16]}); gradient norms {min(norms):.2f}-{max(norms):.2f} "
              f"({'over' if min(norms) > 1 else 'not all over'} the clip of 1.0)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    from launch.results_file import cpu
    from nshard.seam.ds_config import bf16_units
    from nshard.seam.launch_env import extensions_dir, free_port, pin_ninja

    torch.set_num_threads(args.threads)
    # DeepSpeed's CPU collective from this venv's build (launch/setup.sh), as a launched rank finds it
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      TORCH_EXTENSIONS_DIR=extensions_dir())
    pin_ninja()  # the ninja set-up built it with: another would rebuild it
    dist.init_process_group("gloo", rank=0, world_size=1)
    native, why = bf16_units()
    body = {"cpu": cpu(), "torch": torch.__version__, "threads": args.threads, "bf16_native": native,
            "bf16_units": why, "load_before": os.getloadavg(), "updates": args.updates, "grad_std": args.grad_std,
            "clock": args.clock}
    try:
        body["models"] = [bench_model(name, args) for name in args.models]
    finally:
        dist.destroy_process_group()
    body["load_after"] = os.getloadavg()
    from nshard.run.receipts import peak_rss_bytes

    body["peak_rss_bytes"] = peak_rss_bytes()
    report(body)
    if args.out:
        from nshard.files import write_json_atomic

        write_json_atomic(args.out, body)
    return 0 if all(m["bit_identical"] for m in body["models"]) else 1


if __name__ == "__main__":
    sys.exit(main())
