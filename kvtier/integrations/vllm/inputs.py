"""What besides its token ids shapes a vLLM request's K and V, as per-block extras of its keys.

vLLM 0.32 mixes four things into each block's hash besides the tokens and the parent
(`generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`), and so does kvtier, as
`kvtier.model.keys.block_extra` items of the block's key (in vLLM's order):
  * `lora`: the request's adapter, on every block. vLLM names it by name and path; kvtier by a
    fingerprint of the adapter's files (`AdapterFingerprints`): names, integer ids and paths are
    all reused, and an adapter rebuilt in place must never hit the old adapter's KV.
  * `mm`: each multimodal item whose placeholder range overlaps the block, by its hash
    (`MultiModalFeatureSpec.identifier`, the one vLLM hashes: the content hash, prefixed with the
    adapter's name where the adapter reaches the encoder) and its offset from the block's start.
  * `cache_salt`: the request's salt, on the first block; the chain carries it to every later one.
  * `prompt_embeds`: a digest of the block's rows of `prompt_embeds` (dtype, shape and bytes; vLLM
    sets those positions' token ids to zeros), and of which positions are token ids in a mixed prompt.
A request with none of these keeps the keys of its tokens alone (`kvtier.model.keys`). One kvtier
cannot key safely is refused (`Refusal`): served as a miss, counted, never stored, never given a
key another request could share:
  * an adapter whose files cannot be read or fingerprinted;
  * an adapter whose files changed while its integer id stayed (vLLM keeps serving the weights it
    loaded under that id until it evicts them, unless `load_inplace`: kvtier cannot tell which);
  * a multimodal item without a content hash: vLLM skips hashing when both its processor cache and
    its prefix cache are off and names the item by a per-request counter (`renderer0-mm-7-image-0`)
    that the next engine reuses for another image. Identifiers a client gave (`multi_modal_uuids`)
    are taken as vLLM takes them: the client vouches that one identifier is one item.
Nothing here imports vLLM; it reads the attributes of vLLM's `Request` it is given.
"""

from __future__ import annotations

import enum
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.model.keys import block_extra
from kvtier.model.weights import ADAPTER_CONFIG_NAMES, WeightsSource, fingerprint_files, local_weights

ADAPTER_CONFIG = "adapter_config.json"
_MAX_IDS = 4096  # adapter ids remembered for the reuse check; the oldest is forgotten first
# the per-request names vLLM gives items it did not hash (`BaseRenderer._process_mm_uuids`)
_UNHASHED_ITEM = re.compile(r"(^|:)renderer\d+-mm-\d+-")


class RefusalReason(enum.Enum):
    """Why a request cannot be keyed safely (a metrics label)."""

    LORA_UNREADABLE = "lora_unreadable"
    LORA_CHANGED = "lora_changed"
    MM_UNHASHED = "mm_unhashed"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request kvtier cannot key safely: a counted miss, never stored."""

    reason: RefusalReason
    detail: str


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item: its hash and the placeholder tokens `[offset, offset + length)` it fills."""

    identifier: bytes
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """A request's inputs besides its token ids. Built by `read_inputs`; empty for a plain request."""

    lora: bytes | None = None
    cache_salt: bytes | None = None
    mm_items: tuple[MMItem, ...] = ()
    prompt_embeds: Any = None  # a tensor [prompt tokens, hidden]
    prompt_is_token_ids: Any = None  # a mixed prompt's mask: which positions are token ids

    @property
    def plain(self) -> bool:
        return (self.lora is None and self.cache_salt is None and not self.mm_items
                and self.prompt_embeds is None)

    def extras(self, first_block: int, num_blocks: int, block_tokens: int) -> list[bytes | None] | None:
        """The `block_extra` of blocks `first_block ..` (`num_blocks` of them); None for a plain request."""
        if self.plain:
            return None
        return [self._extra(b * block_tokens, (b + 1) * block_tokens)
                for b in range(first_block, first_block + num_blocks)]

    def _extra(self, start: int, end: int) -> bytes | None:
        items: list[tuple[str, bytes]] = []
        if self.lora is not None:
            items.append(("lora", self.lora))
        items += [("mm", _framed(identifier) + struct.pack("<qq", offset, length))
                  for identifier, offset, length in self.mm_in_block(start, end)]
        if start == 0 and self.cache_salt is not None:
            items.append(("cache_salt", self.cache_salt))
        if self.prompt_embeds is not None and start < len(self.prompt_embeds):
            items.append(("prompt_embeds", self._embeds_digest(start, end)))
        return block_extra(items)

    def mm_in_block(self, start: int, end: int) -> list[tuple[bytes, int, int]]:
        """The multimodal items whose placeholders overlap tokens `[start, end)`: each one's hash,
        offset from `start` (negative where it began in an earlier block) and length, as vLLM
        places them (`_gen_mm_extra_hash_keys`)."""
        return [(m.identifier, m.offset - start, m.length) for m in self.mm_items
                if m.offset < end and start < m.offset + m.length]

    def _embeds_digest(self, start: int, end: int) -> bytes:
        rows = self.prompt_embeds[start:end]
        hasher = xxhash.xxh3_128(_framed(f"{rows.dtype}{tuple(rows.shape)}".encode()))
        hasher.update(tensor_bytes(rows))
        if self.prompt_is_token_ids is not None:
            hasher.update(bytes(bool(t) for t in self.prompt_is_token_ids[start:end]))
        return hasher.digest()


