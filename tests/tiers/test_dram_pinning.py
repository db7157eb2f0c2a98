"""The DRAM tier pins its slab by registering its one mmap with CUDA (cudaHostRegister) once and
unregisters it at close or collection; without CUDA nothing is registered. Here there is no GPU, so
torch's CUDA runtime bindings are replaced by a recorder; the `gpu` test checks a real registration.
Cost: milliseconds.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier.errors import CapacityError
from kvtier.tiers.dram import PAGE_BYTES, DRAMTier


class RecordingCudart:
    """What cudaHostRegister / cudaHostUnregister were called with; `refuse` makes registering fail."""

    def __init__(self, refuse: int = 0) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 -- torch.cuda.cudart()'s names
        self.calls.append(("register", ptr, size, flags))
        return self.refuse

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    recorder = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    return recorder


def test_the_slab_is_registered_once_exactly_its_size_and_unregistered_at_close(cudart):
    tier = DRAMTier(capacity_bytes=5 * 12288 + 100, slot_bytes=12288)  # 60 KiB: no power-of-two rounding
    ptr = tier.memory_rows().view(-1).data_ptr()
    assert cudart.calls == [("register", ptr, 5 * 12288, 1)]  # portable
    assert ptr % PAGE_BYTES == 0 and tier.describe()["pinned_by"] == "cudaHostRegister"
    tier.close()
    tier.close()
    assert cudart.calls[1:] == [("unregister", ptr)]


def test_a_collected_tier_unregisters_its_slab(cudart):
    tier = DRAMTier(capacity_bytes=3 * 4096, slot_bytes=4096)
    ptr = tier.memory_rows().view(-1).data_ptr()
    del tier
    gc.collect()
    assert cudart.calls[-1] == ("unregister", ptr)


def test_a_refused_registration_is_a_capacity_error_naming_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: RecordingCudart(refuse=2))
    with pytest.raises(CapacityError, match="tiers.dram.capacity: cudaHostRegister of 8,192 bytes failed"):
        DRAMTier(capacity_bytes=8192, slot_bytes=4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without CUDA")
def test_without_cuda_nothing_is_registered():
    tier = DRAMTier(capacity_bytes=8192, slot_bytes=4096)
    facts = tier.describe()
    assert facts["pinned"] is False and facts["pinned_by"] is None and facts["aligned"]
    tier.close()


@pytest.mark.gpu
def test_on_a_gpu_the_registered_slab_is_pinned_memory():
    tier = DRAMTier(capacity_bytes=3 * (1 << 20), slot_bytes=1 << 20)
    try:
        assert tier.memory_rows().view(-1).is_pinned()
        device = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)[: 1 << 20]
        tier.view(1, 0, 1 << 20).copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(tier.view(1, 0, 1 << 20), device.cpu())
    finally:
        tier.close()
