/* kvtier._keytable: block keys -> block ids, with no object per key.
 *
 * An engine's block index and a pool node's index map millions of keys to small integer ids. A
 * dict does that with a bytes object per key (~64 bytes), an int object per id (32 bytes) and ~42
 * bytes of its own table: ~140 bytes a block. `KeyTable` keeps each key's bytes at its id (16
 * bytes for a 16-byte digest, the usual `BlockKey`; 8 for a 64-bit int, a simulation's hash ids),
 * a 16-bit tag per id (a pool node's tenant: the same key under two tags is two keys), its hash
 * (so that deleting, resizing or comparing never hashes a stored key again), and an
 * open-addressing table of 32-bit ids (linear probing, at most 3/4 full, deletion by backward
 * shift: no tombstones): ~35-40 bytes a block, and nothing per key for the garbage collector.
 *
 * The table's kind of key is chosen by the first 16-byte `bytes` or int64 `int` stored while the
 * table part is empty (exact types: a bool is not stored there, nor a bytes subclass). Any other
 * key (another kind, length or type) is kept in a dict on the side, so every hashable key works
 * and only the usual ones are compact. Keys match as a dict's do: by Python's hash and `==`, so
 * True, 1 and 1.0 are one key, found in whichever part holds it (a key of another type is looked
 * for in the table part by its hash, then compared with `==`). The table part's hash is derived
 * from Python's: a digest's is SipHash with the process's random key (a client that picks its
 * keys cannot pick collisions), an int's goes through a 64-bit mixer.
 *
 * Ids are the caller's (0 <= id < 2**31 - 1), one key each.
 *
 * Re-entry. A key's `__hash__` and `__eq__`, and finalizers the garbage collector runs, are Python
 * code that may run in the middle of a call, and may call the same table (or, while they wait,
 * another thread may). Every call that reads or changes the table therefore holds it (`hold`):
 * a second call that starts while one runs raises RuntimeError and changes nothing, and the
 * first goes on with the state it started from. (A dict lets the second call through and starts
 * its lookup again; ids and slots here cannot be found again as cheaply.)
 *
 * Also here: `KeyList`, an OrderedDict of keys -> 0..255 built on a KeyTable (ARC's and S3-FIFO's
 * queues), `SlotList`, an LRU order over slot numbers (the base of `SlotLRUPolicy`), and
 * `ResidentPath`, the manager's verbs for a batch that stays in one memory tier.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)
#define MIN_SLOTS 64
#define DIGEST_BYTES 16
#define MAX_TAG 65535

enum { MODE_NONE = 0, MODE_DIGEST = 1, MODE_INT = 2 };
enum { UNKNOWN = 0, IN_TABLE = 1, ON_THE_SIDE = 2 };  /* `known[id]` */

typedef struct {
    PyObject_HEAD
    int32_t *slots;       /* an id, or EMPTY */
    size_t mask;          /* number of slots - 1 (a power of two) */
    Py_ssize_t used;      /* keys in the table part */
    unsigned char *keys;  /* per id: DIGEST_BYTES (digest mode) or 8 (int mode) */
    Py_hash_t *hashes;    /* per id: its key's hash, tag mixed in (a deletion or a resize rehashes nothing) */
    uint16_t *tags;       /* per id */
    unsigned char *known; /* per id: UNKNOWN, IN_TABLE or ON_THE_SIDE */
    Py_ssize_t key_cap;   /* ids `keys`, `tags` and `known` have room for */
    int mode;
    PyObject *side;       /* (tag, key) -> id, for keys the table part does not take; NULL until one comes */
    PyObject *side_keys;  /* id -> key, for the same */
    int busy;             /* a call is running (see "Re-entry" above) */
    int in_list;          /* the index of a KeyList: errors name the KeyList */
} KeyTable;

/* One key, parsed against the table's mode. */
typedef struct {
    const unsigned char *digest;
    int64_t value;
    Py_hash_t hash;
    uint16_t tag;
} Key;

static inline uint64_t mix64(uint64_t x) {  /* splitmix64's finalizer; mix64(0) == 0 */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* The mode `key` fits, or MODE_NONE. */
static int mode_of(PyObject *key) {
    if (PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == DIGEST_BYTES)
        return MODE_DIGEST;
    if (PyLong_CheckExact(key)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return MODE_NONE;
        }
        return overflow ? MODE_NONE : MODE_INT;
    }
    return MODE_NONE;
}

/* The table part's hash of a key whose Python hash is `h`, under `tag`: equal keys, whatever their
 * types, have equal Python hashes, so a key of another type is found where an equal stored key is. */
static inline Py_hash_t table_hash(const KeyTable *t, Py_hash_t h, uint16_t tag) {
    uint64_t x = t->mode == MODE_INT ? mix64((uint64_t)h) : (uint64_t)h;  /* a digest's is SipHash already */
    return (Py_hash_t)(x ^ mix64(tag));
}

/* hash(v) for an int64 `v`, as Python computes it for an int (v modulo 2**61 - 1, keeping the
 * sign; -1 is -2), without a call through the type: the table part's int keys are hashed often. */
static inline Py_hash_t int64_hash(int64_t v) {
#if SIZEOF_PY_HASH_T == 8 && defined(_PyHASH_BITS)
    const uint64_t modulus = ((uint64_t)1 << _PyHASH_BITS) - 1;
    uint64_t a = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    uint64_t r = (a & modulus) + (a >> _PyHASH_BITS);  /* 2**61 is 1 modulo 2**61 - 1 */
    if (r >= modulus)
        r -= modulus;
    Py_hash_t h = v < 0 ? -(Py_hash_t)r : (Py_hash_t)r;
    return h == -1 ? -2 : h;
#else
    PyObject *key = PyLong_FromLongLong(v);  /* never taken on the 64-bit builds kvtier targets */
    Py_hash_t h = key ? PyObject_Hash(key) : -1;
    Py_XDECREF(key);
    return h;
#endif
}

/* Parses `key` for the table part: 1 if it belongs there, 0 if not (a side key), -1 on error.
 * Runs no Python code: the keys it takes are exact bytes and ints, hashed in C. */
static int parse(KeyTable *t, PyObject *key, uint16_t tag, Key *out) {
    out->tag = tag;
    Py_hash_t h;
    if (t->mode == MODE_DIGEST) {
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != DIGEST_BYTES)
            return 0;
        out->digest = (const unsigned char *)PyBytes_AS_STRING(key);
        h = PyObject_Hash(key);  /* SipHash, cached in the bytes object */
    } else if (t->mode == MODE_INT) {
        if (!PyLong_CheckExact(key))
            return 0;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (overflow)
            return 0;
        out->value = (int64_t)v;
        h = int64_hash(out->value);
    } else {
        return 0;
    }
    if (h == -1)
        return -1;
    out->hash = table_hash(t, h, tag);
    return 1;
}

static inline Py_hash_t stored_hash(KeyTable *t, int32_t id) { return t->hashes[id]; }

static inline int stored_equals(KeyTable *t, int32_t id, const Key *k) {
    if (t->hashes[id] != k->hash || t->tags[id] != k->tag)
        return 0;
    if (t->mode == MODE_DIGEST)
        return memcmp(t->keys + (size_t)id * DIGEST_BYTES, k->digest, DIGEST_BYTES) == 0;
    int64_t v;
    memcpy(&v, t->keys + (size_t)id * 8, 8);
    return v == k->value;
}

/* The slot holding `k`, or -1. */
static Py_ssize_t find_slot(KeyTable *t, const Key *k) {
    if (t->slots == NULL)
        return -1;
    size_t i = (size_t)k->hash & t->mask;
    for (;;) {
        int32_t id = t->slots[i];
        if (id == EMPTY)
            return -1;
        if (stored_equals(t, id, k))
            return (Py_ssize_t)i;
        i = (i + 1) & t->mask;
    }
}

