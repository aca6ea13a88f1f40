"""The compiled lab command runs and reports each zoo model, coded in the graph."""

from __future__ import annotations

import pytest

from torchstash_bench.compiled import measure

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")


def test_each_zoo_model_is_timed_and_coded_in_the_graph() -> None:
    rows = measure("tiny", "quant.int8", "aot_eager", steps=1, warmup=1)
    assert [r["model"] for r in rows] == ["gpt", "vit", "resnet"]
    for r in rows:
        assert r["in graph"] and r["compiled x"] > 0 and r["eager x"] > 0
        assert 0 < r["compiled saved"] < 1 and 0 < r["eager saved"] < 1
