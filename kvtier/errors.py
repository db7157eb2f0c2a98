"""kvtier's error vocabulary.

An expected miss is a return value, never an exception. These are raised when a contract is broken
or input is bad, and each message names the key, tier, field or file at fault.
"""


class KVTierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, of the wrong type or out of range; the message names the field."""


class GeometryError(KVTierError, ValueError):
    """A model's geometry is unknown or inconsistent (e.g. heads that do not divide)."""


class CapacityError(KVTierError):
    """A capacity cannot hold what it must (e.g. less than one block)."""


class TierIOError(KVTierError, OSError):
    """A tier failed to read or write bytes (disk full, unwritable path, short read)."""


class TierUnavailable(TierIOError):
    """The tier as a whole cannot serve now (its pool nodes do not answer, its device is gone),
    as opposed to one slot failing. The runtime takes it out of the cascade and probes it with
    backoff (`Tier.probe`) until it answers again."""


class IntegrityError(KVTierError):
    """Bytes read back do not match the checksum they were stored with."""


class TransferError(KVTierError):
    """A transfer failed or was cancelled; the blocks it carried are misses, never data."""
