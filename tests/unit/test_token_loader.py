"""The streaming loader: windows without replacement within an epoch, the same global batch in
every layout, each rank reading only its windows, mixtures by weight, bounded memory."""

import numpy as np
import pytest
import torch

from tests._tokens import counting_tokens, write_token_dataset
from trainer.batch import SampleDigest
from trainer.config import DataConfig
from trainer.data import make_cursor
from trainer.tokens.loader import TokenCursor
from trainer.tokens.reader import TokenDataset
from trainer.tokens.windows import KeyedPermutation, Source, WindowSchedule

SEQ = 15  # windows of 16 tokens


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_keyed_permutation_is_a_bijection_that_depends_on_its_key(n):
    perm = KeyedPermutation(n, key=7)
    assert sorted(perm(x) for x in range(n)) == list(range(n))
    if n > 16:
        assert [perm(x) for x in range(n)] != [KeyedPermutation(n, key=8)(x) for x in range(n)]


def test_every_window_once_per_epoch_in_a_new_order_each_epoch():
    sched = WindowSchedule([Source(n_windows=100)], seed=3, global_batch=10)
    first = [sched.window(s, i)[1] for s in range(10) for i in range(10)]
    second = [sched.window(s, i)[1] for s in range(10, 20) for i in range(10)]
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second and first != list(range(100))


@pytest.mark.parametrize("seed", range(5))
def test_a_70_30_mixture_holds_its_shares_within_2_points_over_1000_windows(seed):
    sched = WindowSchedule([Source(500, 0.7), Source(800, 0.3)], seed=seed, global_batch=8)
    sources = [sched.window(s, i)[0] for s in range(125) for i in range(8)]
    assert abs(sources.count(0) / 1000 - 0.7) <= 0.02
    # Each dataset's windows: all of them once per epoch of that dataset (500 windows of the
    # first in its first 500 samples), and no window of the second (800) twice.
    firsts = [w for s, w in (sched.window(st, i) for st in range(125) for i in range(8)) if s == 0]
    seconds = [w for s, w in (sched.window(st, i) for st in range(125) for i in range(8)) if s == 1]
    assert sorted(firsts[:500]) == list(range(500)) and len(set(seconds)) == len(seconds)


def make(tmp_path, n_tokens=1600, vocab=1000, **cfg):
    # Written once per test: a prepared dataset is immutable (rewriting a file under a reader's
    # memory map would be a bus error, as for any mmap reader).
    if not (tmp_path / "ds").exists():
        write_token_dataset(tmp_path / "ds", counting_tokens(n_tokens, vocab), vocab, shard_tokens=333)
    data = DataConfig(source="tokens", path=f"file://{tmp_path}/ds", seq_len=SEQ, **cfg)
    return make_cursor(data, vocab_size=vocab)


def test_windows_are_read_across_shards_exactly(tmp_path):
    cursor = make(tmp_path)
    assert isinstance(cursor, TokenCursor) and cursor.sources[0].n_windows == 100
    for step in range(3):
        for (_, window), batch_row in zip(cursor.windows(step, 4, 0, 1), range(4), strict=True):
            batch = cursor.microbatches(step, 4, 4, 0, 1)[0]
            start = window * (SEQ + 1)
            assert torch.equal(batch.input_ids[batch_row], torch.arange(start, start + SEQ) % 1000)
            assert torch.equal(batch.labels[batch_row], torch.arange(start + 1, start + SEQ + 1) % 1000)
    cursor.close()


def test_every_layout_sees_the_same_global_batch_and_each_rank_reads_only_its_own(tmp_path, monkeypatch):
    whole = make(tmp_path)
    reads = []
    original = TokenDataset.read
    monkeypatch.setattr(TokenDataset, "read", lambda self, start, length: reads.append(start) or
                        original(self, start, length))
    ranks = [make(tmp_path) for _ in range(4)]
    for step in range(5):
        want = torch.cat([b.input_ids for b in whole.microbatches(step, 8, 2, 0, 1)])
        parts = [cursor.microbatches(step, 8, 2, r, 4) for r, cursor in enumerate(ranks)]
        assert torch.equal(torch.cat([b.input_ids for part in parts for b in part]), want)
    for cursor in [whole, *ranks]:
        cursor.close()  # waits for a prefetch in flight
    reads.clear()
    ranks[1]._load((7, 8, 2, 1, 4))  # rank 1 of 4 reads step 7: its 2 windows, nothing else
    assert sorted(reads) == sorted(w * (SEQ + 1) for _, w in ranks[1].windows(7, 8, 1, 4))


