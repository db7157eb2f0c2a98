"""The SGLang storage backend's settings: our keys of its extra config, and the namespace of its pages.

Pure start-up code (no SGLang import at module level): `sglang_storage` is the backend itself.

Our keys of SGLang's extra config (every key we own starts with `kvtier_`; an unknown one is an error):
    kvtier_config       required unless a runtime is injected: the path of a kvtier YAML file
    kvtier_timeout_s    how long one batch may wait before its pages count as misses (default 30)
    kvtier_weights_id   names the weights in page keys, e.g. a digest of the checkpoint (default: a
                        fingerprint of the served model's weight files; see `kvtier.model.weights`)
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.model.keys import Namespace
from kvtier.tiers.base import TierKind
from kvtier.model.weights import (
    ADAPTER_CONFIG_NAMES,
    WeightsSource,
    fingerprint_config,
    user_weights_id,
    weights_fingerprint,
)

log = logging.getLogger(__name__)

_OWN_PREFIX = "kvtier_"
_OWN_KEYS = {"kvtier_config", "kvtier_timeout_s", "kvtier_weights_id"}


@dataclass(frozen=True, slots=True)
class Options:
    """Our keys of SGLang's extra config.

    Attributes:
        config: the kvtier config (None: a runtime is injected instead).
        timeout_s: `kvtier_timeout_s`.
        weights_id: `id:<kvtier_weights_id>`, or None to fingerprint the weight files.
    """

    config: KVTierConfig | None
    timeout_s: float
    weights_id: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, need_config: bool) -> Options:
        """Raises: ConfigError naming the key that is unknown, missing or invalid."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if str(k).startswith(_OWN_PREFIX) and k not in _OWN_KEYS)
        if unknown:
            raise ConfigError(f"extra_config.{unknown[0]}: unknown key; expected one of {sorted(_OWN_KEYS)}")
        timeout_s = extra.get("kvtier_timeout_s", 30.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"extra_config.kvtier_timeout_s: expected a positive number, got {timeout_s!r}")
        weights_id = user_weights_id(extra.get("kvtier_weights_id"), "extra_config.kvtier_weights_id")
        path = extra.get("kvtier_config")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ConfigError(f"extra_config.kvtier_config: expected the path of a kvtier YAML file, got {path!r}")
        if path is None:
            if need_config:
                raise ConfigError("extra_config.kvtier_config: missing; give the path of a kvtier YAML "
                                  "file (see kvtier.integrations.sglang.storage)")
            return cls(None, float(timeout_s), weights_id)
        config = load_config(path)
        _check_no_gpu_tier(config)
        return cls(config, float(timeout_s), weights_id)


def _check_no_gpu_tier(config: KVTierConfig) -> None:
    hbm = config.tier(TierKind.HBM)
    if hbm is not None and hbm.device != "cpu":
        raise ConfigError("tiers.hbm: under SGLang, kvtier sits below SGLang's own GPU and host pools; "
                          "remove tiers.hbm (or set device: cpu) so kvtier takes no GPU memory")


def shard_label(sc: Any) -> str:
    """What distinguishes this rank's pages from another rank's for the same page hash."""
    parts = [] if sc.is_mla_model else [f"tp{sc.tp_rank}/{sc.tp_size}"]  # MLA: replicated over TP
    if sc.pp_size > 1:
        parts.append(f"pp{sc.pp_rank}/{sc.pp_size}")
    if sc.attn_cp_size > 1:
        parts.append(f"cp{sc.attn_cp_rank}/{sc.attn_cp_size}")
    return ",".join(parts)


def page_namespace(sc: Any, options: Options, config: KVTierConfig, dtype: str, page_tokens: int,
                   host_layout: str, settings: Mapping[str, Any] | None = None) -> Namespace:
    """The namespace of this rank's pages.

    It covers the served model (SGLang's name for it, else the kvtier config's `model`), its
    weights (`kvtier_weights_id`, else a fingerprint of the weight files: `served_weights`), the
    server's settings that shape K/V (`served_settings`, appended to the weights as `;config:`),
    the page dtype and size, and in the salt the tenant, the rank's shard and the host layout.

    Args:
        settings: `served_settings()`; None outside an SGLang server (the keys are then those of
            kvtier before it read settings).

    Raises:
        ConfigError: a weight file exists but cannot be read, or a setting has no canonical form.
    """
    salt = f"{config.tenant}|{shard_label(sc)}|{host_layout}"
    weights = options.weights_id or weights_fingerprint(served_weights(sc, config))
    if settings is not None:
        try:
            weights = f"{weights};{fingerprint_config(settings)}"
        except ValueError as e:
            raise ConfigError(f"SGLang's server settings: {e}") from None
    return Namespace(sc.model_name or config.model, dtype, page_tokens, salt, weights)


MODEL_SETTINGS = ("json_model_override_args", "dtype", "kv_cache_dtype", "quantization", "quantization_param_path",
                  "context_length", "model_impl", "load_format", "model_loader_extra_config", "revision")
