"""PowerSGD's orthogonalization: CholeskyQR2 against Householder QR (torch.linalg.qr) on real P-block shapes,
its fallback on blocks it cannot handle, and the reducer's outputs under either method."""

from __future__ import annotations

import json

import pytest
import torch

from spawn import run_ranks
from test_comm_state import LoopbackTransport

from nshard.comm.config import ReducerConfig
from nshard.comm.orthogonal import cholesky_qr2, orthonormalize_, resolve, signed_householder
from nshard.comm.powersgd import PowerSGDReducer

ORTHONORMAL_TOL = 1e-5
"""max |QᵀQ − I| allowed in fp32 (about 84 ulps of 1; both methods measured ~1e-6 or less at r = 32)."""
OUTPUT_RTOL = 1e-4
"""max |difference| of two PowerSGD outputs from the same inputs, relative to the output's largest entry. fp32
Householder QR alone is off by up to ~2e-5 of that at 49,152 rows (against float64); CholeskyQR2 by ~1e-6."""
R = 32


def gaussian(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def orthonormality_error(q: torch.Tensor) -> float:
    return (q.mT @ q - torch.eye(q.shape[-1])).abs().max().item()


def projection_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a aᵀ − b bᵀ‖_F for orthonormal (n, r) a and b, as sqrt(2r − 2‖aᵀb‖²_F): no n×n matrix at 49,152 rows."""
    overlap = (a.double().mT @ b.double()).square().sum(dim=(-2, -1))
    return (2 * a.shape[-1] - 2 * overlap).clamp(min=0).sqrt().max().item()


def conditioned(n: int, cond: float, seed: int) -> torch.Tensor:
    """An (n, r) fp32 block with singular values spread geometrically from 1 down to 1/cond."""
    u = torch.linalg.qr(gaussian((n, R), seed).double()).Q
    v = torch.linalg.qr(gaussian((R, R), seed + 1).double()).Q
    return ((u * torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), R, dtype=torch.float64)) @ v.T).float()


def nearly_dependent(n: int, seed: int) -> torch.Tensor:
    """Full rank, cond ~3e10, exactly representable: column 31 is column 30 plus 2⁻³⁰ e₃₁ (rows scattered)."""
    t = torch.eye(R) + torch.triu(torch.ones(R, R), 1)
    t[R - 1, R - 1] = 2.0 ** -30
    block = torch.zeros(n, R)
    block[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:R]] = t
    return block


def rank_deficient(n: int, seed: int) -> torch.Tensor:
    """Rank 28 of 32, exactly: small integers, so the fp32 product is exact."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n, 28), generator=gen).float() @ torch.randint(-3, 4, (28, R), generator=gen).float()


@pytest.mark.parametrize("k,n", [(3, 2048), (2, 8192), (1, 49152)])
def test_tall_random_blocks_give_orthonormal_columns_spanning_p(k, n):
    p = gaussian((k, n, R), n)
    reference = signed_householder(p)
    q, ok = cholesky_qr2(p)
    assert ok.all()
    assert orthonormality_error(q) <= ORTHONORMAL_TOL
    assert orthonormality_error(reference) <= ORTHONORMAL_TOL
    # Unique QR with R's diagonal > 0: the same Q, so the same subspace (and the same warm-start Q).
    torch.testing.assert_close(q, reference, rtol=0, atol=ORTHONORMAL_TOL)
    assert projection_distance(q, reference) <= ORTHONORMAL_TOL
    assert projection_distance(q, torch.linalg.qr(p).Q) <= ORTHONORMAL_TOL  # unsigned torch QR: same span
    stack = p.clone()
    assert orthonormalize_([stack], "cholesky_qr2") == 0
    assert torch.equal(stack, q)


def test_projection_distance_tells_different_subspaces_apart():
    a, b = (torch.linalg.qr(gaussian((2048, R), seed)).Q for seed in (1, 2))
    assert projection_distance(a, a) <= ORTHONORMAL_TOL
    assert projection_distance(a, b) > 1  # ~sqrt(2r) for unrelated subspaces of a tall space


def test_blocks_cholesky_qr2_cannot_handle_fall_back_and_stay_orthonormal():
    """One stack of every kind: the fallback is counted, taken exactly where it should be, and orthonormal."""
    n = 2048
    kinds = {
        "random": gaussian((n, R), 5),
        "cond 1e4": conditioned(n, 1e4, 6),  # ill-conditioned, within CholeskyQR2's reach
        "cond 1e9": conditioned(n, 1e9, 21),  # both Choleskys held here; the drift (~11) sends it back
        "cond 1e12": conditioned(n, 1e12, 8),
        "nearly dependent": nearly_dependent(n, 10),
        "rank 28": rank_deficient(n, 11),
        "all zero": torch.zeros(n, R),
    }
    expect_fallback = [False, False, True, True, True, True, True]
    stack = torch.stack(list(kinds.values()))
    _, ok = cholesky_qr2(stack)
    assert (~ok).tolist() == expect_fallback
    reference = signed_householder(stack)
    got = stack.clone()
    assert orthonormalize_([got], "cholesky_qr2") == sum(expect_fallback)
    for i, (kind, fallback) in enumerate(zip(kinds, expect_fallback)):
        assert orthonormality_error(got[i]) <= ORTHONORMAL_TOL, kind
        if fallback:  # Householder's own answer, whatever the rest of the stack did
            torch.testing.assert_close(got[i], reference[i], rtol=0, atol=1e-6, msg=kind)
    # Well inside CholeskyQR2's range the subspace is Householder's, to fp32 rounding times the condition.
    assert projection_distance(got[1], reference[1]) <= 1e-3
    assert projection_distance(got[0], reference[0]) <= ORTHONORMAL_TOL


def test_a_nan_block_falls_back_and_its_neighbours_do_not():
    stack = gaussian((3, 576, R), 12)
    stack[1, 7, 3] = float("nan")
    got = stack.clone()
    assert orthonormalize_([got], "cholesky_qr2") == 1
    assert orthonormality_error(got[0]) <= ORTHONORMAL_TOL and orthonormality_error(got[2]) <= ORTHONORMAL_TOL


def test_the_same_p_gives_the_same_bits_and_the_same_fallbacks():
    stacks = [torch.stack([gaussian((2048, R), 13), torch.zeros(2048, R)]), gaussian((4, 576, R), 14)]
    first, second = [s.clone() for s in stacks], [s.clone() for s in stacks]
    assert orthonormalize_(first, "cholesky_qr2") == orthonormalize_(second, "cholesky_qr2") == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_signing_householder_q_changes_no_output_bit():
    """The sign flips are exact: P̂ (Mᵀ P̂)ᵀ is bit for bit what torch.linalg.qr's own Q gives."""
    m = gaussian((4, 576, 1536), 15)
    p = m @ gaussian((4, 1536, R), 16)
    signed, unsigned = signed_householder(p), torch.linalg.qr(p).Q
    assert not torch.equal(signed, unsigned)  # some column's sign did flip, or this test shows nothing
    assert torch.equal(signed @ (m.mT @ signed).mT, unsigned @ (m.mT @ unsigned).mT)


@pytest.mark.parametrize("n,m", [(2048, 2048), (8192, 2048), (49152, 576)])
def test_powersgd_output_matches_householder_on_the_same_inputs(n, m):
    """One update's output P̂ (Mᵀ P̂)ᵀ at real shapes, from a gradient-like M (decaying spectrum plus noise)."""
    low = gaussian((n, 16), n + m) @ (gaussian((16, m), 1) * torch.logspace(0, -3, m))
    grad = low + 1e-2 * gaussian((n, m), 2)
    p = (grad @ gaussian((m, R), 3))[None]
    exact = signed_householder(p.double())[0]
    exact = exact @ (grad.double().T @ exact).T
    scale = exact.abs().max().item()
    outputs, errors = {}, {}
    for method in ("cholesky_qr2", "householder"):
        q = p.clone()
        assert orthonormalize_([q], method) == 0
        outputs[method] = q[0] @ (grad.T @ q[0]).T
        errors[method] = (outputs[method].double() - exact).abs().max().item() / scale
    torch.testing.assert_close(outputs["cholesky_qr2"], outputs["householder"], rtol=0, atol=OUTPUT_RTOL * scale)
    assert errors["householder"] <= OUTPUT_RTOL
    assert errors["cholesky_qr2"] <= 2 * errors["householder"] + 1e-6, errors  # at least as accurate


SHAPES = {"attn.weight": (576, 576), "mlp.weight": (1536, 576), "experts.w": (2, 192, 576), "norm.weight": (576,)}


def reducer(method: str, **overrides) -> PowerSGDReducer:
    config = ReducerConfig(reducer="powersgd", rank=R, dense_warmup_updates=0, seed=3, orthogonalization=method,
                           **overrides)
    return PowerSGDReducer(config, LoopbackTransport())


def named_grads(seed: int, zero: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) if name in zero else gaussian(shape, seed + i)
            for i, (name, shape) in enumerate(SHAPES.items())}


