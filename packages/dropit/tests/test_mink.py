"""dropit.mink / dropit.random: what is dropped, what stays exact, what is stored, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import torchstash as ts
from torchstash.errors import OptionError
from torchstash_dropit import MinK
from torchstash_dropit.storage import BITMAP, DENSE, OFFSETS, cheapest, cost


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def grads(model: nn.Module, x: torch.Tensor, strategy: str | None = None, **options: object):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()  # a leaf that requires grad is never compressed: go through
    if strategy is None:  # an op, as a layer's input in a real model does
        model(x * 1.0).square().mean().backward()
        tally = None
    else:
        with ts.stash(strategy, **options) as s:
            out = model(x * 1.0)
        out.square().mean().backward()
        tally = s.tally
    return {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone(), tally


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gamma": 1.0}, r"gamma=1.0 must be a number in \[0, 1\)"),
        ({"gamma": -0.1}, r"gamma=-0.1"),
        ({"gamma": "most"}, r"gamma='most'"),
        ({"scope": "batch"}, r"scope='batch' must be one of 'tensor', 'sample', 'row', 'feature'"),
        ({"storage": "coo"}, r"storage='coo'"),
        ({"min_numel": 0}, r"min_numel=0"),
        ({"fill": "median"}, r"fill='median' must be one of 'mean', 'zero'"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        ts.apply(nn.Linear(4, 4), "dropit.mink", **options)


def test_random_p_is_checked() -> None:
    with pytest.raises(OptionError, match=r"dropit.random: option p=1.5"):
        ts.apply(nn.Linear(4, 4), "dropit.random", p=1.5)


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("dropit.random", {"seed": "abc"}, r"seed='abc' must be an integer or None"),
        ("dropit.random", {"min_numel": "1"}, r"min_numel='1' must be an integer"),
        ("dropit.mink", {"exact": "no"}, r"exact='no' must be True or False"),
    ],
)
def test_text_for_a_flag_or_number_is_an_error(
    strategy: str, options: dict[str, object], message: str
) -> None:
    """As options come from a command line (``dropit.random:seed=abc``) or a TOML table."""
    with pytest.raises(OptionError, match=message):
        ts.apply(nn.Linear(4, 4), strategy, **options)


def test_gamma_zero_is_exact() -> None:
    model, x = mlp(), torch.randn(8, 16, 64)
    ref, ref_x, _ = grads(model, x)
    got, got_x, tally = grads(model, x, "dropit.mink", gamma=0.0)
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    assert torch.equal(ref_x, got_x)
    assert tally is not None and tally.stored_bytes == tally.raw_bytes


@pytest.mark.parametrize("fill", ["mean", "zero"])
@pytest.mark.parametrize("scope", ["tensor", "sample", "row", "feature"])
def test_weight_gradient_is_from_the_kept_values_and_input_gradient_exact(
    scope: str, fill: str
) -> None:
    model, x = mlp(), torch.randn(8, 16, 64) + torch.linspace(-1, 1, 64)  # features off zero
    ref, ref_x, _ = grads(model, x)
    got, got_x, _tally = grads(model, x, "dropit.mink", gamma=0.9, scope=scope, fill=fill)
    assert torch.allclose(ref_x, got_x, rtol=1e-5, atol=1e-7)  # the input gradient never reads x
    for n in ("0.bias", "2.bias"):
        assert torch.allclose(ref[n], got[n], rtol=1e-5, atol=1e-7)
    # the first layer's weight gradient, from the kept top 10% of x (and the dropped means)
    flat = x.reshape(-1, 64)
    segments = {
        "tensor": flat.reshape(1, -1),
        "sample": x.reshape(8, -1),
        "row": flat,
        "feature": flat.t(),
    }[scope]
    k = math.ceil(0.1 * segments.shape[1])
    keep = torch.zeros_like(segments, dtype=torch.bool)
    keep.scatter_(1, segments.abs().topk(k, dim=1).indices, True)
    keep = keep.t() if scope == "feature" else keep.reshape(-1, 64)
    means = (flat * ~keep).sum(0) / (~keep).sum(0)  # each feature's dropped entries
    seen = torch.where(keep, flat, means if fill == "mean" else 0.0)
    model.zero_grad(set_to_none=True)
    hidden = model[0](x)
    g = torch.autograd.grad(model[2](model[1](hidden)).square().mean(), hidden)[0]
    expected = g.reshape(-1, 256).t() @ seen
    assert torch.allclose(got["0.weight"], expected, rtol=1e-4, atol=1e-6)
    cos = F.cosine_similarity(ref["0.weight"].flatten(), got["0.weight"].flatten(), dim=0)
    assert 0.5 < float(cos) < 1.0


def test_mean_fill_beats_zeros_on_offset_features() -> None:
    """Features with a mean off zero (a GELU's output): zeros bias the weight gradient."""
    model = mlp()
    x = torch.randn(8, 16, 64) * 0.3 + torch.linspace(0.5, 2.0, 64)
    ref, _, _ = grads(model, x)
    errors = {}
    for fill in ("mean", "zero"):
        got, _, _tally = grads(model, x, "dropit.mink", gamma=0.9, fill=fill)
        errors[fill] = float((got["0.weight"] - ref["0.weight"]).norm() / ref["0.weight"].norm())
    assert errors["mean"] < 0.5 * errors["zero"], errors


def test_storage_costs_and_choice() -> None:
    n = 1 << 20
    assert cost(BITMAP, n, n // 10, 2) == n // 8 + n // 10 * 2
    assert cost(OFFSETS, n, n // 10, 2) == n // 10 * 4 + 4 * 16
    assert cheapest(n, n // 10, 2) == BITMAP  # gamma 0.9
    assert cheapest(n, n // 100, 2) == OFFSETS  # gamma 0.99
    assert cheapest(n, n - n // 100, 2) == DENSE  # gamma 0.01 in fp16: nothing is smaller
    for gamma in (0.1, 0.3, 0.5, 0.67, 0.9):  # DropIT's int32 indices: above dense below ~0.67
        kept = math.ceil((1 - gamma) * n)
        assert min(cost(BITMAP, n, kept, 2), cost(OFFSETS, n, kept, 2)) < 2 * n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_saved_bytes_at_gamma_09(dtype: torch.dtype) -> None:
    x = torch.randn(64, 128, 256).to(dtype)
    layer = nn.Linear(256, 256).to(dtype)
    x.requires_grad_()
    with ts.stash("dropit.mink", gamma=0.9) as s:
        layer(x * 1.0).sum().backward()
    row = next(r for r in s.tally.rows.values() if r.module_type == "Linear")
    assert row.stored_bytes <= 0.17 * row.raw_bytes


def test_offsets_at_high_gamma_round_trip() -> None:
    from torchstash.testing.contract import SITE

    x = torch.randn(300, 1000) + torch.linspace(-1, 1, 1000)
    c = MinK(gamma=0.99, scope="tensor", min_numel=1, fill="zero")
    assert c.plan(x)[2] == OFFSETS
    y = c.decompress(c.compress(x, SITE))
    kept = y != 0
    assert int(kept.sum()) == math.ceil(0.01 * x.numel())
    assert torch.equal(y[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())
    # the mean fill: the same kept entries, each feature's dropped mean elsewhere
    mean = MinK(gamma=0.99, scope="tensor", min_numel=1, fill="mean")
    packed = mean.compress(x, SITE)
    assert isinstance(packed, ts.Packed) and packed.meta["form"] == OFFSETS
    z = mean.decompress(packed)
    means = (x * ~kept).sum(0) / (~kept).sum(0)
    assert torch.equal(z[kept], x[kept])
    torch.testing.assert_close(z, torch.where(kept, x, means))


def test_nan_and_inf_are_kept_and_reach_the_weight_gradient() -> None:
    model, x = mlp(), torch.randn(8, 16, 64)
    x[0, 0, 0], x[3, 2, 1] = float("nan"), float("inf")
    got, _got_x, _ = grads(model, x, "dropit.mink", gamma=0.9)
    assert not got["0.weight"].isfinite().all()


def test_eval_mode_and_no_grad_do_no_work() -> None:
    model, x = mlp(), torch.randn(8, 16, 64)
    model.eval()
    ref, _, _ = grads(model, x)
    got, _, tally = grads(model, x, "dropit.mink", gamma=0.9)
    assert tally is not None
    assert sum(r.compressed for r in tally.rows.values()) == 0
    assert any("eval mode" in why for r in tally.rows.values() for why in r.declined)
    for n in ref:
        assert torch.equal(ref[n], got[n])
    model.train()
    with ts.stash("dropit.mink") as s, torch.no_grad():
        model(x)
    assert s.tally.raw_bytes == 0


def test_retain_graph_second_backward_matches() -> None:
    model, x = mlp(), torch.randn(8, 16, 64)
    with ts.stash("dropit.mink", gamma=0.9):
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = model[0].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(first, model[0].weight.grad)


class MyLinear(nn.Linear):
    pass


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: weight (nx, nf), addmm on the flattened tokens."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


@pytest.mark.parametrize(
    "layer",
    [
        MyLinear(64, 64),
        Conv1D(64, 64),
        nn.Conv1d(64, 64, 3),
    ],
    ids=["subclass", "hf-conv1d", "conv1d"],
)
def test_linear_type_layers_are_reached(layer: nn.Module) -> None:
    x = torch.randn(16, 64, 64, requires_grad=True)
    with ts.stash("dropit.mink", gamma=0.9) as s:
        layer(x * 1.0).sum().backward()
    assert sum(r.compressed for r in s.tally.rows.values()) == 1


def test_multihead_attention_projections_are_reached() -> None:
    """nn.MultiheadAttention calls F.linear inside one functional: its in- and out-projection
    inputs are thinned, the input gradient and every bias gradient stay exact."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(4, 32, 64)

    def run(strategy: str | None) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
        mha.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        options = {"gamma": 0.9} if strategy else {}
        with ts.stash(strategy or "none", **options) as s:
            h = xs * 1.0  # one tensor as query, key and value: the packed in-projection
            y, _ = mha(h, h, h)
        y.square().mean().backward()
        return {n: p.grad.clone() for n, p in mha.named_parameters()}, xs.grad.clone(), s.tally

    ref, ref_x, _ = run(None)
    got, got_x, tally = run("dropit.mink")
    assert sum(r.compressed for r in tally.rows.values()) == 2  # type: ignore[attr-defined]
    torch.testing.assert_close(got_x, ref_x)
    for n in ("in_proj_bias", "out_proj.bias"):
        torch.testing.assert_close(got[n], ref[n])
    for n in ("in_proj_weight", "out_proj.weight"):
        assert not torch.equal(got[n], ref[n])


def test_conv_after_relu_stores_no_extra_copy() -> None:
    """The ReLU's output is the conv's input: held as is by the ReLU, never copied beside."""
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3))
    x = torch.randn(4, 8, 32, 32)
    with ts.stash("none") as stock:
        model(x).sum().backward()
    with ts.stash("dropit.mink", gamma=0.9) as s:
        model(x).sum().backward()
    assert s.tally.stored_bytes <= stock.tally.stored_bytes


def test_bf16_autocast_is_detected() -> None:
    model, x = mlp(), torch.randn(8, 16, 64, requires_grad=True)
    with ts.stash("dropit.mink", gamma=0.9) as s, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x * 1.0).float().square().mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert x.grad is not None
    # both inputs, cast to bfloat16, are thinned; the cast weights (needed for the input
    # gradient) are the parameters in bf16: the core keeps them as they are, like weights
    assert sum(r.compressed for r in s.tally.rows.values()) == 2
    assert s.tally.param_refs >= 2


def test_random_is_unbiased() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    from torchstash.testing.contract import SITE
    from torchstash_dropit import RandomDrop

    c = RandomDrop(p=0.75, min_numel=1, seed=3)
    draws = torch.stack([c.decompress(c.compress(x, SITE)) for _ in range(400)]).double()
    kept = (draws != 0).double().mean(0)
    assert abs(float(kept.mean()) - 0.25) < 1e-6  # exactly k per draw
    err = (draws.mean(0) - x.double()).reshape(16, -1).sum(1)
    sd = (draws.var(0) / 400).reshape(16, -1).sum(1).sqrt()
    assert float((err / sd).abs().max()) < 5


def test_tiny_tensors_are_declined() -> None:
    layer = nn.Linear(8, 8)
    with ts.stash("dropit.mink", min_bytes=0) as s:
        layer(torch.randn(4, 8, requires_grad=True) * 1.0).sum().backward()
    assert any("min_numel" in why for r in s.tally.rows.values() for why in r.declined)