def tensor_bytes(tensor: Any) -> bytes:
    """A torch tensor's bytes in row-major order, read on the host (any dtype, bf16 included)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


class AdapterFingerprints:
    """LoRA adapters by their files: `fingerprint` names an adapter in block keys.

    A fingerprint covers the adapter's weight files (`kvtier.model.weights.fingerprint_files`: headers
    and sampled bytes, each file's digest cached by its stat) and its `adapter_config.json` in full
    (rank, alpha, target modules: they scale the delta as much as the weights do). It also
    remembers each integer id's first fingerprint (`_MAX_IDS` of them) to catch an id reused for
    other files.
    """

    def __init__(self, max_ids: int = _MAX_IDS) -> None:
        self._by_id: OrderedDict[int, bytes] = OrderedDict()
        self._max_ids = max_ids

    def fingerprint(self, lora_request: Any) -> bytes | Refusal:
        """The adapter's fingerprint (16 bytes), or why it cannot be had.

        Args:
            lora_request: vLLM's `LoRARequest` (`lora_path`, `lora_int_id`, `load_inplace`).
        """
        path = str(getattr(lora_request, "lora_path", "") or "")
        found = self._read(path)
        if isinstance(found, Refusal):
            return found
        adapter_id = getattr(lora_request, "lora_int_id", None)
        if adapter_id is None:
            return found
        first = self._by_id.get(adapter_id)
        if first is not None and first != found and not getattr(lora_request, "load_inplace", False):
            return Refusal(RefusalReason.LORA_CHANGED, f"the files of LoRA adapter id {adapter_id} ({path}) "
                           "changed since the engine first served it")
        self._by_id[adapter_id] = found
        self._by_id.move_to_end(adapter_id)
        while len(self._by_id) > self._max_ids:
            self._by_id.popitem(last=False)
        return found

    @staticmethod
    def _read(path: str) -> bytes | Refusal:
        local = local_weights(WeightsSource(path))[0] if path else None  # a hub id: its cached snapshot, offline
        if local is None or not local.is_dir():
            return Refusal(RefusalReason.LORA_UNREADABLE, f"LoRA adapter {path!r} is not a local folder kvtier "
                                                          "can read (nor in the local Hugging Face cache)")
        if not (local / ADAPTER_CONFIG).is_file():
            return Refusal(RefusalReason.LORA_UNREADABLE, f"LoRA adapter {local} has no {ADAPTER_CONFIG}")
        try:
            files = fingerprint_files(local, ADAPTER_CONFIG_NAMES)  # adapter_config.json read in full
        except OSError as e:
            return Refusal(RefusalReason.LORA_UNREADABLE, f"cannot read LoRA adapter {local}: {e}")
        if files is None:
            return Refusal(RefusalReason.LORA_UNREADABLE, f"LoRA adapter {local} holds no weight files")
        return xxhash.xxh3_128_digest(files.encode())


def read_inputs(request: Any, adapters: AdapterFingerprints) -> RequestInputs | Refusal:
    """A vLLM `Request`'s inputs besides its token ids, or why it cannot be keyed safely.

    Reads `lora_request`, `cache_salt`, `mm_features` and `prompt_embeds` (and
    `prompt_is_token_ids`); an object without them (a test's request) is a plain request.
    """
    lora = None
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        lora = adapters.fingerprint(lora_request)
        if isinstance(lora, Refusal):
            return lora
    mm_items = _mm_items(getattr(request, "mm_features", None) or ())
    if isinstance(mm_items, Refusal):
        return mm_items
    salt = getattr(request, "cache_salt", None)
    embeds = getattr(request, "prompt_embeds", None)
    return RequestInputs(lora, salt.encode("utf-8") if salt else None, mm_items, embeds,
                         getattr(request, "prompt_is_token_ids", None) if embeds is not None else None)


def _mm_items(features: Any) -> tuple[MMItem, ...] | Refusal:
    items = []
    for i, feature in enumerate(features):
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not isinstance(identifier, str) or not identifier or _UNHASHED_ITEM.search(identifier):
            return Refusal(RefusalReason.MM_UNHASHED, f"multimodal item {i} has no content hash ({identifier!r}; "
                           "vLLM hashes items unless both its processor cache and prefix cache are off)")
        if position is None:
            return Refusal(RefusalReason.MM_UNHASHED, f"multimodal item {i} has no placeholder range")
        items.append(MMItem(identifier.encode("utf-8"), int(position.offset), int(position.length)))
    return tuple(items)


def _framed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data
