"""Where a second cohort's training starts: the accepted candidate's export ("weights", a fresh optimizer) or its
complete state ("state": weights, AdamW moments, error memory, P/Q, with this run's learning-rate schedule).
find_start checks it against the accepted study before any process group exists; restore loads it and checks,
bit for bit, that the engine and the reducer hold what the state's files hold."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nshard.evidence.commit import CommitError, check_committed_as, load_commitment, model_files
from nshard.evidence.export import GROWN, MANIFEST, ManifestError, verify_manifest
from nshard.files import file_sha256
from nshard.run import elastic
from nshard.run import state as state_mod
from nshard.run.cohort import CohortError, read_accepted, read_json
from nshard.run.plan import Plan
from nshard.run.ranks import RunError, all_ranks
from nshard.run.receipts import parameter_root
from nshard.seam import engine as engine_mod
from nshard.seam import patches
from nshard.seam.engine import full_parameters


@dataclass(frozen=True)
class StartPoint:
    """The accepted candidate a cohort continues from, as checked by find_start."""

    kind: str
    """"state" or "weights" (the plan's cohort.start)."""
    model_dir: Path
    state: Path | None
    """The candidate's newest complete state (kind "state")."""
    dense_warmup: bool
    provenance: dict
    """The accepted study's record, the candidate, its committed parameter root and files, the state's name."""


def find_start(plan: Plan, world_size: int) -> StartPoint:
    """The accepted study's candidate, refused (CohortError) unless the study's results say its quality screen
    passed under its commitment, its export matches the record and its manifest, and (start = "state") its newest
    complete state verifies and holds the committed weights. A state saved by another number of ranks than
    `world_size` continues elastically (nshard/run/elastic.py; the provenance names both sizes)."""
    model_dir, provenance = accepted_export(plan.cohort.from_study)
    state = (find_state(read_accepted(plan.cohort.from_study).run_dir, provenance["parameter_root"], world_size)
             if plan.cohort.start == "state" else None)
    saved_world = state_mod.read_manifest(state)["world_size"] if state else None
    return StartPoint(plan.cohort.start, model_dir, state, plan.cohort.dense_warmup,
                      {**provenance, "state": state.name if state else None, "state_world_size": saved_world,
                       "elastic": None not in (saved_world, world_size) and saved_world != world_size})


def grown_start(point: StartPoint, grown_dir) -> StartPoint:
    """A growth study's upcycled arm (train.py --grown): the same accepted candidate, grown. Refused (CohortError)
    unless the grown export verifies against its manifest and its provenance names this candidate: the record,
    the committed parameter root and files the accepted study's are. The arm then trains the grown weights
    (start = "weights"); run.json keeps the accepted candidate's provenance and adds the grown export's."""
    grown_dir = Path(grown_dir)
    try:
        manifest = verify_manifest(grown_dir)
    except ManifestError as exc:
        raise CohortError(f"--grown {grown_dir}: the grown export does not match its manifest: {exc}") from None
    source = (manifest.get("grown") or {}).get("source") or {}
    prov = point.provenance
    wanted = {"kind": "accepted study", "commitment_sha256": prov["commitment_sha256"],
              "candidate": prov["candidate"], "parameter_root": prov["parameter_root"]}
    differs = [k for k, v in wanted.items() if source.get(k) != v]
    if differs or source.get("model_files") != prov["model_files"]:
        raise CohortError(f"--grown {grown_dir}: it was not grown from this study's accepted candidate "
                          f"({', '.join(differs) or 'model_files'} differ from {prov['study']}'s); grow it with "
                          f"python -m nshard.grow --from {prov['study']}")
    grown = {"model_dir": str(grown_dir.resolve()), "parameter_root": manifest["parameter_root"],
             "manifest_sha256": file_sha256(grown_dir / MANIFEST),
             "grown_json_sha256": file_sha256(grown_dir / GROWN), "growth": manifest["grown"]["growth"],
             "active_parameters_per_token": manifest["grown"]["active_parameters_per_token"],
             "parameters": manifest["grown"]["parameters"]}
    return StartPoint("weights", grown_dir, None, False,
                      {**prov, "export_root": manifest["parameter_root"], "grown": grown})


def accepted_export(study_dir) -> tuple[Path, dict]:
    """The accepted study's candidate export and its provenance (study, record, candidate, committed root and
    files), refused (CohortError) unless the study judged it under its commitment, its quality screen passed and
    the export is what the record committed and its manifest seals. A cohort and a growth (nshard/grow.py) start
    from it alike."""
    accepted = read_accepted(study_dir)
    study, name = accepted.study_dir, accepted.candidate
    try:
        record = load_commitment(study / "commitment.json")
    except CommitError as exc:
        raise CohortError(f"cohort.from: {exc}") from None
    entry = next((c for c in record["candidates"] if c["name"] == name), None)
    if entry is None:
        raise CohortError(f"cohort.from: the candidate {name!r} is not committed by {study / 'commitment.json'} "
                          f"(record {record['record_sha256'][:16]}); only a committed, accepted candidate can be "
                          "continued from")
    check_screen_passed(study, record)
    try:
        manifest = verify_manifest(accepted.model_dir)
        check_committed_as(record, name, model_files(accepted.model_dir))
    except (ManifestError, CommitError) as exc:
        raise CohortError(f"cohort.from: the candidate's export {accepted.model_dir} is not what the study committed "
                          f"and judged: {exc}; continue from an untouched study directory") from None
    if manifest["parameter_root"] != entry["parameter_root"]:
        raise CohortError(f"cohort.from: {accepted.model_dir}'s manifest has parameter root "
                          f"{manifest['parameter_root'][:16]}, the record commits {entry['parameter_root'][:16]}")
    provenance = {"study": str(study), "commitment_sha256": record["record_sha256"],
                  "seed_files": record["seed"]["files"], "candidate": name,
                  "parameter_root": entry["parameter_root"], "model_files": entry["files"],
                  # Under delta parameter sync the export holds the masters, whose root the manifest gives apart.
                  "export_root": manifest.get("weights", {}).get("masters_root", entry["parameter_root"])}
    return accepted.model_dir, provenance


def check_screen_passed(study: Path, record: dict) -> None:
    """results.json judged the candidate under this record, not exploratorily, and its quality screen passed."""
    results = read_json(study / "results.json", "finish the study first")
    if results.get("exploratory") or results.get("commitment_sha256") != record["record_sha256"]:
        raise CohortError(f"cohort.from: {study / 'results.json'} was not judged under {study / 'commitment.json'} "
                          f"(record {record['record_sha256'][:16]}; exploratory: {results.get('exploratory')}); only "
                          "a committed, judged study can be continued from")
    if results.get("screens", {}).get("quality", {}).get("passed") is not True:
        failed = [c["name"] for c in results["screens"]["quality"].get("conditions", []) if not c.get("passed")]
        raise CohortError(f"cohort.from: the study's candidate {results.get('candidate')!r} did not pass its quality "
                          f"screen (failed: {'; '.join(failed) or 'none named'}); a second cohort continues only "
                          "from an accepted candidate")


def find_state(run_dir: Path, committed_root: str, world_size: int) -> Path:
    states = state_mod.sealed_states(run_dir)
    if not states:
        raise CohortError(f"cohort.start = \"state\": {run_dir}/state holds no complete state (the study keeps the "
                          "candidate's; keep_state = false removed it?); use cohort.start = \"weights\"")
    state = states[-1]
    why = state_mod.damage(state)
    if why is not None:
        raise CohortError(f"cohort.start = \"state\": {state} is damaged: {why}; use an untouched study directory")
    manifest = state_mod.read_manifest(state)
    if manifest["parameter_root"] != committed_root:
        raise CohortError(f"cohort.start = \"state\": {state} holds parameter root {manifest['parameter_root'][:16]}, "
                          f"not the committed candidate's {committed_root[:16]}; it is not the accepted state")
    return state  # saved by another number of ranks than world_size: restore continues it elastically


class StartError(RunError):
    """A start state that did not load as saved; the message names what differs."""


def tree_sha256(tree) -> str:
    """SHA-256 over every tensor of a nested state (by path, dtype, shape, bytes) and every other leaf's JSON."""
    return parameter_root(list(_leaves(tree, "")))


def _leaves(tree, path: str):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key in tree:
            yield from _leaves(tree[key], f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from _leaves(item, f"{path}/{i}")
    else:
        yield path, torch.tensor(list(json.dumps(tree).encode()), dtype=torch.uint8)


def _keys(seam_state: dict) -> list[str]:
    """A seam state's shape of keys: which reducer saved it (PowerSGD's errors and q, a dense one's none)."""
    return sorted(seam_state) + sorted(f"reducer/{k}" for k in seam_state.get("reducer", {}))


def reducer_part(seam_state: dict) -> dict:
    """What a cohort continues of a reducer's saved state: all but its ledger (this run's bytes are its own)."""
    reducer = seam_state.get("reducer")
    return {} if reducer is None else {k: v for k, v in reducer.items() if k != "ledger"}


def restore(engine, seam, point: StartPoint, rank: int, out: Path | None = None) -> dict:
    """Load the start point's complete state into the built engine and seam; returns the start record.

    Optimizer settings (learning rate, betas, weight decay) and the learning-rate schedule stay this run's; the
    moments, the error memory, P/Q and the projection RNG are the state's. A state saved by another number of
    ranks is loaded elastically (nshard/run/elastic.py: DeepSpeed repartitions the optimizer state, through a
    scratch directory under this run's directory `out`; every rank starts from the mean error memory). Every rank
    checks the loaded weights against the committed parameter root, and its optimizer and reducer state against
    the files (or what the elastic rule made of them), bit for bit."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    saved_world, world = state_mod.read_manifest(point.state)["world_size"], dist.get_world_size()
    before = None
    try:
        if saved_world != world:
            scratch = Path(out or tempfile.gettempdir()) / "state" / f"{elastic.SCRATCH_PREFIX}start-{point.state.name}"
            client, part, before = elastic.load(engine, point.state, saved_world, rank, scratch, rank == 0,
                                                bool(patches.DELTA_SYNC["codec"]), scheduler=False)
            saved = part["seam"]
        else:
            client = engine_mod.load_checkpoint(engine, point.state, scheduler=False)
            saved = torch.load(point.state / f"rank-{rank}.pt", map_location="cpu", weights_only=False)["seam"]
    except (RuntimeError, ValueError) as exc:
        raise StartError(f"{point.state} (saved by {saved_world} ranks, continued on {world}): {exc}") from None
    for group, kept in zip(engine.optimizer.param_groups, settings):
        group.update(kept)
    fresh = seam.state_dict()
    if _keys(saved) != _keys(fresh):
        raise StartError(f"{point.state}: the state's gradient reduction (keys {_keys(saved) or 'DeepSpeed'}) is not "
                         f"this arm's ({_keys(fresh) or 'DeepSpeed'}); give the arm the candidate's reducer, or use "
                         "cohort.start = \"weights\"")
    kept = reducer_part(saved)
    if kept:  # the fresh reducer's empty ledger; updates 0 runs the ds_config's dense warm-up again
        seam.load_state_dict({"reducer": {**kept, "ledger": fresh["reducer"]["ledger"],
                                          "updates": 0 if point.dense_warmup else kept["updates"]}})
    checks = check_loaded(engine, seam, point, client, kept)
    moved = elastic.finish(engine, seam, saved_world, world, before) if saved_world != world else None
    return {"kind": "state", "state": point.state.name, "dense_warmup": point.dense_warmup, **checks,
            "elastic": moved}


def check_loaded(engine, seam, point: StartPoint, client: dict, saved_reducer: dict) -> dict:
    """The loaded weights hash to the committed root on every rank; the optimizer moments (stage 0, where the
    engine steps the client optimizer itself) and the reducer's error memory, P/Q and RNG equal the saved ones."""
    root = loaded_root(engine)
    live_reducer = {k: v for k, v in reducer_part(seam.state_dict()).items() if k != "updates"}
    saved_reducer = {k: v for k, v in saved_reducer.items() if k != "updates"}
    checks = {"reducer_state_sha256": tree_sha256(live_reducer),
              "reducer_state_matches": tree_sha256(live_reducer) == tree_sha256(saved_reducer)}
    if engine.optimizer is engine.basic_optimizer:
        live = tree_sha256(engine.basic_optimizer.state_dict()["state"])
        checks.update(optimizer_state_sha256=live,
                      optimizer_state_matches=live == tree_sha256(client["optimizer"]["state"]))
    found = all_ranks((root, checks.get("optimizer_state_matches", True), checks["reducer_state_matches"]))
    committed = point.provenance["parameter_root"]
    if {r for r, _, _ in found} != {committed}:
        raise StartError(f"{point.state}: the loaded weights have parameter roots {[r[:16] for r, _, _ in found]}, "
                         f"not the committed {committed[:16]}")
    bad = [rank for rank, (_, opt, red) in enumerate(found) if not (opt and red)]
    if bad:
        raise StartError(f"{point.state}: on rank(s) {bad} the loaded optimizer or reducer state differs from the "
                         "state's files; do not train from it")
    return {"parameter_root": root, **checks}


def loaded_root(engine) -> str:
    with full_parameters(engine):
        return parameter_root(engine.module.named_parameters())


def weights_record(engine, point: StartPoint) -> dict:
    """start = "weights": the model built from the export holds the committed weights on every rank."""
    root = loaded_root(engine)
    roots = all_ranks(root)
    expected = point.provenance.get("export_root", point.provenance["parameter_root"])
    if set(roots) != {expected}:
        held = sorted({str(p.dtype).removeprefix("torch.") for p in engine.module.parameters()})
        raise StartError(f"{point.model_dir}: the loaded weights have parameter roots {[r[:16] for r in roots]}, not "
                         f"the committed {expected[:16]} (the engine holds them in {', '.join(held)}: an arm that "
                         "computes in another precision than its start was exported in rounds it; train the arm in "
                         "the candidate's precision)")
    return {"kind": "weights", "parameter_root": root}
