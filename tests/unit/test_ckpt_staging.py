"""The writer's staging buffers: copies that training cannot change, kept from one save to the next."""

import pytest
import torch

from ckpt.staging import StagingPool
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
