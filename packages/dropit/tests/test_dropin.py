"""DropIT's users, one import line changed: ``to_dropit`` as its README and benchmarks call
it, held to DropIT's own rule (the ``int(numel * (1 - gamma))`` largest magnitudes of each
converted layer's whole input, the rest zero, for the weight gradient only), computed here by
stock PyTorch's backward on an input dropped by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_dropit.compat as dropit
from torchstash.errors import OptionError
from torchstash_dropit.compat.dropiter import DropITer


def drop_mink(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """DropIT's ``mink``, in this test's own words."""
    flat = x.reshape(-1)
    k = int(flat.numel() * (1 - gamma))
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.abs().topk(k, sorted=False).indices] = True
    return torch.where(keep, flat, 0).view_as(x)


def reference_grads(
    model: nn.Module, x: torch.Tensor, converted: Callable[[nn.Module], bool], gamma: float
) -> dict[str, torch.Tensor]:
    """Stock's gradients with each converted layer's saved input replaced by its drop."""
    inputs: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        for m in model.modules()
        if converted(m)
    ]

    def unpack(t: torch.Tensor) -> torch.Tensor:
        for i in inputs:
            if t.data_ptr() == i.data_ptr() and t.numel() == i.numel() and t.dtype == i.dtype:
                return drop_mink(t, gamma)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        loss = model(x * 1.0).square().mean()
    loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def our_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x * 1.0).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_converted_weights(model: nn.Module, *, exact: str, dropped: str) -> None:
    """After ``to_dropit(model, "mink", 0.9)``, the weight ``exact``'s gradient is stock's
    bit for bit and ``dropped``'s is not (its layer's input was dropped)."""
    x = torch.randn(32, 16)
    stock = our_grads(model, x)
    dropit.to_dropit(model, "mink", 0.9)
    got = our_grads(model, x)
    assert torch.equal(got[exact], stock[exact])
    assert not torch.equal(got[dropped], stock[dropped])


class Block(nn.Module):
    """A transformer MLP and a conv stem, as DropIT's DeiT and R-CNN runs convert them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).flatten(2).transpose(1, 2).contiguous()  # (batch, tokens, channels)
        return self.head(self.fc2(self.act(self.fc1(h))).mean(1))


def exactly(*types: type) -> Callable[[nn.Module], bool]:
    return lambda m: type(m) in types and not hasattr(m, "no_dropit")


@pytest.mark.parametrize("gamma", [0.9, 0.7, 0.3, 0.02])
def test_readme_call_gives_dropits_gradients(gamma: float) -> None:
    """``to_dropit(model, strategy='mink', gamma=...)`` with the benchmarks' opt-outs; at
    gamma 0.02 no sparse form is smaller, and DropIT's drop is stored dense."""
    torch.manual_seed(0)
    model = Block()
    model.stem.no_dropit = True  # DeiT: patch_embed.proj and head are left exact
    model.head.no_dropit = True
    x = torch.randn(4, 3, 6, 6)
    stock = our_grads(model, x)
    ref = reference_grads(model, x, exactly(nn.Linear, nn.Conv2d), gamma)
    assert dropit.to_dropit(model, strategy="mink", gamma=gamma) is model
    got = our_grads(model, x)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got["stem.weight"], stock["stem.weight"])  # no_dropit: exact
    assert not torch.equal(got["fc1.weight"], stock["fc1.weight"])
    assert torch.equal(got["fc1.bias"], stock["fc1.bias"])  # only weight gradients change
    ts.remove(model)


def test_positional_call_of_the_benchmarks_and_every_tensor_is_dropped() -> None:
    """``to_dropit(model, args.strategy, args.gamma, args.autocast)``; a 4x8 input is dropped
    too (DropIT has no minimum size)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    ref = reference_grads(model, x, exactly(nn.Linear), 0.5)
    dropit.to_dropit(model, "mink", 0.5, False)
    got = our_grads(model, x)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_no_dropit_skips_the_module_even_when_false_but_not_its_children() -> None:
    torch.manual_seed(0)
    model = Block()
    model.no_dropit = False  # the root: present, so skipped; its children still converted
    model.fc2.no_dropit = False
    x = torch.randn(4, 3, 6, 6)
    stock = our_grads(model, x)
    ref = reference_grads(model, x, exactly(nn.Linear, nn.Conv2d), 0.9)
    dropit.to_dropit(model, "mink", 0.9)
    got = our_grads(model, x)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert torch.equal(got["fc2.weight"], stock["fc2.weight"])
    assert not torch.equal(got["fc1.weight"], stock["fc1.weight"])


def test_only_the_exact_types_are_converted() -> None:
    """DropIT matched ``type(module)``: a Linear subclass (``nn.MultiheadAttention``'s
    out-projection is one) and a Conv1d stay exact."""

    class MyLinear(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(MyLinear(16, 16), nn.GELU(), nn.Linear(16, 4))
    assert_converted_weights(model, exact="0.weight", dropped="2.weight")


def test_mink_cpuidx_is_mink_with_the_positions_in_host_memory() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6)
    grads = []
    for strategy in ("mink", "mink_cpuidx"):
        torch.manual_seed(0)
        model = Block()
        dropit.to_dropit(model, strategy, 0.9)
        grads.append(our_grads(model, x))
        ts.remove(model)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_vrandom_drops_a_random_share_unbiased() -> None:
    """DropIT's ``vrandom`` (which failed in its own layers): a random ``1 - gamma`` share,
    scaled so the weight gradient's expectation is stock's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(256, 64)
    stock = our_grads(model, x)["0.weight"]
    dropit.to_dropit(model, "vrandom", 0.5)
    mean = sum(our_grads(model, x)["0.weight"] for _ in range(200)) / 200
    assert not torch.equal(our_grads(model, x)["0.weight"], stock)
    assert float((mean - stock).norm() / stock.norm()) < 0.1


