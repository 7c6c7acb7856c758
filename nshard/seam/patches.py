"""Every place nshard reaches past DeepSpeed's public API, listed here and checked by one guard.

DeepSpeed has no public hook for replacing its gradient reduction, for handing ZeRO a reduced gradient, or
for its end-of-step all-gather. Each private attribute, module symbol and replacement nshard relies on is
named in the lists below; `guard(engine)` checks every one of them (and the version they were verified on)
when the engine is built, before any patch is applied, so an upgrade that moves one fails loudly there.
No other module imports deepspeed.runtime or touches an engine or optimizer attribute not listed here
(tests/test_layout.py checks it). Verified on deepspeed 0.19.8 (pyproject pins >=0.19.8,<0.20).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from nshard.log import log
from nshard.phases import phase

COLLECTIVE, PARAMETER_SYNC = phase("collective_wait"), phase("parameter_sync")
"""The phases (nshard/phases.py) the wrapped collectives and parameter syncs below are timed as."""

VERIFIED_VERSIONS = ((0, 19, 8), (0, 20, 0))  # [lowest, first unverified)
REDUCER_LOG_NAME = "nshard_reducer"
PARAMETER_GATHER_LOG_NAME = "nshard_parameter_gather"
DELTA_SYNC_LOG_NAME = "nshard_delta_sync"
# deepspeed.comm ops that carry gradients (the rest, all_gather & co., carry parameters).
GRAD_OPS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_reduce_coalesced")

# The engine's public API as nshard uses it (listed so that a use outside it shows up in tests/test_layout.py).
ENGINE_API = ("module", "optimizer", "basic_optimizer", "device", "backward", "step", "train", "zero_optimization_stage",
              "gradient_clipping", "clip_fp32_gradients", "mpu",
              "bfloat16_enabled", "fp16_enabled", "gradient_accumulation_steps", "save_checkpoint",
              "load_checkpoint",
              # nshard/seam/observe.py: the monitor it stands in for, the norm DeepSpeed computes, the boundary.
              "monitor", "get_global_grad_norm", "is_gradient_accumulation_boundary")
# What every DeepSpeed optimizer wrapper shares with torch.optim.Optimizer and nshard reads.
OPTIMIZER_API = ("param_groups",)
# Private: the stage-0 all-reduce switch, zero_grad, which nshard replaces at stage 0 in fp32, and the reduction
# epilogue of DeepSpeed's own backward, which nshard times (time_deepspeed_reduction); _config, whose
# load_universal_checkpoint an elastic resume sets for its one load (engine.load_checkpoint_resharded).
PRIVATE_ENGINE_ATTRS = ("enable_backward_allreduce", "zero_grad", "allreduce_gradients", "_config",
                        # agree_before_broadcast: the start's broadcast it asks before and what it reads there.
                        "_broadcast_model", "seq_data_parallel_group", "dist_backend", "has_moe_layers")
# ZeRO-1/2's reduction, which an nshard reducer silences (allreduce_bucket's stand-in uses flatten).
PRIVATE_ZERO_ATTRS = ("gradient_reduction_w_predivide", "allreduce_bucket", "reduce_scatter", "overlap_comm", "flatten")
# ZeRO-1/2's owned gradient partition, which the ingest seam's ZeroPartitionWriter fills directly.
PRIVATE_ZERO_PARTITION_ATTRS = ("params_in_partition", "partition_size", "real_dp_process_group", "get_param_id",
                                "grad_start_offset", "grad_partition_insertion_offset", "averaged_gradients",
                                "_build_compact_grad_partition_buffer")
# Module-wide symbols: the all-gather that ends a partitioned step (replaced on gloo), the comms logger's dict.
PRIVATE_MODULE_SYMBOLS = {"deepspeed.runtime.utils": ("all_gather_dp_groups", "get_weight_norm", "get_global_norm",
                                                     "is_invalid_grad_norm"),
                          "deepspeed.runtime.zero.stage_1_and_2": ("all_gather_dp_groups",),
                          "deepspeed.runtime.bf16_optimizer": ("all_gather_dp_groups",),
                          "deepspeed.runtime.fp16.unfused_optimizer": ("FP16_UnfusedOptimizer",),
                          "deepspeed.moe.utils": ("is_moe_param",),
                          "deepspeed.comm": ("comms_logger", "isend", "all_reduce")}
PRIVATE_COMMS_LOGGER_ATTRS = ("enabled", "prof_all", "comms_dict")
# What optimizer_memory descends through: DeepSpeed's wrappers keep the torch optimizer at `.optimizer`.
PRIVATE_WRAPPER_ATTRS = ("optimizer",)
# Delta parameter sync: each flat group's fp32 master partition and replica partitions, the per-group step after
# which ZeRO copies the master into this rank's replica, and the parameters of each group.
PRIVATE_DELTA_ZERO_ATTRS = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "_optimizer_step",
                            "bit16_groups")
# bf16 at stage 0 (FP16_UnfusedOptimizer in bf16 mode): its groups of bf16 parameters and fp32 masters, and the
# pieces of its step that the flat step calls instead of its per-parameter walk (install_flat_master_step).
PRIVATE_UNFUSED_ATTRS = ("fp16_groups", "fp32_groups", "low_precision_dtype", "fused_lamb_legacy", "mpu", "overflow",
                         "_global_grad_norm", "_update_scale", "_skip_invalid_grad_norm", "unscale_and_clip_grads",
                         "step")
# DeepSpeed's own stage-0 reduction at world size 1, which skip_one_rank_reduction replaces when it is the identity.
PRIVATE_ONE_RANK_ATTRS = ("gradient_average", "communication_data_type", "has_moe_layers", "pipeline_parallelism",
                          "sequence_parallel_size", "gradient_predivide_factor", "zero_optimization_partition_gradients")
LISTED_ATTRS = frozenset(ENGINE_API + OPTIMIZER_API + PRIVATE_ENGINE_ATTRS + PRIVATE_ZERO_ATTRS
                         + PRIVATE_ZERO_PARTITION_ATTRS + PRIVATE_WRAPPER_ATTRS + PRIVATE_DELTA_ZERO_ATTRS
                         + PRIVATE_UNFUSED_ATTRS + PRIVATE_ONE_RANK_ATTRS)


class DeepSpeedAPIMoved(RuntimeError):
    """A DeepSpeed upgrade moved a private attribute nshard's reducer seam depends on."""


