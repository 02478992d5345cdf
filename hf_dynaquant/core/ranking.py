"""Parameter ranking (DynaQuant section 4.1): magnitude ``|w|`` and sensitivity ``|EMA(g) * w|``.

The gradient EMA (``EMA_t = beta * g_t + (1 - beta) * EMA_{t-1}``, beta = 0.9, so recent steps
dominate) holds one float32 per parameter and nothing more, fed only during a window of steps
before a checkpoint. On the CPU the gradients are folded in directly. On CUDA it is kept *on the
device* when the device has room for it (:func:`~hf_dynaquant.core.memory.has_room`, checked at
each window's first step and for a gradient that first arrives later; ``on_device=False`` never
does): :meth:`GradientEMA.start` folds the gradients in on the training thread's stream with a
few fused kernels, with no synchronisation, and whoever takes the average moves it to the host.
Without room each gradient is copied into a small reusable pinned buffer with
``non_blocking=True`` on a side stream after the backward pass, and :meth:`GradientEMA.finish`
(before the gradients are zeroed) waits for those copies and folds them in on the CPU. At 353M
parameters on an H200 a training step in the window took 184 ms that way and 120 ms with the
fold on the device, against 117-119 ms outside the window (``benchmarks/RESULTS.md``, "On a GPU,
session 36"). (``ShardedCompressor``'s subclass folds each rank's local shard where it lies.)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from .memory import has_room, on_accelerator

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
    """EMA of gradients for named parameters, on the CPU or their CUDA device (see the module
    docstring). ``on_device``: keep the average of CUDA gradients on their device when it has room."""

    def __init__(
        self, params: Iterable[tuple[str, torch.nn.Parameter]], beta: float = 0.9, *, on_device: bool = True
    ) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = beta
        self.on_device = on_device
        self.params = [(n, p) for n, p in params if p.requires_grad]
        self.ema: dict[str, torch.Tensor] = {}
        self.steps = 0
        self._pending: list[tuple[str, torch.Tensor, torch.cuda.Event]] = []
        self._staging: torch.Tensor | None = None
        self._stream = None
        self._here: bool | None = None  # this window folds CUDA gradients on their device (None: not decided yet)

    def _fold(self, name: str, grad: torch.Tensor) -> None:
        g = grad.reshape(-1).float()
        ema = self.ema.get(name)
        if ema is None:  # the first gradient seeds the average
            self.ema[name] = g.clone()
        else:
            ema.mul_(1 - self.beta).add_(g, alpha=self.beta)

    def start(self) -> None:
        """After ``backward()``: record this step's gradients (on a CUDA device with room, folded
        in there; otherwise their copies to the host begun)."""
        grads = [(name, p.grad.detach()) for name, p in self.params if p.grad is not None]
        cuda = [(name, g) for name, g in grads if g.device.type == "cuda"]
        if cuda and self._here is not False:
            self._here = self._room_for(cuda) and self._fold_here(cuda)
        for name, g in grads:
            if g.device.type != "cuda":
                self._fold(name, g)
            elif not self._here:
                self._copy_async(name, g)
        self.steps += 1

    def _room_for(self, grads: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether the averages of CUDA gradients ``grads`` stay on their device: ``on_device``,
        one device for them all, and room there for those not averaged yet (checked whenever
        one first arrives: a gradient may first come late in a window). If not, any average
        already there moves to the host, for the rest of the window."""
        new = sum(4 * g.numel() for name, g in grads if name not in self.ema)
        if self._here and not new:
            return True
        device = on_accelerator(g for _, g in grads)
        if self.on_device and device is not None and has_room(device, new):
            return True
        self._to_host()
        return False

    def _fold_here(self, grads: list[tuple[str, torch.Tensor]]) -> bool:
        """Fold CUDA gradients in where they are, queued on the current stream (the same sums as
        :meth:`_fold`: fused kernels for the float32 ones, one addition each for the others,
        whose values are widened in the kernel, with no copy). Only seeding a new average
        allocates; if the device runs out of memory there (the room was checked, but other work
        may have taken it since), the averages move to the host and False says the step's
        gradients are still to be recorded there."""
        new = [(name, g) for name, g in grads if name not in self.ema]
        try:
            for name, g in new:  # the first gradient seeds the average
                self.ema[name] = g.reshape(-1).to(torch.float32, copy=True)
        except torch.OutOfMemoryError:
            for name, _ in new:
                self.ema.pop(name, None)
            self._to_host()
            return False
        seen = {name for name, _ in new}
        old = [(self.ema[name], g.reshape(-1)) for name, g in grads if name not in seen]
        if old:
            torch._foreach_mul_([e for e, _ in old], 1 - self.beta)
            wide = [(e, g) for e, g in old if g.dtype == torch.float32]
            if wide:
                torch._foreach_add_([e for e, _ in wide], [g for _, g in wide], alpha=self.beta)
            for e, g in old:
                if g.dtype != torch.float32:
                    e.add_(g, alpha=self.beta)
        return True

    def _to_host(self) -> None:
        """Move the averages held on a CUDA device to the host (after the folds queued there)."""
        self.ema = {name: t.cpu() if t.is_cuda else t for name, t in self.ema.items()}

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
        self.steps, self._here = 0, None

    def take(self) -> dict[str, torch.Tensor]:
        """Hand the recorded averages over (no copy; on a CUDA device when they were kept there,
        their last folds queued on the training thread's stream) and start a new window."""
        self.finish()
        taken, self.ema = self.ema, {}
        self.steps, self._here = 0, None
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
