"""The Site a compressor is given carries the op call: what a plug-in reads, and what the
engine keeps (never the call's arguments beyond the call)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import torchstash as ts
from torchstash.packed import Packed
from torchstash.site import NO_CALL, OpCall, Site
from torchstash.testing.toys import CloneCompressor


def test_opcall_reads_arguments_by_keyword_or_position() -> None:
    x = torch.randn(4, 8)
    call = OpCall((x, "tanh"), {"inplace": True})
    assert call.argument("approximate", 1, "none") == "tanh"
    assert call.argument("inplace", 2, False) is True
    assert call.argument("missing", 5, "d") == "d"
    assert call.tensors() == (x,)
    assert not call.has_parameter
    assert OpCall((x, torch.nn.Parameter(torch.ones(8, 8)))).has_parameter
    with pytest.raises(AttributeError):
        call.args = ()  # type: ignore[misc]  # immutable


def test_opcall_position_tells_views_of_one_storage_apart() -> None:
    qkv = torch.randn(2, 4, 6, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    call = OpCall((q, k, v))
    assert [call.position(t) for t in (q, k, v)] == [0, 1, 2]
    assert call.position(torch.randn(2, 4, 6, 8)) is None


def test_a_site_built_by_hand_has_no_call_and_drops_result_callbacks() -> None:
    site = Site(op="gelu")
    assert site.opcall is NO_CALL
    site.opcall.on_result(lambda _: pytest.fail("no call to deliver"))  # dropped


class _Recorder(CloneCompressor):
    """Copies (as ``test.clone``); records the sites it is given and each call's result."""

    name = "recorder"

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self.results: list[object] = []

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        self.sites.append(site)
        site.opcall.on_result(self.results.append)
        return super().compress(x, site)


def test_the_engine_fills_the_call_and_keeps_sites_without_it() -> None:
    recorder = _Recorder()
    ts.register_strategy("testsite.rec", lambda: recorder, lossless=True, summary="records")
    try:
        x = torch.randn(16, 32, requires_grad=True)
        with ts.stash("testsite.rec", min_bytes=0) as s:
            y = F.gelu(x * 2, approximate="tanh")
        gelu = next(site for site in recorder.sites if site.op == "gelu")
        assert gelu.opcall.argument("approximate", 1) == "tanh"
        assert any(r is y for r in recorder.results)  # told the op's result
        kept = [e for e in s.tally.rows.values()]
        assert kept
        y.sum().backward()
    finally:
        ts.REGISTRY.unregister("testsite.rec")


def test_the_kept_sites_do_not_hold_the_calls_arguments() -> None:
    """An entry outlives its op call; a site kept with the call would hold every argument
    (here a bias autograd never saves) for as long as the graph lives."""
    ts.register_strategy("testsite.copy", CloneCompressor, lossless=True, summary="copies")
    try:
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 64, requires_grad=True)
        bias = torch.randn(64)
        ref = weakref.ref(bias)
        with ts.stash("testsite.copy", min_bytes=0) as s:
            y = F.linear(x * 1.0, w, bias)
        assert sum(r.compressed for r in s.tally.rows.values()) >= 1
        del bias
        gc.collect()
        assert ref() is None
        y.sum().backward()
        assert x.grad is not None
    finally:
        ts.REGISTRY.unregister("testsite.copy")


@pytest.mark.parametrize("policy", ["cpu-policy", "cuda-policy"])
def test_autocasts_copy_of_an_argument_has_the_arguments_role(policy: str) -> None:
    """Autocast casts an op's arguments inside the call: the copy a Linear, a conv or (under
    CUDA's policy, emulated here) a LayerNorm saves is its ``input``, as it is without
    autocast, so policies and codes for inputs reach it. It was ``output``: a LayerNorm's
    float32 copy of its bf16 input was then kept exact as if a statistic. A dropout's mask,
    shaped like its input, stays ``output``."""
    from torchstash.testing.autocast import cuda_autocast_policy_on_cpu

    recorder = _Recorder()
    ts.register_strategy("testsite.roles", lambda: recorder, lossless=True, summary="records")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 32),
        torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4),
    )  # fmt: skip
    cuda = policy == "cuda-policy"
    emulated = cuda_autocast_policy_on_cpu() if cuda else contextlib.nullcontext()
    try:
        with emulated, ts.stash("testsite.roles", min_bytes=0):
            with torch.autocast("cpu", torch.bfloat16):  # backward outside it
                out = model(torch.randn(2, 3, 8, 8))
            out.float().sum().backward()
    finally:
        ts.REGISTRY.unregister("testsite.roles")
    roles: dict[str, set[str]] = {}
    for site in recorder.sites:
        roles.setdefault(site.op, set()).add(site.role)
    assert roles["conv"] == {"input"}  # the images' copy: nothing needs its gradient
    assert roles["linear"] == {"input"}
    assert roles["layer_norm"] == {"input", "output"}  # its copy (or bf16 input); mean, rstd
    assert roles["dropout"] == {"output"}
