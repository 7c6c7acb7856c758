"""The training run: set up the run directory, prepare inputs, train with DeepSpeed, export, write receipts."""

from __future__ import annotations

import datetime
import itertools
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nshard.run import chat as chat_mod
from nshard import lock
from nshard.run import data as data_mod
from nshard.run import experts as experts_mod
from nshard.run import device as device_mod
from nshard.seam import engine as engine_mod
from nshard.seam import patches
from nshard.run import netcount
from nshard.phases import CLOCK, sync_wanted
from nshard.run import throughput
from nshard.seam import observe
from nshard.run import state as state_mod
from nshard.comm import numerics
from nshard.comm.config import ReducerConfig
from nshard.evidence.export import write_manifest
from nshard.seam.ds_config import precision as ds_precision
from nshard.run.loss import deepspeed_backward_scale, rank_microbatches, weighted_nll_sum
from nshard.files import file_sha256, rename_durably, write_json_atomic
from nshard.log import log
from nshard.run.plan import Plan
from nshard.run.ranks import RunError, all_ranks, on_main_rank, on_main_rank_long
from nshard.run.receipts import GpuPeaks, MetricsLog, Receipt, mark, parameter_root, startup
from nshard.run.start import StartPoint, restore, weights_record


@dataclass
class Run:
    plan: Plan
    plan_path: Path
    ds_config_path: Path
    ds_config: dict
    """Completed from the plan (preflight), once."""
    out: Path
    rank: int
    world: int
    reducer: ReducerConfig | None = None
    """The ds_config's "nshard" section, parsed once (None: DeepSpeed's own all-reduce)."""
    start: "StartPoint | None" = None
    """A second cohort's accepted candidate (nshard/run/start.py), checked before the process group; None: the plan's
    model.spec."""
    replay: bool = True
    """False (--no-replay): train without the plan's replay documents and without a first cohort's cases."""
    experts: "experts_mod.ExpertTap | None" = None
    """A sparse model's router hooks (nshard/run/experts.py), set once the engine is built; None for a dense one."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def preflight(plan: Plan, ds_config: dict, world_size: int) -> dict:
    """Check what can be checked before any process group exists: model path, replay source, batch keys.
    Returns the ds_config completed from the plan, which the run then uses as it is."""
    from nshard.seam.ds_config import check_optimizer_path, complete_ds_config
    from nshard.run.models import resolve_model
    from nshard.run.chat import check_chat_source
    from nshard.run.replay import check_replay_source

    if plan.model.spec != "embedded" and not plan.model.spec.startswith("tiny"):
        resolve_model(plan.model.spec)
    check_replay_source(plan)
    check_chat_source(plan)
    check_optimizer_path(ds_config, device_mod.cuda_available())
    return complete_ds_config(ds_config, plan, world_size)


def check_memory(plan: Plan, given: dict, completed: dict, world_size: int, start: StartPoint | None) -> dict | None:
    """Refuse (RunError, one line) a plan whose predicted per-rank peak does not fit this rank's device: its GPU where
    CUDA is present, else its share of host memory (analysis/memory_model.py plan_peak). Runs before any process
    group exists. NSHARD_MEMORY_CHECK=warn prints the refusal and goes on, =off skips it; a model the memory model
    cannot size is noted and not refused. Returns the prediction (None when skipped or not made)."""
    import os
    
    from nshard.analysis.memory_model import CHECK_ENV, CHECK_MODES, plan_peak, refusal, summary

    mode = os.environ.get(CHECK_ENV, "refuse") or "refuse"
    if mode not in CHECK_MODES:
        raise RunError(f"{CHECK_ENV}={mode!r}: use {', '.join(CHECK_MODES)}")
    if mode == "off":
        return None
    model_dir = start.model_dir if start is not None else (
        Path(plan.model.spec) if (Path(plan.model.spec) / "config.json").is_file() else None)
    ds_config = {**completed, **({"nshard": given["nshard"]} if "nshard" in given else {})}
    main = os.environ.get("RANK", "0") == "0"
    try:
        report = plan_peak(plan, ds_config, world_size, model_dir=model_dir,
                           shapes=meta_shapes(model_dir) if model_dir is not None else None)
    except (OSError, ValueError, KeyError) as exc:  # a model it cannot size: say so, do not refuse
        log.info("note: memory not planned (%s)", exc)
        return None
    if not report["fits"]:
        line = refusal(report, f"plan {plan.name} on {world_size} rank{'s' if world_size > 1 else ''}")
        if mode == "refuse" and refused(report):
            raise RunError(line)
        if main:  # the same on every rank: said once
            log.warning("%s", line)
    else:
        log.info("memory: %s", summary(report))
    return report


def refused(report: dict) -> bool:
    """Whether a prediction that does not fit is refused. A GPU's is. Host memory is refused only for what is certain:
    the activations are an upper bound (every document at max_length) and the host's memory is shared and soft, so a
    host plan that fits without them is warned about instead."""
    if report["fits"]:
        return False
    certain = report["peak_bytes"] - report["parts"].get("activations", 0)
    return report.get("device_kind") != "cpu" or certain > report["usable_bytes"]


def meta_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """A model's parameter shapes from its config.json, built on torch's meta device: no weight is read or allocated."""
    from transformers import AutoConfig

    from nshard.run.models import shaped_model

    model = shaped_model(AutoConfig.from_pretrained(model_dir, local_files_only=True), materialize=False)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def setup_run_dir(run: Run, overwrite: bool) -> None:
    """Make the run directory with copies of the plan and ds_config; only an earlier run's directory is replaced."""
    if run.out.exists() and any(run.out.iterdir()):
        if not overwrite:
            raise RunError(f"run directory {run.out} already exists; pass --out DIR or --overwrite")
        if not (run.out / "plan.toml").exists():
            raise RunError(f"{run.out} is not an nshard run directory (no plan.toml); --overwrite only "
                           "replaces run directories; choose another --out")
        shutil.rmtree(run.out)
    run.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run.plan_path, run.out / "plan.toml")
    shutil.copyfile(run.ds_config_path, run.out / "ds_config.json")
    write_run_json(run, "running")


