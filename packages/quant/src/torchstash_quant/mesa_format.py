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
"""

from __future__ import annotations

import math
from typing import Any

from torchstash.errors import PolicyError
from torchstash.policy import Rule
from torchstash.tags import normalize

MESA_TAGS = ("fc", "conv", "gelu", "bn", "relu", "softmax", "matmul", "layernorm")
_SETTINGS = ("enable", "level", "ema_decay")


def parse_mesa(text: str, name: str, strategy: str = "quant.mesa") -> list[Rule]:
    rules: list[Rule] = []
    tag: str | None = None
    current: dict[str, Any] | None = None

    def flush() -> None:
        if current is not None:
            rules.append(_to_rule(current, strategy))

    for lineno, raw_line in enumerate(text.splitlines(), 1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}, line {lineno}"
        if line.startswith("on ") and line.endswith(":"):
            flush()
            current = None
            tag = line[3:-1].strip().lower()
            if tag not in MESA_TAGS:
                raise PolicyError(
                    f"{where}: unknown layer tag {tag!r}; Mesa's tags are {', '.join(MESA_TAGS)}"
                )
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep:
            raise PolicyError(f"{where}: expected 'key: value' or 'on <tag>:', got {line!r}")
        if tag is None:
            raise PolicyError(f"{where}: {key!r} before any 'on <tag>:' block")
        if key == "by_index":
            flush()
            current = {"tag": tag, "index": _index(value, where), "where": where}
        elif key in _SETTINGS:
            if current is None:
                raise PolicyError(f"{where}: {key!r} must follow a 'by_index:' line")
            current[key] = _setting(key, value, where)
        else:
            raise PolicyError(
                f"{where}: unknown key {key!r}; expected by_index, {', '.join(_SETTINGS)}"
            )
    flush()
    return rules


def _to_rule(r: dict[str, Any], strategy: str) -> Rule:
    tag = normalize(r["tag"])
    enabled = r.get("enable", True)
    options: dict[str, Any] = {}
    if "level" in r:
        options["bits"] = r["level"]
    if "ema_decay" in r:
        options["ema_decay"] = r["ema_decay"]
    # matmul/softmax are functional ops in most models: their index counts occurrences.
    if tag in ("matmul", "softmax"):
        kw: dict[str, Any] = {"op": tag, "op_index": r["index"]}
    else:
        kw = {"type": tag, "index": r["index"]}
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
    try:
        decay = float(value)
    except ValueError:
        decay = -1.0
    if not 0.0 <= decay < 1.0:
        raise PolicyError(f"{where}: ema_decay must be a number in [0, 1), got {value!r}")
    return decay
