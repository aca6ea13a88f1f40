"""memsave's functional layers against stock PyTorch, bit for bit, and what they save.

Every layer configuration x every requires_grad pattern of (input, weight, bias) x train/eval
x fp32/fp16/bf16 x (random values, special values: NaN, +-Inf, 0, thresholds): the output,
every requested gradient (bits, NaN positions and strides) and the running buffers equal
stock's, and the saved bytes (unique storages seen by ``saved_tensors_hooks``, parameters and
buffers excluded) are at most stock's, and strictly less where the plan's table says so.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchstash.testing.bits import assert_bits_equal
from torchstash_memsave import functional as MF
from torchstash_memsave.functional import _standin

Pattern = tuple[bool, bool, bool]  # requires_grad of (input, weight, bias)
Less = Callable[[Pattern, bool, torch.dtype], bool]  # (pattern, training, dtype) -> strictly less

# stock warns (once per process) that 'same' with an even kernel pads a copy of the input
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# -- what memsave runs in place of each stock module ------------------------------------------


def memsave_forward(m: nn.Module, x: torch.Tensor) -> Any:
    """The functional call a memsave module makes, from the stock module's state."""
    a: Any = m
    if isinstance(m, nn.modules.conv._ConvNd):
        geometry = {k: getattr(a, k) for k in ("stride", "padding", "dilation", "groups")}
        if isinstance(m, nn.modules.conv._ConvTransposeNd):
            geometry.update(transposed=True, output_padding=a.output_padding)
        else:
            geometry.update(padding_mode=a.padding_mode)
        return MF.conv(x, a.weight, a.bias, **geometry)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        a._check_input_dim(x)
        return MF.module_batch_norm(
            x,
            weight=a.weight,
            bias=a.bias,
            running_mean=a.running_mean,
            running_var=a.running_var,
            num_batches_tracked=a.num_batches_tracked,
            training=a.training,
            track_running_stats=a.track_running_stats,
            momentum=a.momentum,
            eps=a.eps,
        )
    if isinstance(m, nn.LayerNorm):
        return MF.layer_norm(x, a.normalized_shape, a.weight, a.bias, a.eps)
    if isinstance(m, nn.GroupNorm):
        return MF.group_norm(x, a.num_groups, a.weight, a.bias, a.eps)
    if isinstance(m, nn.RMSNorm):
        return MF.rms_norm(x, a.normalized_shape, a.weight, a.eps)
    if isinstance(m, nn.ReLU):
        return MF.relu(x, a.inplace)
    if isinstance(m, nn.ReLU6):
        return MF.relu6(x, a.inplace)
    if isinstance(m, nn.Hardtanh):
        return MF.hardtanh(x, a.min_val, a.max_val, a.inplace)
    if isinstance(m, nn.LeakyReLU):
        return MF.leaky_relu(x, a.negative_slope, a.inplace)
    if isinstance(m, nn.AlphaDropout):
        return MF.alpha_dropout(x, a.p, a.training, a.inplace)
    if isinstance(m, nn.Dropout):
        return MF.dropout(x, a.p, a.training, a.inplace)
    if isinstance(m, nn.modules.pooling._MaxPoolNd):
        fn = {nn.MaxPool1d: MF.max_pool1d, nn.MaxPool2d: MF.max_pool2d}.get(type(m), MF.max_pool3d)
        return fn(x, a.kernel_size, a.stride, a.padding, a.dilation, a.ceil_mode, a.return_indices)
    if isinstance(m, nn.AvgPool1d):
        return MF.avg_pool1d(
            x, a.kernel_size, a.stride, a.padding, a.ceil_mode, a.count_include_pad
        )
    if isinstance(m, (nn.AvgPool2d, nn.AvgPool3d)):
        fn = MF.avg_pool2d if isinstance(m, nn.AvgPool2d) else MF.avg_pool3d
        args = (a.kernel_size, a.stride, a.padding, a.ceil_mode, a.count_include_pad)
        return fn(x, *args, a.divisor_override)
    if isinstance(m, nn.modules.pooling._AdaptiveAvgPoolNd):
        fn = {
            nn.AdaptiveAvgPool1d: MF.adaptive_avg_pool1d,
            nn.AdaptiveAvgPool2d: MF.adaptive_avg_pool2d,
        }
        return fn.get(type(m), MF.adaptive_avg_pool3d)(x, a.output_size)
    raise TypeError(type(m))


# -- where memsave must save strictly less than stock (plan, section 3.1 and 4) ----------------

