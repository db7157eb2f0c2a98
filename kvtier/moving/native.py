"""Gather/scatter between an engine's paged KV tensors and kvtier's contiguous, layer-major blocks.

An engine keeps one tensor per layer, paged by engine block. `kv_dim` says which dimension indexes
the blocks: `[2, num_engine_blocks, ...]` (`kv_dim=0`, K/V first), `[num_engine_blocks, 2, ...]`
(`kv_dim=1`) or `[num_engine_blocks, ...]` (`kv_dim=None`: an MLA latent, or any *block-major view*,
e.g. vLLM's `[B, H, N, C]` page views permuted so that dim 0 is the block). What one engine block holds
for one layer is the rest of the tensor (for kv_dim 0, its K part then its V part), in row-major
order: that is the order its bytes take in a kvtier block. Those bytes need not be contiguous in
the engine: after merging dimensions that are contiguous with each other, a block's bytes must be
*runs* of contiguous bytes at most `MAX_RUN_DIMS` strided dimensions deep (e.g. vLLM's LHBNC layout,
where each KV head of a block is its own run, `num_engine_blocks` pages apart). `PagedLayer` holds
that geometry. Gathering copies the blocks named by a block table into rows of a
`[num_blocks, block_bytes]` uint8 tensor, layer `l` at `layout.layer_range(l)`; scattering is the
reverse.

Two ways to move the bytes, checked against the same slow reference (`gather_reference`):
  * `Kernels.CUDA`: the kernels of `native/kv_blocks.cu`, compiled by NVRTC through cupy (imported
    lazily) and launched on torch's current stream. One launch covers every layer.
  * `Kernels.TORCH`: `index_select` / `index_copy_` on uint8 views. Works on any device; on a GPU
    where cupy is not installed this is the path taken (`backend_for` says which one applies).
`nvcc_compile` builds the same source ahead of time (cubin, PTX or fatbin), e.g. for a loader
outside Python; `native/Makefile` does the same from a shell.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import math
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier.errors import GeometryError, KVTierError
from kvtier.model.layout import BlockLayout

KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "native" / "kv_blocks.cu"
KERNEL_NAMES = ("gather_layer", "scatter_layer", "gather_layers", "scatter_layers")
THREADS_PER_CTA = 256
# A page larger than this is split across grid.y so that one big page still uses many SMs.
CHUNK_BYTES = 16 * 1024
# How many strided dimensions of runs a block's bytes may span (the kernels' `counts`/`strides`).
MAX_RUN_DIMS = 3
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1

BlockIds = Sequence[int] | torch.Tensor


class NativeError(KVTierError, RuntimeError):
    """nvcc or cupy is missing, or the kernels failed to compile."""


class Kernels(enum.Enum):
    """How the bytes move: torch indexing ops (any device) or the kv_blocks.cu kernels (CUDA + cupy)."""

    TORCH = "torch"
    CUDA = "cuda"


class NvccOutput(enum.Enum):
    """What `nvcc_compile` builds."""

    CUBIN = "cubin"
    PTX = "ptx"
    FATBIN = "fatbin"  # sm_80 and `arch` machine code plus `arch` PTX for newer GPUs


def find_nvcc() -> Path | None:
    """Returns nvcc from PATH, else /usr/local/cuda/bin/nvcc if present, else None."""
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.is_file() else None


def nvcc_compile(out_dir: Path | str, arch: str = "sm_90", output: NvccOutput = NvccOutput.CUBIN,
                 nvcc: Path | str | None = None, timeout_s: float = 300.0) -> Path:
    """Compiles native/kv_blocks.cu with nvcc -O3, warnings as errors.

    Args:
        out_dir: directory for the output; created if missing.
        arch: GPU architecture, `sm_<NN>` (e.g. sm_90 for H100/H200, sm_80 for A100).
        output: what to build; PTX is emitted for `compute_<NN>`.
        nvcc: the compiler; default `find_nvcc()`.
        timeout_s: how long nvcc may run.

    Returns:
        The path of the output, `out_dir/kv_blocks.<arch>.<output>`.

    Raises:
        ValueError: arch is not of the form sm_<NN>.
        NativeError: nvcc is missing, fails (its stderr is in the message) or times out.
    """
    match = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if match is None:
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    compiler = Path(nvcc) if nvcc is not None else find_nvcc()
    if compiler is None or not compiler.is_file():
        raise NativeError("nvcc not found (not on PATH nor at /usr/local/cuda/bin/nvcc); install the CUDA toolkit")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"kv_blocks.{arch}.{output.value}"
    # Warnings are errors, except an architecture a newer toolkit calls deprecated (sm_80 some day).
    cmd = [str(compiler), "-O3", "-Werror", "all-warnings", "-Wno-deprecated-gpu-targets", *_nvcc_target_flags(match.group(1), output),
           "-o", str(target), str(KERNEL_SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise NativeError(f"nvcc timed out after {timeout_s} s: {' '.join(cmd)}") from e
    if done.returncode != 0:
        raise NativeError(f"nvcc failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr.strip()}")
    return target


def _nvcc_target_flags(sm: str, output: NvccOutput) -> list[str]:
    if output is NvccOutput.CUBIN:
        return [f"-arch=sm_{sm}", "--cubin"]
    if output is NvccOutput.PTX:
        return [f"-arch=compute_{sm}", "--ptx"]
    codes = dict.fromkeys(["80", sm])  # ordered, no duplicate when sm is 80
    gencode = [f"-gencode=arch=compute_{c},code=sm_{c}" for c in codes]
    return ["--fatbin", *gencode, f"-gencode=arch=compute_{sm},code=compute_{sm}"]


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """Where one engine block's bytes of one layer sit: strided runs of contiguous bytes; in bytes.

    Run `(i0, i1, i2)` of engine block `b` starts at
    `b * block_stride_bytes + i0 * strides[0] + i1 * strides[1] + i2 * strides[2]` from the tensor's
    first byte; a kvtier block holds the runs in that (row-major) order, `run_bytes` each.

    Attributes:
        num_engine_blocks: engine blocks the tensor holds.
        block_stride_bytes: bytes between consecutive engine blocks.
        run_bytes: bytes of one contiguous run.
        counts: runs along each strided dimension, outermost first (1 where unused).
        strides: bytes between consecutive runs along each dimension (0 where unused).
    """

    num_engine_blocks: int
    block_stride_bytes: int
    run_bytes: int
    counts: tuple[int, ...] = (1,) * 3
    strides: tuple[int, ...] = (0,) * 3

    @property
    def num_runs(self) -> int:
        return math.prod(self.counts)

    @property
    def page_bytes(self) -> int:
        """Bytes of one engine block of this layer (all its runs)."""
        return self.num_runs * self.run_bytes

    @classmethod
    def of(cls, kv: torch.Tensor, kv_dim: int | None) -> PagedLayer:
        """Reads the geometry of `kv` from its shape and strides.

        Args:
            kv: one layer's paged KV tensor.
            kv_dim: 0 for `[2, blocks, ...]`, 1 for `[blocks, 2, ...]`, None for `[blocks, ...]`.

        Raises:
            GeometryError: kv_dim is not 0, 1 or None, the tensor has no dimensions past the block's,
                its last dimension is not contiguous, or a block's bytes are more than `MAX_RUN_DIMS`
                strided dimensions of runs.
        """
        view = block_view(kv, kv_dim)
        size = kv.element_size()
        shape, strides = view.shape[1:], view.stride()[1:]
        if (shape[-1] != 1 and strides[-1] != 1) or any(n > 1 and s == 0 for n, s in zip(shape, strides)):
            raise GeometryError(f"a block's last dimension must be contiguous and no dimension may repeat "
                                f"elements: shape {tuple(kv.shape)}, strides {kv.stride()}, kv_dim={kv_dim}")
        # the bytes of one element are the innermost dimension, so the runs come out in bytes
        dims = _merge_dims([(n, s * size) for n, s in zip(shape, strides)] + [(size, 1)])
        run_bytes = dims[-1][0]
        outer = dims[:-1]
        if len(outer) > MAX_RUN_DIMS:
            raise GeometryError(f"a block's bytes must be contiguous runs at most {MAX_RUN_DIMS} strided dimensions "
                                f"deep; shape {tuple(kv.shape)}, strides {kv.stride()} (kv_dim={kv_dim}) needs "
                                f"{len(outer)}")
        padding = MAX_RUN_DIMS - len(outer)
        return cls(num_engine_blocks=view.shape[0], block_stride_bytes=view.stride(0) * size, run_bytes=run_bytes,
                   counts=(1,) * padding + tuple(n for n, _ in outer),
                   strides=(0,) * padding + tuple(s for _, s in outer))


def block_view(kv: torch.Tensor, kv_dim: int | None) -> torch.Tensor:
    """`kv` as `[num_engine_blocks, ...]`: dim 0 the block, the rest one block's data in stored order.

    Raises:
        GeometryError: kv_dim is not 0, 1 or None, or `kv` has no dimensions past the block's.
    """
    if kv_dim not in (0, 1, None):
        raise GeometryError(f"kv_dim must be 0, 1 or None, got {kv_dim!r}")
    head = 1 if kv_dim is None else 2  # leading dims that index a block's parts
    if kv.ndim <= head:
        raise GeometryError(f"a paged KV tensor with kv_dim={kv_dim} needs more than {head} dims, "
                            f"got shape {tuple(kv.shape)}")
    return kv.transpose(0, 1) if kv_dim == 0 else kv


def _merge_dims(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(size, byte stride) per dimension, outermost first, with size-1 dimensions dropped and each one
    merged into the next inner one where they are contiguous with each other (stride = inner extent)."""
    merged: list[tuple[int, int]] = []
    for size, stride in reversed(dims):
        if size == 1:
            continue
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1] = (size * merged[-1][0], merged[-1][1])
        else:
            merged.append((size, stride))
    return list(reversed(merged))


