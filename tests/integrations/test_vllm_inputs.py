"""A vLLM request's inputs besides its token ids in its block keys (`vllm_inputs`, `vllm_overrides`).

Fake requests carry what vLLM's `Request` does (`lora_request`, `mm_features`, `prompt_embeds`,
`cache_salt`); the multimodal placement is checked against vLLM's own `_gen_mm_extra_hash_keys`.
Real engines run these inputs in tests/attacks/test_attack_vllm_request_keys.py.
Cost: a few seconds (random adapters written to tmp_path, a DRAM backend).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.inputs import (
    AdapterFingerprints,
    Refusal,
    RefusalReason,
    RequestInputs,
    read_inputs,
)
from kvtier.integrations.vllm.metrics import EngineCollector
from kvtier.integrations.vllm.overrides import config_overrides
from kvtier.integrations.vllm.scheduler import KeyDirectory, RequestTracker, ScheduledRequest, SchedulerSide
from kvtier.integrations.vllm.settings import EngineFacts, read_settings
from kvtier.model.keys import block_keys
from kvtier.runtime import KVTier
from support.lora import build_lora
from support.vllm import BLOCK, LAYER_NAMES, P1, PAGE_BYTES, _yaml


@dataclass
class LoRA:
    lora_name: str
    lora_int_id: int
    lora_path: str
    load_inplace: bool = False


@dataclass
class Position:
    offset: int
    length: int


@dataclass
class Feature:
    identifier: Any
    mm_position: Position
    modality: str = "image"


@dataclass
class Request:
    """The fields of vLLM's `Request` the scheduler half reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    lora_request: LoRA | None = None
    cache_salt: str | None = None
    mm_features: list[Feature] = field(default_factory=list)
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@pytest.fixture
def settings(tmp_path, tiny_model):
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")
    return read_settings({"kvtier_config": str(_yaml(tmp_path / "kvtier.yaml", tiny_model,
                                                     {"dram": {"capacity": "4MiB"}}))}, facts)