static int resize(KeyTable *t, size_t num_slots) {
    int32_t *slots = PyMem_Malloc(num_slots * sizeof(int32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xff, num_slots * sizeof(int32_t));  /* EMPTY everywhere */
    size_t mask = num_slots - 1;
    if (t->slots != NULL) {
        for (size_t j = 0; j <= t->mask; j++) {
            int32_t id = t->slots[j];
            if (id == EMPTY)
                continue;
            size_t i = (size_t)stored_hash(t, id) & mask;
            while (slots[i] != EMPTY)
                i = (i + 1) & mask;
            slots[i] = id;
        }
        PyMem_Free(t->slots);
    }
    t->slots = slots;
    t->mask = mask;
    return 0;
}

static int reserve_ids(KeyTable *t, Py_ssize_t id) {
    if (id < t->key_cap)
        return 0;
    Py_ssize_t cap = t->key_cap ? t->key_cap : 1024;
    while (cap <= id)
        cap += cap / 4 + 1;
    unsigned char *keys = PyMem_Realloc(t->keys, (size_t)cap * DIGEST_BYTES);
    if (keys == NULL)
        return PyErr_NoMemory(), -1;
    t->keys = keys;
    Py_hash_t *hashes = PyMem_Realloc(t->hashes, (size_t)cap * sizeof(Py_hash_t));
    if (hashes == NULL)
        return PyErr_NoMemory(), -1;
    t->hashes = hashes;
    uint16_t *tags = PyMem_Realloc(t->tags, (size_t)cap * sizeof(uint16_t));
    if (tags == NULL)
        return PyErr_NoMemory(), -1;
    t->tags = tags;
    unsigned char *known = PyMem_Realloc(t->known, (size_t)cap);
    if (known == NULL)
        return PyErr_NoMemory(), -1;
    memset(known + t->key_cap, UNKNOWN, (size_t)(cap - t->key_cap));
    t->known = known;
    t->key_cap = cap;
    return 0;
}

/* Removes the key in `slot`: backward-shift deletion keeps every probe sequence unbroken. */
static void delete_slot(KeyTable *t, size_t slot) {
    t->known[t->slots[slot]] = UNKNOWN;
    size_t hole = slot, i = slot;
    for (;;) {
        i = (i + 1) & t->mask;
        int32_t id = t->slots[i];
        if (id == EMPTY)
            break;
        size_t home = (size_t)stored_hash(t, id) & t->mask;
        /* `id` moves back into the hole unless its home lies cyclically in (hole, i]. */
        if ((i > hole && (home <= hole || home > i)) || (i < hole && home <= hole && home > i)) {
            t->slots[hole] = id;
            hole = i;
        }
    }
    t->slots[hole] = EMPTY;
    t->used--;
}

static PyObject *table_key(KeyTable *t, int32_t id) {
    if (t->mode == MODE_DIGEST)
        return PyBytes_FromStringAndSize((const char *)t->keys + (size_t)id * DIGEST_BYTES, DIGEST_BYTES);
    int64_t v;
    memcpy(&v, t->keys + (size_t)id * 8, 8);
    return PyLong_FromLongLong(v);
}

/* ---- keys on the side ------------------------------------------------------------------- */

/* Dict operations on side keys run the keys' __hash__ and __eq__: Python code, with the table held. */

static const char *name_of(const KeyTable *t) { return t->in_list ? "KeyList" : "KeyTable"; }

static PyObject *side_key(PyObject *key, uint16_t tag) { return Py_BuildValue("(HO)", tag, key); }

/* 1 found (*id set), 0 not, -1 error. */
static int side_lookup(KeyTable *t, PyObject *key, uint16_t tag, int32_t *id) {
    if (t->side == NULL || PyDict_GET_SIZE(t->side) == 0)
        return 0;
    PyObject *k = side_key(key, tag);
    if (k == NULL)
        return -1;
    PyObject *v = PyDict_GetItemWithError(t->side, k);  /* borrowed */
    Py_DECREF(k);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    *id = (int32_t)PyLong_AsLong(v);
    return 1;
}

/* Deletes `key` (an int: no Python code runs) from `dict`, keeping the exception that is set. */
static void del_keeping_error(PyObject *dict, PyObject *key) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    if (PyDict_DelItem(dict, key) < 0)
        PyErr_Clear();
    PyErr_SetRaisedException(exc);
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (PyDict_DelItem(dict, key) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, traceback);
#endif
}

/* Stores `key`, found absent, at a free `id` on the side. 0 ok, -1 error (nothing changed). */
static int side_store(KeyTable *t, PyObject *key, uint16_t tag, long id) {
    if (t->side == NULL && (t->side = PyDict_New()) == NULL)
        return -1;
    if (t->side_keys == NULL && (t->side_keys = PyDict_New()) == NULL)
        return -1;
    PyObject *k = side_key(key, tag), *v = PyLong_FromLong(id);
    int rc = -1;
    if (k == NULL || v == NULL || PyDict_SetItem(t->side_keys, v, k) < 0)
        goto done;
    PyObject *held = PyDict_SetDefault(t->side, k, v);  /* borrowed: `v` unless an equal key is there */
    if (held == v) {
        t->known[id] = ON_THE_SIDE;
        rc = 0;
    } else {
        if (held != NULL)  /* the lookup that found it absent saw another hash or another answer of == */
            PyErr_Format(PyExc_RuntimeError, "%s: a key's __hash__ or __eq__ answered two lookups of it differently",
                         name_of(t));
        del_keeping_error(t->side_keys, v);
    }
done:
    Py_XDECREF(k);
    Py_XDECREF(v);
    return rc;
}

/* The (tag, key) stored on the side at `id` (borrowed), or NULL with an exception set. */
static PyObject *side_entry(KeyTable *t, PyObject *id) {
    PyObject *k = t->side_keys == NULL ? NULL : PyDict_GetItemWithError(t->side_keys, id);
    if (k == NULL && !PyErr_Occurred())  /* its dicts were emptied by the garbage collector (tp_clear) */
        PyErr_Format(PyExc_RuntimeError, "%s: the key at id %R is gone (the table was cleared)", name_of(t), id);
    return k;
}

/* Removes the side key at `id`; returns the key (new reference), NULL on error (nothing changed). */
static PyObject *side_pop(KeyTable *t, int32_t id) {
    PyObject *v = PyLong_FromLong(id);
    if (v == NULL)
        return NULL;
    PyObject *k = side_entry(t, v);  /* borrowed: (tag, key) */
    if (k == NULL) {
        Py_DECREF(v);
        return NULL;
    }
    Py_INCREF(k);
    if (PyDict_DelItem(t->side, k) < 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_RuntimeError, "%s: the key at id %d is not found by its own hash any more (its "
                         "__hash__ or __eq__ changed)", name_of(t), (int)id);
        }
        Py_DECREF(k);
        Py_DECREF(v);
        return NULL;
    }
    int rc = PyDict_DelItem(t->side_keys, v);  /* an int key that is there: cannot fail */
    Py_DECREF(v);
    t->known[id] = UNKNOWN;
    PyObject *key = PyTuple_GET_ITEM(k, 1);
    Py_INCREF(key);
    Py_DECREF(k);
    if (rc < 0)
        Py_CLEAR(key);
    return key;
}

/* The side key at `id` (new reference), or NULL. */
static PyObject *side_key_of(KeyTable *t, int32_t id) {
    PyObject *v = PyLong_FromLong(id);
    if (v == NULL)
        return NULL;
    PyObject *k = side_entry(t, v);  /* borrowed */
    Py_DECREF(v);
    if (k == NULL)
        return NULL;
    PyObject *key = PyTuple_GET_ITEM(k, 1);
    Py_INCREF(key);
    return key;
}

/* ---- the operations --------------------------------------------------------------------- */

/* Looks for `key`, which the table part does not take, among the stored keys its Python hash
 * matches, comparing with `==` as a dict does (Python code may run: the table is held). 1 found
 * (*id set; *slot, if asked, its slot), 0 not, -1 error: an unhashable key raises, as for a dict. */
static int find_equal(KeyTable *t, PyObject *key, uint16_t tag, int32_t *id, Py_ssize_t *slot) {
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1)
        return -1;
    if (t->slots == NULL || t->used == 0)
        return 0;
    Py_hash_t hash = table_hash(t, h, tag);
    for (size_t i = (size_t)hash & t->mask; t->slots[i] != EMPTY; i = (i + 1) & t->mask) {
        int32_t at = t->slots[i];
        if (t->hashes[at] != hash || t->tags[at] != tag)
            continue;
        PyObject *stored = table_key(t, at);
        if (stored == NULL)
            return -1;
        int equal = PyObject_RichCompareBool(stored, key, Py_EQ);
        Py_DECREF(stored);
        if (equal < 0)
            return -1;
        if (equal) {
            *id = at;
            if (slot != NULL)
                *slot = (Py_ssize_t)i;
            return 1;
        }
    }
    return 0;
}

/* 1 found (*id set; *slot, if asked, its slot in the table part or -1 for a side key), 0 not,
 * -1 error. */
static int lookup_at(KeyTable *t, PyObject *key, uint16_t tag, int32_t *id, Py_ssize_t *slot) {
    if (slot != NULL)
        *slot = -1;
    Key k;
    int fits = parse(t, key, tag, &k);
    if (fits < 0)
        return -1;
    if (fits) {
        Py_ssize_t i = find_slot(t, &k);
        if (i >= 0) {
            *id = t->slots[i];
            if (slot != NULL)
                *slot = i;
            return 1;
        }
    } else {
        int found = find_equal(t, key, tag, id, slot);
        if (found != 0)
            return found;
    }
    /* On the side: a key of another type, or of the table's kind stored before the table part took it. */
    return side_lookup(t, key, tag, id);
}

static inline int lookup(KeyTable *t, PyObject *key, uint16_t tag, int32_t *id) {
    return lookup_at(t, key, tag, id, NULL);
}

static int add_absent(KeyTable *t, PyObject *key, long id, long tag);

static int add(KeyTable *t, PyObject *key, long id, long tag) {
    if (id < 0 || id >= INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "KeyTable: an id must be in [0, 2**31 - 1), got %ld", id);
        return -1;
    }
    if (tag < 0 || tag > MAX_TAG) {
        PyErr_Format(PyExc_ValueError, "KeyTable: a tag must be in [0, %d], got %ld", MAX_TAG, tag);
        return -1;
    }
    if (reserve_ids(t, id) < 0)
        return -1;
    int32_t held;
    int found = lookup(t, key, (uint16_t)tag, &held);
    if (found < 0)
        return -1;
    if (found) {
        if (held == id)
            return 0;
        PyErr_Format(PyExc_ValueError, "KeyTable: the key is stored at id %d already", held);
        return -1;
    }
    if (t->known[id] != UNKNOWN) {
        PyErr_Format(PyExc_ValueError, "KeyTable: id %ld holds another key", id);
        return -1;
    }
    return add_absent(t, key, id, tag);
}

/* `add` once its checks are done: `key` is absent under `tag`, `id` is free and reserved. */
static int add_absent(KeyTable *t, PyObject *key, long id, long tag) {
    if (t->used == 0) {
        int mode = mode_of(key);
        if (mode != MODE_NONE)
            t->mode = mode;  /* the table part is empty: the first key of a kind it takes chooses */
    }
    Key k;
    int fits = parse(t, key, (uint16_t)tag, &k);
    if (fits < 0)
        return -1;
    if (!fits)
        return side_store(t, key, (uint16_t)tag, id);
    if (t->slots == NULL || (size_t)(t->used + 1) * 4 > (t->mask + 1) * 3) {
        if (resize(t, t->slots == NULL ? MIN_SLOTS : (t->mask + 1) * 2) < 0)
            return -1;
    }
    size_t i = (size_t)k.hash & t->mask;
    while (t->slots[i] != EMPTY)
        i = (i + 1) & t->mask;
    t->slots[i] = (int32_t)id;
    t->used++;
    if (t->mode == MODE_DIGEST)
        memcpy(t->keys + (size_t)id * DIGEST_BYTES, k.digest, DIGEST_BYTES);
    else
        memcpy(t->keys + (size_t)id * 8, &k.value, 8);
    t->hashes[id] = k.hash;
    t->tags[id] = (uint16_t)tag;
    t->known[id] = IN_TABLE;
    return 0;
}

