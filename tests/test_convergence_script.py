"""scripts/convergence.py on tiny models for two steps: the table, the JSON and the markdown
are written, ``none`` ends exactly where stock does, and the targets are read right."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from torchstash_bench.convergence_tasks import textures

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "convergence.py"


@pytest.fixture(scope="module")
def conv():
    spec = importlib.util.spec_from_file_location("convergence_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_two_steps_write_table_json_and_markdown(conv, tmp_path: Path, capsys) -> None:
    out = io.StringIO()
    args = ["--quick", "--steps", "2", "--threads", "1", "--device", "cpu"]
    args += ["--models", "gpt-manual,cnn", "--strategies", "none,quant.int8", "--check"]
    args += ["--json", str(tmp_path / "c.json"), "--markdown", str(tmp_path / "c.md")]
    assert conv.main(args, console=Console(file=out, width=200)) == 0

    runs = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert [(r["model"], r["strategy"]) for r in runs] == [
        (m, s)
        for m in ("gpt-manual", "cnn")
        for s in ("stock", "stock+noise", "none", "quant.int8")
    ]
    assert all(r["error"] is None and r["val_loss"] is not None for r in runs)
    for r in runs:
        if r["strategy"] == "none":
            assert r["rel_pct"] == 0.0  # the identity is bit-exact, not merely close
            assert r["worst_cos"] == pytest.approx(1.0, abs=1e-9)
            assert r["trained_worst_cos"] == pytest.approx(1.0, abs=1e-9)
            assert r["met"] is True
        if r["strategy"] == "quant.int8":
            assert r["target_pct"] == 1.0 and r["ratio"] > 2
            assert 0.9 < r["worst_cos"] <= 1.0 + 1e-9
            assert 0.9 < r["trained_whole_cos"] <= 1.0 + 1e-9
    assert runs[4]["val_acc"] is not None  # the CNN reports accuracy
    noise = runs[1]  # stock from slightly other weights: close, not equal
    assert noise["rel_pct"] is not None and noise["target_pct"] is None

    table = out.getvalue()
    assert "worst grad cos" in table and "quant.int8" in table
    md = (tmp_path / "c.md").read_text()
    assert "| gpt-manual | none |" in md and "+0.00%" in md
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("[cnn] ") for line in lines) == 4  # one line per run


def test_probe_only_measures_cosines_without_training(conv, tmp_path: Path) -> None:
    args = ["--quick", "--steps", "2", "--threads", "1", "--device", "cpu", "--probe-only"]
    args += ["--models", "gpt-sdpa", "--strategies", "none,quant.int2"]
    args += ["--json", str(tmp_path / "c.json")]
    assert conv.main(args, console=Console(file=io.StringIO(), width=200)) == 0
    stock, none, int2 = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert stock["val_loss"] is not None and none["val_loss"] is None  # not trained
    assert none["trained_worst_cos"] == pytest.approx(1.0, abs=1e-9)
    assert 0.5 < int2["trained_whole_cos"] <= 1.0 + 1e-9


def test_targets(conv) -> None:
    assert conv.target_of("quant.int8", False) == 1.0
    assert conv.target_of("quant.int2", False) == 3.0
    assert conv.target_of("quant.int1", False) is None  # reported only
    assert conv.target_of("dropit.mink", False) is None
    assert conv.target_of("none", True) == conv.LOSSLESS_PCT
    missed = conv.Run("cnn", "quant.int2", lossless=False, target_pct=3.0, rel_pct=3.5)
    assert conv.met_target(missed) is False
    lossless = conv.Run("cnn", "memsave", lossless=True, target_pct=0.1, rel_pct=-0.2)
    assert conv.met_target(lossless) is False  # lossless: within the bound either way
    assert conv.met_target(conv.Run("cnn", "quant.int4", target_pct=2.0)) is False  # failed
    assert "quant" not in conv.default_strategies()  # the generic preset needs its options


def test_textures_are_deterministic(conv) -> None:
    a = textures(16, 32, 8, torch.Generator().manual_seed(3))
    b = textures(16, 32, 8, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (16, 3, 32, 32)


def test_constant_schedule_keeps_every_model_at_its_rate(conv, tmp_path: Path) -> None:
    cfg = conv.Config.quick()
    cosine = [conv.make_task(m, cfg, 20, 0, torch.device("cpu")) for m in conv.MODELS]
    assert all(t.lr_factor(0, 20) < 1.0 or t.lr_factor(19, 20) < 1.0 for t in cosine)
    constant = conv.replace(cfg, schedule="constant")
    for m in conv.MODELS:
        task = conv.make_task(m, constant, 20, 0, torch.device("cpu"))
        assert [task.lr_factor(i, 20) for i in range(20)] == [1.0] * 20, m
    args = ["--quick", "--steps", "2", "--threads", "1", "--device", "cpu"]
    args += ["--models", "gpt-manual", "--strategies", "none", "--schedule", "constant"]
    args += ["--json", str(tmp_path / "c.json")]
    out = io.StringIO()
    assert conv.main(args, console=Console(file=out, width=300)) == 0
    assert json.loads((tmp_path / "c.json").read_text())["config"]["schedule"] == "constant"
    assert "both constant, no warmup" in out.getvalue()
