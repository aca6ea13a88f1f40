"""Trainer callbacks: ``torchstash.integrations.lightning`` (Lightning) and
``torchstash.integrations.hf`` (the Hugging Face ``Trainer``).

This package imports neither library; each module imports its own and, where it is missing,
says which extra installs it. What they share is here: :class:`Meter` applies torchstash to a
model for one run and turns the handle's tally into per-step metrics.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..api import Handle, PolicyLike, _as_plan, apply

MB = 1 << 20
PREFIX = "torchstash/"

__all__ = ["MB", "PREFIX", "Meter", "missing"]


def missing(module: str, library: str, extra: str) -> ImportError:
    """The error an integration raises when its library is not installed."""
    return ImportError(
        f"torchstash.integrations.{module} needs {library}, which is not installed: "
        f'pip install "torchstash[{extra}]"'
    )


class Meter:
    """One trainer run: ``start`` applies, ``step`` counts steps, ``read`` gives the metrics of
    the steps since the last read (and resets the tally), ``stop`` removes.

    The options are checked when the meter is made, so a misspelt strategy fails before
    training starts rather than at its first step.
    """

    def __init__(
        self, strategy: str | None, policy: PolicyLike | None, options: dict[str, Any]
    ) -> None:
        _as_plan(strategy, policy, dict(options))  # raises ApplyError on a bad name or option
        self.strategy = strategy
        self.policy = policy
        self.options = dict(options)
        self.handle: Handle | None = None
        self.steps = 0

    def start(self, model: nn.Module) -> Handle:
        """Apply to ``model``; a handle left by a run that raised is removed first."""
        self.stop()
        self.handle = apply(model, self.strategy, policy=self.policy, **self.options)
        self.steps = 0
        return self.handle

    def step(self) -> None:
        if self.handle is not None:
            self.steps += 1

    def read(self) -> dict[str, float]:
        """Per training step since the last read, in MiB: what autograd saved (``raw_mb``), what
        was held (``stored_mb``), the difference (``saved_mb``), and ``ratio`` = stored / raw.

        Raw is what autograd asked to keep under the strategy: a rewriting strategy (memsave)
        already asks for less than stock, which shows in ``raw_mb``, not in ``ratio``.
        """
        if self.handle is None or self.steps == 0:
            return {}
        tally, n = self.handle.tally, self.steps
        raw, stored = tally.raw_bytes, tally.stored_bytes
        tally.reset()
        self.steps = 0
        return {
            f"{PREFIX}raw_mb": raw / n / MB,
            f"{PREFIX}stored_mb": stored / n / MB,
            f"{PREFIX}saved_mb": (raw - stored) / n / MB,
            f"{PREFIX}ratio": stored / raw if raw else 1.0,
        }

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.steps = 0
