"""Typed, frozen configuration, read once at the edge from YAML.

Every value is validated at load; an error names the field by its dotted path
(`tiers.ssd.capacity`) and says what was expected. Nothing else in kvtier reads YAML or the
environment.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvtier.deciding.retention import HintLimits
from kvtier.errors import ConfigError
from kvtier.policy import PolicyKind
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.pool.detect import TransportKind
from kvtier.units import check_number, parse_address, parse_size
from kvtier.kinds import CacheMode, PoolBackend, TierKind
from kvtier.yaml_strict import load_yaml


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier: how many bytes, which eviction policy, what it admits, when it demotes."""

    kind: TierKind
    capacity_bytes: int
    policy: PolicyKind = PolicyKind.LRU
    admission: AdmissionRule = AdmissionRule(AdmissionKind.ALL)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    # Every store also places a copy here, in exclusive mode too (inclusive mode writes through to
    # every tier anyway), so the block is in this tier as soon as it is stored. None: a shared
    # pool tier takes the blocks it shares (BlockKeys: other processes then find a block at once,
    # not once it is demoted); the others take none.
    write_through: bool | None = None
    path: Path | None = None  # SSD only: directory holding the slab files
    num_files: int = 4  # SSD only
    o_direct: bool | None = None  # SSD only: None tries O_DIRECT and falls back with a warning
    persist: bool = False  # SSD only: keep blocks across restarts (a journal records each slot)
    device: str | None = None  # HBM only: "cuda", "cuda:1", "cpu"; None picks CUDA when present
    nodes: tuple[str, ...] = ()  # POOL only: "host:port" of each pool node
    tenant: str = "default"  # POOL only: the tenant this process authenticates as
    secret: str | None = field(default=None, repr=False)  # POOL only; prefer secret_file
    secret_file: Path | None = None  # POOL only: a file holding the tenant's secret
    timeout_s: float = 2.0  # POOL only: the longest any one call to a node may take
    reconnect_s: float = 1.0  # POOL only: how long a failed node is skipped before it is retried
    transport: TransportKind = TransportKind.AUTO  # POOL only
    verbs: str = "pyverbs"  # POOL only: the verbs provider under RDMA (a stand-in's module name in tests)
    backend: PoolBackend = PoolBackend.KVTIER  # POOL only: mooncake takes nodes = [master HOST:PORT]
    metadata_server: str | None = None  # POOL mooncake only: http://HOST:PORT/metadata
    shared: bool = True  # POOL only: blocks under their keys, found by every process of the tenant
    negative_cache_s: float = 1.0  # POOL only: how long a key the pool lacked is not asked for again

    def __post_init__(self) -> None:
        # A path given as a string or any path-like (as a YAML file or a Python caller would) is taken as one.
        for name in ("path", "secret_file"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)) and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
            elif value is not None and not isinstance(value, Path):
                raise ConfigError(f"tiers.{self.kind.name.lower()}.{name}: expected a path, got {value!r}")
        if isinstance(self.nodes, (list, str)):
            object.__setattr__(self, "nodes", (self.nodes,) if isinstance(self.nodes, str) else tuple(self.nodes))


