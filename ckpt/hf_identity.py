"""Which initial weights a job started from: an identity of a Hugging Face directory's values.

A job that names `model.from_hf` reads those weights once, at its fresh start; every rerun resumes
its checkpoints and never reads them again. A spec whose `from_hf` names other weights of the same
shape (the instruct variant of a base model, another fine-tune's output), or that adds `from_hf` to
a job trained from scratch, would resume the old run without a word, and `ckpt export` would hand
back the old model. So each manifest records the identity of the weights the job started from, and
`undying run` refuses a spec whose `from_hf` has another (orchestrator.cli.resume_check).

The identity is a SHA-256 over a sample of the values: for the tensors outside the blocks (the
embedding, the final norm, the head) and every tensor of the first, middle and last block, the
name, the shape and SAMPLE elements at the start and in the middle, as float32. A full fine-tune
moves every value, a merged adapter every matrix it adapted in every block; a copy of the same
weights re-sharded into other files, or saved in float32 from bfloat16, has the same identity. The
reads are small (a few hundred KiB in all) and made once, by the driver.

Protocol: the controller (at a run's first restore, `first_weights`) and the parameter-server driver
add to every manifest's state the record of a fresh start, `weights_provenance(spec.model)`
(`from_hf`: the identity; None for a job that names no weights; UNKNOWN when the directory could
not be read then, which compares with nothing), or, for a run that resumes, the resumed manifest's
record (`resumed_provenance`), so the record stays the job's first run's and a resume samples
nothing. A copy of the weights narrowed (to bfloat16 or float16) or with tensors renamed has
another identity: the check refuses it, and a resume without `model.from_hf` is the fix.
"""

from __future__ import annotations

import hashlib
import logging
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from ckpt.safetensors_source import SafetensorsEntry, directory_entries, read_elements
from ckpt.storage import Storage

log = logging.getLogger(__name__)

SAMPLE = 1024  # elements read at each of a tensor's two places
UNKNOWN = "unknown"  # the directory did not read when the identity was taken: compared with nothing
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def weights_identity(url: str, storage_options: dict | None = None) -> str:
    """The identity of the weights of the Hugging Face directory at `url` (module doc); the store's
    errors and BadSafetensors pass through."""
    storage = Storage(url.rstrip("/"), dict(storage_options or {}))
    entries = directory_entries(storage)
    chosen = sorted(_sampled(entries))
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="hf-identity") as pool:
        samples = list(pool.map(lambda name: _sample(storage, entries[name]), chosen))
    digest = hashlib.sha256()
    for name, values in zip(chosen, samples, strict=True):
        digest.update(f"{name}:{entries[name].shape}:".encode())
        digest.update(values)
    return digest.hexdigest()


def weights_provenance(model) -> dict:
    """{"from_hf": the identity of `model.from_hf`'s weights, or None without one}, for every manifest's
    state; UNKNOWN (logged) when the directory does not read now."""
    if not model.from_hf:
        return {"from_hf": None}
    try:
        return {"from_hf": weights_identity(model.from_hf, model.storage_options)}
    except Exception as err:  # noqa: BLE001 (a store failing now: the check is skipped, not the job)
        log.warning("could not sample the weights of %s to record which the job started from: %s", model.from_hf, err)
        return {"from_hf": UNKNOWN}


def resumed_provenance(provenance: dict, saved: dict) -> dict:
    """`provenance` (weights_provenance's, and others') for a run that resumed a manifest whose state is
    `saved`: the weights the job started from are the first run's, carried in every manifest since (a
    resume never reads from_hf, and the resume check compared the spec's with them), not this spec's,
    which may name none or not read now; a manifest from before the record carries none."""
    out = {key: value for key, value in provenance.items() if key != "from_hf"}
    return {**out, "from_hf": saved["from_hf"]} if "from_hf" in saved else out


def first_weights(model, resumed: dict | None) -> dict:
    """The record of the weights a job started from, at a run's first restore: carried from the state of
    the manifest it resumed (`resumed`), else (a fresh start, or a manifest that did not read) that of
    `model.from_hf`, sampled only then."""
    return resumed_provenance({}, resumed) if resumed is not None else weights_provenance(model)


def _sampled(entries: dict[str, SafetensorsEntry]) -> set[str]:
    """The tensors outside the blocks, and those of the first, middle and last block."""
    layers = {name: int(found.group(1)) for name in entries if (found := _LAYER.search(name))}
    if not layers:
        return set(entries)
    top = max(layers.values())
    keep = {0, top // 2, top}
    return {name for name in entries if name not in layers or layers[name] in keep}


def _sample(storage: Storage, entry: SafetensorsEntry) -> bytes:
    """SAMPLE values at the start of the tensor and in its middle, as float32 bytes."""
    dtype = getattr(torch, entry.dtype)
    count = entry.chunks[0].nbytes // dtype.itemsize
    pieces = []
    for start in sorted({0, max(0, count // 2 - SAMPLE // 2)}):
        n = min(SAMPLE, count - start)
        if n <= 0:
            continue
        raw = read_elements(storage, entry, start, n, dtype.itemsize)
        pieces.append(torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.float32).numpy().tobytes())
    return b"".join(pieces)
