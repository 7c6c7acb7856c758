"""Complete resumable state: DeepSpeed's checkpoint, every rank's reducer, RNG and receipt counters, and
the data position, saved atomically and sealed by a manifest of SHA-256s; found and checked for --resume.

    RUN/state/update-000012/
        deepspeed/      engine.save_checkpoint: module, optimizer (ZeRO partitions), scheduler, step counters
        rank-<r>.pt     that rank's reducer state, Python/NumPy/torch RNG states, receipt counters
        manifest.json   written last, by rank 0: the run's identity and the SHA-256 of every file above

A state is written under state/.tmp-update-000012/ and renamed into place only once sealed, so a crash
in the middle of a save leaves the previous complete state the newest; a directory without its
manifest is never used, and one whose files do not match it is refused.
"""

from __future__ import annotations

import datetime
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nshard.seam import engine as engine_mod
from nshard.run import fault
from nshard.comm.agree import shapes_sha256
from nshard.files import file_sha256, first_difference, write_json_atomic
from nshard.run.ranks import RunError, all_ranks, on_main_rank
from nshard.run.receipts import Receipt, parameter_root

FORMAT = "nshard-state/1"
MANIFEST = "manifest.json"
# Checked before any process group exists (from the command line), and once the inputs and model are built.
EARLY_FIELDS = {"plan_sha256": "plan", "ds_config_sha256": "ds_config", "world_size": "world size"}
LATE_FIELDS = {"prepared_identity": "prepared inputs", "parameter_set_sha256": "parameter set (names and shapes)"}


class StateError(RunError):
    """A state that cannot be resumed; the message names what differs and what to do."""


def state_name(update: int) -> str:
    return f"update-{update:06d}"


