"""One call replayed in backward on a recomputed tensor (:mod:`.derive`'s recipes carry a
BatchNorm's output through its ReLU, an attention map through its scale, mask and softmax),
under the autocast the forward ran it in."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .opmark import AUTOCAST_DEVICES, AutocastState
from .optrack import autocast_state


def under_autocast(state: AutocastState, device: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast for ``device`` as it was in the forward, for an op replayed in backward (which
    runs without it): CUDA's autocast runs a softmax or a LayerNorm in float32 on a bf16
    input, and a replay without it returned bf16 where the backward expects float32."""
    dtype = dict(state).get(device)
    if device not in AUTOCAST_DEVICES or (
        torch.is_autocast_enabled(device) == (dtype is not None)
        and (dtype is None or torch.get_autocast_dtype(device) == dtype)
    ):
        return contextlib.nullcontext()
    if dtype is None:
        return torch.autocast(device, enabled=False)
    return torch.autocast(device, dtype=dtype, cache_enabled=False)


class Replay:
    """One call replayed on a recomputed tensor in place of its argument ``index``, with the
    call's other arguments as they were: numbers, and tensors held (detached) with their
    version, so an in-place change to a mask after the forward is an error, not a different
    attention map. In-place functions are replayed out of place: the recomputed tensor may be
    another entry's restored value."""

    __slots__ = (
        "args",
        "autocast",
        "checked",
        "constants",
        "func",
        "held",
        "in_place",
        "index",
        "kwargs",
    )

    def __init__(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        index: int,
    ) -> None:
        self.func = _out_of_place(func)
        self.index = index
        #: the in-place form the forward ran, for a recomputed tensor no one else holds (an
        #: in-place function changes its first argument: only there)
        self.in_place: Callable[..., Any] | None = None
        #: whether the in-place form gives the forward's own result only where the result
        #: keeps the recomputed tensor's shape and dtype (checked per run)
        self.checked = False
        if index == 0:
            if self.func is not func:
                self.in_place = func
            elif func is F.relu and (kwargs.get("inplace") or tuple(args[1:2]) == (True,)):
                self.in_place = torch.relu_
            else:
                self.in_place = _IN_PLACE.get(func)
                self.checked = self.in_place is not None
        if func is F.relu:
            args = args[:1]  # F.relu(x, True): its ``inplace`` flag
        others = [(i, a) for i, a in enumerate(args) if i != index and isinstance(a, torch.Tensor)]
        #: held alive by the recipe only (masks, scales), not Parameters the model holds
        self.constants = [a.detach() for _, a in others if not a.requires_grad]
        self.args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        self.args[index] = None  # the recomputed tensor goes here: the original is not held
        self.kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
        self.held = [(self.args[i], self.args[i]._version) for i, _ in others]
        self.autocast = autocast_state()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.run(t, False)[0]

    def run(self, t: torch.Tensor, owned: bool) -> tuple[torch.Tensor, bool]:
        """The call on ``t``, in place when ``owned`` (no one else holds ``t``) and the
        forward's call was; with whether the result is still owned (it is ``t``)."""
        for held, version in self.held:
            if held._version != version:
                raise RuntimeError(
                    f"torchstash recomputes a saved tensor in backward by replaying "
                    f"{getattr(self.func, '__name__', self.func)!r} with a "
                    f"{tuple(held.shape)} {held.dtype} tensor that was modified by an inplace "
                    f"operation after the forward (version {held._version}, expected "
                    f"{version}). Leave that tensor unchanged until backward, or clone it "
                    "before the forward uses it."
                )
        args = list(self.args)
        args[self.index] = t
        in_place = owned and self.in_place is not None
        if in_place and self.checked:
            in_place = _keeps_layout(t, args[1:], self.kwargs)
        func = self.in_place if in_place else self.func
        assert func is not None
        with under_autocast(self.autocast, t.device.type):
            return func(*args, **self.kwargs), in_place


def _in_place_forms() -> dict[Any, Callable[..., Any]]:
    """Out-of-place pointwise calls whose in-place form computes the same values into the
    first argument: a recomputed attention map scaled (``att * s``) and masked
    (``masked_fill``) in place where the forward made two new maps (on the zoo's GPT the
    out-of-place mask took half as long again as stock's). Only where the result keeps the
    argument's shape and dtype (:func:`_keeps_layout`)."""
    T = torch.Tensor
    pairs = [
        (T.__mul__, T.mul_),
        (T.__rmul__, T.mul_),
        (T.mul, T.mul_),
        (torch.mul, T.mul_),
        (T.__truediv__, T.div_),
        (T.div, T.div_),
        (torch.div, T.div_),
        (T.__add__, T.add_),
        (T.__radd__, T.add_),
        (T.add, T.add_),
        (torch.add, T.add_),
        (T.__sub__, T.sub_),
        (T.sub, T.sub_),
        (torch.sub, T.sub_),
        (T.masked_fill, T.masked_fill_),
        (torch.masked_fill, T.masked_fill_),
        (T.relu, torch.relu_),
        (torch.relu, torch.relu_),
    ]
    return dict(pairs)


_IN_PLACE = _in_place_forms()


def _keeps_layout(t: torch.Tensor, others: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """The call's result has ``t``'s shape and dtype (no other argument broadcasts it wider
    or promotes it), so writing it into ``t`` gives the same values."""
    for a in (*others, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.dtype != torch.bool and torch.result_type(t, a) != t.dtype:
                return False
            if a.dim() > t.dim() or torch.broadcast_shapes(t.shape, a.shape) != t.shape:
                return False
        elif isinstance(a, (bool, int, float, complex)):
            if torch.result_type(t, a) != t.dtype:
                return False
        elif a is not None and not isinstance(a, str):
            return False
    return True


def _out_of_place(func: Callable[..., Any]) -> Callable[..., Any]:
    """``relu_`` -> ``relu``, ``Tensor.__iadd__`` -> ``Tensor.__add__``; else ``func``."""
    name = getattr(func, "__name__", "")
    if name.startswith("__i") and name.endswith("__"):
        return getattr(torch.Tensor, f"__{name[3:]}", func)
    if name.endswith("_") and not name.endswith("__"):
        for owner in (torch.Tensor, torch):
            if getattr(owner, name, None) is func:
                return getattr(owner, name[:-1], func)
    return func


def replay_step(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], index: int = 0
) -> Replay | None:
    """``func`` replayed with a recomputed tensor as argument ``index``, or None when another
    argument's values cannot be held as they were: a tensor in the keywords, or one that is
    itself computed with a gradient (an activation, which the recipe would keep alive whole).
    Numbers, tensors without a gradient (masks, a 0-d scale) and leaf tensors (Parameters)
    are held."""
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    for i, a in enumerate(args):
        if i != index and isinstance(a, torch.Tensor) and a.requires_grad and not a.is_leaf:
            return None
    return Replay(func, args, kwargs, index)
