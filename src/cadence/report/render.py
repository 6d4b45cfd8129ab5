"""How reports (runs, plans, profiles) are drawn: the figures, and the blocks rendered as markdown and HTML.

Figures use matplotlib's object API, no pyplot: pyplot keeps global state (a current figure, a process-wide backend)
that would leak into a user's own plotting and is not safe to use from a library. A bare ``Figure`` attached to a
``FigureCanvasAgg`` needs no backend selection at all and is garbage-collected like any other object.

Blocks are rendered here rather than beside the reports so that each file stays one concern: the report modules
(``cadence.report.runs``, ``cadence.plan.report``, ``cadence.profiling.report``) decide what a report says, this file
how it looks.
"""

from __future__ import annotations

import base64
import html
import io
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from cadence.formatting import finite  # what can be plotted: a real, finite number

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Row = dict[str, Any]

TRAIN, VALIDATION, SKIPPED = "tab:blue", "tab:orange", "tab:red"
ESTIMATED, MEASURED, CHOSEN, BUDGET = "tab:blue", "tab:green", "tab:purple", "black"
"""The plan's series: one colour each, so that no two series of one figure share one."""
HOST_CATEGORIES = ("offloaded_to_host",)
"""Estimate categories that live in host memory: shown apart, never stacked into the device peak."""
CATEGORY_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer_state": "tab:green",
                   "activations": "tab:red", "temporaries": "tab:gray", "inputs": "tab:brown",
                   "offloaded_to_host": "tab:pink"}
"""A colour per estimate category (cadence.memory.estimate.ESTIMATE_CATEGORIES and the host one), all different:
a category left to matplotlib's colour cycle would take the cycle's first colour, the blue of the parameters."""
SPARE_COLORS = ("tab:olive", "tab:cyan", "gold", "navy", "teal", "salmon")
"""Colours for a category this module does not know (a newer plan.json): taken in order, skipping used ones."""
MARKDOWN_MARK = "<!-- written by cadence; `cadence report DIR` rebuilds this file -->"
HTML_MARK = '<meta name="generator" content="cadence">'
PNG_SOFTWARE = "cadence"
"""The marks by which ``cadence report`` knows its own report.md, report.html and report-*.png (the PNG's tEXt
Software chunk): it rewrites only files that carry them (``cadence.report.document``), never a user's file of the same
name. Fixed strings, so that the same data still gives the same bytes."""
MAX_FIGURE_WIDTH_IN = 10.5
"""The HTML page is at most 1100 px wide (CSS below) and figures are drawn at 100 dpi: a wider figure would be
shrunk to the page, its text with it, until it is unreadable. Figures grow in height, never in width."""


def new_figure(size: tuple[float, float]) -> Figure:
    """A bare figure (no pyplot). matplotlib is imported here, on the first plot, not when cadence is imported: it
    costs a third of a second that every ``cadence train`` would otherwise pay before its first step."""
    from matplotlib.figure import Figure

    if size[0] > MAX_FIGURE_WIDTH_IN:
        raise ValueError(f"a figure {size[0]} in wide would be shrunk to the page; at most {MAX_FIGURE_WIDTH_IN} in")
    return Figure(figsize=size, dpi=100, layout="constrained")


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes. The software tag is cadence's mark (PNG_SOFTWARE), not matplotlib's version: the
    same data gives the same bytes, and a rebuild knows the plot as its own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attaches itself as fig.canvas; no global backend is consulted
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": PNG_SOFTWARE})
    return buffer.getvalue()


def byte_unit(largest: float) -> tuple[float, str]:
    """Divisor and unit name for an axis in bytes, chosen so that its largest value reads naturally."""
    for divisor, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= divisor:
            return float(divisor), name
    return 1.0, "B"


def _axes(title: str, xlabel: str, ylabel: str, size: tuple[float, float] = (8.0, 3.4)) -> tuple[Figure, Axes]:
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(size)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and windows are whole; bar plots set their own
    return fig, ax


