"""Which saved tensors DropIT may thin: the inputs linear-type ops keep for the weight gradient.

A linear layer's backward reads its saved input only for the weight's gradient (the input's
gradient needs the weight), so dropping small entries there leaves the input gradient, and
every layer below, exact. The site names the op: ``linear`` covers ``nn.Linear`` and its
subclasses, ``F.linear`` anywhere (``nn.MultiheadAttention``'s projections) and ``addmm``
(Hugging Face GPT-2's ``Conv1D``); ``conv`` covers ``Conv1d/2d/3d`` and transposed
convolutions. The tensor must not be the op's weight (a Parameter never reaches a compressor).
"""

from __future__ import annotations

import torch

from torchstash.site import Site

#: Canonical op names whose saved activation is read only for the weight gradient.
LINEAR_TYPE_OPS = frozenset({"linear", "conv"})


def _operand_index(site: Site) -> tuple[int, int]:
    """Positions of the (input, weight) arguments of the linear-type op at ``site``."""
    return (1, 2) if site.func == "addmm" else (0, 1)


def weight_of_op(site: Site) -> torch.Tensor | None:
    """The weight operand of the linear-type op at ``site`` (``addmm``'s is its third)."""
    weight = site.opcall.argument("weight", _operand_index(site)[1])
    return weight if isinstance(weight, torch.Tensor) else None


def _role(index: int) -> str:
    return "input" if index == 0 else f"arg{index}"


def why_not_linear_input(x: torch.Tensor, site: Site) -> str | None:
    """None when ``x`` is what a linear-type op saved for its weight gradient; else why not."""
    if site.op not in LINEAR_TYPE_OPS:
        what = site.op or "no op"
        return f"saved by {what}, not by a linear or conv (only their inputs may drop values)"
    if not site.opcall.args:  # a site built by hand (a unit test's): trust its role
        return None
    inputs, weights = _operand_index(site)
    weight = weight_of_op(site)
    if weight is None or not weight.requires_grad:
        return f"this {site.op} has no trainable weight, so its input is not for a weight gradient"
    if site.role == _role(inputs):
        return None
    if site.role == _role(weights):
        return f"the {site.op}'s weight, not its input"
    # A copy the op made (autocast's cast): the input's, unless it is shaped like the weight.
    shapes = {tuple(weight.shape), tuple(weight.shape[::-1])}
    if tuple(x.shape) in shapes or weight.numel() == x.numel():
        return (
            f"a copy made inside this {site.op} that cannot be told from its weight's "
            f"(shape {tuple(x.shape)}): stored as is"
        )
    return None


def batch_of_op(x: torch.Tensor, site: Site) -> int:
    """The first dimension of the op's input before it was flattened (``F.linear`` on a
    (B, N, C) tensor saves a (B*N, C) view): the sample count, where it divides ``x``."""
    args, index = site.opcall.args, _operand_index(site)[0]
    first = args[index] if len(args) > index else None
    if isinstance(first, torch.Tensor) and first.dim() >= 1 and first.numel() == x.numel():
        b = int(first.shape[0])
        if b > 0 and x.numel() % b == 0:
            return b
    return int(x.shape[0]) if x.dim() >= 1 else 1