@dataclass(frozen=True)
class _Plan:
    """A validated transfer: (block-major view, geometry, layer offset) per layer, ids and rows on the device."""

    layers: list[tuple[torch.Tensor, PagedLayer, int]]
    block_ids: torch.Tensor
    slots: torch.Tensor | None
    blocks: torch.Tensor


def _plan(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, blocks: torch.Tensor, layout: BlockLayout,
          kv_dim: int | None, slots: BlockIds | None, layers: Sequence[int] | None,
          unique_ids: bool) -> _Plan:
    layer_indices = list(range(layout.num_layers)) if layers is None else [int(x) for x in layers]
    if len(layer_indices) != len(layer_kv):
        raise GeometryError(f"{len(layer_kv)} layer tensors for {len(layer_indices)} layers")
    if len(set(layer_indices)) != len(layer_indices):
        raise ValueError(f"layers repeat: {layer_indices}")
    if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] != layout.block_bytes \
            or blocks.stride(1) != 1:
        raise GeometryError(f"blocks must be a row-contiguous uint8 [num_blocks, {layout.block_bytes}] "
                            f"tensor, got {blocks.dtype} {tuple(blocks.shape)} strides {blocks.stride()}")
    device = blocks.device
    planned = []
    for kv, layer in zip(layer_kv, layer_indices):
        if kv.device != device:
            raise ValueError(f"layer {layer} is on {kv.device} but the blocks are on {device}")
        geometry = PagedLayer.of(kv, kv_dim)
        offset, length = layout.layer_range(layer)
        if geometry.page_bytes != length:
            raise GeometryError(f"layer {layer}: an engine block holds {geometry.page_bytes} bytes of it, which "
                                f"do not fill its {length} bytes in the block layout")
        planned.append((block_view(kv, kv_dim), geometry, offset))
    limit = min((g.num_engine_blocks for _, g, _ in planned), default=0)
    ids = _index_tensor(block_ids, limit, "block_ids", device, unique=unique_ids)
    rows = None if slots is None else _index_tensor(slots, blocks.shape[0], "slots", device, unique=True)
    if rows is None and blocks.shape[0] != ids.numel():
        raise GeometryError(f"{ids.numel()} block ids for {blocks.shape[0]} kvtier blocks; "
                            "pass slots to use some rows only")
    if rows is not None and rows.numel() != ids.numel():
        raise GeometryError(f"{ids.numel()} block ids but {rows.numel()} slots")
    return _Plan(planned, ids, rows, blocks)


