"""PowerSGD against the dense reducer on two and three real gloo ranks: warm-up, exactness, error feedback, placement, resume, bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from spawn import run_ranks

SHAPES = {
    "a.weight": (16, 24),
    "b.weight": (16, 24),  # same shape as a: batched with it
    "conv.weight": (8, 4, 3),  # viewed as (8, 12)
    "moe.experts.w": (3, 16, 24),  # fused experts: three (16, 24) matrices, batched with a and b
    "emb.weight": (40, 8),
    "norm.bias": (16,),
    "scale": (),
}
CONFIG = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 2, "min_compression_rate": 1,
          "warm_start": True, "seed": 7, "transport": "torch"}
# With rank 2 and min_compression_rate 1 every >= 2-D tensor above compresses; (n, m, r) per matrix.
COMPRESSED = {"a.weight": (16, 24, 2), "b.weight": (16, 24, 2), "conv.weight": (8, 12, 2), "emb.weight": (40, 8, 2),
              **{f"moe.experts.w[{e}]": (16, 24, 2) for e in range(3)}}
COMPRESSED_PARAMS = {name.split("[")[0] for name in COMPRESSED}


def unit(tensors: dict, name: str) -> torch.Tensor:
    """A compressed unit of parameter-keyed tensors: the parameter, or one expert `param[e]` of a stack."""
    if name.endswith("]"):
        param, index = name[:-1].split("[")
        return tensors[param][int(index)]
    return tensors[name]
UPDATES, RESUME_AFTER = 6, 3


def grads_for(rank: int, update: int, dtype=torch.float32, shapes=SHAPES) -> dict[str, torch.Tensor]:
    """Rank- and update-dependent gradients, reproducible in the parent for the reference sums."""
    gen = torch.Generator().manual_seed(1000 * update + rank)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def _errors_q_rng(reducer) -> dict:
    sd = reducer.state_dict()
    return copy.deepcopy({"errors": sd["errors"], "q": sd["q"], "rng": sd["rng"]})


def core_scenario(rank: int, world: int, dtype_name: str, warmup: int) -> dict:
    """Dense, PowerSGD with device and host errors, and one restored mid-run, fed identical gradients."""
    from nshard.comm import build_reducer

    dtype = getattr(torch, dtype_name)
    config = {**CONFIG, "dense_warmup_updates": warmup}
    reducers = {
        "dense": build_reducer({**config, "reducer": "dense"}),
        "device": build_reducer({**config, "error_feedback": "device"}),
        "host": build_reducer({**config, "error_feedback": "host"}),
    }
    summed = build_reducer({**config, "error_feedback": "device"})
    summed.register(SHAPES)
    summed.deliver_as({name: dtype for name in SHAPES})
    outputs = {key: [] for key in [*reducers, "restored", "summed"]}
    for update in range(UPDATES):
        for key, reducer in reducers.items():
            grads = grads_for(rank, update, dtype)
            reducer.reduce(grads)
            outputs[key].append(grads)
        outputs["summed"].append(summed_update(summed, grads_for(rank, update, dtype)))
        if update == RESUME_AFTER:
            reducers["restored"] = build_reducer({**config, "seed": 99})  # the RNG state must come from the load
            reducers["restored"].load_state_dict(copy.deepcopy(reducers["device"].state_dict()))
    return {
        "outputs": outputs,
        "state": {**{key: _errors_q_rng(reducers[key]) for key in ("device", "host", "restored")},
                  "summed": _errors_q_rng(summed)},
        "summed_updates": summed.updates, "summed_ledger": summed.ledger.records,
        "ledger": reducers["device"].ledger.records,
        "updates": reducers["device"].updates,
    }


def summed_update(reducer, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ingest seam's one-microbatch path: matrices summed into the error memory, outputs on demand."""
    sums = reducer.error_sums(torch.device("cpu"))
    for name, target in sums.items():
        target.add_(grads[name])
    update = reducer.reduce_summed({n: g for n, g in grads.items() if n not in sums})
    outputs = {n: g for n, g in grads.items() if n not in sums}
    for name in reversed(sorted(sums)):  # any order: each output depends only on this update's P and Q
        outputs[name] = update.output(name).to(grads[name].dtype, copy=True)  # valid until finish()
    update.finish()
    return outputs


