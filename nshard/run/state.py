"""Complete resumable state: DeepSpeed's checkpoint, every rank's reducer, RNG and receipt counters, and
the data position, saved atomically and sealed by a manifest of SHA-256s; found and checked for --resume.

    RUN/state/update-000012/
        deepspeed/      engine.save_checkpoint: module, optimizer (ZeRO partitions), scheduler, step counters
        rank-<r>.pt     that rank's reducer state, Python/NumPy/torch RNG states, receipt counters
        manifest.json   written last, by rank 0: the run's identity, the parameter root at the save and
                        the SHA-256 of every file above (its completion marker)
    RUN/state/damaged/update-000014/    a damaged state that --resume passed over, set aside (never deleted)

A state is written under state/.tmp-update-000012/ and renamed into place only once sealed, so a crash
in the middle of a save leaves the previous complete state the newest. --resume continues from the newest
state that verifies; newer ones without their manifest or whose files do not match it are passed over,
named, and set aside once the chosen state has passed every check. A state saved on another world size is
refused unless --elastic, which repartitions it (nshard/run/elastic.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nshard.seam import engine as engine_mod
from nshard.run import elastic, fault
from nshard.comm.agree import shapes_sha256
from nshard.files import file_sha256, first_difference, rename_durably, write_json_atomic
from nshard.log import log
from nshard.run.ranks import RunError, all_ranks, on_main_rank
from nshard.run.receipts import Receipt, metrics_through, parameter_root

FORMAT = "nshard-state/1"
MANIFEST = "manifest.json"
DAMAGED = "damaged"
"""state/damaged/: where damaged states are set aside, out of reach of --resume and of the pruning of old states."""
# Checked before any process group exists (from the command line), and once the inputs and model are built.
EARLY_FIELDS = {"plan_sha256": "plan", "ds_config_sha256": "ds_config", "world_size": "world size"}
LATE_FIELDS = {"prepared_identity": "prepared inputs", "parameter_set_sha256": "parameter set (names and shapes)"}


class StateError(RunError):
    """A state that cannot be resumed; the message names what differs and what to do."""


class DamagedState(StateError):
    """A state whose manifest or files are not whole: --resume passes over it to an older one."""

    def __init__(self, state: Path, why: str):
        super().__init__(f"--resume: {state} is damaged: {why}")
        self.why = why


@dataclass(frozen=True)
class ResumePoint:
    """The state --resume continues from, and the newer states it passed over because they are damaged."""

    state: Path
    update: int
    skipped: tuple[dict, ...] = ()
    """{"state": name, "why": what is damaged}, newest first."""
    saved_world: int | None = None
    """The world size the state was saved on, where it differs from this run's (an elastic resume); else None."""
    world: int | None = None

    def record(self) -> dict:
        elastic_sizes = None if self.saved_world is None else {"from_world_size": self.saved_world,
                                                               "to_world_size": self.world}
        return {"state": self.state.name, "update": self.update, "skipped": [dict(s) for s in self.skipped],
                "elastic": elastic_sizes}


def state_name(update: int) -> str:
    return f"update-{update:06d}"


def state_dirs(out: Path) -> list[Path]:
    """Every state directory, sealed or not, oldest first (a save in progress, .tmp-*, is none)."""
    return sorted(p for p in (out / "state").glob("update-*") if p.is_dir() and p.name[7:].isdigit())


