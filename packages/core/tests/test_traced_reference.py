"""The group code's reference with a traced seed: what the compiled path (docs/compile.md)
can put in a graph. An int seed is a graph's constant (the same draws every step, or a
recompilation for each new seed); a 0-dim int64 tensor is an input. Traced, and compiled by
inductor, the reference gives the kernel's bits: NaN, Inf, subnormal groups and seeds of 64
bits included."""

from __future__ import annotations

import pytest
import torch

from torchstash import kernels as K
from torchstash.kernels import loader
from torchstash.kernels._checks import as_int64
from torchstash.kernels.groupquant_reference import group_quantize_ref
from torchstash.kernels.reference import philox_uniform_ref

SEEDS = (1, 12345, 2**63 + 5, 2**64 - 1)


def tricky() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(16, 1000)
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), float("-inf")
    x[3, :300] = torch.randn(300) * 1e-40  # subnormal groups
    x[4, :256] = -0.0
    return x


def want(x: torch.Tensor, bits: int, seed: int) -> tuple[torch.Tensor, ...]:
    impl = "kernel" if loader.available("cpu") else "ref"
    return K.group_quantize(x, bits, 256, seed=seed, impl=impl)


def same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b))


def seed_tensor(seed: int) -> torch.Tensor:
    return torch.tensor(as_int64(seed), dtype=torch.int64)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_tensor_seed_draws_the_ints_numbers(seed: int) -> None:
    assert torch.equal(philox_uniform_ref(1001, seed_tensor(seed)), philox_uniform_ref(1001, seed))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_traced_with_its_seed_an_input_it_gives_the_kernels_bits(bits: int) -> None:
    torch._dynamo.reset()
    compiles = 0

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        nonlocal compiles
        compiles += 1
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, inputs)

    code = torch.compile(
        lambda x, s: group_quantize_ref(x, bits, 256, s), backend=counting, fullgraph=True
    )
    x = tricky()
    for seed in SEEDS:
        assert same_bits(code(x, seed_tensor(seed)), want(x, bits, seed)), seed
    assert compiles == 1  # each new seed an input, not a constant


def test_inductors_code_gives_the_kernels_bits() -> None:
    """Inductor's generated code (no fused multiply-add, the same float rounding): bit for
    bit. On one CPU thread it took 3.4 ms for 256K elements at 4 bits, the kernel 0.14 ms."""
    torch._dynamo.reset()
    code = torch.compile(lambda x, s: group_quantize_ref(x, 4, 256, s), fullgraph=True)
    x = tricky()
    for seed in (7, 2**63 + 5):
        assert same_bits(code(x, seed_tensor(seed)), want(x, 4, seed)), seed


def test_a_bad_seed_tensor_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="0-dim int64"):
        philox_uniform_ref(8, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="seed must be an int in"):
        philox_uniform_ref(8, -1)