static int check_id(KeyTable *t, PyObject *arg, int32_t *id) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= t->key_cap || t->known[v] == UNKNOWN) {
        PyErr_Format(PyExc_KeyError, "KeyTable: no key is stored at id %ld", v);
        return -1;
    }
    *id = (int32_t)v;
    return 0;
}

/* Removes the key at a known `id`; returns it (new reference) or NULL. */
static PyObject *pop_id(KeyTable *t, int32_t id) {
    if (t->known[id] == ON_THE_SIDE)
        return side_pop(t, id);
    size_t i = (size_t)stored_hash(t, id) & t->mask;
    while (t->slots[i] != id)  /* stored: on its probe sequence before any EMPTY */
        i = (i + 1) & t->mask;
    PyObject *key = table_key(t, id);
    if (key != NULL)
        delete_slot(t, i);
    return key;
}

/* Removes the key at `id`, found at `slot` by `lookup_at` (-1: a side key), without returning it.
 * 0 ok, -1 error. */
static int remove_at(KeyTable *t, int32_t id, Py_ssize_t slot) {
    if (slot < 0) {
        PyObject *gone = side_pop(t, id);
        Py_XDECREF(gone);
        return gone == NULL ? -1 : 0;
    }
    delete_slot(t, (size_t)slot);
    return 0;
}

static PyObject *key_of(KeyTable *t, int32_t id) {
    return t->known[id] == ON_THE_SIDE ? side_key_of(t, id) : table_key(t, id);
}

/* ---- holding a table for one call (see "Re-entry" at the top) ---------------------------- */

/* Marks `t` as running a call: 0, or -1 with RuntimeError when a call is running already (the
 * caller is then Python code that call ran, or another thread while it waited) or `t` is NULL (a
 * KeyList whose index the garbage collector cleared). */
static int hold(KeyTable *t) {
    if (t == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "KeyList: used after the garbage collector cleared it");
        return -1;
    }
    if (t->busy) {
        PyErr_Format(PyExc_RuntimeError, "%s mutated or read during one of its own lookups (by a key's __hash__ or "
                     "__eq__, a finalizer, or another thread meanwhile): refused, nothing changed", name_of(t));
        return -1;
    }
    t->busy = 1;
    return 0;
}

/* Defines `name`, a method or slot, as `name##_held` run with `table` held. */
#define HELD(ret, fail, name, table, params, args)               \
    static ret name params {                                     \
        KeyTable *held_ = (table);                               \
        if (hold(held_) < 0)                                     \
            return fail;                                         \
        ret out_ = name##_held args;                             \
        held_->busy = 0;                                         \
        return out_;                                             \
    }

/* ---- the type ---------------------------------------------------------------------------- */

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":KeyTable", kwlist))
        return NULL;
    return type->tp_alloc(type, 0);  /* every field zero: no slots, no keys, MODE_NONE */
}

static int KeyTable_traverse(KeyTable *t, visitproc visit, void *arg) {
    Py_VISIT(t->side);
    Py_VISIT(t->side_keys);
    return 0;
}

static int KeyTable_clear(KeyTable *t) {
    Py_CLEAR(t->side);
    Py_CLEAR(t->side_keys);
    return 0;
}

static void KeyTable_dealloc(KeyTable *t) {
    PyObject_GC_UnTrack(t);
    KeyTable_clear(t);
    PyMem_Free(t->slots);
    PyMem_Free(t->keys);
    PyMem_Free(t->hashes);
    PyMem_Free(t->tags);
    PyMem_Free(t->known);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) {
    return t->used + (t->side ? PyDict_GET_SIZE(t->side) : 0);
}

static PyObject *KeyTable_subscript_held(KeyTable *t, PyObject *key) {
    int32_t id;
    int found = lookup(t, key, 0, &id);
    if (found < 0)
        return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLong(id);
}

static int KeyTable_ass_subscript_held(KeyTable *t, PyObject *key, PyObject *value) {
    if (value != NULL) {
        long id = PyLong_AsLong(value);
        if (id == -1 && PyErr_Occurred())
            return -1;
        return add(t, key, id, 0);
    }
    int32_t id;
    Py_ssize_t slot;
    int found = lookup_at(t, key, 0, &id, &slot);
    if (found <= 0) {
        if (found == 0)
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    return remove_at(t, id, slot);
}

static int KeyTable_contains_held(KeyTable *t, PyObject *key) {
    int32_t id;
    return lookup(t, key, 0, &id);
}

static PyObject *KeyTable_get_held(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    int32_t id;
    int found = lookup(t, args[0], 0, &id);
    if (found < 0)
        return NULL;
    if (found)
        return PyLong_FromLong(id);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static int parse_tag(PyObject *arg, uint16_t *tag) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > MAX_TAG) {
        PyErr_Format(PyExc_ValueError, "KeyTable: a tag must be in [0, %d], got %ld", MAX_TAG, v);
        return -1;
    }
    *tag = (uint16_t)v;
    return 0;
}

static PyObject *KeyTable_find_held(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    uint16_t tag;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "find(key, tag)");
        return NULL;
    }
    if (parse_tag(args[1], &tag) < 0)
        return NULL;
    int32_t id;
    int found = lookup(t, args[0], tag, &id);
    if (found < 0)
        return NULL;
    return PyLong_FromLong(found ? id : -1);
}

