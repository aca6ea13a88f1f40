"""CUDA's autocast policy on the CPU, for tests on a machine without a GPU.

CUDA's autocast runs a softmax, a log-softmax and a LayerNorm in float32 on a bf16 input;
the CPU's runs them in bf16. Code that replays an op in backward, where autocast is off,
must reproduce the forward's dtypes, and the CPU's policy never shows whether it does (a
hand-written attention under CUDA autocast failed in backward, fine on the CPU). Inside
:func:`cuda_autocast_policy_on_cpu`, CPU autocast runs those ops in float32 as CUDA's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_CPU_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _float(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch._C._ExcludeDispatchKeyGuard(_CPU_AUTOCAST):
        return torch.ops.aten.softmax.int(_float(x), dim, dtype)


def _log_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch._C._ExcludeDispatchKeyGuard(_CPU_AUTOCAST):
        return torch.ops.aten.log_softmax.int(_float(x), dim, dtype)


def _layer_norm(
    x: torch.Tensor,
    shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> torch.Tensor:
    with torch._C._ExcludeDispatchKeyGuard(_CPU_AUTOCAST):
        return torch.ops.aten.layer_norm(
            _float(x), shape, _float(weight), _float(bias), eps, cudnn_enable
        )


@contextlib.contextmanager
def cuda_autocast_policy_on_cpu() -> Iterator[None]:
    """Inside the block, ``torch.autocast("cpu", ...)`` runs softmax, log_softmax and
    layer_norm in float32, as CUDA's autocast does (the registration is undone on exit)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("softmax.int", _softmax, "AutocastCPU")
        lib.impl("log_softmax.int", _log_softmax, "AutocastCPU")
        lib.impl("layer_norm", _layer_norm, "AutocastCPU")
        yield
    finally:
        lib._destroy()
