"""Mesa's policy text format, registered by this plug-in and read by ``Policy.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchstash as ts
from torchstash.errors import PolicyError
from torchstash.policy import Policy, Rule
from torchstash.registry import REGISTRY
from torchstash.testing.models import zoo

GPT = next(e for e in zoo("tiny") if e.name == "gpt")


MESA = """
on gelu:   # every GELU but the second
    by_index: all
    enable: True
    level: 256
    ema_decay: 0.9
    by_index: 1
    enable: False
on softmax:
    by_index: 0
    enable: True
on fc:
    by_index: all
    enable: False
"""


def test_mesa_format() -> None:
    rules = Policy.from_mesa(MESA, "policy.txt").rules
    assert rules[0] == Rule(
        strategy="quant.mesa",
        options={"bits": 8, "ema_decay": 0.9},
        type="gelu",
        index=None,
        source="rule from policy.txt, line 3",
    )
    assert (rules[1].type, rules[1].index, rules[1].strategy) == ("gelu", frozenset({1}), "none")
    assert (rules[2].op, rules[2].op_index, rules[2].strategy) == (
        "softmax",
        frozenset({0}),
        "quant.mesa",
    )
    assert (rules[3].type, rules[3].strategy) == ("linear", "none")  # fc is Mesa's Linear


def test_mesa_format_with_another_strategy() -> None:
    text = "on gelu:\n  by_index: all\n  enable: True\n"
    policy = Policy.from_mesa(text, "p.txt", strategy="quant.int8")
    assert [(r.type, r.strategy) for r in policy.rules] == [("gelu", "quant.int8")]
    model = GPT.build()
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        x, y = GPT.batch(2, torch.device("cpu"))
        GPT.loss(model, x, y).backward()
        rows = {name: r for name, r in h.tally.rows.items() if r.compressed}
    assert rows and all(set(r.ops) == {"gelu"} for r in rows.values())


def test_the_plugin_registers_the_format_policy_load_reads(tmp_path: Path) -> None:
    form = REGISTRY.policy_format("quant.mesa")
    assert form.distribution == "torchstash-quant" and form.fallback
    assert REGISTRY.policy_format_for(".txt") is form
    assert REGISTRY.policy_format_for("") is form
    for name in ("policy.txt", "policy"):
        f = tmp_path / name
        f.write_text(MESA)
        assert Policy.load(f).rules == Policy.from_mesa(MESA, name).rules
    f = tmp_path / "policy.toml"
    f.write_text(MESA)
    assert Policy.load(f, form="quant.mesa").rules == Policy.from_mesa(MESA, f.name).rules


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("on gleu:\n  by_index: all\n", r"line 1: unknown layer tag 'gleu'"),
        ("by_index: all\n", r"line 1: 'by_index' before any 'on <tag>:'"),
        ("on gelu:\n  enable: True\n", r"line 2: 'enable' must follow a 'by_index:'"),
        ("on gelu:\n  by_index: one\n", r"line 2: by_index takes"),
        ("on gelu:\n  by_index: all\n  level: 100\n", r"line 3: level must be a power of two"),
        ("on gelu:\n  by_index: all\n  ema_decay: 1.5\n", r"line 3: ema_decay"),
        ("on gelu:\n  by_index: all\n  speed: fast\n", r"line 3: unknown key 'speed'"),
        ("on gelu:\n  by_index: all\n  enable: maybe\n", r"line 3: enable takes True or False"),
    ],
)
def test_mesa_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Policy.from_mesa(text, "m.txt")
