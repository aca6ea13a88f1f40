"""Running memsave's ops under torchstash's op tracker the way a stock op runs under it.

The engine names each save from a ``TorchFunctionMode`` (:class:`torchstash.optrack.OpTracker`).
A stock op passes through it once and runs its body, saves included, with the mode popped. A
Function's ``apply`` is no torch function: its forward and the engine's pack hooks would run
under the mode, and each tensor method they call (``numel``, ``data_ptr``, ``stride``...) would
go through the mode's Python handler, which does nothing there (grad mode is off in a forward
and in those pack hooks) but costs about a microsecond: some 90 calls per conv-BN-ReLU block.
:func:`torchstash.untracked` pops the tracker for such a call; the layer names its op with
``as_op``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchstash.opmark import untracked

__all__ = ["apply", "untracked"]


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, with the op tracker off the mode stack where it is on top."""
    with untracked():
        return function.apply(*args)