ALWAYS: Less = lambda pat, training, dtype: True
NEVER: Less = lambda pat, training, dtype: False
NO_WEIGHT_GRAD: Less = lambda pat, training, dtype: not pat[1]  # conv: the input is dead weight
PADDED: Less = lambda pat, training, dtype: not pat[1] or pat[0]  # reflect/replicate keep x too
BIAS_ONLY: Less = lambda pat, training, dtype: pat == (False, False, True)
BN: Less = lambda pat, training, dtype: not pat[1] if not training else pat == (False, False, True)
BN_NO_AFFINE: Less = lambda pat, training, dtype: not training
RMS: Less = lambda pat, training, dtype: pat[0] or dtype != torch.float32
TRAINING: Less = lambda pat, training, dtype: training


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    less: Less
    channels_last: bool = False
    # stock's CPU kernel crashes without an input gradient (GroupNorm channels_last, torch
    # 2.13): compare the weight and bias gradients with stock's when it also computes that one
    stock_needs_input_grad: bool = False


CASES: dict[str, Case] = {
    # convolution
    "conv1d": Case(lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 4, 16), NO_WEIGHT_GRAD),
    "conv2d": Case(lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 8, 8), NO_WEIGHT_GRAD),
    "conv2d-s2-d2-g2": Case(
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2),
        (2, 4, 9, 9),
        NO_WEIGHT_GRAD,
    ),
    "conv2d-nobias": Case(
        lambda: nn.Conv2d(4, 6, (3, 2), bias=False), (2, 4, 8, 8), NO_WEIGHT_GRAD
    ),
    "conv2d-unbatched": Case(lambda: nn.Conv2d(4, 6, 3, padding=1), (4, 8, 8), NO_WEIGHT_GRAD),
    "conv2d-channels_last": Case(
        lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 8, 8), NO_WEIGHT_GRAD, channels_last=True
    ),
    "conv3d": Case(lambda: nn.Conv3d(4, 6, 3, padding=(1, 0, 1)), (2, 4, 4, 6, 6), NO_WEIGHT_GRAD),
    "conv2d-reflect": Case(
        lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"), (2, 4, 8, 8), PADDED
    ),
    "conv2d-replicate": Case(
        lambda: nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode="replicate"), (2, 4, 8, 8), PADDED
    ),
    "conv2d-reflect-channels_last": Case(
        lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"),
        (2, 4, 8, 8),
        PADDED,
        channels_last=True,
    ),
    "conv2d-circular": Case(
        lambda: nn.Conv2d(4, 6, 3, padding=2, padding_mode="circular"), (2, 4, 8, 8), NO_WEIGHT_GRAD
    ),
    "conv1d-reflect-same-k4": Case(
        lambda: nn.Conv1d(4, 6, 4, padding="same", padding_mode="reflect"), (2, 4, 16), PADDED
    ),
    "conv3d-replicate": Case(
        lambda: nn.Conv3d(4, 6, 3, padding=1, padding_mode="replicate"), (2, 4, 4, 5, 5), PADDED
    ),
    "conv2d-same-k4": Case(
        lambda: nn.Conv2d(4, 6, 4, padding="same"), (2, 4, 8, 8), NO_WEIGHT_GRAD
    ),
    "conv2d-same-k3-d2": Case(
        lambda: nn.Conv2d(4, 6, 3, padding="same", dilation=2), (2, 4, 8, 8), NO_WEIGHT_GRAD
    ),
    "conv2d-valid": Case(lambda: nn.Conv2d(4, 6, 3, padding="valid"), (2, 4, 8, 8), NO_WEIGHT_GRAD),
    "convT1d": Case(lambda: nn.ConvTranspose1d(4, 6, 3, stride=2), (2, 4, 8), NO_WEIGHT_GRAD),
    "convT2d-s2-op1-g2-d2": Case(
        lambda: nn.ConvTranspose2d(
            4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2
        ),
        (2, 4, 5, 5),
        NO_WEIGHT_GRAD,
    ),
    "convT2d-channels_last": Case(
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2),
        (2, 4, 5, 5),
        NO_WEIGHT_GRAD,
        channels_last=True,
    ),
    "convT3d": Case(lambda: nn.ConvTranspose3d(4, 6, 2, stride=2), (2, 4, 3, 3, 3), NO_WEIGHT_GRAD),
    # normalization
    "bn2d": Case(lambda: nn.BatchNorm2d(6), (4, 6, 5, 5), BN),
    "bn2d-momentum-None": Case(lambda: nn.BatchNorm2d(6, momentum=None), (4, 6, 5, 5), BN),
    "bn2d-affine-False": Case(lambda: nn.BatchNorm2d(6, affine=False), (4, 6, 5, 5), BN_NO_AFFINE),
    "bn2d-trs-False": Case(
        lambda: nn.BatchNorm2d(6, track_running_stats=False), (4, 6, 5, 5), BIAS_ONLY
    ),
    "bn2d-channels_last": Case(lambda: nn.BatchNorm2d(6), (4, 6, 5, 5), BN, channels_last=True),
    "bn1d-3d-input": Case(lambda: nn.BatchNorm1d(6), (4, 6, 10), BN),
    "bn1d-2d-input": Case(lambda: nn.BatchNorm1d(6), (16, 6), BN),
    "bn3d": Case(lambda: nn.BatchNorm3d(6), (2, 6, 3, 4, 4), BN),
    "ln": Case(lambda: nn.LayerNorm(8), (4, 6, 8), BIAS_ONLY),
    "ln-2d-shape": Case(lambda: nn.LayerNorm((6, 8)), (4, 6, 8), BIAS_ONLY),
    "ln-bias-False": Case(lambda: nn.LayerNorm(8, bias=False), (4, 6, 8), BIAS_ONLY),
    "ln-affine-False": Case(lambda: nn.LayerNorm(8, elementwise_affine=False), (4, 6, 8), NEVER),
    "gn": Case(lambda: nn.GroupNorm(2, 6), (4, 6, 5, 5), BIAS_ONLY),
    "gn-3d-input": Case(lambda: nn.GroupNorm(3, 6), (4, 6, 10), BIAS_ONLY),
    "gn-affine-False": Case(lambda: nn.GroupNorm(2, 6, affine=False), (4, 6, 5, 5), NEVER),
    "gn-channels_last": Case(
        lambda: nn.GroupNorm(2, 6),
        (4, 6, 5, 5),
        BIAS_ONLY,
        channels_last=True,
        stock_needs_input_grad=True,
    ),
    "rms": Case(lambda: nn.RMSNorm(8), (4, 6, 8), RMS),
    "rms-2d-shape-eps": Case(lambda: nn.RMSNorm((6, 8), eps=1e-3), (4, 6, 8), RMS),
    "rms-affine-False": Case(lambda: nn.RMSNorm(8, elementwise_affine=False), (4, 6, 8), RMS),
    # activations
    "relu": Case(nn.ReLU, (4, 6, 8, 8), ALWAYS),
    "relu-channels_last": Case(nn.ReLU, (4, 6, 8, 8), ALWAYS, channels_last=True),
    "relu-inplace": Case(lambda: nn.ReLU(inplace=True), (4, 6, 8, 8), ALWAYS),
    "relu-inplace-channels_last": Case(
        lambda: nn.ReLU(inplace=True), (4, 6, 8, 8), ALWAYS, channels_last=True
    ),
    "leaky_relu": Case(lambda: nn.LeakyReLU(0.1), (4, 6, 8, 8), ALWAYS),
    "leaky_relu-negative-slope": Case(lambda: nn.LeakyReLU(-0.2), (4, 6, 8, 8), ALWAYS),
    "leaky_relu-inplace": Case(lambda: nn.LeakyReLU(0.1, inplace=True), (4, 6, 8, 8), ALWAYS),
    "relu6": Case(nn.ReLU6, (4, 6, 8, 8), ALWAYS),
    "relu6-inplace": Case(lambda: nn.ReLU6(inplace=True), (4, 6, 8, 8), ALWAYS),
    "hardtanh": Case(nn.Hardtanh, (4, 6, 8, 8), ALWAYS),
    "hardtanh-odd-bounds": Case(lambda: nn.Hardtanh(-0.3, 0.7), (4, 6, 8, 8), ALWAYS),
    # NaN in the CPU kernel's scalar tail (its vectorized loop answers differently)
    "hardtanh-odd-numel": Case(nn.Hardtanh, (3, 5, 7), ALWAYS),
    "relu6-inplace-odd-numel": Case(lambda: nn.ReLU6(inplace=True), (3, 5, 7), ALWAYS),
    "hardtanh-inplace-channels_last": Case(
        lambda: nn.Hardtanh(-0.3, 0.7, inplace=True), (4, 6, 8, 8), ALWAYS, channels_last=True
    ),
    # dropout
    "dropout": Case(lambda: nn.Dropout(0.3), (4, 6, 8, 8), TRAINING),
    "dropout-channels_last": Case(
        lambda: nn.Dropout(0.3), (4, 6, 8, 8), TRAINING, channels_last=True
    ),
    "dropout-inplace": Case(lambda: nn.Dropout(0.5, inplace=True), (4, 6, 8, 8), TRAINING),
    "dropout-p0": Case(lambda: nn.Dropout(0.0), (4, 6, 8, 8), NEVER),
    "dropout-p1": Case(lambda: nn.Dropout(1.0), (4, 6, 8, 8), NEVER),
    "dropout-empty": Case(lambda: nn.Dropout(0.3), (0, 6, 8), NEVER),
    "alpha_dropout": Case(lambda: nn.AlphaDropout(0.2), (4, 6, 8, 8), TRAINING),
    "alpha_dropout-inplace": Case(
        lambda: nn.AlphaDropout(0.2, inplace=True), (4, 6, 8, 8), TRAINING
    ),
    # pooling
    "maxpool1d": Case(lambda: nn.MaxPool1d(3, 2, 1), (4, 6, 16), ALWAYS),
    "maxpool1d-unbatched-indices": Case(
        lambda: nn.MaxPool1d(2, return_indices=True), (6, 16), ALWAYS
    ),
    "maxpool2d": Case(lambda: nn.MaxPool2d(2), (4, 6, 8, 8), ALWAYS),
    "maxpool2d-k1": Case(lambda: nn.MaxPool2d(1, 2), (4, 6, 8, 8), ALWAYS),
    "maxpool2d-3-2-1-ceil": Case(
        lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), (4, 6, 9, 9), ALWAYS
    ),
    "maxpool2d-dilation": Case(
        lambda: nn.MaxPool2d((3, 2), 1, 1, dilation=2), (4, 6, 9, 9), ALWAYS
    ),
    "maxpool2d-channels_last": Case(
        lambda: nn.MaxPool2d(3, 2, 1), (4, 6, 9, 9), ALWAYS, channels_last=True
    ),
    "maxpool2d-indices": Case(lambda: nn.MaxPool2d(2, return_indices=True), (4, 6, 8, 8), ALWAYS),
    "maxpool2d-unbatched": Case(lambda: nn.MaxPool2d(2), (6, 8, 8), ALWAYS),
    "maxpool2d-window-289": Case(lambda: nn.MaxPool2d(17, 3), (1, 2, 20, 20), ALWAYS),
    "maxpool3d": Case(lambda: nn.MaxPool3d(2), (2, 6, 4, 4, 4), ALWAYS),
    "maxpool3d-3-2-1-ceil-d": Case(
        lambda: nn.MaxPool3d(3, 2, 1, dilation=(1, 1, 2), ceil_mode=True), (2, 6, 5, 5, 7), ALWAYS
    ),
    "maxpool3d-channels_last": Case(
        lambda: nn.MaxPool3d(2), (2, 6, 4, 4, 4), ALWAYS, channels_last=True
    ),
    "avgpool1d": Case(lambda: nn.AvgPool1d(3, 2, 1), (4, 6, 16), ALWAYS),
    "avgpool2d-ceil-nopad": Case(
        lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (4, 6, 9, 9), ALWAYS
    ),
    "avgpool2d-divisor": Case(lambda: nn.AvgPool2d(2, divisor_override=3), (4, 6, 8, 8), ALWAYS),
    "avgpool2d-channels_last": Case(
        lambda: nn.AvgPool2d(3, 2, 1), (4, 6, 9, 9), ALWAYS, channels_last=True
    ),
    "avgpool3d": Case(lambda: nn.AvgPool3d(2, 1), (2, 6, 4, 4, 4), ALWAYS),
    "adaptive1d": Case(lambda: nn.AdaptiveAvgPool1d(5), (4, 6, 16), ALWAYS),
    "adaptive1d-1": Case(lambda: nn.AdaptiveAvgPool1d(1), (4, 6, 16), NEVER),
    "adaptive2d": Case(lambda: nn.AdaptiveAvgPool2d(3), (4, 6, 8, 8), ALWAYS),
    "adaptive2d-None-5": Case(lambda: nn.AdaptiveAvgPool2d((None, 5)), (4, 6, 8, 8), ALWAYS),
    "adaptive2d-1": Case(lambda: nn.AdaptiveAvgPool2d(1), (4, 6, 8, 8), NEVER),
    "adaptive2d-channels_last": Case(
        lambda: nn.AdaptiveAvgPool2d(3), (4, 6, 8, 8), ALWAYS, channels_last=True
    ),
    "adaptive3d": Case(lambda: nn.AdaptiveAvgPool3d((2, 3, 3)), (2, 6, 4, 5, 5), ALWAYS),
    "adaptive3d-1": Case(lambda: nn.AdaptiveAvgPool3d(1), (2, 6, 4, 5, 5), NEVER),
}