def sealed_states(out: Path) -> list[Path]:
    """Complete states, oldest first: directories named update-NNNNNN that hold their manifest."""
    return [p for p in state_dirs(out) if (p / MANIFEST).is_file()]


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
    """The state's manifest, whole: the right format, of this directory's update, with the parameter root."""
    if not (state / MANIFEST).is_file():
        raise DamagedState(state, f"no {MANIFEST}: its save never finished, or its completion marker was removed")
    try:
        manifest = json.loads((state / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DamagedState(state, f"{MANIFEST} cannot be read ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedState(state, f"{MANIFEST} is not an {FORMAT} manifest (a foreign directory)")
    if manifest.get("update") != int(state.name[7:]):
        raise DamagedState(state, f"{MANIFEST} is of update {manifest.get('update')}, not of {state.name}")
    if not isinstance(manifest.get("parameter_root"), str):
        raise DamagedState(state, f"{MANIFEST} records no parameter_root (saved by an older nshard), so the "
                                  "weights it holds cannot be checked")
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
        raise DamagedState(state, f"{rel}, which its manifest lists, is missing")
    if kind == "extra":
        raise DamagedState(state, f"it holds {rel}, which its manifest does not list (a foreign or altered state)")
    raise DamagedState(state, f"{rel} does not match its manifest's SHA-256 (truncated or altered)")


def damage(state: Path) -> str | None:
    """What makes a state unusable as it is (manifest missing, unreadable or foreign; a file missing, extra or
    changed), or None when it verifies."""
    try:
        verify_files(state, read_manifest(state))
    except DamagedState as exc:
        return exc.why
    return None


def check_fields(state: Path, manifest: dict, current: dict, fields: dict) -> None:
    for key, what in fields.items():
        if key == "world_size" and manifest.get(key) != current[key]:
            raise StateError(f"--resume: {state} was made with another world size ({manifest.get(key)} there, "
                             f"{current[key]} now); resume on {manifest.get(key)} ranks, or add --elastic to "
                             f"continue on {current[key]} with its optimizer state repartitioned "
                             "(docs/evidence.md#elastic-resume)")
        if manifest.get(key) != current[key]:
            raise StateError(f"--resume: {state} was made with another {what} ({manifest.get(key)} there, "
                             f"{current[key]} now); resume with the run's own inputs, or start a new run")


def find_resumable(out: Path, plan_path: Path, ds_config_path: Path, world_size: int,
                   elastic_resume: bool = False) -> ResumePoint:
    """The newest state of run directory `out` that verifies, checked against this command line and metrics.jsonl;
    newer, damaged states are passed over and named in the ResumePoint. A state of another world size is refused
    unless `elastic_resume` (--elastic): then StateKeeper.restore repartitions it (nshard/run/elastic.py).

    Runs in every process before any process group exists and writes nothing, so a refusal is one clear error
    line and leaves the run directory as it was.
    """
    if not (out / "plan.toml").is_file():
        raise StateError(f"--resume: {out} is not an nshard run directory (no plan.toml); give --out the run to continue")
    skipped = []
    for state in reversed(state_dirs(out)):
        why = damage(state)
        if why is None:
            manifest = read_manifest(state)
            current = {"plan_sha256": file_sha256(plan_path), "ds_config_sha256": file_sha256(ds_config_path),
                       "world_size": world_size}
            fields = {k: v for k, v in EARLY_FIELDS.items() if not (elastic_resume and k == "world_size")}
            check_fields(state, manifest, current, fields)
            check_metrics(out, state, manifest["update"])
            moved = manifest.get("world_size") != world_size
            return ResumePoint(state, manifest["update"], tuple(skipped),
                               manifest["world_size"] if moved else None, world_size if moved else None)
        skipped.append({"state": state.name, "why": why})
    if not skipped:
        raise StateError(f"--resume: {out}/state holds no complete state; rerun without --resume (and with --overwrite)")
    reasons = "; ".join(f"{entry['state']}: {entry['why']}" for entry in skipped)
    raise StateError(f"--resume: no state of {out} verifies ({reasons}); the run cannot continue: start a new run "
                     "with another --out and keep this one as evidence")


def check_metrics(out: Path, state: Path, update: int) -> None:
    """metrics.jsonl must hold updates 1..update, in order, as its first lines: the ones a resume keeps."""
    try:
        metrics_through(out / "metrics.jsonl", update)
    except ValueError as exc:
        raise StateError(f"--resume: {state} is at update {update} but {exc}; metrics.jsonl must hold updates "
                         f"1..{update} as its first lines: restore it from a copy, or start a new run") from None


def set_aside(out: Path, skipped) -> list[dict]:
    """Move each damaged state passed over into state/damaged/ (never deleted: it is evidence); returns the
    skipped records with where each now lies (kept_at, relative to the run directory)."""
    return [{**entry, "kept_at": _set_aside(out / "state" / entry["state"]).relative_to(out).as_posix()}
            for entry in skipped]


def _set_aside(state: Path) -> Path:
    folder = state.parent / DAMAGED
    folder.mkdir(exist_ok=True)
    dest, n = folder / state.name, 1
    while dest.exists():  # the same update damaged again, on a later resume
        n += 1
        dest = folder / f"{state.name}.{n}"
    state.rename(dest)
    return dest


def parameter_set_sha256(module: torch.nn.Module) -> str:
    # ZeRO-3 keeps a parameter's full shape in ds_shape (its .shape is then a partition's).
    return shapes_sha256({n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()})


def replica_check_interval(checkpoint, world: int) -> int:
    """Updates between replica checks: checkpoint.replica_check_every with more than one rank; 0 on one rank, which
    has no replica to compare (states are still sealed with its parameter root)."""
    return checkpoint.replica_check_every if world > 1 else 0


FINGERPRINT_CHUNK = 1 << 24
"""16-bit words widened to int64 at a time by replica_fingerprint: 128 MiB of temporaries."""


def replica_fingerprint(named_params) -> str:
    """A digest of every parameter's bits computed where the parameter lives, for the periodic replica check on a GPU
    (copying a 1.7B model to the host and hashing it there takes seconds; this reads it once at memory speed and
    syncs once). Per parameter, its bits as 16-bit words w: sum(w) and sum(w*w) in int64 (exact: integer sums do
    not depend on the order they are added in, so every rank and GPU model gets the same numbers for the same bits).
    Any one changed element changes sum(w); SHA-256 (parameter_root) still seals every state."""
    names, sums = [], []
    for name, p in sorted(named_params, key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        words = flat.view(torch.int16) if flat.element_size() % 2 == 0 and flat.numel() else flat.view(torch.uint8)
        total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for chunk in words.split(FINGERPRINT_CHUNK):
            wide = chunk.to(torch.int64)
            total += torch.stack([wide.sum(), (wide * wide).sum()])
        names.append(f"{name}:{p.dtype}:{list(p.shape)}")
        sums.append(total)
    values = torch.stack(sums).cpu().numpy().tobytes() if sums else b""  # the one wait for the device
    return hashlib.sha256("\n".join(names).encode() + values).hexdigest()


def replica_digest(named_params) -> str:
    """What the periodic check compares: the SHA-256 parameter root of host tensors (1.3 GB/s on one Zen 2 core,
    faster there than the fingerprint), the device-side fingerprint of GPU tensors."""
    named = list(named_params)
    on_gpu = any(p.device.type != "cpu" for _, p in named)
    return replica_fingerprint(named) if on_gpu else parameter_root(named)


def first_divergence(named_params) -> str:
    """All ranks: the first parameter (in name order) whose bits differ between ranks, as 'NAME (ranks i, j differ
    from rank 0)', from each parameter's SHA-256 gathered from every rank. Run only once a check found a divergence."""
    named = sorted(named_params, key=lambda kv: kv[0])
    mine = [hashlib.sha256(p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for _, p in named]
    by_rank = all_ranks(mine)
    for i, (name, _) in enumerate(named):
        column = [digests[i] for digests in by_rank]
        if len(set(column)) != 1:
            odd = [str(r) for r, d in enumerate(column) if d != column[0]]
            return f"{name} (rank{'s' if len(odd) > 1 else ''} {', '.join(odd)} differ{'' if len(odd) > 1 else 's'} from rank 0)"
    return "none found parameter by parameter (the digests differ, the parameters' bytes do not)"


class StateKeeper:
    """Saves complete states every `checkpoint.every` updates and at the end, compares replicas, restores."""

    def __init__(self, run, engine, seam, prepared_identity: str):
        self.run, self.engine, self.seam = run, engine, seam
        self.identity = {"plan_sha256": file_sha256(run.plan_path), "ds_config_sha256": file_sha256(run.ds_config_path),
                         "world_size": run.world, "prepared_identity": prepared_identity,
                         "parameter_set_sha256": parameter_set_sha256(engine.module)}
        self.last_saved: int | None = None
        self.check_every = replica_check_interval(run.plan.checkpoint, run.world)

    def after_update(self, done: int, receipt: Receipt) -> None:
        """Called once `done` updates are complete: fault hook, replica check and state save when due."""
        rank, ck = self.run.rank, self.run.plan.checkpoint
        fault.strike(rank, done, "update")
        fault.strike(rank, done, "diverge", self.engine.module)
        saving = ck.every > 0 and done % ck.every == 0
        if saving:
            self.save(done, receipt, self.check_replicas(done, receipt))
        elif self.check_every > 0 and done % self.check_every == 0:
            self.check_replicas(done, receipt, sealing=False)

    def finish(self, done: int, receipt: Receipt) -> None:
        """The state at the end of the run (unless the last update's was just saved, or the plan says
        checkpoint.final = false: then the replicas are only compared)."""
        if self.last_saved == done:
            return
        if not self.run.plan.checkpoint.final:
            self.check_replicas(done, receipt)
            return
        self.save(done, receipt, self.check_replicas(done, receipt))

    def check_replicas(self, done: int, receipt: Receipt, sealing: bool = True) -> str:
        """All ranks compare parameter roots (between saves: replica_digest); a divergence stops the run before anything
        is saved from it, naming the first parameter that differs. Returns the root (or digest) they agree on."""
        t0 = time.perf_counter()
        with engine_mod.full_parameters(self.engine):
            named = self.engine.module.named_parameters()
            root = parameter_root(named) if sealing else replica_digest(named)
        roots = all_ranks(root)
        receipt.state_s += time.perf_counter() - t0
        if len(set(roots)) != 1:
            states = sealed_states(self.run.out)
            with engine_mod.full_parameters(self.engine):
                first = first_divergence(self.engine.module.named_parameters())
            raise RunError(f"after update {done} the replicas diverged: the first parameter that differs is {first} "
                           f"(digests by rank: {', '.join(r[:16] for r in roots)}); the run stops here. The last "
                           f"complete state is {states[-1] if states else 'none'}; find the cause before resuming from it")
        return root

    def save(self, done: int, receipt: Receipt, parameter_root_now: str) -> None:
        """Every rank writes its part into a fresh temp directory; rank 0 seals it, with the parameter root the
        ranks agreed on just before (check_replicas), and renames it into place."""
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
        fields = {"format": FORMAT, "update": done, **self.identity, "parameter_root": parameter_root_now,
                  "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        sealed = on_main_rank(run, _seal, tmp, root / state_name(done), fields, t0, run.plan.checkpoint.keep)
        seconds = time.perf_counter() - t0
        receipt.state_s += seconds
        receipt.state_saves.append({"update": done, "seconds": seconds, "bytes": sealed and sealed["bytes"]})
        self.last_saved = done
        if run.is_main:  # the others have no manifest to report
            log.info("state %s sealed: %.1f MB in %.2f s", state_name(done), sealed["bytes"] / 1e6, seconds)

    def restore(self, point: ResumePoint) -> tuple[int, Receipt]:
        """Load a state found by find_resumable, checked on every rank before anything goes on (its inputs and
        parameter set, then the loaded weights and next update: check_loaded); returns (next update, the receipt
        counters so far). Writes nothing: a refusal leaves the run directory as it was."""
        state = point.state
        manifest = read_manifest(state)
        check_fields(state, manifest, self.identity, LATE_FIELDS)
        if point.saved_world is not None:
            part, record = self.restore_elastic(point, manifest)
        else:
            engine_mod.load_checkpoint(self.engine, state)
            part = torch.load(state / f"rank-{self.run.rank}.pt", map_location="cpu", weights_only=False)
            self.check_loaded(state, manifest, part["next_update"])
            self.seam.load_state_dict(part["seam"])
            record = None
        receipt = Receipt.from_state_dict(part["receipt"])
        if record is not None:  # this rank continues saved rank (rank mod W)'s counters, as a rank of this run
            receipt.rank, receipt.world_size = self.run.rank, self.run.world
            receipt.elastic.append({"update": part["next_update"], **record})
        # The save that made this state ended after its rank parts were written: its record comes from the seal.
        receipt.state_saves.append({"update": manifest["update"], "seconds": manifest["seal_s"], "bytes": manifest["bytes"]})
        receipt.state_s += manifest["seal_s"]
        receipt.resumed_from.append(part["next_update"])
        set_rng_states(part["rng"])  # last: nothing between here and the next update may draw
        self.last_saved = part["next_update"]
        return part["next_update"], receipt

    def restore_elastic(self, point: ResumePoint, manifest: dict) -> tuple[dict, dict]:
        """--resume --elastic: the state, saved by point.saved_world ranks, loaded on this run's world size
        (nshard/run/elastic.py: optimizer state repartitioned by DeepSpeed, error memory by feedback.ERROR_RULE);
        returns this rank's carried-over part and the elastic record. Refused (StateError) on every rank, naming
        what cannot be repartitioned, before anything is loaded."""
        run, state = self.run, point.state
        scratch = run.out / "state" / f"{elastic.SCRATCH_PREFIX}{state.name}"
        delta = run.reducer is not None and run.reducer.parameter_sync == "delta"
        try:
            _, part, before = elastic.load(self.engine, state, point.saved_world, run.rank, scratch, run.is_main,
                                           delta)
        except ValueError as exc:
            raise StateError(f"--resume --elastic: {state} was saved by {point.saved_world} ranks and cannot "
                             f"continue on {run.world}: {exc}") from None
        self.check_loaded(state, manifest, part["next_update"])
        self.seam.load_state_dict(part["seam"])
        return part, elastic.finish(self.engine, self.seam, point.saved_world, run.world, before)

    def check_loaded(self, state: Path, manifest: dict, next_update: int) -> None:
        """Every rank's loaded weights hash to the parameter root recorded at the save, and its part continues at
        the manifest's update; otherwise every rank stops, naming the state and both roots."""
        with engine_mod.full_parameters(self.engine):  # ZeRO-1/2 replicas are full already; ZeRO-3 gathers
            root = parameter_root(self.engine.module.named_parameters())
        found = all_ranks((root, next_update))
        recorded, update = manifest["parameter_root"], manifest["update"]
        roots = [r for r, _ in found]
        if set(roots) != {recorded}:
            loaded = roots[0] if len(set(roots)) == 1 else ", ".join(f"rank {i}: {r}" for i, r in enumerate(roots))
            raise StateError(f"--resume: {state}: the loaded weights have parameter root {loaded}, but the state "
                             f"recorded parameter root {recorded} when it was saved; these are not the weights it "
                             f"saved: move it into state/{DAMAGED}/ to resume from the previous state, or start a new run")
        for rank, (_, n) in enumerate(found):
            if n != update:
                raise StateError(f"--resume: {state}: rank-{rank}.pt has next_update {n} but its manifest is of "
                                 f"update {update}; the state is inconsistent: move it into state/{DAMAGED}/ to "
                                 "resume from the previous state, or start a new run")


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
    if final.exists():  # --resume sets newer states aside, so none should be here; kept as evidence all the same
        _set_aside(final)
    rename_durably(tmp, final)
    for old in sealed_states(final.parent.parent)[:-keep]:  # final is RUN/state/update-N
        shutil.rmtree(old)
    for stale in final.parent.glob(".tmp-*"):
        shutil.rmtree(stale)
    return manifest
