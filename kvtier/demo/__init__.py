"""`kvtier demo`: a tiny model serving a multi-turn workload on every tier.

`run` (the workload and the command), `ttft` (time to first token per tier), `report` (memory probes,
tables and the plot), `noise` (which figures a busy machine made, decided from the numbers)."""