def test_the_reducer_under_cholesky_qr2_matches_householder_and_counts_its_fallbacks():
    """First compressed update from the same state: outputs within fp32 tolerance, Q alike (same signs).
    A zero gradient's all-zero P is the fallback, counted, and its output is zeros, not NaN."""
    reducers = {method: reducer(method) for method in ("cholesky_qr2", "householder")}
    outputs = {}
    for method, r in reducers.items():
        outputs[method] = named_grads(20, zero=("mlp.weight",))
        r.reduce(outputs[method])
    for name in SHAPES:
        want = outputs["householder"][name]
        torch.testing.assert_close(outputs["cholesky_qr2"][name], want, rtol=0,
                                   atol=OUTPUT_RTOL * max(want.abs().max().item(), 1e-30))
    assert torch.equal(outputs["cholesky_qr2"]["mlp.weight"], torch.zeros(SHAPES["mlp.weight"]))
    assert reducers["cholesky_qr2"].state.orthogonal_fallbacks == 1
    assert reducers["householder"].state.orthogonal_fallbacks == 0
    q = {method: r.state_dict()["q"] for method, r in reducers.items()}
    for name, want in q["householder"].items():
        torch.testing.assert_close(q["cholesky_qr2"][name], want, rtol=0, atol=OUTPUT_RTOL * want.abs().max().item())


