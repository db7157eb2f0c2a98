"""GPU check: kernels, CUDA-stream transfers and pinned bandwidth, in one short run on a GPU machine.

Sections, each recorded as pass/fail with its details:
  env        what was found: torch, CUDA device and arch, cupy, nvcc.
  nvcc       native/kv_blocks.cu compiled with nvcc for the device's arch (sm_90 without a device), and
             native/kv_copy.c (the GPU <-> host copier) built as a shared library.
  kernels    gather/scatter against `gather_reference`/`scatter_reference`, bit-exact, for the layouts
             [2, N, page] (kv_dim 0), [N, 2, page] (kv_dim 1) and MLA [N, page], fp16 and bf16, one- and
             many-layer launches, pages from 6 B to 32 KiB, by every backend present: the NVRTC module
             (cupy), the nvcc cubin (loaded by cupy) and the torch fallback.
  layouts    the vLLM connector's gather/scatter on caches laid out as vLLM 0.32 allocates them for each
             KVCacheLayout (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC; blocks split into kernel blocks
             where vLLM splits them), through `engine_block_view`, by every backend: each gathered block
             must be exactly its tokens' K|V per layer in the format's order, and a scatter must write
             those blocks and nothing else.
  runtime    a KVTier on a CUDA HBM tier, pinned DRAM and an SSD directory: store, spill, load and
             layer-wise load byte-identical; after `wait_layer(l)` returns, layer l is already in place.
  bandwidth  HBM tier <-> DRAM tier through `TransferEngine`, 1-4 MiB blocks in batches, against plain
             `copy_` between pinned host and device tensors of the same bytes in the same run (GB/s, ratio).
  copier     kvtier.moving.cuda_copy.CudaCopier (cuMemcpyBatchAsync, and the C loop forced) against plain pinned
             `copy_`, 64 KiB / 1 MiB / 4 MiB blocks in batches of 64, both ways (bench/gpu_copier.py).

Exit codes: 0 every section passed; 1 a section failed; 2 bad arguments; 3 no CUDA device (after the
nvcc check, which runs wherever nvcc is; its failure gives 1 instead). JSON: `<out>/gpu_check.json`,
rewritten after every section so a killed run still leaves what it did.

    python bench/gpu_check.py [--quick] [--out DIR] [--install-cupy] [--min-ratio 0.9]

`--simulate-cpu` runs the runtime and bandwidth sections on CPU stand-ins (torch backend only); it
exists to test this script where there is no GPU and proves nothing about one.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gpu_copier import copier_section
from gpu_copier import table as copier_table
from kvtier.config import KVTierConfig, PrefetchConfig, TierConfig, TransferConfig
from kvtier.integrations.vllm.pages import HEAD_MAJOR_LAYOUTS, TOKEN_MAJOR_LAYOUTS
from kvtier.integrations.vllm.transfers import engine_block_view
from kvtier.model.layout import BlockLayout
from kvtier.moving.native import (
    KERNEL_NAMES,
    Kernels,
    NvccOutput,
    find_nvcc,
    gather_blocks,
    gather_reference,
    kernel_calls,
    nvcc_compile,
    scatter_blocks,
    scatter_reference,
)
from kvtier.moving.cuda_copy import build_library
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from kvtier.moving.engine import CopyOp, Endpoint, TransferEngine

EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 3
MiB = 1 << 20
WAIT_S = 120.0  # a safety net against a hung transfer, never a measurement
GOAL_RATIO = 0.9  # bench/bench_tiers.py's goal for hbm-dram; reported, gated only by --min-ratio
PAGES = [{"block_size": 4, "heads": 2, "head_dim": 8}, {"block_size": 3, "heads": 1, "head_dim": 5},
         {"block_size": 1, "heads": 1, "head_dim": 3}, {"block_size": 16, "heads": 8, "head_dim": 128}]


# ---- environment -------------------------------------------------------------------------------

def cuda_status() -> tuple[bool, str]:
    """Whether a CUDA device is usable, and why not."""
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            torch.cuda.init()
            return True, ""
        torch.cuda.init()  # raises with the driver's own words when it can
        return False, "torch.cuda.is_available() is False (no device or no driver)"
    except Exception as e:  # noqa: BLE001 -- report, do not crash: this is the answer the user asked for
        return False, f"CUDA init failed: {e}"


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def env_section(has_cuda: bool, reason: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda": has_cuda, "cupy": importlib.util.find_spec("cupy") is not None,
            "nvcc": str(find_nvcc()) if find_nvcc() else None}
    if has_cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, arch=device_arch(), sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["reason"] = reason
    return {"status": "pass", **info}


def install_cupy() -> str:
    """pip-installs the cupy wheel for torch's CUDA major version; returns what it did."""
    major = (torch.version.cuda or "12").split(".")[0]
    package = f"cupy-cuda{major}x"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", package], check=False,
                          capture_output=True, text=True, timeout=600)
    importlib.invalidate_caches()
    if done.returncode != 0:
        return f"pip install {package} failed ({done.returncode}): {done.stderr.strip()[-400:]}"
    return f"installed {package}"


