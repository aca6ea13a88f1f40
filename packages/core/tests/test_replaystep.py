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


@pytest.mark.parametrize("inplace", [True, False], ids=["relu_", "relu"])
def test_an_in_place_step_runs_in_place_only_on_a_fresh_recipe_output(inplace: bool) -> None:
    """A BatchNorm's recomputed output, new and held by no one, takes its in-place ReLU in
    place as the forward did (one pass and one tensor fewer); an out-of-place ReLU stays
    out of place, and a recipe that returns its operand (SDPA's saved output, another
    entry's restored value) never has it changed."""
    x = torch.randn(2, 3, 4, 4)
    mean, invstd = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False).add(1e-5).rsqrt()
    bn = derive.Recipe("batch_norm", {"weight": None, "bias": None}, [mean, invstd])
    steps = (_relu_step(inplace),)
    ran: list[bool] = []
    run = replaystep.Replay.run

    def spied(self: replaystep.Replay, t: torch.Tensor, owned: bool) -> tuple[torch.Tensor, bool]:
        out = run(self, t, owned)
        ran.append(out[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replaystep.Replay, "run", spied)
        got = derive.replace(bn, steps=steps)(x)
        want = F.relu(F.batch_norm(x, None, None, training=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert ran == [inplace]
        operand = torch.randn(2, 3, 4, 4)
        before = operand.clone()
        saved = derive.Recipe(derive.SDPA, {}, steps=steps)(operand)
        assert torch.equal(operand, before)  # not changed in place
        assert torch.equal(saved, before.relu())
        assert ran == [inplace, False]
