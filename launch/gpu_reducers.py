"""Two processes on one device over gloo: nshard's dense and PowerSGD reducers on rank-dependent gradients at real
shapes, and the delta codec on the device against the CPU. launch/gpu_check.sh runs it on a GPU (NCCL refuses two
ranks on one GPU; gloo all-reduces CUDA tensors through the host); tests/test_gpu.py runs the same code on the CPU.

    python launch/gpu_reducers.py --device cuda [--updates 3] [--out FILE]
    python launch/gpu_reducers.py --device cpu        # the CPU is then its own reference (said in the output)
    python launch/gpu_reducers.py --device cuda --check-only   # no process group: the layout and the arguments

It prints one JSON summary (and writes it to --out) and exits 1 naming every check that failed:
- the inputs differ between the ranks (the gradients are rank-dependent);
- after every update both ranks hold the same bits: each reducer's outputs, and PowerSGD's Q (SHA-256 of the bytes);
- every update after the warm-up was compressed, over every matrix of the layout, and its output is not the dense
  average (PowerSGD did its work);
- each output lies within fp32 tolerance of the same reducers run on CPU copies of the same gradients, over the
  same group (on --device cpu that reference is the run itself: trivially exact);
- DeltaCodec gives the same encoded bytes and the same applied replica (fp32 and bf16) on the device as on the CPU,
  and each application closes most of the gap it encoded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    "model.embed_tokens.weight": (49152, 576),  # SmolLM2-135M's embedding: the tallest P block (49,152 rows)
    "model.layers.0.mlp.gate_proj.weight": (8192, 2048),  # SmolLM2-1.7B's MLP
    "model.layers.0.self_attn.o_proj.weight": (2048, 2048),  # SmolLM2-1.7B's attention
    "model.layers.0.input_layernorm.weight": (2048,),  # a vector: the dense remainder
}
REDUCERS = {"dense": {"reducer": "dense"},
            "powersgd": {"reducer": "powersgd", "rank": 32, "dense_warmup_updates": 1, "min_compression_rate": 2,
                         "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch"}}
WORLD = 2
TOLERANCE = 1e-4
"""max |device − CPU| / max |CPU| per tensor: fp32 rounding of other kernels (and CholeskyQR2 against Householder)."""
DELTA_NUMEL = (1 << 24) + 1000  # not a whole number of blocks: the tail block is padded
DELTA_BITS = (8, 4, 2)


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True, help="where the reducers' tensors live")
    parser.add_argument("--updates", type=int, default=3, help="updates (1 dense warm-up, then compressed; >= 2)")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    parser.add_argument("--timeout_s", type=float, default=400, help="give up on the two processes after this long")
    parser.add_argument("--check-only", action="store_true", help="check the arguments and the layout; start nothing")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.updates < 2:
        parser.error(f"--updates {args.updates}: give 2 or more (one dense warm-up, then compressed updates)")
    return args


def digest(tensor) -> str:
    import torch

    data = tensor.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def rank_gradients(rank: int, update: int) -> dict:
    """This rank's gradients of one update, on the CPU: seeded by rank and update, so the ranks' differ."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * update + rank)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def relative_error(got, want) -> float:
    scale = want.abs().max().item()
    return (got.cpu() - want).abs().max().item() / (scale or 1.0)


def reduce_one_update(kind: str, reducer, reference, grads: dict, device: str) -> dict:
    """One update of `kind` on the device and, from copies of the same gradients, on the CPU; the digests of what the
    device holds and its largest relative difference from the CPU."""
    on_device = {n: g.to(device, copy=True) for n, g in grads.items()}
    reducer.reduce(on_device)
    on_cpu = {n: g.clone() for n, g in grads.items()}
    reference.reduce(on_cpu)
    record = {"outputs": {n: digest(t) for n, t in on_device.items()},
              "relative_error": max(relative_error(on_device[n], on_cpu[n]) for n in SHAPES)}
    if kind == "powersgd" and reducer.state.q_flat is not None:
        record["q"] = digest(reducer.state.q_flat)
    return record


