"""The memsave strategy's factory, and ``register`` (the plug-in's entry point)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchstash.declare import StrategyTable

from ._options import check_flags
from .functional.act import RELU_MASK, RELU_OP
from .rewriter import MemSaveRewriter

if TYPE_CHECKING:
    from torchstash.registry import Registry

STRATEGIES = StrategyTable()


@STRATEGIES.strategy("memsave", lossless=True, candidate=True)
def memsave(
    conv: bool = True,
    batchnorm: bool = True,
    layernorm: bool = True,
    groupnorm: bool = True,
    rmsnorm: bool = True,
    relu: bool = True,
    dropout: bool = True,
    maxpool: bool = True,
    avgpool: bool = True,
) -> MemSaveRewriter:
    """Layers that save only what this step's gradients need (exact).

    The ``memsave`` strategy; each flag turns one layer family off.
    """
    flags = check_flags(dict(locals()), "memsave")  # the parameters, by name: all flags
    return MemSaveRewriter(frozenset(f for f, on in flags.items() if on))


def register(registry: Registry) -> None:
    """Register the ``memsave`` strategy, and the default code of memsave's ReLU."""
    STRATEGIES.register(registry)
    registry.register_op_default(
        RELU_OP,
        lambda: RELU_MASK,
        summary="memsave's ReLU under the engine: a 1-bit mask of its output (exact)",
    )