def _patterns(case: Case) -> Iterable[Pattern]:
    params = dict(case.build().named_parameters())
    ws = (True, False) if "weight" in params else (False,)
    bs = (True, False) if "bias" in params else (False,)
    for pat in itertools.product((True, False), ws, bs):
        if any(pat):
            yield pat


def _tag(pat: Pattern) -> str:
    return "".join("T" if p else "-" for p in pat)


PARAMS = [
    pytest.param(name, pat, id=f"{name}-{_tag(pat)}")
    for name, case in CASES.items()
    for pat in _patterns(case)
]


# -- harness ----------------------------------------------------------------------------------


def assert_same(got: Any, want: Any) -> None:
    """Bits (NaN positions for NaNs) and strides equal, through tuples."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
        return
    assert_bits_equal(got, want)
    assert got.stride() == want.stride(), f"strides {got.stride()} != {want.stride()}"


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor]) -> tuple[Any, int]:
    """(fn(), bytes of the unique storages autograd saved that are not in ``exclude``)."""
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude if t.numel()}
    seen: set[int] = set()
    total = 0
    for t in held:
        if t.numel() == 0 or isinstance(t, nn.Parameter):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in skip or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return out, total


def special_values(x: torch.Tensor) -> torch.Tensor:
    """NaN, +-Inf, exact zeros (both signs) and values on and next to the activations' bounds."""
    flat = x.view(-1)
    for start, step, value in (
        (0, 7, 0.0),
        (1, 11, float("nan")),
        (2, 13, float("inf")),
        (3, 17, -float("inf")),
        (4, 19, 6.0),
        (5, 23, -1.0),
        (6, 29, 1.0),
        (7, 31, 0.7),
        (8, 37, -0.3),
        (9, 41, 0.69921875),
        (10, 43, -0.0),
    ):
        flat[start::step] = value
    return x


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def run(
    m: nn.Module,
    x: torch.Tensor,
    pat: Pattern,
    fn: Callable[[nn.Module, torch.Tensor], Any],
    grad_like_output: bool = False,
) -> tuple[Any, list[torch.Tensor], int]:
    """(output, requested gradients, saved bytes) of ``fn(m, x * 1)`` with grads as ``pat``.

    The incoming gradient is contiguous, or laid out like the output (``grad_like_output``).
    """
    params = dict(m.named_parameters())
    for name, need in (("weight", pat[1]), ("bias", pat[2])):
        if name in params:
            params[name].requires_grad_(need)
    xr = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(pat[0])
    exclude = [*m.parameters(), *m.buffers()]
    torch.manual_seed(1234)
    out, nbytes = saved_bytes(lambda: fn(m, xr * 1), exclude)
    wanted = [
        t
        for t, need in ((xr, pat[0]), (params.get("weight"), pat[1]), (params.get("bias"), pat[2]))
        if need and t is not None
    ]
    y = _first(out)
    torch.manual_seed(99)
    g = torch.randn(y.shape, dtype=y.dtype).to(y.device)
    if grad_like_output:
        g = torch.empty_like(y).copy_(g)
    grads = list(torch.autograd.grad(y, wanted, g)) if y.requires_grad else []
    return out, grads, nbytes


