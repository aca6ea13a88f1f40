"""The contract every compressor passes. Subclass it once per compressor and set the knobs:

    from torchstash.testing.contract import CompressorContract

    class TestInt8(CompressorContract):
        lossless = False
        max_error = 0.01          # |x - y| <= max_error * (max - min) of the tensor

        def make_compressor(self):
            return Int8Compressor()

If a test here fails, the docstring of the test says what the contract expects.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from ..compressor import Compressor
from ..engine import Engine
from ..packed import Packed
from ..site import Site

SHAPES = [(4096,), (64, 257), (3, 5, 7, 11), (2, 3, 32, 32), (1,), (1000003,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SITE = Site(module="layer", tag="linear", module_type="Linear", op="linear", role="input")


class CompressorContract:
    #: restored tensors equal the originals bit for bit
    lossless: ClassVar[bool] = False
    #: lossy bound: max |x - y| <= max_error * max(max(x) - min(x), max|x|) per tensor
    max_error: ClassVar[float] = 0.05
    #: gradients under the hooks: cosine similarity to stock at least this (lossy)
    min_grad_cosine: ClassVar[float] = 0.99
    #: devices the compressor works on (others are skipped)
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: dtypes it compresses
    dtypes: ClassVar[tuple[torch.dtype, ...]] = tuple(DTYPES)
    #: tensors with fewer elements may be declined (with a reason): too small to save on
    declines_below: ClassVar[int] = 0

    def make_compressor(self) -> Compressor:
        raise NotImplementedError("return a fresh compressor")

    def expect_smaller(self, dtype: torch.dtype) -> bool:
        """Whether packed bytes must be below raw bytes for a large tensor of ``dtype``."""
        return True

    # -- helpers ------------------------------------------------------------------------------

    def _check_device(self, device: torch.device) -> None:
        if device.type not in self.devices:
            pytest.skip(f"{type(self).__name__} does not run on {device.type}")

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, Packed | torch.Tensor]:
        c = self.make_compressor()
        if x.numel() < self.declines_below and c.unsupported(x, SITE):
            return x, x
        assert c.unsupported(x, SITE) == [], c.unsupported(x, SITE)
        packed = c.compress(x, SITE)
        y = c.decompress(packed) if isinstance(packed, Packed) else packed
        return y, packed

    def assert_close(self, x: torch.Tensor, y: torch.Tensor) -> None:
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
        if self.lossless:
            assert torch.equal(x, y) or bool(((x == y) | (x.isnan() & y.isnan())).all()), (
                "lossless compressor changed values"
            )
            return
        xf, yf = x.float(), y.float()
        finite = xf.isfinite()
        if finite.any():
            vals = xf[finite]
            span = max((vals.max() - vals.min()).item(), vals.abs().max().item())
            err = (xf[finite] - yf[finite]).abs().max().item()
            assert err <= self.max_error * max(span, 1e-6) + 1e-6, (
                f"max error {err:.4g} above {self.max_error} of the range {span:.4g}"
            )

    # -- the contract -------------------------------------------------------------------------

    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_roundtrip(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Restores shape, dtype and device; values exact (lossless) or within max_error."""
        self._check_device(device)
        if dtype not in self.dtypes:
            pytest.skip(f"{dtype} not compressed")
        x = torch.randn(shape, device=device).to(dtype)
        y, _ = self.roundtrip(x)
        self.assert_close(x, y)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_packed_smaller_than_raw(self, dtype: torch.dtype, device: torch.device) -> None:
        """A large tensor's payload is smaller than the tensor (that is the point)."""
        self._check_device(device)
        if dtype not in self.dtypes or not self.expect_smaller(dtype):
            pytest.skip("no size reduction promised for this dtype")
        x = torch.randn(256, 1024, device=device).to(dtype)
        _, packed = self.roundtrip(x)
        assert isinstance(packed, Packed)
        assert packed.nbytes() < x.numel() * x.element_size()

    def test_packed_record(self, device: torch.device) -> None:
        """The record names the codec and the original shape, dtype and device; its
        ``nbytes`` is what its payload holds (each storage once, capacity beyond a view too)."""
        self._check_device(device)
        c = self.make_compressor()
        x = torch.randn(64, 64, device=device)
        packed = c.compress(x, SITE)
        assert isinstance(packed, Packed)
        assert packed.codec and packed.shape == x.shape and packed.dtype == x.dtype
        assert packed.device == x.device
        # nbytes counts what the payload holds: each storage once, at its full size
        storages = {t.untyped_storage().data_ptr(): t for t in packed.payload_tensors()}
        assert packed.nbytes() == sum(t.untyped_storage().nbytes() for t in storages.values())
        assert packed.nbytes() >= sum(t.numel() * t.element_size() for t in storages.values())

    def test_non_contiguous(self, device: torch.device) -> None:
        """Transposed and sliced inputs restore their values."""
        self._check_device(device)
        base = torch.randn(96, 130, device=device)
        for x in (base.t(), base[:, ::2], base[1:, 3:]):
            y, _ = self.roundtrip(x)
            self.assert_close(x, y)

    def test_channels_last(self, device: torch.device) -> None:
        self._check_device(device)
        x = torch.randn(2, 8, 16, 16, device=device).to(memory_format=torch.channels_last)
        y, _ = self.roundtrip(x)
        self.assert_close(x, y)

    def test_empty_and_zero_dim(self, device: torch.device) -> None:
        """Empty and 0-d tensors round-trip (or are declined with a reason)."""
        self._check_device(device)
        c = self.make_compressor()
        for x in (torch.empty(0, 16, device=device), torch.tensor(1.5, device=device)):
            if c.unsupported(x, SITE):
                continue
            packed = c.compress(x, SITE)
            y = c.decompress(packed) if isinstance(packed, Packed) else packed
            assert y.shape == x.shape and y.dtype == x.dtype
            if x.numel():
                self.assert_close(x, y)

    def test_nan_inf_survive(self, device: torch.device) -> None:
        """NaN, +Inf and -Inf come back where they were (GradScaler must see an overflow)."""
        self._check_device(device)
        x = torch.randn(4096, device=device)
        x[7], x[1000], x[4000] = float("nan"), float("inf"), float("-inf")
        y, _ = self.roundtrip(x)
        assert y[7].isnan() and y[1000] == float("inf") and y[4000] == float("-inf")
        assert int(y.isnan().sum()) == 1 and int(y.isinf().sum()) == 2

    def test_decompress_twice(self, device: torch.device) -> None:
        """retain_graph unpacks twice: both results agree and the record is not consumed."""
        self._check_device(device)
        c = self.make_compressor()
        x = torch.randn(128, 96, device=device)
        packed = c.compress(x, SITE)
        assert isinstance(packed, Packed)
        assert torch.equal(c.decompress(packed), c.decompress(packed))

    def test_encoder_codes_as_compress(self, device: torch.device) -> None:
        """A compressor with ``encoder(x, site)`` (what a replayed save calls): its encoder
        codes each tensor as ``compress`` does, record for record and bit for bit, call
        after call (two compressors made alike from the same seed)."""
        self._check_device(device)
        torch.manual_seed(0)
        plain = self.make_compressor()
        torch.manual_seed(0)
        other = self.make_compressor()
        encoder_of = getattr(other, "encoder", None)
        if encoder_of is None:
            pytest.skip("no encoder: a replayed save calls compress")
            return
        base = torch.randn(96, 130, device=device)
        for x in (base, base.t(), base[:, 1:-1], torch.randn(2, 8, 6, 6, device=device)):
            if plain.unsupported(x, SITE):
                continue
            encode = encoder_of(x, SITE)
            for _ in range(2):
                want, got = plain.compress(x, SITE), encode(x)
                assert type(got) is type(want)
                if not isinstance(want, Packed):
                    continue
                assert isinstance(got, Packed)
                assert (got.codec, got.shape, got.dtype, got.meta) == (
                    want.codec,
                    want.shape,
                    want.dtype,
                    want.meta,
                )
                assert got.tensors.keys() == want.tensors.keys()
                for key, value in want.tensors.items():
                    mine = got.tensors[key]
                    assert isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor)
                    assert torch.equal(mine, value), f"payload {key!r} differs"

    def test_declines_integer_tensors(self, device: torch.device) -> None:
        self._check_device(device)
        c = self.make_compressor()
        assert c.unsupported(torch.arange(100, device=device), SITE)

    def test_gradients_under_hooks(self, device: torch.device) -> None:
        """Training gradients through the engine match stock PyTorch (exact if lossless)."""
        self._check_device(device)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 32)
        ).to(device)
        x = torch.randn(128, 64, device=device)

        def grads() -> torch.Tensor:
            model.zero_grad()
            model(x).square().mean().backward()
            return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

        ref = grads()
        compressor = self.make_compressor()
        engine = Engine(lambda site, types: compressor, min_bytes=0)
        with engine.activated():
            got_loss = model(x).square().mean()
        model.zero_grad()
        got_loss.backward()
        got = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert sum(r.compressed for r in engine.tally.rows.values()) > 0, "nothing compressed"
        if self.lossless:
            assert torch.equal(ref, got)
        else:
            cos = torch.nn.functional.cosine_similarity(ref, got, dim=0).item()
            assert cos >= self.min_grad_cosine, f"gradient cosine {cos:.5f}"