# ---------------------------------------------------------------- the guard


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def guard(engine) -> None:
    """Check every listed symbol this engine's patches and readers rely on; raise DeepSpeedAPIMoved naming
    the missing ones. Outside the verified versions a complete set is allowed, with one warning."""
    import deepspeed

    missing = [f"{name}.{attr}" for name, attrs in PRIVATE_MODULE_SYMBOLS.items()
               for attr in attrs if not hasattr(importlib.import_module(name), attr)]
    import deepspeed.comm as ds_comm

    logger = getattr(ds_comm, "comms_logger", None)
    missing += [f"deepspeed.comm.comms_logger.{a}" for a in PRIVATE_COMMS_LOGGER_ATTRS if not hasattr(logger, a)]
    missing += [f"engine.{a}" for a in ENGINE_API + PRIVATE_ENGINE_ATTRS + PRIVATE_ONE_RANK_ATTRS
                if not hasattr(engine, a)]
    missing += [f"optimizer.{a}" for a in OPTIMIZER_API if not hasattr(engine.optimizer, a)]
    if engine.zero_optimization_stage() in (1, 2):
        missing += [f"optimizer.{a}" for a in PRIVATE_ZERO_ATTRS + PRIVATE_ZERO_PARTITION_ATTRS
                    if not hasattr(engine.optimizer, a)]
    if _unfused(engine.optimizer):
        missing += [f"optimizer.{a}" for a in PRIVATE_UNFUSED_ATTRS if not hasattr(engine.optimizer, a)]
    lowest, beyond = VERIFIED_VERSIONS
    if missing:
        raise DeepSpeedAPIMoved(f"deepspeed {deepspeed.__version__} lacks {missing}, which nshard's reducer seam "
                                "replaces (verified on 0.19.8); pin deepspeed>=0.19.8,<0.20 or port "
                                "nshard/seam/patches.py")
    if not lowest <= _version(deepspeed.__version__) < beyond:
        log.warning("deepspeed %s is outside the verified >=0.19.8,<0.20; every private symbol "
                    "nshard/seam/patches.py lists is present, but their behaviour is unverified", deepspeed.__version__)


# ---------------------------------------------------------------- patches


GRAD_COUNT = {"calls": 0, "bytes_sent": 0}
"""DeepSpeed's own gradient collectives (GRAD_OPS) as nshard counts them, on every backend: the receipts' source for
DeepSpeed's gradient bytes where its comms logger is off (a GPU, by default: comms_logger_config)."""
_GRAD_TENSOR_ARG = {"all_reduce": (0, "tensor"), "reduce": (0, "tensor"), "reduce_scatter_tensor": (1, "tensor"),
                    "reduce_scatter": (1, "input_list"), "all_reduce_coalesced": (0, "tensors")}
"""Where each GRAD_OPS collective takes the tensor it sends (position, keyword), as DeepSpeed's logger sizes it."""
_NSHARD_LOG_NAMES = (REDUCER_LOG_NAME, PARAMETER_GATHER_LOG_NAME, DELTA_SYNC_LOG_NAME)


def install_grad_count() -> None:
    """Count the bytes of every deepspeed.comm gradient collective (its engine and ZeRO call them through the module,
    so the switch reaches them) that is not one of nshard's own, whether or not DeepSpeed's logger runs. Idempotent."""
    import deepspeed.comm as ds_comm

    assert set(_GRAD_TENSOR_ARG) == set(GRAD_OPS)
    for op, (position, keyword) in _GRAD_TENSOR_ARG.items():
        original = getattr(ds_comm, op, None)
        if original is None or getattr(original, "_nshard_counted", False):
            continue

        def counted(*args, _original=original, _position=position, _keyword=keyword, **kwargs):
            if kwargs.get("log_name") not in _NSHARD_LOG_NAMES:
                sent = args[_position] if len(args) > _position else kwargs.get(_keyword)
                GRAD_COUNT["calls"] += 1
                GRAD_COUNT["bytes_sent"] += _message_bytes(sent)
            with COLLECTIVE:  # timed too (nshard/phases.py): until it returns, or on CUDA until the device is done
                return _original(*args, **kwargs)

        counted._nshard_counted = True
        setattr(ds_comm, op, counted)


INITIAL_BROADCAST: dict = {}
"""What the engine's start did about rank 0's parameters (agree_before_broadcast), for the receipts."""
_BROADCAST = {"agree": True}


