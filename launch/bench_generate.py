"""Greedy generation time per model with the main job's scoring settings (nshard/study/evaluate.py's
generate_answers on the plan's fresh cases, or transformers' generate on the same batches: --decoders): fp32 and
bf16, one process on both cores or two processes of one core each side by side (two models scored at once), and
whether repeated passes give the same token ids.

    python -m launch.bench_generate [--model embedded] [--plan launch/plans/cpu-study.toml] [--eval_seed N] [--cases 64]
        [--batch_size 16] [--max_new_tokens 40] [--dtypes float32,bfloat16] [--decoders greedy,hf]

Prints one JSON object: per setting, seconds per model (a side-by-side pair's wall time over two), each process's
CPU seconds (what a busy machine's wall times hide), the correct count, and which settings gave identical token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser

REPO = Path(__file__).resolve().parent.parent


def hf_generate(model, tokenizer, inputs: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """transformers' own greedy generate on the same left-padded batches (how nshard scored before greedy_batch):
    finished rows stay in the batch until its longest answer ends."""
    import torch

    from nshard.study.evaluate import scoring_batches, stop_ids

    stops = stop_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    answers: list[list[int]] = [[] for _ in inputs]
    for rows in scoring_batches(inputs, batch_size):
        width = max(len(inputs[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(inputs[i]):] = torch.tensor(inputs[i])
            mask[r, width - len(inputs[i]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 num_beams=1, eos_token_id=stops, pad_token_id=pad)
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            answers[i] = new[:next((k for k, t in enumerate(new) if t in stops), len(new))]
    return answers


def worker(model: str, plan: str, eval_seed: int | None, cases: int, batch_size: int, max_new_tokens: int,
           dtype: str, decoder: str, out: Path) -> None:
    """One model's answers at this process's thread count, timed without the load."""
    import torch

    from nshard import tasks
    from nshard.run.device import Placement, load_for_inference
    from nshard.run.models import load_tokenizer, resolve_model
    from nshard.run.plan import load_plan
    from nshard.study.evaluate import answer_target, generate_answers, prompt_ids

    p = load_plan(Path(plan))
    seed = p.data.eval_seed if eval_seed is None else eval_seed
    per_family = max(1, cases // len(p.data.families))
    chosen = [tasks.family_module(f).generate(seed, i) for f in p.data.families for i in range(per_family)]
    ref = resolve_model(model)
    tokenizer = load_tokenizer(ref)
    net = load_for_inference(ref, Placement("cpu", dtype))
    inputs = [prompt_ids(tokenizer, c) for c in chosen]
    t0, c0 = time.perf_counter(), time.process_time()
    if decoder == "hf":
        answers = hf_generate(net, tokenizer, inputs, max_new_tokens, batch_size)
    else:  # "greedy" cuts an answer once it cannot match (as the study scores), "greedy-full" never does
        targets = [answer_target(c.family, tasks.answer(c)) for c in chosen] if decoder == "greedy" else None
        found = generate_answers(net, tokenizer, inputs, max_new_tokens, batch_size,
                                 desc=f"{dtype}@{torch.get_num_threads()}", targets=targets)
        answers = [found[i][0] for i in range(len(inputs))]
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    correct = sum(tasks.score(c, tokenizer.decode(a, skip_special_tokens=True)) for c, a in zip(chosen, answers))
    out.write_text(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "answers": answers, "correct": correct, "cases": len(chosen),
                               "threads": torch.get_num_threads(), "new_tokens": sum(map(len, answers))}))


def run_side_by_side(args, dtype: str, decoder: str, threads: int, copies: int, tmp: Path) -> dict:
    """`copies` worker processes started together, each on `threads` threads; wall time of the whole set."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TQDM_DISABLE="1")
    outs = [tmp / f"{dtype}-{decoder}-{threads}-{copies}-{k}.json" for k in range(copies)]
    seed = [] if args.eval_seed is None else ["--eval-seed", str(args.eval_seed)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "launch.bench_generate", "--worker", str(o), "--dtypes", dtype,
                               "--decoders", decoder, "--model", args.model, "--plan", args.plan, *seed,
                               "--cases", str(args.cases), "--batch-size", str(args.batch_size),
                               "--max_new_tokens", str(args.max_new_tokens)],
                              cwd=REPO, env=env) for o in outs]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"bench_generate: a {dtype} worker failed")
    wall = time.perf_counter() - t0
    rows = [json.loads(o.read_text()) for o in outs]
    return {"dtype": dtype, "decoder": decoder, "threads": threads, "processes": copies, "wall_s": wall,
            "generate_s": [r["seconds"] for r in rows], "cpu_s": [r["cpu_s"] for r in rows], "per_model_s": max(r["seconds"] for r in rows) / copies,
            "correct": rows[0]["correct"], "cases": rows[0]["cases"], "new_tokens": rows[0]["new_tokens"],
            "answers": [r["answers"] for r in rows]}


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing that stays (its workers' files live in a temporary directory): prints one JSON "
              "object. " + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--plan", default=str(REPO / "launch/plans/cpu-study.toml"))
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=40)
    parser.add_argument("--eval_seed", type=int, help="cases of this evaluation seed (default: the plan's)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--decoders", default="greedy",
                        help="comma-separated: greedy (nshard's greedy_batch, answers cut once they cannot match: as "
                             "the study scores), greedy-full (never cut), hf (transformers' generate on the same "
                             "batches, as nshard scored before)")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.model, args.plan, args.eval_seed, args.cases, args.batch_size, args.max_new_tokens, args.dtypes,
               args.decoders, args.worker)
        return 0
    settings = {}
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        for dtype in args.dtypes.split(","):
            for decoder in args.decoders.split(","):
                # Both cores on one model, then one model per core: the same total work per model either way.
                settings[f"{dtype} {decoder} 1x{args.cores}"] = run_side_by_side(args, dtype, decoder, args.cores, 1,
                                                                                 Path(tmp))
                if args.cores > 1:
                    settings[f"{dtype} {decoder} {args.cores}x1"] = run_side_by_side(args, dtype, decoder, 1,
                                                                                     args.cores, Path(tmp))
    first = {name: s["answers"][0] for name, s in settings.items()}
    same = {f"{a} == {b}": first[a] == first[b] for a in first for b in first if a < b}
    for name, s in settings.items():
        same[f"{name}: every process"] = all(a == s["answers"][0] for a in s["answers"])
        del s["answers"]
    print(json.dumps({"model": args.model, "cases": args.cases, "batch_size": args.batch_size,
                      "max_new_tokens": args.max_new_tokens, "settings": settings, "identical_token_ids": same},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
