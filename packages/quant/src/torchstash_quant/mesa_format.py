"""Reader for Mesa's policy text format, for users coming from Mesa.

    on gelu:                 # tag: fc, conv, gelu, bn, relu, softmax, matmul, layernorm
        by_index: all        # then settings for those indices
        enable: True
        level: 256           # quantization levels (256 = 8 bits)
        ema_decay: 0.9
        by_index: 1 2
        enable: False

Each ``by_index`` starts a rule; settings after it belong to it. Later rules win. The
plug-in registers this reader as policy format ``quant.mesa``, so ``Policy.load`` reads a
Mesa file (any file not ending in ``.toml``) and ``Policy.from_mesa`` a Mesa text.

What Mesa's own files hold reads as Mesa read it: a header may name several tags and end
with trigger epochs (``on fc gelu: 10``, the epochs being ``deploy_on_epoch``'s); the tags
Mesa knew but gave no layer (``eltwise``, ``shuffle``, ``concat``, ``norm``) select nothing;
``by_tag`` picks a sub-quantizer of softmax or matmul (``softmax-2``: the output, ``matmul-1``
and ``matmul-2``: the operands; ``softmax-1``, the input, is not saved by PyTorch's softmax);
``quant_groups`` sets the layer's groups; and the settings Mesa's layers had but that change
nothing here (``stable``, ``fp_forward``, ``non_negative_only``...) are accepted and have no
effect. Any other key or tag is an error naming the line, not ignored as Mesa did.
"""

from __future__ import annotations

import math
from typing import Any

from torchstash.errors import PolicyError
from torchstash.policy import Rule
from torchstash.tags import normalize

MESA_TAGS = ("fc", "conv", "gelu", "bn", "relu", "softmax", "matmul", "layernorm")
#: tags Mesa's ``deploy_on_init`` walked that none of its layers had: accepted, select nothing
EMPTY_TAGS = ("eltwise", "shuffle", "concat", "norm")
_SETTINGS = ("enable", "level", "ema_decay", "quant_groups")
#: settings of Mesa's layers with no counterpart here (its quantizer's variants and debugging)
INERT = ("stable", "fp_forward", "non_negative_only", "half_range", "correlate", "index")
#: ``by_tag`` values -> the saved tensor's role in the op
SUB_TAGS = {"softmax-2": "output", "matmul-1": "input", "matmul-2": "arg1", "softmax-1": None}


def parse_mesa(text: str, name: str, strategy: str = "quant.mesa") -> list[Rule]:
    rules: list[Rule] = []
    tags: list[str] | None = None
    current: list[dict[str, Any]] | None = None

    def flush() -> None:
        for block in current or ():
            if block["settings"]:  # a block of no setting changed nothing in Mesa either
                rules.extend(_to_rules(block, strategy))

    for lineno, raw_line in enumerate(text.splitlines(), 1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}, line {lineno}"
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep:
            raise PolicyError(f"{where}: expected 'key: value' or 'on <tag>:', got {line!r}")
        words = key.lower().split()
        if words and words[0] == "on":
            flush()
            current = None
            tags = _header(words[1:], value, where)
            continue
        if tags is None:
            raise PolicyError(f"{where}: {key!r} before any 'on <tag>:' block")
        if key == "by_index":
            flush()
            index = _index(value, where)
            current = [{"tag": t, "index": index, "where": where, "settings": 0} for t in tags]
        elif key == "by_tag" or key in _SETTINGS or key in INERT:
            if current is None:
                raise PolicyError(f"{where}: {key!r} must follow a 'by_index:' line")
            for block in current:
                if key == "by_tag":
                    block["by_tag"] = _by_tag(value, block["tag"], where)
                elif key in _SETTINGS:
                    block[key] = _setting(key, value, where)
                    block["settings"] += 1
        else:
            raise PolicyError(
                f"{where}: unknown key {key!r}; expected by_index, by_tag, "
                f"{', '.join(_SETTINGS)} (or Mesa's {', '.join(INERT)}, which change nothing)"
            )
    flush()
    return rules


