"""Two profiles side by side: is B really faster or leaner than A, or is the difference run-to-run noise?

Step times vary from step to step (the OS, caches, the allocator), so two profiles of the same configuration never
give the same mean. B is called faster or slower than A only when the difference of the mean step times is large
against that noise: Welch's t statistic on the per-step times (which does not assume equal variances) must exceed
``T_THRESHOLD`` in absolute value. Peak memory is deterministic for a given configuration, so a plain relative
threshold (``MEMORY_THRESHOLD``) decides "leaner". The comparison is rendered with cadence.report.render's blocks, so its
markdown and HTML say the same thing as the reports do.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

from cadence.errors import UsageError
from cadence.formatting import format_bytes, format_number, format_seconds, format_share, format_si
from cadence.output_files import atomic_write_bytes
from cadence.profiling.report import (
    draw_phase_bars,
    mean_sd,
    mfu,
    phase_mean,
    phase_names,
    read_profile,
    setup_items,
    step_times,
)
from cadence.report import render as plots
from cadence.report.render import Block, Bullets, Heading, Paragraph, Plot, Report, Table, to_html, to_markdown

if TYPE_CHECKING:  # matplotlib itself is imported on the first plot (cadence.report.render.new_figure)
    from matplotlib.figure import Figure

T_THRESHOLD = 3.0
"""|Welch t| above which a step-time difference is real. A fixed 3 rather than a Student-t quantile (no scipy): for
two profiles of 8 active steps (about 14 degrees of freedom) the two-sided 99% bound is 2.98, so 3 is that bound for
the usual profile; with more steps it is a little stricter than 99%, with fewer than about 6 steps each more lenient."""
MEMORY_THRESHOLD = 0.02
"""Relative peak-memory difference above which B is leaner or heavier. Memory repeats exactly for a configuration;
2% leaves room for allocator rounding and the small buffers that a different library version may add."""
WARM_UP_FACTOR = 1.5
"""A profile's first active steps are left out of its step-time statistics while each takes more than this times the
median of the steps after it: warm-up that the profile's own warm-up step did not absorb (allocator growth, lazy
initialisation, compilation). Left in, one 1.1 s step among 0.13 s ones makes the spread so wide that a 5x speed-up
reads as "no difference beyond the noise"."""
UNFAIR_KEYS = ("model", "seq_len", "effective_batch_size", "device")
"""Settings that change the work a step does (or where it runs): when they differ, A and B are not like for like."""
NOT_COMPARED = ("out", "resume", "plan")
"""Configuration keys that say where a run was written or its settings read from, not how it ran."""

SpeedKind = Literal["faster", "slower", "no difference", "unknown"]
MemoryKind = Literal["leaner", "heavier", "same", "unknown"]


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Mean and sample standard deviation of a profile's active step times (its warm-up outliers left out)."""

    n: int
    mean_s: float | None
    sd_s: float | None
    warm_up: tuple[float, ...] = ()
    """The leading step times left out as warm-up (see WARM_UP_FACTOR)."""

    def text(self) -> str:
        sd = f" ± {format_seconds(self.sd_s)}" if self.sd_s is not None else ""
        left_out = ""
        if self.warm_up:
            left_out = (f", after leaving out {len(self.warm_up)} warm-up step{'s' if len(self.warm_up) != 1 else ''}"
                        f" of {', '.join(format_seconds(t) for t in self.warm_up)}")
        return f"{format_seconds(self.mean_s)}{sd} over {self.n} step{'s' if self.n != 1 else ''}{left_out}"


def split_warm_up(times: Sequence[float]) -> tuple[list[float], list[float]]:
    """(warm-up, steady) step times: leading steps slower than WARM_UP_FACTOR x the median of the steps after them
    are warm-up; at least 2 steady steps are always kept, so that a spread can still be measured."""
    times = list(times)
    cut = 0
    while len(times) - cut > 2 and times[cut] > WARM_UP_FACTOR * statistics.median(times[cut + 1:]):
        cut += 1
    return times[:cut], times[cut:]


@dataclass(frozen=True, kw_only=True)
class SpeedVerdict:
    """Whether B's steps are faster or slower than A's beyond the noise; t is Welch's (B - A) / standard error."""

    kind: SpeedKind
    a: StepStats
    b: StepStats
    t: float | None
    df: float | None


