"""`MooncakeClient`: keyed blocks in Mooncake Store, each checked on read.

Facts of `mooncake-transfer-engine-non-cuda==0.3.13.post1` this module relies on (checked against a
real `mooncake_master` in tests/pool/test_pool_mooncake.py and test_pool_mooncake_shared.py):
- `batch_put_from` on a key that exists returns 0 and *keeps the old value*; `batch_upsert_from`
  replaces it (a different size too). A private, mutable block is upserted; a shared one is put
  (`replace=False`), see `kvtier.pool.mooncake.tier`.
- `batch_get_into` returns, per key, the object's size, -704 (OBJECT_NOT_FOUND) for a missing key,
  -600 for a buffer smaller than the object, -900 (RPC_FAIL) when the master is gone, -800
  (TRANSFER_FAIL) when the segment holding the object belongs to a process that died.
- An object lives in the segment of whichever client the master placed it in (`random` by
  default: any client's `segment_bytes`), not with the client that put it. A client that closes
  (or exits through `close()`) unmounts its segment and every object in it is gone at once (a
  get is -704, `batch_is_exist` 0). A client killed stays mounted until the master's
  `--client_ttl` (10 s) lapses: its objects still exist, their gets are -800; then they are gone.
  Either way a reader gets a miss or a failure, never bytes of another object.
- `setup()` without a reachable master blocks for about 90 s, holding the GIL (so a thread with a
  deadline cannot bound it); `close()` after the master died takes about 10 s. Hence a TCP probe of
  the master and an HTTP probe of the metadata server, each with a timeout, before `setup()`.

Why a staging region: Mooncake moves bytes zero-copy only from and to memory registered with
`register_buffer`, and registering each caller's buffer per call costs more than a memcpy. So each
client registers one staging region once; a put copies the blocks in, appends each block's xxh3-64
(an 8-byte trailer, verified on every read: a mismatch is a miss), and puts them straight from
there; a get lands in it and is copied out after the check. Calls of one client are serialised on
that region.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError, TransferError
from kvtier.pool.buffers import block_checksum, byte_view
from kvtier.units import parse_address

log = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
TRAILER_BYTES = 8
_ALIGN = 64


class Outcome(enum.Enum):
    """What a get of one key came to. Only HIT leaves valid bytes in the buffer."""

    HIT = "hit"
    MISS = "miss"  # no such key, or its bytes failed their checksum
    FAILED = "failed"  # the transfer or the master call failed: counted as an error


def probe(address: str, timeout_s: float, what: str) -> str:
    """Connects once to `address` (HOST:PORT); returns the local IP that reaches it.

    Raises:
        TransferError: naming `what` and the address, when nothing accepts there within `timeout_s`.
    """
    host, port = parse_address(address, what)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            return sock.getsockname()[0]
    except OSError as e:
        raise TransferError(f"{what} {address}: not reachable ({e}); is mooncake_master running there?") from None


def _metadata_address(url: str) -> str:
    """HOST:PORT of an http:// metadata server URL."""
    if not url.startswith("http://"):
        raise ConfigError(f"mooncake metadata_server: expected http://HOST:PORT/metadata, got {url!r}")
    return url[len("http://"):].split("/", 1)[0]


