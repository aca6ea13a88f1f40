"""``quant.auto`` after its first allocation, on the models users bring (the strategy test
in ``test_models.py`` holds its first step, which comes before any allocation). The step is
repeated on one batch without an optimizer step, so stock's gradient stays the reference."""

from __future__ import annotations

import pytest

import torchstash as ts
from torchstash_bench.ecosystem import MODELS, Unavailable, closeness, fresh, gradients, loss_at
from torchstash_bench.ecosystem_steps import along_stock

#: The least cosine to stock of the gradient ``quant.auto`` (a budget of 2 bits) gives once it
#: has allocated. Measured on 2026-11-28: 0.76 (EfficientNet-B0, torchvision's ViT-B/16) to
#: 1.00 (ConvNeXt-atto); EfficientNet-B0 was 0.36 while its SiLU inputs (batch norms' outputs)
#: were allocated 2 bits, against 0.63 for ``quant.int2`` at the same bytes.
MIN_COSINE = 0.7
STEPS = 4  # the first measures, the second allocates


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_allocated_gradient_stays_close_to_stocks(name: str) -> None:
    spec = MODELS[name]
    try:
        model = fresh(spec)
    except Unavailable as e:
        pytest.skip(str(e))
    loss_at(spec, model, 0).backward()
    want = gradients(model)
    model = fresh(spec)
    with ts.apply(model, "quant.auto"):
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            loss_at(spec, model, 0).backward()
    whole, _ = closeness(want, gradients(model))
    assert whole >= MIN_COSINE, (name, whole)


def test_the_trajectory_tool_takes_each_gradient_at_stocks_weights() -> None:
    """``python -m torchstash_bench.ecosystem_steps`` (the README's EfficientNet-B0 figures):
    a lossless strategy's gradient at stock's weights is stock's at every step, while stock's
    weights move."""
    spec = MODELS["hf-gpt2"]
    try:
        fresh(spec)
    except Unavailable as e:
        pytest.skip(str(e))
    lossless, lossy = along_stock("hf-gpt2", ["none", "quant.int2"], steps=4, lr=0.1)
    for k in ("first", "least", "most"):
        assert lossless[k] == pytest.approx(1.0, abs=1e-12)
    assert lossless["ratio"] == 1.0
    assert 0.5 < lossy["least"] <= lossy["most"] < 1.0 - 1e-6