# ---- nvcc --------------------------------------------------------------------------------------

def nvcc_section(arch: str, build_dir: Path) -> dict:
    nvcc = find_nvcc()
    if nvcc is None:
        return {"status": "skip", "reason": "nvcc not found"}
    version = subprocess.run([str(nvcc), "--version"], check=False, capture_output=True, text=True).stdout.strip()
    start = time.perf_counter()
    cubin = nvcc_compile(build_dir, arch=arch, output=NvccOutput.CUBIN)
    data = cubin.read_bytes()
    missing = [name for name in KERNEL_NAMES if name.encode() not in data]
    copy_library = build_library(build_dir)
    missing += [name for name in ("kvc_submit", "kvc_ticket_wait") if name.encode() not in copy_library.read_bytes()]
    return {"status": "fail" if missing else "pass", "arch": arch, "cubin": str(cubin), "bytes": len(data),
            "copy_library": str(copy_library),
            "seconds": round(time.perf_counter() - start, 2), "missing_kernels": missing,
            "nvcc_version": version.splitlines()[-1] if version else ""}


# ---- kernels -----------------------------------------------------------------------------------

def make_engine(kv_dim, dtype, num_layers, page, device, gen):
    """Random-bit paged KV layers (NaNs included) as strided views of larger tensors, and their layout."""
    shape_page = (page["block_size"], page["heads"], page["head_dim"])
    n = 11
    shapes = {0: (2, n + 3, *shape_page), 1: (n, 3, *shape_page), None: (n, 2, *shape_page)}
    layers = []
    for _ in range(num_layers):
        shape = shapes[kv_dim]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        big = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)
        big = big.to(device)
        layers.append(big[:, 3:] if kv_dim == 0 else big[:, :2] if kv_dim == 1 else big[:, 0])
    page_bytes = torch.Size(shape_page).numel() * layers[0].element_size()
    num_parts = 1 if kv_dim is None else 2
    return layers, BlockLayout.uniform(page["block_size"], num_layers, num_parts * page_bytes)


def poisoned_like(layers, device: str | None = None):
    """Copies filled with 0xA5 bytes that keep each layer's storage size, strides and offset, so
    unwritten bytes show, on `device` (default: each layer's own). The reference's copies are made
    this way on the host, never by `.cpu()`, which compacts a strided CUDA view into a smaller storage
    and would make every comparison of whole storages fail."""
    out = []
    for kv in layers:
        big = torch.full((kv.untyped_storage().nbytes(),), 0xA5, dtype=torch.uint8, device=device or kv.device)
        out.append(big.view(kv.dtype).as_strided(kv.shape, kv.stride(), kv.storage_offset()))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


class CubinLauncher:
    """Launches `kernel_calls` from the nvcc-built cubin through cupy, on torch's current stream."""

    def __init__(self, cubin: Path) -> None:
        import cupy

        self.cupy = cupy
        self.module = cupy.RawModule(path=str(cubin))

    def __call__(self, calls) -> None:
        index = torch.cuda.current_device()
        with self.cupy.cuda.Device(index):
            stream = self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream, index)
            with stream:
                for call in calls:
                    self.module.get_function(call.name)(call.grid, call.block, call.args)


