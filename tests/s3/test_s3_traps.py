"""The s3fs and S3 behaviours that `ckpt.storage` works around, each checked against the real
server: a 412 answered without the condition in its body, multipart uploads left pending,
truncated objects published by an exception inside `open(..., "wb")`, and stale listings (also
under a whole-file read)."""

from __future__ import annotations

import numpy as np
import pytest
from botocore.exceptions import ClientError

from ckpt.manifest import step_dir
from ckpt.storage import AlreadyCommitted, Storage, is_precondition_failure
from tests.s3._seaweed import BUCKET

pytestmark = pytest.mark.s3
MiB = 2**20


def _storage(backend, **kw) -> Storage:
    return Storage(backend.url, backend.storage_options, **kw)


def _pending_uploads(storage: Storage, path: str) -> list[str]:
    _, key, _ = storage.fs.split_path(path)
    listing = storage.fs.call_s3("list_multipart_uploads", Bucket=BUCKET)
    return [u["UploadId"] for u in listing.get("Uploads", []) if u["Key"] == key]


def test_a_412_without_the_condition_in_its_body_is_already_committed(s3_backend):
    storage = _storage(s3_backend)
    path = storage.path(step_dir(1), "manifest.json")
    storage.create_exclusive(path, b"mine")
    with pytest.raises(AlreadyCommitted) as caught:
        storage.create_exclusive(path, b"theirs")
    # What s3fs raised underneath: an OSError from botocore's PreconditionFailed (this server
    # does not name the condition), which must still read as "exists".
    assert is_precondition_failure(caught.value.__cause__)
    assert storage.read(path) == b"mine"


