"""Delta parameter sync: the weights' all-gather that ends a partitioned (ZeRO-1/2) step, sent as quantized changes.

Every rank holds a replica of the whole model; each rank owns one partition's fp32 master, which AdamW steps
exactly. Instead of sending its updated partition, the owner sends Δ = master − replica, quantized blockwise
(one fp32 scale per block, 8, 4 or 2 bits per element), and every rank, the owner included, adds the same
dequantized Δ to its replica of that partition with a plain multiply and a separate add. Both are correctly
rounded IEEE operations, so every rank computes the same bits on any CPU or GPU, and the replicas stay
identical. What quantization left out stays in master − replica and is carried into the next Δ by
construction: the gap is the error memory, and no buffer holds it.

The exchange is a ring of isend/irecv (nshard/comm/ring.py, as nshard/seam/param_gather.py's), each partition applied as it arrives,
so beyond the replicas a rank holds one encoded partition per peer in flight, never a second model.
Imports only torch (and nshard/phases.py's clock): the DeepSpeed side (which tensors are masters and replicas) is
nshard/seam/patches.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nshard.comm.ring import neighbours, ring_step
from nshard.phases import timed

BITS = (8, 4, 2)
CHUNK_BLOCKS = 4096
"""Blocks encoded, applied or compared at a time on the CPU: the fp32 temporaries stay a few MiB, in cache."""
GPU_CHUNK_ELEMENTS = 1 << 26
"""Elements at a time on a GPU: each kernel covers 64M elements (about 12 bytes of temporaries per element,
0.8 GB), so an 850M-element partition takes 13 launches of each kernel instead of 3,300."""


def chunk_elements(device, block: int) -> int:
    """Elements the codec works on at a time on `device`, a whole number of blocks. Every block is encoded and
    applied on its own, so any whole number of blocks gives the same bits."""
    if torch.device(device).type == "cpu":
        return CHUNK_BLOCKS * block
    return max(block, GPU_CHUNK_ELEMENTS // block * block)


def _spans(numel: int, chunk: int):
    for start in range(0, numel, chunk):
        yield start, min(chunk, numel - start)


@dataclass(frozen=True)
class DeltaCodec:
    """Blockwise symmetric quantization of a change: code = round(Δ/scale) in [−qmax, qmax], scale = max|Δ|/qmax."""

    bits: int = 4
    """Bits per element (8, 4 or 2); 2 bits gives the three levels −1, 0, +1 times the block's scale."""
    block: int = 256
    """Elements per fp32 scale (a multiple of 16, so every block's codes fill whole 4-byte words)."""

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"delta bits {self.bits!r}: use one of {BITS}")
        if not (isinstance(self.block, int) and self.block >= 16 and self.block % 16 == 0):
            raise ValueError(f"delta block {self.block!r}: use a multiple of 16 (e.g. 256)")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        return self.blocks(numel) * self.block // self.per_byte

    def encoded_bytes(self, numel: int) -> int:
        """Bytes on the wire for a partition of `numel` elements: the packed codes, then one fp32 scale per block."""
        return self.code_bytes(numel) + 4 * self.blocks(numel)

    def empty(self, numel: int, device) -> torch.Tensor:
        return torch.empty(self.encoded_bytes(numel), dtype=torch.uint8, device=device)

    def _views(self, encoded: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = encoded.narrow(0, 0, self.code_bytes(numel))
        scales = encoded.narrow(0, self.code_bytes(numel), 4 * self.blocks(numel)).view(torch.float32)
        return codes, scales

    def chunk(self, device, chunk: int | None = None) -> int:
        """`chunk` (elements at a time) checked, or chunk_elements(device)'s default."""
        if chunk is None:
            return chunk_elements(device, self.block)
        if not (isinstance(chunk, int) and chunk > 0 and chunk % self.block == 0):
            raise ValueError(f"delta chunk {chunk!r}: use a positive multiple of the block ({self.block})")
        return chunk

    @torch.no_grad()
    def encode(self, master: torch.Tensor, replica: torch.Tensor, out: torch.Tensor, chunk: int | None = None) -> None:
        """Write the quantized master − replica (flat, equal sizes) into `out` (from empty(numel)), `chunk`
        elements at a time (default: chunk_elements(device)). Reads nothing back to the host."""
        codes, scales = self._views(out, master.numel())
        for start, count in _spans(master.numel(), self.chunk(master.device, chunk)):
            first, nblocks = start // self.block, self.blocks(count)
            delta = self._padded_delta(master.narrow(0, start, count), replica.narrow(0, start, count), nblocks)
            low, high = torch.aminmax(delta, dim=1)
            scale = torch.maximum(high, low.neg_()).div_(self.qmax)
            inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), device=scale.device))
            # In place on the chunk's own temporary: q = round(Δ / scale) + qmax, in [0, 2 qmax].
            delta.mul_(inverse[:, None]).round_().clamp_(-self.qmax, self.qmax).add_(self.qmax)
            scales.narrow(0, first, nblocks).copy_(scale)
            codes.narrow(0, first * self.block // self.per_byte, nblocks * self.block // self.per_byte).copy_(
                self._pack(delta.view(-1).to(torch.uint8)))

    def _padded_delta(self, master: torch.Tensor, replica: torch.Tensor, nblocks: int) -> torch.Tensor:
        """master − replica in fp32 as (nblocks, block), the tail past the partition zero (it decodes to nothing)."""
        count = master.numel()
        if count == nblocks * self.block:
            return torch.sub(master.float(), replica.float()).view(nblocks, self.block)
        delta = torch.zeros(nblocks * self.block, dtype=torch.float32, device=master.device)
        torch.sub(master.float(), replica.float(), out=delta.narrow(0, 0, count))
        return delta.view(nblocks, self.block)

    @torch.no_grad()
    def apply_(self, replica: torch.Tensor, encoded: torch.Tensor, chunk: int | None = None) -> None:
        """replica += dequantized Δ, as a plain multiply then a separate add (no fused multiply-add), so every
        rank rounds alike; a bf16 replica adds in fp32 and rounds once to bf16. `chunk` as in encode."""
        codes, scales = self._views(encoded, replica.numel())
        table = self._table(replica.device)
        for start, count in _spans(replica.numel(), self.chunk(replica.device, chunk)):
            first, nblocks = start // self.block, self.blocks(count)
            packed = codes.narrow(0, first * self.block // self.per_byte, nblocks * self.block // self.per_byte)
            # One lookup gives each byte's per_byte levels (code − qmax, exact small integers in fp32).
            change = table.index_select(0, packed.to(torch.int32)).view(nblocks, self.block)
            change.mul_(scales.narrow(0, first, nblocks)[:, None])
            change = change.view(-1).narrow(0, 0, count)
            target = replica.narrow(0, start, count)
            if target.dtype == torch.float32:
                target.add_(change)
            else:
                target.copy_(change.add_(target.float()))

    def _table(self, device) -> torch.Tensor:
        """(256, per_byte) fp32: the levels each byte value packs, low bits first (made on the device: no copy from
        the host, which would wait for the device)."""
        byte = torch.arange(256, dtype=torch.int32, device=device)
        mask = (1 << self.bits) - 1
        levels = [((byte >> (self.bits * k)) & mask) - self.qmax for k in range(self.per_byte)]
        return torch.stack(levels, dim=1).to(torch.float32)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        if self.per_byte == 1:
            return q
        q = q.view(-1, self.per_byte)
        packed = q[:, 0].clone()
        for k in range(1, self.per_byte):
            packed |= q[:, k] << (self.bits * k)
        return packed


@torch.no_grad()
def gap_max_(running: torch.Tensor, master: torch.Tensor, replica: torch.Tensor,
             chunk: int | None = None) -> torch.Tensor:
    """running := max(running, max |master − replica| over a partition), in fp32 on the partition's device, a
    chunk at a time (default: chunk_elements(device, 256)). Reads nothing back to the host, so a step's partitions
    add no synchronization; the caller reads the running maximum once."""
    chunk = chunk or chunk_elements(master.device, 256)
    for start, count in _spans(master.numel(), chunk):
        gap = torch.sub(master.narrow(0, start, count).float(), replica.narrow(0, start, count).float())
        torch.maximum(running, gap.abs_().amax(), out=running)
    return running


def max_gap(master: torch.Tensor, replica: torch.Tensor) -> float:
    """max |master − replica| over a partition (the error memory's largest element), read back once."""
    return gap_max_(torch.zeros((), device=master.device), master, replica).item()


def exchange_isend_irecv(isend: Callable = dist.isend, irecv: Callable = dist.irecv) -> Callable:
    """One ring step as a pair of isend/irecv (gloo), each taking (tensor, peer global rank, group); a two-rank
    group with a second lane sends each direction on its own connection (nshard/comm/ring.py)."""
    def exchange(outgoing: torch.Tensor, incoming: torch.Tensor, group) -> None:
        ring_step(outgoing, incoming, group, isend, irecv)
    return exchange


@timed("collective_wait")
def exchange_batched(outgoing: torch.Tensor, incoming: torch.Tensor, group) -> None:
    """One ring step through batch_isend_irecv (NCCL, where a lone isend before an irecv can deadlock the ring;
    gloo runs it too, on CPU tensors, which is how the suite runs this path)."""
    right, left = neighbours(group)
    ops = [dist.P2POp(dist.isend, outgoing, right, group), dist.P2POp(dist.irecv, incoming, left, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def delta_sync_(codec: DeltaCodec, master: torch.Tensor, replicas: Sequence[torch.Tensor], group=None,
                exchange: Callable | None = None) -> int:
    """Bring every rank's replicas[i] (the partitions of one flat group, equal sizes, contiguous) up to date with
    owner i's master. `master` is this rank's fp32 partition; replicas[me] is its own replica of it.

    Ring: this rank encodes its Δ, then in step s of N−1 sends the encoded partition (me − s) to its right
    neighbour while receiving (me − s − 1) from its left, and applies each one once it has it (its own first).
    `exchange` runs one ring step (exchange_isend_irecv() by default). Returns the bytes this rank sent.
    """
    n = dist.get_world_size(group=group) if dist.is_initialized() else 1
    if len(replicas) != n:
        raise ValueError(f"{len(replicas)} replica partitions for a group of {n} ranks")
    if len({r.numel() for r in replicas}) != 1 or master.numel() != replicas[0].numel():
        raise ValueError("delta_sync_ needs equal partitions and a master of the same size")
    me = dist.get_rank(group=group) if n > 1 else 0
    exchange = exchange or exchange_isend_irecv()
    numel = master.numel()
    encoded = {me: codec.empty(numel, master.device)}
    codec.encode(master, replicas[me], encoded[me])
    codec.apply_(replicas[me], encoded[me])
    if n == 1:
        return 0
    sent = 0
    for step in range(n - 1):
        outgoing, incoming = (me - step) % n, (me - step - 1) % n
        encoded[incoming] = codec.empty(numel, master.device)
        exchange(encoded[outgoing], encoded[incoming], group)
        sent += encoded[outgoing].numel()
        codec.apply_(replicas[incoming], encoded[incoming])
        del encoded[outgoing]  # forwarded: at most two encoded partitions are alive at a time
    return sent
