"""The resident path (kvtier/resident.py; `ResidentPath` in kvtier/_keytable.c;
`_movers.copy_slots`): a load or store that stays in one memory tier, decided by a few C calls
over the manager's columns and copied by one native call, held equal to the general path in all
that is observable: the index, each tier's LRU order and free slots, the counters, the moves it
triggers, and the bytes."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier._keytable import ResidentPath
from kvtier.deciding.index import READY
from kvtier.moving import _movers
from kvtier.observing.stats import DropReason
from kvtier.policy.lru import SlotLRUPolicy
from kvtier.tiers.base import TierKind

from support.runtime import BLOCK, LAYOUT, WAIT_S, blocks, runtime, store
from test_manager import make_manager

H, D, S = TierKind.HBM, TierKind.DRAM, TierKind.SSD


# ---- the manager's verbs: resident against general, step by step ---------------------------------

def _slots(n: int) -> array:
    return array("i", bytes(4 * n))


def _finish(m, moves) -> None:
    """Completes moves, and the moves they trigger, in order (both twins see the same order)."""
    moves = list(moves)
    while moves:
        moves = moves[1:] + list(m.complete_move(moves[0].id, True, (0,)))


def _store(m, keys, target, resident: bool) -> bool:
    placed = m.place_resident(keys, target) if resident else None
    if placed is not None:
        _finish(m, m.finish_resident(placed))
        return True
    plan = m.prepare_store(keys, target)
    _finish(m, list(plan.moves) + list(m.complete_store(plan)))
    return False


def _load(m, keys, resident: bool) -> bool:
    slots = _slots(len(keys))
    tier = m.lease_resident(keys, slots) if resident else None
    if tier is not None:
        _finish(m, m.end_resident(tier, slots))
        return True
    plan = m.prepare_load(keys)
    _finish(m, plan.moves)
    _finish(m, m.complete_load(plan))
    return False


def _observed(m) -> dict:
    """Everything the two paths must leave alike (block ids aside: they are the index's own)."""
    entries = sorted((e.key, sorted((k.name, c.slot, c.state.name, c.readers) for k, c in e.copies.items()),
                      e.pins, e.hits, e.prefetched, e.ready_tier) for e in m.index)
    orders = {k.name: list(p) for k, p in m._policies.items() if isinstance(p, SlotLRUPolicy)}
    free = {k.name: list(f) for k, f in m._free_lists.items()}
    return {"entries": entries, "lru": orders, "free": free, "stats": m.stats.snapshot()}


STEPS = st.lists(st.tuples(st.sampled_from(["store", "store", "load", "load", "prefetch", "pin", "unpin"]),
                           st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
                           st.sampled_from([None, H, D])),
                 min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, sizes=st.sampled_from([(2, 3, 4), (1, 4, 0), (0, 4, 0), (0, 3, 5), (3, 2, 3)]),
       marks=st.sampled_from([(1.0, 1.0), (0.75, 0.5)]), promote_to=st.sampled_from([D, H, None]))
def test_the_resident_verbs_leave_the_manager_as_the_general_ones_do(steps, sizes, marks, promote_to):
    kinds = [k for k, n in zip((H, D, S), sizes) if n]
    if promote_to not in (None, *kinds):
        promote_to = None

    def manager():
        from kvtier.deciding.manager import TierManager, TierSlots
        from kvtier.policy import make_policy
        return TierManager([TierSlots(k, n, make_policy("lru", n), high_watermark=marks[0], low_watermark=marks[1])
                            for k, n in zip((H, D, S), sizes) if n], promote_to=promote_to)

    fast, general = manager(), manager()
    fast.serve_resident({H, D})
    took = 0
    for op, keys, target in steps:
        target = target if target in kinds else None
        if op == "store":
            took += _store(fast, keys, target, True)
            _store(general, keys, target, False)
        elif op == "load":
            took += _load(fast, keys, True)
            _load(general, keys, False)
        elif op == "prefetch":
            for m in (fast, general):
                _finish(m, m.prepare_prefetch(keys, D if D in kinds else kinds[0], 4))
        elif op == "pin":
            assert fast.pin(keys) == general.pin(keys)
        else:
            a, b = fast.unpin(keys), general.unpin(keys)
            assert a[0] == b[0]
            _finish(fast, a[1])
            _finish(general, b[1])
        assert _observed(fast) == _observed(general), f"after {op} {keys} -> {target}"


def test_the_resident_verbs_take_the_common_batches():
    """A DRAM hit and a store into free DRAM slots, or into a full last tier, go the resident way;
    what would need a plan (a miss, a promotion due, a full tier with one below) does not."""
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    dram = TierManager([TierSlots(D, 4, make_policy("lru", 4))])
    dram.serve_resident({D})
    assert _store(dram, [1, 2, 3, 4], None, True)
    assert _load(dram, [1, 2], True)
    assert _store(dram, [5, 6], None, True), "a full last tier drops its LRU blocks in one call"
    assert dram.where(3) is None and dram.where(4) is None and dram.stats.dropped[DropReason.EVICTED] == 2
    assert not _load(dram, [1, 7], True), "one miss: the general path, which reports it"
    assert not _store(dram, [1, 8], None, True), "one key present: the general path"

    m = make_manager((2, 2, 4))  # promote_to DRAM
    m.serve_resident({H, D})
    assert _store(m, [1, 2], None, True)
    assert not _store(m, [3], None, True), "HBM full with DRAM below: a demotion, the general path's"
    assert [m.where(k) for k in (1, 2, 3)] == [D, H, D], "1 demoted; 3 spilled past HBM, whose slot was still read"
    assert _load(m, [2], True) and _load(m, [3, 1], True), "all in one tier, DRAM at or above promote_to"
    assert not _load(m, [2, 3], True), "two tiers"
    up = make_manager((2, 2, 4), promote_to=H)
    up.serve_resident({H, D})
    _store(up, [1, 2, 3], None, False)
    assert [up.where(k) for k in (1, 2, 3)] == [H, H, D]
    assert _load(up, [2], True) and not _load(up, [3], True), "a load from DRAM promotes into HBM: a move"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS, new=st.lists(st.integers(20, 25), min_size=1, max_size=3, unique=True))