@dataclass(frozen=True, kw_only=True)
class MemoryVerdict:
    """Whether B's peak memory is lower or higher than A's by more than MEMORY_THRESHOLD."""

    kind: MemoryKind
    a_bytes: float | None
    b_bytes: float | None
    a_source: str | None
    b_source: str | None

    @property
    def relative(self) -> float | None:
        """(B - A) / A; None when either is unknown or A is 0."""
        if not plots.finite(self.a_bytes) or not plots.finite(self.b_bytes) or not self.a_bytes:
            return None
        return (self.b_bytes - self.a_bytes) / self.a_bytes


@dataclass(frozen=True, kw_only=True)
class PhaseDelta:
    """One phase in both profiles; a mean is None where the profile does not record the phase."""

    name: str
    mean_a_s: float | None
    mean_b_s: float | None

    @property
    def ratio(self) -> float | None:
        """B / A; None when either is missing or A is 0."""
        if self.mean_a_s is None or self.mean_b_s is None or self.mean_a_s <= 0:
            return None
        return self.mean_b_s / self.mean_a_s


@dataclass(frozen=True, kw_only=True)
class ConfigDifference:
    """A setting whose value differs between A and B; ``unfair`` when it changes the work a step does."""

    key: str
    a: Any
    b: Any
    unfair: bool


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Everything render_comparison says about B against A."""

    a_dir: Path
    b_dir: Path
    a: dict[str, Any]
    b: dict[str, Any]
    phases: list[PhaseDelta]
    speed: SpeedVerdict
    memory: MemoryVerdict
    differences: list[ConfigDifference]

    @property
    def unfair(self) -> list[ConfigDifference]:
        return [d for d in self.differences if d.unfair]


# ------------------------------------------------------------------------------------------------- comparing
def compare_profiles(a: Path, b: Path) -> Comparison:
    """Load profile.json of both directories and compare B against A (UsageError naming RUN_A or RUN_B)."""
    first, second = read_profile(Path(a), "RUN_A"), read_profile(Path(b), "RUN_B")
    phases = [PhaseDelta(name=name, mean_a_s=phase_mean(first, name), mean_b_s=phase_mean(second, name))
              for name in phase_names(first, second)]
    return Comparison(a_dir=Path(a), b_dir=Path(b), a=first, b=second, phases=phases,
                      speed=speed_verdict(step_times(first), step_times(second)),
                      memory=memory_verdict(first, second), differences=config_differences(first, second))


def welch_t(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None] | None:
    """Welch's t of mean(b) - mean(a) and its Welch-Satterthwaite degrees of freedom; None below 2 values a side.

    Both spreads zero (identical step times) gives t = 0 for equal means and an infinite t otherwise.
    """
    (mean_a, sd_a), (mean_b, sd_b) = mean_sd(a), mean_sd(b)
    if mean_a is None or mean_b is None or sd_a is None or sd_b is None:
        return None
    var_a, var_b = sd_a**2 / len(a), sd_b**2 / len(b)
    se = math.sqrt(var_a + var_b)
    if se == 0:
        return (0.0 if mean_a == mean_b else math.copysign(math.inf, mean_b - mean_a)), None
    df = (var_a + var_b) ** 2 / (var_a**2 / (len(a) - 1) + var_b**2 / (len(b) - 1))
    return (mean_b - mean_a) / se, df


def speed_verdict(a: Sequence[float], b: Sequence[float]) -> SpeedVerdict:
    """Faster (B's steps take less time), slower, no difference beyond the noise, or unknown (too few steps); each
    side's leading warm-up steps are left out first (split_warm_up)."""
    (warm_a, a), (warm_b, b) = split_warm_up(a), split_warm_up(b)
    stats = [StepStats(n=len(x), mean_s=mean_sd(x)[0], sd_s=mean_sd(x)[1], warm_up=tuple(w))
             for x, w in ((a, warm_a), (b, warm_b))]
    result = welch_t(a, b)
    if result is None:
        return SpeedVerdict(kind="unknown", a=stats[0], b=stats[1], t=None, df=None)
    t, df = result
    kind: SpeedKind = "no difference" if abs(t) <= T_THRESHOLD else ("faster" if t < 0 else "slower")
    return SpeedVerdict(kind=kind, a=stats[0], b=stats[1], t=t, df=df)


def memory_verdict(a: dict[str, Any], b: dict[str, Any]) -> MemoryVerdict:
    """Leaner (B's peak lower by more than MEMORY_THRESHOLD of A's), heavier, the same, or unknown."""
    peaks = [p.get("peak_memory_bytes") if plots.finite(p.get("peak_memory_bytes")) else None for p in (a, b)]
    verdict = MemoryVerdict(kind="unknown", a_bytes=peaks[0], b_bytes=peaks[1],
                            a_source=a.get("peak_memory_source"), b_source=b.get("peak_memory_source"))
    relative = verdict.relative
    if relative is None:
        return verdict
    kind: MemoryKind = "same" if abs(relative) <= MEMORY_THRESHOLD else ("leaner" if relative < 0 else "heavier")
    return MemoryVerdict(kind=kind, a_bytes=peaks[0], b_bytes=peaks[1], a_source=verdict.a_source,
                         b_source=verdict.b_source)


def _settings(profile: dict[str, Any]) -> dict[str, Any]:
    """The configuration with device, world size and effective batch filled in from the profile's top level."""
    config = profile["config"] if isinstance(profile.get("config"), dict) else {}
    settings = {k: v for k, v in config.items() if k not in NOT_COMPARED and v is not None}
    for key in ("device", "world_size"):
        if profile.get(key) is not None:
            settings[key] = profile[key]
    parts = [settings.get(k) for k in ("micro_batch_size", "grad_accum_steps")] + [settings.get("world_size", 1)]
    if "effective_batch_size" not in settings and all(isinstance(p, int) for p in parts):
        settings["effective_batch_size"] = math.prod(parts)
    return settings


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[ConfigDifference]:
    """Every setting that differs (a missing key counts as null); the unfair ones first."""
    first, second = _settings(a), _settings(b)
    keys = list(dict.fromkeys([*first, *second]))
    found = [ConfigDifference(key=k, a=first.get(k), b=second.get(k), unfair=k in UNFAIR_KEYS)
             for k in keys if first.get(k) != second.get(k)]
    return sorted(found, key=lambda d: not d.unfair)  # stable: config order within each group


# ------------------------------------------------------------------------------------------------- statements
def speed_statement(speed: SpeedVerdict) -> str:
    """One sentence on step time, with the means, spreads and the t that decided it."""
    noise = f"A: {speed.a.text()}, B: {speed.b.text()}"
    if speed.kind == "unknown":
        return (f"**Step time cannot be compared:** the run-to-run noise needs at least 2 step times per profile "
                f"({noise}).")
    t = f"Welch t = {speed.t:+.1f}" + (f", {speed.df:.0f} degrees of freedom" if speed.df is not None else "")
    if speed.kind == "no difference":
        return f"**No difference beyond the noise** in step time ({noise}; {t}, needs |t| > {T_THRESHOLD:g})."
    assert speed.a.mean_s is not None and speed.b.mean_s is not None  # a t exists, so both means do
    change = speed.b.mean_s / speed.a.mean_s - 1 if speed.a.mean_s else math.nan
    return (f"**B is {speed.kind} than A:** {format_seconds(speed.b.mean_s)} per step against A's "
            f"{format_seconds(speed.a.mean_s)} ({100 * change:+.1f}%; {t}, beyond |t| > {T_THRESHOLD:g}; {noise}).")


def memory_statement(memory: MemoryVerdict) -> str:
    """One sentence on peak memory; a note when A and B measured it differently."""
    if memory.kind == "unknown":
        missing = " and ".join(n for n, v in (("A", memory.a_bytes), ("B", memory.b_bytes)) if v is None)
        return ("**Peak memory cannot be compared:** " + (f"{missing} recorded no peak memory." if missing
                                                            else "A's peak memory is 0 bytes."))
    peaks = (f"{format_bytes(memory.b_bytes)} against A's {format_bytes(memory.a_bytes)} "
             f"({100 * (memory.relative or 0):+.1f}%")
    if memory.kind == "same":
        text = f"**Same peak memory** within {100 * MEMORY_THRESHOLD:g}%: B's {peaks})."
    else:
        text = f"**B is {memory.kind} than A:** peak memory {peaks}, beyond {100 * MEMORY_THRESHOLD:g}%)."
    if memory.a_source != memory.b_source:
        text += f" Measured differently: A by {memory.a_source or '?'}, B by {memory.b_source or '?'}."
    return text


def terminal_summary(comparison: Comparison) -> list[str]:
    """What `cadence profile --compare` prints before the file paths: the two verdicts and the ratios that matter,
    in plain text (the files hold the tables and the plot)."""
    c = comparison
    lines = [_plain(speed_statement(c.speed)), _plain(memory_statement(c.memory))]
    ratios = [f"{label} B/A {_ratio(c.a.get(key), c.b.get(key))}" for label, key in
              (("tokens/s", "tokens_per_s"), ("peak memory", "peak_memory_bytes"))]
    ratios.append(f"step time B/A {_ratio(c.speed.a.mean_s, c.speed.b.mean_s)}")
    lines.append(", ".join(ratios))
    if c.differences:
        lines.append("B differs from A in: " + ", ".join(f"{d.key} ({_value(d.a)} vs {_value(d.b)})"
                                                         + (" [unfair]" if d.unfair else "") for d in c.differences))
    return lines


def _plain(markdown: str) -> str:
    return markdown.replace("**", "")


def _value(value: Any) -> str:
    return "-" if value is None else (json.dumps(value) if isinstance(value, (dict, list)) else str(value))


def _ratio(a: Any, b: Any) -> str:
    return f"{b / a:.2f}x" if plots.finite(a) and plots.finite(b) and a > 0 else "-"


# ------------------------------------------------------------------------------------------------- rendering
def comparison_report(comparison: Comparison, *, plot_name: str | None = None) -> Report:
    """The comparison as report blocks; with ``plot_name``, a phase plot of that file name is included."""
    c = comparison
    a_name, b_name = c.a_dir.resolve().name, c.b_dir.resolve().name
    blocks: list[Block] = [Heading(text="Verdict"), Paragraph(text=speed_statement(c.speed)),
                           Paragraph(text=memory_statement(c.memory))]
    fair = [d for d in c.differences if not d.unfair]
    if fair:  # usually the point of the comparison (precision, recompute, ...): named where the verdict is read
        blocks.append(Paragraph(text="**B differs from A in:** " + ", ".join(
            f"`{d.key}` ({_value(d.a)} vs {_value(d.b)})" for d in fair) + "."))
    if c.unfair:
        blocks.append(Paragraph(text="**Warning: not like for like.** A and B differ in "
                                + ", ".join(f"`{d.key}` ({_value(d.a)} vs {_value(d.b)})" for d in c.unfair)
                                + ": their steps do different work, so step time and memory reflect that too."))
    blocks += [Heading(text="Profiles"), Paragraph(text=f"**A:** `{c.a_dir}`"), Bullets(items=setup_items(c.a)),
               Paragraph(text=f"**B:** `{c.b_dir}`"), Bullets(items=setup_items(c.b))]
    blocks += [Heading(text="Configuration differences")]
    if c.differences:
        blocks.append(Table(header=["setting", f"A ({a_name})", f"B ({b_name})", "note"], rows=[
            [f"`{d.key}`", _value(d.a), _value(d.b), "**unfair**: changes the work per step" if d.unfair else ""]
            for d in c.differences]))
    else:
        blocks.append(Paragraph(text="None: A and B ran the same configuration, so any difference is the machine "
                                     "or run-to-run noise."))
    blocks += [Heading(text="Phases"), _phase_table(c, a_name, b_name), Heading(text="Totals"),
               _totals_table(c, a_name, b_name)]
    peaks = [p.get("peak_flops") for p in (c.a, c.b)]
    if peaks[0] != peaks[1]:
        blocks.append(Paragraph(text=f"MFU is against each profile's own peak ({format_si(peaks[0], 'FLOP/s')} for A, "
                                     f"{format_si(peaks[1], 'FLOP/s')} for B), so its ratio is not the speed ratio."))
    if plot_name:
        figure = comparison_figure(c, a_name, b_name)
        blocks.append(Plot(name=plot_name, title="Mean step time by phase", png=plots.png_bytes(figure),
                           caption="Mean step of A and B split by phase; the bar length is the mean step time."))
    blocks += [Heading(text="Each profile's verdict"), Bullets(items=[
        f"**{name}:** {v.get('kind', '?')}: {v.get('figure', '-')}" for name, v in
        (("A", c.a.get("verdict")), ("B", c.b.get("verdict"))) if isinstance(v, dict)] or ["none recorded"])]
    return Report(title=f"Profile comparison: B ({b_name}) against A ({a_name})", blocks=blocks)


def _phase_table(c: Comparison, a_name: str, b_name: str) -> Table:
    rows = []
    for phase in c.phases:
        cells = [format_seconds(m) if m is not None else "not recorded" for m in (phase.mean_a_s, phase.mean_b_s)]
        rows.append([phase.name, *cells, _ratio(phase.mean_a_s, phase.mean_b_s)])
    return Table(header=["phase", f"A mean ({a_name})", f"B mean ({b_name})", "B/A"], rows=rows)


def _totals_table(c: Comparison, a_name: str, b_name: str) -> Table:
    def row(label: str, key: str, fmt: Any) -> list[str]:
        a, b = c.a.get(key), c.b.get(key)
        return [label, fmt(a), fmt(b), _ratio(a, b)]

    mfus = mfu(c.a), mfu(c.b)
    rows = [["step time (mean ± sd)", c.speed.a.text(), c.speed.b.text(), _ratio(c.speed.a.mean_s, c.speed.b.mean_s)],
            row("tokens per step", "tokens_per_step", lambda v: format_number(v, ",.0f")),
            row("tokens/s", "tokens_per_s", lambda v: format_number(v, ",.0f")),
            row("peak memory", "peak_memory_bytes", format_bytes),
            ["MFU", format_share(mfus[0]), format_share(mfus[1]), _ratio(*mfus)],
            row("peak FLOP/s (MFU denominator)", "peak_flops", lambda v: format_si(v, "FLOP/s"))]
    return Table(header=["", f"A ({a_name})", f"B ({b_name})", "B/A"], rows=rows)


def comparison_figure(c: Comparison, a_name: str, b_name: str) -> Figure:
    """One horizontal bar per profile, stacked by phase in ms: the length is the mean step time."""
    fig = plots.new_figure((8.5, 2.8))
    ax = fig.add_subplot()
    ax.set(title="Mean step time by phase", xlabel="ms per optimizer step")
    ax.grid(True, alpha=0.3)
    names = [p.name for p in c.phases]
    bars = [(f"A ({a_name})", {p.name: p.mean_a_s or 0.0 for p in c.phases}),
            (f"B ({b_name})", {p.name: p.mean_b_s or 0.0 for p in c.phases})]
    draw_phase_bars(ax, bars, names, percent=False)
    for row, (_, values) in zip((1, 0), bars):  # the mean step time at the end of each bar
        ax.text(sum(values.values()), row, f" {1000 * sum(values.values()):,.0f} ms", va="center", ha="left")
    ax.margins(x=0.1)
    ax.xaxis.set_major_formatter(lambda x, _: f"{1000 * x:,.0f}")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def render_comparison(comparison: Comparison) -> str:
    """The comparison as markdown (without the plot, which needs a file beside it: see write_comparison)."""
    return to_markdown(comparison_report(comparison))


def write_comparison(a: Path, b: Path, out_dir: Path | None = None) -> tuple[Comparison, list[Path]]:
    """Compare B against A and write the markdown, the HTML and the phase plot; return the comparison and the paths.

    Into ``out_dir`` as compare.md, compare.html and compare-phases.png; without it, into B's directory as
    compare-<A's name>.md (and .html, -phases.png), so that comparisons of B against several baselines coexist.
    """
    comparison = compare_profiles(a, b)
    if out_dir is None:
        folder, stem, where = Path(b), f"compare-{Path(a).resolve().name}", "RUN_B"
    else:
        folder, stem, where = Path(out_dir), "compare", "--out"
    md, page, png = folder / f"{stem}.md", folder / f"{stem}.html", folder / f"{stem}-phases.png"
    report = comparison_report(comparison, plot_name=png.name)
    plot = next(block for block in report.blocks if isinstance(block, Plot))
    try:
        atomic_write_bytes(png, plot.png)
        atomic_write_bytes(md, to_markdown(report).encode("utf-8"))
        atomic_write_bytes(page, to_html(report).encode("utf-8"))
    except OSError as err:  # a read-only or full disk is the user's to fix, not a traceback
        raise UsageError.single(where, f"cannot write the comparison into {folder}: {err.strerror or err}") from None
    return comparison, [md, page, png]
