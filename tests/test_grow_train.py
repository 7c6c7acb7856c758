"""Training an upcycled tiny Mixtral with nshard (issue 27 items 2 and 3): PowerSGD per expert on one and two ranks,
ZeRO-1, ZeRO-2 with delta sync, a SIGKILLed run resumed bit-identical, and the expert receipts of every update."""

import json

import pytest
import torch

from nshard.grow import Growth, grow
from runs import REPO, cached_run, final_params, launch, receipts, tiny_config

pytestmark = pytest.mark.slow

UPDATES = 6
POWERSGD = {"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1}
DELTA = {**POWERSGD, "parameter_sync": "delta", "delta_bits": 4}
# At lr 2e-3 (tiny_config's default) the random tiny model's hidden states drift so fast that an expert of layer 1
# got no token by update 5, even with a load-balancing weight of 0.1; at 5e-4 with 0.1 every expert keeps >= 57 of
# ~1,500 slots per layer (docs/growth.md).
LR, AUX = 5e-4, 0.1


def config(**kw) -> dict:
    return tiny_config(lr=LR, **kw)


@pytest.fixture(scope="module")
def plan(runs_root, tmp_path_factory):
    """The tiny plan on a Mixtral grown (4 experts, top 2) from a trained tiny Llama run's export."""
    source = cached_run(runs_root, "ds-dense", tiny_config())
    tmp = tmp_path_factory.mktemp("grown-train")
    grow(source, tmp / "grown", Growth(experts=4, top_k=2, seed=1, aux_coef=AUX))
    text = (REPO / "launch/plans/tiny.toml").read_text().replace('spec = "tiny"', f'spec = "{tmp / "grown"}"')
    path = tmp / "grown.toml"
    path.write_text(text.replace("updates = 3", f"updates = {UPDATES}")
                    + "\n[checkpoint]\nevery = 2\nreplica_check_every = 1\n")
    return path


ARMS = {"one": (config(nshard=POWERSGD), 1), "two": (config(nshard=POWERSGD), 2),
        "zero1": (config(stage=1, nshard=POWERSGD), 2), "zero2-delta": (config(stage=2, nshard=DELTA), 2)}


class Arms(dict):
    """Each arm launched when a test first asks for it, so no one test's set-up carries every launch."""

    def __init__(self, runs_root, plan):
        super().__init__()
        self.runs_root, self.plan = runs_root, plan

    def __missing__(self, name):
        ds, world = ARMS[name]
        self[name] = cached_run(self.runs_root, f"grown-psgd-{name}", ds, world=world, plan=self.plan)
        return self[name]

    def every(self):
        return [(name, self[name]) for name in ARMS]


@pytest.fixture(scope="module")
def arms(runs_root, plan):
    return Arms(runs_root, plan)


def test_one_and_two_ranks_and_zero1_train_the_same_sparse_model(arms, plan):
    """PowerSGD's P and Q are linear in M and the ranks' errors average to the one rank's: one rank, two ranks and
    ZeRO-1 give the same experts and routers within fp32 tolerance, after training really moved them."""
    from transformers import AutoModelForCausalLM

    one = final_params(arms["one"])
    assert any(".block_sparse_moe.experts.3.w2.weight" in k for k in one)  # Mixtral's own checkpoint layout
    for name in ("two", "zero1"):
        other = final_params(arms[name])
        assert other.keys() == one.keys()
        for key in one:
            torch.testing.assert_close(other[key], one[key], rtol=1e-4, atol=1e-5, msg=f"{name}:{key}")
    grown = AutoModelForCausalLM.from_pretrained(plan.read_text().split('spec = "')[1].split('"')[0])
    trained = AutoModelForCausalLM.from_pretrained(arms["two"] / "model")
    experts = [(a - b).abs().max().item() for a, b in ((trained.model.layers[0].mlp.experts.down_proj,
                                                        grown.model.layers[0].mlp.experts.down_proj),)]
    assert experts[0] > 1e-4
    down = trained.model.layers[0].mlp.experts.down_proj
    assert not torch.equal(down[0], down[1])  # the copies were trained apart: different tokens reach each


def test_every_rank_holds_the_same_replica_and_compresses_per_expert(arms):
    for name in ("two", "zero1", "zero2-delta"):
        rs = receipts(arms[name])
        assert len({r["parameter_root"] for r in rs}) == 1, name
        assert all(r["update_compressed"] == [False] + [True] * (UPDATES - 1) for r in rs), name
    state = torch.load(sorted((arms["two"] / "state").glob("update-*"))[-1] / "rank-0.pt", weights_only=False)
    errors = state["seam"]["reducer"]["errors"]
    units = sorted(n for n in errors if "experts.down_proj" in n and n.startswith("model.layers.0."))
    assert units == [f"model.layers.0.mlp.experts.down_proj[{e}]" for e in range(4)]
    assert all(errors[n].shape == (64, 128) for n in units)


def test_zero2_with_delta_sync_trains_the_sparse_model_like_stage_0(arms):
    a, b = final_params(arms["zero2-delta"]), final_params(arms["two"])
    for key in a:  # a few quantization steps of lr-sized changes apart
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=5e-3, msg=key)
    assert all(len(r["update_delta_gap"]) == UPDATES for r in receipts(arms["zero2-delta"]))


