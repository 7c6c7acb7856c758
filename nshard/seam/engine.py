"""Engine building: deepspeed.initialize with nshard's optimizer and patches, the process group, checkpoints,
full parameters, and the seam that puts an nshard reducer in place of DeepSpeed's gradient all-reduce.
The ds_config rules are nshard/seam/ds_config.py; every private touch point is nshard/seam/patches.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import shutil
from pathlib import Path

import torch

from nshard.comm.config import ReducerConfig, check_device
from nshard.files import note_one_time_work
from nshard.seam import patches
from nshard.seam.chunked_adamw import CHUNK_ELEMENTS, chunk_steps
from nshard.seam.ds_config import (CHECKPOINTING, TORCH_ADAMW, DsConfigError, activation_checkpointing,
                                    check_optimizer_params, ingest_mode, optimizer_implementation,
                                    optimizer_path)


FUSED_RTOL, FUSED_ULPS = 1e-3, 2
"""The fused AdamW's stated tolerance against torch's single-tensor AdamW: both moments bit-identical, and each
step's parameter update within FUSED_RTOL of the reference update (relative) plus FUSED_ULPS ulps of the parameter
(tests/test_fused_adamw.py, launch/bench_adamw.py)."""


def torch_adamw(params, config: dict) -> torch.optim.Optimizer:
    """torch's AdamW from the ds_config optimizer block, with DeepSpeed's defaults (weight decay 0, not torch's 0.01).
    Built from lr, betas, eps and weight_decay: any other param is refused (check_optimizer_params), never dropped.
    optimizer.params.fused (default true) picks torch's fused kernel, which keeps torch's AdamW rule: the moments
    come out bit-identical to the single-tensor step's and each update within a stated tolerance of it
    (tests/test_fused_adamw.py); on 2 CPU cores it steps 135M parameters about 5x faster (launch/bench_adamw.py)."""
    p = config["optimizer"]["params"]
    check_optimizer_params(p)
    return torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.0),
                             **({"fused": True} if p.get("fused", True) else {"foreach": False}))


def adamw_chunk() -> int:
    """NSHARD_ADAMW_CHUNK: the piece size, in elements, of the single-tensor step (fused=false) on the CPU; 0 leaves
    torch's step whole."""
    raw = os.environ.get("NSHARD_ADAMW_CHUNK", str(CHUNK_ELEMENTS))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"NSHARD_ADAMW_CHUNK={raw!r}: give a whole number of elements (a multiple of 64), or 0 "
                         "for torch's own step") from None


def optimizer_record(engine, config: dict) -> dict:
    """For the receipt: the torch optimizer DeepSpeed steps, its wrapper, and the implementation that steps AdamW."""
    return {**patches.optimizer_classes(engine),
            "implementation": optimizer_implementation(config, torch.cuda.is_available(), adamw_chunk()),
            "master_step": patches.master_step(engine)}


def build_engine(model: torch.nn.Module, config: dict):
    """deepspeed.initialize with torch's AdamW (no FusedAdam JIT build) unless a CUDA run opted out (optimizer_path)."""
    import deepspeed

    config = copy.deepcopy(config)
    if activation_checkpointing(config) is not None:
        checkpoint_activations(model)
    optimizer = None
    if optimizer_path(config, torch.cuda.is_available()) == TORCH_ADAMW:
        optimizer = torch_adamw(model.parameters(), config)
        # The single-tensor step (fused=false) in cache-sized pieces (nshard/seam/chunked_adamw.py): the same bits.
        chunk = adamw_chunk()
        if chunk and not optimizer.defaults["fused"]:
            chunk_steps(optimizer, chunk)
        config.pop("optimizer")
        config.setdefault("zero_allow_untested_optimizer", True)
    # DeepSpeed's comms logger counts its own collectives' bytes, but syncs the device after each: on where that is
    # free (the CPU), on a GPU only if the ds_config asks (patches.comms_logger_config); a user's block is kept.
    patches.comms_logger_config(config, patches.device_syncs_per_collective())
    patches.install_grad_count()  # DeepSpeed's gradient bytes, counted with the logger off too
    # Rank 0's parameters go only to ranks that do not hold them already (NSHARD_INITIAL_BROADCAST=deepspeed: to all).
    patches.agree_before_broadcast(reference_switch("NSHARD_INITIAL_BROADCAST", ("agree", "deepspeed")) == "agree")
    use_own_extensions()  # deepspeed.initialize loads its CPU collective (init_distributed) from there
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=None if optimizer else model.parameters())
    patches.guard(engine)  # every private symbol below and in install_reducer, checked before any is touched
    if zero_stage(engine) == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        patches.keep_gradients_in_place(engine)
    if patches.partitioned_optimizer(engine):  # counted either way: the receipt reports the path that ran
        patches.install_parameter_gather(ring=reference_switch("NSHARD_PARAMETER_GATHER", ("ring", "deepspeed")) == "ring")
        patches.open_ring_lanes(engine)
    return engine


