"""`kvtier.pool.buffers.byte_view`: the flat byte views the pool client reads into and writes from."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvtier.pool.buffers import byte_view


def test_a_tensor_view_is_its_bytes_written_through_and_keeps_it_alive():
    t = torch.arange(8, dtype=torch.int16)[2:]  # an offset into its storage, 2-byte items
    view = byte_view(t, writable=True, what="row")
    assert (view.format, view.ndim, view.nbytes, view.readonly) == ("B", 1, 12, False)
    assert bytes(view) == t.numpy().tobytes()
    view[0:2] = (1000).to_bytes(2, "little")
    assert int(t[0]) == 1000, "the view is the tensor's memory, not a copy"
    del t
    gc.collect()
    assert int.from_bytes(view[0:2], "little") == 1000 and int.from_bytes(view[2:4], "little") == 3


@pytest.mark.parametrize("buf", [b"abc", bytearray(3), memoryview(bytearray(6)).cast("H"), np.zeros((2, 3), np.uint8),
                                 torch.zeros(0, dtype=torch.uint8), torch.tensor(7, dtype=torch.int32)])
def test_every_kind_of_buffer_is_one_flat_byte_view(buf):
    view = byte_view(buf, writable=False, what="buf")
    assert view.format == "B" and view.ndim == 1
    assert view.nbytes == (buf.numel() * buf.element_size() if isinstance(buf, torch.Tensor) else memoryview(buf).nbytes)


def test_buffers_it_cannot_use_are_refused_naming_them():
    with pytest.raises(ValueError, match="block 3: expected a contiguous CPU tensor"):
        byte_view(torch.zeros(4, 4, dtype=torch.uint8)[:, :2], writable=True, what="block 3")
    with pytest.raises(ValueError, match="part 0: expected a writable buffer"):
        byte_view(b"read only", writable=True, what="part 0")
    with pytest.raises(ValueError, match="expected a contiguous buffer"):
        byte_view(np.zeros((4, 4), np.uint8)[:, ::2], writable=False, what="x")
