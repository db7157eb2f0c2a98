"""Traces as operators bring them: compressed, with or without the partial tail block's hash id."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import zstandard

from kvtier.cli import main as cli_main
from kvtier.kinds import TierKind
from kvtier.simulate.replay import SimConfig, VirtualTier, simulate
from kvtier.simulate.trace import OnError, TraceError, load_trace
from support.traces import TRACE_DIR, needs_traces

# 512-token blocks. Request 1 lists its partial tail (ceil), request 2 leaves it out (floor), request
# 3 is whole blocks; request 4 repeats request 2's prefix.
LINES = [
    {"timestamp": 0, "input_length": 1124, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 1, "input_length": 1300, "output_length": 10, "hash_ids": [1, 4]},
    {"timestamp": 2, "input_length": 1024, "output_length": 10, "hash_ids": [5, 6]},
    {"timestamp": 3, "input_length": 1300, "output_length": 10, "hash_ids": [1, 4]},
]


def text(lines: list) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def one_tier(num_slots: int, **kw) -> SimConfig:
    return SimConfig((VirtualTier(TierKind.HBM, num_slots, 1.0),), block_bytes=1_000_000, **kw)


@pytest.mark.parametrize("kind", ["plain", "gzip", "zstd", "zstd-two-frames"])
def test_a_trace_reads_alike_plain_gzip_and_zstd_whatever_its_name(tmp_path, kind):
    data = text(LINES)
    packed = {"plain": data, "gzip": gzip.compress(data), "zstd": zstandard.ZstdCompressor().compress(data),
              "zstd-two-frames": zstandard.ZstdCompressor().compress(data[:50])
              + zstandard.ZstdCompressor().compress(data[50:])}[kind]
    path = tmp_path / "trace.jsonl"  # the format is told by the first bytes, not the name
    path.write_bytes(packed)
    trace = load_trace(path)
    plain = load_trace((tmp_path / "plain.jsonl", (tmp_path / "plain.jsonl").write_bytes(data))[0])
    assert trace.requests == plain.requests and len(trace.requests) == 4
    assert trace.num_accesses == 9 and trace.num_unique_blocks == 6


def test_floor_and_ceil_counts_are_accepted_counted_and_accounted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(text(LINES))
    trace = load_trace(path)
    assert [r.partial_tail for r in trace.requests] == [True, False, False, False]
    assert trace.describe()["hash_ids_per_request"] == {"whole": 1, "tail_listed": 1, "tail_absent": 2}
    report = simulate(trace, one_tier(100))
    # Hits: request 2 hits block 1, request 4 hits 1 and 4. Tokens saved: 512, then 1024 of 1300
    # (the floor line's 276 tail tokens are in no block: always computed).
    assert report["num_hits"] == 3
    assert report["prefill"]["tokens_saved"] == 512 + 1024
    # full_blocks_only drops only an id that names a partial block: request 1's block 3.
    dropped = simulate(trace, one_tier(100, full_blocks_only=True))
    assert dropped["num_accesses"] == 8 and dropped["num_hits"] == 3


def test_equal_hash_ids_share_one_object(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(text([{**LINES[0], "hash_ids": [10**12, 10**12 + 1, 10**12 + 2]},
                           {**LINES[0], "hash_ids": [10**12, 10**12 + 1, 10**12 + 3]}]))
    a, b = load_trace(path).requests
    assert a.hash_ids[0] is b.hash_ids[0] and a.hash_ids[1] is b.hash_ids[1]


def test_other_counts_are_still_malformed_and_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(text([LINES[0], {**LINES[1], "hash_ids": [1, 4, 7, 8]}]))
    with pytest.raises(TraceError, match=r"line 2: 4 hash_ids for input_length 1300: expected "
                                         r"ceil\(1300 / 512\) = 3 or floor = 2"):
        load_trace(path)
    assert len(load_trace(path, on_error=OnError.SKIP).requests) == 1


def test_a_compressed_trace_is_streamed_not_read_whole(tmp_path):
    """With `limit`, reading stops early: a corrupt end far past it is never reached."""
    many = text([LINES[i % 4] for i in range(20_000)])
    good = gzip.compress(many)
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(good[: len(good) // 2] + os.urandom(4096))  # its second half is garbage
    assert len(load_trace(path, limit=100).requests) == 100
    with pytest.raises(TraceError, match=r"big\.jsonl\.gz.*line \d+"):  # a garbled line, or the stream
        load_trace(path)


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_cut_or_corrupt_compressed_trace_is_an_error_naming_the_line_reached(tmp_path, kind):
    data = text([LINES[i % 4] for i in range(2000)])
    packed = gzip.compress(data) if kind == "gzip" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "t.jsonl"
    path.write_bytes(packed[: len(packed) * 2 // 3])  # cut short
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(path)
    # A flipped byte: the lines it garbles are malformed lines; the stream's checksum, at its end,
    # stops even a load that skips them.
    packed = gzip.compress(data) if kind == "gzip" else zstandard.ZstdCompressor(write_checksum=True).compress(data)
    corrupt = bytearray(packed)
    corrupt[len(corrupt) // 2] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    with pytest.raises(TraceError, match=r"t\.jsonl"):  # with the line, where one was read
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(path, on_error=OnError.SKIP)


def test_cli_reads_a_zstd_trace_and_reports_the_tail_counts(tmp_path, capsys):
    path = tmp_path / "agent.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(text(LINES)))
    assert cli_main(["simulate", "--trace", str(path), "--capacity", "hbm=100", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["hash_ids_per_request"] == {"whole": 1, "tail_listed": 1, "tail_absent": 2}
    assert report["runs"][0]["num_hits"] == 3
    assert cli_main(["simulate", "--trace", str(path), "--capacity", "hbm=100", "--no-progress"]) == 0
    assert "2 leave it out (floor" in capsys.readouterr().out


def test_a_file_out_of_time_order_is_replayed_in_time_order_and_says_so(tmp_path, capsys):
    # Lines 2 and 4 come after a later timestamp. In time order the trace is LINES (timestamps
    # 0, 1, 2, 3, with 2 and 3 given equal timestamps here: a stable sort keeps their file order).
    shuffled = [dict(LINES[2], timestamp=2), LINES[1], LINES[0], dict(LINES[3], timestamp=2)]
    path = tmp_path / "merged.jsonl"
    path.write_bytes(text(shuffled))
    trace = load_trace(path)
    assert trace.num_reordered == 2 and trace.describe()["num_reordered"] == 2
    assert [r.hash_ids for r in trace.requests] == [(1, 2, 3), (1, 4), (5, 6), (1, 4)]
    (tmp_path / "sorted.jsonl").write_bytes(text(LINES))
    in_order = load_trace(tmp_path / "sorted.jsonl")
    assert in_order.num_reordered == 0
    assert simulate(trace, one_tier(100))["num_hits"] == simulate(in_order, one_tier(100))["num_hits"] == 3
    assert cli_main(["simulate", "--trace", str(path), "--capacity", "hbm=100", "--no-progress"]) == 0
    assert "2 requests came after a later timestamp in the file: replayed in timestamp order" in capsys.readouterr().out


CONVERSATION = TRACE_DIR / "conversation_trace.jsonl"


@needs_traces
@pytest.mark.parametrize("share", [0.02, 0.10])
def test_single_tier_lru_hits_exactly_what_libcachesim_hits_on_a_gzipped_floor_trace(tmp_path, share):
    """An independent simulator (libCacheSim's LRU, its C code) as the check: each hash id an
    object of size 1. Half the conversation trace's lines leave their partial tail out (floor), and
    the file is gzipped, as a trace from elsewhere may come."""
    libcachesim = pytest.importorskip("libcachesim")
    lines = []
    for i, line in enumerate(CONVERSATION.read_text().splitlines()):
        obj = json.loads(line)
        if i % 2 and obj["input_length"] % 512:
            obj["hash_ids"] = obj["hash_ids"][:-1]
        lines.append(obj)
    path = tmp_path / "floor.jsonl.gz"
    path.write_bytes(gzip.compress(text(lines)))
    trace = load_trace(path)
    assert trace.describe()["hash_ids_per_request"]["tail_absent"] > 5000
    num_slots = round(share * trace.num_unique_blocks)
    ours = simulate(trace, one_tier(num_slots))
    cache = libcachesim.LRU(cache_size=num_slots)
    theirs = sum(cache.get(libcachesim.Request(obj_id=h, obj_size=1)) for r in trace.requests for h in r.hash_ids)
    assert ours["num_accesses"] == trace.num_accesses
    assert ours["num_hits"] == theirs > 0
    assert ours["engine"] == "native"  # the default path for LRU