def misuse_scenario(rank: int, world: int) -> dict:
    from nshard.comm import build_reducer

    cpu, found = torch.device("cpu"), {}
    for place in ("host", "device"):
        reducer = build_reducer({**CONFIG, "error_feedback": place})
        reducer.register(SHAPES)
        sums = reducer.error_sums(cpu)
        found[f"{place}_sums"] = sorted(sums)
        assert all(sums[n].shape == SHAPES[n] for n in sums)
        dense = {} if place == "host" else {n: torch.zeros(s) for n, s in SHAPES.items()}
        try:
            reducer.reduce_summed(dense)
            found["host_reduce" if place == "host" else "matrix_as_dense"] = "accepted"
        except ValueError as exc:
            found["host_reduce" if place == "host" else "matrix_as_dense"] = str(exc)
    dense = build_reducer({**CONFIG, "reducer": "dense"})
    found["dense_sums"] = sorted(dense.error_sums(cpu))
    return found


def exact_scenario(rank: int, world: int) -> dict:
    """rank >= min(n, m): PowerSGD must reproduce the dense average."""
    from nshard.comm import build_reducer

    shapes = {"w1": (6, 10), "w2": (12, 5), "bias": (7,)}
    config = {**CONFIG, "rank": 8, "dense_warmup_updates": 0, "min_compression_rate": 0.1}
    dense, psgd = build_reducer({**config, "reducer": "dense"}), build_reducer(config)
    pairs = []
    for update in range(3):
        want, got = grads_for(rank, update, shapes=shapes), grads_for(rank, update, shapes=shapes)
        dense.reduce(want)
        psgd.reduce(got)
        pairs.append((want, got))
    return {"pairs": pairs, "compressed": [r["compressed"] for r in psgd.ledger.records]}