def kernel_backends(device: str, cubin: Path | None) -> tuple[dict, list[str]]:
    """The ways to run gather/scatter here, by name, and why any expected one is missing."""
    backends = {"torch": Kernels.TORCH}
    missing = []
    if device == "cuda":
        if importlib.util.find_spec("cupy") is None:
            missing.append("cupy not installed (pass --install-cupy): NVRTC and cubin kernels not run")
        else:
            backends["cuda-nvrtc"] = Kernels.CUDA
            if cubin is None:
                missing.append("no nvcc cubin: the nvcc-built kernels not run")
            else:
                backends["cuda-cubin"] = CubinLauncher(cubin)
    return backends, missing


def run_case(backend, kv_dim, dtype, num_layers, page, device, gen) -> bool:
    """One gather then scatter, checked bit for bit against the reference on CPU copies."""
    layers, layout = make_engine(kv_dim, dtype, num_layers, page, device, gen)
    ids = torch.randint(0, 11, (9,), generator=gen).tolist()  # gather may repeat ids
    slots = torch.randperm(12, generator=gen)[:9].tolist()
    got = torch.full((12, layout.block_bytes), 0xA5, dtype=torch.uint8, device=device)
    want = torch.full((12, layout.block_bytes), 0xA5, dtype=torch.uint8)  # never an alias of got
    move(backend, gather_blocks, layers, ids, got, layout, kv_dim, slots, to_engine=False)
    gather_reference([t.cpu() for t in layers], ids, want, layout, kv_dim, slots=slots)
    unique = torch.randperm(11, generator=gen)[:9].tolist()
    back = poisoned_like(layers)
    back_want = poisoned_like(layers, "cpu")  # own storage, even when device is cpu
    move(backend, scatter_blocks, back, unique, got, layout, kv_dim, slots, to_engine=True)
    scatter_reference(back_want, unique, want, layout, kv_dim, slots=slots)
    if device == "cuda":
        torch.cuda.synchronize()
    storages = [torch.tensor([], dtype=t.dtype, device=t.device).set_(t.untyped_storage()) for t in back]
    storages_want = [torch.tensor([], dtype=t.dtype).set_(t.untyped_storage()) for t in back_want]
    return same_bytes(got, want) and all(same_bytes(a, b) for a, b in zip(storages, storages_want))


def move(backend, fn, layers, ids, blocks, layout, kv_dim, slots, to_engine):
    if isinstance(backend, Kernels):
        fn(layers, ids, blocks, layout, kv_dim, slots=slots, backend=backend)
    else:  # a launcher of the nvcc cubin
        backend(kernel_calls(layers, ids, blocks, layout, kv_dim, to_engine=to_engine, slots=slots))


def kernels_section(device: str, cubin: Path | None, quick: bool) -> dict:
    backends, missing = kernel_backends(device, cubin)
    gen = torch.Generator().manual_seed(1234)
    cases, failures = 0, []
    pages = PAGES[::3] if quick else PAGES
    for name, backend in backends.items():
        for kv_dim in (0, 1, None):
            for dtype in (torch.float16, torch.bfloat16):
                for num_layers in (1, 3):
                    for page in pages:
                        cases += 1
                        if not run_case(backend, kv_dim, dtype, num_layers, page, device, gen):
                            failures.append(f"{name} kv_dim={kv_dim} {dtype} layers={num_layers} page={page}")
    status = "fail" if failures or missing else "pass"
    return {"status": status, "backends": list(backends), "cases": cases, "num_failures": len(failures),
            "failures_by_backend": {b: sum(f.startswith(f"{b} ") for f in failures) for b in backends},
            "failures": failures[:20], "missing": missing}


# ---- vLLM KV cache layouts -----------------------------------------------------------------------

VLLM_LAYOUTS = HEAD_MAJOR_LAYOUTS + TOKEN_MAJOR_LAYOUTS
LAYOUT_SHAPES = [{"num_layers": 3, "num_blocks": 10, "heads": 2, "block_size": 16, "head_dim": 8},
                 {"num_layers": 4, "num_blocks": 12, "heads": 8, "block_size": 16, "head_dim": 128}]


