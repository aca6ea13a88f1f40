"""The engine against stock PyTorch: exact gradients, exact accounting, awkward control flow."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.compressor import Compressor
from torchstash.optrack import STATE as OP_STATE
from torchstash.optrack import OpTracker, on_result
from torchstash.site import Site
from torchstash.testing.models import zoo

from ._helpers import LinearThen, stock_then_measured

ZOO = {e.name: e for e in zoo("tiny")}


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def step(entry_name: str, model: nn.Module, n: int = 4) -> None:
    e = ZOO[entry_name]
    x, y = e.batch(n, torch.device("cpu"))
    model.zero_grad()
    e.loss(model, x, y).backward()


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("strategy", ["none", "test.clone"])
def test_lossless_gradients_bit_identical(
    name: str, strategy: str, toy_strategies: list[str]
) -> None:
    torch.manual_seed(0)
    model = ZOO[name].build()
    step(name, model)
    ref = grads_of(model)
    with ts.apply(model, strategy, min_bytes=0) as h:
        step(name, model)
        assert h.tally.raw_bytes > 0
        if strategy == "test.clone":
            assert sum(r.compressed for r in h.tally.rows.values()) > 0
    got = grads_of(model)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def independent_saved_bytes(model: nn.Module, fn: Any) -> int:
    """What autograd saves, counted with a bare pair of hooks as stock holds it: each storage
    once and whole (a reshape or a view of a saved tensor is the same memory; a slice holds
    all of its storage). The hooks keep every saved tensor, so no address is reused."""
    state = [*model.parameters(), *model.buffers()]
    params = {t.untyped_storage().data_ptr() for t in state}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not isinstance(t, nn.Parameter) and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_measure_raw_bytes_equal_independent_count(name: str) -> None:
    model = ZOO[name].build()
    e = ZOO[name]
    x, y = e.batch(4, torch.device("cpu"))
    expected = independent_saved_bytes(model, lambda: model(x))  # the loss is outside the model
    report = ts.measure(model, lambda: e.loss(model, x, y).backward(), repeat=1, warmup=0)
    assert report.raw_bytes == expected
    assert report.stored_bytes == expected  # "none" stores everything as is
    assert report.param_refs > 0
    assert ts.handle_of(model) is None  # measure's temporary handle is gone


class Recorder(ts.BaseCompressor):
    """Lossless; records every site it was asked to compress."""

    name = "test.recorder"
    lossless = True

    def __init__(self) -> None:
        self.sites: list[Site] = []

    def compress(self, x: torch.Tensor, site: Site) -> ts.Packed:
        self.sites.append(site)
        return ts.Packed.like(x, self.name, data=x.clone())

    def decompress(self, packed: ts.Packed) -> torch.Tensor:
        data = packed.tensors["data"]
        assert isinstance(data, torch.Tensor)
        return data


@pytest.fixture
def recorder() -> Any:
    rec = Recorder()
    ts.REGISTRY.register("test.recorder", lambda: rec, lossless=True, summary="")
    yield rec
    ts.REGISTRY.unregister("test.recorder")


def test_sites_name_module_op_and_role(recorder: Recorder) -> None:
    model = ZOO["gpt"].build()
    with ts.apply(model, "test.recorder", min_bytes=0):
        step("gpt", model)
    by = {(s.module, s.op, s.role) for s in recorder.sites}
    assert ("blocks.0.attn", "matmul") in {(m, o) for m, o, _ in by}  # q @ k.T, functional
    assert ("blocks.0.attn", "softmax", "output") in by  # softmax saves its output
    assert ("blocks.1.mlp.1", "gelu", "input") in by
    assert ("blocks.0.ln1", "layer_norm", "input") in by
    assert ("blocks.0.mlp.0", "linear", "input") in by
    gelu = [s for s in recorder.sites if s.op == "gelu"]
    assert [s.module_index for s in gelu] == [0, 1]  # index among GELU modules
    assert all(s.tag == "gelu" and s.module_type == "GELU" for s in gelu)
    softmax = [s for s in recorder.sites if s.op == "softmax"]
    assert [s.op_index for s in softmax] == [0, 1]  # occurrence in the forward


def test_roles_of_a_plain_matmul(recorder: Recorder) -> None:
    mm = LinearThen(32, lambda h: (h @ h.t().contiguous()).softmax(-1))
    with ts.apply(mm, "test.recorder", min_bytes=0) as h:
        h.plan  # noqa: B018
        model = h._model()
        assert model is not None
        model(torch.randn(16, 32)).sum().backward()
    roles = {(s.op, s.role) for s in recorder.sites}
    assert {("matmul", "input"), ("matmul", "arg1"), ("softmax", "output")} <= roles


class _InPlaceBlock(nn.Module):
    """A conv, then an in-place op on its output."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.act = nn.SiLU(inplace=True)
        self.scale = nn.Parameter(torch.randn(1, 8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.how == "module":
            return self.act(h)
        if self.how == "functional":
            return torch.nn.functional.silu(h, True)
        return h.mul_(torch.sigmoid(self.scale))  # mul_ keeps h's old values for scale's grad


@pytest.mark.parametrize("how", ["module", "functional", "mul_"])
def test_in_place_op_saves_a_copy_of_its_input_as_input(recorder: Recorder, how: str) -> None:
    """An in-place SiLU saves a copy of its input taken before overwriting it: that copy is
    the op's input (its input-reading codes apply), not an output (timm's EfficientNet: every
    SiLU is in place, and its pre-activations were coded as plain 2-bit values)."""
    model = _InPlaceBlock(how)
    with ts.apply(model, "test.recorder", min_bytes=0):
        model(torch.randn(2, 4, 8, 8)).sum().backward()
    copies = [s.role for s in recorder.sites if s.op in ("silu", "mul") and s.role != "arg1"]
    assert copies == ["input"], copies


def test_tensor_saved_twice_is_stored_once(toy_strategies: list[str]) -> None:
    class ThreeHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) * 2 + self.k(x) + self.v(x)

    model = ThreeHeads()
    x = torch.randn(32, 64)
    with ts.apply(model, "test.clone", min_bytes=0) as h:
        model(x).sum().backward()
    rows = h.tally.rows
    assert sum(r.saved for r in rows.values()) == 3
    assert sum(r.shared for r in rows.values()) == 2
    assert h.tally.raw_bytes == h.tally.stored_bytes == x.numel() * 4


def test_tensor_held_two_ways_counts_once_in_raw(toy_strategies: list[str]) -> None:
    """A ReLU's output kept by the ReLU one way and by the next Linear another way is two
    entries, but stock holds the tensor once: raw bytes count it once, stored bytes twice."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    policy = [{"strategy": "test.clone"}, {"op": "relu", "strategy": "test.half"}]
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        model(x).sum().backward()
    act = 32 * 64 * 4
    assert h.tally.raw_bytes == 2 * act  # x, and the ReLU's output once
    assert h.tally.stored_bytes == 2 * act + act // 2


def test_constant_saved_by_an_autograd_function_is_kept_exact(toy_strategies: list[str]) -> None:
    """A reentrant checkpoint saves its block's inputs with ``save_for_backward``, where no op
    is seen: a lossy code takes the activation, but the attention mask (no gradient) stays
    exact, since a group code of 0 and finfo.min does not come back as either."""
    from torch.utils.checkpoint import checkpoint

    from torchstash.engine import CONSTANT_REASON

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def block(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return (self.lin(h) + m).softmax(-1)

        def forward(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, h * 1, m, use_reentrant=True)

    model = Checkpointed()
    x = torch.randn(32, 64, requires_grad=True)
    mask = torch.zeros(32, 64)
    mask[:, 32:] = torch.finfo(torch.float32).min

    def grad() -> torch.Tensor:
        x.grad = None
        model(x, mask).square().sum().backward()
        assert x.grad is not None
        return x.grad.clone()

    want = grad()
    with ts.apply(model, "test.half", min_bytes=0) as h:
        got = grad()
    rows = h.tally.rows.values()
    assert sum(r.declined[CONSTANT_REASON] for r in rows) == 1  # the mask
    assert sum(r.compressed for r in rows) >= 1  # the block's input
    torch.testing.assert_close(got, want, rtol=0.05, atol=1e-4)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_autocast_weight_copies_are_kept_like_weights(
    toy_strategies: list[str], frozen: bool
) -> None:
    """Under bf16 autocast a Linear saves a bf16 copy of its weight: a parameter in another
    dtype, kept as is and counted with the parameters, never coded like an activation."""
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    model.requires_grad_(not frozen)
    x = torch.randn(16, 64, requires_grad=True)
    with ts.apply(model, "test.half", min_bytes=0) as h:
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    raw = {k: r.raw_bytes for k, r in h.tally.rows.items()}
    gelu = 16 * 96 * 2  # the GELU's bf16 input
    if frozen:  # the Linears save only their weights' copies (for the input's gradient)
        assert raw == {"1": gelu}
    else:  # and their inputs (bf16 casts), counted; the weight copies are not
        assert raw == {"0": 16 * 64 * 2, "1": gelu, "2": gelu}
    assert h.tally.param_refs >= 2


def test_shared_module_called_twice(recorder: Recorder) -> None:
    lin = nn.Linear(16, 16)
    model = nn.Sequential(lin, nn.GELU(), lin)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None
    with ts.apply(model, "test.recorder", min_bytes=0):
        model(x).sum().backward()
    assert torch.equal(ref, lin.weight.grad)
    calls = sorted({s.call for s in recorder.sites if s.module == "0"})
    assert calls == [0, 1]


def test_nested_modules_innermost_wins(recorder: Recorder) -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.GELU())))
    with ts.apply(model, "test.recorder", min_bytes=0):
        model(torch.randn(4, 8)).sum().backward()
    assert {s.module for s in recorder.sites} == {"0.0", "0.1.0"}


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_exception_inside_forward_leaves_nothing_behind(toy_strategies: list[str]) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), Boom())
    h = ts.apply(model, "test.clone", min_bytes=0)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(4, 8))
    assert not h.engine.active and OP_STATE.depth == 0
    before = h.tally.raw_bytes
    (torch.randn(4, 8, requires_grad=True).exp()).sum().backward()  # outside: untouched
    assert h.tally.raw_bytes == before
    model[2] = nn.Identity()
    model(torch.randn(4, 8)).sum().backward()  # and the model still works
    h.remove()


def test_retain_graph_and_second_backward(toy_strategies: list[str]) -> None:
    model = ZOO["gpt"].build()
    e = ZOO["gpt"]
    x, y = e.batch(2, torch.device("cpu"))
    loss = e.loss(model, x, y)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = grads_of(model)
    model.zero_grad()
    with ts.apply(model, "test.clone", min_bytes=0):
        loss = e.loss(model, x, y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(ref, grads_of(model)))


def test_two_forwards_then_one_backward_and_accumulation(toy_strategies: list[str]) -> None:
    model = ZOO["resnet"].build()
    e = ZOO["resnet"]
    (x1, y1), (x2, y2) = e.batch(2, torch.device("cpu")), e.batch(3, torch.device("cpu"))
    (e.loss(model, x1, y1) + e.loss(model, x2, y2)).backward()
    ref = grads_of(model)
    model.zero_grad()
    with ts.apply(model, "test.clone", min_bytes=0):
        a = e.loss(model, x1, y1)
        b = e.loss(model, x2, y2)
        (a + b).backward()
    assert all(torch.equal(r, g) for r, g in zip(ref, grads_of(model)))
    # gradient accumulation: two separate backwards add up
    model.zero_grad()
    with ts.apply(model, "test.clone", min_bytes=0):
        e.loss(model, x1, y1).backward()
        e.loss(model, x2, y2).backward()
    assert all(torch.allclose(r, g, atol=1e-6) for r, g in zip(ref, grads_of(model)))


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_work_without_grad(ctx: Any, toy_strategies: list[str]) -> None:
    model = ZOO["gpt"].build()
    seen: list[int] = []
    model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(OP_STATE.depth))
    with ts.apply(model, "test.clone", min_bytes=0) as h, ctx():
        x, _ = ZOO["gpt"].batch(2, torch.device("cpu"))
        model(x)
    assert seen == [0] and not h.tally.rows and not h.engine.active


def test_double_backward_matches_stock() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(4, 8, requires_grad=True)

    def gradgrad() -> torch.Tensor:
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        return gg

    ref = gradgrad()
    with ts.apply(model, "none", min_bytes=0):
        got = gradgrad()
    assert torch.equal(ref, got)


def test_inplace_after_save_is_caught_like_stock() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.sigmoid()  # saves its output
            y.mul_(2)
            return y

    model = nn.Sequential(nn.Linear(8, 8), Bad())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(4, 8)).sum().backward()
    with (
        ts.apply(model, "none", min_bytes=0),
        pytest.raises(RuntimeError, match="modified by an inplace operation"),
    ):
        model(torch.randn(4, 8)).sum().backward()


def test_small_and_integer_tensors_stored_as_they_are(toy_strategies: list[str]) -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8))
    idx = torch.randint(0, 50, (4, 6))
    with ts.apply(model, "test.clone", min_bytes=1 << 20) as h:
        model(idx).sum().backward()
    declined = {k for r in h.tally.rows.values() for k in r.declined}
    assert any("min_bytes" in k for k in declined)
    assert sum(r.compressed for r in h.tally.rows.values()) == 0
    with ts.apply(model, "test.clone", min_bytes=0) as h:
        model(idx).sum().backward()
    declined = {k for r in h.tally.rows.values() for k in r.declined}
    assert any("torch.int64" in k for k in declined)  # the compressor said why
    assert sum(r.compressed for r in h.tally.rows.values()) > 0


def test_lossy_compressor_shrinks_and_trains(toy_strategies: list[str]) -> None:
    e = ZOO["vit"]
    model = e.build()
    stock, report = stock_then_measured(
        e, model, e.batch(4, torch.device("cpu")), "test.half", min_bytes=0
    )
    ref = torch.cat([g.flatten() for g in stock])
    got = torch.cat([g.flatten() for g in grads_of(model)])
    assert report.stored_bytes < 0.6 * report.raw_bytes
    assert torch.nn.functional.cosine_similarity(ref, got, dim=0) > 0.999


def test_on_result_delivers_the_op_output() -> None:
    seen: list[torch.Tensor] = []
    x = torch.randn(3, 4, requires_grad=True)
    on_result(seen.append)  # outside a tracked op: dropped
    with OpTracker():
        y = torch.nn.functional.gelu(x, approximate="none")
        assert seen == []
    assert seen == []

    class Probe(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            on_result(seen.append)
            return func(*args, **(kwargs or {}))

    with Probe(), OpTracker():  # the tracker sees the call first
        y = torch.tanh(x)
    assert len(seen) == 1 and seen[0] is y


def test_attention_map_is_stored_once() -> None:
    """softmax saves its output; the matmul after it saves a reshaped view of it: one entry."""
    from torchstash.engine import Engine
    from torchstash.testing.toys import HalfCompressor

    half = HalfCompressor()
    engine = Engine(lambda site, types: half, min_bytes=0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with engine.activated():
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        out = att @ v
    rows = list(engine.tally.rows.values())
    assert sum(r.shared for r in rows) >= 1
    out.sum().backward()
    ref = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    ((q @ k.transpose(-2, -1)).softmax(-1) @ v).sum().backward()
    for r, t in zip(ref, (q, k, v), strict=True):
        torch.testing.assert_close(r, t.grad, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("self_attention", [True, False])
def test_multihead_attention_is_opened(
    recorder: Recorder, need_weights: bool, self_attention: bool
) -> None:
    """F.multi_head_attention_forward is one torch function; the tracker reports the ops
    inside it (projections as ``linear``, the attention's matmuls and softmax), and a lossless
    strategy leaves every gradient bit for bit as stock's."""
    torch.manual_seed(0)
    other = None if self_attention else 16  # cross-attention with separate projections
    mha = nn.MultiheadAttention(32, 4, batch_first=True, kdim=other, vdim=other)
    x = torch.randn(2, 12, 32)
    kv = x if self_attention else torch.randn(2, 12, 16)

    def grads(apply: bool) -> list[torch.Tensor]:
        mha.zero_grad()
        xs = [t.detach().clone().requires_grad_() for t in (x, kv)]
        handle = ts.apply(mha, "test.recorder", min_bytes=0) if apply else None
        y, w = mha(xs[0], xs[1], xs[1], need_weights=need_weights)
        (y.square().sum() + (w.sum() if w is not None else 0)).backward()
        if handle is not None:
            handle.remove()
        return [p.grad.clone() for p in mha.parameters() if p.grad is not None] + [
            t.grad for t in xs if t.grad is not None
        ]

    stock = grads(False)
    ours = grads(True)
    assert len(stock) == len(ours)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours, strict=True))
    ops = {(s.op, s.role) for s in recorder.sites}
    assert ("linear", "input") in ops  # the in- and out-projections' inputs
    assert "multi_head_attention_forward" not in {s.op for s in recorder.sites}
    if need_weights:
        assert ("softmax", "output") in ops


