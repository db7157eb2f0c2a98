"""Which special devices this host has, for the `gpu` and `rdma` marks (and tests of their absence)."""

from __future__ import annotations

import functools


@functools.cache
def has_cuda() -> bool:
    """A CUDA device torch can use."""
    import torch

    return torch.cuda.is_available()


@functools.cache
def has_rdma_device() -> bool:
    """An RDMA device real pyverbs can open (soft-RoCE counts: see kvtier/pool/rxe_setup.sh)."""
    from kvtier.pool.verbs import NoRDMADevice, device_names, load_verbs

    try:
        return bool(device_names(load_verbs("pyverbs")))
    except NoRDMADevice:
        return False
