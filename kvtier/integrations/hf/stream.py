"""`KVTierStreamingCache`: decode a sequence whose KV stays in kvtier, streamed back layer by layer.

What is where:
- the prompt's full blocks live in kvtier, pinned for the life of the cache, in whatever tier they
  fit (a tiny HBM tier sends them to DRAM, the pool, SSD). They are *streamed*;
- every other token (a partial last block, tokens being generated, blocks whose store is still in
  flight) is *resident* on the model's device, as in a `DynamicCache`.

How one forward reads the streamed prefix, and how far ahead:
- at the end of forward `t` (inside the last layer's `update`) the cache issues one kvtier `load`
  of every streamed block into a host staging buffer. kvtier copies it layer by layer, in order,
  so the load of forward `t+1` is in flight while forward `t` samples its token and forward `t+1`
  embeds it: the load runs up to one whole step ahead of decode (all layers in flight at once);
- `update(l)` waits only for layer `l` (`handle.wait_layer(l)`) and returns the prefix K/V of that
  layer joined with the resident tokens. Layers `l+1..` keep arriving while layer `l` computes;
- device memory holds the resident tokens, plus one layer's prefix K/V at a time while its
  attention runs. The host staging buffer holds the streamed prefix (all layers) for one step: the
  runtime's `load` moves whole blocks, so a narrower window would need a per-layer load verb.
  On CUDA the staging buffer is pinned and copied to the device asynchronously; the next load into
  it first waits (a CUDA event) for the last of those copies.

When a streamed block fails to load (evicted despite the pin, I/O error, checksum mismatch), the
cache recomputes the streamed prefix from the prompt's token ids (one forward of the base model into
a scratch `DynamicCache`), keeps it resident, and stores it again: a miss and recompute, never
wrong tokens. The layers already computed in that forward read only layers that had arrived intact.

A new block is stored once the forward that completed it ends, and joins the streamed prefix at
the end of the next forward, after its store has landed and it is pinned. Only prompt blocks are
streamed: they are the ones whose token ids the cache knows (`Cache.update` never sees token ids).
Generated tokens stay resident until `save()`, so their footprint grows with `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache, DynamicCache, DynamicLayer

from kvtier.moving.handle import TransferHandle
from kvtier.integrations.hf.prefix import check_extends, leading_ok, token_ids_1d
from kvtier.model.keys import BlockKey, block_keys

if TYPE_CHECKING:
    from kvtier.integrations.hf.adapter import HFKVTier

Observer = Callable[[str, int], None]


class _ResidentLayer(DynamicLayer):
    """One layer's resident tokens: those after the streamed prefix. Its length counts the prefix."""

    def __init__(self, owner: KVTierStreamingCache) -> None:
        super().__init__()
        self._owner = owner

    def get_seq_length(self) -> int:
        return self._owner.num_streamed_tokens + self.num_resident_tokens

    @property
    def num_resident_tokens(self) -> int:
        return super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVTierStreamingCache cannot be cropped (no assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVTierStreamingCache holds one sequence (no beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVTierStreamingCache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KVTierStreamingCache holds one sequence")

    def drop_front(self, num_tokens: int) -> None:
        self.keys, self.values = self.keys[:, :, num_tokens:], self.values[:, :, num_tokens:]

    def prepend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys, self.values = torch.cat([keys, self.keys], -2), torch.cat([values, self.values], -2)


class KVTierStreamingCache(Cache):
    """One request's streaming cache (batch 1). Not thread-safe; one forward at a time.

    Call `close()` (or use it as a context manager) when the request ends: it unpins the blocks.

    Args:
        binding: the model and KVTier it serves (`HFKVTier`).
        observer: optional `observer(event, value)` trace, see `HFKVTier.streaming_cache`.
    """

    def __init__(self, binding: HFKVTier, observer: Observer | None = None) -> None:
        super().__init__(layers=[_ResidentLayer(self) for _ in range(binding.codec.num_layers)])
        self._binding, self._kv, self._codec = binding, binding.kv, binding.codec
        self._observer = observer
        self._prompt: torch.Tensor | None = None
        self._prompt_keys: list[BlockKey] = []
        self._num_streamed = 0  # prompt blocks [0, n) are in kvtier, pinned, not resident
        self._load: TransferHandle | None = None  # the streamed blocks, for the next/current forward
        self._pending: tuple[list[BlockKey], TransferHandle] | None = None  # a store in flight
        self._storing_stopped = False  # kvtier refused a block: what follows stays resident
        self._staging = binding.staging(0)
        self._staging_read: torch.cuda.Event | None = None  # CUDA: the last copy out of the staging
        self._closed = False

    @property
    def num_streamed_tokens(self) -> int:
        return self._num_streamed * self._codec.block_tokens

    @property
    def num_streamed_blocks(self) -> int:
        return self._num_streamed

    def prepare(self, input_ids: Any) -> int:
        """Streams the longest stored prefix of `input_ids`; its load starts now, ahead of the first forward.

        Returns:
            How many leading tokens are cached (a multiple of `block_tokens`, below `len(input_ids)`).
        Raises:
            RuntimeError: the cache already holds tokens, was prepared or is closed.
            ValueError: a batch other than 1, or no tokens.
        """
        if self._closed or self._prompt is not None or self.get_seq_length() > 0:
            raise RuntimeError("prepare() is called once, on an empty open cache, before generation")
        self._prompt = token_ids_1d(input_ids)
        self._prompt_keys = block_keys(self._binding.namespace, self._prompt)
        found = self._prompt_keys[: self._kv.lookup(self._prompt_keys)]
        if len(found) * self._codec.block_tokens == len(self._prompt):
            found = found[:-1]  # generate needs one token to compute: the last block is recomputed
        self._num_streamed = self._pin_leading(found)
        if self._num_streamed:
            self._issue_load()
        return self.num_streamed_tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new tokens of layer `layer_idx`; returns its K/V over the whole sequence.

        Raises:
            RuntimeError: the cache is closed.
            GeometryError, ValueError: states of another shape or dtype than the bound model's.
        """
        if self._closed:
            raise RuntimeError("KVTierStreamingCache is closed")
        self._emit("update_enter", layer_idx)
        self._codec.check_states(key_states, value_states, layer_idx)
        prefix = self._streamed_layer(layer_idx)
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        if prefix is not None:
            keys, values = torch.cat([prefix[0], keys], -2), torch.cat([prefix[1], values], -2)
        if layer_idx == len(self.layers) - 1:
            self._end_of_forward()
        self._emit("update_return", layer_idx)
        return keys, values

    def save(self, token_ids: Any) -> TransferHandle:
        """Stores the full blocks of `token_ids` that kvtier does not hold yet (generated ones too).

        Args:
            token_ids: the whole sequence, starting with the prepared prompt (e.g. `generate(...)[0]`).
        Returns:
            The store's handle; blocks kvtier had no room for are in `handle.failed`.
        Raises:
            ValueError: `token_ids` does not extend the prepared prompt.
        """
        ids = check_extends(token_ids, self._prompt)
        self._settle_pending()
        num_blocks = min(len(ids), self.get_seq_length()) // self._codec.block_tokens
        keys = block_keys(self._binding.namespace, ids[: num_blocks * self._codec.block_tokens])
        return self._store_resident(keys[self._num_streamed:])

    def close(self) -> None:
        """Waits for transfers in flight and unpins the streamed blocks. Idempotent; the cache is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self._load is not None:
            self._load.wait()
            self._load = None
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None
        self._unpin(self._prompt_keys[: self._num_streamed])

    def __enter__(self) -> KVTierStreamingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        raise NotImplementedError("KVTierStreamingCache is one request's cache; make a new one")

    # ---- the stream ----------------------------------------------------------------------

    def _streamed_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The streamed prefix's K/V of `layer` on the model's device, or None when nothing is streamed."""
        if self._num_streamed == 0:
            return None
        if self._load is None:  # not issued ahead: only right after a recompute or a save()
            self._issue_load()
        self._load.wait_layer(layer)
        if self._load.failed:
            self._recompute_prefix()
            return None
        self._emit("layer_loaded", layer)
        k, v = self._codec.unpack_layer(self._staging, layer, self._num_streamed)
        device = self._binding.device
        k, v = k.to(device, non_blocking=True), v.to(device, non_blocking=True)
        if device.type == "cuda":  # the copies run later on the stream: the staging is busy until then
            self._staging_read = torch.cuda.Event()
            self._staging_read.record()
        if layer == len(self.layers) - 1:
            self._load.wait()  # the runtime has applied the load: its leases are released
            self._load = None
        return k, v

    def _end_of_forward(self) -> None:
        """After the last layer: land the previous store, store new blocks, issue the next forward's load."""
        self._settle_pending()
        if not self._storing_stopped:
            num_blocks = min(self.get_seq_length() // self._codec.block_tokens, len(self._prompt_keys))
            keys = self._prompt_keys[self._num_streamed: num_blocks]
            if keys:
                self._pending = (keys, self._store_resident(keys))
                self._emit("store_issued", len(keys))
        if self._num_streamed:
            self._issue_load()

    def _issue_load(self) -> None:
        if self._staging_read is not None:  # host-to-device copies of the last load still queued
            self._staging_read.synchronize()
            self._staging_read = None
        n = self._num_streamed
        if self._staging.shape[0] < n:
            self._staging = self._binding.staging(max(n, 2 * self._staging.shape[0]))
        self._load = self._kv.load(self._prompt_keys[:n], self._staging[:n])
        self._emit("load_issued", n)

    def _settle_pending(self) -> None:
        """Waits for the store in flight; its leading stored blocks are pinned and leave the device."""
        if self._pending is None:
            return
        keys, handle = self._pending
        self._pending = None
        handle.wait()
        num_pinned = self._pin_leading(keys[: leading_ok(keys, handle)])
        if num_pinned < len(keys):
            self._storing_stopped = True  # kvtier is full of pinned blocks: keep the rest resident
        if num_pinned:
            for layer in self.layers:
                layer.drop_front(num_pinned * self._codec.block_tokens)
            self._num_streamed += num_pinned
            if self._load is not None:  # issued for the shorter prefix (only after a save())
                self._load.wait()
                self._issue_load()

    def _store_resident(self, keys: Sequence[BlockKey]) -> TransferHandle:
        """Stores the first `len(keys)` resident blocks (they start right after the streamed prefix)."""
        layers = [(layer.keys, layer.values) for layer in self.layers] if keys else []
        return self._kv.store(keys, self._codec.pack(layers, 0, len(keys)))

    def _recompute_prefix(self) -> None:
        """A streamed block is lost: recompute the streamed prefix from its tokens and keep it resident."""
        num_tokens = self.num_streamed_tokens
        self._emit("recompute", num_tokens)
        load, self._load = self._load, None
        load.wait()  # nothing may still write the staging buffer
        if self._pending is not None:  # its blocks follow the streamed prefix: store them again later
            self._pending[1].wait()
            self._pending = None
        scratch = DynamicCache(config=self._binding.model.config)
        ids = self._prompt[:num_tokens][None].to(self._binding.device)
        with torch.no_grad():
            self._binding.model.base_model(input_ids=ids, past_key_values=scratch, use_cache=True)
        for layer, computed in zip(self.layers, scratch.layers):
            layer.prepend(computed.keys, computed.values)
        self._unpin(self._prompt_keys[: self._num_streamed])
        self._num_streamed = 0

    # ---- pins ----------------------------------------------------------------------------

    def _pin_leading(self, keys: Sequence[BlockKey]) -> int:
        """Pins keys in order until one is no longer stored; returns how many were pinned."""
        n = 0
        while n < len(keys) and self._kv.pin([keys[n]]):
            n += 1
        return n

    def _unpin(self, keys: Sequence[BlockKey]) -> None:
        # A block dropped after a failed read lost its pins: `unpin` skips it.
        self._kv.unpin(keys)

    def _emit(self, event: str, value: int) -> None:
        if self._observer is not None:
            self._observer(event, value)
