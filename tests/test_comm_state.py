"""Reducer state that does not fit is refused, naming the parameter (one process, a loopback transport)."""

from __future__ import annotations

import copy

import pytest
import torch

from nshard.comm import DenseReducer, PowerSGDReducer, ReducerConfig

CONFIG = ReducerConfig(reducer="powersgd", rank=2, dense_warmup_updates=0, min_compression_rate=1)


class LoopbackTransport:
    """World of one: the sum over ranks is the tensor itself."""

    world_size, rank = 1, 0

    def all_reduce_sum_(self, tensor):
        return tensor.numel() * tensor.element_size()

    def all_gather_object(self, obj):
        return [obj]


def grads(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


SHAPES = {"layer.weight": (8, 12), "layer.bias": (8,)}


def trained(config: ReducerConfig = CONFIG, shapes: dict = SHAPES) -> PowerSGDReducer:
    reducer = PowerSGDReducer(config, LoopbackTransport())
    reducer.reduce(grads(shapes))
    return reducer


def test_state_dict_is_keyed_by_parameter_name():
    sd = trained().state_dict()
    assert set(sd["errors"]) == set(sd["q"]) == {"layer.weight"}
    assert sd["errors"]["layer.weight"].shape == (8, 12) and sd["q"]["layer.weight"].shape == (12, 2)
    assert sd["shapes"] == {"layer.bias": (8,), "layer.weight": (8, 12)}
    assert sd["updates"] == 1 and sd["rng"].dtype == torch.uint8


@pytest.mark.parametrize("other_shapes,named", [
    ({"layer.weight": (8, 12), "other.bias": (8,)}, "layer.bias"),
    ({"layer.weight": (8, 12), "layer.bias": (8,), "extra.weight": (8, 12)}, "extra.weight"),
    ({"layer.weight": (8, 10), "layer.bias": (8,)}, "layer.weight"),
])
def test_load_refuses_other_names_or_shapes(other_shapes, named):
    saved = trained(shapes=other_shapes).state_dict()
    reducer = trained()
    before = copy.deepcopy(reducer.state_dict())
    with pytest.raises(ValueError, match=repr(named)):
        reducer.load_state_dict(saved)
    assert torch.equal(reducer.state_dict()["errors"]["layer.weight"], before["errors"]["layer.weight"])


def test_load_refuses_q_saved_with_another_rank_even_before_first_reduce():
    saved = trained(ReducerConfig(**{**CONFIG.__dict__, "rank": 3})).state_dict()
    fresh = PowerSGDReducer(CONFIG, LoopbackTransport())
    with pytest.raises(ValueError, match=r"q for parameter 'layer.weight' has shape \(12, 3\).*nshard.rank"):
        fresh.load_state_dict(saved)
    assert fresh.state.layout is None  # a refused load registers nothing


def test_reduce_refuses_gradients_that_changed_shape():
    reducer = trained()
    with pytest.raises(ValueError, match="'layer.weight' shape \\(8, 13\\)"):
        reducer.reduce(grads({"layer.weight": (8, 13), "layer.bias": (8,)}))


def test_register_fixes_the_plan_before_any_gradient():
    reducer = PowerSGDReducer(CONFIG, LoopbackTransport())
    reducer.register(SHAPES)
    assert [s.name for s in reducer.state.layout.matrices] == ["layer.weight"]
    with pytest.raises(ValueError, match="'layer.bias'"):
        reducer.reduce(grads({"layer.weight": (8, 12)}))


def test_dense_reducer_checks_shapes_on_load():
    dense = DenseReducer(LoopbackTransport())
    dense.reduce(grads(SHAPES))
    other = DenseReducer(LoopbackTransport())
    other.reduce(grads({"layer.weight": (8, 12)}))
    with pytest.raises(ValueError, match="'layer.bias'"):
        other.load_state_dict(dense.state_dict())


def test_all_zero_update_keeps_the_warm_start_q_usable():
    """A first compressed update with a zero gradient (and zero error) averages to a zero Q. Kept, the
    next P = M Q would be zero and its QR a fixed set of axes; instead the previous Q stays, so the next
    update matches a reducer that never saw the zero one, bit for bit."""
    zeroed, fresh = PowerSGDReducer(CONFIG, LoopbackTransport()), PowerSGDReducer(CONFIG, LoopbackTransport())
    zero = {"layer.weight": torch.zeros(8, 12), "layer.bias": torch.zeros(8)}
    zeroed.reduce(zero)
    assert torch.equal(zero["layer.weight"], torch.zeros(8, 12))
    assert zeroed.state_dict()["q"]["layer.weight"].abs().sum() > 0
    after_zero, first = grads(SHAPES, 1), grads(SHAPES, 1)
    zeroed.reduce(after_zero)
    fresh.reduce(first)
    assert torch.equal(after_zero["layer.weight"], first["layer.weight"])
    assert torch.equal(zeroed.state_dict()["q"]["layer.weight"], fresh.state_dict()["q"]["layer.weight"])


def _bf16_delivery(deliver: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the outputs as the optimizer receives them, in bf16) + final error, and the sum of the gradients."""
    reducer = PowerSGDReducer(CONFIG, LoopbackTransport())
    if deliver:
        reducer.deliver_as({"layer.weight": torch.bfloat16, "layer.bias": torch.bfloat16})
    received, given = torch.zeros(8, 12, dtype=torch.float64), torch.zeros(8, 12, dtype=torch.float64)
    for seed in range(4):
        g = grads(SHAPES, seed)
        given += g["layer.weight"].double()
        reducer.reduce(g)  # an fp32 buffer, as in the ingest seam; the surrogate backward then casts to bf16
        received += g["layer.weight"].to(torch.bfloat16).double()
    return received + reducer.state_dict()["errors"]["layer.weight"].double(), given


def test_bf16_delivery_settles_the_error_against_what_the_optimizer_receives():
    """Error feedback loses nothing of what bf16 parameters receive; settled against the fp32 buffer
    instead, each update's bf16 rounding would be lost (the contrast shows the check can fail)."""
    kept, given = _bf16_delivery(deliver=True)
    torch.testing.assert_close(kept, given, rtol=0, atol=1e-5)
    lost, given = _bf16_delivery(deliver=False)
    assert (lost - given).abs().max() > 1e-3


def full_rank(**overrides) -> PowerSGDReducer:
    config = ReducerConfig(**{**CONFIG.__dict__, "rank": 16, "min_compression_rate": 0.1, **overrides})
    return PowerSGDReducer(config, LoopbackTransport())


def test_all_zero_gradient_gives_zeros_not_nan():
    # Householder QR keeps an all-zero P orthonormal; Gram-Schmidt without epsilon would divide by zero.
    reducer = full_rank()
    zero = {"layer.weight": torch.zeros(8, 12), "layer.bias": torch.zeros(8)}
    reducer.reduce(zero)
    assert torch.equal(zero["layer.weight"], torch.zeros(8, 12))


def test_non_contiguous_gradient_is_written_back():
    # World of one at full rank: the output is the gradient itself, through the copy-back path.
    grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(1)).T
    original = grad.clone()
    full_rank().reduce({"layer.weight": grad})
    assert not grad.is_contiguous()
    torch.testing.assert_close(grad, original, rtol=1e-5, atol=1e-5)


def test_cold_start_redraws_q_every_update_and_warm_start_does_not():
    states = {}
    for warm in (True, False):
        reducer = PowerSGDReducer(ReducerConfig(**{**CONFIG.__dict__, "warm_start": warm}), LoopbackTransport())
        rngs = []
        for seed in range(3):
            reducer.reduce(grads(SHAPES, seed))
            rngs.append(reducer.state_dict()["rng"])
        states[warm] = rngs
    assert torch.equal(states[True][0], states[True][2])
    assert not torch.equal(states[False][0], states[False][1])


def test_missing_gradient_is_refused_by_name():
    with pytest.raises(ValueError, match="'layer.bias' is None"):
        PowerSGDReducer(CONFIG, LoopbackTransport()).reduce({"layer.weight": torch.zeros(8, 12), "layer.bias": None})
