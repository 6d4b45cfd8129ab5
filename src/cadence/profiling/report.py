"""The report of a profile (``cadence report PROFILE_DIR``): where the step time goes, and what to try next.

``cadence profile`` writes profile.json (phases, step times, throughput, MFU, top operators and a bottleneck verdict)
beside a Chrome trace. This module turns profile.json into the same block list that the run and plan reports build,
so ``cadence.report.document.write_report`` renders it as report.md and a self-contained report.html. It also holds
what the profile comparison (``cadence.profiling.compare``) shares with it: reading profile.json, the phase order and colours, the
per-phase numbers and the stacked phase bars.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from cadence.errors import UsageError
from cadence.formatting import format_bytes, format_number, format_seconds, format_share, format_si
from cadence.records import PROFILE
from cadence.report import render as plots
from cadence.report.render import Block, Bullets, Heading, Paragraph, Plot, Report, Table
from cadence.training.noise_scale import batch_against_noise_scale

if TYPE_CHECKING:  # matplotlib itself is imported on the first plot (cadence.report.render.new_figure)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PHASE_PLOT = "report-phases.png"
PHASES = ("data_wait", "forward", "backward", "gradient_sync", "unscale_clip", "optimizer_step",
          "zero_grad_scheduler", "logging_checkpointing", "other")
"""The phases of one optimizer step in the order they happen; "other" (time in no phase) comes last."""
PHASE_COLORS = {"data_wait": "tab:gray", "forward": "tab:blue", "backward": "tab:orange",
                "gradient_sync": "tab:purple", "unscale_clip": "tab:olive", "optimizer_step": "tab:green",
                "zero_grad_scheduler": "tab:cyan", "logging_checkpointing": "tab:brown", "other": "lightgray"}
SHARE_TOLERANCE = 0.05
"""The phase shares should add up to 1 within this: beyond it, time was missed or counted twice."""
TRACE_VIEWERS = "https://ui.perfetto.dev or chrome://tracing"
WHERE = "RUN_DIR"
PROFILE_FILE = "profile.json"


# ----------------------------------------------------------------------------------------------------- reading
def read_profile(root: Path, where: str = WHERE) -> dict[str, Any]:
    """profile.json of a profile directory as a dict; UsageError naming ``where`` when it is missing or invalid."""
    root = Path(root)
    if not root.exists():
        raise UsageError.single(where, f"{root} does not exist")
    if not root.is_dir():
        raise UsageError.single(where, f"{root} is a file; give the profile directory that holds {PROFILE_FILE}")
    path = root / PROFILE_FILE
    if not path.is_file():
        raise UsageError.single(where, f"{root} holds no {PROFILE_FILE} (written by cadence profile)")
    return dict(PROFILE.read(path, where=where).data)  # the fields it has of their types; absent ones: a dash


# ---------------------------------------------------------------------------------------------- profile numbers
def _dict(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else empty: a hand-edited or older profile.json must not crash a report."""
    return value if isinstance(value, dict) else {}


def step_times(profile: dict[str, Any]) -> list[float]:
    """The finite wall times of the active steps."""
    times = profile.get("step_times_s")
    return [float(t) for t in times if plots.finite(t)] if isinstance(times, list) else []


def mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); None where there are too few values for either."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def phase_names(*profiles: dict[str, Any]) -> list[str]:
    """Phases present in any of the profiles: the known ones in step order, then unknown ones, "other" last."""
    present = list(dict.fromkeys(name for p in profiles for name in _dict(p.get("phases"))))
    known = [name for name in PHASES if name in present and name != "other"]
    extra = [name for name in present if name not in PHASES]
    return known + extra + (["other"] if "other" in present else [])


def phase_mean(profile: dict[str, Any], name: str) -> float | None:
    """Mean seconds per step of a phase (from its per-step list when mean_s is absent); None if not recorded."""
    phase = _dict(_dict(profile.get("phases")).get(name))
    if plots.finite(phase.get("mean_s")):
        return float(phase["mean_s"])
    per_step = [v for v in phase.get("per_step") or [] if plots.finite(v)]
    return mean_sd(per_step)[0]