def agree_before_broadcast(agree: bool = True) -> None:
    """DeepSpeed's engine starts by broadcasting every parameter from rank 0 (DeepSpeedEngine._broadcast_model): a
    whole model copy over the link at every start (270 MB in bf16 for SmolLM2-135M, 3.4 GB for 1.7B), though every
    nshard rank loads the same checked files and seeds alike. Ask first: each rank hashes its parameters
    (receipts.parameter_root: names, dtypes, shapes and bytes), rank 0's 32-byte digest is broadcast the way DeepSpeed
    broadcasts a parameter, and the broadcast runs only when some rank's digest differs (then as DeepSpeed runs it).
    The SHA-256 of the bytes, even on a GPU (each parameter copied to the host to hash: seconds for 1.7B), not the
    replica check's on-device fingerprint (state.replica_fingerprint): its sums of words are blind to a transposed
    square weight, a plausible way for one host to load other weights.
    agree=False (NSHARD_INITIAL_BROADCAST=deepspeed, read by engine.build_engine) always broadcasts. Idempotent: a
    later call only sets `agree` for the engines built after it."""
    _BROADCAST["agree"] = agree
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = getattr(DeepSpeedEngine, "_broadcast_model", None)
    if original is None:
        raise DeepSpeedAPIMoved("deepspeed's DeepSpeedEngine lacks _broadcast_model, which nshard asks before (verified "
                                "on 0.19.8); pin deepspeed>=0.19.8,<0.20 or port nshard/seam/patches.py")
    if getattr(original, "_nshard_agreeing", False):
        return

    def agreeing(engine):
        import deepspeed.comm as ds_comm
        from deepspeed.utils import groups

        from nshard.run.receipts import parameter_root

        group = engine.seq_data_parallel_group
        if (engine.dist_backend is None or engine.has_moe_layers or ds_comm.get_world_size(group=group) == 1
                or not _BROADCAST["agree"]):
            _record(ran=engine.dist_backend is not None, why="DeepSpeed's own")
            return original(engine)
        params = list(engine.module.named_parameters())
        mine = bytes.fromhex(parameter_root(params))
        device = params[0][1].device if params else engine.device
        digest = torch.tensor(list(mine), dtype=torch.uint8, device=device)
        ds_comm.broadcast(digest, groups._get_broadcast_src_rank(), group=group)
        differs = torch.tensor([int(bytes(digest.cpu().tolist()) != mine)], dtype=torch.int32, device=device)
        ds_comm.all_reduce(differs, op=ds_comm.ReduceOp.MAX, group=group)
        if differs.item():
            _record(ran=True, why="some rank's parameters differ from rank 0's")
            return original(engine)
        _record(ran=False, why="every rank holds rank 0's parameters", sha256=mine.hex())

    def _record(**fields):
        INITIAL_BROADCAST.clear()
        INITIAL_BROADCAST.update(fields)

    agreeing._nshard_agreeing = True
    DeepSpeedEngine._broadcast_model = agreeing


def time_deepspeed_reduction(engine) -> None:
    """Under DeepSpeed's own reduction, its backward's reduction epilogue (engine.allreduce_gradients: the bucketing,
    averaging and copies around its all-reduce) is the update's reducer_compute (nshard/phases.py); its collectives
    stay collective_wait. Under an nshard reducer it is switched off or does nothing, and costs nothing."""
    original = engine.allreduce_gradients
    reduction = phase("reducer_compute")

    def timed_allreduce_gradients(*args, **kwargs):
        with reduction:
            return original(*args, **kwargs)

    engine.allreduce_gradients = timed_allreduce_gradients


def _message_bytes(sent) -> int:
    if sent is None:
        return 0
    tensors = sent if isinstance(sent, (list, tuple)) else [sent]
    return sum(t.numel() * t.element_size() for t in tensors)


