"""GELU/SiLU derivative codes: the restored input gives the coded derivative exactly, the code
beats quantizing the input, non-finite inputs stay NaN, and other ops never see the code."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import torchstash as ts
from torchstash.errors import OptionError
from torchstash_quant.derivs import derivative, pack_derivative, table, unpack_derivative
from torchstash_quant.strategies import quant

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FUNCS = [("gelu", "none"), ("gelu", "tanh"), ("silu", "none")]


def relative_error(op: str, approximate: str, x: torch.Tensor, restored: torch.Tensor) -> float:
    d = derivative(op, x.double(), approximate)
    got = derivative(op, restored, approximate).double()
    return float((got - d).norm() / d.norm())


@pytest.mark.parametrize(("op", "approximate"), FUNCS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [True, False])
def test_restored_inputs_give_the_levels_exactly(
    op: str, approximate: str, bits: int, dtype: torch.dtype, stochastic: bool
) -> None:
    t = table(op, bits, dtype, torch.device("cpu"), approximate, stochastic)
    assert bool((t.levels.diff() > 0).all()) and t.inputs.numel() == 2**bits
    # every level is there unless the dtype cannot tell neighbouring inputs apart
    assert t.levels.numel() == 2**bits - 1 or (bits == 8 and dtype != torch.float32)
    assert t.levels.numel() > 2 ** (bits - 1)
    got = derivative(op, t.inputs[: t.levels.numel()], approximate).double()
    assert torch.equal(got, t.levels)
    assert t.inputs[-1].isnan()


@pytest.mark.parametrize(("op", "approximate"), FUNCS)
@pytest.mark.parametrize(("bits", "bound"), [(2, 0.26), (4, 0.05), (8, 0.005)])
def test_code_rounds_to_the_nearest_level(
    op: str, approximate: str, bits: int, bound: float
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4096) * 1.5
    packed = pack_derivative(x, op, bits, approximate)
    assert packed.nbytes() == 4096 * bits // 8
    restored = unpack_derivative(packed)
    t = table(op, bits, x.dtype, x.device, approximate, stochastic=False)
    d = derivative(op, x, approximate).double()
    nearest = t.levels[(d[:, None] - t.levels[None, :]).abs().argmin(1)]
    coded = derivative(op, restored, approximate).double()
    # ties at a cut may go either way in the input's precision
    assert float((coded - nearest).abs().max()) <= float(t.levels.diff().max()) / 2 + 1e-6
    assert relative_error(op, approximate, x, restored) < bound


@pytest.mark.parametrize(("op", "approximate"), FUNCS)
@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_code_is_unbiased_and_brackets_the_derivative(
    op: str, approximate: str, bits: int
) -> None:
    """Mean of the coded derivative over draws against f'(x): pooled z-scores below 5 for each
    of 8 slices; and the test can fail: the nearest-level code is biased."""
    torch.manual_seed(0)
    x = torch.randn(2048) * 1.5
    d = derivative(op, x, approximate).double()
    t = table(op, bits, x.dtype, x.device, approximate, stochastic=True)

    def draws(seed: int | None) -> torch.Tensor:
        packed = pack_derivative(x, op, bits, approximate, seed)
        return derivative(op, unpack_derivative(packed), approximate).double()

    coded = torch.stack([draws(seed) for seed in range(200)])
    gap = t.levels.diff().max()
    assert float((coded - d).abs().max()) <= float(gap) + 1e-6  # one of its two levels

    def unbiased(samples: torch.Tensor) -> bool:
        err = samples - d
        for part in torch.arange(x.numel()).chunk(8):
            e = err[:, part]
            var = e.var(dim=0).sum() * e.shape[0]
            z = float(e.sum() / var.sqrt()) if var > 0 else float(e.sum() != 0) * 1e9
            if abs(z) > 5:
                return False
        return True

    assert unbiased(coded)
    nearest = draws(None).expand(200, -1) + 1e-3 * torch.randn(200, x.numel(), dtype=torch.float64)
    assert not unbiased(nearest)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs_give_nan_like_stock(dtype: torch.dtype) -> None:
    x = torch.randn(512, dtype=dtype)
    x[3], x[10], x[77] = float("nan"), float("inf"), -float("inf")
    restored = unpack_derivative(pack_derivative(x, "gelu", 2, seed=7))
    d = derivative("gelu", restored)
    assert torch.equal(d.isnan(), derivative("gelu", x).isnan())
    assert int(d.isnan().sum()) == 3


@pytest.mark.parametrize("bits", [2, 4])
def test_derivative_code_beats_quantizing_the_input(bits: int) -> None:
    """Measured through autograd: the input gradient of GELU under int``bits``."""
    torch.manual_seed(0)
    x = (torch.randn(64, 512) * 1.5).requires_grad_()
    g = torch.randn(64, 512)
    (ref,) = torch.autograd.grad(F.gelu(x), x, g)
    errors = {}
    for deriv_bits in (bits, None):
        with ts.stash(f"quant.int{bits}", deriv_bits=deriv_bits, act_bits=None, min_bytes=0):
            y = F.gelu(x * 1.0)  # an activation (a leaf that requires grad counts as a weight)
        (got,) = torch.autograd.grad(y, x, g)
        errors[deriv_bits] = float((got - ref).norm() / ref.norm())
    assert errors[bits] < errors[None] / 2, errors


def test_gelu_tanh_is_coded_with_its_own_derivative() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 4))
    x = torch.randn(64, 32)
    with ts.apply(model, "quant.int8", deriv_bits=8, min_bytes=0) as h:
        model(x).sum().backward()
    (entry,) = [r for r in h.tally.rows.values() if r.module_type == "GELU"]
    assert entry.compressed == 1 and entry.stored_bytes == 64 * 256
    packed = pack_derivative(torch.randn(8), "gelu", 4, "tanh")
    assert packed.meta["approximate"] == "tanh"


def test_deriv_bits_auto_follows_the_width() -> None:
    from torchstash_quant.strategies import DERIV_DEFAULT, auto, quant

    for bits, width in DERIV_DEFAULT.items():
        derivs = quant(bits).derivs
        assert (derivs.bits if derivs else None) == width
    assert auto(budget=2, derive=False).derivs is not None
    assert auto(budget=4, derive=False).derivs is None
    assert auto(budget=2).derivs is None  # recomputing GELU outputs needs their values


def test_silu_and_gelu_inputs_take_deriv_bits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.SiLU(), nn.Linear(256, 256), nn.GELU())
    x = torch.randn(64, 32)
    with ts.apply(model, "quant.int2", act_bits=None, min_bytes=0) as h:
        model(x).sum().backward()
    for name in ("1", "3"):
        row = h.tally.rows[name]
        assert row.compressed == 1 and row.stored_bytes == 64 * 256 * 2 // 8, row


def test_the_code_never_stands_in_for_values_another_op_saved() -> None:
    """``x`` feeds GELU and a matmul: the matmul's weight gradient needs the real values."""
    torch.manual_seed(0)
    leaf = torch.randn(128, 256, requires_grad=True)
    w = torch.randn(256, 8, requires_grad=True)

    def loss() -> torch.Tensor:
        x = leaf * 1.0
        return (F.gelu(x).sum(1, keepdim=True) * (x @ w)).square().sum()

    (ref,) = torch.autograd.grad(loss(), w)
    with ts.stash("quant.int8", min_bytes=0) as s:
        value = loss()
    (got,) = torch.autograd.grad(value, w)
    assert F.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.999
    assert sum(r.compressed for r in s.tally.rows.values()) >= 2  # stored twice, two ways


