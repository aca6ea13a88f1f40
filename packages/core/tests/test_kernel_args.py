"""The kernels' argument rules (``torchstash.kernels._checks``) hold in all three places that
check them: the Python dispatcher, the C++ op (``csrc/bindings/checks.h``) and the fake kernel
``torch.compile`` traces with. For each op, a valid call, then one argument broken at a time:
every one of the three refuses it, naming the argument."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchstash import kernels as K
from torchstash.kernels import loader

ops = torch.ops.torchstash
X = torch.randn(4, 64)
PACKED, LO, STEP = K.group_quantize(X, 4, 64, seed=1, impl="ref")
LO_C, HI_C = torch.full((4,), -3.0), torch.full((4,), 0.05)
CODES_C = K.channel_quantize(X, LO_C, HI_C, 64, seed=1, impl="ref")
FP8_CODES, FP8_SCALE = K.fp8_quantize(X, 64, impl="ref")
CENTERED, OFFSETS, CONSTANT, _ = K.row_center(X, 64, impl="ref")
SIGNS = K.sign_pack(X, impl="ref")
POOL_X = torch.randn(2, 3, 8, 8)
POOL = ([3, 3], [2, 2], [1, 1], [1, 1], False)
POOL_TABLE = torch.tensor(
    [0, 1, 2, 0, 0, 0, 0, 0, 3, 4, 5, 0, 0, 0, 0, 0, 6, 7, 8], dtype=torch.uint8
)
POOL_OUT, POOL_CODES = K.max_pool2d_code(POOL_X, *POOL, POOL_TABLE, 4, impl="ref")
POOL_INDICES = torch.nn.functional.max_pool2d(POOL_X, 3, 2, 1, return_indices=True)[1]
WINDOW = ([8, 8], [3, 3], [2, 2], [1, 1], [1, 1])


def op_named(name: str) -> Any:
    """The op ``name`` names: ``op`` or ``op.overload``."""
    op, _, overload = name.partition(".")
    return getattr(getattr(ops, op), overload or "default")


@dataclass(frozen=True)
class Case:
    """One op: its C++ arguments, the dispatcher that takes the same ones, and which
    argument is broken how."""

    op: str
    args: tuple[Any, ...]
    dispatcher: Callable[..., Any]
    broken: dict[int, tuple[str, Any]]  # position -> (argument name, bad value)


CASES = [
    Case(
        "group_quantize",
        (X, 4, 64, 1, True),
        lambda x, b, g, s, st: K.group_quantize(x, b, g, seed=s, stochastic=st, impl="kernel"),
        {0: ("x", X.int()), 1: ("bits", 3), 2: ("group_size", 0)},
    ),
    Case(
        "group_quantize.seeded",
        (X, 4, 64, torch.tensor(1), True),
        lambda x, b, g, s, st: K.group_quantize(x, b, g, seed=s, stochastic=st, impl="kernel"),
        {
            0: ("x", X.int()),
            1: ("bits", 3),
            2: ("group_size", 0),
            3: ("seed", torch.tensor([1])),
        },
    ),
    Case(
        "group_dequantize",
        (PACKED, LO, STEP, 4, 64, X.numel(), torch.float32),
        lambda *a: K.group_dequantize(*a, impl="kernel"),
        {3: ("bits", 3), 6: ("dtype", torch.int32)},
    ),
    Case(
        "channel_minmax",
        (X, 64, 4),
        lambda *a: K.channel_minmax(*a, impl="kernel"),
        {0: ("x", X.int()), 1: ("inner", 0), 2: ("channels", 0)},
    ),
    Case(
        "channel_quantize",
        (X, LO_C, HI_C, 64, 1, True),
        lambda x, lo, st, i, s, sto: K.channel_quantize(
            x, lo, st, i, seed=s, stochastic=sto, impl="kernel"
        ),
        {0: ("x", X.int()), 3: ("inner", 0)},
    ),
    Case(
        "mesa_quantize",
        (X, 64, 4, 2, None, 0.9, 1, True),
        lambda x, i, c, g, r, d, s, st: K.mesa_quantize(
            x, i, c, g, r, d, seed=s, stochastic=st, impl="kernel"
        ),
        {0: ("x", X.int()), 1: ("inner", 0), 2: ("channels", 0), 3: ("groups", 0)},
    ),
    Case(
        "channel_dequantize",
        (CODES_C, LO_C, HI_C, 64, torch.float32),
        lambda *a: K.channel_dequantize(*a, impl="kernel"),
        {4: ("dtype", torch.int32)},
    ),
    Case(
        "fp8_quantize",
        (X, 64),
        lambda *a: K.fp8_quantize(*a, impl="kernel"),
        {0: ("x", X.int()), 1: ("group_size", 0)},
    ),
    Case(
        "fp8_dequantize",
        (FP8_CODES, FP8_SCALE, 64, X.numel(), torch.float32),
        lambda *a: K.fp8_dequantize(*a, impl="kernel"),
        {4: ("dtype", torch.int32)},
    ),
    Case(
        "row_center",
        (X, 64, False),
        lambda x, r, s: K.row_center(x, r, scale=s, impl="kernel"),
        {0: ("x", X.int())},
    ),
    Case(
        "row_uncenter",
        (CENTERED, OFFSETS, CONSTANT, torch.empty(0), 64, torch.float32),
        lambda d, o, c, s, r, t: K.row_uncenter(d, o, c, None, r, t, impl="kernel"),
        {0: ("decoded", CENTERED.half()), 5: ("dtype", torch.int32)},
    ),
    Case(
        "topk_mask",
        (X, 4, 8, True),
        lambda x, s, k, e: K.topk_mask(x, s, k, exact=e, impl="kernel"),
        {0: ("x", X.int()), 1: ("segments", 0), 2: ("k", -1)},
    ),
    Case(
        "row_group_quantize.seeded",
        (X, 64, 4, 64, torch.tensor(7), True),
        lambda x, r, b, g, s, st: K.row_group_quantize(
            x, r, b, g, seed=s, stochastic=st, impl="kernel"
        ),
        {0: ("x", X.int()), 2: ("bits", 3), 4: ("seed", torch.tensor([7]))},
    ),
    Case(
        "pack_bits",
        (torch.zeros(16, dtype=torch.uint8), 2),
        lambda *a: K.pack_bits(*a, impl="kernel"),
        {1: ("bits", 3)},
    ),
    Case(
        "sign_pack",
        (X,),
        lambda *a: K.sign_pack(*a, impl="kernel"),
        {0: ("x", X.int())},
    ),
    Case(
        "sign_select",
        (X, SIGNS),
        lambda *a: K.sign_select(*a, impl="kernel"),
        {0: ("grad", X.int())},
    ),
    Case(
        "max_pool2d_code",
        (POOL_X, *POOL, POOL_TABLE, 4),
        lambda *a: K.max_pool2d_code(*a, impl="kernel"),
        {0: ("x", POOL_X.double()), 6: ("table", POOL_TABLE.long()), 7: ("bits", 3)},
    ),
    Case(
        "max_pool2d_code_backward",
        (POOL_OUT, POOL_CODES, list(POOL_X.shape), *POOL, 4),
        lambda *a: K.max_pool2d_code_backward(*a, impl="kernel"),
        {0: ("grad", POOL_OUT.double()), 1: ("packed", POOL_CODES.long()), 8: ("bits", 3)},
    ),
    Case(
        "window_code",
        (POOL_INDICES, POOL_TABLE, *WINDOW, 4),
        lambda *a: K.window_code(*a, impl="kernel"),
        {0: ("indices", POOL_INDICES.int()), 1: ("table", POOL_TABLE.long()), 7: ("bits", 3)},
    ),
    Case(
        "window_indices",
        (POOL_CODES, list(POOL_INDICES.shape), *WINDOW, 4),
        lambda *a: K.window_indices(*a, impl="kernel"),
        {0: ("packed", POOL_CODES.long()), 7: ("bits", 3)},
    ),
]
BROKEN = [(c, i) for c in CASES for i in c.broken]


@pytest.fixture(scope="module")
def compiled() -> None:
    if not loader.available("cpu"):
        pytest.skip("compiled kernels unavailable")


def _with(case: Case, position: int) -> tuple[Any, ...]:
    args = list(case.args)
    args[position] = case.broken[position][1]
    return tuple(args)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_the_valid_call_runs_in_all_three(case: Case) -> None:
    """The broken calls below fail for their broken argument, not for the rest."""
    case.dispatcher(*case.args)
    op_named(case.op)(*case.args)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case.args]
        op_named(case.op)(*fakes)


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize(
    ("case", "position"), BROKEN, ids=[f"{c.op}-{c.broken[i][0]}" for c, i in BROKEN]
)
def test_a_broken_argument_is_refused_by_all_three(case: Case, position: int) -> None:
    name = case.broken[position][0]
    args = _with(case, position)
    with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
        case.dispatcher(*args)
    with pytest.raises((TypeError, ValueError, RuntimeError), match=rf"\b{name}\b"):
        op_named(case.op)(*args)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=rf"\b{name}\b"):
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        op_named(case.op)(*fakes)


def test_every_op_the_library_defines_has_a_fake_kernel() -> None:
    """Each ``m.def`` of the bindings has its fake kernel's row in ``_meta.FAKES``, whose
    argument names its schema has: an op without one breaks ``torch.compile`` on the first
    trace that meets it."""
    import re

    from torchstash.kernels import _meta

    root, reason = loader.find_csrc()
    if root is None:
        pytest.skip(f"no kernel sources: {reason}")
    defined = re.findall(r'm\.def\(\s*"([\w.]+)\(', (root / "bindings" / "ops.cpp").read_text())
    assert defined and sorted(defined) == sorted(_meta.FAKES)
    assert all(callable(_meta.kernel(name)) for name in _meta.FAKES)


UNCHECKED = {
    "group_quantize": lambda a, **k: K.group_quantize(*a[:3], seed=a[3], stochastic=a[4], **k),
    "group_dequantize": lambda a, **k: K.group_dequantize(*a, **k),
    "row_group_quantize": lambda a, **k: K.row_group_quantize(*a[:4], seed=a[4], **k),
}


@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("op", sorted(UNCHECKED))
def test_an_unchecked_call_is_the_same_call_and_the_op_still_refuses(op: str) -> None:
    """``checked=False`` (a codec's own calls, once per saved tensor) skips the dispatcher's
    rules only: the results are the checked call's bit for bit, and a broken argument is
    still refused, by the compiled op, by name."""
    args = {
        "group_quantize": (X, 4, 64, 7, True),
        "group_dequantize": (PACKED, LO, STEP, 4, 64, X.numel(), torch.float32),
        "row_group_quantize": (X, 64, 4, 64, 7),
    }[op]
    call = UNCHECKED[op]
    for impl in ("kernel", "ref"):
        want = call(args, impl=impl)
        got = call(args, impl=impl, checked=False)
        for a, b in zip(
            want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)
        ):
            assert torch.equal(a, b)
    broken = list(args)
    broken[1 if op != "row_group_quantize" else 2] = 3  # bits=3 (the first's, the third's)
    if op == "group_dequantize":
        broken = [PACKED, LO, STEP, 3, 64, X.numel(), torch.float32]
    with pytest.raises((ValueError, RuntimeError), match=r"\bbits\b"):
        call(tuple(broken), impl="kernel", checked=False)