static PyObject *KeyTable_add_held(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add(key, id, tag)");
        return NULL;
    }
    long id = PyLong_AsLong(args[1]);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    long tag = PyLong_AsLong(args[2]);
    if (tag == -1 && PyErr_Occurred())
        return NULL;
    if (add(t, args[0], id, tag) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeyTable_key_of_held(KeyTable *t, PyObject *arg) {
    int32_t id;
    return check_id(t, arg, &id) < 0 ? NULL : key_of(t, id);
}

static PyObject *KeyTable_tag_of_held(KeyTable *t, PyObject *arg) {
    int32_t id;
    if (check_id(t, arg, &id) < 0)
        return NULL;
    if (t->known[id] == IN_TABLE)
        return PyLong_FromLong(t->tags[id]);
    PyObject *v = PyLong_FromLong(id);
    PyObject *k = v ? side_entry(t, v) : NULL;  /* borrowed */
    Py_XDECREF(v);
    if (k == NULL)
        return NULL;
    PyObject *tag = PyTuple_GET_ITEM(k, 0);
    Py_INCREF(tag);
    return tag;
}

static PyObject *KeyTable_pop_id_held(KeyTable *t, PyObject *arg) {
    int32_t id;
    return check_id(t, arg, &id) < 0 ? NULL : pop_id(t, id);
}

static PyObject *collect(KeyTable *t, int what) {  /* 0 keys, 1 ids, 2 (key, id) pairs; by id */
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t id = 0; id < t->key_cap; id++) {
        if (t->known[id] == UNKNOWN)
            continue;
        PyObject *item;
        if (what == 1) {
            item = PyLong_FromSsize_t(id);
        } else {
            PyObject *key = key_of(t, (int32_t)id);
            item = what == 0 || key == NULL ? key : Py_BuildValue("(Nn)", key, id);
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *KeyTable_keys_held(KeyTable *t, PyObject *unused) { return collect(t, 0); }
static PyObject *KeyTable_values_held(KeyTable *t, PyObject *unused) { return collect(t, 1); }
static PyObject *KeyTable_items_held(KeyTable *t, PyObject *unused) { return collect(t, 2); }

static PyObject *KeyTable_iter_held(KeyTable *t) {
    PyObject *keys = collect(t, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* Every call that may run Python code (a key's __hash__ or __eq__) or read what one changes. */
HELD(PyObject *, NULL, KeyTable_subscript, t, (KeyTable *t, PyObject *key), (t, key))
HELD(int, -1, KeyTable_ass_subscript, t, (KeyTable *t, PyObject *key, PyObject *value), (t, key, value))
HELD(int, -1, KeyTable_contains, t, (KeyTable *t, PyObject *key), (t, key))
HELD(PyObject *, NULL, KeyTable_get, t, (KeyTable *t, PyObject *const *args, Py_ssize_t nargs), (t, args, nargs))
HELD(PyObject *, NULL, KeyTable_find, t, (KeyTable *t, PyObject *const *args, Py_ssize_t nargs), (t, args, nargs))
HELD(PyObject *, NULL, KeyTable_add, t, (KeyTable *t, PyObject *const *args, Py_ssize_t nargs), (t, args, nargs))
HELD(PyObject *, NULL, KeyTable_key_of, t, (KeyTable *t, PyObject *arg), (t, arg))
HELD(PyObject *, NULL, KeyTable_tag_of, t, (KeyTable *t, PyObject *arg), (t, arg))
HELD(PyObject *, NULL, KeyTable_pop_id, t, (KeyTable *t, PyObject *arg), (t, arg))
HELD(PyObject *, NULL, KeyTable_keys, t, (KeyTable *t, PyObject *unused), (t, unused))
HELD(PyObject *, NULL, KeyTable_values, t, (KeyTable *t, PyObject *unused), (t, unused))
HELD(PyObject *, NULL, KeyTable_items, t, (KeyTable *t, PyObject *unused), (t, unused))
HELD(PyObject *, NULL, KeyTable_iter, t, (KeyTable *t), (t))

static PyObject *KeyTable_get_nbytes(KeyTable *t, void *unused) {
    size_t n = (t->slots ? (t->mask + 1) * sizeof(int32_t) : 0)
               + (size_t)t->key_cap * (DIGEST_BYTES + sizeof(Py_hash_t) + sizeof(uint16_t) + 1);
    return PyLong_FromSize_t(n);
}

static PyObject *KeyTable_get_mode(KeyTable *t, void *unused) {
    if (t->mode == MODE_DIGEST)
        return PyUnicode_FromString("digest");
    if (t->mode == MODE_INT)
        return PyUnicode_FromString("int");
    Py_RETURN_NONE;
}

static PyObject *KeyTable_get_num_side(KeyTable *t, void *unused) {
    return PyLong_FromSsize_t(t->side ? PyDict_GET_SIZE(t->side) : 0);
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL, "get(key, default=None): the id of key (tag 0), or default"},
    {"find", (PyCFunction)(void (*)(void))KeyTable_find, METH_FASTCALL, "find(key, tag): the id of key under tag, or -1"},
    {"add", (PyCFunction)(void (*)(void))KeyTable_add, METH_FASTCALL, "add(key, id, tag): stores key under tag at id (both new)"},
    {"key_of", (PyCFunction)KeyTable_key_of, METH_O, "key_of(id): the key stored at id (KeyError if none)"},
    {"tag_of", (PyCFunction)KeyTable_tag_of, METH_O, "tag_of(id): the tag of the key stored at id"},
    {"pop_id", (PyCFunction)KeyTable_pop_id, METH_O, "pop_id(id): removes the key stored at id and returns it"},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "the keys, by id, as a list"},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS, "the ids, in order, as a list"},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "(key, id) pairs, by id, as a list"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"nbytes", (getter)KeyTable_get_nbytes, NULL, "bytes the table part holds outside the object", NULL},
    {"mode", (getter)KeyTable_get_mode, NULL, "the table part's keys: 'digest', 'int', or None before one came", NULL},
    {"num_side", (getter)KeyTable_get_num_side, NULL, "keys kept on the side (in a dict)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_len, (binaryfunc)KeyTable_subscript, (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._keytable.KeyTable",
    .tp_doc = "Block keys -> ids 0 <= id < 2**31 - 1, compact for 16-byte digests and int64 keys.",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_traverse = (traverseproc)KeyTable_traverse,
    .tp_clear = (inquiry)KeyTable_clear,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
};

/* ---- KeyList: an ordered set of keys (what an OrderedDict of key -> None does) ----------- */

/* A policy's queues (ARC's T1/T2/B1/B2, S3-FIFO's small/main/ghost) hold a share of every block's
 * key: as OrderedDicts the garbage collector walked each entry on every full collection (0.6-0.9 s
 * at 10M blocks). A KeyList keeps its keys in a KeyTable (key -> node id), its order in two arrays
 * of 32-bit links and a byte value per key (S3-FIFO's frequency; what `l[key] = None` stores is 0):
 * nothing per key for the collector, ~50 bytes a key. */

/* ---- Links: a doubly linked list threaded through two arrays of 32-bit ids ------------------ */

/* Shared by KeyList (over node ids) and SlotList (over slot numbers). */
typedef struct {
    int32_t *prev, *next; /* per id; EMPTY: none */
    int32_t head, tail;   /* oldest, newest; EMPTY when empty */
} Links;

/* Links `id` (in no list) at the newest end, or the oldest (`last` 0). */
static void links_push(Links *c, int32_t id, int last) {
    if (last) {
        c->prev[id] = c->tail;
        c->next[id] = EMPTY;
        if (c->tail != EMPTY)
            c->next[c->tail] = id;
        else
            c->head = id;
        c->tail = id;
    } else {
        c->next[id] = c->head;
        c->prev[id] = EMPTY;
        if (c->head != EMPTY)
            c->prev[c->head] = id;
        else
            c->tail = id;
        c->head = id;
    }
}

static void links_unlink(Links *c, int32_t id) {
    int32_t before = c->prev[id], after = c->next[id];
    if (before != EMPTY)
        c->next[before] = after;
    else
        c->head = after;
    if (after != EMPTY)
        c->prev[after] = before;
    else
        c->tail = before;
}

typedef struct {
    PyObject_HEAD
    KeyTable *index;      /* key -> node id (tag 0) */
    Links links;          /* the order, by node id */
    uint8_t *values;      /* per node id: the key's value, 0..255 (None is stored as 0) */
    int32_t *free;        /* ids given back, the next one last */
    Py_ssize_t num_free, next_id, cap;
    Py_ssize_t version;   /* changes with every change: an iterator refuses to go on after one */
} KeyList;

static PyTypeObject KeyListType;
static PyTypeObject KeyListIterType;

static PyObject *KeyList_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":KeyList", kwlist))
        return NULL;
    KeyList *l = (KeyList *)type->tp_alloc(type, 0);
    if (l == NULL)
        return NULL;
    l->index = (KeyTable *)KeyTableType.tp_alloc(&KeyTableType, 0);
    if (l->index == NULL) {
        Py_DECREF(l);
        return NULL;
    }
    l->index->in_list = 1;
    l->links.head = l->links.tail = EMPTY;
    return (PyObject *)l;
}

static int KeyList_traverse(KeyList *l, visitproc visit, void *arg) {
    Py_VISIT(l->index);
    return 0;
}

static int KeyList_clear(KeyList *l) {
    Py_CLEAR(l->index);
    return 0;
}

static void KeyList_dealloc(KeyList *l) {
    PyObject_GC_UnTrack(l);
    KeyList_clear(l);
    PyMem_Free(l->links.prev);
    PyMem_Free(l->links.next);
    PyMem_Free(l->values);
    PyMem_Free(l->free);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static Py_ssize_t KeyList_len(KeyList *l) { return l->index ? KeyTable_len(l->index) : 0; }

static int32_t new_node(KeyList *l) {
    if (l->num_free)
        return l->free[--l->num_free];
    if (l->next_id >= INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "KeyList: too many keys");
        return EMPTY;
    }
    if (l->next_id == l->cap) {
        Py_ssize_t cap = l->cap ? l->cap + l->cap / 4 + 1 : 1024;
        int32_t *prev = PyMem_Realloc(l->links.prev, (size_t)cap * sizeof(int32_t));
        if (prev == NULL)
            return PyErr_NoMemory(), EMPTY;
        l->links.prev = prev;
        int32_t *next = PyMem_Realloc(l->links.next, (size_t)cap * sizeof(int32_t));
        if (next == NULL)
            return PyErr_NoMemory(), EMPTY;
        l->links.next = next;
        uint8_t *values = PyMem_Realloc(l->values, (size_t)cap);
        if (values == NULL)
            return PyErr_NoMemory(), EMPTY;
        l->values = values;
        int32_t *free_ = PyMem_Realloc(l->free, (size_t)cap * sizeof(int32_t));
        if (free_ == NULL)
            return PyErr_NoMemory(), EMPTY;
        l->free = free_;
        l->cap = cap;
    }
    return (int32_t)l->next_id++;
}

/* Unlinks node `id`, whose key has left the index, and gives its id back. */
static void free_node(KeyList *l, int32_t id) {
    links_unlink(&l->links, id);
    l->free[l->num_free++] = id;
    l->version++;
}

/* Forgets node `id` (linked), whose key `lookup_at` found at `slot`. 0 ok, -1 error. */
static int drop_node_at(KeyList *l, int32_t id, Py_ssize_t slot) {
    if (remove_at(l->index, id, slot) < 0)
        return -1;
    free_node(l, id);
    return 0;
}

/* Removes node `id` (linked) and its key; returns the key (new reference) or NULL. */
static PyObject *drop_node(KeyList *l, int32_t id) {
    PyObject *key = pop_id(l->index, id);
    if (key != NULL)
        free_node(l, id);
    return key;
}

/* Appends `key`, known absent, with `value` at the newest end, or the oldest (`last` 0). 0 ok, -1 error. */
static int append_absent(KeyList *l, PyObject *key, uint8_t value, int last) {
    int32_t id = new_node(l);
    if (id == EMPTY)
        return -1;
    if (reserve_ids(l->index, id) < 0 || add_absent(l->index, key, id, 0) < 0) {
        l->free[l->num_free++] = id;
        return -1;
    }
    l->values[id] = value;
    links_push(&l->links, id, last);
    l->version++;
    return 0;
}

static int KeyList_contains_held(KeyList *l, PyObject *key) {
    int32_t id;
    return lookup(l->index, key, 0, &id);
}

/* `value` as a KeyList value: None is 0. 0 ok, -1 error. */
static int parse_value(PyObject *value, uint8_t *out) {
    if (value == Py_None) {
        *out = 0;
        return 0;
    }
    long n = PyLong_Check(value) ? PyLong_AsLong(value) : -1;
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (n < 0 || n > 255) {
        PyErr_Format(PyExc_TypeError, "KeyList values are None or 0..255, got %R", value);
        return -1;
    }
    *out = (uint8_t)n;
    return 0;
}

static int KeyList_ass_subscript_held(KeyList *l, PyObject *key, PyObject *value) {
    int32_t id;
    Py_ssize_t slot;
    int found = lookup_at(l->index, key, 0, &id, &slot);
    if (found < 0)
        return -1;
    if (value != NULL) {
        uint8_t v;
        if (parse_value(value, &v) < 0)
            return -1;
        if (found) {  /* as an OrderedDict: a present key keeps its place, its value changes */
            l->values[id] = v;
            return 0;
        }
        return append_absent(l, key, v, 1);
    }
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    return drop_node_at(l, id, slot);
}

static PyObject *KeyList_subscript_held(KeyList *l, PyObject *key) {
    int32_t id;
    int found = lookup(l->index, key, 0, &id);
    if (found < 0)
        return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLong(l->values[id]);
}

