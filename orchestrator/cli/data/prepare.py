"""`undying data prepare`, the driver: check everything, plan, run the units, commit the manifest.

Protocol, in this order, on the driver:
  1. load the tokenizer and check every input (`vocab.py`, `sources.py`; a file two inputs read
     is refused): a mistake exits 2 before anything is written or started;
  2. build the plan (`plan.py`) and compare it with what `--out` holds: DONE (a committed
     dataset of the same inputs and tokenizer) prints "already prepared" and exits 0;
     another dataset, or another plan's unfinished run, exits 2; FRESH creates
     `OUT/plan.json` exclusively, RESUME reuses it; a look at the first documents warns of
     special-token text the plan tokenizes as characters (`special_text.py`);
  3. run every unit (`execute.py`: Ray Data tasks, each writing its own shard and `.done`); a
     fresh run stopped by a record the user must fix marks what it wrote withdrawn and removes
     it, and the next run clears a withdrawn folder, so that the same command runs again once the
     input is fixed; inputs that held no document (empty texts are none) end so too, exit 2;
  4. once every unit has succeeded, create `OUT/manifest.json` exclusively (`ckpt/storage.py`:
     POSIX link(), S3 If-None-Match). Its bytes depend only on the plan, so two runs racing
     to commit the same dataset both succeed, and a run of another plan cannot replace it.

Ray starts only in step 3, so the checks and "already prepared" cost no cluster.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt.storage import AlreadyCommitted, Storage
from orchestrator.cli.data.execute import Executor, Progress, human_count
from orchestrator.cli.data.plan import PLAN_NAME, Decision, Plan, decide, make_plan, parse_plan
from orchestrator.cli.data.shard_task import Job, UnitResult
from orchestrator.cli.data.sources import Source, options_for, resolve_sources, to_url
from orchestrator.cli.data.special_text import special_token_text
from orchestrator.cli.data.vocab import build_tokenizer, load_tokenizer
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from trainer.tokens.format import MANIFEST_NAME, TokenFormatError, TokenManifest, manifest_bytes, parse_manifest
from trainer.urls import place_of


@dataclass
class PrepareRequest:
    """The command's arguments, as parsed."""

    inputs: list[str]
    tokenizer: str
    out: str
    shard_tokens: int
    text_field: str = "text"
    eos_token: str | None = None
    storage_options: dict = field(default_factory=dict)
    add_special_tokens: bool = True
    parse_special_tokens: bool = False


def prepare(request: PrepareRequest, executor: Executor, printer: Callable[[str], None] = print) -> int:
    """Run steps 1-4 of the module docstring; returns the exit code. UsageError propagates
    from steps 1-2 (the command prints it and exits 2)."""
    if request.shard_tokens < 1:
        raise UsageError(f"--shard-tokens {request.shard_tokens}: must be at least 1")
    tokenizer = load_tokenizer(request.tokenizer, request.eos_token, request.storage_options)
    sources = resolve_sources(request.inputs, request.text_field, request.storage_options)
    _refuse_repeated(sources)
    plan = make_plan(sources, tokenizer, request.text_field, request.shard_tokens, request.add_special_tokens,
                     request.parse_special_tokens)
    storage = open_output(request.out, request.storage_options)
    _refuse_an_input(storage.url, sources)
    plan, decision = _settle(storage, plan)
    if decision is Decision.DONE:
        manifest = parse_manifest(storage.read(storage.path(MANIFEST_NAME)), storage.url)
        _refuse_damaged(storage.url, request.storage_options)
        printer(f"already prepared: {storage.url} ({human_count(manifest.n_tokens)} tokens, "
                f"{manifest.n_documents:,} documents in {len(manifest.shards)} shards)")
        return EXIT_OK
    if decision is Decision.RESUME:
        printer(f"resuming the unfinished preparation at {storage.url}")
    warning = special_token_text(plan, build_tokenizer(tokenizer.json_text, tokenizer.sha256), request.storage_options)
    if warning:
        print(f"undying data prepare: warning: {warning}", file=sys.stderr)
    job = Job(storage.url, request.storage_options, plan, plan.sha256(), tokenizer.json_text)
    results = _run(job, executor)
    if not isinstance(results, int) and not sum(r.n_tokens for r in results):
        print(f"undying data prepare: the INPUTs ({', '.join(request.inputs)}) hold no document (every record "
              "empty, or none at all); give inputs with text", file=sys.stderr)
        results = EXIT_USAGE
    if isinstance(results, int):
        if results == EXIT_USAGE and decision is Decision.FRESH:
            _withdraw(storage)
        return results
    return _commit(storage, plan, results, printer)


