"""Progress of `ckpt verify`, `ckpt export` and `data prepare`: a tqdm bar when stderr is a
terminal, a plain line every few seconds when it is not (a log), and stdout left alone."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from monitor import progress as progress_mod
from monitor.progress import Progress
from orchestrator.cli.data.execute import Progress as DataProgress
from orchestrator.cli.data.shard_task import UnitResult
from orchestrator.cli.main import main
from tests._checkpoints import save_checkpoint


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_plain_line_every_interval_and_nothing_before():
    out, now = io.StringIO(), [0.0]
    with Progress("undying ckpt verify step 4", stream=out, every_s=10, clock=lambda: now[0]) as progress:
        progress.advance(1024, total=4096)
        assert out.getvalue() == ""  # a quick operation prints nothing
        now[0] = 12.0
        progress.advance(1024, note="2 files")
    assert out.getvalue() == "undying ckpt verify step 4: 2.0 KiB of 4.0 KiB (50%), 12 s, 2 files\n"
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_a_bar_that_is_gone_at_the_end():
    out = Terminal()
    with Progress("undying ckpt export step 4", 4096, stream=out) as progress:
        progress.advance(2048)
        progress._bar.refresh()
        assert "undying ckpt export step 4:  50%|" in out.getvalue()
    assert out.getvalue().endswith("\r") or out.getvalue().endswith("\x1b[A")  # leave=False: cleared


def test_a_disabled_progress_shows_nothing():  # the ranks other than 0 during a restore
    out = Terminal()
    with Progress("rank 3: restoring step 4", stream=out, every_s=0, enabled=False) as progress:
        progress.advance(10, total=20)
    assert out.getvalue() == ""


@pytest.fixture
def checkpoint(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt"))
    state = {"model/w": torch.randn(256, 64), "model/b": torch.randn(64), "optim/step": torch.tensor(1.0)}
    save_checkpoint(catalog, 4, state, world=2)
    return catalog, tmp_path


def test_verify_and_export_report_every_byte_they_read_or_write(checkpoint):
    from ckpt.export import export_safetensors
    from ckpt.reader import verify_checkpoint

    catalog, tmp_path = checkpoint
    seen = []
    verify_checkpoint(catalog, 4, on_bytes=lambda n, total: seen.append((n, total)))
    assert seen and sum(n for n, _ in seen) == seen[0][1] >= catalog.read_manifest(4).total_bytes
    seen.clear()  # a restore reads through the same fetch (rank 0 shows it: monitor.progress)
    from ckpt.reader import _whole_targets, read_slices

    wanted = _whole_targets(catalog.read_manifest(4), ["model/w"])
    read_slices(catalog, 4, wanted, on_bytes=lambda n, total: seen.append((n, total)))
    assert sum(n for n, _ in seen) == seen[0][1] >= 256 * 64 * 4
    seen.clear()
    export_safetensors(catalog, 4, str(tmp_path / "m.safetensors"), on_bytes=lambda n, total: seen.append((n, total)))
    assert sum(n for n, _ in seen) == seen[0][1] == (256 * 64 + 64) * 4


@pytest.mark.parametrize("terminal", [True, False])
def test_ckpt_verify_and_export_show_progress_on_stderr_only(checkpoint, capsys, monkeypatch, terminal):
    catalog, tmp_path = checkpoint
    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)  # a line per read in a log, to see one here
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["ckpt", "verify", catalog.storage.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True  # stdout holds only the JSON
    assert main(["ckpt", "export", catalog.storage.url, "--out", str(tmp_path / "m.safetensors")]) == 0
    assert os.path.getsize(tmp_path / "m.safetensors") > (256 * 64 + 64) * 4
    text = err.getvalue()
    for label in ("undying ckpt verify step 4", "undying ckpt export step 4"):
        assert (f"{label}:" in text) and (("%|" in text) == terminal), text
    if not terminal:
        assert "undying ckpt export step 4: 64.2 KiB of 64.2 KiB (100%)" in text


def test_data_prepare_shows_a_bar_on_a_terminal_and_lines_in_a_log():
    results = [UnitResult(index=i, n_tokens=1000, n_documents=3) for i in range(4)]
    tty = Terminal()
    with DataProgress(4, stream=tty) as progress:
        progress.begin("this process")
        for r in results:
            progress.add(r)
        progress._bar._bar.refresh()
        assert "data prepare: 100%|" in tty.getvalue() and "4.0k tokens" in tty.getvalue()
    assert tty.getvalue().startswith("data prepare: 4 units to run on this process\n")
    log = io.StringIO()
    with DataProgress(4, stream=log, every_s=0.01) as progress:
        progress.begin("this process")
        progress.add(results[0])
        progress._stop.wait(0.2)
    assert "data prepare: 1/4 shards, 3 documents, 1.0k tokens" in log.getvalue() and "%|" not in log.getvalue()
