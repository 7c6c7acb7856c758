"""A second cohort's recipe parts, without a launch: replay counted per first-cohort family, held-out retention
documents that no training set holds, and weight interpolation toward the seed model."""

from __future__ import annotations

import dataclasses

import pytest

from nshard import tasks
from nshard.run import data as data_mod
from nshard.run.cohort import CohortError
from nshard.run.data import DataError, Document
from nshard.run.plan import PlanError, plan_from_dict
from nshard.run.replay import GENERAL_PROMPTS, HELDOUT_PROMPTS

FIRST = ("lookup", "filtering", "sorting", "invoice")


def cohort_plan(**cohort) -> object:
    return plan_from_dict({"data": {"families": ["cheapest", "acronym"], "seed": 21, "eval_seed": 3001},
                           "cohort": {"from": "runs/x", **cohort}})


def first_train(per_family: int = 6) -> list:
    train, _ = tasks.split_cases(list(FIRST), 11, 1211, per_family, 2)
    return train


def test_replay_by_family_takes_each_familys_count_and_the_screened_ones_whole():
    train = first_train()
    plan = cohort_plan(replay_cases={"lookup": 6, "sorting": 2})
    chosen = data_mod.replayed_case_ids(plan, train, FIRST, 6, ["lookup"])
    families = [next(c.family for c in train if c.case_id == i) for i in chosen]
    assert families.count("lookup") == 6 and families.count("sorting") == 2 and len(chosen) == 8
    # the share rule, by contrast, draws over all families together
    shared = data_mod.replayed_case_ids(cohort_plan(first_cohort_share=0.25), train, FIRST, 6, ["lookup"])
    assert len(shared) == 6
    # other data seeds draw other sorting cases (2 of 6), always the same lookup ones (all of them)
    draws = [data_mod.replayed_case_ids(dataclasses.replace(plan, data=dataclasses.replace(plan.data, seed=s)),
                                        train, FIRST, 6, ["lookup"]) for s in range(22, 28)]
    assert len({frozenset(d) for d in draws}) > 1
    assert all({i for i in d if i.startswith("lookup")} == {i for i in chosen if i.startswith("lookup")} for d in draws)


@pytest.mark.parametrize("cases, screened, words", [
    ({"lookup": 3}, ["lookup"], "cohort.replay_cases.lookup=3: the first-cohort screen counts lookup, so replay all 6"),
    ({"sorting": 6}, ["lookup"], "cohort.replay_cases.lookup=0"),
    ({"lookup": 6, "cheapest": 2}, ["lookup"], "cohort.replay_cases.cheapest: 'cheapest' is not a first-cohort family"),
    ({"lookup": 7}, ["lookup"], "cohort.replay_cases.lookup=7 exceeds the first cohort's 6 training cases"),
])
def test_replay_by_family_refuses_what_cannot_be_replayed(cases, screened, words):
    with pytest.raises(CohortError, match=words.replace("(", r"\(").replace(")", r"\)")):
        data_mod.replayed_case_ids(cohort_plan(replay_cases=cases), first_train(), FIRST, 6, screened)


def test_the_plan_refuses_two_replay_rules_and_bad_counts():
    with pytest.raises(PlanError, match="cohort.first_cohort_share and cohort.replay_cases both"):
        cohort_plan(replay_cases={"lookup": 6}, first_cohort_share=0.25)
    with pytest.raises(PlanError, match=r"cohort.replay_cases=\{.lookup.: -1\}: give each family a whole number"):
        cohort_plan(replay_cases={"lookup": -1})
    with pytest.raises(PlanError, match=r"\[cohort.replay_cases\] table"):
        cohort_plan(replay_cases=6)
    with pytest.raises(PlanError, match="cohort.first_cohort_response_weight=-1.0 must not be negative"):
        cohort_plan(first_cohort_response_weight=-1.0)


def test_held_out_prompts_are_never_the_replay_prompts():
    assert len(HELDOUT_PROMPTS) == len(set(HELDOUT_PROMPTS)) == 64 and len(set(GENERAL_PROMPTS)) == 128
    assert not {p.strip().lower() for p in HELDOUT_PROMPTS} & {p.strip().lower() for p in GENERAL_PROMPTS}
    with pytest.raises(PlanError, match="data.heldout_retention_docs=65 exceeds the 64 built-in held-out prompts"):
        plan_from_dict({"data": {"heldout_retention_docs": 65}})


def chat(doc_id: str, prompt: str, kind: str = "replay") -> Document:
    return Document(doc_id, kind, kind, ({"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"}),
                    1.0)


def test_a_held_out_document_that_training_holds_is_refused_by_id_or_by_prompt():
    heldout = [chat("heldout-builtin-0000", HELDOUT_PROMPTS[0], "retention-heldout")]
    data_mod.check_never_trained(heldout, [chat("replay-builtin-0000", GENERAL_PROMPTS[0])])
    with pytest.raises(DataError, match="held-out retention document heldout-builtin-0000 .* is in the training set"):
        data_mod.check_never_trained(heldout, [chat("own-7", f"  {HELDOUT_PROMPTS[0]} ")])
    with pytest.raises(DataError, match="held-out retention document heldout-builtin-0000"):
        data_mod.check_never_trained(heldout, [chat("heldout-builtin-0000", "another prompt")])


@pytest.mark.parametrize("arm, words", [
    ({"name": "mix", "interpolate": "powersgd", "alpha": 1.0}, "must lie in \\(0, 1\\)"),
    ({"name": "mix", "alpha": 0.5}, "alpha=0.5 without interpolate"),
    ({"name": "mix", "interpolate": "nowhere", "alpha": 0.5}, "interpolate='nowhere' is not a trained arm"),
    ({"name": "mix", "interpolate": "powersgd", "alpha": 0.5, "replay": False}, "trains nothing"),
])
def test_an_interpolated_arm_is_checked_in_the_plan(arm, words):
    arms = [{"name": "powersgd", "ranks": 2}, arm]
    with pytest.raises(PlanError, match=words):
        plan_from_dict({"study": {"arms": arms, "candidate": "powersgd", "speed_baseline": "powersgd"}})
    with pytest.raises(PlanError, match="is an interpolated arm, which trains nothing"):
        plan_from_dict({"checkpoint": {"every": 1}, "train": {"updates": 3}, "study": {
            "arms": [{"name": "powersgd", "ranks": 2}, {"name": "mix", "interpolate": "powersgd", "alpha": 0.5}],
            "candidate": "powersgd", "speed_baseline": "powersgd", "fault": {"arm": "mix", "update": 2}}})


def test_interpolation_is_lerp_of_every_parameter_in_fp32_stored_in_the_trained_dtype():
    import torch

    from nshard.interpolate import InterpolateError, interpolated_parameters
    from nshard.run.models import load_model, resolve_model

    seed = load_model(resolve_model("tiny:1"))
    trained = load_model(resolve_model("tiny:2")).to(torch.bfloat16)
    want = {n: torch.lerp(dict(seed.named_parameters())[n].float(), p.float(), 0.25).to(torch.bfloat16)
            for n, p in trained.named_parameters()}
    interpolated_parameters(seed, trained, 0.25)
    for name, param in trained.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, want[name]), name
    seed.model.embed_tokens.weight.data = seed.model.embed_tokens.weight.data[:-1]
    with pytest.raises(InterpolateError, match="model.embed_tokens.weight: seed shape"):
        interpolated_parameters(seed, trained, 0.5)