def checkpoint_activations(model: torch.nn.Module) -> None:
    """The ds_config's "activation_checkpointing" section: each decoder layer keeps only its input and recomputes
    its forward in backward. Non-reentrant, because the ingest seam (ZeRO-1/2, bf16) backpropagates with
    torch.autograd.grad, which reentrant checkpointing refuses; the recomputation runs in the module's train mode."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise DsConfigError(f"activation_checkpointing: {type(model).__name__} does not support transformers' "
                            "gradient checkpointing; remove the section from the ds_config")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25; the old name warns
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing_record(engine) -> dict | None:
    """What ran, read back from the module for the receipts and run.json: how many decoder layers recompute their
    forward and with which checkpoint kind (None: checkpointing is off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in engine.module.modules()
              if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        return None
    kinds = {getattr(m._gradient_checkpointing_func, "keywords", {}).get("use_reentrant") for m in layers}
    return {"kind": CHECKPOINTING, "use_reentrant": kinds.pop() if len(kinds) == 1 else sorted(map(str, kinds)),
            "checkpointed_layers": len(layers)}


def reference_switch(variable: str, choices: tuple[str, ...]) -> str:
    """The environment's choice between nshard's fast path (choices[0], the default) and the reference path it
    replaced bit for bit (kept so that tests compare the two in one run, on whatever CPU they run on)."""
    value = os.environ.get(variable, choices[0])
    if value not in choices:
        raise ValueError(f"{variable}={value!r}: set it to one of {', '.join(choices)} (or unset it for {choices[0]!r})")
    return value


def use_own_extensions() -> None:
    """Point torch's JIT op builds at this venv's extension folder (launch_env.extensions_dir), with this venv's
    ninja, in this process. The launchers' ranks have it from prepare_process_env; a process that builds an engine
    without them (a notebook, a spawned test rank) used torch's default folder, one for every venv of a user, where
    a build killed half-way leaves a lock that makes every later process wait forever (seen in CI: both ranks of a
    spawned test waited 300 s on ~/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock)."""
    from nshard.seam.launch_env import extensions_dir, pin_ninja

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    pin_ninja()


def build_cpu_comm_extension() -> None:
    """Compile (or load) DeepSpeed's CPU shared-memory collective now; otherwise the first
    init_distributed on a machine compiles it (~40 s) inside whichever run comes first."""
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    use_own_extensions()  # where the launched ranks will look, with the ninja they use (prepare_process_env)
    with _noting_a_build():
        ShareMemCommBuilder().load(verbose=False)


def prebuild_cpu_collective() -> None:
    """build_cpu_comm_extension where there is no GPU (launch/setup.sh: once per machine, before any run)."""
    if not torch.cuda.is_available():
        build_cpu_comm_extension()


@contextlib.contextmanager
def _noting_a_build():
    """Note (nshard.files.note_one_time_work) when DeepSpeed's CPU collective was compiled inside the block: its
    shared object under torch's extension directory is new or newer afterwards. On CUDA nothing is built here."""
    if torch.cuda.is_available():
        yield
        return
    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so"
    before = built.stat().st_mtime_ns if built.exists() else None
    yield
    after = built.stat().st_mtime_ns if built.exists() else None
    if after is not None and after != before:
        note_one_time_work(f"compiled DeepSpeed's CPU collective ({built})")


def require_deepspeed() -> str:
    """DeepSpeed's version; ImportError (naming what is missing: DeepSpeed, or a package it imports, hjson or pydantic
    say) where it cannot be imported."""
    import deepspeed

    return deepspeed.__version__


def init_distributed() -> None:
    import deepspeed

    from nshard.run.device import bind_local_gpu, dist_backend

    bind_local_gpu()
    use_own_extensions()
    with _noting_a_build():
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

    from nshard.seam.launch_env import shm_workspace

    dist.barrier()
    env = os.environ
    shm_workspace(env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""), dist.get_rank()).unlink(missing_ok=True)