def loads_and_tokens(out) -> list[tuple[list[list[int]], int]]:
    """Each update's expert load (metrics.jsonl) and the document tokens its schedule trained."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    prepared = [json.loads(line) for line in (out / "prepared" / "documents.jsonl").read_text().splitlines()]
    schedule = json.loads((out / "prepared" / "schedule.json").read_text())
    return [(m["expert_load"], sum(len(prepared[i]["input_ids"]) for i in schedule[update]))
            for update, m in enumerate(metrics)]


def test_expert_receipts_record_load_no_dead_experts_and_identical_routing(arms):
    for name, out in arms.every():
        rs = receipts(out)
        for r in rs:
            experts = r["experts"]
            assert (experts["layers"], experts["experts"], experts["top_k"]) == (2, 4, 2)
            assert experts["aux_loss"].startswith("Switch") and experts["aux_loss_coef"] == AUX
            assert experts["capacity"].startswith("none")
            assert experts["dead_in_any_update"] == [] and experts["dropped_tokens"] == 0
            assert experts["routing_identical_on_ranks"] and len(r["update_experts"]) == UPDATES
        # The load is the all-rank count, the same in every rank's receipt, and covers every real token twice.
        assert len({json.dumps(r["update_experts"]) for r in rs}) == 1
        for update, (load, tokens) in enumerate(loads_and_tokens(out)):
            assert [sum(layer) for layer in load] == [2 * tokens] * 2, (name, update)
            assert load == rs[0]["update_experts"][update]["load"]
    # One rank and two ranks route the probe of every update the same way (same model within fp32 tolerance).
    digests = {name: [u["probe_routing_sha256"] for u in receipts(out)[0]["update_experts"]]
               for name, out in arms.every()}
    assert digests["one"] == digests["two"] == digests["zero1"]


def test_a_killed_sparse_run_resumes_bit_identical(arms, plan, runs_root):
    out = runs_root / "grown-psgd-killed"
    ds = config(nshard=POWERSGD)
    killed = launch(out, ds, plan=plan, check=False, env={"NSHARD_FAULT": "1:3"})
    assert killed.returncode != 0
    launch(out, ds, plan=plan, extra_args=["--resume"])
    run, ref = (json.loads((d / "run.json").read_text()) for d in (out, arms["two"]))
    assert run["resumed_from_update"] == 2 and run["parameter_root"] == ref["parameter_root"]
    got, want = final_params(out), final_params(arms["two"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["update_experts"] for r in receipts(out)] == [r["update_experts"] for r in receipts(arms["two"])]


# ---------------------------------------------------------------- the shared-expert design (qwen2_moe)

QWEN = {"trainable": ("none", config(nshard=POWERSGD)), "frozen": ("shared", config(stage=2, nshard=POWERSGD))}
"""The tiny Llama grown into a Qwen2-MoE (4 routed experts of 32, top 1, no balancing loss): its shared expert
trained at stage 0, and frozen at ZeRO-2 (the growth study's pooled path)."""


@pytest.fixture(scope="module")
def qwen(runs_root, tmp_path_factory):
    """Each design trained on two ranks with PowerSGD: {name: (grown export, run directory)}."""
    source = cached_run(runs_root, "ds-dense", tiny_config())
    tmp = tmp_path_factory.mktemp("grown-qwen")
    out = {}
    for name, (freeze, ds) in QWEN.items():
        grown = tmp / f"grown-{name}"
        grow(source, grown, Growth(experts=4, top_k=1, seed=1, aux_coef=0.0, architecture="qwen2_moe",
                                   expert_size=32, freeze=freeze))
        text = (REPO / "launch/plans/tiny.toml").read_text().replace('spec = "tiny"', f'spec = "{grown}"')
        plan = tmp / f"{name}.toml"
        plan.write_text(text.replace("updates = 3", f"updates = {UPDATES}"))
        out[name] = (grown, cached_run(runs_root, f"grown-qwen-{name}", ds, plan=plan))
    return out


def test_the_task_trains_the_qwen2_moe_router_through_nshard_with_the_shared_expert_frozen_or_not(qwen):
    """No balancing loss: whatever moves the routers is the task. Frozen, the shared expert (the accepted MLP) and
    its gate leave training bit for bit as grown, PowerSGD holds no error memory for them, and run.json says what
    was frozen; trainable, they move. Either way the zero down projections and the routers move, every rank ends
    with the same parameters, and the export is transformers' own Qwen2-MoE."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    moved = {}
    for name, (grown, out) in qwen.items():
        before, after = load_file(str(grown / "model.safetensors")), final_params(out)
        assert before.keys() == after.keys()
        moved[name] = {k for k in before if not torch.equal(before[k], after[k])}
        routers = [k for k in before if k.endswith("mlp.gate.weight")]
        assert len(routers) == 2 and set(routers) <= moved[name], name
        print(f"{name}: router moved by {max((after[k] - before[k]).abs().max().item() for k in routers):.3g}")
        assert all(after[k].abs().max() > 0 for k in after if "experts" in k and "down_proj" in k), name
        rs = receipts(out)
        assert len({r["parameter_root"] for r in rs}) == 1
        assert all(r["update_compressed"] == [False] + [True] * (UPDATES - 1) for r in rs), name
        model = AutoModelForCausalLM.from_pretrained(out / "model")
        assert type(model).__name__ == "Qwen2MoeForCausalLM" and model.config.norm_topk_prob is False
    shared = {k for k in final_params(qwen["frozen"][1]) if ".shared_expert" in k}
    assert len(shared) == 2 * 4 and not shared & moved["frozen"] and shared <= moved["trainable"]
    frozen_run = json.loads((qwen["frozen"][1] / "run.json").read_text())
    assert frozen_run["frozen"]["setting"] == "shared" and frozen_run["frozen"]["tensors"] == 8
    assert json.loads((qwen["trainable"][1] / "run.json").read_text())["frozen"] is None
    for name, (_, out) in qwen.items():
        state = torch.load(sorted((out / "state").glob("update-*"))[-1] / "rank-0.pt", weights_only=False)
        errors = state["seam"]["reducer"]["errors"]
        assert any("shared_expert" in n for n in errors) == (name == "trainable"), name


def test_qwen2_moe_expert_receipts_count_one_expert_per_token_and_agree_on_ranks(qwen):
    for name, (_, out) in qwen.items():
        rs = receipts(out)
        for r in rs:
            experts = r["experts"]
            assert (experts["layers"], experts["experts"], experts["top_k"]) == (2, 4, 1), name
            assert experts["aux_loss_coef"] == 0.0 and experts["aux_loss"].startswith("none")
            assert experts["dropped_tokens"] == 0 and experts["routing_identical_on_ranks"]
        assert len({json.dumps(r["update_experts"]) for r in rs}) == 1
        loads = loads_and_tokens(out)
        for update, (load, tokens) in enumerate(loads):
            assert [sum(layer) for layer in load] == [tokens] * 2, (name, update)
        print(f"{name}: expert load per update, layer 0: {[load[0] for load, _ in loads]}")