@dataclass(frozen=True, slots=True)
class TransferConfig:
    io_workers: int = 4
    chunk_bytes: int = 1 << 20  # consecutive layers are copied together up to this size (0: per layer)
    # Host-memory batches up to this size run in the caller's thread (0: never): handing one to a
    # worker and back costs ~60-120 µs of CPU on a virtualized host, a 4 MiB copy ~400 µs.
    inline_bytes: int = 4 << 20
    # Native threads one host-memory copy of at least `PARALLEL_COPY_BYTES` (8 MiB) per thread
    # is shared among (1: never shared): on a 2-vCPU VM two threads move 1-4 MiB blocks about a
    # third faster than one; below that, starting a thread costs more than it saves. Copies
    # nobody waits for (demotions, prefetches, background stores) take one thread whatever their size.
    copy_threads: int = 2
    # A tier that fails as a whole leaves the cascade and is probed after this long, the wait
    # doubling with every failed probe up to `tier_retry_max_s` (see kvtier.tiers.health).
    tier_retry_s: float = 0.5
    tier_retry_max_s: float = 30.0
    # Stores in flight (submitted, not yet landed) beyond this many bytes are dropped and counted
    # (`store_backlog_full`), never queued: the engine must not wait for kvtier.
    max_store_backlog_bytes: int = 256 << 20
    background_nice: int = 10  # added to the nice value of the threads that move blocks between tiers
    # The CPUs the transfer threads run on (None: wherever the thread that starts them may run).
    # The vLLM connector fills it, when unset, with the cores vLLM leaves to the rest of the server.
    cpus: tuple[int, ...] | None = None
    # A hit whose measured load time would exceed the engine's measured recompute time for its
    # tokens is reported as a miss (`KVTier.loadable`, kvtier.deciding.cost); needs the engine's
    # `note_compute` reports, which the vLLM connector sends.
    skip_slow_loads: bool = True

    def __post_init__(self) -> None:
        if self.cpus is not None and (not self.cpus or any(not isinstance(c, int) or isinstance(c, bool) or c < 0
                                                            for c in self.cpus)):
            raise ConfigError(f"transfer.cpus: expected a non-empty list of CPU numbers (0, 1, ...), got {self.cpus!r}")
        if not 1 <= self.copy_threads <= 64:
            raise ConfigError(f"transfer.copy_threads: expected 1..64, got {self.copy_threads!r}")
        if not 0 < self.tier_retry_s <= self.tier_retry_max_s:
            raise ConfigError(f"transfer.tier_retry_s: need 0 < tier_retry_s <= tier_retry_max_s, "
                              f"got {self.tier_retry_s} and {self.tier_retry_max_s}")


@dataclass(frozen=True, slots=True)
class PrefetchConfig:
    target: TierKind = TierKind.DRAM
    budget_bytes: int = 256 * 2**20


@dataclass(frozen=True, slots=True)
class HintsConfig:
    """Retention hints (`kvtier.deciding.retention`): whether requests' hints are taken, and their bounds.

    Off, an engine reads no hint and `KVTier.apply_hint` ignores every one (counted `disabled`).
    On (the default), nothing changes until the first hint arrives.
    """

    enabled: bool = True
    limits: HintLimits = field(default_factory=HintLimits)


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The whole runtime configuration."""

    model: str
    tiers: tuple[TierConfig, ...]
    kv_dtype: str | None = None  # None: the model's own dtype
    block_tokens: int = 16
    mode: CacheMode = CacheMode.EXCLUSIVE
    tenant: str = "default"
    promote_to: TierKind | None = TierKind.DRAM  # None: loads never promote
    transfer: TransferConfig = field(default_factory=TransferConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    hints: HintsConfig = field(default_factory=HintsConfig)

    def tier(self, kind: TierKind) -> TierConfig | None:
        return next((t for t in self.tiers if t.kind is kind), None)

    def lasting_tier(self) -> str | None:
        """Where blocks outlive the process, named for a log line ("pool", "persistent SSD tier"), or
        None: a change of block keys leaves old blocks there as misses, said once at start-up."""
        ssd = self.tier(TierKind.SSD)
        if self.tier(TierKind.POOL) is not None:
            return "pool"
        return "persistent SSD tier" if ssd is not None and ssd.persist else None


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
    return cls(check_number(value, where, integral=cls is int, minimum=lo, maximum=hi))


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):  # bool("false") is True: never coerce
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _mapping(raw: Any, where: str) -> dict:
    """A section that may be omitted (None: empty) but, when present, must be a mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    return raw


def _check_keys(raw: dict, allowed: set[str], where: str) -> None:
    """Raises naming the first unknown key by its dotted path (`where` is "" at the top level)."""
    unknown = sorted(map(str, set(raw) - allowed))
    if unknown:
        path = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"{path}: unknown field; expected one of {', '.join(sorted(allowed))}")


