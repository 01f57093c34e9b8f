"""Files a command writes when it ends, checked before it starts: a directory, or a place this user
cannot write, fails at once by flag rather than after a run of hours."""

from __future__ import annotations

from pathlib import Path

from orchestrator.cli.main import main
from orchestrator.cli.output_paths import output_problems

ROOT = Path(__file__).resolve().parents[2]


def test_a_new_file_in_a_new_folder_is_fine_and_nothing_is_created(tmp_path):
    assert output_problems({"--report": str(tmp_path / "a" / "b" / "r.json"), "--timeline": None}) == []
    assert list(tmp_path.iterdir()) == []


def test_a_directory_or_a_path_under_a_file_is_refused_by_flag(tmp_path):
    (tmp_path / "f").write_text("x")
    problems = output_problems({"--report": str(tmp_path), "--out": str(tmp_path / "f" / "s.json")})
    assert [p.field for p in problems] == ["--report", "--out"]
    assert "is a directory" in problems[0].message and "is a file, so" in problems[1].message


def test_undying_run_refuses_a_report_path_that_is_a_directory_before_ray(tmp_path, capsys):
    code = main(["run", str(ROOT / "examples/demo.yaml"), "--report", str(tmp_path),
                 "--set", f"checkpoint.url=file://{tmp_path}/ckpt"])
    err = capsys.readouterr().err
    assert code == 2 and "--report" in err and "is a directory" in err


def test_a_path_inside_a_checkpoint_root_is_refused_before_it_could_replace_a_checkpoint_s_file(tmp_path):
    step = tmp_path / "ck" / "job" / "step-000000100"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    [problem] = output_problems({"--out": str(step / "manifest.json")})
    assert problem.field == "--out" and f"inside the checkpoint folder {tmp_path / 'ck' / 'job'}" in problem.message
    assert output_problems({"--out": str(tmp_path / "ck" / "report.json")}) == []  # beside the roots is fine


def test_a_root_marked_only_by_its_lease_claims_is_one_and_a_bare_owner_folder_is_not(tmp_path):
    (tmp_path / "home" / "owner").mkdir(parents=True)  # a user's folder that happens to hold one named owner
    assert output_problems({"--report": str(tmp_path / "home" / "r.json")}) == []
    (tmp_path / "home" / "owner" / "claim-1.json").write_text("{}")  # a job that claimed, before its first save
    [problem] = output_problems({"--report": str(tmp_path / "home" / "r.json")})
    assert f"inside the checkpoint folder {tmp_path / 'home'}" in problem.message


def test_a_parent_this_user_cannot_enter_is_a_problem_not_a_traceback(tmp_path, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", denied)
    [problem] = output_problems({"--report": str(tmp_path / "locked" / "r.json")})
    assert problem.field == "--report" and "cannot be reached by this user (Permission denied)" in problem.message
