"""The PNG of `undying chaos sweep`: measured goodput per checkpoint interval against the model.

x: the realised interval of each run (log scale); y: steady goodput (productive / (wall -
start-up), the quantity the model predicts). Fixed intervals are dots, adaptive rules
(young, young-daly) are marked apart, each level (storage only, two-level) in its own colour;
the first-order model curve (orchestrator.cli.chaos.goodput_model, with C and R measured over the
storage-only runs) is overlaid and Young's tau* = sqrt(2 C M) is a
vertical line. Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from orchestrator.cli.chaos.goodput_model import ModelInputs, log_grid
from orchestrator.cli.chaos.sweep import Row


def plot_sweep(rows: Sequence[Row], inputs: ModelInputs, path: str, title: str = "") -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # no display: a file is all we write
    import matplotlib.pyplot as plt

    placed = [(r, r.realised_s or r.target_s) for r in rows if (r.realised_s or r.target_s)]
    taus = [tau for _, tau in placed] + [inputs.tau_star]
    lo, hi = min(taus) / 2, max(taus) * 2
    grid = log_grid(lo, hi)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(grid, [100 * inputs.goodput(t) for t in grid], color="0.4",
            label=f"model 1 - C/tau - (tau/2 + R)/M  (C={inputs.cost_s:.2f} s, R={inputs.restart_s:.1f} s, "
                  f"M={inputs.mtbf_s:.0f} s)")
    ax.axvline(inputs.tau_star, color="tab:red", linestyle="--",
               label=f"Young tau* = sqrt(2CM) = {inputs.tau_star:.1f} s")
    for level, color in (("storage", "tab:blue"), ("two-level", "tab:green")):
        fixed = [(r, t) for r, t in placed if r.target_s is not None and r.level == level]
        if fixed:
            ax.plot([t for _, t in fixed], [100 * r.steady_goodput for r, _ in fixed], "o", color=color,
                    label=f"measured, fixed interval, {level}")
        for r, t in fixed:
            ax.annotate(r.label, (t, 100 * r.steady_goodput), textcoords="offset points", xytext=(4, 4), fontsize=8)
        adaptive = [(r, t) for r, t in placed if r.target_s is None and r.level == level]
        for marker, (r, t) in zip("*^", adaptive, strict=False):
            ax.plot([t], [100 * r.steady_goodput], marker, markersize=12,
                    color="tab:orange" if level == "storage" else "tab:olive",
                    label=f"measured, interval: {r.label}, {level}")
    ax.set_xscale("log")
    # Plain seconds on the major ticks, no labels on the minor ones (they collide on a short range).
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("checkpoint interval tau (s, realised: median gap between commits)")
    ax.set_ylabel("goodput excluding start-up (%)")
    ax.set_title(textwrap.fill(title or "goodput vs checkpoint interval", 90), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