def test_a_withdrawn_placement_leaves_the_manager_as_it_found_it(steps, new):
    """`withdraw_resident` (a reservation not written): after any history, placing new blocks
    into free slots and withdrawing them leaves the index, the LRU orders, the free lists and
    every counter as they were."""
    m = make_manager((2, 3, 6))
    m.serve_resident({H, D})
    for verb, keys, target in steps:
        if verb == "store":
            _store(m, keys, target, True)
        elif verb == "load" and all(m.where(k) is not None for k in keys):
            _load(m, keys, True)
    before = _observed(m)
    placed = m.place_resident(new, None)
    if placed is None or len(new) > len(before["free"][placed[0].name]):
        return  # not placed, or placed over dropped victims: then the victims stay dropped
    assert not m.withdraw_resident(placed)
    assert _observed(m) == before


def test_a_copy_released_while_a_resident_load_read_it_is_freed_when_the_load_ends():
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, 2, make_policy("lru", 2), high_watermark=0.5, low_watermark=0.5),
                     TierSlots(S, 4, make_policy("lru", 4))])
    m.serve_resident({D})
    plan = m.prepare_store([1, 2])
    demotions = m.complete_store(plan)  # 2 of 2 slots > 50 %: block 1 (the LRU) is demoted
    assert [mv.key for mv in demotions] == [1]
    slots = _slots(1)
    assert m.lease_resident([1], slots) is D, "a demotion out of DRAM is no reason to leave the path"
    _finish(m, demotions)  # the DRAM copy is released, but read: FREEING until the load ends
    assert m.index.get(1).copies[D].state.name == "FREEING"
    _finish(m, m.end_resident(D, slots))
    assert D not in m.index.get(1).copies and m.where(1) is S, "its DRAM slot freed by end_resident"