def test_opened_is_only_for_listed_composites() -> None:
    from torchstash.optrack import OPENED_COMPOSITES, opened

    assert opened(torch.nn.functional.gelu) is None  # a builtin: nothing to open
    assert opened(torch.nn.functional.layer_norm) is None  # Python, but not listed
    for func in OPENED_COMPOSITES:
        copy = opened(func)
        assert copy is not None and copy is not func and copy.__code__ is func.__code__


def test_a_code_yields_to_the_same_tensor_saved_as_is(toy_strategies: list[str]) -> None:
    """A GELU's input coded first, then saved as is by the linear that reads it: one raw copy
    is held (never more than stock) and both ops read the exact tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    policy = [{"strategy": "test.half"}, {"op": "linear", "strategy": "none"}]

    def run(apply: bool) -> tuple[list[torch.Tensor], Any]:
        model.zero_grad()
        handle = ts.apply(model, policy=policy, min_bytes=0) if apply else None
        h = model[0](x)
        y = model[1](h)  # the GELU saves h (coded)...
        z = model[2](h)  # ...then the linear saves h as is
        (y * z).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        tally = handle.tally if handle is not None else None
        if handle is not None:
            handle.remove()
        return grads, tally

    stock, _ = run(False)
    ours, tally = run(True)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours, strict=True))  # exact: no half
    assert tally.stored_bytes == tally.raw_bytes  # the half code was dropped, nothing beside
    assert sum(r.compressed for r in tally.rows.values()) == 0


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * g * x


def test_as_op_names_a_custom_functions_saves(recorder: Recorder) -> None:
    from torchstash.opmark import as_op

    x = torch.randn(64, 64, requires_grad=True)
    with ts.stash("test.recorder", min_bytes=0):
        h = x * 1.0
        with as_op("square", (h,)):
            y = _Square.apply(h)
        _Square.apply(y).sum()  # outside: no op name
    named = [(s.op, s.role) for s in recorder.sites]
    assert ("square", "input") in named and ("", "") in named


@pytest.fixture
def square_default() -> Iterator[Compressor]:
    """A plug-in op ``toyplug.square`` whose saves have a default code of their own."""
    from torchstash.registry import REGISTRY
    from torchstash.testing.toys import HalfCompressor

    codec = HalfCompressor()
    REGISTRY.register_op_default("toyplug.square", lambda: codec, summary="halves")
    try:
        yield codec
    finally:
        REGISTRY.unregister_op_default("toyplug.square")


def test_an_ops_default_code_is_used_and_yields_to_a_raw_save(square_default: Compressor) -> None:
    x = torch.randn(64, 64, requires_grad=True)
    assert not ts.engine_active()
    with ts.stash("none", min_bytes=0) as s:
        assert ts.engine_active()
        h = x * 1.0
        with ts.as_op("square", (h,), func="toyplug.square"):
            y = _Square.apply(h)  # saves h: coded by the op's default, not the policy's none
            inner = h.exp()  # a torch call inside the block: its own op, no default
    rows = list(s.tally.rows.values())
    assert sum(r.compressed for r in rows) == 1
    (y.sum() + inner.sum()).backward()
    with ts.stash("none", min_bytes=0) as s2:
        h = x * 1.0
        with ts.as_op("square", (h,), func="toyplug.square"):
            y = _Square.apply(h)
        z = h * h  # mul saves h as is: the code is dropped, one raw copy shared
    assert sum(r.compressed for r in s2.tally.rows.values()) == 0
    assert s2.tally.stored_bytes == s2.tally.raw_bytes
    x.grad = None
    (y.sum() + z.sum()).backward()
    assert torch.equal(x.grad, 4 * x.detach())  # type: ignore[arg-type]


def test_a_rule_naming_the_op_overrides_its_default(square_default: Compressor) -> None:
    """The default is a policy default: a rule that names the op decides instead."""
    x = torch.randn(64, 64, requires_grad=True)
    policy = [{"strategy": "none"}, {"op": "toyplug.square", "strategy": "none"}]
    with ts.stash(policy=policy, min_bytes=0) as s:
        h = x * 1.0
        with ts.as_op("square", (h,), func="toyplug.square"):
            y = _Square.apply(h)
    assert sum(r.compressed for r in s.tally.rows.values()) == 0
    y.sum().backward()
