"""Property-based checks of every registered strategy against stock PyTorch (hypothesis).

Each example draws a tensor: its shape (empty, 0-d, sizes around the group sizes), dtype
(fp16, bf16, fp32, fp64), layout (transposed, sliced, channels_last) and values (NaN, +-Inf,
1e30, subnormals), and runs a small model on it under the strategy with ``min_bytes=0``, so
even the smallest tensor goes through the compressors. Lossless strategies must give stock's
gradients bit for bit; lossy ones the same finite/non-finite pattern and an error within
:data:`TOLERANCE`; an in-place change after the save must raise as it does in stock;
``retain_graph`` must give the same gradients twice; two threads training at once must not
disturb each other. A strategy registered tomorrow is covered here the day it is added.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchstash as ts

#: float64 draws: every quantizer says once that it keeps them as they are (tests/test_trust.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*keeps float64 tensors as they are")

STRATEGIES = ts.REGISTRY.names()
LOSSLESS = {name for name in STRATEGIES if ts.REGISTRY.get(name).lossless}

#: Worst relative error of the finite gradients (|g - stock| / |stock| over all parameters and
#: the input) allowed per strategy; lossy strategies not listed are held to the pattern of
#: finite values only. Loose: the drawn tensors are tiny and odd-shaped, where per-group codes
#: are at their worst.
TOLERANCE = {"quant.int8": 0.1, "quant.mesa": 0.25, "quant.fp8": 0.25}

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZES = (0, 1, 3, 7, 31, 32, 33, 64, 255, 257)
SPECIAL = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 1e-40, -1e-42)
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same examples every run: CI is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "0-d": lambda t: t,
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "transposed": lambda t: t.t(),
    "sliced": lambda t: t[:, ::2],
}


@dataclass
class Case:
    """One drawn input (a contiguous base, and the layout the model sees it in) and the model
    that takes it."""

    base: torch.Tensor
    layout: str
    special: int

    @property
    def x(self) -> torch.Tensor:
        return LAYOUTS[self.layout](self.base)

    def leaf(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh leaf that needs a gradient, and the input made from it in the layout."""
        leaf = self.base.detach().clone().requires_grad_(True)
        return leaf, LAYOUTS[self.layout](leaf)

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        x = self.x
        if x.dim() == 4:
            c = x.shape[1]
            net: nn.Module = nn.Sequential(
                nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                nn.Sigmoid(),
            )  # fmt: skip
        elif x.dim() == 2 and x.shape[-1] > 0:
            d = x.shape[-1]
            net = nn.Sequential(
                nn.Linear(d, d), nn.ReLU(), nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(),
                nn.Linear(d, d), nn.Sigmoid(),
            )  # fmt: skip
        else:  # 0-d, 1-d and empty: elementwise only
            net = nn.Sequential(nn.Sigmoid(), nn.GELU(), nn.Tanh(), nn.ReLU())
        return net.to(x.dtype)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(("contiguous", "transposed", "sliced", "channels_last", "0-d")))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows, cols = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES[1:]))
    n, c, hw = (draw(st.sampled_from(v)) for v in ((2, 3), (1, 3, 8), (1, 2, 5)))
    shapes = {
        "0-d": (),
        "channels_last": (n, c, hw, hw),
        "transposed": (cols, rows),
        "sliced": (rows, 2 * cols),
        "contiguous": (rows, cols),
    }
    base = torch.randn(shapes[layout], generator=gen)
    special = draw(st.integers(0, 3)) if base.numel() else 0
    for _ in range(special):  # into the contiguous base, before the layout is made
        base.view(-1)[draw(st.integers(0, base.numel() - 1))] = draw(st.sampled_from(SPECIAL))
    base = base.to(dtype)
    return Case(base, layout, special)


def _step(model: nn.Module, case: Case) -> list[torch.Tensor]:
    """One backward; the gradients of the parameters and of the input."""
    leaf, x = case.leaf()
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [g.clone() for g in (*grads, leaf.grad) if g is not None]


