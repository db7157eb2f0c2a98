"""The vLLM connector's config in the fewest words (`kvtier.integrations.vllm.engine_config`).

Tiers given in `kv_connector_extra_config` (`dram`, `ssd`, `pool`) or `KVTIER_*` variables, a YAML
for the rest, or nothing at all (a DRAM tier sized from the memory available, said in one line);
the model is the engine's unless a YAML names one, which is then checked. Pure: engine facts made
by hand, no engine; the real `vllm serve` with a short form is in test_vllm_serve.py.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import engine_config as ec
from kvtier.integrations.vllm.settings import EngineFacts, read_settings
from kvtier.kinds import TierKind
from support.vllm import BLOCK, LAYER_NAMES, PAGE_BYTES

MiB, GiB = 1 << 20, 1 << 30


def _facts(**changes) -> EngineFacts:
    facts = EngineFacts(model_id="/models/served", block_size=BLOCK, kv_dtype="float32", layer_names=LAYER_NAMES,
                        page_bytes=PAGE_BYTES, device_type="cpu", kv_role="kv_both")
    return replace(facts, **changes)


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for name in ec.ENV.values():
        monkeypatch.delenv(name, raising=False)


def test_short_forms_make_the_tiers_and_the_model_is_the_engines(tmp_path):
    settings = read_settings({"dram": "4MiB", "ssd": f"{tmp_path}/kv:8MiB", "pool": "32MiB@127.0.0.1:7070,[::1]:7071"},
                             _facts())
    config = settings.config
    assert config.model == "/models/served" and settings.config_path is None
    assert config.tier(TierKind.DRAM).capacity_bytes == 4 * MiB
    ssd = config.tier(TierKind.SSD)
    assert (ssd.path, ssd.capacity_bytes) == (tmp_path / "kv", 8 * MiB)
    pool = config.tier(TierKind.POOL)
    assert (pool.nodes, pool.capacity_bytes) == (("127.0.0.1:7070", "[::1]:7071"), 32 * MiB)
    assert settings.config_source == ("dram from kv_connector_extra_config.dram, ssd from kv_connector_extra_config.ssd, "
                                      "pool from kv_connector_extra_config.pool")
    assert settings.layout.layer_bytes == (PAGE_BYTES,) * len(LAYER_NAMES)


def test_a_pool_without_a_size_gets_the_default_share():
    pool = read_settings({"dram": "4MiB", "pool": "10.0.0.5:7070"}, _facts()).config.tier(TierKind.POOL)
    assert pool.capacity_bytes == ec.DEFAULT_POOL_BYTES and pool.nodes == ("10.0.0.5:7070",)


def test_environment_variables_give_tiers_and_the_extra_config_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DRAM", "8MiB")
    monkeypatch.setenv("KVTIER_SSD", f"{tmp_path}/kv:16MiB")
    settings = read_settings({"dram": "4MiB"}, _facts())
    assert settings.config.tier(TierKind.DRAM).capacity_bytes == 4 * MiB  # the extra config's
    assert settings.config.tier(TierKind.SSD).capacity_bytes == 16 * MiB  # the variable's
    assert "ssd from KVTIER_SSD" in settings.config_source
    monkeypatch.setenv("KVTIER_DRAM", "  ")  # empty: unset, so the default DRAM goes in front of the SSD
    config = read_settings({}, _facts()).config
    assert [t.kind for t in config.tiers] == [TierKind.DRAM, TierKind.SSD]


def test_a_short_form_sets_the_yamls_tier_size_and_keeps_the_rest(tmp_path, monkeypatch):
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"tenant": "team-a", "tiers": {"dram": {"capacity": "64MiB", "policy": "s3fifo"}}}))
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    settings = read_settings({"dram": "4MiB"}, _facts())
    dram = settings.config.tier(TierKind.DRAM)
    assert (dram.capacity_bytes, dram.policy.value) == (4 * MiB, "s3fifo")
    assert settings.config.tenant == "team-a" and settings.config_path == path
    assert settings.config_source == f"{path}, dram from kv_connector_extra_config.dram"


def test_no_tier_anywhere_gives_a_dram_tier_sized_from_the_memory_available(monkeypatch, caplog):
    import kvtier.tiers.host_memory as host_memory

    monkeypatch.setattr(host_memory, "available_memory", lambda: (10 * GiB + 123, "available now (MemAvailable)"))
    with caplog.at_level(logging.INFO, logger="kvtier"):
        settings = read_settings({}, _facts())
    assert settings.config.tier(TierKind.DRAM).capacity_bytes == 10 * GiB // 4 // (256 * MiB) * (256 * MiB)
    said = [r.getMessage() for r in caplog.records if "no tier configured" in r.getMessage()]
    assert len(said) == 1 and "a DRAM tier of 2.5 GiB" in said[0] and "1/4 of the 10 GiB" in said[0], said
    assert "KVTIER_DRAM" in said[0] and settings.config_source == "defaults"
    monkeypatch.setattr(host_memory, "available_memory", lambda: (1 << 50, "available now (MemAvailable)"))
    assert read_settings({}, _facts()).config.tier(TierKind.DRAM).capacity_bytes == ec.DEFAULT_DRAM_MAX
    monkeypatch.setattr(host_memory, "available_memory", lambda: None)
    assert read_settings({}, _facts()).config.tier(TierKind.DRAM).capacity_bytes == ec.DEFAULT_DRAM_MIN


def test_a_yaml_without_model_or_block_size_takes_the_engines_and_says_nothing_of_them(tmp_path, caplog):
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"dram": {"capacity": "4MiB"}}}))
    with caplog.at_level(logging.INFO, logger="kvtier"):
        settings = read_settings({"kvtier_config": str(path)}, _facts(page_bytes=12288, block_size=64))
    assert settings.config.model == "/models/served" and settings.block_tokens == 64
    assert not [r for r in caplog.records if "does not apply" in r.getMessage()]


def test_a_yaml_naming_another_model_is_refused_in_one_line(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"model": "llama-3-8b", "tiers": {"dram": {"capacity": "4MiB"}}}))
    with pytest.raises(ConfigError) as e:
        read_settings({"kvtier_config": str(path)}, _facts())
    message = str(e.value)
    assert "\n" not in message and "describes 32 KV layers" in message and "leave model out" in message


@pytest.mark.parametrize("extra, message", [
    ({"dram": "lots"}, "kv_connector_extra_config.dram: cannot read 'lots' as a size"),
    ({"dram": "0B"}, "kv_connector_extra_config.dram: 0B is not a positive size"),
    ({"dram": 8}, "kv_connector_extra_config.dram: expected a string such as 8GiB"),
    ({"ssd": "/nvme/kv"}, "kv_connector_extra_config.ssd: expected DIR:SIZE"),
    ({"ssd": ":8GiB"}, "kv_connector_extra_config.ssd: expected DIR:SIZE"),
    ({"pool": "10.0.0.5"}, "kv_connector_extra_config.pool: expected HOST:PORT"),
    ({"pool": "10.0.0.5:7070,"}, "kv_connector_extra_config.pool: an empty node"),
    ({"pool": "big@10.0.0.5:7070"}, "kv_connector_extra_config.pool: cannot read 'big' as a size"),
    ({"kvtier_config": ""}, "kv_connector_extra_config.kvtier_config: expected the path"),
    ({"kvtier_config": "/nonexistent/kvtier.yaml"}, "/nonexistent/kvtier.yaml"),
])
def test_bad_short_forms_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_settings(extra, _facts())


def test_a_bad_variable_is_named(monkeypatch):
    monkeypatch.setenv("KVTIER_POOL", "nowhere")
    with pytest.raises(ConfigError, match="KVTIER_POOL: expected HOST:PORT"):
        read_settings({}, _facts())


def test_the_shipped_example_yaml_is_one_the_connector_takes():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "vllm.yaml"
    given = ec.engine_config({"kvtier_config": str(path)}, "/models/served", environ={})
    assert not given.model_given and given.config.model == "/models/served"
    assert [t.kind for t in given.config.tiers] == [TierKind.DRAM, TierKind.SSD] and given.config.tier(TierKind.SSD).persist
    resized = ec.engine_config({"kvtier_config": str(path), "dram": "1GiB"}, "/models/served", environ={})
    assert resized.config.tier(TierKind.DRAM).capacity_bytes == GiB
    assert resized.config.tier(TierKind.DRAM).policy.value == "s3fifo"


def test_a_malformed_yaml_tier_is_refused_even_where_a_short_form_resizes_it(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"dram": "64MiB"}}))
    with pytest.raises(ConfigError, match=r"tiers\.dram: expected a mapping, got '64MiB'"):
        read_settings({"kvtier_config": str(path), "dram": "4MiB"}, _facts())
