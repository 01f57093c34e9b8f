"""The run timeline PNG: loss over steps, the job's events over time, and where the time went.

Protocol. Called once per run, after the `RunReport` is built (`undying run --timeline` at the
end of a job, `undying chaos` after its faulty run, `undying report` from an event log); it only
reads the report. `timeline_figure` draws the figure and returns it (tests inspect its artists);
`plot_timeline` draws and saves it. The events panel marks, each with its gid: every injected
fault that fired (`fault`, a triangle at the top, labelled with its kind and rank: the report's
`faults`, or for a report without them each failure whose fault time is known), every failure's
detection (`detection`, a line) and its return to training (`recovery`, a triangle at the
bottom, the span from detection shaded). matplotlib is an optional
dependency (`undying[plot]`), imported inside `plot_timeline` so the core never needs it.
The figure is drawn on an Agg canvas directly, without pyplot, so no global backend or
figure registry is touched and it is safe beside other users of matplotlib in the process.
"""

from __future__ import annotations

import os
from pathlib import Path

from monitor.goodput import BUCKETS, PRODUCTIVE
from monitor.report import RunReport

# One fixed colour per bucket so every report reads the same way; productive is the only green.
BUCKET_COLORS = {
    "productive": "#2ca02c",
    "startup": "#7f7f7f",
    "checkpoint_save": "#1f77b4",
    "checkpoint_restore": "#17becf",
    "detection": "#d62728",
    "reformation": "#ff7f0e",
    "lost_work": "#9467bd",
    "waiting_for_resources": "#bcbd22",
    "data": "#e377c2",
    "other": "#8c564b",
}
_FAILURE_COLOR = "#d62728"
_FAULT_COLOR = "#7b0000"
_RECOVERY_COLOR = "#2ca02c"
_CHECKPOINT_COLOR = "#1f77b4"


def plot_timeline(report: RunReport, path: str | os.PathLike, title: str | None = None) -> None:
    """Write the timeline of `report` as a PNG to a local `path` (parent directory created);
    `title`, when given, is a first line above the job's status (`undying chaos`: the faults)."""
    fig = timeline_figure(report, title)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png", dpi=100)


