"""torch's fused AdamW (the default, optimizer.params.fused) keeps torch's AdamW rule, within a stated tolerance.

The rule nshard promises is torch.optim.AdamW's. Its single-tensor step (fused=false, stepped in pieces on the CPU by
nshard/seam/chunked_adamw.py, bit-identical to torch's) is the reference; the fused kernel computes the same
formulas in one pass. The tolerance, stated here and in docs/configuration.md: both moments bit-identical to the
reference's after every step, and every step's parameter update within 1e-3 of the reference update (relative) plus
2 ulps of the parameter (the rounding of p + update). Both sides are computed in the same test run, so the check
holds on whatever CPU runs it.
"""

from __future__ import annotations

import pytest
import torch

from nshard.seam.ds_config import DsConfigError, check_optimizer_params, optimizer_implementation, validate_ds_config
from nshard.seam.engine import FUSED_RTOL as RTOL
from nshard.seam.engine import FUSED_ULPS as ULPS
from nshard.seam.engine import torch_adamw


def trajectories(steps: int = 12, n: int = 50_000, weight_decay: float = 0.1, **reference_kw):
    """The same gradients through the fused kernel and torch's single-tensor step: per-step updates and moments."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g) * 0.02
    # gradients over six orders of magnitude, so eps and the bias corrections matter for some elements
    grads = [torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-6, 0, generator=g) for _ in range(steps)]
    out = {}
    for name, kw in (("fused", {"fused": True}), ("reference", {"foreach": False, **reference_kw})):
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([p], lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, **kw)
        rows = []
        for grad in grads:
            before = p.detach().clone()
            p.grad = grad.clone()
            opt.step()
            state = opt.state[p]
            rows.append((before, p.detach() - before, state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
        out[name] = rows
    return out["fused"], out["reference"]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_fused_step_keeps_torchs_adamw_rule_within_the_stated_tolerance(weight_decay):
    fused, reference = trajectories(weight_decay=weight_decay)
    moved = False
    for step, ((p_f, d_f, m_f, v_f), (p_r, d_r, m_r, v_r)) in enumerate(zip(fused, reference)):
        assert torch.equal(m_f, m_r) and torch.equal(v_f, v_r), f"step {step}: the moments differ"
        bound = RTOL * d_r.abs() + ULPS * torch.finfo(torch.float32).eps * p_r.abs().clamp_min(1e-30)
        excess = (d_f - d_r).abs() - bound
        assert excess.max() <= 0, f"step {step}: update off by {(d_f - d_r).abs()[excess.argmax()].item():.3g}"
        moved |= bool((d_f != d_r).any())
    # The tolerance is not idle: the kernels round differently, and a wrong rule (no weight decay) breaks it.
    assert moved or weight_decay == 0.0
    wrong, reference = trajectories(weight_decay=weight_decay + 0.5)[0], reference
    assert any(((w[1] - r[1]).abs() > RTOL * r[1].abs() + 1e-12).any() for w, r in zip(wrong, reference))


def test_the_optimizer_is_built_fused_unless_the_config_says_false():
    params = [torch.nn.Parameter(torch.zeros(4))]
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    assert torch_adamw(params, base).defaults["fused"] is True
    assert optimizer_implementation(base, cuda=False, chunk=1024) == "torch AdamW, fused"
    off = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": False}}}
    built = torch_adamw(params, off)
    assert not built.defaults["fused"] and built.defaults["foreach"] is False
    assert optimizer_implementation(off, cuda=False, chunk=1024) == "torch AdamW, single-tensor in 1024-element pieces"
    assert optimizer_implementation(off, cuda=False, chunk=0) == "torch AdamW, single-tensor"
    assert optimizer_implementation({"optimizer": {"params": {"lr": 1e-3}}}, cuda=True, chunk=0) == \
        "DeepSpeed FusedAdam"


def test_a_fused_value_that_is_not_a_boolean_or_that_cannot_apply_is_refused():
    with pytest.raises(DsConfigError, match=r"optimizer.params.fused=\"yes\": use true .* or false"):
        check_optimizer_params({"lr": 1e-3, "fused": "yes"})
    from nshard.seam.ds_config import check_optimizer_path

    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": False, "fused": True}}}
    validate_ds_config(cfg)
    with pytest.raises(DsConfigError, match=r"optimizer.params.fused chooses .* optimizer.params.torch_adam is false"):
        check_optimizer_path(cfg, cuda=True)