def _index_tensor(values: BlockIds, limit: int, name: str, device: torch.device, unique: bool) -> torch.Tensor:
    ids = torch.as_tensor(values, dtype=torch.int64)
    if ids.ndim != 1:
        raise GeometryError(f"{name} must be one-dimensional, got shape {tuple(ids.shape)}")
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())  # one device sync when the ids live on a GPU
        if low < 0 or high >= limit:
            raise IndexError(f"{name} must lie in [0, {limit}), got values from {low} to {high}")
        if unique and torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{name} repeat an id; two copies would race for one destination")
    return ids.to(device)


def backend_for(device: torch.device) -> Kernels:
    """The backend `gather_blocks` picks by default: CUDA for CUDA tensors when cupy is installed."""
    if device.type == "cuda" and importlib.util.find_spec("cupy") is not None:
        return Kernels.CUDA
    return Kernels.TORCH


def gather_blocks(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, out: torch.Tensor,
                  layout: BlockLayout, kv_dim: int | None, *, slots: BlockIds | None = None,
                  layers: Sequence[int] | None = None, backend: Kernels | None = None) -> None:
    """Copies the pages of engine blocks `block_ids` into kvtier blocks, asynchronously on CUDA.

    Args:
        layer_kv: one paged KV tensor per layer, all on `out`'s device.
        block_ids: engine block ids, one per kvtier block; may repeat and come in any order.
        out: uint8 `[num_blocks, layout.block_bytes]`, rows contiguous. Row i receives block_ids[i]
            unless `slots` is given.
        layout: the byte layout of one kvtier block.
        kv_dim: 0 for `[2, blocks, ...]`, 1 for `[blocks, 2, ...]`, None for `[blocks, ...]` (MLA, or any
            block-major view; see the module docstring).
        slots: rows of `out` to write, one per block id (distinct), e.g. slots of a tier's slab.
        layers: the layout layer of each tensor in `layer_kv` (for a layer-wise save); default all.
        backend: force a backend; default `backend_for(out.device)`.

    Raises:
        GeometryError: a tensor's shape, strides or page size disagree with `layout` or `kv_dim`.
        IndexError: a block id or slot is out of range.
        ValueError: slots or layers repeat, tensors span devices, or Kernels.CUDA on a non-CUDA tensor.
        NativeError: Kernels.CUDA without a usable cupy.
    """
    plan = _plan(layer_kv, block_ids, out, layout, kv_dim, slots, layers, unique_ids=False)
    _run(plan, to_engine=False, backend=backend)


