"""quant strategies: options, unbiasedness, op-aware exact codes, savings and gradients."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import torchstash as ts
from torchstash import Site
from torchstash.errors import OptionError
from torchstash.testing.models import zoo
from torchstash_quant import GroupQuantizer, MesaQuantizer

ZOO = {e.name: e for e in zoo("tiny")}


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("quant", {"bits": 3}, r"bits=3 .*1, 2, 4, 8"),
        ("quant.int4", {"group_size": 0}, r"group_size=0 must be a positive integer"),
        ("quant.int2", {"group_size": -5}, r"group_size=-5"),
        ("quant.mesa", {"bits": 4}, r"bits=4 .*8-bit"),
        ("quant.mesa", {"ema_decay": 1.5}, r"ema_decay=1.5 .*\[0, 1\)"),
        ("quant.int8", {"norm_bits": "high"}, r"norm_bits='high'"),
        ("quant.int2", {"attn_bits": 3}, r"attn_bits=3 must be 1, 2, 4, 8 or None"),
        ("quant.int8", {"bitz": 2}, r"It accepts: group_size, stochastic, seed, norm_bits"),
        ("quant.int8", {"stochastic": "no"}, r"stochastic='no' must be True or False"),
        ("quant.int4", {"seed": "abc"}, r"seed='abc' must be an integer or None"),
        ("quant.mesa", {"stochastic": "no"}, r"stochastic='no' must be True or False"),
        ("quant.mesa", {"derive": "yes"}, r"derive='yes' must be True or False"),
        ("quant.auto", {"derive": "no"}, r"derive='no' must be True or False"),
        ("quant.auto", {"interval": 2.5}, r"interval=2.5 must be an integer"),
        ("quant.L2", {"seed": 1.5}, r"seed=1.5 must be an integer or None"),
    ],
)
def test_bad_options_name_the_option(
    strategy: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(OptionError, match=message):
        ts.apply(nn.Linear(4, 4), strategy, **options)


@pytest.mark.parametrize(
    ("spec", "option"),
    [("quant.int8:stochastic=no", "stochastic='no'"), ("quant.int2:seed=abc", "seed='abc'")],
)
def test_command_line_options_are_checked(spec: str, option: str) -> None:
    """``--strategy quant.int8:stochastic=no`` was accepted as stochastic (a non-empty string)."""
    from torchstash.policy import parse_spec

    name, options = parse_spec(spec)
    with pytest.raises(OptionError, match=rf"'{name}': option {option}"):
        ts.apply(nn.Linear(4, 4), name, **options)


def is_unbiased(compress_decompress: object, x: torch.Tensor, draws: int = 300) -> bool:
    """Pooled z-scores of the total error, over each of 16 slices of the elements, all below 5.

    Per element, a sample can miss a rare rounding (a value just above a level): pooling
    the errors of a slice keeps the test exact in distribution and still catches a bias.
    """
    ys = torch.stack([compress_decompress(x) for _ in range(draws)]).double()  # type: ignore[operator]
    err = ys - x.double()
    for part in torch.arange(x.numel()).chunk(16):
        e = err.reshape(draws, -1)[:, part]
        var = e.var(dim=0).sum() * draws
        total = e.sum()
        if var == 0:
            if total != 0:
                return False
            continue
        if abs(float(total / var.sqrt())) > 5:
            return False
    return True


@pytest.mark.parametrize("scale", [1.0, 1e-40], ids=["normal", "subnormal"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits: int, scale: float) -> None:
    x = torch.randn(2048) * scale
    q = GroupQuantizer(bits)
    assert is_unbiased(lambda t: q.decompress(q.compress(t, Site())), x)
    # and the test can fail: round-to-nearest is biased
    rtn = GroupQuantizer(bits, stochastic=False)
    assert not is_unbiased(lambda t: rtn.decompress(rtn.compress(t, Site())), x)


def _linear_weight_cosine(strategy: str, scale: float) -> float:
    """A Linear's weight-gradient cosine to stock's, its input ``randn * scale`` (in float64,
    scaled up: a gradient of subnormals has a norm of 0 in float32)."""
    torch.manual_seed(0)
    stock, model = nn.Linear(64, 64), nn.Linear(64, 64)
    model.load_state_dict(stock.state_dict())
    x = torch.randn(64, 64) * scale
    ts.apply(model, strategy)
    grads = []
    for m in (stock, model):
        (m(x) * torch.linspace(-1, 1, 64 * 64).view(64, 64)).sum().backward()
        grads.append(m.weight.grad.double().flatten() * 2.0**140)
    return float(F.cosine_similarity(*grads, dim=0))


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.int4", "quant.fp8", "quant.mesa"])
def test_subnormal_activations_are_coded_as_closely_as_normal_ones(strategy: str) -> None:
    """Input ``randn * 1e-40``, all subnormal: int8 and int4 gave a weight-gradient cosine of
    0.95 (bfloat16's subnormal steps, multiples of 2**-133, against a range of about 5e-40);
    their groups are now coded scaled by 2**126, as close as on ``randn`` (int8 0.99996,
    int4 0.990, fp8 0.9997)."""
    normal = _linear_weight_cosine(strategy, 1.0)
    assert _linear_weight_cosine(strategy, 1e-40) > normal - 0.005


def test_mesa_unbiased_inside_its_range() -> None:
    x = torch.randn(16, 4, 32, 8)
    q = MesaQuantizer()
    site = Site(module="attn", op="matmul", role="input")
    assert is_unbiased(lambda t: q.decompress(q.compress(t, site)), x, draws=200)


def test_mesa_never_wraps_nor_clamps_and_keeps_state_out_of_the_model() -> None:
    q = MesaQuantizer(ema_decay=0.9)
    site = Site(module="blk", op="gelu", role="input")
    x = torch.rand(8, 64, 32)  # values in [0, 1)
    q.decompress(q.compress(x, site))
    big = x * 10  # beyond the running range: Mesa's codes wrapped past 255
    y = q.decompress(q.compress(big, site))
    step = 10.0 / 252
    assert float((y - big).abs().max()) <= step * 1.01  # represented, not wrapped or clamped
    _lo, hi = q.state[site.key]
    assert 1.0 < float(hi.max()) < 10.0  # the running estimate moved toward the new range
    model = ZOO["vit"].build()
    keys = list(model.state_dict())
    with ts.apply(model, "quant.mesa"):
        x_img, t = ZOO["vit"].batch(2, torch.device("cpu"))
        ZOO["vit"].loss(model, x_img, t).backward()
        assert list(model.state_dict()) == keys


def test_relu_sign_bits_are_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8), nn.ReLU(inplace=True))
    # A frozen next weight: the Linear saves no input, so only the ReLU holds its result (a
    # tensor that another op saves as is is held once, as is: see the core's engine).
    model[2].weight.requires_grad_(False)
    x = torch.randn(32, 64)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    with ts.apply(model, policy=[{"op": "relu", "strategy": "quant.int1"}], min_bytes=0) as h:
        model(x).sum().backward()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(ref, got))
    relu = h.tally.rows["1"]
    assert relu.compressed == 1 and relu.stored_bytes == 32 * 256 // 8


def test_sign_bits_never_stand_in_for_values() -> None:
    """The ReLU's result is also the next Linear's input: that one must keep its values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(64, 64)
    model(x).square().sum().backward()
    ref = model[2].weight.grad.clone()
    model.zero_grad()
    with ts.apply(model, "quant.int8", min_bytes=0):
        model(x).square().sum().backward()
    cos = torch.nn.functional.cosine_similarity(
        ref.flatten(), model[2].weight.grad.flatten(), dim=0
    )
    assert cos > 0.999


def test_dropout_masks_take_one_bit_and_stay_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Dropout(0.5), nn.Linear(512, 8))
    x = torch.randn(64, 64)
    torch.manual_seed(1)
    model(x).sum().backward()
    ref = model[0].weight.grad.clone()
    model.zero_grad()
    torch.manual_seed(1)
    with ts.apply(model, policy=[{"op": "dropout", "strategy": "quant.int2"}], min_bytes=0) as h:
        model(x).sum().backward()
    assert torch.equal(ref, model[0].weight.grad)  # the mask came back exactly
    drop = h.tally.rows["1"]
    assert drop.compressed == 1
    assert (
        drop.stored_bytes <= drop.raw_bytes // 8 // drop.raw_bytes.bit_length() + 64 * 512 // 8 + 4
    )


