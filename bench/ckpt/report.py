"""Numbers and tables of bench.ckpt: reduce the ranks' timestamps, compare with DCP, check the targets.

Reduction of one operation (every rank's `time.time()` stamps):
  blocking  the worst rank's seconds inside the save call (training stopped that long);
  total     first rank starting -> the save is a checkpoint (ours: the manifest commit;
            DCP: the last rank's `save` returning / async future completing), or -> the
            last loading rank done; ranks with nothing to load in a layout are left out.
Each metric is the median over the repeats, with [min-max].
"""

from __future__ import annotations

import statistics
from collections import defaultdict

GB = 1e9

# (metric key, label, ours key, DCP key, unit): rows of the side-by-side table.
ROWS = [
    ("blocking", "training-blocking time per save, async", "ours_async", "dcp_async", "s"),
    ("blocking", "training-blocking time per save, sync", "ours_sync", "dcp_save", "s"),
    ("total", "total save time, async (-> committed)", "ours_async", "dcp_async", "s"),
    ("total", "total save time, sync", "ours_sync", "dcp_save", "s"),
    ("gbps", "save throughput, async", "ours_async", "dcp_async", "GB/s"),
    ("gbps", "save throughput, sync", "ours_sync", "dcp_save", "GB/s"),
]
LAYOUT_NAMES = {"dp4": "same layout (dp4)", "dp2": "resharded to dp2 (2 ranks, row halves)",
                "tp4": "resharded to tp4 (weights split by columns)"}


def reduce_op(record: dict, total_bytes: int) -> dict:
    ranks = [r for r in record["ranks"] if r.get("active", True)]
    start = min(r["start"] for r in ranks)
    total = max(r["end"] for r in ranks) - start
    out = {"total": total, "gbps": total_bytes / total / GB}
    if "blocking" in ranks[0]:
        out["blocking"] = max(r["blocking"] for r in ranks)
    if "nbytes" in ranks[0] and record["op"] in ("raw_read", "ours_load"):
        out["read_bytes"] = sum(r["nbytes"] for r in ranks)
        out["gbps"] = out["read_bytes"] / total / GB
    return out


def summarise(result: dict) -> dict:
    """backend -> operation name (with layout) -> metric -> [values over repeats]."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for record in result["records"]:
        name = record["op"] + (f"/{record['layout']}" if "layout" in record else "")
        for key, value in reduce_op(record, result["total_bytes"]).items():
            out[record["backend"]][name][key].append(value)
    return {b: {n: dict(m) for n, m in ops.items()} for b, ops in out.items()}


def med(values: list[float]) -> float:
    return statistics.median(values)


def cell(values: list[float] | None, unit: str) -> str:
    if not values:
        return "-"
    digits = 2 if unit == "GB/s" else 3
    text = f"{med(values):.{digits}f} {unit}"
    if len(values) > 1:
        text += f" [{min(values):.{digits}f}-{max(values):.{digits}f}]"
    return text


def ratio(ours: list[float] | None, anchor: list[float] | None) -> str:
    if not ours or not anchor or med(anchor) == 0:
        return "-"
    return f"{med(ours) / med(anchor):.2f}x"


def backend_table(ops: dict, layouts: list[str]) -> str:
    lines = ["| metric | undying | DCP | undying / DCP |", "|---|---|---|---|"]
    for key, label, ours, anchor, unit in ROWS:
        a, b = ops.get(ours, {}).get(key), ops.get(anchor, {}).get(key)
        lines.append(f"| {label} | {cell(a, unit)} | {cell(b, unit)} | {ratio(a, b)} |")
    for layout in layouts:
        a, b = ops.get(f"ours_load/{layout}", {}).get("total"), ops.get(f"dcp_load/{layout}", {}).get("total")
        lines.append(f"| load, {LAYOUT_NAMES[layout]} | {cell(a, 's')} | {cell(b, 's')} | {ratio(a, b)} |")
    raw = ops.get("raw_read", {})
    lines.append(f"| raw parallel read of our shard files (floor) | {cell(raw.get('total'), 's')} "
                 f"({cell(raw.get('gbps'), 'GB/s')}) | - | - |")
    return "\n".join(lines)


def targets(ops: dict, backend: str, layouts: list[str]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, limit, met) for each checkpoint target that this backend's numbers decide."""
    def m(name: str, key: str) -> float | None:
        values = ops.get(name, {}).get(key)
        return med(values) if values else None

    out = []
    blocking, sync_total = m("ours_async", "blocking"), m("ours_sync", "total")
    if blocking is not None and sync_total:
        out.append(("async blocking / our sync save", blocking / sync_total, 0.1, blocking / sync_total <= 0.1))
    dcp_blocking = m("dcp_async", "blocking")
    if blocking is not None and dcp_blocking:
        value = blocking / dcp_blocking
        out.append(("async blocking / DCP async_save blocking", value, 1.0, value <= 1.0))
    for mode in ("ours_async", "ours_sync"):
        ours, dcp = m(mode, "gbps"), m("dcp_save", "gbps")
        if ours and dcp:
            out.append((f"save throughput ({mode.split('_')[1]}) / dcp.save", ours / dcp, 1.0, ours >= dcp))
    same = m("ours_load/dp4", "total")
    for layout in layouts:
        other = m(f"ours_load/{layout}", "total")
        if layout != "dp4" and same and other:
            out.append((f"resharded load ({layout}) / same-layout load", other / same, 1.2, other / same <= 1.2))
    raw = m("raw_read", "total")
    if backend == "s3" and same and raw:
        out.append(("same-layout load / raw parallel read", same / raw, 1.3, same / raw <= 1.3))
    return out


