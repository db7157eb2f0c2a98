"""Fingerprints of model weights, for `Namespace.weights`: changed weights never hit old KV.

A model's path or name is not an identity: a checkpoint is rebuilt, fine-tuned or re-quantized
under the same path (and a local path has no revision), and KV computed with the old weights is
garbage to the new ones. So the namespace names the weights themselves, in one of four forms:

- `id:<value>`: the user's `weights_id` (e.g. the digest a training pipeline gives a checkpoint),
  taken as is; nothing is read. The way to name weights kvtier cannot read.
- `files:<xxh3-128 hex>`: the files an engine loads from a local directory or file
  (`fingerprint_files`); a Hugging Face hub id is first resolved to its snapshot in the local
  cache, offline — never downloaded.
- `params:<xxh3-128 hex>`: tensors already in memory (`fingerprint_tensors`; transformers models).
A model's config is not a weight but changes the KV as much (RoPE base and scaling, norms, the
attention implementation), so where an integration holds the loaded config it appends
`;config:<xxh3-128 hex>` (`fingerprint_config`: the config as canonical JSON, and the tensors
that are not weights but shape K/V, such as RoPE's `inv_freq` buffer).
- `name:<model>@<revision>`: weights that cannot be read (a hub id not in the local cache, an
  object-store URI), logged as a warning: new weights under that name would hit old KV.

What is read, and why it is enough. Headers and sizes alone do not change when the same
architecture is retrained or fine-tuned, so tensor bytes are sampled too, with positioned reads,
never whole files:
- safetensors: the header (names, dtypes, shapes, offsets, metadata), plus 4 KiB from the start,
  the middle and the end of every tensor (about two reads per tensor once adjacent samples merge);
- zip archives (torch's `.bin`/`.pt`: one member per tensor storage): every member's name, size
  and CRC-32 of its whole data (from the central directory), plus the same three samples per member;
- any other weight file (`.gguf`, ...): its first and last 64 KiB and 64 evenly spaced 4 KiB chunks;
- the small config files next to the weights (`config.json`, ...) in full: RoPE scaling, layer
  counts or quantization settings change the KV as much as the weights do;
- every file's name and size.
Training, fine-tuning, merged adapters and re-quantization change every sample they touch; a
change confined to unsampled bytes (one row in the middle of one tensor, say) is not seen: give
`weights_id` where weights change that way.

File digests are cached in-process by (device, inode, size, mtime_ns, ctime_ns), so the two
connectors of an engine read the files once; a file changed less than 2 s ago is not cached (a
rewrite within the file system's timestamp granularity could keep all five, as with git's "racy"
index entries). The cache is a bounded memo of a pure function of the file, not shared state.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import struct
import threading
import time
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5",
                             ".npz", ".tensors"})
CONFIG_NAMES = frozenset({"config.json", "params.json", "quantize_config.json", "quant_config.json"})
ADAPTER_CONFIG_NAMES = CONFIG_NAMES | {"adapter_config.json"}
"""The config files read next to a LoRA adapter's weights (PEFT's rank, alpha and target modules)."""
SAMPLE_BYTES = 4096
_EDGE_BYTES = 64 << 10
_NUM_SPREAD = 64
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its header
_RACY_NS = 2_000_000_000
_MAX_CACHED = 4096
_TAG = b"kvtier.model.weights.v1"

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """Where an engine loads its weights from.

    Attributes:
        model: a local directory or file, or a Hugging Face hub id.
        revision: the hub revision (branch, tag or commit), if any.
        cache_dir: the Hugging Face cache the engine downloads into (None: the default one).
    """

    model: str
    revision: str | None = None
    cache_dir: str | None = None


def user_weights_id(value: Any, field: str) -> str | None:
    """The `id:` form of a user's `weights_id`, or None when it is not given.

    Raises:
        ConfigError: `value` is not a non-empty string; the message names `field`.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{field}: expected a non-empty string naming the weights (e.g. a digest of "
                          f"the checkpoint), got {value!r}")
    return f"id:{value}"


def weights_fingerprint(source: WeightsSource, config_names: frozenset[str] = CONFIG_NAMES) -> str:
    """What `Namespace.weights` holds for the weights an engine loads from `source`.

    Args:
        config_names: the config files read in full besides the weights (`ADAPTER_CONFIG_NAMES`
            for a LoRA adapter).

    Returns:
        `files:<hex>` for a local directory or file (or a hub id whose snapshot is in the local
        Hugging Face cache), else `name:<model>@<revision>`, with a one-line warning.

    Raises:
        ConfigError: a weight file exists but cannot be read (the message names it).
    """
    path, why = local_weights(source)
    if path is not None:
        try:
            fingerprint = fingerprint_files(path, config_names)
        except OSError as e:
            raise ConfigError(f"weights: cannot read {e.filename or path} to fingerprint the weights ({e}); "
                              "make it readable or set weights_id") from None
        if fingerprint is not None:
            return fingerprint
        why = f"{path} holds no weight files ({', '.join(sorted(WEIGHT_SUFFIXES))})"
    log.warning("kvtier: cannot fingerprint the weights of %s: %s; its blocks are keyed by name and revision "
                "only, so new weights under that name would hit old KV; set weights_id to name them",
                source.model, why)
    return f"name:{source.model}@{source.revision or ''}"


