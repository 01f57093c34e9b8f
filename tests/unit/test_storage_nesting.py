"""`checkpoint.url` is the folder of jobs' roots: the storage probe refuses one that is a job's root
itself, or lies inside one (that job's retention would delete this job's checkpoints)."""

from __future__ import annotations

from orchestrator.spec.storage_check import check_storage


def _job_root(folder, steps=(50,), claim=True):
    for step in steps:
        (folder / f"step-{step:09d}").mkdir(parents=True)
        (folder / f"step-{step:09d}" / "manifest.json").write_text("{}")
    if claim:
        (folder / "owner").mkdir(parents=True, exist_ok=True)
        (folder / "owner" / "claim-0000000000.json").write_text("{}")


def test_a_jobs_root_given_as_the_url_is_refused_naming_its_parent(tmp_path):
    _job_root(tmp_path / "ckpt" / "demo")
    [problem] = check_storage(f"file://{tmp_path}/ckpt/demo", {})
    assert problem.field == "checkpoint.url"
    assert f"did you mean checkpoint.url file://{tmp_path}/ckpt with name demo" in problem.message


def test_a_root_holding_only_its_lease_is_a_jobs_root(tmp_path):
    _job_root(tmp_path / "demo", steps=())
    [problem] = check_storage(str(tmp_path / "demo"), {})
    assert "is a job's checkpoint root" in problem.message


def test_a_url_inside_a_step_folder_or_below_a_jobs_root_is_refused(tmp_path):
    _job_root(tmp_path / "demo")
    for url in (tmp_path / "demo" / "step-000000050", tmp_path / "demo" / "step-000000050" / "more",
                tmp_path / "demo" / "nested", tmp_path / "demo" / "nested" / "deeper"):
        [problem] = check_storage(str(url), {})
        assert problem.field == "checkpoint.url" and "is inside the checkpoint root" in problem.message, url
        assert str(tmp_path / "demo") in problem.message


def test_the_folder_of_jobs_and_a_folder_named_owner_above_are_fine(tmp_path):
    _job_root(tmp_path / "ckpt" / "demo")
    assert check_storage(str(tmp_path / "ckpt"), {}) == []
    # A folder named owner without lease claims (a user called owner's home) is no job's root.
    (tmp_path / "home" / "owner").mkdir(parents=True)
    assert check_storage(str(tmp_path / "home" / "owner" / "ckpt"), {}) == []


def test_folders_that_cannot_be_listed_are_taken_for_no_jobs(tmp_path, monkeypatch):
    # A policy that grants only the job's own prefix: listing above it is refused, which proves nothing.
    from ckpt.storage import Storage

    _job_root(tmp_path / "demo")
    real = Storage.listdir

    def refused_above(self, path):
        if not path.rstrip("/").endswith("ckpt"):
            raise PermissionError(f"AccessDenied: ListObjectsV2 on {path}")
        return real(self, path)

    monkeypatch.setattr(Storage, "listdir", refused_above)
    assert check_storage(str(tmp_path / "demo" / "ckpt"), {}) == []
