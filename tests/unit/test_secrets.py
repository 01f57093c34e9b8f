"""Credentials: read from a file or the environment, refused on the command line, and never
written into a manifest, a report, the spec hash or a log line."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.cli.main import main
from orchestrator.controller.machine import Controller
from orchestrator.spec.job_spec import HASH_EXCLUDED, load_spec, spec_hash, validate_spec
from orchestrator.spec.problems import SpecError
from orchestrator.wire.store import RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup

SECRET, KEY = "s3cr3t-VALUE-never-logged", "AKIA-never-logged"


def _spec_data(tmp_path, options_file: str | None = None) -> dict:
    # No memory level: the fake worker group sends no snapshot receipts.
    checkpoint = {"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2, "memory": {"enabled": False}}
    if options_file:
        checkpoint["storage_options_file"] = options_file
    return {"name": "unit", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 20, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 2},
            "checkpoint": checkpoint}


def _write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_options_file_is_read_into_the_spec_and_left_out_of_the_hash(tmp_path):
    _write(tmp_path, "creds.yaml", {"key": KEY, "secret": SECRET})
    spec_path = _write(tmp_path, "job.yaml", _spec_data(tmp_path, "creds.yaml"))  # relative to the spec
    spec = load_spec(spec_path)
    assert spec.checkpoint.storage_options == {"key": KEY, "secret": SECRET}
    assert spec_hash(spec) == spec_hash(validate_spec(_spec_data(tmp_path)))
    hashed = json.dumps(spec.model_dump(mode="json", by_alias=True, exclude=HASH_EXCLUDED))
    assert SECRET not in hashed and KEY not in hashed
    # Another endpoint is the same job: it resumes from the checkpoints it finds there.
    moved = _spec_data(tmp_path)
    moved["checkpoint"]["storage_options"] = {"endpoint_url": "http://elsewhere:9000"}
    assert spec_hash(validate_spec(moved)) == spec_hash(spec)


def test_a_relative_options_file_that_is_missing_says_where_it_was_looked_for(tmp_path):
    (tmp_path / "sub").mkdir()
    spec_path = _write(tmp_path / "sub", "job.yaml", _spec_data(tmp_path, "creds.yaml"))
    with pytest.raises(SpecError) as caught:
        load_spec(spec_path)
    [problem] = caught.value.problems
    assert problem.field == "checkpoint.storage_options_file"
    assert f"(read as {tmp_path}/sub/creds.yaml: a relative path is taken from the spec's directory)" in problem.message


@pytest.mark.parametrize(("content", "inline", "fragment"), [
    (None, None, "cannot be read"),
    ("[1, 2]", None, "does not hold a mapping"),
    ("{a: [", None, "not valid YAML"),
    ("key: a\nkey: b\n", None, "not valid YAML or JSON at line 2"),  # a key given twice, as in the spec
    (f"{{secret: {SECRET}}}", {"secret": "x"}, "both set secret"),
])
def test_a_bad_options_file_is_a_problem_naming_the_field(tmp_path, content, inline, fragment):
    data = _spec_data(tmp_path, str(tmp_path / "creds.yaml"))
    if content is not None:
        (tmp_path / "creds.yaml").write_text(content)
    if inline:
        data["checkpoint"]["storage_options"] = inline
    with pytest.raises(SpecError) as caught:
        validate_spec(data)
    [problem] = caught.value.problems
    assert problem.field == "checkpoint.storage_options_file" and fragment in problem.message
    assert SECRET not in str(caught.value)


def test_an_options_file_reads_plain_scalars_as_the_spec_does(tmp_path):
    """YAML 1.2, as the spec: a date-like key, 'no' and a zero-padded number are not a date, false and octal."""
    (tmp_path / "creds.yaml").write_text("key: 2024-06-01\nsecret: no\nmax_pool: 010\n")
    spec = validate_spec(_spec_data(tmp_path, str(tmp_path / "creds.yaml")))
    assert spec.checkpoint.storage_options == {"key": "2024-06-01", "secret": "no", "max_pool": 10}


@pytest.mark.parametrize("override", [
    f"checkpoint.storage_options.secret={SECRET}",
    f"data.storage_options={{key: {SECRET}}}",
    f"checkpoint.storage_options.client_kwargs={{aws_session_token: {SECRET}}}",
    f"eval={{path: x, every_steps: 1, storage_options: {{password: {SECRET}}}}}",
])
def test_credentials_on_the_command_line_are_refused(tmp_path, capsys, override):
    spec_path = _write(tmp_path, "job.yaml", _spec_data(tmp_path))
    assert main(["validate", spec_path, "--set", override]) == 2
    err = capsys.readouterr().err
    assert "--set" in err and "refused, a credential on the command line" in err and "storage_options_file" in err
    assert SECRET not in err
    # An endpoint is no credential.
    assert main(["validate", spec_path, "--set", "checkpoint.storage_options.endpoint_url=http://h:1"]) == 0


def test_ckpt_commands_refuse_credential_flags_and_read_an_options_file(tmp_path, capsys):
    assert main(["ckpt", "ls", str(tmp_path), "--storage-option", f"aws_secret_access_key={SECRET}"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "--storage-options-file" in err and SECRET not in err
    creds = _write(tmp_path, "creds.json", {"secret": SECRET})
    assert main(["ckpt", "ls", str(tmp_path / "none"), "--storage-options-file", creds]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and SECRET not in err  # got past the options, to the location


def test_no_secret_in_manifests_reports_or_logs(tmp_path, caplog):
    _write(tmp_path, "creds.yaml", {"key": KEY, "secret": SECRET, "client_kwargs": {"aws_session_token": SECRET}})
    spec = load_spec(_write(tmp_path, "job.yaml", _spec_data(tmp_path, "creds.yaml")))
    assert spec.checkpoint.storage_options["secret"] == SECRET  # the ranks do get them
    rendezvous, lines = RendezvousServer("127.0.0.1"), []
    catalog = Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    with caplog.at_level(logging.DEBUG):
        report = Controller(spec, workers, rendezvous, catalog, JobMetrics(spec.name), printer=lines.append,
                            poll_s=0.001, release_timeout_s=0.5, commit_lane=False).run()
    assert report.status == "succeeded" and catalog.committed_steps() == [10, 20]
    written = [p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert sum(b"spec_hash" in blob for blob in written) == 2  # both manifests were searched
    for text in [report.model_dump_json(), *lines, caplog.text, *(b.decode("latin-1") for b in written)]:
        assert SECRET not in text and KEY not in text


def test_model_storage_options_come_from_a_file_and_stay_out_of_the_hash_and_the_architecture(tmp_path):
    from tests._hf import save_hf

    save_hf(tmp_path / "hf")
    _write(tmp_path, "creds.yaml", {"key": KEY, "secret": SECRET})
    plain = {**_spec_data(tmp_path), "model": {"from_hf": str(tmp_path / "hf")},
             "data": {"source": "synthetic", "seq_len": 16}}
    spec = load_spec(_write(tmp_path, "job.yaml", {**plain, "model": {**plain["model"],
                                                                      "storage_options_file": "creds.yaml"}}))
    assert spec.model.storage_options == {"key": KEY, "secret": SECRET}  # config.json was read with them
    assert spec_hash(spec) == spec_hash(validate_spec(plain))
    assert SECRET not in json.dumps(spec.model.architecture())  # what a manifest carries of the model
    with pytest.raises(SpecError, match=r"from_hf is not set; remove model.storage_options"):
        validate_spec({**plain, "model": {"preset": "tiny", "storage_options": {"endpoint_url": "http://x"}}})


def test_a_misspelt_options_file_key_is_pointed_at_the_file_key_not_the_inline_one(tmp_path):
    from orchestrator.spec.job_spec import SpecError, validate_spec

    data = {"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 10, "global_batch": 4},
            "checkpoint": {"url": f"file://{tmp_path}/ck", "storage_options_files": "a.yaml"}}
    with pytest.raises(SpecError) as refused:
        validate_spec(data)
    [problem] = refused.value.problems
    assert problem.field == "checkpoint.storage_options_files"
    assert "did you mean 'storage_options_file'?" in problem.message and "storage_options_file" in problem.message
