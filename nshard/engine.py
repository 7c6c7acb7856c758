"""The one place that imports DeepSpeed: read the ds_config, build the engine, count its collectives,
and put an nshard reducer in place of DeepSpeed's gradient all-reduce.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

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
    if "nshard" in config:
        from nshard.comm import validate_config

        try:
            section = validate_config(config["nshard"])
        except ValueError as exc:
            raise DsConfigError(" ".join(str(exc).split())) from None
        if section["reducer"] == "powersgd" and stage == 3:
            raise DsConfigError("nshard.reducer=powersgd with zero_optimization.stage=3: PowerSGD runs at "
                                "stages 0, 1 and 2; lower the stage or use the dense reducer")


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
    config.pop("nshard", None)
    return config


def torch_adamw(params, config: dict) -> torch.optim.Optimizer:
    """torch's AdamW from the ds_config optimizer block, with DeepSpeed's defaults (weight decay 0, not torch's 0.01)."""
    p = config["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.0))


def build_engine(model: torch.nn.Module, config: dict):
    """deepspeed.initialize with torch's AdamW on CPU (no FusedAdam JIT build) and DeepSpeed's own elsewhere."""
    import deepspeed

    config = copy.deepcopy(config)
    optimizer = None
    if not torch.cuda.is_available():
        optimizer = torch_adamw(model.parameters(), config)
        config.pop("optimizer")
        config.setdefault("zero_allow_untested_optimizer", True)
    # Counting bytes needs the comms logger; leave a user's own setting alone.
    config.setdefault("comms_logger", {"enabled": True, "verbose": False, "prof_all": True, "debug": False})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=None if optimizer else model.parameters())
    return engine


def init_distributed() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def zero_stage(engine) -> int:
    return engine.zero_optimization_stage()


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
        grad = sum(v for k, v in delta.items() if k.split("|")[0] in GRAD_OPS)
        return {"grad_bytes": grad, "other_bytes": sum(delta.values()) - grad, "by_op": delta}


def full_parameters(engine):
    """A context in which engine.module holds every full parameter (ZeRO-3 gathers them; other stages already do)."""
    import contextlib

    import deepspeed

    if zero_stage(engine) == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


class ReducerSeam:
    """An nshard reducer standing where DeepSpeed's gradient all-reduce stood.

    Stage 0: DeepSpeed's `enable_backward_allreduce` seam; the trainer calls reduce_engine_grads
    after the last microbatch's backward and before engine.step().
    """

    def __init__(self, engine, reducer, section: dict):
        if zero_stage(engine) != 0:
            raise DsConfigError(f"nshard.reducer={section['reducer']} at zero_optimization.stage="
                                f"{zero_stage(engine)} is not wired yet; use stage 0")
        self.engine, self.reducer, self.section = engine, reducer, section
        engine.enable_backward_allreduce = False
        self.names = [n for n, p in engine.module.named_parameters() if p.requires_grad]

    def reduce_engine_grads(self, engine) -> None:
        params = dict(engine.module.named_parameters())
        named = {}
        for name in self.names:
            p = params[name]
            if p.grad is None:  # every parameter takes part in every update, with a zero gradient if unused
                p.grad = torch.zeros_like(p)
            named[name] = p.grad
        self.reducer.reduce(named)

    def next_update_compressed(self) -> bool:
        s = self.section
        return s["reducer"] == "powersgd" and self.reducer.updates >= s["dense_warmup_updates"]

    def last_update_bytes(self) -> int:
        return sum(self.reducer.ledger.records[-1]["bytes"].values())

    def describe(self) -> str:
        return self.section["reducer"]


def install_reducer(engine, section: dict | None):
    """Build the nshard reducer named by the ds_config's "nshard" section, or None to keep DeepSpeed's all-reduce."""
    if section is None:
        return None
    from nshard.comm import build_reducer, validate_config

    section = validate_config(section)
    return ReducerSeam(engine, build_reducer(section), section)
