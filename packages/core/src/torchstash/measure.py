"""``measure``: run one training step and account for every tensor autograd saved."""

from __future__ import annotations

import inspect
import io
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .api import PolicyLike, apply, handle_of
from .engine import DEFAULT_MIN_BYTES, Row
from .errors import ApplyError

MB = 1 << 20


@dataclass
class ModuleRow:
    module: str
    module_type: str
    saved: int
    shared: int
    raw_bytes: int
    stored_bytes: int
    host_bytes: int
    compressed: int
    declined: dict[str, int]
    ops: dict[str, int]
    derived: int = 0
    held_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @classmethod
    def of(cls, r: Row) -> ModuleRow:
        return cls(
            r.module,
            r.module_type,
            r.saved,
            r.shared,
            r.raw_bytes,
            r.stored_bytes,
            r.host_bytes,
            r.compressed,
            dict(r.declined),
            dict(r.ops),
            r.derived,
            r.held_bytes,
        )


@dataclass
class Report:
    """Saved-tensor accounting of one step, its time and (on CUDA) its peak memory."""

    strategy: str
    device: str
    rows: list[ModuleRow]
    step_times_s: list[float]
    cuda_peak_bytes: int | None = None
    param_refs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        """Bytes stock PyTorch would keep for backward: each saved activation's storage once
        and whole (a view of a saved tensor adds nothing; a saved slice holds its storage)."""
        return sum(r.raw_bytes for r in self.rows)

    @property
    def stored_bytes(self) -> int:
        """Bytes kept under the strategy, wherever they live: the storages of what is kept,
        each once and whole (a payload's scales, indices and spare capacity included)."""
        return sum(r.stored_bytes for r in self.rows)

    @property
    def held_bytes(self) -> int:
        """What the allocators hold for ``stored_bytes``: each block at its allocator's
        granularity (512 bytes on CUDA, malloc's chunk on the CPU) and, on the CPU, each
        storage's and tensor's record (a few hundred bytes each: a small tensor's are most of
        it). The heap holds this, not the payload (:class:`~torchstash.packed.Allocation`)."""
        return sum(r.held_bytes for r in self.rows)

    @property
    def host_bytes(self) -> int:
        """Of ``stored_bytes``, bytes moved to host memory from an accelerator."""
        return sum(r.host_bytes for r in self.rows)

    @property
    def device_bytes(self) -> int:
        return self.stored_bytes - self.host_bytes

    @property
    def ratio(self) -> float:
        """raw / stored on the tensors' own device (higher is better)."""
        return self.raw_bytes / self.device_bytes if self.device_bytes else float("inf")

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            raw_bytes=self.raw_bytes,
            stored_bytes=self.stored_bytes,
            held_bytes=self.held_bytes,
            host_bytes=self.host_bytes,
            ratio=self.ratio if self.device_bytes else None,
            step_time_s=self.step_time_s,
        )
        for row, r in zip(d["rows"], self.rows):
            row["ratio"] = r.ratio
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, top: int | None = None) -> Any:
        """A rich Table of the modules that saved the most."""
        from rich.table import Table

        t = Table(title=f"torchstash.measure: {self.strategy} on {self.device}")
        cols = ("module", "type", "saved", "raw MB", "stored MB", "held MB", "ratio", "declined")
        for col in cols:
            t.add_column(col, justify="left" if col in ("module", "type", "declined") else "right")
        rows = sorted(self.rows, key=lambda r: -r.raw_bytes)
        for r in rows[:top] if top else rows:
            declined = sum(r.declined.values())
            t.add_row(
                r.module or "<top>",
                r.module_type,
                str(r.saved),
                f"{r.raw_bytes / MB:.3f}",
                f"{r.stored_bytes / MB:.3f}",
                f"{r.held_bytes / MB:.3f}",
                f"{r.ratio:.2f}x",
                str(declined) if declined else "",
            )
        peak = f", CUDA peak {self.cuda_peak_bytes / MB:.1f} MB" if self.cuda_peak_bytes else ""
        t.caption = (
            f"total raw {self.raw_bytes / MB:.3f} MB, stored {self.stored_bytes / MB:.3f} MB "
            f"({self.raw_bytes / max(self.stored_bytes, 1):.2f}x; the allocator holds "
            f"{self.held_bytes / MB:.3f} MB for it), step {self.step_time_s * 1e3:.1f} ms{peak}"
        )
        return t

    def declined(self) -> dict[str, int]:
        """Why tensors were kept as they are, over every module: reason -> count."""
        total: Counter[str] = Counter()
        for r in self.rows:
            total.update(r.declined)
        return dict(total.most_common())

    def __str__(self) -> str:
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=110, force_terminal=False, color_system=None)
        console.print(self.table(20))
        reasons = self.declined()
        if reasons:
            console.print("kept as they are (tensors, why):")
            for why, n in reasons.items():
                console.print(f"  {n} x {why}", markup=False)
        return buf.getvalue()

    def plot(self, path: str | Path, top: int = 15) -> Path:
        """Bar chart of raw against stored bytes per module (needs ``torchstash[plot]``)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = sorted(self.rows, key=lambda r: -r.raw_bytes)[:top]
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
        names = [r.module or "<top>" for r in rows]
        ax.barh(names, [r.raw_bytes / MB for r in rows], label="stock", color="#bbbbbb")
        ax.barh(names, [r.stored_bytes / MB for r in rows], label=self.strategy, color="#1f77b4")
        ax.invert_yaxis()
        ax.set_xlabel("saved for backward (MB)")
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
        plt.close(fig)
        return out


def _runner(step: Callable[..., Any], model: nn.Module) -> Callable[[], Any]:
    try:
        wants_model = len(inspect.signature(step).parameters) > 0
    except (TypeError, ValueError):
        wants_model = False
    return (lambda: step(model)) if wants_model else step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    run: Callable[[], Any], device: torch.device, warmup: int = 1, repeat: int = 3
) -> list[float]:
    """Seconds per call of ``run`` (synchronized on CUDA), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def measure(
    model: nn.Module,
    step: Callable[..., Any],
    strategy: str | None = None,
    *,
    policy: PolicyLike | None = None,
    warmup: int = 1,
    repeat: int = 3,
    min_bytes: int = DEFAULT_MIN_BYTES,
    **options: Any,
) -> Report:
    """Run ``step`` (forward and backward; ``step()`` or ``step(model)``) and report.

    With no strategy or policy, measures what is already applied to ``model`` (or stock
    PyTorch via ``none`` when nothing is). Otherwise applies it for the measurement only.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError("measure: repeat must be >= 1 and warmup >= 0")
    handle = handle_of(model)
    temporary = strategy is not None or policy is not None or handle is None
    if temporary and handle is not None:
        raise ApplyError(
            "measure: the model already has torchstash applied; call measure without a "
            "strategy to measure it, or torchstash.remove(model) first"
        )
    if temporary:
        name = None if policy is not None else (strategy or "none")
        handle = apply(model, name, policy=policy, min_bytes=min_bytes, **options)
    assert handle is not None
    run = _runner(step, model)
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    try:
        for _ in range(warmup):
            run()
        _sync(device)
        handle.tally.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        rows = [ModuleRow.of(r) for r in handle.tally.rows.values()]
        param_refs = handle.tally.param_refs
        times += time_steps(run, device, warmup=0, repeat=repeat - 1)
    finally:
        if temporary:
            handle.remove()
    return Report(handle.policy.name, str(device), rows, times, peak, param_refs)
