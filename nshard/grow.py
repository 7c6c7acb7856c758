"""Growth (`python -m nshard.grow`): a Llama export grown into a sparse model transformers ships, sealed with its own
manifest and provenance. Two designs (docs/growth.md#upcycling):
- `--architecture qwen2_moe`: Qwen2-MoE, the accepted MLP kept as the shared expert, E new routed experts (zero down
  projections) and a router whose un-renormalized top-k probabilities scale them, so the task loss trains it;
- `--architecture mixtral` (the default, the first design): E copies of each MLP behind a top-k router that
  renormalizes the chosen weights, so at top 1 its router learns from the load-balancing loss alone.

    python -m nshard.grow --from SOURCE --out DIR [--architecture mixtral] [--experts 4] [--top_k 2] [--seed 0]
        [--router_std 0.02] [--aux_coef 0.01] [--expert_size 0] [--freeze none]

SOURCE is an accepted study (its candidate's export, checked as a second cohort checks it) or an nshard run
directory (its model/ and run.json). Either design's logits equal the dense model's up to fp32 rounding before
training (tests/test_grow.py checks both in a process that never imports nshard).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.commit import files_sha256, model_files
from nshard.evidence.export import GROWN, MANIFEST, ManifestError, verify_manifest, write_manifest
from nshard.files import file_sha256, staged_dir
from nshard.run.plan import upcycling_problem
from nshard.run.receipts import parameter_root
from nshard.run.upcycle import FREEZE, shared_expert_state, upcycled_state

CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
           "initializer_range", "rope_parameters")
"""The Llama settings a Mixtral config takes over unchanged."""
REFUSED = {"attention_bias": False, "mlp_bias": False}
"""Llama settings neither design can express (Mixtral has no biases, Qwen2-MoE no output or MLP bias): a source
with another value is refused."""
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


class GrowError(ValueError):
    """A source or setting that cannot be upcycled; the message names it and the fix."""


@dataclass(frozen=True)
class Growth:
    experts: int = 4
    top_k: int = 2
    seed: int = 0
    router_std: float = 0.02
    aux_coef: float = 0.01
    """router_aux_loss_coef of the grown config: the weight of the load-balancing loss nshard adds in training."""
    architecture: str = "mixtral"
    """"mixtral" (copies, renormalized top-k) or "qwen2_moe" (shared expert, new routed experts, learned router)."""
    expert_size: int = 0
    """qwen2_moe: each routed expert's intermediate size; 0: the MLP's."""
    freeze: str = "none"
    """qwen2_moe: what training keeps fixed (nshard/run/upcycle.py FREEZE)."""

    def check(self) -> None:
        problem = upcycling_problem(**self.__dict__)
        if problem:
            key, text = problem
            raise GrowError(f"--{key} {getattr(self, key)}: {text}")

    def record(self) -> dict:
        """The settings as the manifest records them: a mixtral growth's as before qwen2_moe existed, so an earlier
        grown export still matches the plan that made it."""
        return ({k: v for k, v in self.__dict__.items() if k in LEGACY} if self.architecture == "mixtral"
                else dict(self.__dict__))


LEGACY = ("experts", "top_k", "seed", "router_std", "aux_coef")


def source_export(source: Path) -> tuple[Path, dict]:
    """The export to grow from and its provenance: an accepted study's candidate (checked as a cohort checks it:
    committed, judged, passed, export untouched) or a run directory's sealed export and run.json."""
    source = Path(source)
    if (source / "study.json").is_file():
        from nshard.run.cohort import CohortError
        from nshard.run.start import accepted_export

        try:
            model_dir, provenance = accepted_export(source)
        except CohortError as exc:
            raise GrowError(str(exc).replace("cohort.from", "--from")) from None
        return model_dir, {"kind": "accepted study", **provenance}
    run_json = source / "run.json"
    if not run_json.is_file() or not (source / "model").is_dir():
        raise GrowError(f"--from {source}: neither a study directory (study.json) nor a finished nshard run "
                        "directory (run.json and model/); name the directory python -m nshard.study or "
                        "nshard/train.py wrote")
    run = json.loads(run_json.read_text())
    if run.get("status") != "complete":
        raise GrowError(f"--from {source}: {run_json} says status={run.get('status')!r}; grow a finished run")
    try:
        manifest = verify_manifest(source / "model")
    except ManifestError as exc:
        raise GrowError(f"--from {source}: its export does not match its manifest: {exc}") from None
    return source / "model", {"kind": "run", "run_dir": str(source.resolve()), "run_json_sha256": file_sha256(run_json),
                              "parameter_root": manifest["parameter_root"]}