def test_transformers_conv1d_is_converted() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(16, 8), nn.GELU(), Conv1D(4, 16))
    x = torch.randn(2, 16, 8)
    ref = reference_grads(model, x, exactly(Conv1D), 0.9)
    dropit.to_dropit(model, "mink", 0.9)
    got = our_grads(model, x)
    assert transformers is not None
    assert all(torch.allclose(got[n], ref[n], rtol=1e-6, atol=0) for n in ref)


def test_bad_calls_say_what_dropit_takes() -> None:
    with pytest.raises(OptionError, match="strategy='topk' is not one of DropIT's: mink, "):
        dropit.to_dropit(Block(), "topk", 0.9)
    with pytest.raises(OptionError, match="autocast"):
        dropit.to_dropit(Block(), "mink", 0.9, "yes")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="DropITer: strategy='random'"):
        DropITer("random", 0.9)


@pytest.mark.parametrize("strategy", ["mink", "mink_cpuidx"])
def test_dropiter_selects_and_pads_as_dropit_did(strategy: str) -> None:
    """As DropIT's GPT-2 layer test builds one: ``DropITer('mink', gamma)`` with
    ``autocast`` set by hand; ``select`` keeps ``int(numel * reserve)`` values, ``pad``
    puts them back among zeros, flattened."""
    dropiter = DropITer(strategy, 0.75)
    dropiter.autocast = False
    assert dropiter.reserve == 0.25
    x = torch.randn(6, 10)
    ctx = type("Ctx", (), {})()
    kept = dropiter.select(x, ctx)
    assert kept.shape == (15,)
    if strategy == "mink_cpuidx":
        assert ctx.idxs.device.type == "cpu"
    assert torch.equal(dropiter.pad(kept, ctx).view_as(x), drop_mink(x, 0.75))
    model = Block()
    assert DropITer.transfer(model, strategy, 0.9, False) is model
    assert any(ts.is_applied(m) for m in [model]) if hasattr(ts, "is_applied") else True


def test_an_input_another_op_keeps_whole_stays_exact() -> None:
    """Different on purpose: a ReLU keeps its output, which is the next layer's input; DropIT
    stored a dropped copy beside it (more memory than stock). Here the one tensor is shared
    and that layer's weight gradient stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    assert_converted_weights(model, exact="2.weight", dropped="0.weight")


def test_a_gamma_that_keeps_nothing_zeroes_the_weight_gradient() -> None:
    """``int(32 * 0.01) == 0``: DropIT kept nothing of a 4x8 input, so did this."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    dropit.to_dropit(model, "mink", 0.99)
    got = our_grads(model, torch.randn(4, 8))
    assert torch.equal(got["0.weight"], torch.zeros(8, 8)) and got["0.bias"].abs().sum() > 0


@pytest.mark.parametrize("storage", ["bitmap", "offsets"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_positions_in_host_memory_round_trip(storage: str, device: str) -> None:
    from torchstash.site import Site
    from torchstash_dropit import MinK

    codec = MinK(0.9, "tensor", storage, min_numel=1, keep="floor", indices="cpu")
    x = torch.randn(64, 96, device=device)
    packed = codec.compress(x, Site(op="linear", role="input"))
    for key in ("mask", "offsets", "counts"):
        if key in packed.tensors:
            assert packed.tensors[key].device.type == "cpu"
    assert packed.tensors["values"].device.type == device
    assert torch.equal(codec.decompress(packed).cpu(), drop_mink(x.cpu(), 0.9))


@pytest.mark.parametrize(
    ("option", "value"), [("keep", "round"), ("dense", "keep"), ("indices", "gpu")]
)
def test_new_options_name_their_choices(option: str, value: str) -> None:
    from torchstash_dropit import MinK

    with pytest.raises(OptionError, match=f"{option}={value!r}"):
        MinK(**{option: value})  # type: ignore[arg-type]
