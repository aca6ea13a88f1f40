"""Quantization codes under the engine's replay (:mod:`torchstash.engine.replay`): a code that
reads nothing of the op call replays without the op tracker, bit for bit what the full path
codes and counts; a code that reads the call, a code of other bytes, a new layout, and the
steps ``quant.auto`` measures take the full path."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.engine import Engine
from torchstash.engine.replay import Replayer
from torchstash.testing.replay import Tracked, tally_rows
from torchstash.testing.replay import twins as replay_twins
from torchstash.testing.steps import Switched, assert_same_grads, grads
from torchstash_quant.opaware import OpAware
from torchstash_quant.strategies import auto

#: strategies whose codes on a conv-BN-ReLU net all replay (at 4 bits and up, each
#: BatchNorm's output is recomputed from its coded input: those replay too)
REPLAYING = ("quant.int8", "quant.int4", "quant.int2", "quant.fp8", "quant.mesa")


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> Tracked:
    return Tracked(monkeypatch)


def twins(strategy: str, build: Callable[[], nn.Module] = cnn, **options: object):  # type: ignore[no-untyped-def]
    return replay_twins(strategy, build, **options)


@pytest.mark.parametrize("strategy", REPLAYING)
def test_codes_replay_bit_for_bit_and_count_as_the_full_path(
    strategy: str, tracked: Tracked
) -> None:
    full, ours, a, b = twins(strategy)
    try:
        as_the_full_path(full, ours, a, b, torch.randn(4, 3, 16, 16), tracked, steps=5)
        assert b.tally.stored_bytes < b.tally.raw_bytes / 3
        replayer = b.engine.replayer
        assert (replayer.recorded, replayer.replayed, replayer.missed) == (2, 3, 0)
    finally:
        a.remove()
        b.remove()


def as_the_full_path(
    full: nn.Module,
    ours: nn.Module,
    a: ts.Handle,
    b: ts.Handle,
    x: torch.Tensor,
    tracked: Tracked,
    steps: int,
    regions: bool = False,
) -> None:
    """Each step: ``ours`` (replaying after two recordings, without the op tracker but in
    its ``regions``) has the gradients and tally rows of ``full`` (the full path every step),
    bit for bit."""
    first = 0
    for step in range(steps):
        a.tally.reset()
        b.tally.reset()
        want = grads(full, x)
        calls = tracked.during(lambda: grads(ours, x))
        for g, w in zip(grads_of(ours), want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert tally_rows(b.tally) == tally_rows(a.tally)
        first = first or calls
        if regions:
            assert calls > 0 and (calls < first) == (step >= 2), (step, calls)
        else:
            assert (calls == 0) == (step >= 2), (step, calls)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_a_derivative_code_is_a_region_and_the_rest_replays(tracked: Tracked) -> None:
    """A GELU's derivative code reads the call's ``approximate``: the GELU's call runs down
    the full path on every step (a region), the rest of the forward replays, and each step
    has the full path's gradients and tally (attention's codes: the core's suite)."""
    full, ours, a, b = twins("quant.int2", _gelu_mlp, deriv_bits=4, act_bits=None)
    try:
        as_the_full_path(full, ours, a, b, torch.randn(8, 16), tracked, steps=5, regions=True)
        trace = b.engine.replayer.trace
        assert trace is not None
        assert [type(r.owner()) for r in trace.regions.values()] == [nn.GELU]
    finally:
        a.remove()
        b.remove()


def _gelu_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _pooled() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(), nn.Linear(200, 4)
    )


def test_a_max_pool_replays_with_its_geometry_recalled(tracked: Tracked) -> None:
    """A max pool's positions read its geometry from the call; recorded once (``recall``),
    it comes back on each replayed save, and the code checks the positions give the indices
    back: the full path's gradients and bytes, bit for bit."""
    full, ours, a, b = twins("quant.int2", _pooled)
    try:
        as_the_full_path(full, ours, a, b, torch.randn(2, 3, 12, 12), tracked, steps=4)
        assert any("pool" in op for r in b.tally.rows.values() for op in r.ops)
    finally:
        a.remove()
        b.remove()