def _legend(ax: Axes, **options: Any) -> None:
    """A legend with one entry per label (however many artists carry it), and none at all when nothing is labelled."""
    unique: dict[str, Any] = {}
    for handle, label in zip(*ax.get_legend_handles_labels()):
        unique.setdefault(label, handle)
    if unique:
        ax.legend(list(unique.values()), list(unique.keys()), **options)


def _stepped(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(step, value) of the optimizer steps that happened and have a finite ``key``."""
    pairs = [(row["step"], row[key]) for row in rows if not row.get("skipped") and finite(row.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def skipped_x(row: Row) -> float:
    """Where a skipped window is drawn: its ``step`` repeats the last real step, so half-way to the next one."""
    return float(row["step"]) + 0.5


def _mark_skipped(ax: Axes, rows: Sequence[Row], key: str) -> None:
    """A red vertical line per skipped window, and an x where its value is finite."""
    skipped = [row for row in rows if row.get("skipped")]
    for index, row in enumerate(skipped):
        label = f"skipped step ({len(skipped)})" if index == 0 else None
        ax.axvline(skipped_x(row), color=SKIPPED, alpha=0.35, lw=1, ls="--", label=label)
        if finite(row.get(key)):
            ax.plot([skipped_x(row)], [row[key]], "x", color=SKIPPED, ms=7)


def loss_figure(rows: Sequence[Row]) -> Figure:
    """Training loss per step, validation loss as markers, skipped steps marked."""
    fig, ax = _axes("Loss", "optimizer step", "loss (token mean, nats)")
    steps, losses = _stepped(rows, "loss")
    if len(steps) >= 50:
        # Per-step loss is noisy enough to hide the trend: draw it faintly under a running mean.
        ax.plot(steps, losses, color=TRAIN, lw=0.8, alpha=0.35, label="train loss")
        half = max(2, len(steps) // 60)  # centred, so the mean does not lag behind the raw curve
        windows = [losses[max(0, i - half):i + half + 1] for i in range(len(losses))]
        ax.plot(steps, [sum(w) / len(w) for w in windows], color=TRAIN, lw=1.6,
                label=f"train loss, mean of {2 * half + 1} steps")
    else:
        ax.plot(steps, losses, color=TRAIN, lw=1.4, marker="." if len(steps) < 30 else None, label="train loss")
    val_steps, val_losses = _stepped(rows, "val_loss")
    if val_steps:
        ax.plot(val_steps, val_losses, "o", color=VALIDATION, ms=6, label="validation loss")
    _mark_skipped(ax, rows, "loss")
    _legend(ax, loc="best")
    return fig


def lr_figure(rows: Sequence[Row]) -> Figure:
    """The learning rate each optimizer step used."""
    fig, ax = _axes("Learning rate", "optimizer step", "learning rate")
    steps, lrs = _stepped(rows, "lr")
    ax.plot(steps, lrs, color=TRAIN, lw=1.4, marker="." if len(steps) < 30 else None)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return fig


def rewards_figure(rows: Sequence[Row]) -> Figure:
    """A preference objective's window-wide rewards per step (TRL's names): chosen, rejected and their margin, with
    the accuracy (the share of pairs whose chosen reward is the larger) on a second axis; validation's as dots."""
    fig, ax = _axes("Rewards", "optimizer step", "reward (beta x log-ratio)")
    for key, colour in (("rewards/chosen", "tab:green"), ("rewards/rejected", SKIPPED), ("rewards/margins", TRAIN)):
        steps, values = _stepped(rows, key)
        if steps:
            ax.plot(steps, values, color=colour, lw=1.2, label=key)
        val_steps, val_values = _stepped(rows, "val_" + key)
        if val_steps:
            ax.plot(val_steps, val_values, "o", color=colour, ms=4, label="validation " + key.split("/")[1])
    steps, accuracies = _stepped(rows, "rewards/accuracies")
    if steps:
        share = ax.twinx()
        share.plot(steps, accuracies, color="grey", lw=1, ls=":", label="rewards/accuracies")
        share.set_ylim(0, 1)
        share.set_ylabel("accuracy")
    _legend(ax, loc="best")
    return fig


