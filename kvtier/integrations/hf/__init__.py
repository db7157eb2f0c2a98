"""Hugging Face transformers: `adapter.HFKVTier` serves a model's prefix KV from kvtier.

`codec` (a transformers cache to and from kvtier blocks), `prefix` (prefix lookup and loading),
`stream` (layer-by-layer loading during the forward), `tiny_model` (a random-weight Llama built
locally, for the demo and the benches)."""
