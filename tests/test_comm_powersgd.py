"""PowerSGD against the dense reducer on two real gloo ranks: warm-up, exactness, error feedback, placement, resume, bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from spawn import run_ranks

SHAPES = {
    "a.weight": (16, 24),
    "b.weight": (16, 24),  # same shape as a: batched with it
    "conv.weight": (8, 4, 3),  # viewed as (8, 12)
    "emb.weight": (40, 8),
    "norm.bias": (16,),
    "scale": (),
}
CONFIG = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 2, "min_compression_rate": 1,
          "warm_start": True, "seed": 7, "transport": "torch"}
# With rank 2 and min_compression_rate 1 every >= 2-D tensor above compresses; (n, m, r) per matrix.
COMPRESSED = {"a.weight": (16, 24, 2), "b.weight": (16, 24, 2), "conv.weight": (8, 12, 2), "emb.weight": (40, 8, 2)}
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
    outputs = {key: [] for key in [*reducers, "restored"]}
    for update in range(UPDATES):
        for key, reducer in reducers.items():
            grads = grads_for(rank, update, dtype)
            reducer.reduce(grads)
            outputs[key].append(grads)
        if update == RESUME_AFTER:
            reducers["restored"] = build_reducer({**config, "seed": 99})  # the RNG state must come from the load
            reducers["restored"].load_state_dict(copy.deepcopy(reducers["device"].state_dict()))
    return {
        "outputs": outputs,
        "state": {key: _errors_q_rng(reducers[key]) for key in ("device", "host", "restored")},
        "ledger": reducers["device"].ledger.records,
        "updates": reducers["device"].updates,
    }


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


def all_scenarios(rank: int, world: int) -> dict:
    # One spawn for the whole file: starting two ranks (two torch imports on two cores) costs ~5 s.
    return {
        "fp32": core_scenario(rank, world, "float32", CONFIG["dense_warmup_updates"]),
        "bf16": core_scenario(rank, world, "bfloat16", 0),  # no warm-up: dense bf16 rounding has no feedback
        "exact": exact_scenario(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(all_scenarios, 2)


@pytest.fixture(scope="module")
def fp32_run(two_ranks):
    return [r["fp32"] for r in two_ranks]


@pytest.fixture(scope="module")
def bf16_run(two_ranks):
    return [r["bf16"] for r in two_ranks]


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


@pytest.mark.parametrize("run", ["fp32_run", "bf16_run"])
def test_ranks_end_every_update_with_identical_outputs(run, request):
    rank0, rank1 = request.getfixturevalue(run)
    for key in ("dense", "device", "host"):
        for out0, out1 in zip(rank0["outputs"][key], rank1["outputs"][key]):
            assert_all_equal(out0, out1)


@pytest.mark.parametrize("run", ["fp32_run", "bf16_run"])
def test_device_and_host_error_feedback_are_bit_identical(run, request):
    for result in request.getfixturevalue(run):
        for out_device, out_host in zip(result["outputs"]["device"], result["outputs"]["host"]):
            assert_all_equal(out_device, out_host)
        device, host = result["state"]["device"], result["state"]["host"]
        assert_all_equal(device["errors"], host["errors"])
        assert_all_equal(device["q"], host["q"])
        assert torch.equal(device["rng"], host["rng"])
        assert all(e.dtype == torch.float32 for e in device["errors"].values())


def _mean_grad_sum(dtype) -> dict[str, torch.Tensor]:
    return {name: sum((grads_for(0, t, dtype)[name].double() + grads_for(1, t, dtype)[name].double()) / 2
                      for t in range(UPDATES)) for name in SHAPES}


@pytest.mark.parametrize("run,dtype", [("fp32_run", torch.float32), ("bf16_run", torch.bfloat16)])
def test_error_feedback_loses_nothing(run, dtype, request):
    """sum of outputs + mean of final errors == sum over updates of the mean gradient."""
    results = request.getfixturevalue(run)
    want = _mean_grad_sum(dtype)
    for name in COMPRESSED:
        outputs = sum(out[name].double() for out in results[0]["outputs"]["device"])
        errors = sum(r["state"]["device"]["errors"][name].double() for r in results) / 2
        torch.testing.assert_close(outputs + errors, want[name], rtol=1e-5, atol=1e-5)


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
    remainder_numel = sum(torch.Size(s).numel() for name, s in SHAPES.items() if name not in COMPRESSED)
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


def test_full_rank_powersgd_equals_dense_average(two_ranks):
    for result in (r["exact"] for r in two_ranks):
        assert result["compressed"] == [True, True, True]
        for want, got in result["pairs"]:
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