def test_a_code_of_other_bytes_is_a_guard_miss_kept_exact() -> None:
    """``quant.int1`` widens a tensor holding NaN to 2 bits: the recorded bytes would not
    hold, so that save and the rest of the forward are kept as they are, and NaN survives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 4))
    x = torch.randn(8, 32)
    with ts.apply(model, "quant.int1") as handle:
        for _ in range(3):
            grads(model, x)
        replayer = handle.engine.replayer
        assert replayer.trace is not None
        bad = x.clone()
        bad[0, 0] = float("nan")
        model.zero_grad(set_to_none=True)
        model(bad).sum().backward()
        assert replayer.missed == 1 and replayer.trace is None
        weight = model[2].weight.grad
        assert weight is not None and bool(weight[:, :].isnan().any())


def test_a_new_layout_of_the_same_shape_is_a_guard_miss() -> None:
    """A code's groups may follow the tensor's strides: a transposed activation of the
    recorded shape is a guard miss, kept as stock keeps it (gradients exactly stock's), and
    the forwards after it record and replay again."""

    def head() -> Switched:  # switched, the tanh's input is transposed in memory
        return Switched(
            nn.Linear(64, 8),
            lambda lin, x: lin(torch.tanh(x)),
            lambda lin, x: lin(torch.tanh(x.t().contiguous().t())),
        )

    torch.manual_seed(0)
    stock = head()  # the twins' weights, under no strategy
    full, ours, a, b = twins("quant.int2", head)
    x = torch.randn(64, 64)
    try:
        for _ in range(4):
            assert_same_grads(ours, full, x)
        replayer = b.engine.replayer
        assert replayer.replayed == 2
        ours.switch = stock.switch = True  # type: ignore[assignment]
        assert_same_grads(ours, stock, x)
        assert replayer.missed == 1
        ours.switch = False  # type: ignore[assignment]
        for _ in range(3):
            grads(ours, x)
        assert replayer.replayed == 3 and replayer.missed == 1
    finally:
        a.remove()
        b.remove()


def _tanh_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4)
    )


@pytest.mark.parametrize("build", [_tanh_mlp, cnn], ids=["mlp", "cnn"])
def test_auto_measures_on_the_full_path_and_replays_between(
    build: Callable[[], nn.Module],
) -> None:
    """``quant.auto`` watches gradients on the steps it measures (op-call hooks) and allocates
    on the next: those take the full path and record again; the steps between replay. Its
    allocations are the full path's, and so is every gradient, bit for bit (on the CNN with
    its BatchNorm outputs recomputed and counted in the budget at no bits)."""
    torch.manual_seed(0)
    full = build()
    ours = copy.deepcopy(full)
    codecs = [auto(2, seed=0, interval=8, max_interval=8) for _ in range(2)]
    engines = [Engine(lambda site, types, c=c: c, min_bytes=0) for c in codecs]  # type: ignore[misc]
    engines[0].replayer.enabled = False
    x = torch.randn(16, 32) if build is _tanh_mlp else torch.randn(4, 3, 16, 16)
    allocations = []
    for _ in range(20):
        got = []
        for model, engine in zip((full, ours), engines, strict=True):
            model.zero_grad(set_to_none=True)
            with engine.activated():
                loss = model(x).square().sum()
            loss.backward()
            got.append([p.grad for p in model.parameters()])
        for g, w in zip(got[1], got[0], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        allocations.append([dict(c.values.allocation.bits) for c in codecs])  # type: ignore[attr-defined]
    assert all(a == b for a, b in allocations)
    assert len({str(a) for a, _ in allocations}) > 1  # the allocation changed on the way
    replayer = engines[1].replayer
    assert replayer.replayed >= 4 and replayer.missed == 0
    assert replayer.recorded >= 6  # each measured step and the next took the full path


class Shifted(nn.Module):
    """conv-BN-ReLU-conv whose second conv's input is shifted on the steps ``shift`` is set:
    the saves are the same (a sum with a number saves nothing), the tensor is not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 4, 3, padding=1)
        self.shift = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv1(x))
        if self.shift:
            h = h + 3.0
        return self.conv2(torch.relu_(h))


def replaying_recomputed(
    ours: nn.Module, stock: nn.Module, x: torch.Tensor, handle: ts.Handle
) -> Replayer:
    """Four steps of ``ours`` within int8's noise of ``stock``: two recorded, two replayed,
    with outputs recomputed from codes."""
    for _ in range(4):
        assert close_to(grads(ours, x), grads(stock, x), 0.02)
    replayer = handle.engine.replayer
    assert replayer.replayed == 2
    assert sum(r.derived for r in handle.tally.rows.values()) > 0
    return replayer


