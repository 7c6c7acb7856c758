"""Serving measurements of a study's models, in the same run on the same machine (docs/growth.md#serving):
greedy tokens per second at batch 1 and at the evaluation batch, time to the first token, peak memory and the
export's size. Each model is measured in its own process, so its peak memory is its own.

    python -m nshard.study.serving MODEL_DIR --run RUN_DIR --out JSON [--batch 16] [--new_tokens 32] [--prompts 4]

The prompts are the first fresh evaluation cases of RUN_DIR (its prepared sets), placed and typed as the study
scores that run (nshard/study/evaluate.py run_placement). Every generation is forced to `new_tokens` tokens
(min_new_tokens), so a model that stops early is not faster for it. Timings are medians over the prompts (batch 1)
and over `repeats` batches, after one untimed warm-up generation.
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

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.files import write_json_atomic
from nshard.run.receipts import peak_rss_bytes


class ServingError(RuntimeError):
    """A serving measurement that did not finish; the message names the model and its last error line."""


def export_bytes(model_dir: Path) -> int:
    from nshard.evidence.commit import model_files

    return sum((Path(model_dir) / name).stat().st_size for name in model_files(Path(model_dir)))


def measure(model_dir: Path, run_dir: Path, batch: int, new_tokens: int, prompts: int, repeats: int = 2) -> dict:
    import torch

    from nshard.run.device import load_for_inference
    from nshard.run.models import ModelRef, load_tokenizer
    from nshard.study.evaluate import load_run_sets, prompt_ids, run_placement

    model_dir = Path(model_dir)
    ref = ModelRef(str(model_dir), str(model_dir.resolve()), None, "local")
    tokenizer = load_tokenizer(ref)
    placement = run_placement(run_dir)
    t0 = time.perf_counter()
    model = load_for_inference(ref, placement)
    load_s = time.perf_counter() - t0
    cases = load_run_sets(run_dir).cases
    inputs = [prompt_ids(tokenizer, c) for c in cases[:max(batch, prompts)]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cuda = model.device.type == "cuda"

    def generate(rows: list[list[int]], n: int) -> float:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=pad)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    generate(inputs[:1], 2)  # warm-up: first-call costs are not serving costs
    first = [generate([inputs[i]], 1) for i in range(prompts)]
    one = [generate([inputs[i]], new_tokens) for i in range(prompts)]
    many = [generate(inputs[:batch], new_tokens) for _ in range(repeats)]
    return {"model_dir": str(model_dir), "export_bytes": export_bytes(model_dir),
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(model.device), "dtype": str(placement.torch_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "load_s": load_s,
            "time_to_first_token_s": statistics.median(first),
            "tokens_per_s_batch_1": new_tokens / statistics.median(one),
            "batch": min(batch, len(inputs)),
            "tokens_per_s_batch": min(batch, len(inputs)) * new_tokens / statistics.median(many),
            "new_tokens": new_tokens, "prompts": prompts, "repeats": repeats,
            "peak_memory_bytes": (torch.cuda.max_memory_allocated() if cuda
                                  else peak_rss_bytes()),
            "peak_memory_kind": "GPU allocated" if cuda else "process peak RSS"}


def measure_all(models: dict[str, Path], run_dir: Path, out: Path, batch: int, new_tokens: int = 32,
                prompts: int = 4, note=print) -> dict:
    """Every model in its own process, one after another; serving.json maps label -> measurements."""
    results = {}
    for label, model_dir in models.items():
        target = out.with_name(f".{out.name}.{label}.json")
        cmd = [sys.executable, "-m", "nshard.study.serving", str(model_dir), "--run", str(run_dir), "--out",
               str(target), "--batch", str(batch), "--new_tokens", str(new_tokens), "--prompts", str(prompts)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            raise ServingError(f"serving measurement of {label} failed (exit {proc.returncode}): "
                               f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        results[label] = json.loads(target.read_text())
        target.unlink()
        r = results[label]
        note(f"serving {label}: {r['tokens_per_s_batch_1']:.1f} tokens/s at batch 1, {r['tokens_per_s_batch']:.1f} "
             f"at batch {r['batch']}, first token {r['time_to_first_token_s'] * 1000:.0f} ms, peak "
             f"{r['peak_memory_bytes'] / 2**30:.2f} GiB, export {r['export_bytes'] / 1e6:.0f} MB")
    write_json_atomic(out, results)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.study.serving"), description=__doc__,
                            epilog="Writes --out JSON (the measurements, atomically). " + SPELLING_NOTE)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--run", required=True, type=Path, help="the run whose prepared sets give the prompts")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    write_json_atomic(args.out, measure(args.model_dir, args.run, args.batch, args.new_tokens, args.prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
