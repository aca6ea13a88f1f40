"""Outputs recomputed from a stored input (``torchstash.derive``), against stock PyTorch."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstash as ts
from torchstash import derive, replaystep
from torchstash.derive import matmul_order, recipe
from torchstash.site import Site
from torchstash.testing.models import SelfAttention
from torchstash.testing.toys import DerivableClone

pytestmark = pytest.mark.usefixtures("toy_strategies")


class Mlp(nn.Module):
    """``fc2(act(fc1(norm(x))))``: the LayerNorm's output is fc1's saved input, the
    activation's output fc2's."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _setup(act: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Mlp(act)
    with torch.no_grad():  # a LayerNorm with a non-trivial affine part
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model, torch.randn(4, 16, 32)


def _rows(handle: ts.Handle) -> dict[str, tuple[int, int, int]]:
    """module -> (derived, raw bytes, stored bytes)."""
    return {k: (r.derived, r.raw_bytes, r.stored_bytes) for k, r in handle.tally.rows.items()}


@pytest.mark.parametrize(
    "act",
    [
        F.gelu,
        F.silu,
        lambda x: F.gelu(x, approximate="tanh"),
        lambda x: F.silu(x, inplace=True),  # saves a copy of its input: the recipe's source
        nn.SiLU(inplace=True),
        F.hardswish,
        nn.Hardswish(inplace=True),  # MobileNetV3's
    ],
    ids=[
        "gelu",
        "silu",
        "gelu-tanh",
        "silu-inplace",
        "SiLU-inplace-module",
        "hardswish",
        "Hardswish-inplace-module",
    ],
)
def test_activation_output_recomputed_bit_exact(
    act: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    model, x = _setup(act)
    ref = _grads(model, x)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = _grads(model, x)
        rows = _rows(h)
    # The activation's output (fc2's input) costs no bytes: it is the activation's input again.
    assert rows["fc2"][0] == 1 and rows["fc2"][2] == 0 and rows["fc2"][1] == 4 * 16 * 64 * 4
    assert rows["fc1"][0] == 1 and rows["fc1"][2] == 0  # the LayerNorm's output
    # Everything but the LayerNorm's output is exact, and fc2's weight sees only the
    # activation's output: bit-exact.
    assert torch.equal(ref[-2], got[-2]) and torch.equal(ref[-1], got[-1])
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layer_norm_output_from_saved_statistics() -> None:
    """The recipe uses the forward's mean and rstd, so it agrees with the LayerNorm's own
    output to rounding, and the bytes it saves are exactly that output's."""
    model, x = _setup()
    ref = _grads(model, x)
    with ts.apply(model, "test.clone", min_bytes=0) as h:
        _grads(model, x)
        plain = _rows(h)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = _grads(model, x)
        rows = _rows(h)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    out = 4 * 16 * 32 * 4  # the LayerNorm's output, fp32
    assert plain["fc1"][2] == out and rows["fc1"][2] == 0
    assert sum(r[1] for r in rows.values()) == sum(r[1] for r in plain.values())  # raw: same


def test_lossy_code_recomputes_from_the_code() -> None:
    """With a lossy code the output is the op applied to the restored input: fc2's weight
    gradient equals stock's on ``gelu(bf16(x))``."""
    model, x = _setup()
    with ts.apply(model, "test.derive_half", min_bytes=0) as h:
        got = _grads(model, x)
        assert h.tally.rows["fc2"].derived == 1
    h1 = model.fc1(model.norm(x)).detach()
    hidden = F.gelu(h1.to(torch.bfloat16).float())  # from the GELU's input, as stored
    grad_out = 2 * model.fc2(F.gelu(h1)).detach()  # the forward itself is exact
    want = grad_out.flatten(0, 1).T @ hidden.flatten(0, 1)
    torch.testing.assert_close(got[-2], want, rtol=1e-6, atol=1e-6)
    exact = grad_out.flatten(0, 1).T @ F.gelu(h1).flatten(0, 1)
    assert not torch.allclose(got[-2], exact, rtol=1e-6, atol=1e-6)  # the code is lossy


def test_compressor_not_derivable_stores_the_output() -> None:
    model, x = _setup()
    with ts.apply(model, "test.clone", min_bytes=0) as h:
        _grads(model, x)
        assert all(r.derived == 0 for r in h.tally.rows.values())


def test_output_excluded_by_policy_stays_exact() -> None:
    """A rule leaving fc2's input as is wins: it is stored, not recomputed from a code."""
    model, x = _setup()
    policy = [{"strategy": "test.derive_half"}, {"module": "fc2", "strategy": "none"}]
    ref_hidden = F.gelu(model.fc1(model.norm(x))).detach()
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        got = _grads(model, x)
        assert h.tally.rows["fc2"].derived == 0
        assert h.tally.rows["fc2"].stored_bytes == ref_hidden.numel() * 4
    out = model.fc2(ref_hidden)
    want = (2 * out.detach()).flatten(0, 1).T @ ref_hidden.flatten(0, 1)
    torch.testing.assert_close(got[-2], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("change", "carried"), [("exp_", False), ("mul_", True)])
def test_output_changed_in_place(change: str, carried: bool) -> None:
    """An in-place op between the activation and the next save changes the values: the
    version moved, so the old recipe no longer matches. An elementwise op the engine can
    replay (``mul_(2.0)``) carries it one step on; any other leaves the save stored. Either
    way gradients stay stock's."""

    class Scaled(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.fc1(self.norm(x)))
            getattr(h, change)(*([2.0] if change == "mul_" else []))
            return self.fc2(h)

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 16, 32)
    ref = _grads(model, x)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = _grads(model, x)
        assert h.tally.rows["fc2"].derived == int(carried)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_which_ops_have_a_recipe() -> None:
    # an in-place SiLU's output is recomputed out of place from the copy of its input
    assert recipe("silu", (torch.ones(2),), {"inplace": True}) is not None
    assert recipe("silu", (torch.ones(2), True), {}) is not None
    assert recipe("hardswish", (torch.ones(2), True), {}) is not None
    assert recipe("relu", (torch.ones(2),), {}) is None
    assert recipe("gelu", (torch.ones(2),), {"approximate": "tanh"}) is not None


