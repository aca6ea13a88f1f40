"""Mesa's ``policy`` module: ``convert_by_num_groups``, ``convert_by_group_size``,
``deploy_on_init``, ``read_policy``.

Mesa swapped the model's layers for its own; here nothing is swapped. ``convert_*`` records
the grouping on the model, ``deploy_on_init`` reads Mesa's policy file (the same text format)
and applies ``quant.mesa`` to the layers it enables, with torchstash: the model keeps its
modules, parameters and ``state_dict`` keys. ``torchstash.remove(model)`` undoes it. A layer
of the user's own built on :class:`~.custom_quant.Quant` quantizes itself, as in Mesa: it is
given its index and the policy's settings through ``update_quantization_parameter``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

import torchstash as ts
from torchstash.policy import Policy, Rule
from torchstash.site import Site
from torchstash.tags import tag_of, type_names

from .custom_quant import Quant
from .layers import MatMul, Softmax

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


#: the tags Mesa's ``deploy_on_init`` walked, in its order
DEPLOY_TAGS = (
    "conv", "fc", "eltwise", "shuffle", "concat", "norm", "gelu", "layernorm", "matmul",
    "softmax", "bn", "relu",
)  # fmt: skip


def deploy_on_init(
    model: nn.Module,
    filename: str | Path,
    verbose: Callable[[str], Any] | None = print,
    override_verbose: bool = False,
) -> ts.Handle | None:
    """Apply Mesa's policy file to ``model``: every layer (and functional matmul/softmax) the
    file enables is saved with ``quant.mesa``; what it does not enable stays as it is, and a
    file that enables nothing (empty: Mesa's baseline runs) or is missing leaves the model
    unquantized and says so once, as Mesa ran. ``verbose`` gets one line per layer the file
    reaches (None: silent); with ``override_verbose``, layers built on ``custom_quant.Quant``
    log through it too, as in Mesa. Returns the handle, or None where nothing is applied."""
    say = verbose if verbose is not None else (lambda text: None)
    path = Path(filename) if str(filename) else None
    if path is None or not path.is_file():
        warnings.warn(
            f"mesa: policy file {str(filename)!r} does not exist: the model runs unquantized "
            "(as in Mesa); give the path of a policy file to quantize",
            stacklevel=2,
        )
        return None
    text = path.read_text()
    own = _deploy_own_layers(model, path, say if override_verbose else None)
    file_policy = Policy.from_mesa(text, path.name)
    grouping: dict[str, int] = dict(getattr(model, _ATTR, {}))
    rules: list[Rule] = []
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, Quant):
            continue  # quantizes itself
        tag = tag_of(module)
        index = counts.get(tag, 0)
        counts[tag] = index + 1
        site = Site(module=name, tag=tag, module_type=type(module).__name__, module_index=index)
        rule = file_policy.resolve(site, type_names(module))
        if isinstance(module, (Softmax, MatMul)):  # reached by op: its flag follows the rules
            module.enable = _op_enabled(file_policy, module.tag, index)
        if rule is None or rule.op is not None:
            continue
        options = dict(rule.options)
        if rule.strategy != "none":
            options.update(_groups(module, grouping))
        rules.append(Rule(rule.strategy, options, module=name, source=rule.source))
        if rule.strategy != "none":
            say(f"mesa: {name or '<model>'} ({type(module).__name__}): {rule.strategy} {options}")
            if hasattr(module, "enable"):
                module.enable, module.index = True, index
    for rule in file_policy.rules:  # functional matmul / softmax, reached by op
        if rule.op is not None:
            options = dict(rule.options)
            if rule.strategy != "none":
                options.update(grouping)
            rules.append(
                Rule(rule.strategy, options, op=rule.op, op_index=rule.op_index, source=rule.source)
            )
    if not any(r.strategy != "none" for r in rules):
        if not own:
            say(
                f"mesa: {path} enables no layer of this {type(model).__name__}: it runs "
                "unquantized (as in Mesa)"
            )
        return None
    return ts.apply(model, policy=Policy(rules, f"mesa:{path.name}"))


def _op_enabled(policy: Policy, op: str, index: int) -> bool:
    """Whether the last rule for ``op`` that covers occurrence ``index`` enables it."""
    enabled = False
    for rule in policy.rules:
        if rule.op == op and (rule.op_index is None or index in rule.op_index):
            enabled = rule.strategy != "none"
    return enabled


def _deploy_own_layers(model: nn.Module, path: Path, verbose: Callable[[str], Any] | None) -> int:
    """Mesa's deployment on layers built on ``custom_quant.Quant``: per tag, an index in
    module order, then each block of the tag's section. Returns how many are enabled."""
    own = [m for m in model.modules() if isinstance(m, Quant)]
    if not own:
        return 0
    for module in own:
        if verbose is not None:
            module.verbose = verbose
    for tag in DEPLOY_TAGS:
        tagged = [m for m in own if m.tag == tag]
        for i, module in enumerate(tagged):
            module.update_quantization_parameter(index=i)
        for block in read_policy(path, tag, verbose=lambda text: None)[1:]:
            for module in tagged:
                module.update_quantization_parameter(**block)
    return sum(m.enable for m in own)


def read_policy(
    filename: str | Path,
    section: str = "init",
    debug: bool = False,
    verbose: Callable[[str], Any] = print,
) -> list[dict[str, Any]]:
    """Mesa's reading of one section (``on <tag> ...:``) of a policy file: ``[{"trigger":
    [epochs]}, {settings}, ...]``, each settings dict started by its ``by_*`` keys; ``[]``
    when the file or the section is missing. Values stay text (lists where several are
    given, True/False there as bools), as Mesa left them for the layers to convert."""
    path = Path(filename)
    if not str(filename) or not path.is_file():
        verbose(f"file no exist: {filename}")
        return []
    result: list[dict[str, Any]] = []
    block: dict[str, Any] | None = None
    active = False

    def close() -> None:
        if active and block and any(not k.startswith("by_") for k in block):
            result.append(block)

    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if ":" not in line:
            break  # where Mesa stopped reading
        key, value = (part.strip() for part in line.split(":", 1))
        words = key.split()
        if words and words[0] == "on":
            close()
            block = None
            active = section in words[1:]
            if active:
                result = [{"trigger": [int(v) for v in value.split()]}]
            continue
        if not active:
            continue
        if key.startswith("by_") and block and any(not k.startswith("by_") for k in block):
            close()
            block = None
        block = {} if block is None else block
        block[key] = _value(value)
    close()
    if debug:
        verbose(str(result))
    return result


def _value(text: str) -> Any:
    parts = [p.strip() for p in text.split(",")] if "," in text else text.split()
    if len(parts) <= 1:
        return text
    return [{"true": True, "false": False}.get(p.lower(), p) for p in parts]


def _groups(module: nn.Module, grouping: dict[str, int]) -> dict[str, int]:
    layer_groups = getattr(module, "quant_groups", None)
    if isinstance(layer_groups, int):
        return {"groups": layer_groups}
    return dict(grouping)


def _check_positive(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