static PyObject *KeyList_get_held(KeyList *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    int32_t id;
    int found = lookup(l->index, args[0], 0, &id);
    if (found < 0)
        return NULL;
    if (found)
        return PyLong_FromLong(l->values[id]);
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

static PyObject *KeyList_pop_held(KeyList *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    int32_t id;
    Py_ssize_t slot;
    int found = lookup_at(l->index, args[0], 0, &id, &slot);
    if (found < 0)
        return NULL;
    if (!found) {
        if (nargs == 2) {
            Py_INCREF(args[1]);
            return args[1];
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    long value = l->values[id];
    if (drop_node_at(l, id, slot) < 0)
        return NULL;
    return PyLong_FromLong(value);
}

/* The `last` argument of move_to_end and popitem, positional at `at` or by keyword. 0 ok, -1 error.
 * Parsed by hand: PyArg_ParseTupleAndKeywords cost as much as the operation. */
static int parse_last(const char *name, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      Py_ssize_t at, int *last) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < at || nargs > at + 1 || nargs + nkw > at + 1) {
        PyErr_Format(PyExc_TypeError, "%s: %s", name, at ? "(key, last=True)" : "(last=True)");
        return -1;
    }
    PyObject *arg = NULL;
    if (nargs == at + 1)
        arg = args[at];
    else if (nkw == 1) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, 0);
        if (!PyUnicode_Check(kw) || PyUnicode_CompareWithASCIIString(kw, "last") != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, kw);
            return -1;
        }
        arg = args[nargs];
    }
    if (arg == NULL) {
        *last = 1;
        return 0;
    }
    int v = PyObject_IsTrue(arg);
    if (v < 0)
        return -1;
    *last = v;
    return 0;
}

static PyObject *KeyList_move_to_end_held(KeyList *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int last;
    if (parse_last("move_to_end", args, nargs, kwnames, 1, &last) < 0)
        return NULL;
    int32_t id;
    int found = lookup(l->index, args[0], 0, &id);
    if (found < 0)
        return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    if (last ? id != l->links.tail : id != l->links.head) {
        links_unlink(&l->links, id);
        links_push(&l->links, id, last);
        l->version++;
    }
    Py_RETURN_NONE;
}

static PyObject *KeyList_popitem_held(KeyList *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int last;
    if (parse_last("popitem", args, nargs, kwnames, 0, &last) < 0)
        return NULL;
    int32_t id = last ? l->links.tail : l->links.head;
    if (id == EMPTY) {
        PyErr_SetString(PyExc_KeyError, "popitem(): KeyList is empty");
        return NULL;
    }
    PyObject *value = PyLong_FromLong(l->values[id]);
    if (value == NULL)
        return NULL;
    PyObject *key = drop_node(l, id);
    if (key == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(key);
        Py_DECREF(value);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, key);
    PyTuple_SET_ITEM(pair, 1, value);
    return pair;
}

static PyObject *KeyList_first_held(KeyList *l, PyObject *unused) {
    if (l->links.head == EMPTY) {
        PyErr_SetString(PyExc_KeyError, "first(): KeyList is empty");
        return NULL;
    }
    return key_of(l->index, l->links.head);
}

/* Every call that may run Python code (a key's __hash__ or __eq__) or read what one changes. */
HELD(int, -1, KeyList_contains, l->index, (KeyList *l, PyObject *key), (l, key))
HELD(int, -1, KeyList_ass_subscript, l->index, (KeyList *l, PyObject *key, PyObject *value), (l, key, value))
HELD(PyObject *, NULL, KeyList_subscript, l->index, (KeyList *l, PyObject *key), (l, key))
HELD(PyObject *, NULL, KeyList_get, l->index, (KeyList *l, PyObject *const *args, Py_ssize_t nargs), (l, args, nargs))
HELD(PyObject *, NULL, KeyList_pop, l->index, (KeyList *l, PyObject *const *args, Py_ssize_t nargs), (l, args, nargs))
HELD(PyObject *, NULL, KeyList_move_to_end, l->index,
     (KeyList *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames), (l, args, nargs, kwnames))
HELD(PyObject *, NULL, KeyList_popitem, l->index,
     (KeyList *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames), (l, args, nargs, kwnames))
HELD(PyObject *, NULL, KeyList_first, l->index, (KeyList *l, PyObject *unused), (l, unused))

typedef struct {
    PyObject_HEAD
    KeyList *list;
    int32_t at;
    Py_ssize_t version;
} KeyListIter;

static PyObject *KeyList_iter(KeyList *l) {
    KeyListIter *it = PyObject_GC_New(KeyListIter, &KeyListIterType);
    if (it == NULL)
        return NULL;
    Py_INCREF(l);
    it->list = l;
    it->at = l->links.head;
    it->version = l->version;
    PyObject_GC_Track(it);
    return (PyObject *)it;
}

static PyObject *KeyListIter_next_held(KeyListIter *it) {
    KeyList *l = it->list;
    if (l->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "KeyList mutated during iteration");
        return NULL;
    }
    if (it->at == EMPTY)
        return NULL;
    int32_t id = it->at;
    it->at = l->links.next[id];
    return key_of(l->index, id);
}

HELD(PyObject *, NULL, KeyListIter_next, it->list->index, (KeyListIter *it), (it))

static int KeyListIter_traverse(KeyListIter *it, visitproc visit, void *arg) {
    Py_VISIT(it->list);
    return 0;
}

static void KeyListIter_dealloc(KeyListIter *it) {
    PyObject_GC_UnTrack(it);
    Py_XDECREF(it->list);
    PyObject_GC_Del(it);
}

static PyTypeObject KeyListIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._keytable.KeyListIterator",
    .tp_basicsize = sizeof(KeyListIter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)KeyListIter_dealloc,
    .tp_traverse = (traverseproc)KeyListIter_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)KeyListIter_next,
};

static PyObject *KeyList_get_nbytes(KeyList *l, void *unused) {
    if (l->index == NULL)
        return PyLong_FromSize_t((size_t)l->cap * (3 * sizeof(int32_t) + 1));
    PyObject *n = KeyTable_get_nbytes(l->index, NULL);
    if (n == NULL)
        return NULL;
    size_t own = PyLong_AsSize_t(n) + (size_t)l->cap * (3 * sizeof(int32_t) + 1);
    Py_DECREF(n);
    return PyLong_FromSize_t(own);
}