def test_recomputed_output_later_saved_as_is() -> None:
    """fc2's input is recomputed, then an op the policy leaves as is saves the same tensor:
    the entry becomes that tensor (one exact copy, counted once), and gradients are stock's."""

    class Twice(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.fc1(self.norm(x)))
            return self.fc2(h) + (h * h).sum()

    torch.manual_seed(0)
    model, x = Twice(), torch.randn(64, 32)  # 2-d: fc2 saves h itself, not a view of it
    ref = _grads(model, x)
    policy = [{"strategy": "test.derive"}, {"op": "mul", "strategy": "none"}]
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        got = _grads(model, x)
        rows = _rows(h)
    hidden = 4 * 16 * 64 * 4
    assert rows["fc2"] == (0, hidden, hidden)  # the recompute turned into the tensor itself
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_many_steps_free_their_recipes() -> None:
    """Recipes are held weakly: after many steps nothing piles up."""
    model, x = _setup()
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        for _ in range(5):
            _grads(model, x)
        assert h.engine._recipes == {}  # each dropped when its output was freed


class HFAttention(nn.Module):
    """Hugging Face's layout: ``torch.matmul``, ``transpose(1, 2).contiguous()``, ``view``."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        probs = torch.matmul(q, k.transpose(2, 3)).softmax(-1)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return self.o(out.view(b, n, c))


@pytest.mark.parametrize(
    ("make", "proj"),
    [
        (lambda: SelfAttention(32, 2, causal=True), "proj"),
        (lambda: SelfAttention(32, 2, causal=False), "proj"),
        (HFAttention, "o"),
        # F.scaled_dot_product_attention saves its output: the projection's input is that
        # output transposed back to contiguous (a view of the same layout), then reshaped
        (lambda: SelfAttention(32, 2, causal=True, sdpa=True), "proj"),
    ],
    ids=["zoo-causal", "zoo", "hf", "zoo-sdpa"],
)
def test_attention_output_recomputed_bit_exact(make: Callable[[], nn.Module], proj: str) -> None:
    """``attn @ v``, transposed and copied into the output projection's input, is that
    projection's saved input: recomputed from the two operands the matmul saved, carried
    through the layout ops, it costs no bytes and the gradients are stock's to the bit."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(2, 8, 32)
    ref = _grads(model, x)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = _grads(model, x)
        rows = _rows(h)
    # Stock's bytes: the projection's own copy; with SDPA the input is a view of the output
    # the attention saved, whose storage is counted there once.
    raw = 0 if getattr(model, "sdpa", False) else 2 * 8 * 32 * 4
    assert rows[proj][0] == 1 and rows[proj][2] == 0 and rows[proj][1] == raw
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_matmul_with_a_parameter_is_not_recomputed() -> None:
    """``x @ W``'s output is a linear layer's: recomputing it would cost a forward's matmul,
    and its operand W is not an activation the strategy stores; it is stored as usual."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32))
            self.fc = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x @ self.w)

    model = Plain()
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        _grads(model, torch.randn(2, 8, 32))
        assert all(r.derived == 0 for r in h.tally.rows.values())


def test_attention_output_changed_in_place_is_not_recomputed() -> None:
    class Scaled(SelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, c = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = (q @ k.transpose(-2, -1)).softmax(-1) @ v
            y.sin_()  # after the matmul: the recipe no longer holds
            return self.proj(y.transpose(1, 2).reshape(b, n, c))

    torch.manual_seed(0)
    model, x = Scaled(32, 2, causal=False), torch.randn(2, 8, 32)
    ref = _grads(model, x)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = _grads(model, x)
        assert h.tally.rows["proj"].derived == 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_matmul_order_from_shapes_and_roles() -> None:
    # (B*H, N, N) @ (B*H, N, D), saved right operand first: the shapes decide
    assert matmul_order([(4, 8, 16), (4, 8, 8)], ["output", "input"], (4, 8, 16)) == (1, 0)
    # square: the call's left argument decides, else autograd's save order (right first)
    assert matmul_order([(4, 8, 8), (4, 8, 8)], ["input", "output"], (4, 8, 8)) == (0, 1)
    assert matmul_order([(4, 8, 8), (4, 8, 8)], ["arg1", "input"], (4, 8, 8)) == (1, 0)
    assert matmul_order([(4, 8, 8), (4, 8, 8)], ["output", "output"], (4, 8, 8)) == (1, 0)
    # not a product of the two (a bias, a reduction): no recipe
    assert matmul_order([(4, 8, 16), (4, 8, 8)], ["output", "input"], (4, 8, 32)) is None
    assert matmul_order([(8,), (8, 4)], ["input", "arg1"], (4,)) is None
    assert recipe("matmul", (), {}, "baddbmm") is None
    assert recipe("matmul", (), {}, "matmul") is not None


class SignedClone(DerivableClone):
    """A derivable copy that stores a ReLU's saved result as another variant (as quant's sign
    bits are), so the next op's save of the same tensor is not shared with it."""

    name = "test.derive_signed"

    def variant(self, x: torch.Tensor, site: Site) -> str:
        return "relu" if site.op == "relu" else ""