def scatter_blocks(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, blocks: torch.Tensor,
                   layout: BlockLayout, kv_dim: int | None, *, slots: BlockIds | None = None,
                   layers: Sequence[int] | None = None, backend: Kernels | None = None) -> None:
    """Copies kvtier blocks back into the pages of engine blocks `block_ids`; the reverse of gather.

    Args:
        layer_kv: one paged KV tensor per layer, written in place.
        block_ids: destination engine block ids, distinct, any order.
        blocks: uint8 `[num_blocks, layout.block_bytes]`; row i (or row slots[i]) goes to block_ids[i].
        layout, kv_dim, slots, layers, backend: as for `gather_blocks`.

    Raises:
        ValueError: block_ids repeat (the copies would race); otherwise as `gather_blocks`.
        GeometryError, IndexError, NativeError: as `gather_blocks`.
    """
    plan = _plan(layer_kv, block_ids, blocks, layout, kv_dim, slots, layers, unique_ids=True)
    _run(plan, to_engine=True, backend=backend)


def _run(plan: _Plan, to_engine: bool, backend: Kernels | None) -> None:
    device = plan.blocks.device
    chosen = backend_for(device) if backend is None else backend
    if chosen is Kernels.CUDA and device.type != "cuda":
        raise ValueError(f"Kernels.CUDA needs CUDA tensors, got {device}")
    if plan.block_ids.numel() == 0:
        return
    if chosen is Kernels.CUDA:
        _launch_cupy(_kernel_calls(plan, to_engine), device)
        return
    for view, geometry, offset in plan.layers:
        rows = plan.blocks[:, offset:offset + geometry.page_bytes]
        if to_engine:
            _torch_scatter_layer(view, plan.block_ids, rows, plan.slots)
        else:
            _torch_gather_layer(view, plan.block_ids, rows, plan.slots)


def _byte_view(view: torch.Tensor) -> torch.Tensor:
    """A block-major view as uint8, one byte per element of its last dimension times the element size."""
    if view.shape[-1] == 1 and view.stride(-1) != 1:  # a size-1 dim may carry any stride; view() refuses it
        view = view.as_strided(view.shape, (*view.stride()[:-1], 1))
    return view.view(torch.uint8)