static PyMethodDef KeyList_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyList_get, METH_FASTCALL, "get(key, default=None): key's value, or default"},
    {"pop", (PyCFunction)(void (*)(void))KeyList_pop, METH_FASTCALL, "pop(key[, default]): removes key, returns its value, or default"},
    {"move_to_end", (PyCFunction)(void (*)(void))KeyList_move_to_end, METH_FASTCALL | METH_KEYWORDS,
     "move_to_end(key, last=True): to the newest end, or the oldest"},
    {"popitem", (PyCFunction)(void (*)(void))KeyList_popitem, METH_FASTCALL | METH_KEYWORDS,
     "popitem(last=True): (key, value) of the newest key, or the oldest, removed"},
    {"first", (PyCFunction)KeyList_first, METH_NOARGS, "the oldest key"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyList_getset[] = {
    {"nbytes", (getter)KeyList_get_nbytes, NULL, "bytes held outside the objects", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods KeyList_as_mapping = {
    (lenfunc)KeyList_len, (binaryfunc)KeyList_subscript, (objobjargproc)KeyList_ass_subscript,
};

static PySequenceMethods KeyList_as_sequence = {
    .sq_contains = (objobjproc)KeyList_contains,
};

static PyTypeObject KeyListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._keytable.KeyList",
    .tp_doc = "Keys in order, oldest first, each with a value 0..255, as an OrderedDict of them, with no object per key.",
    .tp_basicsize = sizeof(KeyList),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = KeyList_new,
    .tp_dealloc = (destructor)KeyList_dealloc,
    .tp_traverse = (traverseproc)KeyList_traverse,
    .tp_clear = (inquiry)KeyList_clear,
    .tp_as_mapping = &KeyList_as_mapping,
    .tp_as_sequence = &KeyList_as_sequence,
    .tp_iter = (getiterfunc)KeyList_iter,
    .tp_methods = KeyList_methods,
    .tp_getset = KeyList_getset,
};

/* ---- SlotList: a recency order over slot numbers -------------------------------------------- */

/* An LRU order over small integers (the manager's slot numbers): a doubly linked list threaded
 * through two arrays of 32-bit links indexed by slot, oldest at the head. Base type of
 * `kvtier.policy.lru.SlotLRUPolicy`: insert, touch and remove are single C calls (a Python method
 * over `array.array`s cost ten times more, and LRU runs once or twice per block moved). Keys are
 * integers in [0, 2**31 - 2) (a bool counts as 0 or 1); the arrays grow to the largest seen. */

#define OUT (-2)  /* `prev` of a slot not tracked */

typedef struct {
    PyObject_HEAD
    Links links;         /* the order, by slot; `prev` is OUT for a slot not tracked */
    Py_ssize_t cap;
    Py_ssize_t len;
    Py_ssize_t version;  /* changes with every change: `protected` must not change the order */
} SlotList;

static PyObject *SlotList_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity_hint", NULL};
    Py_ssize_t hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:SlotList", kwlist, &hint))
        return NULL;
    SlotList *l = (SlotList *)type->tp_alloc(type, 0);
    if (l == NULL)
        return NULL;
    l->links.head = l->links.tail = EMPTY;
    if (hint > 0) {
        if (hint > INT32_MAX - 1)
            hint = INT32_MAX - 1;
        l->links.prev = PyMem_Malloc((size_t)hint * sizeof(int32_t));
        l->links.next = PyMem_Malloc((size_t)hint * sizeof(int32_t));
        if (l->links.prev == NULL || l->links.next == NULL) {
            Py_DECREF(l);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < hint; i++)
            l->links.prev[i] = OUT;
        l->cap = hint;
    }
    return (PyObject *)l;
}

static void SlotList_dealloc(SlotList *l) {
    PyMem_Free(l->links.prev);
    PyMem_Free(l->links.next);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

/* `key` as a slot: 1 and *slot set; 0 not a slot number (not an int, or out of range); -1 error. */
static int as_slot(PyObject *key, Py_ssize_t *slot) {
    if (!PyLong_Check(key))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(key, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || v >= INT32_MAX - 1)
        return 0;
    *slot = (Py_ssize_t)v;
    return 1;
}

static inline int slot_tracked(SlotList *l, Py_ssize_t slot) { return slot < l->cap && l->links.prev[slot] != OUT; }

static int slot_grow(SlotList *l, Py_ssize_t slot) {
    Py_ssize_t cap = l->cap * 2;
    if (cap < slot + 1)
        cap = slot + 1;
    if (cap < 16)
        cap = 16;
    if (cap > INT32_MAX - 1)
        cap = INT32_MAX - 1;
    int32_t *prev = PyMem_Realloc(l->links.prev, (size_t)cap * sizeof(int32_t));
    if (prev == NULL)
        return PyErr_NoMemory(), -1;
    l->links.prev = prev;
    int32_t *next = PyMem_Realloc(l->links.next, (size_t)cap * sizeof(int32_t));
    if (next == NULL)
        return PyErr_NoMemory(), -1;
    l->links.next = next;
    for (Py_ssize_t i = l->cap; i < cap; i++)
        l->links.prev[i] = OUT;
    l->cap = cap;
    return 0;
}

static void slot_unlink(SlotList *l, int32_t slot) {
    links_unlink(&l->links, slot);
    l->links.prev[slot] = OUT;
    l->len--;
    l->version++;
}

static void slot_append(SlotList *l, int32_t slot) {
    links_push(&l->links, slot, 1);
    l->len++;
    l->version++;
}

static PyObject *SlotList_insert(SlotList *l, PyObject *key) {
    Py_ssize_t slot;
    int ok = as_slot(key, &slot);
    if (ok < 0)
        return NULL;
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "SlotLRUPolicy tracks slot numbers (integers in [0, 2**31 - 2)), got %R", key);
        return NULL;
    }
    if (slot_tracked(l, slot)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    if (slot >= l->cap && slot_grow(l, slot) < 0)
        return NULL;
    slot_append(l, (int32_t)slot);
    Py_RETURN_NONE;
}

static PyObject *SlotList_touch(SlotList *l, PyObject *key) {
    Py_ssize_t slot;
    int ok = as_slot(key, &slot);
    if (ok < 0)
        return NULL;
    if (ok && slot != l->links.tail && slot_tracked(l, slot)) {  /* a miss is not an error */
        slot_unlink(l, (int32_t)slot);
        slot_append(l, (int32_t)slot);
    }
    Py_RETURN_NONE;
}

static PyObject *SlotList_remove(SlotList *l, PyObject *key) {
    Py_ssize_t slot;
    int ok = as_slot(key, &slot);
    if (ok < 0)
        return NULL;
    if (ok && slot_tracked(l, slot))  /* unknown keys are ignored */
        slot_unlink(l, (int32_t)slot);
    Py_RETURN_NONE;
}

/* protected(slot): 1 yes, 0 no, -1 error; the order must be unchanged by the call. */
static int slot_protected(SlotList *l, PyObject *protected, int32_t slot) {
    Py_ssize_t version = l->version;
    PyObject *arg = PyLong_FromLong(slot);
    if (arg == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(protected, arg);
    Py_DECREF(arg);
    if (r == NULL)
        return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (yes >= 0 && l->version != version) {
        PyErr_SetString(PyExc_RuntimeError, "SlotLRUPolicy: `protected` changed the policy it was asked for");
        return -1;
    }
    return yes;
}

static PyObject *SlotList_evict_one(SlotList *l, PyObject *protected) {
    for (int32_t slot = l->links.head; slot != EMPTY; slot = l->links.next[slot]) {
        int yes = slot_protected(l, protected, slot);
        if (yes < 0)
            return NULL;
        if (!yes) {
            slot_unlink(l, slot);
            return PyLong_FromLong(slot);
        }
    }
    Py_RETURN_NONE;
}

/* _evict(n, protected): the `n` (>= 1) oldest unprotected slots, forgotten, or None (nothing changed). */
static PyObject *SlotList__evict(SlotList *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_evict(n, protected)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *victims = PyList_New(0);
    if (victims == NULL)
        return NULL;
    for (int32_t slot = l->links.head; slot != EMPTY && PyList_GET_SIZE(victims) < n; slot = l->links.next[slot]) {
        int yes = slot_protected(l, args[1], slot);
        if (yes < 0)
            goto fail;
        if (!yes) {
            PyObject *v = PyLong_FromLong(slot);
            if (v == NULL || PyList_Append(victims, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
        }
    }
    if (PyList_GET_SIZE(victims) < n) {
        Py_DECREF(victims);
        Py_RETURN_NONE;  /* fewer than n: nothing changed */
    }
    for (Py_ssize_t i = 0; i < n; i++)
        slot_unlink(l, (int32_t)PyLong_AsLong(PyList_GET_ITEM(victims, i)));
    return victims;
fail:
    Py_DECREF(victims);
    return NULL;
}

static PyObject *SlotList_iter(SlotList *l) {  /* a snapshot, oldest first */
    PyObject *out = PyList_New(l->len);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    for (int32_t slot = l->links.head; slot != EMPTY; slot = l->links.next[slot]) {
        PyObject *v = PyLong_FromLong(slot);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i++, v);
    }
    PyObject *it = PyObject_GetIter(out);
    Py_DECREF(out);
    return it;
}

static int SlotList_contains(SlotList *l, PyObject *key) {
    if (!PyLong_CheckExact(key))
        return 0;  /* as a slot policy's keys are: a bool or a float is never one */
    Py_ssize_t slot;
    int ok = as_slot(key, &slot);
    return ok <= 0 ? ok : slot_tracked(l, slot);
}

static Py_ssize_t SlotList_len(SlotList *l) { return l->len; }

static PyObject *SlotList_get_nbytes(SlotList *l, void *unused) {
    return PyLong_FromSize_t((size_t)l->cap * 2 * sizeof(int32_t));
}

static PyMethodDef SlotList_methods[] = {
    {"insert", (PyCFunction)SlotList_insert, METH_O, "insert(slot): slot becomes the most recent (KeyError if tracked)"},
    {"touch", (PyCFunction)SlotList_touch, METH_O, "touch(slot): a tracked slot becomes the most recent"},
    {"remove", (PyCFunction)SlotList_remove, METH_O, "remove(slot): forgets slot, if tracked"},
    {"evict_one", (PyCFunction)SlotList_evict_one, METH_O,
     "evict_one(protected): the least recent slot for which protected(slot) is false, forgotten, or None"},
    {"_evict", (PyCFunction)(void (*)(void))SlotList__evict, METH_FASTCALL,
     "_evict(n, protected): the n least recent unprotected slots, forgotten, or None"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SlotList_getset[] = {
    {"nbytes", (getter)SlotList_get_nbytes, NULL, "bytes held outside the object", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods SlotList_as_sequence = {
    .sq_length = (lenfunc)SlotList_len,
    .sq_contains = (objobjproc)SlotList_contains,
};

static PyTypeObject SlotListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._keytable.SlotList",
    .tp_doc = "An LRU order over slot numbers, oldest first, in two arrays of links.",
    .tp_basicsize = sizeof(SlotList),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = SlotList_new,
    .tp_dealloc = (destructor)SlotList_dealloc,
    .tp_as_sequence = &SlotList_as_sequence,
    .tp_iter = (getiterfunc)SlotList_iter,
    .tp_methods = SlotList_methods,
    .tp_getset = SlotList_getset,
};

/* ---- ResidentPath: a batch that stays in one memory tier, in one call per verb ----------------- */

/* The manager's verbs spend a few Python steps per block. For the commonest batches they amount
 * to a handful of column updates, done here for a whole batch in one C call each:
 *   - a load whose blocks are all READY in one memory tier (`lease`, then `release` once copied):
 *     look each key up, lease its slot (readers + 1), count its hit, touch the tier's LRU;
 *   - a store of new blocks into one memory tier: `absent` (no key indexed), `evict` (the tier's
 *     oldest unprotected blocks, dropped, where the tier has too few free slots and nothing below
 *     it), `claim` (the new copies WRITING in their slots) and, once copied, `ready`.
 * What qualifies a batch (no tier down, nothing in flight that the general path would join, no
 * promotion due, the tier's policy this LRU) is the manager's to check (see
 * `TierManager.lease_resident`); `lease`, `absent` and `evict` check the per-block conditions and
 * change nothing where one fails, so that the caller takes the general path for the whole batch.
 * The columns are the `BlockIndex`'s (`kvtier.deciding.index`), held by reference: each call takes
 * their buffers anew (an `array` grows in place, moving its items). */

/* A copy's state and a block's `ready` with no READY copy: kvtier.deciding.index's values; the tiers: TierKind's. */
enum { COPY_FREE = 0, COPY_WRITING = 1, COPY_READY = 2, COPY_FREEING = 3, NO_TIER = 255, NUM_TIERS = 4 };

typedef struct {
    PyObject_HEAD
    KeyTable *table;
    PyObject *ready, *hits, *prefetched, *pins, *num_copies;  /* per id */
    PyObject *slot;                                           /* per tier: per id */
    PyObject *owner, *state, *readers;                        /* per tier: per slot */
    PyObject *policies;                                       /* per tier: a SlotList or None */
} ResidentPath;

/* A writable, contiguous buffer of `obj` with items of `itemsize` bytes; 0 or -1 with an error. */
static int column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_CONTIG | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "ResidentPath: %s needs items of %zd bytes, got %zd", what, itemsize,
                     view->itemsize);
        return -1;
    }
    return 0;
}

static Py_ssize_t items(const Py_buffer *view) { return view->len / view->itemsize; }

/* Item `tier` of the per-tier list `list` (a borrowed reference), or NULL with an error. */
static PyObject *of_tier(PyObject *list, long tier, const char *what) {
    if (tier < 0 || tier >= NUM_TIERS || tier >= PyList_GET_SIZE(list) || PyList_GET_ITEM(list, tier) == Py_None) {
        PyErr_Format(PyExc_ValueError, "ResidentPath: no %s for tier %ld", what, tier);
        return NULL;
    }
    return PyList_GET_ITEM(list, tier);
}

static PyObject *ResidentPath_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "ready", "hits", "prefetched", "pins", "num_copies", "slot", "owner", "state",
                             "readers", "policies", NULL};
    PyObject *ids, *cols[10];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOOOO!O!O!O!O!:ResidentPath", kwlist, &KeyTableType, &ids,
                                     &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &PyList_Type, &cols[5],
                                     &PyList_Type, &cols[6], &PyList_Type, &cols[7], &PyList_Type, &cols[8],
                                     &PyList_Type, &cols[9]))
        return NULL;
    ResidentPath *p = (ResidentPath *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    Py_INCREF(ids);
    p->table = (KeyTable *)ids;
    PyObject **fields[10] = {&p->ready, &p->hits, &p->prefetched, &p->pins, &p->num_copies, &p->slot, &p->owner,
                             &p->state, &p->readers, &p->policies};
    for (int i = 0; i < 10; i++) {
        Py_INCREF(cols[i]);
        *fields[i] = cols[i];
    }
    return (PyObject *)p;
}

