"""Chooses between a compiled kernel and the reference for one call (``impl=``)."""

from __future__ import annotations

from typing import Literal

import torch

from . import loader

Impl = Literal["auto", "ref", "kernel"]
IMPLS = ("auto", "ref", "kernel")


def use_kernel(impl: str, device: torch.device | str) -> bool:
    """``ref``: never. ``auto``: when available (``require`` mode makes it strict).
    ``kernel``: always, raising KernelUnavailable with the reasons when it cannot.
    While dynamo traces, ``auto`` takes the reference (its ops compile; the loader's lock
    and build would break the graph)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not valid; allowed values are auto, ref, kernel")
    if impl == "ref":
        return False
    if impl == "auto" and torch.compiler.is_compiling():
        return False  # inside a compiled graph the reference's ops are fused by the compiler
    if impl == "auto" and loader.mode() != "require":
        return loader.available(device)
    loader.require(device)
    return True
