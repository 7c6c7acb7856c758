"""AdamW's step at a real model's shapes: the single-tensor step in cache-sized pieces (optimizer.params.fused=false)
against torch's fused kernel (the default), timed in the same run, with the fused step's distance from torch's
reference AdamW.

    .venv/bin/python launch/bench_adamw.py --model smollm2-135m --threads 1

The parameters are the model's own tensors (nshard/run/configs/<model>.json, shaped by transformers, filled with
N(0, 0.02)), as a stage-0 rank steps them: every rank steps the whole model, so this step does not shrink with more
ranks. --flat steps one flat fp32 tensor of the same size instead, as ZeRO-1/2 hand the optimizer their partition
(--flat-share 0.5: the half one rank of two holds). Each implementation takes one untimed step (it creates the
moments), then --repeats timed steps; the median is printed with the ratio old/new. The distance check runs both on
the same gradients for --check-steps steps and compares with the stated tolerance (nshard/seam/engine.py: FUSED_RTOL, FUSED_ULPS).
It prints a table and writes nothing unless --out names a file; it exits 1 when the fused step is outside tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--model", default="smollm2-135m", help="a config under nshard/run/configs (smollm2-135m, "
                        "smollm2-1.7b, mixtral-4x135m)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the study runs one per rank on 2 cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each implementation")
    parser.add_argument("--flat", action="store_true", help="one flat fp32 tensor, as ZeRO-1/2 step their partition")
    parser.add_argument("--flat-share", type=float, default=1.0, help="with --flat: the share of the model (0.5: one "
                        "rank of two)")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of the distance check (0: none)")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    return parser


def parameters(model: str, flat: bool, share: float):
    import torch
    from transformers import AutoConfig

    from nshard.run.models import RANDOM_CONFIGS, shaped_model

    path = RANDOM_CONFIGS / f"{model}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in RANDOM_CONFIGS.glob("*.json")))
        raise SystemExit(f"bench_adamw: error: --model {model}: no {path}; use one of {names}")
    config = AutoConfig.for_model(**json.loads(path.read_text()))
    shapes = [p.shape for p in shaped_model(config, materialize=False).parameters()]
    numel = sum(s.numel() for s in shapes)
    g = torch.Generator().manual_seed(0)
    if flat:
        return [torch.empty(int(numel * share)).normal_(0, 0.02, generator=g)], numel
    return [torch.empty(s).normal_(0, 0.02, generator=g) for s in shapes], numel


def implementations(chunk: int):
    import torch

    from nshard.seam.chunked_adamw import chunk_steps

    def chunked(params):
        opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)
        chunk_steps(opt, chunk)
        return opt

    def fused(params):
        return torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)

    return {f"single-tensor in {chunk}-element pieces (fused=false)": chunked, "fused (default)": fused}


def time_steps(make, values, repeats: int) -> float:
    import torch

    params = [torch.nn.Parameter(v.clone()) for v in values]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    opt.step()  # creates the moments
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def distance(makes, values, steps: int) -> dict:
    """Both implementations over the same gradients: moments equal? worst update error against the stated bound."""
    import torch

    from nshard.seam.engine import FUSED_RTOL as RTOL
    from nshard.seam.engine import FUSED_ULPS as ULPS

    runs = []
    for make in makes:
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt, g = make(params), torch.Generator().manual_seed(1)
        updates = []
        for _ in range(steps):
            before = [p.detach().clone() for p in params]
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
            opt.step()
            updates.append([(b, p.detach() - b) for b, p in zip(before, params)])
        runs.append((updates, [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]))
    (old, old_moments), (new, new_moments) = runs
    worst = 0.0
    for step_old, step_new in zip(old, new):
        for (p_r, d_r), (_, d_f) in zip(step_old, step_new):
            bound = RTOL * d_r.abs() + ULPS * torch.finfo(torch.float32).eps * p_r.abs()
            worst = max(worst, float(((d_f - d_r).abs() / bound.clamp_min(1e-38)).max()))
    moments = all(torch.equal(a, b) for (ma, va), (mb, vb) in zip(old_moments, new_moments)
                  for a, b in ((ma, mb), (va, vb)))
    return {"steps": steps, "moments_bit_identical": moments, "worst_update_error_over_bound": worst,
            "within_tolerance": moments and worst <= 1.0}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from nshard.seam.chunked_adamw import CHUNK_ELEMENTS
    from launch.results_file import cpu

    torch.set_num_threads(args.threads)
    values, numel = parameters(args.model, args.flat, args.flat_share)
    makes = implementations(CHUNK_ELEMENTS)
    seconds = {name: time_steps(make, values, args.repeats) for name, make in makes.items()}
    (old_name, old), (new_name, new) = seconds.items()
    summary = {"model": args.model, "model_parameters": numel, "stepped_elements": sum(v.numel() for v in values),
               "layout": f"one flat tensor ({args.flat_share:g} of the model)" if args.flat else "the model's tensors",
               "threads": args.threads, "torch": torch.__version__, "cpu": cpu(),
               "median_step_s": seconds, "old_over_new": old / new}
    if args.check_steps:
        summary["fused_against_reference"] = distance(list(makes.values()), values[:8], args.check_steps)
    print(f"AdamW step, {summary['stepped_elements']:,} elements ({summary['layout']}), {args.threads} thread(s), "
          f"{summary['cpu']['model']} (family {summary['cpu']['family']} model {summary['cpu']['model_number']}; "
          f"{', '.join(summary['cpu']['flags']) or 'no listed flags'})")
    for name, s in seconds.items():
        print(f"  {name:48s} {s:8.4f} s")
    print(f"  old / new: {old / new:.2f}x")
    if args.check_steps:
        d = summary["fused_against_reference"]
        print(f"  fused vs torch's single-tensor AdamW over {d['steps']} steps: moments bit-identical "
              f"{d['moments_bit_identical']}, worst update error {d['worst_update_error_over_bound']:.3f} of the "
              f"stated bound -> {'within' if d['within_tolerance'] else 'OUTSIDE'} tolerance")
    if args.out:
        from nshard.files import write_json_atomic

        write_json_atomic(args.out, summary)
    return 0 if not args.check_steps or summary["fused_against_reference"]["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
