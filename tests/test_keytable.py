"""`kvtier._keytable.KeyTable` (C): the same answers as a dict of (tag, key) -> id.

A hypothesis state machine runs random stores, deletes (by key and by id), lookups and re-stores
against a dict, through every size change of the table, with keys of the table's kind, keys of
other kinds (kept on the side) and several tags; then the edges: keys a client picks to collide,
bad ids and tags, and memory that does not grow per key as a dict's does.
"""

from __future__ import annotations

import gc
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier._keytable import KeyTable

DIGESTS = st.binary(min_size=16, max_size=16)
INTS = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.integers(min_value=0, max_value=300))
# Keys the table part never takes, and none equal to one it takes (see the test of 1 and True).
OTHERS = st.one_of(st.binary(max_size=15), st.integers(min_value=2**63, max_value=2**64), st.text(max_size=3),
                   st.tuples(st.integers(0, 3), st.integers(0, 3)))
TAGS = st.sampled_from([0, 0, 0, 1, 7, 65535])


class _Model(RuleBasedStateMachine):
    """A KeyTable and a dict, kept in step; ids handed out from a free list as the index does."""

    usual = DIGESTS
    other_kind = INTS  # the other kind the table part takes: the part's kind changes when it empties

    def __init__(self) -> None:
        super().__init__()
        self.table, self.model = KeyTable(), {}  # model: (tag, key) -> id
        self.free, self.next_id = [], 0

    def keys(self):
        return st.one_of(self.usual, self.usual, self.usual, OTHERS, self.other_kind)

    def _new_id(self) -> int:
        if self.free:
            return self.free.pop()
        self.next_id += 1
        return self.next_id - 1

    def _add(self, key, tag: int) -> None:
        if (tag, key) in self.model:
            return
        block = self._new_id()
        self.table.add(key, block, tag)
        self.model[tag, key] = block

    @rule(data=st.data())
    def store(self, data) -> None:
        self._add(data.draw(self.keys()), data.draw(TAGS))

    @rule(data=st.data())
    def store_many(self, data) -> None:  # past several resizes of the table
        tag = data.draw(TAGS)
        for key in data.draw(st.lists(self.usual, min_size=50, max_size=150, unique=True)):
            self._add(key, tag)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data) -> None:
        tag, key = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        block = self.model.pop((tag, key))
        if tag == 0 and data.draw(st.booleans()):
            del self.table[key]
        else:
            popped = self.table.pop_id(block)
            assert popped == key and type(popped) is type(key)
        self.free.append(block)

    @rule(data=st.data())
    def look_up(self, data) -> None:
        key, tag = data.draw(self.keys()), data.draw(TAGS)
        expected = self.model.get((tag, key))
        assert self.table.find(key, tag) == (-1 if expected is None else expected)
        if tag == 0:
            assert self.table.get(key) == expected and (key in self.table) == (expected is not None)
        if expected is not None:
            assert self.table.key_of(expected) == key and self.table.tag_of(expected) == tag

    @invariant()
    def agrees(self) -> None:
        assert len(self.table) == len(self.model)
        if len(self.model) < 64 or len(self.model) % 37 == 0:  # a full comparison now and then
            by_id = {block: key for (_, key), block in self.model.items()}
            assert dict((block, key) for key, block in self.table.items()) == by_id
            assert self.table.values() == sorted(by_id)


class TestDigestKeys(_Model.TestCase):
    settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


class _IntModel(_Model):
    usual, other_kind = INTS, DIGESTS


class TestIntKeys(_IntModel.TestCase):
    settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_first_usual_key_chooses_the_kind_and_the_rest_go_on_the_side():
    table = KeyTable()
    assert table.mode is None and table.get(b"x" * 16) is None and 3 not in table
    table["first"] = 0  # no kind yet: on the side
    table[b"a" * 16] = 1
    assert table.mode == "digest" and table.num_side == 1
    strangers = [b"short", b"a" * 17, 5, "a" * 16, (1, 2)]
    for block, stranger in enumerate(strangers, start=2):
        table[stranger] = block
    assert table.num_side == 1 + len(strangers) and len(table) == 2 + len(strangers)
    assert [table[s] for s in strangers] == list(range(2, 2 + len(strangers)))
    assert [type(table.key_of(block)) for block in range(7)] == [str, bytes, bytes, bytes, int, str, tuple]
    del table[b"a" * 16]
    table[7] = 20  # the table part is empty again: the next usual key may choose again
    assert table.mode == "int" and table.key_of(20) == 7 and table[5] == 4  # 5 came before: on the side
    assert table.pop_id(4) == 5 and 5 not in table
    with pytest.raises(TypeError, match="unhashable"):
        table.get([1])
    with pytest.raises(TypeError, match="unhashable"):
        table[[1]] = 30


