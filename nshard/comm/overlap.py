"""Reduction that starts during the last microbatch's backward (nshard.overlap_backward): parameters in fixed
buckets, each bucket's collectives started the moment its gradients are final, as DDP's comm hooks do.

The buckets are the parameters in reverse module order (about the order backward finishes them), cut every
BUCKET_BYTES of fp32 gradient; a parameter of at least BUCKET_BYTES is a bucket of its own. Bucket k starts once all its gradients are final and buckets 0..k-1 have started, so
every rank issues the same collectives in the same order whatever order its backward takes. Gradients the last
backward does not touch (a parameter unused by that microbatch) are final when it ends; their buckets start then.
A gradient is final when a hook set only for an update's last backward has seen it: at stage 0 torch's
post-accumulate-grad hook on the parameter (reduce(), on .grad); on the ingest seam (nshard/seam/ingest.py) the
hook that adds it to its fp32 sum (begin(), final(), end(), on the sums). The reducer's start_buckets() update does
the arithmetic (nshard/comm/dense.py DenseBuckets, nshard/comm/powersgd.py BucketedPowerSGD).

Hooks run in the thread that runs the backward (on the CPU, the training thread), so the phases they mark
(nshard/phases.py) nest in forward_backward as any other; the wait after backward is collective_wait.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Mapping, Sequence

import torch

from nshard.comm.agree import RanksDisagree
from nshard.phases import phase

BUCKET_BYTES = 25 * 2**20
"""fp32 gradient bytes per bucket (DDP's default bucket_cap_mb); a parameter of at least this many is a bucket of
its own."""


def plan_buckets(named_bytes: Sequence[tuple[str, int]], bucket_bytes: int = BUCKET_BYTES) -> tuple[tuple[str, ...], ...]:
    """Consecutive names, in the order given, grouped until a bucket holds at least `bucket_bytes`; a name of at
    least `bucket_bytes` closes the open bucket and is a bucket of its own."""
    buckets, current, held = [], [], 0
    for name, size in named_bytes:
        if size >= bucket_bytes and current:
            buckets.append(tuple(current))
            current, held = [], 0
        current.append(name)
        held += size
        if held >= bucket_bytes:
            buckets.append(tuple(current))
            current, held = [], 0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


class BackwardOverlap:
    """Reduces one update's gradients in place, bucket by bucket, while its last backward runs."""

    def __init__(self, reducer, params: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES):
        """`params`: the trained parameters by name in module order, as registered with `reducer` (whose
        transport must start collectives without waiting: TorchTransport). Agreeing on the buckets is a
        collective: every rank builds this at the same point."""
        self.reducer, self.params = reducer, dict(params)
        order = list(self.params)[::-1]
        # What is sent is fp32 (the .grad of an fp32 model, the ingest seam's fp32 sums): 4 bytes per element,
        # whatever the parameter's dtype.
        self.buckets = plan_buckets([(n, 4 * self.params[n].numel()) for n in order], bucket_bytes)
        self.bucket_of = {name: i for i, bucket in enumerate(self.buckets) for name in bucket}
        agree_on_buckets(self.buckets, reducer.transport)
        self.launched_in_backward = 0
        """Buckets the last update started from inside its backward (the rest started after it)."""
        self.updates, self.started_in_backward = 0, 0
        """Updates closed by end(), and the buckets they started from inside their backward, all told (receipts)."""
        self._update, self._source, self._waiting, self._next = None, None, [], 0

    def reduce(self, backward: Callable[[], None]) -> None:
        """The .grad path (stage 0): run the update's last `backward` with a post-accumulate-grad hook on every
        parameter, then reduce what is left. Afterwards each .grad holds the reduced gradient (a zero one for a
        parameter never used)."""
        self.begin(lambda name: self.params[name].grad)
        handles = [p.register_post_accumulate_grad_hook(lambda _, name=name: self.final(name))
                   for name, p in self.params.items()]
        try:
            self.backward(backward)
        finally:
            for handle in handles:
                handle.remove()
        with phase("reducer_compute"):
            for p in self.params.values():
                if p.grad is None:  # every parameter takes part in every update, with a zero gradient if unused
                    p.grad = torch.zeros_like(p)
        self.end()

    def begin(self, source: Callable[[str], torch.Tensor]) -> None:
        """Open an update before its last backward; `source(name)` is the tensor that holds a parameter's gradient
        once final(name) was called, and is reduced in place. Refused while an update is open (its buckets may
        still be in flight): each begin() is closed by end(), or by abandon() when its backward failed."""
        if self._update is not None:
            raise RuntimeError("nshard.overlap_backward: an update was begun while the previous one is still open "
                               f"({self._next} of its {len(self.buckets)} buckets started, none waited for); every "
                               "begin() must be closed by end(), or by abandon() when its backward raised")
        device = next(iter(self.params.values())).device
        with phase("reducer_compute"):
            self._update = self.reducer.start_buckets(device)
        self._source, self._waiting, self._next = source, [set(bucket) for bucket in self.buckets], 0

    def backward(self, backward: Callable[[], None]) -> None:
        """Run the update's last `backward` (between begin() and end()); if it raises, abandon() the update before
        the exception goes on, so that no all-reduce it started is left in flight."""
        try:
            backward()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Close an update whose backward failed: wait for every bucket it started (the other ranks start the same
        buckets in the same order, so each completes unless a peer failed before reaching it) and write nothing
        back. The reducer's state then holds part of an update (its error memory, P): the run must not go on from
        it, but resume from a checkpoint."""
        update, self._update = self._update, None
        self.launched_in_backward, self._waiting = self._next, []
        if update is not None:
            with phase("collective_wait"):
                update.abandon()

    def final(self, name: str) -> None:
        """`name`'s gradient is final (its hook ran in the last backward): start every bucket now ready."""
        waiting = self._waiting[self.bucket_of[name]]
        if name not in waiting:
            raise RuntimeError(f"the gradient of {name} was accumulated twice in one backward (reentrant activation "
                               "checkpointing?): nshard.overlap_backward needs each gradient final once; set it to "
                               "false")
        waiting.discard(name)
        self._start_ready()

    def end(self) -> None:
        """After the last backward every gradient is final: start the buckets left and wait for all of them."""
        self.launched_in_backward = self._next
        self.updates += 1
        self.started_in_backward += self._next
        with phase("reducer_compute"):
            for waiting in self._waiting:
                waiting.clear()
            self._start_ready()
            update, self._update = self._update, None
            update.finish({name: self._source(name) for name in self.params})

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and not self._waiting[self._next]:
            self._update.launch({name: self._source(name) for name in self.buckets[self._next]})
            self._next += 1


def agree_on_buckets(buckets: Sequence[Sequence[str]], transport) -> None:
    """Raise RanksDisagree unless every rank cut the same buckets (the same module order): otherwise their
    collectives would pair different tensors."""
    digest = hashlib.sha256(json.dumps([list(b) for b in buckets]).encode()).hexdigest()
    digests = transport.all_gather_object(digest)
    if len(set(digests)) != 1:
        raise RanksDisagree(f"ranks cut different gradient buckets (hashes {digests}): their modules list the "
                            "parameters in different orders; build the same model on every rank")
