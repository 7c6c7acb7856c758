"""Per-rank memory of nshard's configurations (ZeRO stage x reducer x precision x error-memory place x ranks),
predicted part by part from the parameter shapes, and set against measured peaks. Reads files only (no torch).

    python -m nshard.analysis.memory_model --measured runs/memory-probe          # predicted vs measured
    python -m nshard.analysis.memory_model --model_dir DIR --world 2             # predictions for a model
    python -m nshard.analysis.memory_model --layers 24 --ratios                  # pooled vs one rank at stage 0

A plan's peak (plan_peak, under "a plan's peak, before launch") is what nshard/train.py checks before any process
group exists: it refuses a plan whose predicted per-rank peak does not fit the device, naming the largest parts and
the setting that would make it fit. `python -m launch.capacity --plan PLAN` prints it for every arm of a plan on
common GPUs (docs/gpu.md#memory-planned-before-launch).

What each part is, per rank (DeepSpeed 0.19.8, CPU, torch AdamW stepped in pieces of 2^18 elements by
nshard/seam/chunked_adamw.py; P parameters, C of them in PowerSGD-compressed matrices, D = P - C, N ranks,
L the largest tensor, w bytes per module weight):
- params: the module's weights (fp32 4P; bf16 2P).
- grads: DeepSpeed's own gradient buffers. Stage 0: .grad (4P). ZeRO-1/2 under DeepSpeed's own reduction:
  the ipg bucket the grads are copied into (contiguous_gradients; w*min(P, reduce_bucket_size): CPU pages
  are only counted once touched) plus the owned flat partition (4P/N). ZeRO-1/2 under an nshard reducer:
  only the owned partition (4P/N), written by nshard/seam/ingest.py's ZeroPartitionWriter; no bucket.
- accumulators: the ingest seam's fp32 microbatch sums (nshard/seam/ingest.py IngestSeam): 4P when an update has
  several microbatches (microbatch_sums "exact"), 4D when the compressed matrices are summed straight into
  their error memory (one microbatch per update, or microbatch_sums "error"); always 4P under
  nshard.overlap_backward.
- error: PowerSGD's fp32 error memory, one (n, m) matrix per compressed parameter (4C).
- pq: the flat P and Q buffers, r(n+m) floats per compressed matrix.
- optimizer: AdamW exp_avg + exp_avg_sq (8P; 8P/N under ZeRO-1/2).
- master: fp32 master weights (ZeRO's single_partition_of_fp32_groups, 4P/N; 0 at stage 0 fp32; 4P at stage 0
  bf16, where torch's AdamW gets DeepSpeed's FP16_UnfusedOptimizer in bf16 mode: whole fp32 masters).
- comm: flat buffers that exist only while reducing (stage-0 bucket 4*min(P, 5e8); a dense flat
  all-reduce of the reducer's remainder, 4D; 4P when a dense warm-up update runs with state allocated). Under
  nshard.overlap_backward the buckets' flat buffers (4P for a dense update; 4D and a copy of P for a compressed one)
  are alive in the backward phase too, beside the activations.
- transient: the ingest seam's one gradient at a time (a parameter hook sums each into its accumulator as
  autograd produces it; the heap keeps the largest, w*L), one matrix's output while it is written into
  ZeRO's partition (4L), AdamW's temporaries (two pieces: 8*min(2^18, the tensor); on a GPU the foreach
  path's square roots of every second moment stepped, 4 bytes each), activations; in ZeRO-1/2's
  step, one after another, the gradient norm's fp64 copy of an owned gradient (8L), and what the closing
  all-gather of the weights stages: nothing under nshard (patches.install_parameter_gather sends each
  partition straight into place; likewise a native all-gather, e.g. NCCL), the whole model (w*P) through
  torch's all_gather_into_tensor on gloo (runs before nshard did it in place).
  Under nshard.parameter_sync = "delta" the step's transients add the codec's encoded partitions in flight (one per
  rank) and its chunk temporaries (12 bytes per element of a chunk: 1M elements on the CPU, 64M on a GPU), and
  nothing is staged.
Peak = the largest of the phases (backward, reduce, hand-over, step, all-gather), each the sum of the parts
alive in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog

REDUCE_BUCKET_ELEMENTS = 500_000_000  # deepspeed zero config reduce_bucket_size default (elements)
ADAMW_CHUNK_ELEMENTS = 1 << 18  # nshard/seam/chunked_adamw.py CHUNK_ELEMENTS
STAGE0_BUCKET_ELEMENTS = 500_000_000  # MEMORY_OPT_ALLREDUCE_SIZE: stage 0's flat all-reduce bucket
DEFAULT_BASELINE_BYTES = 480 * 2**20  # a rank with no model (python, torch, deepspeed, gloo, shm): measured
PARTS = ("params", "grads", "accumulators", "error", "pq", "optimizer", "master", "comm", "transient")


@dataclass(frozen=True)
class Shapes:
    """What the model needs of a network: parameter shapes, and dimensions for the activation estimate."""

    shapes: dict[str, tuple[int, ...]]
    layers: int = 0
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    experts: int = 0
    """Experts per layer of a sparse (Mixtral) model; 0: dense."""
    top_k: int = 0
    """Experts each token passes through (a sparse model)."""

    @property
    def params(self) -> int:
        return sum(numel(s) for s in self.shapes.values())

    @property
    def largest(self) -> int:
        return max(numel(s) for s in self.shapes.values())


@dataclass(frozen=True)
class Config:
    stage: int = 0
    reducer: str = "dense"  # "dense" = DeepSpeed's own all-reduce; "powersgd" = nshard's
    bf16: bool = False
    error_place: str = "device"  # "host": on GPU the error memory is in host memory (same RAM on CPU)
    world: int = 2
    rank: int = 32
    min_compression_rate: float = 2.0
    dense_update_with_state: bool = False  # a dense warm-up update after the first one (warm-up >= 2)
    tokens_per_microbatch: int = 256
    microbatches: int = 1  # per rank per update
    microbatch_sums: str = "exact"  # nshard.microbatch_sums
    reduce_bucket_elements: int = REDUCE_BUCKET_ELEMENTS  # zero_optimization.reduce_bucket_size
    # ZeRO's closing all-gather of the weights stages the whole model (torch's all_gather_into_tensor on
    # gloo: runs before patches.install_parameter_gather), or nothing (nshard's in-place ring; native NCCL).
    gather_staged_whole: bool = False
    activation_checkpointing: bool = False  # the ds_config's "activation_checkpointing" section
    delta_bits: int = 0  # nshard.parameter_sync = "delta": its delta_bits; 0: dense parameter sync
    delta_block: int = 256
    device: str = "cpu"  # "cpu" or "cuda": the delta codec's chunk size
    overlap_backward: bool = False  # nshard.overlap_backward: the reduction starts during the last backward

    @property
    def sums_in_error(self) -> bool:
        """The ingest seam adds the compressed matrices' gradients straight into their error memory (never under
        overlap_backward, which always sums into fp32 buffers)."""
        return (self.reducer == "powersgd" and self.error_place == "device" and not self.overlap_backward
                and (self.microbatches == 1 or self.microbatch_sums == "error"))

    @property
    def name(self) -> str:
        extra = "-bf16" if self.bf16 else ""
        extra += "-host" if self.reducer == "powersgd" and self.error_place == "host" else ""
        extra += "-sums" if self.reducer == "powersgd" and (self.stage or self.bf16) and not self.sums_in_error else ""
        extra += "-overlap" if self.overlap_backward else ""
        return f"s{self.stage}-{self.reducer}{extra}"


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def compressed_matrices(shapes: Shapes, rank: int, rate: float):
    """(count, n, m, r) of each compressed parameter (nshard/comm/layout.py's rule): `count` (n, m) matrices of rank r."""
    for name, shape in shapes.shapes.items():
        if len(shape) < 2 or numel(shape) == 0:
            continue
        # A 3-D parameter of an `experts` module is one matrix per expert (nshard/comm/layout.py's stacked()).
        stack = len(shape) == 3 and "experts" in name.split(".")[:-1]
        count, matrix = (shape[0], shape[1:]) if stack else (1, shape)
        n, m = matrix[0], numel(matrix) // matrix[0]
        r = min(rank, n, m)
        if r * (n + m) * rate <= n * m:
            yield count, n, m, r


def compression(shapes: Shapes, rank: int, rate: float) -> tuple[int, int]:
    """(C, PQ): elements in compressed matrices and in their P and Q (nshard/comm/layout.py's rule)."""
    found = list(compressed_matrices(shapes, rank, rate))
    return sum(k * n * m for k, n, m, _ in found), sum(k * r * (n + m) for k, n, m, r in found)


def overlap_flat_bytes(shapes: Shapes, c: Config) -> float:
    """nshard.overlap_backward: the flat buffers of the buckets started during the last backward, alive until the
    reduction waits for them after it (nshard/comm/dense.py start_sum_): every gradient of a dense update (4P), or
    the dense remainder and P's blocks of a compressed one (4D + 4 r n per matrix); both when a dense warm-up update
    runs with state allocated, as the reduce phase counts them."""
    if not c.overlap_backward:
        return 0.0
    P = shapes.params
    if c.reducer != "powersgd":
        return 4.0 * P
    found = list(compressed_matrices(shapes, c.rank, c.min_compression_rate))
    D = P - sum(k * n * m for k, n, m, _ in found)
    compressed = 4 * D + 4 * sum(k * r * n for k, n, _, r in found)
    return float(compressed + (4 * P if c.dense_update_with_state else 0))


def activation_bytes(shapes: Shapes, tokens: int, bf16: bool, checkpointing: bool = False) -> int:
    """An estimate of the saved activations of one microbatch: ~(10h + 4i) values per token per Llama layer (a sparse
    layer: 10h + k(4i + 2h) for its k experts per token and the tokens gathered for them), and the logits with their
    log-softmax and gradient (3V per token, fp32 in the loss). Attention through torch's SDPA (flash or
    memory-efficient kernels) keeps no tokens x tokens matrix. With activation checkpointing each layer keeps only its
    input (h per token) and one layer at a time is recomputed whole in the backward."""
    mlp = shapes.top_k * (4 * shapes.intermediate + 2 * shapes.hidden) if shapes.experts else 4 * shapes.intermediate
    layer = 10 * shapes.hidden + mlp
    kept = shapes.layers * shapes.hidden + layer if checkpointing else shapes.layers * layer
    return tokens * (kept * (2 if bf16 else 4) + 3 * shapes.vocab * 4)


def phases(shapes: Shapes, c: Config) -> dict[str, dict[str, float]]:
    """Bytes per rank of every part alive in each phase of an update."""
    P, L, N = shapes.params, shapes.largest, c.world
    C, PQ = compression(shapes, c.rank, c.min_compression_rate) if c.reducer == "powersgd" else (0, 0)
    D = P - C
    w = 2 if c.bf16 else 4  # bytes of a module weight / gradient element
    zero = c.stage in (1, 2)
    # bf16 at stage 0 with torch's AdamW runs DeepSpeed's FP16_UnfusedOptimizer (bf16 mode): nothing partitioned,
    # whole fp32 masters (engine.optimizer_classes in the receipts says which wrapper ran).
    pooled = zero
    base = {"params": w * P, "optimizer": 8 * P / (N if pooled else 1),
            "master": 4 * P / N if pooled else (4 * P if c.bf16 else 0), "error": 4 * C, "pq": 4 * PQ}
    ingest = c.reducer == "powersgd" and (zero or c.bf16)  # engine.ingest_mode
    if ingest:
        base["accumulators"] = 4 * D if c.sums_in_error else 4 * P
    act = activation_bytes(shapes, c.tokens_per_microbatch, c.bf16, c.activation_checkpointing)
    owned = 4 * P / N  # ZeRO's flat gradient partition (fp32)
    if zero:
        # ZeRO's step holds the owned partition through two transients, one after the other: the gradient
        # norm's fp64 copy of each owned gradient (8L at most), then AdamW's pieces. It releases the
        # partition, then all-gathers the weights; gloo stages what one call gathers before copying it
        # into place. (Sampled RSS: the norm and the whole-model all-gather were each the peak in a run.)
        step_temps = max(8 * min(L, P / N), adamw_temps(c, P / N, P / N))
        staged = w * P if c.gather_staged_whole else 0
        # + the gradient autograd has just produced, which DeepSpeed's hook copies into the bucket and then
        # drops: w*L at most (the model left it out and under-predicted ZeRO-2 dense at one 1.7B layer,
        # whose tied 100M-element embedding makes the peak in backward, by 14%; sampled RSS).
        # With several microbatches ZeRO-1 keeps whole .grad tensors until the update's boundary, where it reduces;
        # ZeRO-2 reduces at every micro-step (FACTS.md).
        whole = w * P if c.stage == 1 and c.microbatches > 1 else 0
        grads_backward = {"grads": w * min(P, c.reduce_bucket_elements) + owned + w * L + whole}
        # The bucket is gone by the step at both stages (one micro-step per update): a stage-1 term for it
        # over-predicted ZeRO-1 by 10-14% on the 1.7B shapes.
        grads_step = {"grads": owned}
    elif c.bf16:  # FP16_UnfusedOptimizer: whole fp32 gradients for the masters, bf16 .grad transient
        step_temps, staged = adamw_temps(c, L, P), None  # None: no all-gather phase
        grads_backward = {"grads": 4 * P + w * L}
        grads_step = {"grads": 4 * P}
    else:
        step_temps, staged = adamw_temps(c, L, P), None
        grads_backward = {"grads": 4 * P}
        grads_step = {"grads": 4 * P}
    if c.delta_bits and zero:
        # The delta sync replaces ZeRO's closing all-gather inside the step: no weights are staged.
        step_temps, staged = step_temps + delta_buffer_bytes(P, c), None
    # nshard.overlap_backward: the buckets' flat buffers are alive at the end of the last backward, with its
    # activations (counted whole: an upper bound, as backward frees them while the buckets start).
    flights = overlap_flat_bytes(shapes, c)
    out = {}
    if ingest:
        # A parameter hook sums each gradient into its accumulator (or error memory) as autograd produces
        # it, so one gradient exists at a time; freed per-parameter tensors go back to the heap, which
        # keeps its high-water mark: the largest one stays in every later phase.
        held = w * L
        out["backward"] = {**base, "comm": flights, "transient": act + held}
        out["reduce"] = {**base, "comm": 4 * D + (4 * P if c.dense_update_with_state else 0), "transient": held}
        if zero:
            # ZeroPartitionWriter: the owned partition, and one matrix's output (4L) while its slice is copied.
            out["hand-over"] = {**base, "grads": owned, "transient": held + 4 * L}
        else:
            # bf16 at stage 0: HandOver's per-parameter gradient (and its rounded copy) into DeepSpeed's hook.
            out["hand-over"] = {**base, **grads_backward, "transient": held + w * L * 2}
        out["step"] = {**base, **grads_step, "transient": step_temps + held}
        if staged is not None:
            out["all-gather"] = {**base, "transient": staged + held}
    else:
        out["backward"] = {**base, **grads_backward, "comm": flights, "transient": act}
        if c.reducer == "dense" and c.stage == 0 and not c.bf16:
            comm = 4 * min(P, STAGE0_BUCKET_ELEMENTS)
        elif c.reducer == "powersgd":
            comm = 4 * D + (4 * P if c.dense_update_with_state else 0)
        else:
            comm = 0  # ZeRO reduces inside its bucket (counted in grads)
        out["reduce"] = {**base, **grads_backward, "comm": comm}
        out["step"] = {**base, **grads_step, "transient": step_temps}
        if staged is not None:
            out["all-gather"] = {**base, "transient": staged}
    return {k: {p: float(v.get(p, 0)) for p in PARTS} for k, v in out.items()}


def adamw_temps(c: Config, largest: float, stepped: float) -> float:
    """torch AdamW's temporaries: on the CPU two pieces of nshard's chunked step (8*min(2^18, the tensor)); on a GPU
    its multi-tensor (foreach) path, which takes the square root of every second moment it steps at once (4 bytes per
    element stepped)."""
    return 4 * stepped if c.device == "cuda" else 8 * min(largest, ADAMW_CHUNK_ELEMENTS)


def delta_buffer_bytes(params: int, c: Config) -> float:
    """nshard/comm/delta.py's buffers in the step: one encoded partition per rank (codes and one fp32 scale per block)
    and the codec's chunk temporaries (~12 bytes per element of a chunk)."""
    owned = params / c.world
    encoded = owned * c.delta_bits / 8 + 4 * owned / c.delta_block
    chunk = (1 << 26) if c.device == "cuda" else 4096 * c.delta_block
    return c.world * encoded + 12 * min(chunk, owned)


def predict(shapes: Shapes, c: Config, baseline_bytes: float = DEFAULT_BASELINE_BYTES) -> dict:
    """The peak phase, its parts (bytes and bytes/parameter) and the total with the no-model baseline."""
    by_phase = phases(shapes, c)
    peak_phase = max(by_phase, key=lambda k: sum(by_phase[k].values()))
    parts = by_phase[peak_phase]
    model_bytes = sum(parts.values())
    return {"config": c.name, "world": c.world, "params": shapes.params, "peak_phase": peak_phase,
            "parts_bytes": parts, "parts_per_param": {k: v / shapes.params for k, v in parts.items()},
            "model_bytes": model_bytes, "baseline_bytes": baseline_bytes, "total_bytes": model_bytes + baseline_bytes}


def device_bytes(pred: dict, c: Config) -> float:
    """On GPU with host error memory, the error leaves the device (one (n, m) M at a time comes back)."""
    moved = pred["parts_bytes"]["error"] if c.reducer == "powersgd" and c.error_place == "host" else 0
    return pred["total_bytes"] - moved


# ---------------------------------------------------------------- shapes from files


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:  # reads the header only
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    if not shapes:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors file")
    return shapes


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """LlamaForCausalLM's parameter shapes from its config.json (tied embeddings: no lm_head)."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not config.get("tie_word_embeddings", False):  # transformers' default: untied
        shapes["lm_head.weight"] = (v, h)
    return shapes


def mixtral_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """MixtralForCausalLM's parameter shapes (transformers 5: fused experts [E, 2I, H] and [E, H, I], a router)."""
    h, i, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    shapes = llama_shapes(config)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del shapes[p + name + ".weight"]
        shapes.update({p + "gate.weight": (e, h), p + "experts.gate_up_proj": (e, 2 * i, h),
                       p + "experts.down_proj": (e, h, i)})
    return shapes


ARCHITECTURES = {"llama": llama_shapes, "mixtral": mixtral_shapes}


def config_shapes(config: dict, shapes: dict[str, tuple[int, ...]] | None = None) -> Shapes:
    """A model's Shapes from its config.json: the parameter shapes given (read from safetensors headers, or built on
    the meta device by the trainer), else derived for the architectures this module knows (ARCHITECTURES)."""
    if shapes is None:
        kind = config.get("model_type", "llama")
        if kind not in ARCHITECTURES:
            raise ValueError(f"model_type {kind!r}: analysis/memory_model.py derives shapes for "
                             f"{', '.join(ARCHITECTURES)} only; give the parameter shapes (the trainer builds them on "
                             "the meta device)")
        shapes = ARCHITECTURES[kind](config)
    experts = config.get("num_local_experts", 0) if config.get("model_type") == "mixtral" else 0
    return Shapes(shapes, config.get("num_hidden_layers", 0), config.get("hidden_size", 0),
                  config.get("intermediate_size", 0), config.get("vocab_size", 0), experts,
                  config.get("num_experts_per_tok", 0) if experts else 0)


def model_shapes(model_dir: Path) -> Shapes:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        shapes = safetensors_shapes(model_dir)
    except FileNotFoundError:
        shapes = None
    return config_shapes(config, shapes)


def smollm2_1_7b(layers: int) -> Shapes:
    config = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
                  vocab_size=49152, num_hidden_layers=layers, tie_word_embeddings=True)
    return Shapes(llama_shapes(config), layers, 2048, 8192, 49152)


