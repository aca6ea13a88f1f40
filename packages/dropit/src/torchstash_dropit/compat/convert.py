"""``to_dropit``: DropIT's one-call conversion, as a drop-in for its users.

DropIT's ``to_dropit(model, strategy, gamma, autocast)`` patched the forward of layers whose
type was exactly ``nn.Linear``, ``nn.Conv2d`` or GPT-2's ``Conv1D``, and crashed without
``autocast``. This one applies the ``dropit.<strategy>`` strategy through the core's engine,
so every linear-type op is reached (subclasses, ``F.linear``, ``nn.MultiheadAttention``),
autocast's dtype is whatever the saved tensor has, and a module with a true ``no_dropit``
attribute (and everything inside it) is left exact, as DropIT's opt-out did.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchstash.errors import OptionError

STRATEGIES = ("mink", "random")


def no_dropit_rules(model: nn.Module) -> list[dict[str, Any]]:
    """Policy rules that leave the modules marked ``no_dropit`` (and their children) exact."""
    rules: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        if getattr(module, "no_dropit", False):
            if not name:
                raise OptionError(
                    "to_dropit: the model itself is marked no_dropit, so nothing would be "
                    "dropped; remove the attribute or don't convert it"
                )
            rules.append({"module": name, "strategy": "none"})
            rules.append({"module": f"{name}.*", "strategy": "none"})
    return rules


def to_dropit(
    model: nn.Module,
    strategy: str = "mink",
    gamma: float = 0.9,
    autocast: bool | None = None,
    **options: Any,
) -> nn.Module:
    """Make ``model`` keep only the largest ``1 - gamma`` share of each linear-type input for
    its weight gradient (``strategy='random'``: a random share, rescaled). Returns ``model``
    (changed in place; ``torchstash.remove(model)`` undoes it).

    ``autocast`` is accepted for DropIT's signature and ignored: the saved tensor's dtype
    (float16 or bfloat16 under autocast, else the model's) is used as it is. Other keyword
    options go to the strategy (``scope=``, ``storage=``, ``exact=``, ``min_numel=``).
    """
    from torchstash import apply

    if strategy not in STRATEGIES:
        raise OptionError(
            f"to_dropit: strategy={strategy!r} is not known; use one of {', '.join(STRATEGIES)}"
        )
    if autocast is not None and not isinstance(autocast, bool):
        raise OptionError(f"to_dropit: autocast={autocast!r} must be True, False or None")
    rate = {"gamma": gamma} if strategy == "mink" else {"p": gamma}
    rules: list[dict[str, Any]] = [
        {"strategy": f"dropit.{strategy}", "options": {**rate, **options}}
    ]
    apply(model, policy=rules + no_dropit_rules(model))
    return model