def write_run_json(run: Run, status: str, **fields) -> None:
    body = {"status": status, "plan": run.plan.name,
            "plan_sha256": file_sha256(run.plan_path), "ds_config_sha256": file_sha256(run.ds_config_path),
            "world_size": run.world, "updates": run.plan.train.updates, "replay": run.replay,
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(), **fields}
    write_json_atomic(run.out / "run.json", body)


def prepare_inputs(run: Run, tokenizer, model_ref):
    """Every rank prepares the inputs itself (deterministic, cheap) and all must agree on the identity."""
    from nshard.run.replay import heldout_retention_documents, replay_documents

    # Rank 0 generates and caches the seed model's replay answers once, on the run's device and in its dtype
    # (minutes to hours for a big model: the others wait on a long timeout); the others then read them.
    placement = device_mod.run_placement(run.ds_config)
    replay = []
    if run.replay:
        on_main_rank_long(run, replay_documents, run.plan, model_ref, tokenizer, placement)
        replay = replay_documents(run.plan, model_ref, tokenizer, placement)
    on_main_rank_long(run, heldout_retention_documents, run.plan, model_ref, tokenizer, placement)
    retention_heldout = heldout_retention_documents(run.plan, model_ref, tokenizer, placement)
    if run.plan.data.chat_train:  # rank 0 tokenizes own data once into the cache; the others then read it
        on_main_rank_long(run, warm_chat, run.plan, tokenizer)
    try:
        prepared_all = data_mod.prepare(run.plan, tokenizer, replay, with_replay=run.replay,
                                        chat=chat_mod.chat_data(run.plan, tokenizer),
                                        retention_heldout=retention_heldout)
        error = None
    except data_mod.DataError as exc:
        prepared_all, error = None, str(exc)
    errors = all_ranks(error)
    if any(errors):
        raise data_mod.DataError(next(e for e in errors if e))
    identities = all_ranks(prepared_all[-1])
    if len(set(identities)) != 1:
        raise RunError(f"ranks prepared different inputs: {identities}; check every host has the same files")
    return prepared_all


def warm_chat(plan: Plan, tokenizer) -> None:
    try:
        chat_mod.chat_data(plan, tokenizer)
    except data_mod.DataError:
        pass  # every rank reports it in prepare_inputs, as one error