# ---- the C verbs: all or nothing ----------------------------------------------------------------

def test_lease_changes_nothing_unless_every_block_qualifies():
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, 4, make_policy("lru", 4))])
    m.serve_resident({D})
    _store(m, [1, 2, 3], None, False)
    before = _observed(m)
    assert m.lease_resident([1, 2, 9], _slots(3)) is None, "a miss"
    assert m.lease_resident([], _slots(0)) is None
    m.index.prefetched[m._ids.get(2)] = 1
    assert m.lease_resident([1, 2], _slots(2)) is None, "prefetched, never loaded: the general path counts it used"
    m.index.prefetched[m._ids.get(2)] = 0
    assert _observed(m) == before
    with pytest.raises(ValueError, match="out holds 1 slots for 2 keys"):
        m.lease_resident([1, 2], _slots(1))
    assert _observed(m) == before


def test_evict_claim_and_ready_refuse_what_the_index_does_not_allow():
    from kvtier.deciding.manager import TierManager, TierSlots
    from kvtier.policy import make_policy

    m = TierManager([TierSlots(D, 2, make_policy("lru", 2))])
    m.serve_resident({D})
    _store(m, [1, 2], None, False)
    m.pin([1, 2])
    before = _observed(m)
    assert m.place_resident([3], None) is None, "every block pinned: no victim, nothing changed"
    assert _observed(m) == before
    path: ResidentPath = m._resident
    ids, slots = array("i", [m._ids.get(1)]), array("i", [m._slot[D][m._ids.get(1)]])
    with pytest.raises(ValueError, match="cannot take slot"):
        path.claim(int(D), ids, slots)  # block 1 already has its copy there
    with pytest.raises(ValueError, match="cannot take slot"):
        path.ready(int(D), ids, slots)  # READY already, not WRITING
    with pytest.raises(ValueError, match="no slot column for tier 0"):
        path.claim(int(H), ids, slots)
    assert _observed(m) == before and m.index.get(1).copies[D].state.name == "READY" and READY == 2


# ---- the copy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
def test_copy_slots_moves_whole_rows_both_ways_and_checks_every_slot_first(threads):
    slab = torch.zeros(8, 4096, dtype=torch.uint8)
    rows = torch.randint(0, 256, (3, 4096), dtype=torch.uint8)
    slots = array("i", [5, 0, 7])
    _movers.copy_slots(slab.data_ptr(), slab.stride(0), 8, rows.data_ptr(), rows.stride(0), slots, 4096, False,
                       threads=threads)
    assert torch.equal(slab[[5, 0, 7]], rows) and not slab[[1, 2, 3, 4, 6]].any()
    back = torch.zeros_like(rows)
    _movers.copy_slots(slab.data_ptr(), slab.stride(0), 8, back.data_ptr(), back.stride(0), slots, 4096, True,
                       threads=threads)
    assert torch.equal(back, rows)
    slab.zero_()
    with pytest.raises(ValueError, match="slot 8 of a slab of 8 rows"):
        _movers.copy_slots(slab.data_ptr(), slab.stride(0), 8, rows.data_ptr(), rows.stride(0),
                           array("i", [0, 8]), 4096, False)
    assert not slab.any(), "nothing copied when one slot is out of range"
    with pytest.raises(TypeError, match="4-byte integers"):
        _movers.copy_slots(slab.data_ptr(), slab.stride(0), 8, rows.data_ptr(), rows.stride(0),
                           np.zeros(2, np.int64), 4096, False)


# ---- the runtime: resident against general, with real tiers and bytes ----------------------------

RUNTIME_STEPS = st.lists(st.tuples(st.sampled_from(["store", "load", "load", "prefetch", "pin", "unpin"]),
                                   st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True),
                                   st.sampled_from(["sync", "async", "background"])),
                         min_size=1, max_size=20)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=RUNTIME_STEPS, tiers=st.sampled_from([dict(hbm=0, ssd=0), dict(), dict(promote_to=None)]),
       inline=st.booleans())
