"""The shared Mooncake traces in tests: where they are, a mark for the tests that need them, a loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.simulate.trace import Trace, load_trace

# The uncompressed originals (the package ships them compressed): the shared/ directory the
# repository is cloned next to, as in CI, or KVTIER_TRACE_DIR.
SHARED_TRACE_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "mooncake"
TRACE_DIR = Path(os.environ.get("KVTIER_TRACE_DIR", SHARED_TRACE_DIR))
needs_traces = pytest.mark.skipif(
    not (TRACE_DIR / "conversation_trace.jsonl").is_file(),
    reason=f"Mooncake traces not found in {TRACE_DIR} (the shared/ directory next to the repo, or KVTIER_TRACE_DIR)",
)


def mooncake(name: str) -> Trace:
    """The shared trace `name` ("conversation" or "synthetic"), loaded whole."""
    return load_trace(TRACE_DIR / f"{name}_trace.jsonl")


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return mooncake("conversation")


@pytest.fixture(scope="module")
def synthetic() -> Trace:
    return mooncake("synthetic")


# Five requests over 512-token blocks, with partial tails (tests/simulate works out answers for it by hand).
TINY_TRACE = [
    {"timestamp": 0, "input_length": 1124, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 9, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 4]},
    {"timestamp": 12, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
    {"timestamp": 20, "input_length": 1124, "output_length": 10, "hash_ids": [1, 2, 3]},
]
