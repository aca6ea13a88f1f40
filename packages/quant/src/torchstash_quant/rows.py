"""Groups that never straddle two normalization statistics.

A normalization op's backward divides by each row's standard deviation again, so a group
shared by a wide row and a narrow one (a ViT's class token next to a patch token) gives the
narrow row a coarse step that the backward then multiplies up: at 2 bits the ViT's gradient
cosine fell to 0.12. Groups that lie inside one normalized stretch of memory keep every
row's error relative to its own scale.
"""

from __future__ import annotations

import math

import torch

from torchstash.site import Site

#: Normalized over the last dimension(s): a row is the innermost dimension.
ROW_NORM_OPS = frozenset({"layer_norm", "rms_norm"})
#: Normalized per channel (and sample): a contiguous (H, W, ...) plane holds one channel.
PLANE_NORM_OPS = frozenset({"batch_norm", "group_norm", "instance_norm"})
#: Shorter rows would cost more in per-group scales than they save.
MIN_ROW = 32


def static_size(n: int | torch.SymInt | None) -> int | None:
    """``n`` as an int, or None where it is a size of a graph traced with dynamic shapes: a
    group size is the graph's, the same at every size, so it is never derived from one."""
    if isinstance(n, torch.SymInt):
        return int(n) if n.node.expr.is_number else None
    return n


def normalized_run(x: torch.Tensor, site: Site) -> int | None:
    """Elements in a row of ``x`` (in memory) that share one normalization statistic."""
    if x.dim() == 0 or x.numel() == 0:
        return None
    if site.op in ROW_NORM_OPS and x.stride(-1) == 1:
        return x.shape[-1]
    if site.op in PLANE_NORM_OPS and x.dim() >= 3 and x.is_contiguous():
        return math.prod(x.shape[2:])
    return None


def channel_major_run(x: torch.Tensor, site: Site) -> int | None:
    """Elements of one BatchNorm channel (all samples) once ``x`` is stored channel-major,
    ``(C, N, ...)``: on small maps (a ResNet's last stage, 2x2) a plane is too short for a
    group, but a channel over the batch is not, and BatchNorm normalizes exactly over it."""
    if site.op != "batch_norm" or x.dim() < 2 or not x.is_contiguous() or x.numel() == 0:
        return None
    return x.numel() // x.shape[1]


def aligned_group_size(run: int | None, group_size: int) -> int | None:
    """A group size close to ``group_size`` whose groups each fall inside one run of ``run``
    elements, or None when no such size is worth its scales."""
    if run is None:
        return None
    if run % group_size == 0:
        return group_size
    if run < group_size:
        return run if run >= MIN_ROW else None
    for g in range(group_size, max(MIN_ROW, group_size // 4) - 1, -1):
        if run % g == 0:
            return g
    return None