def test_a_runtime_with_the_resident_path_serves_and_counts_as_one_without(tmp_path_factory, steps, tiers, inline):
    """Real tiers (HBM stand-in, DRAM, SSD files) and real bytes: the same answers, the same
    blocks where they were, the same counters (bytes per route included), with and without;
    with copies on workers (not `inline`), the same answers and the same blocks held (see below)."""
    kw = dict(inline_bytes=4 * BLOCK if inline else 0, **tiers)
    if not inline and kw.get("ssd", 6):
        # Copies on the engine's workers: a demotion in flight holds a slot in both tiers, so with
        # the SSD at 6 a cascade can drop the SSD's least recent block, and which block that is
        # depends on the order demotions completed in (the machine's timing). Room for every key
        # on SSD takes drops out of it; the inline runs keep the tight geometry, drops included.
        kw["ssd"] = 12  # the 10 keys, and 2 to spare
    fast, general = runtime(tmp_path_factory.mktemp("fast"), **kw), runtime(tmp_path_factory.mktemp("general"), **kw)
    general._resident._media = ()  # the general path only
    universe = list(range(10))
    try:
        for op, keys, how in steps:
            sync, background = how == "sync", how == "background"
            if op == "store":
                a, b = (kv.store(keys, blocks(keys), sync=sync, background=background) for kv in (fast, general))
            elif op == "load":
                outs = [torch.zeros(len(keys), BLOCK, dtype=torch.uint8) for _ in range(2)]
                a, b = (kv.load(keys, out, sync=sync) for kv, out in zip((fast, general), outs))
            elif op == "prefetch":
                a, b = (kv.prefetch(keys).handle for kv in (fast, general))
            elif op == "pin":
                assert fast.pin(keys) == general.pin(keys)
                continue
            else:
                assert fast.unpin(keys) == general.unpin(keys)
                continue
            for h in (a, b):
                h.wait(WAIT_S)
            assert set(a.failed) == set(b.failed), f"{op} {keys}"
            if op == "load":
                for i, k in enumerate(keys):
                    if k not in a.failed:
                        assert torch.equal(outs[0][i], blocks([k])[0]) and torch.equal(outs[1][i], outs[0][i])
            for kv in (fast, general):
                kv.quiesce(WAIT_S)
            if not inline:
                # Copies on the engine's workers: a demotion a store starts completes in its own
                # thread, before or after the store, and a policy ranks whichever landed last as
                # the more recent, so which tier a block sits in after a later eviction is the
                # machine's timing (two runtimes of one path differ as often). What must agree: the
                # blocks held, and no drop where the SSD has room for every key (DRAM alone moves
                # nothing, so its drops are the same in both).
                held = [{k for k, w in zip(universe, kv.where(universe)) if w is not None} for kv in (fast, general)]
                assert held[0] == held[1], f"after {op} {keys}"
                dropped = [kv.stats.snapshot()["dropped"] for kv in (fast, general)]
                assert dropped[0] == dropped[1], f"after {op} {keys}"
                assert "ssd" in tiers or not dropped[0], f"after {op} {keys}: {dropped[0]}"
                continue
            assert fast.where(universe) == general.where(universe), f"after {op} {keys}"
            counts = [{k: v for k, v in kv.stats.snapshot().items() if k != "transfer_latency"} for kv in (fast, general)]
            assert counts[0] == counts[1], f"after {op} {keys}"
    finally:
        fast.close()
        general.close()


