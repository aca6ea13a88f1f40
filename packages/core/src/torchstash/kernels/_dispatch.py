"""Chooses between a compiled kernel and the reference for one call (``impl=``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import torch

from . import loader

Impl = Literal["auto", "ref", "kernel"]
T = TypeVar("T")
IMPLS = ("auto", "ref", "kernel")

#: ``auto``'s answer per device, with the build outcome it was read from: every code calls
#: here once or twice per saved tensor, and asking the loader again cost several
#: microseconds a call (more inside a training step, with the caches cold).
_answers: dict[tuple[str, object], tuple[object, bool]] = {}


_HOOKS = threading.local()


@contextmanager
def kernels_in_graph() -> Iterator[None]:
    """``auto`` takes the kernels while a compiled graph's saved-tensor hooks are traced
    (:mod:`torchstash.graphhooks`): AOTAutograd traces them in plain Python, where loading
    the kernels breaks nothing, and their ops are many times faster than the reference's
    compiled code on a CPU (0.16 against 3.4 ms for 256K values at 4 bits)."""
    before = getattr(_HOOKS, "on", False)
    _HOOKS.on = True
    try:
        yield
    finally:
        _HOOKS.on = before


def use_kernel(impl: str, device: torch.device | str) -> bool:
    """``ref``: never. ``auto``: when available (``require`` mode makes it strict).
    ``kernel``: always, raising KernelUnavailable with the reasons when it cannot.
    While dynamo traces, ``auto`` takes the reference (its ops compile; the loader's lock
    and build would break the graph)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not valid; allowed values are auto, ref, kernel")
    if impl == "ref":
        return False
    if impl == "auto" and torch.compiler.is_compiling() and not getattr(_HOOKS, "on", False):
        return False  # inside a compiled graph the reference's ops are fused by the compiler
    mode = loader.mode()
    if impl == "auto" and mode != "require":
        return _available(mode, device)
    loader.require(device)
    return True


def _available(mode: str, device: torch.device | str) -> bool:
    """``loader.available(device)`` in ``mode``, remembered while the loader keeps the same
    outcome (a reset or a rebuild makes a new one)."""
    outcome = loader._outcome
    hit = _answers.get((mode, device))
    if hit is not None and outcome is not None and hit[0] is outcome:
        return hit[1]
    answer = loader.available(device)
    _answers[(mode, device)] = (loader._outcome, answer)
    return answer


def dispatch(
    op: str, impl: str, device: torch.device, reference: Callable[..., T], *args: Any
) -> T:
    """``torch.ops.torchstash.<op>(*args)`` where :func:`use_kernel` says so, else
    ``reference(*args)``: an op whose kernel and golden model take the same arguments."""
    if use_kernel(impl, device):
        out: T = getattr(torch.ops.torchstash, op)(*args)
        return out
    return reference(*args)
