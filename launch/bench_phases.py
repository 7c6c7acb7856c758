"""Time of each PowerSGD and delta-sync phase at SmolLM2-1.7B's shapes, synchronized, as a share of a dense bf16
training step of the same model on the same device (launch/gpu_check.sh gives it its 1.7B step's receipt).

    python launch/bench_phases.py --device cuda --dense-step-receipt RUN/receipts/rank-0.json [--out FILE]
    python launch/bench_phases.py --device cpu --shrink           # a smoke run; its output says what was shrunk

Phases (nshard/comm/powersgd.py's functions, on one process: the all-reduces between them are not timed):
error_accumulate (M = error + gradient), p_products (P = M Q), orthogonalize, q_products (Q = Mᵀ P), decompress
(P Qᵀ into each gradient, rounded to bf16 as a bf16 run delivers it), error_settle (error = M − output);
delta_encode and delta_apply (nshard/comm/delta.py, 4 bits, an fp32 master against a bf16 replica) on one
partition of 850M elements, half the model (ZeRO-2 on two ranks). Each is the median of --repeats timed runs after
one untimed run, with the device synchronized before and after. --layers and --delta-numel below the model's
shrink the shapes; the output then says so under "shrunk" (and launch/gpu_check.sh fails such a run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = "smollm2-1.7b"
MODEL_LAYERS = 24
PARTITION_NUMEL = 850_000_000
SHRUNK_LAYERS, SHRUNK_DELTA_NUMEL = 1, 1 << 22
REDUCER = {"reducer": "powersgd", "rank": 32, "dense_warmup_updates": 0, "min_compression_rate": 2,
           "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch"}
DELTA = {"bits": 4, "block": 256}
GROUPS = {"p_and_q_products": ("p_products", "q_products", "decompress"), "orthogonalize": ("orthogonalize",),
          "error_update": ("error_accumulate", "error_settle"), "delta_encode_apply": ("delta_encode", "delta_apply")}
"""The issue's phases, each the sum of the timed ones it names."""


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--layers", type=int, default=MODEL_LAYERS, help=f"decoder layers (the model has {MODEL_LAYERS})")
    parser.add_argument("--delta-numel", type=int, default=PARTITION_NUMEL, help="elements of the delta partition")
    parser.add_argument("--shrink", action="store_true",
                        help=f"--layers {SHRUNK_LAYERS} --delta-numel {SHRUNK_DELTA_NUMEL}: a smoke run, said so")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each phase (after one untimed)")
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--dense-step-s", type=float, help="seconds of one dense bf16 training step of the model")
    step.add_argument("--dense-step-receipt", type=Path,
                      help="a one-rank dense bf16 run's receipts/rank-0.json: its median update is the step")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    parser.add_argument("--check-only", action="store_true", help="check the arguments and the layout; time nothing")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shrink:
        args.layers, args.delta_numel = SHRUNK_LAYERS, SHRUNK_DELTA_NUMEL
    if not 1 <= args.layers <= MODEL_LAYERS:
        parser.error(f"--layers {args.layers}: give 1 to {MODEL_LAYERS}")
    if not 0 < args.delta_numel <= PARTITION_NUMEL:
        parser.error(f"--delta-numel {args.delta_numel}: give 1 to {PARTITION_NUMEL}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if args.dense_step_s is not None and not args.dense_step_s > 0:
        parser.error(f"--dense-step-s {args.dense_step_s}: give the step's seconds, > 0")
    return args


def model_shapes(layers: int) -> dict:
    """SmolLM2-1.7B's parameter shapes (tied embedding) with `layers` decoder layers."""
    from nshard.analysis.memory_model import smollm2_1_7b

    return smollm2_1_7b(layers).shapes


def shrunk(args) -> str | None:
    parts = []
    if args.layers != MODEL_LAYERS:
        parts.append(f"{args.layers} of the model's {MODEL_LAYERS} layers (each layer's shapes as the model's)")
    if args.delta_numel != PARTITION_NUMEL:
        parts.append(f"a delta partition of {args.delta_numel:,} elements, not {PARTITION_NUMEL:,}")
    return "; ".join(parts) or None


def dense_step(args) -> tuple[float | str, dict]:
    """The dense bf16 step's seconds (or 'missing: why') and where the figure came from."""
    if args.dense_step_s is not None:
        return args.dense_step_s, {"source": "--dense-step-s"}
    if args.dense_step_receipt is None:
        return "missing: no dense bf16 step given (--dense-step-s or --dense-step-receipt)", {}
    try:
        receipt = json.loads(args.dense_step_receipt.read_text())
    except (OSError, ValueError) as exc:
        return f"missing: the dense step's receipt cannot be read ({exc})", {}
    dense = [s for s, c in zip(receipt.get("update_s", []), receipt.get("update_compressed", [])) if not c]
    source = {"source": str(args.dense_step_receipt), "device": receipt.get("device"), "updates": len(dense),
              "precision": receipt.get("precision")}
    if not dense:
        return "missing: the receipt holds no dense update", source
    return statistics.median(dense), source


def shares(phases_s: dict, step) -> dict | str:
    """Each phase and group of phases as a fraction of the dense step ('missing: why' without one)."""
    if isinstance(step, str):
        return step
    out = {name: seconds / step for name, seconds in phases_s.items()}
    out.update({group: sum(phases_s[p] for p in members) / step for group, members in GROUPS.items()})
    return out


class Timer:
    def __init__(self, device):
        import torch

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, list[float]] = {}

    def run(self, name: str, fn, keep: bool) -> None:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        if keep:
            self.seconds.setdefault(name, []).append(time.perf_counter() - t0)


