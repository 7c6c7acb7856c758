"""A growth study's one-time steps before either arm runs (docs/growth.md#the-growth-study): the accepted candidate
grown once into STUDY/grown (python -m nshard.grow, with the plan's [growth] settings), the frozen budget fixed in
numbers, and each arm's number of updates written into its own plan (STUDY/arm-plans/ARM.toml: the study's plan
with train.updates and growth.train_flops set), all recorded in study.json before the first arm starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from nshard.files import file_sha256, write_text_atomic
from nshard.run.plan import Plan


class GrowthError(RuntimeError):
    """A growth study that cannot start; the message says what to do."""


def grown_dir(out: Path) -> Path:
    return Path(out) / "grown"


def make_grown(plan: Plan, out: Path, note) -> dict:
    """STUDY/grown: grown now, or an earlier one reused when it is what these settings make of this candidate.
    Either way it is checked as the grown arm's trainer checks it (nshard/run/start.py grown_start: its manifest
    verifies and its provenance names the accepted candidate); returns that check's record of it."""
    from nshard.grow import GrowError, Growth, grow
    from nshard.run.cohort import CohortError
    from nshard.run.start import find_start, grown_start

    target, settings = grown_dir(out), Growth(**plan.growth.settings())
    point = find_start(plan, 0)  # start = "weights": no rank count to match
    if not target.exists():
        try:
            grow(Path(plan.cohort.from_study), target, settings)
        except GrowError as exc:
            raise GrowthError(str(exc)) from None
        note(f"grew {point.provenance['candidate']} into {target}: {settings.experts} experts, top {settings.top_k}")
    try:
        grown = grown_start(point, target).provenance["grown"]
    except CohortError as exc:
        raise GrowthError(f"{exc}; move {target} aside and run the study again") from None
    if grown["growth"] != settings.__dict__:
        raise GrowthError(f"{target} was grown with other settings than this plan's [growth] ({grown['growth']}); "
                          "move it aside and run the study again")
    note(f"grown export {target}: {grown['parameters']:,} parameters ({grown['active_parameters_per_token']:,} per "
         f"token), parameter root {grown['parameter_root'][:16]}")
    return grown


def arm_model_dir(plan: Plan, out: Path, grown: bool) -> Path:
    from nshard.run.cohort import read_accepted

    return grown_dir(out) if grown else read_accepted(plan.cohort.from_study).model_dir


