"""`undying ckpt ls|verify|export|gc` on file:// checkpoints written by the real writer and catalog.

The same commands against a real S3 server are in tests/s3/test_ckpt_cli_s3.py."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt.catalog import Catalog
from ckpt.export import export_safetensors
from ckpt.shards import write_shard
from ckpt.storage import Storage
from orchestrator.cli.main import main
from tests._checkpoints import flip_bit, make_state, save_checkpoint, shard_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def job(tmp_path) -> tuple[str, Catalog]:
    """A job root with committed steps 10, 20, 30 and unfinished saves 15 (stale) and 35 (newer)."""
    url = f"file://{tmp_path}/ckpt/myjob"
    catalog = Catalog(Storage(url))
    for step in (10, 20, 30):
        save_checkpoint(catalog, step, make_state(step))
    for step in (15, 35):
        write_shard(catalog.storage, step, 0, make_state(), blocking_s=0.0)
    return url, catalog


def _one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_ls_lists_committed_checkpoints_as_a_table(capsys, job):
    url, _ = job
    code, out, err = run(capsys, "ls", url)
    assert code == 0 and not err
    rows = [line.split() for line in out.splitlines() if line.strip()[:2].isdigit()]
    assert [r[0] for r in rows] == ["10", "20", "30"]
    assert all(" ".join(r[1:5]) == "dp3 tp1 pp1 zero0" for r in rows)
    assert "KiB" in out or " B" in out
    assert "unfinished saves (no manifest): steps 15" in out
    assert "steps 35" in out and "owner" not in out


def test_ls_tells_quarantined_steps_from_unfinished_saves(capsys, job):
    import json

    url, catalog = job
    catalog.quarantine(30)  # proven corrupt: its manifest moved aside, its files kept as evidence
    code, out, _ = run(capsys, "ls", url)
    lines = out.splitlines()
    assert code == 0 and any(line.startswith("quarantined as corrupt") and line.endswith("steps 30") for line in lines)
    assert "unfinished saves (no manifest): steps 15;" in out and lines[-2].endswith("yet): steps 35")  # 30 in neither
    listing = json.loads(run(capsys, "ls", url, "--json")[1])
    assert listing["quarantined"] == [30] and listing["in_progress"] == [35] and listing["unfinished"] == [15]
    for step in (10, 20):
        catalog.quarantine(step)
    code, _, err = run(capsys, "ls", url)
    _one_line_error(err, "no committed checkpoint: steps 10, 20, 30 were quarantined as corrupt",
                    "steps 15, 35 are unfinished saves", "`undying run --fresh`")
    assert code == 2


def test_ls_tells_late_commits_moved_aside_from_unfinished_saves(capsys, job):
    import json

    url, catalog = job
    catalog.withdraw_late(20)  # a driver that had lost the root committed it; the holder moved it aside
    code, out, _ = run(capsys, "ls", url)
    assert code == 0 and "late commits of a driver that had lost the folder" in out and "steps 20" in out
    assert "unfinished saves (no manifest): steps 15;" in out  # 20 is not garbage: gc leaves it
    listing = json.loads(run(capsys, "ls", url, "--json")[1])
    assert listing["late"] == [20] and listing["unfinished"] == [15]


def test_ls_says_who_drives_the_job(capsys, job):
    import json
    import os

    from ckpt.ownership import OwnerLease

    url, catalog = job
    lease = OwnerLease.claim(catalog.storage, "undying run of job 'j'", 60.0)
    out = run(capsys, "ls", url)[1]
    assert "owner: undying run of job 'j' on host" in out and f"pid {os.getpid()}, running (last heartbeat" in out
    lease.release()
    owner = json.loads(run(capsys, "ls", url, "--json")[1])["owner"]
    assert owner["standing"] == "released" and owner["pid"] == os.getpid() and owner["epoch"] == 0
    assert "last owner: undying run of job 'j'" in run(capsys, "ls", url)[1]


def test_ls_says_when_a_running_owner_has_gone_silent(capsys, job):
    import json
    import time

    url, catalog = job
    record = {"holder": "undying run of job 'j'", "lease_s": 2.0, "claimed_at": time.time() - 60,
              "process": {"host": "node-3/boot/pid:[1]", "pid": 11, "started": "1"}}
    catalog.storage.create_exclusive(catalog.storage.path("owner", "claim-0000000000.json"),
                                     json.dumps(record).encode())
    out = run(capsys, "ls", url)[1]  # on another host, no beat for 60 s: not known dead, but past its lease
    assert "owner: undying run of job 'j' on host node-3, pid 11, silent for longer than its 2 s lease" in out
    catalog.storage.write_immutable(catalog.storage.path("owner", "claim-0000000001.json"), b'{"holder": ')
    assert "owner: unknown: the owner folder does not parse" in run(capsys, "ls", url)[1]


def test_ls_accepts_a_plain_path(capsys, job, tmp_path):
    code, out, _ = run(capsys, "ls", str(tmp_path / "ckpt" / "myjob"))
    assert code == 0 and "3 committed checkpoint(s)" in out


def test_ls_of_checkpoint_url_without_the_job_name_points_at_the_job(capsys, job, tmp_path):
    code, _, err = run(capsys, "ls", f"file://{tmp_path}/ckpt")
    assert code == 2
    _one_line_error(err, "holds job directories", f"file://{tmp_path}/ckpt/myjob")


def test_bad_locations_exit_2_with_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "ls", str(tmp_path / "nothing-here"))
    assert code == 2
    _one_line_error(err, "does not exist", "<checkpoint.url>/<job name>")
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "verify", str(tmp_path / "empty"))
    assert code == 2
    _one_line_error(err, "has no checkpoints")
    code, _, err = run(capsys, "ls", "nosuchproto://bucket/x")
    assert code == 2
    _one_line_error(err, "unknown or unavailable protocol")
    code, _, err = run(capsys, "ls", str(tmp_path), "--storage-option", "endpoint_url")
    assert code == 2
    _one_line_error(err, "--storage-option expects KEY=VALUE")
    (tmp_path / "a-file.txt").write_text("not checkpoints")
    code, _, err = run(capsys, "ls", str(tmp_path / "a-file.txt"))
    assert code == 2 and "endpoint" not in err
    _one_line_error(err, "a-file.txt is a file, not a checkpoint root")


def test_only_unfinished_saves_is_an_error_that_says_so(capsys, tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/job"))
    write_shard(catalog.storage, 5, 0, make_state(), blocking_s=0.0)
    code, _, err = run(capsys, "gc", str(tmp_path / "job"))
    assert code == 2
    _one_line_error(err, "no committed checkpoint", "steps 5")
    assert catalog.all_steps() == [5]


def test_verify_passes_intact_checkpoints(capsys, job):
    url, _ = job
    code, out, err = run(capsys, "verify", url)
    assert code == 0 and not err
    assert [line.split(":")[0] for line in out.splitlines()] == ["step 10", "step 20", "step 30"]
    assert all(": ok (" in line for line in out.splitlines())


def test_verify_names_the_shard_with_a_flipped_bit(capsys, job):
    url, catalog = job
    bad_file = shard_of(catalog, 20, "model/w")
    flip_bit(catalog, 20, bad_file)
    code, out, err = run(capsys, "verify", url)
    assert code == 1
    assert "step 10: ok" in out and "step 30: ok" in out
    assert "step 20: CORRUPT" in out and bad_file in out
    assert "1 of 3" in err and bad_file in err and "Traceback" not in err
    code, out, _ = run(capsys, "verify", url, "--step", "30")
    assert code == 0 and out.startswith("step 30: ok")
    code, _, err = run(capsys, "verify", url, "--step", "20")
    assert code == 1 and bad_file in err


def test_verify_reports_a_checkpoint_the_store_keeps_failing_and_checks_the_others(capsys, job, monkeypatch):
    url, catalog = job
    real = Storage.read_range_into

    def flaky(self, path, start, out):
        if "/step-000000020/" in path:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, path, start, out)

    monkeypatch.setattr(Storage, "read_range_into", flaky)
    code, out, err = run(capsys, "verify", url, "--read-retry-s", "0.2")
    assert code == 1, err
    assert "step 10: ok" in out and "step 30: ok" in out  # the failing store stopped nothing else
    assert "step 20: NOT VERIFIED (transient storage errors): bytes" in out and "read_retry_s=0.2" in out
    assert "1 of 3" in err and "step 20: not verified, the store kept failing" in err and "Traceback" not in err
    assert catalog.committed_steps() == [10, 20, 30]
    code, _, err = run(capsys, "verify", url, "--read-retry-s", "-1")
    assert code == 2 and "--read-retry-s -1: must be 0" in err
    for endless in ("nan", "inf"):  # (nan compared false with everything: the reads were retried for ever)
        for command in ("verify", "gc"):
            code, _, err = run(capsys, command, url, "--read-retry-s", endless)
            assert code == 2 and f"--read-retry-s {endless}: must be 0 (no retry) or a finite number" in err


def test_a_checkpoint_retention_deletes_while_verify_runs_is_not_called_corrupt(capsys, job, monkeypatch):
    import shutil

    import ckpt.reader

    url, catalog = job
    real = ckpt.reader.verify_checkpoint

    def retention_meanwhile(cat, step, *args, **kwargs):
        if step == 10:  # a running job committed 40 and retired 10 after verify listed the steps
            shutil.rmtree(catalog.storage.path("step-000000010"))
        return real(cat, step, *args, **kwargs)

    monkeypatch.setattr(ckpt.reader, "verify_checkpoint", retention_meanwhile)
    code, out, err = run(capsys, "verify", url)
    assert code == 0, err
    assert out.splitlines()[0].startswith("step 10: deleted meanwhile") and "CORRUPT" not in out
    assert "step 20: ok" in out and "step 30: ok" in out


def test_a_checkpoint_a_running_job_quarantines_while_verify_runs_is_called_corrupt(capsys, job, monkeypatch):
    import ckpt.reader

    url, catalog = job
    real = ckpt.reader.verify_checkpoint

    def quarantined_meanwhile(cat, step, *args, **kwargs):
        if step == 10:  # a running job's restore found it damaged and moved its manifest aside
            catalog.quarantine(10)
        return real(cat, step, *args, **kwargs)

    monkeypatch.setattr(ckpt.reader, "verify_checkpoint", quarantined_meanwhile)
    code, out, err = run(capsys, "verify", url)
    assert code != 0 and "deleted meanwhile" not in out
    assert "step 10" in out and "CORRUPT" in out.splitlines()[0], out


def test_verify_of_a_step_that_is_not_committed(capsys, job):
    url, _ = job
    code, _, err = run(capsys, "verify", url, "--step", "15")
    assert code == 2
    _one_line_error(err, "--step 15", "committed steps: 10, 20, 30")


def _saved_model(step: int) -> dict[str, torch.Tensor]:
    return {name.removeprefix("model/"): t for name, t in make_state(step).items() if name.startswith("model/")}


def test_export_writes_the_model_tensors_as_safetensors(capsys, job, tmp_path):
    url, _ = job
    out_file = tmp_path / "model.safetensors"
    code, out, err = run(capsys, "export", url, "--step", "20", "--out", str(out_file))
    assert code == 0 and not err and "4 tensors of step 20" in out
    loaded = load_file(str(out_file))  # the reference reader
    expected = _saved_model(20)
    assert set(loaded) == set(expected) == {"w", "b", "half", "emb.weight"}
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(str(out_file), "pt") as f:
        assert f.metadata()["undying.step"] == "20"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_export_defaults_to_the_newest_and_reads_in_bounded_batches(capsys, job, tmp_path):
    url, catalog = job
    code, out, _ = run(capsys, "export", url, "--out", str(tmp_path / "newest.safetensors"))
    assert code == 0 and "of step 30" in out
    loaded = load_file(str(tmp_path / "newest.safetensors"))
    assert all(torch.equal(loaded[n], t) for n, t in _saved_model(30).items())
    # One tensor per batch: the same file, byte for byte.
    reads = []
    catalog.read_manifest = lambda step, real=catalog.read_manifest: reads.append(step) or real(step)
    export_safetensors(catalog, 30, str(tmp_path / "batched.safetensors"), batch_bytes=1)
    assert (tmp_path / "batched.safetensors").read_bytes() == (tmp_path / "newest.safetensors").read_bytes()
    # Every batch by the one manifest: a step committed again mid-export must not mix two checkpoints.
    assert reads == [30]


def test_export_of_a_damaged_checkpoint_writes_nothing(capsys, job, tmp_path):
    url, catalog = job
    flip_bit(catalog, 30, shard_of(catalog, 30, "model/w"))
    out_file = tmp_path / "model.safetensors"
    code, _, err = run(capsys, "export", url, "--out", str(out_file))
    assert code == 1 and "damaged" in err and "Traceback" not in err
    assert not out_file.exists() and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_export_of_a_step_deleted_meanwhile_says_so_not_damaged(capsys, job, tmp_path, monkeypatch):
    # A running job's retention deletes step 30 (its manifest, then its shards) while it is exported.
    import os

    from ckpt import export

    url, catalog = job
    real = export.load_checkpoint

    def retention_strikes(cat, step, *args, **kwargs):
        catalog.storage.fs.rm(os.path.dirname(catalog.manifest_path(step)), recursive=True)
        return real(cat, step, *args, **kwargs)

    monkeypatch.setattr(export, "load_checkpoint", retention_strikes)
    out_file = tmp_path / "model.safetensors"
    code, _, err = run(capsys, "export", url, "--step", "30", "--out", str(out_file))
    assert code == 1 and "step 30 was deleted meanwhile" in err and "damaged" not in err and "Traceback" not in err
    assert not out_file.exists()


def test_export_bad_arguments(capsys, job, tmp_path):
    url, _ = job
    code, _, err = run(capsys, "export", url, "--out", str(tmp_path / "no" / "dir" / "m.safetensors"))
    assert code == 2
    _one_line_error(err, "--out", "does not exist")
    code, _, err = run(capsys, "export", url, "--out", str(tmp_path / "m.safetensors"), "--prefix", "weights/")
    assert code == 2
    _one_line_error(err, "--prefix 'weights/'", "model/", "optim/")
    code, _, err = run(capsys, "export", url, "--step", "25", "--out", str(tmp_path / "m.safetensors"))
    assert code == 2
    _one_line_error(err, "--step 25")
    # An option of the other format would be ignored: refused, by name.
    code, _, err = run(capsys, "export", url, "--out", str(tmp_path / "m.safetensors"), "--dtype", "bf16")
    assert code == 2
    _one_line_error(err, "--dtype: for --format hf only", "this export is --format safetensors")
    code, _, err = run(capsys, "export", url, "--format", "hf", "--out", str(tmp_path / "hf"), "--prefix", "optim/")
    assert code == 2
    _one_line_error(err, "--prefix: for --format safetensors only")
    code, _, err = run(capsys, "export", url, "--out", "s3://bucket/m.safetensors")
    assert code == 2
    _one_line_error(err, "written to a local path")


def test_export_never_replaces_a_file_nor_writes_inside_the_checkpoint_folder(capsys, job, tmp_path):
    url, catalog = job
    mine = tmp_path / "model.safetensors"
    mine.write_bytes(b"an earlier export")
    code, _, err = run(capsys, "export", url, "--out", str(mine))
    assert code == 2 and mine.read_bytes() == b"an earlier export"
    _one_line_error(err, f"--out {mine} exists", "new file name")
    manifest = catalog.manifest_path(30)
    before = catalog.storage.read(manifest)
    code, _, err = run(capsys, "export", url, "--out", manifest)
    assert code == 2
    _one_line_error(err, "exists", "never replaces a file")
    for out, fmt in ((os.path.join(catalog.storage.root, "m.safetensors"), "safetensors"),
                     (os.path.join(catalog.storage.root, "step-000000030", "m.safetensors"), "safetensors"),
                     (os.path.join(catalog.storage.root, "hf"), "hf")):
        code, _, err = run(capsys, "export", url, "--out", out, "--format", fmt)
        assert code == 2, (out, fmt)
        _one_line_error(err, "inside the checkpoint folder", "outside it")
    other = os.path.join(os.path.dirname(catalog.storage.root), "another-job")  # another job's root, beside
    os.makedirs(os.path.join(other, "step-000000010"))
    code, _, err = run(capsys, "export", url, "--out", os.path.join(other, "m.safetensors"))
    assert code == 2 and not os.path.exists(os.path.join(other, "m.safetensors"))
    _one_line_error(err, f"inside the checkpoint folder {os.path.realpath(other)}", "outside it")
    assert catalog.storage.read(manifest) == before and catalog.committed_steps() == [10, 20, 30]


def test_gc_waits_for_a_live_job_unless_forced(capsys, job):
    from ckpt.owner_claims import epochs, newest_claim
    from ckpt.ownership import OwnerLease

    url, catalog = job
    running = OwnerLease.claim(catalog.storage, "undying run of job 'j'", 1.2)  # a job runs here, beating
    code, out, err = run(capsys, "gc", url, "--keep", "1")  # its heartbeat advances within seconds
    assert code == 2 and catalog.all_steps() == [10, 15, 20, 30, 35]
    assert out == ""  # refused before reading a checkpoint to verify it (minutes for a large one)
    _one_line_error(err, "held by undying run of job 'j' on host", "pid", "--force")
    code, out, err = run(capsys, "gc", url, "--keep", "1", "--no-verify")  # no read first: the claim's watch
    assert code == 2 and "watching its heartbeat" in err.splitlines()[0] and len(err.strip().splitlines()) == 2
    _one_line_error(err.splitlines()[1], "held by undying run of job 'j' on host", "pid", "--force")
    assert run(capsys, "gc", url, "--keep", "1", "--dry-run")[0] == 0  # looking deletes nothing
    running.release()  # it stopped
    assert run(capsys, "gc", url, "--keep", "2")[0] == 0 and catalog.committed_steps() == [20, 30]
    gc_claim = newest_claim(catalog.storage)  # gc held the folder while it deleted, and let it go
    assert gc_claim.record["holder"] == "undying ckpt gc" and gc_claim.beat["ended"]
    running = OwnerLease.claim(catalog.storage, "undying run of job 'j'", 60.0)
    assert run(capsys, "gc", url, "--keep", "1", "--force")[0] == 0 and catalog.committed_steps() == [30]
    assert epochs(catalog.storage)[-1] == running.epoch and running.lost is None  # --force claims nothing
    running.release()


def test_gc_keeps_the_newest_and_deletes_stale_unfinished_saves(capsys, job):
    url, catalog = job
    code, out, _ = run(capsys, "gc", url, "--keep", "2", "--dry-run")
    assert code == 0 and "would delete committed checkpoints: steps 10" in out
    assert "would delete unfinished saves: steps 15" in out
    assert catalog.all_steps() == [10, 15, 20, 30, 35]
    code, out, _ = run(capsys, "gc", url, "--keep", "2")
    assert code == 0 and "deleted committed checkpoints: steps 10" in out and "kept: steps 20, 30" in out
    assert catalog.all_steps() == [20, 30, 35]  # 35 is newer than the newest commit: maybe in flight
    code, out, _ = run(capsys, "gc", url, "--keep", "1")
    assert code == 0 and catalog.committed_steps() == [30]
    code, out, _ = run(capsys, "gc", url, "--keep", "1")
    assert code == 0 and "nothing to delete" in out
    code, _, err = run(capsys, "gc", url, "--keep", "0")
    assert code == 2
    _one_line_error(err, "--keep 0", "at least 1")
    assert catalog.committed_steps() == [30]


def test_gc_never_deletes_the_newest_checkpoint_that_verifies(capsys, job):
    """The two newest are damaged (a flipped bit, a torn manifest): --keep 1 by age alone would leave
    nothing a job could resume from. Step 10, the newest that verifies, is kept, and so are the
    damaged ones (evidence); the exit status says damage was found."""
    url, catalog = job
    save_checkpoint(catalog, 40, make_state(40))
    flip_bit(catalog, 30, shard_of(catalog, 30, "model/w"))
    with open(catalog.manifest_path(20), "wb") as torn:  # a file:// root: paths are local
        torn.write(b'{"torn')
    code, out, err = run(capsys, "gc", url, "--keep", "1")
    assert code == 0 and "step 40: ok" in out and catalog.committed_steps() == [40]  # the newest verifies
    flip_bit(catalog, 40, shard_of(catalog, 40, "model/w"))
    save_checkpoint(catalog, 50, make_state(50))
    flip_bit(catalog, 50, shard_of(catalog, 50, "model/w"))
    code, out, err = run(capsys, "gc", url, "--keep", "1")
    assert code == 1 and "step 50: CORRUPT" in out and "step 40: CORRUPT" in out
    assert "no committed checkpoint verifies, so none was deleted" in err and catalog.committed_steps() == [40, 50]
    code, _, err = run(capsys, "gc", url, "--keep", "1", "--no-verify", "--read-retry-s", "5")  # it would be ignored
    assert code == 2 and "--no-verify reads no checkpoint" in err and catalog.committed_steps() == [40, 50]
    assert run(capsys, "gc", url, "--keep", "1", "--no-verify")[0] == 0 and catalog.committed_steps() == [50]


def test_gc_reads_before_it_holds_the_folder(capsys, job, monkeypatch):
    """Verifying a large checkpoint takes minutes: a job starting meanwhile must not find its folder held."""
    from ckpt.owner_claims import live_owner
    from orchestrator.cli import ckpt_gc

    url, catalog = job
    held_while_reading = []

    def verify(catalog, step, read_retry_s):
        held_while_reading.append(live_owner(catalog.storage))
        return real(catalog, step, read_retry_s)

    real = ckpt_gc.verify_one
    monkeypatch.setattr(ckpt_gc, "verify_one", verify)
    assert run(capsys, "gc", url, "--keep", "1")[0] == 0 and catalog.committed_steps() == [30]
    assert held_while_reading == [None]


def test_gc_of_a_checkpoint_retention_deletes_while_it_verifies_is_no_failure(capsys, job, monkeypatch):
    import shutil

    import ckpt.reader

    url, catalog = job
    real = ckpt.reader.verify_checkpoint

    def retention_meanwhile(cat, step, *args, **kwargs):
        if step == 30:  # a job's retention (gc --force runs beside one) took it after the listing
            shutil.rmtree(catalog.storage.path("step-000000030"))
        return real(cat, step, *args, **kwargs)

    monkeypatch.setattr(ckpt.reader, "verify_checkpoint", retention_meanwhile)
    code, out, err = run(capsys, "gc", url, "--keep", "1", "--force")
    assert code == 0, err
    assert "step 30: deleted meanwhile" in out and "did not verify" not in err and catalog.committed_steps() == [20]


def test_gc_keeps_every_checkpoint_down_to_the_newest_intact_one(capsys, job):
    url, catalog = job
    flip_bit(catalog, 30, shard_of(catalog, 30, "model/w"))
    code, out, err = run(capsys, "gc", url, "--keep", "1", "--dry-run")
    assert code == 1 and "step 30: CORRUPT" in out and "step 20: ok" in out
    assert "would delete committed checkpoints: steps 10" in out and "kept: steps 20, 30" in out
    assert "step(s) 30 did not verify" in err and "step 20, the newest that verifies" in err
    code, out, _ = run(capsys, "gc", url, "--keep", "1")
    assert code == 1 and catalog.committed_steps() == [20, 30]


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "ckpt", "ls", str(tmp_path / "missing")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    _one_line_error(result.stderr, "undying ckpt ls:", "does not exist")


def test_ctrl_c_while_gc_watches_a_job_deletes_nothing_and_prints_one_line(job):
    import json

    from ckpt.owner_claims import epochs

    url, catalog = job
    # A holder on another host, silent: gc looks for a few seconds, verifies, then watches a whole lease.
    record = {"holder": "undying run of job 'j'", "lease_s": 12.0, "claimed_at": time.time(),
              "process": {"host": "node-3/boot/pid:[1]", "pid": 11, "started": "1"}}
    catalog.storage.create_exclusive(catalog.storage.path("owner", "claim-0000000000.json"),
                                     json.dumps(record).encode())
    # SIGINT as a terminal sends it: a shell's background job (a CI runner's) starts with it ignored.
    gc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "ckpt", "gc", url, "--keep", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = gc.stderr.readline()
    assert "watching its heartbeat" in line, line + gc.stderr.read()
    time.sleep(0.5)  # inside the watch
    gc.send_signal(signal.SIGINT)
    out, err = gc.communicate(timeout=60)
    assert gc.returncode == 130 and "step 30" in out  # it had verified the newest before it watched
    _one_line_error(err, "undying ckpt gc: interrupted")
    assert catalog.all_steps() == [10, 15, 20, 30, 35] and epochs(catalog.storage) == [0]  # gc claimed nothing


def test_export_into_a_directory_this_user_cannot_write_names_out(capsys, job, tmp_path, monkeypatch):
    url, _ = job
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(locked) else real(path, mode))
    code, _, err = run(capsys, "export", url, "--out", str(locked / "m.safetensors"))
    assert code == 2
    _one_line_error(err, f"--out {locked / 'm.safetensors'}", "cannot be written by this user")
    assert list(locked.iterdir()) == []
