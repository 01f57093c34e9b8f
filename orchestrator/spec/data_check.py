"""Check, before any rank starts, that the prepared datasets a spec names can be read and fit the model,
and that the pretrained weights it names (`model.from_hf`) are the model's.

Protocol: the driver (`undying run`, `undying validate`) calls `require_data(spec)` once, after
the spec validated and beside `require_storage`. A text source's file is read (it is small: every
rank holds it whole). Of a prepared dataset it reads the manifest and lists the shards (no token is
read): a missing or damaged dataset (a shard missing, or not the size its
manifest says), a vocabulary larger than the model's, a tokenizer other than the pretrained
weights' (orchestrator.spec.pretrained_tokenizer), a dataset too small for one training
window, for its share of one step's samples (for a mixture, the most the dealing gives it in one of the
run's first steps) or for the validation windows asked, or a validation set
prepared from training text is a `SpecError` naming the field and the fix, exit
2, instead of a rank failing after placement, or hours into the run at its first read of a shard.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from orchestrator.spec.job_spec import JobSpec, Problem, SpecError
from orchestrator.spec.pretrained_tokenizer import tokenizer_problems

if TYPE_CHECKING:
    from trainer.tokens.reader import TokenDataset


def _dataset(url: str, options: dict, field: str, problems: list[Problem]):
    from trainer.tokens.format import NoManifest, TokenFormatError
    from trainer.tokens.reader import TokenDataset

    try:
        return TokenDataset(url, options)
    except (NoManifest, TokenFormatError) as err:
        problems.append(Problem(field, str(err)))
    except NotADirectoryError:  # (a local file: its manifest.json is a path under a file)
        problems.append(Problem(field, f"{url} is a file, not a prepared dataset; prepare it first (`undying data "
                                       f"prepare {url} --tokenizer ... --out DIR`) and give DIR"))
    except Exception as err:  # noqa: BLE001 (the store's client: missing credentials, an option, a library)
        problems.append(Problem(field, _cannot(url, "read", err)))
    return None


def _cannot(url: str, what: str, err: BaseException, options: str = "data.storage_options") -> str:
    """Why the store did not answer, naming the field to fix: an option or the credentials when it is
    one of those (ckpt.storage_options), else the error in one line. `options`: the field they came from."""
    from ckpt.storage_options import error_reason, explain

    return explain(err, options) or f"{url} cannot be {what} ({error_reason(err)}); check the URL and {options}"


def _check_shards(ds, url: str, field: str, problems: list[Problem]) -> None:
    try:
        damaged = ds.damaged_shards()
    except Exception as err:  # noqa: BLE001 (as `_dataset`)
        problems.append(Problem(field, _cannot(url, "listed", err)))
        return
    if damaged:
        shown = "; ".join(damaged[:3]) + (f"; and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        problems.append(Problem(field, f"{url} is damaged: {shown}; prepare it again (`undying data prepare`)"))


def _text_problems(spec: JobSpec) -> list[Problem]:
    """`data.source: text`: the file every rank reads whole (small by design), read here once."""
    from trainer.data import NotUtf8Text, TextTooLarge, read_text_bytes

    data, url = spec.data, spec.data.path
    try:
        size = len(read_text_bytes(url, data.storage_options))
    except IsADirectoryError:
        return [Problem("data.path", f"{url} is a directory; source 'text' reads one UTF-8 text file (a dataset "
                                     "prepared by `undying data prepare` is source 'tokens')")]
    except FileNotFoundError:
        return [Problem("data.path", f"{url} does not exist; fix the path (a plain path is taken from the "
                                     "directory `undying` runs in)")]
    except NotUtf8Text as err:
        return [Problem("data.path", f"{url} is not UTF-8 text ({err.__cause__}); give a text file")]
    except TextTooLarge as err:
        return [Problem("data.path", str(err))]
    except Exception as err:  # noqa: BLE001 (the store's client)
        return [Problem("data.path", _cannot(url, "read as text", err))]
    if size < data.seq_len + 1:  # (its byte vocabulary against model.vocab_size: the spec's own check)
        return [Problem("data.path", f"{url} has {size} bytes, fewer than one window of data.seq_len + 1 = "
                                     f"{data.seq_len + 1}; use a longer file or a shorter seq_len")]
    return []


def _pretrained_problems(spec: JobSpec) -> list[Problem]:
    """`model.from_hf`: its weights against the model its config.json gave (the spec read that file when
    it loaded). Only the safetensors headers are read (two small reads per file; and a tied model's
    head and embedding when both are stored): a directory without safetensors weights, a tensor
    missing or of another shape, a head that is not the tied embedding fails here, not in every rank's load."""
    from ckpt.hf_import import check_directory, differing_tied_head
    from ckpt.safetensors_source import directory_entries
    from ckpt.storage import Storage

    url = spec.model.from_hf
    try:
        storage = Storage(url.rstrip("/"), spec.model.storage_options)
        entries = directory_entries(storage)
        check_directory(entries, spec.model, url)
        if differing_tied_head(storage, entries, spec.model):
            return [Problem("model.from_hf", f"{url}: config.json says tie_word_embeddings: true, yet lm_head.weight "
                                             "differs from model.embed_tokens.weight (transformers 5 loads that head "
                                             "untied); set tie_word_embeddings to false in config.json to train the "
                                             "model the weights hold, or remove lm_head.weight to tie them")]
    except ValueError as err:  # check_directory's words name the field; BadSafetensors names the file
        words = str(err)
        return [Problem("model.from_hf", words if words.startswith("model.from_hf") else f"{url}: {words}")]
    except Exception as err:  # noqa: BLE001 (the store's client)
        return [Problem("model.from_hf", _cannot(url, "read", err, "model.storage_options"))]
    return []