def phase_share(profile: dict[str, Any], name: str) -> float | None:
    """Share of the step wall time spent in a phase (recorded, or its mean over the mean step time)."""
    phase = _dict(_dict(profile.get("phases")).get(name))
    if plots.finite(phase.get("share")):
        return float(phase["share"])
    mean, step = phase_mean(profile, name), mean_sd(step_times(profile))[0]
    return mean / step if mean is not None and step else None


def shares_sum(profile: dict[str, Any]) -> float | None:
    """The recorded sum of phase shares, or the sum of the shares this report shows."""
    if plots.finite(profile.get("phase_shares_sum")):
        return float(profile["phase_shares_sum"])
    shares = [phase_share(profile, name) for name in phase_names(profile)]
    return sum(s for s in shares if s is not None) if any(s is not None for s in shares) else None


def mfu(profile: dict[str, Any]) -> float | None:
    """Model FLOPs utilisation: recorded, or tokens/s x FLOPs per token / peak FLOP/s."""
    if plots.finite(profile.get("mfu")):
        return float(profile["mfu"])
    rate, flops, peak = (profile.get(k) for k in ("tokens_per_s", "model_flops_per_token", "peak_flops"))
    return rate * flops / peak if plots.finite(rate) and plots.finite(flops) and plots.finite(peak) and peak else None


def effective_batch(profile: dict[str, Any]) -> str:
    """"E = micro x accum x world" (E recorded, or the product when it is not)."""
    config = _dict(profile.get("config"))
    micro, accum = config.get("micro_batch_size", "?"), config.get("grad_accum_steps", "?")
    world = profile.get("world_size", config.get("world_size", 1))
    total = config.get("effective_batch_size")
    if not isinstance(total, int) and all(isinstance(v, int) for v in (micro, accum, world)):
        total = micro * accum * world
    return f"{total if total is not None else '?'} = {micro} micro-batch x {accum} accumulation x {world} process(es)"


def compile_line(profile: dict[str, Any]) -> str:
    """--compile's cost in a profile: the compile time, the part of it inside the active steps, the graphs."""
    inside = profile.get("compile_time_in_active_steps_s")
    graphs = profile.get("compiled_graphs")
    text = (f"compile {format_number(profile.get('compile_time_s'), '.1f')} s "
            f"({format_number(graphs, ',.0f')} graph{'' if graphs == 1 else 's'})")
    if plots.finite(inside) and inside > 0:
        return text + (f", {format_seconds(inside)} of it inside the active steps (a new shape recompiled): their "
                       f"step times include it")
    return text + ", all before the active steps: their step times hold none of it"


def setup_items(profile: dict[str, Any]) -> list[str]:
    """Model, device, precision, batch and schedule: what the numbers of a profile are numbers of."""
    config = _dict(profile.get("config"))
    get = config.get
    params = get("model_parameters")
    schedule = _dict(profile.get("schedule"))
    tokens = profile.get("tokens_per_step")
    return [
        f"**Model:** {get('model', '?')}" + (f", {params:,} parameters" if isinstance(params, int) else ""),
        f"**Device:** {profile.get('device', get('device', '?'))}, {profile.get('world_size', 1)} process(es); "
        f"**precision:** {get('precision', '?')}; recompute {get('activation_checkpointing', 'none')}; "
        f"offload {get('offload', 'none')}",
        f"**Effective batch:** {effective_batch(profile)}"
        + (f" = {format_number(tokens, ',.0f')} tokens per optimizer step" if plots.finite(tokens) else ""),
        f"**Sequence length:** {get('seq_len', '?')} tokens",
        f"**Profiled:** {schedule.get('active', len(step_times(profile)))} active optimizer steps after "
        f"{schedule.get('wait', '?')} wait and {schedule.get('warmup', '?')} warm-up; {profile.get('created', '?')}",
    ]