def _header(tags: list[str], triggers: str, where: str) -> list[str]:
    """The tags of an ``on <tag> [<tag>...]: [epochs]`` line (Mesa's tags only)."""
    if not tags:
        raise PolicyError(f"{where}: 'on' names no layer tag; Mesa's are {', '.join(MESA_TAGS)}")
    for tag in tags:
        if tag not in MESA_TAGS and tag not in EMPTY_TAGS:
            raise PolicyError(
                f"{where}: unknown layer tag {tag!r}; Mesa's tags are {', '.join(MESA_TAGS)}"
            )
    if triggers and not all(t.lstrip("-").isdigit() for t in triggers.split()):
        raise PolicyError(f"{where}: after 'on {' '.join(tags)}:' come epochs, got {triggers!r}")
    return [t for t in tags if t in MESA_TAGS]


def _by_tag(value: str, tag: str, where: str) -> frozenset[str] | None:
    """The roles a ``by_tag`` selects of a ``tag`` block (None: all; empty: none)."""
    names = value.replace(",", " ").split()
    unknown = [n for n in names if n not in SUB_TAGS and n != tag]
    if unknown:
        raise PolicyError(
            f"{where}: by_tag {unknown[0]!r} is not a sub-quantizer of Mesa's softmax or "
            f"matmul ({', '.join(SUB_TAGS)})"
        )
    if tag in names:
        return None  # the layer itself: every save of it
    return frozenset(
        role for n in names if n.startswith(f"{tag}-") and (role := SUB_TAGS[n]) is not None
    )


def _to_rules(r: dict[str, Any], strategy: str) -> list[Rule]:
    roles = r.get("by_tag")
    if roles is None:
        return [_to_rule(r, strategy, None)]
    return [_to_rule(r, strategy, role) for role in sorted(roles)]


def _to_rule(r: dict[str, Any], strategy: str, role: str | None) -> Rule:
    tag = normalize(r["tag"])
    enabled = r.get("enable", True)
    options: dict[str, Any] = {}
    if "level" in r:
        options["bits"] = r["level"]
    if "ema_decay" in r:
        options["ema_decay"] = r["ema_decay"]
    if "quant_groups" in r:
        options["groups"] = r["quant_groups"]
    # matmul/softmax are functional ops in most models: their index counts occurrences.
    if tag in ("matmul", "softmax"):
        kw: dict[str, Any] = {"op": tag, "op_index": r["index"]}
    else:
        kw = {"type": tag, "index": r["index"]}
    if role is not None:
        kw["role"] = role
    return Rule(
        strategy=strategy if enabled else "none",
        options=options if enabled else {},
        source=f"rule from {r['where']}",
        **kw,
    )


def _index(value: str, where: str) -> frozenset[int] | None:
    if value.strip().lower() == "all":
        return None
    try:
        items = [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise PolicyError(
            f"{where}: by_index takes 'all' or indices like '0 2 5', got {value!r}"
        ) from None
    if not items or any(i < 0 for i in items):
        raise PolicyError(f"{where}: by_index takes 'all' or indices >= 0, got {value!r}")
    return frozenset(items)


def _setting(key: str, value: str, where: str) -> Any:
    if key == "enable":
        if value.lower() not in ("true", "false"):
            raise PolicyError(f"{where}: enable takes True or False, got {value!r}")
        return value.lower() == "true"
    if key == "level":
        try:
            level = int(value)
        except ValueError:
            level = -1
        bits = int(math.log2(level)) if level > 1 else 0
        if level < 2 or 2**bits != level or bits > 8:
            raise PolicyError(f"{where}: level must be a power of two from 2 to 256, got {value!r}")
        return bits
    if key == "quant_groups":
        groups = int(value) if value.isdigit() else 0
        if groups < 1:
            raise PolicyError(f"{where}: quant_groups must be a positive integer, got {value!r}")
        return groups
    try:
        decay = float(value)
    except ValueError:
        decay = -1.0
    if not 0.0 <= decay < 1.0:
        raise PolicyError(f"{where}: ema_decay must be a number in [0, 1), got {value!r}")
    return decay
