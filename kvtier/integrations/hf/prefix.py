"""`KVTierPrefixCache`: a `DynamicCache` that starts from the longest prefix kvtier holds.

The sequence's KV is resident, as in a `DynamicCache`; kvtier holds its full blocks between
requests. `prepare` loads the stored prefix before generation so the model only computes the rest;
`save` stores the full blocks the request computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from kvtier.moving.handle import TransferHandle
from kvtier.model.keys import BlockKey, block_keys

if TYPE_CHECKING:
    from kvtier.integrations.hf.adapter import HFKVTier


class KVTierPrefixCache(DynamicCache):
    """One request's cache (batch 1). Not thread-safe; one `generate` at a time.

    Args:
        binding: the model and KVTier it serves, checked against each other (`HFKVTier`).
    """

    def __init__(self, binding: HFKVTier) -> None:
        super().__init__(config=binding.model.config)
        self._binding = binding
        self._prompt: torch.Tensor | None = None
        self._num_saved_blocks = 0

    def prepare(self, input_ids: Any) -> int:
        """Loads the longest stored prefix of `input_ids` into this (empty) cache.

        A block that is missing or fails to load (I/O error, checksum mismatch) ends the prefix
        there: the model recomputes it, never reads it. At least one token is always left to
        compute, so a fully cached prompt gives `len(input_ids) - 1`.

        Args:
            input_ids: the prompt: 1-D, or `[1, T]`.
        Returns:
            How many leading tokens are now cached; `generate(input_ids, past_key_values=cache)`
            feeds only the rest to the model.
        Raises:
            RuntimeError: the cache already holds tokens or was prepared.
            ValueError: a batch other than 1, or no tokens.
        """
        if self._prompt is not None or self.get_seq_length() > 0:
            raise RuntimeError("prepare() is called once, on an empty cache, before generation")
        ids = token_ids_1d(input_ids)
        b = self._binding
        keys = block_keys(b.namespace, ids)
        blocks, num_blocks = b.load_prefix(keys[: b.kv.lookup(keys)])
        for layer, cache_layer in enumerate(self.layers if num_blocks else ()):
            k, v = b.codec.unpack_layer(blocks, layer, num_blocks)
            cache_layer.update(k.to(b.device), v.to(b.device))  # copies out of the staging rows
        self._prompt, self._num_saved_blocks = ids, num_blocks
        num_cached = num_blocks * b.codec.block_tokens
        if num_cached == len(ids):
            self.crop(-1)  # generate needs one token to compute logits from
            num_cached -= 1
        return num_cached

    def save(self, token_ids: Any) -> TransferHandle:
        """Stores the full blocks of `token_ids` this cache computed and kvtier does not hold yet.

        Args:
            token_ids: the whole sequence (prompt then generated tokens, e.g. `generate(...)[0]`);
                it must start with the prompt given to `prepare`. Only tokens whose KV is in the
                cache count (generate never feeds its last token).
        Returns:
            The store's handle; `wait()` it before relying on the blocks. Blocks kvtier had no
            room for are in `handle.failed`.
        Raises:
            ValueError: `token_ids` does not extend the prepared prompt.
        """
        ids = check_extends(token_ids, self._prompt)
        b = self._binding
        num_blocks = min(len(ids), self.get_seq_length()) // b.codec.block_tokens
        first = min(self._num_saved_blocks, num_blocks)
        keys = block_keys(b.namespace, ids[: num_blocks * b.codec.block_tokens])[first:]
        layers = [(layer.keys, layer.values) for layer in self.layers] if keys else []
        blocks = b.codec.pack(layers, first * b.codec.block_tokens, len(keys))
        self._num_saved_blocks = num_blocks
        return b.kv.store(keys, blocks)

    def close(self) -> None:
        """Nothing to release (no pins, no transfer left in flight); for symmetry with the streaming cache."""

    def __enter__(self) -> KVTierPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_ids_1d(input_ids: Any) -> torch.Tensor:
    """`input_ids` (list, 1-D or `[1, T]` tensor) as a 1-D int64 CPU tensor.

    Raises:
        ValueError: a batch other than 1, or no tokens.
    """
    ids = torch.as_tensor(input_ids).detach().to("cpu", torch.int64)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"kvtier caches hold one sequence; input_ids has batch {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be 1-D or [1, T] with at least one token, got {tuple(ids.shape)}")
    return ids


def check_extends(token_ids: Any, prompt: torch.Tensor | None) -> torch.Tensor:
    """`token_ids` as 1-D, after checking it starts with `prompt` (a block key must name its KV's tokens).

    Raises:
        RuntimeError: nothing was prepared.
        ValueError: `token_ids` does not start with `prompt`.
    """
    if prompt is None:
        raise RuntimeError("save() needs the prompt given to prepare(); call prepare() before generation")
    ids = token_ids_1d(token_ids)
    if len(ids) < len(prompt) or not torch.equal(ids[: len(prompt)], prompt):
        raise ValueError("token_ids must start with the prompt given to prepare(): the blocks' keys would "
                         "name tokens whose KV this cache did not compute")
    return ids


def leading_ok(keys: Sequence[BlockKey], handle: TransferHandle) -> int:
    """How many leading `keys` the transfer moved without failure."""
    n = 0
    for key in keys:
        if key in handle.failed:
            break
        n += 1
    return n