def train_update(engine, seam, run: Run, prepared, batch: list[int], pad_id: int) -> torch.Tensor:
    """One optimizer update over a global batch; returns this rank's weighted NLL sum, a float64 scalar on the device.
    It is summed there, so no microbatch waits for the device to read its loss: global_loss reads it once, after the
    update's timing (the same float64 sum of the same fp32 values, in the same order, as reading each one)."""
    micros = rank_microbatches(prepared, batch, run.world, run.rank, run.plan.train.microbatch_docs, pad_id)
    device = engine.device
    sparse = {"output_router_logits": True} if run.experts is not None else {}
    local_nll = torch.zeros((), dtype=torch.float64, device=device)
    for step, mb in enumerate(micros):
        with CLOCK.microbatch():  # forward_backward; the seam marks its reduction and step (nshard/phases.py)
            ids, mask = mb.input_ids.to(device), mb.attention_mask.to(device)
            if run.experts is not None:
                run.experts.see(torch.zeros_like(mb.attention_mask) if mb.filler else mb.attention_mask)  # no load
            out = seam.forward(engine, input_ids=ids, attention_mask=mask, use_cache=False, **sparse)
            nll = weighted_nll_sum(out.logits, ids, mb.weights.to(device))
            loss = nll * mb.loss_scale + aux_loss(run, out, mask, mb.doc_shares)
            seam.backward_and_step(engine, loss, last=step == len(micros) - 1)
            local_nll += nll.detach()
    return local_nll


def aux_loss(run: Run, out, mask: torch.Tensor, shares: list[float]):
    """A sparse model's declared load-balancing term (nshard/run/experts.py), on DeepSpeed's backward scale; 0 for a
    dense model or a zero router_aux_loss_coef."""
    if run.experts is None or not run.experts.coef:
        return 0.0
    return run.experts.aux_term(out.router_logits, mask, torch.tensor(shares)) * deepspeed_backward_scale(run.world)


def global_loss(local_nll: torch.Tensor, batch: list[int], prepared) -> float:
    """The update's loss: every rank's NLL sum (train_update's device scalar) over the batch's target weight. The
    update's one read of a training value, after its timing."""
    total = local_nll.reshape(1)  # on the rank's device: NCCL reduces device tensors only
    dist.all_reduce(total)  # torch.distributed, not deepspeed.comm: kept out of the gradient byte count
    return total.item() / math.fsum(prepared[i].target_weight for i in batch)