def carried_settings(llama) -> dict:
    """The Llama settings a grown config takes over; a Llama with a bias neither design has is refused."""
    if llama.model_type != "llama":
        raise GrowError(f"the source export is a {llama.model_type!r} model; nshard.grow upcycles Llama models")
    for key, wanted in REFUSED.items():
        if getattr(llama, key, wanted) != wanted:
            raise GrowError(f"the source config has {key}={getattr(llama, key)!r}; the grown model has no such "
                            "bias, so it cannot be upcycled exactly")
    return {key: getattr(llama, key) for key in CARRIED if getattr(llama, key, None) is not None}


def mixtral_config(llama, growth: Growth):
    from transformers import MixtralConfig

    return MixtralConfig(**carried_settings(llama), num_local_experts=growth.experts, num_experts_per_tok=growth.top_k,
                         router_jitter_noise=0.0, output_router_logits=False, sliding_window=None,
                         router_aux_loss_coef=growth.aux_coef)


def qwen2_moe_config(llama, growth: Growth):
    """Qwen2-MoE with every layer sparse (decoder_sparse_step 1, no mlp_only_layers), no q/k/v bias (Llama has none),
    Llama's RoPE, norms and tied embeddings, the shared expert the MLP's size, and norm_topk_prob = false: the
    router's top-k probabilities scale the experts as they are."""
    from transformers import Qwen2MoeConfig

    carried = carried_settings(llama)
    size = growth.expert_size or carried["intermediate_size"]
    return Qwen2MoeConfig(**carried, num_experts=growth.experts, num_experts_per_tok=growth.top_k,
                          moe_intermediate_size=size, shared_expert_intermediate_size=carried["intermediate_size"],
                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=False,
                          use_sliding_window=False, output_router_logits=False, router_aux_loss_coef=growth.aux_coef)


def upcycle(model_dir: Path, growth: Growth):
    """The grown MixtralForCausalLM and its tokenizer, from a Llama transformers directory, in the dtype the source's
    weights are stored in: a bf16-trained export grows into bf16 tensors, so the trainer, which computes in the
    candidate's precision, holds exactly the grown weights and their parameter root (an fp32 router would be
    rounded when a bf16 engine takes the model, and the root the arm checks would differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    growth.check()
    llama_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    qwen = growth.architecture == "qwen2_moe"
    config = (qwen2_moe_config if qwen else mixtral_config)(llama_config, growth)
    dtype = stored_dtype(model_dir)
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    tensors = dict(dense.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if qwen:
        state = shared_expert_state(tensors, config.num_hidden_layers, growth, config.hidden_size,
                                    config.moe_intermediate_size)
    else:
        state = upcycled_state(tensors, config.num_hidden_layers, growth, config.hidden_size)
    torch.manual_seed(growth.seed)  # transformers' own init of the tensors load_state_dict then replaces
    grown = AutoModelForCausalLM.from_config(config).to(dtype)
    missing, unexpected = grown.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise GrowError(f"{model_dir}: the upcycled tensors do not fit {type(grown).__name__} (missing "
                        f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); is the source a plain Llama "
                        "export?")
    if config.tie_word_embeddings:
        grown.tie_weights()
    return grown.eval(), AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The one floating dtype of a transformers directory's safetensors weights (fp32 where they mix dtypes)."""
    from safetensors import safe_open

    dtypes = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            dtypes |= {f.get_slice(key).get_dtype() for key in f.keys()}
    by_name = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    return by_name.get(dtypes.pop(), torch.float32) if len(dtypes) == 1 else torch.float32


def parameter_counts(model, growth: Growth) -> dict:
    """All parameters, the routed experts' share, the routers', those one token passes through (top_k of E routed
    experts per layer, the routers and any shared expert included), and (qwen2_moe) those of them `growth.freeze`
    keeps fixed: what a FLOPs budget prices a token at (nshard/run/budget.py HOW)."""
    from nshard.run.budget import parameter_cost, router_parameters
    from nshard.run.upcycle import frozen_names

    frozen = set(frozen_names([n for n, _ in model.named_parameters()], growth.freeze))
    active, frozen_active = parameter_cost(model, frozen)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "expert_parameters": sum(p.numel() for name, p in model.named_parameters() if ".experts." in name),
            "router_parameters": router_parameters(model), "active_parameters_per_token": active,
            **({"frozen_active_parameters_per_token": frozen_active} if growth.architecture != "mixtral" else {})}


