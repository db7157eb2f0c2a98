"""The GPU <-> host copier (kvtier.moving.cuda_copy): nvcc builds native/kv_copy.c; descriptors are built,
checked and merged exactly as a slow reference does; the copier contract holds against the host-memory
stand-in driver (native/fake_cuda.c, built as a CUDA 13, a CUDA 12.8 and an older driver) and, in the
`gpu` tests, against a real device with the batch API and with the loop forced.

Cost: one nvcc build of each library per source version (cached in ~/.cache/kvtier/native, ~1 s each),
then a few seconds of copies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.moving.copy_descriptors import (
    CopyDescriptors,
    check_descriptors,
    descriptors,
    merge_adjacent,
    merge_reference,
    span_descriptors,
)
from kvtier.moving.cuda_copy import CopyMode, CopyPath, CudaCopier, CudaDriverError, build_library
from kvtier.errors import KVTierError, TransferError
from kvtier.moving.native import find_nvcc
from kvtier.testing.copier_contract import CopierContract
from kvtier.testing.fake_cuda import DriverVariant, FailKind, FakeDriver, build_fake_driver

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: kv_copy.c cannot be built here")
CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_NOT_SUPPORTED = 700, 801


# ---- the build ---------------------------------------------------------------------------------------

@needs_nvcc
def test_nvcc_builds_the_library_with_every_entry_point(tmp_path):
    path = build_library(tmp_path)
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in (b"kvc_mover_create", b"kvc_submit", b"kvc_ticket_wait", b"cuMemcpyBatchAsync_v2",
                 b"cuMemcpyBatchAsync", b"cuMemcpyAsync", b"libcuda.so.1"):
        assert name in data, name
    assert build_library(tmp_path) == path  # cached: the same source is not rebuilt
    assert path.stat().st_mtime_ns == build_library(tmp_path).stat().st_mtime_ns


def test_without_nvcc_the_build_error_says_so(tmp_path, monkeypatch):
    import kvtier.moving.cuda_copy as cuda_copy

    monkeypatch.setattr(cuda_copy, "find_nvcc", lambda: None)
    with pytest.raises(cuda_copy.CopyLibraryError, match="nvcc not found") as info:
        build_library(tmp_path)
    assert isinstance(info.value, KVTierError)


# ---- descriptors -------------------------------------------------------------------------------------

@st.composite
def batches(draw):
    """Random descriptors over a small address space, with runs adjacent on one side, both or neither."""
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    dst, src, d, s = [], [], 4096, 1 << 20
    for size in sizes:
        dst.append(d)
        src.append(s)
        d += size + draw(st.sampled_from([0, 0, 1, 7]))
        s += size + draw(st.sampled_from([0, 0, 3])) if draw(st.booleans()) else -size - 500
    order = draw(st.permutations(range(n)))
    pick = lambda xs: np.array([xs[i] for i in order], dtype=np.uint64)  # noqa: E731
    return CopyDescriptors(pick(dst), pick(src), pick(sizes))


def byte_map(batch: CopyDescriptors) -> dict[int, int]:
    return {d + k: s + k for d, s, n in zip(batch.dst.tolist(), batch.src.tolist(), batch.sizes.tolist())
            for k in range(n)}


@settings(max_examples=300, deadline=None)
@given(batches())
def test_merging_matches_the_reference_and_moves_the_same_bytes(batch):
    merged = merge_adjacent(batch)
    want = merge_reference(batch)
    for got, ref in zip((merged.dst, merged.src, merged.sizes), (want.dst, want.src, want.sizes)):
        assert got.tolist() == ref.tolist()
    assert byte_map(merged) == byte_map(batch)
    assert merged.num_bytes == batch.num_bytes
    check_descriptors(merged)  # still valid: no overlap created


def test_merging_contiguous_slots_gives_one_descriptor_and_a_gap_two():
    base = np.arange(64, dtype=np.uint64) * 4096
    one = merge_adjacent(descriptors(1 << 30 | base, 1 << 40 | base, 4096))
    assert (one.dst.tolist(), one.sizes.tolist()) == ([1 << 30], [64 * 4096])
    src = (1 << 40 | base).copy()
    src[32:] += 4096  # adjacent on the destination only from here on
    two = merge_adjacent(descriptors(1 << 30 | base, src, 4096))
    assert two.sizes.tolist() == [32 * 4096, 32 * 4096]


def test_span_descriptors_are_every_block_times_every_span():
    got = span_descriptors([1000, 5000], [90000, 70000], [0, 100], [10, 20], src_span_offsets_bytes=[50, 300])
    assert got.dst.tolist() == [1000, 1100, 5000, 5100]
    assert got.src.tolist() == [90050, 90300, 70050, 70300]
    assert got.sizes.tolist() == [10, 20, 10, 20]
    with pytest.raises(ValueError, match="dst_bases has 2 blocks but src_bases 1"):
        span_descriptors([1, 2], [3], [0], [1])


@pytest.mark.parametrize("dst, src, sizes, error, match", [
    ([-1], [4096], 1, ValueError, r"dst_ptrs\[0\] is negative"),
    ([[1]], [4096], 1, ValueError, "one-dimensional"),
    ([1.5], [4096], 1, TypeError, "dst_ptrs must hold integers"),
    ([4096], [2**64], 1, ValueError, "src_ptrs"),
    ([4096, 8192], [4096], 1, ValueError, "differ in length"),
])
def test_bad_address_lists_are_named(dst, src, sizes, error, match):
    with pytest.raises(error, match=match):
        descriptors(dst, src, sizes)


@pytest.mark.parametrize("dst, src, sizes, alignment, match", [
    ([4096, 0], [4096, 8192], 16, 1, r"dst_ptrs\[1\] is a null address"),
    ([4096], [2**64 - 8], 16, 1, r"src_ptrs\[0\] plus its size runs past"),
    ([4096, 4100], [0x10000, 0x20000], 8, 1, r"destinations overlap: dst_ptrs\[0\].*dst_ptrs\[1\]"),
    ([4096, 8200], [4096, 8192], 16, 16, r"dst_ptrs\[1\] is not a multiple of 16"),
    ([4096], [4096], 24, 16, r"sizes\[0\] is not a multiple of 16"),
])
def test_bad_descriptors_are_named(dst, src, sizes, alignment, match):
    with pytest.raises(ValueError, match=match):
        check_descriptors(descriptors(dst, src, sizes), alignment)


# ---- the contract against the stand-in driver --------------------------------------------------------

STAND_INS = [(DriverVariant.CUDA13, CopyMode.AUTO, CopyPath.BATCH_V2),
             (DriverVariant.CUDA12_8, CopyMode.AUTO, CopyPath.BATCH_V1),
             (DriverVariant.OLD, CopyMode.AUTO, CopyPath.LOOP),
             (DriverVariant.CUDA13, CopyMode.LOOP, CopyPath.LOOP)]
STREAM = 0x5EED  # any nonzero handle: the stand-in has one queue for every stream


@pytest.fixture(scope="module")
def driver_paths():
    """The stand-in drivers, built by nvcc: every test that takes them is marked `needs_nvcc`,
    which skips it at collection where nvcc is missing."""
    return {variant: build_fake_driver(variant) for variant in DriverVariant}


def stand_in(driver_paths, variant=DriverVariant.CUDA13, mode=CopyMode.AUTO, **kwargs) -> CudaCopier:
    return CudaCopier(mode=mode, driver=driver_paths[variant], **kwargs)


@needs_nvcc
class TestContractOnStandIn(CopierContract):
    num_blocks = 16  # the stand-in proves the logic; 64-block batches run on a GPU

    @pytest.fixture(params=STAND_INS, ids=lambda p: f"{p[0].name}-{p[1].name}")
    def copier(self, request, driver_paths):
        variant, mode, path = request.param
        with stand_in(driver_paths, variant, mode) as made:
            assert made.path is path
            yield made

    @pytest.fixture
    def memory(self):
        return lambda num_bytes, side: torch.empty(num_bytes, dtype=torch.uint8)

    @pytest.fixture
    def stream(self):
        return STREAM

    @pytest.fixture
    def sync(self):
        return lambda: None


# ---- the stand-in's own checks: what only a controllable driver can show -------------------------------

@needs_nvcc
def test_a_ticket_is_pending_until_the_copies_ran(driver_paths):
    fake = FakeDriver(driver_paths[DriverVariant.CUDA13])
    src, dst = torch.arange(256, dtype=torch.int64).view(torch.uint8), torch.zeros(2048, dtype=torch.uint8)
    with stand_in(driver_paths) as copier:
        fake.pause()
        try:
            ticket = copier.submit([dst.data_ptr()], [src.data_ptr()], 2048, STREAM)
            with pytest.raises(TimeoutError):
                ticket.wait(0.05)
            assert not ticket.done() and not dst.any()
        finally:
            fake.resume()
        ticket.wait(5)
        assert ticket.done() and torch.equal(dst, src)


@needs_nvcc
@pytest.mark.parametrize("variant, mode, kind, index, reported", [
    (DriverVariant.CUDA12_8, CopyMode.AUTO, FailKind.BATCH, 1, "at descriptor 1"),
    (DriverVariant.CUDA13, CopyMode.AUTO, FailKind.BATCH, 1, None),  # the _v2 signature has no failIdx
    (DriverVariant.CUDA13, CopyMode.LOOP, FailKind.MEMCPY, 2, "at descriptor 2"),
])
def test_a_failed_batch_raises_naming_the_error_and_descriptor(driver_paths, variant, mode, kind, index, reported):
    fake = FakeDriver(driver_paths[variant])
    buf = torch.zeros(4 * 8192, dtype=torch.uint8)
    with stand_in(driver_paths, variant, mode, merge=False) as copier:
        fake.fail_next(kind, CUDA_ERROR_ILLEGAL_ADDRESS, index)
        ticket = copier.submit(buf.data_ptr() + np.arange(4) * 8192, buf.data_ptr() + np.arange(4) * 8192 + 4096,
                               1024, STREAM)
        with pytest.raises(TransferError, match="CUDA_ERROR_ILLEGAL_ADDRESS") as info:
            ticket.wait(5)
        assert (reported in str(info.value)) if reported else "at descriptor" not in str(info.value)
        with pytest.raises(TransferError):  # the failure stays
            ticket.done()
        assert copier.stats()["failed_jobs"] == 1


@needs_nvcc
def test_the_legacy_default_stream_takes_the_loop_on_a_batch_driver(driver_paths):
    fake = FakeDriver(driver_paths[DriverVariant.CUDA13])
    src, dst = torch.ones(8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8)
    with stand_in(driver_paths, merge=False) as copier:
        before = fake.counts()
        copier.submit([dst.data_ptr(), dst.data_ptr() + 4096], [src.data_ptr(), src.data_ptr() + 4096], 4096, 0).wait(5)
        after = fake.counts()
        assert after["memcpy"] - before["memcpy"] == 2 and after["batch_v2"] == before["batch_v2"]
        assert copier.stats()["loop_jobs"] == 1 and torch.equal(dst, src)


@needs_nvcc
def test_a_batch_is_one_driver_call_after_its_event(driver_paths):
    fake = FakeDriver(driver_paths[DriverVariant.CUDA12_8])
    src, dst = torch.ones(64 * 4096, dtype=torch.uint8), torch.zeros(64 * 4096, dtype=torch.uint8)
    with stand_in(driver_paths, DriverVariant.CUDA12_8, merge=False) as copier:
        before = fake.counts()
        offsets = np.arange(64) * 4096
        copier.submit(dst.data_ptr() + offsets, src.data_ptr() + offsets, 4096, STREAM, after_event=0xE7E).wait(5)
        after = fake.counts()
    assert after["batch_v1"] - before["batch_v1"] == 1 and after["memcpy"] == before["memcpy"]
    assert after["stream_wait"] - before["stream_wait"] == 1 and after["last_wait_event"] == 0xE7E
    assert after["last_stream"] == STREAM and after["bytes"] - before["bytes"] == 64 * 4096


@needs_nvcc
def test_close_gives_back_the_context_and_every_event(driver_paths):
    fake = FakeDriver(driver_paths[DriverVariant.OLD])
    before = fake.counts()
    buf = torch.zeros(8192, dtype=torch.uint8)
    with stand_in(driver_paths, DriverVariant.OLD) as copier:
        assert fake.counts()["context_refs"] == before["context_refs"] + 1
        for _ in range(5):
            copier.submit([buf.data_ptr()], [buf.data_ptr() + 4096], 4096, STREAM).wait(5)
        assert copier.stats()["events_created"] == 1  # a done ticket's event is reused
    after = fake.counts()
    assert after["context_refs"] == before["context_refs"]
    assert after["events_created"] - before["events_created"] == after["events_destroyed"] - before["events_destroyed"]


@needs_nvcc
def test_a_copier_dropped_unclosed_stops_its_thread(driver_paths):
    import gc

    fake = FakeDriver(driver_paths[DriverVariant.CUDA12_8])
    before = fake.counts()["context_refs"]
    copier = stand_in(driver_paths, DriverVariant.CUDA12_8)
    buf = torch.zeros(8192, dtype=torch.uint8)
    copier.submit([buf.data_ptr()], [buf.data_ptr() + 4096], 4096, STREAM).wait(5)
    del copier
    gc.collect()
    assert fake.counts()["context_refs"] == before


@needs_nvcc
def test_describe_says_which_path_and_why(driver_paths, caplog):
    with caplog.at_level("INFO", logger="kvtier.moving.cuda_copy"):
        with stand_in(driver_paths, DriverVariant.OLD) as copier:
            facts = copier.describe()
    assert facts["path"] == "LOOP" and "no cuMemcpyBatchAsync" in facts["reason"]
    assert any(r.levelname == "WARNING" and "LOOP" in r.getMessage() for r in caplog.records)
    with stand_in(driver_paths, DriverVariant.CUDA12_8) as copier:
        assert copier.describe()["reason"] == "the driver has cuMemcpyBatchAsync (12.8 signature)"


@needs_nvcc
def test_a_driver_that_cannot_be_used_is_a_clear_error(driver_paths, tmp_path):
    with pytest.raises(CudaDriverError, match="neither cuMemcpyBatchAsync_v2 nor cuMemcpyBatchAsync"):
        stand_in(driver_paths, DriverVariant.OLD, CopyMode.BATCH)
    with pytest.raises(CudaDriverError, match="dlopen failed"):
        CudaCopier(driver=tmp_path / "no-such-libcuda.so")
    with pytest.raises(CudaDriverError, match="CUDA initialisation failed"):
        CudaCopier(device_index=3, driver=driver_paths[DriverVariant.CUDA13])  # the stand-in has device 0 only


# ---- the contract on a GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
class TestContractOnGPU(CopierContract):
    @pytest.fixture(params=[CopyMode.AUTO, CopyMode.LOOP], ids=["auto", "loop-forced"])
    def copier(self, request):
        with CudaCopier(torch.cuda.current_device(), request.param) as made:
            if request.param is CopyMode.LOOP:
                assert made.path is CopyPath.LOOP
            yield made

    @pytest.fixture
    def memory(self):
        def allocate(num_bytes, side):
            if side == "device":
                return torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
            return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return allocate

    @pytest.fixture
    def stream(self):
        return torch.cuda.Stream()

    @pytest.fixture
    def sync(self):
        return torch.cuda.synchronize


@pytest.mark.gpu
def test_gpu_copies_wait_for_the_event_after_the_writer():
    """A source written by a kernel on another stream is copied only after it: the after_event orders it."""
    writer, copies = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    with CudaCopier(torch.cuda.current_device()) as copier:
        with torch.cuda.stream(writer):
            src.fill_(7)
            written = torch.cuda.Event()
            written.record(writer)
        copier.submit([dst.data_ptr()], [src.data_ptr()], src.numel(), copies, after_event=written).wait(60)
    assert bool((dst == 7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [CopyMode.AUTO, CopyMode.LOOP], ids=["auto", "loop-forced"])
def test_gpu_copies_to_and_from_the_registered_dram_slab(mode):
    """The DRAM tier's slab is cudaHostRegister'ed memory, where batched copies once faulted elsewhere
    (SGLang #40232): 64 blocks of 1 MiB each way, byte for byte, with the batch API and the loop."""
    from kvtier.tiers.dram import DRAMTier

    block, n = 1 << 20, 64
    dram = DRAMTier(capacity_bytes=n * block, slot_bytes=block)
    device = torch.randint(0, 256, (n * block,), dtype=torch.uint8, device="cuda")
    back = torch.empty_like(device)
    slots = (np.arange(n) * 5) % n
    try:
        with CudaCopier(torch.cuda.current_device(), mode) as copier:
            slab = dram.memory_rows().data_ptr()
            stream = torch.cuda.Stream()
            torch.cuda.synchronize()
            copier.submit(slab + slots * block, device.data_ptr() + np.arange(n) * block, block, stream).wait(60)
            copier.submit(back.data_ptr() + np.arange(n) * block, slab + slots * block, block, stream).wait(60)
        assert torch.equal(back, device)
        assert torch.equal(dram.view(int(slots[1]), 0, block), device[block:2 * block].cpu())
    finally:
        dram.close()


# ---- the transfer engine's device route on the stand-in: one submission per layer span -------------------

@needs_nvcc
@pytest.mark.parametrize("chunk_bytes", [0, 1 << 30])
def test_the_transfer_engine_moves_a_device_batch_in_one_submission_per_span(driver_paths, chunk_bytes):
    """Blocks between a caller's rows and an HBM tier (a CPU tensor stands in for device memory; the
    stand-in driver copies host memory): every span of a store or a load is one submission of the
    whole batch, and every byte lands where it belongs."""
    from kvtier.model.layout import BlockLayout
    from kvtier.tiers.hbm import HBMTier
    from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine

    layout = BlockLayout.uniform(16, 4, 16 * 1024)
    num_spans = 4 if chunk_bytes == 0 else 1
    with stand_in(driver_paths) as copier:
        engine = TransferEngine(layout, chunk_bytes=chunk_bytes, device_copier=lambda device: copier)
        hbm = HBMTier(16 * layout.block_bytes, layout.block_bytes, device="cpu")
        try:
            blocks = torch.randint(0, 256, (8, layout.block_bytes), dtype=torch.uint8)
            slots = [9, 2, 15, 0, 4, 11, 6, 13]
            before = copier.stats()["jobs"]
            stored = engine.submit([CopyOp(k, Endpoint(buffer=blocks, slot=k), Endpoint(hbm, s))
                                    for k, s in enumerate(slots)], inline=False)
            assert stored.wait(60) and copier.stats()["jobs"] - before == num_spans
            assert all(torch.equal(hbm.view(s, 0, layout.block_bytes), blocks[k]) for k, s in enumerate(slots))
            out = torch.zeros_like(blocks)
            loaded = engine.submit([CopyOp(k, Endpoint(hbm, s), Endpoint(buffer=out, slot=k))
                                    for k, s in enumerate(slots)], inline=False)
            assert loaded.wait(60) and torch.equal(out, blocks)
            assert copier.stats()["jobs"] - before == 2 * num_spans
        finally:
            engine.close()
            hbm.close()


@needs_nvcc
def test_a_failed_device_batch_fails_each_of_its_blocks(driver_paths):
    """The driver reports a failed batch, not a block: every block of it is failed (a miss), none
    is reported as landed."""
    from kvtier.model.layout import BlockLayout
    from kvtier.tiers.hbm import HBMTier
    from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine

    layout = BlockLayout.uniform(16, 2, 8 * 1024)
    fake = FakeDriver(driver_paths[DriverVariant.CUDA13])
    with stand_in(driver_paths) as copier:
        engine = TransferEngine(layout, device_copier=lambda device: copier)
        hbm = HBMTier(4 * layout.block_bytes, layout.block_bytes, device="cpu")
        try:
            blocks = torch.randint(0, 256, (3, layout.block_bytes), dtype=torch.uint8)
            fake.fail_next(FailKind.BATCH, CUDA_ERROR_ILLEGAL_ADDRESS)
            handle = engine.submit([CopyOp(k, Endpoint(buffer=blocks, slot=k), Endpoint(hbm, k)) for k in range(3)],
                                   inline=False)
            assert not handle.wait(60) and set(handle.failed) == {0, 1, 2}
            assert all(f.stage == "write" for f in handle.failed.values())
        finally:
            engine.close()
            hbm.close()
