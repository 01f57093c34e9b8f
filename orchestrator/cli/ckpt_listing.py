"""`undying ckpt ls` and `undying ckpt verify`: what a job's checkpoint root holds, and whether its bytes are intact.

Called by `orchestrator.cli.ckpt_cmd.ckpt_main` with an open catalog and the parsed arguments.
Each gathers its result as plain data first, then prints it as a table (the default) or, with
`--json`, as one JSON object on stdout and nothing else, so a script can read it with one
`json.loads`:

    ls      {"url", "committed": [{"step", "layout", "bytes", "created_at", "age_s", "generation",
             "tensors"} or {"step", "error"}], "unfinished": [steps], "in_progress": [steps], "quarantined": [steps],
             "owner": null or {"holder", "host", "pid", "epoch", "lease_s", "last_beat_age_s", "standing":
             "running" | "released" | "gone" | "stale"} or {"error"}}
    verify  {"url", "ok", "checkpoints": [{"step", "status": "ok" | "corrupt" | "not_verified"
             | "deleted" (by a job's retention while verify ran),
             "error", and for ok "tensors", "chunks", "files", "bytes", "seconds"; for a store that
             kept failing "transient": true}]}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ckpt.catalog import Catalog
from ckpt.errors import TransientStorageError
from ckpt.late_commits import LATE_PREFIX
from ckpt.owner_claims import UnreadableClaim, owner_status, watch_s
from ckpt.storage_errors import ReadRetry
from monitor.progress import human_bytes
from orchestrator.cli.ckpt_catalog import (
    about,
    check_read_retry_s,
    committed_or_fail,
    deleted_meanwhile,
    error_reason,
    human_age,
    layout_label,
    step_or_fail,
    steps_text,
)
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK

# -- ls ----------------------------------------------------------------------------------


def _listing(catalog: Catalog) -> dict[str, Any]:
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest

    committed = committed_or_fail(catalog)
    quarantined, late = catalog.quarantined_steps(), catalog.quarantined_steps(LATE_PREFIX)
    unfinished = sorted(set(catalog.all_steps()) - set(committed) - set(quarantined) - set(late))
    now, entries = time.time(), []
    for step in committed:
        try:
            m = read_manifest(catalog, step)
        except (CorruptCheckpoint, UnsupportedManifest) as err:
            entries.append({"step": step, "error": str(err)})
            continue
        entries.append({"step": step, "layout": m.layout, "bytes": m.total_bytes, "created_at": m.created_at,
                        "age_s": round(max(0.0, now - m.created_at), 3), "generation": m.generation,
                        "tensors": len(m.tensors)})
    return {"url": catalog.storage.url, "committed": entries,
            "unfinished": [s for s in unfinished if s < committed[-1]],
            "in_progress": [s for s in unfinished if s > committed[-1]],
            "quarantined": quarantined, "late": late, "owner": _owner(catalog)}


def _owner(catalog: Catalog) -> dict | None:
    try:
        return owner_status(catalog.storage)
    except UnreadableClaim as err:  # say so, list the rest
        return {"error": f"the owner folder does not parse ({error_reason(err)})"}


def list_checkpoints(catalog: Catalog, args: argparse.Namespace) -> int:
    listing = _listing(catalog)
    if args.as_json:
        print(json.dumps(listing))
        return EXIT_OK
    print(f"{listing['url']}: {len(listing['committed'])} committed checkpoint(s)")
    print(f"{'step':>10}  {'layout':<22}{'size':>11}{'age':>10}{'gen':>5}{'tensors':>9}")
    for e in listing["committed"]:
        if "error" in e:
            print(f"{e['step']:>10}  unreadable: {e['error']}")
            continue
        print(f"{e['step']:>10}  {layout_label(e['layout']):<22}{human_bytes(e['bytes']):>11}"
              f"{human_age(e['age_s']):>10}{e['generation']:>5}{e['tensors']:>9}")
    if listing["unfinished"]:
        print(f"unfinished saves (no manifest): steps {steps_text(listing['unfinished'])}; "
              "`undying ckpt gc` deletes them")
    if listing["in_progress"]:
        print(f"saves in progress or abandoned (no manifest yet): steps {steps_text(listing['in_progress'])}")
    if listing["quarantined"]:
        print(f"quarantined as corrupt (manifest moved aside, files kept as evidence; gc leaves them): steps "
              f"{steps_text(listing['quarantined'])}")
    if listing["late"]:
        print(f"late commits of a driver that had lost the folder (manifest moved aside, files kept as evidence; gc "
              f"leaves them): steps {steps_text(listing['late'])}")
    if listing["owner"] is not None:
        print(_owner_line(listing["owner"]))
    return EXIT_OK


_STANDING = {"running": "running", "released": "released the folder", "gone": "no longer running",
             "stale": "silent for many leases"}


def _owner_line(owner: dict) -> str:
    """Who drives (or last drove) the job: the folder's newest owner claim (ckpt.owner_claims)."""
    if "error" in owner:
        return f"owner: unknown: {owner['error']}"
    who = f"{owner['holder']} on host {owner['host']}, pid {owner['pid']}"
    age = owner["last_beat_age_s"]
    beat = f"last heartbeat {human_age(age)} ago"
    label = "owner" if owner["standing"] == "running" else "last owner"
    if owner["standing"] == "running" and age > watch_s(owner["lease_s"]):  # a run would take it over now
        return f"{label}: {who}, silent for longer than its {owner['lease_s']:.0f} s lease: probably stopped ({beat})"
    return f"{label}: {who}, {_STANDING[owner['standing']]} ({beat})"