# ---------------------------------------------------------------------------------------------------- figures
def draw_phase_bars(ax: Axes, bars: Sequence[tuple[str, dict[str, float]]], phases: Sequence[str], *,
                    percent: bool) -> None:
    """Horizontal bars, one per (label, phase -> value), each stacked by phase in step order, top bar first.

    Segments wide enough to hold it carry their value, so the figure can be read without the table.
    """
    largest = max([sum(v for v in values.values() if plots.finite(v)) for _, values in bars] + [1e-12])
    lefts = [0.0] * len(bars)
    rows = list(range(len(bars)))[::-1]  # the first bar on top, as it is listed first
    for phase in phases:
        widths = [values.get(phase) or 0.0 for _, values in bars]
        widths = [w if plots.finite(w) else 0.0 for w in widths]
        ax.barh(rows, widths, left=lefts, height=0.6, color=PHASE_COLORS.get(phase), label=phase,
                edgecolor="white", linewidth=0.5)
        for row, left, width in zip(rows, lefts, widths):
            if width >= 0.05 * largest:
                text = f"{100 * width:.0f}%" if percent else f"{width * 1000:.0f} ms"
                ax.text(left + width / 2, row, text, ha="center", va="center", fontsize="small")
        lefts = [left + width for left, width in zip(lefts, widths)]
    ax.set_yticks(rows, [label for label, _ in bars])
    ax.grid(False, axis="y")


def phase_figure(profile: dict[str, Any]) -> Figure:
    """Top: the mean step split by phase (share of the wall time). Bottom: every active step, stacked in ms."""
    phases = phase_names(profile)
    fig = plots.new_figure((8.5, 5.6))
    top, bottom = fig.subplots(2, 1, height_ratios=[1, 2.6])
    top.set(title="Where the step time goes (mean over the active steps)", xlabel="share of the step wall time")
    top.grid(True, alpha=0.3)
    draw_phase_bars(top, [("mean step", {p: phase_share(profile, p) or 0.0 for p in phases})], phases, percent=True)
    top.xaxis.set_major_formatter(lambda x, _: f"{100 * x:.0f}%")
    bottom.set(title="Each active step, by phase", xlabel="active step", ylabel="ms")
    bottom.grid(True, alpha=0.3, axis="y")
    times = step_times(profile)
    steps = list(range(1, len(times) + 1))
    heights = [0.0] * len(times)
    for phase in phases:
        per_step = _dict(_dict(profile.get("phases")).get(phase)).get("per_step") or []
        values = [1000 * per_step[i] if i < len(per_step) and plots.finite(per_step[i]) else 0.0
                  for i in range(len(times))]
        bottom.bar(steps, values, bottom=heights, width=0.7, color=PHASE_COLORS.get(phase), label=phase)
        heights = [h + v for h, v in zip(heights, values)]
    # The measured step time on top of each bar: a gap or an overshoot shows time the phases miss or double-count.
    bottom.plot(steps, [1000 * t for t in times], "_", color="black", ms=22, mew=2, label="measured step time")
    bottom.set_xticks(steps)
    by_label = dict(zip(*reversed(bottom.get_legend_handles_labels())))
    # The step-time marker, then the phases top-down as they are stacked.
    order = ["measured step time", *reversed(phases)]
    bottom.legend([by_label[label] for label in order], order, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize="small")
    return fig


