"""Options an object store does not take, and missing credentials, said with the field and the fix
(s3fs hands unknown options to botocore's session, which refuses them only at the first call)."""

from __future__ import annotations

import sys

import fsspec
import pytest
import s3fs

from ckpt.storage_options import explain
from orchestrator.cli.main import main
from orchestrator.spec.storage_check import check_storage


class NoCredentialsError(Exception):
    """botocore's, by name: the check does not import botocore."""


def test_a_misspelt_option_is_named_with_the_nearest_one_the_store_takes():
    err = TypeError("AioSession.__init__() got an unexpected keyword argument 'endpointurl'")
    assert explain(err, "--storage-option", s3fs.S3FileSystem) == (
        "--storage-option: 'endpointurl' is not an option this store takes; did you mean 'endpoint_url'?")
    far = TypeError("got an unexpected keyword argument 'zzzz'")
    assert explain(far, "x", s3fs.S3FileSystem).endswith("'zzzz' is not an option this store takes; remove it")


def test_missing_credentials_say_where_to_set_them_and_other_errors_are_left_alone():
    words = explain(NoCredentialsError("Unable to locate credentials"), "checkpoint.storage_options")
    assert "AWS_ACCESS_KEY_ID" in words and "checkpoint.storage_options" in words
    assert explain(OSError("timed out"), "x") is None and explain(TypeError("other"), "x") is None


def test_ckpt_commands_refuse_a_misspelt_option_before_any_request(capsys):
    code = main(["ckpt", "ls", "s3://bucket/job", "--storage-option", "endpointurl=http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "did you mean 'endpoint_url'?" in err


def test_validate_names_the_misspelt_option_in_checkpoint_storage_options():
    [problem] = check_storage("s3://bucket/ck", {"endpointurl": "http://127.0.0.1:9"})
    assert problem.field == "checkpoint.storage_options" and "did you mean 'endpoint_url'?" in problem.message


class _BrokenFileSystem(fsspec.AbstractFileSystem):
    """A filesystem whose client cannot start (a library missing a piece, a broken set-up)."""

    protocol = "brokenfs"

    def __init__(self, *args, **kwargs):
        raise RuntimeError("the client library is missing a piece")


@pytest.fixture
def broken_protocol():
    fsspec.register_implementation("brokenfs", _BrokenFileSystem, clobber=True)
    yield "brokenfs://bucket/job"
    sys.modules["fsspec.registry"]._registry.pop("brokenfs", None)  # the public registry is read-only


def test_a_filesystem_that_does_not_start_is_named_with_its_field_and_fix(broken_protocol, capsys):
    url = broken_protocol
    [problem] = check_storage(url, {})
    assert problem.field == "checkpoint.url" and problem.message == (
        f"{url}: its filesystem did not start (RuntimeError: the client library is missing a piece); check its "
        "client libraries and setup")
    [problem] = check_storage(url, {"region": "x"})
    assert problem.field == "checkpoint.storage_options"
    assert problem.message.startswith(f"cannot open {url} with these options (RuntimeError:")
    assert main(["ckpt", "ls", url]) == 2
    assert f"URL {url}: its filesystem did not start" in capsys.readouterr().err
    assert main(["ckpt", "ls", url, "--storage-option", "region=x"]) == 2
    assert f"--storage-option: cannot open {url} with these options" in capsys.readouterr().err