def _torch_gather_layer(view: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                        slots: torch.Tensor | None) -> None:
    if not (view.is_cuda or rows.is_cuda):  # host memory: NumPy's copies (see `_host_gather_layer`)
        return _host_gather_layer(_byte_view(view).numpy(), ids.numpy(), rows.numpy(),
                                  None if slots is None else slots.numpy())
    pages = _byte_view(view).index_select(0, ids).reshape(ids.numel(), -1)  # row-major: the stored order
    if slots is None:
        rows.copy_(pages)
    else:
        rows.index_copy_(0, slots, pages)


def _torch_scatter_layer(view: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                         slots: torch.Tensor | None) -> None:
    raw = _byte_view(view)
    if not (raw.is_cuda or rows.is_cuda):
        source = rows.numpy() if slots is None else rows.numpy()[slots.numpy()]
        raw.numpy()[ids.numpy()] = source.reshape(ids.numel(), *raw.shape[1:])
        return
    source = rows if slots is None else rows.index_select(0, slots)
    raw.index_copy_(0, ids, source.reshape(ids.numel(), *raw.shape[1:]))


def _host_gather_layer(pages: np.ndarray, ids: np.ndarray, rows: np.ndarray, slots: np.ndarray | None) -> None:
    """`_torch_gather_layer` on host memory. Torch's `index_select` and `copy_` run on its intra-op
    threads, which a CPU engine keeps busy with its own compute (or binds to one core): 20 MiB of a
    vLLM step's blocks took 4.5 ms with one torch thread and 15 ms with two on a loaded 2-core
    host, against 2.7-3.0 ms for NumPy's single-threaded copies."""
    gathered = pages[ids].reshape(len(ids), -1)  # row-major: the stored order
    if slots is None:
        rows[...] = gathered
    else:
        rows[slots] = gathered


@dataclass(frozen=True)
class KernelCall:
    """One launch of a kv_blocks.cu kernel: what `Kernels.CUDA` hands to cupy.

    Attributes:
        name: the kernel, one of KERNEL_NAMES.
        grid, block: launch shape.
        args: the kernel's arguments as numpy scalars (pointers as np.uint64).
        keep_alive: tensors that args point into, to hold until the launch is enqueued.
    """

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[np.generic, ...]
    keep_alive: tuple[torch.Tensor, ...]


def kernel_calls(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, blocks: torch.Tensor,
                 layout: BlockLayout, kv_dim: int | None, *, to_engine: bool, slots: BlockIds | None = None,
                 layers: Sequence[int] | None = None) -> list[KernelCall]:
    """The launches `Kernels.CUDA` makes for a gather (or, with `to_engine`, a scatter); launches nothing.

    Exposed so the kernels can run under another launcher; the tests run them on the CPU this way.
    Args and Raises are those of `gather_blocks` / `scatter_blocks`; the tensors may be on any device.
    """
    plan = _plan(layer_kv, block_ids, blocks, layout, kv_dim, slots, layers, unique_ids=to_engine)
    return _kernel_calls(plan, to_engine) if plan.block_ids.numel() else []


def _kernel_calls(plan: _Plan, to_engine: bool) -> list[KernelCall]:
    """One batched launch for all layers, or one launch per layer if their run counts differ."""
    prefix = "scatter" if to_engine else "gather"
    num_blocks = plan.block_ids.numel()
    offsets = None if plan.slots is None else plan.slots * plan.blocks.stride(0)
    keep = (plan.block_ids, plan.blocks) + (() if offsets is None else (offsets,))

    def destination_args(blocks_ptr: int) -> tuple[np.generic, ...]:
        return (np.uint64(plan.block_ids.data_ptr()), np.int64(num_blocks), np.uint64(blocks_ptr),
                np.uint64(0 if offsets is None else offsets.data_ptr()), np.int64(plan.blocks.stride(0)))

    run_counts = {g.num_runs for _, g, _ in plan.layers}
    if len(plan.layers) > 1 and len(run_counts) == 1 and len(plan.layers) <= _MAX_GRID_YZ:
        (num_runs,) = run_counts
        table = torch.tensor([[kv.data_ptr(), *_geometry_fields(g), offset] for kv, g, offset in plan.layers],
                             dtype=torch.int64).to(plan.blocks.device)
        grid = _grid(num_blocks, num_runs, max(g.run_bytes for _, g, _ in plan.layers), len(plan.layers))
        args = (np.uint64(table.data_ptr()), *destination_args(plan.blocks.data_ptr()))
        return [KernelCall(f"{prefix}_layers", grid, (THREADS_PER_CTA, 1, 1), args, keep + (table,))]
    calls = []
    for kv, g, offset in plan.layers:
        args = (np.uint64(kv.data_ptr()), *(np.int64(f) for f in _geometry_fields(g)),
                *destination_args(plan.blocks.data_ptr() + offset))
        grid = _grid(num_blocks, g.num_runs, g.run_bytes, 1)
        calls.append(KernelCall(f"{prefix}_layer", grid, (THREADS_PER_CTA, 1, 1), args, keep + (kv,)))
    return calls