def train(run: Run, engine, seam, prepared, schedule, pad_id: int, keeper: state_mod.StateKeeper,
          start: int = 0, receipt: Receipt | None = None) -> Receipt:
    """Updates start.. of the schedule (a resumed run passes its state's position and receipt counters)."""
    from tqdm import tqdm

    receipt = receipt or Receipt(run.rank, run.world)
    counter = patches.CollectiveCounter()
    counter.take()
    log = MetricsLog(run.out / "metrics.jsonl" if run.is_main else None, resume_after=start)
    engine.train()
    link = netcount.LinkCount(patches.CollectiveCounter(), dist.get_backend())  # kernel vs collective bytes
    gpu_peaks = GpuPeaks()  # reset at every update, so each update's peaks are its own
    meter, grad_norm = throughput.meter(engine, prepared, run.world), observe.GradNorm(engine)
    monitor = observe.Monitor.install(engine)  # None unless the ds_config enables one of DeepSpeed's monitors
    CLOCK.use_device(engine.device)  # every update split into phases (nshard/phases.py), synchronized on CUDA
    patches.time_deepspeed_reduction(engine)
    receipt.throughput = {**meter.record(), "grad_norm": grad_norm.source, "monitor_step": observe.STEP}
    samples = list(itertools.accumulate(len(batch) for batch in schedule))  # the monitors' step: documents trained
    began, state_s_before = time.perf_counter(), receipt.state_s
    receipt.first_update_at = time.time()  # this process's start-up ends here (not part of the resumable counters)
    bar = tqdm(range(start, len(schedule)), initial=start, total=len(schedule), desc="updates", disable=not run.is_main)
    for update in bar:
        batch = schedule[update]
        if monitor:
            monitor.samples = samples[update]  # DeepSpeed's own events during this update's step
        t0 = time.perf_counter()
        CLOCK.start()
        gpu_peaks.start()
        lr = engine.optimizer.param_groups[0]["lr"]  # the rate this update steps with
        local_nll = train_update(engine, seam, run, prepared, batch, pad_id)
        compressed = seam.last_update_compressed()
        _sync()
        seconds = time.perf_counter() - t0
        timing = CLOCK.stop(seconds)  # phases summing to seconds, their detail, each microbatch's forward_backward
        counts = counter.take()
        reducer_bytes = seam.last_update_bytes()
        grad_bytes = counts["deepspeed_grad_bytes"] + reducer_bytes
        receipt.record_update(seconds, grad_bytes, counts["other_bytes"], compressed, gpu_peaks.take(),
                              deepspeed_grad_bytes=counts["deepspeed_grad_bytes"], timing=timing)
        # The compression error (a pass over the error memory and a scalar all-reduce, which only a PowerSGD arm
        # would pay) is computed for the monitors that show it; monitor.enabled is the ds_config's, alike on all ranks.
        figures = {**meter.figures(batch, seconds), "grad_norm": grad_norm.take(),
                   **(throughput.compression_error(seam, engine.device) if monitor else {})}
        receipt.record_throughput(figures)
        loss = global_loss(local_nll, batch, prepared)
        gap = delta_gap(run, engine.device)
        experts = run.experts.finish_update(update + 1, run.rank, engine.device) if run.experts else None
        if experts is not None:
            receipt.update_experts.append(experts)
        if gap is not None:
            receipt.update_delta_gap.append(gap)
        record = {"update": update + 1, "loss": loss, "lr": lr, "update_s": seconds, "compressed": compressed,
                  "grad_bytes": grad_bytes, "deepspeed_grad_bytes": counts["deepspeed_grad_bytes"],
                  "reducer_bytes": reducer_bytes, "logged_reducer_bytes": counts["logged_reducer_bytes"],
                  "parameter_bytes": counts["other_bytes"], "microbatch_sums": seam.sums,
                  "phases": timing["phases"], "phase_detail": timing["detail"], "microbatch_s": timing["microbatch_s"],
                  **figures,
                  **({"delta_gap_max": gap} if gap is not None else {}),
                  **({"expert_load": experts["load"], "dead_experts": experts["dead"],
                      "aux_loss": experts["aux_loss"]} if experts else {})}
        log.write(record)
        if monitor:
            monitor.write(record, samples[update])
        bar.set_postfix(loss=f"{loss:.4f}", s_per_update=f"{seconds:.2f}", tokens_per_s=f"{figures['tokens_per_s']:.0f}",
                        MB_sent=f"{(grad_bytes + counts['other_bytes']) / 1e6:.2f}", refresh=False)
        # Active time so far goes into the receipt before a state save, so a resumed run's receipt counts the updates
        # it did not redo (state saves and replica checks are timed apart, in receipt.state_s).
        now = time.perf_counter()
        receipt.active_s += now - began - (receipt.state_s - state_s_before)
        began, state_s_before = now, receipt.state_s
        keeper.after_update(update + 1, receipt)
        counter.take()  # a replica check's or state save's collectives belong to no update
    # The residual the last update left in PowerSGD's error memory (what the optimizer did not receive): one scalar
    # all-reduce, after the timed updates; None when that update did not compress.
    receipt.compression_error_norm = throughput.compression_error_norm(seam, engine.device)
    ledger = seam.ledger  # None under DeepSpeed's own reduction
    receipt.where_and_link = link.finish(run.rank, run.world, ledger.total_bytes() if ledger else None)
    keeper.finish(len(schedule), receipt)
    # State saves and replica checks are timed apart (receipt.state_s), so resumed or not, active_s is training.
    receipt.active_s += time.perf_counter() - began - (receipt.state_s - state_s_before)
    log.close()
    if monitor:
        monitor.close()
    return receipt


def delta_gap(run: Run, device) -> float | None:
    """Under delta parameter sync, the largest |master − replica| on any rank after this update (else None)."""
    if run.reducer is None or run.reducer.parameter_sync != "delta":
        return None
    gap = patches.take_delta_gap(device).to(torch.float64).reshape(1)  # kept on the device through the step
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)  # torch.distributed: no update's byte count
    return gap.item()  # the update's one wait for the gap, after its timing