# ---------------------------------------------------------------- measured runs


def max_microbatch_tokens(run_dir: Path) -> int:
    """The longest document in the run's prepared inputs (one document per microbatch in the probes)."""
    longest = 0
    for line in (run_dir / "prepared" / "documents.jsonl").read_text().splitlines():
        if line.strip():
            longest = max(longest, len(json.loads(line)["input_ids"]))
    return longest


def arm_config(probe: dict, run_dir: Path, receipt: dict) -> Config:
    ds = json.loads((run_dir / "ds_config.json").read_text())
    section = ds.get("nshard", {})
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summed = {m.get("microbatch_sums") for m in metrics} == {"error memory"}
    # Absent: runs from before the receipt said, which gathered through all_gather_into_tensor.
    in_place = (receipt.get("parameter_all_gather") or {}).get("call", "").startswith("isend/irecv")
    return Config(stage=probe["stage"], reducer=probe["reducer"], bf16=probe["bf16"],
                  error_place=section.get("error_feedback", "device"), world=probe["ranks"],
                  rank=section.get("rank", 32), min_compression_rate=section.get("min_compression_rate", 2.0),
                  dense_update_with_state=section.get("dense_warmup_updates", 0) >= 2,
                  tokens_per_microbatch=max_microbatch_tokens(run_dir),
                  # what the run did: one microbatch summed into the error memory, or separate sums
                  microbatches=1 if summed else 2, microbatch_sums=section.get("microbatch_sums", "exact"),
                  reduce_bucket_elements=int(ds.get("zero_optimization", {}).get(
                      "reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
                  gather_staged_whole=not in_place)


def measured_rows(directory: Path) -> list[dict]:
    """One row per probed arm: prediction, measured peak (max over ranks: host RSS, or GPU allocated on a GPU run;
    measured_bytes) and the receipts' own parts."""
    rows = []
    for probe_path in sorted(Path(directory).glob("*/*/probe.json")):
        probe, run_dir = json.loads(probe_path.read_text()), probe_path.parent
        if probe["arm"] == "base" or probe["outcome"] != "complete":
            continue
        base_path = run_dir.parent / "base" / "probe.json"
        receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
        # A GPU holds nothing of an idle rank's python, torch and DeepSpeed: no baseline without a measured one.
        gpu = measured_bytes(receipts[0]) != receipts[0]["peak_rss_bytes"]
        baseline = measured_peak(base_path.parent) if base_path.is_file() else 0 if gpu else DEFAULT_BASELINE_BYTES
        shapes = model_shapes(run_dir / "model")
        config = arm_config(probe, run_dir, receipts[0])
        pred = predict(shapes, config, baseline)
        measured = max(measured_bytes(r) for r in receipts)
        rows.append({**pred, "model": probe["model"], "measured_bytes": measured,
                     "measured_optimizer_state_bytes": receipts[0].get("optimizer_state_bytes"),
                     "measured_master_param_bytes": receipts[0].get("master_param_bytes"),
                     "cgroup_max_usage_bytes": max(probe["cgroup_max_usage_bytes"]),
                     "error": (pred["total_bytes"] - measured) / measured})
    return rows


def measured_peak(run_dir: Path) -> float:
    return max(measured_bytes(json.loads(p.read_text())) for p in (run_dir / "receipts").glob("rank-*.json"))


def measured_bytes(receipt: dict) -> float:
    """What the prediction is set against: on a GPU run the peak GPU memory allocated (tensors, as the parts
    count them; the receipt keeps the reserved figure beside it), else the peak resident set of the host."""
    if str(receipt.get("device", "cpu")).startswith("cuda") and receipt.get("peak_allocated_bytes") is not None:
        return receipt["peak_allocated_bytes"]
    return receipt["peak_rss_bytes"]


# ---------------------------------------------------------------- a plan's peak, before launch

MARGIN = 0.10
"""Share of the device's memory a plan leaves free: the caching allocator's fragmentation on a GPU, what the parts
leave out (Python objects, the tokenizer, data), and the error of the activation estimate."""
CUDA_RUNTIME_BYTES = 1.5 * 2**30
"""Device memory a GPU rank uses beside torch's tensors (an estimate): the CUDA context and kernels (~0.5 GiB),
NCCL's buffers and cuBLAS's workspaces. torch.cuda.max_memory_allocated() does not count it."""
CAPACITY_ENV = "NSHARD_MEMORY_CAPACITY_GIB"
"""Per-rank memory to plan against, in GiB, in place of the detected device's (a user who knows better)."""
CHECK_ENV = "NSHARD_MEMORY_CHECK"
"""nshard/train.py's memory check: "refuse" (default), "warn" (print the refusal and go on) or "off"."""
CHECK_MODES = ("refuse", "warn", "off")

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)  # nshard/run/models.py TINY_CONFIG
KNOWN_SPECS = {"embedded": "smollm2-135m", "HuggingFaceTB/SmolLM2-135M": "smollm2-135m",
               "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m", "HuggingFaceTB/SmolLM2-1.7B": "smollm2-1.7b",
               "HuggingFaceTB/SmolLM2-1.7B-Instruct": "smollm2-1.7b"}
"""Model specs sized from the configs shipped for random:NAME (nshard/run/configs/NAME.json), without a download."""
_HERE = Path(__file__).resolve().parent
SHIPPED_CONFIGS = next((d for d in (_HERE.parent / "nshard" / "run" / "configs", _HERE.parent / "run" / "configs")
                        if d.is_dir()), _HERE.parent / "nshard" / "run" / "configs")
"""nshard/run/configs/ in a checkout (analysis/ beside nshard/) and installed (nshard/analysis/ inside nshard/)."""


@dataclass(frozen=True)
class Device:
    """Where a rank's peak must fit."""

    name: str
    kind: str
    """"cuda" (the GPU's memory) or "cpu" (this rank's share of the host's memory)."""
    capacity_bytes: float
    source: str
    """Where the capacity came from (torch.cuda, /proc/meminfo, a cgroup, the catalog, NSHARD_MEMORY_CAPACITY_GIB)."""


GPUS = {"L4": Device("NVIDIA L4 (24 GB)", "cuda", 22.5 * 2**30, "catalog"),
        "A100-40GB": Device("NVIDIA A100 (40 GB)", "cuda", 39.4 * 2**30, "catalog"),
        "A100-80GB": Device("NVIDIA A100 (80 GB)", "cuda", 79.1 * 2**30, "catalog"),
        "H100-80GB": Device("NVIDIA H100 (80 GB)", "cuda", 79.1 * 2**30, "catalog"),
        "H200": Device("NVIDIA H200 (141 GB)", "cuda", 139.0 * 2**30, "catalog")}
"""Common GPUs with the memory torch.cuda reports for them (total_memory, rounded down), smallest first."""


def host_memory() -> tuple[float, str]:
    """This machine's memory (bytes) and where it was read: the cgroup's limit where one is set, else MemTotal."""
    total, source = None, "/proc/meminfo MemTotal"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < (total or float("inf")):
            total, source = int(limit), str(path)
    if total is None:
        raise OSError("/proc/meminfo has no MemTotal: give the capacity with " + CAPACITY_ENV)
    return float(total), source


def detect_device(local_ranks: int = 1) -> Device:
    """This process's device: its GPU where the trainer has torch loaded and CUDA present (analysis imports no torch:
    it reads what the process already loaded), else its share of the host's memory among `local_ranks` ranks."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        return Device(props.name, "cuda", float(props.total_memory), f"torch.cuda device {index}")
    total, source = host_memory()
    share = f"host memory / {local_ranks} ranks" if local_ranks > 1 else "host memory"
    return Device(share, "cpu", total / local_ranks, source)


def resolve_device(device, local_ranks: int = 1) -> Device:
    """A Device from None or "auto" (detect_device), "cpu" (host memory), a GPUS key, or a Device; then
    NSHARD_MEMORY_CAPACITY_GIB, when set, replaces its capacity."""
    if isinstance(device, Device):
        found = device
    elif device in (None, "auto", "cuda"):
        found = detect_device(local_ranks)
        if device == "cuda" and found.kind != "cuda":
            raise ValueError("device \"cuda\": this process sees no GPU; name one (" + ", ".join(GPUS) + ")")
    elif device == "cpu":
        total, source = host_memory()
        found = Device(f"host memory / {local_ranks} ranks" if local_ranks > 1 else "host memory", "cpu",
                       total / local_ranks, source)
    else:
        key = next((k for k in GPUS if k.lower() == str(device).lower()), None)
        if key is None:
            raise ValueError(f"device {device!r}: use cpu, auto or one of {', '.join(GPUS)}")
        found = GPUS[key]
    override = os.environ.get(CAPACITY_ENV, "").strip()
    if override:
        try:
            gib_ = float(override)
        except ValueError:
            gib_ = -1.0
        if not gib_ > 0:
            raise ValueError(f"{CAPACITY_ENV}={override!r}: give the per-rank memory in GiB, e.g. 79")
        found = dataclasses.replace(found, capacity_bytes=gib_ * 2**30, source=f"{CAPACITY_ENV}={override}")
    return found


def spec_config(spec: str) -> dict:
    """The config (config.json's fields) of a model spec: tiny, random:NAME[:SEED] (its shipped config; a grown one's
    Mixtral), a hub id whose config is shipped, a local directory's config.json, or a hub id's config.json in the
    Hugging Face cache; read only, never downloaded."""
    if spec == "tiny" or spec.startswith("tiny:"):
        return dict(TINY)
    if spec.startswith("random:") or spec in KNOWN_SPECS:
        name = spec.split(":")[1] if spec.startswith("random:") else KNOWN_SPECS[spec]
        path = SHIPPED_CONFIGS / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"model {spec!r}: no {path}")
        config = json.loads(path.read_text())
        if "grown_from" in config:
            growth = config["growth"]
            return grown_config(spec_config(f"random:{config['grown_from']}"), growth["experts"], growth["top_k"])
        return config
    local = Path(spec).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")) / "hub")
    for found in sorted(hub.glob(f"models--{spec.replace('/', '--')}/snapshots/*/config.json")):
        return json.loads(found.read_text())
    raise ValueError(f"model {spec!r}: no config.json to size it from (not tiny, random:NAME, a local directory, or a "
                     "hub id in the Hugging Face cache); give its directory")


def grown_config(config: dict, experts: int, top_k: int) -> dict:
    """The Mixtral config nshard/grow.py makes of a Llama config (E experts per layer, top-k routing)."""
    return {**config, "model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": top_k}


def run_config(plan, ds_config: dict, world: int, device: Device, microbatch_docs: int | None = None) -> Config:
    """The memory model's Config of a plan and ds_config on `world` ranks (bf16 "auto": on a GPU, on the CPU off, as
    DeepSpeed on a CPU without bf16 units)."""
    zero = ds_config.get("zero_optimization", {})
    section = ds_config.get("nshard") or {}
    bf16 = any(v == "auto" and device.kind == "cuda" or v is True
               for v in (ds_config.get(k, {}).get("enabled") for k in ("bf16", "bfloat16")))
    reducer = section.get("reducer", "dense")
    docs = microbatch_docs or plan.train.microbatch_docs
    delta = section.get("parameter_sync", "dense") == "delta"
    return Config(stage=zero.get("stage", 0), reducer=reducer, bf16=bf16,
                  error_place=section.get("error_feedback", "device"), world=world, rank=section.get("rank", 32),
                  min_compression_rate=section.get("min_compression_rate", 2.0),
                  dense_update_with_state=reducer == "powersgd" and section.get("dense_warmup_updates", 8) >= 2,
                  tokens_per_microbatch=docs * plan.model.max_length,
                  microbatches=math.ceil(math.ceil(plan.train.global_batch_docs / world) / docs),
                  microbatch_sums=section.get("microbatch_sums", "exact"),
                  reduce_bucket_elements=int(zero.get("reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
                  activation_checkpointing="activation_checkpointing" in ds_config,
                  delta_bits=section.get("delta_bits", 4) if delta else 0, delta_block=section.get("delta_block", 256),
                  device=device.kind, overlap_backward=section.get("overlap_backward") is True)


PART_LABELS = {"weights": "weights", "gradients": "gradients", "microbatch_sums": "microbatch sums",
               "error_memory": "PowerSGD error memory", "powersgd_pq": "PowerSGD P/Q",
               "optimizer_moments": "optimizer moments", "masters": "fp32 masters",
               "comm_buffers": "communication buffers", "delta_buffers": "delta sync buffers",
               "activations": "activations (estimate)", "temporaries": "temporaries", "runtime": "runtime"}
_RENAMED = {"params": "weights", "grads": "gradients", "accumulators": "microbatch_sums", "error": "error_memory",
            "pq": "powersgd_pq", "optimizer": "optimizer_moments", "master": "masters", "comm": "comm_buffers",
            "transient": "temporaries"}


def assess(shapes: Shapes, c: Config, device: Device) -> dict:
    """The predicted per-rank peak of `c` on `device`, part by part, and whether it fits under the margin."""
    cuda = device.kind == "cuda"
    runtime = CUDA_RUNTIME_BYTES if cuda else DEFAULT_BASELINE_BYTES
    pred = predict(shapes, c, runtime)
    phase = pred["peak_phase"]
    parts = {_RENAMED[k]: v for k, v in pred["parts_bytes"].items()}
    if cuda and c.reducer == "powersgd" and c.error_place == "host":
        parts["error_memory"] = 0.0  # in the host's memory: one (n, m) M at a time comes to the GPU
    if phase == "backward":
        parts["activations"] = activation_bytes(shapes, c.tokens_per_microbatch, c.bf16, c.activation_checkpointing)
        parts["temporaries"] -= parts["activations"]
    if phase == "step" and c.delta_bits and c.stage in (1, 2):
        parts["delta_buffers"] = delta_buffer_bytes(shapes.params, c)
        parts["temporaries"] -= parts["delta_buffers"]
    allocated = sum(parts.values())
    parts["runtime"] = runtime
    peak = allocated + runtime
    usable = device.capacity_bytes * (1 - MARGIN)
    return {"device": device.name, "device_kind": device.kind, "capacity_bytes": device.capacity_bytes,
            "capacity_source": device.source, "margin": MARGIN, "usable_bytes": usable, "peak_bytes": peak,
            "allocated_bytes": allocated, "peak_phase": phase, "parts": parts, "config": c.name, "world": c.world,
            "params": shapes.params, "tokens_per_microbatch": c.tokens_per_microbatch,
            "microbatches": c.microbatches, "fits": peak <= usable, "fix": None}


def fixes(plan, shapes: Shapes, config: dict | None, c: Config, device: Device):
    """Settings that lower the peak, in the order they are offered: (what to set, the changed Config, Shapes, Device)."""
    ingest = c.reducer == "powersgd" and (c.stage in (1, 2) or c.bf16)
    if c.stage < 2 and c.world > 1:
        yield "zero_optimization.stage = 2", dataclasses.replace(c, stage=2), shapes, device
    if c.overlap_backward:
        yield "nshard.overlap_backward = false", dataclasses.replace(c, overlap_backward=False), shapes, device
    if ingest and c.microbatches > 1 and c.microbatch_sums == "exact" and c.error_place == "device" \
            and not c.overlap_backward:  # refused with overlap_backward (nshard/comm/config.py)
        yield "nshard.microbatch_sums = \"error\"", dataclasses.replace(c, microbatch_sums="error"), shapes, device
    if device.kind == "cuda" and not c.bf16:
        yield "bf16.enabled = true", dataclasses.replace(c, bf16=True), shapes, device
    if device.kind == "cuda" and c.reducer == "powersgd" and c.error_place == "device":
        yield "nshard.error_feedback = \"host\"", dataclasses.replace(c, error_place="host"), shapes, device
    if not c.activation_checkpointing:
        yield "\"activation_checkpointing\": {} in the ds_config", \
            dataclasses.replace(c, activation_checkpointing=True), shapes, device
    if c.dense_update_with_state:
        yield "nshard.dense_warmup_updates = 1", dataclasses.replace(c, dense_update_with_state=False), shapes, device
    docs = c.tokens_per_microbatch // plan.model.max_length
    while docs > 1:
        docs //= 2
        yield f"train.microbatch_docs = {docs}", dataclasses.replace(
            c, tokens_per_microbatch=docs * plan.model.max_length,
            microbatches=math.ceil(math.ceil(plan.train.global_batch_docs / c.world) / docs)), shapes, device
    if config is not None and shapes.experts > 2:
        for experts in range(shapes.experts - 1, 1, -1):
            smaller = config_shapes(grown_config(config, experts, min(shapes.top_k, experts)))
            yield f"growth.experts = {experts}", c, smaller, device


def find_fix(plan, shapes: Shapes, config: dict | None, c: Config, device: Device) -> str:
    """The listed settings (fixes), taken in order while each lowers the peak, until the plan fits; then those it can
    do without are dropped. Else one setting alone that fits; else the smallest listed GPU that holds the plan as it
    is, or what is left to try."""
    chosen: list[tuple[str, dict, Shapes]] = []  # (setting, the Config fields it changes, the Shapes it gives)
    larger = [d for d in GPUS.values() if device.kind == "cuda" and d.capacity_bytes > device.capacity_bytes
              and assess(shapes, c, d)["fits"]]
    bigger = f"a GPU with more memory as the plan stands: {larger[0].name}" if larger else ""

    def build(settings):
        fields, model = {}, shapes
        for _, changed, changed_shapes in settings:
            fields.update(changed)
            model = changed_shapes
        return assess(model, dataclasses.replace(c, **fields), device)

    offered = [(label, {f.name: getattr(changed, f.name) for f in dataclasses.fields(c)
                        if getattr(changed, f.name) != getattr(c, f.name)}, changed_shapes)
               for label, changed, changed_shapes, _ in fixes(plan, shapes, config, c, device)]
    for label, delta, changed_shapes in offered:
        key = label.split(" = ")[0]  # a smaller microbatch, or fewer experts, replaces the one before
        trial = [x for x in chosen if x[0].split(" = ")[0] != key] + [(label, delta, changed_shapes)]
        if build(trial)["peak_bytes"] < build(chosen)["peak_bytes"]:
            chosen = trial
        if build(chosen)["fits"]:
            break
    if not build(chosen)["fits"]:  # in order they do not get there: one setting alone may (a bf16 taken first did not)
        chosen = next(([x] for x in offered if build([x])["fits"]), chosen)
    if chosen and build(chosen)["fits"]:
        for setting in list(chosen):
            fewer = [x for x in chosen if x is not setting]
            if build(fewer)["fits"]:
                chosen = fewer
        fix = f"{' and '.join(x[0] for x in chosen)} (predicted {gib(build(chosen)['peak_bytes'])} GiB)"
        return fix + (f", or {bigger}" if bigger else "")
    if bigger:
        return bigger
    return (f"no listed setting suffices (with all of them: {gib(build(chosen)['peak_bytes'])} GiB): ZeRO-2 over more "
            f"ranks, or a {'GPU' if device.kind == 'cuda' else 'machine'} with more memory")


def plan_peak(plan, ds_config: dict, world_size: int, device=None, *, model_dir=None,
              shapes: dict[str, tuple[int, ...]] | None = None, spec: str | None = None, grown: bool = False) -> dict:
    """The predicted per-rank peak of `plan` (nshard.run.plan.Plan, or anything with its model/train/growth fields)
    with `ds_config` on `world_size` ranks, on `device` (None: this process's GPU where CUDA is present, else its share
    of host memory; "cpu"; a GPUS key; a Device). The model comes from `model_dir`'s config.json (and `shapes`, e.g.
    built on the meta device, or its safetensors headers), else from `spec` or the plan's model.spec (spec_config);
    `grown` makes it the Mixtral a growth study grows from it. Returns {device, capacity_bytes, peak_bytes,
    allocated_bytes (tensors: what torch.cuda.max_memory_allocated measures), parts {name: bytes}, peak_phase, fits,
    fix (the setting that would make it fit, or None), ...}. Activations are an estimate (activation_bytes)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: give the number of ranks, 1 or more")
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
                or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or world_size)  # ranks sharing this host (mpirun: OMPI_*)
    dev = resolve_device(device, local)
    if model_dir is not None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if shapes is None:
            try:
                shapes = safetensors_shapes(Path(model_dir))
            except FileNotFoundError:
                shapes = None
    else:
        config = spec_config(spec or plan.model.spec)
    if grown:
        config, shapes = grown_config(config, plan.growth.experts, plan.growth.top_k), None
    model = config_shapes(config, shapes)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise ValueError("zero_optimization.stage = 3 is not in analysis/memory_model.py's model (stages 0-2)")
    c = run_config(plan, ds_config, world_size, dev)
    report = assess(model, c, dev)
    if not report["fits"]:
        report["fix"] = find_fix(plan, model, config if model.experts else None, c, dev)
    return report


