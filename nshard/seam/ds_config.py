"""The ds_config rules: read and check the DeepSpeed JSON, parse its "nshard" section, and complete it from the
plan once, before any process group or engine exists. Imports no DeepSpeed."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from typing import TYPE_CHECKING

from nshard.comm.config import ReducerConfig

if TYPE_CHECKING:  # the plan is read, never imported: the seam sits below the run
    from nshard.run.plan import Plan

# Keys nshard derives from the plan (documents per batch); a ds_config may leave them out or "auto".
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


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
    if not isinstance(opt.get("params", {}), dict):
        raise DsConfigError(f"optimizer.params={json.dumps(opt['params'], default=str)}: use an object such as "
                            "{\"lr\": 5e-05}")
    if "lr" not in opt.get("params", {}):
        raise DsConfigError("optimizer.params.lr is missing: give a learning rate")
    check_optimizer_params(opt["params"])
    for key in ("bf16", "bfloat16"):
        enabled = config.get(key, {}).get("enabled", False)
        if enabled not in (True, False, "auto"):
            raise DsConfigError(f"{key}.enabled={enabled!r}: use true, false or \"auto\" (bf16 where this machine "
                                "has bf16 matrix units: a GPU that supports it, a CPU with AMX-BF16 or AVX512-BF16)")
    if not isinstance(opt["params"].get("torch_adam", False), bool):
        raise DsConfigError(f"optimizer.params.torch_adam={opt['params']['torch_adam']!r}: use true (torch's AdamW, "
                            "the shipped configs) or false (DeepSpeed's FusedAdam on CUDA, see docs/gpu.md)")
    activation_checkpointing(config)


ADAMW_PARAMS = ("lr", "betas", "eps", "weight_decay")
"""The optimizer params nshard builds torch's AdamW from (nshard/seam/engine.py: torch_adamw), DeepSpeed's defaults
for the others: betas (0.9, 0.999), eps 1e-8, weight decay 0."""
PATH_PARAMS = ("torch_adam", "fused", "adam_w_mode")
"""The optimizer params that choose an implementation: torch_adam (optimizer_path), fused (torch's fused AdamW
kernel or its single-tensor step; optimizer_implementation), and adam_w_mode, accepted as true only (the AdamW that
runs, whether optimizer.type says "AdamW" or "Adam")."""
PARAM_FIXES = {"max_grad_norm": "clip with the top-level \"gradient_clipping\" key instead"}


def check_optimizer_params(params: dict) -> None:
    """Refuse an optimizer param that nshard would not apply, naming it: torch's AdamW is built from ADAMW_PARAMS
    alone, so any other key (amsgrad, foreach, maximize, bias_correction, ...) would be dropped without a
    word. One rule on every path, so that a ds_config means the same on the CPU and on a GPU."""
    for key, value in params.items():
        if key not in ADAMW_PARAMS + PATH_PARAMS:
            fix = PARAM_FIXES.get(key, "remove the key")
            raise DsConfigError(f"optimizer.params.{key}={json.dumps(value, default=str)}: nshard steps AdamW with "
                                f"{', '.join(ADAMW_PARAMS)} only (and torch_adam and fused choosing the "
                                f"implementation), so this key would not be applied; {fix}")
    if not isinstance(params.get("fused", True), bool):
        raise DsConfigError(f"optimizer.params.fused={json.dumps(params['fused'], default=str)}: use true (torch's "
                            "fused AdamW kernel, the default) or false (torch's single-tensor AdamW, stepped in "
                            "pieces on the CPU)")
    if params.get("adam_w_mode", True) is not True:
        raise DsConfigError(f"optimizer.params.adam_w_mode={json.dumps(params['adam_w_mode'], default=str)}: nshard "
                            "steps AdamW (decoupled weight decay) whether optimizer.type is \"AdamW\" or \"Adam\"; "
                            "remove the key or set it to true")


CHECKPOINTING = "non-reentrant torch.utils.checkpoint around every decoder layer (transformers' gradient_checkpointing)"
"""What an "activation_checkpointing" section switches on, as the receipts say it."""
CHECKPOINTING_DEFAULTS = {"partition_activations": False, "cpu_checkpointing": False,
                          "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
                          "profile": False, "number_checkpoints": None}
"""DeepSpeed's sub-keys, accepted at these (DeepSpeed's own) defaults: each configures deepspeed.checkpointing,
an API that a model's code must call and transformers' models do not."""


def activation_checkpointing(config: dict) -> dict | None:
    """The "activation_checkpointing" section: None when absent, else the record of what nshard runs. Its presence
    switches checkpointing on; a sub-key away from DeepSpeed's default, or one DeepSpeed does not know, is refused."""
    section = config.get("activation_checkpointing")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise DsConfigError(f"activation_checkpointing={json.dumps(section)}: use an object; {{}} switches non-reentrant "
                            "activation checkpointing on, leaving the section out switches it off")
    for key, value in section.items():
        if key not in CHECKPOINTING_DEFAULTS:
            raise DsConfigError(f"activation_checkpointing.{key}: not a DeepSpeed activation_checkpointing key "
                                f"({', '.join(CHECKPOINTING_DEFAULTS)}); the section's presence is the switch "
                                "(leave it out to switch checkpointing off): remove the key")
        if value != CHECKPOINTING_DEFAULTS[key]:
            default = json.dumps(CHECKPOINTING_DEFAULTS[key])
            raise DsConfigError(f"activation_checkpointing.{key}={json.dumps(value)}: it configures DeepSpeed's "
                                "deepspeed.checkpointing API, which transformers' models do not call; nshard "
                                "checkpoints every decoder layer with torch's non-reentrant checkpoint instead. "
                                f"Remove the key or set it to {default}")
    return {"kind": CHECKPOINTING, "use_reentrant": False, "ds_config": dict(section)}


