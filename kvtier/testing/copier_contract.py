"""The contract every GPU <-> host copier (kvtier.moving.cuda_copy.CudaCopier) keeps, as a pytest class.

Subclass `CopierContract` and provide the fixtures:
  copier      a CudaCopier (closed by the fixture's teardown).
  memory      a callable (num_bytes, side) -> 1-D uint8 torch tensor, side "host" or "device": where
              the copies' ends live (pinned host and CUDA memory on a GPU; two host buffers under the
              stand-in driver).
  stream      a stream handle or torch.cuda.Stream to submit on.
  sync        a callable () -> None that waits for everything the test enqueued itself (torch's own
              writes into `memory`) before it submits.
The suite runs unchanged against the stand-in (tests/test_cuda_copy.py) and a real GPU (`gpu` tests).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import TransferError

KiB, MiB = 1024, 1024 * 1024
WAIT_S = 60.0  # a safety net against a hang, never a measurement


def _random(num_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)


class CopierContract:
    """What `submit` / `CopyTicket` promise, whichever path (batch v2, batch v1, loop) runs the copies."""

    num_blocks = 64
    block_sizes = (64 * KiB, 1 * MiB, 4 * MiB)

    @pytest.mark.parametrize("direction", ["h2d", "d2h"])
    @pytest.mark.parametrize("size_index", [0, 1, 2])
    def test_a_batch_of_blocks_arrives_byte_for_byte(self, copier, memory, stream, sync, direction, size_index):
        block = self.block_sizes[size_index]
        src_side, dst_side = ("host", "device") if direction == "h2d" else ("device", "host")
        src, dst = memory(self.num_blocks * block, src_side), memory(self.num_blocks * block, dst_side)
        src.copy_(_random(src.numel(), seed=size_index))
        dst.fill_(0xA5)
        sync()
        # slot i of the destination takes block order[i] of the source: few runs are adjacent on both sides
        order = np.random.default_rng(size_index).permutation(self.num_blocks)
        ticket = copier.submit(dst.data_ptr() + np.arange(self.num_blocks) * block,
                               src.data_ptr() + order * block, block, stream)
        ticket.wait(WAIT_S)
        assert ticket.done()
        want = src.cpu().view(self.num_blocks, block)[torch.from_numpy(order)]
        assert torch.equal(dst.cpu().view(self.num_blocks, block), want)

    def test_blocks_adjacent_on_both_sides_go_as_one_descriptor(self, copier, memory, stream, sync):
        block = 64 * KiB
        src, dst = memory(16 * block, "host"), memory(16 * block, "device")
        src.copy_(_random(src.numel(), seed=7))
        sync()
        before = copier.stats()
        ticket = copier.submit(dst.data_ptr() + np.arange(16)[::-1] * block, src.data_ptr() + np.arange(16)[::-1] * block,
                               block, stream)
        ticket.wait(WAIT_S)
        after = copier.stats()
        assert ticket.num_descriptors == 1 and ticket.num_bytes == 16 * block
        assert after["descriptors"] - before["descriptors"] == 1 and after["jobs"] - before["jobs"] == 1
        assert torch.equal(dst.cpu(), src.cpu())

    def test_layer_spans_of_many_blocks_in_one_submission(self, copier, memory, stream, sync):
        from kvtier.moving.copy_descriptors import span_descriptors

        num_blocks, num_layers, layer = 8, 4, 4 * KiB
        block = num_layers * layer
        src, dst = memory(num_blocks * block, "device"), memory(num_blocks * block, "host")
        src.copy_(_random(src.numel(), seed=3))
        dst.fill_(0)
        sync()
        slots = np.array([5, 0, 7, 2, 1, 6, 3, 4])
        spans = span_descriptors(dst.data_ptr() + slots * block, src.data_ptr() + np.arange(num_blocks) * block,
                                 [layer, 3 * layer], [layer, layer])  # layers 1 and 3 only
        copier.submit(spans.dst, spans.src, spans.sizes, stream).wait(WAIT_S)
        got, want = dst.cpu().view(num_blocks, num_layers, layer), src.cpu().view(num_blocks, num_layers, layer)
        for block_index, slot in enumerate(slots):
            assert torch.equal(got[slot, 1], want[block_index, 1]) and torch.equal(got[slot, 3], want[block_index, 3])
            assert not got[slot, 0].any() and not got[slot, 2].any()

    def test_many_tickets_in_flight_each_complete(self, copier, memory, stream, sync):
        block, n = 64 * KiB, 8
        src, dst = memory(n * block, "host"), memory(n * block, "device")
        src.copy_(_random(src.numel(), seed=11))
        sync()
        tickets = [copier.submit([dst.data_ptr() + i * block], [src.data_ptr() + i * block], block, stream)
                   for i in range(n)]
        for ticket in reversed(tickets):
            ticket.wait(WAIT_S)
        assert all(t.done() for t in tickets)
        assert torch.equal(dst.cpu(), src.cpu())

    def test_an_empty_batch_is_done(self, copier, stream):
        ticket = copier.submit([], [], [], stream)
        ticket.wait(WAIT_S)
        assert ticket.done() and ticket.num_descriptors == 0

    def test_stream_wait_on_a_ticket_is_accepted(self, copier, memory, stream, sync):
        src, dst = memory(4 * KiB, "host"), memory(4 * KiB, "device")
        sync()
        ticket = copier.submit([dst.data_ptr()], [src.data_ptr()], 4 * KiB, stream)
        ticket.stream_wait(stream)
        ticket.wait(WAIT_S)
        ticket.stream_wait(stream)  # done: a no-op

    def test_bad_descriptors_are_refused_before_any_copy(self, copier, memory, stream):
        dst = memory(8 * KiB, "device")
        before = copier.stats()["jobs"]
        with pytest.raises(ValueError, match="overlap"):
            copier.submit([dst.data_ptr(), dst.data_ptr() + 1024], [4096, 65536], 2048, stream)
        with pytest.raises(ValueError, match=r"sizes\[1\] is 0"):
            copier.submit([dst.data_ptr(), dst.data_ptr() + 4096], [4096, 65536], [16, 0], stream)
        with pytest.raises(ValueError, match="differ in length"):
            copier.submit([dst.data_ptr()], [4096, 8192], 16, stream)
        with pytest.raises(TypeError, match="stream"):
            copier.submit([dst.data_ptr()], [4096], 16, "stream")
        assert copier.stats()["jobs"] == before

    def test_close_waits_for_outstanding_tickets_and_refuses_more(self, copier, memory, stream, sync):
        src, dst = memory(64 * KiB, "host"), memory(64 * KiB, "device")
        src.copy_(_random(src.numel(), seed=5))
        sync()
        ticket = copier.submit([dst.data_ptr()], [src.data_ptr()], 64 * KiB, stream)
        copier.close()
        assert ticket.done()
        assert torch.equal(dst.cpu(), src.cpu())
        with pytest.raises(TransferError, match="closed"):
            copier.submit([dst.data_ptr()], [src.data_ptr()], 64 * KiB, stream)
        assert copier.describe()["closed"] is True
