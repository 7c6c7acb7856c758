"""Elastic resume (nshard/run/elastic.py): a complete state saved on W ranks continues on W' != W ranks with
--resume --elastic, 2 -> 1 and 1 -> 2 at ZeRO stages 0, 1 and 2 with PowerSGD. The optimizer state the resumed run
holds, gathered, is the saved one (rebuilt here from the saved ZeRO partitions); the error-feedback total (the mean
over ranks of the error memory) is conserved by the stated rule (nshard/comm/feedback.py ERROR_RULE), checked
exactly against the saved errors; the receipts and run.json say what changed. The rule itself is checked on plain
tensors in the fast tier, and what cannot be repartitioned is refused with one line naming the fix."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from nshard.comm.feedback import conservation_record, mean_errors, spread_errors, total_record
from nshard.run import elastic
from nshard.run.state import StateError, find_resumable, read_manifest, sealed_states
from runs import RESUME_UPDATES as UPDATES, launch, receipts, resume_plan, resume_reference

RESUMED_AT, RESUMED_UPDATE = "update-000006", 6  # the newest state is removed, so the resumed run trains 7 and 8


# --- the rule, on plain tensors (fast) ---------------------------------------------------------------------------

def random_errors(world: int, seed: int) -> list[dict]:
    """Per-rank error memories with elements spread over many binades, so fp32 sums round."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (5, 7), "b": (3, 2, 4)}
    return [{n: torch.randn(s, generator=g) * torch.exp2(torch.randint(-20, 20, s, generator=g).float())
             for n, s in shapes.items()} for _ in range(world)]


def fp64_mean(errors_by_rank: list[dict]) -> dict:
    return {n: sum(e[n].double() for e in errors_by_rank) / len(errors_by_rank) for n in errors_by_rank[0]}


@pytest.mark.parametrize("saved_world,world", [(2, 1), (1, 2), (3, 2), (1, 3), (4, 1)])
def test_every_new_rank_gets_the_mean_error_and_the_total_is_conserved(saved_world, world):
    before = random_errors(saved_world, seed=saved_world * 10 + world)
    spread = spread_errors(mean_errors(before))
    after = [{n: t.clone() for n, t in spread.items()} for _ in range(world)]  # every new rank holds the spread
    want, got = fp64_mean(before), fp64_mean(after)
    assert all(after[r][n].dtype == torch.float32 for r in range(world) for n in want)
    for n in want:
        if saved_world == 1:  # a copy of the one saved error: conserved exactly
            assert torch.equal(got[n], want[n])
        else:  # the fp64 mean rounded once to fp32, nothing more
            assert torch.equal(got[n], want[n].float().double())
            ulp = torch.finfo(torch.float32).eps * want[n].abs()
            assert ((got[n] - want[n]).abs() <= ulp / 2).all()
    record = conservation_record(mean_errors(before), fp64_mean(after))
    assert record["exact"] is (saved_world == 1)
    assert record["before"] == total_record(want) and record["after"] == total_record(got)


def test_errors_of_different_parameters_are_refused():
    a, b = random_errors(2, seed=1)
    with pytest.raises(ValueError, match="holds error memory for"):
        mean_errors([a, {"a": b["a"]}])
    with pytest.raises(ValueError, match="the error memory of b has shape"):
        mean_errors([a, {**b, "b": b["b"][:1]}])


def reducer(q: float = 1.0) -> dict:
    return {"updates": 3, "shapes": {"w": (4, 4)}, "rng": torch.zeros(8, dtype=torch.uint8),
            "q": {"w": torch.full((4, 2), q)}, "errors": {"w": torch.ones(4, 4)}, "ledger": {"records": []}}


def test_q_that_differs_between_saved_ranks_is_refused_naming_the_parameter():
    parts = [{"seam": {"reducer": reducer()}}, {"seam": {"reducer": reducer(q=2.0)}}]
    with pytest.raises(ValueError, match="the saved Q of w differs between rank 0 and rank 1"):
        elastic.carry_parts(lambda i: parts[i], 2, 0)
    parts[1]["seam"]["reducer"]["q"]["w"] = torch.full((4, 2), 1.0)
    part, before = elastic.carry_parts(lambda i: parts[i], 2, 0)
    assert torch.equal(part["seam"]["reducer"]["q"]["w"], parts[0]["seam"]["reducer"]["q"]["w"])
    assert torch.equal(before["w"], torch.ones(4, 4, dtype=torch.float64))


@pytest.mark.parametrize("stage,delta,wrapped,message", [
    (3, False, False, "ZeRO stage 3 partitions the parameters themselves"),
    (1, True, False, "parameter_sync = \"delta\""),
    (0, False, True, "at ZeRO stage 0 DeepSpeed wraps the optimizer in object"),
])
def test_what_cannot_be_repartitioned_is_refused_with_the_fix(stage, delta, wrapped, message):
    basic = object()
    engine = SimpleNamespace(zero_optimization_stage=lambda: stage, basic_optimizer=basic,
                             optimizer=object() if wrapped else basic)
    why = elastic.refusal(engine, delta)
    assert message in why and "resume on the state's own world size" in why


# --- real runs (slow) ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan(runs_root):
    return resume_plan(runs_root)


def saved_run(plan, root, stage: int, world: int, bf16: bool = False):
    """One run per stage, world size and precision: tests/test_resume.py's uninterrupted reference (two ranks), or
    its twin on one rank."""
    return resume_reference(root, stage, bf16, world)