# Below full rank (rank 2 < min(n, m) for every matrix): the reference test's shapes and schedule.
REF_SHAPES = {"wide": (6, 10), "tall": (12, 5), "wide2": (6, 10), "bias": (7,)}  # wide2: batched QR with wide
REF_CONFIG = {**CONFIG, "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 1, "seed": 11}
REF_UPDATES = 5  # 1 dense warm-up, then 4 compressed updates, 3 of them warm-started
# The reducer draws one flat Gaussian Q on the first compressed update, in layout order: shape
# groups by first appearance among the sorted names, names sorted inside a group.
REF_Q_ORDER = ("tall", "wide", "wide2")  # sorted: bias (dense), tall, wide, wide2


def reference_scenario(rank: int, world: int) -> dict:
    """PowerSGD below full rank, its per-update outputs, Q and final errors, for the float64 reference."""
    from nshard.comm import build_reducer

    psgd = build_reducer(REF_CONFIG)
    outputs, qs = [], []
    for update in range(REF_UPDATES):
        grads = grads_for(rank, update, shapes=REF_SHAPES)
        psgd.reduce(grads)
        outputs.append(grads)
        qs.append(copy.deepcopy(psgd.state_dict()["q"]))
    return {"outputs": outputs, "q": qs, "errors": copy.deepcopy(psgd.state_dict()["errors"]),
            "compressed": [r["compressed"] for r in psgd.ledger.records]}


def disagree_scenario(rank: int, world: int) -> dict:
    """The last rank built 'b.weight' with another shape: register() must stop every rank, naming it."""
    from nshard.comm import RanksDisagree, build_reducer

    shapes = {**SHAPES, "b.weight": (16, 25)} if rank == world - 1 else SHAPES
    messages = {}
    for name in ("dense", "powersgd"):
        try:
            build_reducer({**CONFIG, "reducer": name}).register(shapes)
            messages[name] = None
        except RanksDisagree as exc:
            messages[name] = str(exc)
    return messages


EXPERT_SHAPES = {"moe.experts.w": (3, 12, 8), "moe.gate.weight": (3, 4)}


def experts_scenario(rank: int, world: int) -> dict:
    """The same gradients three ways: a fused [3, 12, 8] expert stack; its three slices as separate (12, 8)
    parameters named as the stack's units; the stack under a name outside an `experts` module (one (3, 96) matrix)."""
    from nshard.comm import build_reducer

    config = {**CONFIG, "dense_warmup_updates": 0}
    ways = {"stack": EXPERT_SHAPES, "slices": {**{f"moe.experts.w[{e}]": (12, 8) for e in range(3)},
                                               "moe.gate.weight": (3, 4)},
            "flat": {"moe.w": (3, 12, 8), "moe.gate.weight": (3, 4)}}
    out = {}
    for way, shapes in ways.items():
        reducer, outputs = build_reducer(config), []
        for update in range(4):
            grads = grads_for(rank, update, shapes=EXPERT_SHAPES)
            if way == "slices":
                grads = {**{f"moe.experts.w[{e}]": grads["moe.experts.w"][e].clone() for e in range(3)},
                         "moe.gate.weight": grads["moe.gate.weight"]}
            elif way == "flat":
                grads = {"moe.w": grads["moe.experts.w"], "moe.gate.weight": grads["moe.gate.weight"]}
            reducer.reduce(grads)
            outputs.append(grads)
        layout = reducer.state.layout
        out[way] = {"outputs": outputs, "state": copy.deepcopy(reducer.state_dict()),
                    "units": [(s.name, s.param, s.index, s.n, s.m) for s in layout.matrices],
                    "groups": [(g.n, g.m, g.count) for g in layout.groups], "dense": list(layout.dense_names)}
    return out


def all_scenarios(rank: int, world: int) -> dict:
    # One spawn per world size for the whole file: starting ranks (torch imports on two cores) costs ~5 s.
    return {
        "fp32": core_scenario(rank, world, "float32", CONFIG["dense_warmup_updates"]),
        "bf16": core_scenario(rank, world, "bfloat16", 0),  # no warm-up: dense bf16 rounding has no feedback
        "exact": exact_scenario(rank, world),
        "reference": reference_scenario(rank, world),
        "disagree": disagree_scenario(rank, world),
        "misuse": misuse_scenario(rank, world),
        "experts": experts_scenario(rank, world),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    return run_ranks(all_scenarios, request.param)


@pytest.fixture(scope="module")
def fp32_run(ranks):
    return [r["fp32"] for r in ranks]



def assert_all_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_warmup_updates_are_bit_identical_to_dense(fp32_run):
    for result in fp32_run:
        for update in range(CONFIG["dense_warmup_updates"]):
            assert_all_equal(result["outputs"]["device"][update], result["outputs"]["dense"][update])
        # After warm-up the compressed matrices differ from the dense average (rank 2 < min(n, m)).
        assert not torch.equal(result["outputs"]["device"][2]["a.weight"], result["outputs"]["dense"][2]["a.weight"])


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_ranks_end_every_update_with_identical_outputs(kind, ranks):
    rank0, *others = [r[kind] for r in ranks]
    for other in others:
        for key in ("dense", "device", "host"):
            for out0, out1 in zip(rank0["outputs"][key], other["outputs"][key]):
                assert_all_equal(out0, out1)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_device_and_host_error_feedback_are_bit_identical(kind, ranks):
    for result in [r[kind] for r in ranks]:
        for out_device, out_host in zip(result["outputs"]["device"], result["outputs"]["host"]):
            assert_all_equal(out_device, out_host)
        device, host = result["state"]["device"], result["state"]["host"]
        assert_all_equal(device["errors"], host["errors"])
        assert_all_equal(device["q"], host["q"])
        assert torch.equal(device["rng"], host["rng"])
        assert all(e.dtype == torch.float32 for e in device["errors"].values())


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_gradients_summed_into_the_error_memory_give_bit_identical_updates(kind, ranks):
    """Issue 9 item 2: the ingest seam's one-microbatch path (gradient added straight into the error
    memory, each output computed on demand) against reduce(): outputs, errors, Q, RNG, ledger."""
    for result in [r[kind] for r in ranks]:
        for out_device, out_summed in zip(result["outputs"]["device"], result["outputs"]["summed"], strict=True):
            assert_all_equal(out_device, out_summed)
        device, summed = result["state"]["device"], result["state"]["summed"]
        assert_all_equal(device["errors"], summed["errors"])
        assert_all_equal(device["q"], summed["q"])
        assert torch.equal(device["rng"], summed["rng"])
        assert result["summed_updates"] == result["updates"]
        assert result["summed_ledger"] == result["ledger"]


def test_summed_update_refuses_misuse(ranks):
    for result in ranks:
        misuse = result["misuse"]
        assert misuse["host_sums"] == [] and misuse["dense_sums"] == []  # nothing to sum into
        assert misuse["device_sums"] == sorted(COMPRESSED_PARAMS)
        assert "dense remainder" in misuse["host_reduce"] and "dense remainder" in misuse["matrix_as_dense"]


def _mean_grad_sum(dtype, world: int) -> dict[str, torch.Tensor]:
    return {name: sum(sum(grads_for(r, t, dtype)[name].double() for r in range(world)) / world
                      for t in range(UPDATES)) for name in SHAPES}


@pytest.mark.parametrize("kind,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_error_feedback_loses_nothing(kind, dtype, ranks):
    """sum of outputs + mean of final errors == sum over updates of the mean gradient."""
    results = [r[kind] for r in ranks]
    want = _mean_grad_sum(dtype, len(results))
    for name in COMPRESSED:
        outputs = sum(unit(out, name).double() for out in results[0]["outputs"]["device"])
        errors = sum(r["state"]["device"]["errors"][name].double() for r in results) / len(results)
        torch.testing.assert_close(outputs + errors, unit(want, name), rtol=1e-5, atol=1e-5)


def test_restored_reducer_continues_bit_identically(fp32_run):
    for result in fp32_run:
        continued = result["outputs"]["device"][RESUME_AFTER + 1 :]
        assert len(result["outputs"]["restored"]) == len(continued)
        for restored, original in zip(result["outputs"]["restored"], continued):
            assert_all_equal(restored, original)
        assert_all_equal(result["state"]["restored"]["errors"], result["state"]["device"]["errors"])
        assert_all_equal(result["state"]["restored"]["q"], result["state"]["device"]["q"])
        assert torch.equal(result["state"]["restored"]["rng"], result["state"]["device"]["rng"])


def test_ledger_bytes_follow_the_formula(fp32_run):
    dense_numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    remainder_numel = sum(torch.Size(s).numel() for name, s in SHAPES.items() if name not in COMPRESSED_PARAMS)
    for result in fp32_run:
        assert result["updates"] == UPDATES
        for record in result["ledger"]:
            if record["update"] < CONFIG["dense_warmup_updates"]:
                assert record == {"update": record["update"], "compressed": False,
                                  "bytes": {"dense": 4 * dense_numel, "p": 0, "q": 0}}
            else:
                assert record["compressed"]
                assert record["bytes"]["dense"] == 4 * remainder_numel
                assert record["bytes"]["p"] == sum(4 * r * n for n, m, r in COMPRESSED.values())
                assert record["bytes"]["q"] == sum(4 * r * m for n, m, r in COMPRESSED.values())
                assert record["bytes"]["p"] + record["bytes"]["q"] == sum(
                    4 * r * (n + m) for n, m, r in COMPRESSED.values())


def test_full_rank_powersgd_equals_dense_average(ranks):
    for result in (r["exact"] for r in ranks):
        assert result["compressed"] == [True, True, True]
        for want, got in result["pairs"]:
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def initial_q_float64() -> dict[str, torch.Tensor]:
    """The Q the reducer draws: one flat randn from its seeded CPU generator, cut into (m, r) blocks."""
    shapes = {name: (REF_SHAPES[name][1], REF_CONFIG["rank"]) for name in REF_Q_ORDER}
    generator = torch.Generator().manual_seed(REF_CONFIG["seed"])
    flat = torch.randn(sum(m * r for m, r in shapes.values()), generator=generator)
    blocks = flat.split([m * r for m, r in shapes.values()])
    return {name: block.view(shape).double() for (name, shape), block in zip(shapes.items(), blocks)}


def powersgd_float64(world: int = 2) -> tuple[list[dict], list[dict], list[dict]]:
    """Vogels et al.'s algorithm in float64, written from the paper: (outputs, Q after each update, errors by rank)."""
    q = initial_q_float64()
    errors = [{name: torch.zeros(REF_SHAPES[name], dtype=torch.float64) for name in q} for _ in range(world)]
    outputs, qs = [], []
    for update in range(REF_UPDATES):
        grads = [{n: g.double() for n, g in grads_for(r, update, shapes=REF_SHAPES).items()} for r in range(world)]
        out = {name: sum(g[name] for g in grads) / world for name in REF_SHAPES}  # warm-up and 1-D: plain mean
        if update >= REF_CONFIG["dense_warmup_updates"]:
            for name in q:
                ms = [g[name] + e[name] for g, e in zip(grads, errors)]
                # The QR with R's diagonal >= 0 (unique for full-rank P), the convention nshard's Q follows.
                p, r = torch.linalg.qr(sum(m @ q[name] for m in ms))
                p = p * torch.where(r.diagonal() < 0, -1.0, 1.0).double()
                q[name] = sum(m.T @ p for m in ms) / world  # warm start: the next update projects onto this Q
                out[name] = p @ q[name].T
                for e, m in zip(errors, ms):
                    e[name] = m - out[name]
            qs.append({name: t.clone() for name, t in q.items()})
        else:
            qs.append({})
        outputs.append(out)
    return outputs, qs, errors


def test_below_full_rank_powersgd_matches_a_float64_reference(ranks):
    """Outputs, warm-started Q and error feedback of every update agree with the reference on every rank."""
    want_outputs, want_qs, want_errors = powersgd_float64(len(ranks))
    assert set(want_qs[-1]) == {name for name, s in REF_SHAPES.items() if len(s) == 2}
    for rank, result in enumerate(r["reference"] for r in ranks):
        assert result["compressed"] == [False] + [True] * (REF_UPDATES - 1)
        for update, (got, want) in enumerate(zip(result["outputs"], want_outputs)):
            for name in REF_SHAPES:
                torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5,
                                           msg=f"update {update} {name}")
            assert result["q"][update].keys() == want_qs[update].keys()
            for name in want_qs[update]:
                torch.testing.assert_close(result["q"][update][name].double(), want_qs[update][name],
                                           rtol=1e-5, atol=1e-5, msg=f"update {update} Q of {name}")
        for name in want_errors[rank]:
            torch.testing.assert_close(result["errors"][name].double(), want_errors[rank][name],
                                       rtol=1e-5, atol=1e-5, msg=f"rank {rank} error of {name}")


def test_ranks_with_different_parameters_stop_at_register_naming_the_parameter(ranks):
    last = len(ranks) - 1
    for messages in (r["disagree"] for r in ranks):
        for name in ("dense", "powersgd"):
            assert messages[name] == (f"ranks hold different parameters: 'b.weight' is shape (16, 24) on rank 0 "
                                      f"and shape (16, 25) on rank {last}; every rank must build the same model")


def test_fused_experts_are_compressed_one_matrix_per_expert_keyed_by_name(ranks):
    """Issue 27 item 2: a [E, n, m] expert stack is E (n, m) matrices named `param[e]`, one QR group, and gives
    bit for bit what E separate parameters of those names give (outputs, errors, Q); not one (E, n*m) matrix."""
    for result in (r["experts"] for r in ranks):
        stack, slices, flat = result["stack"], result["slices"], result["flat"]
        assert stack["units"] == [(f"moe.experts.w[{e}]", "moe.experts.w", e, 12, 8) for e in range(3)]
        assert stack["groups"] == [(12, 8, 3)] and stack["dense"] == ["moe.gate.weight"]
        assert flat["units"] == [("moe.w", "moe.w", None, 3, 96)]
        for got, want, other in zip(stack["outputs"], slices["outputs"], flat["outputs"], strict=True):
            for e in range(3):
                assert torch.equal(got["moe.experts.w"][e], want[f"moe.experts.w[{e}]"])
            assert not torch.equal(got["moe.experts.w"], other["moe.w"])
        for part in ("errors", "q"):
            assert stack["state"][part].keys() == slices["state"][part].keys()
            assert_all_equal(stack["state"][part], slices["state"][part])
        assert stack["state"]["shapes"] == {"moe.experts.w": (3, 12, 8), "moe.gate.weight": (3, 4)}


def test_each_shape_groups_q_is_one_contiguous_range_covering_the_flat_q():
    """reduce_q_into_outputs all-reduces each shape group's Q as one slice of the flat Q: the groups' matrices, in
    layout order, must tile it exactly (a gap would leave a Q unreduced, an overlap would sum one twice)."""
    from nshard.comm.layout import build_layout, group_matrices

    shapes = {"a.w": (64, 48), "b.w": (48, 64), "c.w": (64, 48), "d.w": (64,), "mlp.experts.up": (3, 32, 48),
              "e.w": (200, 48)}
    layout = build_layout(shapes, 4, 2.0)
    groups = group_matrices(layout)
    assert [s for slots in groups for s in slots] == list(layout.matrices)
    assert len(groups) == len(layout.groups) > 2
    end = 0
    for slots, group in zip(groups, layout.groups):
        assert {(s.n, s.m) for s in slots} == {(group.n, group.m)} and len(slots) == group.count
        for slot in slots:
            assert slot.q_offset == end
            end += slot.m * slot.r
    assert end == layout.q_numel
