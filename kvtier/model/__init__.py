"""Model identity: what a block is (`layout`, `geometry`, `catalog`) and what names it (`keys`, and
the fingerprint of the weights and config they are bound to, `weights`)."""
