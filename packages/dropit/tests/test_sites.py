"""Which saves DropIT may thin, decided from the Site alone (its op call built by hand)."""

from __future__ import annotations

import torch

from torchstash.site import OpCall, Site
from torchstash_dropit.sites import batch_of_op, why_not_linear_input


def _linear_site(x: torch.Tensor, w: torch.Tensor, role: str, func: str = "linear") -> Site:
    args = (torch.zeros(4), x, w.t()) if func == "addmm" else (x, w)
    return Site(op="linear", func=func, role=role, opcall=OpCall(args))


def test_a_linear_input_may_drop_its_weight_may_not() -> None:
    x = torch.randn(6, 8)
    w = torch.nn.Parameter(torch.randn(4, 8))
    assert why_not_linear_input(x, _linear_site(x, w, "input")) is None
    assert "weight" in (why_not_linear_input(w, _linear_site(x, w, "arg1")) or "")
    frozen = w.detach()
    assert "no trainable weight" in (
        why_not_linear_input(x, _linear_site(x, frozen, "input")) or ""
    )
    assert "not by a linear" in (why_not_linear_input(x, Site(op="gelu")) or "")


def test_addmm_puts_its_input_second() -> None:
    x = torch.randn(6, 8)
    w = torch.nn.Parameter(torch.randn(4, 8))
    assert why_not_linear_input(x, _linear_site(x, w, "arg1", func="addmm")) is None


def test_the_batch_is_read_from_the_calls_input() -> None:
    x = torch.randn(3, 5, 8)
    w = torch.nn.Parameter(torch.randn(4, 8))
    site = _linear_site(x, w, "input")
    assert batch_of_op(x.reshape(15, 8), site) == 3
    assert batch_of_op(x.reshape(15, 8), Site(op="linear")) == 15  # no call: its first dim
