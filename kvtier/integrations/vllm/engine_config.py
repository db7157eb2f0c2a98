"""The kvtier config a vLLM engine runs with, from what the user gave in the fewest words.

Sources, each one optional, the first that gives a field winning:
  1. the connector's `kv_connector_extra_config`: `dram` ("8GiB"), `ssd` ("/nvme/kv:200GiB"),
     `pool` ("10.0.0.5:7070,10.0.0.6:7070", optionally "64GiB@" in front) and `kvtier_config`
     (a kvtier YAML file);
  2. the environment: `KVTIER_DRAM`, `KVTIER_SSD`, `KVTIER_POOL`, `KVTIER_CONFIG`, in the same forms;
  3. the YAML file, for everything else (policies, tenants, secrets, persistence, transfer settings).
A short form sets a tier's capacity (and the SSD's folder, the pool's nodes) over the YAML's, the
rest of that tier's YAML still applying. Where no DRAM tier is given and no YAML lists tiers, a
DRAM tier is sized from the memory this machine has available (`DEFAULT_DRAM_SHARE` of it), said
in one log line: in front of short-form lower tiers too (a YAML that lists tiers is taken as it is).

The model needs no naming: under vLLM the geometry, block size and KV dtype are the engine's. A
YAML that names a model is checked against the engine (`settings._check_engine`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, config_from_dict, read_config_mapping
from kvtier.errors import ConfigError
from kvtier.units import format_bytes, parse_address, parse_size

log = logging.getLogger(__name__)

EXTRA = "kv_connector_extra_config"
SHORT_TIERS = ("dram", "ssd", "pool")
ENV = {"kvtier_config": "KVTIER_CONFIG", **{name: f"KVTIER_{name.upper()}" for name in SHORT_TIERS}}
DEFAULT_DRAM_SHARE = 4  # a quarter of the memory available: vLLM's own KV and activations need the rest
DEFAULT_DRAM_MIN = 256 << 20
DEFAULT_DRAM_MAX = 64 << 30
DEFAULT_DRAM_STEP = 256 << 20
DEFAULT_POOL_BYTES = 16 << 30


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The validated config and where it came from.

    Attributes:
        config: the kvtier config; its `model` is the engine's where `model_given` is False.
        path: the YAML file read, or None.
        model_given: the YAML named a model (to be checked against the engine).
        set_in_yaml: top-level fields the YAML set (a block size or dtype it sets is overridden
            with a line saying so; one it does not set is not mentioned).
        source: where the config came from, for the start-up line.
    """

    config: KVTierConfig
    path: Path | None
    model_given: bool
    set_in_yaml: frozenset[str]
    source: str


def engine_config(extra: Mapping[str, Any], engine_model: str,
                  environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """The config for an engine serving `engine_model`, from `extra`, `environ` and a YAML file.

    Raises:
        ConfigError: a value that does not parse, or a YAML that does not validate, naming the key
            or variable it came from.
    """
    path_value, path_where = _given(extra, environ, "kvtier_config")
    raw: dict[str, Any] = {}
    path = None
    if path_value is not None:
        if not isinstance(path_value, (str, Path)) or not str(path_value).strip():
            raise ConfigError(f"{path_where}: expected the path of a kvtier YAML config, got {path_value!r}")
        path = Path(path_value).expanduser().resolve()
        raw = read_config_mapping(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(raw).__name__}")
    tiers_raw = raw.get("tiers") if raw.get("tiers") is not None else {}
    if not isinstance(tiers_raw, dict):
        raise ConfigError(f"config file {path}: tiers: expected a mapping of tiers, got {tiers_raw!r}")
    tiers = {str(k).lower(): v for k, v in tiers_raw.items()}
    short = []
    for name in SHORT_TIERS:
        value, where = _given(extra, environ, name)
        if value is None:
            continue
        below = tiers.get(name, {})
        if not isinstance(below, dict):  # as config_from_dict would say, had no short form replaced it
            raise ConfigError(f"config file {path}: tiers.{name}: expected a mapping, got {below!r}")
        tiers[name] = {**below, **_short_tier(name, value, where)}
        short.append(f"{name} from {where}")
    if "dram" not in tiers and not tiers_raw:  # no YAML tiers: short forms of lower tiers get a DRAM in front
        tiers = {"dram": {"capacity": _default_dram()}, **tiers}
    model_given = isinstance(raw.get("model"), str) and bool(raw["model"].strip())
    config = config_from_dict({**raw, "model": raw["model"] if model_given else engine_model, "tiers": tiers})
    parts = ([f"{path}"] if path is not None else []) + short
    return EngineConfig(config, path, model_given, frozenset(raw), ", ".join(parts) or "defaults")


def _given(extra: Mapping[str, Any], environ: Mapping[str, str], name: str) -> tuple[Any, str]:
    """The value of `name` and where it came from: the extra config, else its environment
    variable (an empty variable counts as unset), else (None, "")."""
    if extra.get(name) is not None:
        return extra[name], f"{EXTRA}.{name}"
    value = environ.get(ENV[name], "")
    return (value, ENV[name]) if value.strip() else (None, "")


def _short_tier(name: str, value: Any, where: str) -> dict[str, Any]:
    """A tier's fields from its short form (see the module docstring), checked and naming `where`."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a string such as {_EXAMPLES[name]}, got {value!r}")
    value = value.strip()
    if name == "dram":
        return {"capacity": _size(value, where, name)}
    if name == "ssd":
        folder, sep, size = value.rpartition(":")
        if not sep or not folder.strip():
            raise ConfigError(f"{where}: expected DIR:SIZE such as {_EXAMPLES[name]}, got {value!r}")
        return {"path": folder.strip(), "capacity": _size(size.strip(), where, name)}
    size, at, nodes = value.rpartition("@")
    capacity = _size(size.strip(), where, name) if at else DEFAULT_POOL_BYTES
    addresses = [n.strip() for n in nodes.split(",")]
    for address in addresses:
        if not address:
            raise ConfigError(f"{where}: an empty node in {value!r}; expected {_EXAMPLES[name]}")
        parse_address(address, where)
    return {"capacity": capacity, "nodes": addresses}


_EXAMPLES = {"dram": "8GiB", "ssd": "/nvme/kv:200GiB", "pool": "10.0.0.5:7070 or 64GiB@10.0.0.5:7070,10.0.0.6:7070"}


def _size(text: str, where: str, name: str) -> int:
    size = parse_size(text, where)
    if size <= 0:
        raise ConfigError(f"{where}: {text} is not a positive size; expected a string such as {_EXAMPLES[name]}")
    return size


def _default_dram() -> int:
    """A DRAM tier of a share of the memory available now (said in one INFO line)."""
    from kvtier.tiers.host_memory import available_memory

    known = available_memory()
    if known is None:
        size, why = DEFAULT_DRAM_MIN, "the memory available is unknown here"
    else:
        share = known[0] // DEFAULT_DRAM_SHARE // DEFAULT_DRAM_STEP * DEFAULT_DRAM_STEP
        size = min(max(share, DEFAULT_DRAM_MIN), DEFAULT_DRAM_MAX)
        why = f"1/{DEFAULT_DRAM_SHARE} of the {format_bytes(known[0])} {known[1]}, within " \
              f"{format_bytes(DEFAULT_DRAM_MIN)}-{format_bytes(DEFAULT_DRAM_MAX)}"
    log.info("kvtier: no tier configured: a DRAM tier of %s (%s); choose one with %s.dram, %s or a kvtier YAML "
             "(%s.kvtier_config)", format_bytes(size), why, EXTRA, ENV["dram"], EXTRA)
    return size