def close_to(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> bool:
    a, b = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    return float((a - b).norm() / b.norm()) < tol


@pytest.mark.parametrize("change", ["shift", "weight", "frozen"])
def test_a_recomputed_save_replays_only_from_its_own_op(change: str) -> None:
    """A BatchNorm output's recipe is replayed only where autograd's graph leads from the save,
    node type by node type, to this step's coded operand, through a node reading the recorded
    parameters: a shift after the BatchNorm (a node more), a weight replaced, a frozen weight
    replaced: each a guard miss, its gradients those of the full path within int8's noise (a
    stale recipe would be off by the shift or the old weight)."""
    torch.manual_seed(0)
    stock = Shifted()
    ours = copy.deepcopy(stock)
    if change == "frozen":
        for m in (stock, ours):
            m.bn.weight.requires_grad_(False)
    x = torch.randn(4, 3, 12, 12)
    with ts.apply(ours, "quant.int8") as handle:
        replayer = replaying_recomputed(ours, stock, x, handle)
        if change == "shift":
            stock.shift = ours.shift = True  # type: ignore[assignment]
        else:
            torch.manual_seed(1)
            weight = nn.Parameter(torch.rand(16) + 2.0, requires_grad=change != "frozen")
            stock.bn.weight = nn.Parameter(weight.detach().clone(), weight.requires_grad)
            ours.bn.weight = weight
        assert close_to(grads(ours, x), grads(stock, x), 0.02)
        assert replayer.missed == 1
        for _ in range(3):  # records the new model and replays it
            assert close_to(grads(ours, x), grads(stock, x), 0.02)
        assert replayer.replayed == 3


@pytest.mark.parametrize("replay", [False, True])
def test_a_code_read_twice_is_decoded_once(replay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A BatchNorm's coded input is read by the recipe of the output the next conv saves and
    by the BatchNorm's backward: decoded once, on the full path and replayed."""
    from torchstash_quant.opaware import OpAware

    decoded: list[int] = []
    original = OpAware.decompress

    def counting(self, packed):  # type: ignore[no-untyped-def]
        decoded.append(id(packed))
        return original(self, packed)

    monkeypatch.setattr(OpAware, "decompress", counting)
    torch.manual_seed(0)
    model = cnn()
    x = torch.randn(4, 3, 16, 16)
    with ts.apply(model, "quant.int8") as handle:
        handle.engine.replayer.enabled = replay
        for _ in range(4):
            decoded.clear()
            grads(model, x)
            assert decoded and len(decoded) == len(set(decoded))
        assert sum(r.derived for r in handle.tally.rows.values()) > 0
        assert (handle.engine.replayer.replayed > 0) == replay


def test_a_recomputed_gelu_replays_only_with_its_approximation() -> None:
    """A GELU's output recomputed from its coded input replays while the GELU node keeps the
    recorded ``approximate``; switched to ``tanh``, the save is a guard miss, and the
    gradients are the tanh GELU's (a stale recipe would recompute the exact one)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 4))
    ours = copy.deepcopy(stock)
    x = torch.randn(64, 32) * 3
    with ts.apply(ours, "quant.int8") as handle:
        replayer = replaying_recomputed(ours, stock, x, handle)
        for m in (stock, ours):
            m[1].approximate = "tanh"
        assert close_to(grads(ours, x), grads(stock, x), 0.02)
        assert replayer.missed == 1


class _Block(nn.Module):
    """A pre-norm MLP block with a SiLU and a dropout that drops: LayerNorm inputs in
    row-aligned centered groups, the SiLU's input as values, a dropout's 1-bit mask."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(nn.functional.silu(self.up(self.norm(x))))
        return (x + self.down(h)).sum(-1)


def _block() -> nn.Module:
    return nn.Sequential(_Block())  # a region is a call below the model's own


@pytest.mark.parametrize("strategy", [*REPLAYING, "quant.int1"])
@pytest.mark.parametrize("build", [cnn, _block], ids=["cnn", "block"])
def test_a_replayed_code_is_its_encoder_s_and_never_decided_again(
    strategy: str, build: Callable[[], nn.Module]
) -> None:
    """A replayed save calls the encoder its compressor gave on the first replay (the
    decisions about the tensor settled once): the replayed steps have the full path's
    gradients bit for bit, on the CNN with the compressor's ``compress`` refused from then
    on, and each value code calls the kernel's codec directly."""
    torch.manual_seed(3)  # the dropout's masks: the same for both copies at each step
    full, ours, a, b = twins(strategy, build)
    x = torch.randn(4, 3, 16, 16) if build is cnn else torch.randn(8, 16, 64)
    try:
        for step in range(5):
            torch.manual_seed(step)
            want = grads(full, x)
            torch.manual_seed(step)
            with pytest.MonkeyPatch.context() as patch:
                trace = b.engine.replayer.trace
                if step >= 3 and trace is not None and not trace.regions:
                    # two recordings and a first replay have made the encoders (a region's
                    # saves take the full path: :mod:`torchstash.engine.regions`)
                    patch.setattr(OpAware, "compress", _refused)
                got = grads(ours, x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        trace = b.engine.replayer.trace
        assert trace is not None and b.engine.replayer.replayed == 3
        assert build is not cnn or not trace.regions  # where compress was refused
        codes = [m for m in trace.moves if m.kind == "code"]
        assert codes and all(m.full or m.encode is not None for m in codes)
        if strategy.startswith("quant.int"):
            kinds = {type(m.encode).__name__ for m in codes}
            assert "GroupEncoder" in kinds, kinds
    finally:
        a.remove()
        b.remove()


def _refused(self: object, x: torch.Tensor, site: object) -> None:
    raise AssertionError("a replayed save decided its code again")


class _Attention(nn.Module):
    """Attention written out as users write it, its scale and mask read at each call."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale: float | None = None
        self.causal = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(self.norm(x)).view(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scale = self.scale if self.scale is not None else k.size(-1) ** -0.5
        att = (q @ k.transpose(-2, -1)) * scale
        if self.causal:
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        return x + self.proj((att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c))


def _attention() -> nn.Module:
    return nn.Sequential(_Attention(), _Attention(), nn.Flatten(), nn.Linear(32 * 16, 4))


class _Entered:
    """Counts the saves the engine's full path decides (``Engine._decide``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = Engine._decide

        def counting(engine, t, tls):  # type: ignore[no-untyped-def]
            self.calls += 1
            return original(engine, t, tls)

        monkeypatch.setattr(Engine, "_decide", counting)


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.int2", "quant.auto", "quant.mesa"])
def test_attention_saves_are_made_as_recorded_in_their_region(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attention's saves read the op call (which operand of which matmul; the map's
    scale, mask and softmax), so their module call is a region and the op tracker runs
    there. On a replayed step the full path does not decide them again: each is made as the
    recording made it (its variant checked from this call, the map recomputed by the recipe
    the tracker carried this step), with the full path's gradients and tally bit for bit
    (``quant.auto`` measures on the full path now and then: those steps are the full path's)."""
    entered = _Entered(monkeypatch)
    full, ours, a, b = twins(strategy, _attention)
    replayer = b.engine.replayer
    try:
        x = torch.randn(2, 16, 32)
        quiet = 0  # replayed steps that decided nothing on the full path
        for _ in range(8):
            a.tally.reset()
            b.tally.reset()
            want = grads(full, x)
            entered.calls, before = 0, replayer.replayed
            got = grads(ours, x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert tally_rows(b.tally) == tally_rows(a.tally)
            quiet += replayer.replayed > before and entered.calls == 0
        trace = replayer.trace
        assert trace is not None and len(trace.regions) == 2
        assert sum(m.full for m in trace.moves) >= 8  # q, k, v, the map and its reads
        assert quiet >= (2 if strategy == "quant.auto" else 6), quiet
        assert replayer.missed == 0
    finally:
        a.remove()
        b.remove()


@pytest.mark.parametrize("change", ["scale", "mask"])
def test_an_attention_called_otherwise_stays_exact(change: str) -> None:
    """A replayed region whose call changes. A new scale is read from this step's call (the
    recipe is this step's): the full path's gradients and tally on every step. A mask
    dropped changes the saves: a guard miss (that step keeps the rest of its forward exact,
    and the codes' seeds part from the full path's), recorded again: no step recomputes the
    map with a mask its call did not apply (every gradient stays close to stock's)."""
    torch.manual_seed(0)
    stock = _attention()
    full, ours, a, b = twins("quant.int8", _attention)
    try:
        x = torch.randn(2, 16, 32)
        for _ in range(4):
            grads(full, x), grads(ours, x)
        for model in (stock, full, ours):
            for m in model.modules():
                if isinstance(m, _Attention):
                    if change == "scale":
                        m.scale = 0.05
                    else:
                        m.causal = False
        missed = b.engine.replayer.missed
        for _ in range(5):
            a.tally.reset()
            b.tally.reset()
            want = grads(full, x)
            got = grads(ours, x)
            exact = grads(stock, x)
            for g, w, e in zip(got, want, exact, strict=True):
                if change == "scale":
                    torch.testing.assert_close(g, w, rtol=0, atol=0)
                cosine = torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0)
                assert cosine > 0.99, float(cosine)
            if change == "scale":
                assert tally_rows(b.tally) == tally_rows(a.tally)
        assert b.engine.replayer.missed == missed + (change == "mask")
        # without its mask this small model's attention holds most of its saves: not replayed
        assert b.engine.replayer.replayed >= (7 if change == "scale" else 2)
    finally:
        a.remove()
        b.remove()


class _Fused(nn.Module):
    """A pre-norm block whose attention is ``F.scaled_dot_product_attention``, its arguments
    read at each call; ``memory`` (set by a test) makes it cross-attention, over a memory of
    that many rows."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.causal = True
        self.scale: float | None = None
        self.mask = False
        self.dropout = 0.0
        self.memory = 0
        self.dense_values = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = c // self.heads
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, h).permute(2, 0, 3, 1, 4)
        if self.memory:  # the first rows' keys and values, repeated: another length
            k = k[:, :, :1].expand(b, self.heads, self.memory, h)
            v = v[:, :, :1].expand(b, self.heads, self.memory, h)
        if self.dense_values:  # saved after ``k`` and ``q``: a miss once those are coded
            v = v.contiguous()
        mask = torch.ones(n, k.shape[2], dtype=torch.bool).tril() if self.mask else None
        out = nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout,
            is_causal=self.causal and mask is None and not self.memory,
            scale=self.scale,
        )
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def _fused() -> nn.Module:
    """Two blocks after a projection (a LayerNorm's output is recomputed from its input's
    code only where that input has a node to check: not the model's input)."""
    return nn.Sequential(nn.Linear(32, 32), _Fused(), _Fused(), nn.Flatten(), nn.Linear(32 * 16, 4))


@pytest.mark.parametrize("strategy", [*REPLAYING, "quant.auto"])
def test_a_fused_attention_replays_without_the_op_tracker(strategy: str, tracked: Tracked) -> None:
    """A fused attention's ``q``, ``k``, ``v`` are coded and its output and log-sum-exp
    recomputed from them (:mod:`torchstash.engine.attention`): recorded once, rebuilt on the
    next steps behind the call's node, with no region and no op tracker, the full path's
    gradients and tally bit for bit (``quant.auto`` measures on the full path now and then)."""
    full, ours, a, b = twins(strategy, _fused)
    try:
        x = torch.randn(2, 16, 32)
        if strategy == "quant.auto":
            for _ in range(6):
                a.tally.reset()
                b.tally.reset()
                torch.testing.assert_close(grads(ours, x), grads(full, x), rtol=0, atol=0)
                assert tally_rows(b.tally) == tally_rows(a.tally)
        else:
            as_the_full_path(full, ours, a, b, x, tracked, steps=5)
        trace = b.engine.replayer.trace
        assert trace is not None and not trace.regions
        attends = [m for m in trace.moves if m.kind == "attend"]
        assert len(attends) == 4  # each call's output and log-sum-exp
        assert sum(m.attends for m in trace.moves) == 6  # each call's q, k, v
        assert b.engine.replayer.missed == 0
        assert sum(r.derived for r in b.tally.rows.values()) >= 4
    finally:
        a.remove()
        b.remove()


@pytest.mark.parametrize("change", ["causal", "scale", "mask", "dropout", "memory", "layout"])
def test_a_fused_attention_called_otherwise_misses_and_stays_exact(change: str) -> None:
    """A replayed fused attention whose call changes. Its ``q``, ``k``, ``v`` are coded before
    its node can be checked (its output is saved after them): a new ``is_causal``, scale,
    mask or dropout is seen on the output's node, a memory of another length on the key's
    shape, values of another layout on theirs (saved after ``k`` and ``q``, by then coded);
    either way a guard miss, and what was made of the call's saves is turned back
    into the tensors (no output recomputed with the recorded arguments, no codes beside
    exact others): that step's gradients are stock's up to the codes before the call, its
    attention's saves exact, and the next steps record again and replay."""
    torch.manual_seed(0)
    stock = _fused()
    full, ours, a, b = twins("quant.int8", _fused)
    try:
        x = torch.randn(2, 16, 32)
        for _ in range(4):
            grads(full, x), grads(ours, x)
        replayer = b.engine.replayer
        assert replayer.replayed == 2 and replayer.missed == 0
        for model in (stock, full, ours):
            first = model[1]
            if change == "causal":
                first.causal = False
            elif change == "scale":
                first.scale = 0.05
            elif change == "mask":
                first.mask = True
            elif change == "dropout":
                first.dropout = 0.5
            elif change == "memory":
                first.memory = 8
            else:
                first.dense_values = True
        torch.manual_seed(7)
        exact = grads(stock, x)
        torch.manual_seed(7)
        b.tally.reset()
        got = grads(ours, x)
        assert replayer.missed == 1
        for g, e in zip(got, exact, strict=True):
            cosine = torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0)
            assert cosine > 0.999, float(cosine)
        attention = b.tally.rows["1"]
        assert attention.compressed == 0 and attention.derived == 0, attention
        assert attention.stored_bytes == attention.raw_bytes, attention  # as stock holds them
        for _ in range(3):  # the codes' seeds part from the full path's at a miss
            torch.manual_seed(11)
            exact = grads(stock, x)
            torch.manual_seed(11)
            for g, e in zip(grads(ours, x), exact, strict=True):
                cosine = torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0)
                assert cosine > 0.99, float(cosine)
        assert replayer.missed == 1 and replayer.replayed == 3
    finally:
        a.remove()
        b.remove()


def _gelu_then_norm() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
        nn.LayerNorm(32), nn.Linear(32, 4),
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.int2", "quant.auto"])
def test_a_recomputed_save_read_by_another_recipe_replays(strategy: str, tracked: Tracked) -> None:
    """A LayerNorm after a GELU saves the GELU's output, itself recomputed from the GELU's
    coded input; the LayerNorm's output (the next Linear's input) is recomputed from that.
    Its recipe's operand is a recomputed save, whose node the recording now keeps: the
    forward replays (before, neither recipe could be checked, the region was the whole
    forward, and nothing replayed), the full path's gradients and tally bit for bit."""
    full, ours, a, b = twins(strategy, _gelu_then_norm)
    try:
        x = torch.randn(8, 16)
        if strategy == "quant.auto":  # measures on the full path now and then
            for _ in range(6):
                a.tally.reset()
                b.tally.reset()
                torch.testing.assert_close(grads(ours, x), grads(full, x), rtol=0, atol=0)
                assert tally_rows(b.tally) == tally_rows(a.tally)
            assert b.engine.replayer.replayed > 0
        else:
            as_the_full_path(full, ours, a, b, x, tracked, steps=5)
        trace = b.engine.replayer.trace
        assert trace is not None and not trace.regions
        derived = [m for m in trace.moves if m.derive is not None]
        chained = [m for m in derived if trace.moves[m.derive.source].kind == "derive"]
        assert chained, [(m.op, m.derive.source) for m in derived]
    finally:
        a.remove()
        b.remove()


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["quant.int8", "quant.auto"])
def test_a_fused_attention_replays_on_cuda(strategy: str, tracked: Tracked) -> None:
    """The same on a GPU, under bfloat16 autocast (FlashAttention's kernel, whose output and
    log-sum-exp are replayed by ``torchstash.derive.FUSED_ATTENTION``): the steps replay with
    no region and no op tracker, nothing misses, and the gradients are the full path's up to
    the kernel's own nondeterminism (its backward adds in any order)."""
    full, ours, a, b = twins(strategy, lambda: _fused().cuda())
    try:
        x = torch.randn(2, 16, 32, device="cuda")
        for step in range(6):
            with torch.autocast("cuda", torch.bfloat16):
                want = grads(full, x)
                calls = tracked.during(lambda: grads(ours, x))
            for g, w in zip(grads_of(ours), want, strict=True):
                torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)
            assert strategy == "quant.auto" or (calls == 0) == (step >= 2), (step, calls)
        trace = b.engine.replayer.trace
        assert trace is not None and not trace.regions
        assert sum(m.kind == "attend" for m in trace.moves) == 4
        assert b.engine.replayer.missed == 0
    finally:
        a.remove()
        b.remove()