def _geometry_fields(g: PagedLayer) -> tuple[int, ...]:
    """A layer's geometry in the kernels' argument order (see LAYER_* in kv_blocks.cu)."""
    return (g.block_stride_bytes, g.run_bytes, *(x for pair in zip(g.counts, g.strides) for x in pair))


def _grid(num_blocks: int, num_runs: int, run_bytes: int, num_layers: int) -> tuple[int, int, int]:
    pairs = num_blocks * num_runs
    if pairs > _MAX_GRID_X:
        raise ValueError(f"{num_blocks} blocks x {num_runs} runs exceed one launch; split the transfer")
    chunks = min(max(1, -(-run_bytes // CHUNK_BYTES)), _MAX_GRID_YZ)
    return pairs, chunks, num_layers


def _import_cupy():
    try:
        import cupy
    except ImportError as e:
        raise NativeError("Kernels.CUDA needs cupy (pip install 'kvtier[gpu]'); "
                          "without it use Kernels.TORCH") from e
    return cupy


# Compiled modules are cached per device: NVRTC takes ~1 s, and the module is immutable.
@functools.lru_cache(maxsize=None)
def _cupy_module(device_index: int):
    cupy = _import_cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++17",))
        for name in KERNEL_NAMES:  # compile now, so a build error surfaces here and names the source
            module.get_function(name)
    return module


def _launch_cupy(calls: list[KernelCall], device: torch.device) -> None:
    cupy = _import_cupy()
    from cupy.cuda.compiler import CompileException

    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        module = _cupy_module(index)
    except CompileException as e:
        raise NativeError(f"NVRTC failed to compile {KERNEL_SOURCE}: {e}") from e
    with cupy.cuda.Device(index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
        with stream:
            for call in calls:
                module.get_function(call.name)(call.grid, call.block, call.args)


def _reference_pages(layer_kv, block_ids, layout, kv_dim, slots, layers):
    """Yields (row, byte offset in the row, page view) for every page (a block's part) a transfer moves."""
    ids = [int(b) for b in block_ids]
    rows = list(range(len(ids))) if slots is None else [int(s) for s in slots]
    for kv, layer in zip(layer_kv, range(len(layer_kv)) if layers is None else layers):
        offset, _ = layout.layer_range(layer)
        for row, block in zip(rows, ids):
            parts = [kv[block]] if kv_dim is None else [
                kv[part, block] if kv_dim == 0 else kv[block, part] for part in range(kv.shape[kv_dim])]
            start = offset
            for page in parts:
                yield row, start, page
                start += page.numel() * page.element_size()


def gather_reference(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, out: torch.Tensor,
                     layout: BlockLayout, kv_dim: int | None, *, slots: BlockIds | None = None,
                     layers: Sequence[int] | None = None) -> None:
    """`gather_blocks` written as plainly as possible, one page at a time, for tests; no validation.

    Args:
        layer_kv, block_ids, out, layout, kv_dim, slots, layers: as for `gather_blocks`.
    """
    for row, start, page in _reference_pages(layer_kv, block_ids, layout, kv_dim, slots, layers):
        data = page.contiguous().reshape(-1).view(torch.uint8)
        out[row, start:start + data.numel()] = data


def scatter_reference(layer_kv: Sequence[torch.Tensor], block_ids: BlockIds, blocks: torch.Tensor,
                      layout: BlockLayout, kv_dim: int | None, *, slots: BlockIds | None = None,
                      layers: Sequence[int] | None = None) -> None:
    """`scatter_blocks` written as plainly as possible, one page at a time, for tests; no validation.

    Args:
        layer_kv, block_ids, blocks, layout, kv_dim, slots, layers: as for `scatter_blocks`.
    """
    for row, start, page in _reference_pages(layer_kv, block_ids, layout, kv_dim, slots, layers):
        data = blocks[row, start:start + page.numel() * page.element_size()].clone()
        page.copy_(data.view(page.dtype).reshape(page.shape))