def throughput_figure(rows: Sequence[Row], *, average: float | None, profiled_steps: set[int]) -> Figure:
    """Tokens/s per step; steps slowed by the memory profiler are marked, the run's average is a line."""
    fig, ax = _axes("Throughput", "optimizer step", "tokens / s")
    steps, speeds = _stepped(rows, "tokens_per_s")
    ax.plot(steps, speeds, color=TRAIN, lw=1.2, marker="." if len(steps) < 30 else None, label="tokens/s")
    slow = [(s, v) for s, v in zip(steps, speeds) if s in profiled_steps]
    if slow:
        ax.plot([s for s, _ in slow], [v for _, v in slow], "s", color=SKIPPED, mfc="none", ms=8,
                label="memory-profiled step (slower)")
    if finite(average):
        ax.axhline(average, color="black", ls=":", lw=1, label=f"run average {average:,.0f}")
    ax.set_ylim(bottom=0)
    _legend(ax, loc="best")
    return fig


def grad_norm_figure(rows: Sequence[Row], *, clip: float | None) -> Figure:
    """Gradient norm before clipping (log scale); non-finite ones (null) as red x at the top; the clip threshold."""
    fig, ax = _axes("Gradient norm (before clipping)", "optimizer step", "total grad norm")
    attempts = [(row["step"] if not row.get("skipped") else skipped_x(row), row.get("grad_norm")) for row in rows]
    shown = [(x, v) for x, v in attempts if finite(v) and v > 0]  # a log axis cannot show 0
    ax.plot([x for x, _ in shown], [v for _, v in shown], color=TRAIN, lw=1.2,
            marker="." if len(shown) < 30 else None, label="grad norm")
    if finite(clip) and clip > 0:
        ax.axhline(clip, color="black", ls=":", lw=1, label=f"clipped to {clip:g}")
    ax.set_yscale("log")
    missing = [x for x, v in attempts if not finite(v)]
    if missing:
        # x in data units, y in axes units: pinned to the top whatever the scale.
        ax.plot(missing, [0.96] * len(missing), "x", color=SKIPPED, ms=8, transform=ax.get_xaxis_transform(),
                label=f"non-finite ({len(missing)})")
    _legend(ax, loc="best")
    return fig


def noise_scale_figure(rows: Sequence[Row], *, effective: float | None) -> Figure:
    """The gradient noise scale's moving average per step (sequences, log scale) against the run's effective batch."""
    fig, ax = _axes("Gradient noise scale against the effective batch", "optimizer step", "sequences")
    steps, values = _stepped(rows, "grad_noise_scale")
    shown = [(s, v) for s, v in zip(steps, values) if v > 0]
    ax.plot([s for s, _ in shown], [v for _, v in shown], color=TRAIN, lw=1.4,
            marker="." if len(shown) < 30 else None, label="gradient noise scale (moving average)")
    if finite(effective) and effective > 0:
        ax.axhline(effective, color="black", ls=":", lw=1.2, label=f"effective batch {effective:,.0f}")
    ax.set_yscale("log")
    _legend(ax, loc="best")
    return fig