def test_bool_tensors_take_one_bit() -> None:
    mask = torch.rand(64, 512) > 0.3
    with ts.stash("quant.int8", min_bytes=0) as s:
        x = torch.randn(64, 512, requires_grad=True)
        y = x.masked_fill(mask, 0.0).relu()
    y.sum().backward()
    (row,) = s.tally.rows.values()
    assert row.ops == {"masked_fill": 1, "relu": 1}
    assert row.raw_bytes == 64 * 512 * (1 + 4)  # a bool mask and a float32 ReLU result
    assert row.stored_bytes == 2 * 64 * 512 // 8  # one bit each


def test_batchnorm_on_small_maps_is_grouped_by_channel_over_the_batch() -> None:
    """A 2x2 plane is too short for a group; one channel over the batch is what BatchNorm
    normalizes, so its groups hold exactly that (stored channel-major)."""
    from torchstash_quant.strategies import quant

    torch.manual_seed(0)
    x = torch.randn(16, 64, 2, 2) * torch.logspace(-2, 2, 64).view(1, 64, 1, 1)
    codec = quant(2)
    site = Site(module="bn", op="batch_norm", role="input")
    packed = codec.compress(x, site)
    assert packed.meta["channel_major"] and packed.meta["group_size"] == 64
    assert packed.shape == x.shape
    y = codec.decompress(packed)
    assert y.shape == x.shape
    # every channel's error is relative to its own scale, from 0.01 to 100
    err = (y - x).abs().amax(dim=(0, 2, 3)) / x.abs().amax(dim=(0, 2, 3))
    assert float(err.max()) < 1.0
    bn = nn.BatchNorm2d(64)
    r = torch.randn_like(x)  # a loss whose gradient does not vanish under normalization
    ref_in = x.clone().requires_grad_()
    (bn(ref_in * 1.0) * r).sum().backward()
    ref = ref_in.grad.clone()
    got_in = x.clone().requires_grad_()
    # norm_bits=None: no wider fallback codec (unaligned 256-groups here gave cosine -0.12)
    with ts.stash("quant.int4", min_bytes=0, norm_bits=None) as s:
        out = bn(got_in * 1.0)
    (out * r).sum().backward()
    assert F.cosine_similarity(ref.flatten(), got_in.grad.flatten(), dim=0) > 0.99
    assert sum(r.compressed for r in s.tally.rows.values()) >= 1