def test_equal_keys_of_other_types_match_as_in_a_dict():
    """1, True and 1.0 are one key, as in a dict, whether 1 is in the table part or on the side (more
    in tests/attacks/test_attack_native_modules.py)."""
    table = KeyTable()
    table[1] = 0
    assert table.get(True) == table.get(1.0) == table[1] == 0 and table.num_side == 0
    with pytest.raises(ValueError, match="stored at id 0 already"):
        table[True] = 1
    del table[1.0]
    table[True] = 1  # the table part is empty: True goes on the side, where 1 finds it
    assert (table[1], table.get(1.0), table.key_of(1)) == (1, 1, True) and table.num_side == 1


def test_ids_and_tags_are_checked_and_an_id_holds_one_key():
    table = KeyTable()
    for bad in (-1, 2**31 - 1, 2**40):
        with pytest.raises(ValueError, match="id must be"):
            table[b"k" * 16] = bad
    for bad in (-1, 65536):
        with pytest.raises(ValueError, match="tag must be"):
            table.add(b"k" * 16, 0, bad)
        with pytest.raises(ValueError, match="tag must be"):
            table.find(b"k" * 16, bad)
    with pytest.raises(TypeError):
        table[b"k" * 16] = "zero"
    table[b"k" * 16] = 3
    with pytest.raises(ValueError, match="holds another key"):
        table[b"j" * 16] = 3
    with pytest.raises(ValueError, match="stored at id 3 already"):
        table[b"k" * 16] = 4
    table.add(b"k" * 16, 4, 1)  # the same key under another tag is another key
    assert table.find(b"k" * 16, 1) == 4 and table[b"k" * 16] == 3
    for missing in (0, 5, 10**6, -1):
        with pytest.raises(KeyError, match="no key is stored"):
            table.key_of(missing)
        with pytest.raises(KeyError):
            table.pop_id(missing)
    assert len(table) == 2


def test_keys_a_client_picks_to_collide_in_the_low_bits_still_find_their_own_ids():
    """Digests are hashed with the process's random SipHash key: keys that share all but one
    byte, or differ in one bit, spread like any others."""
    table = KeyTable()
    keys = [bytes(15) + bytes([i]) for i in range(256)] + [(1 << i).to_bytes(16, "little") for i in range(128)]
    keys += [os.urandom(16) for _ in range(5_000)]
    keys = list(dict.fromkeys(keys))
    for block, key in enumerate(keys):
        table.add(key, block, block % 3)
    assert all(table.find(key, block % 3) == block for block, key in enumerate(keys))
    assert all(table.find(key, (block + 1) % 3) == -1 for block, key in enumerate(keys))
    for block in range(0, len(keys), 2):
        table.pop_id(block)
    assert all(table.find(key, block % 3) == (-1 if block % 2 == 0 else block) for block, key in enumerate(keys))


def test_keys_of_the_usual_kind_cost_tens_of_bytes_each_and_the_collector_walks_none():
    table = KeyTable()
    n = 200_000
    for block in range(n):
        table[block.to_bytes(16, "little")] = block
    assert table.num_side == 0 and gc.get_referents(table) == []
    assert table.nbytes / n < 48, table.nbytes / n  # 16 key bytes, hash, tag, flag, 4-byte slots at <= 3/4
    for block in range(0, n, 3):
        del table[block.to_bytes(16, "little")]
    assert len(table) == n - len(range(0, n, 3))
    assert table.get((1).to_bytes(16, "little")) == 1 and table.get((3).to_bytes(16, "little")) is None


