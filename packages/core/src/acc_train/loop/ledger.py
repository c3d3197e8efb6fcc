"""What each step measured, kept on the accelerator until the loop reads it.

Reading a tensor's value on the host (``.item()``, ``.tolist()``, ``float(t)``) blocks the CPU
until the device has run everything queued before it, so the Python between steps (metrics,
hooks, the progress bar) would run while the device idles. The loop therefore reads only every
``training.read_every`` steps and before an evaluation, a checkpoint, a stop and the end, as
torchtitan reads at ``log_freq`` and HF Trainer at ``logging_steps``; between reads each step's
loss, gradient norm and token count stay device tensors in a :class:`StepLedger`, and one read
brings them all back, so ``metrics.jsonl`` still gets one row per step.

A step's loss is this rank's share; summing it over ranks rides on the next step's token-count
all-reduce (:func:`acc_train.loop.loss.step_windows` carries it), so a read costs one collective
only for the last step it covers. Step times come from a :class:`StepClock`: device events on an
accelerator (host timestamps would measure how fast the host queues work, not the steps), the
host clock on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepValues", "StepReading", "StepLedger", "StepClock"]


@dataclass
class StepValues:
    """One step as the loop hands it over: host values and device tensors."""

    step: int
    epoch: int
    lr: float
    #: this rank's share of the step's per-token mean loss (0-d tensor); summed over ranks later
    loss: Any
    #: the global gradient norm (a 0-d tensor, a float) or None where it was not measured
    grad_norm: Any
    #: the step's real tokens, all ranks (0-d tensor or int)
    tokens: Any
    #: the dict ``acc_train_step_end`` got: keys plugins added to it go into the step's row
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepReading:
    """One step as read back: plain Python numbers."""

    step: int
    epoch: int
    lr: float
    #: the step's per-token mean loss over every rank and micro-batch
    loss: float
    grad_norm: float | None
    tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


class StepLedger:
    """Steps not read yet, in order. ``loss_replicas`` divides the summed losses (ranks of a
    tensor-parallel group hold the same loss)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.many = accelerator.num_processes > 1
        self.loss_replicas = accelerator.loss_replicas
        self._steps: list[StepValues] = []
        #: losses summed over ranks, by position in ``_steps``
        self._summed: list[Any] = []
        self._carried = False

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, values: StepValues) -> None:
        self._steps.append(values)
        if not self.many:
            self._summed.append(values.loss)

    def take(self) -> Any:
        """The last step's loss if it still has to be summed over ranks (every rank calls this at
        the same point, before a collective that carries it), else None."""
        if self.many and len(self._summed) < len(self._steps) and not self._carried:
            self._carried = True
            return self._steps[-1].loss
        return None

    def put(self, summed: Any) -> None:
        """The loss :meth:`take` gave, summed over ranks."""
        self._summed.append(summed)
        self._carried = False

    def read(self) -> list[StepReading]:
        """Every step held, read back in one transfer; the ledger is then empty. A collective
        where the last step's loss is not summed yet: every rank reads at the same steps."""
        if len(self._summed) < len(self._steps):
            import torch

            loss = self._steps[-1].loss
            self._summed.append(self.accelerator.reduce(loss.double().reshape(1), reduction="sum")[0])
        return self._drain(len(self._steps))

    def read_local(self) -> list[StepReading]:
        """The steps whose losses are summed already, with no collective (after a failure)."""
        return self._drain(len(self._summed))

    def _drain(self, n: int) -> list[StepReading]:
        import torch

        steps, summed = self._steps[:n], self._summed[:n]
        self._steps, self._summed, self._carried = self._steps[n:], self._summed[n:], False
        if not steps:
            return []
        tensors = [v for s in steps for v in (s.grad_norm, s.tokens) if isinstance(v, torch.Tensor)] + list(summed)
        device = summed[0].device
        # one device-to-host transfer for all of them
        values = iter(torch.stack([t.detach().to(device=device, dtype=torch.float64).reshape(()) for t in tensors]).tolist())

        def value(v: Any) -> Any:
            return next(values) if isinstance(v, torch.Tensor) else v

        out = []
        for s in steps:
            norm, tokens = value(s.grad_norm), value(s.tokens)
            out.append(StepReading(s.step, s.epoch, s.lr, 0.0, None if norm is None else float(norm), int(tokens), s.extra))
        for reading in out:
            reading.loss = next(values) / self.loss_replicas
        return out


class StepClock:
    """When each step ended, and how long it took, without waiting for the device: events
    recorded on the device's stream where it has them (read back with the steps), the host's
    clock on a CPU (which computes as the host runs)."""

    def __init__(self, device: Any) -> None:
        import torch

        self._event = None
        if getattr(device, "type", "cpu") != "cpu":
            module = torch.get_device_module(device)
            if hasattr(module, "Event"):
                self._event = lambda: module.Event(enable_timing=True)
        self._origin = self._now()
        self._begin = self._origin
        #: (step, begin, end) of the steps not resolved yet
        self._marks: list[tuple[int, Any, Any]] = []

    def _now(self) -> Any:
        if self._event is None:
            return time.perf_counter()
        event = self._event()
        event.record()
        return event

    def _seconds(self, a: Any, b: Any) -> float:
        return b - a if self._event is None else a.elapsed_time(b) / 1000.0

    def mark(self, step: int) -> None:
        """Step ``step`` ends now."""
        end = self._now()
        self._marks.append((step, self._begin, end))
        self._begin = end

    def restart(self) -> None:
        """The next step begins now (what ran since the last step, an evaluation or a save, is
        not part of it)."""
        self._begin = self._now()

    def resolve(self) -> list[tuple[int, float, float]]:
        """``(step, seconds from the start to its end, its duration)`` of each step marked
        since the last call. Call after a read (the events have completed)."""
        marks, self._marks = self._marks, []
        if self._event is not None and marks:
            marks[-1][2].synchronize()
        return [(step, self._seconds(self._origin, end), self._seconds(begin, end)) for step, begin, end in marks]
