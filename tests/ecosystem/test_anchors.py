"""The anchors' own settings (:mod:`torchstash_bench.anchors`: Mesa's DeiT-S under mixed
precision, GACT's ResNet-50) at a tiny scale: every method gets its row, and what the forward
leaves for backward, read from the heap for every method alike, is below stock's where a
method keeps less. Skipped where timm or torchvision is not installed."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from torchstash.testing import heap
from torchstash_bench import anchors

pytestmark = pytest.mark.skipif(not heap.available(), reason=heap.why_unavailable() or "")


@pytest.mark.parametrize(
    ("setting", "library", "methods"),
    [
        ("mesa-deit-s", "timm", "checkpoint,quant.mesa,quant.int8"),
        ("gact-resnet50", "torchvision", "checkpoint,quant.auto,quant.int2"),
    ],
)
def test_anchor_rows(setting: str, library: str, methods: str, tmp_path: Path) -> None:
    pytest.importorskip(library)
    argv = ["--scale", "tiny", "--anchors", setting, "--strategies", methods]
    argv += ["--steps", "1", "--warmup", "0", "--device", "cpu", "--json", str(tmp_path / "a.json")]
    out = io.StringIO()
    rc = anchors.main(argv, console=Console(file=out, width=200))
    assert rc == 0, out.getvalue()
    rows = json.loads((tmp_path / "a.json").read_text())
    by_method = {r["method"]: r for r in rows}
    assert list(by_method) == ["stock", *methods.split(",")]
    stock = by_method["stock"]["held_bytes"]
    assert isinstance(stock, int) and stock > 0
    for name in methods.split(","):
        row = by_method[name]
        held, speed = row["held_bytes"], row["images_per_s"]
        assert isinstance(held, int) and 0 < held < stock, (name, held, stock)
        assert isinstance(speed, float) and speed > 0
    assert f"{setting} on cpu" in out.getvalue()
