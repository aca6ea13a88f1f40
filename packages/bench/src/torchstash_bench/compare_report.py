"""What ``torchstash bench --compare`` prints and draws: the table (terminal and Markdown), its
notes and legend, and the Pareto plot of saved memory against step time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from .common import (
    compressed_nothing,
    fmt,
    plural,
    top_reason,
)
from .compare_methods import SAVE_ON_CPU


@dataclass
class CompareResult:
    """Every row of one ``--compare`` run, the demo's runs, and how it ran (``meta``)."""

    rows: list[dict[str, Any]]
    demo: list[dict[str, Any]]
    meta: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {**self.meta, "rows": self.rows, "demo": self.demo}


def _saved_cell(row: dict[str, Any]) -> str:
    if row["error"]:
        return "failed"
    pct = "" if row["vs_stock"] is None else f" ({100 * row['vs_stock']:.0f}%)"
    return f"{row['saved_mb']:.2f}{pct}"


def grid(result: CompareResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """Header, one row of cells per method and where a family ends: per model, saved MB
    (share of stock's) and step time / stock's, on CUDA also peak MB; then the demo's final
    train and validation loss."""
    rows = result.rows
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    cuda = any(r["cuda_peak_mb"] is not None for r in rows)
    demo = {d["method"]: d for d in result.demo}
    header = ["method"]
    for m in models:
        header += [f"{m} saved MB", f"{m} time"] + ([f"{m} peak MB"] if cuda else [])
    if demo:
        header += ["demo loss", "demo val loss"]
    by = {(r["model"], r["method"]): r for r in rows}
    cells: list[list[str]] = []
    ends: list[bool] = []
    for i, name in enumerate(names):
        line = [name]
        for m in models:
            r = by[(m, name)]
            line += [_saved_cell(r), fmt(r["time_ratio"], ".2f", "x")]
            if cuda:
                line.append(fmt(r["cuda_peak_mb"], ".1f"))
        if demo:
            d = demo.get(name, {})
            if d.get("error"):
                line += ["failed", "-"]
            else:
                line += [fmt(d.get("train_loss"), ".4f"), fmt(d.get("val_loss"), ".4f")]
        cells.append(line)
        family = by[(models[0], name)]["family"]
        ends.append(i + 1 < len(names) and by[(models[0], names[i + 1])]["family"] != family)
    return header, cells, ends


def compare_table(result: CompareResult, title: str = "torchstash bench --compare") -> Table:
    """The :func:`grid` as a rich table (failures in red)."""
    header, cells, ends = grid(result)
    t = Table(title=title)
    t.add_column(header[0], no_wrap=True)
    for h in header[1:]:
        t.add_column(h.replace(" ", "\n", 1), justify="right")
    for line, end in zip(cells, ends):
        styled = [escape(line[0])] + [
            "[red]failed[/red]" if c == "failed" else escape(c) for c in line[1:]
        ]
        t.add_row(*styled, end_section=end)
    return t


def markdown_table(result: CompareResult) -> str:
    """The :func:`grid` as a Markdown table (for the README)."""
    header, cells, _ = grid(result)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
    out += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(out)


def compare_notes(result: CompareResult) -> list[str]:
    """Why a method failed or held what stock holds: one line per method and reason."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in result.rows:
        why = _note(r)
        if why:
            seen.setdefault((r["method"], why), []).append(r["model"])
    for d in result.demo:
        if d["error"]:
            seen.setdefault((d["method"], f"failed: {d['error']}"), []).append("demo")
    return [f"{name} ({', '.join(where)}): {why}" for (name, why), where in seen.items()]


def _note(r: dict[str, Any]) -> str | None:
    if r["error"]:
        return f"failed: {r['error']}"
    if r["method"] == SAVE_ON_CPU and r["host_bytes"] == 0:
        return (
            "the tensors already live on the host, so nothing moves "
            "(it saves device memory only on an accelerator)"
        )
    same = (r["vs_stock"] or 1.0) >= 0.999
    if r["family"] != "torchstash" or not same:
        return None
    if not compressed_nothing(r["method"], r["compressed"], r["host_bytes"]):
        return None
    if r.get("rewritten"):
        return f"rewrote {plural(r['rewritten'], 'module')}, which keep what stock keeps here"
    return f"compressed nothing: {top_reason(r['declined'] or {})}"


def legend(result: CompareResult) -> str:
    m = result.meta
    demo = ""
    if m["demo_steps"]:
        c = m["demo_config"]
        demo = (
            f"; demo = the demo's char-level GPT (dim {c['dim']}, {plural(c['layers'], 'layer')}, "
            f"ctx {c['ctx']}, batch {c['batch']}) trained {m['demo_steps']} steps with each method "
            "from the same weights on the same batches: loss = mean of the last "
            f"{c['tail']} steps, val loss "
            "on held-out batches"
        )
    return (
        "saved MB = bytes held for backward after the forward (activations; parameters not "
        "counted), in parentheses the share of stock's; time = median step time / stock's in "
        f"this run (compile time excluded); compile-budget = torch.compile with "
        f"activation_memory_budget={m['budget']}{demo}."
    )


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both time and memory (lower is better), by time."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _label_groups(
    rows: Sequence[dict[str, Any]], near_x: float = 0.15, near_y: float = 0.035
) -> list[tuple[tuple[float, float], list[str], str]]:
    """Points whose labels would overlap (closer than ``near_x`` and ``near_y`` of the axes'
    spans: stock, offload.cpu and save_on_cpu sit on one spot on CPU) share one label, at
    the leftmost; grey when the families differ."""
    if not rows:
        return []
    rows = sorted(rows, key=lambda r: r["time_ratio"])
    xs = [r["time_ratio"] for r in rows]
    ys = [r["saved_mb"] for r in rows]
    dx, dy = near_x * ((max(xs) - min(xs)) or 1.0), near_y * ((max(ys) - min(ys)) or 1.0)
    groups: list[tuple[tuple[float, float], list[str], str]] = []
    for r, x, y in zip(rows, xs, ys):
        color = FAMILY_COLORS.get(r["family"], "grey")
        for i, ((gx, gy), names, gcolor) in enumerate(groups):
            if abs(x - gx) <= dx and abs(y - gy) <= dy:
                names.append(r["method"])
                groups[i] = ((gx, gy), names, gcolor if gcolor == color else "dimgrey")
                break
        else:
            groups.append(((x, y), [r["method"]], color))
    return groups


FAMILY_COLORS = {"stock": "black", "torch": "#d95f02", "torchstash": "#1b9e77"}


def save_plot(result: CompareResult, path: str | Path) -> Path:
    """Step time ratio against saved MB, one panel per model, the Pareto front dashed
    (needs matplotlib: ``pip install torchstash[plot]``)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r["model"] for r in result.rows))
    fig = Figure(figsize=(5.2 * len(models), 4.6))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        ok = [
            r
            for r in result.rows
            if r["model"] == model and r["error"] is None and r["time_ratio"] is not None
        ]
        for r in ok:
            color = FAMILY_COLORS.get(r["family"], "grey")
            ax.scatter(r["time_ratio"], r["saved_mb"], color=color, s=22, zorder=3)
        for (x, y), names, color in _label_groups(ok):
            ax.annotate(
                ", ".join(names),
                (x, y),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=7,
                color=color,
            )
        front = pareto_front([(r["time_ratio"], r["saved_mb"]) for r in ok])
        if front:
            xs, ys = zip(*front)
            ax.step(xs, ys, where="post", linestyle="--", color="grey", linewidth=1, zorder=2)
        ax.set(title=model, xlabel="step time / stock's", ylabel="saved for backward (MB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], marker="o", linestyle="", color=c, label=f) for f, c in FAMILY_COLORS.items()
    ]
    handles.append(Line2D([], [], linestyle="--", color="grey", label="Pareto front"))
    axes[0].legend(handles=handles, fontsize=7, loc="upper right")
    m = result.meta
    where = f"{m['device']} ({plural(m['threads'], 'thread')})" if m["threads"] else m["device"]
    fig.suptitle(f"torchstash bench --compare: zoo scale {m['scale']} on {where}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