"""What SGLang resolves at start-up (`get_model()`) that changes a page's bytes for the same files:
config overrides (RoPE), activation and KV dtypes (fp8 e4m3 and e5m2 pages are both uint8 to the
host pool), quantization and its KV scales, the context length (some RoPE scalings follow it),
the implementation and loader."""
LORA_SETTINGS = ("enable_lora", "max_lora_rank", "lora_target_modules")


def served_settings() -> dict[str, Any] | None:
    """The settings of the SGLang server this process runs in that shape K/V, or None outside one.

    `MODEL_SETTINGS` and the KV scales file's bytes; `LORA_SETTINGS` and, per `--lora-paths`
    adapter, its name, path, SGLang's `lora_id` (uuid5 of name and path: the same after a
    restart, so it is not an identity) and a fingerprint of its files (`ADAPTER_CONFIG_NAMES`);
    the weight version the server started with; SGLang's version (page formats follow it).

    Raises:
        ConfigError: an adapter's or the KV scales' file exists but cannot be read.
    """
    try:
        from sglang.srt.runtime_context import get_lora, get_model, get_serving

        model, lora, serving = get_model(), get_lora(), get_serving()
    except (ImportError, ValueError, AttributeError):  # not in an SGLang server, or not published yet
        return None
    settings: dict[str, Any] = {name: getattr(model, name, None) for name in MODEL_SETTINGS}
    settings["kv_scales"] = _file_digest(settings["quantization_param_path"], "quantization_param_path")
    settings["lora"] = {name: getattr(lora, name, None) for name in LORA_SETTINGS}
    settings["lora_adapters"] = [_adapter_identity(*ref) for ref in lora_refs(getattr(lora, "lora_paths", None))]
    settings["weight_version"] = getattr(serving, "weight_version", None)
    settings["sglang_version"] = _sglang_version()
    return settings


def weight_version_reader() -> Any:
    """A callable giving the server's current weight version (it moves with in-place weight updates
    that name one), or None outside an SGLang server."""
    try:
        from sglang.srt.runtime_context import get_serving
    except ImportError:
        return None
    return lambda: getattr(get_serving(), "weight_version", None)


def lora_refs(lora_paths: Any) -> list[tuple[str, str, str | None]]:
    """(name, path, lora_id) of each `--lora-paths` adapter, in any form SGLang accepts or resolves
    it to: `LoRARef`s, `{"lora_name", "lora_path"}` dicts, `NAME=PATH` or `PATH` strings, a name->path dict.

    Raises:
        ConfigError: an entry of none of these forms.
    """
    if not lora_paths:
        return []
    if isinstance(lora_paths, Mapping):
        return [(str(name), str(path), None) for name, path in lora_paths.items()]
    refs = []
    for entry in lora_paths:
        if isinstance(entry, str):
            name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
            refs.append((name, path, None))
        elif isinstance(entry, Mapping) and "lora_path" in entry:
            refs.append((str(entry.get("lora_name")), str(entry["lora_path"]), entry.get("lora_id")))
        elif getattr(entry, "lora_path", None) is not None:
            refs.append((str(entry.lora_name), str(entry.lora_path), getattr(entry, "lora_id", None)))
        else:
            raise ConfigError(f"lora_paths: cannot read the adapter entry {entry!r}")
    return refs


def _adapter_identity(name: str, path: str, lora_id: str | None) -> list[Any]:
    return [name, path, lora_id, weights_fingerprint(WeightsSource(path), ADAPTER_CONFIG_NAMES)]


def log_key_change(config: KVTierConfig) -> None:
    """One line where pages outlive the process (a persistent SSD tier, a pool): keys changed."""
    lasting = config.lasting_tier()
    if lasting is not None:
        log.info("kvtier HiCache storage: page keys now name SGLang's settings (overrides, dtypes, quantization, "
                 "LoRA adapters, weight version) besides the weights; pages an older kvtier stored on the %s "
                 "are misses under the new keys, never served", lasting)


def _file_digest(path: Any, field: str) -> str | None:
    """xxh3-128 of a small file's bytes (KV scales JSON), or None where no path is given.

    Raises:
        ConfigError: the file cannot be read.
    """
    if not path:
        return None
    try:
        return xxhash.xxh3_128_hexdigest(Path(path).read_bytes())
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path} to key pages by it ({e})") from None


def _sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def served_weights(sc: Any, config: KVTierConfig) -> WeightsSource:
    """Where the served model's weights are.

    Inside an SGLang server: the model path, revision and download directory its runtime context
    publishes (`storage_config.model_name` is the *served* model name, an alias when
    `--served-model-name` is set, and may carry a page-format tag). Elsewhere (or before that
    context is published): `model_name`, else the kvtier config's `model`.
    """
    try:
        from sglang.srt.runtime_context import get_model

        model = get_model()
        return WeightsSource(str(model.model_path), getattr(model, "revision", None),
                             getattr(model, "download_dir", None))
    except (ImportError, ValueError, AttributeError):  # not in an SGLang server, or not published yet
        return WeightsSource(sc.model_name or config.model)
