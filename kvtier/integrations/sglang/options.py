"""The SGLang storage backend's settings: our keys of its extra config, and the namespace of its pages.

Pure start-up code (no SGLang import at module level): `sglang_storage` is the backend itself.

Our keys of SGLang's extra config (every key we own starts with `kvtier_`; an unknown one is an error):
    kvtier_config       required unless a runtime is injected: the path of a kvtier YAML file
    kvtier_timeout_s    how long one batch may wait before its pages count as misses (default 30)
    kvtier_weights_id   names the weights in page keys, e.g. a digest of the checkpoint (default: a
                        fingerprint of the served model's weight files; see `kvtier.weights`)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.tiers.base import TierKind
from kvtier.weights import WeightsSource, user_weights_id, weights_fingerprint

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
                   host_layout: str) -> Namespace:
    """The namespace of this rank's pages.

    It covers the served model (SGLang's name for it, else the kvtier config's `model`), its
    weights (`kvtier_weights_id`, else a fingerprint of the weight files: `served_weights`), the
    page dtype and size, and in the salt the tenant, the rank's shard and the host layout.

    Raises:
        ConfigError: a weight file exists but cannot be read.
    """
    salt = f"{config.tenant}|{shard_label(sc)}|{host_layout}"
    weights = options.weights_id or weights_fingerprint(served_weights(sc, config))
    return Namespace(sc.model_name or config.model, dtype, page_tokens, salt, weights)


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
