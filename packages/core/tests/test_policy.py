"""Policies: TOML (Mesa's text format is the quant plug-in's), last match wins, errors that name the rule and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.errors import OptionError, PolicyError, UnknownStrategyError
from torchstash.policy import Policy
from torchstash.site import Site
from torchstash.testing.models import zoo
from torchstash.tomlheaders import header_lines

GPT = next(e for e in zoo("tiny") if e.name == "gpt")

TOML = """
[[rule]]
strategy = "test.half"

[[rule]]
type = "gelu"
index = [1]
strategy = "none"

[[rule]]
op = "softmax"
strategy = "test.clone"
"""


def compressed_sites(model: nn.Module, policy: object) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    with ts.apply(model, policy=policy, min_bytes=0) as h:  # type: ignore[arg-type]
        x, y = GPT.batch(2, torch.device("cpu"))
        GPT.loss(model, x, y).backward()
    for r in h.tally.rows.values():
        seen[r.module] = {f"{op}" for op in r.ops} if r.compressed else set()
    return seen


def test_toml_last_match_wins(toy_strategies: list[str]) -> None:
    policy = Policy.from_toml(TOML, "p.toml")
    assert [r.source for r in policy.rules] == [
        "rule 1 (p.toml, line 2)",
        "rule 2 (p.toml, line 5)",
        "rule 3 (p.toml, line 10)",
    ]
    gelu = lambda i: Site(module=f"blocks.{i}.mlp.1", tag="gelu", module_index=i, op="gelu")
    assert policy.resolve(gelu(0)).strategy == "test.half"  # type: ignore[union-attr]
    assert policy.resolve(gelu(1)).strategy == "none"  # type: ignore[union-attr]
    sm = Site(module="blocks.0.attn", tag="selfattention", op="softmax", role="output")
    assert policy.resolve(sm).strategy == "test.clone"  # type: ignore[union-attr]
    seen = compressed_sites(GPT.build(), policy)
    assert seen["blocks.0.mlp.1"] and not seen["blocks.1.mlp.1"]


def test_policy_file_and_list_of_dicts(tmp_path: Path, toy_strategies: list[str]) -> None:
    f = tmp_path / "policy.toml"
    f.write_text(TOML)
    a = compressed_sites(GPT.build(), str(f))
    b = compressed_sites(
        GPT.build(),
        [
            {"strategy": "test.half"},
            {"type": "gelu", "index": 1, "enable": False},
            {"op": "softmax", "strategy": "test.clone"},
        ],
    )
    assert a == b


def test_module_glob_and_role(toy_strategies: list[str]) -> None:
    policy = Policy.from_rules([{"module": "blocks.1.*", "role": "input", "strategy": "test.half"}])
    seen = compressed_sites(GPT.build(), policy)
    assert seen["blocks.1.mlp.1"] and not seen["blocks.0.mlp.1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[rule]]\nstrategy = "none"\n\n[[rule]]\ntpye = "gelu"\n',
            r"rule 2 \(t.toml, line 4\).*'tpye'.*did you mean 'type'",
        ),
        ('[[rule]]\nop = "sofmax"\n', r"rule 1 \(t.toml, line 1\).*unknown op 'sofmax'"),
        ("[[rule]]\nindex = 2\n", r"'index' needs 'type'"),
        ('[[rule]]\ntype = "gelu"\nindex = -1\n', r"index"),
        ('[[rule]]\nenable = "yes"\n', r"'enable' must be true or false"),
        ('[rule]\nstrategy = "none"\n', r"\[\[rule\]\]"),
        ('[[rules]]\nstrategy = "none"\n', r"unknown top-level key"),
        ("[[rule]\n", r"not valid TOML"),
        ('[[rule]]\nstrategy = "none"\noptions = {bits = 2}\n', r"takes no options"),
    ],
)
def test_toml_errors_name_the_rule(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Policy.from_toml(text, "t.toml")


def test_unknown_strategy_and_option_name_the_rule(toy_strategies: list[str]) -> None:
    model = GPT.build()
    bad = Policy.from_toml(
        '[[rule]]\nstrategy = "none"\n[[rule]]\nstrategy = "quant.int3"\n', "b.toml"
    )
    with pytest.raises(UnknownStrategyError, match=r"rule 2 \(b.toml, line 3\)"):
        ts.apply(model, policy=bad)
    bad2 = Policy.from_toml(
        '[[rule]]\nstrategy = "offload.cpu"\noptions = {prefetsh = 1}\n', "c.toml"
    )
    with pytest.raises(OptionError, match=r"rule 1 \(c.toml, line 1\).*prefetch, pin_memory"):
        ts.apply(model, policy=bad2)
    assert ts.handle_of(model) is None


def test_unknown_type_tag_names_the_rule() -> None:
    policy = Policy.from_toml('[[rule]]\ntype = "transformerblok"\n', "d.toml")
    with pytest.raises(
        PolicyError, match=r"rule 1 \(d.toml, line 1\).*unknown type 'transformerblok'"
    ):
        ts.apply(GPT.build(), policy=policy)
    # a class name that exists in the model is fine, and so is a known tag it lacks
    ts.apply(GPT.build(), policy=[{"type": "SelfAttention"}, {"type": "conv"}]).remove()


@pytest.mark.parametrize(
    ("text", "value"), [("false", False), ("False", False), ("TRUE", True), ("true", True)]
)
def test_parse_spec_reads_booleans_as_a_command_line_writes_them(text: str, value: bool) -> None:
    """``quant.int8:stochastic=false`` is what a shell user types (Python's ``False`` too);
    as a string the strategy refused it with "must be True or False"."""
    from torchstash.policy import parse_spec

    assert parse_spec(f"quant.int8:stochastic={text}") == ("quant.int8", {"stochastic": value})


def test_a_spec_with_a_lowercase_boolean_builds() -> None:
    from torchstash.policy import parse_spec

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    name, options = parse_spec("offload.cpu:pin_memory=false")
    handle = ts.apply(model, name, **options)
    try:
        model(torch.randn(4, 8)).sum().backward()
    finally:
        handle.remove()


def test_parse_spec_reads_options_as_literals() -> None:
    from torchstash.policy import parse_spec

    assert parse_spec("quant.auto:budget=3;interval=5") == (
        "quant.auto",
        {"budget": 3, "interval": 5},
    )
    assert parse_spec("quant.int4") == ("quant.int4", {})
    assert parse_spec("dropit.mink:gamma=0.8;scope=row") == (
        "dropit.mink",
        {"gamma": 0.8, "scope": "row"},
    )
    with pytest.raises(PolicyError, match="key=value"):
        parse_spec("quant.auto:budget")
    with pytest.raises(PolicyError, match="name is missing"):
        parse_spec(":gamma=0.5")


@pytest.mark.parametrize("role", ["inptu", "arg0", "parameter", "outputs", "inp?t*x"])
def test_unknown_role_names_the_rule_and_line(role: str) -> None:
    text = f'[[rule]]\nstrategy = "none"\n\n[[rule]]\nop = "linear"\nrole = "{role}"\n'
    with pytest.raises(
        PolicyError, match=rf"rule 2 \(r.toml, line 4\): unknown role {re.escape(repr(role))}"
    ):
        Policy.from_toml(text, "r.toml")


@pytest.mark.parametrize("role", ["input", "output", "arg1", "arg12", "arg*", "*"])
def test_known_roles_and_globs(role: str) -> None:
    assert Policy.from_rules([{"role": role}]).rules[0].role == role


def test_non_utf8_policy_file_names_the_file(tmp_path: Path) -> None:
    for name in ("latin1.toml", "latin1.txt"):  # .txt: read as the fallback format's text
        f = tmp_path / name
        f.write_bytes(b'[[rule]]\n# caf\xe9\nstrategy = "none"\n')
        with pytest.raises(
            PolicyError, match=re.escape(f"'{f}' is not UTF-8 text: byte 0xe9 on line 2")
        ):
            Policy.load(f)


TRICKY = '''\
[[ rule ]]                    # 1: spaces inside the brackets
module = """
[[rule]]
"""
strategy = "none"

  [["rule"]]
strategy = "quant.int8"
options.groups = [
[["rule"]]
]
options.note = '[[rule]]'  # [[rule]]
[[rule]]
tpye = "gelu"
'''


def test_toml_line_numbers_survive_spaces_strings_and_arrays() -> None:
    assert header_lines(TRICKY) == [1, 7, 13]
    with pytest.raises(PolicyError, match=r"rule 3 \(t.toml, line 13\).*'tpye'"):
        Policy.from_toml(TRICKY, "t.toml")
    literal = "[[rule]]\nmodule = '''\n[[rule]]'''\n[[rule]]\nstrategy = \"x\"\n"
    assert header_lines(literal) == [1, 4]
    escaped = '[[rule]]\nmodule = """\\"""\n[[rule]]\n"""\n[[rule]]\n'
    assert header_lines(escaped) == [1, 5]


def test_inline_rules_give_no_line_rather_than_a_wrong_one() -> None:
    with pytest.raises(PolicyError, match=r"rule 2 \(i.toml\): unknown key"):
        Policy.from_toml('rule = [{strategy = "none"}, {tpye = "gelu"}]\n', "i.toml")


def test_a_role_rule_reaches_autocasts_copy(toy_strategies: list[str]) -> None:
    """Under autocast a Linear saves a bf16 copy of its float32 input: a rule for the linear
    ops' ``input`` reaches it, as it does without autocast (it saw the copy as ``output``)."""
    policy = Policy.from_rules([{"op": "linear", "role": "input", "strategy": "test.half"}])
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    x = torch.randn(8, 32)  # its copy needs no gradient: told by shape and dtype
    for autocast in (False, True):
        with ts.apply(model, policy=policy, min_bytes=0) as h:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                out = model(x)
            out.float().sum().backward()
        rows = h.tally.rows
        assert rows["0"].compressed == 1 and rows["2"].compressed == 1, (autocast, rows)