def reduction_ran(seam, receipt: Receipt) -> dict:
    """What reduced the gradients, from what ran: the nshard reducer's ledger (one record per reduce call, the
    updates before a resume included), whether the reduction started during the last backward (this process's
    updates: its buckets, and how many of them started before the backward ended) and the bytes DeepSpeed's comms
    logger saw its own gradient collectives carry. Under an nshard reducer DeepSpeed's count holds only its scalar
    checks (tens of bytes per update)."""
    records = seam.ledger.records if seam.ledger is not None else []
    # nshard.overlap_backward, under an nshard reducer: None when the reduction starts after the last backward.
    # DeepSpeed's own reduction ("deepspeed") has no such record: its ZeRO overlap_comm is DeepSpeed's.
    overlap = getattr(seam, "overlap", None)
    started = {} if seam.name == "deepspeed" else {"overlap_backward": None if overlap is None else {
        "buckets": len(overlap.buckets), "updates": overlap.updates,
        "started_in_backward": overlap.started_in_backward}}
    # A world of one rank: "skipped" where nothing was reduced (nshard/seam/engine.py one_rank_skips), else "ran".
    one_rank = None if receipt.world_size > 1 else "skipped" if seam.one_rank_skip else "ran"
    return {"configured": seam.name, "one_rank": one_rank, "nshard_reducer_calls": len(records), **started,
            "nshard_compressed_calls": sum(1 for r in records if r["compressed"]),
            "deepspeed_grad_bytes": receipt.deepspeed_grad_bytes, "deepspeed_comms_logged": patches.comms_logged()}


def orthogonalization_record(seam) -> dict | None:
    """PowerSGD's orthogonalizations in this process: its setting, the matrices orthogonalized, and how many of them
    CholeskyQR2 handed to Householder QR (None without PowerSGD)."""
    state = getattr(getattr(seam, "reducer", None), "state", None)
    if not hasattr(state, "orthogonal_fallbacks"):
        return None
    return {"setting": state.orthogonalization, "matrices": state.orthogonalized,
            "fallbacks": state.orthogonal_fallbacks}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def export_model(run: Run, engine, tokenizer, prepared_identity: str) -> str:
    """All ranks must agree on the parameter root before rank 0 publishes model/ (safetensors, atomically)."""
    with engine_mod.full_parameters(engine):
        root = parameter_root(engine.module.named_parameters())
        roots = all_ranks(root)
        if len(set(roots)) != 1:
            raise RunError(f"ranks disagree on the parameter root: {roots}; the replicas diverged, do not use this run")
        weights = None
        if run.reducer is not None and run.reducer.parameter_sync == "delta":
            # The replicas trail the exact masters by the gap (the last complete state keeps it): the export holds
            # the masters, so the gap is closed now, in place.
            patches.close_delta_gap(engine)
            weights = {"holds": "the fp32 masters in the module's dtype: nshard.parameter_sync = \"delta\" closed "
                                "the gap (replica := master) once, after the last complete state was saved",
                       "parameter_root_of": "the replicas before the gap was closed",
                       "masters_root": parameter_root(engine.module.named_parameters())}
        if run.is_main:
            tmp = run.out / "model.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            engine.module.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            write_manifest(tmp, parameter_root=root, plan_sha256=file_sha256(run.plan_path),
                           ds_config_sha256=file_sha256(run.ds_config_path), prepared_identity=prepared_identity,
                           weights=weights)
            rename_durably(tmp, run.out / "model")
    return root


def write_prepared(run: Run, inputs: tuple) -> None:
    docs, prepared, schedule, sets, identity = inputs
    data_mod.write_prepared(run.out / "prepared", docs, prepared, schedule, sets, identity)
    print(f"prepared identity {identity}", flush=True)


