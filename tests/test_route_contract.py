"""The `Route` contract (`kvtier.testing.route_contract`), run unchanged against every built-in route
of the transfer engine and a block-by-block fake.

Cases: host ↔ host (a DRAM tier and a caller's 2-D buffer, both ways; two 1-D buffers), memory with
a device end (a CPU tensor standing in for HBM), disk reads and writes (an SSD tier, from and into
a caller's buffer and a DRAM slot), disk → disk, the pool (a real `kvtier pool serve` node, its
blocks private to this process so that a layer span may be written alone), the batched device
copier on its stand-in driver (where nvcc builds it), and `Route.per_block` over the host copy (the
reference every batched route agrees with). Cost: ~10 s (the pool node, the stand-in's build).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from kvtier.moving.copies import Endpoint, Route
from kvtier.model.layout import BlockLayout
from kvtier.moving.native import find_nvcc
from kvtier.moving.routes import BuiltinRoutes
from kvtier.testing.route_contract import RouteCase, RouteContract, SlottedRouteContract
from kvtier.tiers.base import Medium, Tier
from kvtier.tiers.dram import DRAMTier
from kvtier.tiers.hbm import HBMTier
from kvtier.tiers.ssd import SSDTier
from kvtier.moving.engine import TransferEngine

LAYOUT = BlockLayout.uniform(16, 4, 4096 + 512)  # 18 KiB blocks; layers not 4 KiB multiples on purpose
BLOCK = LAYOUT.block_bytes
SLOTS = 12
_seeds = itertools.count(1)


def _random_block() -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(next(_seeds)))


def _tier_sources(tier: Tier):
    def sources(n: int):
        blocks = [_random_block() for _ in range(n)]
        for slot, block in enumerate(blocks):
            tier.write(slot, block)
        return [Endpoint(tier, slot) for slot in range(n)], blocks
    return sources


def _tier_destinations(tier: Tier, first_slot: int = SLOTS // 2):
    def destinations(n: int):
        for slot in range(first_slot, first_slot + n):
            tier.write(slot, torch.full((BLOCK,), 0xA5, dtype=torch.uint8))
        return [Endpoint(tier, slot) for slot in range(first_slot, first_slot + n)]
    return destinations


def _buffer_sources(n: int):
    rows = torch.stack([_random_block() for _ in range(n)])
    return [Endpoint(buffer=rows, slot=i) for i in range(n)], list(rows)


def _buffer_destinations(n: int):
    rows = torch.full((n, BLOCK), 0xA5, dtype=torch.uint8)
    return [Endpoint(buffer=rows, slot=i) for i in range(n)]


def _one_d_sources(n: int):
    blocks = [_random_block() for _ in range(n)]
    return [Endpoint(buffer=b.clone()) for b in blocks], blocks


def _one_d_destinations(n: int):
    return [Endpoint(buffer=torch.full((BLOCK,), 0xA5, dtype=torch.uint8)) for _ in range(n)]


def _read(end: Endpoint) -> torch.Tensor:
    if end.buffer is not None:
        return end.view(0, BLOCK).clone()
    out = torch.empty(BLOCK, dtype=torch.uint8)
    end.tier.read(end.slot, out)
    return out


def _key(i: int) -> bytes:
    return b"route-contract%02d" % i


NEEDS_NVCC = pytest.mark.skipif(find_nvcc() is None,
                                reason="nvcc not found: the batched device copier and its stand-in driver cannot be built")
SLOTTED = ["dram->buffer", "buffer->dram", "hbm->buffer", "buffer->hbm", "ssd->buffer", "buffer->ssd", "dram->ssd",
           "ssd->dram", "ssd->ssd", "pool->buffer", "buffer->pool", pytest.param("device-copier", marks=NEEDS_NVCC)]
BUFFERS_ONLY = ["buffer->buffer", "per-block"]  # both ends caller's buffers: no slot to put out of range


@pytest.fixture(scope="module")
def pool_node() -> Iterator[str]:
    from kvtier.pool.node.process import running_node

    with running_node(capacity="16MiB", region_size="1MiB") as node:
        yield node.address


@pytest.fixture
def built(tmp_path, request) -> Iterator:
    """`built(name)` -> the `RouteCase` of case `name`, everything it made closed afterwards."""
    made: list = []

    def build(name: str) -> RouteCase:
        engine = TransferEngine(LAYOUT)
        made.append(engine)
        return make_case(name, engine, tmp_path, made, request)

    yield build
    for thing in reversed(made):
        thing.close()


class TestSlottedRoutes(SlottedRouteContract):
    @pytest.fixture(params=SLOTTED)
    def case(self, request, built) -> RouteCase:
        return built(request.param)


class TestBufferRoutes(RouteContract):
    @pytest.fixture(params=BUFFERS_ONLY)
    def case(self, request, built) -> RouteCase:
        return built(request.param)


def make_case(name: str, engine: TransferEngine, tmp_path, made: list, request) -> RouteCase:
    """The route and both ends of case `name`; what it builds goes into `made`, closed afterwards."""
    def keep(thing):
        made.append(thing)
        return thing

    def dram() -> DRAMTier:
        return keep(DRAMTier(SLOTS * BLOCK, BLOCK))

    def ssd(sub: str) -> SSDTier:
        (tmp_path / sub).mkdir()
        return keep(SSDTier(tmp_path / sub, SLOTS * BLOCK, BLOCK, num_files=3))

    def pool() -> Tier:
        from kvtier.pool.client.api import PoolClient
        from kvtier.pool.client.tier import PoolTier

        address = request.getfixturevalue("pool_node")
        return keep(PoolTier(PoolClient([address], timeout_s=30), SLOTS * BLOCK, BLOCK, owns_client=True,
                             shared=False))

    routes = engine.routes
    host, device, disk, remote = Medium.HOST, Medium.DEVICE, Medium.DISK, Medium.REMOTE
    if name in ("dram->buffer", "buffer->dram", "hbm->buffer", "buffer->hbm"):
        tier = dram() if "dram" in name else keep(HBMTier(SLOTS * BLOCK, BLOCK, device="cpu"))
        medium = tier.medium
        if name.endswith("buffer"):
            return RouteCase(routes[medium, host], LAYOUT, _tier_sources(tier), _buffer_destinations, _read,
                             (Endpoint(tier, SLOTS), None))
        return RouteCase(routes[host, medium], LAYOUT, _buffer_sources, _tier_destinations(tier), _read,
                         (None, Endpoint(tier, SLOTS)))
    if name == "buffer->buffer":
        return RouteCase(routes[host, host], LAYOUT, _one_d_sources, _one_d_destinations, _read)
    if name in ("ssd->buffer", "ssd->dram", "pool->buffer"):
        tier = pool() if name.startswith("pool") else ssd("a")
        dst = _tier_destinations(dram(), 0) if name.endswith("dram") else _buffer_destinations
        return RouteCase(routes[tier.medium, host], LAYOUT, _tier_sources(tier), dst, _read,
                         (Endpoint(tier, SLOTS), None), _key)
    if name in ("buffer->ssd", "dram->ssd", "buffer->pool"):
        tier = pool() if name.endswith("pool") else ssd("a")
        src = _tier_sources(dram()) if name.startswith("dram") else _buffer_sources
        return RouteCase(routes[host, tier.medium], LAYOUT, src, _tier_destinations(tier), _read,
                         (None, Endpoint(tier, SLOTS)), _key)
    if name == "ssd->ssd":
        a, b = ssd("a"), ssd("b")
        return RouteCase(routes[disk, disk], LAYOUT, _tier_sources(a), _tier_destinations(b), _read,
                         (Endpoint(a, SLOTS), None), _key)
    if name == "device-copier":
        return _device_case(keep)
    assert name == "per-block" and (remote, host) in routes
    reference = BuiltinRoutes(LAYOUT, None, engine._staging)
    return RouteCase(Route.per_block(reference.copy_host), LAYOUT, _buffer_sources, _buffer_destinations, _read)


def _device_case(keep) -> RouteCase:
    from kvtier.moving.cuda_copy import CudaCopier
    from kvtier.testing.fake_cuda import DriverVariant, build_fake_driver

    copier = keep(CudaCopier(driver=build_fake_driver(DriverVariant.CUDA13)))
    hbm = keep(HBMTier(SLOTS * BLOCK, BLOCK, device="cpu"))
    routes = BuiltinRoutes(LAYOUT, None, lambda n, which: torch.empty(n, dtype=torch.uint8),
                           device_copier=lambda device: copier)
    return RouteCase(Route(routes.move_memory), LAYOUT, _buffer_sources, _tier_destinations(hbm), _read,
                     (None, Endpoint(hbm, SLOTS)))