def _refuse_damaged(url: str, storage_options: dict) -> None:
    """A committed dataset whose shards are not all there at their sizes (one listing): the job's own
    check refuses it, so "already prepared" must not pass it either. It is never rewritten in place
    (a job may be reading it): UsageError saying so."""
    from trainer.tokens.reader import TokenDataset

    damaged = TokenDataset(url, storage_options).damaged_shards()
    if damaged:
        shown = "; ".join(damaged[:3]) + (f"; and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        raise UsageError(f"--out {url} holds this dataset, committed, but damaged: {shown}; it is not rewritten in "
                         "place (a job may be reading it): prepare it to another --out, or delete this one and run "
                         "the same command again")


# Left by a fresh run that stopped at a record the user must fix (`_withdraw`): the run's own files
# beside it (its plan, its shards and their temporary copies) go before the next run starts.
WITHDRAWN_NAME = "withdrawn.json"
_RUN_FILE = re.compile(rf"^({re.escape(PLAN_NAME)}|shard-\d+\.\w+)(\.tmp-[0-9a-f]+)?$")


def _withdraw(storage: Storage) -> None:
    """A fresh run stopped at a record the user must fix: its plan names this version of the input,
    so the fixed input's rerun would find `--out` holding another preparation and be refused. The
    location held nothing before this run (FRESH), so its files are this run's: the folder is marked
    withdrawn first (a task still finishing elsewhere may write a shard after this), then they go."""
    storage.write_immutable(storage.path(WITHDRAWN_NAME), b"{}")
    _remove(storage, [n for n in storage.listdir(storage.root) if _RUN_FILE.match(n)])
    print(f"undying data prepare: nothing of this run was kept at {storage.url} (marked withdrawn): fix the input "
          "and run the same command again", file=sys.stderr)


def _leftovers(names: list[str]) -> list[str] | None:
    """A withdrawn run's files among `names` (what the folder held when looked at), to remove before
    a new run; None when it holds anything else too (a user's files: the folder is not empty)."""
    if WITHDRAWN_NAME not in names or not all(n == WITHDRAWN_NAME or _RUN_FILE.match(n) for n in names):
        return None
    return [n for n in names if n != WITHDRAWN_NAME] + [WITHDRAWN_NAME]  # the mark last


def _remove(storage: Storage, names: list[str]) -> None:
    """Remove these entries of the output folder (never the folder: it may be a mount the user made)."""
    for name in names:
        storage.remove_tree(storage.path(name))


def open_output(out: str, storage_options: dict) -> Storage:
    url = to_url(out, "--out")
    try:
        return Storage(url, options_for(url, storage_options))
    except (ValueError, ImportError) as err:
        raise UsageError(f"--out {out}: unknown or unavailable protocol ({err}); use a local path, file:// "
                         "or s3:// (with s3fs installed)") from None


def _refuse_an_input(out: str, sources: list[Source]) -> None:
    """--out is a folder of the dataset's own: not an input (whose bytes the plan describes), nor
    inside one (a datasets directory would then hold shards it would read next time)."""
    given, out = out, place_of(out)
    for i, source in enumerate(sources, 1):
        for where in (place_of(source.url), *(place_of(f.url) for f in source.files)):
            if out == where or out.startswith(where + "/"):
                raise UsageError(f"--out {given} is {'' if out == where else 'inside '}INPUT {i} ({source.arg}); "
                                 "give a new directory for the dataset")


def _refuse_repeated(sources: list[Source]) -> None:
    """A file two INPUTs read (the same one twice, or one inside a directory given too) would put its
    documents in the dataset twice: UsageError naming both (a data.mixture weight repeats on purpose)."""
    read_by: dict[str, str] = {}
    for source in sources:
        for where in {place_of(f.url) for f in source.files}:
            if where in read_by:
                raise UsageError(f"INPUT {source.arg} reads {where}, which INPUT {read_by[where]} reads too: its "
                                 "documents would be in the dataset twice; give each input once (to weigh a "
                                 "dataset more, give it a larger data.mixture weight)")
            read_by[where] = source.arg