def _attention_rows(model: nn.Module, **options: object) -> tuple[dict[str, int], torch.Tensor]:
    torch.manual_seed(0)
    idx = torch.randint(0, 128, (2, 16))
    with ts.stash("quant.int2", min_bytes=0, seed=1, **options) as s:
        model(idx).square().mean().backward()
    stored = {r.module_type: r.stored_bytes for r in s.tally.rows.values()}
    shared = sum(r.shared for r in s.tally.rows.values() if r.module_type == "SelfAttention")
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return {**stored, "shared": shared}, grad


def test_attn_bits_widens_attention_only() -> None:
    from torchstash.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(dim=64, layers=1, ctx=16)
    base, _ = _attention_rows(model, attn_bits=None)
    wide, _ = _attention_rows(model, attn_bits=8)
    # v: 2 bits to 8 (q and k are at 8 bits either way, the map recomputed from them)
    tokens, dim = 2 * 16, 64
    assert wide["SelfAttention"] - base["SelfAttention"] == tokens * dim * (8 - 2) // 8
    for kind in ("Linear", "GELU", "LayerNorm"):
        assert wide[kind] == base[kind], kind
    assert wide["shared"] >= 1  # the map, saved by softmax and by attn @ v, stored once


def test_attn_bits_brings_gradients_closer() -> None:
    from torchstash.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(dim=64, layers=1, ctx=16)
    torch.manual_seed(0)
    idx = torch.randint(0, 128, (2, 16))
    model(idx).square().mean().backward()
    exact = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    error = {}
    for bits in (None, 8):
        errs = []
        for seed in range(4):
            with ts.stash("quant.int2", min_bytes=0, seed=seed, attn_bits=bits):
                model(idx).square().mean().backward()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            errs.append(float((got - exact).square().sum() / exact.square().sum()))
        error[bits] = sum(errs) / len(errs)
    assert error[8] < error[None]