def local_weights(source: WeightsSource) -> tuple[Path | None, str]:
    """The local path of `source`'s files, or None and why not. A path that exists wins, as in engines."""
    path = Path(source.model).expanduser()
    if path.exists():
        return path, ""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None, "not a local path (and huggingface_hub is not installed to look in its cache)"
    try:  # offline: the snapshot already in the cache, or an error
        snapshot = snapshot_download(source.model, revision=source.revision, cache_dir=source.cache_dir,
                                     local_files_only=True)
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError), not a hub id (HFValidationError)
        return None, "not a local path, and not in the local Hugging Face cache"
    return Path(snapshot), ""


def fingerprint_files(path: str | os.PathLike, config_names: frozenset[str] = CONFIG_NAMES) -> str | None:
    """The `files:` fingerprint of the weights at `path`: one file, or a directory's top-level files.

    Engines load a checkpoint's top-level files; subdirectories (e.g. `original/`) are not read.

    Args:
        config_names: the names of the config files read in full besides the weight files.

    Returns:
        None where `path` holds no weight file (by suffix: `WEIGHT_SUFFIXES`).

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        (p for p in path.iterdir() if (p.suffix in WEIGHT_SUFFIXES or p.name in config_names) and p.is_file()),
        key=lambda p: p.name)
    if not any(f.suffix in WEIGHT_SUFFIXES for f in files):
        return None
    hasher = xxhash.xxh3_128(_TAG)
    for file in files:
        size, digest = _file_digest(file)
        hasher.update(_framed(file.name.encode("utf-8")) + struct.pack("<Q", size) + digest)
    return "files:" + hasher.hexdigest()


_digests: dict[tuple, bytes] = {}
_digests_lock = threading.Lock()


def _file_digest(path: Path) -> tuple[int, bytes]:
    """A file's size and the digest of its samples; cached by the identity `fstat` gives the open file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, path.suffix)
        with _digests_lock:
            digest = _digests.get(key)
        if digest is None:
            digest = _sample_digest(fd, st.st_size, path.suffix)
            if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= _RACY_NS:
                with _digests_lock:
                    if len(_digests) >= _MAX_CACHED:
                        _digests.clear()
                    _digests[key] = digest
        return st.st_size, digest
    finally:
        os.close(fd)


def _sample_digest(fd: int, size: int, suffix: str) -> bytes:
    """xxh3-128 of what describes the file (format-specific) and of its sampled byte ranges."""
    found = _safetensors_ranges(fd, size) if suffix == ".safetensors" else None
    meta, ranges = (b"safetensors", found) if found is not None else _zip_samples(fd, size)
    hasher = xxhash.xxh3_128(meta)
    for start, end in _merged(ranges):
        hasher.update(struct.pack("<QQ", start, end))
        hasher.update(os.pread(fd, end - start, start))
    return hasher.digest()


