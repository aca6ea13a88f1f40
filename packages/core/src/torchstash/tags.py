"""Type tags: short names for module types that policies select by (Mesa's ``fc``, ``gelu``...)."""

from __future__ import annotations

from torch import nn

# Checked in order; a subclass gets its first matching base's tag.
_TAGS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.modules.batchnorm._NormBase, "bn"),
    (nn.LayerNorm, "layernorm"),
    (nn.GroupNorm, "groupnorm"),
    (nn.RMSNorm, "rmsnorm"),
    (nn.GELU, "gelu"),
    (nn.SiLU, "silu"),
    (nn.ReLU, "relu"),
    (nn.LeakyReLU, "relu"),
    (nn.ReLU6, "relu"),
    (nn.Hardtanh, "relu"),
    (nn.Softmax, "softmax"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.modules.pooling._MaxPoolNd, "maxpool"),
    (nn.modules.pooling._AvgPoolNd, "avgpool"),
    (nn.modules.pooling._AdaptiveAvgPoolNd, "avgpool"),
    (nn.Embedding, "embedding"),
    (nn.MultiheadAttention, "attention"),
)

#: Other spellings users (and Mesa's policy files) write for the same tag.
ALIASES = {
    "fc": "linear",
    "dense": "linear",
    "layer_norm": "layernorm",
    "batchnorm": "bn",
    "batch_norm": "bn",
    "group_norm": "groupnorm",
    "rms_norm": "rmsnorm",
    "mha": "attention",
}

KNOWN_TAGS: frozenset[str] = frozenset(t for _, t in _TAGS)


def tag_of(module: nn.Module) -> str:
    """The module's tag, or its class name lowercased when it has none."""
    for cls, tag in _TAGS:
        if isinstance(module, cls):
            return tag
    return type(module).__name__.lower()


def normalize(tag: str) -> str:
    t = tag.strip().lower()
    return ALIASES.get(t, t)


def type_names(module: nn.Module) -> frozenset[str]:
    """Every name a ``type`` selector may use for this module: its tag and its classes' names."""
    names = {tag_of(module)}
    names.update(c.__name__.lower() for c in type(module).__mro__ if issubclass(c, nn.Module))
    names.discard("module")
    return frozenset(names)