class MooncakeClient:
    """Keyed blocks in Mooncake Store, the same calls as `PoolClient`. Thread-safe.

    Args:
        master: HOST:PORT of `mooncake_master`'s RPC port.
        metadata_server: http://HOST:PORT/metadata (the master's `--enable_http_metadata_server`).
        segment_bytes: memory this process lends to the store (its objects may land there).
        staging_bytes: the registered region every call goes through; bounds bytes per batch.
        local_hostname: HOST[:PORT] this client's transfer engine serves on; None picks the local
            IP that reaches the master. Without a port the engine binds one itself (nothing here
            checks a port free and binds it later, which another process could take between).
        tenant: prefixes every key, so tenants never see each other's blocks.
        setup_timeout_s: the longest each probe of the master and metadata server may take. A
            master that is absent fails at once; a port that accepts but never answers RPC still
            costs Mooncake's own RPC timeout (about 30 s).
    Raises:
        TransferError: the master or metadata server is not reachable, or `setup()` failed or timed out.
        ConfigError: a malformed address, or the mooncake package is missing.
    """

    def __init__(self, master: str, metadata_server: str, *, segment_bytes: int = 64 << 20,
                 staging_bytes: int = 64 << 20, local_hostname: str | None = None, tenant: str = "default",
                 setup_timeout_s: float = 10.0) -> None:
        self.master, self.metadata_server, self.tenant = master, metadata_server, tenant
        self._prefix = f"kvtier/{tenant}/"
        local_ip = probe(master, setup_timeout_s, "mooncake master")
        probe(_metadata_address(metadata_server), setup_timeout_s, "mooncake metadata server")
        _probe_metadata(metadata_server, setup_timeout_s)
        self.local_hostname = local_hostname or local_ip  # no port: the transfer engine binds one itself
        self._store = _setup_store(self.local_hostname, metadata_server, segment_bytes, master)
        self._staging = _np().zeros(staging_bytes, dtype=_np().uint8)
        self._base = self._staging.ctypes.data
        if (rc := self._store.register_buffer(self._base, staging_bytes)) != 0:
            self._store.close()
            raise TransferError(f"mooncake: register_buffer of {staging_bytes} bytes failed ({rc})")
        self._lock = threading.Lock()
        self._counters: Counter = Counter()
        self._closed = False

    def key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def put(self, key: bytes, data: Any, *, replace: bool = True) -> bool:
        return self.batch_put([key], [data], replace=replace)[0]

    def get(self, key: bytes, into: Any) -> bool:
        return self.batch_get([key], [into])[0]

    def batch_put(self, keys: Sequence[bytes], blocks: Sequence[Any], *, replace: bool = True) -> list[bool]:
        """Stores each block under its key. True: stored (or, without `replace`, already there).
        False: not stored (counted).

        Args:
            replace: upsert (`batch_upsert_from`): the block replaces what the key held. False:
                `batch_put_from`, which keeps an object the key already names untouched.
        """
        views = [byte_view(b, writable=False, what=f"block {i}") for i, b in enumerate(blocks)]
        return [ok for chunk in self._chunks(views) for ok in self._put_chunk(keys, views, chunk, replace)]

    def batch_get(self, keys: Sequence[bytes], intos: Sequence[Any]) -> list[bool]:
        """As `batch_get_outcomes`, True for a HIT only."""
        return [o is Outcome.HIT for o in self.batch_get_outcomes(keys, intos)]

    def batch_get_outcomes(self, keys: Sequence[bytes], intos: Sequence[Any]) -> list[Outcome]:
        """Copies each stored block into its buffer, which must be the block's exact size.

        Raises:
            ValueError: a buffer is not the stored block's size.
        """
        views = [byte_view(b, writable=True, what=f"buffer {i}") for i, b in enumerate(intos)]
        return [o for chunk in self._chunks(views) for o in self._get_chunk(keys, views, chunk)]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (an error answers False)."""
        return [r == 1 for r in self._call(lambda s: s.batch_is_exist([self.key(k) for k in keys]))]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drops keys; returns how many were dropped.

        Forced: without `force` the master keeps any key put or read within its lease TTL (10 s by
        default); a read racing the removal is caught by the block's checksum and becomes a miss.
        """
        return sum(r == 0 for r in self._call(lambda s: s.batch_remove([self.key(k) for k in keys], True)))

    @property
    def counters(self) -> dict[str, int]:
        """hits, misses, puts, put_errors, get_errors, checksum_errors."""
        with self._lock:
            return dict(self._counters)

    def describe(self) -> dict[str, object]:
        return {"backend": "mooncake", "master": self.master, "metadata_server": self.metadata_server,
                "local_hostname": self.local_hostname, "transport": "tcp", "tenant": self.tenant}

    def close(self) -> None:
        """Unregisters the staging region and leaves the store (its segment's blocks go). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._store.unregister_buffer(self._base)
            self._store.close()

    def __enter__(self) -> MooncakeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------

    def _chunks(self, views: list[memoryview]) -> list[list[int]]:
        """Positions grouped so that each group's blocks and trailers fit the staging region."""
        chunks, used = [[]], 0
        for j, v in enumerate(views):
            need = stored_bytes(len(v))
            if need > len(self._staging):
                raise ValueError(f"mooncake: block {j} of {len(v)} bytes exceeds the staging region")
            if used + need > len(self._staging):
                chunks, used = chunks + [[]], 0
            chunks[-1].append(j)
            used += need
        return [c for c in chunks if c]

    def _layout(self, views: list[memoryview], chunk: list[int]) -> list[int]:
        offsets, at = [], 0
        for j in chunk:
            offsets.append(at)
            at += stored_bytes(len(views[j]))
        return offsets

    def _put_chunk(self, keys: Sequence[bytes], views: list[memoryview], chunk: list[int],
                   replace: bool) -> list[bool]:
        offsets = self._layout(views, chunk)
        sizes = [len(views[j]) + TRAILER_BYTES for j in chunk]
        with self._lock:
            self._check_open()
            for j, at in zip(chunk, offsets):
                n = len(views[j])
                self._staging[at: at + n] = views[j]
                self._staging[at + n: at + n + TRAILER_BYTES] = _np().frombuffer(
                    _trailer(keys[j], views[j]), dtype=_np().uint8)
            put = self._store.batch_upsert_from if replace else self._store.batch_put_from
            codes = put([self.key(keys[j]) for j in chunk], [self._base + at for at in offsets], sizes)
            ok = [c == 0 for c in codes]
            self._counters["puts"] += sum(ok)
            self._counters["put_errors"] += len(ok) - sum(ok)
        for j, c in zip(chunk, codes):
            if c != 0:
                log.debug("mooncake: put of %s failed (%d)", self.key(keys[j]), c)
        return ok

    def _get_chunk(self, keys: Sequence[bytes], views: list[memoryview], chunk: list[int]) -> list[Outcome]:
        offsets = self._layout(views, chunk)
        names = [self.key(keys[j]) for j in chunk]
        with self._lock:
            self._check_open()
            codes = self._store.batch_get_into(names, [self._base + at for at in offsets],
                                               [len(views[j]) + TRAILER_BYTES for j in chunk])
            out = [self._land(names[i], keys[j], views[j], at, c)
                   for i, (j, at, c) in enumerate(zip(chunk, offsets, codes))]
        return out

    def _land(self, name: str, key: bytes, view: memoryview, at: int, code: int) -> Outcome:
        """The outcome of one get, its bytes copied out of staging on a verified hit (lock held)."""
        n = len(view)
        if code == OBJECT_NOT_FOUND:
            self._counters["misses"] += 1
            return Outcome.MISS
        if code == BUFFER_TOO_SMALL or (code >= 0 and code != n + TRAILER_BYTES):
            size = self._store.get_size(name)
            if size >= 0:
                raise ValueError(f"mooncake block {name}: stored {size - TRAILER_BYTES} bytes, buffer holds {n}")
        if code != n + TRAILER_BYTES:
            self._counters["get_errors"] += 1
            log.debug("mooncake: get of %s failed (%d)", name, code)
            return Outcome.FAILED
        data = self._staging[at: at + n]
        if _trailer(key, data) != self._staging[at + n: at + n + TRAILER_BYTES].tobytes():
            self._counters["checksum_errors"] += 1
            self._counters["misses"] += 1
            return Outcome.MISS
        view[:] = data.data
        self._counters["hits"] += 1
        return Outcome.HIT

    def _call(self, fn):
        with self._lock:
            self._check_open()
            return fn(self._store)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"mooncake client of {self.master} is closed")


