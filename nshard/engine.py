"""The one place that imports DeepSpeed: read the ds_config, build the engine, count its collectives,
and put an nshard reducer in place of DeepSpeed's gradient all-reduce.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from nshard.chunked_adamw import CHUNK_ELEMENTS, chunk_steps
from nshard.comm.config import ReducerConfig
from nshard.plan import Plan

# Keys nshard derives from the plan (documents per batch); a ds_config may leave them out or "auto".
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# deepspeed.comm ops that carry gradients (the rest, all_gather & co., carry parameters).
GRAD_OPS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_reduce_coalesced")


class DsConfigError(ValueError):
    """A ds_config that cannot be run; the message names the key and the fix."""


def load_ds_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DsConfigError(f"ds_config {path} does not exist: give --ds_config a file such as ds_configs/dense.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DsConfigError(f"ds_config {path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(config, dict):
        raise DsConfigError(f"ds_config {path}: the top level must be a JSON object")
    validate_ds_config(config)
    return config


def validate_ds_config(config: dict) -> None:
    """Check what nshard relies on before any process group or model exists."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DsConfigError(f"zero_optimization.stage={stage!r}: use 0, 1, 2 or 3")
    opt = config.get("optimizer")
    if opt is None:
        raise DsConfigError("ds_config has no 'optimizer': add {\"type\": \"AdamW\", \"params\": {\"lr\": ...}}")
    if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        raise DsConfigError(f"optimizer.type={opt.get('type')!r}: nshard's study rule is AdamW; use \"AdamW\"")
    if "lr" not in opt.get("params", {}):
        raise DsConfigError("optimizer.params.lr is missing: give a learning rate")
    if not isinstance(opt["params"].get("torch_adam", False), bool):
        raise DsConfigError(f"optimizer.params.torch_adam={opt['params']['torch_adam']!r}: use true (torch's AdamW, "
                            "the shipped configs) or false (DeepSpeed's FusedAdam on CUDA, see docs/gpu.md)")


def reducer_config(config: dict) -> ReducerConfig | None:
    """The "nshard" section, parsed once into the ReducerConfig that the run passes on (None: DeepSpeed's
    own all-reduce), and checked against the rest of the ds_config; each problem is a DsConfigError."""
    if "nshard" not in config:
        return None
    from nshard.comm.config import ConfigError, parse_config

    try:
        parsed = parse_config(config["nshard"])
    except ConfigError as exc:
        raise DsConfigError(" ".join(str(exc).split())) from None
    if config.get("zero_optimization", {}).get("stage", 0) == 3:
        raise DsConfigError("an \"nshard\" section with zero_optimization.stage=3: nshard's reducers run "
                            "at stages 0, 1 and 2; lower the stage or drop the section")
    if config.get("fp16", {}).get("enabled"):
        raise DsConfigError("fp16.enabled with an \"nshard\" section: nshard's reducers take unscaled "
                            "gradients; use bf16 (\"bf16\": {\"enabled\": true}) or fp32")
    if config.get("torch_autocast", {}).get("enabled"):
        raise DsConfigError("torch_autocast.enabled with an \"nshard\" section is not supported "
                            "(the ingest seam calls the module directly); use bf16 or fp32")
    if config.get("managed_gradient_accumulation", True) is not True:
        raise DsConfigError("managed_gradient_accumulation=false with an \"nshard\" section: the reducer "
                            "averages each update's accumulated gradient, which needs DeepSpeed to manage "
                            "accumulation; remove the key or set it to true")
    return parsed


def complete_ds_config(config: dict, plan: Plan, world_size: int) -> dict:
    """Fill the batch keys (and a WarmupDecayLR's total_num_steps) from the plan; conflicting values are errors."""
    from nshard.data import accumulation_steps

    config = copy.deepcopy(config)
    t = plan.train
    gas = accumulation_steps(t.global_batch_docs, world_size, t.microbatch_docs)
    derived = {"train_micro_batch_size_per_gpu": t.microbatch_docs, "gradient_accumulation_steps": gas,
               "train_batch_size": t.microbatch_docs * gas * world_size}
    for key in BATCH_KEYS:
        given = config.get(key, "auto")
        if given not in ("auto", derived[key]):
            raise DsConfigError(f"ds_config {key}={given} conflicts with the plan (which gives {derived[key]} from "
                                "train.global_batch_docs/microbatch_docs); remove it or set it to \"auto\"")
        config[key] = derived[key]
    sched = config.get("scheduler", {}).get("params", {})
    if sched.get("total_num_steps", None) == "auto":
        sched["total_num_steps"] = t.updates
    if "nshard" in config and ingest_mode(config.get("zero_optimization", {}).get("stage", 0), _bf16(config)):
        # DeepSpeed sees one micro-step per update in ingest mode (see nshard/seam.py IngestSeam).
        config["gradient_accumulation_steps"] = 1
        config["train_batch_size"] = t.microbatch_docs * world_size
        zero = config.setdefault("zero_optimization", {})
        for key in ("reduce_scatter", "overlap_comm"):
            if zero.get(key, False):
                raise DsConfigError(f"zero_optimization.{key}=true with an nshard reducer: set it to false "
                                    "(the nshard reducer does the gradient reduction)")
            zero[key] = False
    config.pop("nshard", None)
    return config


