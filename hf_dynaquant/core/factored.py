"""Contexts for a matrix of codes from its row and column terms (numeric primitives, no I/O).

Adam's second moment ``v`` of a weight matrix is close to the outer product of its row and
column sums: Adafactor (Shazeer and Stern, 2018) stores only those two vectors. In the log
domain the product is a sum, so the scale ``log(sqrt(v) + eps)`` that
:mod:`~hf_dynaquant.core.moments` quantizes on a fixed grid is close to a row term plus a column
term, and so is its code. Coded on their own (order 0) the codes pay for the spread of those
terms over the matrix; coded each with a model for the value its row and column predict, they
pay only for what is left. A keyframe's scale codes then take a quarter fewer bits: on a
109M-parameter GPT-2 trained 8 and 40 steps with AdamW, 1.38 and 1.34 bits a code against 1.80
and 1.77 as the plain keyframe codes them (packed, then zstd), and 2.11 at their order-0 entropy
(``benchmarks/out/factored_s47.log``). The weights' codes gain little from these contexts (the
linear layers' nothing, the embedding's 1-3%), and Adam's update's coding already takes about
what they would give (the same measurement), so only the scale's are coded with them. They cost
a keyframe a pass that groups the codes by context and an rANS stream in place of zstd's: on
one core about 0.8 ns a code more to encode and 1.5 to decode (0.1 s and 0.2 s for a 124M
GPT-2's scales), the grouping made a class of columns at a time (:class:`FactoredContexts`).

The prediction is kept in quarters of a level: a code's context is ``clip(R_i + S_j, 0, B - 1)``
with integer terms ``R_i = round(4 * mean of row i)`` and ``S_j = round(4 * mean of column j) -
round(4 * mean)``, and ``B = 4 * (levels - 1) + 1`` contexts (a byte each up to 64 levels).
Quarters code 7% smaller than whole levels, whose context ignores where between two levels the
prediction falls. A reader rebuilds the contexts from the stored terms alone
(:func:`factored_contexts`), so the writer's choice of terms is free and the reader's rule is the
one the format fixes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .kernels import native

__all__ = [
    "CONTEXTS_PER_LEVEL",
    "MAX_FACTORED_LEVELS",
    "FactoredContexts",
    "context_count",
    "factored_terms",
    "factored_contexts",
]

CONTEXTS_PER_LEVEL = 4  # the prediction's resolution: contexts per level
MAX_FACTORED_LEVELS = 64  # the most levels whose contexts fit a byte (4 * 63 + 1 = 253)
_TERM_BOUND = 1 << 12  # terms are clipped to +-this before they are added (int16 cannot overflow)
_CHUNK = 1 << 20  # codes whose contexts numpy makes at a time


def context_count(levels: int) -> int:
    """``B``: how many contexts codes of ``levels`` levels take (``ValueError`` past
    :data:`MAX_FACTORED_LEVELS`)."""
    if not 1 <= levels <= MAX_FACTORED_LEVELS:
        raise ValueError(f"factored contexts take 1 to {MAX_FACTORED_LEVELS} levels, not {levels}")
    return CONTEXTS_PER_LEVEL * (levels - 1) + 1


def factored_terms(codes: np.ndarray, rows: int) -> np.ndarray:
    """The int16 terms of uint8 ``codes`` (flat, in ``rows`` rows of equal length): the ``rows``
    row terms, then the column terms, in quarters of a level (see the module's docstring)."""
    if rows < 1 or codes.size % rows:
        raise ValueError(f"{codes.size} codes do not make {rows} rows of equal length")
    matrix = np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, -1)
    cols = matrix.shape[1]
    if native is not None and cols <= 1 << 24:  # (one pass; numpy's two took 0.6 ns a code)
        row_sums, col_sums = np.empty(rows, dtype=np.int64), np.empty(cols, dtype=np.int64)
        native.factored_sums(matrix, rows, row_sums, col_sums)
    else:
        row_sums, col_sums = matrix.sum(axis=1, dtype=np.int64), matrix.sum(axis=0, dtype=np.int64)
    q = CONTEXTS_PER_LEVEL
    mean = np.rint(q * float(row_sums.sum()) / max(codes.size, 1))
    terms = np.concatenate((np.rint(q * row_sums / cols), np.rint(q * col_sums / rows) - mean))
    return terms.astype(np.int16)