def _admission(raw: Any, where: str) -> AdmissionRule:
    if isinstance(raw, str):
        return AdmissionRule(_enum(AdmissionKind, raw, where))
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a name or a mapping, got {raw!r}")
    _check_keys(raw, {"kind", "min_hits", "allow_demoted"}, where)
    kind = _enum(AdmissionKind, raw.get("kind", "all"), f"{where}.kind")
    return AdmissionRule(kind, _number(raw.get("min_hits", 1), f"{where}.min_hits", int, 0),
                         _bool(raw.get("allow_demoted", False), f"{where}.allow_demoted"))


_TIER_FIELDS = {"capacity", "policy", "admission", "high_watermark", "low_watermark", "write_through"}
# Fields only one kind of tier reads; elsewhere they would be silently ignored, so they are refused.
_KIND_FIELDS = {TierKind.HBM: {"device"}, TierKind.SSD: {"path", "num_files", "o_direct", "persist"},
                TierKind.POOL: {"nodes", "tenant", "secret", "secret_file", "timeout_s", "reconnect_s", "transport",
                                 "verbs", "backend", "metadata_server", "shared", "negative_cache_s"}}


def _pool_fields(raw: dict, where: str) -> dict[str, Any]:
    """The POOL tier's own fields, validated."""

    nodes = raw.get("nodes")
    nodes = [nodes] if isinstance(nodes, str) else nodes
    if not isinstance(nodes, list) or not nodes:
        raise ConfigError(f"{where}.nodes: expected a list of HOST:PORT, got {nodes!r}")
    for i, node in enumerate(nodes):
        parse_address(node, f"{where}.nodes[{i}]")
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{where}.nodes: a node appears twice in {nodes}")
    tenant = raw.get("tenant", "default")
    if not isinstance(tenant, str) or not 0 < len(tenant) <= 64 or not tenant.isprintable():
        raise ConfigError(f"{where}.tenant: expected a printable name of 1-64 characters, got {tenant!r}")
    secret, secret_file = raw.get("secret"), raw.get("secret_file")
    if secret is not None and secret_file is not None:
        raise ConfigError(f"{where}.secret: give secret or secret_file, not both")
    for name, value in (("secret", secret), ("secret_file", secret_file)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{where}.{name}: expected a non-empty string")
    backend = _enum(PoolBackend, raw.get("backend", "kvtier"), f"{where}.backend")
    metadata_server = raw.get("metadata_server")
    if backend is PoolBackend.MOONCAKE:
        if len(nodes) != 1:
            raise ConfigError(f"{where}.nodes: the mooncake backend takes one master HOST:PORT, got {nodes}")
        if not isinstance(metadata_server, str) or not metadata_server.startswith("http://"):
            raise ConfigError(f"{where}.metadata_server: the mooncake backend needs http://HOST:PORT/metadata, "
                              f"got {metadata_server!r}")
    elif metadata_server is not None:
        raise ConfigError(f"{where}.metadata_server: only the mooncake backend reads it")
    return {"nodes": tuple(nodes), "tenant": tenant, "secret": secret, "backend": backend,
            "metadata_server": metadata_server,
            "secret_file": Path(secret_file).expanduser() if secret_file else None,
            "timeout_s": _number(raw.get("timeout_s", 2.0), f"{where}.timeout_s", float, 0.001, 3600),
            "reconnect_s": _number(raw.get("reconnect_s", 1.0), f"{where}.reconnect_s", float, 0.0, 3600),
            "transport": _enum(TransportKind, raw.get("transport", "auto"), f"{where}.transport"),
            "verbs": _verbs(raw.get("verbs", "pyverbs"), f"{where}.verbs"),
            "shared": _bool(raw.get("shared", True), f"{where}.shared"),
            "negative_cache_s": _number(raw.get("negative_cache_s", 1.0), f"{where}.negative_cache_s", float, 0.0, 60)}


def _verbs(value: Any, where: str) -> str:
    """A verbs provider: `pyverbs`, or a dotted module name (checked when RDMA is first used)."""
    if not isinstance(value, str) or not all(part.isidentifier() for part in value.split(".")):
        raise ConfigError(f"{where}: expected pyverbs or a module name such as kvtier.testing.fake_verbs, "
                          f"got {value!r}")
    return value


def _tier(name: str, raw: Any) -> TierConfig:
    where = f"tiers.{name}"
    kind = _tier_kind(name, where)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    _check_keys(raw, _TIER_FIELDS | _KIND_FIELDS.get(kind, set()), where)
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity: missing")
    high = _number(raw.get("high_watermark", 0.95), f"{where}.high_watermark", float, 0.0, 1.0)
    low = _number(raw.get("low_watermark", 0.85), f"{where}.low_watermark", float, 0.0, 1.0)
    if low > high:
        raise ConfigError(f"{where}.low_watermark: {low} is above high_watermark {high}")
    path = raw.get("path")
    if kind is TierKind.SSD and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"{where}.path: the SSD tier needs a directory, got {path!r}")
    o_direct = raw.get("o_direct", "auto")
    if o_direct not in ("auto", None) and not isinstance(o_direct, bool):  # 1 == True: test the type
        raise ConfigError(f"{where}.o_direct: expected auto, true or false, got {o_direct!r}")
    return TierConfig(
        kind=kind,
        capacity_bytes=parse_size(raw["capacity"], f"{where}.capacity"),
        policy=_enum(PolicyKind, raw.get("policy", "lru"), f"{where}.policy"),
        admission=_admission(raw.get("admission", "all"), f"{where}.admission"),
        high_watermark=high,
        low_watermark=low,
        write_through=None if raw.get("write_through") is None else _bool(raw["write_through"],
                                                                           f"{where}.write_through"),
        path=Path(path).expanduser() if path else None,
        num_files=_number(raw.get("num_files", 4), f"{where}.num_files", int, 1),
        o_direct=None if o_direct in ("auto", None) else bool(o_direct),
        persist=_bool(raw.get("persist", False), f"{where}.persist"),
        device=str(raw["device"]) if raw.get("device") else None,
        **(_pool_fields(raw, where) if kind is TierKind.POOL else {}),
    )


