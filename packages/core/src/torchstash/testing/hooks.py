"""What :func:`torchstash.apply` puts on a model's modules, counted, for tests that check
``remove`` takes all of it off: forward hooks, forward pre-hooks and call entries (a
``_call_impl`` or ``__call__`` on the instance, :mod:`torchstash.modulecalls`, with their
replicas' rebinding)."""

from __future__ import annotations

from torch import nn

#: what torchstash may set on a module's instance (:mod:`torchstash.modulecalls`,
#: :mod:`torchstash.compiling`, :mod:`torchstash.replicas`)
_ON_INSTANCE = ("_call_impl", "__call__", "_replicate_for_data_parallel")


def hook_counts(model: nn.Module) -> list[tuple[int, int, int]]:
    """Per module of ``model``: its forward pre-hooks, forward hooks and instance entries."""
    return [
        (
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            sum(name in m.__dict__ for name in _ON_INSTANCE),
        )
        for m in model.modules()
    ]


def hook_total(model: nn.Module) -> int:
    """Everything :func:`hook_counts` counts, summed."""
    return sum(sum(row) for row in hook_counts(model))