# --------------------------------------------------------------------------------------------------- the report
def profile_report(root: Path) -> Report:
    """The report of a profile directory: setup, verdict, phases (table and plot), throughput, operators, trace."""
    root = Path(root)
    profile = read_profile(root)
    blocks: list[Block] = [Heading(text="Setup"), Bullets(items=setup_items(profile))]
    blocks += _verdict(_dict(profile.get("verdict")))
    blocks += _step_time(profile)
    blocks += _phases(profile)
    blocks += _throughput(profile)
    blocks += _noise_scale(profile)
    blocks += _operators(profile.get("top_operators"))
    blocks += _optimizer_regions(profile)
    blocks += _trace(root, profile.get("trace"))
    if profile.get("version") not in (None, 1):
        blocks.append(Paragraph(text=f"**Note:** {PROFILE_FILE} version {profile.get('version')}; this report "
                                     "reads version 1 and may miss fields."))
    model = _dict(profile.get("config")).get("model", "?")
    return Report(title=f"Profile report: {model}, {root.resolve().name}", blocks=blocks)


def _verdict(verdict: dict[str, Any]) -> list[Block]:
    if not verdict:
        return [Heading(text="Verdict"), Paragraph(text=f"**No verdict** was recorded in {PROFILE_FILE}.")]
    return [Heading(text=f"Verdict: {verdict.get('kind', '?')}"),
            Paragraph(text=f"**{verdict.get('kind', '?')}**: {verdict.get('figure', 'no figure recorded')}."),
            Paragraph(text=f"**Try next:** {verdict.get('advice') or 'no advice recorded'}")]


def _step_time(profile: dict[str, Any]) -> list[Block]:
    times = step_times(profile)
    mean, sd = mean_sd(times)
    text = (f"**{format_seconds(mean)}** per optimizer step" + (f" ± {format_seconds(sd)}" if sd is not None else "")
            + f" over {len(times)} active steps" + (f" (fastest {format_seconds(min(times))}, slowest "
                                                    f"{format_seconds(max(times))})" if times else "")
            + "; wall time, data wait included.")
    return [Heading(text="Step time"), Paragraph(text=text)]


def _phases(profile: dict[str, Any]) -> list[Block]:
    names = phase_names(profile)
    if not names:
        return [Heading(text="Phases"), Paragraph(text=f"{PROFILE_FILE} records no phases.")]
    peaks = _dict(profile.get("phase_peak_memory_bytes"))
    rows = [[name, format_seconds(phase_mean(profile, name)), format_share(phase_share(profile, name)),
             format_bytes(peaks.get(name))] for name in names]
    total = shares_sum(profile)
    rows.append(["**step**", f"**{format_seconds(mean_sd(step_times(profile))[0])}**", f"**{format_share(total)}**",
                 f"**{format_bytes(profile.get('peak_memory_bytes'))}**"])
    blocks: list[Block] = [Heading(text="Phases"), Table(
        header=["phase", "mean time", "share of step wall time", "peak memory in the phase"], rows=rows)]
    if total is not None and abs(total - 1) > SHARE_TOLERANCE:
        blocks.append(Paragraph(text=f"**Warning:** the phase shares add up to {format_share(total)}, not 100% "
                                     f"(tolerance {100 * SHARE_TOLERANCE:.0f}%): some time was missed or counted "
                                     "twice, so read the shares with care."))
    if step_times(profile):
        blocks.append(Plot(name=PHASE_PLOT, title="Where the step time goes", png=plots.png_bytes(
            phase_figure(profile)), caption="Top: share of the mean step wall time per phase. Bottom: each active "
                                            "step stacked by phase; black bars: the measured step time."))
    return blocks