def timeline_figure(report: RunReport, title: str | None = None):
    """The timeline of `report` as a matplotlib Figure on an Agg canvas (not saved)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, events_ax, goodput_ax = fig.subplots(3, 1, height_ratios=[3, 2, 1])
    status = f"{report.job}: {report.status}, goodput {100 * report.goodput.ratio:.1f}%"
    fig.suptitle(f"{title}\n{status}" if title else status)
    _plot_loss(loss_ax, report)
    _plot_events(events_ax, report)
    _plot_goodput(goodput_ax, report)
    return fig


def _plot_loss(ax, report: RunReport) -> None:
    """Loss over steps; committed checkpoints and failures (where their step is known) marked."""
    ax.set_title("loss")
    ax.set_xlabel("step")
    if report.losses:
        ax.plot([p.step for p in report.losses], [p.loss for p in report.losses], color="black", lw=1,
                label="training loss")
    if report.evals:  # after N steps: beside the loss of step index N - 1
        ax.plot([p.step - 1 for p in report.evals], [p.loss for p in report.evals], "o-", color="#e377c2",
                ms=4, lw=1, label="validation loss")
    for i, ckpt in enumerate(report.checkpoints):  # step N holds N steps: after the loss of step index N - 1
        ax.axvline(ckpt.step - 1, color=_CHECKPOINT_COLOR, ls=":", lw=1, label="checkpoint" if i == 0 else None)
    failed_steps = [f.step for f in report.failures if f.step is not None]
    for i, step in enumerate(failed_steps):
        ax.axvline(step, color=_FAILURE_COLOR, lw=1.5, label="failure" if i == 0 else None)
    if report.checkpoints or failed_steps:
        ax.legend(loc="upper right")


def _plot_events(ax, report: RunReport) -> None:
    """World size and throughput over job time, with failures, recovery spans and checkpoint commits."""
    ax.set_title("events and throughput")
    ax.set_xlabel("job seconds")
    ax.set_ylabel("world size")
    wall = report.goodput.wall_s
    if report.world_history:
        times = [w.started_at for w in report.world_history] + [wall]
        sizes = [w.world_size for w in report.world_history]
        ax.step(times, [*sizes, sizes[-1]], where="post", color="black", lw=1)
        ax.set_ylim(0, 1.6 * max(sizes))  # headroom: the line at the top stays clear of the fault labels
    _mark_failures(ax, report)
    for i, ckpt in enumerate(report.checkpoints):
        ax.axvline(
            ckpt.committed_at, color=_CHECKPOINT_COLOR, ls=":", lw=1, label="checkpoint" if i == 0 else None
        )
    ax.set_xlim(0, max(wall, 1e-9))
    if report.failures or report.faults or report.checkpoints:  # under the panel: never over a mark
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, fontsize="small", frameon=False)
    timed = [p for p in report.losses if p.time is not None and p.tokens_per_s is not None]
    if timed:  # throughput on its own axis: it drops to nothing while a failure is handled
        tput = ax.twinx()
        tput.plot([p.time for p in timed], [p.tokens_per_s for p in timed], ".", ms=2, color="#2ca02c")
        tput.set_ylabel("tokens/s", color="#2ca02c")
        tput.set_ylim(0, 1.2 * max(p.tokens_per_s for p in timed))


def fault_marks(report: RunReport) -> list[tuple[float, str]]:
    """(job seconds, "kind rN") of each injected fault that fired: the report's `faults`; a report
    without them (an older one) gives each failure whose fault time is known."""
    def who(kind: str, rank: int | None) -> str:
        return kind + (f" r{rank}" if rank is not None else "")

    if report.faults:
        return [(f.time, who(f.kind, f.rank)) for f in report.faults if f.time is not None]
    return [(f.time - f.detected_after_s, who(f.kind, f.rank)) for f in report.failures
            if f.detected_after_s is not None]


def _mark_failures(ax, report: RunReport) -> None:
    """Each fault, each failure's detection and recovery, with gids (module doc). A fault and its
    detection are often milliseconds apart, so they differ in shape, not only place."""
    top_bottom = ax.get_xaxis_transform()  # x in job seconds, y in axes fractions
    first = {"fault": True, "detection": True, "recovery": True}

    def label(name: str, text: str) -> str | None:
        shown, first[name] = first[name], False
        return text if shown else None

    wall, previous, stacked = max(report.goodput.wall_s, 1e-9), None, 0
    for at, text in fault_marks(report):
        ax.plot([at], [0.97], "v", ms=9, color=_FAULT_COLOR, transform=top_bottom, clip_on=False,
                gid="fault", label=label("fault", "fault"))
        # Faults a moment apart (two kills in one step) get their labels one under the other;
        # a label near the right edge goes left of its mark.
        stacked = stacked + 1 if previous is not None and at - previous < 0.03 * wall else 0
        previous, right = at, at > 0.85 * wall
        ax.annotate(text, (at, 0.97), xycoords=top_bottom, xytext=(-4 if right else 4, -4 - 9 * stacked),
                    textcoords="offset points", fontsize="x-small", va="top", ha="right" if right else "left",
                    color=_FAULT_COLOR)
    for failure in report.failures:
        ax.axvline(failure.time, color=_FAILURE_COLOR, lw=1.5, gid="detection",
                   label=label("detection", "detected"))
        if failure.recovered_after_s is not None:
            end = failure.time + failure.recovered_after_s
            ax.axvspan(failure.time, end, color=_FAILURE_COLOR, alpha=0.15)
            ax.plot([end], [0.03], "^", ms=9, color=_RECOVERY_COLOR, transform=top_bottom, clip_on=False,
                    gid="recovery", label=label("recovery", "training again"))


def _plot_goodput(ax, report: RunReport) -> None:
    """One horizontal bar of wall time, stacked by bucket (productive first)."""
    ax.set_title("where the time went")
    ax.set_xlabel("job seconds")
    seconds = {PRODUCTIVE: report.goodput.productive_s, **report.goodput.badput_s}
    left = 0.0
    for bucket in BUCKETS:
        value = seconds.get(bucket, 0.0)
        if value <= 0:
            continue
        ax.barh(0, value, left=left, color=BUCKET_COLORS[bucket], label=f"{bucket} {value:.1f}s")
        left += value
    ax.set_yticks([])
    ax.set_xlim(0, max(report.goodput.wall_s, 1e-9))
    if left > 0:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, fontsize="small", frameon=False)
