"""ActNN's and GACT's users, one import line changed: their READMEs' calls, ActNN's layer
tests (a Q-layer built directly, weights copied from the torch layer), GACT's training loop in
both its forms, and the memory helpers their benchmarks call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_quant.compat.actnn as actnn
import torchstash_quant.compat.gact as gact
from torchstash.testing.models import zoo

GPT = next(e for e in zoo("tiny") if e.name == "gpt")


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    yield
    actnn.set_optimization_level("L3")
    actnn.config.training = True
    gact.set_optimization_level("L2")
    gact.set_adapt_interval(1000)


def cnn() -> nn.Sequential:
    """ActNN's own layers, built directly as its README lists them."""
    torch.manual_seed(0)
    return nn.Sequential(
        actnn.QConv2d(3, 16, 3, padding=1),
        actnn.QBatchNorm2d(16),
        actnn.QReLU(),
        actnn.QMaxPool2d(2),
        actnn.QConv2d(16, 16, 3, padding=1, groups=4),
        actnn.QDropout(0.1),
        nn.Flatten(),
        actnn.QLinear(16 * 8 * 8, 10),
    )


def stashes(model: nn.Module) -> list[ts.stash]:
    return [m._actnn_stash for m in model.modules() if getattr(m, "_actnn_stash", None)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("level", ["L2", "L3"])
def test_q_layers_built_directly_quantize_on_their_own(level: str, device: str) -> None:
    actnn.set_optimization_level(level)
    model = cnn().to(device)
    x, y = torch.randn(8, 3, 16, 16).to(device), torch.randint(0, 10, (8,)).to(device)
    torch.manual_seed(1)
    nn.functional.cross_entropy(model(x), y).backward()
    got = [p.grad.clone() for p in model.parameters()]
    blocks = stashes(model)
    assert len(blocks) == 7
    raw = sum(b.tally.raw_bytes for b in blocks)
    stored = sum(b.tally.stored_bytes for b in blocks)
    assert raw > 4 * stored, (raw, stored)
    actnn.config.training = False  # as QModule.eval() sets it: the torch layers, exact
    model.zero_grad()
    torch.manual_seed(1)
    nn.functional.cross_entropy(model(x), y).backward()
    exact = [p.grad.clone() for p in model.parameters()]
    assert all(g.isfinite().all() for g in got)
    whole = cosine(torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in exact]))
    assert whole > {"L2": 0.98, "L3": 0.7}[level]  # measured: 0.989 (4 bits), 0.80 (2 on average)
    assert sum(b.tally.raw_bytes for b in blocks) == raw  # nothing more went through them


def test_actnn_layer_test_usage_with_compression_off() -> None:
    """ActNN's test_linear: a QLinear given an nn.Linear's weights, compression off (its
    ``config.compress_activation = False``): the same output and gradients, bit for bit."""
    actnn.config.compress_activation = False
    torch.manual_seed(0)
    ref, q = nn.Linear(100, 10), actnn.QLinear(100, 10)
    with torch.no_grad():
        q.weight.copy_(ref.weight)
        q.bias.copy_(ref.bias)
    x = torch.randn(32, 100)
    for layer in (ref, q):
        layer(x).square().sum().backward()
    assert torch.equal(ref.weight.grad, q.weight.grad) and torch.equal(ref.bias.grad, q.bias.grad)
    actnn.set_optimization_level("L2")  # compression back on: close, not equal
    q2 = actnn.QLinear(100, 10)
    with torch.no_grad():
        q2.weight.copy_(ref.weight)
        q2.bias.copy_(ref.bias)
    xr = torch.randn(256, 100)
    ref.zero_grad()
    ref(xr).square().sum().backward()
    q2(xr).square().sum().backward()
    assert not torch.equal(ref.weight.grad, q2.weight.grad)
    assert cosine(ref.weight.grad, q2.weight.grad) > 0.99


def test_qmodule_readme_and_faq() -> None:
    """``set_optimization_level("L2"); config.activation_compression_bits = [8]``, then
    ``QModule(model)``: 8 bits; ``train()``/``eval()`` set ``config.training``."""
    actnn.set_optimization_level("L2")
    actnn.config.activation_compression_bits = [8]
    model = GPT.build()
    q = actnn.QModule(model)
    assert q.handle is not None and q.handle.policy.rules[0].strategy == "quant.int8"
    q.eval()
    assert actnn.config.training is False
    q.train()
    assert actnn.config.training is True
    q.remove()


def test_qmodule_around_q_layers() -> None:
    """A model of Q-layers wrapped in QModule: each layer's own block decides its saves."""
    actnn.set_optimization_level("L2")
    model = cnn()
    q = actnn.QModule(model)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(q(x), y).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert sum(b.tally.stored_bytes for b in stashes(model)) > 0
    q.remove()