def _conv_bn(relu: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers, nn.Conv2d(8, 4, 3, padding=1))


@pytest.mark.parametrize("relu", [False, True], ids=["bn-conv", "bn-inplace-relu-conv"])
def test_batch_norm_output_recomputed(relu: bool) -> None:
    """A training BatchNorm's output (through an in-place ReLU, carried one version on) is the
    next conv's saved input: recomputed from the BatchNorm's input with the batch mean and
    invstd its forward saved, it costs no bytes and the gradients are stock's to rounding."""
    torch.manual_seed(0)
    model, x = _conv_bn(relu), torch.randn(4, 3, 8, 8)
    ref = _grads(model, x)
    ts.REGISTRY.register(SignedClone.name, SignedClone, lossless=True, summary="test")
    try:
        with ts.apply(model, SignedClone.name, min_bytes=0) as h:
            got = _grads(model, x)
            rows = _rows(h)
    finally:
        ts.REGISTRY.unregister(SignedClone.name)
    assert rows[str(len(model) - 1)][0] == 1 and rows[str(len(model) - 1)][2] == 0
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_batch_norm_in_eval_is_not_recomputed() -> None:
    """In eval a BatchNorm normalizes by its running statistics, which a later step may change
    before this backward: its output is stored as usual."""
    torch.manual_seed(0)
    model, x = _conv_bn(False), torch.randn(4, 3, 8, 8)
    model[1].eval()
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        _grads(model, x)
        assert all(r.derived == 0 for r in h.tally.rows.values())
    assert recipe("batch_norm", (x, None, None, None, None, False), {}, "batch_norm") is None


def test_autocast_cast_of_a_recomputable_output_is_recomputed() -> None:
    """Under bf16 autocast fc1 saves a bf16 copy of the LayerNorm's fp32 output, made inside
    ``linear``: autograd's graph shows it is that output cast, so it is the LayerNorm's recipe
    followed by the same cast, and costs no bytes."""
    model, x = _setup()

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = grads()
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        got = grads()
        rows = _rows(h)
    assert rows["fc1"][0] == 1 and rows["fc1"][2] == 0
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0.02, atol=1e-3)


