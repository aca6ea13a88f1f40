"""The torch-free groupquant.h on its own, compiled with the host C++ compiler: its storage
conversions against torch's casts, its bfloat16 rounding against the reference, and no FMA
contraction under the loader's flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchstash.kernels.groupquant_reference import bf16_down, bf16_up
from torchstash.testing.native import build_host_program, run_host_program

PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "torchstash/groupquant.h"
using namespace torchstash;

// Out of line, so that its multiply has one use (the add) and could be fused into an FMA.
__attribute__((noinline)) float decode(std::uint8_t code, const groupquant::Params& p) {
  return groupquant::value_of(code, p, 8);
}

// argv[1]: uint32 float patterns in; argv[2]: out, per pattern: bf16 bits, half bits (u16),
// bf16_down, bf16_up (u32); then the float bits of all 65536 halves; then the FMA check.
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::vector<std::uint32_t> pats;
  std::uint32_t p;
  while (std::fread(&p, 4, 1, in) == 1) pats.push_back(p);
  std::fclose(in);
  std::FILE* out = std::fopen(argv[2], "wb");
  for (std::uint32_t b : pats) {
    const float v = groupquant::bits_float(b);
    const std::uint16_t h[2] = {groupquant::float_to_bf16_bits(v), groupquant::float_to_half_bits(v)};
    const std::uint32_t r[2] = {groupquant::float_bits(groupquant::bf16_down(v)),
                                groupquant::float_bits(groupquant::bf16_up(v))};
    std::fwrite(h, 2, 2, out);
    std::fwrite(r, 4, 2, out);
  }
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const std::uint32_t f = groupquant::float_bits(groupquant::half_bits_to_float(static_cast<std::uint16_t>(h)));
    std::fwrite(&f, 4, 1, out);
  }
  // value_of must round the product and the sum separately, whatever the ISA offers.
  std::uint32_t state = 1, fused = 0;
  for (int t = 0; t < 1000000; ++t) {
    state = state * 1664525u + 1013904223u;
    const float lo = groupquant::bits_float((state >> 1) & 0x3FFFFFFFu) - 1.0f;
    state = state * 1664525u + 1013904223u;
    const float step = groupquant::bits_float(0x30000000u | (state >> 4));
    const auto code = static_cast<std::uint8_t>(state & 0xFF);
    const groupquant::Params prm = groupquant::ordinary_params(lo, step, 255.0f, false);
    volatile float prod = static_cast<float>(code) * step;  // rounded on its own
    if (decode(code, prm) != lo + prod) ++fused;
  }
  std::fwrite(&fused, 4, 1, out);
  std::fclose(out);
  return 0;
}
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, bytes]:
    tmp = tmp_path_factory.mktemp("groupquant_headers")
    program = build_host_program(PROGRAM, tmp)  # the loader's flags, FMA where it can be
    pats = _patterns()
    (tmp / "in.bin").write_bytes(pats.numpy().tobytes())
    run_host_program(program, str(tmp / "in.bin"), str(tmp / "out.bin"), timeout=120)
    return pats, Path(tmp / "out.bin").read_bytes()


def _patterns() -> torch.Tensor:
    """int32 float patterns: random, every exponent with edge mantissas, the specials."""
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64)
    exps = torch.arange(256, dtype=torch.int64) << 23
    mants = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x7FFFFF])
    mants = torch.cat([mants, 0x2000 * torch.arange(1024), 0x2000 * torch.arange(1024) + 0x1000])
    edges = (exps[:, None] | mants[None, :]).reshape(-1)
    both = torch.cat([rand, edges, edges | (1 << 31)])
    both = torch.where(both >= 1 << 31, both - (1 << 32), both)
    return both.to(torch.int32)


def _split(data: bytes, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    per = torch.frombuffer(bytearray(data[: n * 12]), dtype=torch.int32).view(n, 3)
    halves = per[:, 0].contiguous().view(torch.int16).view(n, 2)
    return halves[:, 0], halves[:, 1], per[:, 1], per[:, 2]


def _same_or_both_nan(got_bits: torch.Tensor, want: torch.Tensor) -> None:
    got = got_bits.view(want.dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    view = torch.int16 if want.element_size() == 2 else torch.int32
    mismatch = (got.view(view) != want.view(view)) & ~nan
    assert not bool(mismatch.any()), f"{int(mismatch.sum())} patterns differ"


def test_narrowing_casts_match_torch(results: tuple[torch.Tensor, bytes]) -> None:
    pats, data = results
    bf16, half, _, _ = _split(data, pats.numel())
    values = pats.view(torch.float32)
    _same_or_both_nan(bf16, values.to(torch.bfloat16))
    _same_or_both_nan(half, values.to(torch.float16))
    assert set(bf16[values.isnan()].tolist()) == {0x7FC0}
    assert set((half[values.isnan()] & 0x7FFF).tolist()) == {0x7E00}


def test_half_widening_matches_torch(results: tuple[torch.Tensor, bytes]) -> None:
    pats, data = results
    start = pats.numel() * 12
    got = torch.frombuffer(bytearray(data[start : start + 4 * 65536]), dtype=torch.int32)
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    _same_or_both_nan(got, halves.float())


def test_bf16_rounding_matches_the_reference(results: tuple[torch.Tensor, bytes]) -> None:
    pats, data = results
    _, _, down, up = _split(data, pats.numel())
    values = pats.view(torch.float32)
    finite = values.isfinite()
    assert torch.equal(down[finite], bf16_down(values[finite]).view(torch.int32))
    upward = finite | (values == float("inf"))
    assert torch.equal(up[upward], bf16_up(values[upward]).view(torch.int32))


def test_no_fma_contraction(results: tuple[torch.Tensor, bytes]) -> None:
    pats, data = results
    fused = int.from_bytes(data[pats.numel() * 12 + 4 * 65536 :], "little")
    assert fused == 0
