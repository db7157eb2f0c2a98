"""The YAML config loader: the embedded default, sizes, and every way a file can be wrong.

Each bad file is written to tmp_path and loaded through `load_config`, and the `ConfigError` must
name the field at fault by its dotted path. Two errors only show when the tiers are built (a
capacity below one block, an SSD directory that cannot be created): those go through `KVTier`.
Cost: well under a second; the only real I/O is small files in tmp_path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import CacheMode, KVTierConfig, TierConfig, load_config, parse_size
from kvtier.kinds import TierKind
from kvtier.errors import CapacityError, ConfigError, TierIOError
from kvtier.policy import PolicyKind
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TINY_BLOCK_BYTES = 16 * 512  # kvtier-tiny: 512 B/token x 16 tokens per block


def small_config(ssd_dir: Path) -> dict[str, Any]:
    """A valid config of kvtier-tiny with every local tier, a few blocks each."""
    return {
        "model": "kvtier-tiny",
        "block_tokens": 16,
        "mode": "exclusive",
        "tiers": {
            "hbm": {"capacity": "32KiB", "device": "cpu", "high_watermark": 0.9, "low_watermark": 0.5},
            "dram": {"capacity": "64KiB", "policy": "s3fifo"},
            "ssd": {"capacity": "256KiB", "path": str(ssd_dir), "num_files": 2, "o_direct": False},
        },
        "transfer": {"io_workers": 2, "chunk_bytes": "256KiB"},
        "prefetch": {"target": "dram", "budget": "16KiB"},
    }


def write_yaml(tmp_path: Path, raw: Any, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def load_dict(tmp_path: Path, raw: Any) -> KVTierConfig:
    return load_config(write_yaml(tmp_path, raw))


# ---- the embedded default --------------------------------------------------------------------


def test_embedded_default_loads_and_is_valid() -> None:
    cfg = load_config()
    assert cfg.model == "llama-3-8b" and cfg.block_tokens == 16 and cfg.mode is CacheMode.EXCLUSIVE
    assert [t.kind for t in cfg.tiers] == [TierKind.HBM, TierKind.DRAM, TierKind.SSD]
    hbm, dram, ssd = cfg.tiers
    assert (hbm.capacity_bytes, dram.capacity_bytes, ssd.capacity_bytes) == (128 * MiB, 256 * MiB, 1 * GiB)
    assert dram.policy is PolicyKind.S3FIFO and hbm.policy is PolicyKind.LRU
    assert all(t.low_watermark <= t.high_watermark for t in cfg.tiers)
    assert ssd.path == Path("/var/tmp/kvtier/ssd") and ssd.o_direct is None and ssd.num_files == 4
    assert cfg.tier(TierKind.POOL) is None and cfg.tier(TierKind.SSD) is ssd
    assert cfg.transfer.io_workers == 4 and cfg.prefetch.budget_bytes == 128 * MiB


def test_a_small_file_round_trips(tmp_path: Path) -> None:
    cfg = load_dict(tmp_path, small_config(tmp_path / "ssd"))
    assert cfg.model == "kvtier-tiny"
    assert [(t.kind, t.capacity_bytes) for t in cfg.tiers] == [
        (TierKind.HBM, 32 * KiB), (TierKind.DRAM, 64 * KiB), (TierKind.SSD, 256 * KiB)]  # fmt: skip
    assert cfg.tier(TierKind.HBM).device == "cpu" and cfg.tier(TierKind.SSD).o_direct is False
    assert cfg.transfer.io_workers == 2 and cfg.prefetch.budget_bytes == 16 * KiB


def test_optional_sections_may_be_omitted_or_null(tmp_path: Path) -> None:
    cfg = load_dict(tmp_path, {"model": "kvtier-tiny", "tiers": {"dram": {"capacity": 4096}},
                               "transfer": None, "prefetch": None})
    assert cfg.transfer.io_workers == 4 and cfg.transfer.chunk_bytes == 2**20
    assert cfg.tiers[0].high_watermark == 0.95 and cfg.tiers[0].low_watermark == 0.85
    assert cfg.hints.enabled and cfg.hints.limits.max_retain_s == 3600


def test_the_hints_section_sets_the_retention_limits(tmp_path: Path) -> None:
    cfg = load_dict(tmp_path, {"model": "kvtier-tiny", "tiers": {"dram": {"capacity": 4096}},
                               "hints": {"enabled": False, "max_retain_s": 600, "max_sessions": 8,
                                         "max_session_blocks": 100, "retain_fraction_per_tenant": 0.1,
                                         "retain_fraction": 0.3}})
    limits = cfg.hints.limits
    assert cfg.hints.enabled is False
    assert (limits.max_retain_s, limits.max_sessions, limits.max_session_blocks) == (600.0, 8, 100)
    assert (limits.retain_fraction_per_tenant, limits.retain_fraction) == (0.1, 0.3)


# ---- parse_size ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [("512MiB", 512 * MiB), ("4GB", 4 * 10**9), ("1.5GiB", 3 * GiB // 2), (1024, 1024), ("0", 0),
     ("4 kib", 4 * KiB), ("100", 100), ("2TB", 2 * 10**12), (0, 0), ("1e9", 10**9), ("4Gi", 4 * GiB),
     ("0.5KiB", 512), ("1.5TiB", 3 * 512 * GiB)],
)  # fmt: skip
def test_parse_size(value: Any, expected: int) -> None:
    assert parse_size(value, "tiers.dram.capacity") == expected


@pytest.mark.parametrize("value", ["12 parsecs", "-5MiB", "", "MiB", "1e", -1, True, None, 1.5, [1]])
def test_parse_size_rejects_naming_the_field(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\.dram\.capacity: "):
        parse_size(value, "tiers.dram.capacity")


@pytest.mark.parametrize("value,hint", [("4G", "4GiB .* or 4GB"), ("512m", "512MiB .* or 512MB"), ("2 t", "2TiB")])
def test_parse_size_refuses_a_bare_prefix_as_ambiguous(value: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=rf"^tiers\.dram\.capacity: '{value}' is ambiguous; write {hint}"):
        parse_size(value, "tiers.dram.capacity")


def test_sizes_are_read_in_one_place_with_the_callers_error() -> None:
    from kvtier.sizing.hardware import HardwareError

    for text in ("80GiB", "24GB", "1.5TiB", "512", "2 MiB", "1e9", "4Gi"):
        assert parse_size(text, "hbm", HardwareError) == parse_size(text, "hbm")
    for text in ("4G", "4g", "-1GiB", "24XB"):
        with pytest.raises(ConfigError, match="hbm"):
            parse_size(text, "hbm")
        with pytest.raises(HardwareError, match="hbm"):
            parse_size(text, "hbm", HardwareError)


# ---- every validation path names its field ---------------------------------------------------


def _set(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        raw = raw.setdefault(p, {})
    raw[leaf] = value


def _drop(raw: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        raw = raw[p]
    del raw[leaf]


# (field to set, value) -> the dotted path the error must start with
BAD_VALUES = [
    ("tiers.ssd.capacity", "12 parsecs", "tiers.ssd.capacity"),
    ("tiers.ssd.capacity", -4096, "tiers.ssd.capacity"),
    ("tiers.ssd.capacity", "-4KiB", "tiers.ssd.capacity"),
    ("tiers.ssd.capacity", True, "tiers.ssd.capacity"),
    ("tiers.hbm.capacity", 1.5, "tiers.hbm.capacity"),
    ("tiers.hbm.low_watermark", 0.95, "tiers.hbm.low_watermark"),  # above high_watermark 0.9
    ("tiers.hbm.low_watermark", 1.5, "tiers.hbm.low_watermark"),
    ("tiers.hbm.low_watermark", -0.1, "tiers.hbm.low_watermark"),
    ("tiers.hbm.high_watermark", True, "tiers.hbm.high_watermark"),
    ("tiers.hbm.high_watermark", "0.9", "tiers.hbm.high_watermark"),
    ("tiers.hbm.high_watermark", float("nan"), "tiers.hbm.high_watermark"),
    ("tiers.dram.policy", "fifo-ish", "tiers.dram.policy"),
    ("tiers.dram.admission", "sometimes", "tiers.dram.admission"),
    ("tiers.dram.admission", ["all"], "tiers.dram.admission"),
    ("tiers.dram.admission", {"kind": "reused", "min_hits": -1}, "tiers.dram.admission.min_hits"),
    ("tiers.dram.admission", {"kind": "reused", "hits": 2}, "tiers.dram.admission.hits"),
    ("tiers.ssd.path", "", "tiers.ssd.path"),
    ("tiers.ssd.path", 42, "tiers.ssd.path"),
    ("tiers.ssd.num_files", 0, "tiers.ssd.num_files"),
    ("tiers.ssd.num_files", True, "tiers.ssd.num_files"),
    ("tiers.ssd.o_direct", "sometimes", "tiers.ssd.o_direct"),
    ("tiers.ssd.o_direct", 1, "tiers.ssd.o_direct"),
    ("tiers.ssd.capasity", "1GiB", "tiers.ssd.capasity"),  # unknown tier field
    ("tiers.dram.path", "/var/tmp/x", "tiers.dram.path"),  # an SSD-only field on DRAM
    ("tiers.ssd.device", "cuda", "tiers.ssd.device"),  # an HBM-only field on SSD
    ("tiers.hbm", None, "tiers.hbm"),
    ("tiers.hbm", "32KiB", "tiers.hbm"),
    ("tiers.nvram", {"capacity": "1GiB"}, "tiers.nvram"),  # unknown tier name
    ("tiers.HBM", {"capacity": "1GiB"}, "tiers.hbm"),  # the same tier twice
    ("transfer.io_workers", 0, "transfer.io_workers"),
    ("transfer.io_workers", 1000, "transfer.io_workers"),
    ("transfer.io_workers", True, "transfer.io_workers"),
    ("transfer.io_workers", 2.0, "transfer.io_workers"),
    ("transfer.io_workers", "four", "transfer.io_workers"),
    ("transfer.copy_threads", 0, "transfer.copy_threads"),
    ("transfer.copy_threads", 65, "transfer.copy_threads"),
    ("transfer.chunk_bytes", "lots", "transfer.chunk_bytes"),
    ("promote_to", "pool", "promote_to"),  # a tier that is not configured
    ("prefetch.target", "pool", "prefetch.target"),
    ("transfer.threads", 4, "transfer.threads"),
    ("transfer", 4, "transfer"),
    ("prefetch", ["dram"], "prefetch"),
    ("prefetch.budget", "lots", "prefetch.budget"),
    ("prefetch.target", "l3", "prefetch.target"),
    ("prefetch.when", "always", "prefetch.when"),
    ("mode", "write-back", "mode"),
    ("promote_to", "cloud", "promote_to"),
    ("block_tokens", 0, "block_tokens"),
    ("block_tokens", True, "block_tokens"),
    ("tier", {"hbm": {}}, "tier"),  # unknown top-level field
    ("model", "", "model"),
    ("model", 8, "model"),
    ("tiers", {}, "tiers"),
    ("tiers", ["hbm", "dram"], "tiers"),
    ("hints", ["retain"], "hints"),
    ("hints.pin_all", True, "hints.pin_all"),
    ("hints.enabled", "yes", "hints.enabled"),
    ("hints.max_retain_s", 0, "hints.max_retain_s"),
    ("hints.max_retain_s", "1h", "hints.max_retain_s"),
    ("hints.max_sessions", 0, "hints.max_sessions"),
    ("hints.max_sessions", 1.5, "hints.max_sessions"),
    ("hints.max_session_blocks", -1, "hints.max_session_blocks"),
    ("hints.retain_fraction_per_tenant", 1.0, "hints.retain_fraction_per_tenant"),
    ("hints.retain_fraction", float("nan"), "hints.retain_fraction"),
]


@pytest.mark.parametrize("dotted,value,field", BAD_VALUES, ids=[f"{d}={v!r}" for d, v, _ in BAD_VALUES])
def test_bad_value_raises_naming_the_field(tmp_path: Path, dotted: str, value: Any, field: str) -> None:
    raw = small_config(tmp_path / "ssd")
    _set(raw, dotted, value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: "):
        load_dict(tmp_path, raw)


@pytest.mark.parametrize("dotted", ["model", "tiers", "tiers.ssd.capacity", "tiers.ssd.path"])
def test_missing_required_field_raises_naming_it(tmp_path: Path, dotted: str) -> None:
    raw = small_config(tmp_path / "ssd")
    _drop(raw, dotted)
    with pytest.raises(ConfigError, match=rf"^{re.escape(dotted)}: "):
        load_dict(tmp_path, raw)


def test_the_low_above_high_message_gives_both_values(tmp_path: Path) -> None:
    raw = small_config(tmp_path / "ssd")
    raw["tiers"]["dram"].update(high_watermark=0.6, low_watermark=0.7)
    with pytest.raises(ConfigError, match=r"^tiers\.dram\.low_watermark: 0\.7 .*high_watermark 0\.6"):
        load_dict(tmp_path, raw)


def test_unknown_tier_name_lists_the_valid_ones(tmp_path: Path) -> None:
    raw = small_config(tmp_path / "ssd")
    raw["tiers"]["nvram"] = {"capacity": "1GiB"}
    with pytest.raises(ConfigError, match=r"^tiers\.nvram: unknown tier 'nvram'; expected one of hbm, dram, pool, ssd"):
        load_dict(tmp_path, raw)


# ---- files that are not config mappings ----------------------------------------------------------


@pytest.mark.parametrize(
    "text,pattern",
    [("- hbm\n- dram\n", r"^config: expected a mapping"),
     ("just a string\n", r"^config: expected a mapping"),
     ("", r"^config: expected a mapping"),
     ("model: [kvtier-tiny\ntiers: {\n", r"not valid YAML"),
     ("model: kvtier-tiny\n  tiers: x\n\t- y", r"not valid YAML")],
    ids=["list", "scalar", "empty", "unclosed-brackets", "bad-indent"],
)  # fmt: skip
def test_file_that_is_not_a_mapping(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(path)
    if "YAML" in pattern:
        assert str(path) in str(info.value)


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("model: kvtier-tiny\ntransfer:\n  io_workers: 4\n  chunk_bytes: 1MiB\n  io_workers: 8\n")
    with pytest.raises(ConfigError, match=r"'io_workers' a second time \(first at line 3, column 3\)") as info:
        load_config(path)
    assert str(path) in str(info.value) and "line 5" in str(info.value)


def test_a_tenants_file_that_gives_a_field_twice_is_refused(tmp_path: Path) -> None:
    from kvtier.pool.tenants import load_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: bob, secret: s3cret-bob-s3cret, quota: 1MiB, quota: 64MiB}\n")
    with pytest.raises(ConfigError, match=r"(?s)tenants file .*'quota' a second time \(first at line 2, column 44\)"):
        load_tenants(path, 1 << 30)


REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "kvtier" / "configs").glob("*.yaml")])


ENGINE_CONFIGS = {"vllm.yaml"}  # read by the vLLM connector, which gives the model (engine_config)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_loads_with_no_key_twice(path: Path) -> None:
    # The embedded default once held two lines twice (a merge); PyYAML kept the last without a word.
    if path.name in ENGINE_CONFIGS:
        from kvtier.integrations.vllm.engine_config import engine_config

        assert isinstance(engine_config({"kvtier_config": str(path)}, "/models/served", environ={}).config,
                          KVTierConfig)
        return
    assert isinstance(load_config(path), KVTierConfig)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "kvtier.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


def test_directory_or_binary_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        load_config(tmp_path)
    binary = tmp_path / "kvtier.yaml"
    binary.write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match=re.escape(str(binary))):
        load_config(binary)


# ---- errors that appear when the runtime builds the tiers ------------------------------------


@pytest.mark.parametrize("tier", ["hbm", "dram", "ssd"])
def test_capacity_below_one_block_raises_when_built(tmp_path: Path, tier: str) -> None:
    raw = small_config(tmp_path / "ssd")
    raw["tiers"][tier]["capacity"] = TINY_BLOCK_BYTES - 1
    cfg = load_dict(tmp_path, raw)  # valid as a config: the block size depends on the model
    with pytest.raises(CapacityError, match=rf"{tier}.*{TINY_BLOCK_BYTES - 1}.*{TINY_BLOCK_BYTES}"):
        KVTier(cfg)


def test_zero_capacity_raises_when_built(tmp_path: Path) -> None:
    raw = small_config(tmp_path / "ssd")
    raw["tiers"]["dram"]["capacity"] = "0"
    with pytest.raises(CapacityError, match="dram"):
        KVTier(load_dict(tmp_path, raw))


def test_ssd_path_under_a_regular_file_raises_tier_io_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ssd_dir = blocker / "ssd"
    cfg = load_dict(tmp_path, small_config(ssd_dir))
    with pytest.raises(TierIOError, match=re.escape(str(ssd_dir))) as info:
        KVTier(cfg)
    assert "tiers.ssd.path" in str(info.value)
    assert blocker.read_text() == "not a directory"


def test_small_config_builds_and_sizes_every_tier(tmp_path: Path) -> None:
    raw = small_config(tmp_path / "ssd")
    with KVTier(load_dict(tmp_path, raw)) as kv:
        assert kv.layout.block_bytes == TINY_BLOCK_BYTES
        assert {t: u["slots"] for t, u in kv.usage().items()} == {"hbm": 4, "dram": 8, "ssd": 32}
        assert (tmp_path / "ssd").is_dir()


def test_the_pool_verbs_provider_is_passed_in_and_a_bad_one_named() -> None:
    from kvtier.config import config_from_dict
    from kvtier.kinds import TierKind
    from kvtier.pool.verbs import load_verbs

    def pool(**extra: Any) -> dict:
        return {"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"},
                                                  "pool": {"capacity": "1MiB", "nodes": ["127.0.0.1:1"], **extra}}}

    assert config_from_dict(pool()).tier(TierKind.POOL).verbs == "pyverbs"
    assert config_from_dict(pool(verbs="kvtier.testing.fake_verbs")).tier(TierKind.POOL).verbs == "kvtier.testing.fake_verbs"
    for bad in ("not a module", 3, "a..b"):
        with pytest.raises(ConfigError, match=r"tiers\.pool\.verbs"):
            config_from_dict(pool(verbs=bad))
    with pytest.raises(ConfigError, match="verbs provider 'no_such_verbs' cannot be imported"):
        load_verbs("no_such_verbs")
    with pytest.raises(ConfigError, match="verbs provider 'json' lacks Context"):
        load_verbs("json")  # importable, but not verbs


@pytest.mark.parametrize("value,kwargs,message", [
    (True, {}, "expected a number"), ("3", {}, "expected a number"), (1.5, {"integral": True}, "expected a whole number"),
    (float("nan"), {}, "expected a finite number"), (float("inf"), {"positive": True}, "expected a finite number"),
    (0, {"integral": True, "positive": True}, "must be a positive integer"), (-0.5, {"positive": True}, "must be a positive number"),
    (3, {"minimum": 4}, "must be >= 4"), (9, {"minimum": 0, "maximum": 8}, r"must be in \[0, 8\]"), (9, {"maximum": 8}, "must be <= 8"),
])  # fmt: skip
def test_numbers_are_checked_in_one_place_naming_the_field(value, kwargs, message) -> None:
    from kvtier.units import check_number

    with pytest.raises(ConfigError, match=rf"^the\.field: {message}"):
        check_number(value, "the.field", **kwargs)
    assert check_number(7, "the.field", integral=True, positive=True, minimum=1, maximum=8) == 7
    assert check_number(0.25, "the.field", positive=True) == 0.25


def test_a_tier_config_takes_paths_and_nodes_as_a_python_caller_passes_them(tmp_path):
    """A string path (and a list of nodes) is what a caller building a config in Python passes:
    taken as a Path (a tuple), not failed later, deep in the tier's build; a number is refused by name."""
    ssd = TierConfig(TierKind.SSD, 1 << 20, path=str(tmp_path), secret_file=None)
    assert ssd.path == tmp_path
    assert TierConfig(TierKind.POOL, 1 << 20, nodes=["127.0.0.1:1"]).nodes == ("127.0.0.1:1",)
    with pytest.raises(ConfigError, match="tiers.ssd.path"):
        TierConfig(TierKind.SSD, 1 << 20, path=3)
