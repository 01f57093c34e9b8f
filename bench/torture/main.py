"""Save torture: SIGKILL a process in the middle of a real checkpoint save, at random points, and check
that no bad checkpoint is ever loadable.

    .venv/bin/python -m bench.torture [--points 50] [--backends file s3] [--seed 1] [--no-docs]

The writer is a real process doing a real save (tests/_torn_writer.py, forked from a server that
imported torch once): four ranks' `ShardWriter`s write their shards in background threads, the
controller's `Committer` merges the receipts and commits the manifest by exclusive create
(`Catalog.commit`), step 10 first and then step 20, the save that is killed. On file:// (a temp
dir) and on s3:// (a SeaweedFS `weed mini` this script starts on free loopback ports and stops by
PID, tests/s3/_seaweed.py; model/big goes up in 5 MiB multipart parts), every point gets a fresh
checkpoint root and one SIGKILL, timed from an event the writer reports:
  * half uniformly over the whole step-20 save (measured by one save run to the end first),
  * a tenth 0-15 ms after the last shard receipt (the commit: merging receipts, the manifest), and
    a tenth there exactly (the writer stops after that receipt until it is killed),
  * the rest within a window after the manifest create began (racing it): 2 ms on file:// (a
    local create takes about a millisecond), 30 ms on s3:// (a PUT); `--create-window-ms` sets both.
After each kill, bench/torture/checks.py verifies and loads every committed checkpoint with the
real verifier and loader, tries to load the uncommitted one, and counts (never asserts) what is
wrong. It prints one row per backend, writes runs/bench/torture.json and rewrites its section of
docs/benchmarks.md; the exit status is 1 when any bad checkpoint was found.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.docs import replace_section
from bench.torture.checks import WHERE, Tally, check_after_kill
from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.storage import Storage
from tests._torn_kills import NEW, OLD, Plan, digest, fork_server, run_writer, shard_objects

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Save torture: SIGKILL during checkpoint saves"
CREATE_WINDOW_S = {"file": 0.002, "s3": 0.03}
NOTES = ("<!-- torture-notes: kept when python -m bench.torture rewrites this section -->", "<!-- /torture-notes -->")


def kill_points(count: int, save_s: float, create_window_s: float, rng: random.Random) -> list[Plan]:
    """`count` seeded kill points over a step-20 save that takes about `save_s` seconds (module doc)."""
    points = []
    for i in range(count):
        share = i / count
        if share < 0.5:
            points.append(Plan("uniform", "save_begin", rng.uniform(0.0, 1.1 * save_s)))
        elif share < 0.6:
            points.append(Plan("commit", "shards_done", rng.uniform(0.0, 0.015)))
        elif share < 0.7:
            points.append(Plan("held", "shards_done", rng.uniform(0.0, 0.02), hold="shards_done"))
        else:
            points.append(Plan("manifest", f"manifest_begin {step_dir(NEW)}", rng.uniform(0.0, create_window_s)))
    rng.shuffle(points)
    return points


class Place:
    """One backend: where each point's checkpoint root goes, and how it is removed after its checks."""

    def __init__(self, kind: str, work: Path, server=None):
        self.kind = kind
        if kind == "file":
            self.base, self.options = f"file://{work}/ckpt", {}
        else:
            from tests.s3._seaweed import BUCKET

            self.base, self.options = f"s3://{BUCKET}/torture-{uuid.uuid4().hex[:8]}", server.storage_options

    def url(self, name: str) -> str:
        return f"{self.base}/{name}/job"

    def catalog(self, url: str) -> Catalog:
        return Catalog(Storage(url, self.options))

    def remove(self, url: str) -> None:
        storage = Storage(url, self.options)
        with contextlib.suppress(FileNotFoundError):
            storage.fs.rm(storage.root, recursive=True)