_TOP_FIELDS = {"model", "kv_dtype", "block_tokens", "mode", "tenant", "promote_to", "tiers", "transfer", "prefetch",
               "hints"}
_HINT_FIELDS = {"max_sessions": int, "max_session_blocks": int, "retain_fraction_per_tenant": float,
                "retain_fraction": float, "max_retain_s": float}


def _hints(raw: Any) -> HintsConfig:
    """The `hints` section: `enabled` and `HintLimits`' fields (ranges checked there, naming the field)."""
    raw = _mapping(raw, "hints")
    _check_keys(raw, {"enabled", *_HINT_FIELDS}, "hints")
    limits = {name: _number(raw[name], f"hints.{name}", cls, 0) for name, cls in _HINT_FIELDS.items() if name in raw}
    return HintsConfig(enabled=_bool(raw.get("enabled", True), "hints.enabled"), limits=HintLimits(**limits))


def config_from_dict(raw: Any) -> KVTierConfig:
    """Validates a parsed YAML mapping into a `KVTierConfig`.

    Raises:
        ConfigError: naming the first field that is missing, unknown or out of range.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    _check_keys(raw, _TOP_FIELDS, "")
    if not isinstance(raw.get("model"), str) or not raw["model"].strip():
        raise ConfigError(f"model: expected a catalog name such as llama-3-8b or a path to config.json, "
                          f"got {raw.get('model')!r}")
    tiers_raw = raw.get("tiers")
    if not isinstance(tiers_raw, dict) or not tiers_raw:
        raise ConfigError("tiers: expected a mapping of at least one tier (hbm, dram, pool, ssd)")
    tiers = tuple(sorted((_tier(str(n), t) for n, t in tiers_raw.items()), key=lambda t: t.kind))
    for above, below in zip(tiers, tiers[1:]):
        if above.kind is below.kind:  # `hbm` and `HBM` are two YAML keys but one tier
            raise ConfigError(f"tiers.{below.kind.name.lower()}: configured twice")
    transfer_raw = _mapping(raw.get("transfer"), "transfer")
    _check_keys(transfer_raw, {"io_workers", "chunk_bytes", "inline_bytes", "copy_threads", "tier_retry_s", "tier_retry_max_s",
                               "max_store_backlog", "background_nice", "skip_slow_loads", "cpus"}, "transfer")
    prefetch_raw = _mapping(raw.get("prefetch"), "prefetch")
    _check_keys(prefetch_raw, {"target", "budget"}, "prefetch")
    return KVTierConfig(
        model=str(raw["model"]),
        tiers=tiers,
        kv_dtype=str(raw["kv_dtype"]) if raw.get("kv_dtype") else None,
        block_tokens=_number(raw.get("block_tokens", 16), "block_tokens", int, 1),
        mode=_enum(CacheMode, raw.get("mode", "exclusive"), "mode"),
        tenant=str(raw.get("tenant", "default")),
        promote_to=_configured_tier(raw, "promote_to", tiers, allow_none=True),
        transfer=TransferConfig(
            io_workers=_number(transfer_raw.get("io_workers", 4), "transfer.io_workers", int, 1, 256),
            chunk_bytes=parse_size(transfer_raw.get("chunk_bytes", "1MiB"), "transfer.chunk_bytes"),
            inline_bytes=parse_size(transfer_raw.get("inline_bytes", "4MiB"), "transfer.inline_bytes"),
            copy_threads=_number(transfer_raw.get("copy_threads", 2), "transfer.copy_threads", int, 1, 64),
            tier_retry_s=_number(transfer_raw.get("tier_retry_s", 0.5), "transfer.tier_retry_s", float, 1e-3),
            tier_retry_max_s=_number(transfer_raw.get("tier_retry_max_s", 30.0), "transfer.tier_retry_max_s",
                                     float, 1e-3),
            max_store_backlog_bytes=parse_size(transfer_raw.get("max_store_backlog", "256MiB"),
                                               "transfer.max_store_backlog"),
            background_nice=_number(transfer_raw.get("background_nice", 10), "transfer.background_nice", int, 0, 19),
            skip_slow_loads=_bool(transfer_raw.get("skip_slow_loads", True), "transfer.skip_slow_loads"),
            cpus=_cpus(transfer_raw.get("cpus")),
        ),
        prefetch=PrefetchConfig(
            target=_configured_tier(prefetch_raw, "target", tiers, where="prefetch.target"),
            budget_bytes=parse_size(prefetch_raw.get("budget", "256MiB"), "prefetch.budget"),
        ),
        hints=_hints(raw.get("hints")),
    )


def _configured_tier(raw: dict, name: str, tiers: tuple[TierConfig, ...], *, allow_none: bool = False,
                     where: str | None = None) -> TierKind | None:
    """The tier named by `raw[name]`, which must be configured (None or "none" where `allow_none`)."""
    where = where or name
    kinds = [t.kind for t in tiers]
    if name not in raw:  # DRAM; without one, no promotion, and prefetch into the fastest tier
        return TierKind.DRAM if TierKind.DRAM in kinds else None if allow_none else kinds[0]
    if raw[name] in (None, "none") and allow_none:
        return None
    kind = _tier_kind(raw[name], where)
    if kind not in kinds:
        raise ConfigError(f"{where}: tier {kind.name.lower()} is not configured under tiers")
    return kind


def _cpus(raw: Any) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ConfigError(f"transfer.cpus: expected a list of CPU numbers such as [2, 3], or null, got {raw!r}")
    return tuple(raw)


def load_config(path: str | Path | None = None) -> KVTierConfig:
    """Loads and validates a YAML file; None loads the embedded `default.yaml`.

    Raises:
        ConfigError: the file is missing, is not YAML, or a field is invalid.
    """
    return config_from_dict(read_config_mapping(path))


def read_config_mapping(path: str | Path | None = None) -> Any:
    """The parsed YAML of a config file (None: the embedded `default.yaml`), not yet validated
    (`config_from_dict` does that): for callers that complete a config before validating it.

    Raises:
        ConfigError: the file is missing, is not UTF-8 text or is not YAML.
    """
    if path is None:
        text = resources.files("kvtier").joinpath("configs/default.yaml").read_text()
        source = "embedded default.yaml"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path}: not UTF-8 text") from None
        source = str(path)
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {source}: not valid YAML: {e}") from None