def interrupted_copy(src, dest):
    """The saved run as if it had stopped after update 6: newer states, receipts and the export removed."""
    shutil.copytree(src, dest)
    for state in sealed_states(dest):
        if state.name != RESUMED_AT:
            shutil.rmtree(state)
    shutil.rmtree(dest / "model")
    shutil.rmtree(dest / "receipts")
    return dest


def saved_optimizer_state(ds_dir, stage: int) -> dict:
    """Every parameter's fp32 master and AdamW moments, whole, read from DeepSpeed's files as saved: stage 0's one
    optimizer state dict, or the ZeRO partitions put back together by their parameter slice mappings."""
    model = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if stage == 0:
        seen, names = set(), []
        for name, t in model["module"].items():  # parameter order; a tied weight once
            if name not in model["buffer_names"] and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                names.append(name)
        saved = model["optimizer"]
        if "fp32_groups" in saved:  # bf16 compute: DeepSpeed's wrapper saves the fp32 masters beside the moments
            masters, saved = saved["fp32_groups"][0], saved["optimizer_state_dict"]
        else:
            masters = [model["module"][n].float() for n in names]
        return {n: {"fp32": masters[i], "exp_avg": saved["state"][i]["exp_avg"],
                    "exp_avg_sq": saved["state"][i]["exp_avg_sq"]}
                for n, i in zip(names, saved["param_groups"][0]["params"])}
    pieces: dict = {}
    for path in sorted(ds_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                       key=lambda p: int(p.name.split("_")[3])):
        saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for g, mapping in enumerate(saved["param_slice_mappings"]):
            flat = {"fp32": saved["single_partition_of_fp32_groups"][g],
                    **{k: saved["base_optimizer_state"]["state"][g][k] for k in ("exp_avg", "exp_avg_sq")}}
            for name, frag in mapping.items():
                for key, t in flat.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(t[frag.start:frag.start + frag.numel])
    shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}
    return {n: {k: torch.cat(v).reshape(shapes[n]) for k, v in keys.items()} for n, keys in pieces.items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("saved_world,world", [(2, 1), (1, 2)])
def test_state_continues_on_another_world_size(plan, runs_root, tmp_path, stage, saved_world, world):
    check_elastic_resume(plan, runs_root, tmp_path, stage, saved_world, world)


@pytest.mark.slow
def test_bf16_state_at_stage_0_continues_on_one_rank(plan, runs_root, tmp_path):
    """bf16 compute at stage 0 (the CPU main job's path where the CPU has bf16 units): DeepSpeed's wrapper keeps the
    fp32 masters whole, and they are what the resumed rank holds."""
    check_elastic_resume(plan, runs_root, tmp_path, 0, 2, 1, bf16=True)


def check_elastic_resume(plan, runs_root, tmp_path, stage: int, saved_world: int, world: int, bf16: bool = False):
    out = interrupted_copy(saved_run(plan, runs_root, stage, saved_world, bf16), tmp_path / "run")
    state = out / "state" / RESUMED_AT
    # Without --elastic a state of another world size is refused, naming the fix; with it, found.
    with pytest.raises(StateError, match=f"another world size \\({saved_world} there, {world} now\\).*--elastic"):
        find_resumable(out, plan, out / "ds_config.json", world)
    assert find_resumable(out, plan, out / "ds_config.json", world, elastic_resume=True).saved_world == saved_world

    launch(out, out / "ds_config.json", world=world, plan=plan, extra_args=["--resume", "--elastic"])
    body = json.loads((out / "run.json").read_text())
    assert body["status"] == "complete" and body["world_size"] == world
    assert body["resumed_from"]["elastic"] == {"from_world_size": saved_world, "to_world_size": world}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in lines] == list(range(1, UPDATES + 1))
    assert not list((out / "state").glob(".tmp-*"))  # the universal checkpoint's scratch is gone
    newest = sealed_states(out)[-1]
    assert newest.name == f"update-{UPDATES:06d}" and read_manifest(newest)["world_size"] == world

    # The optimizer state the new ranks hold, gathered, is the saved one.
    saved_optimizer = saved_optimizer_state(state / "deepspeed", stage)
    assert saved_optimizer and all(sorted(v) == ["exp_avg", "exp_avg_sq", "fp32"] for v in saved_optimizer.values())
    want_optimizer = elastic.optimizer_sha256(saved_optimizer)
    # The error-feedback total: the mean over the saved ranks' errors, in fp64.
    parts = [torch.load(state / f"rank-{r}.pt", map_location="cpu", weights_only=False)
             for r in range(saved_world)]
    before = fp64_mean([p["seam"]["reducer"]["errors"] for p in parts])
    assert before and any(t.abs().sum() > 0 for t in before.values())  # compressed updates left an error
    after = before if saved_world == 1 else {n: t.float().double() for n, t in before.items()}
    got = receipts(out)
    assert [r["rank"] for r in got] == list(range(world))
    for receipt in got:
        assert receipt["world_size"] == world and receipt["updates"] == UPDATES
        [record] = receipt["elastic"]
        assert (record["from_world_size"], record["to_world_size"], record["zero_stage"], record["update"]) == (
            saved_world, world, stage, RESUMED_UPDATE)
        assert record["optimizer_state_sha256"] == want_optimizer
        memory = record["error_memory"]
        assert memory["before"] == total_record(before) and memory["after"] == total_record(after)
        assert memory["exact"] is all(torch.equal(after[n], before[n]) for n in before)