def run_backend(kind: str, count: int, seed: int, create_window_s: float, work: Path, server) -> dict:
    started = time.monotonic()
    place = Place(kind, work, server)
    with fork_server() as writers:
        # One save run to the end: how long step 20 takes, and the final bytes of every shard.
        url = place.url("full")
        full = run_writer(writers, work, url, place.options, Plan("full", "done", 0.0))
        catalog = place.catalog(url)
        assert catalog.committed_steps() == [OLD, NEW], catalog.committed_steps()
        shards = {name: digest(catalog, NEW, name) for name in shard_objects(catalog, NEW)}
        place.remove(url)
        tally = Tally()
        rng = random.Random(f"{seed}-{kind}")
        for i, plan in enumerate(kill_points(count, full.done_at, create_window_s, rng)):
            url = place.url(f"p{i:03d}")
            out = run_writer(writers, work, url, place.options, plan)
            check_after_kill(place.catalog(url), out, shards, tally, f"{kind} point {i} ({plan.kind})")
            place.remove(url)
            if (i + 1) % 10 == 0:
                print(f"  {kind}: {i + 1}/{count} points, bad so far {tally.bad}", flush=True)
    return {"backend": kind, "points": tally.points, "where": {w: tally.where[w] for w in WHERE},
            "new_committed": tally.new_committed, "checked": tally.checked, "intact": tally.intact,
            "bad_loadable": tally.bad_loadable, "committed_broken": tally.committed_broken,
            "commit_lost": tally.commit_lost, "torn_visible": tally.torn_visible, "bad": tally.bad,
            "problems": tally.problems, "full_save_s": full.done_at, "wall_s": time.monotonic() - started}


def table(rows: list[dict]) -> str:
    head = ["backend", "points", *(f"kills: {w}" for w in WHERE), "step 20 committed",
            "bad loadable checkpoints", "committed intact", "other faults", "full save", "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        other = r["committed_broken"] + r["commit_lost"] + r["torn_visible"]
        cells = [r["backend"], r["points"], *(r["where"][w] for w in WHERE), r["new_committed"],
                 r["bad_loadable"], f"{r['intact']}/{r['checked']}", other,
                 f"{r['full_save_s'] * 1e3:.0f} ms", f"{r['wall_s']:.0f} s"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def docs_section(result: dict, text: str) -> str:
    load = result["load"]
    windows = ", ".join(f"{kind}: {ms:.0f} ms" for kind, ms in result["create_window_ms"].items())
    return f"""{SECTION}

Measured by `python -m bench.torture` on {result['date']} ({result['wall_s']:.0f} s). Command:

```bash
{result['command']}
```

Machine: {result['cores']} cores, shared: 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f}
at the end (the bench ran alone under the suite's CPU lock; other work outside the lock may have run).
Each point is one SIGKILL of a process doing a real save of step 20 (4 ranks' `ShardWriter`s, the
`Committer`, the manifest's exclusive create; 24 MiB, model/big in 5 MiB multipart parts on s3://), on a
fresh checkpoint root holding committed step 10. Half the points fall uniformly over the save, a tenth in
the 15 ms after the last shard receipt, a tenth right there (the writer stops after that receipt until
it is killed), the rest within a few ms after the manifest create began
({windows}). Where a kill landed is read from the writer's own events ("manifest create":
the create had begun and not returned; it may have landed). After each kill every committed checkpoint is
verified (CRC32 of every block) and loaded with the real reader and compared bit for bit with what was
saved, the uncommitted step must refuse to load, and `newest_loadable` must name the newest committed
step. "Other faults" counts a committed checkpoint that does not load, a create that returned without a
commit, and a shard object visible with bytes other than its final ones: 0 is the only passing value.

{text}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torture", description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=50, help="SIGKILL points per backend")
    parser.add_argument("--backends", nargs="+", choices=["file", "s3"], default=["file", "s3"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--create-window-ms", type=float, default=None,
                        help="kills timed from the manifest create's start fall within this many ms of it "
                             "(default: 2 on file, 30 on s3)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench/torture.json")
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "-m", "bench.torture", *(argv if argv is not None else sys.argv[1:])])
    started, load_start = time.monotonic(), os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="undying-torture-"))
    server = None
    try:
        if "s3" in args.backends:
            from tests.s3._seaweed import start_seaweed

            server = start_seaweed(work / "seaweedfs")
        windows = {kind: CREATE_WINDOW_S[kind] if args.create_window_ms is None else args.create_window_ms / 1e3
                   for kind in args.backends}
        rows = [run_backend(kind, args.points, args.seed, windows[kind], work, server) for kind in args.backends]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    text = table(rows)
    print(text)
    for row in rows:
        for problem in row["problems"]:
            print(f"BAD: {problem}")
    result = {"date": time.strftime("%Y-%m-%d"), "command": command, "cores": os.cpu_count(),
              "load": [load_start, os.getloadavg()[0]], "wall_s": time.monotonic() - started,
              "create_window_ms": {kind: w * 1e3 for kind, w in windows.items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_docs:
        replace_section(ROOT / "docs/benchmarks.md", SECTION, docs_section(result, text), NOTES)
    return 1 if any(row["bad"] for row in rows) else 0