def _step_problems(spec: JobSpec, part, field: str, windows: int) -> list[Problem]:
    """A dataset that holds fewer windows than a step draws from it (its share of train.global_batch)
    would put some windows in every step twice or more (trainer.tokens.windows starts its next epoch
    inside the step): the same sample's gradient counted several times over, never what is meant. (A
    larger one may still repeat a window in the one step an epoch ends in, as any epoch-wise sampler.)"""
    data, batch, share = spec.data, spec.train.global_batch, _share(spec, part)
    if windows >= share * batch:
        # Dealt to within one sample per level: a step may draw up to ceil(share) + level; counted then.
        level = [f for _, f in data.token_parts()].index(field)
        most, step = _most_in_a_step(spec, level) if windows < math.ceil(share * batch) + level + 1 else (0, 0)
        if windows >= most:
            return []
        drawn = (f"the {most} samples step {step} draws from it (its share of train.global_batch = {batch} is "
                 f"{share:.3g}, dealt to within one sample per dataset listed before it)")
        every = "that step"
    else:
        every = "every step"
        drawn = (f"the {share * batch:.3g} samples a step draws from it ({share:.3g} of train.global_batch = {batch})"
                 if share < 1 else f"the train.global_batch = {batch} samples a step draws")
    fix = "; or raise the weight of the other datasets" if share < 1 else ""
    return [Problem(field, f"{part.path} holds {windows} windows of data.seq_len + 1 = {data.seq_len + 1} tokens, "
                           f"fewer than {drawn}: {every} would read some windows twice; use more data, a "
                           f"shorter seq_len or a smaller global_batch{fix}")]