def reducers_rank(rank: int, device: str, updates: int) -> dict:
    """One rank's side: both reducers on `device` and on the CPU (its reference), update by update."""
    import torch

    from nshard.comm import build_reducer

    on_device = {kind: build_reducer(config) for kind, config in REDUCERS.items()}
    on_cpu = {kind: build_reducer(config) for kind, config in REDUCERS.items()}
    records = {kind: [] for kind in REDUCERS}
    inputs, differs_from_dense = [], []
    for update in range(updates):
        grads = rank_gradients(rank, update)
        inputs.append(hashlib.sha256("".join(digest(g) for g in grads.values()).encode()).hexdigest())
        for kind in REDUCERS:
            records[kind].append(reduce_one_update(kind, on_device[kind], on_cpu[kind], grads, device))
        differs_from_dense.append(records["powersgd"][-1]["outputs"] != records["dense"][-1]["outputs"])
        del grads
    powersgd = on_device["powersgd"]
    layout = powersgd.state.layout
    return {"inputs": inputs, "records": records, "powersgd_output_differs_from_dense": differs_from_dense,
            "compressed_updates": sum(1 for r in powersgd.ledger.records if r["compressed"]),
            "compressed_matrices": [slot.name for slot in layout.matrices],
            "dense_remainder": list(layout.dense_names),
            "error_memory_device": sorted({t.device.type for t in powersgd.state.errors.tensors.values()}),
            "threads": torch.get_num_threads()}


def delta_codec_bits(device: str) -> dict:
    """DeltaCodec's encode and apply on `device` against the CPU, from the same master and replica, per bit width and
    replica dtype: equal bytes and equal replicas, and the gap after applying smaller than before."""
    import torch

    from nshard.comm.delta import DeltaCodec

    gen = torch.Generator().manual_seed(11)
    master = torch.randn(DELTA_NUMEL, generator=gen)
    drift = torch.randn(DELTA_NUMEL, generator=gen).mul_(0.1)  # well above bf16's spacing near 1
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        replica = (master + drift).to(dtype)
        for bits in DELTA_BITS:
            codec = DeltaCodec(bits=bits, block=256)
            results = {}
            for where in ("cpu", device):
                m, r = master.to(where, copy=True), replica.to(where, copy=True)
                encoded = codec.empty(m.numel(), m.device)
                codec.encode(m, r, encoded)
                codec.apply_(r, encoded)
                results[where] = (encoded.cpu(), r.cpu())
            (enc_cpu, rep_cpu), (enc_dev, rep_dev) = results["cpu"], results[device]
            before = (master - replica.float()).abs().max().item()
            after = (master - rep_dev.float()).abs().max().item()
            out[f"{str(dtype).removeprefix('torch.')}-{bits}bit"] = {
                "encoded_equal": bool(torch.equal(enc_cpu, enc_dev)), "replica_equal": bool(torch.equal(rep_cpu, rep_dev)),
                "encoded_bytes": enc_dev.numel(), "gap_before": before, "gap_after": after}
    return out


def _rank_main(rank: int, port: int, device: str, updates: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        body = reducers_rank(rank, device, updates)
        if rank == 0:
            body["delta_codec"] = delta_codec_bits(device)
        results.put((rank, True, body))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- handed to the parent, which names the rank
        results.put((rank, False, traceback.format_exc()))


def run_ranks(device: str, updates: int, timeout_s: float) -> list[dict]:
    from nshard.seam.launch_env import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, device, updates, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    by_rank, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(by_rank) < WORLD:
            try:
                rank, ok, body = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in by_rank and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead or 'all'} died or timed out without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{body}")
            by_rank[rank] = body
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:  # a failed rank leaves its peer blocked in a collective
            if p.is_alive():
                p.kill()
    return [by_rank[r] for r in range(WORLD)]


