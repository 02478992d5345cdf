"""Log-space quantile sketch (DynaQuant Alg. 2, a DDSketch without bucket collapsing).

A value ``x > 0`` falls in bucket ``key = ceil(log_gamma(x))`` with ``gamma = (1+a)/(1-a)``;
every value of a bucket lies in ``(gamma**(key-1), gamma**key]`` and the bucket's
representative ``2 * gamma**key / (gamma + 1)`` is within relative error ``a`` of all of them
(Masson et al., DDSketch, VLDB 2019). Negative values go to a mirrored store, exact zeros (and
values too small to index) to a zero count. Stores are dense count arrays over a key range, so
sketches of shards or ranks merge by adding counts; the number of buckets stays in the low
thousands even for a = 0.01 (a fp32 tensor spans at most ~280 binades).

Building a sketch is one pass. On the CPU a compiled kernel looks the key up in a table indexed
by the top 20 bits of the float (exponent and 12 mantissa bits), which also says where in that
fine bucket the next key begins (a fine bucket is narrower than a key); it computes the
logarithm only for values next to the zero threshold, infinities and NaN (for every value
below an accuracy of about 3e-4, whose slots the table cannot hold); chunks run on two threads. On
an accelerator the keys are computed there with torch (log, ceil, bincount) and only the counts
travel. Quantiles are then cheap, and many of them cost the same as one.

A tensor of :data:`SAMPLE_FROM` values or more is sketched from a sample (:func:`sample`): the
blocks of 64 consecutive values (of the full tensor, so shards of it sample what the whole
would) that Fibonacci hashing of the block number picks, one in :data:`SAMPLE_WEIGHT`, each
sampled value counted that many times. The picked blocks are spread evenly along the tensor
(a Weyl sequence: gaps of 5, 8 or 13 blocks), so no row or column pattern is missed. At 2^20
values the sample holds 131,072: a single tensor's share above its 0.5% protection threshold
then lands within 4-8% of 0.5% (from every value, within 4%: a threshold is a bucket of 2%
width), and thresholds merged over a model's tensors read many samples. Codebooks move more
where the paper's K-means weights each occupied bucket's magnitude once (``sigma < 1``): a
sample occupies fewer of a heavy tail's sparse buckets, so its centres sit nearer the middle
(on a scale mixture over three decades, 3 centres at +-1.55 against +-1.96, which fit it better:
cosine 0.76 against 0.69). A 124M-parameter GPT-2's keyframe came out 0.4% larger, its restored
weights as close (relative error 0.1041 against 0.1045) and every optimizer tensor at the same
bin count; the MiniLM snapshot of the default search unchanged (11.15x against 11.14x, the same
held-out cosine); see ``benchmarks/RESULTS.md``, issue 16.
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .kernels import native
from .pool import ForkSafePool

__all__ = ["LogSketch", "SAMPLE_FROM", "SAMPLE_WEIGHT", "sample"]

_MIN_INDEXABLE = 1e-30  # smaller magnitudes count as zero (keeps key ranges bounded)
_PART = 1 << 22  # values per kernel call; parts run on the pool
_POOL = ForkSafePool("dq-sketch")
SAMPLE_FROM = 1 << 20  # values of a tensor from which its sketches read a sample
SAMPLE_WEIGHT = 8  # one block in this many is sampled, each of its values counted this many times
_BLOCK = 64  # values of a block, sampled whole or not at all
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: block j is sampled when the
_TOP_BITS = np.uint64(61)  # top 3 bits (1 / SAMPLE_WEIGHT) of j * _FIBONACCI mod 2^64 are zero


def _sampled_blocks(first: int, count: int) -> np.ndarray:
    """Whether each of the blocks ``first .. first + count - 1`` of a tensor is sampled."""
    j = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the product wraps around mod 2^64, as it should
        return (j * _FIBONACCI) >> _TOP_BITS == 0


def sample(values: torch.Tensor, total: int, offset: int = 0, *, given: int | None = None) -> tuple[torch.Tensor, int]:
    """``(values, weight)`` that a sketch of a tensor of ``total`` values reads of its flat
    ``values``, which start at flat index ``offset`` of the tensor (a shard's rows; 0 for the
    whole): all of them with weight 1 below :data:`SAMPLE_FROM` values, else those in the
    tensor's sampled blocks (see the module docstring) with weight :data:`SAMPLE_WEIGHT`, in
    order, on the device of ``values`` (a copy). Any tensor (values, sensitivities, codes): the
    same ``total`` and ``offset`` pick the same positions. ``given``: ``values`` are a sample
    already, each value counting that many times; they are returned as they are."""
    x = values.reshape(-1)
    n = x.numel()
    if given is not None:
        return x, given
    if total < SAMPLE_FROM:
        return x, 1
    if n == 0:
        return x, SAMPLE_WEIGHT
    first = offset // _BLOCK
    keep = _sampled_blocks(first, (offset + n - 1) // _BLOCK - first + 1)
    lead = min(n, -offset % _BLOCK)  # values before the first whole block (of a block begun earlier)
    body = (n - lead) // _BLOCK * _BLOCK  # values in whole blocks
    parts = [x[:lead]] if lead and keep[0] else []
    if body:
        picked = np.flatnonzero(keep[int(lead > 0) : int(lead > 0) + body // _BLOCK])
        rows = x[lead : lead + body].view(-1, _BLOCK)
        parts.append(rows.index_select(0, torch.from_numpy(picked).to(x.device)).reshape(-1))
    if lead + body < n and keep[-1]:  # the last block, begun here and ending past these values
        parts.append(x[lead + body :])
    if body and len(parts) == 1:  # the whole blocks' picks alone: a copy already (torch.cat would copy it again)
        return parts[0], SAMPLE_WEIGHT
    return (torch.cat(parts) if parts else x[:0]), SAMPLE_WEIGHT


_TABLES: dict[float, tuple[np.ndarray, int, int, int]] = {}  # _slot_table's, by alpha
_TABLES_LOCK = threading.Lock()
_MAX_TABLES = 8  # tables kept (4 MB each); a sketch's alpha is a configuration's, so few are used


def _slot_table(alpha: float) -> tuple[np.ndarray, int, int, int]:
    """``(table, kmin, nkeys, tiny_bits)`` for the kernel: for every fine bucket (top 20 bits of a
    float32 magnitude), its count slot ``key - kmin`` (clamped to ``0..nkeys-1``; ``2 * nkeys``,
    the zeros' slot, below ``_MIN_INDEXABLE``) and where in the bucket the next key begins, or
    the exact path's mark (made by the kernels' ``sketch_table``, by the kernel's own rule).
    Made once for each alpha, under a lock: the threads of a process's first save sketch at once,
    and with ``functools.lru_cache`` each made its own (four tables for two alphas, 30 ms each
    side, session 49)."""
    table = _TABLES.get(alpha)
    if table is None:
        with _TABLES_LOCK:
            table = _TABLES.get(alpha)
            if table is None:
                if len(_TABLES) >= _MAX_TABLES:
                    _TABLES.pop(next(iter(_TABLES)))
                table = _TABLES[alpha] = _new_slot_table(alpha)
    return table


def _new_slot_table(alpha: float) -> tuple[np.ndarray, int, int, int]:
    """:func:`_slot_table`'s table for ``alpha``, made now."""
    inv = 1.0 / math.log((1 + alpha) / (1 - alpha))
    kmin = math.ceil(math.log(_MIN_INDEXABLE) * inv)
    kmax = math.ceil(math.log(float(np.finfo(np.float32).max)) * inv)
    nkeys = kmax - kmin + 1
    tiny = int(np.float32(_MIN_INDEXABLE).view(np.uint32))
    table = np.empty(1 << 20, dtype=np.int32)
    native.sketch_table(table, inv, tiny, kmin, nkeys)
    table.flags.writeable = False
    return table, kmin, nkeys, tiny


@dataclass
class _Store:
    """Counts of consecutive keys ``offset, offset+1, ...``."""

    offset: int = 0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add_keys(self, keys: torch.Tensor, weight: int = 1) -> None:
        if keys.numel() == 0:
            return
        lo, hi = int(keys.min()), int(keys.max())
        # counted where the keys live: only the (small) histogram crosses to the host
        self.add_counts(lo, torch.bincount(keys - lo, minlength=hi - lo + 1).cpu().numpy() * weight)

    def add_counts(self, offset: int, counts: np.ndarray) -> None:
        if counts.size == 0:
            return
        if self.counts.size == 0:
            self.offset, self.counts = offset, counts.astype(np.int64, copy=True)
            return
        lo = min(self.offset, offset)
        hi = max(self.offset + self.counts.size, offset + counts.size)
        merged = np.zeros(hi - lo, dtype=np.int64)
        merged[self.offset - lo : self.offset - lo + self.counts.size] += self.counts
        merged[offset - lo : offset - lo + counts.size] += counts
        self.offset, self.counts = lo, merged

    @property
    def total(self) -> int:
        return int(self.counts.sum())


class LogSketch:
    """Mergeable quantile sketch with relative accuracy ``alpha`` (see the module docstring).

    >>> s = LogSketch(alpha=0.01); s.add(torch.randn(10_000)); s.quantile(0.5)   # doctest: +SKIP
    """

    def __init__(self, alpha: float = 0.01) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"relative accuracy alpha must be in (0, 1), got {alpha}")
        self.alpha = float(alpha)
        self.gamma = (1 + alpha) / (1 - alpha)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)
        self.positive, self.negative = _Store(), _Store()
        self.zeros = 0

    @property
    def count(self) -> int:
        return self.positive.total + self.negative.total + self.zeros

    def key(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Bucket keys of positive magnitudes."""
        return torch.ceil(torch.log(magnitude.double()) * self._inv_log_gamma).to(torch.int64)

    def value(self, key: np.ndarray | int) -> np.ndarray | float:
        """The representative magnitude of a bucket (within ``alpha`` of all its values)."""
        return 2.0 * np.power(self.gamma, key) / (self.gamma + 1.0)

    def add(
        self,
        values: torch.Tensor | np.ndarray,
        *,
        magnitude: bool = False,
        where: tuple[np.ndarray, int] | None = None,
        weight: int = 1,
    ) -> LogSketch:
        """Add values (any shape, any float dtype, float32 precision; NaNs are refused).
        With ``magnitude``, add their absolute values (without computing them). ``where=(codes,
        code)`` (uint8, one per value) adds only the values whose code is ``code``, as if
        ``values[codes == code]`` had been added (the compiled kernel skips the others in place).
        Each value counts ``weight`` times (a :func:`sample`'s weight)."""
        if operator.index(weight) < 1:
            raise ValueError(f"a sketch's weight must be a positive integer, got {weight}")
        x = torch.as_tensor(values).detach().reshape(-1).float()
        if where is not None:
            codes, code = where
            if codes.size != x.numel():
                raise ValueError(f"{codes.size} codes for {x.numel()} values")
            if magnitude or x.device.type != "cpu" or native is None or codes.dtype != np.uint8:
                selected = x[torch.from_numpy(np.asarray(codes).reshape(-1) == code)]
                return self.add(selected, magnitude=magnitude, weight=weight)
        if magnitude:  # sketch the signed values apart, then fold their negative store over
            signed = LogSketch(self.alpha).add(x, weight=weight)
            signed.positive.add_counts(signed.negative.offset, signed.negative.counts)
            signed.negative = _Store()
            return self.merge(signed)
        if x.device.type == "cpu" and native is not None:
            self._add_cpu(x.contiguous().numpy(), where, weight)
        else:
            self._add_torch(x, weight)
        return self

    def _add_cpu(self, x: np.ndarray, where: tuple[np.ndarray, int] | None = None, weight: int = 1) -> None:
        table, kmin, nkeys, tiny = _slot_table(self.alpha)
        codes, code = (np.ascontiguousarray(where[0]).reshape(-1), int(where[1])) if where else (None, 0)

        def part(i: int) -> tuple[int, int, int, np.ndarray]:
            # positive, negative, zeros, discarded: zeros from calloc, whose pages the kernel
            # touches only where it counts (and the keys read back are only those it saw)
            counts = np.zeros(2 * nkeys + 2, np.int64)
            selected = codes[i : i + _PART] if codes is not None else b""
            nans, lo, hi = native.sketch_f32(
                x[i : i + _PART], table, self._inv_log_gamma, tiny, kmin, counts, selected, code
            )
            return nans, lo, hi, counts

        # (one part, most tensors: counted here, not queued behind the pool's other work)
        parts = [part(0)] if x.size <= _PART else list(_POOL.map(part, range(0, x.size, _PART)))
        if sum(p[0] for p in parts):
            raise ValueError("cannot sketch NaN values")
        for _, lo, hi, counts in parts:
            self.zeros += int(counts[2 * nkeys]) * weight
            halves = ((self.positive, counts[lo : hi + 1]), (self.negative, counts[nkeys + lo : nkeys + hi + 1]))
            for store, half in halves:
                nz = np.flatnonzero(half)  # (the span of either sign's keys within both signs')
                if nz.size:
                    store.add_counts(kmin + lo + int(nz[0]), half[nz[0] : nz[-1] + 1] * weight)

    def _add_torch(self, x: torch.Tensor, weight: int = 1) -> None:
        """Keys computed where the tensor lives (the accelerator path); only counts move."""
        if bool(torch.isnan(x).any()):
            raise ValueError("cannot sketch NaN values")
        mag = x.abs().clamp(max=float(torch.finfo(torch.float32).max))
        big = mag >= _MIN_INDEXABLE
        self.zeros += int(x.numel() - int(big.sum())) * weight
        pos = x > 0
        self.positive.add_keys(self.key(mag[big & pos]), weight)
        self.negative.add_keys(self.key(mag[big & ~pos]), weight)

    def merge(self, other: LogSketch) -> LogSketch:
        """Add another sketch's counts into this one (same ``alpha`` required)."""
        if other.alpha != self.alpha:
            raise ValueError(f"cannot merge sketches of relative accuracy {self.alpha} and {other.alpha}")
        self.positive.add_counts(other.positive.offset, other.positive.counts)
        self.negative.add_counts(other.negative.offset, other.negative.counts)
        self.zeros += other.zeros
        return self

    def buckets(self) -> tuple[np.ndarray, np.ndarray]:
        """``(centres, counts)`` of the non-empty buckets in increasing order of value."""
        neg_keys = self.negative.offset + np.nonzero(self.negative.counts)[0]
        pos_keys = self.positive.offset + np.nonzero(self.positive.counts)[0]
        centres = np.concatenate([-self.value(neg_keys[::-1]), np.zeros(1 if self.zeros else 0), self.value(pos_keys)])
        counts = np.concatenate(
            [
                self.negative.counts[neg_keys[::-1] - self.negative.offset],
                np.array([self.zeros] if self.zeros else [], dtype=np.int64),
                self.positive.counts[pos_keys - self.positive.offset],
            ]
        )
        return centres.astype(np.float64), counts.astype(np.int64)

    def quantiles(self, qs: np.ndarray | list[float]) -> np.ndarray:
        """Values at quantiles ``qs`` (each in [0, 1]): the element of rank ``floor(q*(n-1))``
        in sorted order, to relative accuracy ``alpha``."""
        qs = np.asarray(qs, dtype=np.float64)
        if np.any((qs < 0) | (qs > 1)):
            raise ValueError("quantiles must lie in [0, 1]")
        if self.count == 0:
            raise ValueError("the sketch is empty")
        centres, counts = self.buckets()
        ranks = np.floor(qs * (self.count - 1))
        idx = np.searchsorted(np.cumsum(counts), ranks, side="right")
        return centres[np.minimum(idx, centres.size - 1)]

    def quantile(self, q: float) -> float:
        return float(self.quantiles([q])[0])

    def to_dict(self) -> dict:
        """JSON-serialisable form (for sharing between ranks or storing)."""
        return {
            "alpha": self.alpha,
            "zeros": self.zeros,
            "positive": [self.positive.offset, self.positive.counts.tolist()],
            "negative": [self.negative.offset, self.negative.counts.tolist()],
        }

    @classmethod
    def from_dict(cls, d: dict) -> LogSketch:
        s = cls(d["alpha"])
        s.zeros = int(d["zeros"])
        s.positive.add_counts(int(d["positive"][0]), np.asarray(d["positive"][1], dtype=np.int64))
        s.negative.add_counts(int(d["negative"][0]), np.asarray(d["negative"][1], dtype=np.int64))
        return s