def torch_adamw(params, config: dict) -> torch.optim.Optimizer:
    """torch's AdamW from the ds_config optimizer block, with DeepSpeed's defaults (weight decay 0, not torch's 0.01)."""
    p = config["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.0))


TORCH_ADAMW = "torch AdamW"
FUSED_ADAM = "DeepSpeed FusedAdam"


def optimizer_path(config: dict, cuda: bool) -> str:
    """Which AdamW steps the run: torch's (built by nshard, chunked on CPU) on the CPU and wherever the
    ds_config says optimizer.params.torch_adam=true (the shipped configs), so a GPU steps the optimizer the
    CPU tests check; DeepSpeed's FusedAdam (compiled with nvcc at first use) only on CUDA by opting out."""
    return TORCH_ADAMW if not cuda or config["optimizer"].get("params", {}).get("torch_adam", False) else FUSED_ADAM


def check_optimizer_path(config: dict, cuda: bool) -> None:
    """Refuse the optimizer path nshard cannot vouch for: FusedAdam under bf16 at stage 0, where DeepSpeed wraps
    it in its FP16_Optimizer (bf16 mode) instead of the FP16_UnfusedOptimizer that torch's AdamW gets."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if optimizer_path(config, cuda) == FUSED_ADAM and _bf16(config) and stage == 0:
        raise DsConfigError("optimizer.params.torch_adam=false with bf16 at zero_optimization.stage=0: DeepSpeed "
                            "would step FusedAdam inside its FP16_Optimizer, which no nshard test covers; set "
                            "optimizer.params.torch_adam to true (the shipped default) or use stage 1 or 2")


def optimizer_classes(engine) -> dict[str, str]:
    """For the receipt: the torch optimizer DeepSpeed steps and the wrapper it sits in (the same class when none)."""
    return {"basic": type(engine.basic_optimizer).__name__, "wrapper": type(engine.optimizer).__name__}


def build_engine(model: torch.nn.Module, config: dict):
    """deepspeed.initialize with torch's AdamW (no FusedAdam JIT build) unless a CUDA run opted out (optimizer_path)."""
    import deepspeed

    config = copy.deepcopy(config)
    optimizer = None
    if optimizer_path(config, torch.cuda.is_available()) == TORCH_ADAMW:
        optimizer = torch_adamw(model.parameters(), config)
        # The same arithmetic in cache-sized pieces (nshard/chunked_adamw.py); NSHARD_ADAMW_CHUNK sets the
        # piece size in elements, 0 leaves torch's step as it is.
        chunk = int(os.environ.get("NSHARD_ADAMW_CHUNK", CHUNK_ELEMENTS))
        if chunk:
            chunk_steps(optimizer, chunk)
        config.pop("optimizer")
        config.setdefault("zero_allow_untested_optimizer", True)
    # Counting bytes needs the comms logger; leave a user's own setting alone.
    config.setdefault("comms_logger", {"enabled": True, "verbose": False, "prof_all": True, "debug": False})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=None if optimizer else model.parameters())
    if zero_stage(engine) == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        # DeepSpeed's stage-0 zero_grad sets .grad to None; keep the buffers and zero them, so
        # every parameter has a gradient (zero if unused) in every update and nothing is reallocated.
        engine.zero_grad = lambda: _zero_grads_in_place(engine.module)
    if partitioned_optimizer(engine) and reference_switch("NSHARD_PARAMETER_GATHER", ("ring", "deepspeed")) == "ring":
        gather_parameters_in_place()
    return engine


def reference_switch(variable: str, choices: tuple[str, ...]) -> str:
    """The environment's choice between nshard's fast path (choices[0], the default) and the reference path it
    replaced bit for bit (kept so that tests compare the two in one run, on whatever CPU they run on)."""
    value = os.environ.get(variable, choices[0])
    if value not in choices:
        raise ValueError(f"{variable}={value!r}: set it to one of {', '.join(choices)} (or unset it for {choices[0]!r})")
    return value


