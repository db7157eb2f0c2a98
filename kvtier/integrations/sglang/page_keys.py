"""From SGLang page hashes to kvtier keys, with every identity input a storage call carries.

    key = xxh3_128(namespace ‖ epoch ‖ page hash)                         the plain call
    key = xxh3_128(namespace ‖ epoch ‖ 0xFF ‖ xxh3_128(extras) ‖ page hash)  a call with extras

What SGLang 0.5.23 puts in a page hash already: the page's tokens and every token before it (a
SHA-256 chain), seeded with the request's `extra_key` (its own, plus the LoRA adapter's `lora_id`)
and `cache_salt`; multimodal items enter as placeholder tokens derived from each item's hash. So
the hash alone isolates adapters, salts and images within what SGLang can tell apart.

The extras are what a call adds that the namespace (fixed at start-up) cannot hold:
- the weight version, where the server publishes one and it moved since start-up (an in-place
  update under a new `weight_version`: SGLang flushes its own caches, never a storage backend's);
- `HiCacheStorageExtraInfo.extra_info`, a dict SGLang's HiCache controller leaves empty but whose
  contents would be an identity if a caller filled it. It enters as canonical JSON; one that has
  no canonical form (a tensor, an object) makes the call unkeyable: its pages are misses and are
  not stored.
`prefix_keys` are left out: the page hash chains over them already, and they depend on how SGLang
cut a request into batches, so keying on them would turn hits into misses.

No 0xFF byte occurs in UTF-8, so a key with extras never equals a plain one. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from kvtier.model.keys import BlockKey

_EXTRAS_MARK = b"\xff"


class UnkeyableCall(Exception):
    """A call carries an identity input kvtier cannot encode; its pages must be misses, never stored."""


@dataclass(frozen=True, slots=True)
class PageKeys:
    """The keys of one namespace and epoch.

    Attributes:
        namespace_digest: `Namespace.digest` of the rank's pages.
        epoch: bumped by `clear()`: every earlier page becomes unreachable at once.
        weight_version: reads the server's current weight version; None outside a server.
        start_version: the weight version the namespace was made under.
    """

    namespace_digest: bytes
    epoch: int = 0
    weight_version: Callable[[], Any] | None = None
    start_version: Any = None

    def next_epoch(self) -> PageKeys:
        return replace(self, epoch=self.epoch + 1)

    def keys(self, page_hashes: Sequence[str], extra_info: Any = None) -> list[BlockKey]:
        """The kvtier keys of `page_hashes` for one call.

        Args:
            extra_info: SGLang's `HiCacheStorageExtraInfo` for the call, or None.

        Raises:
            UnkeyableCall: `extra_info.extra_info` has no canonical JSON form.
        """
        prefix = self.namespace_digest + self.epoch.to_bytes(8, "little") + self._extras(extra_info)
        return [BlockKey(xxhash.xxh3_128_digest(prefix + h.encode("utf-8"))) for h in page_hashes]

    def _extras(self, extra_info: Any) -> bytes:
        extras: dict[str, Any] = {}
        if self.weight_version is not None:
            version = self.weight_version()
            if version != self.start_version:
                extras["weight_version"] = version
        info = getattr(extra_info, "extra_info", None)
        if info:
            extras["extra_info"] = info
        if not extras:
            return b""
        try:
            canonical = json.dumps(extras, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnkeyableCall(f"extra_info {sorted(map(str, info or {}))}: no canonical form ({e})") from None
        return _EXTRAS_MARK + xxhash.xxh3_128_digest(canonical.encode("utf-8"))
