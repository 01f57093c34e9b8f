"""A checkpoint carries what decides its data schedule (source, seq_len, the datasets' content and
weights), and a restore under another data section is refused: resumed, it would repeat some samples
and skip others. A copy of the same prepared dataset at another URL, or another layout, is the same."""

from __future__ import annotations

import shutil

import pytest

from tests._tokens import counting_tokens, write_token_dataset
from trainer.config import DataConfig, MixturePart, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import make_cursor
from trainer.engine import Engine

MODEL = ModelConfig(preset="tiny", vocab_size=1000)
TRAIN = TrainConfig(steps=2, global_batch=2, micro_batch=1)


def _engine(data: DataConfig) -> Engine:
    return Engine(MODEL, data, TRAIN, ParallelConfig(), rank=0, world_size=1)


def _resume(saved_with: DataConfig, resumed_with: DataConfig) -> None:
    first = _engine(saved_with)
    first.train_step()
    tensors, meta = first.state_tensors(), first.state_meta()
    _engine(resumed_with).load_state(tensors, meta)


def test_another_seq_len_or_source_is_refused_and_the_same_data_resumes():
    base = DataConfig(seq_len=16)
    _resume(base, DataConfig(seq_len=16, prefetch_steps=1))  # how it is read ahead changes nothing
    for other in (DataConfig(seq_len=32), DataConfig(seq_len=16, min_len_fraction=1.0)):
        with pytest.raises(ValueError, match="resuming would repeat some samples and skip others"):
            _resume(base, other)


def test_a_prepared_dataset_is_known_by_its_content_and_weights(tmp_path):
    write_token_dataset(tmp_path / "a", counting_tokens(4000, 1000), 1000, shard_tokens=1000)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    write_token_dataset(tmp_path / "b", counting_tokens(4000, 1000)[::-1].copy(), 1000, shard_tokens=1000)
    a = DataConfig(source="tokens", path=f"file://{tmp_path}/a", seq_len=16)
    _resume(a, DataConfig(source="tokens", path=f"file://{tmp_path}/copy", seq_len=16))  # same bytes elsewhere
    with pytest.raises(ValueError, match="resuming would repeat"):
        _resume(a, DataConfig(source="tokens", path=f"file://{tmp_path}/b", seq_len=16))
    mix = [MixturePart(path=f"file://{tmp_path}/a", weight=1.0), MixturePart(path=f"file://{tmp_path}/b", weight=1.0)]
    reweighted = [mix[0], MixturePart(path=mix[1].path, weight=3.0)]
    with pytest.raises(ValueError, match="resuming would repeat"):
        _resume(DataConfig(source="tokens", mixture=mix, seq_len=16),
                DataConfig(source="tokens", mixture=reweighted, seq_len=16))


def test_a_checkpoint_of_an_older_release_without_the_data_identity_still_loads():
    first = _engine(DataConfig(seq_len=16))
    meta = {k: v for k, v in first.state_meta().items() if k != "data"}
    _engine(DataConfig(seq_len=32)).load_state(first.state_tensors(), meta)
    assert make_cursor(DataConfig(seq_len=16), 1000).identity()["source"] == "synthetic"