static int ResidentPath_traverse(ResidentPath *p, visitproc visit, void *arg) {
    Py_VISIT(p->table);
    Py_VISIT(p->ready);
    Py_VISIT(p->hits);
    Py_VISIT(p->prefetched);
    Py_VISIT(p->pins);
    Py_VISIT(p->num_copies);
    Py_VISIT(p->slot);
    Py_VISIT(p->owner);
    Py_VISIT(p->state);
    Py_VISIT(p->readers);
    Py_VISIT(p->policies);
    return 0;
}

static int ResidentPath_clear(ResidentPath *p) {
    Py_CLEAR(p->table);
    Py_CLEAR(p->ready);
    Py_CLEAR(p->hits);
    Py_CLEAR(p->prefetched);
    Py_CLEAR(p->pins);
    Py_CLEAR(p->num_copies);
    Py_CLEAR(p->slot);
    Py_CLEAR(p->owner);
    Py_CLEAR(p->state);
    Py_CLEAR(p->readers);
    Py_CLEAR(p->policies);
    return 0;
}

static void ResidentPath_dealloc(ResidentPath *p) {
    PyObject_GC_UnTrack(p);
    ResidentPath_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Whether every key of `seq` (a sequence) is indexed (`want` 1; their ids into `ids`, n of them)
 * or none is (`want` 0; `ids` may be NULL): 1 yes, 0 no (stopped at the first key otherwise),
 * -1 error. Holds the table for the lookups only: the columns' buffers are taken after them,
 * since a key's `__eq__` may run Python code. */
static int each_key(ResidentPath *p, PyObject *seq, int want, int32_t *ids) {
    KeyTable *t = p->table;
    if (hold(t) < 0)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    int as_wanted = 1;
    for (Py_ssize_t i = 0; i < n && as_wanted == 1; i++) {
        int32_t id;
        int found = lookup(t, keys[i], 0, ids != NULL ? &ids[i] : &id);
        as_wanted = found < 0 ? -1 : found == want;
    }
    t->busy = 0;
    return as_wanted;
}

/* The SlotList of `tier`, or NULL (the tier's policy is another). Borrowed. */
static SlotList *lru_of(ResidentPath *p, long tier) {
    if (tier < 0 || tier >= PyList_GET_SIZE(p->policies))
        return NULL;
    PyObject *policy = PyList_GET_ITEM(p->policies, tier);
    return PyObject_TypeCheck(policy, &SlotListType) ? (SlotList *)policy : NULL;
}

static void lru_touch(SlotList *l, int32_t slot) {
    if (slot != l->links.tail && slot_tracked(l, slot)) {
        slot_unlink(l, slot);
        slot_append(l, slot);
    }
}

/* lease(keys, eligible, out): see the section's comment. `eligible`: 4 bytes, nonzero for the
 * tiers a resident load may be served from. Returns the tier, its slots in `out` (int32, one per
 * key), or -1 having changed nothing (a key not indexed, not READY in one eligible tier, or
 * prefetched and not loaded since). */
static PyObject *ResidentPath_lease(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lease(keys, eligible, out)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "lease: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long tier = -1;
    int32_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    Py_buffer eligible = {0}, out = {0}, ready = {0}, prefetched = {0}, hits = {0}, slots = {0}, readers = {0};
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int all = n > 0 ? each_key(p, seq, 1, ids) : 0;
    if (all < 0)
        goto fail;
    if (!all)
        goto done;
    if (PyObject_GetBuffer(args[1], &eligible, PyBUF_SIMPLE) < 0 || column(args[2], &out, 4, "out") < 0
        || column(p->ready, &ready, 1, "ready") < 0 || column(p->prefetched, &prefetched, 1, "prefetched") < 0)
        goto fail;
    if (items(&out) < n) {
        PyErr_Format(PyExc_ValueError, "lease: out holds %zd slots for %zd keys", items(&out), n);
        goto fail;
    }
    const uint8_t *rd = ready.buf, *pf = prefetched.buf, *ok = eligible.buf;
    uint8_t first = rd[ids[0]];
    if (first >= eligible.len || first >= NUM_TIERS || !ok[first])
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rd[ids[i]] != first || pf[ids[i]])
            goto done;
    PyObject *slot_col, *readers_col;
    if ((slot_col = of_tier(p->slot, first, "slot column")) == NULL
        || (readers_col = of_tier(p->readers, first, "readers")) == NULL || column(slot_col, &slots, 4, "slot") < 0
        || column(readers_col, &readers, 4, "readers") < 0 || column(p->hits, &hits, 4, "hits") < 0)
        goto fail;
    SlotList *lru = lru_of(p, first);
    int32_t *sl = slots.buf, *rs = readers.buf, *hs = hits.buf, *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = sl[ids[i]];
        o[i] = s;
        rs[s]++;
        hs[ids[i]]++;
        if (lru != NULL)
            lru_touch(lru, s);
    }
    tier = first;
    goto done;
fail:
    tier = -2;
done:
    PyMem_Free(ids);
    Py_buffer *views[] = {&eligible, &out, &ready, &prefetched, &hits, &slots, &readers};
    for (size_t i = 0; i < sizeof views / sizeof *views; i++)
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
    Py_DECREF(seq);
    return tier == -2 ? NULL : PyLong_FromLong(tier);
}

/* release(tier, slots): ends the leases `lease` took; returns the slots whose copy is FREEING and
 * now unread (the caller frees them: rare, an eviction came while they were read). */
static PyObject *ResidentPath_release(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs) {
    long tier;
    if (nargs != 2 || (tier = PyLong_AsLong(args[0])) == -1) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "release(tier, slots)");
        return NULL;
    }
    PyObject *readers_col, *state_col;
    if ((readers_col = of_tier(p->readers, tier, "readers")) == NULL || (state_col = of_tier(p->state, tier, "state")) == NULL)
        return NULL;
    Py_buffer slots = {0}, readers = {0}, state = {0};
    PyObject *unread = NULL;
    if (column(args[1], &slots, 4, "slots") < 0 || column(readers_col, &readers, 4, "readers") < 0
        || column(state_col, &state, 1, "state") < 0)
        goto done;
    unread = PyList_New(0);
    if (unread == NULL)
        goto done;
    const int32_t *sl = slots.buf;
    int32_t *rs = readers.buf;
    const uint8_t *st = state.buf;
    for (Py_ssize_t i = 0; i < items(&slots); i++) {
        int32_t s = sl[i];
        if (s < 0 || s >= items(&readers) || rs[s] <= 0) {
            PyErr_Format(PyExc_ValueError, "release: slot %d of tier %ld is not leased", (int)s, tier);
            Py_CLEAR(unread);
            goto done;
        }
        if (--rs[s] == 0 && st[s] == COPY_FREEING) {
            PyObject *v = PyLong_FromLong(s);
            if (v == NULL || PyList_Append(unread, v) < 0) {
                Py_XDECREF(v);
                Py_CLEAR(unread);
                goto done;
            }
            Py_DECREF(v);
        }
    }
done:
    if (slots.obj != NULL)
        PyBuffer_Release(&slots);
    if (readers.obj != NULL)
        PyBuffer_Release(&readers);
    if (state.obj != NULL)
        PyBuffer_Release(&state);
    return unread;
}

/* absent(keys): whether no key of `keys` is indexed. */
static PyObject *ResidentPath_absent(ResidentPath *p, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "absent: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    int none = each_key(p, seq, 0, NULL);
    Py_DECREF(seq);
    return none < 0 ? NULL : PyBool_FromLong(none);
}

/* evict(tier, n, out_ids, out_slots): drops the `n` oldest unprotected blocks of `tier` (READY,
 * unread, unpinned), each its block's only copy, as `TierManager._evict` drops a victim of the
 * last tier: out of the LRU and the index, their slots FREE (the caller puts them on the free
 * list and their ids on the reuse list, and counts them). Returns how many of them were
 * prefetched and never loaded, or -1 having changed nothing (fewer than n such blocks in order:
 * a victim with another copy stops the search, as the general path would treat it otherwise). */