def grow(source: Path, out: Path, growth: Growth) -> dict:
    """Upcycle the source's export into `out` (staged, then one rename) and seal it; returns the manifest."""
    out = Path(out)
    if out.exists():
        raise GrowError(f"--out {out} already exists; choose a new directory (a grown export is never replaced)")
    model_dir, provenance = source_export(source)
    source_manifest = verify_manifest(model_dir)
    grown, tokenizer = upcycle(model_dir, growth)
    root = parameter_root(grown.named_parameters())
    record = {"method": METHODS[growth.architecture], "growth": growth.record(), "source": {
                  **provenance, "model_dir": str(Path(model_dir).resolve()),
                  "manifest_sha256": file_sha256(Path(model_dir) / MANIFEST),
                  "model_files_sha256": files_sha256(model_files(model_dir)),
                  "parameter_root": source_manifest["parameter_root"],
                  "plan_sha256": source_manifest.get("plan_sha256"),
                  "prepared_identity": source_manifest.get("prepared_identity")},
              "architecture": ARCHITECTURES[growth.architecture], **parameter_counts(grown, growth),
              "aux_loss": {"router_aux_loss_coef": growth.aux_coef,
                           "how": "nshard adds a per-document load-balancing loss (nshard/run/experts.py) in training"}}
    with staged_dir(out, "grow") as tmp:
        grown.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / GROWN).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        manifest = write_manifest(tmp, parameter_root=root, plan_sha256=None, ds_config_sha256=None,
                                  prepared_identity=None, grown=record)
    return manifest


METHODS = {"mixtral": "sparse upcycling: every MLP copied into each expert, seeded top-k router",
           "qwen2_moe": ("shared-expert growth: every MLP kept as the shared expert (down projection x2 behind a zero "
                         "sigmoid gate), new routed experts with zero down projections, seeded top-k router whose "
                         "probabilities scale them (norm_topk_prob false)")}


def build_parser() -> argparse.ArgumentParser:
    epilog = (f"Writes --out DIR (new): the grown model as a transformers directory (safetensors, config, tokenizer), "
              f"{GROWN} (source, method and settings) and {MANIFEST} (every file's SHA-256); prints one JSON line "
              f"(out, parameter_root, parameters). {SPELLING_NOTE}")
    parser = ArgumentParser(prog=prog("nshard.grow"), description=__doc__.split("\n\n")[0], epilog=epilog)
    parser.add_argument("--from", dest="source", required=True, type=Path,
                        help="an accepted study directory, or a finished nshard run directory")
    parser.add_argument("--out", required=True, type=Path, help="a new directory for the grown export")
    parser.add_argument("--experts", type=int, default=Growth.experts)
    parser.add_argument("--top_k", type=int, default=Growth.top_k)
    parser.add_argument("--seed", type=int, default=Growth.seed, help="the router's seed")
    parser.add_argument("--router_std", type=float, default=Growth.router_std)
    parser.add_argument("--aux_coef", type=float, default=Growth.aux_coef,
                        help="router_aux_loss_coef: the load-balancing loss's weight in training (0: none)")
    parser.add_argument("--architecture", default=Growth.architecture, choices=sorted(ARCHITECTURES),
                        help="qwen2_moe: shared expert + routed experts, a router the task trains; mixtral: copies")
    parser.add_argument("--expert_size", type=int, default=Growth.expert_size,
                        help="qwen2_moe: each routed expert's intermediate size (0: the MLP's)")
    parser.add_argument("--freeze", default=Growth.freeze, choices=FREEZE,
                        help="qwen2_moe: what training keeps fixed: none, shared (the shared expert and its gate), "
                             "accepted (every weight carried from the source)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = grow(args.source, args.out, Growth(args.experts, args.top_k, args.seed, args.router_std, args.aux_coef,
                                                      args.architecture, args.expert_size, args.freeze))
    except GrowError as exc:
        print(f"nshard.grow: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "parameter_root": manifest["parameter_root"],
                      "parameters": manifest["grown"]["parameters"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
