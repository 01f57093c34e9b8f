"""Running the units of a preparation: on Ray Data, or in this process; and the progress line.

An executor is called by the driver (`prepare.py`) once, with the job, the indices of the
units to run and a `Sink`. On the driver thread it calls `sink.started(where)` once its
workers are ready, then `sink.result(r)` with each `UnitResult` as it arrives, in
completion order (the driver orders them by index). `result` returns False to stop early
(a bad record: the other units' work would be thrown away anyway).

`RayDataExecutor` joins the cluster at `--address` (or `$RAY_ADDRESS`), else starts an
embedded local Ray, as `undying run` does (`orchestrator/cluster/ray_cluster.py`), and
stops the embedded one when done. Each unit is one row of a Ray Data dataset of one row
per block, so each becomes its own task; `run_unit` runs in a Ray worker and writes the
shard itself, and only the small result row comes back. `run_serial` does the same in this
process (tests, and a check that the two agree).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol, TextIO

from ckpt.storage_options import error_reason
from monitor.progress import Progress as BarProgress
from orchestrator.cli.data.shard_task import Job, UnitResult, run_unit

TASK_RETRIES = 3  # a unit's task is run again this often when its worker dies


class Sink(Protocol):
    def started(self, where: str) -> None: ...

    def result(self, result: UnitResult) -> bool: ...


Executor = Callable[[Job, list[int], Sink], None]


def run_serial(job: Job, indices: list[int], sink: Sink) -> None:
    sink.started("this process")
    for index in indices:
        if sink.result(run_unit(job, index)) is False:
            return


def _map_row(row: dict, job: Job) -> dict:
    return run_unit(job, int(row["unit"])).as_row()


def _warm_worker(tokenizer_json: str, tokenizer_sha256: str, parse_special: bool) -> None:
    """A Ray task run once per CPU before the units: imports what a unit task runs (Ray Data's
    operator code, this module's) and builds the tokenizer (cached per process), while the driver
    imports Ray Data itself. Otherwise each worker pays these, about 2 s of a core, only once its
    first unit has been handed to it, after the driver's own import."""
    import ray.data  # noqa: F401  (the import is the work)

    from orchestrator.cli.data.vocab import build_tokenizer

    build_tokenizer(tokenizer_json, tokenizer_sha256, parse_special)  # the units' own variant


def warm_workers(job: Job, tasks: int) -> list:
    """Start `tasks` warm-ups (one CPU each); their refs, to be waited on or dropped."""
    import ray

    remote = ray.remote(num_cpus=1)(_warm_worker)
    plan = job.plan
    # One copy in the object store for every task (a Llama 3 tokenizer.json is about 9 MB): a plain
    # argument is put once per call, a copy per CPU.
    tokenizer_json = ray.put(job.tokenizer_json)
    return [remote.remote(tokenizer_json, plan.tokenizer_sha256, plan.parse_special_tokens) for _ in range(tasks)]


class RayDataExecutor:
    """Runs the units as Ray Data tasks on the cluster at `address` (None: embedded local Ray)."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def __call__(self, job: Job, indices: list[int], sink: Sink) -> None:
        import ray

        from orchestrator.cluster import ray_cluster

        conn = ray_cluster.connect(self.address, cpus_needed=1, gpus_needed=0)
        try:
            address = self.address or os.environ.get("RAY_ADDRESS")
            where = "the embedded local Ray" if conn.embedded else f"the Ray cluster at {address}"
            cpus = int(ray.cluster_resources().get("CPU", 0))
            sink.started(f"{where} ({cpus} CPUs)")
            # Not waited on: the units queue behind them for the CPUs, and a warm-up's error is
            # the units' error too, reported by them.
            warm_workers(job, max(1, min(cpus, len(indices))))
            import ray.data  # while the workers warm up

            context = ray.data.DataContext.get_current()
            context.enable_progress_bars = False  # the driver prints its own progress line
            logging.getLogger("ray.data").setLevel(logging.WARNING)
            # Its one warning says that the bars above are off, which is what we asked for.
            logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
            rows = ray.data.from_items([{"unit": i} for i in indices], override_num_blocks=max(1, len(indices)))
            # Bounded retries: Ray Data's default retries a task whose worker died without end, so a
            # unit too large for a worker's memory would hang the command instead of failing it.
            results = rows.map(_map_row, fn_kwargs={"job": job}, num_cpus=1, max_retries=TASK_RETRIES)
            try:
                for row in results.iter_rows():
                    if sink.result(UnitResult.from_row(row)) is False:
                        return
            except Exception as err:  # noqa: BLE001 (a task's worker kept dying: out of memory, a lost node)
                sink.result(UnitResult(-1, error=task_failure(err), error_kind="task"))
        finally:
            conn.close()


def task_failure(err: BaseException) -> str:
    """The one line for a unit task that failed past its retries (its worker died each time)."""
    return (f"a unit's task failed {TASK_RETRIES + 1} times ({error_reason(err, 300)}); its worker died each "
            "time: give the workers more memory (a .txt or .arrow input is one unit whole, a large one needs "
            "several times its size), or split the input; run the same command again to resume")


class Progress:
    """Totals of the units done so far, shown as a bar when `stream` (stderr) is a terminal, else
    as a line every `every_s` seconds (monitor.progress says why).

    `begin` (once the workers are ready: the clock starts there, so tokens/s leaves out
    starting Ray) and `add` are called on the driver thread; the printing thread only reads
    the totals. Use as a context manager: the thread (or the bar) starts on entry, stops on exit.
    """

    def __init__(self, n_units: int, printer: Callable[[str], None] | None = None, every_s: float = 2.0,
                 stream: TextIO | None = None) -> None:
        self.n_units = n_units
        self.stream = stream if stream is not None else sys.stderr
        self.printer = printer or (lambda line: print(line, file=self.stream, flush=True))
        self.every_s = every_s
        self._bar: BarProgress | None = None
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.units = self.reused = self.documents = self.tokens = 0
        self.started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="data-progress", daemon=True)

    def begin(self, where: str) -> None:
        self.started = time.monotonic()
        self.printer(f"data prepare: {self.n_units} units to run on {where}")
        if self._tty:  # after the line above: a line printed under a live bar would break it
            self._bar = BarProgress("data prepare", self.n_units, unit="shards", stream=self.stream).__enter__()

    def add(self, result: UnitResult) -> None:
        self.units += 1
        self.reused += int(result.reused)
        self.documents += result.n_documents
        self.tokens += result.n_tokens
        if self._bar is not None:
            self._bar.advance(1, note=f"{human_count(self.tokens)} tokens")

    def line(self) -> str:
        elapsed = max(time.monotonic() - (self.started or time.monotonic()), 1e-9)
        reused = f" ({self.reused} kept from an earlier run)" if self.reused else ""
        return (f"data prepare: {self.units}/{self.n_units} shards{reused}, {self.documents:,} documents, "
                f"{human_count(self.tokens)} tokens, {human_count(self.tokens / elapsed)} tokens/s, "
                f"{elapsed:.0f} s")

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.started is not None:
                self.printer(self.line())

    def __enter__(self) -> Progress:
        if not self._tty:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()


def human_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"