def _settle(storage: Storage, plan: Plan) -> tuple[Plan, Decision]:
    """The plan to run and what to do: step 2 of the module docstring."""
    for _ in range(2):  # a second look when another run created plan.json meanwhile
        manifest, old_plan, others = _what_is_there(storage)
        leftovers = _leftovers(others) if manifest is None and old_plan is None else None
        if leftovers:  # only what was there when looked at: a concurrent rerun's new files stay
            _remove(storage, leftovers)
            others = []
        decision = decide(storage.url, plan, manifest, old_plan, others)
        if decision is Decision.RESUME:
            return old_plan, decision  # the same identity; how inputs and tokenizer were spelled may differ
        if decision is Decision.DONE:
            return plan, decision
        try:
            storage.create_exclusive(storage.path(PLAN_NAME), plan.to_bytes())
            return plan, decision
        except AlreadyCommitted:
            continue
    raise UsageError(f"--out {storage.url}: another run is writing there; choose another --out")


def _what_is_there(storage: Storage) -> tuple[TokenManifest | None, Plan | None, list[str]]:
    names = storage.listdir(storage.root)
    manifest = old_plan = None
    if MANIFEST_NAME in names:
        try:
            manifest = parse_manifest(storage.read(storage.path(MANIFEST_NAME)), f"{storage.url}/{MANIFEST_NAME}")
        except TokenFormatError as err:
            raise UsageError(f"--out {storage.url}: {err}") from None
    if PLAN_NAME in names:
        old_plan = parse_plan(storage.read(storage.path(PLAN_NAME)), f"{storage.url}/{PLAN_NAME}")
    return manifest, old_plan, [n for n in names if n not in (MANIFEST_NAME, PLAN_NAME)]


class _Collector:
    """The `Sink` of one run: keeps each unit's result, the first failure, and the progress."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.results: dict[int, UnitResult] = {}
        self.failed: UnitResult | None = None

    def started(self, where: str) -> None:
        self.progress.begin(where)

    def result(self, result: UnitResult) -> bool:
        if result.error:
            self.failed = result
            return False
        self.results[result.index] = result
        self.progress.add(result)
        return True


def _run(job: Job, executor: Executor) -> list[UnitResult] | int:
    """Every unit's result in index order, or the exit code of the first failure."""
    units = [u.index for u in job.plan.units]
    if not units:  # inputs without a single record: an empty dataset, and no cluster to start
        return []
    progress = Progress(len(units))
    collector = _Collector(progress)
    with progress:
        executor(job, units, collector)
    if collector.failed is not None:
        print(f"undying data prepare: {collector.failed.error}", file=sys.stderr)
        return EXIT_USAGE if collector.failed.error_kind == "usage" else EXIT_FAILED
    assert len(collector.results) == len(units), f"{len(units) - len(collector.results)} units returned no result"
    progress.printer(progress.line())
    return [collector.results[i] for i in units]


def _commit(storage: Storage, plan: Plan, results: list[UnitResult], printer: Callable[[str], None]) -> int:
    shards = [r.entry() for r in results]
    manifest = TokenManifest(dtype=plan.dtype, vocab_size=plan.vocab_size, eos_id=plan.eos_id,
                             tokenizer_sha256=plan.tokenizer_sha256, tokenizer=plan.tokenizer,
                             text_field=plan.text_field, add_special_tokens=plan.add_special_tokens,
                             parse_special_tokens=plan.parse_special_tokens, inputs=plan.inputs,
                             n_tokens=sum(s.n_tokens for s in shards),
                             n_documents=sum(s.n_documents for s in shards), shards=shards)
    started = time.monotonic()
    try:
        storage.create_exclusive(storage.path(MANIFEST_NAME), manifest_bytes(manifest))
    except AlreadyCommitted:
        print(f"undying data prepare: {storage.url}/{MANIFEST_NAME} appeared meanwhile with other contents "
              "(another run committed there); nothing was replaced", file=sys.stderr)
        return EXIT_FAILED
    printer(f"prepared {storage.url}: {human_count(manifest.n_tokens)} tokens ({manifest.dtype}), "
            f"{manifest.n_documents:,} documents, {len(shards)} shards; manifest committed in "
            f"{time.monotonic() - started:.2f} s")
    return EXIT_OK
