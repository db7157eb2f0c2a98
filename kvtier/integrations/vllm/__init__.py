"""vLLM: `connector.KVTierConnector`, a KV connector (`--kv-transfer-config`) over kvtier.

The scheduler side (`scheduler`, `lookup`: which prefix blocks kvtier holds) and the worker side
(`backends`, `transfers`, `pages`, `shards`, `pool`: moving vLLM's pages), with `settings` (the
connector's options), `metrics` and `log` (kvtier inside vLLM's process tree)."""
