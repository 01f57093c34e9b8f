"""The PNG of bench.ps: smoothed loss against wall time, one panel without and one with the
straggler, every run a line, bsp's final loss a dashed line. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

from bench.ps.analysis import Run

COLORS = {"collective dp": "0.3", "ps bsp": "tab:blue", "ps asp": "tab:red"}


def plot_loss_wall(runs: list[Run], target: float, straggler_text: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file is all we write
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, straggler in zip(axes, (False, True), strict=True):
        for run in (r for r in runs if r.straggler == straggler):
            points = run.points
            ax.plot([t for t, _ in points], [loss for _, loss in points], label=run.mode,
                    color=COLORS.get(run.mode, "tab:green"), linewidth=1.4)
        ax.axhline(target, color="0.5", linestyle="--", linewidth=1, label=f"bsp's final loss {target:.3f}")
        ax.set_title(f"straggler: {straggler_text}" if straggler else "no straggler", fontsize=9)
        ax.set_xlabel("wall time since the first step (s)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("training loss (token-weighted, smoothed)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