def zero_stage(engine) -> int:
    return engine.zero_optimization_stage()


def full_parameters(engine):
    """A context in which engine.module holds every full parameter (ZeRO-3 gathers them; other stages already do)."""
    import contextlib

    import deepspeed

    if zero_stage(engine) == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


DS_CHECKPOINT_TAG = "deepspeed"
"""DeepSpeed's checkpoint sits in <state dir>/deepspeed/ (nshard/run/state.py seals the directory around it)."""


def save_checkpoint(engine, directory: Path) -> None:
    """DeepSpeed's own checkpoint: module, optimizer (ZeRO partitions: one file per rank), scheduler, step
    counters. A collective: every rank calls it."""
    engine.save_checkpoint(str(directory), tag=DS_CHECKPOINT_TAG, save_latest=False)


def load_checkpoint(engine, directory: Path, scheduler: bool = True) -> dict:
    """DeepSpeed's checkpoint in <directory>/deepspeed/: module, optimizer, step counters, and the learning-rate
    schedule unless scheduler=False (a second cohort keeps its own). Returns DeepSpeed's client state."""
    path, client = engine.load_checkpoint(str(directory), tag=DS_CHECKPOINT_TAG, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=scheduler)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}/{DS_CHECKPOINT_TAG}")
    return client


def install_reducer(engine, config: ReducerConfig | None):
    """The gradient reduction chosen by the parsed "nshard" section (None: DeepSpeed's own)."""
    from nshard.seam.ingest import IngestSeam, ZeroPartitionWriter
    from nshard.seam.reduction import DeepSpeedReduction, InPlaceSeam

    # A world of one rank reduces nothing (NSHARD_ONE_RANK_REDUCTION=run: the reference path, which flattens,
    # all-reduces with itself, divides by 1 and copies back, changing no bit).
    if config is None:
        return DeepSpeedReduction(one_rank_skip=one_rank_skips() and patches.skip_one_rank_reduction(engine))
    check_device(config, torch.device(engine.device).type)  # before any collective or hook
    one_rank = one_rank_skips()
    import functools

    import deepspeed.comm as ds_comm

    from nshard.comm import build_reducer

    # Through deepspeed.comm under its own log name, so DeepSpeed's comms logger counts the
    # reducer's traffic apart from DeepSpeed's own gradient collectives.
    all_reduce = functools.partial(ds_comm.all_reduce, log_name=patches.REDUCER_LOG_NAME)
    reducer = build_reducer(config, all_reduce=all_reduce, skip_one_rank=one_rank)
    one_rank_skip = one_rank and config.reducer == "dense"  # PowerSGD compresses on one rank too
    overlap = config.overlap_backward and not one_rank  # nothing to start during backward on one rank
    patches.silence_deepspeed_reduction(engine)
    if config.parameter_sync == "delta":
        from nshard.comm.delta import DeltaCodec

        patches.install_delta_sync(engine, DeltaCodec(bits=config.delta_bits, block=config.delta_block))
    ingest = ingest_mode(zero_stage(engine), engine.bfloat16_enabled())
    if ingest:
        # NSHARD_ZERO_INGEST=hooks hands ZeRO-1/2 the reduced gradient through DeepSpeed's own backward and
        # gradient hooks (HandOver), the path the partition writer replaced bit for bit.
        writer = None
        if zero_stage(engine) in (1, 2) and reference_switch("NSHARD_ZERO_INGEST", ("writer", "hooks")) == "writer":
            writer = ZeroPartitionWriter(engine.optimizer)
        return IngestSeam(engine, reducer, config.reducer, partition_writer=writer,
                          sum_every_microbatch_into_error=
                          config.reducer == "powersgd" and config.microbatch_sums == "error",
                          overlap=overlap, flat=flat_gradients(engine), one_rank_skip=one_rank_skip)
    return InPlaceSeam(engine, reducer, config.reducer, overlap=overlap, one_rank_skip=one_rank_skip)


