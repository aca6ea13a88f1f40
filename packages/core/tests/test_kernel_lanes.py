"""The CPU kernels give the same bits at every vector width they run at (``csrc/cpu/simd.h``).

Their leaf loops run at the CPU's lane count (16 with AVX-512, 8 with AVX2, 4 below), read once
per process; ``TORCHSTASH_CPU_LANES`` sets it. Each width runs in a process of its own, every
op's kernel against its pure-PyTorch reference, bit for bit, on tensors whose lengths leave
tails at every width and which hold NaN, infinities, subnormals, constant rows and groups.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from torchstash.kernels import loader

SCRIPT = textwrap.dedent(
    """
    import torch
    import torchstash.kernels as K

    def same(a, b):
        if isinstance(a, (tuple, list)):
            return all(same(x, y) for x, y in zip(a, b, strict=True))
        if a is None or b is None:
            return a is b
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.is_floating_point() else a,
            b.view(torch.uint8) if b.is_floating_point() else b,
        )

    torch.manual_seed(0)
    bad = []
    for n in (1, 15, 17, 161, 200, 4099, 70_003):  # 161, 200, 70_003: 5, 6, 139 Philox groups of 8
        x = torch.randn(n) * 3
        x[:: 97] = float("nan")
        x[5 :: 101] = float("inf")
        x[7 :: 103] = -float("inf")
        x[9 :: 89] = 1e-40
        x[: min(n, 300)] = 0.25  # a constant group and row
        clean = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        run = 33
        rows = torch.randn(n // run * run + run) * 2
        if rows.numel() > 4 * run:
            rows[run : 2 * run] = 0.5  # a constant row
            rows[3 * run + 4] = float("nan")
            rows[-2] = float("inf")
            rows[-run - 3] = 1e-40
        cases = {
            "group_quantize": lambda impl: K.group_quantize(
                x, 4, 64, seed=3, stochastic=True, impl=impl
            ),
            "group_quantize nearest": lambda impl: K.group_quantize(
                x, 8, 256, seed=3, stochastic=False, impl=impl
            ),
            "row_group_quantize": lambda impl: K.row_group_quantize(
                rows, run, 8, 33, seed=5, stochastic=True, impl=impl
            ),
            "row_center": lambda impl: K.row_center(rows, run, scale=True, impl=impl),
            "fp8_quantize": lambda impl: K.fp8_quantize(x, 32, impl=impl),
            "channel_minmax": lambda impl: K.channel_minmax(clean, 1, n, impl=impl),
            "sign_pack": lambda impl: K.sign_pack(x, impl=impl),
        }
        for bits in (2, 8):
            codes, lo, step = K.group_quantize(x, bits, 64, seed=1, impl="ref")
            cases[f"group_dequantize {bits}"] = lambda impl, c=codes, l=lo, s=step, b=bits: (
                K.group_dequantize(c, l, s, b, 64, n, torch.float32, impl=impl)
            )
        codes, scale = K.fp8_quantize(x, 32, impl="ref")
        cases["fp8_dequantize"] = lambda impl: K.fp8_dequantize(
            codes, scale, 32, codes.numel(), torch.float32, impl=impl
        )
        centered, offsets, constant, scales = K.row_center(rows, run, scale=True, impl="ref")
        cases["row_uncenter"] = lambda impl: K.row_uncenter(
            centered.reshape(-1), offsets, constant, scales, run, torch.float32, impl=impl
        )
        cases["row_uncenter unscaled"] = lambda impl: K.row_uncenter(
            centered.reshape(-1), offsets, constant, None, run, torch.float32, impl=impl
        )
        lo, step = torch.full((1,), -2.0), torch.full((1,), 0.03)
        cases["channel_quantize"] = lambda impl: K.channel_quantize(
            clean.view(1, n), lo, step, n, seed=2, impl=impl
        )
        cases["channel_quantize special"] = lambda impl: K.channel_quantize(
            x.view(1, n), lo, step, n, seed=0, stochastic=False, impl=impl
        )
        chan = K.channel_quantize(x.view(1, n), lo, step, n, seed=0, stochastic=False, impl="ref")
        cases["channel_dequantize"] = lambda impl: K.channel_dequantize(
            chan, lo, step, n, torch.float32, impl=impl
        )
        cases["philox_uniform"] = lambda impl: K.philox_uniform(n, 0xFEDCBA9876543210, 7, impl=impl)
        cases["level_quantize"] = lambda impl: K.level_quantize(
            clean, torch.tensor([-1.0, 0.0, 0.5, 2.0]), 4, seed=4, impl=impl
        )
        cases["level_quantize 15 levels, NaN and Inf"] = lambda impl: K.level_quantize(
            x, torch.linspace(-3.0, 3.0, 15), 4, seed=6, impl=impl
        )
        packed = K.sign_pack(x, impl="ref")
        cases["sign_select"] = lambda impl: K.sign_select(x, packed, impl=impl)
        cases["sign_unpack"] = lambda impl: K.sign_unpack(packed, n, torch.float32, impl=impl)
        for name, call in cases.items():
            if not same(call("kernel"), call("ref")):
                bad.append(f"{name} at n={n}")
    print("BAD " + "; ".join(bad) if bad else "OK")
    """
)


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_every_width_matches_the_reference(built: None, lanes: int) -> None:
    env = {**os.environ, "TORCHSTASH_CPU_LANES": str(lanes), "TORCHSTASH_KERNELS": "require"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "OK", done.stdout[-3000:]


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("nm") is None,
    reason="the CPU clones are x86-64's; the check reads the library's symbols with nm",
)
def test_no_lanes_loop_is_left_out_of_its_clones(built: None) -> None:
    """A lambda given to ``at_lanes`` is inlined into each ``TS_CPU_CLONES`` caller: one left
    out of line is compiled for baseline x86-64 whatever clone calls it, and its 16-lane
    vectors then run lane by lane (a group code's statistics six times slower on AVX-512)."""
    library = loader.status()["library"]
    listed = subprocess.run(
        ["nm", "-C", library], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    out_of_line = [
        line.split(" ", 2)[-1]
        for line in listed.splitlines()
        if "::{lambda(auto:1)" in line and "integral_constant<int," in line
    ]
    assert not out_of_line, "at_lanes lambdas without TS_LANES:\n" + "\n".join(out_of_line)