static PyObject *ResidentPath_evict(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs) {
    long tier;
    Py_ssize_t n;
    if (nargs != 4 || (tier = PyLong_AsLong(args[0])) == -1 || (n = PyLong_AsSsize_t(args[1])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "evict(tier, n, out_ids, out_slots)");
        return NULL;
    }
    SlotList *lru = lru_of(p, tier);
    PyObject *slot_col, *owner_col, *state_col, *readers_col;
    if ((slot_col = of_tier(p->slot, tier, "slot column")) == NULL || (owner_col = of_tier(p->owner, tier, "owner")) == NULL
        || (state_col = of_tier(p->state, tier, "state")) == NULL
        || (readers_col = of_tier(p->readers, tier, "readers")) == NULL)
        return NULL;
    if (lru == NULL) {
        PyErr_Format(PyExc_ValueError, "evict: tier %ld's policy is not an LRU of slots", tier);
        return NULL;
    }
    Py_buffer v[10] = {{0}};
    long wasted = -2;
    if (column(args[2], &v[0], 4, "out_ids") < 0 || column(args[3], &v[1], 4, "out_slots") < 0
        || column(slot_col, &v[2], 4, "slot") < 0 || column(owner_col, &v[3], 4, "owner") < 0
        || column(state_col, &v[4], 1, "state") < 0 || column(readers_col, &v[5], 4, "readers") < 0
        || column(p->pins, &v[6], 4, "pins") < 0 || column(p->num_copies, &v[7], 1, "num_copies") < 0
        || column(p->ready, &v[8], 1, "ready") < 0 || column(p->hits, &v[9], 4, "hits") < 0)
        goto done;
    if (items(&v[0]) < n || items(&v[1]) < n) {
        PyErr_Format(PyExc_ValueError, "evict: out_ids and out_slots need room for %zd", n);
        goto done;
    }
    int32_t *out_ids = v[0].buf, *out_slots = v[1].buf, *slot = v[2].buf, *owner = v[3].buf, *readers = v[5].buf;
    int32_t *pins = v[6].buf, *hits = v[9].buf;
    uint8_t *state = v[4].buf, *copies = v[7].buf, *ready = v[8].buf;
    Py_buffer prefetched = {0};
    if (column(p->prefetched, &prefetched, 1, "prefetched") < 0)
        goto done;
    uint8_t *pf = prefetched.buf;
    Py_ssize_t found = 0;
    for (int32_t s = lru->links.head; s != EMPTY && found < n; s = lru->links.next[s]) {
        int32_t b = owner[s];
        if (b < 0 || pins[b] != 0 || state[s] != COPY_READY || readers[s] != 0)
            continue;  /* protected, as `TierManager._protected_in` says */
        if (copies[b] != 1)
            break;
        out_ids[found] = b;
        out_slots[found++] = s;
    }
    if (found < n) {
        wasted = -1;
        goto release_pf;
    }
    wasted = 0;
    KeyTable *t = p->table;
    if (hold(t) < 0) {
        wasted = -2;
        goto release_pf;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = out_ids[i], s = out_slots[i];
        slot_unlink(lru, s);
        wasted += pf[b] != 0;
        pf[b] = 0;
        ready[b] = NO_TIER;
        pins[b] = 0;
        hits[b] = 0;
        slot[b] = -1;
        copies[b] = 0;
        state[s] = COPY_FREE;
        owner[s] = -1;
        PyObject *key = pop_id(t, b);
        if (key == NULL) {  /* cannot happen (the id is indexed); the state is then inconsistent */
            wasted = -2;
            break;
        }
        Py_DECREF(key);
    }
    t->busy = 0;
release_pf:
    PyBuffer_Release(&prefetched);
done:
    for (int i = 0; i < 10; i++)
        if (v[i].obj != NULL)
            PyBuffer_Release(&v[i]);
    return wasted == -2 ? NULL : PyLong_FromLong(wasted);
}

/* Applies `op` to each (id, slot) pair of `ids` and `slots` in `tier`: CLAIM makes the copy
 * WRITING (`TierManager._claim`), READY makes it READY (`_make_ready`, the LRU told). */
enum { CLAIM, MAKE_READY };

static PyObject *apply_copies(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs, int op) {
    long tier;
    if (nargs != 3 || (tier = PyLong_AsLong(args[0])) == -1) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s(tier, ids, slots)", op == CLAIM ? "claim" : "ready");
        return NULL;
    }
    SlotList *lru = op == MAKE_READY ? lru_of(p, tier) : NULL;
    PyObject *slot_col, *owner_col, *state_col;
    if ((slot_col = of_tier(p->slot, tier, "slot column")) == NULL || (owner_col = of_tier(p->owner, tier, "owner")) == NULL
        || (state_col = of_tier(p->state, tier, "state")) == NULL)
        return NULL;
    if (op == MAKE_READY && lru == NULL) {
        PyErr_Format(PyExc_ValueError, "ready: tier %ld's policy is not an LRU of slots", tier);
        return NULL;
    }
    Py_buffer v[7] = {{0}};
    int ok = 0;
    if (column(args[1], &v[0], 4, "ids") < 0 || column(args[2], &v[1], 4, "slots") < 0
        || column(slot_col, &v[2], 4, "slot") < 0 || column(owner_col, &v[3], 4, "owner") < 0
        || column(state_col, &v[4], 1, "state") < 0 || column(p->num_copies, &v[5], 1, "num_copies") < 0
        || column(p->ready, &v[6], 1, "ready") < 0)
        goto done;
    Py_ssize_t n = items(&v[0]);
    if (items(&v[1]) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd ids for %zd slots", op == CLAIM ? "claim" : "ready", n, items(&v[1]));
        goto done;
    }
    const int32_t *ids = v[0].buf, *sl = v[1].buf;
    int32_t *slot = v[2].buf, *owner = v[3].buf;
    uint8_t *state = v[4].buf, *copies = v[5].buf, *ready = v[6].buf;
    Py_ssize_t num_ids = items(&v[2]), num_slots = items(&v[3]);
    for (Py_ssize_t i = 0; i < n; i++) {  /* checked first: nothing changes if one is wrong */
        int32_t b = ids[i], s = sl[i];
        int bad = b < 0 || b >= num_ids || s < 0 || s >= num_slots;
        if (!bad && op == CLAIM)
            bad = slot[b] >= 0 || state[s] != COPY_FREE;
        else if (!bad)
            bad = slot[b] != s || state[s] != COPY_WRITING || slot_tracked(lru, s);
        if (bad) {
            PyErr_Format(PyExc_ValueError, "%s: block %d cannot take slot %d of tier %ld as it stands",
                         op == CLAIM ? "claim" : "ready", (int)b, (int)s, tier);
            goto done;
        }
    }
    if (op == MAKE_READY)
        for (Py_ssize_t i = 0; i < n; i++)  /* the LRU's arrays may grow: done first, nothing else changes if it fails */
            if (sl[i] >= lru->cap && slot_grow(lru, sl[i]) < 0)
                goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i], s = sl[i];
        if (op == CLAIM) {
            slot[b] = s;
            state[s] = COPY_WRITING;
            owner[s] = b;
            copies[b]++;
        } else {
            state[s] = COPY_READY;
            if (tier < ready[b])
                ready[b] = (uint8_t)tier;
            slot_append(lru, s);
        }
    }
    ok = 1;
done:
    for (int i = 0; i < 7; i++)
        if (v[i].obj != NULL)
            PyBuffer_Release(&v[i]);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ResidentPath_claim(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs) {
    return apply_copies(p, args, nargs, CLAIM);
}

static PyObject *ResidentPath_ready(ResidentPath *p, PyObject *const *args, Py_ssize_t nargs) {
    return apply_copies(p, args, nargs, MAKE_READY);
}

static PyMethodDef ResidentPath_methods[] = {
    {"lease", (PyCFunction)(void (*)(void))ResidentPath_lease, METH_FASTCALL,
     "lease(keys, eligible, out) -> tier, or -1 (nothing changed): leases every block READY in one eligible tier"},
    {"release", (PyCFunction)(void (*)(void))ResidentPath_release, METH_FASTCALL,
     "release(tier, slots) -> the slots now unread and FREEING"},
    {"absent", (PyCFunction)ResidentPath_absent, METH_O, "absent(keys) -> whether no key is indexed"},
    {"evict", (PyCFunction)(void (*)(void))ResidentPath_evict, METH_FASTCALL,
     "evict(tier, n, out_ids, out_slots) -> prefetched victims, or -1 (nothing changed): drops the n oldest unprotected"},
    {"claim", (PyCFunction)(void (*)(void))ResidentPath_claim, METH_FASTCALL,
     "claim(tier, ids, slots): each block's new copy WRITING in its slot"},
    {"ready", (PyCFunction)(void (*)(void))ResidentPath_ready, METH_FASTCALL,
     "ready(tier, ids, slots): each WRITING copy READY, the newest in the tier's LRU"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ResidentPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._keytable.ResidentPath",
    .tp_doc = "The manager's verbs for a batch that stays in one memory tier (see kvtier/_keytable.c).",
    .tp_basicsize = sizeof(ResidentPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = ResidentPath_new,
    .tp_dealloc = (destructor)ResidentPath_dealloc,
    .tp_traverse = (traverseproc)ResidentPath_traverse,
    .tp_clear = (inquiry)ResidentPath_clear,
    .tp_methods = ResidentPath_methods,
};

static struct PyModuleDef keytable_module = {
    PyModuleDef_HEAD_INIT, "kvtier._keytable", "Block keys -> ids without an object per key.", -1, NULL,
};

PyMODINIT_FUNC PyInit__keytable(void) {
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&KeyListType) < 0 || PyType_Ready(&KeyListIterType) < 0
        || PyType_Ready(&SlotListType) < 0 || PyType_Ready(&ResidentPathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&keytable_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&KeyListType);
    if (PyModule_AddObject(m, "KeyList", (PyObject *)&KeyListType) < 0) {
        Py_DECREF(&KeyListType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SlotListType);
    if (PyModule_AddObject(m, "SlotList", (PyObject *)&SlotListType) < 0) {
        Py_DECREF(&SlotListType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ResidentPathType);
    if (PyModule_AddObject(m, "ResidentPath", (PyObject *)&ResidentPathType) < 0) {
        Py_DECREF(&ResidentPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
