"""Block keys: chaining on the prefix, namespaces, determinism across processes.

Cost: a few seconds; two short subprocesses check `PYTHONHASHSEED` independence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.model.geometry import KVDtype
from kvtier.model.keys import ROOT_KEY, Namespace, block_extra, block_keys, keys_hex, next_block_key

NS = Namespace(model="Llama-2-7B", kv_dtype="fp16", block_tokens=4, tenant_salt="tenant-a")
TOKENS = list(range(10))

token_lists = st.lists(st.integers(min_value=0, max_value=(1 << 31) - 1), max_size=64)


def test_golden_keys_never_change():
    """Persisted blocks (SSD, pool nodes) are found by these bytes; a change here orphans them all."""
    assert NS.digest.hex() == "13f8f1e7ec979eb1a9ec1165d7e253e7"  # namespace v2 (with weights)
    assert keys_hex(block_keys(NS, TOKENS)) == [
        "597e12c428c57e2dff1f4b71ecf64e05",
        "b02d57da238c573035bb2fc3447c7ca8",
    ]


def test_key_is_xxh3_128_of_namespace_parent_and_int64_tokens():
    first = xxhash.xxh3_128_digest(NS.digest + bytes(16) + np.arange(4, dtype="<i8").tobytes())
    second = xxhash.xxh3_128_digest(NS.digest + first + np.arange(4, 8, dtype="<i8").tobytes())
    assert block_keys(NS, TOKENS) == [first, second]


def test_keys_are_16_hashable_bytes():
    keys = block_keys(NS, TOKENS)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert {k: i for i, k in enumerate(keys)}[keys[1]] == 1


@pytest.mark.parametrize(
    "tokens",
    [TOKENS, tuple(TOKENS), np.arange(10, dtype=np.int32), np.arange(10, dtype=np.uint16),
     np.repeat(np.arange(10), 2)[::2], torch.arange(10), torch.arange(10, dtype=torch.int32)],
)  # fmt: skip
def test_every_container_gives_the_same_keys(tokens):
    assert block_keys(NS, tokens) == block_keys(NS, TOKENS)


def test_partial_block_gets_no_key():
    assert len(block_keys(NS, TOKENS[:3])) == 0
    assert len(block_keys(NS, TOKENS[:8])) == 2
    assert block_keys(NS, TOKENS[:9]) == block_keys(NS, TOKENS[:8])
    assert block_keys(NS, []) == []


KEYS_SCRIPT = """
import json
from kvtier.model.keys import Namespace, block_keys, keys_hex
ns = Namespace(model="Llama-2-7B", kv_dtype="fp16", block_tokens=4, tenant_salt="tenant-a")
print(json.dumps(keys_hex(block_keys(ns, list(range(10))))))
"""


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_keys_are_identical_in_a_process_with_another_hash_seed(seed):
    env = os.environ | {"PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", KEYS_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert json.loads(out.stdout) == keys_hex(block_keys(NS, TOKENS))


@pytest.mark.parametrize(
    "other",
    [Namespace("Llama-3-8B", "fp16", 4, "tenant-a"), Namespace("Llama-2-7B", "fp8_e4m3", 4, "tenant-a"),
     Namespace("Llama-2-7B", "fp16", 4, "tenant-b"), Namespace("Llama-2-7B", "fp16", 4),
     Namespace("Llama-2-7B", "fp16", 4, "tenant-a", weights="files:0123")],
)  # fmt: skip
def test_any_namespace_change_changes_every_key(other):
    tokens = list(range(64))
    assert other.digest != NS.digest
    assert not set(block_keys(other, tokens)) & set(block_keys(NS, tokens))


def test_block_size_is_part_of_the_namespace():
    by_4 = block_keys(Namespace("m", "fp16", 4), range(8))
    by_8 = block_keys(Namespace("m", "fp16", 8), range(8))
    assert by_8[0] not in by_4


def test_fields_cannot_bleed_into_each_other():
    assert Namespace("ab", "c", 4).digest != Namespace("a", "bc", 4).digest
    assert Namespace("m", "fp16", 4, "x").digest != Namespace("m", "fp16x", 4).digest
    assert Namespace("m", "fp16", 4, "x", "y").digest != Namespace("m", "fp16", 4, "xy").digest


def test_kv_dtype_enum_and_its_name_are_the_same_namespace():
    assert Namespace("m", KVDtype.FP8, 4) == Namespace("m", "fp8", 4)
    assert Namespace("m", KVDtype.FP8, 4).digest == Namespace("m", "fp8", 4).digest


@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=64))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, cut):
    assert block_keys(NS, tokens[:cut]) == block_keys(NS, tokens)[: min(cut, len(tokens)) // 4]


@given(tokens=token_lists.filter(bool), data=st.data())
def test_changing_one_token_changes_its_block_and_all_later_ones(tokens, data):
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    before, after = block_keys(NS, tokens), block_keys(NS, changed)
    block = position // 4
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:]))


@given(tokens=token_lists, cut_blocks=st.integers(min_value=0, max_value=16))
def test_a_chain_can_be_extended_from_its_last_key(tokens, cut_blocks):
    cut = min(cut_blocks * 4, len(tokens) // 4 * 4)
    head = block_keys(NS, tokens[:cut])
    tail = block_keys(NS, tokens[cut:], parent=head[-1] if head else ROOT_KEY)
    assert head + tail == block_keys(NS, tokens)


def test_next_block_key_matches_block_keys():
    first = next_block_key(NS, ROOT_KEY, TOKENS[:4])
    assert [first, next_block_key(NS, first, TOKENS[4:8])] == block_keys(NS, TOKENS)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        next_block_key(NS, ROOT_KEY, TOKENS[:3])


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [([1.5, 2.0, 3.0, 4.0], TypeError, "integers"), ([[1, 2], [3, 4]], ValueError, "1-D"),
     (np.array([2**63], dtype=np.uint64), ValueError, "int64"), ([2**70, 1, 2, 3], ValueError, "int64"),
     ([True, False, True, False], TypeError, "integers")],
)  # fmt: skip
def test_bad_token_ids_raise(tokens, error, message):
    with pytest.raises(error, match=message):
        block_keys(NS, tokens)


def test_bad_parent_and_namespace_raise():
    with pytest.raises(ValueError, match="16 bytes"):
        block_keys(NS, TOKENS, parent=b"short")
    with pytest.raises(ConfigError, match="block_tokens"):
        Namespace("m", "fp16", 0)
    with pytest.raises(ConfigError, match="model"):
        Namespace("", "fp16", 16)
    with pytest.raises(ConfigError, match="Namespace.weights must be a string"):
        Namespace("m", "fp16", 16, weights=b"files:0123")


# ---- per-block extra inputs (a LoRA adapter, an image, prompt embeddings, a salt) ----------------

GOLDEN = ["597e12c428c57e2dff1f4b71ecf64e05", "b02d57da238c573035bb2fc3447c7ca8"]


@pytest.mark.parametrize("extras", [None, [None, None], [b"", None], [None, b""]])
def test_a_block_without_an_extra_keeps_the_key_it_had_before_extras_existed(extras):
    """Upgrading keeps every persisted block of a plain request (SSD tiers, pool nodes) valid."""
    assert keys_hex(block_keys(NS, TOKENS, extras=extras)) == GOLDEN
    assert block_extra([]) is None


def test_golden_keys_with_an_extra_never_change():
    extras = [block_extra([("lora", b"x")]), None]
    assert keys_hex(block_keys(NS, TOKENS, extras=extras)) == [
        "14fe2a7f920795d3ea97beebaf89f269",
        "d698a2cb91417ff2782b1f88680ca4fd",
    ]


def test_an_extra_changes_its_block_and_every_later_one_never_an_earlier_one():
    plain = block_keys(NS, list(range(12)))
    salted = block_keys(NS, list(range(12)), extras=[None, block_extra([("salt", b"a")]), None])
    assert salted[0] == plain[0]
    assert salted[1] != plain[1] and salted[2] != plain[2]
    # a chain extended from a key that carried an extra carries it on
    assert block_keys(NS, list(range(8, 12)), parent=salted[1]) == salted[2:]


@pytest.mark.parametrize(("a", "b"), [
    ([("lora", b"x")], [("lora", b"y")]),
    ([("lora", b"x")], [("salt", b"x")]),
    ([("ab", b"c")], [("a", b"bc")]),  # no shift of bytes between tag and value
    ([("a", b"x"), ("b", b"y")], [("b", b"y"), ("a", b"x")]),  # order is part of it
    ([("a", b"xy")], [("a", b"x"), ("a", b"y")]),
])  # fmt: skip
def test_different_extras_give_different_keys(a, b):
    assert block_extra(a) != block_extra(b)
    assert block_keys(NS, TOKENS[:4], extras=[block_extra(a)]) != block_keys(NS, TOKENS[:4], extras=[block_extra(b)])


def test_bad_extras_raise():
    with pytest.raises(ValueError, match="one per full block"):
        block_keys(NS, TOKENS, extras=[None])
    with pytest.raises(TypeError, match="bytes"):
        block_keys(NS, TOKENS, extras=["text", None])
    with pytest.raises(TypeError, match="tag"):
        block_extra([("lora", "not bytes")])
