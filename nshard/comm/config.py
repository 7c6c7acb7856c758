"""The `"nshard"` section of a ds_config: its fields with their types and rules (nshard/schema.py), defaults, and
the one error that lists every problem."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping

from nshard.schema import Rule, choice, field_problems, setting

REDUCERS = ("dense", "powersgd")
ERROR_FEEDBACK_PLACES = ("device", "host")
TRANSPORTS = ("torch", "mpi")
MICROBATCH_SUMS = ("exact", "error")
PARAMETER_SYNCS = ("dense", "delta")
DELTA_BITS = (8, 4, 2)
ORTHOGONALIZATIONS = ("auto", "cholesky_qr2", "householder")


class ConfigError(ValueError):
    """A bad `nshard` section; `problems` holds one line per key, each naming `nshard.<key>` and its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid nshard config:\n  " + "\n  ".join(self.problems))


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `"rank": true` is a typo, not a rank.
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(choices: tuple[str, ...]) -> Rule:
    return choice(choices, "{key} is {value!r}; set it to " + " or ".join(f'"{c}"' for c in choices))


TRUE_OR_FALSE = Rule(lambda v: isinstance(v, bool), "{key} is {value!r}; set it to true or false")


@dataclass(frozen=True)
class ReducerConfig:
    """How gradients are averaged across data-parallel ranks."""

    reducer: str = setting("dense", _one_of(REDUCERS))
    """"dense" (plain flat all-reduce) or "powersgd" (low-rank compression with error feedback)."""
    rank: int = setting(32, Rule(lambda v: _is_int(v) and v >= 1, "{key} is {value!r}; set it to an integer >= 1 "
                                 "(e.g. 32)"))
    """PowerSGD approximation rank r; each compressed (n, m) gradient sends r*(n+m) floats (the study's 32)."""
    dense_warmup_updates: int = setting(8, Rule(lambda v: _is_int(v) and v >= 0, "{key} is {value!r}; set it to an "
                                                "integer >= 0 (0 compresses from the first update)"))
    """Updates reduced densely before compression starts (early training is sensitive to bias; the study's 8)."""
    min_compression_rate: float = setting(2.0, Rule(
        lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
        "{key} is {value!r}; set it to a number > 0 (e.g. 2)"))
    """Compress an (n, m) matrix only if r*(n+m)*min_compression_rate <= n*m."""
    error_feedback: str = setting("device", _one_of(ERROR_FEEDBACK_PLACES))
    """Where the fp32 error memory lives: "device" (with the grads) or "host" (CPU, pinned on CUDA)."""
    warm_start: bool = setting(True, TRUE_OR_FALSE)
    """Reuse the previous update's Q instead of drawing a fresh one."""
    seed: int = setting(0, Rule(lambda v: _is_int(v) and 0 <= v < 2**63, "{key} is {value!r}; set it to an integer "
                                "in [0, 2**63)"))
    """Seed of the projection RNG; identical on every rank so every replica draws the same Q."""
    transport: str = setting("torch", _one_of(TRANSPORTS))
    """"torch" (torch.distributed: gloo on CPU, NCCL on GPU) or "mpi" (mpi4py COMM_WORLD)."""
    microbatch_sums: str = setting("exact", _one_of(MICROBATCH_SUMS))
    """Under ZeRO-1/2 or bf16 with device error memory, where an update's microbatch gradients are summed.
    "exact": an update with one microbatch per rank adds its gradient straight into the error memory;
    one with several keeps fp32 sums apart (4 bytes per parameter), so M = error + (g1 + g2 + ...) rounds
    as at stage 0. "error": every microbatch goes into the error memory as it arrives, (error + g1) + g2,
    with no extra buffer; it rounds differently from stage 0 when an update has several microbatches."""
    parameter_sync: str = setting("dense", _one_of(PARAMETER_SYNCS))
    """How ZeRO-1/2 share the updated weights after each step: "dense" (DeepSpeed's all-gather of every
    partition, one model copy across the ranks) or "delta" (each owner sends master − replica quantized to
    delta_bits per element, nshard/comm/delta.py; the replicas stay bit-identical, the masters exact AdamW)."""
    delta_bits: int = setting(4, choice(DELTA_BITS, "{key} is {value!r}; set it to 8, 4 or 2"))
    """Bits per element of a delta parameter sync: 8, 4 or 2."""
    delta_block: int = setting(256, Rule(lambda v: _is_int(v) and v >= 16 and v % 16 == 0, "{key} is {value!r}; set "
                                         "it to a multiple of 16 (e.g. 256)"))
    """Elements that share one fp32 scale in a delta parameter sync (a multiple of 16)."""
    orthogonalization: str = setting("auto", _one_of(ORTHOGONALIZATIONS))
    """How PowerSGD orthonormalizes the summed P: "cholesky_qr2" (batched matmuls, Householder QR for a matrix
    it cannot handle: rank-deficient, all-zero, cond(P) past ~10⁷), "householder" (QR alone), or "auto"
    (CholeskyQR2 on CUDA, Householder on CPU). Same Q within fp32 rounding either way; not saved state."""
    overlap_backward: bool = setting(False, TRUE_OR_FALSE)
    """Start the reduction during the last microbatch's backward, bucket by bucket as gradients are final
    (nshard/comm/overlap.py), instead of after it; the same result, bit for bit on two ranks. Needs transport
    "torch", microbatch_sums "exact" and a CPU device (check_device); under ZeRO-1/2 and bf16 the update's gradients
    are then always summed in fp32 buffers apart from the error memory (4 bytes more per compressed parameter in an
    update of one microbatch under PowerSGD with device error memory, which otherwise sums into the error memory)."""
    tf32: bool = setting(False, TRUE_OR_FALSE)
    """Let PowerSGD's fp32 matmuls (P, Q, CholeskyQR2's products, decompression) use TF32 on CUDA: faster, with a
    10-bit mantissa in the products. false: full fp32, whatever torch's global matmul precision (the receipts'
    `numerics` record both)."""

    def __post_init__(self):
        problems = field_problems(self, "nshard") + cross_field_problems(self)
        if problems:
            raise ConfigError(problems)


