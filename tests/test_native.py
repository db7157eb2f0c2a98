"""Gather/scatter between paged engine KV and kvtier blocks: kernels, torch fallback, reference.

Cost: about 6 s on CPU. nvcc builds (~1 s each) run wherever nvcc is installed; the CUDA kernels
also run here, on the CPU, through a g++ build of the same source with a shim for the CUDA built-ins
(exact, since the kernels use no shared memory or barriers). The `gpu` test runs them on a device.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvtier.errors import GeometryError
from kvtier.model.layout import BlockLayout
from kvtier.moving.native import (
    KERNEL_NAMES,
    KERNEL_SOURCE,
    Kernels,
    KernelCall,
    NativeError,
    NvccOutput,
    PagedLayer,
    find_nvcc,
    gather_blocks,
    gather_reference,
    kernel_calls,
    nvcc_compile,
    scatter_blocks,
    scatter_reference,
)

KV_DIMS = [0, 1, None]  # [2, blocks, ...], [blocks, 2, ...], MLA [blocks, ...]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# On a GPU both copy paths run; the kernel's launches go through cupy.
CUDA_BACKENDS = [pytest.param(Kernels.CUDA, marks=pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                                                     reason="Kernels.CUDA needs cupy")),
                 Kernels.TORCH]


def make_engine(kv_dim, dtype, *, num_layers=3, num_engine_blocks=11, block_size=4, heads=2, head_dim=8,
                strided=False, seed=0, device="cpu"):
    """Random paged KV tensors (random bit patterns, NaNs included) and the matching block layout.

    With `strided`, each layer is a view into a larger allocation, so block and part strides are
    not the ones a fresh tensor would have.
    """
    gen = torch.Generator().manual_seed(seed)
    page = (block_size, heads, head_dim)
    n, extra = num_engine_blocks, 3 if strided else 0
    shapes = {0: (2, n + extra, *page), 1: (n, 2 + (1 if strided else 0), *page),
              None: (n, 2 if strided else 1, *page)}
    layers = []
    for _ in range(num_layers):
        shape = shapes[kv_dim]
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        big = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)
        big = big.to(device)  # before slicing, so the strides survive the move
        if kv_dim == 0:
            layers.append(big[:, extra:extra + n])  # some blocks of a larger pool
        elif kv_dim == 1:
            layers.append(big[:, :2])  # K and V of [n, 3, ...]
        else:
            layers.append(big[:, 0])  # the first of [n, 2, ...]
    num_parts = 1 if kv_dim is None else 2
    page_bytes = int(np.prod(page)) * layers[0].element_size()
    return layers, BlockLayout.uniform(block_size, num_layers, num_parts * page_bytes)


def zeroed_like(layers):
    """Zeroed copies that keep each layer's strides (zeros_like and clone make non-dense views dense)."""
    copies = []
    for kv in layers:
        big = torch.zeros(kv.untyped_storage().nbytes(), dtype=torch.uint8, device=kv.device).view(kv.dtype)
        copies.append(big.as_strided(kv.shape, kv.stride(), kv.storage_offset()))
    return copies


def random_ids(num, limit, seed, unique):
    gen = torch.Generator().manual_seed(seed)
    if unique:
        return torch.randperm(limit, generator=gen)[:num].tolist()
    return torch.randint(0, limit, (num,), generator=gen).tolist()


def raw(tensors):
    """Bytes of each tensor, so that comparisons are bit-exact and NaN-proof."""
    return [t.contiguous().view(torch.uint8).cpu() for t in tensors]


def assert_same_bytes(got, want):
    for a, b in zip(raw(got), raw(want)):
        assert torch.equal(a, b)


# --- nvcc ---------------------------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")


@needs_nvcc
def test_nvcc_builds_cubin_for_sm90_with_every_kernel(tmp_path):
    cubin = nvcc_compile(tmp_path, arch="sm_90", output=NvccOutput.CUBIN)
    data = cubin.read_bytes()
    assert cubin.name == "kv_blocks.sm_90.cubin" and data[:4] == b"\x7fELF"
    for name in KERNEL_NAMES:
        assert name.encode() in data


@needs_nvcc
def test_nvcc_builds_ptx_with_every_kernel_as_an_entry(tmp_path):
    ptx = nvcc_compile(tmp_path, arch="sm_90", output=NvccOutput.PTX).read_text()
    assert ".target sm_90" in ptx
    for name in KERNEL_NAMES:
        assert f".visible .entry {name}(" in ptx


