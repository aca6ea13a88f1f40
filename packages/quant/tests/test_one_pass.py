"""Each code is one kernel call per tensor each way, with no full-size PyTorch pass around it
and no host synchronisation: what keeps the codes cheap on every saved activation.

Counted with torch.profiler: the ``torchstash::`` ops a compress or decompress runs, and no
``aten::`` op other than views and allocations on a tensor as large as the input (Mesa's and
the fp8 code's bookkeeping on one entry per channel or row is allowed). Host syncs are caught
by making ``Tensor.item``, ``tolist`` and the conversions to Python scalars raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchstash.kernels import loader
from torchstash.registry import REGISTRY
from torchstash.site import Site

#: aten ops that only make views or allocate
METADATA = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::as_strided",
        "aten::slice",
        "aten::select",
        "aten::permute",
        "aten::transpose",
        "aten::t",
        "aten::expand",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::alias",
        "aten::detach",
        "aten::empty",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::lift_fresh",
    }
)

SITES = {
    "values": ((8, 16, 16, 16), Site(op="conv", role="input", func="conv2d", module="c")),
    "batch_norm": ((8, 16, 16, 16), Site(op="batch_norm", role="input", func="batch_norm")),
    "layer_norm": ((4, 8, 256), Site(op="layer_norm", role="input", func="layer_norm")),
    "relu": ((8, 16, 16, 16), Site(op="relu", role="output", func="relu")),
}
INT = {
    "values": (["group_quantize"], ["group_dequantize"]),
    "batch_norm": (["row_group_quantize"], ["row_group_dequantize"]),
    "layer_norm": (["row_group_quantize"], ["row_group_dequantize"]),
    "relu": (["sign_pack"], ["sign_unpack"]),
}
EXPECTED = {
    "quant.int8": INT,
    "quant.int4": INT,
    "quant.int2": INT,
    "quant.auto": INT,
    "quant.fp8": {
        "values": (["fp8_quantize"], ["fp8_dequantize"]),
        "batch_norm": (["row_center", "fp8_quantize"], ["fp8_dequantize", "row_uncenter"]),
        "layer_norm": (["row_center", "fp8_quantize"], ["fp8_dequantize", "row_uncenter"]),
        "relu": (["sign_pack"], ["sign_unpack"]),
    },
    "quant.mesa": {
        # its running range is updated inside the one call, between the range and the codes
        "values": (["mesa_quantize"], ["channel_dequantize"]),
        "batch_norm": (["row_center", "mesa_quantize"], ["channel_dequantize", "row_uncenter"]),
        "layer_norm": (["row_center", "mesa_quantize"], ["channel_dequantize", "row_uncenter"]),
        "relu": (["sign_pack"], ["sign_unpack"]),
    },
}


@pytest.fixture
def kernels() -> None:
    if not loader.available("cpu"):
        pytest.skip("compiled kernels unavailable")


def _refuse(*args: object, **kwargs: object) -> object:
    raise AssertionError("a host synchronisation inside a code")


@contextmanager
def no_host_sync() -> Iterator[None]:
    names = ("item", "tolist", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, _refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _ops(run: object, x: torch.Tensor) -> list[str]:
    """The torchstash ops ``run()`` calls; fails on a full-size aten op."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, no_host_sync():
        run()  # type: ignore[operator]
    ours = []
    for e in prof.events():
        if e.name.startswith("torchstash::"):
            ours.append(e.name.removeprefix("torchstash::"))
        elif e.name.startswith("aten::") and e.name not in METADATA:
            sizes = [s for s in e.input_shapes if s]
            largest = max((int(torch.Size(s).numel()) for s in sizes), default=0)
            assert largest < x.numel() // 8, f"{e.name} makes a pass over {largest} elements"
    return ours


@pytest.mark.parametrize("where", sorted(SITES))
@pytest.mark.parametrize("strategy", sorted(EXPECTED))
def test_one_kernel_call_each_way(kernels: None, strategy: str, where: str) -> None:
    shape, site = SITES[where]
    x = torch.randn(shape)
    if where == "relu":
        x = x.relu()
    codec = REGISTRY.get(strategy).create()
    for _ in range(3):  # the first calls build tables and running state
        packed = codec.compress(x, site)
    want_c, want_d = EXPECTED[strategy][where]
    assert _ops(lambda: codec.compress(x, site), x) == want_c
    assert _ops(lambda: codec.decompress(packed), x) == want_d
