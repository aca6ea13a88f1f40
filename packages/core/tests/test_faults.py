"""Faults never corrupt training: a plug-in whose compressor raises (in forward or backward),
an out-of-memory error in backward, and a kernel build that fails. Each leaves the parameters
and the optimizer state as they were, says what happened, and the next step trains normally.

The plug-in is a fake one (an entry point of a distribution ``torchstash-faulty``) whose codec
stores a copy, as ``test.clone`` does, and raises where told: so every step that does not
raise is bit-identical to stock PyTorch's, and a twin model trained without torchstash is the
reference for "unchanged" and "trains normally".
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import re
import sys
import types
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash import env
from torchstash.errors import CompressionError, KernelUnavailable
from torchstash.kernels import group_quantize, loader
from torchstash.kernels.groupquant_reference import group_quantize_ref
from torchstash.optrack import STATE as OP_STATE
from torchstash.packed import Packed
from torchstash.registry import EntryPoint
from torchstash.site import Site
from torchstash.testing.hooks import hook_total
from torchstash.testing.models import zoo
from torchstash.testing.toys import CloneCompressor

GPT = next(e for e in zoo("tiny") if e.name == "gpt")
CPU = torch.device("cpu")
DIST, VERSION = "torchstash-faulty", "0.3"


class Faulty(CloneCompressor):
    """Stores a copy; while ``armed`` it raises in ``fail_in`` for modules matching ``where``."""

    name = "faulty-codec"

    def __init__(self, fail_in: str = "compress", error: str = "value", where: str = "*") -> None:
        self.fail_in = fail_in
        self.error = error
        self.where = where
        self.armed = False
        self.payloads: list[weakref.ref[torch.Tensor]] = []  # every copy it made, weakly

    def _maybe_raise(self, stage: str, module: str) -> None:
        if self.armed and stage == self.fail_in and fnmatch.fnmatchcase(module, self.where):
            if self.error == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise ValueError("codec state is corrupt")

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        self._maybe_raise("compress", site.module)
        packed = super().compress(x, site)
        packed.meta["module"] = site.module
        data = packed.tensors["data"]
        assert isinstance(data, torch.Tensor)
        self.payloads.append(weakref.ref(data))
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        self._maybe_raise("decompress", str(packed.meta["module"]))
        return super().decompress(packed)

    def alive(self) -> int:
        return sum(r() is not None for r in self.payloads)


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch) -> str:
    """``faulty.codec`` from the fake plug-in ``torchstash-faulty``, found through its entry
    point by the process-wide registry; every registry change is undone after the test."""
    reg = ts.REGISTRY
    reg.load_all()
    monkeypatch.setattr(reg, "_strategies", dict(reg._strategies))
    monkeypatch.setattr(reg, "_plugins", dict(reg._plugins))
    module = types.ModuleType("torchstash_faulty")

    def register(registry: Any) -> None:
        registry.register("faulty.codec", Faulty, lossless=True, summary="copies; raises if told")

    module.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchstash_faulty", module)
    point = EntryPoint("faulty", "torchstash_faulty:register", DIST, VERSION, lambda: register)
    monkeypatch.setattr(reg, "_entry_points", {**reg._entry_point_map(), "faulty": [point]})
    return "faulty.codec"


def codec_of(handle: ts.Handle | ts.stash) -> Faulty:
    (codec,) = [b.compressor for b in handle.plan.built.values() if b.compressor is not None]
    assert isinstance(codec, Faulty)
    return codec


class Twins:
    """A model under torchstash and a stock twin, each with its own Adam, trained in step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = GPT.build()
        self.twin = copy.deepcopy(self.model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.twin_opt = torch.optim.Adam(self.twin.parameters(), lr=1e-2)

    def batch(
        self, opt: torch.optim.Optimizer, n: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``'s batch, drawn with ``seed``, with ``opt``'s gradients zeroed: where a test
        runs the rest of the step itself."""
        torch.manual_seed(seed)
        x, y = GPT.batch(n, CPU)
        opt.zero_grad(set_to_none=True)
        return x, y

    def step(self, model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
        x, y = self.batch(opt, n, seed)
        GPT.loss(model, x, y).backward()
        opt.step()

    def both(self, n: int = 4, seed: int = 1) -> None:
        self.step(self.model, self.opt, n, seed)
        self.step(self.twin, self.twin_opt, n, seed)

    def assert_same(self) -> None:
        """Parameters and optimizer state bit-equal to the twin's (which never faulted)."""
        for a, b in zip(self.model.parameters(), self.twin.parameters(), strict=True):
            assert torch.equal(a, b)
        mine, theirs = self.opt.state_dict()["state"], self.twin_opt.state_dict()["state"]
        assert mine.keys() == theirs.keys() and mine
        for k in mine:
            for name, value in mine[k].items():
                assert torch.equal(value, theirs[k][name]), (k, name)


def twins_under(faulty: str, **options: Any) -> tuple[Twins, ts.Handle, Faulty]:
    """Twins, the model under ``faulty`` with ``options`` (its codec not armed yet), after a
    normal step by both: the optimizer has state to keep."""
    t = Twins()
    handle = ts.apply(t.model, faulty, **options)
    t.both(seed=1)
    return t, handle, codec_of(handle)


def assert_engine_idle(handle: ts.Handle) -> None:
    """No frame, activation, op tracker or saved-tensor hook left behind by the fault."""
    assert not handle.engine.active and not handle.engine._tls.frames
    assert OP_STATE.depth == 0 and not OP_STATE.op
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_function_stack() == 0


def assert_removed(model: nn.Module) -> None:
    assert ts.handle_of(model) is None
    assert hook_total(model) == 0


def suggested_rule(message: str) -> dict[str, str]:
    """The policy rule the error proposes, read back as the user would paste it."""
    match = re.search(r"policy rule (\{.*?\})", message)
    assert match, message
    rule = ast.literal_eval(match.group(1))
    assert isinstance(rule, dict)
    return rule


# -- a plug-in that raises --------------------------------------------------------------------


def test_compress_error_in_forward(faulty: str) -> None:
    t, handle, codec = twins_under(faulty, where="blocks.1.mlp.*")
    t.assert_same()
    codec.armed = True
    with pytest.raises(CompressionError) as info:
        t.step(t.model, t.opt, 4, seed=2)
    message = str(info.value)
    for part in (
        "strategy 'faulty.codec'",
        "compressor 'faulty-codec'",
        f"{Faulty.__module__}.Faulty",
        f"from {DIST} {VERSION}",
        "(64, 64) torch.float32 tensor linear.input saved in module 'blocks.1.mlp.0' (Linear)",
        "leave module 'blocks.1.mlp.0' out with the policy rule",
        "ValueError: codec state is corrupt",
        "raised in forward",
        f"report this to {DIST} {VERSION}",
    ):
        assert part in message, (part, message)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "codec state is corrupt"
    assert all(p.grad is None for p in t.model.parameters())  # zero_grad set them to None
    t.assert_same()
    assert_engine_idle(handle)

    codec.armed = False  # the same handle goes on: bit-identical to stock
    t.both(seed=3)
    t.assert_same()
    assert handle.tally.raw_bytes > 0
    handle.remove()
    assert_removed(t.model)

    # What the message proposes works: that module left out, the armed codec trains
    policy: list[dict[str, Any]] = [{"strategy": faulty, "options": {"where": "blocks.1.mlp.*"}}]
    rule = suggested_rule(message)
    assert rule == {"module": "blocks.1.mlp.0", "strategy": "none"}
    policy.append(rule)
    with ts.apply(t.model, policy=policy) as h2:
        codec_of(h2).where = "blocks.1.mlp.0"
        codec_of(h2).armed = True
        t.both(seed=4)
    t.assert_same()
    assert_removed(t.model)


def test_decompress_error_in_backward(faulty: str) -> None:
    t, handle, codec = twins_under(faulty, fail_in="decompress", where="blocks.0.*")
    codec.armed = True
    codec.payloads.clear()
    x, y = t.batch(t.opt, 4, seed=2)
    loss = GPT.loss(t.model, x, y)
    assert codec.alive() > 0
    with pytest.raises(CompressionError) as info:
        loss.backward(retain_graph=True)
    message = str(info.value)
    for part in (
        "strategy 'faulty.codec'",
        "compressor 'faulty-codec'",
        "failed to restore the",
        "saved in module 'blocks.0.",
        "ValueError: codec state is corrupt",
        "raised in backward",
        "gradients may be partly accumulated: zero them",
        f"report this to {DIST} {VERSION}",
    ):
        assert part in message, (part, message)
    assert isinstance(info.value.__cause__, ValueError)
    # What that forward stored went back at once, though the graph (loss) is still referenced;
    # only the payload being restored is held, by the traceback, until the error is dropped
    assert codec.alive() <= 1
    assert re.search(r"released the [1-9]\d* tensors \([\d.]+ MiB\)", message), message
    # Backward ran through the later layers first: their gradients are partly accumulated,
    # as the message says; the optimizer has not stepped
    assert t.model.head.weight.grad is not None
    assert all(p.grad is None for p in t.model.blocks[0].parameters())
    t.assert_same()
    assert_engine_idle(handle)
    codec.armed = False
    with pytest.raises(CompressionError, match="released when an earlier backward"):
        loss.backward()  # the released graph says so
    del info
    assert codec.alive() == 0
    del loss

    t.both(seed=3)  # zero_grad, then a normal step: bit-identical to stock
    t.assert_same()
    handle.remove()
    assert_removed(t.model)


def test_a_tensor_two_forward_passes_share_survives_one_failed_backward(faulty: str) -> None:
    """Only what the failing pass alone stored is released: another graph keeps working."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    twin = copy.deepcopy(model)
    x = torch.randn(64, 32)  # both passes save it: stored once, shared
    handle = ts.apply(model, faulty, fail_in="decompress")
    first = model(x).sum()
    second = model(x).square().sum()
    assert sum(r.shared for r in handle.tally.rows.values()) >= 1
    codec = codec_of(handle)
    codec.armed = True
    with pytest.raises(CompressionError):
        first.backward()  # the pass that stored the shared input fails
    codec.armed = False
    model.zero_grad(set_to_none=True)
    second.backward()  # the second graph, the shared input included, is whole
    twin(x).square().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    handle.remove()


def test_a_fault_inside_a_stash_block(faulty: str) -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    block = ts.stash(faulty)
    x = torch.randn(64, 32)
    with pytest.raises(CompressionError, match="saved in module '<Linear>'"), block:
        codec_of(block).armed = True
        model(x).sum().backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert OP_STATE.depth == 0 and torch._C._len_torch_function_stack() == 0
    with ts.stash(faulty) as again:  # a new block works
        model(x).sum().backward()
    assert again.tally.stored_bytes > 0


# -- out of memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("fail_in", ["compress", "decompress"])
def test_out_of_memory_keeps_its_type(faulty: str, fail_in: str) -> None:
    t, handle, codec = twins_under(faulty, fail_in=fail_in, error="oom")
    codec.armed = True
    codec.payloads.clear()
    x, y = t.batch(t.opt, 8, seed=2)
    caught: torch.OutOfMemoryError | None = None
    loss = None
    try:  # the usual batch-size back-off
        loss = GPT.loss(t.model, x, y)
        loss.backward()
    except torch.OutOfMemoryError as e:
        caught = e
    assert caught is not None and type(caught) is torch.OutOfMemoryError
    assert caught.__cause__ is None
    assert str(caught).startswith("CUDA out of memory")
    (note,) = caught.__notes__
    assert note.startswith(
        f"torchstash: raised in {'forward' if fail_in == 'compress' else 'back'}"
    )
    assert "strategy 'faulty.codec'" in note and " torch.float32 tensor " in note
    if fail_in == "decompress":
        assert loss is not None  # still referenced, as in a training loop's variable
        assert codec.alive() <= 1 and "released the" in note and "zero them" in note
    else:
        assert "gradients and optimizer state are as they were" in note
    t.assert_same()
    assert_engine_idle(handle)
    del caught, loss
    assert codec.alive() == 0

    codec.armed = False
    t.both(n=4, seed=3)  # the next, smaller step: as stock
    t.assert_same()
    handle.remove()
    assert_removed(t.model)


# -- a kernel build that fails ----------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build is attempted again at the next kernel call; the memo is put back after."""
    monkeypatch.setattr(loader, "_outcome", None)
    monkeypatch.setattr(loader, "_warned", False)


def _crash() -> Any:
    raise RuntimeError("simulated: the compiler was killed")


def test_an_exception_anywhere_in_the_build_is_a_failed_build(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "_build", _crash)
    monkeypatch.setenv(env.KERNELS, "auto")
    x = torch.randn(1000)
    with pytest.warns(RuntimeWarning) as caught:
        got = group_quantize(x, 4, seed=7)
        assert not loader.available()
    (w,) = caught
    message = str(w.message)
    assert "build failed: RuntimeError: simulated: the compiler was killed" in message
    assert "using the pure-PyTorch reference" in message
    for a, b in zip(got, group_quantize_ref(x, 4, 256, 7, True), strict=True):
        assert torch.equal(a, b)
    info = loader.status()
    assert not info["built"] and info["error"].startswith("RuntimeError: simulated")


def test_require_raises_with_the_cause_and_a_fixed_cause_is_retried(
    built: None, fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.KERNELS, "require")
    with monkeypatch.context() as fault:
        fault.setattr(loader, "_build", _crash)
        with pytest.raises(KernelUnavailable, match="unset TORCHSTASH_KERNELS") as info:
            group_quantize(torch.randn(1000), 4, seed=7)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "build failed: RuntimeError: simulated" in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.load()  # the failure was not memoized: this call builds (or loads)
        group_quantize(torch.randn(1000), 4, seed=7)