def factored_contexts(terms: np.ndarray, rows: int, cols: int, contexts: int) -> np.ndarray:
    """Each code's context (flat uint8, ``rows x cols``): ``clip(R_i + S_j, 0, contexts - 1)``
    for the ``rows`` row terms ``R`` and the ``cols`` column terms ``S`` of ``terms`` (any
    int16 values: a damaged file's give contexts all the same, never an error)."""
    if terms.size != rows + cols or not 1 <= contexts <= 256:
        raise ValueError(f"{terms.size} terms for {rows} rows and {cols} columns, or {contexts} contexts")
    row_terms, col_terms = FactoredContexts(terms, rows, cols, contexts).bounded_terms()
    if native is not None:
        out = np.empty(rows * cols, dtype=np.uint8)
        native.factored_contexts(row_terms, col_terms, contexts, out)
        return out
    out = np.empty((rows, cols), dtype=np.uint8)
    step = max(1, _CHUNK // max(cols, 1))  # (rows at a time: their int16 sums take 2 bytes a code)
    for r in range(0, rows, step):
        sums = np.add.outer(row_terms[r : r + step], col_terms)
        out[r : r + step] = np.clip(sums, 0, contexts - 1, out=sums)
    return out.reshape(-1)


class FactoredContexts(NamedTuple):
    """The contexts of a ``rows x cols`` matrix of codes as their terms give them, never made
    where the kernels are built: :func:`~hf_dynaquant.core.delta.grouped_delta` and
    :func:`~hf_dynaquant.core.delta.undo_regrouped_delta` group and ungroup by them a row at a
    time. Made whole, a 124M GPT-2's scale contexts took 124 MB of new memory a keyframe, on top
    of the grouped codes (what a delta on packed previous codes never holds either), and a pure
    bfloat16 keyframe's peak rose past its checkpoint's size.

    A row's contexts follow from its columns' terms: the columns with one term value (a *class*)
    take one context in every row, ``clip(R_i + value)``. The kernels sort the columns by term
    once, then move each row's codes a class at a time, a run of columns known in advance,
    to their context's group (each context's codes in a row are one class's, unless two classes
    clip to the same end context: such rows go a column at a time). On one thread and a 124M
    GPT-2's scales that took the grouping (with its pairs' counts) from 1.4-1.8 ns a code to
    0.8-1.1, and undoing it from 1.2-1.3 to 0.5; the contexts' counts come from ``rows x
    classes`` steps instead of a pass over the codes."""

    terms: np.ndarray  # int16: the row terms, then the column terms
    rows: int
    cols: int
    contexts: int

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def unpacked(self) -> np.ndarray:
        """The contexts, made whole (:func:`factored_contexts`)."""
        return factored_contexts(self.terms, self.rows, self.cols, self.contexts)

    def counts(self) -> np.ndarray:
        """How many codes take each context (int64, as long as the largest context taken plus
        one, as :func:`~hf_dynaquant.core.histogram.byte_counts` of :meth:`unpacked` gives
        them): from the terms alone where the kernel is built, a row's columns counted a class
        of equal column terms at a time."""
        if native is None:
            return np.bincount(self.unpacked(), minlength=1)
        counts = np.zeros(256, dtype=np.int64)
        native.factored_counts(*self.bounded_terms(), self.contexts, counts)
        present = np.flatnonzero(counts)
        return counts[: int(present[-1]) + 1 if present.size else 1]

    def bounded_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(row terms, column terms)``, contiguous int16, clipped as :func:`factored_contexts` clips them."""
        bounded = np.clip(self.terms.astype(np.int16), -_TERM_BOUND, _TERM_BOUND)
        return np.ascontiguousarray(bounded[: self.rows]), np.ascontiguousarray(bounded[self.rows :])
