"""Killing a checkpoint writer anywhere in a save: the harness of tests/s3/test_torn_writes.py and of
the save-torture bench (python -m bench.torture).

`fork_server()` runs tests/_torn_writer.py (a fork server that has imported torch once);
`run_writer` has it fork one writer (step 10, then step 20: real ShardWriters, the real
Committer and manifest create) and SIGKILLs it as a `Plan` says, timed from an event the
writer reports; `plans` draws seeded kill points over a save, `stage_of` names where a kill
landed, `settled_steps` lists the committed steps once the store is quiet after a kill.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from tests._torn_writer import BIG_SHARD, WORLD

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
PART = 5 * MiB  # s3fs part size of the writer's shard files: model/big (16 MiB) goes in 4 parts
OLD, NEW = 10, 20  # the writer's two saves: the first always completes, the second is killed
STAGES = ("before_shard", "mid_shard", "before_manifest", "after_commit")


class WriterFailed(AssertionError):
    """The writer reported an error, or never reached the event its kill is timed from."""


@dataclass
class Plan:
    kind: str
    anchor: str  # the event the kill is timed from
    delay: float  # seconds after the anchor event reached the test
    hold: str | None = None  # the writer stops right after this event


@dataclass
class Outcome:
    events: list[str]
    anchor_at: float | None = None
    done_at: float | None = None
    killed_after: float | None = None  # seconds from save_begin to the kill


@contextlib.contextmanager
def fork_server() -> Iterator[subprocess.Popen]:
    """The writers' fork server (tests/_torn_writer.py), running for the `with` block."""
    proc = subprocess.Popen([sys.executable, "-m", "tests._torn_writer"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        yield proc
    finally:
        proc.stdin.close()  # it exits at end of input
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_writer(server, fifo_dir: Path, url: str, options: dict, plan: Plan, timeout_s: float = 180.0) -> Outcome:
    """Start a writer on `url`, SIGKILL it as `plan` says, and return every event it emitted."""
    fifo = fifo_dir / f"events-{uuid.uuid4().hex[:8]}"
    os.mkfifo(fifo)
    job = {"url": url, "options": options, "multipart_chunk": PART, "fifo": str(fifo), "hold": plan.hold}
    server.stdin.write(json.dumps(job) + "\n")
    word, pid = server.stdout.readline().split()
    assert word == "pid", word
    pid = int(pid)
    out = Outcome(events=[])
    begun = deadline = None
    killed = False
    fd = os.open(fifo, os.O_RDONLY)  # the writer opens its end first thing
    try:
        buf = b""
        give_up = time.monotonic() + timeout_s
        while not killed:
            now = time.monotonic()
            wait = 1.0 if deadline is None else max(0.0, deadline - now)
            if select.select([fd], [], [], wait)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, f"writer died on its own; events: {out.events[-5:]}"
                buf += chunk
                *lines, buf = buf.split(b"\n")
                now = time.monotonic()
                for line in (raw.decode() for raw in lines):
                    out.events.append(line)
                    if line.startswith("error"):
                        raise WriterFailed(f"writer failed: {line}")
                    if line == "save_begin":
                        begun = now
                    if line == "done":
                        out.done_at = now - begun
                    if line == plan.anchor and deadline is None:
                        out.anchor_at, deadline = now, now + plan.delay
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                os.kill(pid, signal.SIGKILL)
                killed = True
                out.killed_after = now - begun if begun is not None else None
            elif now > give_up:
                raise WriterFailed(f"writer never reached {plan.anchor!r}; last events: {out.events[-5:]}")
    finally:
        if not killed:
            os.kill(pid, signal.SIGKILL)
        word, reaped, status = server.stdout.readline().split()
        assert (word, int(reaped)) == ("exit", pid)
        # Everything the writer emitted before it died: it is gone, so this ends at EOF.
        while chunk := os.read(fd, 65536):
            buf += chunk
        os.close(fd)
        fifo.unlink()
    assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL, status
    out.events += [raw.decode() for raw in buf.split(b"\n") if raw]
    return out


def shard_objects(catalog: Catalog, step: int) -> list[str]:
    """Shard files visible in the step directory (temporary names of a local write excluded)."""
    names = catalog.storage.listdir(catalog.storage.path(step_dir(step)))
    return [n for n in names if n.startswith("shard-") and n.endswith(".bin")]


def digest(catalog: Catalog, step: int, name: str) -> str:
    return hashlib.sha256(catalog.storage.read(catalog.storage.path(step_dir(step), name))).hexdigest()


def plans(count: int, save_s: float, rng: random.Random, multipart: bool = False) -> list[Plan]:
    """`count` kill points over a save that takes about `save_s` seconds, in random order.
    With `multipart` (S3) one exact kill lands once the big shard's first part is uploaded,
    so a pending multipart upload is surely left behind for GC to abort."""
    exact = [
        Plan("hold_before_shard", "save_begin", 0.0, hold="save_begin"),
        Plan("hold_mid_big_shard", f"wrote {BIG_SHARD} 1", 0.0, hold=f"wrote {BIG_SHARD} 1"),
        Plan("hold_before_manifest", f"manifest_begin {step_dir(NEW)}", 0.0, hold=f"manifest_begin {step_dir(NEW)}"),
        Plan("after_done", "done", 0.0),
    ]
    if multipart:
        exact.append(Plan("hold_mid_multipart", f"part {BIG_SHARD} 1", 0.0, hold=f"part {BIG_SHARD} 1"))
    chosen = exact * max(1, count // 25)
    while len(chosen) < count:
        if rng.random() < 0.25:  # the last receipt is in: the manifest create is racing the kill
            chosen.append(Plan("near_manifest", "shards_done", rng.uniform(0.0, 0.015)))
        else:
            chosen.append(Plan("uniform", "save_begin", rng.uniform(0.0, 1.1 * save_s)))
    chosen = chosen[:count]
    for plan in chosen:
        if plan.hold is not None:
            plan.delay = rng.uniform(0.0, 0.02)
    rng.shuffle(chosen)
    return chosen


def stage_of(events: list[str], committed: bool) -> str:
    after = events[events.index("save_begin"):] if "save_begin" in events else []
    opened = {e.split()[1] for e in after if e.startswith("shard_open ")}
    closed = {e.split()[1] for e in after if e.startswith("shard_close ")}
    if committed:
        return "after_commit"
    if not opened:
        return "before_shard"
    if len(closed) < WORLD:
        return "mid_shard"
    return "before_manifest"


def settled_steps(catalog) -> list[int]:
    """Committed steps once the storage is quiet: a request the killed writer had fully sent
    (the manifest PUT, say) may still complete at the server just after the SIGKILL."""
    last = catalog.committed_steps()
    for _ in range(40):
        time.sleep(0.25)
        catalog.storage.invalidate()
        now = catalog.committed_steps()
        if now == last:
            return now
        last = now
    return last