def test_a_dram_hit_and_a_store_into_dram_make_no_plan(tmp_path, monkeypatch):
    with runtime(tmp_path, hbm=0, ssd=0) as kv:
        for verb in ("prepare_load", "prepare_store", "complete_load", "complete_store"):
            monkeypatch.setattr(kv.manager, verb, _refuse(verb))
        keys = [1, 2, 3]
        assert not kv.store(keys, blocks(keys), sync=True).failed
        out = torch.zeros(3, BLOCK, dtype=torch.uint8)
        assert not kv.load(keys, out, sync=True).failed and torch.equal(out, blocks(keys))
        assert kv.stats.hits[D] == 3 and kv.stats.stores[D] == 3
        assert kv.stats.bytes_moved[("buffer:cpu", "dram")] == 3 * BLOCK
        assert kv.stats.bytes_moved[("dram", "buffer:cpu")] == 3 * BLOCK
        monkeypatch.undo()
        assert set(kv.load([1, 9], torch.zeros(2, BLOCK, dtype=torch.uint8), sync=True).failed) == {9}


def test_a_route_put_in_the_table_sees_every_copy_it_routes(tmp_path):
    from kvtier.moving.copies import Route
    from kvtier.tiers.base import Medium

    seen = []
    with runtime(tmp_path, hbm=0, ssd=0) as kv:
        builtin = kv.engine.routes[Medium.HOST, Medium.HOST]
        kv.engine.add_route(Medium.HOST, Medium.HOST, Route(lambda batch: (seen.append(len(batch.ops)), builtin.run(batch))))
        assert not kv.store([1, 2], blocks([1, 2]), sync=True).failed
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        assert not kv.load([1, 2], out, sync=True).failed and torch.equal(out, blocks([1, 2]))
    assert seen == [2, 2]


def _refuse(verb):
    def refused(*args, **kwargs):
        raise AssertionError(f"{verb} called: the batch should have taken the resident path")
    return refused


def test_after_close_a_store_or_load_raises_as_the_general_path_does(tmp_path):
    kv = runtime(tmp_path, hbm=0, ssd=0)
    assert not kv.store([1], blocks([1]), sync=True).failed
    kv.close()
    for call in (lambda: kv.store([2], blocks([2]), sync=True), lambda: kv.store([2], blocks([2]), background=True),
                 lambda: kv.load([1], torch.zeros(1, BLOCK, dtype=torch.uint8), sync=True)):
        with pytest.raises(RuntimeError, match="transfer engine is closed"):
            call()


def test_copies_nobody_waits_for_take_one_thread(tmp_path, monkeypatch):
    """A background store's copy and a demotion's take one native thread, however large; a copy
    a caller waits for shares `copy_threads` once each thread gets `PARALLEL_COPY_BYTES`."""
    from kvtier.moving import routes

    monkeypatch.setattr(routes, "PARALLEL_COPY_BYTES", BLOCK)  # every batch of two blocks is "large"
    threads: list[int] = []
    for name in ("copy", "copy_slots"):
        def spy(*args, inner=getattr(_movers, name), **kwargs):
            threads.append(kwargs.get("threads", 1))
            return inner(*args, **kwargs)
        monkeypatch.setattr(routes._movers, name, spy)
    with runtime(tmp_path, hbm=2, dram=4, ssd=0, marks=(0.5, 0.5)) as kv:
        assert not kv.store([1, 2], blocks([1, 2]), sync=True).failed  # into HBM: resident, waited for
        assert threads[0] == 2
        kv.quiesce(WAIT_S)  # HBM at 2 of 2 > 50 %: demoted to DRAM on the background workers
        assert kv.where([1, 2]).count(D) >= 1 and len(threads) >= 2 and set(threads[1:]) == {1}
        threads.clear()
        assert kv.store([3, 4], blocks([3, 4]), target=D, background=True).wait(WAIT_S)
        assert threads == [1]


