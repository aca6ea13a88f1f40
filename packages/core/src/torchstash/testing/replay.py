"""Helpers for tests of the engine's replay (:mod:`torchstash.engine.replay`), shared by the
core's and the plug-ins' suites: two copies of a model, one held to the full path; what a step
ran through the op tracker; and a tally's rows as plain values to compare a replayed step with
a recorded one."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ..api import Handle, apply
from ..engine.tally import Tally
from ..optrack import OpTracker


def twins(
    strategy: str, build: Callable[[], nn.Module], **options: Any
) -> tuple[nn.Module, nn.Module, Handle, Handle]:
    """Two copies of one model under ``strategy`` (with ``options``), built and applied
    under the same seeds (a code's stochastic rounding draws alike): the first never replays
    (the full path on every step), the second does."""
    torch.manual_seed(0)
    full = build()
    ours = copy.deepcopy(full)
    torch.manual_seed(1)
    a = apply(full, strategy, **options)
    torch.manual_seed(1)
    b = apply(ours, strategy, **options)
    a.engine.replayer.enabled = False
    return full, ours, a, b


class Tracked:
    """Counts the torch calls the op tracker sees (a replayed forward makes none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = OpTracker.__torch_function__

        def counting(mode, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            return original(mode, func, types, args, kwargs)

        monkeypatch.setattr(OpTracker, "__torch_function__", counting)

    def during(self, step: Callable[[], object]) -> int:
        """The calls ``step()`` sent through the tracker."""
        before = self.calls
        step()
        return self.calls - before


def tally_rows(tally: Tally) -> dict[str, tuple[Any, ...]]:
    """Every row's counts, bytes, reasons and ops, by module."""
    return {
        k: (
            r.saved,
            r.shared,
            r.raw_bytes,
            r.stored_bytes,
            r.held_bytes,
            r.compressed,
            r.derived,
            dict(r.declined),
            dict(r.ops),
        )
        for k, r in tally.rows.items()
    }
