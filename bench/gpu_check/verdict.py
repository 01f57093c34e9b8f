"""Rows of the GPU check's table, their tolerances, and the exit code they add up to.

Every check becomes one `Row`: what was measured, the target it is judged against, and a
status. Only `FAIL` changes the exit code; `info` rows are context (a bandwidth, a speed-up),
`not tested` says plainly what this machine could not exercise (a reduce-scatter on a world of
one), `unknown` is a judgement the check cannot make (MFU on a GPU without a known peak).

Exit codes of `python -m bench.gpu_check`: 0 every judged check within tolerance; 1 at least
one out of tolerance (or a check that raised); 3 no CUDA device, nothing checked.
"""

from __future__ import annotations

from dataclasses import dataclass

OK, FAIL, INFO, NOT_TESTED, UNKNOWN = "ok", "FAIL", "info", "not tested", "unknown"
STATUSES = (OK, FAIL, INFO, NOT_TESTED, UNKNOWN)

EXIT_OK, EXIT_OUT_OF_TOLERANCE, EXIT_NO_CUDA = 0, 1, 3


@dataclass(frozen=True)
class Row:
    check: str
    measured: str
    target: str = ""
    status: str = INFO

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row {self.check!r}: status {self.status!r} is not one of {STATUSES}")

    def to_json(self) -> dict:
        return {"check": self.check, "measured": self.measured, "target": self.target, "status": self.status}


def judged(check: str, measured: str, target: str, ok: bool) -> Row:
    return Row(check, measured, target, OK if ok else FAIL)


def within_relative(measured: float, reference: float, tolerance: float) -> bool:
    """|measured / reference - 1| <= tolerance; False for a non-positive reference (nothing to
    compare with is not a pass)."""
    if reference <= 0:
        return False
    return abs(measured / reference - 1.0) <= tolerance + 1e-12  # 85 / 100 - 1 is -0.15000000000000002


def exit_code(rows: list[Row]) -> int:
    return EXIT_OUT_OF_TOLERANCE if any(row.status == FAIL for row in rows) else EXIT_OK


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned plain-text table, a header and one line per row, then a summary
    line counting the statuses (so a failure is visible without reading every row)."""
    header = ("check", "measured", "target", "status")
    cells = [header] + [(r.check, r.measured, r.target, r.status) for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    counts = {status: sum(1 for r in rows if r.status == status) for status in STATUSES}
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    verdict = "FAILED" if counts[FAIL] else "passed"
    lines.append(f"gpu-check {verdict}: {summary or 'no rows'}")
    return "\n".join(lines)


def format_markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table, to paste into docs/benchmarks.md as they are."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| check | measured | target | status |", "| --- | --- | --- | --- |"]
    lines += [f"| {cell(r.check)} | {cell(r.measured)} | {cell(r.target)} | {r.status} |" for r in rows]
    return "\n".join(lines)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"