def _most_in_a_step(spec: JobSpec, level: int) -> tuple[int, int]:
    """(the most samples one step draws from dataset `level` of the mixture, that step), counted exactly over
    the run's first steps (as many as about 200,000 samples make: a dataset this small is for a short run).
    The dealing (trainer.tokens.windows) depends on the weights and data.seed alone, not the sizes."""
    from trainer.tokens.windows import Source, WindowSchedule

    parts, batch = [p for p, _ in spec.data.token_parts()], spec.train.global_batch
    schedule = WindowSchedule([Source(1, p.weight) for p in parts], spec.data.seed, batch)
    most = (0, 0)
    for step in range(min(spec.train.steps, max(1, 200_000 // batch))):
        drawn = sum(1 for i in range(batch) if schedule.deal(step * batch + i)[0] == level)
        most = max(most, (drawn, -step))
    return most[0], -most[1]


def _share(spec: JobSpec, part) -> float:
    """The fraction of the samples that dataset `part` (a data.token_parts() one) is dealt."""
    return part.weight / sum(p.weight for p, _ in spec.data.token_parts())


def data_problems(spec: JobSpec) -> list[Problem]:
    return _examine(spec)[0]


def _examine(spec: JobSpec) -> tuple[list[Problem], list[tuple[str, object, int]]]:
    """The problems, and (field, part, windows) of each training dataset read whole enough to count."""
    problems: list[Problem] = _text_problems(spec) if spec.data.source == "text" else []
    counted: list[tuple[str, object, int]] = []
    if spec.model.from_hf:
        problems += _pretrained_problems(spec)
    data, model = spec.data, spec.model
    opened: list[tuple[str, TokenDataset]] = []  # (field, dataset) of every dataset read
    if data.source == "tokens":
        for part, field in data.token_parts():
            url = part.path
            ds = _dataset(url, data.storage_options, field, problems)
            if ds is None:
                continue
            opened.append((field, ds))
            _check_shards(ds, url, field, problems)
            if ds.vocab_size > model.vocab_size:
                problems.append(Problem(field, f"{url} holds token ids up to {ds.vocab_size - 1}, beyond model."
                                        f"vocab_size = {model.vocab_size}; prepare it with the model's tokenizer"))
            if len(ds) < data.seq_len + 1:
                problems.append(Problem(field, f"{url} holds {len(ds)} tokens, fewer than one window of data.seq_len "
                                        f"+ 1 = {data.seq_len + 1}; use more data or a shorter seq_len"))
            else:
                counted.append((field, part, len(ds) // (data.seq_len + 1)))
                problems += _step_problems(spec, part, field, counted[-1][2])
    if spec.eval is not None:
        ds = _dataset(spec.eval.path, spec.eval.storage_options or data.storage_options, "eval.path", problems)
        if ds is not None:
            _check_shards(ds, spec.eval.path, "eval.path", problems)
        span = (spec.eval.seq_len or data.seq_len) + 1
        if ds is not None and len(ds) // span < spec.eval.windows:
            problems.append(Problem("eval.windows", f"{spec.eval.windows} windows of {span} tokens need "
                                    f"{spec.eval.windows * span} tokens; {spec.eval.path} holds {len(ds)}: evaluate "
                                    "fewer windows or prepare more data"))
        if ds is not None and ds.vocab_size > model.vocab_size:
            problems.append(Problem("eval.path", f"token ids up to {ds.vocab_size - 1}, beyond model.vocab_size = "
                                    f"{model.vocab_size}; prepare it with the model's tokenizer"))
        if ds is not None:
            opened.append(("eval.path", ds))
    if spec.model.from_hf:
        problems += tokenizer_problems(spec, opened)
    return problems + _between_datasets(opened, data.storage_options), counted


def _between_datasets(opened: list[tuple[str, TokenDataset]], options: dict) -> list[Problem]:
    """What the job's datasets must be to one another (`opened`: (field, dataset), training ones first;
    `options`: data.storage_options, to read the tokenizers they name)."""
    from orchestrator.spec.pretrained_tokenizer import same_vocabulary
    from trainer.tokens.loader import content_hash

    problems = []
    # Ids mean something only under their tokenizer: a mixture (or a validation set) tokenized
    # with another one would train (or measure) on different words behind the same numbers.
    first_field, first = opened[0] if opened else (None, None)
    for field, ds in opened[1:]:
        sha, first_sha = ds.manifest.tokenizer_sha256, first.manifest.tokenizer_sha256
        if sha != first_sha and not same_vocabulary(first.manifest.tokenizer, ds.manifest.tokenizer, options):
            problems.append(Problem(field, f"was tokenized with another tokenizer ({ds.manifest.tokenizer}, sha256 "
                                    f"{sha[:12]}...) than {first_field} ({first.manifest.tokenizer}, "
                                    f"{first_sha[:12]}...), whose vocabulary differs or cannot be read; prepare "
                                    "every dataset of a job with the same tokenizer"))
    # A validation set holding training tokens measures no held-out loss. (A mixture listing one
    # dataset twice is left alone: a job trained so resumes only with its spec as it was.)
    trained = {content_hash(ds): field for field, ds in opened if field != "eval.path"}
    for field, ds in opened:
        if field != "eval.path":
            continue
        if content_hash(ds) in trained:
            problems.append(Problem(field, f"holds the same tokens as {trained[content_hash(ds)]}; evaluate on a "
                                    "dataset kept out of training"))
            continue
        # The same text prepared again (another --shard-tokens, another run) is other bytes, not other words.
        shared = [(url, train_field) for url in ds.manifest.inputs for train_field, other in opened
                  if train_field != "eval.path" and any(_overlap(url, mine) for mine in other.manifest.inputs)]
        if shared:
            url, train_field = shared[0]
            problems.append(Problem(field, f"was prepared from {url}, an input of {train_field} too; evaluate on "
                                    "text kept out of training"))
    return problems


def _overlap(a: str, b: str) -> bool:
    """Whether two prepared inputs' URLs name common files: the same place (trainer.urls.place_of), or one
    a directory holding the other."""
    from trainer.urls import place_of

    a, b = place_of(a), place_of(b)
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _epoch_notes(spec: JobSpec, counted: list[tuple[str, object, int]]) -> list[str]:
    """How much of each prepared training dataset the run reads, in epochs (its share of train.steps x
    train.global_batch over its windows, as `_examine` counted them): a fine-tune's many passes, or a
    pretraining's fraction, said before it starts (`undying validate` and `undying run` print them)."""
    samples = spec.train.steps * spec.train.global_batch
    return [f"{field}: {windows:,} windows of data.seq_len + 1 = {spec.data.seq_len + 1} tokens; train.steps = "
            f"{spec.train.steps} read {_share(spec, part) * samples / windows:.3g} epochs of it"
            for field, part, windows in counted]


def require_data(spec: JobSpec) -> list[str]:
    """Raise SpecError listing every problem of the spec's prepared datasets; else the notes on how
    many epochs of each the run reads (from the same reads: no dataset is opened twice)."""
    problems, counted = _examine(spec)
    if problems:
        raise SpecError(problems)
    return _epoch_notes(spec, counted)