def _keys(settings, request, adapters=None) -> list[bytes]:
    inputs = read_inputs(request, adapters or AdapterFingerprints())
    assert not isinstance(inputs, Refusal), inputs
    return RequestTracker(request, settings.namespace, inputs).keys_for(len(request.all_token_ids) // BLOCK)


def _lora(path: Path, seed: int) -> Path:
    return build_lora(path, seed=seed, num_layers=4, hidden_size=128, kv_dim=64)


# ---- a plain request keeps its keys --------------------------------------------------------------


def test_a_request_without_other_inputs_keeps_the_keys_of_its_tokens(settings):
    request = Request("a", list(P1))
    assert read_inputs(request, AdapterFingerprints()).plain
    assert _keys(settings, request) == block_keys(settings.namespace, P1)


def test_keys_extended_block_by_block_equal_keys_made_at_once(settings, tmp_path):
    request = Request("a", list(P1), cache_salt="s", lora_request=LoRA("a", 1, str(_lora(tmp_path / "a", 1))),
                      mm_features=[Feature("img", Position(20, 50))], prompt_embeds=torch.randn(len(P1), 8))
    tracker = RequestTracker(request, settings.namespace, read_inputs(request, AdapterFingerprints()))
    stepwise = [tracker.keys_for(n)[-1] for n in range(1, 5)]
    assert stepwise == _keys(settings, request)


# ---- cache_salt ------------------------------------------------------------------------------------


def test_a_cache_salt_changes_every_key_and_the_same_salt_gives_the_same_keys(settings):
    plain = _keys(settings, Request("p", list(P1)))
    a, b = (_keys(settings, Request(s, list(P1), cache_salt=s)) for s in ("tenant-a", "tenant-b"))
    assert all(x != y for x, y in zip(a, plain)) and all(x != y for x, y in zip(a, b))
    assert _keys(settings, Request("again", list(P1), cache_salt="tenant-a")) == a


# ---- LoRA ---------------------------------------------------------------------------------------


def test_adapters_are_named_by_their_files_never_by_name_id_or_path(settings, tmp_path):
    a, b = _lora(tmp_path / "a", 1), _lora(tmp_path / "b", 2)
    copy = Path(shutil.copytree(a, tmp_path / "elsewhere"))
    keys = {name: _keys(settings, Request(name, list(P1), lora_request=lora)) for name, lora in {
        "a": LoRA("a", 1, str(a)), "b": LoRA("a", 1, str(b)),  # B under A's name and id
        "a copied": LoRA("other", 7, str(copy))}.items()}  # A's files under another name, id and path
    plain = _keys(settings, Request("p", list(P1)))
    assert all(x != y for x, y in zip(keys["a"], plain))  # every block names the adapter
    assert all(x != y for x, y in zip(keys["a"], keys["b"]))
    assert keys["a copied"] == keys["a"]


def test_an_adapter_rebuilt_in_place_or_reconfigured_is_another_adapter(tmp_path):
    adapters, path = AdapterFingerprints(), _lora(tmp_path / "a", 1)
    before = AdapterFingerprints().fingerprint(LoRA("a", 1, str(path)))
    _lora(path, 2)  # the same path, shapes and file sizes
    assert AdapterFingerprints().fingerprint(LoRA("a", 1, str(path))) != before
    config = path / "adapter_config.json"
    rebuilt = adapters.fingerprint(LoRA("a", 1, str(path)))
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 16'))
    assert AdapterFingerprints().fingerprint(LoRA("a", 1, str(path))) != rebuilt


def test_an_id_whose_files_changed_is_refused_unless_vllm_reloads_it(tmp_path):
    """vLLM keeps serving the weights it loaded under an id: kvtier cannot tell which KV it computes."""
    adapters, path = AdapterFingerprints(), _lora(tmp_path / "a", 1)
    first = adapters.fingerprint(LoRA("a", 1, str(path)))
    _lora(path, 2)
    refusal = adapters.fingerprint(LoRA("a", 1, str(path)))
    assert isinstance(refusal, Refusal) and refusal.reason is RefusalReason.LORA_CHANGED
    assert "id 1" in refusal.detail and str(path) in refusal.detail
    new = adapters.fingerprint(LoRA("a", 2, str(path)))  # a new id: vLLM loads the files anew
    assert isinstance(new, bytes) and new != first
    assert adapters.fingerprint(LoRA("a", 1, str(path), load_inplace=True)) == new  # reloaded in place


@pytest.mark.parametrize("make", [
    lambda tmp: str(tmp / "missing"),
    lambda tmp: str(Path(tmp / "empty").mkdir() or tmp / "empty"),
    lambda tmp: str(Path(_lora(tmp / "noconfig", 1), "adapter_config.json").unlink() or tmp / "noconfig"),
    lambda tmp: "",
])  # fmt: skip
def test_an_adapter_kvtier_cannot_read_is_refused(tmp_path, make):
    refusal = AdapterFingerprints().fingerprint(LoRA("a", 1, make(tmp_path)))
    assert isinstance(refusal, Refusal) and refusal.reason is RefusalReason.LORA_UNREADABLE


# ---- multimodal items ----------------------------------------------------------------------------

LAYOUTS = [
    [(0, 32)],  # exactly block 0
    [(10, 100)],  # across four blocks
    [(5, 3), (8, 2), (40, 30)],  # two in one block, one across a boundary
    [(32, 32), (64, 1), (127, 2)],  # on boundaries; the last ends in block 4
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_items_go_on_the_blocks_their_placeholders_overlap_as_in_vllm(layout):
    from vllm.v1.core.kv_cache_utils import _gen_mm_extra_hash_keys

    features = [Feature(f"hash{i}", Position(o, n)) for i, (o, n) in enumerate(layout)]
    request = Request("a", list(P1), mm_features=features)
    inputs = read_inputs(request, AdapterFingerprints())
    mm_index = 0
    for start in range(0, 160, BLOCK):
        theirs, mm_index = _gen_mm_extra_hash_keys(request, start, start + BLOCK, mm_index)
        ours = [(identifier.decode(), offset) for identifier, offset, _ in inputs.mm_in_block(start, start + BLOCK)]
        assert ours == [(identifier, offset) for _, identifier, offset in theirs], start


def test_another_image_changes_the_keys_from_the_first_block_it_touches(settings):
    def keys(identifier: str) -> list[bytes]:
        return _keys(settings, Request(identifier, list(P1), mm_features=[Feature(identifier, Position(40, 50))]))

    cat, dog = keys("cat-hash"), keys("dog-hash")
    assert cat[0] == dog[0] == block_keys(settings.namespace, P1)[0]  # block 0 holds text only
    assert all(x != y for x, y in zip(cat[1:], dog[1:]))
    assert keys("cat-hash") == cat
    moved = _keys(settings, Request("m", list(P1), mm_features=[Feature("cat-hash", Position(41, 50))]))
    assert moved[1] != cat[1]  # the same image at another offset in the block


@pytest.mark.parametrize("identifier", [None, "", "renderer0-mm-7-image-0", "lora-a:renderer1-mm-12-image-3"])
def test_an_item_without_a_content_hash_is_refused(identifier):
    request = Request("a", list(P1), mm_features=[Feature(identifier, Position(40, 50))])
    refusal = read_inputs(request, AdapterFingerprints())
    assert isinstance(refusal, Refusal) and refusal.reason is RefusalReason.MM_UNHASHED


# ---- prompt embeddings -----------------------------------------------------------------------------


def test_prompt_embeds_key_each_block_by_its_rows(settings):
    zeros = [0] * len(P1)  # vLLM's token ids for an embeddings prompt
    first = torch.randn(len(P1), 16, generator=torch.Generator().manual_seed(1))
    second = first.clone()
    second[100] += 1  # a row of block 3

    def keys(embeds: torch.Tensor) -> list[bytes]:
        return _keys(settings, Request("e", zeros, prompt_embeds=embeds))

    assert keys(first.clone()) == keys(first)  # the values, not the tensor object
    assert keys(second)[:3] == keys(first)[:3] and keys(second)[3] != keys(first)[3]
    assert keys(first.to(torch.bfloat16)) != keys(first)  # the dtype is part of them
    assert keys(first)[0] != block_keys(settings.namespace, zeros)[0]
    mixed = [True] * 40 + [False] * (len(P1) - 40)
    assert _keys(settings, Request("m", zeros, prompt_embeds=first, prompt_is_token_ids=mixed))[0] != keys(first)[0]


# ---- the scheduler side: a request it cannot key is a counted miss, never stored -------------------


def test_a_refused_request_never_hits_never_stores_and_is_counted(settings, tmp_path, caplog):
    backend = KVTier(settings.config, layout=settings.layout)
    from kvtier.integrations.vllm.backends import SHARED

    SHARED.acquire(settings.backend_id(), lambda: backend)
    try:
        keys = block_keys(settings.namespace, P1)
        blocks = torch.randint(0, 256, (len(keys), backend.layout.block_bytes), dtype=torch.uint8)
        assert backend.store(keys, blocks).wait(10)
        side = SchedulerSide(settings, KeyDirectory(settings, 100))
        assert side.num_matched_tokens(Request("plain", list(P1)), 0) == 4 * BLOCK
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            for name in ("x", "y"):
                request = Request(name, list(P1), mm_features=[Feature("renderer0-mm-1-image-0", Position(0, 8))])
                assert side.num_matched_tokens(request, 0) == 0
                side.after_alloc(request, [1, 2, 3, 4, 5], 0)
        assert len([r for r in caplog.records if "no content hash" in r.message]) == 1  # once per reason
        assert side.plan_step([ScheduledRequest("x", len(P1))], lambda r: [[1, 2, 3, 4, 5]]).stores == []
        assert side.prompt_blocks.unkeyable == 8
        assert side.prompt_blocks.unkeyable_requests == {"mm_unhashed": 2}
        metrics = {(s.name, tuple(s.labels.items())): s.value for f in
                   EngineCollector(1, lambda rank: None, side.prompt_blocks).collect() for s in f.samples}
        assert metrics[("kvtier_vllm_unkeyable_prompt_blocks_total", ())] == 8
        assert metrics[("kvtier_vllm_unkeyable_requests_total", (("reason", "mm_unhashed"),))] == 2
        assert metrics[("kvtier_vllm_unkeyable_requests_total", (("reason", "lora_changed"),))] == 0
    finally:
        SHARED.release(settings.backend_id())


# ---- the engine's config overrides -----------------------------------------------------------------


@dataclass
class ModelConfig:
    hf_overrides: Any = field(default_factory=dict)
    hf_config_path: str | None = None
    quantization_config: Any = None
    hf_text_config: Any = None
    hf_config: Any = None
    max_model_len: int = 4096


@dataclass
class CacheConfig:
    kv_cache_dtype_skip_layers: list[str] = field(default_factory=list)


@dataclass
class HFConfig:
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None

    def to_dict(self) -> dict:
        return dict(vars(self))


def test_an_engine_without_overrides_keeps_its_namespace(settings):
    plain = config_overrides(ModelConfig(hf_text_config=HFConfig({"rope_type": "default", "rope_theta": 1e4})),
                             CacheConfig())
    assert plain == {}
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both",
                        config_overrides=tuple(plain.items()))
    assert read_settings({"kvtier_config": str(settings.config_path)}, facts).namespace == settings.namespace


def test_each_override_changes_the_namespace_and_is_said_once(settings, caplog):
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    long_rope = HFConfig({"rope_type": "longrope", "long_factor": [1.0]}, original_max_position_embeddings=4096)
    cases = {"hf_overrides": (ModelConfig(hf_overrides=rope), CacheConfig()),
             "hf_overrides fn": (ModelConfig(hf_overrides=lambda c: c, hf_config=HFConfig({"rope_theta": 5.0})),
                                 CacheConfig()),
             "quantization_config": (ModelConfig(quantization_config={"bits": 4}), CacheConfig()),
             "kv_cache_dtype_skip_layers": (ModelConfig(), CacheConfig(["model.layers.0.self_attn.attn"])),
             "long factors": (ModelConfig(hf_text_config=long_rope, max_model_len=8192), CacheConfig()),
             "short factors": (ModelConfig(hf_text_config=long_rope, max_model_len=4096), CacheConfig())}
    namespaces = {settings.namespace.digest}
    facts = EngineFacts(model_id="tiny", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")
    for name, (model, cache) in cases.items():
        overrides = tuple(config_overrides(model, cache).items())
        assert overrides, name
        with caplog.at_level(logging.INFO, logger="kvtier"):
            caplog.clear()
            changed = read_settings({"kvtier_config": str(settings.config_path)},
                                    replace(facts, config_overrides=overrides))
        said = [r.message for r in caplog.records if "config overrides" in r.message]
        assert len(said) == 1 and overrides[0][0] in said[0], name
        namespaces.add(changed.namespace.digest)
    assert len(namespaces) == len(cases) + 1
