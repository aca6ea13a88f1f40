"""``convert_to_memory_saving``: memsave_torch's one call, as a drop-in for its users.

Like memsave_torch, it returns a converted copy and leaves ``model`` as it was. Without
``clone_params`` the copy shares every Parameter and buffer with ``model`` (memsave_torch
shared only the converted layers', so an optimizer built on ``model`` missed the others);
with ``clone_params=True`` it is a deep copy, independent of ``model``. The layers are
converted through ``torchstash.apply(copy, "memsave", ...)``: ``torchstash.remove(copy)``
gives the stock layers back.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torch import nn

from torchstash.errors import ApplyError, NothingToRewriteWarning

from .._options import check_flags

#: (flag, the stock classes it covers) where a flag picks classes out of a family
CONV_FLAGS = (
    ("conv1d", (nn.Conv1d, nn.ConvTranspose1d)),
    ("conv2d", (nn.Conv2d, nn.ConvTranspose2d)),
    ("conv3d", (nn.Conv3d, nn.ConvTranspose3d)),
)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that holds ``model``'s own Parameters and buffers."""
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    return copy.deepcopy(model, memo)


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
    layernorm: bool = True,
    dropout: bool = True,
    verbose: bool = False,
    clone_params: bool = False,
) -> nn.Module:
    """memsave_torch's flags, each turning a layer family off (``conv1d``, ``conv2d`` and
    ``conv3d`` the convs and transposed convs of that dimension). ``linear`` is accepted and
    changes nothing: stock PyTorch already keeps only what a linear layer's gradients need.
    ``verbose`` prints each replaced layer as memsave_torch did (``replaced <name>``)."""
    flags = {name: value for name, value in locals().items() if name != "model"}  # the flags
    from torchstash import apply, handle_of

    applied = next((name for name, m in model.named_modules() if handle_of(m) is not None), None)
    if applied is not None:
        raise ApplyError(
            f"convert_to_memory_saving: torchstash is applied to "
            f"{'the model' if not applied else repr(applied)}, and a copy would carry its hooks; "
            "call torchstash.remove() on it first, or apply 'memsave' (or 'memsave>quant.int8') "
            "with torchstash instead"
        )
    check_flags(flags, "convert_to_memory_saving")
    converted = copy.deepcopy(model) if clone_params else shared_copy(model)
    options: dict[str, Any] = {
        "conv": conv1d or conv2d or conv3d,
        "batchnorm": batchnorm2d,
        "relu": relu,
        "maxpool": maxpool2d,
        "dropout": dropout,
        "layernorm": layernorm,
    }
    classes = tuple(cls for flag, group in CONV_FLAGS if not flags[flag] for cls in group)
    off = [  # a conv dimension turned off: those layers stay stock
        {"module": name or "*", "strategy": "none"}
        for name, module in converted.named_modules()
        if classes and isinstance(module, classes)
    ]
    with warnings.catch_warnings():
        # memsave_torch returned a model with nothing to convert as it was, silently
        warnings.simplefilter("ignore", NothingToRewriteWarning)
        handle = apply(converted, policy=[{"strategy": "memsave", "options": options}, *off])
    if verbose:
        for rw in handle.rewrites:
            print(f"replaced {rw.qualname}")
    return converted


def recursive_setattr(obj: nn.Module, attr: str, value: Any, clone_params: bool) -> None:
    """Set the submodule ``attr`` (a dotted name) of ``obj`` to ``value``; with
    ``clone_params``, ``value``'s own Parameters are replaced by detached copies first."""
    if clone_params and isinstance(value, nn.Module):
        for name, param in list(value._parameters.items()):
            if param is not None:
                value._parameters[name] = nn.Parameter(
                    param.detach().clone(), requires_grad=param.requires_grad
                )
    head, _, rest = attr.partition(".")
    if rest:
        recursive_setattr(getattr(obj, head), rest, value, False)
    else:
        setattr(obj, head, value)