def _run(case: Case, strategy: str | None) -> list[torch.Tensor]:
    model = case.model()
    if strategy is not None:
        ts.apply(model, strategy, min_bytes=0)
    return _step(model, case)


def _applicable(case: Case, strategy: str) -> bool:
    """memsave rewrites modules: a model with none of its layers is an ApplyError, rightly."""
    try:
        ts.apply(case.model(), strategy, min_bytes=0)
    except ts.errors.ApplyError:
        return False
    return True


def _assert_close(strategy: str, want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape
    if strategy in LOSSLESS:
        for a, b in zip(want, got):
            assert torch.equal(a.isnan(), b.isnan()), "NaN positions differ"
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), "not bit-exact"
        return
    for a, b in zip(want, got):
        assert torch.equal(a.isfinite(), b.isfinite()), "finite/non-finite pattern differs"
    tol = TOLERANCE.get(strategy)
    if tol is None:
        return
    diff = sum(float((a - b)[a.isfinite()].double().norm()) ** 2 for a, b in zip(want, got))
    norm = sum(float(a[a.isfinite()].double().norm()) ** 2 for a in want)
    if norm > 0 and math.isfinite(norm):
        assert math.sqrt(diff / norm) <= tol, f"relative error {math.sqrt(diff / norm):.3f}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@SETTINGS
@given(case=cases())
def test_gradients_agree_with_stock(strategy: str, case: Case) -> None:
    if not _applicable(case, strategy):
        return
    try:
        want = _run(case, None)
    except Exception as e:  # what stock refuses, the strategy refuses the same way
        with pytest.raises(type(e)):
            _run(case, strategy)
        return
    _assert_close(strategy, want, _run(case, strategy))


def _edit_after_save(model: nn.Module, case: Case) -> Callable[[], None]:
    _, x = case.leaf()
    h = x * 1  # the first layer saves h
    out = model(h)
    with torch.no_grad():
        h.add_(1)
    return lambda: out.float().sum().backward()


@pytest.mark.parametrize("strategy", STRATEGIES)
@SETTINGS
@given(case=cases())
def test_inplace_change_after_save_is_an_error_as_in_stock(strategy: str, case: Case) -> None:
    if not _applicable(case, strategy) or case.x.numel() == 0:
        return
    outcomes = []
    for name in (None, strategy):
        model = case.model()
        if name is not None:
            ts.apply(model, name, min_bytes=0)
        backward = _edit_after_save(model, case)
        try:
            backward()
            outcomes.append("ran")
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            outcomes.append("raised")
    assert outcomes[0] == outcomes[1], outcomes


@pytest.mark.parametrize("strategy", STRATEGIES)
@SETTINGS
@given(case=cases())
def test_retain_graph_gives_the_same_gradients_twice(strategy: str, case: Case) -> None:
    if not _applicable(case, strategy):
        return
    model = case.model()
    ts.apply(model, strategy, min_bytes=0)
    leaf, x = case.leaf()
    out = model(x).float().sum()
    firsts = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        leaf.grad = None
        out.backward(retain_graph=True)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        firsts.append([g.clone() for g in (*grads, leaf.grad) if g is not None])
    for a, b in zip(*firsts):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_threads_train_without_disturbing_each_other(strategy: str) -> None:
    """Two models, one strategy each, stepped at the same time in two threads: each gets
    what it gets alone (bit for bit when lossless)."""
    gen = torch.Generator().manual_seed(0)
    case = Case(torch.randn(64, 96, generator=gen), "contiguous", 0)
    if not _applicable(case, strategy):
        pytest.skip(f"{strategy} has nothing to rewrite in this model")
    alone = _run(case, strategy)
    # Built here: torch's global generator, which initializes the layers, is one for all
    # threads (two threads seeding and drawing from it at once get each other's numbers).
    models = {i: [case.model() for _ in range(3)] for i in range(2)}
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for model in models[i]:
                ts.apply(model, strategy, min_bytes=0)
                results[i] = _step(model, case)
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2
    for got in results.values():  # lossy: a preset's seed stream may be shared, so close only
        _assert_close(strategy, alone, got)