def keep_clip_norm(engine, keep) -> None:
    """fp32 stage 0 with gradient_clipping: engine.clip_fp32_gradients as DeepSpeed 0.19.8 defines it (its
    clip_grad_norm_ over the module's parameters, the same arguments), handing the norm it clips by, which DeepSpeed
    drops, to keep(norm) (a device tensor, read after the update)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_keeping_the_norm():
        keep(clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                             mpu=engine.mpu))

    engine.clip_fp32_gradients = clip_keeping_the_norm


def keep_gradients_in_place(engine) -> None:
    """DeepSpeed's stage-0 zero_grad sets .grad to None; keep the buffers and zero them, so every parameter
    has a gradient (zero if unused) in every update and nothing is reallocated."""
    engine.zero_grad = lambda: _zero_grads_in_place(engine.module)


def _zero_grads_in_place(module: torch.nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


def skip_one_rank_reduction(engine) -> bool:
    """DeepSpeed's own stage-0 reduction on a world of one rank: its epilogue (engine.allreduce_gradients) flattens
    every gradient, all-reduces it with itself, divides it by 1 and copies it back, which leaves every value as it
    was. Where that holds exactly, it is replaced by the one thing it does that matters: a parameter without a
    gradient gets a zero one (DeepSpeed's _get_gradients_for_reduction), so AdamW steps the same parameters.
    Exactly: averaging (gradient_average) with predivide factor 1, a communication dtype that holds the gradients'
    (fp32, or theirs), no MoE, pipeline or sequence parallelism; an update with a sparse gradient runs DeepSpeed's
    own. Returns whether it was replaced (elsewhere DeepSpeed's own runs, as with more ranks)."""
    import torch.distributed as dist

    if (dist.get_world_size() != 1 or engine.zero_optimization_stage() != 0 or not engine.gradient_average
            or engine.gradient_predivide_factor() != 1.0 or engine.has_moe_layers or engine.pipeline_parallelism
            or engine.sequence_parallel_size != 1 or engine.zero_optimization_partition_gradients()):
        return False
    dtypes = {p.dtype for p in engine.module.parameters() if p.requires_grad}
    if engine.communication_data_type not in (torch.float32, *dtypes) or len(dtypes) != 1:
        return False
    original = engine.allreduce_gradients

    def zero_missing_gradients(*args, **kwargs):
        params = [p for p in engine.module.parameters() if p.requires_grad and p.numel()]
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            return original(*args, **kwargs)
        if not engine.is_gradient_accumulation_boundary():  # DeepSpeed's own touches nothing before the boundary
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)

    engine.allreduce_gradients = zero_missing_gradients
    return True


def _unfused(optimizer) -> bool:
    """Whether `optimizer` is DeepSpeed's FP16_UnfusedOptimizer (False where the class moved: the guard names it)."""
    wrapper = getattr(importlib.import_module("deepspeed.runtime.fp16.unfused_optimizer"), "FP16_UnfusedOptimizer", None)
    return wrapper is not None and isinstance(optimizer, wrapper)


def flat_master_order(engine) -> list[torch.Tensor] | None:
    """The module parameters in the order DeepSpeed's FP16_UnfusedOptimizer in bf16 mode steps their fp32 masters
    (bf16 at stage 0 with torch's AdamW), for install_flat_master_step; None where another wrapper steps them, or
    where its per-parameter step does more than the flat step reproduces (MoE parameters, whose norm it leaves out;
    its legacy fused LAMB)."""
    from deepspeed.moe.utils import is_moe_param

    wrapper = engine.optimizer
    if not _unfused(wrapper) or wrapper.low_precision_dtype != torch.bfloat16 or wrapper.fused_lamb_legacy:
        return None
    params = [p for group in wrapper.fp16_groups for p in group]
    return None if any(is_moe_param(p) for p in params) else params


def install_flat_master_step(engine, grads: dict[int, torch.Tensor], flat: torch.Tensor) -> None:
    """bf16 at stage 0: DeepSpeed's FP16_UnfusedOptimizer steps its fp32 masters from fp32 gradients that nshard's
    ingest seam writes once per update into one flat buffer (`flat`; `grads`: id(module parameter) -> its fp32 view,
    already rounded to bf16 values, as the bf16 .grad it stood for), instead of walking the parameters one by one:
    no bf16 .grad, no fp32 copy of it made per update, no overflow pass.

    Each master's .grad is its view, for good. The step is DeepSpeed's arithmetic on the same values: its
    get_weight_norm of each group's gradients (fp32, so its .float() copies nothing) and get_global_norm (a
    non-finite gradient makes the norm invalid, which its overflow check would have caught first: the step is
    skipped alike), its clip factor (unscale_and_clip_grads with apply_scale=False), applied to the flat buffer in
    one multiply (skipped when the factor is 1: x * 1 is x), torch's AdamW over the masters as before, then one
    copy of the masters into the bf16 parameters. Every rank holds the same reduced gradients, so the overflow
    flag DeepSpeed all-reduced is the same everywhere and is not sent. The masters, moments and bf16 weights come
    out bit for bit as from DeepSpeed's own step (tests/test_bf16_step.py)."""
    from deepspeed.runtime.utils import get_global_norm, get_weight_norm, is_invalid_grad_norm

    wrapper = engine.optimizer
    masters = [m for group in wrapper.fp32_groups for m in group]
    params = [p for group in wrapper.fp16_groups for p in group]
    group_views = [[grads[id(p)] for p in group] for group in wrapper.fp16_groups]

    def attach() -> None:
        for p, master in zip(params, masters):
            master.grad = grads[id(p)]

    def flat_step(closure=None):
        norms = [get_weight_norm(views, mpu=wrapper.mpu) if views else 0.0 for views in group_views]
        wrapper._global_grad_norm = get_global_norm(norm_list=norms)
        if is_invalid_grad_norm(wrapper._global_grad_norm):
            overflow = wrapper._skip_invalid_grad_norm()  # drops the masters' gradients: give them back
            attach()
            return overflow
        wrapper.overflow = False
        wrapper._update_scale(False)
        combined_scale = wrapper.unscale_and_clip_grads(wrapper._global_grad_norm, apply_scale=False)
        if combined_scale != 1.0:
            flat.mul_(1.0 / combined_scale)
        wrapper.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        return False

    attach()
    flat_step.nshard_flat = True
    wrapper.step = flat_step


def master_step(engine) -> str | None:
    """For the receipt: how DeepSpeed's bf16 wrapper at stage 0 steps its fp32 masters: "flat" (nshard's one flat
    fp32 gradient buffer, install_flat_master_step) or "per parameter" (its own step); None under other wrappers."""
    if not _unfused(engine.optimizer):
        return None
    return "flat" if getattr(engine.optimizer.step, "nshard_flat", False) else "per parameter"


GATHER_CALLS = {"ring": {"calls": 0, "bytes_sent": 0}, "deepspeed": {"calls": 0, "bytes_sent": 0},
                "delta": {"calls": 0, "bytes_sent": 0}}
"""Calls of the weights' all-gather that actually ran in this process, by path, and the bytes this rank handed to
each (for DeepSpeed's own all-gather: its partitions, the bytes the comms logger would record). nshard's own count,
on every backend: the source of the receipts' parameter bytes (CollectiveCounter)."""
_DEEPSPEED_GATHER = {}  # the module's own all_gather_dp_groups, kept before the first switch


def install_parameter_gather(ring: bool) -> None:
    """DeepSpeed's partitioned optimizers (ZeRO-1/2, BF16_Optimizer) end each step with an all-gather of the
    updated weights (deepspeed.runtime.utils.all_gather_dp_groups, imported into both modules).

    ring=True on gloo: nshard/seam/param_gather.py's ring of isend/irecv straight into the flat weights, instead
    of torch's all_gather_into_tensor, which gloo stages whole (one more copy of the weights per rank at the
    end of every step) and runs ~3x slower. The same bytes land in the same places, so the model is unchanged
    bit for bit. Sends are logged (PARAMETER_GATHER_LOG_NAME), so the receipts count them.
    Otherwise (NCCL, where the all-gather is native, or the reference switch): DeepSpeed's own function, only
    counted. Either way every call is counted in GATHER_CALLS, and the receipt reports what ran, not what was
    installed. The switch is process-wide (one engine per process).
    """
    import torch.distributed as dist
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    for module in (stage_1_and_2, bf16_optimizer):
        original = _DEEPSPEED_GATHER.setdefault(module.__name__, module.all_gather_dp_groups)
        if ring and dist.get_backend() == "gloo":
            module.all_gather_dp_groups = _all_gather_dp_groups_in_place
        else:
            module.all_gather_dp_groups = functools.partial(_counted_deepspeed_gather, original)


def open_ring_lanes(engine) -> None:
    """Every ring of isend/irecv nshard runs on the partitioned optimizer's data-parallel groups (the weights' ring
    all-gather, delta sync, closing the gap) sends each direction of a two-rank ring on its own gloo connection
    (nshard/comm/ring.py). The lanes are made here, at set-up, on every rank in the same order."""
    from nshard.comm.ring import open_second_lane

    groups = getattr(engine.optimizer, "real_dp_process_group", None) or []
    for group in dict.fromkeys(groups):  # distinct, in order
        open_second_lane(group)


def _counted_deepspeed_gather(original, groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs):
    import torch.distributed as dist

    GATHER_CALLS["deepspeed"]["calls"] += 1
    for partitions, group in zip(partitioned_param_groups, dp_process_group):
        if dist.get_world_size(group=group) > 1:  # DeepSpeed skips a group of one
            mine = partitions[dist.get_rank(group=group)]
            GATHER_CALLS["deepspeed"]["bytes_sent"] += mine.numel() * mine.element_size()
    with PARAMETER_SYNC, COLLECTIVE:  # its collectives are deepspeed.comm's all_gather, which nshard does not wrap
        return original(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs)


def _all_gather_dp_groups_in_place(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                                   allgather_bucket_size):
    """deepspeed.runtime.utils.all_gather_dp_groups's signature and effect; the flat buffers are filled through
    their partition views (the last two arguments only size DeepSpeed's own pieces)."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    from nshard.seam.param_gather import ring_all_gather_

    GATHER_CALLS["ring"]["calls"] += 1
    send = functools.partial(ds_comm.isend, log_name=PARAMETER_GATHER_LOG_NAME)
    with PARAMETER_SYNC:  # its ring steps are collective_wait (nshard/comm/ring.py)
        for group_id, partitions in enumerate(partitioned_param_groups):
            GATHER_CALLS["ring"]["bytes_sent"] += ring_all_gather_(partitions, dp_process_group[group_id], isend=send,
                                                                   irecv=dist.irecv)


GATHER_PATHS = {"ring": "isend/irecv ring into the flat weights", "deepspeed": "deepspeed all_gather_dp_groups",
                "delta": "delta parameter sync (quantized master - replica, nshard/comm/delta.py)"}


def parameter_all_gather(engine) -> dict | None:
    """Which all-gather of the updated weights ran in this process, from the counted calls (None: no partitioned
    optimizer). `call` names the path whose calls ran ("none counted" if neither ran: DeepSpeed gathered by a
    path nshard does not see, or no step was taken); `calls` has the counts of both."""
    if not partitioned_optimizer(engine):
        return None
    ran = [path for path, counts in GATHER_CALLS.items() if counts["calls"]]
    call = " and ".join(GATHER_PATHS[p] for p in ran) if ran else "none counted"
    from nshard.comm.ring import lanes_opened

    body = {"call": call, "calls": {p: dict(c) for p, c in GATHER_CALLS.items()},
            "ring_connections": "one per direction" if lanes_opened() else "one per pair of ranks"}
    if "ring" in ran:
        body["log_name"] = PARAMETER_GATHER_LOG_NAME
    if "delta" in ran:
        body["delta_codec"] = dict(DELTA_SYNC["codec"])
        body["delta_transport"] = DELTA_SYNC["transport"]
        if DELTA_SYNC["transport"] == "ring":  # batch_isend_irecv is not logged: nshard's count is the only one
            body["delta_log_name"] = DELTA_SYNC_LOG_NAME
    return body


def partitioned_optimizer(engine) -> bool:
    """Whether DeepSpeed steps a partitioned optimizer here: ZeRO-1/2, or a BF16_Optimizer. (bf16 at stage 0 with
    torch's AdamW gets FP16_UnfusedOptimizer in bf16 mode, which keeps whole fp32 masters and gathers nothing.)"""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return engine.zero_optimization_stage() in (1, 2) or isinstance(engine.optimizer, BF16_Optimizer)


def optimizer_classes(engine) -> dict[str, str]:
    """For the receipt: the torch optimizer DeepSpeed steps and the wrapper it sits in (the same class when none)."""
    return {"basic": type(engine.basic_optimizer).__name__, "wrapper": type(engine.optimizer).__name__}


def silence_deepspeed_reduction(engine) -> None:
    """An nshard reducer reduces the gradients: stage 0 switches DeepSpeed's all-reduce off; ZeRO-1/2 (where
    switching the flag off breaks the norm: KeyError) take their own partition of a gradient every rank
    already holds, sending nothing."""
    if engine.zero_optimization_stage() in (1, 2):
        _silence_zero_reduction(engine.optimizer)
    else:
        engine.enable_backward_allreduce = False


def _keep_local_bucket(tensor, communication_data_type):
    """Stands in for ZeRO's gradient_reduction_w_predivide: the bucket already holds the reduced gradient."""
    return tensor if tensor.dtype == communication_data_type else tensor.to(communication_data_type)


def _silence_zero_reduction(optimizer) -> None:
    from nshard.seam.ds_config import DsConfigError

    if optimizer.reduce_scatter or optimizer.overlap_comm:
        raise DsConfigError("an nshard reducer under ZeRO-1/2 needs zero_optimization.reduce_scatter=false and "
                            "overlap_comm=false (DeepSpeed's reduce-scatter path does its own reduction)")
    optimizer.gradient_reduction_w_predivide = _keep_local_bucket
    optimizer.allreduce_bucket = lambda bucket, communication_data_type, *args, **kwargs: _keep_local_bucket(
        optimizer.flatten(bucket), communication_data_type)


# ---------------------------------------------------------------- ZeRO-1/2's gradient partition


def zero_owned_slices(optimizer) -> dict[int, tuple[int, int, int, int]]:
    """id(param) -> (group, source, destination, count): the part of each parameter's gradient this rank owns,
    at the offsets ZeRO computed at construction (what its own reduction epilogue copies)."""
    import deepspeed.comm as ds_comm

    slices: dict[int, tuple[int, int, int, int]] = {}
    for group, params in enumerate(optimizer.params_in_partition):
        me = ds_comm.get_rank(group=optimizer.real_dp_process_group[group])
        size = int(optimizer.partition_size[group])
        for param in params:
            pid = optimizer.get_param_id(param)
            source = int(optimizer.grad_start_offset[group][me][pid])
            destination = int(optimizer.grad_partition_insertion_offset[group][me][pid])
            count = min(param.numel() - source, size - destination)
            if count > 0:
                slices[id(param)] = (group, source, destination, count)
    return slices


def fresh_zero_partitions(optimizer) -> tuple[list, list[torch.Tensor]]:
    """Fresh zeroed compact partitions, one per group (ZeRO's own buffer, as its fp32 epilogue builds it), and
    their flat tensors."""
    buffers = [optimizer._build_compact_grad_partition_buffer(group)
               for group in range(len(optimizer.params_in_partition))]
    return buffers, [buffer.flat_partition for buffer in buffers]


def hand_zero_partitions(optimizer, buffers: list) -> None:
    """What ZeRO's step() reads: averaged_gradients[i] (it releases them, so they do not outlive the update)."""
    for group, buffer in enumerate(buffers):
        optimizer.averaged_gradients[group] = buffer


# ---------------------------------------------------------------- readers


def optimizer_memory(engine) -> dict[str, int]:
    """This rank's optimizer memory, measured on the innermost torch optimizer (under DeepSpeed's ZeRO,
    bf16 and fp16 wrappers, which keep it at `.optimizer`).

    optimizer_state_bytes: every tensor in its `state` (AdamW's exp_avg, exp_avg_sq, step); under
    ZeRO-1/2 that is this rank's partition. master_param_bytes: the tensors it steps that share no
    storage with the module's parameters (ZeRO's single_partition_of_fp32_groups, a bf16/fp16
    optimizer's fp32 masters); 0 when it steps the module's own fp32 parameters (stage 0).
    """
    inner = engine.optimizer
    for _ in range(4):  # a wrapper of a wrapper at most; bounded so a changed layout fails, not loops
        if isinstance(inner, torch.optim.Optimizer):
            break
        inner = getattr(inner, "optimizer", None)
    else:
        inner = None
    if inner is None:
        raise DeepSpeedAPIMoved(f"no torch optimizer under {type(engine.optimizer).__name__}.optimizer; "
                                "port nshard/seam/patches.py:optimizer_memory")
    nbytes = lambda t: t.numel() * t.element_size()
    state = sum(nbytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
    module_storage = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    masters = sum(nbytes(p) for g in inner.param_groups for p in g["params"]
                  if p.untyped_storage().data_ptr() not in module_storage)
    return {"optimizer_state_bytes": state, "master_param_bytes": masters}


LOGGER_BLOCK_NSHARD_SETS = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
COMMS_LOGGER = {"asked": None, "device_syncs": None}
"""How this process's ds_config came by its comms_logger block (see comms_logger_config)."""


def device_syncs_per_collective() -> bool:
    """Whether DeepSpeed's comms logger, when enabled, waits for the device after every collective: it calls
    get_accelerator().synchronize(), which DeepSpeed's CPU accelerator makes a no-op and every GPU's makes a wait."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu"


def comms_logger_config(config: dict, device_syncs: bool) -> dict:
    """The ds_config with nshard's comms_logger rule applied, in place.

    DeepSpeed's comms logger, when enabled, synchronizes the device after every collective it wraps (its own and
    nshard's), inside every timed update. nshard enables it for its byte counts only where that costs nothing
    (device_syncs False: DeepSpeed's CPU accelerator). On a GPU it stays off unless the ds_config asks for it
    (comms_logger.enabled true: kept as written); the receipts' `comms_logger` says which happened. DeepSpeed
    switches the logger on for any comms_logger block, `"enabled": false` included, so such a block is dropped:
    it asks for the logger to be off, and off it stays, on the CPU too."""
    block = config.get("comms_logger")
    asked = bool(block.get("enabled", False)) if isinstance(block, dict) else block is not None
    COMMS_LOGGER.update(asked=asked, device_syncs=device_syncs)
    if block is not None and not asked:
        del config["comms_logger"]
    elif block is None and not device_syncs:
        config["comms_logger"] = dict(LOGGER_BLOCK_NSHARD_SETS)
    return config


def comms_logged() -> bool:
    """Whether DeepSpeed's comms logger counted this run's collectives (a ds_config may switch it off)."""
    import deepspeed.comm as dist

    return bool(dist.comms_logger.enabled and dist.comms_logger.prof_all)


def comms_logger_receipt() -> dict:
    """For the receipt: whether DeepSpeed's comms logger ran, who asked for it, and whether it synchronized the
    device after every collective (inside the timed updates)."""
    import deepspeed.comm as dist

    enabled = bool(dist.comms_logger.enabled)
    asked = COMMS_LOGGER["asked"]
    return {"enabled": enabled, "counted": comms_logged(),
            "set_by": "ds_config" if asked else "nshard" if enabled else None,
            "device_sync_per_collective": enabled and bool(COMMS_LOGGER["device_syncs"])}


class CollectiveCounter:
    """Bytes this rank handed to collectives since the last call, split gradient/parameter.

    `deepspeed_grad_bytes` comes from DeepSpeed's comms logger, or from nshard's own count (GRAD_COUNT) when the
    logger is off; `logged_reducer_bytes` from the logger (None when it is off). `other_bytes` (the weights' all-gather and the rest) takes nshard's own count (GATHER_CALLS) for every
    all-gather nshard runs: its ring, delta sync on either transport (batch_isend_irecv, as on NCCL, bypasses the
    logger) and, with the logger off, DeepSpeed's own all-gather; the logger adds the rest. `delta_bytes` is
    nshard's count of delta sync's bytes, `logged_delta_bytes` the logger's where it sees them (else None)."""

    def __init__(self):
        self._seen: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        self._grad = GRAD_COUNT["bytes_sent"]

    def _logged(self) -> dict[str, int]:
        import deepspeed.comm as dist

        totals = {name: sum(size * rec[0] for size, rec in by_size.items())
                  for name, by_size in dist.comms_logger.comms_dict.items()}
        delta = {k: v - self._seen.get(k, 0) for k, v in totals.items() if v != self._seen.get(k, 0)}
        self._seen = totals
        return delta

    def _counted(self) -> dict[str, int]:
        sent = {path: counts["bytes_sent"] for path, counts in GATHER_CALLS.items()}
        delta = {path: sent[path] - self._sent.get(path, 0) for path in sent}
        self._sent = sent
        return delta

    def take(self) -> dict:
        logged, counted, on = self._logged(), self._counted(), comms_logged()
        grad_counted, self._grad = GRAD_COUNT["bytes_sent"] - self._grad, GRAD_COUNT["bytes_sent"]
        grad_logged = sum(v for k, v in logged.items() if k in GRAD_OPS)
        grad = grad_logged if on else grad_counted
        reducer = logged.get(REDUCER_LOG_NAME, 0)
        # The logger's records of nshard's own sends are replaced by nshard's count of them.
        nshard_logged = logged.get(PARAMETER_GATHER_LOG_NAME, 0) + logged.get(DELTA_SYNC_LOG_NAME, 0)
        rest = sum(logged.values()) - grad_logged - reducer - nshard_logged  # what else the logger saw
        other = rest + counted["ring"] + counted["delta"] + (0 if on else counted["deepspeed"])
        delta_logged = on and DELTA_SYNC["transport"] == "ring"
        return {"deepspeed_grad_bytes": grad, "logged_reducer_bytes": reducer if on else None,
                "other_bytes": other, "delta_bytes": counted["delta"],
                "logged_delta_bytes": logged.get(DELTA_SYNC_LOG_NAME, 0) if delta_logged else None}


# ---------------------------------------------------------------- delta parameter sync


DELTA_SYNC = {"codec": {}, "transport": None, "gap_max": None, "swapped": {}}
"""This process's delta sync: its codec and transport, the largest master − replica gap since take_delta_gap() (a
device tensor, read once per update), and the masters set aside while ZeRO's step() copies "master" into the
replica (see install_delta_sync)."""
DELTA_TRANSPORT_VARIABLE = "NSHARD_DELTA_TRANSPORT"
DELTA_TRANSPORTS = {"ring": "isend/irecv ring (DeepSpeed's comms logger sees it); the gap closed by a ring all-gather",
                    "batched": "batch_isend_irecv; the gap closed by all_gather (NCCL's path; gloo runs it too)"}


def delta_transport(backend: str) -> str:
    """How delta sync moves its partitions: NSHARD_DELTA_TRANSPORT (ring or batched), else ring on gloo and batched
    elsewhere. Setting it to batched on gloo runs NCCL's code on CPU tensors (how the suite covers it)."""
    value = os.environ.get(DELTA_TRANSPORT_VARIABLE) or ("ring" if backend == "gloo" else "batched")
    if value not in DELTA_TRANSPORTS:
        raise ValueError(f"{DELTA_TRANSPORT_VARIABLE}={value!r}: set it to ring or batched (or unset it: ring on "
                         "gloo, batched otherwise)")
    if value == "ring" and backend != "gloo":
        raise ValueError(f"{DELTA_TRANSPORT_VARIABLE}=ring needs the gloo backend ({backend} can deadlock a lone "
                         "isend before its irecv); unset it or set it to batched")
    return value


def install_delta_sync(engine, codec) -> None:
    """Replace the end of every ZeRO-1/2 step by nshard/comm/delta.py's delta_sync_: the owner's master stays exact
    AdamW, every rank adds the same quantized master − replica to its replica of each partition.

    DeepSpeed's ZeRO optimizer (the one an nshard reducer runs under at stage 1 or 2, fp32 or bf16) steps each flat
    group in _optimizer_step(i), then copies the fp32 master into this rank's replica partition, then all-gathers.
    The copy would close the gap that is the error memory, so the wrapped _optimizer_step syncs group i and points
    single_partition_of_fp32_groups[i] at this rank's replica for the rest of step(): the copy becomes a copy of the
    replica onto itself, and the all-gather that follows (module-wide, replaced here) puts the masters back and
    sends nothing more. A call of that all-gather with no sync before it is a load that would set replica := master
    (update_lp_params after a universal checkpoint, refused in the ds_config too): it is refused here as well.
    """
    import dataclasses

    import torch.distributed as dist
    from deepspeed.runtime.zero import stage_1_and_2

    optimizer = engine.optimizer
    missing = [f"optimizer.{a}" for a in PRIVATE_DELTA_ZERO_ATTRS + ("real_dp_process_group",) if not hasattr(optimizer, a)]
    if missing or engine.zero_optimization_stage() not in (1, 2):
        raise DeepSpeedAPIMoved(f"delta parameter sync needs ZeRO-1/2's masters and replicas; {type(optimizer).__name__} "
                                f"lacks {missing}; port nshard/seam/patches.py:install_delta_sync")
    DELTA_SYNC["codec"] = dataclasses.asdict(codec)
    DELTA_SYNC["transport"] = delta_transport(dist.get_backend())
    exchange = _delta_exchange(DELTA_SYNC["transport"])
    original_step = optimizer._optimizer_step

    def step_group(i: int) -> None:
        original_step(i)
        masters, replicas = optimizer.single_partition_of_fp32_groups, optimizer.parallel_partitioned_bit16_groups
        # What step() does next, done here: after the swap its `.grad = None` would reach the replica instead, and
        # the master would keep the gradient partition alive into the next update.
        masters[i].grad = None
        with PARAMETER_SYNC:  # encode and apply; the exchange is collective_wait
            me = _sync_group(optimizer, codec, exchange, masters, replicas, i)
        DELTA_SYNC["swapped"][i] = masters[i]
        masters[i] = replicas[i][me]

    optimizer._optimizer_step = step_group
    stage_1_and_2.all_gather_dp_groups = functools.partial(_after_delta_sync, optimizer)


def _delta_exchange(transport: str):
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    from nshard.comm.delta import exchange_batched, exchange_isend_irecv

    if transport == "ring":  # logged too, so the logger's count checks nshard's (CollectiveCounter)
        return exchange_isend_irecv(functools.partial(ds_comm.isend, log_name=DELTA_SYNC_LOG_NAME), dist.irecv)
    return exchange_batched


def _sync_group(optimizer, codec, exchange, masters, replicas, i: int) -> int:
    import deepspeed.comm as ds_comm

    from nshard.comm.delta import delta_sync_, gap_max_

    group = optimizer.real_dp_process_group[i]
    me = ds_comm.get_rank(group=group)
    sent = delta_sync_(codec, masters[i], replicas[i], group, exchange)
    GATHER_CALLS["delta"]["calls"] += 1
    GATHER_CALLS["delta"]["bytes_sent"] += sent
    if DELTA_SYNC["gap_max"] is None:
        DELTA_SYNC["gap_max"] = torch.zeros((), dtype=torch.float32, device=masters[i].device)
    gap_max_(DELTA_SYNC["gap_max"], masters[i], replicas[i][me])  # on the device: read once per update
    return me


def _after_delta_sync(optimizer, *args, **kwargs) -> None:
    """Stands in for all_gather_dp_groups under delta sync: every group was synced by its step; put its master back."""
    swapped = DELTA_SYNC["swapped"]
    if not swapped:
        raise RuntimeError("an all-gather of the updated weights with no delta sync before it: something (a universal "
                           "checkpoint load, update_lp_params) would set every replica to its master and lose the "
                           "error memory; with nshard.parameter_sync=\"delta\" resume from nshard's complete state")
    for i, master in swapped.items():
        optimizer.single_partition_of_fp32_groups[i] = master
    swapped.clear()


def take_delta_gap(device) -> torch.Tensor:
    """The largest |master − replica| on this rank since the last call, as an fp32 scalar on `device` (0 without
    delta sync); reading it is the update's one wait for the gap."""
    gap, DELTA_SYNC["gap_max"] = DELTA_SYNC["gap_max"], None
    return torch.zeros((), dtype=torch.float32, device=device) if gap is None else gap


@torch.no_grad()
def close_delta_gap(engine, transport: str | None = None) -> None:
    """Every replica := its master, once, in place (a collective: all ranks). The run calls it after its last
    complete state is saved (which keeps the gap), so that the export holds the masters (rounded to the module's
    dtype, as any ZeRO export is) without a second copy of the model on any rank. `transport` as delta sync's
    (default: the one it ran)."""
    import torch.distributed as dist

    optimizer = engine.optimizer
    transport = transport or DELTA_SYNC["transport"] or delta_transport(dist.get_backend())
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        close_gap_(master, optimizer.parallel_partitioned_bit16_groups[i], optimizer.real_dp_process_group[i],
                   transport)


@torch.no_grad()
def close_gap_(master: torch.Tensor, partitions, group, transport: str) -> None:
    """This rank's replica partition := its master (rounded to the replicas' dtype), then every rank's partition
    gathered into every rank's replicas: by the ring of isend/irecv ("ring", gloo), or by all_gather ("batched":
    NCCL's path, which gloo runs on CPU tensors too)."""
    import torch.distributed as dist

    from nshard.seam.param_gather import ring_all_gather_

    if transport not in DELTA_TRANSPORTS:
        raise ValueError(f"transport {transport!r}: use one of {sorted(DELTA_TRANSPORTS)}")
    mine = partitions[dist.get_rank(group=group)]
    mine.copy_(master)
    if transport == "ring":
        ring_all_gather_(partitions, group)
    else:
        dist.all_gather(list(partitions), mine.clone(), group=group)
