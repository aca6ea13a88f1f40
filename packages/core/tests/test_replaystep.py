"""A recipe's replayed calls (:mod:`torchstash.replaystep`): under the forward's autocast,
and in place where the forward's call was and no one else holds the recomputed tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchstash import derive, replaystep
from torchstash.derive import Recipe
from torchstash.replaystep import replay_step


def test_a_replay_runs_under_the_autocast_of_its_forward() -> None:
    """Backward runs without autocast (or inside a block the forward was not in): an op
    replayed there computes as it did in the forward. On CUDA, autocast runs a softmax in
    float32 on a bf16 map; replayed without it, the map came back bf16 and the softmax's
    backward failed ("expected scalar type Float but found BFloat16")."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", torch.bfloat16):
        want = torch.matmul(x, w)
        step = replay_step(torch.matmul, (x, w), {}, 0)
        rec = Recipe("matmul", {}, arity=2)
    assert want.dtype == torch.bfloat16 and step is not None
    assert torch.equal(step(x), want)  # called outside autocast, as backward is
    assert torch.equal(rec(x, w), want)
    plain = replay_step(torch.matmul, (x, w), {}, 0)
    assert plain is not None
    with torch.autocast("cpu", torch.bfloat16):  # a backward inside the autocast block
        assert plain(x).dtype == torch.float32
        assert Recipe("matmul", {}, arity=2)(x, w).dtype == torch.bfloat16


def _relu_step(inplace: bool) -> replaystep.Replay:
    x = torch.randn(4)
    return replaystep.Replay(torch.relu_ if inplace else torch.relu, [x], {}, 0)


def _spy_in_place(mp: pytest.MonkeyPatch) -> list[bool]:
    """The list each replayed step appends to: whether it ran in place."""
    ran: list[bool] = []
    run = replaystep.Replay.run

    def spied(self: replaystep.Replay, t: torch.Tensor, owned: bool) -> tuple[torch.Tensor, bool]:
        out = run(self, t, owned)
        ran.append(out[1])
        return out

    mp.setattr(replaystep.Replay, "run", spied)
    return ran


@pytest.mark.parametrize("inplace", [True, False], ids=["relu_", "relu"])
def test_an_in_place_step_runs_in_place_only_on_a_fresh_recipe_output(inplace: bool) -> None:
    """A BatchNorm's recomputed output, new and held by no one, takes its ReLU in place (one
    pass and one tensor fewer), whether the forward's ReLU was in place or not; a recipe
    that returns its operand (SDPA's saved output, another entry's restored value) never
    has it changed."""
    x = torch.randn(2, 3, 4, 4)
    mean, invstd = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False).add(1e-5).rsqrt()
    bn = derive.Recipe("batch_norm", {"weight": None, "bias": None}, [mean, invstd])
    steps = (_relu_step(inplace),)
    with pytest.MonkeyPatch.context() as mp:
        ran = _spy_in_place(mp)
        got = derive.replace(bn, steps=steps)(x)
        want = F.relu(F.batch_norm(x, None, None, training=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert ran == [True]
        operand = torch.randn(2, 3, 4, 4)
        before = operand.clone()
        saved = derive.Recipe(derive.SDPA, {}, steps=steps)(operand)
        assert torch.equal(operand, before)  # not changed in place
        assert torch.equal(saved, before.relu())
        assert ran == [True, False]


def _attention_map(q: torch.Tensor, k: torch.Tensor, scale: object, mask: torch.Tensor) -> Recipe:
    """``softmax(masked_fill(q @ k * scale))`` as the engine records it from the op calls."""
    att = q @ k
    scaled = att * scale
    steps = (
        replay_step(torch.Tensor.__mul__, (att, scale), {}, 0),
        replay_step(torch.Tensor.masked_fill, (scaled, mask, float("-inf")), {}, 0),
        replay_step(torch.Tensor.softmax, (scaled,), {"dim": -1}, 0),
    )
    assert all(s is not None for s in steps)
    return Recipe("matmul", {}, arity=2, steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_of_place_steps_run_in_place_on_a_fresh_map_with_the_same_bits(
    dtype: torch.dtype,
) -> None:
    """The recomputed attention map is scaled and masked in place (the forward made a new map
    for each): the same bits as the forward's calls, and the operands left unchanged."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 8, 4, generator=g).to(dtype), torch.randn(6, 4, 8, generator=g).to(dtype)
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
    want = ((q @ k) * 0.5).masked_fill(mask, float("-inf")).softmax(dim=-1)
    rec = _attention_map(q, k, 0.5, mask)
    q0, k0 = q.clone(), k.clone()
    with pytest.MonkeyPatch.context() as mp:
        ran = _spy_in_place(mp)
        got = rec(q, k)
    assert torch.equal(got, want)
    assert ran == [True, True, False]  # scale and mask in place; softmax has no such form
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize(
    "case", ["wider-operand", "promoting-operand", "promoting-number", "reversed-sub"]
)
def test_a_step_whose_result_differs_from_its_argument_stays_out_of_place(case: str) -> None:
    """In place only where the result is the argument's shape and dtype: an operand that
    broadcasts the map wider or promotes its dtype (a float32 scale on a bf16 map, a float on
    an integer tensor) keeps the forward's out-of-place call, and ``s - t`` is never ``t -=
    s``."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    func: object
    if case == "wider-operand":
        func, other = torch.Tensor.__mul__, torch.ones(2, 3, 4)
    elif case == "promoting-operand":
        x, func, other = x.bfloat16(), torch.Tensor.__mul__, torch.full((4,), 0.5)
    elif case == "promoting-number":
        x, func, other = x.long(), torch.Tensor.__mul__, 0.5
    else:
        func, other = torch.Tensor.__rsub__, 2.0
    step = replay_step(func, (x, other), {}, 0)  # type: ignore[arg-type]
    assert step is not None
    t = x.clone()
    out, in_place = step.run(t, True)
    assert not in_place
    assert torch.equal(t, x)  # the argument as it was
    assert torch.equal(out, func(x, other))  # type: ignore[operator]
    assert out.shape == func(x, other).shape and out.dtype == func(x, other).dtype  # type: ignore[operator]
