"""GPU <-> pinned host copies in batches: native/kv_copy.c through ctypes, one native call per batch.

`CudaCopier.submit(dst_ptrs, src_ptrs, sizes, stream)` checks and merges the descriptors with NumPy
(kvtier.moving.copy_descriptors), hands them to the copier's native thread and returns a `CopyTicket` at
once; the thread enqueues them on `stream` with `cuMemcpyBatchAsync` (the CUDA 13 `_v2` signature or
the 12.8 one, whichever the driver has) or, where the driver has neither or `CopyMode.LOOP` asks,
with a C loop of `cuMemcpyAsync`, and records an event the ticket polls (`done`) or waits on (`wait`).
ctypes lets the GIL go during every native call.

The library is built by nvcc on first use into `~/.cache/kvtier/native/` (a file name carrying a
digest of the source, so an edited source is rebuilt), or ahead of time by `make -C native copy`;
either is passed as `library`. libcuda is opened at run time, so building needs only nvcc, and a
driver older than 12.8 still works (the loop). The path taken is logged once per copier and reported
by `describe()`; nothing falls back unannounced.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from kvtier.moving.copy_descriptors import Addresses, CopyDescriptors, check_descriptors, descriptors, merge_adjacent
from kvtier.errors import TransferError
from kvtier.moving.native import NativeError, find_nvcc

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "native" / "kv_copy.c"
DEFAULT_BUILD_DIR = Path.home() / ".cache" / "kvtier" / "native"
NVCC_FLAGS = ("-O2", "-shared", "-Xcompiler", "-fPIC,-Wall,-Wextra,-Werror", "-cudart", "none")
ABI_VERSION = 1

# kv_copy.c's own results (below zero); above zero is a CUresult.
_OK, _PENDING, _TIMEOUT = 0, -1, -2
_NATIVE_ERRORS = {-3: "invalid argument", -4: "out of memory", -5: "copier closed", -6: "driver symbol missing",
                  -7: "driver library not found", -8: "thread start failed"}
_NO_INDEX = 2**64 - 1
STAT_NAMES = ("jobs", "descriptors", "bytes", "batch_calls", "loop_calls", "loop_jobs", "failed_jobs",
              "events_created")


class CopyLibraryError(NativeError):
    """native/kv_copy.c cannot be built (no nvcc, a compile error) or its library cannot be loaded."""


class CudaDriverError(NativeError):
    """The CUDA driver cannot be opened or initialised, or lacks what the copier needs."""


class CopyMode(enum.Enum):
    """How a copier may enqueue copies."""

    AUTO = 0   # the batch API where the driver has it, else the loop (logged)
    BATCH = 1  # the batch API, or CudaDriverError at creation
    LOOP = 2   # always the loop (e.g. where batched copies misbehave on registered host memory)


class CopyPath(enum.Enum):
    """How a copier does enqueue copies (kv_copy.c's KVC_PATH_*)."""

    BATCH_V2 = 0  # cuMemcpyBatchAsync_v2, CUDA 13 drivers
    BATCH_V1 = 1  # cuMemcpyBatchAsync with failIdx, CUDA 12.8+ drivers
    LOOP = 2      # cuMemcpyAsync per descriptor, in C


def compile_shared(source: Path, target: Path, defines: tuple[str, ...] = (), nvcc: Path | None = None,
                   timeout_s: float = 120.0) -> Path:
    """Compiles one C source into a shared library with nvcc (warnings are errors); atomic on `target`.

    Raises:
        CopyLibraryError: nvcc is missing, fails (stderr in the message) or times out.
    """
    compiler = nvcc or find_nvcc()
    if compiler is None:
        raise CopyLibraryError(f"nvcc not found (not on PATH nor at /usr/local/cuda/bin/nvcc): cannot build {source}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    cmd = [str(compiler), *NVCC_FLAGS, *(f"-D{d}" for d in defines), "-o", tmp, str(source), "-ldl", "-lpthread"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise CopyLibraryError(f"nvcc failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr.strip()}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise CopyLibraryError(f"nvcc timed out after {timeout_s} s: {' '.join(cmd)}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_library(build_dir: Path | str | None = None, nvcc: Path | None = None) -> Path:
    """native/kv_copy.c as a shared library in `build_dir`, compiled unless this source's build is there.

    Returns:
        The library's path, `libkv_copy-<digest of source and flags>.so`.

    Raises:
        CopyLibraryError: as `compile_shared`.
    """
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    target = Path(build_dir or DEFAULT_BUILD_DIR) / f"libkv_copy-{digest}.so"
    return target if target.is_file() else compile_shared(SOURCE, target, nvcc=nvcc)


@functools.lru_cache(maxsize=None)
def load_library(path: Path) -> ctypes.CDLL:
    """Loads a built kv_copy library and declares its functions.

    Raises:
        CopyLibraryError: it cannot be loaded or is not this ABI version.
    """
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise CopyLibraryError(f"cannot load {path}: {e}") from e
    u64, ptr, i64 = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64
    p_u64 = ctypes.POINTER(u64)
    signatures = {
        "kvc_version": ([], ctypes.c_int),
        "kvc_mover_create": ([ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ptr), ctypes.c_char_p,
                              ctypes.c_size_t], ctypes.c_int),
        "kvc_mover_path": ([ptr], ctypes.c_int),
        "kvc_mover_destroy": ([ptr], ctypes.c_int),
        "kvc_submit": ([ptr, ptr, ptr, ptr, ctypes.c_size_t, u64, u64, p_u64], ctypes.c_int),
        "kvc_ticket_query": ([ptr, u64, p_u64], ctypes.c_int),
        "kvc_ticket_wait": ([ptr, u64, i64, p_u64], ctypes.c_int),
        "kvc_ticket_stream_wait": ([ptr, u64, u64], ctypes.c_int),
        "kvc_ticket_release": ([ptr, u64], ctypes.c_int),
        "kvc_stats": ([ptr, p_u64, ctypes.c_int], ctypes.c_int),
        "kvc_error_name": ([ptr, ctypes.c_int], ctypes.c_char_p),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    if lib.kvc_version() != ABI_VERSION:
        raise CopyLibraryError(f"{path} is ABI version {lib.kvc_version()}, expected {ABI_VERSION}: rebuild it")
    return lib


def _handle(value, attribute: str, name: str) -> int:
    """A CUDA handle as an int: an int, or an object carrying it (torch.cuda.Stream.cuda_stream,
    torch.cuda.Event.cuda_event)."""
    raw = getattr(value, attribute, value)
    if isinstance(raw, bool) or not isinstance(raw, (int, np.integer)) or raw < 0:
        raise TypeError(f"{name} must be a CUDA handle (an int or an object with .{attribute}), got {value!r}")
    return int(raw)


class CopyTicket:
    """One submitted batch. Final once `done()` is True or a call raised; thread-safe."""

    def __init__(self, copier: CudaCopier, native: int, batch: CopyDescriptors) -> None:
        self._copier = copier
        self._native: int | None = native
        self._batch = batch
        self._error: TransferError | None = None
        self._lock = threading.Lock()
        self.num_descriptors = len(batch)
        self.num_bytes = batch.num_bytes

    def done(self) -> bool:
        """True once every copy finished; False while any is queued or running.

        Raises:
            TransferError: the batch failed (the driver's error and the descriptor in the message).
        """
        return self._settle(lambda native, index: self._copier._lib.kvc_ticket_query(
            self._copier._handle, native, index))

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks, without the GIL, until every copy finished.

        Raises:
            TimeoutError: not finished within timeout_s.
            TransferError: the batch failed.
        """
        timeout_us = -1 if timeout_s is None else max(0, int(timeout_s * 1e6))
        if not self._settle(lambda native, index: self._copier._lib.kvc_ticket_wait(
                self._copier._handle, native, timeout_us, index)):
            raise TimeoutError(f"copies of {self.num_descriptors} descriptors not done after {timeout_s} s")

    def stream_wait(self, stream) -> None:
        """Makes `stream` (a handle or torch.cuda.Stream) wait for these copies, without blocking the host
        beyond the native thread's enqueueing them. A no-op once done.

        Raises:
            TransferError: the driver refused.
        """
        handle = _handle(stream, "cuda_stream", "stream")
        with self._lock:
            if self._native is None:
                return
            rc = self._copier._lib.kvc_ticket_stream_wait(self._copier._handle, self._native, handle)
        if rc != _OK:
            raise TransferError(f"cuStreamWaitEvent on stream {handle:#x} failed: {self._copier._error_name(rc)}")

    def _settle(self, call) -> bool:
        with self._lock:
            if self._native is None:
                if self._error is not None:
                    raise self._error
                return True
            index = ctypes.c_uint64(_NO_INDEX)
            rc = call(self._native, ctypes.byref(index))
            if rc in (_PENDING, _TIMEOUT):
                return False
            self._release_locked()
            if rc != _OK:
                self._error = self._copier._failure(rc, index.value, self._batch)
                raise self._error
            return True

    def _release_locked(self) -> None:
        native, self._native = self._native, None
        if native is not None and self._copier._handle is not None:
            self._copier._lib.kvc_ticket_release(self._copier._handle, native)

    def __del__(self) -> None:
        if getattr(self, "_native", None) is not None:
            self._release_locked()


class CudaCopier:
    """Owns one native copy thread on one device's primary context; `close()` (or `with`) ends it."""

    def __init__(self, device_index: int = 0, mode: CopyMode = CopyMode.AUTO, *, library: Path | str | None = None,
                 driver: Path | str | None = None, alignment_bytes: int = 1, merge: bool = True) -> None:
        """Loads (building if needed) the library, opens the driver and starts the thread.

        Args:
            device_index: the CUDA device whose primary context (torch's) the copies run in.
            mode: which way to enqueue copies (see CopyMode).
            library: a built kv_copy library; default `build_library()`.
            driver: the CUDA driver library; default libcuda.so.1 (tests pass a stand-in).
            alignment_bytes: every address and size must be a multiple of this (1: any).
            merge: merge descriptors adjacent on both sides (see copy_descriptors.merge_adjacent).

        Raises:
            CopyLibraryError: the library cannot be built or loaded.
            CudaDriverError: the driver cannot be opened or initialised, or mode is BATCH and it has no
                batch API.
            ValueError: alignment_bytes is not positive.
        """
        if alignment_bytes < 1:
            raise ValueError(f"alignment_bytes must be positive, got {alignment_bytes}")
        self.library = Path(library) if library is not None else build_library()
        self._lib = load_library(self.library)
        self.mode, self.device_index, self.driver = mode, device_index, str(driver or "libcuda.so.1")
        self.alignment_bytes, self.merge = alignment_bytes, merge
        self._handle: int | None = self._create(mode, device_index)
        self.path = CopyPath(self._lib.kvc_mover_path(self._handle))
        self._tickets: weakref.WeakSet[CopyTicket] = weakref.WeakSet()
        self._tickets_lock = threading.Lock()
        level = logging.WARNING if mode is CopyMode.AUTO and self.path is CopyPath.LOOP else logging.INFO
        log.log(level, "kvtier copier on device %d: %s (%s)", device_index, self.path.name, self.reason)

    def _create(self, mode: CopyMode, device_index: int) -> int:
        handle, err = ctypes.c_void_p(), ctypes.create_string_buffer(512)
        driver = None if self.driver == "libcuda.so.1" else self.driver.encode()
        rc = self._lib.kvc_mover_create(driver, device_index, mode.value, ctypes.byref(handle), err, len(err))
        if rc != _OK:
            what = _NATIVE_ERRORS.get(rc, f"CUresult {rc}")
            raise CudaDriverError(f"CUDA copier on device {device_index} with {self.driver} ({mode.name}): "
                                  f"{err.value.decode(errors='replace') or what}")
        return handle.value

    @property
    def reason(self) -> str:
        """Why this path: what the driver offered and the mode asked."""
        if self.path is CopyPath.LOOP:
            return "CopyMode.LOOP asked for it" if self.mode is CopyMode.LOOP else \
                "the driver has no cuMemcpyBatchAsync (older than CUDA 12.8): a C loop of cuMemcpyAsync"
        name = "cuMemcpyBatchAsync_v2" if self.path is CopyPath.BATCH_V2 else "cuMemcpyBatchAsync (12.8 signature)"
        return f"the driver has {name}"

    def prepare(self, dst_ptrs: Addresses, src_ptrs: Addresses, sizes: Addresses | int) -> CopyDescriptors:
        """The descriptors `submit` would hand to the driver: checked, and merged if `merge`.

        Raises:
            TypeError, ValueError: as copy_descriptors.descriptors and check_descriptors.
        """
        batch = descriptors(dst_ptrs, src_ptrs, sizes)
        check_descriptors(batch, self.alignment_bytes)
        return merge_adjacent(batch) if self.merge else batch

    def submit(self, dst_ptrs: Addresses, src_ptrs: Addresses, sizes: Addresses | int, stream,
               after_event=None) -> CopyTicket:
        """Queues copies `dst_ptrs[i] <- src_ptrs[i]` of `sizes[i]` bytes on `stream`; returns at once.

        Args:
            dst_ptrs, src_ptrs: addresses (device, or pinned/registered host) as ints or a uint64 array.
            sizes: bytes per copy, or one int for all.
            stream: a CUDA stream handle or torch.cuda.Stream; 0 is the legacy default stream (the loop).
            after_event: an event handle or torch.cuda.Event the copies wait for (e.g. recorded after the
                kernels that write the source); it must not be recorded again until the ticket is done.

        Returns:
            The ticket. The memory must stay valid until it is done.

        Raises:
            TypeError, ValueError: bad descriptors (naming the field and index), stream or event.
            TransferError: the copier is closed or the native submit failed.
        """
        batch = self.prepare(dst_ptrs, src_ptrs, sizes)
        return self.submit_prepared(batch, stream, after_event)

    def submit_prepared(self, batch: CopyDescriptors, stream, after_event=None) -> CopyTicket:
        """`submit` for descriptors `prepare` returned (no second check or merge)."""
        stream_handle = _handle(stream, "cuda_stream", "stream")
        event_handle = 0 if after_event is None else _handle(after_event, "cuda_event", "after_event")
        if self._handle is None:
            raise TransferError("CUDA copier is closed")
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (batch.dst, batch.src, batch.sizes)]
        ticket = ctypes.c_uint64()
        rc = self._lib.kvc_submit(self._handle, *(a.ctypes.data for a in arrays), len(batch), stream_handle,
                                  event_handle, ctypes.byref(ticket))
        if rc != _OK:
            raise TransferError(f"CUDA copier: submit of {len(batch)} descriptors failed: {self._error_name(rc)}")
        made = CopyTicket(self, ticket.value, batch)
        with self._tickets_lock:
            self._tickets.add(made)
        return made

    def stats(self) -> dict[str, int]:
        """Counters since start: jobs, descriptors, bytes, batch_calls, loop_calls, loop_jobs, failed_jobs,
        events_created."""
        if self._handle is None:
            return dict(self._final_stats)
        out = (ctypes.c_uint64 * len(STAT_NAMES))()
        n = self._lib.kvc_stats(self._handle, out, len(STAT_NAMES))
        return {name: int(out[i]) for i, name in enumerate(STAT_NAMES[:n])}

    def describe(self) -> dict[str, object]:
        """What this copier is: path and why, mode, device, driver, library, checks and counters."""
        return {"path": self.path.name, "reason": self.reason, "mode": self.mode.name,
                "device_index": self.device_index, "driver": self.driver, "library": str(self.library),
                "alignment_bytes": self.alignment_bytes, "merge": self.merge, "closed": self._handle is None,
                **self.stats()}

    def close(self) -> None:
        """Waits for every outstanding ticket, then stops the thread. Idempotent."""
        if self._handle is None:
            return
        with self._tickets_lock:
            live = list(self._tickets)
        for ticket in live:
            try:
                ticket.wait()
            except TransferError:
                pass  # already reported to whoever holds the ticket; closing must still finish
        self._final_stats = self.stats()
        handle, self._handle = self._handle, None
        self._lib.kvc_mover_destroy(handle)

    def __del__(self) -> None:
        # Unclosed and unreferenced: no ticket is alive (each holds its copier), so nothing waits on the thread.
        handle = getattr(self, "_handle", None)
        if handle is not None:
            self._handle = None
            self._lib.kvc_mover_destroy(handle)

    def __enter__(self) -> CudaCopier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error_name(self, rc: int) -> str:
        if rc < 0:
            return _NATIVE_ERRORS.get(rc, f"kv_copy error {rc}")
        name = self._lib.kvc_error_name(self._handle, rc) if self._handle is not None else None
        return f"{name.decode()} ({rc})" if name else f"CUresult {rc}"

    def _failure(self, rc: int, index: int, batch: CopyDescriptors) -> TransferError:
        where = ""
        if index != _NO_INDEX and index < len(batch):
            where = (f" at descriptor {index} (dst {int(batch.dst[index]):#x}, src {int(batch.src[index]):#x}, "
                     f"{int(batch.sizes[index])} bytes)")
        return TransferError(f"CUDA copy of {len(batch)} descriptors via {self.path.name} failed{where}: "
                             f"{self._error_name(rc)}")
