"""Compiled kernels shared by every torchstash plug-in, with pure-PyTorch fallbacks.

``pack_bits``/``unpack_bits`` store small integer codes densely, ``philox_uniform``
draws reproducible random numbers, ``group_quantize``/``group_dequantize`` store floats
at 1-8 bits with per-group stochastic rounding, ``channel_minmax``/``channel_quantize``/
``channel_dequantize`` store them at 8 bits with a scale per channel (Mesa's layout;
``mesa_quantize``: its running range and codes in one call),
``fp8_quantize``/``fp8_dequantize`` as e4m3 codes with a scale per group, ``level_quantize``
rounds values stochastically to a table of a few levels (derivative codes; CPU kernel),
``row_center``/``row_uncenter`` take each row's offset off a normalization's input and put it
back (``row_group_quantize``/``row_group_dequantize``: fused with the group codes), ``sign_pack``/``sign_unpack`` keep where a tensor is above zero as one bit per element
(``sign_select``: a gradient kept where those bits are set, a ReLU's backward; CPU kernel),
``max_pool2d_code``/``max_pool2d_code_backward`` pool and keep each argmax as its position in
the window at 1-8 bits, and scatter the gradient back from it (memsave's MaxPool; CPU kernel),
``window_code``/``window_indices`` code a stock pool's indices so and back (CPU kernel),
``topk_mask``/``mask_compact``/``mask_scatter``/``mask_offsets``/``offsets_scatter`` keep the
``k`` largest magnitudes per segment as a 1-bit mask or 16-bit offsets plus values; each
runs a JIT-built C++/CUDA kernel when one is available (see ``status()``) and the
pure-PyTorch reference (``torchstash.kernels.reference`` and the ``*_reference`` modules) if not.
"""

from __future__ import annotations

from ._dispatch import Impl, kernels_in_graph
from .bitpack import (
    pack_bits,
    pack_mask,
    sign_pack,
    sign_select,
    sign_unpack,
    unpack_bits,
    unpack_mask,
)
from .channelquant import channel_dequantize, channel_minmax, channel_quantize, mesa_quantize
from .fp8 import fp8_dequantize, fp8_quantize
from .groupquant import group_dequantize, group_quantize, group_steps
from .levelquant import level_quantize
from .loader import available, load, status
from .maxpool import max_pool2d_code, max_pool2d_code_backward, window_code, window_indices
from .philox import philox_uniform
from .rowcenter import row_center, row_group_dequantize, row_group_quantize, row_uncenter
from .sparse import (
    OFFSET_BLOCK,
    mask_compact,
    mask_offsets,
    mask_scatter,
    offsets_scatter,
    topk_mask,
)

__all__ = [
    "OFFSET_BLOCK",
    "Impl",
    "available",
    "channel_dequantize",
    "channel_minmax",
    "channel_quantize",
    "fp8_dequantize",
    "fp8_quantize",
    "group_dequantize",
    "group_quantize",
    "group_steps",
    "kernels_in_graph",
    "level_quantize",
    "load",
    "mesa_quantize",
    "mask_compact",
    "max_pool2d_code",
    "max_pool2d_code_backward",
    "mask_offsets",
    "mask_scatter",
    "offsets_scatter",
    "pack_bits",
    "pack_mask",
    "philox_uniform",
    "row_center",
    "row_group_dequantize",
    "row_group_quantize",
    "row_uncenter",
    "sign_pack",
    "sign_select",
    "sign_unpack",
    "status",
    "topk_mask",
    "unpack_bits",
    "unpack_mask",
    "window_code",
    "window_indices",
]