def read_lines(ops: dict, layouts: list[str], total_bytes: int) -> str:
    """Bytes `read_slices` fetched per layout (all ranks), against the state's size: the read amplification."""
    parts = []
    for layout in layouts:
        values = ops.get(f"ours_load/{layout}", {}).get("read_bytes")
        if values:
            parts.append(f"{layout} {med(values) / GB:.2f} GB ({med(values) / total_bytes:.2f}x the state)")
    return "- bytes fetched by `read_slices`, all ranks: " + ", ".join(parts) if parts else ""


def target_lines(ops: dict, backend: str, layouts: list[str]) -> str:
    lines = []
    for what, value, limit, met in targets(ops, backend, layouts):
        bound = "at least" if "throughput" in what else "at most"
        lines.append(f"- {backend}: {what} = {value:.3f} (target {bound} {limit:g}: {'met' if met else 'NOT met'})")
    return "\n".join(lines)


def tvp_table(tvp: dict) -> str:
    lines = ["| storage | writer | blocking (staging) | save -> durable | seconds per step / baseline "
             "| training time lost per window |", "|---|---|---|---|---|---|"]
    for backend, run in tvp.items():
        for name, r in run["writers"].items():
            trials = r["trials"]
            slow = [t["slowdown"] for t in trials]
            save = name != "none"
            lines.append(f"| {backend} | {name if save else 'none (noise floor)'} "
                         f"| {cell([t['blocking'] for t in trials], 's') if save else '-'} "
                         f"| {cell([t['write'] for t in trials], 's') if save else '-'} "
                         f"| {med(slow):.2f}x [{min(slow):.2f}-{max(slow):.2f}] "
                         f"| {cell([t['lost'] for t in trials], 's')} |")
    return "\n".join(lines)


def tvp_verdict(tvp: dict) -> str:
    """Which writer costs training less and which finishes sooner, per backend, with the medians."""
    lines = []
    for backend, run in tvp.items():
        w = run["writers"]
        thread, proc, none = w["thread"], w["process"], w["none"]
        noise = max(abs(t["lost"]) for t in none["trials"])
        gap = thread["median_lost"] - proc["median_lost"]
        if len(none["trials"]) < 3:  # one trial of no writer is its own baseline: its spread is not measured
            cost = (f"the difference is {abs(gap):.3f} s, from {len(none['trials'])} trial(s): the noise floor is not "
                    "measured (--tvp-repeats 3 or more), so no winner is called")
        elif abs(gap) <= noise:
            cost = f"the difference ({abs(gap):.3f} s) is within the noise floor ({noise:.3f} s): no clear winner"
        else:
            cost = f"the {'process' if gap > 0 else 'thread'} writer costs training {abs(gap):.3f} s less per save"
        sooner = "process" if proc["median_write"] < thread["median_write"] else "thread"
        lines.append(f"- {backend} (window {run['window_s']:.2f} s, baseline {run['baseline_step_s'] * 1e3:.1f} ms "
                     f"per step): training lost per save {thread['median_lost']:.3f} s (thread) vs "
                     f"{proc['median_lost']:.3f} s (process): {cost}; durable after {thread['median_write']:.2f} s "
                     f"(thread) vs {proc['median_write']:.2f} s (process): the {sooner} writer finishes sooner.")
    return "\n".join(lines)