def test_a_large_resident_load_reports_each_run_of_layers_as_it_lands(tmp_path, monkeypatch):
    """Too large to run inline, a resident load goes to a worker and copies layer by layer
    (`chunk_bytes` 0): `wait_layer(0)` returns while the later layers are still held back."""
    import threading

    with runtime(tmp_path, hbm=0, ssd=0, chunk_bytes=0, inline_bytes=0) as kv:
        keys = [1, 2, 3]
        assert not kv.store(keys, blocks(keys), sync=True).failed
        gate, spans = threading.Event(), []
        inner = kv.engine._builtin.copy_slots

        def gated(slab, slots, rows, to_rows, background, offset, length):
            spans.append(offset)
            if offset > 0:
                assert gate.wait(WAIT_S)
            return inner(slab, slots, rows, to_rows, background, offset, length)

        monkeypatch.setattr(kv.engine._builtin, "copy_slots", gated)
        out = torch.zeros(3, BLOCK, dtype=torch.uint8)
        handle = kv.load(keys, out)
        handle.wait_layer(0, WAIT_S)
        assert not handle.done() and torch.equal(out[:, :LAYOUT.offsets[1]], blocks(keys)[:, :LAYOUT.offsets[1]])
        gate.set()
        assert handle.wait(WAIT_S) and not handle.failed and torch.equal(out, blocks(keys))
        assert spans == list(LAYOUT.offsets[:-1]), "one native copy per layer, in order"
        assert kv.stats.hits[D] == 3 and kv.stats.bytes_moved[("dram", "buffer:cpu")] == 3 * BLOCK



def test_a_large_store_goes_to_a_foreground_worker_in_one_native_copy(tmp_path, monkeypatch):
    """Too large to run inline, a store the caller waits for later still takes the resident path:
    one native copy of the whole batch on a foreground worker (threads shared as a waited-for copy
    of its size), the handle finished once the blocks are READY, and the caller's thread not
    held for the copy (it returns while the copy is gated)."""
    import threading

    from kvtier.moving import routes

    monkeypatch.setattr(routes, "PARALLEL_COPY_BYTES", BLOCK)  # every batch of two blocks is "large"
    with runtime(tmp_path, hbm=0, ssd=0, inline_bytes=0) as kv:
        gate, calls = threading.Event(), []
        inner = routes._movers.copy_slots

        def gated(*args, **kwargs):
            calls.append((threading.current_thread().name, kwargs.get("threads", 1)))
            assert gate.wait(WAIT_S)
            return inner(*args, **kwargs)

        monkeypatch.setattr(routes._movers, "copy_slots", gated)
        keys = [1, 2, 3]
        handle = kv.store(keys, blocks(keys))
        assert not handle.done() and kv.lookup(keys) == 0  # returned with the copy still held
        gate.set()
        assert handle.wait(WAIT_S) and not handle.failed
        assert len(calls) == 1 and calls[0][0] != threading.current_thread().name and calls[0][1] == 2
        assert kv.where(keys) == [D] * 3 and kv.stats.stores[D] == 3
        out = torch.zeros(3, BLOCK, dtype=torch.uint8)
        assert not kv.load(keys, out, sync=True).failed and torch.equal(out, blocks(keys))


def test_a_store_that_ends_while_close_waits_for_it_goes_through_and_its_demotions_are_not_started(tmp_path, monkeypatch, caplog):
    """`KVTier.close` waits for a background store in flight; when that store lands it makes room
    below it (DRAM past its watermark), but the engine has closed: the demotions it asks for are
    not started (no traceback, no internal error given to the store), and the store itself, which
    went through, is not failed. Found under load (a probe that closed right after storing)."""
    import logging
    import threading

    from kvtier.moving import routes

    with runtime(tmp_path, hbm=0, dram=4, ssd=8, marks=(0.5, 0.5)) as kv:
        assert not kv.store([1, 2], blocks([1, 2]), sync=True).failed
        kv.quiesce(WAIT_S)
        gate, entered = threading.Event(), threading.Event()
        inner = routes._movers.copy_slots

        def gated(*args, **kwargs):
            entered.set()
            assert gate.wait(WAIT_S)
            return inner(*args, **kwargs)

        monkeypatch.setattr(routes._movers, "copy_slots", gated)
        handle = kv.store([3, 4], blocks([3, 4]), background=True)
        assert entered.wait(WAIT_S)
        closer = threading.Thread(target=kv.close)
        with caplog.at_level(logging.INFO, logger="kvtier"):
            closer.start()
            while not kv.engine.closed:
                closer.join(0.01)
            gate.set()
            closer.join(WAIT_S)
        assert not closer.is_alive()
        assert handle.wait(WAIT_S) and not handle.failed and handle.error is None
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert "moves asked for while closing were not started" in caplog.text