def test_qscheme_attributes_and_per_sample_indices() -> None:
    """ActNN's README: ``config.use_gradient = True; QScheme.num_samples = ...``, and its
    DataLoader's ``(indices, batch)`` for ``QScheme.batch = indices``."""
    actnn.QScheme.num_samples = 100
    actnn.config.use_gradient = True
    try:
        layer = actnn.QConv2d(3, 4, 3)
        assert isinstance(layer.scheme, actnn.QScheme) and layer.scheme in actnn.QScheme.layers
        assert layer.scheme.num_locations == 9
        bn = actnn.QBatchNorm2d(4)
        assert isinstance(bn.scheme, actnn.QBNScheme) and bn.scheme.prev_linear is layer.scheme
        data = torch.utils.data.TensorDataset(torch.randn(10, 3, 5, 5), torch.arange(10))
        loader = actnn.DataLoader(data, batch_size=4)
        indices, (images, target) = next(iter(loader))
        assert images.shape == (4, 3, 5, 5)
        assert torch.equal(indices, torch.arange(4)) and torch.equal(target, torch.arange(4))
        actnn.QScheme.batch = indices
        layer.scheme.set_scale(torch.ones(4, 2))
        assert torch.equal(layer.scheme.get_scale(), torch.full((4,), 1.0))
        actnn.QScheme.update_scale = False
        layer.scheme.set_scale(torch.zeros(4, 2))
        assert torch.equal(layer.scheme.get_scale(), torch.full((4,), 1.0))
    finally:
        actnn.QScheme.num_samples, actnn.QScheme.batch = 1, None
        actnn.QScheme.update_scale = True
        actnn.config.use_gradient = False


def test_layer_signatures_take_group() -> None:
    assert actnn.QConv2d(3, 4, 3, 1, 0, 1, 1, True, "zeros", 1).scheme.group == 1
    assert actnn.QLinear(4, 5, True, 1).scheme.group == 1
    assert actnn.QConvTranspose2d(3, 4, 3, 1, 0, 0, 1, True, 1, "zeros", 0).out_channels == 4
    assert actnn.QBatchNorm1d(4, 1e-5, 0.1, True, True, 0).num_features == 4
    assert actnn.QReLU(inplace=True).inplace is False  # ActNN's ignored it
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(actnn.layers.QAvgPool2d(2)(x), nn.functional.avg_pool2d(x, 2))


def test_memory_helpers(tmp_path: Path) -> None:
    tensors = [torch.zeros(3, dtype=torch.int64), torch.zeros(4), torch.zeros(2, dtype=torch.bool)]
    assert actnn.compute_tensor_bytes(tensors) == 24 + 16 + 2
    assert gact.utils.compute_tensor_bytes(torch.zeros(5, dtype=torch.float16)) == 10
    assert actnn.compute_tensor_bytes((torch.zeros(2), 7)) == 8 + 4
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torchstash.measure"):
            actnn.get_memory_usage(True)
    recorder = actnn.utils.GlobalExpRecorder()
    recorder.record("act_mem", 1.23456789, 2)
    recorder.record("batch", torch.tensor(64))
    recorder.dump(str(tmp_path / "mem.json"))
    assert json.loads((tmp_path / "mem.json").read_text()) == {"act_mem": 1.23, "batch": 64}
    recorder.clear()
    assert not recorder.val_dict and actnn.exp_recorder is gact.utils.exp_recorder


@pytest.mark.cuda
def test_get_memory_usage_reads_the_cuda_allocator() -> None:
    before = actnn.get_memory_usage()
    x = torch.empty(1024, 1024, device="cuda")
    assert actnn.get_memory_usage() - before >= x.numel() * 4


def test_level_calls_start_from_the_defaults() -> None:
    actnn.set_optimization_level("L2")
    actnn.set_optimization_level("L3")  # ActNN's kept L2's 4 bits here
    assert actnn.config.activation_compression_bits == [2, 8, 8]
    assert actnn.conf.strategy(batchnorm=False)[0] == "quant.auto"
    actnn.set_optimization_level("L1")
    assert actnn.conf.strategy(batchnorm=False)[0] == "quant.L1"
    actnn.set_optimization_level("L4")
    assert actnn.conf.strategy(batchnorm=False)[0] == "quant.auto>offload.cpu"
    actnn.set_optimization_level("swap")
    assert actnn.conf.strategy(batchnorm=False) == ("offload.cpu", {})


def backprop_factory(model: nn.Module, calls: list[int]) -> object:
    def backprop() -> None:
        calls.append(1)

    return backprop