def adaptive_batch_figure(rows: Sequence[Row]) -> Figure:
    """--effective-batch-size adaptive: the batch of each step and the noise scale (sequences, log scale) and the LR
    (right axis) against the tokens seen, each switch a vertical line with its decision."""
    fig, ax = _axes("Adaptive batch against tokens", "tokens seen", "sequences")
    tokens, seen = [], 0
    for row in rows:
        seen += int(row.get("tokens") or 0)
        tokens.append(seen)
    ax.step(tokens, [row.get("effective_batch") or 0 for row in rows], where="pre", color="black", lw=1.6,
            label="effective batch")
    noise = [(x, row["grad_noise_scale"]) for x, row in zip(tokens, rows)
             if finite(row.get("grad_noise_scale")) and row["grad_noise_scale"] > 0]
    ax.plot([x for x, _ in noise], [v for _, v in noise], color=TRAIN, lw=1.2, label="gradient noise scale")
    ax.set_yscale("log")
    for x, row in zip(tokens, rows):
        if row.get("batch_decision") in ("grow", "shrink"):
            ax.axvline(x, color=VALIDATION, ls="--", lw=1, alpha=0.6)
            ax.annotate(f"{row['batch_decision']} -> {row.get('next_effective_batch')}", (x, 1), xycoords=(
                "data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
    lr_axis = ax.twinx()
    lr_axis.plot(tokens, [float(row.get("lr") or 0.0) for row in rows], color="grey", lw=1, ls=":", label="learning rate")
    lr_axis.set_ylabel("learning rate")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    _legend(ax, loc="upper left")
    return fig


def loss_scale_figure(rows: Sequence[Row]) -> Figure:
    """fp16's loss scale per window: it halves on every skipped window, so windows (not steps) are the x axis."""
    fig, ax = _axes("fp16 loss scale", "window (optimizer step attempts, skipped ones included)", "loss scale")
    points = [(row.get("window", index + 1), row["loss_scale"], row.get("skipped")) for index, row in enumerate(rows)
              if finite(row.get("loss_scale")) and row["loss_scale"] > 0]
    ax.step([p[0] for p in points], [p[1] for p in points], where="post", color=TRAIN, lw=1.4, label="loss scale")
    bad = [(window, scale) for window, scale, skipped in points if skipped]
    if bad:
        ax.plot([w for w, _ in bad], [s for _, s in bad], "x", color=SKIPPED, ms=8, label=f"skipped ({len(bad)})")
    ax.set_yscale("log", base=2)
    _legend(ax, loc="best")
    return fig


# ---------------------------------------------------------------------------------------------------- plan figures
ROW_HEIGHT_IN = 0.3
"""Height of one candidate's row in the per-candidate figures: 30 px at 100 dpi holds two bars and a one-line tick
label of ~11 px with room between neighbours, so labels never overlap however many candidates there are."""
ROWS_FRAME_IN = 1.7
"""Height the per-candidate figures need besides their rows: title, x axis and the legend below it."""
ROWS_WIDTH_IN = 9.0
"""Width of the per-candidate figures: fixed, within the page (MAX_FIGURE_WIDTH_IN), whatever the count."""
ROWS_LEGEND_ORDER = ("estimated", "estimated, not measured", "measured", "chosen", "over the budget (hatched)")
"""Legend order of the per-candidate figures; the budget line (its label holds its value) comes after these."""
CHOSEN_BAND = "#efe6f7"
"""Background of the chosen candidate's row: the colour of the marked row of the HTML table (CSS below)."""


def candidate_label(candidate: Row) -> str:
    """One-line tick label: id, micro x accum, precision, and recompute/offload when they are on."""
    shape = f"{candidate.get('micro_batch_size', '?')}x{candidate.get('grad_accum_steps', '?')}"
    parts = [shape, str(candidate.get("precision", ""))]
    if candidate.get("activation_checkpointing") not in (None, "none"):
        parts.append(f"ckpt {candidate['activation_checkpointing']}")
    if candidate.get("offload") not in (None, "none"):
        parts.append(f"offload {candidate['offload']}")
    return f"{candidate.get('id', '?')}  " + " ".join(parts)


def category_colors(categories: Sequence[str]) -> dict[str, str]:
    """A colour per estimate category: its own where known, else one no other category (known or shown) uses."""
    spare = [color for color in SPARE_COLORS if color not in CATEGORY_COLORS.values()]
    colors = {}
    for name in categories:
        colors[name] = CATEGORY_COLORS.get(name) or (spare.pop(0) if spare else "silver")
    return colors


def breakdown_figure(bars: Sequence[tuple[str, dict[str, float]]], *, budget: float | None) -> Figure:
    """Stacked bars of estimated bytes by category (baseline, and the choice beside it), budget as a line."""
    largest = max([sum(v for k, v in cats.items() if finite(v) and k not in HOST_CATEGORIES) for _, cats in bars]
                  + [budget or 0, 1])
    divisor, unit = byte_unit(largest)
    fig, ax = _axes("Estimated peak memory by category", "", unit, size=(6.5, 4.2))
    ax.grid(False, axis="x")
    categories = list(dict.fromkeys(name for _, cats in bars for name in cats if name not in HOST_CATEGORIES))
    colors = category_colors(categories)
    bottoms = [0.0] * len(bars)
    for category in categories:
        heights = [cats.get(category, 0) / divisor if finite(cats.get(category)) else 0 for _, cats in bars]
        ax.bar([name for name, _ in bars], heights, bottom=bottoms, width=0.5, label=category.replace("_", " "),
               color=colors[category])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylim(0, 1.06 * largest / divisor)  # the budget line clear of the top edge when it is the largest
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))
    if finite(budget):
        line = ax.axhline(budget / divisor, color=BUDGET, ls="--", lw=1.2)
        handles = {f"budget {budget / divisor:,.1f} {unit}": line, **handles}
    # The categories top-down, as they are stacked, under the budget.
    order = [label for label in handles if label.startswith("budget")] + [
        label for label in reversed(handles) if not label.startswith("budget")]
    if order:
        ax.legend([handles[label] for label in order], order, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize="small")
    return fig


