"""quant.mesa on the channel-wise kernels gives what its pure-PyTorch formulas gave, bit for bit.

``LegacyMesa`` is the codec as it was before the kernels (full-size PyTorch passes); both
codecs see the same tensors with the same seeds and must agree on the codes, the stored
range, the running state and the decoded values (NaN payloads aside: torch's own bf16 cast
writes either of two NaN patterns).
"""

from __future__ import annotations

import pytest
import torch

from torchstash import Site
from torchstash.kernels import philox_uniform
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.testing.bits import assert_bits_equal
from torchstash_quant import MesaQuantizer
from torchstash_quant.mesa_codec import _NAN, _NEG_INF, _POS_INF, LEVELS, record_parts

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class LegacyMesa(MesaQuantizer):
    """compress/decompress exactly as they were written before the kernels."""

    def _legacy_groups(self, channels: int, device: torch.device) -> tuple[torch.Tensor, int]:
        k = self._group_count(channels)
        return torch.arange(channels, device=device) * k // channels, k

    def _legacy_observe(
        self, x: torch.Tensor, axis: int, gid: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        v = x.float()
        dims = [d for d in range(x.dim()) if d != axis]
        finite = v.isfinite()
        low = torch.where(finite, v, float("inf"))
        high = torch.where(finite, v, float("-inf"))
        cmin = low.amin(dim=dims) if dims else low
        cmax = high.amax(dim=dims) if dims else high
        gmin = torch.full((k,), float("inf"), device=x.device).scatter_reduce(0, gid, cmin, "amin")
        gmax = torch.full((k,), float("-inf"), device=x.device).scatter_reduce(0, gid, cmax, "amax")
        return gmin, gmax

    def _running(self, site: Site, observed: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        with self._lock:
            prev = self.state.get(site.key)
            if prev is None or prev.shape != observed.shape or prev.device != observed.device:
                run = torch.where(seen, observed, 0.0)
            else:
                d = self.ema_decay
                run = torch.where(seen, d * prev + (1 - d) * observed, prev)
            self.state[site.key] = run
        return run

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        axis = self._axis(x)
        channels = x.shape[axis]
        gid, k = self._legacy_groups(channels, x.device)
        gmin, gmax = self._legacy_observe(x, axis, gid, k)
        seen = gmin <= gmax
        lo, hi = self._running(site, torch.stack((gmin, gmax)), seen)
        lo = torch.where(seen, torch.minimum(lo, gmin), lo)
        hi = torch.where(seen, torch.maximum(hi, gmax), hi)
        step = torch.clamp(hi - lo, min=0.0) / LEVELS
        shape = [1] * x.dim()
        shape[axis] = channels
        lo_c, step_c = lo[gid].view(shape), step[gid].view(shape)
        v = x.float()
        scaled = torch.where(step_c > 0, (v - lo_c) / torch.where(step_c > 0, step_c, 1.0), 0.0)
        if self.stochastic:
            _, inverse = memory_order(scaled)
            u = philox_uniform(x.numel(), self.seeds.next(), 0, device=x.device)
            q = torch.floor(scaled + restore(u, scaled.shape, inverse))
        else:
            q = torch.floor(scaled + 0.5)
        codes = q.clamp(0, LEVELS).to(torch.uint8)
        codes = torch.where(v.isnan(), _NAN, codes)
        codes = torch.where(v == float("inf"), _POS_INF, codes)
        codes = torch.where(v == float("-inf"), _NEG_INF, codes).to(torch.uint8)
        flat_codes, inverse = memory_order(codes)
        packed = Packed.like(x, self.name, codes=flat_codes.reshape(-1), lo=lo.clone(), step=step)
        packed.meta.update(axis=axis, order=inverse)
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        codes, lo, step, inverse, axis = record_parts(packed)
        c = restore(codes, packed.shape, inverse)
        channels = packed.shape[axis]
        gid, _ = self._legacy_groups(channels, codes.device)
        shape = [1] * len(packed.shape)
        shape[axis] = channels
        val = lo[gid].view(shape) + c.float() * step[gid].view(shape)
        val = torch.where(c == _NAN, float("nan"), val)
        val = torch.where(c == _POS_INF, float("inf"), val)
        val = torch.where(c == _NEG_INF, float("-inf"), val)
        return val.to(packed.dtype)


def _data(shape: tuple[int, ...], axis: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Per-channel scales and offsets, some NaN/Inf, a channel of non-finite values only,
    and a constant channel (step 0 on the first call)."""
    gen = torch.Generator().manual_seed(seed)
    c = shape[axis]
    bshape = [1] * len(shape)
    bshape[axis] = c
    scale = torch.exp(torch.randn(c, generator=gen) * 2).view(bshape)
    offset = (torch.randn(c, generator=gen) * 5).view(bshape)
    x = torch.randn(shape, generator=gen) * scale + offset
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randperm(n, generator=gen)[: max(3, n // 200)]
    third = len(pick) // 3
    flat[pick[:third]] = float("nan")
    flat[pick[third : 2 * third]] = float("inf")
    flat[pick[2 * third :]] = float("-inf")
    if c >= 3:
        only = torch.full_like(x.select(axis, 1), float("nan"))
        only.view(-1)[::3] = float("inf")
        x.select(axis, 1).copy_(only)
        x.select(axis, 2).fill_(1.25)
    return x.to(dtype)


LAYOUTS = {
    "heads": ((4, 6, 16, 8), "contiguous"),
    "tokens": ((4, 33, 20), "contiguous"),
    "vector": ((50,), "contiguous"),
    "matrix": ((17, 9), "contiguous"),
    "channels_last": ((3, 8, 5, 7), "channels_last"),
    "transposed": ((4, 16, 6, 8), "transpose12"),
    "last_transposed": ((10, 12), "t"),
}


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if how == "transpose12":
        return x.transpose(1, 2).contiguous().transpose(1, 2)  # dense, not row-major
    if how == "t":
        return x.t().contiguous().t()
    return x


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_bits_as_the_pytorch_formulas(
    layout: str, dtype: torch.dtype, stochastic: bool
) -> None:
    shape, how = LAYOUTS[layout]
    new, old = (
        cls(seed=5, stochastic=stochastic, groups=None) for cls in (MesaQuantizer, LegacyMesa)
    )
    grouped = (MesaQuantizer(seed=6, groups=2), LegacyMesa(seed=6, groups=2))
    site = Site(module="attn", op="matmul", role="input")
    for step in range(3):  # the running (EMA) state evolves the same way
        base = _data(shape, 1 if len(shape) == 4 else len(shape) - 1, dtype, seed=step)
        x = _layout(base * (1 + step), how)
        for a, b in ((new, old), grouped):
            pa, pb = a.compress(x, site), b.compress(x, site)
            assert pa.meta == pb.meta
            assert pa.tensors.keys() == pb.tensors.keys()
            assert pa.nbytes() == pb.nbytes()
            for key in ("codes", "lo", "step"):
                ta, tb = pa.tensors[key], pb.tensors[key]
                assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
                assert torch.equal(ta, tb), key  # -0.0 == 0.0: zeros may differ in sign
            ya, yb = a.decompress(pa), b.decompress(pb)
            assert_bits_equal(ya, yb)
            assert ya.stride() == x.stride()  # the input's layout back
            for sa, sb in zip(a.state[site.key], b.state[site.key]):
                assert torch.equal(sa, sb)


def test_strided_input_rounds_to_nearest_as_before() -> None:
    """A non-dense input is copied to row-major order first: the same values when rounding
    to nearest (its stochastic codes draw the stream in row-major order)."""
    base = _data((4, 6, 16, 8), 1, torch.float32, seed=3)
    x = base[:, :, ::2].transpose(2, 3)
    assert not x.is_contiguous()
    new, old = MesaQuantizer(stochastic=False), LegacyMesa(stochastic=False)
    site = Site(module="m", op="matmul", role="input")
    assert_bits_equal(new.decompress(new.compress(x, site)), old.decompress(old.compress(x, site)))
    stochastic = MesaQuantizer(seed=1)
    y = stochastic.decompress(stochastic.compress(x, site))
    finite = x.isfinite()
    assert torch.equal(y.isnan(), x.isnan()) and bool(y[finite].isfinite().all())


def test_reference_path_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels off (TORCHSTASH_KERNELS=off) the codec runs the references."""
    x = _layout(_data((3, 8, 5, 7), 1, torch.bfloat16, seed=9), "channels_last")
    site = Site(module="m", op="conv2d", role="input")
    with_kernels = MesaQuantizer(seed=2)
    packed = with_kernels.compress(x, site)
    monkeypatch.setenv("TORCHSTASH_KERNELS", "off")
    without = MesaQuantizer(seed=2)
    ref = without.compress(x, site)
    for key in ("codes", "lo", "step"):
        ta, tb = packed.tensors[key], ref.tensors[key]
        assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
        assert torch.equal(ta, tb)
    assert_bits_equal(with_kernels.decompress(packed), without.decompress(ref))