def test_int2_defaults_recompute_norm_and_gelu_outputs() -> None:
    """``quant.int2``: LayerNorm inputs at 4 bits stand in for the projections' inputs, GELU
    inputs (values at 2 bits) for fc2's; ``v`` at 4 bits, the map recomputed from ``q`` and
    ``k``. A BatchNorm's input, whose
    output no op recomputes, keeps 2 bits."""
    from torchstash.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(dim=64, layers=1, ctx=16)
    idx = torch.randint(0, 128, (2, 16))
    with ts.apply(model, "quant.int2", min_bytes=0, seed=1) as h:
        model(idx).square().mean().backward()
    model.zero_grad(set_to_none=True)
    rows = h.tally.rows
    derived = {k for k, r in rows.items() if r.derived}
    recomputed = {"blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.0.mlp.2", "head"}
    assert recomputed | {"blocks.0.attn"} <= derived  # and the attention map
    assert all(rows[k].stored_bytes == 0 for k in recomputed)
    ln = rows["blocks.0.ln1"]
    assert ln.stored_bytes > 16 * 2 * 64 * 4 // 8  # 4-bit codes, not 2
    wide, _ = _attention_rows(model)
    narrow, _ = _attention_rows(model, attn_bits=None)
    # v at 4 bits, not 2 (q and k at 8 bits either way)
    assert wide["SelfAttention"] - narrow["SelfAttention"] == 2 * 16 * 64 * (4 - 2) // 8

    bn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 18, 18)
    with ts.stash("quant.int2", min_bytes=0) as s:
        bn(x).sum().backward()
    row = next(r for r in s.tally.rows.values() if r.module_type == "BatchNorm2d")
    assert row.derived == 0 and row.stored_bytes < 4 * 8 * 16 * 16 * 3 // 8


def test_mesa_with_derive_recomputes_what_int8_recomputes() -> None:
    """``quant.mesa`` codes every saved tensor (Mesa's scheme); with ``derive=True`` the
    outputs a later op saves (a LayerNorm's, a GELU's) are recomputed from the coded inputs
    as under ``quant.int8``: the same rows keep no bytes, and the gradients stay near stock's."""
    from torchstash.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(dim=64, layers=1, ctx=16)
    idx = torch.randint(0, 128, (2, 16))
    model(idx).square().mean().backward()
    stock = [p.grad.clone() for p in model.parameters()]
    stored, grads = {}, {}
    for derive in (False, True):
        model.zero_grad(set_to_none=True)
        with ts.apply(model, "quant.mesa", min_bytes=0, seed=1, derive=derive) as h:
            model(idx).square().mean().backward()
        rows = h.tally.rows
        stored[derive] = sum(r.stored_bytes for r in rows.values())
        grads[derive] = torch.cat([p.grad.flatten() for p in model.parameters()])
        recomputed = {"blocks.0.attn.qkv", "blocks.0.mlp.2"}
        derived = {k for k, r in rows.items() if r.derived}
        if derive:
            assert recomputed <= derived
            assert all(rows[k].stored_bytes == 0 for k in recomputed)
        else:
            assert not recomputed & derived
    assert stored[True] < 0.75 * stored[False]
    ref = torch.cat([g.flatten() for g in stock]).double()
    for g in grads.values():
        assert torch.nn.functional.cosine_similarity(g.double(), ref, dim=0) > 0.999