def _throughput(profile: dict[str, Any]) -> list[Block]:
    get = profile.get
    rate, flops, peak = get("tokens_per_s"), get("model_flops_per_token"), get("peak_flops")
    achieved = rate * flops if plots.finite(rate) and plots.finite(flops) else None
    items = [
        f"**Throughput:** {format_number(rate, ',.0f')} tokens/s "
        f"({format_number(get('tokens_per_step'), ',.0f')} tokens per optimizer step)",
        f"**MFU:** {format_share(mfu(profile))} = tokens/s x model FLOPs per token / peak FLOP/s "
        f"= {format_si(achieved, 'FLOP/s')} / {format_si(peak, 'FLOP/s')}",
        f"**Model FLOPs per token:** {format_si(flops, 'FLOP')} ({get('flops_formula') or 'formula not recorded'})",
        f"**Peak FLOP/s:** {format_si(peak, 'FLOP/s')} ({get('peak_flops_source') or 'source not recorded'})",
        f"**Peak memory:** {format_bytes(get('peak_memory_bytes'))}"
        + (f" ({get('peak_memory_source')})" if get("peak_memory_source") else ""),
    ]
    if get("padding_fraction") is not None:  # profiles written before padding was counted have none
        order = (get("config") or {}).get("micro_batch_order") or "drawn"
        items.append(f"**Padding:** {format_share(get('padding_fraction'))} of the positions computed are right "
                     f"padding (micro-batch order: {order}); tokens/s counts real tokens only")
    if get("compile_time_s") is not None:  # --compile
        items.append(f"**Compiled:** {compile_line(profile)}")
    return [Heading(text="Throughput and MFU"), Bullets(items=items)]


def _noise_scale(profile: dict[str, Any]) -> list[Block]:
    """The effective batch against the gradient noise scale measured over the profiled windows: a batch far above
    the critical one wastes compute as surely as a step that waits on data."""
    if "grad_noise_scale" not in profile:  # a profile from before cadence measured it
        return []
    value, effective = profile.get("grad_noise_scale"), _dict(profile.get("config")).get("effective_batch_size")
    if plots.finite(value) and value > 0 and plots.finite(effective) and effective > 0:
        windows = profile.get("grad_noise_scale_windows")
        text = batch_against_noise_scale(float(effective), float(value),
                                         windows=windows if isinstance(windows, int) else None)
        text += " Over a profile's few windows the estimate is rough; a run's moving average is the figure to trust."
    else:
        text = f"**No estimate:** {profile.get('grad_noise_scale_note') or 'not recorded'}."
    return [Heading(text="Effective batch and the gradient noise scale"), Paragraph(text=text)]


def _operators(operators: Any) -> list[Block]:
    rows = [[f"`{op.get('name', '?')}`", format_number(op.get("calls"), ",.0f"), format_seconds(op.get("self_time_s")),
             format_seconds(op.get("total_time_s")), format_share(op.get("share"))]
            for op in operators or [] if isinstance(op, dict)]
    if not rows:
        return [Heading(text="Top operators"), Paragraph(text=f"{PROFILE_FILE} records no operators.")]
    return [Heading(text="Top operators"), Table(
        header=["operator", "calls", "self time", "total time", "self time / active wall time"], rows=rows),
        Paragraph(text="Times are summed over all active steps; self time excludes the operators each one calls.")]


def _optimizer_regions(profile: dict[str, Any]) -> list[Block]:
    """The regions the optimizer named inside its step (Muon's Newton-Schulz) against the optimizer step's phase."""
    regions = _dict(profile.get("optimizer_regions"))
    step = _dict(_dict(profile.get("phases")).get("optimizer_step"))
    items = [f"`{name}`: {format_number(region.get('calls'), ',.0f')} calls, {format_seconds(region.get('total_time_s'))}"
             f" in all, {format_share(region.get('share'))} of the active wall time (the whole optimizer step: "
             f"{format_share(step.get('share'))})" for name, region in regions.items() if isinstance(region, dict)]
    return [Heading(text="Inside the optimizer step"), Bullets(items=items)] if items else []


def _trace(root: Path, trace: Any) -> list[Block]:
    if not trace:
        return [Heading(text="Trace"), Paragraph(text="No trace file was recorded.")]
    path = root / str(trace)
    size = f", {format_bytes(path.stat().st_size)}" if path.is_file() else ", **not found in this directory**"
    return [Heading(text="Trace"), Paragraph(
        text=f"Timeline of every operator and phase: `{trace}`{size}. Open it in {TRACE_VIEWERS}.")]