# ---- reservations: blocks the caller writes in place ---------------------------------------------

def test_reserved_blocks_are_hidden_until_committed_then_served_as_stored(tmp_path):
    """`KVTier.reserve`: slots of DRAM for new blocks, WRITING (found by no lookup or load) until
    `commit`; then READY, counted as stores, served byte for byte; a block not written is given
    back (its slot free again, nothing counted, never found)."""
    with runtime(tmp_path, hbm=0, ssd=0) as kv:
        reservation = kv.reserve([1, 2, 3])
        assert reservation is not None and reservation.tier is D and reservation.rows.shape == (3, BLOCK)
        assert sorted(reservation.slots.tolist()) == [0, 1, 2]
        reservation.rows[reservation.slots] = blocks([1, 2, 3])
        assert kv.lookup([1]) == 0 and set(kv.load([1], torch.zeros(1, BLOCK, dtype=torch.uint8),
                                                   sync=True).failed) == {1}
        reservation.commit([True, False, True])
        assert (kv.lookup([1]), kv.lookup([2]), kv.lookup([3])) == (1, 0, 1)
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        assert not kv.load([1, 3], out, sync=True).failed and torch.equal(out, blocks([1, 3]))
        assert kv.stats.stores[D] == 2 and sum(kv.stats.dropped.values()) == 0
        again = kv.reserve([4])  # the slot key 2 had is free again
        assert again is not None and again.slots.tolist() == [reservation.slots.tolist()[1]]
        again.commit([False])


def test_a_reservation_is_refused_where_a_store_would_not_stay_in_the_tier(tmp_path):
    """None, nothing changed, for what the general path must decide: a key held already (or
    reserved), duplicate keys, a full DRAM whose victims would be demoted into a tier below."""
    with runtime(tmp_path, hbm=0, dram=3, ssd=6) as kv:
        store(kv, [1], D)
        assert kv.reserve([1, 2]) is None and kv.reserve([2, 2]) is None
        held = kv.reserve([2, 3])
        assert held is not None and kv.reserve([3]) is None  # 3 is WRITING under the first reservation
        assert kv.reserve([4]) is None  # DRAM is full: its victim would be demoted to the SSD
        held.commit()
        assert kv.where([1, 2, 3, 4]) == [D, D, D, None] and kv.stats.stores[D] == 3


def test_a_reservation_in_the_last_tier_drops_its_oldest_blocks_counted(tmp_path):
    with runtime(tmp_path, hbm=0, dram=3, ssd=0) as kv:
        store(kv, [1, 2, 3], D)
        reservation = kv.reserve([4, 5])
        assert reservation is not None and kv.where([1, 2, 3]) == [None, None, D]
        assert kv.stats.dropped[DropReason.EVICTED] == 2 and kv.stats.evictions[D] == 2
        reservation.commit()


def test_a_reservation_is_committed_once_with_a_flag_per_block_and_not_after_close(tmp_path):
    kv = runtime(tmp_path, hbm=0, ssd=0)
    reservation = kv.reserve([1, 2])
    with pytest.raises(ValueError, match="1 flags for 2 reserved blocks"):
        reservation.commit([True])
    reservation.commit()
    with pytest.raises(RuntimeError, match="committed already"):
        reservation.commit()
    late = kv.reserve([3])
    kv.close()
    with pytest.raises(RuntimeError, match="kvtier is closed"):
        late.commit()
    assert kv.reserve([4]) is None
