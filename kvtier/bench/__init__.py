"""`kvtier bench`: spill/fill latency and bandwidth per tier path, against the machine's own limits.

- `measure`: paired timing of a kvtier op against its limit op, and the `Row` it yields.
- `limits`: the machine's own limits (memcpy / pinned cudaMemcpy, raw O_DIRECT pread/pwrite, a raw
  TCP socket on loopback) and the checks that keep the bench from writing where it should not.
- `rawsock`: the raw socket server (a subprocess, as a pool node is); imports nothing heavy.
- `paths`: the tier paths HBM<->DRAM, DRAM<->pool, DRAM<->SSD; `e2e`: spill/fill through a `KVTier`.
- `runner`: options, the plan of rows, and the run; `report`: Markdown, JSON and PNG plots.

Nothing is imported here, so `python -m kvtier.bench.rawsock` starts without torch.
"""
