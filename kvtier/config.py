"""Typed, frozen configuration, read once at the edge from YAML.

Every value is validated at load; an error names the field by its dotted path
(`tiers.ssd.capacity`) and says what was expected. Nothing else in kvtier reads YAML or the
environment.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.policy import PolicyKind
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.tiers.base import TierKind


class CacheMode(enum.Enum):
    """Exclusive keeps one copy of a block; inclusive writes through to every lower tier."""

    EXCLUSIVE = "exclusive"
    INCLUSIVE = "inclusive"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string such as '512MiB', '4GB', '1.5GiB'.

    Raises:
        ConfigError: naming `where` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 4GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value)) if isinstance(value, str) else None
    if not match:
        raise ConfigError(f"{where}: expected a size such as 4GiB or 512MB, got {value!r}")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier: how many bytes, which eviction policy, what it admits, when it demotes."""

    kind: TierKind
    capacity_bytes: int
    policy: PolicyKind = PolicyKind.LRU
    admission: AdmissionRule = AdmissionRule(AdmissionKind.ALL)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    path: Path | None = None  # SSD only: directory holding the slab files
    num_files: int = 4  # SSD only
    o_direct: bool | None = None  # SSD only: None tries O_DIRECT and falls back with a warning
    device: str | None = None  # HBM only: "cuda", "cuda:1", "cpu"; None picks CUDA when present