def test_prefetch_serves_the_next_steps_and_a_restore_drops_them(tmp_path):
    cursor = make(tmp_path, prefetch_steps=3)
    cursor.microbatches(0, 4, 2, 0, 1)
    assert sorted(k[0] for k in cursor.prefetcher.ahead()) == [1, 2, 3]
    cursor.microbatches(1, 4, 2, 0, 1)
    assert sorted(k[0] for k in cursor.prefetcher.ahead()) == [2, 3, 4]
    cursor.microbatches(0, 4, 2, 0, 1)  # a rollback: the steps ahead of it are recomputed
    assert sorted(k[0] for k in cursor.prefetcher.ahead()) == [1, 2, 3]
    cursor.close()


def test_the_consumed_digest_matches_the_ids_whatever_the_layout(tmp_path):
    ranks = [make(tmp_path) for _ in range(2)]
    for step in range(4, 9):
        for r, cursor in enumerate(ranks):
            cursor.microbatches(step, 8, 4, r, 2)
    expected = SampleDigest.of(4, [ranks[0].sample_keys(s, 8) for s in range(4, 9)])
    got = (ranks[0].consumed.count + ranks[1].consumed.count,
           (ranks[0].consumed.total + ranks[1].consumed.total) % 2**64)
    assert (ranks[0].consumed.first_step, ranks[0].consumed.end_step) == (4, 9)
    assert got == (expected.count, expected.total)
    ranks[0].microbatches(9, 8, 4, 0, 2, record=False)  # a look (the memory probe's) consumes nothing
    assert (ranks[0].consumed.end_step, ranks[0].consumed.count) == (9, 20)
    ranks[1].microbatches(8, 8, 4, 1, 2)  # a sample consumed twice changes the digest
    assert ranks[1].consumed.first_step == 8
    twice = (ranks[0].consumed.count + ranks[1].consumed.count,
             (ranks[0].consumed.total + ranks[1].consumed.total) % 2**64)
    assert twice != (expected.count, expected.total)


def rss_bytes(kind: str = "RssAnon") -> int:
    """This process's resident memory of one kind (/proc/self/status): RssAnon is what the process
    allocated; RssFile counts page-cache pages of mapped files, which the kernel may drop."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(kind + ":"))
    return int(line.split()[1]) * 1024


def test_loader_memory_stays_bounded_on_a_dataset_larger_than_the_bound(tmp_path):
    vocab = 50_000
    n = 40_000_000  # 80 MB of uint16 tokens, far above the loader's bound of a few KB per step
    write_token_dataset(tmp_path / "big", np.arange(n, dtype=np.int64) % vocab, vocab, shard_tokens=8_000_000,
                        doc_tokens=4096)
    data = DataConfig(source="tokens", path=str(tmp_path / "big"), seq_len=255, prefetch_steps=4)
    cursor = make_cursor(data, vocab)
    # The loader's own memory is anonymous; the shards' mapped pages are page cache the kernel
    # shares and reclaims (RssFile; a warm cache maps whole 64 KiB fault-around blocks of it).
    anon = rss_bytes()
    for step in range(200):
        cursor.microbatches(step, 16, 4, 0, 1)
    grown = rss_bytes() - anon
    bound = 4 * 16 * 256 * 8  # prefetch_steps x windows per step x (seq_len + 1) x int64
    assert grown < 16 * 2**20, f"anonymous RSS grew {grown / 2**20:.1f} MiB reading 200 steps of a 80 MB dataset"
    assert bound < 2**20
    cursor.close()


def test_bad_token_configs_are_refused_by_field(tmp_path):
    with pytest.raises(ValueError, match="exactly one of data.path"):
        DataConfig(source="tokens")
    with pytest.raises(ValueError, match="data.mixture needs source 'tokens'"):
        DataConfig(mixture=[{"path": "x", "weight": 1}])
    write_token_dataset(tmp_path / "ds", counting_tokens(100, 1000), 1000)
    with pytest.raises(ValueError, match="larger than model.vocab_size"):
        make_cursor(DataConfig(source="tokens", path=str(tmp_path / "ds")), vocab_size=256)
    with pytest.raises(ValueError, match=r"^data.path=.*fewer than one window"):
        make_cursor(DataConfig(source="tokens", path=str(tmp_path / "ds"), seq_len=200), vocab_size=1000)
    write_token_dataset(tmp_path / "big", counting_tokens(1000, 1000), 1000)
    mixture = [{"path": str(tmp_path / "big"), "weight": 1}, {"path": str(tmp_path / "ds"), "weight": 1}]
    with pytest.raises(ValueError, match=r"^data.mixture\[1\].path=.*fewer than one window"):  # the part, by index
        make_cursor(DataConfig(source="tokens", mixture=mixture, seq_len=200), vocab_size=1000)
    with pytest.raises(ValueError, match=r"^data.mixture\[0\].path=.*larger than model.vocab_size"):
        make_cursor(DataConfig(source="tokens", mixture=mixture, seq_len=16), vocab_size=256)
    with pytest.raises(ValueError, match=r"^data.mixture\[0\].path=.*fewer than one window"):  # a one-part mixture
        make_cursor(DataConfig(source="tokens", mixture=mixture[1:], seq_len=200), vocab_size=1000)
