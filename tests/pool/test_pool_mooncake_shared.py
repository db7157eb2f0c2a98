"""Mooncake Store shared by key through `KVTier` itself, two client processes on one real
`mooncake_master`: blocks a writer process stores are found and loaded byte-exact here; a miss
asked again is answered from the negative cache; a demotion of a block the store holds sends
nothing; the writer gone (closed, or killed) turns its blocks into misses, never errors or wrong
bytes; keys that are not `BlockKey`s stay private.

Why the writer stays alive while this process reads: a Mooncake object lives in the segment of a
client (the writer's own, the only one mounted when it stored), and goes with it.

Cost: about 40 s: a writer subprocess per scenario (torch, a KVTier, Mooncake's set-up), a
Mooncake client per `KVTier` here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvtier.config import config_from_dict  # noqa: E402
from kvtier.model.keys import Namespace, block_keys  # noqa: E402
from kvtier.pool.mooncake import MooncakeClient, Outcome  # noqa: E402
from kvtier.runtime import KVTier  # noqa: E402
from kvtier.testing.mooncake_master import MasterProcess  # noqa: E402
from kvtier.tiers.base import TierKind  # noqa: E402
from support.runtime import LAYOUT, WAIT_S  # noqa: E402

P = TierKind.POOL
pytestmark = pytest.mark.slow  # seconds per test (writer subprocesses, Mooncake set-ups)
TENANT = "serving"
KEYS = block_keys(Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens),
                  list(range(8 * LAYOUT.block_tokens)))  # 8 chained BlockKeys

# Another process: a KVTier over a Mooncake pool tier; stores its first n blocks (bytes derived
# from each key), prints what it did, then keeps its segment (where its blocks live) until told
# "close" on stdin. argv: config as JSON, n.
WRITER = r"""
import json, sys, torch
from kvtier.config import config_from_dict
from kvtier.model.layout import BlockLayout
from kvtier.model.keys import Namespace, block_keys
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
layout = BlockLayout.uniform(block_tokens=4, num_layers=4, layer_bytes=4096)
keys = block_keys(Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=4), list(range(32)))
n = int(sys.argv[2])
with KVTier(config_from_dict(json.loads(sys.argv[1])), layout=layout) as kv:
    data = torch.stack([torch.frombuffer(bytearray((k * (layout.block_bytes // 16 + 1))[:layout.block_bytes]),
                                         dtype=torch.uint8) for k in keys[:n]])
    handle = kv.store(keys[:n], data, target=TierKind.POOL)
    assert handle.wait(30) and not handle.failed, handle.failed
    kv.quiesce(30)
    facts = {"where": [t.name if t else None for t in kv.where(keys[:n])],
             "puts": kv.tiers[TierKind.POOL]._client.counters.get("puts", 0), **kv.snapshot()}
    print(json.dumps(facts, default=str), flush=True)
    assert sys.stdin.readline().strip() == "close"
print("closed", flush=True)
"""


def expected(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray((key * (LAYOUT.block_bytes // 16 + 1))[:LAYOUT.block_bytes]), dtype=torch.uint8)


def config(master: MasterProcess, **pool) -> dict:
    return {"model": "kvtier-tiny", "transfer": pool.pop("transfer", {}), "tiers": {
        "dram": {"capacity": LAYOUT.block_bytes, "high_watermark": 1.0, "low_watermark": 1.0},
        "pool": {"capacity": 16 * LAYOUT.block_bytes, "backend": "mooncake", "nodes": [master.address],
                 "metadata_server": master.metadata_server, "tenant": TENANT, "timeout_s": WAIT_S,
                 "high_watermark": 1.0, "low_watermark": 1.0, **pool}}}


class Writer:
    """The WRITER subprocess, up once it has stored its blocks (`facts`); its log goes to `log_path`."""

    def __init__(self, cfg: dict, n: int, log_path: Path) -> None:
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(cfg), str(n)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        line = self.proc.stdout.readline()  # the store waits at most 30 s; EOF if the writer failed
        if not line.startswith("{"):
            self.kill()
            raise AssertionError(f"writer failed: {line!r}\n{log_path.read_text(errors='replace')[-3000:]}")
        self.facts = json.loads(line)

    def close(self) -> None:
        """Lets the writer close its KVTier (and so its Mooncake client and segment) and exit."""
        if self.proc.poll() is None:
            self.proc.stdin.write("close\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "closed", self.log_path.read_text(errors="replace")[-3000:]
            self.proc.wait(WAIT_S)
        self._log.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(WAIT_S)
        self._log.close()


def load(kv: KVTier, keys) -> tuple[torch.Tensor, dict]:
    out = torch.zeros(len(keys), LAYOUT.block_bytes, dtype=torch.uint8)
    handle = kv.load(keys, out)
    handle.wait(WAIT_S)  # False where a block failed: the caller looks at which
    return out, handle.failed


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    m = MasterProcess()
    yield m
    m.close()


@pytest.fixture(scope="module")
def writer(master: MasterProcess, tmp_path_factory) -> Iterator[Writer]:
    """Four blocks, stored layer by layer (`chunk_bytes` 0: four spans a block, gathered into one put)."""
    w = Writer(config(master, transfer={"chunk_bytes": 0}), 4, tmp_path_factory.mktemp("writer") / "log")
    yield w
    w.close()


@pytest.fixture(scope="module")
def probe(master: MasterProcess, writer: Writer) -> Iterator[MooncakeClient]:
    """A bare client of the tenant, to see what the store holds (mounted after the writer stored)."""
    with MooncakeClient(master.address, master.metadata_server, tenant=TENANT, segment_bytes=16 << 20,
                        staging_bytes=16 << 20) as c:
        yield c


def test_blocks_another_process_stored_are_found_and_loaded(master, writer, probe) -> None:
    assert writer.facts["where"] == ["POOL"] * 4 and writer.facts["puts"] == 4  # one put per block
    assert probe.contains([bytes(k) for k in KEYS[:4]]) == [True] * 4  # each under its own key
    with KVTier(config_from_dict(config(master, transfer={"chunk_bytes": 0})), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:4]) == 4
        got, failed = load(kv, KEYS[:4])
        assert not failed
        for row, key in zip(got, KEYS[:4]):
            assert torch.equal(row, expected(key))
        snap = kv.snapshot()
        assert snap["hits"] == {"pool": 4}
        assert snap["shared"]["adopted"] == 4 and snap["shared"]["found"] == 4 and snap["shared"]["asked"] == 4
        assert kv.tiers[P]._client.counters["hits"] == 4  # four layer reads a block, one get each
    # this process closed: the shared blocks stay (a client never deletes them)
    assert probe.contains([bytes(k) for k in KEYS[:4]]) == [True] * 4


def test_a_repeated_miss_is_answered_from_the_negative_cache(master, writer) -> None:
    with KVTier(config_from_dict(config(master, negative_cache_s=60)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:6]) == 4  # asks for all six at once; 4 found, 2 absent
        assert kv.snapshot()["shared"] == {"adopted": 4, "asked": 6, "found": 4}
        assert kv.lookup(KEYS[:6]) == 4  # the four adopted are asked again (still there?); the two are not
        assert kv.snapshot()["shared"] == {"adopted": 4, "asked": 10, "found": 8, "negative_cached": 2}
    with KVTier(config_from_dict(config(master, negative_cache_s=0)), layout=LAYOUT) as kv:
        kv.lookup(KEYS[4:6])
        kv.lookup(KEYS[4:6])
        assert kv.snapshot()["shared"] == {"asked": 4}  # no cache: both misses asked both times


def test_a_demotion_of_a_block_the_store_holds_moves_no_bytes(master, writer, probe) -> None:
    """Loading the four adopted blocks one by one through a one-block DRAM tier promotes each, and
    each promotion demotes the one before back to the pool: the block is there, nothing is sent."""
    with KVTier(config_from_dict(config(master)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:4]) == 4
        for key in KEYS[:4]:
            got, failed = load(kv, [key])
            assert not failed and torch.equal(got[0], expected(key))
            kv.quiesce(WAIT_S)
        snap = kv.snapshot()
        demoted = snap["demotions"]["dram->pool"]
        assert demoted >= 1 and snap["promotions"]["pool->dram"] >= demoted
        assert snap["shared"]["deduplicated"] == demoted
        assert kv.tiers[P]._client.counters.get("puts", 0) == 0  # not one block sent
        assert kv.lookup(KEYS[:4]) == 4 and not load(kv, KEYS[:4])[1]


def test_keys_that_are_not_block_keys_stay_private(master, writer, probe) -> None:
    cfg = config_from_dict(config(master))
    with KVTier(cfg, layout=LAYOUT) as a, KVTier(cfg, layout=LAYOUT) as b:
        own = ["plain-string-key", 7]
        handle = a.store(own, torch.stack([expected(bytes(16))] * 2), target=P)
        assert handle.wait(WAIT_S) and not handle.failed
        assert a.lookup(own) == 2 and b.lookup(own) == 0
        assert "asked" not in b.snapshot()["shared"]
        got, failed = load(a, own)
        assert not failed and all(torch.equal(r, expected(bytes(16))) for r in got)


def test_sharing_off_keeps_block_keys_private(master, probe) -> None:
    with KVTier(config_from_dict(config(master, shared=False)), layout=LAYOUT) as kv:
        handle = kv.store(KEYS[6:8], torch.stack([expected(k) for k in KEYS[6:8]]), target=P)
        assert handle.wait(WAIT_S) and not handle.failed
        assert probe.contains([bytes(k) for k in KEYS[6:8]]) == [False, False]
        assert kv.lookup(KEYS[6:8]) == 2 and kv.snapshot()["shared"] == {}
        assert kv.tiers[P].describe()["sharing"] == "per process"


@pytest.mark.parametrize("gone", ["closed", "killed"])
def test_the_writer_gone_is_misses_never_wrong_bytes(tmp_path, gone) -> None:
    """Its own master, so that no other client's segment is mounted when the writer stores: every
    block lives in the writer's segment and goes with it."""
    own = MasterProcess()
    try:
        w = Writer(config(own), 3, tmp_path / "writer.log")
        with KVTier(config_from_dict(config(own, negative_cache_s=0)), layout=LAYOUT) as kv:
            assert kv.lookup(KEYS[:3]) == 3
            w.close() if gone == "closed" else w.kill()
            got, failed = load(kv, KEYS[:3])
            assert set(failed) == set(KEYS[:3])  # every block a miss...
            assert not got.any()  # ...and not one byte landed
            snap = kv.snapshot()
            assert snap["io_errors"] == 3 and snap["dropped"] == {"read_io_error": 3}
            outcomes = kv.tiers[P]._client.batch_get_outcomes(
                [bytes(k) for k in KEYS[:3]], [bytearray(LAYOUT.block_bytes) for _ in range(3)])
            if gone == "closed":  # its segment unmounted with it: the objects are gone at once
                assert outcomes == [Outcome.MISS] * 3 and kv.lookup(KEYS[:3]) == 0
            else:  # mounted until the master's client_ttl lapses: the objects are there, unreadable
                assert set(outcomes) <= {Outcome.FAILED, Outcome.MISS}
    finally:
        own.close()
