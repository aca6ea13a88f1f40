"""``python -m torchstash_bench.dropit``: the README's figures come from working code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchstash_bench import dropit as evaluate


def test_relative_errors_per_group() -> None:
    ref = {"blocks.0.attn.qkv": torch.ones(2, 2), "head": torch.ones(2, 2)}
    got = {"blocks.0.attn.qkv": torch.ones(2, 2), "head": torch.zeros(2, 2)}
    errors = evaluate.relative_errors(ref, got)
    assert errors["attn.qkv"] == 0.0 and errors["head"] == 1.0
    assert errors["all"] == pytest.approx(0.5**0.5)


def test_error_on_the_demo_model_orders_the_estimators() -> None:
    rows = evaluate.error_vs_gamma(steps=0, gammas=(0.5, 0.9), scopes=("tensor",))
    err = {(r["strategy"], r["fill"], r["gamma"]): r["all"] for r in rows}
    for g in (0.5, 0.9):  # min-k beats random sampling, and the mean fill beats zeros
        assert err["mink", "mean", g] < err["mink", "zero", g] < err["random", "zero", g]
    assert err["mink", "zero", 0.5] < err["mink", "zero", 0.9]
    assert len(evaluate.error_table(rows, 0).rows) == len(rows)


def test_zoo_saved_bytes_below_stock() -> None:
    rows = evaluate.zoo_saved_bytes("tiny", ["dropit.mink"])
    assert {r["model"] for r in rows} == {"gpt", "vit", "resnet"}
    for r in rows:
        assert r["stored_bytes"] < r["raw_bytes"], r
        assert r["bf16_stored_bytes"] < r["bf16_raw_bytes"], r


def test_cli_rejects_a_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        evaluate.main(["zoo", "--scale", "tiny", "--strategies", "dropit.mink:gamma"])
    assert "key=value" in capsys.readouterr().err


def test_demo_runs_the_projection_policies(tmp_path: Path) -> None:
    result = evaluate.demo(steps=2, out=str(tmp_path))
    labels = [r.strategy for r in result.runs]
    assert labels == ["stock", *evaluate.DEMO_STRATEGIES, *evaluate.DEMO_POLICIES]
    assert all(r.error is None for r in result.runs)
    every, projections = result.run("dropit.mink"), result.run(evaluate.PROJECTIONS)
    assert every.stored_bytes < projections.stored_bytes < result.stock.raw_bytes


def test_saved_bytes_table_beats_dropit_everywhere() -> None:
    rows = evaluate.saved_bytes_table()
    for r in rows:
        assert r["mink"] < min(1.0, r["dropit"]), r
        if r["mink_int8"] is not None:  # torchstash-quant installed beside
            assert r["mink_int8"] < r["mink"], r
    fp16 = next(r for r in rows if r["dtype"] == "float16" and r["gamma"] == 0.9)
    assert fp16["mink"] <= 0.17 and fp16["dropit"] == pytest.approx(0.3)
    if fp16["mink_int8"] is not None:
        assert fp16["mink_int8"] <= 0.12
    assert len(evaluate.bytes_table(rows).rows) == len(rows)