def refusal(report: dict, what: str) -> str:
    """One line: what does not fit where, by how much, the largest parts, the fix, and how to override."""
    parts = sorted(((v, k) for k, v in report["parts"].items() if v > 0), reverse=True)[:3]
    largest = ", ".join(f"{PART_LABELS[k]} {gib(v)}" for v, k in parts)
    return (f"{what} needs ~{gib(report['peak_bytes'])} GiB per rank ({report['config']}, {report['peak_phase']} "
            f"phase) but {report['device']} holds {gib(report['capacity_bytes'])} GiB, {gib(report['usable_bytes'])} "
            f"after the {report['margin']:.0%} margin: over by {gib(report['peak_bytes'] - report['usable_bytes'])} GiB, "
            f"the largest parts being {largest} GiB; fix: {report['fix']}. Memory model: analysis/memory_model.py; "
            f"if you know better, set {CAPACITY_ENV} or {CHECK_ENV}=warn")


def summary(report: dict) -> str:
    return (f"predicted peak ~{gib(report['peak_bytes'])} GiB per rank of {gib(report['usable_bytes'])} usable on "
            f"{report['device']} ({report['config']}, {report['peak_phase']} phase)")


# ---------------------------------------------------------------- tables


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(rows: list[dict], measured: bool) -> str:
    head = ["model", "config", "N", "params (M)", "peak phase", *[f"{p} B/p" for p in PARTS], "predicted GiB"]
    head += ["measured GiB", "pred-meas"] if measured else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.get("model", ""), r["config"], str(r["world"]), f"{r['params'] / 1e6:.1f}", r["peak_phase"],
                 *[f"{r['parts_per_param'][p]:.2f}" for p in PARTS], gib(r["total_bytes"])]
        if measured:
            cells += [gib(r["measured_bytes"]), f"{100 * r['error']:+.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def capacity(config: Config, cap_bytes: float, baseline: float, max_layers: int = 64) -> int:
    """The deepest SmolLM2-1.7B-shaped model whose predicted peak fits under cap_bytes (0: none)."""
    best = 0
    for layers in range(1, max_layers + 1):
        if predict(smollm2_1_7b(layers), config, baseline)["total_bytes"] > cap_bytes:
            break
        best = layers
    return best


def ratios(shapes: Shapes, worlds=(2, 3, 4, 8), baseline: float = DEFAULT_BASELINE_BYTES) -> str:
    """Predicted per-rank bytes of one rank at stage 0 over those of N ranks of ZeRO-2 (the size of model the same
    cap holds, at this depth), like with like (bf16 against bf16 at stage 0). ZeRO's closing all-gather of the
    weights in place (nshard on gloo; a native NCCL all-gather likewise), or "whole model staged": through torch's
    all_gather_into_tensor on gloo, as DeepSpeed does it."""
    def per_rank(c: Config) -> float:
        return device_bytes(predict(shapes, c, baseline), c)
    one = {bf16: per_rank(Config(stage=0, world=1, bf16=bf16)) for bf16 in (False, True)}
    head = ["N", "ZeRO-2 dense fp32", "ZeRO-2 PowerSGD fp32", "same, whole model staged",
            "same, separate microbatch sums", "ZeRO-2 PowerSGD bf16", "same, whole model staged"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in worlds:
        fp32 = [Config(stage=2, world=n), Config(stage=2, reducer="powersgd", world=n),
                Config(stage=2, reducer="powersgd", world=n, gather_staged_whole=True),
                Config(stage=2, reducer="powersgd", world=n, microbatches=2)]
        bf16 = [Config(stage=2, reducer="powersgd", world=n, bf16=True),
                Config(stage=2, reducer="powersgd", world=n, bf16=True, gather_staged_whole=True)]
        row = [one[False] / per_rank(c) for c in fp32] + [one[True] / per_rank(c) for c in bf16]
        lines.append("| " + " | ".join([str(n)] + [f"{r:.2f}x" for r in row]) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.analysis.memory_model"), description=__doc__,
                            epilog="Writes nothing unless --json FILE is given: prints the table. " + SPELLING_NOTE)
    parser.add_argument("--measured", help="a launch/memory_probe.py output directory")
    parser.add_argument("--model_dir", help="predict for this transformers model directory")
    parser.add_argument("--layers", type=int, default=None, help="predict for a SmolLM2-1.7B-shaped model of LAYERS")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per microbatch (activations)")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per rank per update")
    parser.add_argument("--ratios", action="store_true",
                        help="print how much larger a model N pooled ranks hold than one rank at stage 0")
    parser.add_argument("--json", help="also write the rows here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (OSError, KeyError, TypeError, ValueError) as exc:  # a bad directory or file: one line, exit 2
        print(f"memory_model: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def run(args) -> int:
    if args.measured:
        rows = measured_rows(Path(args.measured))
        if not rows:
            print(f"memory_model: error: no completed probe arms under {args.measured}", file=sys.stderr)
            return 2
        print(render(rows, measured=True), end="")
    else:
        shapes = model_shapes(Path(args.model_dir)) if args.model_dir else smollm2_1_7b(args.layers or 24)
        if args.ratios:
            print(ratios(shapes), end="")
            return 0
        rows = []
        for stage in (0, 1, 2):
            for reducer in ("dense", "powersgd"):
                for bf16 in (False, True):
                    c = Config(stage=stage, reducer=reducer, bf16=bf16, world=args.world,
                               tokens_per_microbatch=args.tokens, microbatches=args.microbatches)
                    rows.append({**predict(shapes, c), "model": "given"})
        print(render(rows, measured=False), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
