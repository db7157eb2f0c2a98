"""Block keys: 128-bit digests chained on the prefix.

    key_i = xxh3_128(namespace.digest ‖ key_{i-1} ‖ token ids of block i as little-endian int64)

with `key_{-1}` = 16 zero bytes. Equal keys therefore mean equal prefixes (model, weights, KV dtype,
block size, tenant salt and every earlier token), so any process on any machine that computed a prefix
can serve it to any other. Nothing here uses Python's `hash()`, so keys survive `PYTHONHASHSEED` and restarts.

A block whose K and V depend on more than its tokens and its prefix (a LoRA adapter, an image behind
placeholder tokens, prompt embeddings, a per-request salt: what an engine mixes into its own block
hashes) gets that input as its *extra* (`block_extra`: tagged, length-prefixed items), appended:

    key_i = xxh3_128(namespace.digest ‖ key_{i-1} ‖ tokens ‖ "kvtier.block-extra.v1" ‖ len ‖ extra)

A block without an extra gets exactly the key above, so the keys of plain requests, and every block
persisted under them, stay valid; the extra reaches every later key through the chain.

Changing this encoding invalidates every persisted block (SSD files, pool nodes): bump `_NAMESPACE_TAG`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NewType

import numpy as np
import xxhash

from kvtier.errors import ConfigError
from kvtier.units import check_number

BlockKey = NewType("BlockKey", bytes)
"""A 16-byte digest; cheap to hash and compare, printable with `.hex()`."""

KEY_BYTES = 16
ROOT_KEY = BlockKey(bytes(KEY_BYTES))
"""The parent of a sequence's first block."""

_NAMESPACE_TAG = b"kvtier.namespace.v2"  # v2: the weights fingerprint
_EXTRA_TAG = b"kvtier.block-extra.v1"
_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Namespace:
    """What, besides tokens, must match for two blocks to hold the same bytes.

    Attributes:
        model: names the model (e.g. the HF id and revision, or the path the engine loaded). Not
            the catalog's geometry name: a base and a chat model share geometry but never KV.
        kv_dtype: the exact cache byte format (e.g. `fp16`, `fp8_e4m3`); formats of one width differ.
        block_tokens: tokens per block.
        tenant_salt: isolates tenants: blocks of different salts never share keys.
        weights: a fingerprint of the weights themselves (`kvtier.model.weights`): a path or a name is
            not an identity, weights change under it. The integrations fill it in (from the files
            an engine loads, or the tensors in memory, or the user's `weights_id`); empty means
            only `model` names the weights (synthetic runs, simulations).
    """

    model: str
    kv_dtype: str
    block_tokens: int
    tenant_salt: str = ""
    weights: str = ""

    def __post_init__(self) -> None:
        kv_dtype = getattr(self.kv_dtype, "value", self.kv_dtype)  # accept a geometry.KVDtype
        object.__setattr__(self, "kv_dtype", kv_dtype)
        for field in ("model", "kv_dtype"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"Namespace.{field} must be a non-empty string, got {value!r}")
        for field in ("tenant_salt", "weights"):
            if not isinstance(getattr(self, field), str):
                raise ConfigError(f"Namespace.{field} must be a string, got {getattr(self, field)!r}")
        block_tokens = self.block_tokens
        check_number(block_tokens, "Namespace.block_tokens", integral=True, positive=True)
        object.__setattr__(self, "block_tokens", int(block_tokens))

    @cached_property
    def digest(self) -> bytes:
        """16 bytes identifying the namespace; every field is length-prefixed so none can bleed into another."""
        parts = [_NAMESPACE_TAG, self.model, self.kv_dtype, self.tenant_salt, self.weights]
        encoded = b"".join(_length_prefixed(p if isinstance(p, bytes) else p.encode("utf-8")) for p in parts)
        return xxhash.xxh3_128_digest(encoded + struct.pack("<q", self.block_tokens))


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def block_keys(namespace: Namespace, token_ids: Any, parent: BlockKey = ROOT_KEY,
               extras: Sequence[bytes | None] | None = None) -> list[BlockKey]:
    """The keys of every full block of `token_ids`; a partial last block gets no key.

    Args:
        namespace: model, dtype, block size and tenant the blocks belong to.
        token_ids: a 1-D sequence of integer token ids: list, tuple, numpy array or torch tensor.
        parent: the key of the block before `token_ids[0]`, to extend a chain; the root by default.
        extras: per full block, what else shapes its K and V (`block_extra`), or None (or b"") for
            nothing: such a block gets the key it would get without `extras`. None: no block has any.

    Returns:
        `len(token_ids) // namespace.block_tokens` keys, in order.

    Raises:
        TypeError: token_ids are not integers, or an extra is not bytes.
        ValueError: token_ids are not 1-D, a value does not fit int64, parent is not 16 bytes, or
            `extras` does not have one entry per full block.
    """
    _check_key(parent)
    tokens = _as_int64(token_ids)
    block_tokens = namespace.block_tokens
    num_blocks = len(tokens) // block_tokens
    if extras is not None and len(extras) != num_blocks:
        raise ValueError(f"extras: one per full block ({num_blocks}), got {len(extras)}")
    data = memoryview(tokens.tobytes())
    block_bytes = block_tokens * 8
    keys: list[BlockKey] = []
    prev = parent
    for i in range(num_blocks):
        extra = extras[i] if extras is not None else None
        prev = _chain(namespace.digest, prev, data[i * block_bytes: (i + 1) * block_bytes], extra)
        keys.append(prev)
    return keys