def record_resume(run: Run, point: state_mod.ResumePoint, inputs: tuple) -> dict:
    """Once the state has passed every check: prepared/ (the inputs it was made with), the damaged newer states set
    aside, and run.json saying which state the run continues from and which it passed over."""
    write_prepared(run, inputs)
    record = {**point.record(), "skipped": state_mod.set_aside(run.out, point.skipped)}
    write_run_json(run, "running", resumed_from_update=point.update, resumed_from=record)
    skipped = "".join(f"; skipped {s['state']} ({s['why']}), kept at {s['kept_at']}" for s in record["skipped"])
    log.info("resumed from state %s (update %d)%s", point.state.name, point.update, skipped)
    return record


def first_start(run: Run) -> dict | None:
    """A resumed cohort run's start record: the one its first attempt wrote into run.json (the resumed state
    descends from that start; the resume itself is recorded under resumed_from)."""
    try:
        return json.loads((run.out / "run.json").read_text())["cohort"]["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_cohort(run: Run, engine, seam) -> dict:
    """A second cohort's first update continues the accepted candidate: its complete state is loaded (start =
    "state") or its export was (start = "weights"); either way checked on every rank before training."""
    record = (restore(engine, seam, run.start, run.rank, run.out) if run.start.kind == "state"
              else weights_record(engine, run.start))
    log.info("second cohort from %s of %s (%s, parameter root %s)", run.start.provenance["candidate"],
             run.start.provenance["study"], record["kind"], record["parameter_root"][:16])
    return record


def check_budget(run: Run, model_ref, prepared, schedule) -> dict | None:
    """A growth study's arm ([growth]): its schedule's training FLOPs within the plan's budget (nshard/run/budget.py),
    else BudgetError on every rank; the record for run.json and the receipts. Without growth.train_flops the budget
    is what the accepted candidate, continued dense, spends in train.updates updates."""
    from nshard.run import budget as budget_mod
    from nshard.run.cohort import read_accepted

    if not run.plan.growth.enabled:
        return None
    tokens = budget_mod.update_tokens([len(p.input_ids) for p in prepared], schedule)
    active, frozen = budget_mod.model_cost(model_ref.path)
    limit = run.plan.growth.train_flops or budget_mod.flops(
        budget_mod.model_cost(read_accepted(run.plan.cohort.from_study).model_dir)[0], tokens)
    return budget_mod.check_schedule(limit, active, tokens, frozen)


def frozen_record(model, model_ref) -> dict | None:
    """A grown export whose record declares a freeze (nshard/run/upcycle.py): those parameters get requires_grad
    False, so DeepSpeed and the seams reduce and step only what trains; None when nothing is frozen."""
    from nshard.run.budget import declared_freeze
    from nshard.run.upcycle import freeze

    setting = declared_freeze(model_ref.path) if model_ref.kind == "local" else "none"
    names = freeze(model, setting)
    if not names:
        return None
    params = dict(model.named_parameters())
    return {"setting": setting, "tensors": len(names), "parameters": sum(params[n].numel() for n in names)}


def run_training(run: Run, overwrite: bool = False, resume_from: state_mod.ResumePoint | None = None) -> dict:
    """A fresh run, or (resume_from: a state found by nshard.run.state.find_resumable) one continued from a state.
    Rank 0 owns the run directory for the run's life (nshard/lock.py); a run that holds it refuses every rank."""
    owner = on_main_rank(run, lock.acquire, run.out, note=log.info)
    try:
        return train_owned(run, overwrite, resume_from)
    finally:
        if owner is not None:
            owner.release()


def train_owned(run: Run, overwrite: bool, resume_from: state_mod.ResumePoint | None) -> dict:
    from nshard.run.cohort import start_model_spec
    from nshard.run.models import load_model, load_tokenizer, resolve_model

    # Before any CUDA kernel runs: cuBLAS reads its workspace setting when it starts.
    determinism = device_mod.apply_determinism(run.plan.checkpoint.deterministic_cuda, device_mod.cuda_available())
    if device_mod.cuda_available():
        try:
            sync_wanted()  # NSHARD_PHASE_SYNC, read by the phase clock on CUDA: refused before anything is written
        except ValueError as exc:
            raise RunError(str(exc)) from None
    gpu_peaks = GpuPeaks()
    gpu_peaks.start()

    # Rank 0 converts the embedded model once; the others then find it cached. A second cohort loads the export.
    spec = str(run.start.model_dir) if run.start else run.plan.model.spec
    on_main_rank(run, resolve_model, spec)
    model_ref = resolve_model(spec)
    tokenizer = load_tokenizer(model_ref)
    # A cohort's replay answers are the accepted candidate's, whichever model the arm trains (a grown one included).
    replay_ref = resolve_model(start_model_spec(run.plan)) if run.plan.cohort.enabled else model_ref
    inputs = prepare_inputs(run, tokenizer, replay_ref)
    docs, prepared, schedule, sets, identity = inputs
    budget = check_budget(run, model_ref, prepared, schedule)  # a growth study's arm: refused before anything is written
    mark("model and inputs")
    # Only now, with every input checked, does the run directory appear. A resumed run's is written only once its
    # state has passed every check (keeper.restore), so a refused resume leaves it as it was.
    if resume_from is None:
        on_main_rank(run, setup_run_dir, run, overwrite)
        if run.is_main:
            write_prepared(run, inputs)
    torch.manual_seed(run.plan.train.seed)
    model = load_model(model_ref)
    frozen = frozen_record(model, model_ref)  # a grown export's declared freeze, before the engine sees the model
    engine = engine_mod.build_engine(model, run.ds_config)
    seam = engine_mod.install_reducer(engine, run.reducer)
    run.experts = experts_mod.ExpertTap.find(engine.module, list(prepared[0].input_ids))
    keeper = state_mod.StateKeeper(run, engine, seam, identity)
    start, receipt = keeper.restore(resume_from) if resume_from else (0, None)
    started = (start_cohort(run, engine, seam) if not resume_from else first_start(run)) if run.start else None
    resumed = on_main_rank(run, record_resume, run, resume_from, inputs) if resume_from else None
    setup_gpu = gpu_peaks.take()  # model load, replay generation, engine build (and restore)
    mark("engine")
    receipt = train(run, engine, seam, prepared, schedule, tokenizer.pad_token_id, keeper, start, receipt)
    receipt.record_gpu_phase("setup", setup_gpu)
    gpu_peaks.start()
    t0 = time.perf_counter()
    root = export_model(run, engine, tokenizer, identity)
    receipt.record_gpu_phase("export", gpu_peaks.take())
    active_plus_checkpoint = receipt.active_s + receipt.state_s + time.perf_counter() - t0
    ds_config = json.loads(run.ds_config_path.read_text())
    extra = {"zero_stage": engine_mod.zero_stage(engine), "reducer": seam.name,
             "prepared_identity": identity, "comms_logged": patches.comms_logged(),
             "comms_logger": patches.comms_logger_receipt(),
             "parameter_all_gather": patches.parameter_all_gather(engine),
             "reduction_ran": reduction_ran(seam, receipt),
             **patches.optimizer_memory(engine), "device": str(engine.device),
             "optimizer": engine_mod.optimizer_record(engine, ds_config), "determinism": determinism,
             "numerics": numerics.record(bool(run.reducer and run.reducer.tf32)),
             "orthogonalization": orthogonalization_record(seam),
             "compression_error_norm_after_last_update": receipt.compression_error_norm,
             "precision": ds_precision(ds_config),
             "startup": startup(receipt.first_update_at),
             "initial_broadcast": dict(patches.INITIAL_BROADCAST) or None,
             "experts": run.experts and {**run.experts.declared(), **experts_mod.summary(receipt.update_experts)},
             "budget": budget, "activation_checkpointing": engine_mod.checkpointing_record(engine), "frozen": frozen}
    body = receipt.finish(run.out / "receipts" / f"rank-{run.rank}.json", root, active_plus_checkpoint, extra)
    dist.barrier()
    if run.is_main:
        write_run_json(run, "complete", prepared_identity=identity, parameter_root=root,
                       model={"spec": model_ref.spec, "kind": model_ref.kind, "sha256": model_ref.sha256},
                       zero_stage=extra["zero_stage"], reducer=extra["reducer"], precision=extra["precision"],
                       resumed_from_update=body["resumed_from_update"], resumed_from=resumed,
                       cohort=run.start and {**run.start.provenance, "start": started}, budget=budget,
                       activation_checkpointing=extra["activation_checkpointing"], frozen=frozen)
        print(json.dumps({"run": str(run.out), "parameter_root": root, "active_s": round(body["active_s"], 3)}),
              flush=True)
    return body
