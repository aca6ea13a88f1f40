"""Which float types the quantizers code, and the one behaviour for the others (float64).

Every quant strategy keeps a float64 tensor exactly as it is, with one warning per compressor
(so one per ``apply`` or ``stash``):
an fp64 model is run for its precision, and coding through float32 would throw away the very
digits it is run for. Cast the model (``model.float()``) or use autocast to compress it.
"""

from __future__ import annotations

import warnings

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_reasons(owner: object, name: str, dtype: torch.dtype) -> list[str]:
    """Why compressor ``owner`` (strategy ``name``) keeps a ``dtype`` tensor as is (empty:
    it codes it). The first float64 tensor it meets is also told as a warning."""
    if dtype in FLOAT_DTYPES:
        return []
    if dtype == torch.float64 and not getattr(owner, "_told_float64", False):
        owner.__dict__["_told_float64"] = True
        warnings.warn(
            f"{name} keeps float64 tensors as they are (it codes float32, float16 and "
            "bfloat16): this model saves no memory there. Cast it with model.float() or "
            "train under torch.autocast to compress it; the per-module count of kept "
            "tensors is in the handle's tally (declined).",
            UserWarning,
            stacklevel=2,
        )
    return [f"{name} codes float32, float16 and bfloat16 tensors, got {dtype}"]
