"""`undying report CKPT_URL` from an event log, `--json` output of report and eval (errors too),
and a tracker's missing package refused before a job starts."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from ckpt.storage import Storage
from monitor.event_log import EventLog
from monitor.tracking import Trackers
from orchestrator.cli.main import main
from tests.unit.test_tracking import scripted_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")


def _logged(tmp_path, run: str, end: bool = True):
    storage = Storage(f"file://{tmp_path}/ck/tiny")
    log = EventLog(storage, run=run)
    if not end:  # a controller that died: the end never reached the log
        emit = log.emit
        log.emit = lambda ev: None if ev["kind"] == "end" else emit(ev)
    trackers = Trackers([log])
    _, report = scripted_run(trackers)
    trackers.close()
    return f"file://{tmp_path}/ck/tiny", report


def test_report_rebuilds_the_table_and_the_png_of_the_newest_run(tmp_path, capsys, monkeypatch):
    url, report = _logged(tmp_path, "20261203T060000Z-aaaaaa")
    _logged(tmp_path, "20261203T070000Z-bbbbbb", end=False)
    monkeypatch.chdir(tmp_path)
    assert main(["report", url, "--run", "20261203T060000Z-aaaaaa"]) == 0
    out = capsys.readouterr().out
    assert report.summary_table() in out and "timeline written to tiny-timeline.png" in out
    assert (tmp_path / "tiny-timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png, out_json = str(tmp_path / "t.png"), str(tmp_path / "r.json")
    assert main(["report", url, "--json", "--timeline", png, "--out", out_json]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["run"] == "20261203T070000Z-bbbbbb" and len(result["runs"]) == 2  # the newest by default
    assert result["report"]["status"] == "unfinished" and len(result["report"]["losses"]) == 8
    assert os.path.getsize(tmp_path / "t.png") > 0 and json.loads((tmp_path / "r.json").read_text())["job"] == "tiny"


@pytest.mark.parametrize("argv, says", [
    (["--run", "nope"], "--run nope: no such run"),
    (["--timeline", "x.png", "--no-timeline"], "give one"),
    (["--no-timeline", "--out", "."], "--out: . is a directory; give a file path"),
])
def test_report_errors_name_the_argument_and_parse_under_json(tmp_path, capsys, argv, says):
    url, _ = _logged(tmp_path, "r1")
    assert main(["report", url, *argv]) == 2
    assert says in capsys.readouterr().err
    assert main(["report", url, *argv, "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert result["exit"] == 2 and says in result["error"]


def test_report_of_a_root_without_an_event_log(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", f"file://{tmp_path}/empty", "--json"]) == 2
    assert "has no event log (events/)" in json.loads(capsys.readouterr().out)["error"]
    url, _ = _logged(tmp_path, "r1")
    (tmp_path / "a-file").write_text("x")
    parent = url.rsplit("/", 1)[0]
    for where, says in ((f"file://{tmp_path}/none", "does not exist"), (f"file://{tmp_path}/a-file", "is a file"),
                        (parent, f"holds job folders, not one job's log; give one of them, e.g. {url}")):
        assert main(["report", where, "--json"]) == 2
        result = json.loads(capsys.readouterr().out)
        assert result["exit"] == 2 and says in result["error"], result


def test_eval_errors_parse_under_json(tmp_path, capsys):
    assert main(["eval", f"file://{tmp_path}/none", "--data", str(tmp_path / "d"), "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert result["exit"] == 2 and result["error"].startswith("undying eval: ")


def test_validate_refuses_a_tracker_whose_package_is_missing(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["validate", TINY, "--offline", "--set", "monitor.wandb={project: demo}", "--json"]) == 2
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] is False
    assert result["problems"][0]["field"] == "monitor.wandb"
    assert "pip install 'undying[wandb]'" in result["problems"][0]["message"]


def test_report_without_matplotlib_skips_the_default_png_and_refuses_an_asked_one(tmp_path, capsys, monkeypatch):
    url, _ = _logged(tmp_path, "r1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # the standard way to block an import
    assert main(["report", url]) == 0
    assert "no timeline PNG: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "tiny-timeline.png").exists()
    assert main(["report", url, "--timeline", "x.png"]) == 2
    assert "--timeline needs matplotlib: pip install 'undying[plot]'" in capsys.readouterr().err