def _rows_axes(title: str, xlabel: str, labels: Sequence[str]) -> tuple[Figure, Axes]:
    """A figure of one horizontal row per candidate: fixed width, height growing with the count, first row on top."""
    fig = new_figure((ROWS_WIDTH_IN, ROWS_FRAME_IN + ROW_HEIGHT_IN * max(len(labels), 1)))
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_yticks(range(len(labels)), labels, fontsize="small")
    ax.set_ylim(max(len(labels), 1) - 0.5, -0.5)  # inverted: the first candidate on top, as in the table
    if len(labels) > 12:
        ax.tick_params(axis="x", labeltop=True)  # a tall figure is read from its top too
    return fig, ax


def _mark_chosen_row(ax: Axes, candidates: Sequence[Row], chosen: str | None, end: Any = None) -> None:
    """The chosen candidate's row: a band behind it, its tick label bold in CHOSEN and, given ``end`` (where its
    longest bar ends), a star there."""
    for index, candidate in enumerate(candidates):
        if candidate.get("id") != chosen:
            continue
        ax.axhspan(index - 0.5, index + 0.5, color=CHOSEN_BAND, zorder=0)
        label = ax.get_yticklabels()[index]
        label.set_fontweight("bold")
        label.set_color(CHOSEN)
        if end is not None:
            ax.plot([end(candidate)], [index], "*", color=CHOSEN, ms=12, label="chosen", clip_on=False, zorder=3)


def _rows_legend(fig: Figure, ax: Axes, *, over_budget: bool) -> None:
    """One legend below the axes (never over the bars or the labels); hatching explained once, in black on white."""
    from matplotlib.container import BarContainer
    from matplotlib.patches import Patch

    unique: dict[str, Any] = {}
    for handle, label in zip(*ax.get_legend_handles_labels()):
        # A bar's entry shows its colour alone: the first bar of a series may be over the budget, and hatched.
        unique.setdefault(label, Patch(facecolor=handle.patches[0].get_facecolor(), edgecolor="none")
                          if isinstance(handle, BarContainer) else handle)
    if over_budget:
        unique["over the budget (hatched)"] = Patch(facecolor="white", edgecolor="black", hatch="//")
    # The same order in every such figure, whichever candidate happens to come first: the series, then the marks.
    def rank(label: str) -> int:
        return ROWS_LEGEND_ORDER.index(label) if label in ROWS_LEGEND_ORDER else len(ROWS_LEGEND_ORDER)

    unique = {label: unique[label] for label in sorted(unique, key=rank)}  # stable: unknown labels keep their order
    if unique:
        fig.legend(list(unique.values()), list(unique.keys()), loc="outside lower center", fontsize="small",
                   ncols=min(len(unique), 3))


