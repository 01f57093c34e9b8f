import hashlib
import math
import os
import subprocess
import sys
from collections import Counter

import fsspec
import pytest
import torch

from trainer.batch import SampleDigest
from trainer.config import DataConfig
from trainer.data import DataCursor, collate, microbatches_per_rank
from trainer.loss import IGNORE_INDEX

VOCAB = 256
GLOBAL_BATCH = 16


def digest(samples: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(s.numpy().tobytes() + b"|" for s in samples)).hexdigest()


def unpad(batches) -> list[torch.Tensor]:
    """The samples a list of microbatches holds, in order, without padding."""
    samples = []
    for batch in batches:
        for inputs, labels in zip(batch.input_ids, batch.labels, strict=True):
            length = int((labels != IGNORE_INDEX).sum())
            samples.append(torch.cat([inputs[:length], labels[length - 1 : length]]))
    return samples


def test_sample_depends_only_on_seed_step_and_index():
    cursor = DataCursor(DataConfig(seed=3), VOCAB)
    forward = {(s, i): cursor.sample(s, i) for s in range(3) for i in range(5)}
    fresh = DataCursor(DataConfig(seed=3), VOCAB)
    for (s, i) in reversed(list(forward)):
        assert torch.equal(fresh.sample(s, i), forward[(s, i)])
    assert not torch.equal(cursor.sample(0, 0), cursor.sample(0, 1))
    assert not torch.equal(cursor.sample(0, 0), cursor.sample(1, 0))
    assert not torch.equal(cursor.sample(0, 0), DataCursor(DataConfig(seed=4), VOCAB).sample(0, 0))


def test_sample_is_identical_in_another_process():
    cursor = DataCursor(DataConfig(seed=11), VOCAB)
    expected = digest([cursor.sample(s, i) for s in (0, 7, 1000) for i in (0, 3, 31)])
    code = (
        "import hashlib\nfrom trainer.config import DataConfig\nfrom trainer.data import DataCursor\n"
        "c = DataCursor(DataConfig(seed=11), 256)\n"
        "samples = [c.sample(s, i) for s in (0, 7, 1000) for i in (0, 3, 31)]\n"
        "print(hashlib.sha256(b''.join(x.numpy().tobytes() + b'|' for x in samples)).hexdigest())\n"
    )
    # A different PYTHONHASHSEED proves no per-process string hashing leaks into the data.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == expected


def test_global_rng_is_neither_used_nor_changed():
    cursor = DataCursor(DataConfig(), VOCAB)
    before = torch.get_rng_state()
    first = cursor.sample(5, 5)
    torch.manual_seed(999)
    assert torch.equal(cursor.sample(5, 5), first)
    torch.set_rng_state(before)
    cursor.sample(6, 6)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_every_layout_sees_the_same_global_batch(micro_batch):
    cursor = DataCursor(DataConfig(seed=1), VOCAB)
    step = 4
    expected = [cursor.sample(step, i) for i in range(GLOBAL_BATCH)]
    for dp_size in (1, 2, 4):
        union = []
        for dp_rank in range(dp_size):
            ids = cursor.sample_ids(step, GLOBAL_BATCH, dp_rank, dp_size)
            batches = cursor.microbatches(step, GLOBAL_BATCH, micro_batch, dp_rank, dp_size)
            assert len(batches) == GLOBAL_BATCH // (dp_size * micro_batch)
            assert all(b.input_ids.shape[0] == micro_batch for b in batches)
            assert list(ids) == list(range(dp_rank * len(ids), (dp_rank + 1) * len(ids)))
            union += unpad(batches)
        assert len(union) == GLOBAL_BATCH
        for got, want in zip(union, expected, strict=True):
            assert torch.equal(got, want)


def test_batches_made_ahead_equal_batches_made_on_the_spot():
    """Recorded calls take what the prefetch thread made; a look (`record=False`) makes it on the spot.
    Consecutive steps, a rollback (a restore) and a new layout all serve the same samples."""
    ahead, spot = DataCursor(DataConfig(seed=2, prefetch_steps=2), VOCAB), DataCursor(DataConfig(seed=2), VOCAB)
    for step, dp_rank, dp_size in [(0, 0, 2), (1, 0, 2), (2, 0, 2), (1, 0, 2), (2, 1, 4), (3, 1, 4)]:
        got = ahead.microbatches(step, GLOBAL_BATCH, 2, dp_rank, dp_size)
        assert sorted(ahead.prefetcher.ahead()) == [(step + k, GLOBAL_BATCH, 2, dp_rank, dp_size) for k in (1, 2)]
        want = spot.microbatches(step, GLOBAL_BATCH, 2, dp_rank, dp_size, record=False)
        assert digest(unpad(got)) == digest(unpad(want))
        assert ahead.last_wait_s >= 0.0
    assert spot.prefetcher is None  # looks start no thread
    owned = [spot.sample_keys(s, GLOBAL_BATCH, spot.sample_ids(s, GLOBAL_BATCH, r, n)) for s, r, n in
             [(1, 0, 2), (2, 1, 4), (3, 1, 4)]]
    assert ahead.consumed == SampleDigest.of(1, owned)  # counted on the training thread, from the rollback on
    ahead.close()
    assert ahead.prefetcher.ahead() == []


