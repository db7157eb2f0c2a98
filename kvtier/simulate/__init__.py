"""`kvtier simulate`: replaying request traces through the real manager, without moving bytes.

`trace` (Mooncake-format traces: reading, synthesizing), `replay` (one configuration through the
`TierManager`), `belady` (the offline optimum, for comparison) and `sweep` (many configurations)."""
