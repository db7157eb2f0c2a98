"""SGLang: `storage.KVTierStorage`, a HiCache storage backend over kvtier; `options` its settings."""
