"""The ``dynaquant`` codec: quantized codes, keyframes and quantization-aware deltas.

A tensor is quantized under its :class:`~hf_dynaquant.core.quantizer.TensorPlan` into one byte
per value (``0`` pruned, ``1`` protected, ``2 + i`` centre ``i``) plus the protected values as
bfloat16. The codec's *state* of a tensor is those codes, the centres and the protected values;
a later checkpoint codes its codes as a delta on the base's (section 6 of the paper, see
:mod:`hf_dynaquant.core.delta`) and falls back to a keyframe when the delta would be larger.

Blobs: ``codes`` (keyframe), ``symbols`` (a trellis keyframe's) or ``delta``; ``p.c<i>`` the
protected values (``lossless`` BF16; absent when there are none).
Params: ``levels``, ``centres``, ``mode`` (``keyframe`` | ``delta``), ``delta_coding``
(``ans``: regrouped and rANS-coded per group, the default; ``regroup``: the paper's regrouping
+ RLE + zstd; ``rle`` and ``entropy``: for comparisons), ``codes_stream`` (a keyframe's coding:
under ``ans``, codes spanning at most 16 values packed two or more to a byte, then zstd
where it shrinks them, or rANS where it saves 10% over that, which decodes faster,
:func:`~hf_dynaquant.core.entropy.encode_codes`; an Adam scale's with factored contexts where
that is smaller, ``ans-factored``, :class:`_Factored`; zstd under the others),
``protected`` (the lossless params of the protected values, with their count ``n``),
``layer_type``, ``residual`` (``previous`` | ``pretrained``; absent: the codes are of the
weights themselves), ``trellis`` (``tcq8``: a keyframe's codes are trellis symbols, put back
into codes by following the trellis down each column, :func:`~hf_dynaquant.core.trellis.unpack`;
absent: the codes themselves).

A residual tensor decodes to ``reference + dequantized codes`` in float32
(:func:`~hf_dynaquant.core.quantizer.decoded_values`), then cast to its dtype; the store hands
:meth:`DynaQuantCodec.decode` the reference: the base entry's decoded tensor (``previous``, which
makes the tensor use the base even as a code keyframe) or the entry's pre-trained weights
(``pretrained``). The cyclic code delta (``mode`` ``delta``) applies to the codes either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..core import trellis
from ..core.ans import ans_coding, ans_counts, ans_decode, ans_encode, ans_lanes, lanes_for
from ..core.bitplanes import PackedCodes, pack_bits
from ..core.delta import (
    GAP_ESCAPE,
    PAIRED_LEVELS,
    apply_delta,
    current_counts,
    cyclic_delta,
    gap_up,
    grouped_delta,
    most_gap_tokens,
    pair_up,
    paired_sizes,
    regroup,
    rle_decode,
    rle_encode,
    undo_regrouped_delta,
    ungap,
    ungroup,
    unpair,
    varint_decode,
    varint_encode,
)
from ..core.dtypes import RawTensor, ValuesInParts, from_raw, to_raw, torch_dtype
from ..core.entropy import (
    ans_bytes,
    codes_size_floor,
    decode_stream,
    encode_codes_packed,
    encode_stream,
    entropy_bits,
    order0_bits,
)
from ..core.factored import MAX_FACTORED_LEVELS, FactoredContexts, context_count, factored_terms
from ..core.histogram import byte_counts
from ..core.quantizer import FIRST_CENTRE, TensorPlan, decoded_values, quantize
from ..core.varint import length_prefixed, split_prefixed, uleb128_decode, uleb128_encode
from ..errors import CodecError, CorruptCheckpointError
from .base import BlobSource, Codec, Encoded, register_codec
from .lossless import LosslessCodec

__all__ = ["DynaQuantCodec", "KeptState", "QuantState", "DELTA_CODINGS", "DEFAULT_DELTA_CODING"]

DELTA_CODINGS = ("ans", "regroup", "rle", "entropy")
_NO_CODES = np.zeros(0, np.uint8)  # a KeptState's state's codes (kept packed beside it)
_NO_CODES.flags.writeable = False
_SURE_DELTA = 0.5  # a delta under this share of the codes' order-0 entropy needs no keyframe to compare
_SLACK = 64  # bytes by which an rANS payload may exceed its estimate (ans_bytes) or a stream its entropy
DEFAULT_DELTA_CODING = "ans"
_TOKEN_LEVEL = 9  # zstd level for run-length token streams: small, so a strong level is cheap
ROWS_ANS = "ans-rows"  # keyframe codes coded by rANS, the common and the rare rows each with a model
FACTORED_ANS = "ans-factored"  # keyframe codes coded by rANS with contexts from row and column terms (_Factored)
_FACTORED_MIN = 1 << 16  # the fewest codes a factored keyframe is tried on (its tables take a few KB)
TRELLIS = "tcq8"  # the trellis a keyframe's symbols follow (core.trellis: 8 states, Ungerboeck's)


@dataclass
class QuantState:
    """A quantized tensor: what a delta on it needs, and what dequantizes it."""

    codes: np.ndarray  # uint8, flat
    levels: int
    centres: np.ndarray  # float32
    protected: np.ndarray  # uint16 bf16 bits, in element order
    dtype: str
    shape: tuple[int, ...]
    residual: str = "none"  # the kind of reference the codes are a residual against
    reference: np.ndarray | None = None  # its flat float32 values (None: direct coding)
    rare_rows: np.ndarray | None = None  # uint8 per row, 1: a rare row (QuantConfig.rare_bins)
    trellis: bool = False  # whether the codes follow the trellis down each column (QuantConfig.trellis)
    common: int = 0  # with rare_rows under the trellis: how many of the centres are the common rows' grid
    packed: PackedCodes | None = None  # the codes as a keyframe's stream packed them (DynaQuantCodec.kept keeps them)

    def unpacked(self) -> QuantState:
        """This state, its codes a byte each already (as :meth:`KeptState.unpacked` gives them)."""
        return self


@dataclass(frozen=True)
class KeptState:
    """A :class:`QuantState` as the store keeps it between checkpoints for the next delta
    (:meth:`DynaQuantCodec.kept`): its codes packed 1, 2 or 4 bits a code, :meth:`unpacked`
    when they are read. A byte a code held 3 bytes a parameter of a float32 Adam checkpoint
    (weights, update and scale codes: a quarter of the checkpoint) until the next save; packed,
    Adam's update takes a bit or two a code and the weights and the scale (of float32 moments)
    four; codes of over 16 levels (a large embedding's, a bfloat16 ``v``'s scale) stay a byte
    each, as a plain :class:`QuantState`."""

    state: QuantState  # without its codes
    packed: PackedCodes

    @property
    def levels(self) -> int:
        return self.state.levels

    def unpacked(self) -> QuantState:
        return replace(self.state, codes=self.packed.unpacked())


def _delta_payload(
    prev: np.ndarray | PackedCodes | FactoredContexts,
    delta: np.ndarray,
    coding: str,
    pairs: np.ndarray | None,
    estimate: float | None,
) -> tuple[str, bytes, int]:
    """``(stream coding, payload, stream bytes before entropy coding)`` of the codes' cyclic
    delta. Under "ans" ``delta`` comes regrouped by ``prev``, ``pairs`` holds its groups'
    models (both from :func:`grouped_delta`) and ``estimate`` their ``ans_bytes``. It is coded
    one delta to a symbol, or two (FORMAT.md ``"ans<L>:pairs"``, at most :data:`PAIRED_LEVELS`
    levels: half the rANS steps, and 1-2% smaller on a checkpoint's long tensors), or, where at
    most :data:`_GAP_SHARE` of the values changed, as the gaps between the changed values and
    those values (``"ans<L>:gaps"``: a step or two for each changed value, none for the others),
    the smallest of those it tries, except that gaps within :data:`_GAP_SLACK` of the smallest
    are kept (a restore decodes every delta of its chain). Pairs and gaps are tried only where
    their tables stay small beside the delta (:data:`_TABLE_SHARE`). The other codings take it
    in element order; only "regroup" reads ``prev`` (a byte a code: packed previous codes are
    read by "ans" alone)."""
    if coding == "ans":
        if pairs is None or estimate is None:
            raise ValueError("an 'ans' delta is coded with its groups' models (grouped_delta's pairs) and size")
        levels = pairs.shape[0]
        tried: dict[str, tuple[float, Any]] = {"": (estimate, (delta, pairs, b""))}  # suffix: (size, what to code)
        # each coding's tables hold, for each group, a count of each symbol it may take (about 2
        # bytes a count): pairs up to levels^2 symbols in levels + 1 groups, gaps up to GAP_ESCAPE + 1
        # tokens and levels - 1 values in each of levels groups. A sparse delta (a weight's, two
        # steps on) is small, and on a tensor of a few hundred thousand values a coding whose
        # tables weigh that much never wins (its histograms only cost a pass)
        if levels <= PAIRED_LEVELS and 2 * (levels + 1) * levels**2 < _TABLE_SHARE * estimate:
            symbols, histograms = pair_up(delta, pairs.sum(axis=1), levels)
            tried[_PAIRED] = (ans_bytes(histograms), (symbols, histograms, b""))
        sparse = int(pairs[:, 1:].sum()) <= _GAP_SHARE * delta.size
        if sparse and 2 * levels * (GAP_ESCAPE + levels) < _TABLE_SHARE * estimate:
            symbols, histograms, token_counts = gap_up(delta, pairs)
            header = length_prefixed(uleb128_encode(token_counts.astype(np.uint64)).tobytes())
            tried[_GAPS] = (ans_bytes(histograms) + len(header), (symbols, histograms, header))
        suffix = min(tried, key=lambda k: tried[k][0])
        if _GAPS in tried and tried[_GAPS][0] <= (1 + _GAP_SLACK) * tried[suffix][0]:
            suffix = _GAPS
        symbols, histograms, header = tried[suffix][1]
        lanes = lanes_for(symbols.size)
        payload = header + ans_encode(symbols, lanes=lanes, histograms=histograms)
        return f"{ans_coding(lanes)}{suffix}", payload, int(delta.size)
    if coding == "entropy":
        return (*encode_stream(delta), int(delta.size))
    tokens = varint_encode(rle_encode(regroup(delta, prev) if coding == "regroup" else delta))
    return (*encode_stream(tokens, level=_TOKEN_LEVEL), int(tokens.size))


_PAIRED = ":pairs"  # a stream coding's suffix: the rANS stream's symbols are pairs of deltas
_GAPS = ":gaps"  # a stream coding's suffix: the gaps between the changed deltas, then those deltas
_TABLE_SHARE = 0.05  # the most of a delta's size a coding's tables may take for it to be tried
_GAP_SHARE = 1 / 8  # the most of a delta's values that may have changed for gaps to be tried
_GAP_SLACK = 0.02  # gaps are kept over a coding at most this much smaller (a restore decodes them faster)


def _groups(prev: np.ndarray | FactoredContexts) -> np.ndarray:
    """Sizes of the regrouped delta's groups: how many values the base has at each code."""
    return prev.counts() if isinstance(prev, FactoredContexts) else byte_counts(prev)


def _undo_delta(
    prev: np.ndarray | FactoredContexts, payload: np.ndarray, params: dict[str, Any], n: int, where: str
) -> np.ndarray:
    """The current codes from a stored delta on the base's codes ``prev``."""
    coding, (stream_coding, size) = params["delta_coding"], params["delta_stream"]
    levels = params["delta_levels"]
    if coding not in DELTA_CODINGS or not isinstance(levels, int) or not 1 <= levels <= 256:
        raise CorruptCheckpointError(
            f"{where}: delta coding {coding!r} at {levels!r} levels is not one this codec writes"
        )
    groups = None  # the base's histogram, under "ans": the delta's models, and its groups when undone
    try:
        if coding == "ans":
            if int(size) != n:
                raise ValueError(f"delta holds {int(size)} values, expected {n}")
            head, colon, suffix = (stream_coding if isinstance(stream_coding, str) else "").partition(":")
            lanes, kind = ans_lanes(head), colon + suffix  # kind: "" (one delta a symbol), _PAIRED or _GAPS
            if not lanes or kind not in ("", _PAIRED, _GAPS):
                raise ValueError(f"delta_coding 'ans' with stream coding {stream_coding!r}, not an rANS stream")
            groups = _groups(prev)
            if not kind:
                delta = ans_decode(payload, n, groups, lanes)
            elif groups.size > levels or (kind == _PAIRED and levels > PAIRED_LEVELS):
                raise ValueError(f"{suffix} at {levels} levels of a base coded up to {groups.size - 1}")
            else:  # (the encoder's groups: one per level, those past the base's largest code empty)
                sizes = np.zeros(levels, np.int64)
                sizes[: groups.size] = groups
                if kind == _PAIRED:
                    symbols = paired_sizes(sizes)
                    delta = unpair(ans_decode(payload, int(symbols.sum()), symbols, lanes), sizes, levels)
                else:  # (each group's changed values: its tokens less its escapes, from the table)
                    header, payload = split_prefixed(payload, "gap stream's token counts")
                    token_counts = uleb128_decode(header).astype(np.int64)
                    if token_counts.size != levels or np.any(token_counts < 0):
                        raise ValueError(f"gap stream's header holds no token count for each of its {levels} groups")
                    if np.any(token_counts > most_gap_tokens(sizes)):  # (refused before a stream of them is made)
                        raise ValueError("gap stream's header counts more tokens than its groups' values can take")
                    changed = token_counts - ans_counts(payload, token_counts)[:, GAP_ESCAPE]
                    symbols = np.concatenate((token_counts, changed))
                    delta = ungap(ans_decode(payload, int(symbols.sum()), symbols, lanes), token_counts, sizes, levels)
        else:
            data = decode_stream(stream_coding, payload, int(size), where)
            delta = data if coding == "entropy" else rle_decode(varint_decode(data)).astype(np.uint8)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    if delta.size != n:
        raise CorruptCheckpointError(f"{where}: delta holds {delta.size} values, expected {n}")
    if coding in ("ans", "regroup"):  # stored in groups of the previous code (given up by the caller)
        try:
            return undo_regrouped_delta(delta, prev, levels, in_place=True, groups=groups)
        except ValueError as exc:  # (the base given up is then partly overwritten)
            raise CorruptCheckpointError(f"{where}: {exc}") from None
    return apply_delta(prev, delta, levels)


class _Prefixed:
    """The blobs of the protected values, seen through the tensor's blob source."""

    def __init__(self, blobs: BlobSource, prefix: str) -> None:
        self.blobs, self.prefix, self.where = blobs, prefix, blobs.where

    def __call__(self, name: str) -> np.ndarray:
        return self.blobs(self.prefix + name)


@register_codec
class DynaQuantCodec(Codec):
    """Quantize with a plan (encode); decode needs only the stored params and blobs."""

    name = "dynaquant"
    # 2: rANS streams in lanes ("ans<L>"); version 1 records use one lane ("ans") only. 3: trellis
    # symbols (blob "symbols"); records without the "trellis" param read as version 2's. 4: codes
    # packed from their smallest ("pack<N>+<B>"), which earlier records never use. 5: packed codes
    # zstd-compressed ("zstd:pack<N>+<B>"), which earlier records never use. 6: deltas two to an
    # rANS symbol ("ans<L>:pairs"), which earlier records never use. 7: deltas as the gaps between
    # the changed ones ("ans<L>:gaps"), which earlier records never use. 8: keyframe codes with
    # contexts from row and column terms ("ans-factored"), which earlier records never use
    version = 8
    stable_state = True  # codes, centres and protected values are new arrays
    reads_parts = True  # values made a part at a time are partitioned so (quantize)

    def __init__(self, plan: TensorPlan | None = None, delta_coding: str = DEFAULT_DELTA_CODING) -> None:
        if delta_coding not in DELTA_CODINGS:
            raise ValueError(f"delta_coding must be one of {DELTA_CODINGS}, got {delta_coding!r}")
        self.plan, self.delta_coding = plan, delta_coding

    def max_blobs(self, numel: int) -> int:
        """The codes (or their delta, or trellis symbols), the rare rows' flags where the plan
        has rare rows, and the protected values' chunks where the plan may protect any (an
        optimizer moment's never does). Counted from the plan: bounding every tensor by all
        three reserved a 124M checkpoint 234 KB of header for the 62 KB written, and what a
        delta left unused was kept as padding (0.7% of it) or the payload copied once more."""
        plan = self.plan
        if plan is None:
            return 2 + LosslessCodec().max_blobs(numel)
        protects = plan.protect_magnitude < math.inf or (
            plan.protect_sensitivity is not None and plan.protect_sensitivity < math.inf
        )
        return 1 + (plan.rare_rows is not None) + (LosslessCodec().max_blobs(numel) if protects else 0)

    def encode(self, tensor: RawTensor | ValuesInParts, base: Any = None) -> Encoded:
        if self.plan is None:
            raise CodecError(
                "the dynaquant codec quantizes with a plan made for the whole checkpoint; use "
                "hf_dynaquant.Compressor or compress_state_dict rather than the bare codec"
            )
        plan, reference = self.plan.with_reference()
        codes, protected = quantize(tensor if isinstance(tensor, ValuesInParts) else from_raw(tensor), plan)
        state = QuantState(
            codes,
            FIRST_CENTRE + len(plan.centres),
            plan.centres,
            protected,
            tensor.dtype,
            tensor.shape,
            plan.residual,
            reference,
            plan.rare_rows,
            plan.trellis_steps is not None,
            plan.common if plan.trellis_steps is not None else 0,
        )
        if isinstance(base, KeptState) and (state.trellis or self.delta_coding != "ans"):
            # a trellis tensor tries no delta (its base is not read); the paper's codings read the
            # previous codes a byte each, where "ans" reads them packed (grouped_delta)
            base = None if state.trellis else base.unpacked()
        return self._encode_state(state, base, {"layer_type": self.plan.layer_type})

    def kept(self, state: QuantState) -> QuantState | KeptState:
        """``state`` with its codes packed (:class:`KeptState`): as its keyframe's stream packed
        them where it did, else as tightly as its levels allow (1, 2 or 4 bits; over 16 levels
        they stay a byte a code). Raises ``ValueError`` for codes past the state's levels (a
        damaged record's)."""
        packed = state.packed
        if packed is None:
            width = next((w for w in (1, 2, 4) if state.levels <= 1 << w), None)
            if width is None:
                return state
            packed = PackedCodes(pack_bits(state.codes, width), width, 0, int(state.codes.size))
        return KeptState(replace(state, codes=_NO_CODES, packed=None), packed)

    def keyframe(self, state: QuantState) -> Encoded:
        """The codes self-contained; a ``previous`` residual still needs its base's values, so it
        cannot be one (:meth:`CheckpointStore.compact` stores such a tensor losslessly)."""
        if state.residual == "previous":
            raise CodecError("a residual against the previous checkpoint cannot be re-encoded without its base")
        return self._encode_state(state, None, {})

    def reference_kind(self, params: dict[str, Any]) -> str | None:
        return params.get("residual")

    def _encode_state(self, state: QuantState, base: Any, extra: dict[str, Any]) -> Encoded:
        params: dict[str, Any] = {"levels": state.levels, "centres": _shortest(state.centres), **extra}
        if state.residual != "none":
            params["residual"] = state.residual
        # A delta is kept when it is smaller than the keyframe. Under "ans" the delta's size is
        # known to a few bytes before coding it (ans_bytes of its groups' histograms), so it is
        # coded alone when it is sure to win (under half the codes' order-0 entropy, which no
        # keyframe comes near, or under the size a long keyframe's coding cannot go below), else
        # only when it may win against the keyframe as coded; Adam's update, which
        # changes a lot between checkpoints, usually may not (coding its delta only to discard
        # it took a third of a delta save). The paper's codings code the delta, then the
        # keyframe unless the delta is sure to win, and keep the smaller.
        delta: bytes | None = None
        packed: PackedCodes | None = None  # the codes as the keyframe's stream packed them, if it did
        sure = False  # whether the delta is smaller than the keyframe would be, without coding that
        estimate: float | None = None  # the delta's size under "ans", before coding it
        delta_params: dict[str, Any] = {}
        key_bits = 0.0  # the codes' order-0 entropy, needed (and computed) only beside a delta
        key_counts: np.ndarray | None = None  # their histogram, where a delta's pair counts gave it
        # (a trellis keyframe's symbols take a bit less a value than its codes; its deltas are not tried)
        prev = base.packed if isinstance(base, KeptState) else base.codes if isinstance(base, QuantState) else None
        if prev is not None and prev.size == state.codes.size and not state.trellis:
            levels = max(base.levels, state.levels)
            pairs: np.ndarray | None = None
            if self.delta_coding == "ans":  # regrouped as coded; the pair counts hold every histogram needed
                diff, pairs = grouped_delta(prev, state.codes, levels)
                key_counts = current_counts(pairs, levels)
                key_bits, estimate = entropy_bits(key_counts), ans_bytes(pairs)
            else:
                diff, key_bits = cyclic_delta(prev, state.codes, levels), order0_bits(state.codes)
            delta_params = {"mode": "delta", "delta_levels": levels, "delta_coding": self.delta_coding}

            def code_delta() -> bytes:
                stream_coding, payload, size = _delta_payload(prev, diff, self.delta_coding, pairs, estimate)
                delta_params["delta_stream"] = [stream_coding, size]
                return payload

            sure = estimate is not None and key_counts is not None and self._surely_smaller(estimate, key_counts, state)
            if estimate is None or sure:
                delta = code_delta()
        if delta is not None and (sure or len(delta) * 8 < _SURE_DELTA * key_bits):
            blobs, params = {"delta": delta}, {**params, **delta_params}
        else:
            # "ans" codes keyframes with rANS too where it pays (few levels); the paper's codings keep
            # zstd keyframes, which decode several times faster
            symbols = state.codes
            factored: _Factored | None = None
            if state.trellis:
                symbols = trellis.pack(state.codes, state.rare_rows, state.common)
                params["trellis"] = TRELLIS
                if state.rare_rows is not None:
                    params["trellis_levels"] = [state.common, len(state.centres) - state.common]
            if state.rare_rows is not None:
                codes_coding, codes_payload = ROWS_ANS, _rows_encode(symbols, state.rare_rows)
            elif self.delta_coding == "ans":  # (key_counts: the codes' histogram, made beside a delta)
                factored = _Factored.tried(state) if self.plan is not None and self.plan.factored else None
                if factored is not None and key_counts is None:
                    key_counts = current_counts(factored.pairs, factored.contexts)
                if factored is not None and self._surely_smaller(factored.estimate, key_counts, state):
                    codes_coding, codes_payload = FACTORED_ANS, factored.code()  # (no keyframe of its own coded)
                else:
                    codes_coding, codes_payload, packed = encode_codes_packed(symbols, key_counts)
                    packed = None if state.trellis else packed  # (a trellis tensor's symbols are not its codes)
                    if factored is not None and factored.estimate < len(codes_payload):
                        factored_payload = factored.code()
                        if len(factored_payload) < len(codes_payload):
                            codes_coding, codes_payload, packed = FACTORED_ANS, factored_payload, None
            else:
                codes_coding, codes_payload = encode_stream(symbols)
            if delta is None and estimate is not None and estimate < len(codes_payload):
                delta = code_delta()
            if delta is not None and len(delta) < len(codes_payload):
                blobs, params = {"delta": delta}, {**params, **delta_params}
            else:
                # (trellis symbols under a name of their own: a reader that knows no trellis finds no codes)
                key = "symbols" if state.trellis else "codes"
                blobs, params = {key: codes_payload}, {**params, "mode": "keyframe", "codes_stream": codes_coding}
                if codes_coding == ROWS_ANS:
                    rows_coding, blobs["rows"] = encode_stream(state.rare_rows)
                    params["rows_stream"] = rows_coding
                elif codes_coding == FACTORED_ANS:
                    params["factored"] = factored.params()
        params["protected"] = {"n": int(state.protected.size)}
        if state.protected.size:  # none (optimizer moments, protect=0): no blob, no stream params
            prot = LosslessCodec(delta=False).encode(RawTensor("BF16", (state.protected.size,), state.protected))
            blobs.update({f"p.{k}": v for k, v in prot.blobs.items()})
            params["protected"].update(prot.params)
        uses_base = params["mode"] == "delta" or state.residual == "previous"
        kept = state if packed is None else replace(state, packed=packed)  # (the caller's state is left as it was)
        return Encoded(blobs, params, uses_base=uses_base, state=kept)

    @staticmethod
    def _surely_smaller(estimate: float, key_counts: np.ndarray, state: QuantState) -> bool:
        """Whether a delta of ``estimate`` bytes (rANS, to a few bytes) is smaller than the
        keyframe of ``state`` (whose codes have the histogram ``key_counts``) would be: under
        :data:`_SURE_DELTA` of their order-0 entropy, or, for a long stream coded as
        :func:`encode_codes` codes it, under the size that coding does not go below
        (:func:`codes_size_floor`, as a sample of the codes estimates zstd's) by :data:`_SLACK`
        bytes."""
        key_bits = entropy_bits(key_counts)
        if estimate * 8 < _SURE_DELTA * key_bits:
            return True
        if state.rare_rows is not None or estimate + _SLACK >= key_bits / 8:  # (the floor is at most the entropy)
            return False
        floor = codes_size_floor(state.codes, key_counts)
        return floor is not None and estimate + _SLACK < floor

    def decode(
        self,
        dtype: str,
        shape: tuple[int, ...],
        params: dict[str, Any],
        blobs: BlobSource,
        base: Any = None,
        *,
        reference: np.ndarray | None = None,
    ) -> QuantState:
        n = int(np.prod(shape, dtype=np.int64))
        where = blobs.where
        residual = params.get("residual", "none")
        if residual != "none" and (reference is None or reference.size != n):
            raise CorruptCheckpointError(
                f"{where}: a {residual!r} residual, but its reference values are missing or differ in size"
            )
        rare_rows = None
        kind = params.get("trellis")
        stored = "codes" if kind is None else "symbols"  # a keyframe's blob
        if params["mode"] == "delta":
            if kind is not None:
                raise CorruptCheckpointError(f"{where}: a delta with trellis symbols, which only keyframes store")
            if not isinstance(base, QuantState) or base.codes.size != n:
                raise CorruptCheckpointError(f"{where}: delta-coded but its base state is missing or differs in size")
            codes = _undo_delta(base.codes, blobs("delta"), params, n, where)
        elif params["codes_stream"] == FACTORED_ANS:
            codes = _factored_decode(blobs, params.get("factored"), shape, n, where)
        elif params["codes_stream"] == ROWS_ANS:
            if not shape:
                raise CorruptCheckpointError(f"{where}: codes coded by rows, but the tensor has none")
            rare_rows = decode_stream(params["rows_stream"], blobs("rows"), shape[0], where)
            if rare_rows.size != shape[0] or (rare_rows.size and int(rare_rows.max()) > 1):
                raise CorruptCheckpointError(f"{where}: the row map does not hold a 0 or 1 for each of {shape[0]} rows")
            codes = _rows_decode(blobs(stored), rare_rows, n, where)
        else:
            codes = decode_stream(params["codes_stream"], blobs(stored), n, where)
        if kind is not None:
            count = len(params["centres"])
            codes = _unpack(codes, kind, shape, params.get("trellis_levels", [count]), count, rare_rows, where)
        prot_params = params["protected"]
        m = int(prot_params["n"])
        protected = (
            LosslessCodec().decode("BF16", (m,), prot_params, _Prefixed(blobs, "p.")).bits
            if m
            else np.zeros(0, dtype=np.uint16)
        )
        centres = np.asarray(params["centres"], dtype=np.float32)
        # an undone delta's codes are remainders below its levels: checked when those exceed the centres
        bounded = params["mode"] == "delta" and params["delta_levels"] <= FIRST_CENTRE + centres.size
        if codes.size and not bounded and int(codes.max()) >= FIRST_CENTRE + centres.size:
            raise CorruptCheckpointError(f"{where}: a code exceeds the {centres.size} stored centres")
        return QuantState(
            codes,
            int(params["levels"]),
            centres,
            protected,
            dtype,
            tuple(shape),
            residual,
            reference if residual != "none" else None,
            rare_rows,
            kind is not None,
            int(params["trellis_levels"][0]) if kind is not None and rare_rows is not None else 0,
        )

    def coded(self, state: QuantState) -> QuantState | None:
        plain = state.reference is None and state.codes.dtype == np.uint8 and state.dtype == "F32"
        return state if plain else None  # (other dtypes round the decoded values: to_raw)

    def to_raw(self, state: QuantState) -> RawTensor:
        try:
            values = decoded_values(state.codes, state.centres, state.protected, state.reference)
        except ValueError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        tensor = torch.from_numpy(values).to(torch_dtype(state.dtype)).reshape(state.shape)
        return to_raw(tensor)


def _unpack(
    stored: np.ndarray,
    kind: Any,
    shape: tuple[int, ...],
    levels: Any,
    centres: int,
    rare_rows: np.ndarray | None,
    where: str,
) -> np.ndarray:
    """The codes of a keyframe's trellis symbols (``kind``: the ``trellis`` param; ``levels``: each
    grid's level count, the ``trellis_levels`` param with a row map, else the centres'; together
    they must be the ``centres`` stored)."""
    if kind != TRELLIS:
        raise CorruptCheckpointError(f"{where}: trellis {kind!r} is not one this version decodes (it writes {TRELLIS!r})")
    if len(shape) < 2:
        raise CorruptCheckpointError(f"{where}: trellis-coded, but the tensor has no columns")
    try:
        if not isinstance(levels, list) or not all(isinstance(k, int) for k in levels) or sum(levels) != centres:
            raise ValueError(f"trellis grids of {levels!r} levels for {centres} centres")
        return trellis.unpack(stored, shape[0], tuple(levels), rare_rows)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None


@dataclass
class _Factored:
    """A keyframe's codes coded with contexts from their rows' and columns' terms
    (:mod:`~hf_dynaquant.core.factored`): an "ans" delta (:func:`_delta_payload`) on the base of
    the codes' contexts, modulo the context count. Within a context the delta and the code are
    one another's (codes lie below the levels, which the contexts outnumber), so each context's
    model is the codes' there; and the delta coder's kernels (grouping, counting, rANS in lanes)
    code and decode it. Tried (:meth:`tried`) where the codes' plan asks (an Adam scale's)."""

    terms: np.ndarray  # int16: the row terms, then the column terms
    contexts: int  # B
    base: FactoredContexts  # each code's context, as its terms give it
    grouped: np.ndarray  # the delta, regrouped by context
    pairs: np.ndarray  # its (context, delta) counts: every histogram the coding needs
    estimate: float  # bytes: the rANS stream's (to a few bytes) and the terms' (raw, a bound)
    stream: str = ""  # the rANS stream's coding, once coded
    terms_stream: str = ""  # the terms' stream coding, once coded

    @classmethod
    def tried(cls, state: QuantState) -> _Factored | None:
        """The factored coding of ``state``'s codes, its size estimated and nothing coded yet;
        None where it does not apply (fewer than :data:`_FACTORED_MIN` codes, no rows and
        columns, more levels than contexts fit a byte, trellis symbols)."""
        n, shape = state.codes.size, state.shape
        if state.trellis or n < _FACTORED_MIN or len(shape) < 2 or state.levels > MAX_FACTORED_LEVELS:
            return None
        rows = int(shape[0])
        if rows < 2 or n // rows < 2:
            return None
        contexts = context_count(state.levels)
        terms = factored_terms(state.codes, rows)
        base = FactoredContexts(terms, rows, n // rows, contexts)
        grouped, pairs = grouped_delta(base, state.codes, contexts)
        return cls(terms, contexts, base, grouped, pairs, ans_bytes(pairs) + 2 * terms.size)

    def code(self) -> bytes:
        """Blob ``codes``: the terms (length-prefixed, in the one blob a delta or a plain
        keyframe takes: a blob of their own widened every delta's reserved header), then the
        codes' rANS stream; the codings are kept for :meth:`params`."""
        self.terms_stream, terms = encode_stream(self.terms.astype("<i2").view(np.uint8))
        self.stream, payload, _ = _delta_payload(self.base, self.grouped, "ans", self.pairs, self.estimate)
        return length_prefixed(terms) + payload

    def params(self) -> dict[str, Any]:
        """The ``factored`` param of the blob :meth:`code` made."""
        return {"contexts": self.contexts, "stream": self.stream, "terms_stream": self.terms_stream}


def _factored_decode(blobs: BlobSource, spec: Any, shape: tuple[int, ...], n: int, where: str) -> np.ndarray:
    """The codes of a factored keyframe (:class:`_Factored`) from its blobs and its "factored"
    param ``spec``."""
    if not isinstance(spec, dict) or len(shape) < 2 or int(shape[0]) < 1 or not n:
        raise CorruptCheckpointError(
            f"{where}: codes with factored contexts, but no rows and columns or no 'factored' param"
        )
    contexts, stream, terms_stream = spec.get("contexts"), spec.get("stream"), spec.get("terms_stream")
    if not isinstance(contexts, int) or not 1 <= contexts <= 256 or not isinstance(terms_stream, str):
        raise CorruptCheckpointError(
            f"{where}: factored contexts {contexts!r} (1 to 256) or terms stream {terms_stream!r}"
        )
    rows = int(shape[0])
    size = 2 * (rows + n // rows)  # (int16 terms, a row's and a column's each)
    try:
        stored, stream_payload = split_prefixed(blobs("codes"), "factored terms")
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    terms = decode_stream(terms_stream, stored, size, where)
    if terms.size != size:
        raise CorruptCheckpointError(f"{where}: the factored terms hold {terms.size} bytes, expected {size}")
    base = FactoredContexts(np.ascontiguousarray(terms).view("<i2"), rows, n // rows, contexts)
    as_delta = {"delta_coding": "ans", "delta_levels": contexts, "delta_stream": [stream, n]}
    return _undo_delta(base, stream_payload, as_delta, n, where)


def _row_keys(rare_rows: np.ndarray, n: int) -> np.ndarray:
    """Each value's row kind (0 common, 1 rare), for ``n`` values in rows of equal length."""
    return np.repeat(rare_rows, n // rare_rows.size)


def _rows_encode(codes: np.ndarray, rare_rows: np.ndarray) -> bytes:
    """rANS of the codes, the common rows' and the rare rows' each with a model of its own (their
    codes come from different codebooks; one model over both would pay for telling them apart)."""
    keys = _row_keys(rare_rows, codes.size)
    return ans_encode(regroup(codes, keys), byte_counts(keys))


def _rows_decode(payload: Any, rare_rows: np.ndarray, n: int, where: str) -> np.ndarray:
    """Inverse of :func:`_rows_encode`."""
    keys = _row_keys(rare_rows, n)
    try:
        return ungroup(ans_decode(payload, n, byte_counts(keys)), keys)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None


def _shortest(values: np.ndarray) -> list[float]:
    """Float32 values as the shortest decimals that read back to the same float32 (half the
    manifest bytes of ``tolist()``, which prints float64 digits)."""
    return [float(str(v)) for v in values.astype(np.float32)]