@pytest.mark.parametrize("values", ["random", "special"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("name", "pat"), PARAMS)
def test_layer_matches_stock(
    name: str, pat: Pattern, training: bool, dtype: str, values: str
) -> None:
    case = CASES[name]
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    stock = case.build().to(dt).train(training)
    if isinstance(stock, nn.modules.batchnorm._BatchNorm) and stock.running_mean is not None:
        assert stock.running_var is not None
        stock.running_mean.normal_()  # non-trivial running statistics
        stock.running_var.uniform_(0.5, 2.0)
    ours = copy.deepcopy(stock)
    x = torch.randn(case.shape, dtype=dt)
    if values == "special":
        special_values(x)
    if case.channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)

    like = case.channels_last and values == "special"  # a channels_last incoming gradient too
    forced = case.stock_needs_input_grad and not pat[0]
    stock_pat = (True, pat[1], pat[2]) if forced else pat
    try:
        want, want_grads, stock_bytes = run(stock, x, stock_pat, lambda m, t: m(t), like)
    except RuntimeError as err:
        if "not implemented for" not in str(err):
            raise
        with pytest.raises(type(err), match="not implemented for"):  # ours refuses it too
            run(ours, x, pat, memsave_forward)
        pytest.skip(f"stock CPU has no {dtype} kernel: {err}")
    got, got_grads, our_bytes = run(ours, x, pat, memsave_forward, like)
    if forced:
        want_grads = want_grads[1:]  # stock's input gradient was only asked for to run

    assert_same(got, want)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads):
        assert_same(g, w)
    for b_got, b_want in zip(ours.buffers(), stock.buffers()):
        assert_bits_equal(b_got, b_want)
    assert our_bytes <= stock_bytes
    if case.less(pat, training, dt):
        assert our_bytes < stock_bytes
    else:
        assert our_bytes == stock_bytes