def block_extra(items: Iterable[tuple[str, bytes]]) -> bytes | None:
    """One block's extra input (for `block_keys`) from `(tag, value)` items, in the order given.

    Each tag and value is length-prefixed, so no item, and no split of one, can read as another.

    Returns:
        The encoded items, or None when there are none (the block's plain key).

    Raises:
        TypeError: a tag is not a string or a value is not bytes.
    """
    parts = []
    for tag, value in items:
        if not isinstance(tag, str) or not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"a block extra is (str tag, bytes value), got ({tag!r}, {type(value).__name__})")
        parts.append(_length_prefixed(tag.encode("utf-8")) + _length_prefixed(bytes(value)))
    return b"".join(parts) or None


def next_block_key(namespace: Namespace, parent: BlockKey, block_token_ids: Any) -> BlockKey:
    """The key of one block that follows `parent` (use `ROOT_KEY` for a sequence's first block).

    Raises:
        TypeError: token ids are not integers.
        ValueError: not exactly `namespace.block_tokens` ids, or parent is not 16 bytes.
    """
    _check_key(parent)
    tokens = _as_int64(block_token_ids)
    if len(tokens) != namespace.block_tokens:
        raise ValueError(f"a block holds {namespace.block_tokens} tokens, got {len(tokens)}")
    return _chain(namespace.digest, parent, tokens.tobytes())


def _chain(namespace_digest: bytes, parent: bytes, token_bytes: bytes | memoryview,
           extra: bytes | None = None) -> BlockKey:
    hasher = xxhash.xxh3_128()
    hasher.update(namespace_digest)
    hasher.update(parent)
    hasher.update(token_bytes)
    if extra:
        if not isinstance(extra, bytes):
            raise TypeError(f"a block's extra input is bytes (block_extra), got {type(extra).__name__}")
        hasher.update(_EXTRA_TAG + _length_prefixed(extra))
    return BlockKey(hasher.digest())


def _check_key(key: Any) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {key!r}")


def _as_int64(token_ids: Any) -> np.ndarray:
    """token ids as a contiguous little-endian int64 array, without copying when already so."""
    if hasattr(token_ids, "detach"):  # a torch tensor; torch itself is not imported here
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype="<i8")
    if array.dtype.kind == "O":  # Python ints beyond int64, or mixed objects
        raise ValueError("token ids must be integers that fit int64")
    if array.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) > _INT64_MAX:
        raise ValueError(f"token id {int(array.max())} does not fit int64")
    return np.ascontiguousarray(array, dtype="<i8")


def keys_hex(keys: Sequence[BlockKey]) -> list[str]:
    """Printable form of `keys` (for logs and JSON)."""
    return [key.hex() for key in keys]
