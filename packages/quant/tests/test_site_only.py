"""The op-aware codes decided and applied from a Site alone: its op call built by hand, no
engine, no model. (A plug-in reads the call from its Site, never from the engine.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchstash.site import OpCall, Site
from torchstash_quant.derivs import current_approximate
from torchstash_quant.opaware import attention_part
from torchstash_quant.strategies import quant


def test_a_gelus_variant_is_read_from_its_call() -> None:
    x = torch.randn(4, 8)
    assert (
        current_approximate(Site(op="gelu", opcall=OpCall((x,), {"approximate": "tanh"}))) == "tanh"
    )
    assert current_approximate(Site(op="gelu", opcall=OpCall((x, "tanh")))) == "tanh"
    assert current_approximate(Site(op="gelu")) == "none"


def test_attention_parts_are_told_from_the_calls_operands() -> None:
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    sdpa = "scaled_dot_product_attention"
    call = OpCall((q, k, v))
    parts = [attention_part(t, Site(op=sdpa, role="input", opcall=call)) for t in (q, k, v)]
    assert parts == ["scores", "scores", "values"]
    weight = torch.nn.Parameter(torch.randn(8, 8))
    linear_like = Site(op="matmul", role="input", opcall=OpCall((q, weight)))
    assert attention_part(q, linear_like) == ""  # a matmul with a Parameter is a projection
    assert attention_part(q, Site(op="matmul", role="input", opcall=OpCall((q, k)))) == "scores"


def test_a_max_pools_indices_are_coded_from_its_calls_geometry() -> None:
    x = torch.randn(2, 3, 8, 8)
    _, indices = F.max_pool2d(x, 2, return_indices=True)
    site = Site(op="max_pool", func="max_pool2d_with_indices", role="output")
    codec = quant(4)
    packed = codec.compress(indices, Site(**{**_fields(site), "opcall": OpCall((x, 2))}))
    assert not isinstance(packed, torch.Tensor)  # coded as positions in each window
    assert torch.equal(codec.decompress(packed), indices)
    assert codec.compress(indices, site) is indices  # no call: no geometry, kept as is


def _fields(site: Site) -> dict[str, object]:
    return {f: getattr(site, f) for f in ("op", "func", "role")}