def build_reducer_state(shapes: dict, device):
    """nshard's PowerSGD reducer on a one-process gloo group, registered with the shapes, its buffers on `device`."""
    import torch.distributed as dist

    from nshard.comm import build_reducer
    from nshard.comm.powersgd import prepare_buffers
    from nshard.seam.launch_env import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    reducer = build_reducer(REDUCER)
    reducer.register(shapes)
    prepare_buffers(reducer.state, device)
    return reducer


def powersgd_phases(timer: Timer, shapes: dict, device, repeats: int) -> dict:
    """One compressed update's compute, phase by phase, over every compressed matrix of the model."""
    import torch

    from nshard.comm import powersgd as ps

    reducer = build_reducer_state(shapes, device)
    state = reducer.state
    state.delivered_dtypes = {slot.param: torch.bfloat16 for slot in state.layout.matrices}
    gen = torch.Generator(device=device).manual_seed(0)
    grads = {slot.param: torch.randn(shapes[slot.param], generator=gen, device=device) for slot in state.layout.matrices}
    slots = state.layout.matrices

    def accumulate():
        for slot in slots:
            state.errors.accumulate(slot.name, ps.as_matrix(ps.unit_grad(grads, slot)))

    def decompress():
        for slot in slots:
            grad = ps.unit_grad(grads, slot)
            ps.decompress(ps.p_block(state.p_flat, slot), ps.q_block(state.q_flat, slot), grad)
            ps.round_to_delivered(grad, state.delivered_dtypes.get(slot.param))

    def settle():
        for slot in slots:
            grad = ps.unit_grad(grads, slot)
            ps.update_error(state, slot, state.errors.matrix(slot.name, ps.as_matrix(grad)), grad)

    for i in range(repeats + 1):  # the first run is untimed (kernel selection, workspaces)
        for name, fn in (("error_accumulate", accumulate), ("p_products", lambda: ps.compute_p(state, grads)),
                         ("orthogonalize", lambda: ps.orthogonalize(state)),
                         ("q_products", lambda: ps.compute_q(state, grads)), ("decompress", decompress),
                         ("error_settle", settle)):
            timer.run(name, fn, keep=i > 0)
    layout = state.layout
    return {"compressed_matrices": len(layout.matrices),
            "compressed_elements": sum(s.n * s.m for s in layout.matrices),
            "shape_groups": [{"n": g.n, "m": g.m, "r": g.r, "count": g.count} for g in layout.groups],
            "orthogonalization": getattr(state, "orthogonalization", "householder"),
            "orthogonal_fallbacks": getattr(state, "orthogonal_fallbacks", None)}


def delta_phases(timer: Timer, numel: int, device, repeats: int) -> dict:
    import torch

    from nshard.comm.delta import DeltaCodec

    codec = DeltaCodec(**DELTA)
    gen = torch.Generator(device=device).manual_seed(1)
    master = torch.randn(numel, generator=gen, device=device)
    replica = master.to(torch.bfloat16)
    master.add_(torch.randn(numel, generator=gen, device=device).mul_(1e-3))
    encoded = codec.empty(numel, device)
    for i in range(repeats + 1):
        timer.run("delta_encode", lambda: codec.encode(master, replica, encoded), keep=i > 0)
        timer.run("delta_apply", lambda: codec.apply_(replica, encoded), keep=i > 0)
    return {"numel": numel, "encoded_bytes": encoded.numel(), **DELTA, "master": "float32", "replica": "bfloat16"}


def check_only(args) -> dict:
    """What would be timed, from the layout alone (no tensors)."""
    from nshard.comm.config import parse_config
    from nshard.comm.delta import DeltaCodec
    from nshard.comm.layout import build_layout

    import torch

    torch.device(args.device)  # a bad device string fails here
    config = parse_config(REDUCER)
    layout = build_layout(model_shapes(args.layers), config.rank, config.min_compression_rate)
    DeltaCodec(**DELTA)
    return {"check_only": True, "device": args.device, "layers": args.layers, "delta_numel": args.delta_numel,
            "shrunk": shrunk(args), "compressed_matrices": len(layout.matrices),
            "dense_step": "--dense-step-s" if args.dense_step_s else str(args.dense_step_receipt)}


def run(args) -> dict:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_phases: --device cuda but torch sees no CUDA device")
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    timer = Timer(device)
    shapes = model_shapes(args.layers)
    body = {"model": MODEL, "device": str(device), "layers": args.layers, "shrunk": shrunk(args),
            "repeats": args.repeats, "synchronized": device.type == "cuda",
            "powersgd": powersgd_phases(timer, shapes, device, args.repeats)}
    body["delta"] = delta_phases(timer, args.delta_numel, device, args.repeats)
    if device.type == "cuda":
        body["gpu"] = torch.cuda.get_device_name(device)
        body["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    phases_s = {name: statistics.median(times) for name, times in timer.seconds.items()}
    step, source = dense_step(args)
    body.update(phases_s=phases_s, dense_step_s=step, dense_step=source, share_of_dense_step=shares(phases_s, step))
    return body


def write(out: Path | None, body: dict) -> None:
    """The result on stdout as one JSON line and, with --out, atomically into that file."""
    from nshard.files import write_json_atomic

    if out is not None:
        write_json_atomic(out, body)
    print(json.dumps(body), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_only:
        write(args.out, check_only(args))
        return 0
    body = run(args)
    if body["shrunk"]:
        print(f"bench_phases: SHAPES SHRUNK: {body['shrunk']}; these are not the 1.7B model's figures", file=sys.stderr)
    for name, seconds in body["phases_s"].items():
        share = body["share_of_dense_step"]
        print(f"bench_phases: {name:17s} {seconds * 1e3:9.2f} ms"
              + (f"  {share[name]:7.2%} of the dense step" if isinstance(share, dict) else ""), file=sys.stderr)
    write(args.out, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
