"""nshard/seam/chunked_adamw.py: torch's AdamW stepped in pieces gives the same bits as torch's own step."""

import copy

import pytest
import torch

from nshard.seam.chunked_adamw import chunk_steps

SHAPES = [(12345,), (64, 300), (7,), (1024,), (3, 5, 4100)]  # pieces of 1024 split all but the small ones


def params_and_grads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) * 10 ** (k - 2) for s in SHAPES] for k in range(5)]
    return params, grads


def run(chunked: bool, steps: int = 5, **options):
    params, grads = params_and_grads(0)
    options = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **options}
    optimizer = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], **options)
    if chunked:
        assert chunk_steps(optimizer, chunk=1024)
    for k in range(steps):
        for p, g in zip(params, grads[k]):
            p.grad = None if (k == 2 and p is params[1]) else g.clone()  # a step without one parameter's gradient
        optimizer.param_groups[0]["lr"] *= 0.7  # a scheduler between steps
        optimizer.step()
    return params, optimizer.state_dict()


@pytest.mark.parametrize("options", [{}, {"maximize": True}, {"weight_decay": 0.0}, {"amsgrad": True}],
                         ids=["plain", "maximize", "no-decay", "amsgrad-falls-back"])
def test_chunked_steps_are_bit_identical_to_torch(options):
    want_params, want_state = run(False, **options)
    got_params, got_state = run(True, **options)
    for want, got in zip(want_params, got_params, strict=True):
        assert torch.equal(want, got)
    for key, want in want_state["state"].items():
        for name, tensor in want.items():
            assert torch.equal(tensor, got_state["state"][key][name]), (key, name)


def test_pieces_really_run_and_only_adamw_is_wrapped():
    params, grads = params_and_grads(1)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    assert chunk_steps(optimizer, chunk=1024) and not chunk_steps(optimizer, chunk=1024)  # wrapped once
    calls = []
    import nshard.seam.chunked_adamw as module

    real = module.adam
    module.adam = lambda params, *a, **k: (calls.append(len(params)), real(params, *a, **k))
    try:
        for k in range(2):
            for p, g in zip(params, grads[k]):
                p.grad = g
            optimizer.step()
    finally:
        module.adam = real
    # Both steps go in pieces of 1024 elements (the first after torch's own state initialization).
    pieces = sum(-(-torch.Size(s).numel() // 1024) if torch.Size(s).numel() > 1024 else 1 for s in SHAPES)
    assert calls == [pieces, pieces]
    assert not chunk_steps(torch.optim.Adam(params), chunk=1024)  # Adam is not AdamW: left alone
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_steps(torch.optim.AdamW(copy.deepcopy(params)), chunk=1000)