def test_gact_readme_loop() -> None:
    gact.set_optimization_level("L2")
    model = GPT.build()
    keys = list(model.state_dict())
    controller = gact.controller.Controller(model)
    controller.install_hook()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = GPT.batch(4, torch.device("cpu"))
    calls: list[int] = []
    for _ in range(3):
        loss = GPT.loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        controller.iterate(backprop_factory(model, calls))
    assert calls == [] and controller.iter == 3 and torch.isfinite(loss)
    assert controller.handle is not None
    tally = controller.handle.tally
    assert tally.raw_bytes > 3 * tally.stored_bytes
    controller.uninstall_hook()
    assert ts.handle_of(model) is None and list(model.state_dict()) == keys


def test_gact_explicit_hooks_form() -> None:
    """GACT's benchmark form: its pack/unpack hooks around the loop."""
    gact.set_optimization_level("L1")
    gact.set_adapt_interval(20)
    model = GPT.build()
    controller = gact.Controller(model)

    def pack_hook(tensor: torch.Tensor) -> object:
        return controller.quantize(tensor)

    def unpack_hook(tensor: object) -> torch.Tensor:
        return controller.dequantize(tensor)

    x, y = GPT.batch(4, torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
        loss = GPT.loss(model, x, y)
        loss.backward()
    assert controller.handle is not None
    assert controller.handle.tally.raw_bytes > 3 * controller.handle.tally.stored_bytes
    controller.uninstall_hook()


def mlp_grads(model: nn.Module, hooks: tuple[object, object] | None = None) -> list[torch.Tensor]:
    """One step of a 3-layer MLP, under the baseline's pass-through hooks (GACT's GNN
    benchmark without ``--actnn``) or the given ones."""
    torch.manual_seed(1)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    pack, unpack = hooks or (lambda t: t, lambda t: t)
    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):  # type: ignore[arg-type]
        nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
    )


@pytest.mark.parametrize("level", ["L1.2", "L2"])
def test_gact_controller_never_hooked_changes_nothing(level: str) -> None:
    """GACT's controller does nothing until its hooks are used; its GNN benchmark builds one
    for the full-precision baseline too. Built, iterated, never hooked: stock, bit for bit;
    hooked, quantized; unhooked, stock again."""
    gact.set_optimization_level(level)
    model = mlp()
    stock = mlp_grads(model)
    controller = gact.controller.Controller(model)
    assert controller.handle is None and ts.handle_of(model) is None
    got = mlp_grads(model)
    controller.iterate(None)
    assert all(torch.equal(a, b) for a, b in zip(got, stock, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(mlp_grads(model), stock, strict=True))
    controller.install_hook()
    assert ts.handle_of(model) is controller.handle is not None
    hooked = mlp_grads(model)
    assert not all(torch.equal(a, b) for a, b in zip(hooked, stock, strict=True))
    controller.uninstall_hook()
    assert ts.handle_of(model) is None
    assert all(torch.equal(a, b) for a, b in zip(mlp_grads(model), stock, strict=True))


def test_gact_explicit_form_applies_the_level_when_first_called() -> None:
    """The explicit form applies the level at ``quantize``'s first call, in the first forward:
    that step quantizes every save but those already under way (the first layer's input, which
    made the call); from the second step on, every save, as under ``install_hook``."""
    gact.set_optimization_level("L1.2")
    hooked = gact.Controller(mlp())
    hooked.install_hook()
    mlp_grads(hooked.model)
    assert hooked.handle is not None
    full = hooked.handle.tally
    model = mlp()
    stock = mlp_grads(model)
    controller = gact.Controller(model)
    hooks = (controller.quantize, controller.dequantize)
    first = mlp_grads(model, hooks)
    assert controller.handle is not None
    tally = controller.handle.tally
    assert sorted(tally.rows) == ["1", "2", "3", "4"]
    assert sorted(full.rows) == ["0", "1", "2", "3", "4"]
    assert tally.raw_bytes == full.raw_bytes - 64 * 32 * 4  # the input of layer 0
    assert not all(torch.equal(a, b) for a, b in zip(first, stock, strict=True))
    tally.reset()
    mlp_grads(model, hooks)
    assert tally.raw_bytes == full.raw_bytes and tally.stored_bytes == full.stored_bytes
    controller.uninstall_hook()
    hooked.uninstall_hook()


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("L0", None),
        ("L1.1", "quant.int8"),
        ("L1.2", "quant.int2"),
        ("L2.1", "quant.auto"),
        ("L3", "quant.auto>offload.cpu"),
        ("swap", "offload.cpu"),
        ("L4bit-swap", "quant.int4>offload.cpu"),
    ],
)
def test_gact_levels(level: str, expected: str | None) -> None:
    gact.set_optimization_level(level)
    gact.set_adapt_interval(50)
    name, options = gact.conf.strategy()
    assert name == expected
    if level == "L2.1":
        assert options["budget"] == 3 and options["interval"] == 50
