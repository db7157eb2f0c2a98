"""Hugging Face transformers on kvtier: `Cache` objects whose KV blocks live in kvtier's tiers.

    hf = HFKVTier(model, kv, Namespace(model="org/model@rev", kv_dtype="fp32", block_tokens=16))
    cache = hf.prefix_cache()                  # or hf.streaming_cache()
    num_cached = cache.prepare(input_ids)      # the longest stored prefix: not recomputed
    out = model.generate(input_ids, past_key_values=cache, do_sample=False, max_new_tokens=32)
    cache.save(out[0]).wait()                  # the full blocks this request computed
    cache.close()

Two caches, for two memory budgets (both batch 1, full-attention models):

- `KVTierPrefixCache` (a `DynamicCache`): the sequence's KV is resident on the model's device;
  kvtier only carries prefixes from one request to the next.
- `KVTierStreamingCache`: for a sequence whose KV should not stay on the device (larger than the
  HBM budget). The prompt's full blocks live in kvtier, pinned, wherever they fit (HBM, DRAM, pool,
  SSD); every forward streams them back layer by layer — see `hf_stream` for how far ahead.

Both give the tokens a `DynamicCache` gives: a block is either the exact bytes the model computed
(checksummed below DRAM) or a miss that is recomputed.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

if importlib.util.find_spec("transformers") is None:  # the caches below subclass its Cache classes
    raise ImportError("kvtier.integrations.hf.adapter needs Hugging Face transformers: pip install 'kvtier[hf]'")

from kvtier.errors import ConfigError
from kvtier.integrations.hints import HintReader
from kvtier.integrations.hf.codec import BlockCodec, bind_model
from kvtier.integrations.hf.prefix import KVTierPrefixCache, leading_ok, token_ids_1d
from kvtier.integrations.hf.stream import KVTierStreamingCache, Observer
from kvtier.model.keys import BlockKey, Namespace, block_keys
from kvtier.runtime import KVTier
from kvtier.model.weights import WeightsSource, fingerprint_config, fingerprint_tensors, weights_fingerprint
from kvtier.tiers.dram import host_rows

log = logging.getLogger(__name__)

__all__ = ["Generation", "HFKVTier", "KVTierPrefixCache", "KVTierStreamingCache", "Observer", "config_of",
           "model_fingerprint", "weights_of"]


class HFKVTier:
    """A transformers causal LM bound to a `KVTier`: makes the caches of its requests.

    Args:
        model: a loaded `PreTrainedModel` (e.g. `AutoModelForCausalLM`) with full-attention layers.
        kv: the runtime holding the blocks; its layout must be this model's.
        namespace: the namespace block keys are made in. This binding sets its `weights` to
            `<weights>;<config>` (`model_fingerprint`): `<weights>` is the namespace's own when
            given (the caller names the weights, e.g. with a checkpoint digest), else a
            fingerprint of the model's tensors as loaded (`weights_of`: the weights actually
            used, whatever path they came from); `<config>` is always the loaded model's config
            and the buffers outside `state_dict()` (`config_of`: RoPE settings change the KV as
            much as weights do). `self.namespace` is the one keys are made in. Build a new
            `HFKVTier` after changing the model's weights or config in place: the fingerprint
            is taken here.

    Raises:
        GeometryError, ConfigError: the model's layers, KV heads, head size or dtype do not give
            `kv.layout`, or the namespace's block size or KV dtype differ (see `bind_model`).
    """

    def __init__(self, model: Any, kv: KVTier, namespace: Namespace) -> None:
        self.codec: BlockCodec = bind_model(model.config, model.dtype, kv.layout, namespace)
        namespace = replace(namespace, weights=model_fingerprint(model, namespace.weights))
        self.model, self.kv, self.namespace = model, kv, namespace
        _log_key_change(kv)
        self.device = model.device
        self.hints = HintReader(kv.config.hints.limits.max_retain_s)  # counts the hints it refuses

    def prefix_cache(self) -> KVTierPrefixCache:
        """A new request's resident cache (a `DynamicCache`)."""
        return KVTierPrefixCache(self)

    def streaming_cache(self, observer: Observer | None = None) -> KVTierStreamingCache:
        """A new request's streaming cache.

        Args:
            observer: called as `observer(event, value)` on each step of the pipeline, for tests
                and tracing: `load_issued` (blocks), `store_issued` (blocks), `update_enter`,
                `layer_loaded` (the streamed prefix of that layer arrived) and `update_return`
                (layer), `recompute` (tokens).
        """
        return KVTierStreamingCache(self, observer)

    def generate(self, input_ids: Any, *, streaming: bool = False, kv_hints: Mapping[str, Any] | None = None,
                 **generate_kwargs: Any) -> Generation:
        """`model.generate` through a kvtier cache: prepare, generate, save (waited), close.

        Args:
            input_ids: the prompt, 1-D or `[1, T]`.
            streaming: use a `KVTierStreamingCache` instead of a `KVTierPrefixCache`.
            kv_hints: the request's retention hint, `{"kvtier": {"retain_s": .., "session": .., "closed": ..}}`
                as vLLM takes it in `kv_transfer_params`; applied to the sequence's blocks once
                saved (`apply_hint`). A malformed one is refused and counted, never raised.
            generate_kwargs: passed to `model.generate` (not `past_key_values`).

        Raises:
            ConfigError: `generate_kwargs` carry a model input besides the token ids (a tensor such
                as `inputs_embeds`, `pixel_values` or a padding `attention_mask`): blocks are keyed
                by token ids, so its KV would be served to every prompt of the same tokens.
        """
        _refuse_inputs_beside_tokens(generate_kwargs)
        ids = token_ids_1d(input_ids)[None].to(self.device)
        cache = self.streaming_cache() if streaming else self.prefix_cache()
        try:
            num_cached = cache.prepare(ids)
            output = self.model.generate(ids, past_key_values=cache, **generate_kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            handle = cache.save(sequences[0])
            handle.wait()
        finally:
            cache.close()
        if kv_hints is not None:
            self.apply_hint(sequences[0], kv_hints)
        return Generation(output, num_cached, len(handle.ok_keys))

    def apply_hint(self, token_ids: Any, params: Any, *, session_id: str | None = None,
                   tenant: str | None = None) -> bool:
        """Applies the retention hint in `params` (`kvtier.integrations.hints`) to the full blocks of
        `token_ids`, a sequence whose blocks were saved: a lease covers only the blocks kvtier holds.

        Args:
            token_ids: the sequence, 1-D or `[1, T]`.
            params: `{"kvtier": {...}}`; None or a mapping without `kvtier`: no hint.
            session_id: the caller's session for the request, used when the hint names none.
            tenant: whose retention budget a lease is charged to (default: the kvtier config's).
        Returns:
            Whether a hint was applied. A malformed one is refused, counted in `self.hints.refused`
            (by `HintRefusal`) and logged; one kvtier refuses is counted in its `snapshot()["hints"]`.
        """
        hint = self.hints.read(params, session_id)
        if hint is None:
            return False
        ids = token_ids_1d(token_ids).tolist()
        keys = block_keys(self.namespace, ids[: len(ids) // self.codec.block_tokens * self.codec.block_tokens])
        return self.kv.apply_hint(keys, session=hint.session, retain_s=hint.retain_s, closed=hint.closed,
                                  tenant=tenant)

    # ---- used by the caches --------------------------------------------------------------

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A host buffer of `num_blocks` blocks (pinned when the model runs on CUDA; page-aligned rows)."""
        return host_rows(num_blocks, self.codec.layout.block_bytes, pinned=self.device.type == "cuda")

    def load_prefix(self, keys: Sequence[BlockKey]) -> tuple[torch.Tensor, int]:
        """Loads `keys` and waits; returns the staging buffer and how many leading blocks arrived."""
        blocks = self.staging(len(keys))
        if not keys:
            return blocks, 0
        handle = self.kv.load(keys, blocks, sync=True)  # waited for at once: copied in this thread
        return blocks, leading_ok(keys, handle)


def _refuse_inputs_beside_tokens(generate_kwargs: dict[str, Any]) -> None:
    """Tensors among `generate` kwargs are model inputs that shape K/V (an all-ones attention mask does not)."""
    for name, value in generate_kwargs.items():
        if isinstance(value, torch.Tensor) and not (name == "attention_mask" and bool(value.all())):
            raise ConfigError(f"HFKVTier.generate: {name} shapes the KV but kvtier keys blocks by token ids only; "
                              "generate without kvtier for prompts that carry it")


def model_fingerprint(model: Any, weights: str = "") -> str:
    """`Namespace.weights` for a loaded model: `<weights>;<config>`.

    Args:
        weights: the caller's name for the weights (e.g. `id:<digest>`); empty: `weights_of(model)`.

    Raises:
        ConfigError: the weights are not named and cannot be fingerprinted (see `weights_of`), or the
            config cannot be (see `config_of`).
    """
    return f"{weights or weights_of(model)};{config_of(model)}"


def config_of(model: Any) -> str:
    """The `config:` fingerprint of a loaded model (`kvtier.model.weights.fingerprint_config`).

    It covers `model.config.to_dict()` (sub-configs included; the RoPE base and scaling, layer
    and head counts, norms, quantization, the transformers version that resolves them), the
    attention implementation the model runs (eager, sdpa, flash differ in rounding), and every
    buffer outside `state_dict()` (RoPE's non-persistent `inv_freq`; persistent buffers are in
    `weights_of`). Only where the files came from is left out (`_name_or_path`, `_commit_hash`):
    the same model at another path shares its KV. A buffer without bytes here (the `meta`
    device) enters by name, dtype and shape only.

    Raises:
        ConfigError: a config value has no canonical JSON form (see `fingerprint_config`).
    """
    config = model.config.to_dict()
    config["_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    in_state = set(model.state_dict())
    buffers = [(name, b) for name, b in model.named_buffers() if name not in in_state]
    config["_meta_buffers"] = [f"{name}:{b.dtype}{tuple(b.shape)}" for name, b in buffers if b.is_meta]
    try:
        return fingerprint_config(config, [(name, b) for name, b in buffers if not b.is_meta])
    except ValueError as e:
        raise ConfigError(f"Namespace.weights: {e}; the KV of a model whose config cannot be fingerprinted "
                          "cannot be told from another's") from None


def _log_key_change(kv: KVTier) -> None:
    """One line where blocks outlive the process (a persistent SSD tier, a pool): keys changed."""
    lasting = kv.config.lasting_tier()
    if lasting is not None:
        log.info("kvtier: Hugging Face block keys now name the model's config and its buffers besides its "
                 "weights; blocks an older kvtier stored on the %s are misses under the new keys, never served",
                 lasting)


def weights_of(model: Any) -> str:
    """The fingerprint of a loaded model's weights (`Namespace.weights`).

    Its tensors in `state_dict()` order (names, dtypes, shapes and sampled bytes: see
    `fingerprint_tensors`), so two models loaded from one path before and after it was rebuilt
    differ. Where tensors hold no bytes here (offloaded to disk: the `meta` device), the files at
    the model's `name_or_path` instead.

    Raises:
        ConfigError: the tensors hold no bytes and the model names no path to read instead.
    """
    try:
        return fingerprint_tensors(model.state_dict().items())
    except ValueError as e:
        source = str(getattr(model, "name_or_path", "") or "")
        if not source:
            raise ConfigError(f"Namespace.weights: cannot fingerprint the model's weights ({e}) and it names no "
                              "path to read them from; give Namespace(..., weights=...) naming them") from None
        log.info("kvtier: fingerprinting the files at %s instead of the tensors in memory (%s)", source, e)
        return weights_fingerprint(WeightsSource(source))


@dataclass(frozen=True)
class Generation:
    """What `HFKVTier.generate` returns.

    Attributes:
        output: what `model.generate` returned.
        num_cached_tokens: prompt tokens served by kvtier instead of computed.
        num_stored_blocks: blocks the final `save()` stored or found already stored (the
            streaming cache also stores prompt blocks during generation; those are not counted).
    """

    output: Any
    num_cached_tokens: int
    num_stored_blocks: int
