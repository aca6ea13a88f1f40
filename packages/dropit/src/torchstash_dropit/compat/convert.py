"""``to_dropit``: DropIT's one-call conversion, as a drop-in for its users.

DropIT's ``to_dropit(model, strategy, gamma, autocast)`` swapped the forward of each module
whose type is exactly ``nn.Linear``, ``nn.Conv2d`` or Hugging Face's GPT-2 ``Conv1D``, unless
the module has a ``no_dropit`` attribute (whatever its value; its children are still
converted), and ranked each saved input over the whole tensor, keeping
``int(numel * (1 - gamma))`` entries of every tensor, however small. This does the same
through the core's engine (``torchstash.remove(model)`` undoes it) with the same selection,
so the weight gradients are DropIT's; where no sparse form is smaller than the tensor (small
gammas), DropIT's drop is kept and the rest stored dense, as DropIT did (it then cost more
than stock). ``torchstash.apply(model, "dropit.mink")`` is torchstash's own, with other
defaults (see the README).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from torchstash.errors import OptionError

#: DropIT's strategy -> (torchstash strategy, its options)
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mink": ("dropit.mink", {}),
    "mink_cpuidx": ("dropit.mink", {"indices": "cpu"}),
    "vrandom": ("dropit.random", {}),
}
#: DropIT's selection and storage rules, as options of both strategies
UPSTREAM = {"scope": "tensor", "min_numel": 1, "keep": "floor", "dense": "drop"}


def supported_types() -> tuple[type[nn.Module], ...]:
    """The module types DropIT converts: exactly these, not their subclasses. GPT-2's
    ``Conv1D`` only where transformers is already loaded (a model holding one has loaded it;
    importing transformers for a model that has none would cost seconds)."""
    types: list[type[nn.Module]] = [nn.Linear, nn.Conv2d]
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    if isinstance(conv1d, type):
        types.append(conv1d)
    return tuple(types)


def dropit_rules(model: nn.Module, strategy: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """One rule per module DropIT would convert (by exact type, not marked ``no_dropit``)."""
    types = supported_types()
    return [
        {"module": name, "strategy": strategy, "options": options}
        for name, module in model.named_modules()
        if type(module) in types and not hasattr(module, "no_dropit")
    ]


def to_dropit(
    model: nn.Module,
    strategy: str = "mink",
    gamma: float = 0.9,
    autocast: bool = False,
    **options: Any,
) -> nn.Module:
    """DropIT's call: drop the ``gamma`` share of smallest magnitudes (``"mink"``; its
    ``"mink_cpuidx"`` keeps the positions in host memory; ``"vrandom"`` a random share) of
    each converted layer's input for its weight gradient. Returns ``model``, changed in place.

    ``autocast`` is accepted for DropIT's signature and changes nothing: under autocast the
    saved input is already float16 or bfloat16 and is thinned as such. Other keyword options
    go to the strategy (``scope=``, ``min_numel=``, ``storage=``...), over DropIT's."""
    from torchstash import apply

    if strategy not in STRATEGIES:
        raise OptionError(
            f"to_dropit: strategy={strategy!r} is not one of DropIT's: {', '.join(STRATEGIES)}"
        )
    if not isinstance(autocast, bool):
        raise OptionError(f"to_dropit: autocast={autocast!r} must be True or False")
    name, extra = STRATEGIES[strategy]
    rate = {"gamma": gamma} if name == "dropit.mink" else {"p": gamma}
    rules = dropit_rules(model, name, {**UPSTREAM, **extra, **rate, **options})
    if not rules:  # DropIT converted nothing and said nothing: the same, without a handle
        return model
    apply(model, policy=rules, min_bytes=0)  # DropIT dropped every tensor, however small
    return model
