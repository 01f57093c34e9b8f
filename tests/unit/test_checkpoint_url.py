"""Where a job's checkpoints go: a relative path is made absolute in the driver, except where that
would name a folder no later run finds (ckpt.config.CheckpointConfig's url)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ckpt.config import CheckpointConfig


def test_a_relative_checkpoint_path_under_a_ray_job_s_working_dir_copy_is_refused(tmp_path, monkeypatch):
    # `ray job submit --working-dir .` runs the driver in Ray's per-upload copy: a relative root there
    # would be a new, node-local folder at every submission (the job starting again at step 0).
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    with pytest.raises(ValidationError, match=r"'runs/ckpt' is relative, and this driver runs in Ray's copy of the "
                                              r"job's working directory .*_ray_pkg_0123abcd\), which each `ray job "
                                              r"submit` makes anew on one node; give a path every node shares"):
        CheckpointConfig(url="runs/ckpt")
    assert CheckpointConfig(url="/mnt/shared/ckpt").url == "file:///mnt/shared/ckpt"  # absolute: as given
    assert CheckpointConfig(url=f"file://{copy}/ckpt").url == f"file://{copy}/ckpt"  # (a rank re-reading the spec)
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(url="runs/ckpt").url == f"file://{tmp_path}/runs/ckpt"
