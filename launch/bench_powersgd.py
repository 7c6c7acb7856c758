"""Payload and time per update: nshard's PowerSGD vs PyTorch's powerSGD_hook vs dense, on SmolLM2 shapes.

Two gloo ranks on this machine (OMP_NUM_THREADS=1), same rank, same gradient tensors for every arm.
Usage: .venv/bin/python -m launch.bench_powersgd [--rank 32] [--updates 3] [--layers K] [--models 135m,1.7b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: two ranks x two OpenMP threads on two cores spin 50-200x slower

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from nshard.cli import SPELLING_NOTE, ArgumentParser


@dataclass(frozen=True)
class ModelShape:
    """The Llama-family dimensions that fix every parameter's shape."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    default_layers: int  # what fits the ~2 minute default run on two CPU cores


MODELS = {
    "135m": ModelShape("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, default_layers=30),
    "1.7b": ModelShape("SmolLM2-1.7B", 2048, 24, 32, 32, 64, 8192, 49152, default_layers=1),
}


def parameter_shapes(model: ModelShape, layers: int) -> dict[str, tuple[int, ...]]:
    """HF LlamaForCausalLM names and shapes for the first `layers` layers; tied embeddings, so no lm_head."""
    h, q_out, kv_out = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    shapes = {"model.embed_tokens.weight": (model.vocab, h)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes.update({
            prefix + "self_attn.q_proj.weight": (q_out, h), prefix + "self_attn.k_proj.weight": (kv_out, h),
            prefix + "self_attn.v_proj.weight": (kv_out, h), prefix + "self_attn.o_proj.weight": (h, q_out),
            prefix + "mlp.gate_proj.weight": (model.intermediate, h),
            prefix + "mlp.up_proj.weight": (model.intermediate, h),
            prefix + "mlp.down_proj.weight": (h, model.intermediate),
            prefix + "input_layernorm.weight": (h,), prefix + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    return shapes


def floor_bytes(shapes: dict[str, tuple[int, ...]], rank: int, min_compression_rate: float) -> tuple[int, int, int]:
    """(compressed matrices, r(n+m) floor bytes, dense remainder bytes) for fp32, by nshard's compression rule."""
    from nshard.comm.layout import effective_rank, matrix_shape, should_compress

    count = low_rank = remainder = 0
    for shape in shapes.values():
        if should_compress(shape, rank, min_compression_rate):
            n, m = matrix_shape(shape)
            count, low_rank = count + 1, low_rank + 4 * effective_rank(n, m, rank) * (n + m)
        else:
            remainder += 4 * torch.Size(shape).numel()
    return count, low_rank, remainder


class CountingAllReduce:
    """Wraps dist.all_reduce to count the bytes each arm hands to collectives, whoever calls it."""

    def __init__(self):
        self.bytes, self._original = 0, dist.all_reduce

    def __call__(self, tensor, *args, **kwargs):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._original(tensor, *args, **kwargs)


class FakeBucket:
    """The slice of dist.GradBucket that powerSGD_hook reads: one bucket holding every gradient."""

    def __init__(self, buffer: torch.Tensor, grads: list[torch.Tensor]):
        self._buffer, self._grads = buffer, grads

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def timed_updates(run_one, refill, updates: int) -> tuple[list[float], int]:
    """One untimed update (allocations, first Q draw), then `updates` timed ones; seconds and bytes per update."""
    counter = dist.all_reduce
    refill()
    run_one()
    seconds, sent_before = [], counter.bytes
    for _ in range(updates):
        refill()
        dist.barrier()  # both ranks start together, so the time includes waiting for the slower one
        start = time.perf_counter()
        run_one()
        seconds.append(time.perf_counter() - start)
    return seconds, (counter.bytes - sent_before) // updates


def arms(shapes, rank: int, buffer: torch.Tensor, grads: dict[str, torch.Tensor]):
    """(name, builder) per arm; each builder returns (callable that reduces one update, its ledger or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    from nshard.comm import build_reducer

    def nshard_arm(reducer_name):
        reducer = build_reducer({"reducer": reducer_name, "rank": rank, "dense_warmup_updates": 0})
        return (lambda: reducer.reduce(grads)), reducer.ledger

    def hook_arm():
        state = hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        state.iter = state.start_powerSGD_iter  # skip its dense warm-up, as the nshard arm does
        bucket = FakeBucket(buffer, list(grads.values()))
        # Waiting inside is what keeps gloo collectives in the same order on both ranks (FACTS.md).
        return (lambda: hook.powerSGD_hook(state, bucket).wait()), None

    return [("dense", lambda: nshard_arm("dense")), ("nshard", lambda: nshard_arm("powersgd")), ("hook", hook_arm)]


def worker(rank_id: int, world: int, port: int, model: ModelShape, layers: int, rank: int, updates: int, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_id, world_size=world)
    dist.all_reduce = CountingAllReduce()
    shapes = parameter_shapes(model, layers)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    # bf16 source halves the memory of the copy each update restores; the arms see fp32 gradients.
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank_id)).to(torch.bfloat16)
    buffer = torch.empty(numel)
    grads, offset = {}, 0
    for name, shape in shapes.items():  # views into one flat buffer, like DeepSpeed's contiguous gradients
        grads[name] = buffer[offset : offset + torch.Size(shape).numel()].view(shape)
        offset += grads[name].numel()
    report = {}
    for name, build in arms(shapes, rank, buffer, grads):
        run_one, ledger = build()
        report[name] = timed_updates(run_one, lambda: buffer.copy_(source), updates)
        if ledger is not None:  # what the reducer says it sent must be what dist.all_reduce saw
            assert sum(ledger.records[-1]["bytes"].values()) == report[name][1], (name, ledger.records[-1])
    results.put((rank_id, report))
    dist.barrier()
    dist.destroy_process_group()


def run_model(model: ModelShape, layers: int, rank: int, updates: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, 2, port, model, layers, rank, updates, results)) for r in range(2)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    # Per update, the slower rank's time is the update's time.
    return {arm: ([max(pair) for pair in zip(reports[0][arm][0], reports[1][arm][0])], reports[0][arm][1])
            for arm in reports[0]}


def print_model(model: ModelShape, layers: int, rank: int, measured: dict) -> None:
    shapes = parameter_shapes(model, layers)
    count, low_rank, remainder = floor_bytes(shapes, rank, min_compression_rate=2)
    floor, dense_bytes = low_rank + remainder, 4 * sum(torch.Size(s).numel() for s in shapes.values())
    median = {arm: statistics.median(seconds) for arm, (seconds, _) in measured.items()}
    print(f"\n{model.name}: {layers}/{model.layers} layers, {dense_bytes // 4:,} params, "
          f"{count} compressed matrices, rank {rank}, 2 gloo ranks")
    print(f"  floor r(n+m)+dense 1-D : {floor:>14,} B/update  ({low_rank:,} low-rank + {remainder:,} dense 1-D)")
    for arm, (seconds, sent) in measured.items():
        print(f"  {arm:<23}: {sent:>14,} B/update  = {sent / floor:6.3f}x floor, {dense_bytes / sent:6.2f}x less "
              f"than dense | {median[arm]:.3f} s/update (median of {len(seconds)}: "
              f"{', '.join(f'{s:.3f}' for s in seconds)})")
    print("  (nshard and dense ledgers agree with the bytes counted at dist.all_reduce)")
    print(f"  ratios: nshard/hook time {median['nshard'] / median['hook']:.3f}x, nshard/dense time "
          f"{median['nshard'] / median['dense']:.3f}x, nshard/floor bytes {measured['nshard'][1] / floor:.4f}x")


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing: prints bytes and times per arm. " + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__.splitlines()[0], epilog=epilog)
    parser.add_argument("--rank", type=int, default=32, help="PowerSGD rank for both implementations")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per arm (median reported)")
    parser.add_argument("--layers", type=int, default=None,
                        help="first K layers of each model (default: all 30 of 135M, 1 of 1.7B)")
    parser.add_argument("--models", default="135m,1.7b", help="comma-separated subset of: 135m, 1.7b")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    for key in args.models.split(","):
        model = MODELS[key]
        layers = min(args.layers if args.layers is not None else model.default_layers, model.layers)
        start = time.perf_counter()
        print_model(model, layers, args.rank, run_model(model, layers, args.rank, args.updates))
        print(f"  (wall {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