@dataclass(frozen=True, slots=True)
class TransferConfig:
    io_workers: int = 4
    layerwise: bool = True


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    target: TierKind = TierKind.DRAM
    budget_bytes: int = 256 * 2**20


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The whole runtime configuration."""

    model: str
    tiers: tuple[TierConfig, ...]
    kv_dtype: str | None = None  # None: the model's own dtype
    block_tokens: int = 16
    mode: CacheMode = CacheMode.EXCLUSIVE
    tenant: str = "default"
    promote_to: TierKind = TierKind.DRAM
    transfer: TransferConfig = field(default_factory=TransferConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)

    def tier(self, kind: TierKind) -> TierConfig | None:
        return next((t for t in self.tiers if t.kind is kind), None)


def _enum(cls: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return cls(str(value).lower()) if not isinstance(value, cls) else value
    except ValueError:
        valid = ", ".join(str(m.value) for m in cls)
        raise ConfigError(f"{where}: {value!r} is not one of {valid}") from None


def _tier_kind(name: Any, where: str) -> TierKind:
    try:
        return TierKind[str(name).upper()]
    except KeyError:
        valid = ", ".join(k.name.lower() for k in TierKind)
        raise ConfigError(f"{where}: unknown tier {name!r}; expected one of {valid}") from None


def _number(value: Any, where: str, cls: type, lo: float, hi: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (cls is int and not isinstance(value, int)):
        raise ConfigError(f"{where}: expected {cls.__name__}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{where}: must be {bound}, got {value}")
    return cls(value)


def _check_keys(raw: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; expected some of {', '.join(sorted(allowed))}")


def _admission(raw: Any, where: str) -> AdmissionRule:
    if isinstance(raw, str):
        return AdmissionRule(_enum(AdmissionKind, raw, where))
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a name or a mapping, got {raw!r}")
    _check_keys(raw, {"kind", "min_hits"}, where)
    kind = _enum(AdmissionKind, raw.get("kind", "all"), f"{where}.kind")
    return AdmissionRule(kind, _number(raw.get("min_hits", 1), f"{where}.min_hits", int, 0))


_TIER_FIELDS = {"capacity", "policy", "admission", "high_watermark", "low_watermark", "path", "num_files", "o_direct", "device"}


def _tier(name: str, raw: Any) -> TierConfig:
    where = f"tiers.{name}"
    kind = _tier_kind(name, where)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    _check_keys(raw, _TIER_FIELDS, where)
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity: missing")
    high = _number(raw.get("high_watermark", 0.95), f"{where}.high_watermark", float, 0.0, 1.0)
    low = _number(raw.get("low_watermark", 0.85), f"{where}.low_watermark", float, 0.0, 1.0)
    if low > high:
        raise ConfigError(f"{where}.low_watermark: {low} is above high_watermark {high}")
    path = raw.get("path")
    if kind is TierKind.SSD and not path:
        raise ConfigError(f"{where}.path: the SSD tier needs a directory")
    o_direct = raw.get("o_direct", "auto")
    if o_direct not in ("auto", True, False, None):
        raise ConfigError(f"{where}.o_direct: expected auto, true or false, got {o_direct!r}")
    return TierConfig(
        kind=kind,
        capacity_bytes=parse_size(raw["capacity"], f"{where}.capacity"),
        policy=_enum(PolicyKind, raw.get("policy", "lru"), f"{where}.policy"),
        admission=_admission(raw.get("admission", "all"), f"{where}.admission"),
        high_watermark=high,
        low_watermark=low,
        path=Path(path).expanduser() if path else None,
        num_files=_number(raw.get("num_files", 4), f"{where}.num_files", int, 1),
        o_direct=None if o_direct in ("auto", None) else bool(o_direct),
        device=str(raw["device"]) if raw.get("device") else None,
    )


_TOP_FIELDS = {"model", "kv_dtype", "block_tokens", "mode", "tenant", "promote_to", "tiers", "transfer", "prefetch"}


def config_from_dict(raw: Any) -> KVTierConfig:
    """Validates a parsed YAML mapping into a `KVTierConfig`.

    Raises:
        ConfigError: naming the first field that is missing, unknown or out of range.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    _check_keys(raw, _TOP_FIELDS, "config")
    if not raw.get("model"):
        raise ConfigError("model: missing (a catalog name such as llama-3-8b or a path to config.json)")
    tiers_raw = raw.get("tiers")
    if not isinstance(tiers_raw, dict) or not tiers_raw:
        raise ConfigError("tiers: expected a mapping of at least one tier (hbm, dram, pool, ssd)")
    tiers = tuple(sorted((_tier(str(n), t) for n, t in tiers_raw.items()), key=lambda t: t.kind))
    transfer_raw = raw.get("transfer") or {}
    _check_keys(transfer_raw, {"io_workers", "layerwise"}, "transfer")
    prefetch_raw = raw.get("prefetch") or {}
    _check_keys(prefetch_raw, {"target", "budget"}, "prefetch")
    return KVTierConfig(
        model=str(raw["model"]),
        tiers=tiers,
        kv_dtype=str(raw["kv_dtype"]) if raw.get("kv_dtype") else None,
        block_tokens=_number(raw.get("block_tokens", 16), "block_tokens", int, 1),
        mode=_enum(CacheMode, raw.get("mode", "exclusive"), "mode"),
        tenant=str(raw.get("tenant", "default")),
        promote_to=_tier_kind(raw.get("promote_to", "dram"), "promote_to"),
        transfer=TransferConfig(
            io_workers=_number(transfer_raw.get("io_workers", 4), "transfer.io_workers", int, 1, 256),
            layerwise=bool(transfer_raw.get("layerwise", True)),
        ),
        prefetch=PrefetchConfig(
            target=_tier_kind(prefetch_raw.get("target", "dram"), "prefetch.target"),
            budget_bytes=parse_size(prefetch_raw.get("budget", "256MiB"), "prefetch.budget"),
        ),
    )


def load_config(path: str | Path | None = None) -> KVTierConfig:
    """Loads and validates a YAML file; None loads the embedded `default.yaml`.

    Raises:
        ConfigError: the file is missing, is not YAML, or a field is invalid.
    """
    if path is None:
        text = resources.files("kvtier").joinpath("configs/default.yaml").read_text()
        source = "embedded default.yaml"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        source = str(path)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {source}: not valid YAML: {e}") from None
    return config_from_dict(raw)