def sealed_states(out: Path) -> list[Path]:
    """Complete states, oldest first: directories named update-NNNNNN that hold their manifest."""
    return sorted(p for p in (out / "state").glob("update-*") if (p / MANIFEST).is_file())


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def read_manifest(state: Path) -> dict:
    try:
        manifest = json.loads((state / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(f"--resume: {state}/{MANIFEST} cannot be read ({exc}); the state is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StateError(f"--resume: {state}/{MANIFEST} is not an {FORMAT} manifest (a foreign directory)")
    return manifest


def verify_files(state: Path, manifest: dict) -> None:
    """Every file the manifest lists is present with its SHA-256, and nothing else is there."""
    listed = manifest.get("files", {})
    present = {p.relative_to(state).as_posix() for p in state.rglob("*") if p.is_file()} - {MANIFEST}
    difference = first_difference(listed, {rel: file_sha256(state / rel) for rel in sorted(present)})
    if difference is None:
        return
    kind, rel = difference
    if kind == "missing":
        raise StateError(f"--resume: {state} is truncated: {rel}, which its manifest lists, is missing")
    if kind == "extra":
        raise StateError(f"--resume: {state} holds {rel}, which its manifest does not list (a foreign or altered state)")
    raise StateError(f"--resume: {state}/{rel} does not match its manifest's SHA-256 (truncated or altered)")


def check_fields(state: Path, manifest: dict, current: dict, fields: dict) -> None:
    for key, what in fields.items():
        if manifest.get(key) != current[key]:
            raise StateError(f"--resume: {state} was made with another {what} ({manifest.get(key)} there, "
                             f"{current[key]} now); resume with the run's own inputs, or start a new run")


def find_resumable(out: Path, plan_path: Path, ds_config_path: Path, world_size: int) -> Path:
    """The newest complete state of run directory `out`, checked against this command line and its manifest.

    Runs in every process before any process group exists, so a refusal is one clear error line.
    """
    if not (out / "plan.toml").is_file():
        raise StateError(f"--resume: {out} is not an nshard run directory (no plan.toml); give --out the run to continue")
    states = sealed_states(out)
    if not states:
        raise StateError(f"--resume: {out}/state holds no complete state; rerun without --resume (and with --overwrite)")
    manifest = read_manifest(states[-1])
    current = {"plan_sha256": file_sha256(plan_path), "ds_config_sha256": file_sha256(ds_config_path),
               "world_size": world_size}
    check_fields(states[-1], manifest, current, EARLY_FIELDS)
    verify_files(states[-1], manifest)
    return states[-1]


def parameter_set_sha256(module: torch.nn.Module) -> str:
    # ZeRO-3 keeps a parameter's full shape in ds_shape (its .shape is then a partition's).
    return shapes_sha256({n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()})


class StateKeeper:
    """Saves complete states every `checkpoint.every` updates and at the end, compares replicas, restores."""

    def __init__(self, run, engine, seam, prepared_identity: str):
        self.run, self.engine, self.seam = run, engine, seam
        self.identity = {"plan_sha256": file_sha256(run.plan_path), "ds_config_sha256": file_sha256(run.ds_config_path),
                         "world_size": run.world, "prepared_identity": prepared_identity,
                         "parameter_set_sha256": parameter_set_sha256(engine.module)}
        self.last_saved: int | None = None

    def after_update(self, done: int, receipt: Receipt) -> None:
        """Called once `done` updates are complete: fault hook, replica check and state save when due."""
        rank, ck = self.run.rank, self.run.plan.checkpoint
        fault.strike(rank, done, "update")
        fault.strike(rank, done, "diverge", self.engine.module)
        saving = ck.every > 0 and done % ck.every == 0
        if saving or (ck.replica_check_every > 0 and done % ck.replica_check_every == 0):
            self.check_replicas(done, receipt)
        if saving:
            self.save(done, receipt)

    def finish(self, done: int, receipt: Receipt) -> None:
        """The state at the end of the run (unless the last update's was just saved)."""
        if self.last_saved != done:
            self.check_replicas(done, receipt)
            self.save(done, receipt)

    def check_replicas(self, done: int, receipt: Receipt) -> None:
        """All ranks compare parameter roots; a divergence stops the run before anything is saved from it."""
        t0 = time.perf_counter()
        with engine_mod.full_parameters(self.engine):
            root = parameter_root(self.engine.module.named_parameters())
        roots = all_ranks(root)
        receipt.state_s += time.perf_counter() - t0
        if len(set(roots)) != 1:
            states = sealed_states(self.run.out)
            raise RunError(f"after update {done} the replicas diverged (parameter roots by rank: "
                           f"{', '.join(r[:16] for r in roots)}); the run stops here. The last complete state is "
                           f"{states[-1] if states else 'none'}; find the cause before resuming from it")

    def save(self, done: int, receipt: Receipt) -> None:
        """Every rank writes its part into a fresh temp directory; rank 0 seals it and renames it into place."""
        t0 = time.perf_counter()
        run, root = self.run, self.run.out / "state"
        tmp = root / f".tmp-{state_name(done)}"
        on_main_rank(run, _fresh_dir, tmp)
        engine_mod.save_checkpoint(self.engine, tmp)
        fault.strike(run.rank, done, "save")
        part = {"next_update": done, "seam": self.seam.state_dict(), "rng": rng_states(),
                "receipt": receipt.state_dict()}
        torch.save(part, tmp / f"rank-{run.rank}.pt")
        dist.barrier()
        fields = {"format": FORMAT, "update": done, **self.identity,
                  "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        sealed = on_main_rank(run, _seal, tmp, root / state_name(done), fields, t0, run.plan.checkpoint.keep)
        seconds = time.perf_counter() - t0
        receipt.state_s += seconds
        receipt.state_saves.append({"update": done, "seconds": seconds, "bytes": sealed and sealed["bytes"]})
        self.last_saved = done
        if run.is_main:
            print(f"nshard: state {state_name(done)} sealed: {sealed['bytes'] / 1e6:.1f} MB in {seconds:.2f} s",
                  flush=True)

    def restore(self, state: Path) -> tuple[int, Receipt]:
        """Load a state found by find_resumable; returns (next update, the receipt counters so far)."""
        manifest = read_manifest(state)
        check_fields(state, manifest, self.identity, LATE_FIELDS)
        engine_mod.load_checkpoint(self.engine, state)
        part = torch.load(state / f"rank-{self.run.rank}.pt", map_location="cpu", weights_only=False)
        self.seam.load_state_dict(part["seam"])
        receipt = Receipt.from_state_dict(part["receipt"])
        # The save that made this state ended after its rank parts were written: its record comes from the seal.
        receipt.state_saves.append({"update": manifest["update"], "seconds": manifest["seal_s"], "bytes": manifest["bytes"]})
        receipt.state_s += manifest["seal_s"]
        receipt.resumed_from.append(part["next_update"])
        set_rng_states(part["rng"])  # last: nothing between here and the next update may draw
        self.last_saved = part["next_update"]
        return part["next_update"], receipt


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # a half-made save of an earlier, crashed attempt
    path.mkdir(parents=True)


def _seal(tmp: Path, final: Path, fields: dict, t0: float, keep: int) -> dict:
    """Hash every file, write the manifest last, rename into place, then drop old and half-made states."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {**fields, "files": {p.relative_to(tmp).as_posix(): file_sha256(p) for p in files},
                "bytes": sum(p.stat().st_size for p in files)}
    manifest["seal_s"] = time.perf_counter() - t0
    write_json_atomic(tmp / MANIFEST, manifest)
    if final.exists():  # only a state of an update after the one resumed from: never the newest complete one
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sealed_states(final.parent.parent)[:-keep]:  # final is RUN/state/update-N
        shutil.rmtree(old)
    for stale in final.parent.glob(".tmp-*"):
        shutil.rmtree(stale)
    return manifest