#: saves of each kind :class:`~torchstash_quant.opaware.OpAware` codes its own way
_KINDS = {
    "values": (Site(module="fc", op="linear", role="input"), (8, 512)),
    "rows": (Site(module="ln", op="layer_norm", role="input"), (8, 256)),
    "channel_major": (Site(module="bn", op="batch_norm", role="input"), (16, 64, 2, 2)),
    "sign": (Site(module="act", op="relu", role="output"), (8, 512)),
    "silu": (Site(module="act", op="silu", role="input"), (8, 512)),
    "mask": (Site(module="drop", op="dropout", role="output"), (8, 512)),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize(
    "strategy", ["quant.int8", "quant.int4", "quant.int2", "quant.int1", "quant.fp8", "quant.mesa"]
)
def test_a_record_says_which_code_decodes_it(strategy: str, kind: str) -> None:
    """A record names its decoder (:data:`~torchstash_quant.opaware.DECODERS`), or is its
    value codec's own: another strategy's compressor decodes a group code as its maker
    does, and the encoder a replayed save calls codes as ``compress`` does."""
    from torchstash_quant.opaware import CENTERED, DECODERS

    site, shape = _KINDS[kind]
    torch.manual_seed(0)
    x = torch.randn(shape)
    if kind == "mask":
        x = (torch.rand(shape) > 0.3).float() / 0.7
    options = {"seed": 5} if strategy.startswith("quant.int") else {}  # fp8 rounds to nearest
    maker = ts.registry.REGISTRY.get(strategy).create(**options)
    twin = ts.registry.REGISTRY.get(strategy).create(**options)
    packed = maker.compress(x, site)
    assert packed.codec in DECODERS or packed.codec in (CENTERED, maker.values.name), packed.codec
    again = twin.encoder(x, site)(x)  # the same seed, decided once
    assert again.codec == packed.codec and again.meta == packed.meta
    for key, value in packed.tensors.items():
        torch.testing.assert_close(again.tensors[key], value, rtol=0, atol=0)
    y = maker.decompress(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    if packed.codec in DECODERS:  # the record alone decides: any quant compressor decodes it
        other = ts.registry.REGISTRY.get("quant.int2").create()
        torch.testing.assert_close(other.decompress(packed), y, rtol=0, atol=0)


def test_quant_options_are_a_typed_config_checked_once_made() -> None:
    """``quant``'s options are :class:`QuantConfig`'s fields: a config is valid once made
    (each error names its option), the fixed widths take every option but ``bits``, and
    their values are checked against the config's annotations before anything is built."""
    from torchstash_quant.strategies import AutoConfig, QuantConfig

    assert QuantConfig(4).resolved("norm_bits", {4: 8}) == 8
    for options, option in [
        ({"bits": 3}, "bits=3"),
        ({"group_size": 0}, "group_size=0"),
        ({"norm_bits": "wide"}, "norm_bits='wide'"),
        ({"norm_bits": 3}, "norm_bits=3"),
        ({"stochastic": "no"}, "stochastic='no'"),
        ({"seed": 1.5}, "seed=1.5"),
        ({"deriv_bits": 1}, "deriv_bits=1"),
        ({"attn_bits": 5}, "attn_bits=5"),
        ({"act_bits": "x"}, "act_bits='x'"),
    ]:
        with pytest.raises(OptionError, match=re.escape(option)):
            QuantConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=re.escape("deriv_bits=3")):
        AutoConfig(deriv_bits=3)
    int8 = ts.registry.REGISTRY.get("quant.int8")
    assert "bits" not in int8.options() and "act_bits" in int8.options()
    with pytest.raises(OptionError, match=r"option stochastic='no' must be True or False"):
        int8.create(stochastic="no")
    with pytest.raises(OptionError, match=r"option interval=2.5 must be an integer"):
        ts.registry.REGISTRY.get("quant.auto").create(interval=2.5)
