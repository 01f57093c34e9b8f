"""The docs section of an `undying chaos sweep` result (its --out JSON), written by bench.goodput --sweep.

The sweep itself is a user command; this only turns its JSON into a markdown section with the
table, the fitted model, the verdict on Young's interval and the plot, so the figures in
docs/benchmarks.md always come from one recorded run.
"""

from __future__ import annotations

from orchestrator.cli.chaos.goodput_model import ModelInputs
from orchestrator.cli.chaos.sweep import Row, against_best, table

SECTION = "## Checkpoint interval sweep: measured goodput vs Young's tau*"
NOTES = ("<!-- sweep-notes: kept when python -m bench.goodput rewrites this section -->", "<!-- /sweep-notes -->")


def sweep_section(data: dict, command: str, plot: str | None, date: str, seconds: float | None) -> str:
    rows = [Row(**r) for r in data["rows"]]
    summary = data["summary"]
    inputs = ModelInputs(**summary["model"])
    best = summary["best_fixed"]
    verdicts = [f"- tau* = sqrt(2 C M) = {inputs.tau_star:.1f} s with C = {inputs.cost_s:.3f} s (median blocking "
                f"save, {inputs.saves} saves), M = {inputs.mtbf_s:.0f} s (the injected system MTBF), and the model's "
                f"R = {inputs.restart_s:.1f} s (median fault -> training again, {inputs.restarts} recoveries)."]
    if best:
        verdicts.append(f"- best fixed interval: {best['label']} (realised {best['realised_s']:.1f} s), "
                        f"{100 * best['steady_goodput']:.1f}% goodput excluding start-up.")
    for rule in ("young", "young-daly"):
        if rule in summary:
            side = against_best(summary[rule]["points_below_best"])
            verdicts.append(f"- `interval: {rule}`: {side} the best fixed interval (realised interval "
                            f"{summary[rule]['realised_s'] or 0:.1f} s), given the injected system MTBF as its prior "
                            f"(checkpoint.mtbf_s = {inputs.mtbf_s:.0f} s, as the sweep sets it).")
    command = command or data.get("command", "")
    took = f" ({seconds / 60:.0f} minutes)" if seconds else ""
    picture = f"\n![goodput vs interval]({plot})\n" if plot else ""
    return f"""{SECTION}

Measured by `undying chaos sweep` on {date}{took}. Command:

```bash
{command}
```

Each row is one run of the same job under the same seeded failure process
({data['chaos']['mtbf_kind']} with chaos.mtbf_s = {data['chaos']['mtbf_s']:g} s per rank, seed {data['chaos']['seed']},
none before {data['chaos']['mtbf_start_s']:g} s: a system MTBF of {data['system_mtbf_s']:.0f} s). Fixed intervals are
converted to `checkpoint.every_steps` with the step time of a short failure-free run ({data['step_s']:.3f} s), because
the controller converts `every_seconds` to steps only at the first restore. "Steady goodput" is productive /
(wall - start-up), the quantity the first-order model 1 - C/tau - (tau/2 + R)/M predicts; "model" is that
prediction at the run's realised interval (median gap between commits with no failure between them).

{table(rows, inputs)}

{chr(10).join(verdicts)}
{picture}"""
