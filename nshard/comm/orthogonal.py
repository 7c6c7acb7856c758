"""Orthonormal columns for PowerSGD's summed P: CholeskyQR2, batched on every device, with a Householder QR
fallback, or Householder QR alone. Either way Q's columns are signed so that R = QᵀP has a diagonal >= 0, so
both methods give the same Q (within rounding) and a checkpoint's Q means the same under either."""

from __future__ import annotations

from typing import Sequence

import torch

from nshard.comm.config import ORTHOGONALIZATIONS

MAX_FIRST_PASS_DRIFT = 0.5
"""CholeskyQR2's first pass leaves ‖Q₁ᵀQ₁ − I‖_F at about u·cond(P) (fp32 products, fp64 Gram). Up to this
value cond(Q₁)² <= 3 and the second pass restores orthogonality to fp32 rounding; past it (cond(P) beyond
about 10⁷, a rank-deficient or all-zero P) the block goes to Householder QR."""


def resolve(method: str, device: torch.device) -> str:
    """The method an `orthogonalization` setting runs on `device`. "auto": CholeskyQR2 on CUDA, where torch's
    batched Householder QR loops over blocks taller than 256 rows (151 of SmolLM2-135M's 211 P blocks); Householder QR
    elsewhere, since on CPU it was as fast (docs/benchmarks.md, launch/bench_orthogonalize.py)."""
    if method not in ORTHOGONALIZATIONS:
        raise ValueError(f"orthogonalization {method!r}; set it to one of {', '.join(ORTHOGONALIZATIONS)}")
    if method == "auto":
        return "cholesky_qr2" if device.type == "cuda" else "householder"
    return method


def signed_householder(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Householder QR's Q with each column's sign flipped where R's diagonal is negative (a zero keeps its sign),
    written into `out` when given (the flip and the copy in one pass). Sign flips are exact, so P Qᵀ and the
    error feedback are bit for bit what the unsigned Q gives."""
    q, r = torch.linalg.qr(blocks)
    signs = torch.where(r.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    return torch.mul(q, signs.unsqueeze(-2), out=q if out is None else out)


def _inverse_cholesky_factor(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R⁻¹ for the Cholesky factor R = Lᵀ of each Gram matrix, LAPACK's info: 0 where the factorization held)."""
    lower, info = torch.linalg.cholesky_ex(gram)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve_triangular(lower.mT, eye, upper=True), info


def cholesky_qr2(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CholeskyQR2 of a [k, n, r] stack: (Q, ok per matrix). Only batched matmuls and r×r factorizations.

    The first Gram matrix is formed in fp64: in fp32 its rounding would swamp σ_min² once cond(P) passed about
    3·10³, which PowerSGD's warm-started P (close to U Σ²) reaches. Q₁ is well conditioned, so the second pass
    runs in fp32. ok is False where the first Cholesky failed or its pass drifted past MAX_FIRST_PASS_DRIFT
    (NaN or inf included); there Q is garbage and the caller must replace it."""
    wide = blocks.double()
    r1_inverse, info1 = _inverse_cholesky_factor(wide.mT @ wide)
    del wide
    q1 = blocks @ r1_inverse.to(blocks.dtype)
    gram2 = q1.mT @ q1
    eye = torch.eye(gram2.shape[-1], dtype=gram2.dtype, device=gram2.device)
    drift = torch.linalg.matrix_norm(gram2 - eye)
    # Drift <= 0.5 puts gram2's eigenvalues in [0.5, 1.5], so its Cholesky cannot fail where ok holds.
    r2_inverse, _ = _inverse_cholesky_factor(gram2.double())
    ok = (info1 == 0) & (drift <= MAX_FIRST_PASS_DRIFT)  # NaN compares False
    return q1 @ r2_inverse.to(blocks.dtype), ok


def orthonormalize_(stacks: Sequence[torch.Tensor], method: str) -> int:
    """Replace every [k, n, r] stack by orthonormal columns spanning each matrix, in place. `method` is resolved
    ("cholesky_qr2" or "householder"). Returns how many matrices CholeskyQR2 handed to Householder QR.

    Which matrices fall back depends only on the stacks' values, so ranks holding the same summed P make the
    same choice and get the same bits. One host sync for all stacks together."""
    if method == "householder":
        for stack in stacks:
            signed_householder(stack, out=stack)  # QR works on its own copy, so writing over P is safe
        return 0
    if method != "cholesky_qr2":
        raise ValueError(f"orthonormalize_ takes a resolved method, not {method!r}; see resolve()")
    results = [cholesky_qr2(stack) for stack in stacks]
    ok = torch.cat([good for _, good in results]).tolist() if results else []
    fallbacks, start = 0, 0
    for stack, (q, _) in zip(stacks, results):
        bad = [i for i, good in enumerate(ok[start:start + len(stack)]) if not good]
        start += len(stack)
        if bad:
            index = torch.tensor(bad, device=stack.device)
            q[index] = signed_householder(stack[index])
            fallbacks += len(bad)
        stack.copy_(q)
    return fallbacks