def kernel_ratios(layout: str) -> tuple[int, ...]:
    """How many kernel blocks vLLM may split a block into: only where a layer's block is one dense page
    right after the previous block's (layer-compact, block-contiguous: LBHNC, LBNHC)."""
    return (1, 2) if layout in ("LBHNC", "LBNHC") else (1,)


def vllm_layout_caches(layout: str, num_layers: int, num_blocks: int, heads: int, block_size: int, head_dim: int,
                       dtype: torch.dtype, device: str, ratio: int = 1, fill: int | None = None) -> list[torch.Tensor]:
    """The per-layer caches vLLM 0.32 registers with a connector for one full-attention group.

    A copy of `get_kv_cache_config_from_groups` (layer and block strides), `allocate_kv_cache` (one
    int8 buffer) and `create_kv_cache_views` (a `[B * ratio, H, N / ratio, C]` view per layer, strides by
    the layout's permutation, C = K then V); tests/integrations/test_vllm_layouts.py pins it to vLLM's own code.
    The buffer holds `fill` bytes, else random ones.
    """
    size = torch.empty((), dtype=dtype).element_size()
    logical = {"L": num_layers, "B": num_blocks, "H": heads, "N": block_size, "C": 2 * head_dim * size}
    strides, extent = {}, 1
    for dim in reversed(layout):  # the layout names the physical order, outermost first
        strides[dim], extent = extent, extent * logical[dim]
    if ratio > 1 and strides["B"] != heads * block_size * logical["C"]:
        raise ValueError(f"vLLM does not split the blocks of {layout} into kernel blocks")
    kernel = {**logical, "B": num_blocks * ratio, "N": block_size // ratio}
    fixed = {"L": strides["L"], "B": strides["B"] // ratio}
    kernel_strides, current = {}, 1
    for dim in reversed(layout):
        kernel_strides[dim] = fixed.get(dim) or current
        current = kernel_strides[dim] * kernel[dim]
    if fill is None:
        buf = torch.randint(-128, 128, (extent,), dtype=torch.int8).to(device)
    else:
        buf = torch.full((extent,), fill - 256 if fill > 127 else fill, dtype=torch.int8, device=device)
    view = buf.as_strided(tuple(kernel[d] for d in "LBHNC"), tuple(kernel_strides[d] for d in "LBHNC"))
    return [view[layer].view(dtype) for layer in range(num_layers)]


def expected_block_bytes(kv: torch.Tensor, block: int, ratio: int, head_major: bool, head_dim: int) -> torch.Tensor:
    """The bytes kvtier must hold for `block` of one layer, read as the CUDA attention backends read the
    cache: K = C[:head_size], V = C[head_size:] of (kernel block, head, token); tokens in order."""
    raw = kv.view(torch.uint8)  # [B * ratio, H, N / ratio, C bytes]
    key, value = raw.split(head_dim * kv.element_size(), dim=-1)
    kernel_tokens = kv.shape[2]
    tokens = torch.arange(kernel_tokens * ratio, device=kv.device)
    rows, cols = block * ratio + tokens // kernel_tokens, tokens % kernel_tokens
    per_token = torch.cat([key[rows, :, cols], value[rows, :, cols]], dim=-1)  # [N, H, C]
    return (per_token.transpose(0, 1) if head_major else per_token).contiguous().flatten().cpu()


def layout_case(backend, layout: str, ratio: int, dtype: torch.dtype, shape: dict, device: str, gen) -> bool:
    """One gather then scatter through `engine_block_view` on vLLM-laid-out caches, checked by meaning."""
    n, head_dim, head_major = shape["num_blocks"], shape["head_dim"], layout in HEAD_MAJOR_LAYOUTS
    page_bytes = shape["heads"] * shape["block_size"] * 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    layout_bytes = BlockLayout.uniform(shape["block_size"], shape["num_layers"], page_bytes)

    def views(caches):
        return [engine_block_view(kv, n, shape["block_size"], page_bytes, head_major) for kv in caches]

    caches = vllm_layout_caches(layout, **shape, dtype=dtype, device=device, ratio=ratio)
    ids = torch.randint(0, n, (7,), generator=gen).tolist()
    slots = torch.randperm(n, generator=gen)[:7].tolist()
    got = torch.full((n, layout_bytes.block_bytes), 0xA5, dtype=torch.uint8, device=device)
    move(backend, gather_blocks, views(caches), ids, got, layout_bytes, None, slots, to_engine=False)
    unique = torch.randperm(n, generator=gen)[:7].tolist()
    back = vllm_layout_caches(layout, **shape, dtype=dtype, device=device, ratio=ratio, fill=0xA5)
    move(backend, scatter_blocks, views(back), unique, got, layout_bytes, None, slots, to_engine=True)
    if device == "cuda":
        torch.cuda.synchronize()
    got_rows, ok = got.cpu(), True
    for block, target, slot in zip(ids, unique, slots):
        for layer in range(shape["num_layers"]):
            start, length = layout_bytes.layer_range(layer)
            want = expected_block_bytes(caches[layer], block, ratio, head_major, head_dim)
            ok &= torch.equal(got_rows[slot, start:start + length], want)
            ok &= torch.equal(expected_block_bytes(back[layer], target, ratio, head_major, head_dim), want)
    untouched = [kv.view(torch.uint8).clone() for kv in back]  # everything else is still 0xA5
    for kv in untouched:
        kv.unflatten(0, (n, ratio))[unique] = 0xA5
    return ok and all(bool((kv == 0xA5).all()) for kv in untouched)


def layouts_section(device: str, cubin: Path | None, quick: bool) -> dict:
    backends, missing = kernel_backends(device, cubin)
    gen = torch.Generator().manual_seed(4321)
    cases, failures = 0, []
    shapes = LAYOUT_SHAPES[:1] if quick else LAYOUT_SHAPES
    for name, backend in backends.items():
        for layout in VLLM_LAYOUTS:
            for ratio in kernel_ratios(layout):
                for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                    for shape in shapes:
                        cases += 1
                        if not layout_case(backend, layout, ratio, dtype, shape, device, gen):
                            failures.append(f"{name} {layout} ratio={ratio} {dtype} {shape}")
    status = "fail" if failures or missing else "pass"
    return {"status": status, "backends": list(backends), "cases": cases, "failures": failures[:20],
            "missing": missing}


# ---- runtime -----------------------------------------------------------------------------------

def runtime_config(layout: BlockLayout, ssd_dir: Path, device: str) -> KVTierConfig:
    """HBM 4 blocks, DRAM 4, SSD 16; watermarks off so spills are exact; per-layer copies."""
    b = layout.block_bytes
    tiers = (TierConfig(TierKind.HBM, 4 * b, device=device, high_watermark=1.0, low_watermark=1.0),
             TierConfig(TierKind.DRAM, 4 * b, high_watermark=1.0, low_watermark=1.0),
             TierConfig(TierKind.SSD, 16 * b, path=ssd_dir, high_watermark=1.0, low_watermark=1.0))
    return KVTierConfig(model="kvtier-tiny", tiers=tiers, prefetch=PrefetchConfig(TierKind.DRAM, 16 * b),
                        transfer=TransferConfig(io_workers=4, chunk_bytes=0))


def runtime_section(device: str, tmp: Path) -> dict:
    layout = BlockLayout.uniform(block_tokens=16, num_layers=8, layer_bytes=256 * 1024)  # 2 MiB blocks
    gen = torch.Generator().manual_seed(99)
    num_blocks = 12  # 4 stay in HBM, the rest spill to DRAM and SSD
    blocks = torch.randint(0, 256, (num_blocks, layout.block_bytes), dtype=torch.uint8, generator=gen).to(device)
    keys = [f"block-{i}".encode() for i in range(num_blocks)]
    problems: list[str] = []
    with KVTier(runtime_config(layout, tmp / "ssd", device), layout=layout) as kv:
        facts = {t["tier"]: t for t in kv.describe()["tiers"]}
        if device == "cuda" and (facts["hbm"].get("stand_in") or not facts["dram"].get("pinned")):
            problems.append(f"expected a CUDA HBM tier and pinned DRAM, got {facts}")
        sync(device)  # the engine's stream does not wait on the caller's: finish writing the sources first
        stored = kv.store(keys, blocks)
        stored.wait(WAIT_S)
        kv.quiesce(WAIT_S)
        problems += [f"store failed: {k!r}" for k in stored.failed]
        where = {k.decode(): (w.name if w is not None else None) for k, w in zip(keys, kv.where(keys))}
        if {w for w in where.values()} != {"HBM", "DRAM", "SSD"}:
            problems.append(f"expected blocks in HBM, DRAM and SSD, got {where}")
        problems += load_all(kv, keys, blocks, device, pinned_host=device == "cuda")
        layer_problems, ordering_stressed = load_layerwise(kv, keys, blocks, layout, device)
        problems += layer_problems
        miss = kv.load([b"absent"], torch.empty(1, layout.block_bytes, dtype=torch.uint8, device=device))
        miss.wait(WAIT_S)
        if b"absent" not in miss.failed:
            problems.append("a missing key was not reported failed")
        usage = kv.usage()
    return {"status": "fail" if problems else "pass", "problems": problems, "where_after_store": where,
            "usage_after": usage, "tiers": facts,
            "ordering_stressed": ordering_stressed, "block_bytes": layout.block_bytes}


def load_all(kv: KVTier, keys, blocks, device, pinned_host: bool) -> list[str]:
    """Loads every block into device buffers and into (pinned) host buffers; checks bytes."""
    problems = []
    for where, dev in (("device", device), ("host", "cpu")):
        into = torch.full_like(blocks, 0xA5, device=dev)
        if dev == "cpu" and pinned_host:
            into = into.pin_memory()
        sync(device)  # the poison fill must land before the engine's stream writes the buffer
        handle = kv.load(keys, into)
        handle.wait(WAIT_S)
        kv.quiesce(WAIT_S)
        problems += [f"load into {where} failed: {k!r} {f}" for k, f in handle.failed.items()]
        bad = [i for i in range(len(keys)) if not torch.equal(into[i].to(blocks.device), blocks[i])]
        problems += [f"load into {where}: block {i} differs" for i in bad]
    return problems


def load_layerwise(kv: KVTier, keys, blocks, layout: BlockLayout, device) -> tuple[list[str], bool]:
    """After wait_layer(l) returns, layer l of every block must already be in place.

    Returns the problems, and whether some wait_layer returned while later layers were still in
    flight (else the ordering was not put to the test, only the contents).
    """
    problems = []
    into = torch.full_like(blocks, 0xA5)
    sync(device)
    handle = kv.load(keys, into)
    seen_partial = False
    for layer in range(layout.num_layers):
        handle.wait_layer(layer, WAIT_S)
        seen_partial |= handle.layers_done < layout.num_layers
        lo, hi = layout.offsets[layer], layout.offsets[layer + 1]
        if not torch.equal(into[:, lo:hi], blocks[:, lo:hi]):
            problems.append(f"layer {layer} not in place when wait_layer({layer}) returned")
        if handle.layers_done < layer + 1:
            problems.append(f"layers_done {handle.layers_done} after wait_layer({layer})")
    handle.wait(WAIT_S)
    kv.quiesce(WAIT_S)
    problems += [f"layer-wise load failed: {k!r} {f}" for k, f in handle.failed.items()]
    if not torch.equal(into, blocks):
        problems.append("layer-wise load: blocks differ at the end")
    return problems, seen_partial


# ---- bandwidth ---------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_median(fn, repeats: int, device: str) -> float:
    fn()  # warm-up: streams, pinned buffers, allocator
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth_row(block_bytes: int, num_blocks: int, repeats: int, device: str) -> dict:
    """One block size: kvtier's HBM<->DRAM transfers and a plain copy_ of the same bytes, both ways."""
    from kvtier.tiers.dram import DRAMTier
    from kvtier.tiers.hbm import HBMTier

    layout = BlockLayout.uniform(block_tokens=16, num_layers=32, layer_bytes=block_bytes // 32)
    hbm = HBMTier(num_blocks * block_bytes, block_bytes, device=device)
    dram = DRAMTier(num_blocks * block_bytes, block_bytes)
    engine = TransferEngine(layout, chunk_bytes=TransferConfig().chunk_bytes)
    try:
        src = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
        for slot in range(num_blocks):
            dram.view(slot, 0, block_bytes).copy_(src[slot])
        d2h = [CopyOp(i, Endpoint(hbm, i), Endpoint(dram, i)) for i in range(num_blocks)]
        h2d = [CopyOp(i, Endpoint(dram, i), Endpoint(hbm, i)) for i in range(num_blocks)]

        def run(ops):
            handle = engine.submit(ops)
            handle.wait(WAIT_S)
            if handle.failed:
                raise RuntimeError(f"transfer failed: {dict(handle.failed)}")

        row = {"block_mib": block_bytes / MiB, "num_blocks": num_blocks, "bytes": num_blocks * block_bytes}
        row["kvtier_h2d_s"] = time_median(lambda: run(h2d), repeats, device)
        hbm_ok = all(torch.equal(hbm.view(i, 0, block_bytes).cpu(), src[i]) for i in range(num_blocks))
        for slot in range(num_blocks):
            dram.view(slot, 0, block_bytes).fill_(0xA5)
        row["kvtier_d2h_s"] = time_median(lambda: run(d2h), repeats, device)
        dram_ok = all(torch.equal(dram.view(i, 0, block_bytes), src[i]) for i in range(num_blocks))
        row.update(plain_copy_times(block_bytes, num_blocks, repeats, device))
        row["bytes_ok"] = hbm_ok and dram_ok
        return with_rates(row)
    finally:
        engine.close()
        hbm.close()
        dram.close()


def plain_copy_times(block_bytes: int, num_blocks: int, repeats: int, device: str) -> dict:
    """cudaMemcpyAsync per block between a pinned host tensor and a device tensor, then synchronize."""
    host = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, pin_memory=device == "cuda")
    host.random_(0, 256)
    dev = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device)

    def copy_all(dst, src):
        for i in range(num_blocks):
            dst[i].copy_(src[i], non_blocking=True)

    return {"plain_h2d_s": time_median(lambda: copy_all(dev, host), repeats, device),
            "plain_d2h_s": time_median(lambda: copy_all(host, dev), repeats, device)}


def with_rates(row: dict) -> dict:
    for way in ("h2d", "d2h"):
        for who in ("kvtier", "plain"):
            row[f"{who}_{way}_gbps"] = round(row["bytes"] / row[f"{who}_{way}_s"] / 1e9, 2)
        row[f"ratio_{way}"] = round(row[f"kvtier_{way}_gbps"] / row[f"plain_{way}_gbps"], 3)
    return row


def bandwidth_section(device: str, quick: bool, min_ratio: float) -> dict:
    sizes = [1 * MiB, 4 * MiB] if quick else [1 * MiB, 2 * MiB, 4 * MiB]
    batch_bytes = (64 if quick else 256) * MiB
    repeats = 3 if quick else 7
    rows = [bandwidth_row(size, batch_bytes // size, repeats, device) for size in sizes]
    problems = [f"{r['block_mib']} MiB: bytes differ after the transfers" for r in rows if not r["bytes_ok"]]
    problems += [f"{r['block_mib']} MiB {way}: ratio {r[f'ratio_{way}']} < --min-ratio {min_ratio}"
                 for r in rows for way in ("h2d", "d2h") if r[f"ratio_{way}"] < min_ratio]
    meets = all(r[f"ratio_{w}"] >= GOAL_RATIO for r in rows for w in ("h2d", "d2h"))
    return {"status": "fail" if problems else "pass", "problems": problems, "rows": rows,
            "goal_ratio": GOAL_RATIO, "meets_goal": meets, "min_ratio": min_ratio,
            "chunk_bytes": TransferConfig().chunk_bytes, "repeats": repeats}


# ---- driver ------------------------------------------------------------------------------------

class Report:
    """Sections by name, written to JSON after each one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sections: dict[str, dict] = {}

    def run(self, name: str, fn, *args) -> dict:
        print(f"[gpu_check] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 -- a checker reports a broken section and goes on to the next
            result = {"status": "fail", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.sections[name] = result
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)", flush=True)
        self.write()
        return result

    def write(self, **extra) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        env = self.sections.get("env", {})
        doc = {"cuda": env.get("cuda", False), "sections": self.sections, **extra}
        self.path.write_text(json.dumps(doc, indent=2, default=str))

    def table(self) -> str:
        lines = [f"{'section':<10} {'status':<6} {'seconds':>8}  detail"]
        for name, s in self.sections.items():
            detail = s.get("error") or "; ".join((s.get("problems") or s.get("failures") or s.get("missing")
                                                  or [])[:3])
            lines.append(f"{name:<10} {s['status']:<6} {s.get('seconds', 0):>8}  {detail}")
        bw = self.sections.get("bandwidth", {}).get("rows", [])
        if bw:
            lines.append(f"\n{'block':>7} {'blocks':>6} {'H2D kvtier':>11} {'plain':>7} {'ratio':>6} "
                         f"{'D2H kvtier':>11} {'plain':>7} {'ratio':>6}   (GB/s)")
            for r in bw:
                lines.append(f"{r['block_mib']:>5g}Mi {r['num_blocks']:>6} {r['kvtier_h2d_gbps']:>11} "
                             f"{r['plain_h2d_gbps']:>7} {r['ratio_h2d']:>6} {r['kvtier_d2h_gbps']:>11} "
                             f"{r['plain_d2h_gbps']:>7} {r['ratio_d2h']:>6}")
        if self.sections.get("copier", {}).get("rows"):
            lines += copier_table(self.sections["copier"])
        return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer cases and smaller batches (about a minute)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"),
                   help="directory for gpu_check.json (default $OUT, else ./out)")
    p.add_argument("--install-cupy", action="store_true",
                   help="pip install cupy-cuda<major>x for torch's CUDA if cupy is missing")
    p.add_argument("--min-ratio", type=float, default=0.0,
                   help=f"fail bandwidth below this kvtier/plain ratio (default 0: report only; goal {GOAL_RATIO})")
    p.add_argument("--time-limit-s", type=float, default=480.0,
                   help="dump stacks and exit 1 if the run hangs past this (default 480)")
    p.add_argument("--simulate-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.time_limit_s, exit=True)
    report = Report(args.out / "gpu_check.json")
    has_cuda, reason = cuda_status()
    if args.install_cupy and has_cuda and importlib.util.find_spec("cupy") is None:
        print(f"[gpu_check] {install_cupy()}", flush=True)
    report.run("env", env_section, has_cuda, reason)
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as tmp:
        nvcc = report.run("nvcc", nvcc_section, device_arch() if has_cuda else "sm_90", args.out)
        if not has_cuda and not args.simulate_cpu:
            print(report.table())
            print(f"no CUDA device: nothing to check ({reason})", flush=True)
            report.write(message=f"no CUDA device: nothing to check ({reason})")
            return EXIT_FAILED if nvcc["status"] == "fail" else EXIT_NO_CUDA
        device = "cuda" if has_cuda else "cpu"
        cubin = Path(nvcc["cubin"]) if nvcc["status"] == "pass" else None
        report.run("kernels", kernels_section, device, cubin, args.quick)
        report.run("layouts", layouts_section, device, cubin, args.quick)
        report.run("runtime", runtime_section, device, Path(tmp))
        report.run("bandwidth", bandwidth_section, device, args.quick, args.min_ratio)
        report.run("copier", copier_section, device, args.quick, args.min_ratio)
    print(report.table(), flush=True)
    required = [s for name, s in report.sections.items() if name != "nvcc" or has_cuda]
    ok = all(s["status"] == "pass" for s in required)
    report.write(passed=ok, device=device)
    print(f"[gpu_check] {'PASS' if ok else 'FAIL'}: {report.path}", flush=True)
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