# -- the functional API beyond the modules ------------------------------------------------------


def _grads(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    torch.manual_seed(5)
    return (out, *torch.autograd.grad(out, leaves, torch.randn_like(out)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stride": (2, 1), "padding": (1, 0)},
        {"stride": [2], "padding": [1], "dilation": [2]},
        {"padding": "valid"},
        {"padding": "same", "dilation": (1, 2)},
        {"groups": 2},
    ],
    ids=["tuples", "one-element-lists", "valid", "same-dilated", "groups"],
)
def test_conv_matches_torch_functional(kwargs: dict[str, Any]) -> None:
    x, w, b = (
        torch.randn(2, 4, 7, 7),
        torch.randn(6, 4 // kwargs.get("groups", 1), 3, 2),
        torch.randn(6),
    )
    got = _grads(lambda x, w, b: MF.conv(x, w, b, **kwargs), x, w, b)
    want = _grads(lambda x, w, b: F.conv2d(x, w, b, **kwargs), x, w, b)
    for g, t in zip(got, want):
        assert_same(g, t)


def test_conv_transpose_matches_torch_functional() -> None:
    x, w = torch.randn(2, 4, 5), torch.randn(4, 3, 3)
    kw = {"stride": 3, "padding": 1, "output_padding": 2, "dilation": 1}
    got = _grads(lambda x, w: MF.conv(x, w, transposed=True, **kw), x, w)
    want = _grads(lambda x, w: F.conv_transpose1d(x, w, None, **kw), x, w)
    for g, t in zip(got, want):
        assert_same(g, t)


def test_conv_bad_arguments() -> None:
    x, w = torch.randn(1, 2, 6, 6, requires_grad=True), torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match="strided"):
        MF.conv(x, w, padding="same", stride=2)
    with pytest.raises(ValueError, match="padding_mode"):
        MF.conv(x, w, padding_mode="mirror")
    with pytest.raises(ValueError, match="zeros"):
        MF.conv(x, w, transposed=True, padding_mode="reflect")
    with pytest.raises(ValueError, match="not supported for ConvTranspose"):
        MF.conv(x, w, transposed=True, padding="same")
    with pytest.raises(ValueError, match="Invalid padding string"):
        MF.conv(x, w, padding="full")
    with pytest.raises(RuntimeError, match="Expected 3D"):
        MF.conv(x[0, 0], w)


def test_nothing_to_record_calls_stock() -> None:
    """Under no_grad (or with nothing trainable) the stock op runs, running stats included."""
    bn = nn.BatchNorm2d(3).train()
    ref = copy.deepcopy(bn)
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    with torch.no_grad():
        got = MF.module_batch_norm(
            x,
            weight=bn.weight,
            bias=bn.bias,
            running_mean=bn.running_mean,
            running_var=bn.running_var,
            num_batches_tracked=bn.num_batches_tracked,
            training=True,
            track_running_stats=True,
            momentum=bn.momentum,
            eps=bn.eps,
        )
        want = ref(x)
        assert_same(MF.relu(x), F.relu(x))
        assert_same(
            MF.max_pool2d(x, 2, return_indices=True), F.max_pool2d(x, 2, return_indices=True)
        )
    assert_same(got, want)
    for a, b in zip(bn.buffers(), ref.buffers()):
        assert torch.equal(a, b)
    frozen = torch.randn(4, 3, 5, 5)
    assert MF.relu(frozen).grad_fn is None


@pytest.mark.parametrize("name", list(CASES))
def test_without_a_graph_stock_runs(name: str) -> None:
    """Under no_grad every wrapper calls stock unchanged: same outputs and running buffers."""
    case = CASES[name]
    stock = case.build().train()
    ours = copy.deepcopy(stock)
    x = torch.randn(case.shape, requires_grad=True)
    if case.channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    with torch.no_grad():
        torch.manual_seed(3)
        want = stock(x * 1)
        torch.manual_seed(3)
        got = memsave_forward(ours, x * 1)
    assert_same(got, want)
    for b_got, b_want in zip(ours.buffers(), stock.buffers()):
        assert_bits_equal(b_got, b_want)


@pytest.mark.parametrize(
    ("stock_fn", "memsave_fn"),
    [
        (lambda t: F.relu(t, inplace=True), lambda t: MF.relu(t, inplace=True)),
        (lambda t: F.dropout(t, 0.4, True, True), lambda t: MF.dropout(t, 0.4, True, True)),
        (lambda t: F.hardtanh(t, -0.5, 0.5, True), lambda t: MF.hardtanh(t, -0.5, 0.5, True)),
    ],
    ids=["relu", "dropout", "hardtanh"],
)
def test_inplace_on_a_view_as_stock(
    stock_fn: Callable[[torch.Tensor], torch.Tensor],
    memsave_fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """In place on a view of a non-leaf: autograd rebases the base's history, as for stock."""

    def run_view(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()
        base = x * 1
        torch.manual_seed(8)
        fn(base[:, 1:4])
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        return (base, *torch.autograd.grad(base, x, g))

    for got, want in zip(run_view(memsave_fn), run_view(stock_fn)):
        assert_same(got, want)


def test_double_backward_refused() -> None:
    """Stand-ins are not differentiable: create_graph=True must fail loudly, not silently.
    Where the weight trains, stock's op runs (nothing to spare), and so does its double
    backward."""
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = nn.Parameter(torch.randn(4, 3, 3, 3), requires_grad=False)
    (gx,) = torch.autograd.grad(MF.conv(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()
    w.requires_grad_()
    (gx,) = torch.autograd.grad(MF.conv(x, w).pow(2).sum(), x, create_graph=True)
    gx.sum().backward()
    assert w.grad is not None


def test_inplace_on_leaf_raises_before_modifying() -> None:
    x = torch.randn(8, requires_grad=True)
    before = x.detach().clone()
    for fn in (
        lambda: MF.relu(x, inplace=True),
        lambda: MF.hardtanh(x, inplace=True),
        lambda: MF.dropout(x, 0.5, True, inplace=True),
        lambda: MF.relu(x[2:], inplace=True),
    ):
        with pytest.raises(RuntimeError, match="leaf Variable"):
            fn()
    assert torch.equal(x.detach(), before)


def test_leaky_relu_inplace_negative_slope_computes_the_gradient() -> None:
    """Stock refuses this backward; memsave's mask (taken before the op) gives stock's
    out-of-place gradient."""
    x = torch.randn(64)
    got = _grads(lambda t: MF.leaky_relu(t * 1, -0.5, inplace=True), x)
    want = _grads(lambda t: F.leaky_relu(t, -0.5), x)
    for g, t in zip(got, want):
        assert_same(g, t)


def test_dropout_edge_cases_as_stock() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    assert MF.dropout(x, 0.0) is x
    assert MF.dropout(x, 0.7, training=False) is x
    assert MF.alpha_dropout(x, 0.7) is x  # F.alpha_dropout's training defaults to False
    with pytest.raises(ValueError, match="between 0 and 1"):
        MF.dropout(x, 1.5)


def test_batch_norm_checks_as_stock() -> None:
    w = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        MF.batch_norm(torch.randn(1, 3, requires_grad=True), None, None, w, None, training=True)
    empty = torch.randn(0, 3, 4, requires_grad=True)
    assert_same(
        MF.batch_norm(empty, None, None, w, None, True),
        F.batch_norm(empty, None, None, w, None, True),
    )


def test_group_norm_checks() -> None:
    x = torch.randn(2, 6, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        MF.group_norm(x, 4)
    with pytest.raises(RuntimeError, match="weight to be a vector"):
        MF.group_norm(x, 3, torch.ones(5))


def test_computed_weights_are_not_kept_without_an_input_gradient() -> None:
    """A non-leaf weight (e.g. a parametrization) is saved only for the input gradient."""
    x = torch.randn(2, 4, 8, 8)
    base = nn.Parameter(torch.randn(6, 4, 3, 3))
    _, with_x = saved_bytes(lambda: MF.conv(x.requires_grad_(), base * 2), [base])
    _, without_x = saved_bytes(lambda: MF.conv(x.detach(), base * 2), [base])
    assert with_x == 6 * 4 * 3 * 3 * 4 + x.numel() * 4  # the weight and the input
    assert without_x == x.numel() * 4  # the input only (for the weight gradient)
    got = _grads(lambda t: MF.conv(x, t * 2), base.detach())
    want = _grads(lambda t: F.conv2d(x, t * 2), base.detach())
    for g, t in zip(got, want):
        assert_same(g, t)


@pytest.mark.parametrize(
    ("ours", "stock", "shape", "args"),
    [
        (MF.max_pool2d, F.max_pool2d, (2, 3, 7, 6), ((3, 2), (), (1, 0), 1, True, True)),
        (MF.max_pool1d, F.max_pool1d, (2, 3, 9), ([3], None, [1], [2], False, True)),
        (MF.max_pool3d, F.max_pool3d, (1, 2, 5, 5, 5), (2, None, 0, 1, True, True)),
        (MF.avg_pool1d, F.avg_pool1d, (2, 3, 9), (3, None, 1, True, False)),
        (MF.avg_pool3d, F.avg_pool3d, (1, 2, 5, 5, 5), ((2, 3, 2), (1, 2, 1), 1, True)),
    ],
    ids=["max2d", "max1d", "max3d", "avg1d", "avg3d"],
)
def test_pool_arguments_as_torch_functional(
    ours: Callable[..., Any],
    stock: Callable[..., Any],
    shape: tuple[int, ...],
    args: tuple[Any, ...],
) -> None:
    x = torch.randn(shape)
    got = _grads(lambda t: _first(ours(t, *args)), x)
    want = _grads(lambda t: _first(stock(t, *args)), x)
    for g, w in zip(got, want):
        assert_same(g, w)
    xr = x.requires_grad_()
    if isinstance(want := stock(xr, *args), tuple):  # the indices too
        assert_same(ours(xr, *args), want)


def test_adaptive_pool_output_sizes() -> None:
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    with pytest.raises(ValueError, match="at least 3"):
        MF.adaptive_avg_pool2d(x[0, 0], (None, 2))
    for size in (4, (4, None), (None, None)):
        assert_same(MF.adaptive_avg_pool2d(x, size), F.adaptive_avg_pool2d(x, size))


# -- helpers of _standin ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 5, 4, 2),
        lambda: torch.randn(3, 5, 4, 2).to(memory_format=torch.channels_last),
        lambda: torch.randn(5, 7).t(),
        lambda: torch.randn(2, 6, 4)[:, ::2],  # not dense: packed from a contiguous copy
        lambda: torch.randn(()),
        lambda: torch.randn(0, 3),
    ],
    ids=["contiguous", "channels_last", "transposed", "strided", "scalar", "empty"],
)
def test_masks_round_trip_in_memory_order(make: Callable[[], torch.Tensor]) -> None:
    keep = make() > 0
    bits, inverse = _standin.pack_keep_mask(keep)
    assert bits.numel() == (keep.numel() + 7) // 8
    back = _standin.unpack_keep_mask(bits, tuple(keep.shape), inverse)
    assert torch.equal(back, keep)
    if (
        keep.is_contiguous()
        or keep.is_contiguous(memory_format=torch.channels_last)
        or keep.dim() == 2
    ):
        assert back.stride() == keep.stride()
    codes = (make().abs() * 3).to(torch.uint8) % 4
    packed, inverse = _standin.pack_codes(codes, 2)
    assert torch.equal(_standin.unpack_codes(packed, 2, tuple(codes.shape), inverse), codes)


def test_standins_keep_the_layout() -> None:
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    layout = _standin.Layout.of(x)
    assert not layout.is_contiguous()
    s = _standin.standin(layout, sizes_only=True)
    assert s.stride() == x.stride() and s.dtype == x.dtype
    assert _standin.standin(layout, grad=x) is x
    flat = _standin.Layout.of(torch.randn(2, 3, 4, 5))
    assert _standin.standin(flat, sizes_only=True).stride() == (0, 0, 0, 0)
    assert _standin.suggest_memory_format(x) == torch.channels_last
    assert (
        _standin.suggest_memory_format(
            torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
        )
        == torch.channels_last_3d
    )
    assert _standin.suggest_memory_format(torch.randn(2, 3, 4, 5)) == torch.contiguous_format
    assert _standin.suggest_memory_format(torch.randn(2, 1, 1, 1)) == torch.contiguous_format


# -- CUDA (the cuDNN/fused code paths; tolerances where cuDNN picks its own reduction order) ----


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name",
    [
        "conv2d",
        "conv2d-reflect",
        "bn2d",
        "bn2d-channels_last",
        "gn",
        "ln",
        "rms",
        "relu",
        "hardtanh-odd-bounds",
        "relu6-inplace-odd-numel",
        "dropout",
        "alpha_dropout",
        "maxpool2d",
        "avgpool2d-ceil-nopad",
        "adaptive2d",
    ],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_cuda_matches_stock(name: str, training: bool) -> None:
    case = CASES[name]
    stock = case.build().cuda().train(training)
    ours = copy.deepcopy(stock)
    x = special_values(torch.randn(case.shape)).cuda()
    if case.channels_last:
        x = x.to(memory_format=torch.channels_last)
    for pat in _patterns(case):
        want, want_grads, stock_bytes = run(stock, x, pat, lambda m, t: m(t))
        got, got_grads, our_bytes = run(ours, x, pat, memsave_forward)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)
            assert g.stride() == w.stride()
        assert our_bytes <= stock_bytes
    for b_got, b_want in zip(ours.buffers(), stock.buffers()):
        torch.testing.assert_close(b_got, b_want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("nd", [1, 2])
def test_a_pool_without_indices_on_cpu_float32_pools_and_codes_in_one_pass(nd: int) -> None:
    """The pool the CPU's models take (contiguous float32, no indices asked for) runs as one
    kernel pass each way (``MaxPoolCodeFunction``), stock's output and gradient bit for bit,
    keeping the same positions' code; indices asked for, or channels_last, take ATen's pool."""
    shape = (4, 6, 17) if nd == 1 else (4, 6, 9, 9)
    pool, stock = (MF.max_pool1d, F.max_pool1d) if nd == 1 else (MF.max_pool2d, F.max_pool2d)
    x = torch.randn(shape).requires_grad_()
    xs = x.detach().clone().requires_grad_()
    out = pool(x, 3, 2, 1)
    node = out.grad_fn if nd == 2 else out.grad_fn.next_functions[0][0]  # 1-d: a squeezed 2-d pool
    assert type(node).__name__ == "MaxPoolCodeFunctionBackward"
    (packed,) = node.saved_tensors
    bits = 4 if nd == 2 else 2  # a 3x3 window's 9 positions; a 1x3 one's 3
    assert packed.dtype == torch.uint8 and packed.numel() == (out.numel() * bits + 7) // 8
    ref = stock(xs, 3, 2, 1)
    assert_bits_equal(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    assert_bits_equal(x.grad, xs.grad)
    with_indices = pool(x, 3, 2, 1, return_indices=True)[0]
    node = with_indices.grad_fn if nd == 2 else with_indices.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "MaxPoolFunctionBackward"
    if nd == 2:
        last = x.detach().to(memory_format=torch.channels_last).requires_grad_()
        assert type(pool(last, 3, 2, 1).grad_fn).__name__ == "MaxPoolFunctionBackward"