def test_a_checkpoint_from_one_method_loads_and_runs_under_the_other():
    saved_by = reducer("cholesky_qr2")
    saved_by.reduce(named_grads(30))
    saved = saved_by.state_dict()
    assert "orthogonalization" not in saved  # not numerical state
    loaded = reducer("householder")
    loaded.load_state_dict(saved)
    outputs = [named_grads(31), named_grads(31)]
    saved_by.reduce(outputs[0])
    loaded.reduce(outputs[1])
    for name in SHAPES:
        want = outputs[0][name]
        torch.testing.assert_close(outputs[1][name], want, rtol=0, atol=OUTPUT_RTOL * want.abs().max().item())


def test_auto_is_cholesky_qr2_on_cuda_and_householder_on_cpu():
    assert resolve("auto", torch.device("cuda", 0)) == "cholesky_qr2"
    assert resolve("auto", torch.device("cpu")) == "householder"
    assert resolve("householder", torch.device("cuda")) == "householder"
    with pytest.raises(ValueError, match="set it to one of auto, cholesky_qr2, householder"):
        resolve("qr", torch.device("cpu"))
    with pytest.raises(ValueError, match="takes a resolved method"):
        orthonormalize_([torch.zeros(1, 4, 2)], "auto")


def two_ranks(rank: int, world: int) -> dict:
    from nshard.comm import build_reducer

    r = build_reducer({"reducer": "powersgd", "rank": R, "dense_warmup_updates": 0,
                       "orthogonalization": "cholesky_qr2"})
    outputs = []
    for update in range(2):
        grads = named_grads(100 * update + 10 * rank, zero=("mlp.weight",) if update == 0 else ())
        r.reduce(grads)
        outputs.append(grads)
    return {"outputs": outputs, "q": r.state_dict()["q"], "fallbacks": r.state.orthogonal_fallbacks}


def test_ranks_get_bit_identical_outputs_and_q_under_cholesky_qr2():
    """Two gloo ranks, rank-dependent gradients, a fallback in the first update: every rank, the same bits."""
    first, second = run_ranks(two_ranks, 2)
    assert first["fallbacks"] == second["fallbacks"] == 1
    for a, b in zip(first["outputs"], second["outputs"]):
        assert all(torch.equal(a[name], b[name]) for name in SHAPES)
    assert all(torch.equal(first["q"][name], second["q"][name]) for name in first["q"])


def test_the_benchmark_runs_and_reports_every_arm(tmp_path):
    """Seconds-long smoke run of launch/bench_orthogonalize.py (one layer, said in its output) and its --json."""
    from launch.bench_orthogonalize import main, parameter_shapes
    from nshard.comm.layout import build_layout

    summary = main(["--models", "135m", "--layers", "1", "--repeats", "1", "--json", str(tmp_path / "o.json")])
    written = json.loads((tmp_path / "o.json").read_text())
    assert written["models"] == json.loads(json.dumps(summary["models"]))
    (result,) = written["models"]
    assert (result["layers"], result["all_layers"], result["matrices"]) == (1, 30, 8)
    assert sum(g["count"] for g in result["groups"]) == result["matrices"] and result["fallbacks"] == 0
    assert set(result["ms_per_update"]) == {"householder (old)", "householder signed", "cholesky_qr2 (new)"}
    assert all(ms > 0 for ms in result["ms_per_update"].values())
    # The full model's plan is the one PowerSGD runs at r = 32: 211 compressed matrices (docs/benchmarks.md).
    assert len(build_layout(parameter_shapes("135m"), 32, 2.0).matrices) == 211
