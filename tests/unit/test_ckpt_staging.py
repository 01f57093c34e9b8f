"""The writer's staging buffers: copies that training cannot change, kept from one save to the next."""

import pytest
import torch

from ckpt.staging import NON_TEMPORAL_THRESHOLD, StagingPool, copy_into, staging_env
from trainer.state_slices import TensorSlice, whole


def test_staged_copies_are_independent_of_training_and_buffers_are_kept():
    weight, bias = torch.arange(12.0).reshape(3, 4), torch.ones(4)
    pool = StagingPool()
    first = pool.stage([whole("w", weight), whole("b", bias)])
    weight.add_(100)  # training goes on
    assert torch.equal(first[0].tensor, torch.arange(12.0).reshape(3, 4))
    assert pool.reused == 0 and pool.nbytes == 16 * 4

    buffers = [piece.tensor.data_ptr() for piece in first]
    second = pool.stage([whole("w", weight), whole("b", bias)])
    assert [piece.tensor.data_ptr() for piece in second] == buffers
    assert torch.equal(second[0].tensor, weight) and second[0].tensor is not weight
    assert pool.reused == 2


def test_a_new_geometry_gets_a_new_buffer_and_unused_buffers_are_released():
    pool = StagingPool()
    pool.stage([whole("w", torch.zeros(4, 4)), whole("b", torch.zeros(4))])
    # After a reshard the rank holds a different slice of w and no longer b.
    half = TensorSlice(name="w", dtype=torch.float32, global_shape=(4, 4), offsets=(2, 0), lengths=(2, 4),
                       tensor=torch.full((2, 4), 7.0))
    staged = pool.stage([half])
    assert pool.reused == 0 and pool.nbytes == 8 * 4
    assert torch.equal(staged[0].tensor, torch.full((2, 4), 7.0))


def test_bad_input_is_named():
    pool = StagingPool()
    with pytest.raises(ValueError, match="no data"):
        pool.stage([whole("w", torch.zeros(2)).with_tensor(None)])
    with pytest.raises(ValueError, match="staged twice"):
        pool.stage([whole("w", torch.zeros(2)), whole("w", torch.zeros(2))])


def test_copy_into_uses_memmove_only_where_bytes_are_the_values():
    base = torch.arange(40.0).reshape(5, 8)
    cases = [
        base[1:3],  # contiguous, with a storage offset: memmove from the offset
        base[:, 2:6],  # strided: copy_
        torch.arange(16, dtype=torch.float64).reshape(2, 8).float(),
        (torch.arange(8.0) + 1j * torch.arange(8.0)).reshape(2, 4).conj(),  # lazy conjugate: copy_
        -torch.arange(8.0).reshape(2, 4),
    ]
    for source in cases:
        buffer = torch.empty(source.shape, dtype=source.dtype)
        copy_into(buffer, source)
        assert torch.equal(buffer, source.resolve_conj()), source
    mixed = torch.empty(2, 8, dtype=torch.float64)
    copy_into(mixed, base[1:3])  # dtypes differ: copy_ casts
    assert torch.equal(mixed, base[1:3].double())


def test_staging_env_lowers_the_streaming_threshold_and_keeps_other_tunables():
    assert staging_env({}) == {"GLIBC_TUNABLES": f"glibc.cpu.x86_non_temporal_threshold={NON_TEMPORAL_THRESHOLD}"}
    other = "glibc.malloc.arena_max=2"
    assert staging_env({"GLIBC_TUNABLES": other})["GLIBC_TUNABLES"] == (
        f"{other}:glibc.cpu.x86_non_temporal_threshold={NON_TEMPORAL_THRESHOLD}")
    # An operator's own value wins.
    assert staging_env({"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x4040"}) == {}