def memory_figure(candidates: Sequence[Row], *, budget: float | None, chosen: str | None) -> Figure:
    """Estimated and measured peak per candidate, one row each; unmeasured estimates faint, over-budget bars hatched,
    the chosen row marked, the budget a dashed line."""
    values = [c.get("estimated_peak_bytes") for c in candidates]
    values += [(c.get("measured") or {}).get("peak_bytes") for c in candidates]
    largest = max([v for v in values if finite(v)] + [budget or 0, 1])
    divisor, unit = byte_unit(largest)
    fig, ax = _rows_axes("Peak memory per candidate", f"peak memory ({unit})",
                         [candidate_label(c) for c in candidates])
    height, hatched = 0.38, False
    for index, candidate in enumerate(candidates):
        measured = candidate.get("measured") or {}
        estimate = candidate.get("estimated_peak_bytes")
        if finite(estimate):
            over = candidate.get("fits_estimate") is False or (finite(budget) and estimate > budget)
            ax.barh(index - height / 2, estimate / divisor, height, color=ESTIMATED, alpha=0.9 if measured else 0.35,
                    hatch="//" if over else None, edgecolor="black" if over else "none", linewidth=0.6,
                    label="estimated" if measured else "estimated, not measured")
            hatched |= bool(over)
        if finite(measured.get("peak_bytes")):
            over = measured.get("fits") is False
            ax.barh(index + height / 2, measured["peak_bytes"] / divisor, height, color=MEASURED,
                    hatch="//" if over else None, edgecolor="black" if over else "none", linewidth=0.6,
                    label="measured")
            hatched |= over
    if finite(budget):
        ax.axvline(budget / divisor, color=BUDGET, ls="--", lw=1.2, label=f"budget {budget / divisor:,.1f} {unit}")
    _mark_chosen_row(ax, candidates, chosen, lambda c: max(
        [v for v in (c.get("estimated_peak_bytes"), (c.get("measured") or {}).get("peak_bytes")) if finite(v)]
        + [0]) / divisor)
    ax.set_xlim(0, 1.06 * largest / divisor)  # room for the chosen star after the longest bar
    _rows_legend(fig, ax, over_budget=hatched)
    return fig


def throughput_plan_figure(candidates: Sequence[Row], *, chosen: str | None) -> Figure:
    """Measured tokens/s per measured candidate, one row each with its value; the chosen one in its own colour,
    over-budget ones hatched."""
    measured = [c for c in candidates if finite((c.get("measured") or {}).get("tokens_per_s"))]
    fig, ax = _rows_axes("Measured throughput per candidate", "tokens / s", [candidate_label(c) for c in measured])
    hatched = False
    largest = max([c["measured"]["tokens_per_s"] for c in measured] + [1])
    for index, candidate in enumerate(measured):
        result = candidate["measured"]
        over = result.get("fits") is False
        is_chosen = candidate.get("id") == chosen
        ax.barh(index, result["tokens_per_s"], 0.6, color=CHOSEN if is_chosen else MEASURED,
                hatch="//" if over else None, edgecolor="black" if over else "none", linewidth=0.6,
                label="chosen" if is_chosen else "measured")
        ax.text(result["tokens_per_s"] + 0.01 * largest, index, f"{result['tokens_per_s']:,.0f}", va="center",
                fontsize="small", color=CHOSEN if is_chosen else "black",
                fontweight="bold" if is_chosen else "normal")
        hatched |= over
    _mark_chosen_row(ax, measured, chosen)  # its bar is already in CHOSEN: no star
    ax.set_xlim(0, 1.15 * largest)  # room for the values after the bars
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:,.0f}")
    if not measured:
        ax.text(0.5, 0.5, "no candidate was measured", ha="center", va="center", transform=ax.transAxes)
    _rows_legend(fig, ax, over_budget=hatched)
    return fig