class WrittenAttention(nn.Module):
    """Attention written out as published models write it, for the map's recipe: ``style``
    picks nanoGPT's (scale, boolean ``masked_fill``, dropout), Llama's eager path (additive
    float mask made per forward, softmax in float32 cast back), GPT-2's eager path (division
    by a 0-d tensor, ``torch.where`` with a 0-d fill, dropout that drops) or an in-place
    additive mask."""

    def __init__(self, style: str, dim: int = 32, heads: int = 2, ctx: int = 8) -> None:
        super().__init__()
        self.style, self.heads = style, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.25 if style == "gpt2" else 0.0)
        causal = torch.ones(ctx, ctx, dtype=torch.bool).tril()
        self.register_buffer("causal", causal.view(1, 1, ctx, ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        d = c // self.heads
        if self.style == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            att = att.masked_fill(self.causal[:, :, :n, :n] == 0, float("-inf"))
            att = self.drop(F.softmax(att, dim=-1))
        elif self.style == "llama":
            mask = torch.zeros(b, 1, n, n).masked_fill(~self.causal[:, :, :n, :n], -1e9)
            att = torch.matmul(q, k.transpose(2, 3)) * d**-0.5 + mask
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
            att = F.dropout(att, p=0.0, training=self.training)
        elif self.style == "gpt2":
            att = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], d**0.5)
            fill = torch.full([], torch.finfo(att.dtype).min)
            att = torch.where(self.causal[:, :, :n, :n], att, fill)
            att = self.drop(F.softmax(att, dim=-1))
        else:  # "inplace"
            att = q @ k.transpose(-2, -1)
            att *= d**-0.5
            att += torch.zeros(n, n).masked_fill(~self.causal[0, 0, :n, :n], float("-inf"))
            att = att.softmax(-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


STYLES = ["nanogpt", "llama", "gpt2", "inplace"]


@pytest.mark.parametrize("style", STYLES)
def test_attention_map_recomputed_from_q_and_k(style: str) -> None:
    """The map is recomputed from the stored ``q`` and ``k`` through the scale, the mask,
    the softmax and the casts after them: no bytes of its own, gradients stock's to the bit
    (dropout's own mask is the one thing not replayed: what it keeps is stored)."""
    torch.manual_seed(0)
    model, x = WrittenAttention(style), torch.randn(2, 8, 32)
    torch.manual_seed(1)
    ref = _grads(model, x)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        torch.manual_seed(1)
        got = _grads(model, x)
        row = h.tally.rows[""]
    assert row.derived == 1
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_attention_map_stored_without_its_recipe_is_dearer() -> None:
    """The same attention, its map stored by a policy that leaves ``q @ k.T``'s operands as
    they are: then the map is a stored tensor, the bytes the recipe saves."""
    torch.manual_seed(0)
    model, x = WrittenAttention("nanogpt"), torch.randn(2, 8, 32)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        _grads(model, x)
        recomputed = h.tally.rows[""].stored_bytes
    policy = [{"strategy": "test.derive"}, {"op": "matmul", "op_index": 0, "strategy": "none"}]
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        _grads(model, x)
        stored = h.tally.rows[""]
    assert stored.derived == 0
    assert stored.stored_bytes >= recomputed + 2 * 2 * 8 * 8 * 4  # the (2, 2, 8, 8) map


def test_mask_held_by_a_recipe_is_counted_once_and_checked() -> None:
    """A mask made for the forward (one for every layer, as Hugging Face models make it) is
    held by the maps' recipes: counted in stored bytes once, and an in-place change to it
    before backward is an error that says what happened, never a different map."""

    class Masked(WrittenAttention):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            b, n, c = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1) + mask).softmax(-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, n, c))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Masked("llama") for _ in range(2))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layers[1](self.layers[0](x, mask), mask)

    torch.manual_seed(0)
    model, x = Two(), torch.randn(2, 8, 32)
    mask = torch.zeros(2, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), -1e9)
    with ts.apply(model, "test.derive", min_bytes=0) as h:
        loss = model(x, mask).square().sum()
        rows = h.tally.rows
        assert rows["layers.0"].derived == rows["layers.1"].derived == 1
        # the first layer's recipe counted the mask; the second one's holds the same one
        assert rows["layers.0"].stored_bytes - rows["layers.1"].stored_bytes == mask.nbytes
        mask.fill_(0.0)  # changed in place before backward
        with pytest.raises(
            RuntimeError, match="modified by an inplace operation after the forward"
        ):
            loss.backward()


