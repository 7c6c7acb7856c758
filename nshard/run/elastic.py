"""Elastic resume: a complete state saved by W ranks continued on W' != W ranks (--resume --elastic, or a second
cohort whose arms run on another rank count than the state's).

What each part of the state becomes (docs/evidence.md#elastic-resume states the same):

    weights, fp32 masters, AdamW moments   repartitioned by DeepSpeed: ZeRO-0 keeps one optimizer state dict for
                                           any world size (loaded as it is); ZeRO-1/2 partitions are converted to
                                           DeepSpeed's universal checkpoint (ds_to_universal) and loaded with
                                           checkpoint.load_universal, which cuts them for W' ranks
    PowerSGD error memory                  every new rank gets the mean of the W saved errors (computed in fp64,
                                           stored in fp32): the mean over ranks, which is what the averaging
                                           reducer feeds into the next update, is conserved (conservation_record)
    PowerSGD Q, projection RNG, updates    identical on every saved rank by construction (Q is all-reduced and
                                           divided alike everywhere); checked identical, carried over unchanged
    RNG states, receipt counters, ledger   new rank r continues saved rank r mod W's
    data position                          the state's next update: the schedule is global, so the next global
                                           batch is the same documents, dealt to W' ranks

Anything that cannot be repartitioned is refused before anything is loaded (refusal).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from nshard.comm.feedback import mean_errors, spread_errors
from nshard.seam import engine as engine_mod

SCRATCH_PREFIX = ".tmp-elastic-"
"""state/.tmp-elastic-update-NNNNNN/: the universal checkpoint a ZeRO-1/2 elastic load reads, removed once loaded
(and, were a rank to die first, by the next save's clean-up of state/.tmp-*)."""


WHOLE_WRAPPERS = ("FP16_UnfusedOptimizer",)
"""DeepSpeed's stage-0 wrappers (bf16 or fp16 compute) that keep every fp32 master and moment on every rank and
save them whole in the model states file: loaded as they are on any world size."""


def refusal(engine, delta_sync: bool) -> str | None:
    """Why this engine (delta_sync: under nshard.parameter_sync = "delta") cannot take a state saved on another
    world size (None: it can), with the fix."""
    stage = engine_mod.zero_stage(engine)
    if stage == 3:
        return ("ZeRO stage 3 partitions the parameters themselves, and nshard's elastic resume covers stages 0, 1 "
                "and 2; resume on the state's own world size")
    if delta_sync:
        return ("nshard.parameter_sync = \"delta\" keeps replicas that trail the fp32 masters, and a repartitioned "
                "load rebuilds the replicas from the masters (not the weights the state sealed); resume on the "
                "state's own world size")
    optimizer = type(engine.optimizer).__name__
    if stage == 0 and engine.optimizer is not engine.basic_optimizer and optimizer not in WHOLE_WRAPPERS:
        return (f"at ZeRO stage 0 DeepSpeed wraps the optimizer in {optimizer}, whose fp32 state is partitioned by "
                "rank and which nshard's elastic resume does not repartition; resume on the state's own world "
                "size, or train at ZeRO stage 1 or 2")
    if stage in (1, 2) and optimizer != "DeepSpeedZeroOptimizer":
        return (f"the ZeRO-{stage} optimizer is {optimizer}, not DeepSpeedZeroOptimizer, whose partitions DeepSpeed's "
                "universal checkpoint repartitions; resume on the state's own world size")
    return None


def source_rank(rank: int, saved_world: int) -> int:
    """The saved rank whose RNG states, receipt counters and byte ledger new rank `rank` continues."""
    return rank % saved_world


def carry_parts(load_part, saved_world: int, rank: int) -> tuple[dict, dict | None]:
    """New rank `rank`'s part: saved rank (rank mod W)'s (RNG states, receipt counters, ledger), its seam state's
    PowerSGD error memory replaced by ERROR_RULE's and its Q, RNG and update count checked alike on every saved rank;
    and the fp64 mean error before (None without a PowerSGD reducer). `load_part(i)` reads saved rank i's part; the
    saved ranks' errors are read one rank at a time. ValueError names what differs between the saved ranks."""
    own = load_part(source_rank(rank, saved_world))
    reducer = own["seam"].get("reducer")
    if reducer is None or "errors" not in reducer:
        return own, None  # DeepSpeed's reduction keeps nothing; a dense reducer only its shapes and ledger
    first = own if source_rank(rank, saved_world) == 0 else load_part(0)

    def errors():
        for i in range(saved_world):
            other = first if i == 0 else own if i == source_rank(rank, saved_world) else load_part(i)
            check_alike(first["seam"]["reducer"], other["seam"]["reducer"], i)
            yield other["seam"]["reducer"]["errors"]

    before = mean_errors(errors())
    carried = {**first["seam"]["reducer"], "errors": spread_errors(before), "ledger": reducer["ledger"]}
    return {**own, "seam": {**own["seam"], "reducer": carried}}, before


def check_alike(first: dict, other: dict, r: int) -> None:
    """Q, the projection RNG, the update count and the shapes are the same on saved rank r as on rank 0 (they are
    made alike: Q is all-reduced and divided identically everywhere, the generator seeded and drawn alike), so
    carrying rank 0's over is carrying every rank's."""
    for key in ("updates", "shapes"):
        if other[key] != first[key]:
            raise ValueError(f"the saved reducers differ in {key} (rank 0: {first[key]}, rank {r}: {other[key]})")
    if not torch.equal(other["rng"], first["rng"]):
        raise ValueError(f"the saved reducers' projection RNG differs between rank 0 and rank {r}")
    if sorted(other["q"]) != sorted(first["q"]):
        raise ValueError(f"the saved reducers hold Q for different parameters (rank 0 and rank {r})")
    for name in first["q"]:
        if not torch.equal(other["q"][name], first["q"][name]):
            raise ValueError(f"the saved Q of {name} differs between rank 0 and rank {r}; Q is all-reduced and "
                             "must be identical on every rank")


def live_mean_errors(seam, world: int, device) -> dict:
    """The fp64 mean over the new ranks of the error memory each holds once loaded (a collective: one fp64
    all-reduce per compressed matrix), for the conservation record."""
    errors = seam.state_dict()["reducer"]["errors"]
    out = {}
    for name in sorted(errors):
        total = errors[name].detach().to(device, torch.float64)
        dist.all_reduce(total)  # torch.distributed: no update's byte count
        out[name] = (total / world).cpu()
    return out


def optimizer_sha256(full: dict) -> str:
    """SHA-256 over full_optimizer_state's tensors: name, key, dtype, shape and bytes, in name and key order."""
    h = hashlib.sha256()
    for name in sorted(full):
        for key in sorted(full[name]):
            t = full[name][key].detach().contiguous().cpu()
            h.update(f"{name}/{key}:{t.dtype}:{list(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load(engine, state: Path, saved_world: int, rank: int, scratch: Path, is_main: bool, delta_sync: bool,
         scheduler: bool = True) -> tuple[dict, dict, dict | None]:
    """A state saved by `saved_world` ranks loaded into this engine on another world size: (DeepSpeed's client
    state, this rank's carried-over part (carry_parts), the fp64 mean error before or None). ValueError names what
    cannot be repartitioned, before anything is loaded, and the fix."""
    why = refusal(engine, delta_sync)
    if why is not None:
        raise ValueError(why)
    client = engine_mod.load_checkpoint_resharded(engine, state, scratch, is_main, scheduler)
    part, before = carry_parts(lambda i: torch.load(state / f"rank-{i}.pt", map_location="cpu", weights_only=False),
                               saved_world, rank)
    return client, part, before


def finish(engine, seam, saved_world: int, world: int, before: dict | None) -> dict:
    """Once the carried-over seam state is loaded: the elastic record, with the error-feedback total the new ranks
    hold (gathered) beside the one they were given, and the gathered optimizer state's SHA-256 (collectives)."""
    from nshard.comm.feedback import conservation_record

    errors = None
    if before is not None:
        errors = conservation_record(before, live_mean_errors(seam, world, engine.device))
    optimizer_state = optimizer_sha256(engine_mod.full_optimizer_state(engine))
    return record(saved_world, world, engine_mod.zero_stage(engine), errors, optimizer_state)


def record(saved_world: int, world: int, stage: int, errors: dict | None, optimizer_state: str) -> dict:
    """The elastic record of the receipts and run.json: what changed and by which rule."""
    return {"from_world_size": saved_world, "to_world_size": world, "zero_stage": stage,
            "optimizer": ("one optimizer state dict (masters and moments whole), loaded as saved" if stage == 0 else
                          f"ZeRO-{stage} partitions repartitioned by DeepSpeed's universal checkpoint"),
            "optimizer_state_sha256": optimizer_state,
            "error_memory": errors if errors is not None else {"rule": "none: no PowerSGD error memory"},
            "q": "carried over unchanged (identical on every saved rank, checked)",
            "rng_receipts_ledger": f"new rank r continues saved rank r mod {saved_world}",
            "data": "the schedule's next global batch, dealt to the new ranks"}