def _contract_model() -> nn.Module:
    """Every layer family a rewriter may know: convs (a depthwise one), BatchNorm, in-place
    ReLU, pooling, dropout, LayerNorm and Linear."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.LayerNorm(8 * 8 * 8),
        nn.Linear(8 * 8 * 8, 10),
    )


class RewriterContract:
    """The contract every rewriter passes (a strategy that swaps modules, as memsave's does).
    Subclass it once per rewriter and set the knobs:

        class TestMemSave(RewriterContract):
            def make_rewriter(self):
                return MemSaveRewriter()

    It is applied through ``torchstash.apply`` (registered in-process for the test), as a user
    would, on :meth:`make_model` (override it to bring the layers the rewriter knows).
    """

    #: gradients equal stock's bit for bit
    lossless: ClassVar[bool] = True
    #: lossy: cosine of the whole gradient to stock's at least this
    min_grad_cosine: ClassVar[float] = 0.99
    #: a graph under the rewriter holds at most this share of stock's (the heap's word)
    max_held_share: ClassVar[float] = 1.0

    def make_rewriter(self) -> object:
        raise NotImplementedError("return a fresh rewriter")

    def make_model(self) -> nn.Module:
        return _contract_model()

    def make_input(self) -> torch.Tensor:
        return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    # -- helpers ------------------------------------------------------------------------------

    def _applied(self, model: nn.Module) -> Any:
        from ..api import apply
        from ..registry import Registry

        registry = Registry.fresh()  # the process's registry is left as it is
        name = "contract.rewriter"
        registry.register(name, self.make_rewriter, lossless=self.lossless, summary="contract")
        return apply(model, name, registry=registry)

    def _step(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)  # the same dropout draws for stock and the rewritten model
        model.zero_grad()
        out = model(x)
        out.square().mean().backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return out.detach(), torch.cat(grads)

    def _pair(self) -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        stock = self.make_model()
        torch.manual_seed(0)
        return stock, self.make_model()

    # -- the contract -------------------------------------------------------------------------

    def test_is_a_rewriter(self) -> None:
        """It has a name and a ``rewrite(module)`` (what a strategy's factory may return)."""
        from ..plan import Rewriter

        rewriter = self.make_rewriter()
        assert isinstance(rewriter, Rewriter) and isinstance(rewriter.name, str)

    def test_rewrites_and_keeps_the_models_state(self) -> None:
        """Something is rewritten; the Parameters are the model's own objects and the
        ``state_dict`` keys are unchanged; ``remove`` puts every module's class back."""
        _, model = self._pair()
        params = {n: p for n, p in model.named_parameters()}
        keys = list(model.state_dict())
        types = {n: type(m) for n, m in model.named_modules()}
        handle = self._applied(model)
        assert handle.rewrites, "the rewriter rewrote nothing in the contract's model"
        now = dict(model.named_parameters())
        assert list(now) == list(params), "the rewritten model's parameters have other names"
        assert all(now[n] is p for n, p in params.items()), "a Parameter was replaced"
        assert list(model.state_dict()) == keys
        handle.remove()
        assert {n: type(m) for n, m in model.named_modules()} == types

    @pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-features"])
    def test_gradients_and_outputs_match_stock(self, frozen: bool) -> None:
        """Outputs and gradients equal stock's (bit for bit if lossless), with every layer
        trained and with the features frozen (only the head trains)."""
        stock, model = self._pair()
        for m in (stock, model):
            for p in list(m.parameters())[:-4] if frozen else []:
                p.requires_grad_(False)
        x = self.make_input()
        ref_out, ref = self._step(stock, x)
        with self._applied(model):
            out, got = self._step(model, x)
        if self.lossless:
            assert torch.equal(out, ref_out) and torch.equal(got, ref)
        else:
            cos = torch.nn.functional.cosine_similarity(ref, got, dim=0).item()
            assert cos >= self.min_grad_cosine, f"gradient cosine {cos:.5f}"

    def test_eval_mode_matches_stock(self) -> None:
        stock, model = self._pair()
        stock.eval()
        model.eval()
        x = self.make_input()
        with torch.no_grad():
            ref = stock(x)
        with self._applied(model), torch.no_grad():
            assert torch.equal(model(x), ref) if self.lossless else model(x).isfinite().all()

    def test_holds_no_more_than_stock(self) -> None:
        """The graph one step leaves holds no more than stock's, on the process heap's word
        (an independent gauge: the allocator, not torchstash's own count)."""
        from .heap import held_by_graph

        stock, model = self._pair()
        x = self.make_input()
        held_stock = held_by_graph(lambda: stock(x).square().mean())
        with self._applied(model):
            held = held_by_graph(lambda: model(x).square().mean())
        assert held <= self.max_held_share * held_stock + 4096, (held, held_stock)
