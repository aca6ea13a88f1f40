"""quant's README figures on the zoo (``python -m torchstash_bench.quant``): savings and
gradient fidelity, in fp32 and under bf16 autocast; presets the bench and demo skip."""

from __future__ import annotations

import pytest

import torchstash as ts
from torchstash.testing.models import zoo
from torchstash_bench.common import strategy_names
from torchstash_bench.quant import evaluate_one

ZOO = {e.name: e for e in zoo("tiny")}


@pytest.mark.parametrize(
    ("strategy", "model", "min_ratio", "min_bf16_ratio", "min_cosine"),
    [
        # floors measured on the tiny zoo (README: the small zoo and the targets)
        ("quant.int8", "gpt", 3.8, 1.9, 0.999),
        ("quant.int8", "vit", 3.8, 1.9, 0.999),
        ("quant.int4", "vit", 7.0, 3.5, 0.99),
        ("quant.int4", "gpt", 7.0, 3.5, 0.99),
        # LayerNorm inputs carry an exact offset per row (torchstash_quant.centered), at 8
        # bits (NORM_DEFAULT); the attention map is recomputed from q and k at 8 bits
        # (SCORES_BITS): tiny GPT 9.23x under int2 at cosine 0.998 (10.98x at 0.992 with
        # LayerNorm inputs at 4 bits), tiny ViT 11.6x at 0.990 (13.5x at 0.987)
        ("quant.int2", "gpt", 9.1, 5.2, 0.97),
        ("quant.int2", "vit", 11.5, 6.4, 0.97),
        ("quant.mesa", "gpt", 3.7, 1.85, 0.999),
        ("quant.mesa", "vit", 3.8, 1.9, 0.999),
        ("quant.fp8", "vit", 3.8, 1.9, 0.999),
        # max-pool positions in 4 bits, conv inputs after bn1's ReLU recomputed: 5.4x
        ("quant.int8", "resnet", 5.0, 2.4, 0.999),
    ],
)
def test_savings_and_gradients_on_the_zoo(
    strategy: str, model: str, min_ratio: float, min_bf16_ratio: float, min_cosine: float
) -> None:
    row = evaluate_one(ZOO[model], strategy, batch=8)
    assert row["ratio_fp32"] >= min_ratio, row
    assert row["ratio_bf16"] >= min_bf16_ratio, row
    assert row["grad_cosine"] >= min_cosine, row
    # and under bf16 autocast, against stock's there: the same floors
    assert row["grad_cosine_bf16"] >= min_cosine, row


def test_presets_are_not_rerun_by_the_demo_and_bench() -> None:

    by_name = {s["name"]: s for s in ts.strategies()}
    assert by_name["quant.L3"]["preset"] and by_name["quant"]["preset"]
    assert not by_name["quant.int2"]["preset"]
    default = strategy_names(None)
    assert "quant.int2" in default and "quant.L3" not in default and "quant" not in default
    assert strategy_names(["quant.L3"]) == ["quant.L3"]  # still runnable by name