@pytest.mark.slow
@needs_nvcc
def test_nvcc_builds_fatbin_for_sm80_and_sm90(tmp_path):
    fatbin = nvcc_compile(tmp_path, arch="sm_90", output=NvccOutput.FATBIN)
    assert fatbin.stat().st_size > 0


def test_nvcc_missing_or_bad_arch_is_a_clear_error(tmp_path):
    with pytest.raises(NativeError, match="nvcc not found"):
        nvcc_compile(tmp_path, nvcc=tmp_path / "no-such-nvcc")
    with pytest.raises(ValueError, match="sm_90"):
        nvcc_compile(tmp_path, arch="hopper")


@needs_nvcc
def test_nvcc_failure_carries_its_stderr(tmp_path):
    with pytest.raises(NativeError, match="nvcc failed"):
        nvcc_compile(tmp_path, arch="sm_1")


# --- torch fallback against the reference -------------------------------------------------------

@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_torch_gather_equals_reference(kv_dim, dtype, strided):
    layers, layout = make_engine(kv_dim, dtype, strided=strided)
    ids = random_ids(16, 11, seed=1, unique=False)  # more ids than blocks: repeats, any order
    got = torch.zeros(len(ids), layout.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    gather_blocks(layers, ids, got, layout, kv_dim, backend=Kernels.TORCH)
    gather_reference(layers, ids, want, layout, kv_dim)
    assert torch.equal(got, want)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_torch_scatter_equals_reference(kv_dim, dtype, strided):
    layers, layout = make_engine(kv_dim, dtype, strided=strided)
    ids = random_ids(7, 11, seed=2, unique=True)
    blocks = torch.randint(0, 256, (7, layout.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    got = zeroed_like(layers)
    want = [t.clone() for t in got]
    scatter_blocks(got, ids, blocks, layout, kv_dim, backend=Kernels.TORCH)
    scatter_reference(want, ids, blocks, layout, kv_dim)
    assert_same_bytes(got, want)


@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_scatter_of_gather_round_trips_and_touches_nothing_else(kv_dim):
    layers, layout = make_engine(kv_dim, torch.bfloat16, strided=True)
    ids = random_ids(6, 11, seed=4, unique=True)
    blocks = torch.empty(6, layout.block_bytes, dtype=torch.uint8)
    gather_blocks(layers, ids, blocks, layout, kv_dim, backend=Kernels.TORCH)
    restored = zeroed_like(layers)
    scatter_blocks(restored, ids, blocks, layout, kv_dim, backend=Kernels.TORCH)
    block_dim = 1 if kv_dim == 0 else 0
    for before, after in zip(raw(layers), raw(restored)):
        for b in range(11):
            page_after = after.select(block_dim, b)
            expected = before.select(block_dim, b) if b in ids else torch.zeros_like(page_after)
            assert torch.equal(page_after, expected)


@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_slots_and_a_single_layer_address_part_of_a_slab(kv_dim):
    layers, layout = make_engine(kv_dim, torch.float16)
    ids, slots = [3, 3, 0, 9], [5, 1, 7, 2]
    got = torch.zeros(8, layout.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    gather_blocks(layers[1:2], ids, got, layout, kv_dim, slots=slots, layers=[1], backend=Kernels.TORCH)
    gather_reference(layers[1:2], ids, want, layout, kv_dim, slots=slots, layers=[1])
    assert torch.equal(got, want) and got[[0, 3, 4, 6]].count_nonzero() == 0
    unique_ids = [4, 1, 8, 10]
    back = zeroed_like(layers)
    back_want = [t.clone() for t in back]
    scatter_blocks(back[2:], unique_ids, want, layout, kv_dim, slots=slots, layers=[2], backend=Kernels.TORCH)
    scatter_reference(back_want[2:], unique_ids, want, layout, kv_dim, slots=slots, layers=[2])
    assert_same_bytes(back, back_want)


# --- blocks whose bytes are strided runs (vLLM's LHBNC, BHLNC, kernel blocks) --------------------

RUN_CASES = ["per-head", "interleaved-layers", "kernel-blocks", "three-deep"]


def make_runs_engine(case, dtype, *, num_layers=3, num_engine_blocks=11, block_size=4, heads=2, content=6,
                     seed=0, device="cpu"):
    """Block-major views (kv_dim None) whose blocks are not one contiguous page, and their block layout.

    per-head            [H, blocks, N, C] storage, as vLLM's LHBNC: one run per head, `blocks` pages apart
    interleaved-layers  [blocks, H, L, N, C] storage shared by all layers, as BHLNC
    kernel-blocks       [2 * blocks, H, N / 2, C] storage read as [blocks, H, 2, N / 2, C]: runs per head
                        and kernel block, as an LBHNC block split into two kernel blocks
    three-deep          runs along three strided dimensions, the most `PagedLayer` takes
    """
    gen = torch.Generator().manual_seed(seed)
    n, size = num_engine_blocks, torch.empty((), dtype=dtype).element_size()

    def random(*shape):
        data = torch.randint(0, 256, (int(np.prod(shape)) * size,), dtype=torch.uint8, generator=gen)
        return data.view(dtype).reshape(shape).to(device)

    if case == "interleaved-layers":
        shared = random(n, heads, num_layers, block_size, content)
        layers = [shared[:, :, layer] for layer in range(num_layers)]
    elif case == "per-head":
        layers = [random(heads, n + 2, block_size, content)[:, 1:1 + n].transpose(0, 1) for _ in range(num_layers)]
    elif case == "kernel-blocks":
        half = block_size // 2
        layers = [random(2 * n, heads, half, content).unflatten(0, (n, 2)).permute(0, 2, 1, 3, 4)
                  for _ in range(num_layers)]
    else:  # [c=2, b=2, blocks, a=heads, run] read as [blocks, a, b, c, run]
        layers = [random(2, 2, n, heads, block_size * content).permute(2, 3, 1, 0, 4) for _ in range(num_layers)]
    page_bytes = layers[0][0].numel() * size
    return layers, BlockLayout.uniform(block_size, num_layers, page_bytes)


def test_geometry_of_strided_runs_is_read_from_shape_and_strides():
    layers, _ = make_runs_engine("per-head", torch.float16, heads=4)
    g = PagedLayer.of(layers[0], None)
    run = 4 * 6 * 2
    assert (g.num_engine_blocks, g.block_stride_bytes, g.run_bytes) == (11, run, run)
    assert (g.counts, g.strides, g.num_runs, g.page_bytes) == ((1, 1, 4), (0, 0, 13 * run), 4, 4 * run)
    three = PagedLayer.of(make_runs_engine("three-deep", torch.float16)[0][0], None)
    assert three.num_runs == 8 and all(c > 1 for c in three.counts)
    contiguous = PagedLayer.of(torch.zeros(5, 2, 3, 4), None)
    assert (contiguous.run_bytes, contiguous.num_runs) == (2 * 3 * 4 * 4, 1)


def test_blocks_of_more_than_three_strided_dimensions_are_refused():
    deep = torch.zeros(2, 2, 2, 5, 2, 8).permute(3, 4, 2, 1, 0, 5)  # [blocks, 2, 2, 2, 2, run], nothing merges
    with pytest.raises(GeometryError, match="at most 3 strided dimensions"):
        PagedLayer.of(deep, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", RUN_CASES)
def test_torch_path_on_strided_runs_equals_reference(case, dtype):
    layers, layout = make_runs_engine(case, dtype)
    ids, slots = random_ids(9, 11, seed=11, unique=False), random_ids(9, 12, seed=12, unique=True)
    got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    gather_blocks(layers, ids, got, layout, None, slots=slots, backend=Kernels.TORCH)
    gather_reference(layers, ids, want, layout, None, slots=slots)
    assert torch.equal(got, want) and got[slots].count_nonzero() > 0
    unique_ids = random_ids(9, 11, seed=13, unique=True)
    back, back_want = zeroed_like(layers), zeroed_like(layers)
    scatter_blocks(back, unique_ids, got, layout, None, slots=slots, backend=Kernels.TORCH)
    scatter_reference(back_want, unique_ids, want, layout, None, slots=slots)
    for a, b in zip(back, back_want):  # whole storages: nothing outside the blocks was written
        assert torch.equal(storage_bytes(a), storage_bytes(b))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([], dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()


def test_bad_inputs_raise_and_write_nothing():
    layers, layout = make_engine(0, torch.float16)
    blocks = torch.zeros(2, layout.block_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError, match="block_ids"):
        gather_blocks(layers, [0, 11], blocks, layout, 0)
    with pytest.raises(ValueError, match="repeat"):
        scatter_blocks(layers, [4, 4], blocks, layout, 0)
    with pytest.raises(GeometryError, match="do not fill"):
        gather_blocks(layers, [0, 1], blocks, layout, 1)
    with pytest.raises(GeometryError, match="2 block ids for 3"):
        gather_blocks(layers, [0, 1], torch.zeros(3, layout.block_bytes, dtype=torch.uint8), layout, 0)
    with pytest.raises(GeometryError, match="contiguous"):
        gather_blocks([t.transpose(3, 4) for t in layers], [0, 1], blocks, layout, 0)
    with pytest.raises(ValueError, match="CUDA tensors"):
        gather_blocks(layers, [0, 1], blocks, layout, 0, backend=Kernels.CUDA)
    assert blocks.count_nonzero() == 0


# --- the CUDA kernels, run on the CPU -----------------------------------------------------------

_EMULATOR = r"""
// Host build of kv_blocks.cu: CUDA built-ins as globals; a launch runs every thread in turn.
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
// A GPU faults on a 16-byte access that is not 16-byte aligned; x86 does not, so count them.
static int misaligned_vectors = 0;
struct uint4 {
    unsigned x, y, z, w;
    uint4& operator=(const uint4& o) {
        misaligned_vectors += (((unsigned long long)this | (unsigned long long)&o) & 15) != 0;
        x = o.x; y = o.y; z = o.z; w = o.w;
        return *this;
    }
};
#define __global__
#define __device__
#define __forceinline__ inline
#include "KERNEL_SOURCE"
#define LAUNCH(call)                                                              \
    gridDim = {gx, gy, gz}; blockDim = {bx, 1, 1};                               \
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y)          \
    for (unsigned x = 0; x < gx; ++x) for (unsigned t = 0; t < bx; ++t) {        \
        blockIdx = {x, y, z}; threadIdx = {t, 0, 0}; call; }
#define LAUNCH_ARGS unsigned gx, unsigned gy, unsigned gz, unsigned bx
typedef unsigned char u8;
extern "C" {
int emu_misaligned_vectors() { return misaligned_vectors; }
#define GEO i64 bs_e, i64 rb, i64 c0, i64 s0, i64 c1, i64 s1, i64 c2, i64 s2
void emu_gather_layer(LAUNCH_ARGS, u8* e, GEO, i64* ids, i64 n, u8* b, i64* o, i64 bs)
{ LAUNCH(gather_layer(e, bs_e, rb, c0, s0, c1, s1, c2, s2, ids, n, b, o, bs)) }
void emu_scatter_layer(LAUNCH_ARGS, u8* e, GEO, i64* ids, i64 n, u8* b, i64* o, i64 bs)
{ LAUNCH(scatter_layer(e, bs_e, rb, c0, s0, c1, s1, c2, s2, ids, n, b, o, bs)) }
void emu_gather_layers(LAUNCH_ARGS, i64* l, i64* ids, i64 n, u8* b, i64* o, i64 bs)
{ LAUNCH(gather_layers(l, ids, n, b, o, bs)) }
void emu_scatter_layers(LAUNCH_ARGS, i64* l, i64* ids, i64 n, u8* b, i64* o, i64 bs)
{ LAUNCH(scatter_layers(l, ids, n, b, o, bs)) }
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    compiler = shutil.which("g++")  # present on every machine of this kind (build-essential)
    build = tmp_path_factory.mktemp("emulator")
    source = build / "emulator.cpp"
    source.write_text(_EMULATOR.replace("KERNEL_SOURCE", str(KERNEL_SOURCE)))
    library = build / "emulator.so"
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(library))

    def launch(calls: list[KernelCall]) -> None:
        ctype = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
                 np.dtype(np.int32): ctypes.c_int32}
        for call in calls:
            shape = [ctypes.c_uint(v) for v in (*call.grid, call.block[0])]
            getattr(lib, f"emu_{call.name}")(*shape, *(ctype[a.dtype](int(a)) for a in call.args))
        assert lib.emu_misaligned_vectors() == 0, "a kernel made a misaligned 16-byte access"

    return launch


# page sizes: 64 B (aligned), 30 B (head/tail bytes, alignments that differ), 6 B (less than a vector),
# 40,000 B (several chunks)
PAGES = [dict(block_size=4, heads=2, head_dim=4), dict(block_size=3, heads=1, head_dim=5),
         dict(block_size=1, heads=1, head_dim=3), dict(block_size=10, heads=4, head_dim=500)]


@pytest.mark.parametrize("page", PAGES, ids=["64B", "30B", "6B", "40000B"])
@pytest.mark.parametrize("num_layers", [1, 3], ids=["one-layer-kernel", "batched-kernel"])
@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_kernels_on_cpu_equal_reference(emulator, kv_dim, num_layers, page):
    layers, layout = make_engine(kv_dim, torch.float16, num_layers=num_layers, strided=True, **page)
    ids, slots = random_ids(9, 11, seed=5, unique=False), random_ids(9, 12, seed=6, unique=True)
    got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    emulator(kernel_calls(layers, ids, got, layout, kv_dim, to_engine=False, slots=slots))
    gather_reference(layers, ids, want, layout, kv_dim, slots=slots)
    assert torch.equal(got, want)

    unique_ids = random_ids(9, 11, seed=7, unique=True)
    back = zeroed_like(layers)
    back_want = [t.clone() for t in back]
    emulator(kernel_calls(back, unique_ids, want, layout, kv_dim, to_engine=True, slots=slots))
    scatter_reference(back_want, unique_ids, want, layout, kv_dim, slots=slots)
    assert_same_bytes(back, back_want)


@pytest.mark.parametrize("num_layers", [1, 3], ids=["one-layer-kernel", "batched-kernel"])
@pytest.mark.parametrize("case", RUN_CASES)
def test_kernels_on_cpu_equal_reference_on_strided_runs(emulator, case, num_layers):
    layers, layout = make_runs_engine(case, torch.bfloat16, num_layers=num_layers, content=5)  # 10 B: unaligned
    ids, slots = random_ids(9, 11, seed=14, unique=False), random_ids(9, 12, seed=15, unique=True)
    got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    emulator(kernel_calls(layers, ids, got, layout, None, to_engine=False, slots=slots))
    gather_reference(layers, ids, want, layout, None, slots=slots)
    assert torch.equal(got, want)
    unique_ids = random_ids(9, 11, seed=16, unique=True)
    back, back_want = zeroed_like(layers), zeroed_like(layers)
    emulator(kernel_calls(back, unique_ids, want, layout, None, to_engine=True, slots=slots))
    scatter_reference(back_want, unique_ids, want, layout, None, slots=slots)
    for a, b in zip(back, back_want):
        assert torch.equal(storage_bytes(a), storage_bytes(b))


# --- the CUDA kernels on a GPU ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="Kernels.CUDA needs cupy")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dim", KV_DIMS)
def test_cuda_kernels_equal_reference(kv_dim, dtype):
    for page, num_layers in [(PAGES[0], 3), (PAGES[1], 1), (PAGES[2], 2), (PAGES[3], 2)]:
        device_layers, layout = make_engine(kv_dim, dtype, num_layers=num_layers, strided=True, device="cuda",
                                            **page)
        layers = [t.cpu() for t in device_layers]
        ids, slots = random_ids(9, 11, seed=8, unique=False), random_ids(9, 12, seed=9, unique=True)
        got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8, device="cuda")
        want = torch.zeros(12, layout.block_bytes, dtype=torch.uint8)
        gather_blocks(device_layers, ids, got, layout, kv_dim, slots=slots, backend=Kernels.CUDA)
        gather_reference(layers, ids, want, layout, kv_dim, slots=slots)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want)

        unique_ids = random_ids(9, 11, seed=10, unique=True)
        back = zeroed_like(device_layers)
        back_want = [t.cpu() for t in back]
        scatter_blocks(back, torch.tensor(unique_ids, device="cuda"), got, layout, kv_dim, slots=slots,
                       backend=Kernels.CUDA)
        scatter_reference(back_want, unique_ids, want, layout, kv_dim, slots=slots)
        torch.cuda.synchronize()
        assert_same_bytes(back, back_want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("case", RUN_CASES)
def test_on_a_gpu_strided_runs_equal_reference(case, backend):
    for num_layers in (1, 3):
        device_layers, layout = make_runs_engine(case, torch.float16, num_layers=num_layers, device="cuda")
        layers, _ = make_runs_engine(case, torch.float16, num_layers=num_layers)  # same seed: same values
        ids, slots = random_ids(9, 11, seed=17, unique=False), random_ids(9, 12, seed=18, unique=True)
        got = torch.zeros(12, layout.block_bytes, dtype=torch.uint8, device="cuda")
        want = torch.zeros(12, layout.block_bytes, dtype=torch.uint8)
        gather_blocks(device_layers, ids, got, layout, None, slots=slots, backend=backend)
        gather_reference(layers, ids, want, layout, None, slots=slots)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want)
        unique_ids = random_ids(9, 11, seed=19, unique=True)
        back, back_want = zeroed_like(device_layers), zeroed_like(layers)
        scatter_blocks(back, unique_ids, got, layout, None, slots=slots, backend=backend)
        scatter_reference(back_want, unique_ids, want, layout, None, slots=slots)
        torch.cuda.synchronize()
        for a, b in zip(back, back_want):
            assert torch.equal(storage_bytes(a), storage_bytes(b))