def _safetensors_ranges(fd: int, size: int) -> list[Range] | None:
    """The header and three samples of every tensor; None when the file is not valid safetensors."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        return None
    (header_bytes,) = struct.unpack("<Q", prefix)
    base = 8 + header_bytes
    if header_bytes > _MAX_HEADER_BYTES or base > size:
        return None
    ranges = [(0, base)]
    try:
        header = json.loads(os.pread(fd, header_bytes, 8))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= size - base):
                return None
            ranges += sample_ranges(base + begin, base + end)
    except (ValueError, TypeError, KeyError, AttributeError):  # not JSON, not a safetensors header
        return None
    return ranges


def _zip_samples(fd: int, size: int) -> tuple[bytes, list[Range]]:
    """Members (name, size, CRC-32) and three samples of each for a zip file; else evenly spread chunks."""
    try:
        with os.fdopen(os.dup(fd), "rb") as f, zipfile.ZipFile(f) as archive:  # reads the central directory
            members = sorted(archive.infolist(), key=lambda m: m.header_offset)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return b"file", _spread_ranges(size)
    meta = b"zip" + b"".join(_framed(m.filename.encode("utf-8")) + struct.pack("<QQI", m.file_size, m.header_offset,
                                                                              m.CRC) for m in members)
    starts = [m.header_offset for m in members]
    ranges = [r for start, end in zip(starts, starts[1:] + [size]) for r in sample_ranges(start, end)]
    return meta, ranges


def sample_ranges(start: int, end: int, sample_bytes: int = SAMPLE_BYTES) -> list[Range]:
    """`[start, end)` in full when short, else its first, middle and last `sample_bytes`."""
    if end - start <= 3 * sample_bytes:
        return [(start, end)]
    middle = (start + end - sample_bytes) // 2
    return [(start, start + sample_bytes), (middle, middle + sample_bytes), (end - sample_bytes, end)]


def _spread_ranges(size: int) -> list[Range]:
    if size <= 2 * _EDGE_BYTES + _NUM_SPREAD * SAMPLE_BYTES:
        return [(0, size)]
    step = (size - SAMPLE_BYTES) // (_NUM_SPREAD + 1)
    spread = [(i * step, i * step + SAMPLE_BYTES) for i in range(1, _NUM_SPREAD + 1)]
    return [(0, _EDGE_BYTES), *spread, (size - _EDGE_BYTES, size)]


def _merged(ranges: Iterable[Range]) -> list[Range]:
    """Ranges sorted, those overlapping or less than a sample apart joined: fewer, larger reads."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + SAMPLE_BYTES:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def fingerprint_tensors(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """The `params:` fingerprint of tensors in memory, in the order given (e.g. `state_dict()`'s).

    Per tensor: its name, dtype and shape, and its first, middle and last 4 KiB of bytes (all of
    it when smaller), copied to the host: the same weights give the same fingerprint in any
    process and on any device; other values, dtypes or shapes give another.

    Raises:
        ValueError: a tensor's bytes cannot be read (on the `meta` device, or a tensor subclass
            without a byte view); the message names it.
    """
    hasher = xxhash.xxh3_128(_TAG + b".tensors")
    _hash_tensors(hasher, named_tensors)
    return "params:" + hasher.hexdigest()


CONFIG_FIELDS_WITHOUT_KV = frozenset({"_name_or_path", "_commit_hash"})
"""Config fields left out of `fingerprint_config`, at any depth: where the files came from (a path
or a hub commit is not an identity; the weights fingerprint names them). Everything else stays in,
down to output flags and label maps: a field kept that cannot change the KV only costs misses,
one left out that can would serve wrong KV."""


def fingerprint_config(config: Mapping[str, Any], buffers: Iterable[tuple[str, Any]] = ()) -> str:
    """The `config:` fingerprint of a loaded model's config and of the buffers that shape its K/V.

    Args:
        config: the model's config as a mapping (e.g. transformers' `config.to_dict()`, plus what
            the engine resolved at load time, such as the attention implementation). Hashed as
            canonical JSON (sorted keys, no whitespace), without `CONFIG_FIELDS_WITHOUT_KV`.
        buffers: named tensors that are not weights but enter the computation (e.g. RoPE's
            non-persistent `inv_freq`), hashed as `fingerprint_tensors` hashes weights.

    Returns:
        `config:<xxh3-128 hex>`: equal for equal configs and buffers in any process.

    Raises:
        ValueError: a config value has no canonical JSON form (not JSON, an enum, a set, a path or
            a torch dtype), or a buffer's bytes cannot be read (see `fingerprint_tensors`).
    """
    try:
        canonical = json.dumps(_without_fields(config, CONFIG_FIELDS_WITHOUT_KV), sort_keys=True,
                               separators=(",", ":"), default=_json_value)
    except (TypeError, ValueError) as e:  # also a mapping whose keys do not sort (mixed types)
        raise ValueError(f"model config: cannot fingerprint it: {e}") from None
    hasher = xxhash.xxh3_128(_TAG + b".config")
    hasher.update(_framed(canonical.encode("utf-8")))
    _hash_tensors(hasher, buffers)
    return "config:" + hasher.hexdigest()


def _without_fields(value: Any, fields: frozenset[str]) -> Any:
    """`value` with the keys `fields` removed from every mapping in it, at any depth."""
    if isinstance(value, Mapping):
        return {str(k): _without_fields(v, fields) for k, v in value.items() if k not in fields}
    if isinstance(value, (list, tuple)):
        return [_without_fields(v, fields) for v in value]
    return value


def _json_value(value: Any) -> Any:
    """A JSON form of the few non-JSON values configs hold: enums by value, sets sorted, paths and
    torch dtypes by name.

    Raises:
        TypeError: any other type: its `repr` may not show all its state (a long tensor's is
            abridged), and two configs that differ must never hash alike.
    """
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, os.PathLike) or type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)
    raise TypeError(f"a value of type {type(value).__module__}.{type(value).__qualname__} has no canonical JSON form")


def _hash_tensors(hasher: Any, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Feeds each tensor's name, dtype, shape and sampled bytes to `hasher` (see `fingerprint_tensors`)."""
    import torch

    for name, tensor in named_tensors:
        if tensor.is_meta:
            raise ValueError(f"tensor {name} has no data here (meta device, e.g. offloaded)")
        hasher.update(_framed(name.encode("utf-8")) + _framed(f"{tensor.dtype}{tuple(tensor.shape)}".encode()))
        try:
            data = tensor.detach().reshape(-1).view(torch.uint8)
            sample = torch.cat([data[start:end] for start, end in sample_ranges(0, data.numel())])
        except (RuntimeError, TypeError, NotImplementedError) as e:
            raise ValueError(f"tensor {name} ({type(tensor).__name__}, {tensor.dtype}): no byte view: {e}") from None
        hasher.update(sample.cpu().numpy().tobytes())


def _framed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data
