"""One convergence run's record (``scripts/convergence.py``): its losses, its gradient
cosines against stock, its bytes and time, and the target its final validation loss is held
to."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torchstash
from torchstash.policy import parse_spec

#: Largest validation loss above stock's, in percent, that a strategy may end at. A strategy
#: without an entry is reported only (dropit.*, quant.int1), except a lossless one, which
#: must stay within :data:`LOSSLESS_PCT` either way (it should be bit-exact).
TARGETS: dict[str, float] = {
    "quant": 1.0,  # bits=8 by default
    "quant.int8": 1.0,
    "quant.mesa": 1.0,
    "quant.int4": 2.0,
    "quant.fp8": 2.0,
    "quant.L1": 2.0,
    "quant.L2": 2.0,
    "quant.int2": 3.0,
    "quant.auto": 3.0,
    "quant.L3": 3.0,
    "quant.L4": 3.0,
    "quant.L5": 3.0,
}
LOSSLESS_PCT = 0.1


@dataclass
class Run:
    model: str
    strategy: str
    lossless: bool | None = None
    target_pct: float | None = None
    losses: list[float] = field(default_factory=list)
    curve_every: int = 10
    val_loss: float | None = None
    val_acc: float | None = None
    rel_pct: float | None = None
    met: bool | None = None
    worst_cos: float | None = None
    worst_cos_param: str | None = None
    whole_cos: float | None = None  # of the whole gradient
    cos_skipped: list[str] = field(default_factory=list)  # stock gradient zero up to rounding
    #: the same at stock's trained weights (its last step's), on a held-out batch
    trained_worst_cos: float | None = None
    trained_worst_param: str | None = None
    trained_whole_cos: float | None = None
    raw_bytes: int | None = None  # what stock saves in one step
    stored_bytes: int | None = None  # what this run kept for the same step
    host_bytes: int | None = None
    step_ms: float | None = None
    wall_s: float = 0.0
    error: str | None = None

    @property
    def curve(self) -> list[float]:
        k = self.curve_every
        return [statistics.fmean(self.losses[i : i + k]) for i in range(0, len(self.losses), k)]

    @property
    def rise(self) -> float | None:
        """The most the ``curve_every``-step mean train loss climbed above its lowest value so
        far: how far the loss went back up during training."""
        curve = self.curve
        if len(curve) < 2:
            return None
        low, worst = curve[0], 0.0
        for v in curve[1:]:
            worst = max(worst, v - low)
            low = min(low, v)
        return worst

    @property
    def ratio(self) -> float | None:
        if self.raw_bytes is None or self.stored_bytes is None:
            return None
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else math.inf

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["losses"]
        d.update(curve=self.curve, rise=self.rise, ratio=self.ratio)
        return d


def strategy_info() -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in torchstash.strategies()}


def target_of(spec: str, lossless: bool | None) -> float | None:
    """The largest allowed increase of the validation loss over stock's, in percent."""
    name, options = parse_spec(spec)
    if lossless:
        return LOSSLESS_PCT
    if spec in TARGETS:
        return TARGETS[spec]
    return None if options else TARGETS.get(name)


def met_target(run: Run) -> bool | None:
    """None where the run has no target; a failed run misses its target."""
    if run.target_pct is None:
        return None
    if run.rel_pct is None:
        return False
    if run.lossless:
        return abs(run.rel_pct) <= run.target_pct
    return run.rel_pct <= run.target_pct
