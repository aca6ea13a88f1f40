"""ActNN's ``config`` and ``set_optimization_level``, and the torchstash strategy they mean.

The fields are ActNN's, with its defaults (level L3: 2 bits on average, mixed). Each call of
``set_optimization_level`` starts from those defaults, so the level named is the level run
(ActNN changed only the level's own fields, and ``L2`` then ``L3`` ran 4-bit). What a field
means here: ``compress_activation`` (off: nothing quantized), ``activation_compression_bits``
(its first entry: the width, or the average budget where ``adaptive_conv_scheme`` is on),
``swap`` (payloads to host memory), ``enable_quantized_bn`` (off: BatchNorm inputs exact, as
ActNN's L1), ``training`` (``QModule.train``/``eval`` set it; off: layers run exact),
``group_size`` and ``seed``. The others are accepted and change nothing: they tuned ActNN's
CUDA kernels, allocator and debugging.
"""

from __future__ import annotations

from typing import Any

import torch

from torchstash.errors import OptionError

LEVELS = ("L0", "L1", "L2", "L3", "L3.1", "L4", "L5", "swap")


class QuantizationConfig:
    def __init__(self) -> None:
        self.level = "L3"
        self.compress_activation = True
        self.activation_compression_bits: list[int] = [2, 8, 8]
        self.pergroup = True
        self.perlayer = True
        self.initial_bits = 8
        self.stochastic = True
        self.training = True
        self.group_size = 256
        self.use_gradient = False
        self.adaptive_conv_scheme = True
        self.adaptive_bn_scheme = True
        self.simulate = False
        self.enable_quantized_bn = True
        self.empty_cache_threshold: float | None = None
        self.pipeline_threshold: int | None = None
        self.cudnn_benchmark_conv2d = True
        self.swap = False
        self.seed: int | None = None
        self.debug_memory_model = False
        self.debug_speed = False
        self.debug_memory_op_forward = False
        self.debug_memory_op_backward = False
        self.debug_remove_bn = False
        self.debug_remove_relu = False


config = QuantizationConfig()


def set_optimization_level(level: str) -> None:
    """ActNN's levels: L0 (nothing), L1 (4-bit conv and linear inputs), L2 (4-bit), L3 (2
    bits on average, mixed; L3.1 the same), L4 (L3, swapped to host memory), L5 (L4 with the
    CUDA allocator's expandable segments), ``swap`` (swapped, not quantized)."""
    if level not in LEVELS:
        raise OptionError(f"unknown ActNN level {level!r}; use one of {', '.join(LEVELS)}")
    training, seed = config.training, config.seed
    config.__init__()  # type: ignore[misc]
    config.level, config.training, config.seed = level, training, seed
    if level == "L0":
        config.compress_activation = False
        config.adaptive_conv_scheme = config.adaptive_bn_scheme = False
    elif level in ("L1", "L2"):
        config.activation_compression_bits = [4]
        config.adaptive_conv_scheme = config.adaptive_bn_scheme = False
        config.enable_quantized_bn = level == "L2"
    elif level == "L3.1":
        config.cudnn_benchmark_conv2d = False
        config.empty_cache_threshold = 0.2
        config.pipeline_threshold = 3 * 1024**3
    elif level in ("L4", "L5"):
        config.swap = True
    elif level == "swap":
        config.swap = True
        config.compress_activation = False


def strategy(batchnorm: bool = True) -> tuple[str | None, dict[str, Any]]:
    """(strategy, options) for the current ``config``. For one layer (``batchnorm=True``)
    None where nothing is to be done; for a model (``batchnorm=False``) ``quant.L0`` there
    (saves kept as they are, and counted), and with ``enable_quantized_bn`` off BatchNorm
    inputs kept exact (``quant.L1``)."""
    options: dict[str, Any] = {"group_size": config.group_size, "seed": config.seed}
    if not config.compress_activation:
        if config.swap:
            return "offload.cpu", {}
        return (None, {}) if batchnorm else ("quant.L0", options)  # a model: counted as is
    bits = config.activation_compression_bits[0]
    if bits not in (1, 2, 4, 8):
        raise OptionError(
            f"config.activation_compression_bits[0]={bits!r}: torchstash codes 1, 2, 4 or 8 bits"
        )
    if config.adaptive_conv_scheme:
        name, options = "quant.auto", {**options, "budget": bits}
    elif not config.enable_quantized_bn and not batchnorm and bits == 4:
        name = "quant.L1"  # ActNN's L1: conv and linear inputs only
    else:
        name = f"quant.int{bits}"
    if config.level == "L5" and torch.cuda.is_available():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if config.swap:
        return f"{name}>offload.cpu", {name: options}
    return name, options
