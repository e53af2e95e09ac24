"""StagingBuffer: a step's arrays cross to the device as views of one copy, and stay intact.

The engine uses it only off the CPU; here it runs its plain-copy branch, which checks the packing,
the shapes and the alignment. tests/gpu checks the pinned, asynchronous branch."""

import numpy as np
import torch

from engine.runner.staging import StagingBuffer


def test_views_hold_each_array_with_its_shape():
    staging = StagingBuffer(torch.device("cpu"), torch.int64)
    arrays = [np.arange(5), np.array([7]), np.arange(12).reshape(3, 4) - 1, np.zeros(0, np.int64)]
    got = staging.upload(arrays)
    for a, t in zip(arrays, got):
        assert t.dtype == torch.int64 and tuple(t.shape) == a.shape
        assert t.tolist() == a.tolist()


def test_a_later_upload_does_not_change_earlier_tensors():
    """The host buffer is reused every step; what was handed out must not alias it."""
    staging = StagingBuffer(torch.device("cpu"), torch.int32)
    first = staging.upload([np.array([1, 2, 3]), np.array([[4, 5]])])
    second = staging.upload([np.array([9, 9, 9]), np.array([[9, 9]])])
    assert [t.tolist() for t in first] == [[1, 2, 3], [[4, 5]]]
    assert [t.tolist() for t in second] == [[9, 9, 9], [[9, 9]]]
    assert first[0].dtype == torch.int32


def test_grows_for_a_bigger_step():
    staging = StagingBuffer(torch.device("cpu"), torch.int64)
    staging.upload([np.arange(4)])
    big = np.arange(5000)
    (got,) = staging.upload([big])
    assert max(h.numel() for h in staging.hosts) >= 5000
    assert torch.equal(got, torch.from_numpy(big))


def test_every_view_starts_on_a_16_byte_boundary():
    """Triton compiles a kernel per pointer alignment: odd offsets would mean extra variants."""
    for dtype in (torch.int32, torch.int64):
        staging = StagingBuffer(torch.device("cpu"), dtype)
        views = staging.upload([np.arange(3), np.arange(5), np.array([1]), np.arange(7).reshape(7, 1)])
        assert all(v.data_ptr() % 16 == 0 for v in views), dtype
        assert [v.tolist() for v in views[:3]] == [[0, 1, 2], [0, 1, 2, 3, 4], [1]]