class _ListModel(RuleBasedStateMachine):
    """A KeyList against an OrderedDict of key -> value (None stands for 0): the same order and
    values after every operation."""

    def __init__(self) -> None:
        super().__init__()
        from collections import OrderedDict

        from kvtier._keytable import KeyList

        self.keys, self.model = KeyList(), OrderedDict()

    KEYS = st.one_of(DIGESTS, DIGESTS, st.integers(0, 50), st.text(max_size=2))
    VALUES = st.one_of(st.none(), st.integers(0, 255))

    @rule(key=KEYS, value=VALUES)
    def set(self, key, value) -> None:
        self.keys[key] = value
        self.model[key] = value or 0

    @rule(data=st.data())
    def append_many(self, data) -> None:
        for key in data.draw(st.lists(DIGESTS, max_size=120)):
            self.keys[key] = None
            self.model[key] = 0

    @rule(key=KEYS, last=st.booleans())
    def move(self, key, last) -> None:
        if key in self.model:
            self.keys.move_to_end(key, last=last)
            self.model.move_to_end(key, last=last)
        else:
            with pytest.raises(KeyError):
                self.keys.move_to_end(key, last=last)

    @rule(key=KEYS)
    def pop(self, key) -> None:
        assert self.keys.pop(key, "missing") == self.model.pop(key, "missing")

    @rule(key=KEYS)
    def read(self, key) -> None:
        assert self.keys.get(key) == self.model.get(key)
        if key in self.model:
            assert self.keys[key] == self.model[key]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_present(self, data) -> None:
        key = data.draw(st.sampled_from(list(self.model)))
        del self.keys[key]
        del self.model[key]

    @rule(last=st.booleans())
    def popitem(self, last) -> None:
        if self.model:
            assert self.keys.popitem(last=last) == self.model.popitem(last=last)
        else:
            with pytest.raises(KeyError):
                self.keys.popitem(last=last)

    @invariant()
    def same_order(self) -> None:
        assert len(self.keys) == len(self.model) and bool(self.keys) == bool(self.model)
        assert list(self.keys) == list(self.model)
        if self.model:
            assert self.keys.first() == next(iter(self.model))


class TestKeyList(_ListModel.TestCase):
    settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_key_list_refuses_to_iterate_on_after_a_change_and_holds_byte_values():
    from kvtier._keytable import KeyList

    keys = KeyList()
    for i in range(5):
        keys[i.to_bytes(16, "little")] = None
    it = iter(keys)
    next(it)
    keys.move_to_end((0).to_bytes(16, "little"))
    with pytest.raises(RuntimeError, match="mutated during iteration"):
        next(it)
    for bad in (256, -1, "one", 1.5):
        with pytest.raises(TypeError, match="None or 0..255"):
            keys[b"x" * 16] = bad
    assert b"x" * 16 not in keys and gc.get_referents(keys) != [] and len(keys) == 5  # its key table, one object


def test_a_key_list_takes_last_as_an_ordered_dict_does_and_names_a_bad_call():
    from collections import OrderedDict

    from kvtier._keytable import KeyList

    keys, model = KeyList(), OrderedDict()
    for k in range(6):
        keys[k] = model[k] = k
    for args, kwargs in (((3,), {}), ((2, False), {}), ((4,), {"last": 0}), ((1,), {"last": True})):
        keys.move_to_end(*args, **kwargs)
        model.move_to_end(*args, **kwargs)
    assert list(keys) == list(model)
    for args, kwargs in (((), {}), ((False,), {}), ((), {"last": False}), ((1,), {})):
        assert keys.popitem(*args, **kwargs) == model.popitem(*args, **kwargs)
    assert list(keys) == list(model)
    for call, args, kwargs in ((keys.move_to_end, (), {}), (keys.move_to_end, (1, True, 2), {}),
                               (keys.move_to_end, (1,), {"first": True}), (keys.popitem, (True, 1), {}),
                               (keys.popitem, (), {"oldest": True}), (keys.popitem, (True,), {"last": True})):
        with pytest.raises(TypeError, match="move_to_end|popitem"):
            call(*args, **kwargs)
    assert list(keys) == list(model)  # a refused call changed nothing