def cross_field_problems(config: ReducerConfig) -> list[str]:
    """Settings that are each valid but cannot go together, each line naming the keys and the fix."""
    problems = []
    if config.microbatch_sums == "error" and config.error_feedback != "device":
        problems.append('nshard.microbatch_sums is "error", which sums into an error memory beside the gradients; '
                        'set error_feedback to "device" or microbatch_sums to "exact"')
    if config.overlap_backward is True and config.transport != "torch":
        problems.append(f'nshard.overlap_backward is true with transport {config.transport!r}, whose collectives '
                        'block; set transport to "torch" or overlap_backward to false')
    elif config.overlap_backward is True and config.microbatch_sums == "error":
        # Refused at stage 0 in fp32 too, where the sums are .grad and microbatch_sums has no effect: the section is
        # checked on its own, before the stage and the precision (bf16 "auto" follows the machine) are known.
        problems.append('nshard.overlap_backward is true with microbatch_sums "error": the reduction during backward '
                        'reduces fp32 sums of the microbatches (under ZeRO-1/2 and bf16; refused at stage 0 in fp32 '
                        'too, where microbatch_sums has no effect, since the section is checked before the stage '
                        'and precision are known); set microbatch_sums to "exact" or overlap_backward to false')
    return problems


def check_device(config: ReducerConfig, device_type: str) -> None:
    """Refuse what the "nshard" section asks of a device that cannot do it (`device_type`: torch.device.type,
    "cpu" or "cuda"). overlap_backward on CUDA: the phase clock waits for the device at every phase boundary
    (nshard/phases.py), so each bucket's all-reduce would finish inside the backward that started it; nothing
    would overlap, and it is measured on CPU gloo only."""
    if config.overlap_backward and device_type == "cuda":
        raise ConfigError(["nshard.overlap_backward is true on a CUDA device: it is measured on CPU gloo only (on "
                           "CUDA the phase clock's synchronization at each phase boundary would finish every "
                           "bucket's all-reduce inside the backward); set overlap_backward to false"])


def _unknown_key_problems(config: Mapping[str, Any]) -> list[str]:
    known = [f.name for f in dataclasses.fields(ReducerConfig)]
    problems = []
    for key in sorted(k for k in config if k not in known):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f'did you mean "{close[0]}"? ' if close else ""
        problems.append(f"nshard.{key} is not a known key; {hint}remove it (known: {', '.join(known)})")
    return problems


def parse_config(config: Mapping[str, Any] | None) -> ReducerConfig:
    """The section as a ReducerConfig, or one ConfigError listing unknown keys and bad values together."""
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError([f"nshard must be a JSON object (dict), got {type(config).__name__}"])
    problems = _unknown_key_problems(config)
    known = {k: v for k, v in config.items() if k in {f.name for f in dataclasses.fields(ReducerConfig)}}
    try:
        parsed = ReducerConfig(**known)
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    return parsed


def validate_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The section with defaults filled in, so the trainer can fail before any process group exists."""
    return dataclasses.asdict(parse_config(config))
