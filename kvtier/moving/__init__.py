"""Moving: the transfer engine (`engine`) and its routes, which execute plans in batches, in native
code outside the GIL (`_movers`: host copies and file I/O; `cuda_copy`: batched GPU copies;
`native`: gather/scatter between an engine's paged KV and kvtier's blocks). Nothing here decides."""
