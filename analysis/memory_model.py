"""Per-rank memory of nshard's configurations (ZeRO stage x reducer x precision x error-memory place x ranks),
predicted part by part from the parameter shapes, and set against measured peaks. Reads files only (no torch).

    python -m nshard.analysis.memory_model --measured runs/memory-probe          # predicted vs measured
    python -m nshard.analysis.memory_model --model-dir DIR --world 2             # predictions for a model
    python -m nshard.analysis.memory_model --layers 24 --ratios                  # pooled vs one rank at stage 0

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
  their error memory (one microbatch per update, or microbatch_sums "error").
- error: PowerSGD's fp32 error memory, one (n, m) matrix per compressed parameter (4C).
- pq: the flat P and Q buffers, r(n+m) floats per compressed matrix.
- optimizer: AdamW exp_avg + exp_avg_sq (8P; 8P/N under ZeRO-1/2).
- master: fp32 master weights (ZeRO's single_partition_of_fp32_groups, 4P/N; 0 at stage 0 fp32; 4P at stage 0
  bf16, where torch's AdamW gets DeepSpeed's FP16_UnfusedOptimizer in bf16 mode: whole fp32 masters).
- comm: flat buffers that exist only while reducing (stage-0 bucket 4*min(P, 5e8); a dense flat
  all-reduce of the reducer's remainder, 4D; 4P when a dense warm-up update runs with state allocated).
- transient: the ingest seam's one gradient at a time (a parameter hook sums each into its accumulator as
  autograd produces it; the heap keeps the largest, w*L), one matrix's output while it is written into
  ZeRO's partition (4L), AdamW's temporaries (two pieces: 8*min(2^18, the tensor)), activations; in ZeRO-1/2's
  step, one after another, the gradient norm's fp64 copy of an owned gradient (8L), and what the closing
  all-gather of the weights stages: nothing under nshard (engine.gather_parameters_in_place sends each
  partition straight into place; likewise a native all-gather, e.g. NCCL), the whole model (w*P) through
  torch's all_gather_into_tensor on gloo (runs before nshard did it in place).
Peak = the largest of the phases (backward, reduce, hand-over, step, all-gather), each the sum of the parts
alive in it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

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
    # gloo: runs before engine.gather_parameters_in_place), or nothing (nshard's in-place ring; native NCCL).
    gather_staged_whole: bool = False

    @property
    def sums_in_error(self) -> bool:
        """The ingest seam adds the compressed matrices' gradients straight into their error memory."""
        return (self.reducer == "powersgd" and self.error_place == "device"
                and (self.microbatches == 1 or self.microbatch_sums == "error"))

    @property
    def name(self) -> str:
        extra = "-bf16" if self.bf16 else ""
        extra += "-host" if self.reducer == "powersgd" and self.error_place == "host" else ""
        extra += "-sums" if self.reducer == "powersgd" and (self.stage or self.bf16) and not self.sums_in_error else ""
        return f"s{self.stage}-{self.reducer}{extra}"


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def compression(shapes: Shapes, rank: int, rate: float) -> tuple[int, int]:
    """(C, PQ): elements in compressed matrices and in their P and Q (nshard/comm/layout.py's rule)."""
    compressed = pq = 0
    for shape in shapes.shapes.values():
        if len(shape) < 2 or numel(shape) == 0:
            continue
        n, m = shape[0], numel(shape) // shape[0]
        r = min(rank, n, m)
        if r * (n + m) * rate <= n * m:
            compressed, pq = compressed + n * m, pq + r * (n + m)
    return compressed, pq


def activation_bytes(shapes: Shapes, tokens: int, bf16: bool) -> int:
    """Saved activations of one microbatch: ~(10h + 4i) values per token per Llama layer, and the logits
    with their log-softmax and gradient (3V per token, fp32 in the loss)."""
    per_token = shapes.layers * (10 * shapes.hidden + 4 * shapes.intermediate) * (2 if bf16 else 4)
    return tokens * (per_token + 3 * shapes.vocab * 4)


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
    act = activation_bytes(shapes, c.tokens_per_microbatch, c.bf16)
    owned = 4 * P / N  # ZeRO's flat gradient partition (fp32)
    if zero:
        # ZeRO's step holds the owned partition through two transients, one after the other: the gradient
        # norm's fp64 copy of each owned gradient (8L at most), then AdamW's pieces. It releases the
        # partition, then all-gathers the weights; gloo stages what one call gathers before copying it
        # into place. (Sampled RSS: the norm and the whole-model all-gather were each the peak in a run.)
        step_temps = max(8 * min(L, P / N), 8 * min(P / N, ADAMW_CHUNK_ELEMENTS))
        staged = w * P if c.gather_staged_whole else 0
        # + the gradient autograd has just produced, which DeepSpeed's hook copies into the bucket and then
        # drops: w*L at most (the model left it out and under-predicted ZeRO-2 dense at one 1.7B layer,
        # whose tied 100M-element embedding makes the peak in backward, by 14%; sampled RSS).
        grads_backward = {"grads": w * min(P, c.reduce_bucket_elements) + owned + w * L}
        # The bucket is gone by the step at both stages (one micro-step per update): a stage-1 term for it
        # over-predicted ZeRO-1 by 10-14% on the 1.7B shapes.
        grads_step = {"grads": owned}
    elif c.bf16:  # FP16_UnfusedOptimizer: whole fp32 gradients for the masters, bf16 .grad transient
        step_temps, staged = 8 * min(L, ADAMW_CHUNK_ELEMENTS), None  # None: no all-gather phase
        grads_backward = {"grads": 4 * P + w * L}
        grads_step = {"grads": 4 * P}
    else:
        step_temps, staged = 8 * min(L, ADAMW_CHUNK_ELEMENTS), None
        grads_backward = {"grads": 4 * P}
        grads_step = {"grads": 4 * P}
    out = {}
    if ingest:
        # A parameter hook sums each gradient into its accumulator (or error memory) as autograd produces
        # it, so one gradient exists at a time; freed per-parameter tensors go back to the heap, which
        # keeps its high-water mark: the largest one stays in every later phase.
        held = w * L
        out["backward"] = {**base, "transient": act + held}
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
        out["backward"] = {**base, **grads_backward, "transient": act}
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
    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        shapes.update({name: tuple(info["shape"]) for name, info in header.items()})
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
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def model_shapes(model_dir: Path) -> Shapes:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        shapes = safetensors_shapes(model_dir)
    except FileNotFoundError:
        shapes = llama_shapes(config)
    return Shapes(shapes, config.get("num_hidden_layers", 0), config.get("hidden_size", 0),
                  config.get("intermediate_size", 0), config.get("vocab_size", 0))


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", help="a launch/memory_probe.py output directory")
    parser.add_argument("--model-dir", help="predict for this transformers model directory")
    parser.add_argument("--layers", type=int, default=None, help="predict for a SmolLM2-1.7B-shaped model of LAYERS")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per microbatch (activations)")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per rank per update")
    parser.add_argument("--ratios", action="store_true",
                        help="print how much larger a model N pooled ranks hold than one rank at stage 0")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
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
