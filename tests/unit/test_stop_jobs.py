"""`undying stop-jobs` (a head pod's preStop hook) against a fake of Ray's job API: one job whose stop
fails leaves the others to be stopped, and a --wait that is no number of seconds is refused."""

from __future__ import annotations

import types

import pytest
import ray.job_submission

from orchestrator.cli.main import main


class FakeJobs:
    """The job API as stop-jobs uses it: two running jobs, the first one's stop refused."""

    def __init__(self, address: str):
        self.status = {"a": "RUNNING", "b": "RUNNING"}
        FakeJobs.last = self

    def list_jobs(self):
        return [types.SimpleNamespace(submission_id=job, status=status, driver_info=None)
                for job, status in self.status.items()]

    def stop_job(self, job: str) -> None:
        if job == "a":
            raise RuntimeError("permission denied")
        self.status[job] = "STOPPED"

    def get_job_status(self, job: str) -> str:
        return self.status[job]


def test_a_job_whose_stop_fails_leaves_the_others_to_be_stopped(monkeypatch, capsys):
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", FakeJobs)
    assert main(["stop-jobs", "--wait", "0.6"]) == 1  # job a still runs: the pod ends all the same
    out, err = capsys.readouterr()
    assert "job a: not stopped (RuntimeError: permission denied)" in out
    assert "job b: its driver is not a known process of this node: stopped" in out
    assert FakeJobs.last.status == {"a": "RUNNING", "b": "STOPPED"} and "job(s) ['a'] still running" in err


@pytest.mark.parametrize("wait", ["-1", "nan", "1e9"])
def test_a_wait_that_is_no_number_of_seconds_is_refused(monkeypatch, capsys, wait):
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", lambda address: pytest.fail("no request"))
    assert main(["stop-jobs", "--wait", wait]) == 2
    assert "--wait must be a number of seconds from 0 to 3600" in capsys.readouterr().err