def test_samples_are_ragged_within_bounds():
    cfg = DataConfig(seq_len=64, min_len_fraction=0.5)
    cursor = DataCursor(cfg, VOCAB)
    lengths = [len(cursor.sample(s, i)) - 1 for s in range(4) for i in range(32)]
    assert min(lengths) >= math.ceil(0.5 * 64) and max(lengths) <= 64
    assert len(set(lengths)) > 10
    fixed = DataCursor(DataConfig(seq_len=64, min_len_fraction=1.0), VOCAB)
    assert {len(fixed.sample(0, i)) for i in range(16)} == {65}


def test_microbatch_padding_and_shift():
    cursor = DataCursor(DataConfig(seq_len=32), VOCAB)
    samples = [cursor.sample(2, i) for i in range(4)]
    batch = cursor.microbatches(2, 4, 4, 0, 1)[0]
    width = max(len(s) for s in samples) - 1
    assert batch.input_ids.shape == batch.labels.shape == (4, width)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long
    for row, sample in enumerate(samples):
        n = len(sample) - 1
        assert torch.equal(batch.input_ids[row, :n], sample[:-1])
        assert torch.equal(batch.labels[row, :n], sample[1:])
        assert (batch.labels[row, n:] == IGNORE_INDEX).all()
    assert batch.n_tokens == sum(len(s) - 1 for s in samples)
    assert (batch.labels == IGNORE_INDEX).any()


def test_collate_single_full_sample_has_no_padding():
    batch = collate([torch.arange(9)])
    assert torch.equal(batch.input_ids, torch.arange(8).view(1, 8))
    assert torch.equal(batch.labels, torch.arange(1, 9).view(1, 8))


def test_synthetic_data_is_learnable():
    # Each token has one dominant successor: a bigram model gets ~90% of the next tokens right.
    cursor = DataCursor(DataConfig(seq_len=128), VOCAB)
    successors: dict[int, Counter] = {}
    for i in range(64):
        tokens = cursor.sample(0, i).tolist()
        for a, b in zip(tokens, tokens[1:], strict=False):
            successors.setdefault(a, Counter())[b] += 1
    predictable = sum(c.most_common(1)[0][1] for c in successors.values())
    total = sum(sum(c.values()) for c in successors.values())
    assert 0.8 < predictable / total < 0.97
    assert len(successors) > VOCAB // 2  # the chain visits most of the vocabulary


@pytest.mark.parametrize(("global_batch", "micro_batch", "dp_size"), [(10, 1, 4), (8, 3, 2), (6, 4, 1)])
def test_indivisible_batch_is_refused(global_batch, micro_batch, dp_size):
    cursor = DataCursor(DataConfig(), VOCAB)
    with pytest.raises(ValueError, match=f"train.global_batch={global_batch} is not divisible"):
        cursor.microbatches(0, global_batch, micro_batch, 0, dp_size)
    with pytest.raises(ValueError, match="not divisible"):
        microbatches_per_rank(global_batch, micro_batch, dp_size)


def test_bad_rank_and_negative_indices_are_refused():
    cursor = DataCursor(DataConfig(), VOCAB)
    with pytest.raises(ValueError, match="dp_rank=2"):
        cursor.sample_ids(0, 8, 2, 2)
    with pytest.raises(ValueError, match="must be >= 0"):
        cursor.sample(-1, 0)


TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé is fine too. " * 20


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def test_text_windows_are_byte_tokens_of_the_file(text_file):
    raw = TEXT.encode("utf-8")
    cursor = DataCursor(DataConfig(source="text", path=text_file, seq_len=32, seed=5), VOCAB)
    offsets = set()
    for i in range(20):
        sample = cursor.sample(1, i)
        assert len(sample) == 33
        window = bytes(sample.tolist())
        offset = raw.find(window)
        assert offset >= 0
        offsets.add(offset)
    assert len(offsets) > 10
    again = DataCursor(DataConfig(source="text", path=text_file, seq_len=32, seed=5), VOCAB)
    assert torch.equal(again.sample(1, 3), cursor.sample(1, 3))


def test_text_reads_fsspec_urls(text_file):
    with fsspec.open("memory://corpus.txt", "wb") as handle:
        handle.write(TEXT.encode("utf-8"))
    local = DataCursor(DataConfig(source="text", path=text_file, seq_len=16), VOCAB)
    remote = DataCursor(DataConfig(source="text", path="memory://corpus.txt", seq_len=16), VOCAB)
    assert torch.equal(local.sample(0, 0), remote.sample(0, 0))


def test_text_source_errors(tmp_path, text_file):
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        DataCursor(DataConfig(source="text", path=text_file), 255)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="fewer than data.seq_len"):
        DataCursor(DataConfig(source="text", path=str(short), seq_len=32), VOCAB)
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(ValueError, match="not UTF-8"):
        DataCursor(DataConfig(source="text", path=str(binary), seq_len=8), VOCAB)