def plan_budget(plan: Plan, plan_path: Path, out: Path, note, resolve_ds_config) -> tuple[dict, dict[str, Path]]:
    """The budget in numbers and each arm's updates within it (nshard/run/budget.py), from the plan's own data
    tokenized here; each arm's plan is written with them. Returns (study.json's "growth", arm name -> plan path).
    resolve_ds_config(path, plan_path): where the study finds an arm's ds_config (nshard/study/runner.py)."""
    from nshard.run import budget as budget_mod
    from nshard.run.chat import chat_data
    from nshard.run.cohort import start_model_spec
    from nshard.run.data import batch_schedule, prepare
    from nshard.run.device import run_placement
    from nshard.run.models import load_tokenizer, resolve_model
    from nshard.run.replay import heldout_retention_documents, replay_documents
    from nshard.seam.ds_config import load_ds_config

    grown = make_grown(plan, out, note)
    ref = resolve_model(start_model_spec(plan))
    tokenizer = load_tokenizer(ref)
    g, t = plan.growth, plan.train
    chat = chat_data(plan, tokenizer) if plan.data.chat_train else None
    inputs, made = {}, {}  # arms that replay alike on one placement share their inputs
    for arm in plan.study.arms:
        placement = run_placement(load_ds_config(resolve_ds_config(arm.ds_config, plan_path)))
        key = (arm.replay, placement)
        if key not in made:
            replay = replay_documents(plan, ref, tokenizer, placement) if arm.replay else []
            docs, prepared, schedule, _, _ = prepare(
                plan, tokenizer, replay, with_replay=arm.replay, chat=chat,
                retention_heldout=heldout_retention_documents(plan, ref, tokenizer, placement))
            made[key] = ([len(p.input_ids) for p in prepared],
                         len(docs) - sum(d.kind in ("heldout", "retention-heldout") for d in docs), schedule)
        inputs[arm.name] = made[key]
    actives = {arm.name: budget_mod.model_active_parameters(arm_model_dir(plan, out, arm.grown))
               for arm in plan.study.arms}
    dense = next(a for a in plan.study.arms if not a.grown)
    if g.train_flops:
        budget, declared = float(g.train_flops), "growth.train_flops"
    else:
        lengths, _, schedule = inputs[dense.name]
        budget = float(budget_mod.flops(actives[dense.name], budget_mod.update_tokens(lengths, schedule)))
        declared = f"continued dense training ({dense.name}) over train.updates = {t.updates} updates"
    arms, paths = {}, {}
    text = plan_path.read_text()
    for arm in plan.study.arms:
        lengths, n_train, _ = inputs[arm.name]
        updates = budget_mod.updates_within(budget, actives[arm.name], lengths, n_train, t.global_batch_docs,
                                            plan.data.seed)
        if updates < 1:
            raise GrowthError(f"growth: the budget ({budget:.4g} FLOPs) does not buy arm {arm.name} one update; "
                              "raise growth.train_flops or train.updates")
        tokens = budget_mod.update_tokens(lengths, batch_schedule(n_train, updates, t.global_batch_docs, plan.data.seed))
        path = Path(out) / "arm-plans" / f"{arm.name}.toml"
        write_text_atomic(path, arm_plan_text(text, updates, budget, plan, plan_path, resolve_ds_config))
        paths[arm.name] = path
        arms[arm.name] = {"grown": arm.grown, "updates": updates, "active_parameters_per_token": actives[arm.name],
                          "tokens": sum(tokens), "train_flops": budget_mod.flops(actives[arm.name], tokens),
                          "plan": str(path), "plan_sha256": file_sha256(path)}
        note(f"budget: arm {arm.name} trains {updates} updates ({sum(tokens):,} tokens, "
             f"{arms[arm.name]['train_flops']:.4g} of {budget:.4g} FLOPs)")
    record = {"budget": {"kind": g.budget, "train_flops": budget, "declared_as": declared, "how": budget_mod.HOW},
              "arms": arms, "grown": {k: grown[k] for k in ("model_dir", "parameter_root", "parameters",
                                                            "active_parameters_per_token", "growth")}}
    return record, paths


def arm_plan_text(text: str, updates: int, budget: float, plan: Plan | None = None,
                  plan_path: Path | None = None, resolve_ds_config=None) -> str:
    """The study's plan with [train] updates and [growth] train_flops set, and the paths it names made absolute
    (the arm's plan lies under the study directory, not beside the study's); the rest as written."""
    text, n = re.subn(r"(?m)^updates\s*=\s*\d+", f"updates = {updates}", text, count=1)
    if n != 1:
        raise GrowthError("a growth plan needs an 'updates = N' line in its [train] section")
    line = f"train_flops = {float(budget)!r}"
    text, n = re.subn(r"(?m)^train_flops\s*=.*$", line, text, count=1)
    if n == 0:
        text, n = re.subn(r"(?m)^\[growth\][^\n]*$", lambda m: m.group(0) + "\n" + line, text, count=1)
    if n != 1:
        raise GrowthError("a growth plan needs its [growth] section header on a line of its own")
    if plan is None:
        return text
    resolved = {"from": lambda v: plan.cohort.from_study, "ds_config": lambda v: str(resolve_ds_config(v, plan_path)),
                "replay_file": lambda v: plan.data.replay_file, "chat_train": lambda v: plan.data.chat_train,
                "chat_heldout": lambda v: plan.data.chat_heldout, "hostfile": lambda v: plan.study.hostfile}
    for key, value in resolved.items():
        text = re.sub(rf'(?m)^(\s*{key}\s*=\s*)"([^"]+)"',
                      lambda m, value=value: f'{m.group(1)}{json.dumps(str(Path(value(m.group(2))).resolve()))}', text)
    return text
