"""Public counter-based random numbers: Philox4x32-10 uniforms, identical on CPU and CUDA.

The stream is a pure function of (seed, offset, element index), so a draw can be
recomputed later (e.g. to regenerate a dropout mask in backward) instead of stored.
"""

from __future__ import annotations

import torch

from ._checks import as_int64, check_numel, check_u64
from ._dispatch import Impl, use_kernel
from .reference import philox_uniform_ref

__all__ = ["philox_uniform"]


def philox_uniform(
    numel: int,
    seed: int,
    offset: int = 0,
    *,
    device: torch.device | str = "cpu",
    impl: Impl = "auto",
) -> torch.Tensor:
    """``numel`` float32 uniforms in [0, 1) for ``seed`` and stream ``offset`` (both in [0, 2**64)).

    Element i comes from counter block i // 4, so a shorter draw is a prefix of a longer
    one; a different ``offset`` selects an independent stream (the counter's high words).
    """
    check_numel(numel, op="philox_uniform")
    check_u64(seed, "seed", op="philox_uniform")
    check_u64(offset, "offset", op="philox_uniform")
    dev = torch.device(device)
    if use_kernel(impl, dev):
        out = torch.empty(numel, dtype=torch.float32, device=dev)
        torch.ops.torchstash.philox_uniform(out, as_int64(seed), as_int64(offset))
        return out
    return philox_uniform_ref(numel, seed, offset, device=dev)