def _np():
    import numpy

    return numpy


def stored_bytes(n: int) -> int:
    """Bytes a block of `n` takes in staging: itself and its trailer, rounded up to 64."""
    return -(-(n + TRAILER_BYTES) // _ALIGN) * _ALIGN


def _setup_store(local_hostname: str, metadata_server: str, segment_bytes: int, master: str):
    """A set-up `MooncakeDistributedStore`, else TransferError.

    Why no thread with a deadline: `setup()` holds the GIL while it blocks (measured: a thread's
    `join(2)` returned after 30 s), so only the probes before it can bound the wait.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ConfigError(f"tiers.pool.backend: mooncake needs mooncake-transfer-engine ({e})") from None
    store = MooncakeDistributedStore()
    rc = store.setup(local_hostname, metadata_server, segment_bytes, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise TransferError(f"mooncake master {master}: setup() failed ({rc}); metadata {metadata_server}")
    return store


def _probe_metadata(url: str, timeout_s: float) -> None:
    """One GET of a key that does not exist: a Mooncake metadata server answers 404 at once.

    Raises:
        TransferError: nothing answers HTTP there within `timeout_s`.
    """
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{url}?key=kvtier%2Fprobe", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it speaks HTTP: 404 is the expected answer
    except OSError as e:
        raise TransferError(f"mooncake metadata server {url}: no HTTP answer within {timeout_s} s ({e})") from None


def _trailer(key: bytes, data) -> bytes:
    """The 8 bytes stored after a block: its key-seeded checksum (`buffers.block_checksum`), so bytes
    under another key fail the check."""
    return block_checksum(key, data).to_bytes(TRAILER_BYTES, "big")
