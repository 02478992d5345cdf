"""Error feedback while rounding: GPTQ (Frantar et al., ICLR 2023) over DynaQuant's codebooks.

Rounding every weight of a linear layer to its nearest centre minimises the error of the
*weights*; what a user sees is the error of the layer's *outputs*, ``(W - Q) X`` on real inputs
``X``. GPTQ rounds the columns of ``W`` (one input feature each) left to right and, after each,
moves the columns not yet rounded to cancel as much of that column's output error as the inputs'
correlations allow: with ``H = X Xᵀ`` (the Gram matrix of the inputs over calibration text) and
``U`` the upper Cholesky factor of ``H⁻¹``, column ``j``'s error ``e = (w_j - q_j) / U_jj``
updates the later columns by ``-e U_j,k``. The codes still index the same per-tensor codebook, so
the stored format and the decoder do not change; only which centre each weight gets does.

Decisions where GPTQ's paper leaves room (also in FORMAT.md, "Error feedback"):

* The damping is 1% of the mean diagonal of ``H`` (GPTQ's default); an input feature that is
  always 0 gets ``H_jj = 1``, so its column is rounded and changes nothing downstream.
* Columns go in their natural order, in blocks of :data:`BLOCK` (GPTQ's lazy batch updates: the
  rest of the matrix is updated once per block, as one matrix product).
* A column's protected values are kept (as bfloat16, their stored form) and pruned ones set to 0
  by the same rules as nearest rounding; only the remaining error is fed forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["DAMP", "BLOCK", "ACT_ORDER", "inverse_factor", "feedback_round", "columnwise", "RoundBlock"]

DAMP = 0.01
BLOCK = 128
ACT_ORDER = True


def inverse_factor(gram: torch.Tensor, damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """``(U, order)``: the order the columns are rounded in (with :data:`ACT_ORDER`, the input
    features of largest ``H_jj`` first, GPTQ's "act order"; else their own order) and the float32
    upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)⁻¹`` in that order, for the Gram
    matrix ``H = X Xᵀ`` of a layer's inputs (``in x in``), computed in float64."""
    h = gram.detach().to("cpu", torch.float64).clone()
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if ACT_ORDER else torch.arange(h.shape[0])
    h = h[order][:, order]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * float(torch.diagonal(h).mean()) * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32).numpy(), order.numpy()


RoundBlock = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def feedback_round(values: np.ndarray, factor: np.ndarray, order: np.ndarray, round_block: RoundBlock) -> np.ndarray:
    """Round the float32 matrix ``values`` (``rows x in``) column by column with error feedback,
    in ``order``, with the factor :func:`inverse_factor` gave for that order.

    The columns are handled as the rows of a transposed copy, a block of :data:`BLOCK` at a time:
    ``round_block(block, u, first)`` rounds the block (``b x rows``, in place: each column left
    holding the values its codes decode to, and the later columns of the block updated by the
    earlier ones' errors, see :func:`columnwise`) given the block's ``b x b`` corner ``u`` of the
    factor and the position ``first`` of its first column in ``order``, records the codes, and
    returns the errors (``b x rows``); the columns after the block then take their share of them
    in one matrix product. Returns the matrix of decoded values."""
    transposed = np.ascontiguousarray(values[:, order].T, dtype=np.float32)
    n = transposed.shape[0]
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        errors = round_block(transposed[start:stop], np.ascontiguousarray(factor[start:stop, start:stop]), start)
        if stop < n:
            later = torch.from_numpy(transposed[stop:])
            later -= torch.from_numpy(np.ascontiguousarray(factor[start:stop, stop:].T)) @ torch.from_numpy(errors)
    out = np.empty_like(values, dtype=np.float32)
    out[:, order] = transposed.T
    return out


def columnwise(round_column: Callable[[np.ndarray, int], np.ndarray]) -> RoundBlock:
    """A ``round_block`` for :func:`feedback_round` (the reference the compiled kernel follows)
    from ``round_column(column, k)``, which rounds the block's ``k``-th column (a float32 vector),
    records its codes and returns the values they decode to. Each column's error ``e = (w - q) /
    u[k, k]`` updates the block's later columns by ``-e u[k, j]``."""

    def round_block(block: np.ndarray, u: np.ndarray, first: int) -> np.ndarray:
        errors = np.empty_like(block)
        for k in range(block.shape[0]):
            rounded = round_column(block[k], first + k)
            errors[k] = (block[k] - rounded) / u[k, k]
            block[k] = rounded
            block[k + 1 :] -= u[k, k + 1 :, None] * errors[k][None, :]
        return errors

    return round_block