def partitioned_optimizer(engine) -> bool:
    """Whether DeepSpeed steps a partitioned optimizer here: ZeRO-1/2, or a BF16_Optimizer. (bf16 at stage 0 with
    torch's AdamW gets FP16_UnfusedOptimizer in bf16 mode, which keeps whole fp32 masters and gathers nothing.)"""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return zero_stage(engine) in (1, 2) or isinstance(engine.optimizer, BF16_Optimizer)


def gather_parameters_in_place() -> None:
    """On gloo, DeepSpeed's partitioned optimizers (ZeRO-1/2, BF16_Optimizer) end each step with an
    all-gather of the updated weights through nshard/comm/param_gather.py's ring of isend/irecv straight
    into the flat weights, instead of torch's all_gather_into_tensor, which gloo stages whole (one more copy
    of the weights per rank at the end of every step) and runs ~3x slower. The same bytes land in the same
    places, so the model is unchanged bit for bit. Sends are logged (PARAMETER_GATHER_LOG_NAME), so the
    receipts count them. Where the all-gather is native (NCCL), nothing changes. The switch is process-wide
    (one engine per process); parameter_all_gather reports it.
    """
    import torch.distributed as dist
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    if dist.get_backend() == "gloo":
        for module in (stage_1_and_2, bf16_optimizer):
            module.all_gather_dp_groups = _all_gather_dp_groups_in_place


def _all_gather_dp_groups_in_place(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                                   allgather_bucket_size):
    """deepspeed.runtime.utils.all_gather_dp_groups's signature and effect; the flat buffers are filled through
    their partition views (the last two arguments only size DeepSpeed's own pieces)."""
    import functools

    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    from nshard.comm.param_gather import ring_all_gather_

    send = functools.partial(ds_comm.isend, log_name=PARAMETER_GATHER_LOG_NAME)
    for group_id, partitions in enumerate(partitioned_param_groups):
        ring_all_gather_(partitions, dp_process_group[group_id], isend=send, irecv=dist.irecv)


def parameter_all_gather(engine) -> dict | None:
    """How the partitioned optimizer gathers the updated weights in this process, for the receipt (None: no
    partitioned optimizer)."""
    from deepspeed.runtime.zero import stage_1_and_2

    if not partitioned_optimizer(engine):
        return None
    if stage_1_and_2.all_gather_dp_groups is _all_gather_dp_groups_in_place:
        return {"call": "isend/irecv ring into the flat weights", "log_name": PARAMETER_GATHER_LOG_NAME}
    return {"call": "deepspeed all_gather_dp_groups"}


