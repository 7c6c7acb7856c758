"""Seconds per update of PowerSGD's orthogonalization, old vs new, at the real P blocks of SmolLM2-135M and 1.7B.

old: one torch.linalg.qr per shape group (Householder; on CUDA a loop of cuSOLVER calls for blocks over 256 rows);
new: CholeskyQR2 with its Householder fallback (nshard/comm/orthogonal.py); also the signed Householder QR that
`orthogonalization = "householder"` runs. Shape groups come from nshard/comm/layout.py's build_layout over the
models' parameter shapes (transformers' LlamaForCausalLM on the meta device: no weights). P is Gaussian.
Usage: .venv/bin/python -m launch.bench_orthogonalize [--device cpu|cuda] [--models 135m,1.7b] [--rank 32]
       [--repeats 5] [--threads N] [--json PATH|-]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from nshard.cli import SPELLING_NOTE, ArgumentParser
from nshard.comm.layout import build_layout, p_group
from nshard.comm.orthogonal import orthonormalize_
from nshard.files import write_text_atomic

MODELS = {  # transformers LlamaConfig keywords; tied embeddings, so no lm_head parameter
    "135m": ("SmolLM2-135M", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, intermediate_size=1536)),
    "1.7b": ("SmolLM2-1.7B", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                                  num_key_value_heads=32, intermediate_size=8192)),
}


def parameter_shapes(model: str, layers: int = 0) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, from a model built on the meta device (`layers`: only that many)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = {**MODELS[model][1], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**dims, vocab_size=49152, tie_word_embeddings=True)
    with torch.device("meta"):
        built = LlamaForCausalLM(config)
    return {name: tuple(p.shape) for name, p in built.named_parameters()}


def householder_old(stacks: list[torch.Tensor]) -> int:
    """What PowerSGD ran before: one batched torch.linalg.qr per shape group."""
    for stack in stacks:
        stack.copy_(torch.linalg.qr(stack).Q)
    return 0


ARMS = {"householder (old)": householder_old,
        "householder signed": lambda stacks: orthonormalize_(stacks, "householder"),
        "cholesky_qr2 (new)": lambda stacks: orthonormalize_(stacks, "cholesky_qr2")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: str, device: torch.device, rank: int, repeats: int, layers: int = 0) -> dict:
    """Median seconds per update of every arm on the same P, arms rotated each round; P restored before each."""
    layout = build_layout(parameter_shapes(model, layers), rank, 2.0)
    source = torch.randn(layout.p_numel, generator=torch.Generator().manual_seed(0)).to(device)
    p_flat = torch.empty_like(source)
    stacks = [p_group(p_flat, group) for group in layout.groups]
    seconds, fallbacks = {arm: [] for arm in ARMS}, {}
    for round_ in range(repeats + 1):  # round 0 warms up (allocator, kernels) and is not counted
        names = list(ARMS)
        for arm in names[round_ % len(names):] + names[:round_ % len(names)]:
            p_flat.copy_(source)
            sync(device)
            start = time.perf_counter()
            fallbacks[arm] = ARMS[arm](stacks)
            sync(device)
            if round_:
                seconds[arm].append(time.perf_counter() - start)
    median_ms = {arm: 1e3 * statistics.median(s) for arm, s in seconds.items()}
    return {
        "model": MODELS[model][0], "layers": layers or MODELS[model][1]["num_hidden_layers"],
        "all_layers": MODELS[model][1]["num_hidden_layers"], "matrices": len(layout.matrices),
        "p_elements": layout.p_numel,
        "groups": [{"n": g.n, "m": g.m, "r": g.r, "count": g.count} for g in layout.groups],
        "ms_per_update": median_ms, "fallbacks": fallbacks["cholesky_qr2 (new)"],
        "old_over_new": median_ms["householder (old)"] / median_ms["cholesky_qr2 (new)"],
        "signed_over_new": median_ms["householder signed"] / median_ms["cholesky_qr2 (new)"],
    }


def write_json(path: str, summary: dict) -> None:
    text = json.dumps(summary, indent=2)
    if path == "-":
        print(text)
        return
    write_text_atomic(Path(path), text + "\n")


def build_parser() -> ArgumentParser:
    epilog = "Prints one line per model; writes the summary as JSON only with --json. " + SPELLING_NOTE
    parser = ArgumentParser(description=__doc__.split("\n", 1)[0], epilog=epilog)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default="135m,1.7b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per arm (median reported)")
    parser.add_argument("--layers", type=int, default=0, help="only the first K layers, said in the output "
                        "(0: all; the smoke test's setting)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON ('-': to stdout)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown or args.repeats < 1 or args.rank < 1 or args.layers < 0:
        parser.error(f"--models takes {', '.join(MODELS)} (got {unknown}); --repeats and --rank must be >= 1, "
                     "--layers >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; run with --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "threads": torch.get_num_threads(), "rank": args.rank,
               "repeats": args.repeats, "load_average_1min": os.getloadavg()[0],
               "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
               "models": [measure(model, device, args.rank, args.repeats, args.layers) for model in models]}
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"{summary['device']}, torch {summary['torch']}, {summary['threads']} threads, rank {args.rank}, "
          f"median of {args.repeats}", file=out)
    for result in summary["models"]:
        times = ", ".join(f"{arm} {ms:.2f} ms" for arm, ms in result["ms_per_update"].items())
        shrunk = "" if result["layers"] == result["all_layers"] else f" (first {result['layers']} of " \
            f"{result['all_layers']} layers only)"
        print(f"{result['model']}{shrunk}: {result['matrices']} matrices in {len(result['groups'])} groups; {times}; "
              f"old/new {result['old_over_new']:.2f}x; fallbacks {result['fallbacks']}", file=out)
    if args.json:
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
