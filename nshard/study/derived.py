"""A study's interpolated arms (`interpolate = "<arm>"`, `alpha = A`): made, not trained, from the seed model and a
trained arm's export once that arm finished (nshard/interpolate.py), into a run directory the commitment, scoring,
validation and analysis read as they read a trained arm's: its model/, its run.json (the trained arm's, with the new
parameter root and an `interpolated` record) and the trained arm's prepared/ and ds_config.json. It has no receipts:
its training is the trained arm's, whose process time the analysis counts for it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from nshard.evidence.commit import files_sha256, model_files
from nshard.files import file_sha256, write_json_atomic
from nshard.run.plan import ArmSpec

COPIED = ("prepared", "ds_config.json", "plan.toml")
"""What an interpolated run directory takes from its trained arm's: the inputs it was trained on."""


def derived_record(arm: ArmSpec, source_run: Path, seed_dir: Path) -> dict:
    """What makes an interpolated arm: its trained arm's parameter root, its seed model's files and alpha."""
    source = json.loads((source_run / "run.json").read_text())
    return {"from": arm.interpolate, "alpha": arm.alpha, "from_parameter_root": source.get("parameter_root"),
            "seed_model_dir": str(seed_dir), "seed_files_sha256": files_sha256(model_files(seed_dir))}


def is_done(run_dir: Path, record: dict) -> bool:
    """Made earlier from the same trained export, seed model and alpha."""
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return False
    made = run.get("interpolated") or {}
    return (run.get("status") == "complete" and (run_dir / "model" / "model.safetensors").is_file()
            and {k: made.get(k) for k in record} == record)


def derive_arm(arm: ArmSpec, source: dict, out: Path, seed_dir: Path, say) -> dict:
    """The study.json entry of an interpolated arm, made from its trained arm's entry `source` (reused when made
    earlier from the same inputs); a trained arm that did not finish leaves it failed."""
    from nshard.interpolate import InterpolateError, interpolate

    run_dir = out / "arms" / arm.name
    entry = {"name": arm.name, "ranks": source["ranks"], "ds_config": source["ds_config"],
             "ds_config_sha256": source["ds_config_sha256"], "run_dir": str(run_dir), "attempts": [],
             "recovery": [], "failed_attempts": 0, "failed_attempts_s": 0.0, "launcher_wall_s": None}
    if source["status"] != "complete":
        say(f"arm {arm.name}: not made: arm {arm.interpolate} did not finish")
        return {**entry, "status": "failed", "reused": False, "log": source.get("log"),
                "error_tail": [f"arm {arm.interpolate}, which it interpolates, did not finish"]}
    source_run = Path(source["run_dir"])
    record = derived_record(arm, source_run, seed_dir)
    if is_done(run_dir, record):
        say(f"arm {arm.name}: made earlier from the same export, seed model and alpha; reused")
        run = json.loads((run_dir / "run.json").read_text())
        return {**entry, "status": "complete", "reused": True, "log": source.get("log"),
                "interpolated": run["interpolated"]}
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    try:
        manifest = interpolate(seed_dir, source_run / "model", arm.alpha, run_dir / "model")
    except InterpolateError as exc:
        say(f"arm {arm.name}: failed: {exc}")
        return {**entry, "status": "failed", "reused": False, "log": source.get("log"), "error_tail": [str(exc)]}
    for name in COPIED:
        path = source_run / name
        if path.is_dir():
            shutil.copytree(path, run_dir / name)
        elif path.is_file():
            shutil.copyfile(path, run_dir / name)
    made = {**record, "seconds": time.perf_counter() - t0, "model_files_sha256": files_sha256(model_files(
        run_dir / "model"))}
    run = json.loads((source_run / "run.json").read_text())
    write_json_atomic(run_dir / "run.json", {**run, "parameter_root": manifest["parameter_root"], "interpolated": made,
                                             "run_json_from": str(source_run / "run.json"),
                                             "run_json_from_sha256": file_sha256(source_run / "run.json")})
    say(f"arm {arm.name}: (1 - {arm.alpha}) x the seed model + {arm.alpha} x arm {arm.interpolate}, made in "
        f"{made['seconds']:.0f} s (parameter root {manifest['parameter_root'][:16]})")
    return {**entry, "status": "complete", "reused": False, "log": source.get("log"), "interpolated": made}