# -- verify ------------------------------------------------------------------------------


def verify_one(catalog: Catalog, step: int, read_retry_s: float) -> dict[str, Any]:
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest, verify_checkpoint
    from monitor.progress import Progress

    started = time.perf_counter()
    retry = ReadRetry(read_retry_s)  # one budget for the checkpoint's manifest and all its chunks
    try:
        manifest = read_manifest(catalog, step, retry)
        with Progress(f"undying ckpt verify step {step}") as progress:  # a bar, or a line every 10 s
            verify_checkpoint(catalog, step, retry, on_bytes=progress.advance)
    except CorruptCheckpoint as err:
        if deleted_meanwhile(catalog, step):  # a running job's retention, not damage: nothing to alarm about
            return {"step": step, "status": "deleted", "error": None}
        return {"step": step, "status": "corrupt", "error": about(step, err)}
    except TransientStorageError as err:  # proves nothing about this one; the others are still checked
        return {"step": step, "status": "not_verified", "transient": True, "error": about(step, err)}
    except UnsupportedManifest as err:  # not damage, but not verifiable by this version either
        return {"step": step, "status": "not_verified", "error": about(step, err)}
    return {"step": step, "status": "ok", "error": None, "tensors": len(manifest.tensors),
            "chunks": sum(len(e.chunks) for e in manifest.tensors.values()),
            "files": len({c.file for e in manifest.tensors.values() for c in e.chunks}),
            "bytes": manifest.total_bytes, "seconds": round(time.perf_counter() - started, 3)}


def verify_line(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        return (f"step {r['step']}: ok ({r['tensors']} tensors, {r['chunks']} chunks in {r['files']} shard files, "
                f"{human_bytes(r['bytes'])}, {r['seconds']:.2f} s)")
    if r["status"] == "corrupt":
        return f"step {r['step']}: CORRUPT: {r['error']}"
    if r["status"] == "deleted":
        return f"step {r['step']}: deleted meanwhile (a running job's retention, or `undying ckpt gc`), not checked"
    why = " (transient storage errors)" if r.get("transient") else ""
    return f"step {r['step']}: NOT VERIFIED{why}: {r['error']}"


def verify_checkpoints(catalog: Catalog, args: argparse.Namespace) -> int:
    check_read_retry_s(args.read_retry_s)
    committed = committed_or_fail(catalog)
    steps = [step_or_fail(catalog, args.step, committed)] if args.step is not None else committed
    results = []
    for step in steps:
        results.append(verify_one(catalog, step, args.read_retry_s))
        if not args.as_json:  # a line per checkpoint as it is done: a big one takes minutes
            print(verify_line(results[-1]), flush=True)
    bad = [r for r in results if r["status"] not in ("ok", "deleted")]
    if args.as_json:
        print(json.dumps({"url": catalog.storage.url, "ok": not bad, "checkpoints": results}))
    elif bad:
        reasons = "; ".join(f"step {r['step']}: " + ("not verified, the store kept failing: " if r.get("transient")
                                                      else "") + r["error"] for r in bad)
        print(f"undying ckpt verify: {len(bad)} of {len(steps)} checkpoint(s) failed: {reasons}", file=sys.stderr)
    return EXIT_FAILED if bad else EXIT_OK
