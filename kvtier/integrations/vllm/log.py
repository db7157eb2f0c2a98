"""kvtier's lines in vLLM's log: its start-up facts and its warnings, in vLLM's format.

vLLM configures only its own `vllm` logger (a handler and format of its own, `propagate=False`)
and leaves the root logger bare, so kvtier's records would reach nobody but Python's last-resort
handler (warnings only, unformatted). `log_through_vllm` gives the `kvtier` logger vLLM's
handlers and level, once per process, when a connector starts.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.units import format_bytes


def log_through_vllm() -> None:
    """Sends the `kvtier` logger's records through the `vllm` logger's handlers, at its level.

    Nothing changes where vLLM's logging is off (`VLLM_CONFIGURE_LOGGING=0`: no handlers) or
    where the application configured the root logger (kvtier's records already propagate there,
    and would otherwise be written twice).
    """
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not theirs.handlers or logging.getLogger().handlers:
        return
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())


def backend_summary(rank: int, backend: Any) -> str:
    """One line for the log: the rank's tiers with their capacities and media, the pool's data
    plane, and the blocks restored from a persistent SSD tier."""
    info = backend.describe()
    parts = [f"{t['tier']} {format_bytes(t['capacity_bytes'])} ({t['num_slots']:,} blocks, {_medium(t)})"
             for t in info["tiers"]]
    pool = info.get("pool")
    if pool:
        parts.append(f"pool {', '.join(pool['nodes'])} (tenant {pool['tenant']}, transport {pool['transport']}: "
                     f"{pool['transport_reason']})")
    restored = info.get("num_restored_blocks", 0)
    block = f"{format_bytes(info['block_bytes'])} blocks of {info['block_tokens']} tokens x {info['num_layers']} layers"
    return (f"kvtier rank {rank}: {block}; tiers " + "; ".join(parts)
            + f"; {restored:,} blocks restored from disk")


def _medium(tier: dict) -> str:
    if tier["tier"] == "ssd":
        io = "O_DIRECT" if tier.get("o_direct") else f"buffered: {tier.get('reason', '')}"
        return f"{tier['directory']}, {io}" + (", persistent" if tier.get("persist") else "")
    if tier["tier"] == "pool":
        return f"{tier.get('transport', '?')} to {', '.join(tier.get('nodes', ()))}"
    return str(tier.get("device", tier["medium"]))


def settings_summary(settings: Any) -> str:
    """One line for the log: what the scheduler side keys blocks by and where the config is."""
    ns, layout = settings.namespace, settings.layout
    return (f"kvtier connector: blocks of {ns.block_tokens} tokens (the engine's block size), KV {ns.kv_dtype} "
            f"(the engine's), {layout.num_layers} layers, {layout.block_bytes:,} bytes per block on each of "
            f"{settings.sharding.num_ranks} rank(s); kvtier config: {settings.config_source}")