def problems(ranks: list[dict], updates: int, device: str) -> list[str]:
    """Every way the ranks' results fall short of what this check promises (empty: all held)."""
    found = []
    first, *others = ranks
    warmup = REDUCERS["powersgd"]["dense_warmup_updates"]
    for update in range(updates):
        if len({r["inputs"][update] for r in ranks}) != len(ranks):
            found.append(f"update {update + 1}: two ranks were given the same gradients (not rank-dependent)")
        for kind in REDUCERS:
            mine = first["records"][kind][update]
            for other in others:
                theirs = other["records"][kind][update]
                differ = [n for n in SHAPES if mine["outputs"][n] != theirs["outputs"][n]]
                if differ:
                    found.append(f"update {update + 1}: {kind} outputs differ between ranks in {differ}")
                if mine.get("q") != theirs.get("q"):
                    found.append(f"update {update + 1}: PowerSGD's Q differs between ranks")
            for rank, r in enumerate(ranks):
                error = r["records"][kind][update]["relative_error"]
                if not error <= TOLERANCE:  # NaN fails too
                    found.append(f"update {update + 1}: rank {rank}'s {kind} output is {error:.3g} (relative) from the "
                                 f"CPU reference, over the tolerance {TOLERANCE:g}")
        if update >= warmup and not all(r["powersgd_output_differs_from_dense"][update] for r in ranks):
            found.append(f"update {update + 1}: PowerSGD's output equals the dense average (nothing compressed)")
    for rank, r in enumerate(ranks):
        if r["compressed_updates"] != updates - warmup:
            found.append(f"rank {rank}: {r['compressed_updates']} compressed updates, expected {updates - warmup}")
        if not r["compressed_matrices"]:
            found.append(f"rank {rank}: PowerSGD compressed no matrix")
        if r["error_memory_device"] != [device]:
            found.append(f"rank {rank}: error memory on {r['error_memory_device']}, not {device}")
    if len(first["compressed_matrices"]) != sum(len(s) == 2 for s in SHAPES.values()):
        found.append(f"compressed matrices {first['compressed_matrices']}: every 2-D shape should be")
    for case, c in first.get("delta_codec", {}).items():
        if not (c["encoded_equal"] and c["replica_equal"]):
            found.append(f"delta codec {case}: {device} and CPU differ (encoded equal: {c['encoded_equal']}, "
                         f"replica equal: {c['replica_equal']})")
        if not c["gap_after"] < c["gap_before"]:
            found.append(f"delta codec {case}: applying the delta left the gap at {c['gap_after']:.3g} "
                         f"(was {c['gap_before']:.3g})")
    if "delta_codec" not in first:
        found.append("rank 0 returned no delta codec result")
    return found


def summarize(ranks: list[dict], updates: int, device: str, seconds: float) -> dict:
    first = ranks[0]
    return {
        "device": device, "world": WORLD, "backend": "gloo", "updates": updates, "shapes": SHAPES,
        "reducers": REDUCERS, "seconds": round(seconds, 1),
        "cpu_reference": ("same device: --device cpu runs the reducers on the CPU, so the reference run is the "
                          "same computation and the comparison is trivially exact" if device == "cpu" else
                          "the same reducers on CPU copies of the same gradients, over the same gloo group"),
        "compressed_updates": [r["compressed_updates"] for r in ranks],
        "compressed_matrices": first["compressed_matrices"], "dense_remainder": first["dense_remainder"],
        "max_relative_error": {kind: max(r["records"][kind][u]["relative_error"] for r in ranks for u in range(updates))
                               for kind in REDUCERS},
        "tolerance": TOLERANCE,
        "ranks_bit_identical": all(r["records"][k][u]["outputs"] == first["records"][k][u]["outputs"]
                                   and r["records"][k][u].get("q") == first["records"][k][u].get("q")
                                   for r in ranks for k in REDUCERS for u in range(updates)),
        "delta_codec": first.get("delta_codec"), "delta_numel": DELTA_NUMEL,
        "ranks": ranks,  # every rank's digests and figures, which problems() was given
    }


def check_only(args) -> dict:
    """What the run would compress, from the layout alone (no process group, no device)."""
    from nshard.comm.config import parse_config
    from nshard.comm.delta import DeltaCodec
    from nshard.comm.layout import build_layout

    config = parse_config(REDUCERS["powersgd"])
    layout = build_layout(SHAPES, config.rank, config.min_compression_rate)
    for bits in DELTA_BITS:
        DeltaCodec(bits=bits, block=256)
    return {"check_only": True, "device": args.device, "updates": args.updates, "shapes": SHAPES,
            "compressed_matrices": [s.name for s in layout.matrices], "dense_remainder": list(layout.dense_names)}


def write(out: Path | None, body: dict) -> None:
    """The result on stdout as one JSON line and, with --out, atomically into that file."""
    from nshard.files import write_json_atomic

    if out is not None:
        write_json_atomic(out, body)
    print(json.dumps(body), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_only:
        body = check_only(args)
        write(args.out, body)
        return 0 if body["compressed_matrices"] else 1
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_reducers: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 1
    t0 = time.perf_counter()
    ranks = run_ranks(args.device, args.updates, args.timeout_s)
    body = summarize(ranks, args.updates, args.device, time.perf_counter() - t0)
    body["problems"] = problems(ranks, args.updates, args.device)
    body["ok"] = not body["problems"]
    write(args.out, body)
    for line in body["problems"]:
        print(f"gpu_reducers: FAILED: {line}", file=sys.stderr)
    return 0 if body["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