def test_precondition_check_reads_codes_not_message_text():
    def client_error(code: str, status: int, message: str) -> OSError:
        err = OSError(22, message)
        err.__cause__ = ClientError({"Error": {"Code": code, "Message": message},
                                     "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        return err

    assert is_precondition_failure(client_error("PreconditionFailed", 412, "At least one pre-condition failed"))
    assert is_precondition_failure(FileExistsError("exists"))
    # A path with "412" in it, or a message that mentions a precondition, is not a 412.
    assert not is_precondition_failure(client_error("InternalError", 500, "step-000000412/manifest.json"))
    assert not is_precondition_failure(OSError(5, "PreconditionFailed talk in a 503 body"))


def test_a_large_create_over_an_existing_object_fails_and_leaves_no_upload(s3_backend):
    storage = _storage(s3_backend, multipart_chunk=5 * MiB)
    path = storage.path(step_dir(2), "manifest.json")
    big = bytes(range(256)) * (12 * MiB // 256)  # 12 MiB: over twice the multipart chunk
    storage.create_exclusive(path, b"small")
    with pytest.raises(AlreadyCommitted):
        storage.create_exclusive(path, big)
    assert storage.read(path) == b"small"
    assert _pending_uploads(storage, path) == []


def test_a_large_create_is_exclusive_and_a_retry_with_the_same_bytes_succeeds(s3_backend):
    storage = _storage(s3_backend, multipart_chunk=5 * MiB)
    path = storage.path(step_dir(3), "manifest.json")
    big = bytes(range(256)) * (11 * MiB // 256)
    storage.create_exclusive(path, big)
    storage.create_exclusive(path, big)
    with pytest.raises(AlreadyCommitted):
        storage.create_exclusive(path, big[:-1] + b"!")
    assert storage.read(path) == big
    assert _pending_uploads(storage, path) == []


def test_a_manifest_is_created_in_one_put_whatever_its_size(s3_backend):
    """A store may honour If-None-Match on a PUT and not on a multipart completion, and a large
    model's manifest (millions of chunks) passes s3fs's multipart size: the create is one PUT."""
    storage, calls = _storage(s3_backend, multipart_chunk=5 * MiB), []
    call_s3 = storage.fs._call_s3

    async def recorded(method, *args, **kwargs):
        calls.append(method)
        return await call_s3(method, *args, **kwargs)

    storage.fs._call_s3 = recorded
    storage.create_exclusive(storage.path(step_dir(7), "manifest.json"), bytes(12 * MiB))
    assert "put_object" in calls and "create_multipart_upload" not in calls, calls


def test_a_writer_that_raises_mid_write_leaves_no_object_and_no_upload(s3_backend):
    storage = _storage(s3_backend, multipart_chunk=5 * MiB)
    path = storage.path(step_dir(4), "shard-r00000.bin")
    with pytest.raises(RuntimeError, match="killed"), storage.atomic_writer(path) as f:
        f.write(b"a" * (6 * MiB))  # more than one part: a part is on the server already
        f.flush()
        raise RuntimeError("rank killed mid-write")
    assert not storage.exists(path)
    assert _pending_uploads(storage, path) == []
    assert not Storage(s3_backend.url, s3_backend.storage_options).exists(path)


def test_atomic_writer_writes_multipart_objects_whole(s3_backend):
    storage = _storage(s3_backend, multipart_chunk=5 * MiB)
    path = storage.path(step_dir(5), "shard-r00000.bin")
    parts = [bytes([i]) * (3 * MiB) for i in range(4)]
    with storage.atomic_writer(path) as f:
        for part in parts:
            f.write(part)
    assert storage.read(path) == b"".join(parts)
    assert storage.read_range(path, 3 * MiB - 2, 3 * MiB + 2) == b"\x00\x00\x01\x01"
    assert _pending_uploads(storage, path) == []


def test_shards_are_not_written_into_a_missing_bucket(s3_server):
    # A missing bucket is a typo in the URL; creating it would hide the mistake.
    storage = Storage("s3://no-such-bucket-undying/job", s3_server.storage_options)
    with pytest.raises(FileNotFoundError):
        storage.write_immutable(storage.path(step_dir(1), "shard-r00000.bin"), b"x")
    assert not s3_server.filesystem().exists("no-such-bucket-undying")


def test_the_storage_probe_passes_a_store_that_honours_exclusive_creates_and_leaves_nothing(s3_backend):
    from orchestrator.spec.storage_check import check_storage

    assert check_storage(s3_backend.url, s3_backend.storage_options) == []
    store = Storage(s3_backend.url, s3_backend.storage_options)
    assert [p for p in store.fs.find(store.root) if "probe" in p] == []  # both deleted (SeaweedFS keeps its directory)


def test_a_file_written_after_its_folder_was_listed_is_read_not_taken_for_absent(s3_backend):
    # s3fs sizes a whole-file read from its listing cache: a lease watcher that listed the owner
    # folder before the holder's first beat landed would read "no beat" for as long as it watched.
    watcher, writer = _storage(s3_backend), _storage(s3_backend)
    folder = watcher.path("owner")
    writer.write_immutable(watcher.path("owner", "claim-0000000000.json"), b"{}")
    assert watcher.listdir(folder) == ["claim-0000000000.json"]
    writer.write_immutable(watcher.path("owner", "beat-0000000000.json"), b'{"beat": 1}')
    assert watcher.read(watcher.path("owner", "beat-0000000000.json")) == b'{"beat": 1}'


def test_a_call_to_a_hung_store_is_botocore_s_attempts_not_s3fs_s_retries_of_them(s3_backend):
    # s3fs retries each botocore call (itself retried) 5 times, and a whole-file read 5 times more: a
    # store that stops answering held one read for 5 x 5 x botocore's attempts of read timeouts before
    # the read's retry budget (checkpoint.read_retry_s) saw an error. The budget owns the retries.
    storage = _storage(s3_backend)
    assert storage.fs.retries == 1
    storage.write_immutable(storage.path("x.bin"), b"x")
    assert storage.read(storage.path("x.bin")) == b"x"


def test_a_prepared_dataset_s_reads_are_botocore_s_attempts_too(s3_backend, tmp_path):
    # The data path read with s3fs's default 5 x 5 retries: a hung store held one ranged GET ~30 min,
    # far past data.read_retry_s and the hang and collective limits sized by it.
    from tests._tokens import write_token_dataset
    from trainer.tokens.reader import TokenDataset

    url = write_token_dataset(f"{s3_backend.url}/tokens", np.arange(100) % 50, 50,
                              storage_options=s3_backend.storage_options)
    ds = TokenDataset(url, s3_backend.storage_options)
    assert ds.fs.retries == 1 and ds.read(10, 5).tolist() == [10, 11, 12, 13, 14]
    assert s3_backend.server.filesystem().retries != 1  # its own instance: nobody else's client changed


def test_an_abort_the_store_fails_too_leaves_the_write_s_own_error(s3_backend, monkeypatch):
    storage = _storage(s3_backend, multipart_chunk=5 * MiB)
    path = storage.path(step_dir(6), "shard-r00000.bin")
    opened = storage.fs.open

    def failing_abort(*args, **kwargs):
        f = opened(*args, **kwargs)
        f.discard = lambda: (_ for _ in ()).throw(OSError("the abort timed out"))
        return f

    monkeypatch.setattr(storage.fs, "open", failing_abort)
    with pytest.raises(RuntimeError, match="killed"), storage.atomic_writer(path) as f:
        f.write(b"a" * (6 * MiB))
        f.flush()
        raise RuntimeError("rank killed mid-write")
    assert not storage.exists(path)  # the pending upload is GC's (ckpt.housekeeping)


def test_the_probe_refuses_a_url_that_is_or_lies_inside_a_jobs_root_on_s3(s3_backend):
    from orchestrator.spec.storage_check import check_storage

    storage = _storage(s3_backend)
    storage.write_immutable(storage.path("demo", step_dir(7), "manifest.json"), b"{}")
    options = s3_backend.storage_options
    [problem] = check_storage(f"{s3_backend.url}/demo", options)
    assert f"did you mean checkpoint.url {s3_backend.url} with name demo" in problem.message
    for inner in ("demo/elsewhere", f"demo/{step_dir(7)}"):
        [problem] = check_storage(f"{s3_backend.url}/{inner}", options)
        assert "is inside the checkpoint root" in problem.message, inner
    assert check_storage(s3_backend.url, options) == []
