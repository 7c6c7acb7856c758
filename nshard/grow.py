"""Sparse upcycling (`python -m nshard.grow`): a Llama export becomes a Mixtral-style model whose E experts per
layer are copies of that layer's MLP, with a seeded top-k router, sealed with its own manifest and provenance.

    python -m nshard.grow --from SOURCE --out DIR [--experts 4] [--top_k 2] [--seed 0] [--router_std 0.02] [--aux_coef 0.01]

SOURCE is an accepted study (its candidate's export, checked as a second cohort checks it) or an nshard run
directory (its model/ and run.json). Identical experts make every routing give the dense MLP's output, since
transformers' Mixtral router renormalizes the top-k weights to sum 1: the grown model's logits equal the dense
model's up to fp32 rounding (tests/test_grow.py checks it in a process that never imports nshard).
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
from nshard.run.upcycle import upcycled_state

CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
           "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
           "initializer_range", "rope_parameters")
"""The Llama settings a Mixtral config takes over unchanged."""
REFUSED = {"attention_bias": False, "mlp_bias": False}
"""Llama settings Mixtral cannot express: a source with another value is refused."""


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

    def check(self) -> None:
        problem = upcycling_problem(**self.__dict__)
        if problem:
            key, text = problem
            raise GrowError(f"--{key} {getattr(self, key)}: {text}")


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


def mixtral_config(llama, growth: Growth):
    from transformers import MixtralConfig

    if llama.model_type != "llama":
        raise GrowError(f"the source export is a {llama.model_type!r} model; nshard.grow upcycles Llama models")
    for key, wanted in REFUSED.items():
        if getattr(llama, key, wanted) != wanted:
            raise GrowError(f"the source config has {key}={getattr(llama, key)!r}; Mixtral has no such bias, so it "
                            "cannot be upcycled exactly")
    carried = {key: getattr(llama, key) for key in CARRIED if getattr(llama, key, None) is not None}
    return MixtralConfig(**carried, num_local_experts=growth.experts, num_experts_per_tok=growth.top_k,
                         router_jitter_noise=0.0, output_router_logits=False, sliding_window=None,
                         router_aux_loss_coef=growth.aux_coef)


def upcycle(model_dir: Path, growth: Growth):
    """The grown MixtralForCausalLM and its tokenizer, from a Llama transformers directory, in the dtype the source's
    weights are stored in: a bf16-trained export grows into bf16 tensors, so the trainer, which computes in the
    candidate's precision, holds exactly the grown weights and their parameter root (an fp32 router would be
    rounded when a bf16 engine takes the model, and the root the arm checks would differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MixtralForCausalLM

    growth.check()
    llama_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config = mixtral_config(llama_config, growth)
    dtype = stored_dtype(model_dir)
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    tensors = dict(dense.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    state = upcycled_state(tensors, config.num_hidden_layers, growth, config.hidden_size)
    torch.manual_seed(growth.seed)  # transformers' own init of the tensors load_state_dict then replaces
    grown = MixtralForCausalLM(config).to(dtype)
    missing, unexpected = grown.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise GrowError(f"{model_dir}: the upcycled tensors do not fit Mixtral (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}); is the source a plain Llama export?")
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
    """All parameters, the experts' share, and those one token passes through (top_k of E experts per layer, the
    routers left out as nshard.run.budget counts them): the count a FLOPs budget (about 6 x active parameters per
    trained token) prices a token at."""
    from nshard.run.budget import router_parameters

    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    routers = router_parameters(model)
    return {"parameters": total, "expert_parameters": experts, "router_parameters": routers,
            "active_parameters_per_token": total - experts + experts * growth.top_k // growth.experts - routers}


def grow(source: Path, out: Path, growth: Growth) -> dict:
    """Upcycle the source's export into `out` (staged, then one rename) and seal it; returns the manifest."""
    out = Path(out)
    if out.exists():
        raise GrowError(f"--out {out} already exists; choose a new directory (a grown export is never replaced)")
    model_dir, provenance = source_export(source)
    source_manifest = verify_manifest(model_dir)
    grown, tokenizer = upcycle(model_dir, growth)
    root = parameter_root(grown.named_parameters())
    record = {"method": "sparse upcycling: every MLP copied into each expert, seeded top-k router",
              "growth": growth.__dict__, "source": {
                  **provenance, "model_dir": str(Path(model_dir).resolve()),
                  "manifest_sha256": file_sha256(Path(model_dir) / MANIFEST),
                  "model_files_sha256": files_sha256(model_files(model_dir)),
                  "parameter_root": source_manifest["parameter_root"],
                  "plan_sha256": source_manifest.get("plan_sha256"),
                  "prepared_identity": source_manifest.get("prepared_identity")},
              "architecture": "MixtralForCausalLM", **parameter_counts(grown, growth),
              "aux_loss": {"router_aux_loss_coef": growth.aux_coef,
                           "how": "nshard adds a per-document load-balancing loss (nshard/run/experts.py) in training"}}
    with staged_dir(out, "grow") as tmp:
        grown.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / GROWN).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        manifest = write_manifest(tmp, parameter_root=root, plan_sha256=None, ds_config_sha256=None,
                                  prepared_identity=None, grown=record)
    return manifest


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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = grow(args.source, args.out, Growth(args.experts, args.top_k, args.seed, args.router_std, args.aux_coef))
    except GrowError as exc:
        print(f"nshard.grow: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "parameter_root": manifest["parameter_root"],
                      "parameters": manifest["grown"]["parameters"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
