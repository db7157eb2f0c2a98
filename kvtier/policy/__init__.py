"""Eviction policies and admission rules.

`make_policy` builds one tier's policy from its config: a `PolicyKind` plus that kind's parameters.
"""

from __future__ import annotations

import enum
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policy.admission import AdmissionKind, AdmissionRule
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.chain import ChainARCPolicy
from kvtier.policy.lru import LRUPolicy, SlotLRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy

__all__ = [
    "ARCPolicy",
    "AdmissionKind",
    "AdmissionRule",
    "ChainARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyKind",
    "S3FIFOPolicy",
    "SlotLRUPolicy",
    "make_policy",
]


class PolicyKind(enum.Enum):
    """The eviction policies a tier can use."""

    LRU = "lru"
    S3FIFO = "s3fifo"
    ARC = "arc"
    CHAIN_ARC = "chain-arc"


# Parameters each kind accepts besides capacity_hint; their defaults live in the classes.
_PARAMS: dict[PolicyKind, frozenset[str]] = {
    PolicyKind.LRU: frozenset(),
    PolicyKind.S3FIFO: frozenset({"small_ratio", "ghost_ratio", "max_freq"}),
    PolicyKind.ARC: frozenset(),
    PolicyKind.CHAIN_ARC: frozenset(),
}


def make_policy(kind: PolicyKind | str, capacity_hint: int, **params: Any) -> EvictionPolicy:
    """Builds an empty eviction policy.

    Args:
        kind: which policy; a `PolicyKind` or its value ("lru", "s3fifo", "arc", "chain-arc").
        capacity_hint: expected number of resident keys (>= 1); S3-FIFO and the ARCs size their
            internal queues from it, LRU its arrays (it grows past it if need be).
        **params: the kind's own parameters (S3-FIFO: small_ratio, ghost_ratio, max_freq).
    Returns:
        A new policy tracking no keys. For LRU, a `SlotLRUPolicy`: its keys are integers >= 0 (the
        manager hands policies slot numbers); `LRUPolicy` takes any keys.
    Raises:
        ConfigError: unknown kind, a parameter the kind does not take, or a value out of range;
            the message names the parameter.
    """
    kind = _policy_kind(kind)
    if isinstance(capacity_hint, bool) or not isinstance(capacity_hint, int) or capacity_hint < 1:
        raise ConfigError(f"policy.capacity_hint must be an integer >= 1, got {capacity_hint!r}")
    unknown = sorted(set(params) - _PARAMS[kind])
    if unknown:
        raise ConfigError(f"policy.{unknown[0]} is not a parameter of policy {kind.value!r}")
    if kind is PolicyKind.LRU:
        return SlotLRUPolicy(capacity_hint)
    if kind is PolicyKind.S3FIFO:
        return S3FIFOPolicy(capacity_hint, **params)
    if kind is PolicyKind.CHAIN_ARC:
        return ChainARCPolicy(capacity_hint)
    return ARCPolicy(capacity_hint)


def _policy_kind(kind: PolicyKind | str) -> PolicyKind:
    """Returns `kind` as a PolicyKind.

    Raises:
        ConfigError: `kind` is neither a PolicyKind nor one's value.
    """
    if isinstance(kind, PolicyKind):
        return kind
    try:
        return PolicyKind(kind)
    except ValueError:
        valid = ", ".join(k.value for k in PolicyKind)
        raise ConfigError(f"policy.kind must be one of {valid}, got {kind!r}") from None