TORCH_ADAMW = "torch AdamW"
FUSED_ADAM = "DeepSpeed FusedAdam"


def optimizer_path(config: dict, cuda: bool) -> str:
    """Which AdamW steps the run: torch's (built by nshard, chunked on CPU) on the CPU and wherever the
    ds_config says optimizer.params.torch_adam=true (the shipped configs), so a GPU steps the optimizer the
    CPU tests check; DeepSpeed's FusedAdam (compiled with nvcc at first use) only on CUDA by opting out."""
    return TORCH_ADAMW if not cuda or config["optimizer"].get("params", {}).get("torch_adam", False) else FUSED_ADAM


def optimizer_implementation(config: dict, cuda: bool, chunk: int) -> str:
    """What steps AdamW, as the receipts and the report name it. torch's AdamW runs its fused kernel (one pass
    over parameter, gradient and both moments, on the CPU as on a GPU) unless optimizer.params.fused is false; then
    its single-tensor step, in pieces of `chunk` elements on the CPU (chunked_adamw; 0: whole tensors)."""
    if optimizer_path(config, cuda) == FUSED_ADAM:
        return FUSED_ADAM
    if config["optimizer"].get("params", {}).get("fused", True):
        return f"{TORCH_ADAMW}, fused"
    if cuda or not chunk:
        return f"{TORCH_ADAMW}, single-tensor"
    return f"{TORCH_ADAMW}, single-tensor in {chunk}-element pieces"


