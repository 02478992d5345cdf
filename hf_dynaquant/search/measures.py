"""What the search measures of one tensor of a candidate: its size and its error.

A candidate is sized from its codes without evaluating the model, and evaluated on the values
it decodes to (:mod:`.configuration`). Both are done tensor by tensor: on the host by the
compiled kernels, a few tensors at a time on the search's pool; or, when the model lives on an
accelerator, there (:class:`DeviceTensors`), one tensor after another on the search's stream.
The two give the same codes, sizes and decoded values (:meth:`~hf_dynaquant.core.quantizer.TensorPlan.device_codes`),
so where the search runs changes none of its choices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from ..core import trellis
from ..core.entropy import ans_bytes, entropy_bits
from ..core.histogram import byte_counts
from ..core.memory import cached_on_device, has_room, on_accelerator
from ..core.moments import fidelity_sums
from ..core.quantizer import QuantPlan, TensorPlan, decoded_values, device_decoded, quantize

__all__ = ["DeviceTensors", "Measured", "code_bits", "host_measure", "live_tensor", "squared_error"]

logger = logging.getLogger("hf_dynaquant")

Measured = tuple[str, torch.Tensor | None, np.ndarray]  # (name, decoded values, [bits, values, error, norm])

_ERROR_CHUNK = 1 << 20  # values per float64 chunk of squared_error (8 MB temporaries, not 8 bytes a value)
# bytes of temporaries per value of a tensor measured on the device (codes, masks, indices,
# decoded values; a stochastic rounding's int64 draws): it is measured there only with this much room
_DEVICE_BYTES_PER_VALUE = 40


def code_bits(
    counts: np.ndarray, protected: int, joint: np.ndarray | None = None, base: np.ndarray | None = None
) -> float:
    """Bits of one tensor's codes at their order-0 entropy (``counts``: of each code; with rare
    rows two rows, the common and the rare rows' counts, sized apart as stored), plus 16 per
    protected (bf16) value. With ``joint`` (the counts of ``base code * 256 + code`` against the
    base entry's codes, and ``base``, the counts of those), the smaller of that and the entropy
    of the codes given the base codes: what the code delta (the regrouped cyclic delta, one
    model per base code) stores when it pays, as the codec chooses."""
    bits = entropy_bits(counts) if counts.ndim == 1 else 8 * ans_bytes(counts)
    if joint is not None and base is not None:
        pairs = np.nonzero(joint)[0]
        count = joint[pairs]
        bits = min(bits, float(-(count * np.log2(count / base[pairs // 256])).sum()))
    return bits + 16 * protected


def squared_error(decoded: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """``(sum (decoded - exact)^2, sum exact^2)`` in float64: the error of the values a resume
    loads, for the audit figure ``weight_error``. float32 on the host in one compiled pass
    (:func:`~.moments.fidelity_sums`, no copies); otherwise a chunk at a time where the tensors
    are (float64 temporaries of one chunk, not of the tensor)."""
    host32 = [t.device.type == "cpu" and t.dtype == torch.float32 for t in (decoded, exact)]
    if all(host32):
        sums = fidelity_sums(exact, decoded)
        return float(sums[3]), float(sums[1])
    d, e = decoded.reshape(-1), exact.reshape(-1)
    error = norm = 0.0
    for start in range(0, e.numel(), _ERROR_CHUNK):
        chunk = e[start : start + _ERROR_CHUNK].double()
        error += float((d[start : start + _ERROR_CHUNK].double() - chunk).pow(2).sum())
        norm += float(chunk.pow(2).sum())
    return error, norm


def live_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The live tensor ``name`` of ``model``; for a sharded (DTensor) parameter its local shard,
    which is what a sharded snapshot holds."""
    try:
        live = model.get_parameter(name)
    except AttributeError:
        live = model.get_buffer(name)
    to_local = getattr(live, "to_local", None)  # torch.distributed.tensor.DTensor
    return to_local() if to_local is not None else live


def host_measure(
    name: str, tp: TensorPlan, exact: torch.Tensor, base: np.ndarray | None, decode: bool
) -> Measured:
    """One tensor of a candidate on the host: ``(name, decoded values or None, [bits, values,
    squared error, squared norm])`` (without ``decode``, a size only: error and norm 0, and
    error feedback and the trellis left out when the plan says ``nearest``, see
    :func:`~.configuration.measured_bits`)."""
    tp, reference = tp.with_reference()
    codes, protected = quantize(exact, tp)
    if tp.rare_rows is None:
        counts = byte_counts(codes)
    else:
        rows = codes.reshape(tp.rare_rows.size, -1)
        counts = np.stack([byte_counts(rows[tp.rare_rows == kind], 256) for kind in (0, 1)])
    if tp.trellis_steps is not None:  # sized as stored: trellis symbols (of nearest rounding, when sized)
        counts = trellis.symbol_counts(counts, tp.common)
    joint = given = None
    if base is not None and base.size == codes.size and tp.trellis_steps is None:  # (trellis codes: keyframes only)
        joint, given = np.bincount(base.astype(np.int64) * 256 + codes, minlength=1), byte_counts(base)
    sums = np.array([code_bits(counts, protected.size, joint, given), codes.size, 0.0, 0.0])
    if not decode:
        return name, None, sums
    values = torch.from_numpy(decoded_values(codes, tp.centres, protected, reference)).view(exact.shape)
    sums[2:] = squared_error(values.to(exact.dtype), exact)
    return name, values, sums


class DeviceTensors:
    """The search's tensors on the accelerator that holds the model it evaluates.

    The exact weights are the model's own tensors there: a candidate's tensor is measured before
    the evaluation writes its decoded values over it, and every tensor is written back from the
    host snapshot after the evaluation, so they hold the exact weights whenever one is read.
    What the plans hold on the host (sensitivities, the references of residuals, the base
    entry's codes) is copied there once per checkpoint, into the planner's cache (shared with
    :func:`~hf_dynaquant.core.quantizer.plan_quantization`, so one copy each), when the device
    has room for it besides its reserve (:func:`~hf_dynaquant.core.memory.has_room`; training's
    next step must still fit).
    A tensor the device has no room for, or a plan with error feedback, trellis grids or rare rows, is measured
    on the host (:func:`host_measure`), with the same result.
    """

    def __init__(
        self, exact: Mapping[str, torch.Tensor], base_codes: Mapping[str, np.ndarray], cache: dict | None = None
    ) -> None:
        self.exact = dict(exact)
        self.base_codes = base_codes
        # device copies, shared with the planner's (plan_quantization's sketch_cache): one each
        self.cache = cache if cache is not None else {}

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        snapshot: Mapping[str, torch.Tensor],
        base_codes: Mapping[str, np.ndarray],
        cache: dict | None = None,
    ) -> DeviceTensors | None:
        """The tensors of ``model`` named in ``snapshot`` when they all lie on one CUDA device with
        the snapshot's shapes (a sharded parameter: its local shard), else None (measure on the host)."""
        try:
            exact = {n: live_tensor(model, n) for n in snapshot}
        except AttributeError:  # a name the model does not hold
            return None
        if not exact or on_accelerator(exact.values()) is None:
            return None
        if any(t.shape != snapshot[n].shape for n, t in exact.items()):
            return None
        return cls(exact, base_codes, cache)

    @staticmethod
    def takes(plan: QuantPlan) -> bool:
        """Whether the plan's tensors are measured on the device."""
        return all(tp.partitions_on_device() for tp in plan.tensors.values())

    def measure(self, name: str, tp: TensorPlan, snapshot: torch.Tensor, decode: bool) -> Measured:
        """:func:`host_measure` of one tensor, computed on the device (on the host without room
        there); ``snapshot``: its exact values on the host, for the fallback."""
        base = self.base_codes.get(name)
        exact = self.exact[name]
        device = exact.device
        # what the plan holds (or computes) on the host that the device needs: each is copied there once
        codes_of_base = base if base is not None and base.size == exact.numel() else None
        hosts = {
            (name, "sensitivity", tp.residual): tp.sensitivity,
            (name, "reference", tp.residual): tp.reference,
            (name, "base codes"): None if codes_of_base is None else lambda: codes_of_base,
        }
        parts = None
        if device.type != "cuda" or has_room(device, exact.numel() * _DEVICE_BYTES_PER_VALUE):
            parts = [None if h is None else cached_on_device(self.cache, key, h, device) for key, h in hosts.items()]
        if parts is None or any(h is not None and p is None for h, p in zip(hosts.values(), parts)):
            logger.debug("hf_dynaquant: no room on %s to measure %r there: measured on the host", device, name)
            return host_measure(name, tp, snapshot, base, decode)
        sens, reference, base_t = parts
        target = exact.detach().reshape(-1).float()
        if reference is not None:
            target = target - reference
        codes, protected = tp.device_codes(target, sens)
        counts = torch.bincount(codes, minlength=256).cpu().numpy()
        joint = given = None
        if base_t is not None:
            joint = torch.bincount(base_t.int() * 256 + codes.int(), minlength=1 << 16).cpu().numpy()
            given = joint.reshape(256, 256).sum(axis=1)
        sums = np.array([code_bits(counts, protected.numel(), joint, given), codes.numel(), 0.0, 0.0])
        if not decode:
            return name, None, sums
        values = device_decoded(codes, tp.centres, protected, reference).view(exact.shape)
        sums[2:] = squared_error(values.to(exact.dtype), exact)
        return name, values, sums