def test_attention_map_is_recomputed_once_per_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three backward ops read the map (the softmax's, the ``@ v``'s and the projection
    input's recipe): it is replayed once and kept until the last of them read it."""

    replayed: list[str] = []
    run = replaystep.Replay.run

    def counted(self: replaystep.Replay, t: torch.Tensor, owned: bool) -> tuple[torch.Tensor, bool]:
        replayed.append(getattr(self.func, "__name__", ""))
        return run(self, t, owned)

    monkeypatch.setattr(replaystep.Replay, "run", counted)
    torch.manual_seed(0)
    model, x = WrittenAttention("nanogpt"), torch.randn(2, 8, 32)
    with ts.apply(model, "test.derive", min_bytes=0):
        loss = model(x).square().sum()
        assert replayed == []
        loss.backward()
    assert replayed.count("softmax") == 1, replayed


@pytest.mark.parametrize("style", STYLES)
def test_attention_map_recomputed_bit_exact_under_cudas_autocast(style: str) -> None:
    """Under bf16 autocast with CUDA's policy (softmax and LayerNorm in float32, emulated on
    the CPU), the map, the GELU's and the LayerNorm's outputs are recomputed as the forward
    computed them (the casts between included): gradients stock's to the bit. Replayed without the forward's autocast, the softmax came
    back bf16 and its backward failed."""
    from torchstash.testing.autocast import cuda_autocast_policy_on_cpu

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32), WrittenAttention(style))
    x = torch.randn(2, 8, 32)

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(1)
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with cuda_autocast_policy_on_cpu():
        ref = grads()
        with ts.apply(model, "test.derive", min_bytes=0) as h:
            got = grads()
            rows = {name: row.derived for name, row in h.tally.rows.items()}
    # the GELU's output (as the LayerNorm's float32 copy of it), the LayerNorm's output (as
    # qkv's bf16 copy of it) and the map: each a cast of a recomputed output
    assert rows["2"] == 1 and rows["3.qkv"] == 1 and rows["3"] >= 1, rows
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_broadcast_is_torchs() -> None:
    """derive's shape broadcast (in the matmul operand check, each step) answers as
    ``torch.broadcast_shapes`` does, None where torch raises; empty and zero-size dims too."""
    import itertools

    from torchstash.derive import _broadcast

    shapes = [s for n in range(4) for s in itertools.product((0, 1, 2, 3), repeat=n)]
    for a, b in itertools.product(shapes, repeat=2):
        try:
            want: tuple[int, ...] | None = tuple(torch.broadcast_shapes(a, b))
        except RuntimeError:
            want = None
        assert _broadcast(a, b) == want, (a, b)


def test_batch_norm_recipe_keeps_nan_and_inf() -> None:
    """The recomputed BatchNorm output carries a NaN or an infinity where stock's does."""
    x = torch.randn(2, 3, 4, 4)
    x[0, 1, 2, 2], x[1, 2, 0, 0] = float("nan"), float("inf")
    mean, invstd = torch.zeros(3), torch.ones(3)
    r = derive.Recipe("batch_norm", {"weight": None, "bias": None}, [mean, invstd])
    got = r(x)
    assert torch.isnan(got[0, 1, 2, 2]) and torch.isinf(got[1, 2, 0, 0])
    assert torch.equal(got.isfinite(), x.isfinite())


@pytest.mark.parametrize("kind", ["causal-bool", "random-bool", "additive", "none"])
def test_a_fused_attention_with_a_mask_is_recomputed_bit_exact(kind: str) -> None:
    """A fused attention's output and log-sum-exp are recomputed by its kernel from exact
    ``q``, ``k``, ``v`` and its mask as the call passed it to that kernel: a boolean mask
    becomes the additive one ``scaled_dot_product_attention`` makes of it (before, the CPU
    replay passed it as given, and backward raised). Gradients are stock's bit for bit."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 48)
    x = torch.randn(2, 8, 16)
    masks = {
        "causal-bool": torch.ones(8, 8, dtype=torch.bool).tril(),
        "random-bool": (torch.rand(2, 1, 8, 8) > 0.3) | torch.eye(8, dtype=torch.bool),
        "additive": torch.zeros(2, 1, 8, 8).masked_fill(
            torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")
        ),
        "none": None,
    }
    mask = masks[kind]

    def grads() -> list[torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        q, k, v = lin(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum().backward()
        return [p.grad.clone() for p in lin.parameters() if p.grad is not None]

    want = grads()
    with ts.stash("test.derive", min_bytes=0) as h:
        got = grads()
    assert sum(r.derived for r in h.tally.rows.values()) == 2  # the output and log-sum-exp
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