def _zero_grads_in_place(module: torch.nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


def build_cpu_comm_extension() -> None:
    """Compile (or load) DeepSpeed's CPU shared-memory collective now; otherwise the first
    init_distributed on a machine compiles it (~40 s) inside whichever run comes first."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    ShareMemCommBuilder().load(verbose=False)


def init_distributed() -> None:
    import deepspeed

    from nshard.device import bind_local_gpu, dist_backend

    bind_local_gpu()
    deepspeed.init_distributed(dist_backend=dist_backend(torch.cuda.is_available()))
    _unlink_shm_workspace()


def _unlink_shm_workspace() -> None:
    """Remove the name of DeepSpeed's CPU shared-memory all-reduce workspace (66 MB per rank).

    deepspeed_shm_comm creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> at
    init and never unlinks it: every run on a machine leaked 132 MB of shared memory until the
    machine ran out (measured: 15 GB after a day of test runs). Once every rank has mapped its
    peers' buffers (by the barrier), the names can go; the mappings live on until exit.
    """
    import torch.distributed as dist

    from nshard.launch_env import shm_workspace

    dist.barrier()
    env = os.environ
    shm_workspace(env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""), dist.get_rank()).unlink(missing_ok=True)


def zero_stage(engine) -> int:
    return engine.zero_optimization_stage()


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
                                "port nshard/engine.py:optimizer_memory")
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nbytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
    module_storage = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    masters = sum(nbytes(p) for g in inner.param_groups for p in g["params"]
                  if p.untyped_storage().data_ptr() not in module_storage)
    return {"optimizer_state_bytes": state, "master_param_bytes": masters}


def comms_logged() -> bool:
    """Whether DeepSpeed's comms logger counted this run's collectives (a ds_config may switch it off)."""
    import deepspeed.comm as dist

    return bool(dist.comms_logger.enabled and dist.comms_logger.prof_all)


class CollectiveCounter:
    """Bytes this rank handed to deepspeed.comm collectives since the last call, split gradient/parameter."""

    def __init__(self):
        self._seen: dict[str, int] = {}

    def take(self) -> dict[str, int]:
        import deepspeed.comm as dist

        totals: dict[str, int] = {}
        for name, by_size in dist.comms_logger.comms_dict.items():
            totals[name] = sum(size * rec[0] for size, rec in by_size.items())
        delta = {k: v - self._seen.get(k, 0) for k, v in totals.items() if v != self._seen.get(k, 0)}
        self._seen = totals
        grad = sum(v for k, v in delta.items() if k in GRAD_OPS)
        reducer = delta.get(REDUCER_LOG_NAME, 0)
        return {"deepspeed_grad_bytes": grad, "logged_reducer_bytes": reducer,
                "other_bytes": sum(delta.values()) - grad - reducer}


def full_parameters(engine):
    """A context in which engine.module holds every full parameter (ZeRO-3 gathers them; other stages already do)."""
    import contextlib

    import deepspeed

    if zero_stage(engine) == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


DS_CHECKPOINT_TAG = "deepspeed"
"""DeepSpeed's checkpoint sits in <state dir>/deepspeed/ (nshard/state.py seals the directory around it)."""


def save_checkpoint(engine, directory: Path) -> None:
    """DeepSpeed's own checkpoint: module, optimizer (ZeRO partitions: one file per rank), scheduler, step
    counters. A collective: every rank calls it."""
    engine.save_checkpoint(str(directory), tag=DS_CHECKPOINT_TAG, save_latest=False)


def load_checkpoint(engine, directory: Path) -> None:
    path, _ = engine.load_checkpoint(str(directory), tag=DS_CHECKPOINT_TAG, load_module_strict=True,
                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}/{DS_CHECKPOINT_TAG}")


# ---------------------------------------------------------------- where the gradients are reduced
#
# DeepSpeed has no public hook for replacing its gradient reduction. Everything nshard touches
# that is not public API is named here, and check_private_api() fails loudly if an upgrade moves
# it. Verified on deepspeed 0.19.8 (pyproject pins >=0.19.8,<0.20).
PRIVATE_ENGINE_ATTRS = ("enable_backward_allreduce",)
PRIVATE_ZERO_ATTRS = ("gradient_reduction_w_predivide", "allreduce_bucket", "reduce_scatter", "overlap_comm")
# ZeRO-1/2's owned gradient partition, which ZeroPartitionWriter fills directly.
PRIVATE_ZERO_PARTITION_ATTRS = ("params_in_partition", "partition_size", "real_dp_process_group", "get_param_id",
                                "grad_start_offset", "grad_partition_insertion_offset", "averaged_gradients",
                                "_build_compact_grad_partition_buffer")


class DeepSpeedAPIMoved(RuntimeError):
    """A DeepSpeed upgrade moved a private attribute nshard's reducer seam depends on."""


def check_private_api(engine) -> None:
    import deepspeed

    missing = [a for a in PRIVATE_ENGINE_ATTRS if not hasattr(engine, a)]
    if zero_stage(engine) in (1, 2):
        missing += [f"optimizer.{a}" for a in PRIVATE_ZERO_ATTRS + PRIVATE_ZERO_PARTITION_ATTRS
                    if not hasattr(engine.optimizer, a)]
    if missing:
        raise DeepSpeedAPIMoved(f"deepspeed {deepspeed.__version__} lacks {missing}, which nshard's reducer seam "
                                "replaces (verified on 0.19.8); pin deepspeed>=0.19.8,<0.20 or port nshard/engine.py")


def _keep_local_bucket(tensor, communication_data_type):
    """Stands in for ZeRO's gradient_reduction_w_predivide: the bucket already holds the reduced gradient."""
    return tensor if tensor.dtype == communication_data_type else tensor.to(communication_data_type)


def _silence_zero_reduction(optimizer) -> None:
    """ZeRO-1/2 then take their own partition of a gradient every rank already holds, sending nothing."""
    if optimizer.reduce_scatter or optimizer.overlap_comm:
        raise DsConfigError("an nshard reducer under ZeRO-1/2 needs zero_optimization.reduce_scatter=false and "
                            "overlap_comm=false (DeepSpeed's reduce-scatter path does its own reduction)")
    optimizer.gradient_reduction_w_predivide = _keep_local_bucket
    optimizer.allreduce_bucket = lambda bucket, communication_data_type, *args, **kwargs: _keep_local_bucket(
        optimizer.flatten(bucket), communication_data_type)


class ZeroPartitionWriter:
    """Hands ZeRO-1/2 an already-reduced gradient by writing each parameter's owned slice straight into the
    flat gradient partition its step() reads (averaged_gradients[i], ZeRO's own compact partition buffer:
    what its reduction epilogue builds when it accumulates in fp32), so DeepSpeed's backward, its per-parameter
    hooks, its reduce bucket (4 bytes per parameter) and its copies into the partition are not needed.

    The values are what DeepSpeed's path delivered (the gradient rounded to the parameter's dtype, then held in
    the partition's dtype), at the offsets ZeRO computed at construction, so the step is unchanged bit for bit.
    """

    def __init__(self, optimizer):
        import deepspeed.comm as ds_comm

        self.optimizer = optimizer
        self.slices: dict[int, tuple[int, int, int, int]] = {}  # id(param) -> (group, source, destination, count)
        for group, params in enumerate(optimizer.params_in_partition):
            me = ds_comm.get_rank(group=optimizer.real_dp_process_group[group])
            size = int(optimizer.partition_size[group])
            for param in params:
                pid = optimizer.get_param_id(param)
                source = int(optimizer.grad_start_offset[group][me][pid])
                destination = int(optimizer.grad_partition_insertion_offset[group][me][pid])
                count = min(param.numel() - source, size - destination)
                if count > 0:
                    self.slices[id(param)] = (group, source, destination, count)
        self.buffers = None

    def begin(self) -> None:
        """Fresh zeroed partitions (ZeRO's step releases them, so they do not outlive the update)."""
        self.buffers = [self.optimizer._build_compact_grad_partition_buffer(group)
                        for group in range(len(self.optimizer.params_in_partition))]

    def write(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy the part of `grad` (param's full reduced gradient) that this rank owns; nothing if none."""
        where = self.slices.get(id(param))
        if where is None:
            return
        group, source, destination, count = where
        owned = grad.reshape(-1).narrow(0, source, count).to(param.dtype)
        self.buffers[group].flat_partition.narrow(0, destination, count).copy_(owned)

    def finish(self) -> None:
        for group, buffer in enumerate(self.buffers):
            self.optimizer.averaged_gradients[group] = buffer
        self.buffers = None


def ingest_mode(stage: int, bf16: bool) -> bool:
    """The one rule for where an nshard reducer sits: the ingest seam (nshard/seam.py) at ZeRO-1/2 or
    bf16, in place of the stage-0 all-reduce otherwise. Applied to the ds_config before the engine
    exists (complete_ds_config) and to the engine itself (install_reducer)."""
    return stage in (1, 2) or bf16


def _bf16(config: dict) -> bool:
    return any(bool(config.get(key, {}).get("enabled")) for key in ("bf16", "bfloat16"))  # DeepSpeed takes both


def install_reducer(engine, config: ReducerConfig | None):
    """The gradient reduction chosen by the parsed "nshard" section (None: DeepSpeed's own)."""
    from nshard import seam

    if config is None:
        return seam.DeepSpeedReduction()
    import functools

    import deepspeed.comm as ds_comm

    from nshard.comm import build_reducer

    # Through deepspeed.comm under its own log name, so DeepSpeed's comms logger counts the
    # reducer's traffic apart from DeepSpeed's own gradient collectives.
    all_reduce = functools.partial(ds_comm.all_reduce, log_name=REDUCER_LOG_NAME)
    reducer = build_reducer(config, all_reduce=all_reduce)
    check_private_api(engine)
    if zero_stage(engine) in (1, 2):
        _silence_zero_reduction(engine.optimizer)  # (switching the flag off breaks ZeRO-1/2's norm: KeyError)
    else:
        engine.enable_backward_allreduce = False
    ingest = ingest_mode(zero_stage(engine), engine.bfloat16_enabled())
    if ingest:
        # NSHARD_ZERO_INGEST=hooks hands ZeRO-1/2 the reduced gradient through DeepSpeed's own backward and
        # gradient hooks (HandOver), the path the partition writer replaced bit for bit.
        writer = None
        if zero_stage(engine) in (1, 2) and reference_switch("NSHARD_ZERO_INGEST", ("writer", "hooks")) == "writer":
            writer = ZeroPartitionWriter(engine.optimizer)
        return seam.IngestSeam(engine, reducer, config.reducer, partition_writer=writer,
                               sum_every_microbatch_into_error=
                               config.reducer == "powersgd" and config.microbatch_sums == "error")
    return seam.InPlaceSeam(engine, reducer, config.reducer)


REDUCER_LOG_NAME = "nshard_reducer"
PARAMETER_GATHER_LOG_NAME = "nshard_parameter_gather"
