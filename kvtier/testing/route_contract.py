"""The `Route` contract: what every route of the transfer engine must do with a batch, as a pytest class.

kvtier runs it against each built-in route (host ↔ host, memory with a device end, disk and remote
reads and writes, disk ↔ disk, the batched device copier on its stand-in driver) and a block-by-block
fake (tests/test_route_contract.py); a new route runs it the same way, by subclassing and giving
the `case` fixture:

    from kvtier.testing.route_contract import RouteCase, SlottedRouteContract

    class TestMyRoute(SlottedRouteContract):  # RouteContract where both ends are caller's buffers
        @pytest.fixture
        def case(self, tmp_path):
            ...  # build the tiers or buffers at both ends
            yield RouteCase(route, LAYOUT, sources, destinations, read)
            ...  # close them

A route gets one `SpanBatch` (one layer span of every block of a transfer) and must leave, for
each op, either the span in place at its destination — checked against `op.verify` where given,
with its per-layer checksums in `batch.checksums` where `op.checksum` asks — or a `StageError` in
`batch.failed`, and nothing else: one block's failure never fails another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvtier.moving.copies import CopyOp, Endpoint, Route, SpanBatch, block_seed, layer_checksum
from kvtier.moving.handle import Stage
from kvtier.model.layout import BlockLayout

NUM_BLOCKS = 5


@dataclass
class RouteCase:
    """One route under test and the two ends it joins.

    Attributes:
        route: the route.
        layout: the block layout of the copies.
        sources: `sources(n)` -> n source ends, each holding a distinct block, with those blocks'
            bytes (1-D uint8 CPU tensors).
        destinations: `destinations(n)` -> n destination ends, distinct from each other.
        read: `read(end)` -> the whole block now at a destination end (a CPU tensor).
        out_of_range: an end of each side whose slot is outside its tier (source, destination);
            None where that side is a caller's buffer, which has no slots (`SlottedRouteContract`
            needs one of the two).
        key: `key(i)` -> the key of block i (a shared tier files blocks under 16-byte keys).
    """

    route: Route
    layout: BlockLayout
    sources: Callable[[int], tuple[list[Endpoint], list[torch.Tensor]]]
    destinations: Callable[[int], list[Endpoint]]
    read: Callable[[Endpoint], torch.Tensor]
    out_of_range: tuple[Endpoint | None, Endpoint | None] = (None, None)
    key: Callable[[int], object] = lambda i: i


def sums_of(layout: BlockLayout, key, block: torch.Tensor) -> tuple[int, ...]:
    """The per-layer checksums of `block` under `key`, as a checked read expects them."""
    seed = block_seed(key)
    return tuple(layer_checksum(block[a:b], seed, layer)
                 for layer, (a, b) in enumerate(zip(layout.offsets, layout.offsets[1:])))


def run(case: RouteCase, ops: Sequence[CopyOp], first: int | None = None, last: int | None = None) -> SpanBatch:
    """Runs `ops` through the case's route as one span (default: every layer)."""
    layout = case.layout
    first = 0 if first is None else first
    last = layout.num_layers - 1 if last is None else last
    batch = SpanBatch(list(ops), first, last, layout.offsets[first], layout.offsets[last + 1] - layout.offsets[first])
    case.route.run(batch)
    return batch


class RouteContract:
    """What `Route.run` promises for a batch, whatever the media."""

    def test_a_batch_lands_byte_for_byte(self, case: RouteCase) -> None:
        srcs, blocks = case.sources(NUM_BLOCKS)
        dsts = case.destinations(NUM_BLOCKS)
        batch = run(case, [CopyOp(case.key(i), s, d) for i, (s, d) in enumerate(zip(srcs, dsts))])
        assert batch.failed == {}
        for d, block in zip(dsts, blocks):
            assert torch.equal(case.read(d), block)

    def test_a_layer_span_moves_those_layers_only(self, case: RouteCase) -> None:
        layout = case.layout
        layer = layout.num_layers // 2  # a middle layer: others on both sides where there are any
        srcs, blocks = case.sources(NUM_BLOCKS)
        dsts = case.destinations(NUM_BLOCKS)
        before = [case.read(d).clone() for d in dsts]
        ops = [CopyOp(case.key(i), s, d) for i, (s, d) in enumerate(zip(srcs, dsts))]
        assert run(case, ops, layer, layer).failed == {}
        a, b = layout.offsets[layer], layout.offsets[layer + 1]
        for d, block, old in zip(dsts, blocks, before):
            now = case.read(d)
            assert torch.equal(now[a:b], block[a:b]), "the span's layer landed"
            assert torch.equal(now[:a], old[:a]) and torch.equal(now[b:], old[b:]), "nothing else changed"

    def test_checksums_come_back_where_asked(self, case: RouteCase) -> None:
        srcs, blocks = case.sources(NUM_BLOCKS)
        dsts = case.destinations(NUM_BLOCKS)
        ops = [CopyOp(case.key(i), s, d, checksum=i % 2 == 0) for i, (s, d) in enumerate(zip(srcs, dsts))]
        batch = run(case, ops)
        assert batch.failed == {}
        assert set(batch.checksums) == {i for i in range(NUM_BLOCKS) if i % 2 == 0}
        for i, sums in batch.checksums.items():
            assert tuple(sums) == sums_of(case.layout, case.key(i), blocks[i])

    def test_a_block_that_fails_its_check_fails_alone_naming_the_layer(self, case: RouteCase) -> None:
        srcs, blocks = case.sources(NUM_BLOCKS)
        dsts = case.destinations(NUM_BLOCKS)
        verify = [sums_of(case.layout, case.key(i), b) for i, b in enumerate(blocks)]
        bad_layer = case.layout.num_layers - 1
        verify[2] = verify[2][:bad_layer] + (verify[2][bad_layer] ^ 1,)
        ops = [CopyOp(case.key(i), s, d, verify=verify[i]) for i, (s, d) in enumerate(zip(srcs, dsts))]
        batch = run(case, ops)
        assert set(batch.failed) == {2}
        assert batch.failed[2].stage == Stage.VERIFY and f"layer {bad_layer}" in str(batch.failed[2].cause)
        for i in (0, 1, 3, 4):
            assert torch.equal(case.read(dsts[i]), blocks[i])


class SlottedRouteContract(RouteContract):
    """The contract of a route with a tier at one end or both: the same, and an end whose slot is
    outside its tier (`RouteCase.out_of_range`) fails that block alone."""

    def test_an_end_out_of_range_fails_alone(self, case: RouteCase) -> None:
        bad_src, bad_dst = case.out_of_range
        assert bad_src is not None or bad_dst is not None, "a slotted case names an end out of range"
        srcs, blocks = case.sources(3)
        dsts = case.destinations(3)
        if bad_src is not None:
            srcs[1] = bad_src
        else:
            dsts[1] = bad_dst
        batch = run(case, [CopyOp(case.key(i), s, d) for i, (s, d) in enumerate(zip(srcs, dsts))])
        assert set(batch.failed) == {1}
        assert batch.failed[1].stage == (Stage.READ if bad_src is not None else Stage.WRITE)
        assert isinstance(batch.failed[1].cause, (IndexError, OSError))
        for i in (0, 2):
            assert torch.equal(case.read(dsts[i]), blocks[i])
