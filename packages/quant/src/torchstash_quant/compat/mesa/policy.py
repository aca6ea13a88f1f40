"""Mesa's ``policy`` module: ``convert_by_num_groups``, ``convert_by_group_size``, ``deploy_on_init``.

Mesa swapped the model's layers for its own; here nothing is swapped. ``convert_*`` records
the grouping on the model, ``deploy_on_init`` reads Mesa's policy file (the same text format)
and applies ``quant.mesa`` to the layers it enables, with torchstash: the model keeps its
modules, parameters and ``state_dict`` keys. ``torchstash.remove(model)`` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

import torchstash as ts
from torchstash.policy import Policy, Rule
from torchstash.site import Site
from torchstash.tags import tag_of, type_names

_ATTR = "_torchstash_mesa_grouping"


def convert_by_num_groups(model: nn.Module, num_groups: int) -> nn.Module:
    """Quantize each layer's saved tensors in ``num_groups`` channel groups (heads)."""
    _check_positive(num_groups, "num_groups")
    object.__setattr__(model, _ATTR, {"groups": num_groups})
    return model


def convert_by_group_size(model: nn.Module, group_size: int) -> nn.Module:
    """Quantize each layer's saved tensors in groups of ``group_size`` channels."""
    _check_positive(group_size, "group_size")
    object.__setattr__(model, _ATTR, {"group_size": group_size})
    return model


def deploy_on_init(
    model: nn.Module,
    policy_path: str | Path,
    verbose: Callable[[str], Any] | None = None,
    override_verbose: bool = False,
) -> ts.Handle:
    """Apply Mesa's policy file to ``model``: every layer (and functional matmul/softmax) the
    file enables is saved with ``quant.mesa``; what it does not enable stays as it is."""
    text = Path(policy_path).read_text()
    file_policy = Policy.from_mesa(text, Path(policy_path).name)
    grouping: dict[str, int] = dict(getattr(model, _ATTR, {}))
    rules: list[Rule] = []
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        tag = tag_of(module)
        index = counts.get(tag, 0)
        counts[tag] = index + 1
        site = Site(module=name, tag=tag, module_type=type(module).__name__, module_index=index)
        rule = file_policy.resolve(site, type_names(module))
        if rule is None or rule.op is not None:
            continue
        options = dict(rule.options)
        if rule.strategy != "none":
            options.update(_groups(module, grouping))
        rules.append(Rule(rule.strategy, options, module=name, source=rule.source))
        if verbose is not None and (override_verbose or rule.strategy != "none"):
            verbose(
                f"mesa: {name or '<model>'} ({type(module).__name__}): {rule.strategy} {options}"
            )
    for rule in file_policy.rules:  # functional matmul / softmax, reached by op
        if rule.op is not None:
            options = dict(rule.options)
            if rule.strategy != "none":
                options.update(grouping)
            rules.append(
                Rule(rule.strategy, options, op=rule.op, op_index=rule.op_index, source=rule.source)
            )
    if not any(r.strategy != "none" for r in rules):
        raise ts.errors.ApplyError(
            f"{policy_path}: the policy enables no layer of this {type(model).__name__}; "
            f"nothing would be quantized"
        )
    return ts.apply(model, policy=Policy(rules, f"mesa:{Path(policy_path).name}"))


def _groups(module: nn.Module, grouping: dict[str, int]) -> dict[str, int]:
    layer_groups = getattr(module, "quant_groups", None)
    if isinstance(layer_groups, int):
        return {"groups": layer_groups}
    return dict(grouping)


def _check_positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
