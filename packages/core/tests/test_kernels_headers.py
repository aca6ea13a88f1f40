"""The torch-free headers on their own: Philox known answers and every bitpack fast path,
compiled with the host C++ compiler; and the CUDA sources with ``nvcc -c`` where it exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from torchstash.kernels import loader
from torchstash.kernels.nvcc_check import nvcc_check

PROGRAM = r"""
#include <cstdio>
#include "torchstash/bitpack.h"
#include "torchstash/philox.h"
using namespace torchstash;

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { ++failures; std::printf(__VA_ARGS__); std::printf("\n"); } } while (0)

static void kat(philox::Words ctr, std::uint32_t k0, std::uint32_t k1, philox::Words want) {
  const philox::Words got = philox::philox4x32_10(ctr, k0, k1);
  CHECK(got.x0 == want.x0 && got.x1 == want.x1 && got.x2 == want.x2 && got.x3 == want.x3,
        "kat: got %08x %08x %08x %08x", got.x0, got.x1, got.x2, got.x3);
}

template <int BITS>
static void bitpack_fast_paths() {
  constexpr int per = 8 / BITS;
  for (int b = 0; b < 256; ++b) {  // every packed byte unpacks the same both ways
    std::uint8_t out[per + 1];
    out[per] = 0xEE;
    bitpack::unpack_full<BITS>(static_cast<std::uint8_t>(b), out);
    const std::uint8_t packed = static_cast<std::uint8_t>(b);
    for (int k = 0; k < per; ++k)
      CHECK(out[k] == bitpack::unpack_code(&packed, k, BITS), "unpack<%d> byte %d code %d", BITS, b, k);
    CHECK(out[per] == 0xEE, "unpack<%d> wrote past its %d codes", BITS, per);
  }
  std::uint32_t state = 12345;
  for (int trial = 0; trial < 200000; ++trial) {  // random codes with garbage high bits
    std::uint8_t codes[8];
    for (int k = 0; k < 8; ++k) { state = state * 1664525u + 1013904223u; codes[k] = static_cast<std::uint8_t>(state >> 24); }
    if (trial < 256) for (int k = 0; k < 8; ++k) codes[k] = static_cast<std::uint8_t>((trial >> k) & 1 ? 0xFF : 0x00);
    CHECK(bitpack::pack_full<BITS>(codes) == bitpack::pack_byte(codes, per, 0, BITS), "pack<%d> trial %d", BITS, trial);
  }
}

int main() {
  kat({0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  kat({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu,
      {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  kat({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u,
      {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
  const philox::Words w = philox::block_words(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull);
  CHECK(w.x0 == 0xd16cfe09u && w.x3 == 0x24126ea1u, "block_words layout");
  CHECK(philox::to_uniform(0xffffffffu) < 1.0f && philox::to_uniform(0xffffffffu) == 16777215.0f / 16777216.0f, "to_uniform");
  CHECK(bitpack::packed_size(9, 1) == 2 && bitpack::packed_size(9, 2) == 3 && bitpack::packed_size(9, 4) == 5, "packed_size");
  CHECK(bitpack::packed_size(INT64_MAX, 1) == INT64_MAX / 8 + 1, "packed_size does not overflow");
  bitpack_fast_paths<1>();
  bitpack_fast_paths<2>();
  bitpack_fast_paths<4>();
  bitpack_fast_paths<8>();
  std::printf(failures ? "FAILED %d\n" : "OK\n", failures);
  return failures != 0;
}
"""


@pytest.fixture(scope="module")
def csrc() -> Path:
    root, reason = loader.find_csrc()
    if root is None:
        pytest.skip(str(reason))
    return root


def test_headers_known_answers_and_fast_paths(csrc: Path, tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "headers.cpp"
    source.write_text(PROGRAM)
    exe = tmp_path / "headers"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", str(csrc / "include"),
         str(source), "-o", str(exe)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stdout[-2000:]


def test_cuda_sources_compile_with_nvcc(csrc: Path) -> None:
    if shutil.which("nvcc") is None:
        assert nvcc_check(csrc) == []
        pytest.skip("nvcc not on PATH")
    results = nvcc_check(csrc)
    assert {path.name for path, _, _ in results} == {p.name for p in (csrc / "cuda").glob("*.cu")}
    failed = [f"{path.name}:\n{output}" for path, ok, output in results if not ok]
    assert not failed, "\n".join(failed)