def one_rank_skips() -> bool:
    """Whether this process is a world of one rank that skips the gradient reduction (NSHARD_ONE_RANK_REDUCTION)."""
    import torch.distributed as dist

    return dist.get_world_size() == 1 and reference_switch("NSHARD_ONE_RANK_REDUCTION", ("skip", "run")) == "skip"


def flat_gradients(engine):
    """bf16 at stage 0: one flat fp32 buffer of gradients that the ingest seam sums into and DeepSpeed's fp32 masters
    step from (patches.install_flat_master_step); None at ZeRO-1/2, under another optimizer wrapper, or with
    NSHARD_BF16_STEP=deepspeed (the reference path: HandOver into DeepSpeed's per-parameter step)."""
    from nshard.seam.ingest import FlatGradients

    if zero_stage(engine) != 0 or reference_switch("NSHARD_BF16_STEP", ("flat", "deepspeed")) != "flat":
        return None
    order = patches.flat_master_order(engine)
    if order is None:
        return None
    names = {id(p): n for n, p in engine.module.named_parameters() if p.requires_grad}
    if len(order) != len(names) or any(id(p) not in names for p in order):
        return None  # the wrapper steps another set of parameters than the seam sums: keep DeepSpeed's own step
    flat = FlatGradients({names[id(p)]: p for p in order})
    patches.install_flat_master_step(engine, {id(p): flat.views[names[id(p)]] for p in order}, flat.flat)
    return flat


# ---- elastic resume (nshard/run/elastic.py): DeepSpeed's universal checkpoint and full optimizer state ----

def load_checkpoint_resharded(engine, state: Path, scratch: Path, is_main: bool, scheduler: bool = True) -> dict:
    """An elastic resume's load (nshard/run/elastic.py): DeepSpeed's checkpoint in <state>/deepspeed/, saved on another
    world size, loaded into this engine: as it
    is at stage 0; at ZeRO-1/2 through DeepSpeed's universal checkpoint, which rank 0 converts into `scratch`
    (removed once every rank has loaded it). Returns DeepSpeed's client state."""
    import torch.distributed as dist

    if zero_stage(engine) == 0:
        return load_checkpoint(engine, state, scheduler=scheduler)
    error = None
    if is_main:
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            to_universal(state / DS_CHECKPOINT_TAG, scratch / "universal")
        except Exception as exc:  # noqa: BLE001 -- DeepSpeed's converter asserts; every rank reports it below
            error = f"{type(exc).__name__}: {exc}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    try:
        if errors[0]:
            raise ValueError(f"DeepSpeed's universal checkpoint conversion of its ZeRO partitions failed: {errors[0]}")
        config = engine._config  # checkpoint.load_universal, for this one load
        saved_flag = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            path, client = engine.load_checkpoint(str(scratch), tag="universal", load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=scheduler)
        finally:
            config.load_universal_checkpoint = saved_flag
        if path is None:
            raise ValueError(f"DeepSpeed found no universal checkpoint in {scratch}")
        return client
    finally:
        dist.barrier()
        if is_main:
            shutil.rmtree(scratch, ignore_errors=True)


def to_universal(source: Path, dest: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process (one worker: no child processes), its progress lines muted."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(dest, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(source), output_folder=str(dest), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # nshard's engines do not write universal_checkpoint_info; the converter adds its default
                              inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal(args)


def full_optimizer_state(engine) -> dict:
    """Every trained parameter's fp32 master and AdamW moments, whole (gathered from the ZeRO partitions: a
    collective at stages 1 and 2), by name; what the elastic record's optimizer_state_sha256 hashes."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    stage = zero_stage(engine)
    wrapper = engine.optimizer
    masters = ({id(lp): hp for lps, hps in zip(wrapper.fp16_groups, wrapper.fp32_groups) for lp, hp in zip(lps, hps)}
               if stage == 0 and wrapper is not engine.basic_optimizer else {})  # a WHOLE_WRAPPERS one's fp32 copies
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if stage == 0:
            master = masters.get(id(p), p)
            held = engine.basic_optimizer.state.get(master, {})
            out[name] = {"fp32": master.detach().float().cpu(),
                         **{k: held[k].detach().cpu() for k in ("exp_avg", "exp_avg_sq") if k in held}}
        else:
            out[name] = {"fp32": safe_get_full_fp32_param(p).detach().cpu(),
                         **{k: safe_get_full_optimizer_state(p, k).detach().cpu() for k in ("exp_avg", "exp_avg_sq")}}
    return out
