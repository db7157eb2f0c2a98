"""Tenants of a pool node and the challenge-response that authenticates them.

The tenants file is YAML, read once when the node starts (the node's own edge; the runtime's
configuration stays in `kvtier.config`):

    tenants:
      - name: team-a
        secret_file: /etc/kvtier/team-a.key   # or `secret: ...` inline
        quota: 64GiB                          # optional; default: the node's whole capacity
      - name: ops
        secret_file: /etc/kvtier/ops.key
        operator: true                        # optional; default false

A tenant's STATS shows the node's static facts (transport, memory, region size, capacity) and its
own use, quota, blocks, leases and counters, never another tenant's activity. An **operator**
credential (`operator: true`) sees the node-wide figures instead: all tenants' use and counters,
connections, handshakes, authentication failures. Without a tenants file the one tenant,
`default`, is the operator (there is nobody else to hide from).

Authentication: the client sends its tenant name and a random nonce (HELLO); the node answers
with its own nonce; the client proves knowledge of the secret with
HMAC-SHA256(secret, "kvtier-pool-v1" | role | tenant | client nonce | node nonce) (AUTH), and the
node answers with the same MAC for the other role, so each side knows the other holds the secret.
No secret crosses the wire; a fresh nonce on each side defeats replay.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.pool.protocol import MAX_NAME_BYTES
from kvtier.units import parse_size

_TAG = b"kvtier-pool-v1"
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    secret: bytes
    quota_bytes: int
    operator: bool = False  # sees node-wide STATS

    def __repr__(self) -> str:  # never print a secret
        return f"Tenant({self.name!r}, quota_bytes={self.quota_bytes}, operator={self.operator})"


def proof(secret: bytes, role: bytes, tenant: str, client_nonce: bytes, node_nonce: bytes) -> bytes:
    """The 32-byte MAC one side sends; `role` is b"client" or b"node"."""
    msg = b"\0".join((_TAG, role, tenant.encode(), client_nonce, node_nonce))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def open_tenants(capacity_bytes: int) -> dict[str, Tenant]:
    """Without a tenants file: one tenant, `default`, with an empty secret, the whole node, operator."""
    return {DEFAULT_TENANT: Tenant(DEFAULT_TENANT, b"", capacity_bytes, operator=True)}


def load_tenants(path: str | Path, capacity_bytes: int) -> dict[str, Tenant]:
    """Reads and validates a tenants file.

    Raises:
        ConfigError: the file is unreadable or not YAML, or an entry is invalid; the message names
            the file and the field (`tenants[1].quota`).
    """
    import yaml  # here, not at the top: a node without a tenants file starts without YAML

    from kvtier.yaml_strict import load_yaml

    try:
        raw = load_yaml(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"tenants file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"tenants file {path}: not valid YAML: {e}") from None
    entries = raw.get("tenants") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"tenants file {path}: expected `tenants:` with a list of at least one tenant")
    tenants: dict[str, Tenant] = {}
    for i, entry in enumerate(entries):
        tenant = _tenant(entry, f"tenants file {path}: tenants[{i}]", Path(path).parent, capacity_bytes)
        if tenant.name in tenants:
            raise ConfigError(f"tenants file {path}: tenants[{i}].name: {tenant.name!r} appears twice")
        tenants[tenant.name] = tenant
    return tenants


def _tenant(entry: Any, where: str, base: Path, capacity_bytes: int) -> Tenant:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping, got {entry!r}")
    unknown = sorted(map(str, set(entry) - {"name", "secret", "secret_file", "quota", "operator"}))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field; expected name, secret, secret_file, quota, operator")
    name = entry.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_BYTES or not name.isprintable():
        raise ConfigError(f"{where}.name: expected a printable name of 1-{MAX_NAME_BYTES} characters, got {name!r}")
    secret = read_secret(entry.get("secret"), entry.get("secret_file"), where, base)
    if not secret:
        raise ConfigError(f"{where}: tenant {name!r} needs a non-empty secret or secret_file")
    quota = parse_size(entry.get("quota", capacity_bytes), f"{where}.quota")
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise ConfigError(f"{where}.operator: expected true or false, got {operator!r}")
    return Tenant(name, secret, quota, operator)


def read_secret(secret: Any, secret_file: Any, where: str, base: Path | None = None) -> bytes:
    """The secret given inline or in a file (surrounding whitespace stripped); b"" when neither.

    Raises:
        ConfigError: both given, or the file is unreadable.
    """
    if secret is not None and secret_file is not None:
        raise ConfigError(f"{where}: give secret or secret_file, not both")
    if secret_file is not None:
        return read_secret_file(secret_file, f"{where}.secret_file", base)
    if secret is not None and not isinstance(secret, str):
        raise ConfigError(f"{where}.secret: expected a string")
    return (secret or "").encode()


def read_secret_file(secret_file: Any, field: str, base: Path | None = None) -> bytes:
    """The secret in `secret_file` (surrounding whitespace stripped; a relative path is under `base`
    where given); `field` names where the path came from (a config field, a flag) in the error.

    Raises:
        ConfigError: the file is unreadable.
    """
    path = Path(str(secret_file)).expanduser()
    path = base / path if base is not None and not path.is_absolute() else path
    try:
        return path.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror}") from None
