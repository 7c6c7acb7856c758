"""Weight interpolation toward the seed model: an export whose every parameter is (1 - alpha) x the seed's + alpha x a
trained arm's, computed in fp32 and stored in the trained export's dtype, sealed with its provenance.

    python -m nshard.interpolate --seed SEED_MODEL_DIR --trained RUN_DIR --alpha A --out DIR

A study's arm with `interpolate = "<arm>"` and `alpha = A` is made this way from its seed model (in a second cohort,
the accepted checkpoint) and the named arm's export (docs/study.md#interpolated-arms). It trains nothing: its
training is the named arm's, and the report counts that arm's process time for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.commit import files_sha256, model_files
from nshard.evidence.export import MANIFEST, ManifestError, verify_manifest, write_manifest
from nshard.files import file_sha256, staged_dir

INTERPOLATED = "nshard-interpolated.json"
"""An interpolated export's record beside its weights: seed, trained export, alpha; readable without nshard."""


class InterpolateError(RuntimeError):
    """Two models that cannot be interpolated, or an output that cannot be written; the message names the fix."""


def interpolated_parameters(seed, trained, alpha: float) -> None:
    """Overwrite `trained`'s parameters with lerp(seed, trained, alpha) in fp32, cast back to each one's dtype."""
    import torch

    seed_params = dict(seed.named_parameters())
    names = [name for name, _ in trained.named_parameters()]
    if sorted(names) != sorted(seed_params):
        extra = sorted(set(names) ^ set(seed_params))
        raise InterpolateError(f"the seed and the trained model have different parameters (first: {extra[0]}); "
                               "interpolate a model toward the seed it was trained from")
    with torch.no_grad():
        for name, param in trained.named_parameters():
            start = seed_params[name]
            if start.shape != param.shape:
                raise InterpolateError(f"parameter {name}: seed shape {tuple(start.shape)}, trained "
                                       f"{tuple(param.shape)}; interpolate a model toward the seed it was trained from")
            mixed = torch.lerp(start.detach().float(), param.detach().float(), alpha)
            param.copy_(mixed.to(param.dtype))


def interpolate(seed_dir: Path, trained_dir: Path, alpha: float, out: Path) -> dict:
    """Write the interpolated export of `trained_dir` (a sealed export) toward `seed_dir` into `out` (staged, one
    rename) and seal it; returns the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nshard.run.receipts import parameter_root

    if not 0.0 < alpha < 1.0:
        raise InterpolateError(f"--alpha {alpha}: the trained model's weight must lie in (0, 1)")
    out = Path(out)
    if out.exists():
        raise InterpolateError(f"--out {out} already exists; choose a new directory (an export is never replaced)")
    try:
        trained_manifest = verify_manifest(trained_dir)
    except ManifestError as exc:
        raise InterpolateError(f"--trained {trained_dir}: its export does not match its manifest: {exc}") from None
    t0 = time.perf_counter()
    trained = AutoModelForCausalLM.from_pretrained(trained_dir, dtype="auto", local_files_only=True)
    seed = AutoModelForCausalLM.from_pretrained(seed_dir, dtype=torch.float32, local_files_only=True)
    interpolated_parameters(seed, trained, alpha)
    del seed
    root = parameter_root(trained.named_parameters())
    record = {"method": "linear interpolation of every parameter in fp32: (1 - alpha) x seed + alpha x trained "
                        "(torch.lerp), stored in the trained export's dtype",
              "alpha": alpha,
              "seed": {"model_dir": str(Path(seed_dir).resolve()),
                       "model_files_sha256": files_sha256(model_files(seed_dir))},
              "trained": {"model_dir": str(Path(trained_dir).resolve()),
                          "manifest_sha256": file_sha256(Path(trained_dir) / MANIFEST),
                          "model_files_sha256": files_sha256(model_files(trained_dir)),
                          "parameter_root": trained_manifest["parameter_root"]}}
    with staged_dir(out, "interpolate") as tmp:
        trained.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(trained_dir, local_files_only=True).save_pretrained(tmp)
        (tmp / INTERPOLATED).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        manifest = write_manifest(tmp, parameter_root=root, plan_sha256=trained_manifest.get("plan_sha256"),
                                  ds_config_sha256=trained_manifest.get("ds_config_sha256"),
                                  prepared_identity=trained_manifest.get("prepared_identity"),
                                  weights={"interpolated": record})
    return {**manifest, "seconds": time.perf_counter() - t0}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.interpolate"), description=__doc__,
                            epilog=f"Writes DIR (a sealed export) and prints its parameter root as JSON. {SPELLING_NOTE}")
    parser.add_argument("--seed", required=True, type=Path, help="the model the trained one started from")
    parser.add_argument("--trained", required=True, type=Path, help="a sealed export (a run's model/ directory)")
    parser.add_argument("--alpha", required=True, type=float, help="the trained model's weight, in (0, 1)")
    parser.add_argument("--out", required=True, type=Path, help="a new directory for the interpolated export")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = interpolate(args.seed, args.trained, args.alpha, args.out)
    except (InterpolateError, OSError) as exc:
        print(f"nshard.interpolate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "parameter_root": manifest["parameter_root"], "alpha": args.alpha}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