@pytest.mark.parametrize("value", [3, 1, "two", True])
def test_bad_deriv_bits_name_the_option(value: object) -> None:
    with pytest.raises(OptionError, match=r"deriv_bits=.* must be 2, 4, 8, 'auto' or None"):
        ts.apply(nn.Linear(4, 4), "quant.int2", deriv_bits=value)


def test_act_bits_stores_the_input_wider_and_recomputes_the_output() -> None:
    """``act_bits``: GELU/SiLU inputs as values at that width (not derivative codes), and the
    next Linear's input, their output, recomputed from them at no cost of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.SiLU(), nn.Linear(256, 256), nn.GELU())
    x = torch.randn(64, 32)
    with ts.apply(model, "quant.int2", act_bits=4, min_bytes=0) as h:
        model(x).sum().backward()
    rows = h.tally.rows
    for name in ("1", "3"):
        row = rows[name]
        assert row.compressed == 1 and row.stored_bytes > 64 * 256 * 4 // 8, row
    assert rows["2"].derived == 1 and rows["2"].stored_bytes == 0
    with ts.apply(model, "quant.int2", act_bits=4, derive=False, min_bytes=0) as h:
        model(x).sum().backward()
    assert h.tally.rows["2"].derived == 0 and h.tally.rows["2"].compressed == 1


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    ("strategy", "derived"), [("quant.int8", 1), ("quant.int4", 0), ("quant.int2", 0)]
)
def test_an_activation_after_a_batch_norm_keeps_its_own_width(
    strategy: str, derived: int, inplace: bool
) -> None:
    """A SiLU's input, a BatchNorm's output, is recomputed from the BatchNorm's coded input
    only where that code is as wide as ``act_bits`` (int8: no ``act_bits``); under int4 it is
    kept at 8 bits, in place or not (eager once recomputed it from 4 bits when not in place,
    and a compiled graph did so either way). An in-place SiLU saves a copy of its input, which
    no recipe names: stored, at any width."""
    from torchstash_quant.opaware import OpAware

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(inplace), nn.Conv2d(16, 8, 1)
    )
    x = torch.randn(4, 3, 16, 16)
    with ts.apply(model, strategy, seed=0) as h:
        model(x).sum().backward()
    row = h.tally.rows["2"]
    assert row.derived == (derived and not inplace), row
    assert (row.stored_bytes == 0) is bool(row.derived), row
    compressor = next(b.compressor for b in h.plan.built.values() if b.compressor is not None)
    assert isinstance(compressor, OpAware)
    assert compressor.derives_op("batch_norm", "silu") is bool(derived)
    assert compressor.derives_op("batch_norm", "conv") is (strategy != "quant.int2")


@pytest.mark.parametrize("value", [3, "4", True, 0])
def test_act_bits_rejects_other_widths(value: object) -> None:
    with pytest.raises(OptionError, match="act_bits"):
        quant(2, act_bits=value)