def check_optimizer_path(config: dict, cuda: bool) -> None:
    """Refuse the optimizer path nshard cannot vouch for: FusedAdam under bf16 at stage 0, where DeepSpeed wraps
    it in its FP16_Optimizer (bf16 mode) instead of the FP16_UnfusedOptimizer that torch's AdamW gets."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if optimizer_path(config, cuda) == FUSED_ADAM and "fused" in config["optimizer"].get("params", {}):
        raise DsConfigError("optimizer.params.fused chooses between torch's AdamW kernels, but "
                            "optimizer.params.torch_adam is false, so DeepSpeed's FusedAdam steps: remove the fused "
                            "key or set torch_adam to true")
    if optimizer_path(config, cuda) == FUSED_ADAM and _bf16(config) and stage == 0:
        raise DsConfigError("optimizer.params.torch_adam=false with bf16 at zero_optimization.stage=0: DeepSpeed "
                            "would step FusedAdam inside its FP16_Optimizer, which no nshard test covers; set "
                            "optimizer.params.torch_adam to true (the shipped default) or use stage 1 or 2")


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
    if parsed.parameter_sync == "delta":
        check_delta_sync(config)
    return parsed


def check_delta_sync(config: dict) -> None:
    """Delta parameter sync needs ZeRO-1/2's partitioned masters, and a checkpoint that restores masters and
    replicas apart: a load that sets one from the other would close the gap that is its error memory."""
    zero = config.get("zero_optimization", {})
    if zero.get("stage", 0) not in (1, 2):
        raise DsConfigError("nshard.parameter_sync=\"delta\" with zero_optimization.stage="
                            f"{zero.get('stage', 0)}: it replaces ZeRO's all-gather of the updated weights, so it "
                            "needs stage 1 or 2; set the stage or parameter_sync to \"dense\"")
    if zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None):
        raise DsConfigError("nshard.parameter_sync=\"delta\" with zero_optimization.offload_optimizer: the masters "
                            "must stay beside the replicas; remove the offload or set parameter_sync to \"dense\"")
    if zero.get("load_from_fp32_weights", True) is not True:
        raise DsConfigError("zero_optimization.load_from_fp32_weights=false with nshard.parameter_sync=\"delta\": "
                            "a load would set every master to its replica and lose the error memory; remove the key")
    if config.get("checkpoint", {}).get("load_universal", False):
        raise DsConfigError("checkpoint.load_universal=true with nshard.parameter_sync=\"delta\": a universal "
                            "checkpoint sets every replica to its master and loses the error memory; load nshard's "
                            "own complete state (--resume) instead, or set parameter_sync to \"dense\"")


def complete_ds_config(config: dict, plan: Plan, world_size: int) -> dict:
    """Fill the batch keys (and a WarmupDecayLR's total_num_steps) from the plan; conflicting values are errors."""
    from nshard.run.data import accumulation_steps

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
        # DeepSpeed sees one micro-step per update in ingest mode (see nshard/seam/ingest.py IngestSeam).
        config["gradient_accumulation_steps"] = 1
        config["train_batch_size"] = t.microbatch_docs * world_size
        zero = config.setdefault("zero_optimization", {})
        for key in ("reduce_scatter", "overlap_comm"):
            if zero.get(key, False):
                raise DsConfigError(f"zero_optimization.{key}=true with an nshard reducer: set it to false "
                                    "(the nshard reducer does the gradient reduction)")
            zero[key] = False
    for key in ("bf16", "bfloat16"):
        if config.get(key, {}).get("enabled") == "auto":  # DeepSpeed takes a bool: resolved here, once
            config[key]["enabled"] = _bf16(config)
    config.pop("nshard", None)
    return config


def ingest_mode(stage: int, bf16: bool) -> bool:
    """The one rule for where an nshard reducer sits: the ingest seam (nshard/seam/ingest.py) at ZeRO-1/2 or
    bf16, in place of the stage-0 all-reduce otherwise. Applied to the ds_config before the engine
    exists (complete_ds_config) and to the engine itself (install_reducer)."""
    return stage in (1, 2) or bf16


def _bf16(config: dict) -> bool:
    """Whether the run computes in bf16 (DeepSpeed takes both keys); "auto" asks this machine (bf16_units)."""
    return any(bf16_units()[0] if config.get(key, {}).get("enabled") == "auto" else bool(config.get(key, {}).get("enabled"))
               for key in ("bf16", "bfloat16"))


@functools.lru_cache(maxsize=1)
def bf16_units() -> tuple[bool, str]:
    """Whether this machine has bf16 matrix units that torch uses, and why: what "bf16": {"enabled": "auto"}
    resolves to. A GPU: torch.cuda.is_bf16_supported(). A CPU: AMX-BF16 or AVX512-BF16 in /proc/cpuinfo's flags,
    and torch running its AVX-512 kernels (ATEN_CPU_CAPABILITY=default or avx2 takes the slow, and on an AMX
    machine broken, bf16 paths: FACTS.md)."""
    import torch

    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name()} {'supports' if ok else 'does not support'} bf16"
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    if not units:
        return False, "this CPU has no bf16 matrix units (neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo)"
    if not capability.startswith("AVX512"):
        return False, f"this CPU has {' and '.join(units)} but torch runs its {capability} kernels here"
    return True, f"this CPU has {' and '.join(units)} and torch runs its {capability} kernels"


def precision(config: dict) -> dict:
    """What the run computes in and why, for its receipts and the report: the ds_config's request (true, false,
    "auto"), the outcome, and the masters' dtype (fp32 in DeepSpeed's bf16 optimizers, as in fp32)."""
    requested = next((config[k].get("enabled") for k in ("bf16", "bfloat16") if k in config), False)
    bf16 = _bf16(config)
    why = bf16_units()[1] if requested == "auto" else f"the ds_config sets bf16.enabled={str(bool(requested)).lower()}"
    return {"requested": requested, "compute": "bfloat16" if bf16 else "float32", "masters": "float32", "why": why}