def quality_figure(chosen: Sequence[float], reference: Sequence[float]) -> Figure:
    """The chosen configuration's first losses against the reference's, on the same data."""
    fig, ax = _axes("Loss: chosen vs reference", "optimizer step", "loss", size=(6.5, 3.2))
    # The curves usually coincide: the chosen one wide underneath, the reference thin and dashed on top of it.
    for values, label, color, style, width in ((chosen, "chosen", CHOSEN, "-", 3.0),
                                               (reference, "reference", "black", "--", 1.2)):
        points = [(i + 1, v) for i, v in enumerate(values) if finite(v)]
        ax.plot([p[0] for p in points], [p[1] for p in points], ls=style, lw=width, color=color, label=label,
                marker="o" if label == "chosen" else None, ms=5)
    _legend(ax, loc="upper right")
    return fig


# ------------------------------------------------------------------------------------ report blocks and rendering
@dataclass(frozen=True, kw_only=True)
class Heading:
    """A section heading (level 2 = a section of the report; the title is the only level 1)."""

    text: str
    level: int = 2


@dataclass(frozen=True, kw_only=True)
class Paragraph:
    """Text with ``**bold**`` and ``code`` spans, the only inline markup both renderers understand."""

    text: str


@dataclass(frozen=True, kw_only=True)
class Bullets:
    """A list; items take the same inline markup as a paragraph."""

    items: list[str]


@dataclass(frozen=True, kw_only=True)
class Table:
    """A table of preformatted cells."""

    header: list[str]
    rows: list[list[str]]
    marked_row: int | None = None
    """Index of a row to highlight in HTML (the chosen candidate); markdown carries the mark in the cell text."""


@dataclass(frozen=True, kw_only=True)
class Plot:
    """A figure: a PNG file beside the report (linked from the markdown) and embedded in the HTML."""

    name: str
    """File name of the PNG beside the report, e.g. report-loss.png."""
    title: str
    """Short name, the markdown image's alt text."""
    caption: str
    png: bytes = field(repr=False)


Block = Heading | Paragraph | Bullets | Table | Plot


@dataclass(frozen=True, kw_only=True)
class Report:
    """A whole report: the title (level-1 heading and HTML title) and its blocks in order."""

    title: str
    blocks: list[Block]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _inline_html(text: str) -> str:
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


def to_markdown(report: Report) -> str:
    """GitHub-flavoured markdown; plots are links to the PNG files written beside it."""
    lines = [f"# {report.title}", ""]
    for block in report.blocks:
        if isinstance(block, Heading):
            lines += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Paragraph):
            lines += [block.text, ""]
        elif isinstance(block, Bullets):
            lines += [f"- {item}" for item in block.items] + [""]
        elif isinstance(block, Table):
            lines.append("| " + " | ".join(_md_cell(h) for h in block.header) + " |")
            lines.append("|" + "|".join(" --- " for _ in block.header) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        else:
            lines += [f"![{block.title}]({block.name})", "", f"*{block.caption}*", ""]
    lines += [MARKDOWN_MARK, ""]  # last, invisible when rendered: what a rebuild looks for before overwriting
    return "\n".join(lines)


CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
tr.marked td { background: #efe6f7; font-weight: 600; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
code { background: #f5f5f5; padding: 0 0.2em; }
"""


def to_html(report: Report) -> str:
    """One self-contained HTML page: inline CSS, plots as base64 data URIs, no external resource."""
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', HTML_MARK,
           f"<title>{html.escape(report.title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{html.escape(report.title)}</h1>"]
    for block in report.blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_inline_html(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{_inline_html(block.text)}</p>")
        elif isinstance(block, Bullets):
            out += ["<ul>", *(f"<li>{_inline_html(item)}</li>" for item in block.items), "</ul>"]
        elif isinstance(block, Table):
            out += ["<table>", "<tr>" + "".join(f"<th>{_inline_html(h)}</th>" for h in block.header) + "</tr>"]
            for index, row in enumerate(block.rows):
                marked = ' class="marked"' if index == block.marked_row else ""
                out.append(f"<tr{marked}>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>")
            out.append("</table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(block.title)}">'
                       f"<figcaption>{_inline_html(block.caption)}</figcaption></figure>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)
