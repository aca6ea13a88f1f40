"""The engine hears of module calls through an entry on each module (torchstash.modulecalls),
which keeps torch's fast call path: no hook of ours on a module, the sites named as before,
user hooks and exceptions as stock has them, and copies and other entries left as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.modulecalls import takes_entry
from torchstash.testing.hooks import hook_total


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.act = nn.Tanh()
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_applied_modules_keep_torch_s_fast_call_path(toy_strategies: list[str]) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    h = ts.apply(model, "test.clone", min_bytes=0)
    for m in list(model.modules())[1:]:  # no hook of ours: nn.Module._call_impl's fast path
        assert not m._forward_pre_hooks and not m._forward_hooks, m
        assert "_call_impl" in m.__dict__, m
    # the model itself has its compile entry (torchstash.compiling): there, hooks
    assert "_call_impl" in model.__dict__ and model._forward_pre_hooks
    _grads(model, x)
    # every save named by the module whose forward made it, as the hooks named them
    assert {"a", "act", "b"} <= set(h.tally.rows)
    h.remove()
    assert hook_total(model) == 0


def test_user_hooks_run_inside_the_module_s_call(toy_strategies: list[str]) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    stock = copy.deepcopy(model)
    seen: list[str] = []

    def double(m: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append("post")
        return out * 2  # an op on the output: saves nothing, changes the result

    def before(m: nn.Module, args: object) -> None:
        seen.append("pre")

    for m in (model, stock):
        m.act.register_forward_pre_hook(before)
        m.act.register_forward_hook(double)
    h = ts.apply(model, "test.clone", min_bytes=0)
    model.act.register_forward_hook(lambda m, a, o: seen.append("late"))
    want, got = _grads(stock, x), _grads(model, x)
    assert seen == ["pre", "post", "pre", "post", "late"]
    assert all(torch.equal(want[n], got[n]) for n in want)
    h.remove()
    assert len(model.act._forward_hooks) == 2 and len(model.act._forward_pre_hooks) == 1


def test_a_raising_forward_leaves_no_frame(toy_strategies: list[str]) -> None:
    class Boom(nn.Module):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise ValueError("boom")
            return x.tanh()

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    h = ts.apply(model, "test.clone", min_bytes=0)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4, requires_grad=True))
    assert not h.engine._tls.frames and not h.engine.active
    model[1].fail = False  # the engine names and restores saves afterwards
    model(torch.randn(2, 4)).sum().backward()
    assert {"0", "1"} <= set(h.tally.rows)


def test_an_entry_is_never_stacked_on_another(toy_strategies: list[str]) -> None:
    """A module that already has a call of its own on the instance (another library's) keeps
    it, and takes the hooks instead; remove leaves the library's call in place."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    calls: list[int] = []

    def theirs(self: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return nn.Module._call_impl(self, *args, **kwargs)

    model.act._call_impl = theirs.__get__(model.act)  # type: ignore[method-assign]
    assert not takes_entry(model.act) and takes_entry(model.a)
    h = ts.apply(model, "test.clone", min_bytes=0)
    assert model.act._forward_pre_hooks and model.act._forward_hooks
    assert model.act.__dict__["_call_impl"].__func__ is theirs
    _grads(model, x)
    assert calls == [1] and "act" in h.tally.rows
    h.remove()
    assert model.act.__dict__["_call_impl"].__func__ is theirs
    assert not model.act._forward_pre_hooks and "_call_impl" not in model.a.__dict__


def test_a_deep_copy_calls_its_own_modules(toy_strategies: list[str]) -> None:
    """A copy of an applied model binds its entries to its own modules (as hooks, copied,
    were handed the copy's module): its gradients are its own and right."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    stock = copy.deepcopy(model)
    h = ts.apply(model, "test.clone", min_bytes=0)
    twin = copy.deepcopy(model)
    for m, t in zip(model.modules(), twin.modules(), strict=True):
        assert t.__dict__["_call_impl"].__self__ is t and m.__dict__["_call_impl"].__self__ is m
    want = _grads(stock, x)
    for m in (model, twin):
        got = _grads(m, x)
        assert all(torch.equal(want[n], got[n]) for n in want)
    h.remove()
    assert "_call_impl" not in model.a.__dict__ and "_call_impl" in twin.a.__dict__


def test_dynamo_s_path_through_an_entry_names_the_module() -> None:
    """Under torch.compile a submodule is reached through its parent's entry (the bound
    method's ``__self__``): the graph names it as the eager engine does."""
    from torchstash.graphsite import module_path

    key = "L['self']._modules['blocks']._modules['0']._call_impl.__self__._modules['attn']"
    assert module_path(key) == "blocks.0.attn"
    assert module_path("L['self']._call_impl.__self__._modules['fc']") == "fc"
    assert module_path("L['self']._modules['blocks']._modules['0']") == "blocks.0"


def _replicate_like_data_parallel(model: nn.Module) -> nn.Module:
    """What ``torch.nn.parallel.replicate`` does for one device, on the CPU: each module's
    ``_replicate_for_data_parallel``, the children wired, each parameter set on the replica as
    a plain tensor (here its own leaf, so the gradients show which module ran)."""
    modules = list(model.modules())
    replicas = {id(m): m._replicate_for_data_parallel() for m in modules}
    for m in modules:
        replica = replicas[id(m)]
        for key, child in m._modules.items():
            replica._modules[key] = replicas[id(child)] if child is not None else None
        for key, p in m._parameters.items():
            if p is not None:
                setattr(replica, key, p.detach().clone().requires_grad_())
    return replicas[id(model)]


def test_data_parallel_replicas_call_themselves(toy_strategies: list[str]) -> None:
    """``nn.DataParallel`` copies each module's ``__dict__`` into its replica: the entries
    (and the model's compile entry) are rebound to the replica, which runs on its own
    parameters, as with hooks; without the rebinding every replica ran the original."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    want = _grads(copy.deepcopy(model), x)
    h = ts.apply(model, "test.clone", min_bytes=0)
    replica = _replicate_like_data_parallel(model)
    for r in replica.modules():
        assert r.__dict__["_call_impl"].__self__ is r
    replica(x).square().sum().backward()
    got = {
        n: getattr(r, k).grad
        for n, (r, k) in {
            "a.weight": (replica.a, "weight"),
            "a.bias": (replica.a, "bias"),
            "b.weight": (replica.b, "weight"),
            "b.bias": (replica.b, "bias"),
        }.items()
    }
    assert all(got[n] is not None and torch.equal(got[n], want[n]) for n in got)
    assert all(p.grad is None for p in model.parameters())  # the originals did not run
    assert {"a", "act", "b"} <= set(h.tally.rows)
    h.remove()
    assert hook_total(model) == 0
