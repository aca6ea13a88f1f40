"""``convert_to_memory_saving``: memsave_torch's one call, as a drop-in for its users.

memsave_torch deep-copied the model and returned the copy, so the parameters it did not
replace were copies (an optimizer built on the original missed them). This converts the model
in place through ``torchstash.apply(model, "memsave", ...)`` and returns it: no parameter is
copied, and ``torchstash.remove(model)`` undoes it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchstash.errors import OptionError

from .._options import check_flag


def convert_to_memory_saving(
    model: nn.Module,
    *,
    linear: bool = True,
    conv2d: bool = True,
    conv1d: bool = True,
    conv3d: bool = True,
    batchnorm2d: bool = True,
    relu: bool = True,
    maxpool2d: bool = True,
    dropout: bool = True,
    layernorm: bool = True,
    verbose: bool = False,
    clone_params: bool = False,
) -> nn.Module:
    """memsave_torch's flags: each turns a layer family off (the conv flags go together here,
    as one family with the transposed convs; ``linear`` is accepted and does nothing, since
    stock PyTorch already saves only what a linear layer's gradients need). ``verbose``
    prints what was rewritten and what was left alone. ``clone_params=True`` is refused:
    the layers always share the model's Parameters."""
    from torchstash import apply

    if clone_params:
        raise OptionError(
            "convert_to_memory_saving: clone_params=True is not supported; the memory-saving "
            "layers share the model's Parameters (nothing is copied)"
        )
    flags = {
        "conv2d": conv2d,
        "conv1d": conv1d,
        "conv3d": conv3d,
        "batchnorm2d": batchnorm2d,
        "relu": relu,
        "maxpool2d": maxpool2d,
        "dropout": dropout,
        "layernorm": layernorm,
        "linear": linear,
        "verbose": verbose,
    }
    for flag, value in flags.items():
        check_flag(value, flag, "convert_to_memory_saving")
    convs = {conv1d, conv2d, conv3d}
    if len(convs) > 1:
        raise OptionError(
            "convert_to_memory_saving: conv1d, conv2d and conv3d must agree here (one family; "
            "use a torchstash policy to choose layers one by one)"
        )
    options: dict[str, Any] = {
        "conv": conv2d,
        "batchnorm": batchnorm2d,
        "relu": relu,
        "maxpool": maxpool2d,
        "dropout": dropout,
        "layernorm": layernorm,
    }
    handle = apply(model, "memsave", **options)
    if verbose:
        for rw in handle.rewrites:
            print(f"memsave: {rw.qualname or '(model)'}: {type(rw.replacement).__name__}")
    return model
