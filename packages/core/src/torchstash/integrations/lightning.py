"""A Lightning callback: torchstash on the ``LightningModule`` for the length of ``fit``.

    trainer = lightning.Trainer(callbacks=[TorchstashCallback("quant.int8")])

Works with ``lightning`` (``lightning.pytorch``) or, where only that is installed, the older
``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any

from ..api import Handle, PolicyLike
from . import Meter, missing

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise missing("lightning", "Lightning", "lightning") from e

__all__ = ["TorchstashCallback"]


class TorchstashCallback(pl.Callback):
    """Applies torchstash at fit start, logs what it saved, removes it when fit ends.

    Applied in ``on_fit_start``, after the strategy has set up (and wrapped) the model, so it
    sees the final modules. Every ``log_every_n_steps`` training batches (default: each one) it
    logs ``torchstash/saved_mb``, ``stored_mb``, ``raw_mb`` (per batch, averaged since the last
    log) and ``ratio`` (stored / raw) through ``pl_module.log``; the Trainer's own
    ``log_every_n_steps`` decides which of them reach the logger. Removed at fit end, in
    ``teardown`` and on an exception, so the model is stock again whatever happened.
    """

    def __init__(
        self,
        strategy: str | None = None,
        *,
        policy: PolicyLike | None = None,
        log_every_n_steps: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be at least 1, got {log_every_n_steps}")
        self.meter = Meter(strategy, policy, options)
        self.log_every_n_steps = log_every_n_steps or 1

    @property
    def handle(self) -> Handle | None:
        """The active handle during fit; None before and after."""
        return self.meter.handle

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.meter.start(pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.step()
        if self.meter.steps < self.log_every_n_steps:
            return
        for name, value in self.meter.read().items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.meter.stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.meter.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.meter.stop()
