"""Delta sync's encode + apply + gap of one partition, old chunking against new, in one run on one device.

    .venv/bin/python -m launch.bench_delta --device cuda [--numel 850000000] --json   # the GPU check's call
    .venv/bin/python -m launch.bench_delta --device cpu                                # a smaller partition, said so

old: the codec a CPU-cache-sized chunk at a time (CHUNK_BLOCKS blocks) on every device, and the gap read back to
the host after every chunk (two reads each), as nshard/comm/delta.py did before. new: chunks sized by the device
(chunk_elements: the same on the CPU, GPU_CHUNK_ELEMENTS on a GPU) and the gap kept on the device, read once.
Both encode an fp32 master against a bf16 replica at 4 bits, block 256 (what a ZeRO-2 bf16 run sends), apply it,
and measure the gap; each arm is the median of --repeats timed passes after one untimed pass, the device
synchronized around each. `host_reads` counts the reads the arm's code makes; on CUDA `cuda_syncs` counts the
synchronizations torch reports in one further pass (torch.cuda.set_sync_debug_mode). `same_bits` compares the two
arms' encoded bytes and replicas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402 -- after sys.path takes the checkout

from nshard.comm.delta import CHUNK_BLOCKS, DeltaCodec, chunk_elements, gap_max_  # noqa: E402 -- after sys.path takes the checkout
from nshard.files import write_text_atomic  # noqa: E402 -- after sys.path takes the checkout

PARTITION_NUMEL = 850_000_000
"""Half of SmolLM2-1.7B's parameters: one rank's partition under ZeRO-2 on two ranks."""
CPU_NUMEL = 1 << 24
CODEC = DeltaCodec(bits=4, block=256)


def build_parser() -> argparse.ArgumentParser:
    from nshard.cli import SPELLING_NOTE, ArgumentParser

    parser = ArgumentParser(description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--numel", type=int, help=f"partition elements (default {PARTITION_NUMEL:,} on a GPU, "
                                                  f"{CPU_NUMEL:,} on the CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each arm (after one untimed)")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: give cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; give --device cpu")
    if args.numel is None:
        args.numel = CPU_NUMEL if args.device == "cpu" else PARTITION_NUMEL
    if args.numel <= 0 or args.repeats <= 0:
        parser.error("--numel and --repeats: give positive numbers")
    return args


class Arm:
    """One way of syncing the partition: a chunk size and a way of taking the gap; counts its host reads."""

    def __init__(self, name: str, chunk: int, gap_per_chunk: bool):
        self.name, self.chunk, self.gap_per_chunk, self.host_reads = name, chunk, gap_per_chunk, 0

    def run(self, master: torch.Tensor, replica: torch.Tensor, encoded: torch.Tensor) -> float:
        CODEC.encode(master, replica, encoded, chunk=self.chunk)
        CODEC.apply_(replica, encoded, chunk=self.chunk)
        return self._gap_per_chunk(master, replica) if self.gap_per_chunk else self._gap_once(master, replica)

    def _gap_per_chunk(self, master, replica) -> float:
        gap = 0.0
        for m, r in zip(master.split(self.chunk), replica.split(self.chunk)):
            low, high = torch.aminmax(torch.sub(m.float(), r.float()))
            gap = max(gap, float(high), -float(low))
            self.host_reads += 2
        return gap

    def _gap_once(self, master, replica) -> float:
        running = gap_max_(torch.zeros((), device=master.device), master, replica, chunk=self.chunk)
        self.host_reads += 1
        return running.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_pass(arm: Arm, master, start, replica, encoded) -> tuple[float, float]:
    replica.copy_(start)
    sync(master.device)
    t0 = time.perf_counter()
    gap = arm.run(master, replica, encoded)
    sync(master.device)
    return time.perf_counter() - t0, gap


def counted_pass(arm: Arm, master, start, replica, encoded) -> dict:
    """One more pass, its host reads counted (and on CUDA its synchronizations), ending as the timed ones did."""
    arm.host_reads = 0
    replica.copy_(start)
    run = lambda: arm.run(master, replica, encoded)
    syncs = count_cuda_syncs(run) if master.device.type == "cuda" else run() and None
    return {"chunk_elements": arm.chunk, "chunks": -(-master.numel() // arm.chunk), "host_reads": arm.host_reads,
            "cuda_syncs": syncs}


def count_cuda_syncs(fn) -> int:
    """Synchronizations torch reports while fn runs (its sync debug mode warns once per synchronizing call)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(device_name: str, numel: int, repeats: int, command: str) -> dict:
    device = torch.device(device_name)
    g = torch.Generator(device=device).manual_seed(0)
    start = torch.randn(numel, generator=g, device=device).to(torch.bfloat16)
    master = start.float().add_(torch.randn(numel, generator=g, device=device), alpha=1e-3)
    replica = torch.empty_like(start)
    arms = {"old": Arm("old", CHUNK_BLOCKS * CODEC.block, gap_per_chunk=True),
            "new": Arm("new", chunk_elements(device, CODEC.block), gap_per_chunk=False)}
    encoded = {name: CODEC.empty(numel, device) for name in arms}
    seconds, gaps = {name: [] for name in arms}, {}
    for i in range(repeats + 1):  # the arms take turns, so a busy machine slows both alike; pass 0 warms up
        for name in (("old", "new") if i % 2 else ("new", "old")):
            took, gaps[name] = timed_pass(arms[name], master, start, replica, encoded[name])
            if i:
                seconds[name].append(took)
    results, bits = {}, {}
    for name, arm in arms.items():
        results[name] = {**counted_pass(arm, master, start, replica, encoded[name]),
                         "seconds": statistics.median(seconds[name]), "seconds_each": seconds[name], "gap": gaps[name]}
        bits[name] = (encoded[name].cpu(), replica.cpu())
    same = all(torch.equal(a, b) for a, b in zip(bits["old"], bits["new"]))
    shrunk = None
    if numel < PARTITION_NUMEL:
        shrunk = {"numel": numel, "model_partition_numel": PARTITION_NUMEL,
                  "why": "a smaller partition than SmolLM2-1.7B's half (given by --numel, or the CPU default)"}
    return {"benchmark": "delta encode+apply+gap, old vs new chunking", "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(), "numel": numel, "shrunk": shrunk,
            "codec": {"bits": CODEC.bits, "block": CODEC.block}, "replica_dtype": "bfloat16", "repeats": repeats,
            "old": results["old"], "new": results["new"], "same_bits": same,
            "new_over_old_seconds": results["new"]["seconds"] / results["old"]["seconds"],
            "command": command}


def main(argv=None) -> dict:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    summary = measure(args.device, args.numel, args.repeats, " ".join(["python -m launch.bench_delta", *argv]))
    text = json.dumps(summary, indent=1)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    if args.json:
        print(text)
    else:
        if summary["shrunk"]:
            print(f"shrunk: {summary['numel']:,} elements, not the 1.7B partition's {PARTITION_NUMEL:,}")
        for name in ("old", "new"):
            r = summary[name]
            print(f"{name}: {r['chunks']:,} chunks of {r['chunk_elements']:,}, {r['host_reads']:,} host reads, "
                  f"cuda syncs {r['cuda_syncs']}, {r['seconds']:.4f} s")
        print(f"new/old: {summary['new_over_old_seconds']:.3f}x the time; same bits: {summary['same_bits']}")
    if not summary["same_bits"]:
        raise SystemExit("old and new chunking gave different bits")
    return summary


if __name__ == "__main__":
    main()
