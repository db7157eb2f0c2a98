"""A host-memory stand-in for libcuda (native/fake_cuda.c), so kv_copy.c's copier runs without a GPU.

It proves the copier's queueing, tickets, path choice and error reporting; nothing about a GPU.
Each `DriverVariant` is the stand-in built with the batch entry points a driver generation exports.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
from pathlib import Path

from kvtier.moving.cuda_copy import DEFAULT_BUILD_DIR, NVCC_FLAGS, compile_shared

SOURCE = Path(__file__).resolve().parents[2] / "native" / "fake_cuda.c"
COUNTER_NAMES = ("batch_v1", "batch_v2", "memcpy", "stream_wait", "last_wait_event", "events_created",
                 "events_destroyed", "context_refs", "last_stream", "bytes")


class DriverVariant(enum.Enum):
    """Which batch entry points the stand-in exports (the -D flags of native/fake_cuda.c)."""

    CUDA13 = ("FAKE_BATCH_V2", "FAKE_BATCH_V1")  # cuMemcpyBatchAsync_v2 and the 12.8 one
    CUDA12_8 = ("FAKE_BATCH_V1",)                # cuMemcpyBatchAsync with failIdx only
    OLD = ()                                     # neither: a driver before 12.8


class FailKind(enum.IntEnum):
    BATCH = 0   # the next batch call fails
    MEMCPY = 1  # the index-th next cuMemcpyAsync fails


@functools.lru_cache(maxsize=None)
def build_fake_driver(variant: DriverVariant, build_dir: Path = DEFAULT_BUILD_DIR) -> Path:
    """The stand-in for `variant`, built by nvcc unless this source's build is there.

    Raises:
        CopyLibraryError: nvcc is missing or fails.
    """
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((*NVCC_FLAGS, *variant.value)).encode()).hexdigest()[:16]
    target = Path(build_dir) / f"libfake_cuda-{variant.name.lower()}-{digest}.so"
    return target if target.is_file() else compile_shared(SOURCE, target, defines=variant.value)


class FakeDriver:
    """Controls of one loaded stand-in: pause/resume its queue, inject a failure, read its counters."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # the same handle the copier's dlopen gets: one state
        self._lib.fake_cuda_fail_next.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
        self._lib.fake_cuda_counts.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)

    def pause(self) -> None:
        """Copies and event records queue up until `resume`."""
        self._lib.fake_cuda_pause()

    def resume(self) -> None:
        self._lib.fake_cuda_resume()

    def fail_next(self, kind: FailKind, code: int, index: int = 0) -> None:
        """The next batch call (reporting `index` as failIdx), or the index-th next cuMemcpyAsync, returns `code`."""
        self._lib.fake_cuda_fail_next(int(kind), code, index)

    def counts(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(COUNTER_NAMES))()
        n = self._lib.fake_cuda_counts(out, len(COUNTER_NAMES))
        return {name: int(out[i]) for i, name in enumerate(COUNTER_NAMES[:n])}
