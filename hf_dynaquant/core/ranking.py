"""Parameter ranking (DynaQuant section 4.1): magnitude ``|w|`` and sensitivity ``|EMA(g) * w|``.

The gradient EMA (``EMA_t = beta * g_t + (1 - beta) * EMA_{t-1}``, beta = 0.9, so recent steps
dominate) is kept on the CPU, one float32 per parameter and nothing more. It is fed only during a
window of steps before a checkpoint. On CUDA, :meth:`GradientEMA.start` copies each gradient into
a small reusable pinned buffer with ``non_blocking=True`` on a side stream after the backward
pass, and :meth:`GradientEMA.finish` (before the gradients are zeroed) waits for those copies and
folds them in; the accelerator is never synchronised with the training stream. On the CPU the
gradients are folded in directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

__all__ = ["GradientEMA", "magnitude", "sensitivity"]

_STAGING = 1 << 24  # pinned staging elements (64 MB) reused for device->host gradient copies


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().abs()


def sensitivity(weight: torch.Tensor, ema_grad: torch.Tensor | None) -> torch.Tensor:
    """``|EMA(g) * w|``; falls back to ``|w|`` when no gradient was recorded."""
    if ema_grad is None:
        return magnitude(weight)
    return torch.mul(ema_grad.to(weight.device, torch.float32), weight.detach().float()).abs_()  # (one new tensor)


class GradientEMA:
    """EMA of gradients for named parameters, held on the CPU (see the module docstring)."""

    def __init__(self, params: Iterable[tuple[str, torch.nn.Parameter]], beta: float = 0.9) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = beta
        self.params = [(n, p) for n, p in params if p.requires_grad]
        self.ema: dict[str, torch.Tensor] = {}
        self.steps = 0
        self._pending: list[tuple[str, torch.Tensor, torch.cuda.Event]] = []
        self._staging: torch.Tensor | None = None
        self._stream = None

    def _fold(self, name: str, grad: torch.Tensor) -> None:
        g = grad.reshape(-1).float()
        ema = self.ema.get(name)
        if ema is None:  # the first gradient seeds the average
            self.ema[name] = g.clone()
        else:
            ema.mul_(1 - self.beta).add_(g, alpha=self.beta)

    def start(self) -> None:
        """After ``backward()``: begin recording this step's gradients."""
        for name, p in self.params:
            if p.grad is None:
                continue
            if p.grad.device.type == "cuda":
                self._copy_async(name, p.grad)
            else:
                self._fold(name, p.grad.detach())
        self.steps += 1

    def _copy_async(self, name: str, grad: torch.Tensor) -> None:
        if grad.numel() > _STAGING:  # larger than the staging buffer: one blocking copy
            self._fold(name, grad.detach().float().cpu())
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=grad.device)
            self._staging = torch.empty(_STAGING, dtype=torch.float32, pin_memory=True)
        used = sum(t.numel() for _, t, _ in self._pending)
        if used + grad.numel() > _STAGING:  # staging full: fold what is in flight first
            self.finish()
            used = 0
        dst = self._staging[used : used + grad.numel()]
        event = torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(grad.detach().reshape(-1).float(), non_blocking=True)
            event.record(self._stream)
        self._pending.append((name, dst, event))

    def finish(self) -> None:
        """Before the gradients are zeroed: wait for in-flight copies and fold them in."""
        for name, staged, event in self._pending:
            event.synchronize()
            self._fold(name, staged)
        self._pending.clear()

    def get(self, name: str) -> torch.Tensor | None:
        """The EMA of a parameter's gradient, flat, or None if none was recorded."""
        return self.ema.get(name)

    def reset(self) -> None:
        self.finish()
        self.ema.clear()
        self.steps = 0

    def take(self) -> dict[str, torch.Tensor]:
        """Hand the recorded averages over (no copy) and start a new window."""
        self.finish()
        taken, self.ema = self.ema, {}
        self.steps = 0
        return taken

    def sensitivity(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``|EMA(g) * w|`` for one parameter (``|w|`` with a warning if none was recorded)."""
        ema = self.get(name)
        if ema is None:
            warnings.warn(
                f"no gradient recorded for {name!r}: its sensitivity falls back to magnitude "
                "(call on_backward_pass_end() during the steps before a checkpoint)",
                stacklevel=2,
            )
            return magnitude(weight)
        return sensitivity(weight, ema.view(weight.shape))
