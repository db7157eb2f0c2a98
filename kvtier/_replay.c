/* kvtier._replay: `kvtier simulate`'s trace replay for LRU tiers, in C.
 *
 * `replay_lru` serves a trace's requests one at a time, as `kvtier.simulate.replay._Replay.run`
 * drives the runtime's `TierManager`: lookup, `load_now` of the hit prefix, `store_now` of the rest.
 * Every decision is a line-for-line port of the manager's synchronous path (kvtier/deciding/manager.py) for
 * the tiers `kvtier simulate` builds: every tier LRU, an admission rule per tier, watermarks on all
 * but the last, exclusive or inclusive mode, an optional promotion tier; no tier down, no pins,
 * no prefetch, no pool tier that may drop blocks (`may_drop`), no write-through but inclusive
 * mode's, no failed transfer. Each function below names the manager method it ports; the paths the
 * manager takes only outside that set are left out. tests/simulate/test_native_engine.py checks
 * that both replays report the same numbers and leave the same LRU orders.
 *
 * Retention hints (`hints`, kvtier/deciding/retention.py): after each request, what
 * `TierManager.apply_hint` does (deadlines, budgets, doomed blocks queued per tier, pruning), and
 * the victims `_bind_hinted_victims` chooses once hints are on: a queued doomed block first, and in
 * the last tier a retained copy the LRU walk meets is set aside until its deadline lapses. The
 * sessions' bookkeeping (`HintBook.use` / `close`) depends on the trace alone: the caller works it
 * out (kvtier/simulate/native_replay.py, `hint_arrays`) and this applies its results per block.
 *
 * The model, per the manager's index (kvtier/deciding/index.py), with two simplifications that decide
 * nothing:
 *   - blocks are the trace's hash ids interned to 0 .. num_blocks - 1 by the caller, so a block's
 *     id is fixed for the whole replay; where the manager removes a block from its index (its last
 *     copy freed) this resets what `BlockIndex.remove` resets (the hit count), and "indexed" is
 *     "has a copy" (the manager adds a key just before its first copy and removes it with its last);
 *   - a tier's slots are a count of free slots, not numbers: a block has at most one copy per
 *     tier, so (tier, block) names a copy, and LRU orders the same copies by block id as the
 *     manager's `SlotLRUPolicy` orders them by slot (insertion and touch order, not slot numbers,
 *     decide it).
 * Moves complete at once, first in first out, in a queue as `TierManager._queue`.
 *
 * Errors: arguments are checked up front (TypeError / ValueError naming the argument); a broken
 * invariant (a copy completed twice: a bug, never a trace's fault) stops the replay with
 * RuntimeError; an exception from `on_progress` is passed on.
 *
 * Python code runs in the middle (`on_progress`, and other threads while it does), so the replay
 * keeps no pointer into the caller's arrays: it reads private copies of the inputs, taken and
 * checked when the call begins, and copies the TTFTs out at the end into the output arrays as
 * they are then. What `on_progress` does to the arrays changes nothing of the replay.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define MAX_TIERS 4
#define NO_TIER 255  /* `ready` of a block with no READY copy, as in kvtier.deciding.index */
#define OUT (-2)     /* `prev` of a block not in a tier's LRU order */
#define END (-1)     /* the end of an LRU order */

enum { FREE = 0, WRITING = 1, READY = 2, FREEING = 3 };  /* a copy's state: kvtier.deciding.index's values */
enum { ADMIT_ALL = 0, ADMIT_EVICTED = 1, ADMIT_REUSED = 2 };  /* kvtier.policy.admission.AdmissionKind */
/* The drop reasons a replay can reach (kvtier.observing.stats.DropReason), in the order `replay_lru` reports them. */
enum { DROP_EVICTED = 0, DROP_ADMISSION, DROP_LOWER_FULL, DROP_NO_SPACE, NUM_DROPS, DROP_UNCOUNTED = -1 };
enum { DEMOTE = 0, PROMOTE = 1 };

typedef struct {
    /* rules */
    int64_t num_slots;
    int admission;          /* ADMIT_* */
    int64_t min_hits;       /* ADMIT_REUSED */
    int allow_demoted;      /* ADMIT_REUSED */
    int watermarked;        /* high watermark < 1 and a tier below: `TierManager._watermarked` */
    int64_t high_slots;     /* floor(high_watermark * num_slots): more in use is over the mark */
    int64_t low_slots;      /* floor(low_watermark * num_slots): where a rebalance stops */
    double seconds_per_block;
    /* slots */
    int64_t num_free;
    int64_t outgoing;       /* demotions queued out of this tier */
    /* per block: its copy here */
    uint8_t *state;
    int32_t *readers;
    /* per block: the LRU order of READY copies (`SlotLRUPolicy`), oldest at `head` */
    int32_t *prev, *next;
    int32_t head, tail;
    int64_t lru_len;
    int32_t *victims;       /* `rebalance`'s scratch: up to num_slots victims */
    /* counters: `Stats` per tier, and the copies read out to the engine (`_Replay.engine_reads`) */
    int64_t hits, stores, evictions, engine_reads;
} Tier;

typedef struct {
    int32_t block;
    int8_t src, dst, kind;  /* kind: DEMOTE or PROMOTE */
} Queued;

/* One retention deadline (`HintBook._deadlines`' (deadline, seq, key)). */
typedef struct {
    double deadline;
    int64_t seq;
    int32_t block;
} Deadline;

/* A tier's doomed queue (`DoomedQueues`): a ring of block ids. */
typedef struct {
    int32_t *ids;
    int64_t cap, head, len;
} Ring;

/* Retention hints: `HintBook` per block id, the doomed queues, and the trace's hints per request. */
typedef struct {
    int on;                 /* the trace has hints: `apply_hint` after every request */
    double now;             /* `HintBook.now` */
    /* per block */
    int32_t *refs;          /* open sessions that list it (`_refs`) */
    uint8_t *unhinted, *closed, *has_until;
    double *until;          /* its deadline, where has_until */
    int8_t *held;           /* the tier it is set aside in (`TierManager._held`), or -1 */
    int64_t num_unhinted, num_closed, num_retained;
    int64_t tenant_cap, total_cap, prune_keep;
    Deadline *heap;
    int64_t heap_len, heap_cap, num_pushed;
    Ring doomed[MAX_TIERS];
    int64_t over_budget, doomed_evicted;  /* `Stats.hints` counters the replay decides */
    /* the trace's hints, private copies (see `read_hints`) */
    double *now_s, *retain_s;  /* per request; retain_s 0: none */
    int32_t *ids;
    int64_t *offsets;       /* 3 per request + 1: unhinted, listed, ended blocks in `ids` */
} Hints;

typedef struct {
    int num_tiers;
    int inclusive;
    int promote_to;         /* a tier index, or -1 */
    Tier tier[MAX_TIERS];
    /* per block */
    uint8_t *num_copies, *ready;
    int64_t *hits;
    int8_t *inbound;        /* the destination of its promotion in flight, or -1 (`TierManager._inbound`) */
    /* moves in flight: a ring, never fuller than the slots of all tiers (each holds a WRITING copy) */
    Queued *queue;
    int64_t queue_cap, queue_head, queue_len;
    int over_high;          /* `TierManager._over_high` */
    int64_t demotions[MAX_TIERS][MAX_TIERS], promotions[MAX_TIERS][MAX_TIERS], dropped[NUM_DROPS];
    const char *broken;     /* the first broken invariant, if any: the replay stops after the request */
    /* per request, sized for the longest */
    int32_t *leased_block;
    int8_t *leased_tier, *source_tier;
    int32_t *placed_block;
    int8_t *placed_tier;
    int64_t num_blocks;
    Hints h;
} Engine;

/* The token and access sums. Every other counter counts steps the replay takes (a few per block
 * access at most), so none can reach 2**63 in a replay that ends; these add up `input_tokens`,
 * which the caller picks (any int64 each), so they are kept in 128 bits and returned exactly. */
#ifndef __SIZEOF_INT128__
#error "kvtier._replay needs a compiler with 128-bit integers (GCC or Clang on a 64-bit target)"
#endif
typedef unsigned __int128 u128;

typedef struct {
    u128 num_accesses, cached_tokens, input_tokens;
} Totals;

/* ---- LRU order of one tier (`kvtier._keytable.SlotList`, by block instead of slot) ---------- */

static inline int lru_tracked(const Tier *t, int32_t b) { return t->prev[b] != OUT; }

static void lru_unlink(Tier *t, int32_t b) {
    int32_t p = t->prev[b], n = t->next[b];
    if (p == END)
        t->head = n;
    else
        t->next[p] = n;
    if (n == END)
        t->tail = p;
    else
        t->prev[n] = p;
    t->prev[b] = OUT;
    t->lru_len--;
}

static void lru_append(Tier *t, int32_t b) {
    t->prev[b] = t->tail;
    t->next[b] = END;
    if (t->tail == END)
        t->head = b;
    else
        t->next[t->tail] = b;
    t->tail = b;
    t->lru_len++;
}

/* `SlotList.insert`: the manager inserts only copies it has not inserted. */
static void lru_insert(Engine *e, Tier *t, int32_t b) {
    if (lru_tracked(t, b)) {
        e->broken = "a copy entered its tier's LRU order twice";
        return;
    }
    lru_append(t, b);
}

/* `SlotList.touch`: a tracked copy becomes the most recent. */
static inline void lru_touch(Tier *t, int32_t b) {
    if (b != t->tail && lru_tracked(t, b)) {
        lru_unlink(t, b);
        lru_append(t, b);
    }
}

/* `TierManager._protected_in`: pins are always 0 here, and a tracked copy's slot is owned. */
static inline int is_protected(const Tier *t, int32_t b) { return t->state[b] != READY || t->readers[b] != 0; }

/* `SlotList.evict_one(protected)`: the oldest unprotected copy, forgotten, or -1. */
static int32_t lru_evict_one(Tier *t) {
    for (int32_t b = t->head; b != END; b = t->next[b]) {
        if (!is_protected(t, b)) {
            lru_unlink(t, b);
            return b;
        }
    }
    return -1;
}

/* `EvictionPolicy.evict(n, protected)` over `SlotList._evict` (n >= 2): the n oldest unprotected
 * copies into `t->victims`, forgotten; 0 (nothing changed) where there are fewer. */
static int lru_evict_n(Tier *t, int64_t n) {
    if (n > t->lru_len)
        return 0;
    int64_t found = 0;
    for (int32_t b = t->head; b != END && found < n; b = t->next[b]) {
        if (!is_protected(t, b))
            t->victims[found++] = b;
    }
    if (found < n)
        return 0;
    for (int64_t i = 0; i < n; i++)
        lru_unlink(t, t->victims[i]);
    return 1;
}

/* ---- copies (`TierManager`'s copy lifecycle) ------------------------------------------------ */

/* `AdmissionRule.admits`. */
static inline int admits(const Tier *t, int demoted, int64_t hits) {
    if (t->admission == ADMIT_ALL)
        return 1;
    if (t->admission == ADMIT_EVICTED)
        return demoted;
    return hits >= t->min_hits || (demoted && t->allow_demoted);
}

/* `TierManager._live`: a copy that is or will become servable. */
static int is_live(const Engine *e, int32_t b) {
    for (int i = 0; i < e->num_tiers; i++) {
        uint8_t s = e->tier[i].state[b];
        if (s == WRITING || s == READY)
            return 1;
    }
    return 0;
}

/* `TierManager._refresh`: the fastest READY copy. */
static void refresh(Engine *e, int32_t b) {
    for (int i = 0; i < e->num_tiers; i++) {
        if (e->tier[i].state[b] == READY) {
            e->ready[b] = (uint8_t)i;
            return;
        }
    }
    e->ready[b] = NO_TIER;
}

/* `TierManager._claim`: a WRITING copy in a slot of `ti` already taken off its free count. */
static void claim(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    if (t->state[b] != FREE) {
        e->broken = "a block was given a second copy in one tier";
        return;
    }
    t->state[b] = WRITING;
    e->num_copies[b]++;
}

/* `TierManager._make_ready`. */
static void make_ready(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    if (t->state[b] != WRITING) {
        e->broken = "a copy was completed twice";
        return;
    }
    t->state[b] = READY;
    if (ti < e->ready[b])
        e->ready[b] = (uint8_t)ti;
    lru_insert(e, t, b);
}

/* `TierManager._free`; the block leaves the index with its last copy (`BlockIndex.remove`). */
static void free_copy(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    t->state[b] = FREE;
    t->num_free++;
    if (--e->num_copies[b] == 0)
        e->hits[b] = 0;
}

/* `TierManager._retire_unlisted`: a copy (out of its LRU order) leaves service, freed once unread. */
static void retire_unlisted(Engine *e, int32_t b, int ti, int reason) {
    Tier *t = &e->tier[ti];
    if (t->state[b] != FREEING) {
        t->state[b] = FREEING;
        if (e->num_copies[b] == 1) {
            e->ready[b] = NO_TIER;
            if (reason != DROP_UNCOUNTED)
                e->dropped[reason]++;
            if (t->readers[b] == 0) {
                t->state[b] = FREE;
                t->num_free++;
                e->num_copies[b] = 0;
                e->hits[b] = 0;
            }
            return;
        }
        if (e->ready[b] == ti)
            refresh(e, b);
        if (!is_live(e, b) && reason != DROP_UNCOUNTED)
            e->dropped[reason]++;
    }
    if (t->readers[b] == 0)
        free_copy(e, b, ti);
}

/* `TierManager._retire`: `_retire_unlisted` for a copy that may still be in its LRU order. */
static void retire(Engine *e, int32_t b, int ti, int reason) {
    Tier *t = &e->tier[ti];
    if (t->state[b] == READY && lru_tracked(t, b))
        lru_unlink(t, b);
    retire_unlisted(e, b, ti, reason);
}

/* `TierManager._free_if_unread`. */
static void free_if_unread(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    if (t->state[b] == FREEING && t->readers[b] == 0)
        free_copy(e, b, ti);
}

/* ---- retention hints (kvtier/deciding/retention.py; `TierManager.apply_hint` and its victims) ---- */

/* `HintBook.doomed`: every session that listed `b` closed, and no request without one used it. */
static inline int is_doomed(const Hints *h, int32_t b) { return h->closed[b] && h->refs[b] == 0 && !h->unhinted[b]; }

/* `HintBook.retained`. */
static inline int is_retained(const Hints *h, int32_t b) { return h->has_until[b] && h->until[b] > h->now; }

/* `DoomedQueues.push`: `b` at the back of `q`, which grows as needed. */
static void ring_push(Engine *e, Ring *q, int32_t b) {
    if (q->len == q->cap) {
        int64_t cap = q->cap ? 2 * q->cap : 64;
        int32_t *ids = PyMem_Malloc((size_t)cap * sizeof(int32_t));
        if (ids == NULL) {
            e->broken = "out of memory for a doomed queue";  /* RuntimeError, after the request */
            return;
        }
        for (int64_t i = 0; i < q->len; i++)
            ids[i] = q->ids[(q->head + i) % q->cap];
        PyMem_Free(q->ids);
        q->ids = ids;
        q->cap = cap;
        q->head = 0;
    }
    q->ids[(q->head + q->len) % q->cap] = b;
    q->len++;
}

static int32_t ring_pop(Ring *q) {
    int32_t b = q->ids[q->head];
    q->head = (q->head + 1) % q->cap;
    q->len--;
    return b;
}

/* Whether (deadline, seq) of `a` comes before that of `b`: the heap's order, as Python's tuples. */
static inline int earlier(const Deadline *a, const Deadline *b) {
    return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

/* `heapq.heappush(HintBook._deadlines, (deadline, seq, key))`. */
static void heap_push(Engine *e, double deadline, int32_t b) {
    Hints *h = &e->h;
    if (h->heap_len == h->heap_cap) {
        int64_t cap = h->heap_cap ? 2 * h->heap_cap : 1024;
        Deadline *heap = PyMem_Realloc(h->heap, (size_t)cap * sizeof(Deadline));
        if (heap == NULL) {
            e->broken = "out of memory for the retention deadlines";
            return;
        }
        h->heap = heap;
        h->heap_cap = cap;
    }
    Deadline item = {deadline, ++h->num_pushed, b};
    int64_t i = h->heap_len++;
    while (i > 0 && earlier(&item, &h->heap[(i - 1) / 2])) {
        h->heap[i] = h->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->heap[i] = item;
}

/* `heapq.heappop`: the earliest entry (the heap is not empty). */
static Deadline heap_pop(Hints *h) {
    Deadline top = h->heap[0], last = h->heap[--h->heap_len];
    int64_t i = 0, n = h->heap_len;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && earlier(&h->heap[c + 1], &h->heap[c]))
            c++;
        if (!earlier(&h->heap[c], &last))
            break;
        h->heap[i] = h->heap[c];
        i = c;
    }
    if (n > 0)
        h->heap[i] = last;
    return top;
}

/* `TierManager._release_held`: a block set aside in `ti` goes back into its LRU order, as a
 * newcomer, where its copy there is still READY and out of the order. */
static void release_held(Engine *e, int32_t b) {
    int ti = e->h.held[b];
    e->h.held[b] = -1;
    Tier *t = &e->tier[ti];
    if (t->state[b] == READY && !lru_tracked(t, b))
        lru_insert(e, t, b);
}

/* `HintBook.release`: `b`'s retention ends now, if any. */
static void release(Hints *h, int32_t b) {
    if (h->has_until[b]) {
        h->has_until[b] = 0;
        h->num_retained--;
    }
}

/* `HintBook.advance`, then `_release_held` for each lapsed block that was set aside. */
static void advance(Engine *e, double now) {
    Hints *h = &e->h;
    if (now > h->now)
        h->now = now;
    while (h->heap_len > 0 && h->heap[0].deadline <= h->now) {
        Deadline d = heap_pop(h);
        if (h->has_until[d.block] && h->until[d.block] == d.deadline) {
            release(h, d.block);
            if (h->held[d.block] >= 0)
                release_held(e, d.block);
        }
    }
}

/* `HintBook.retain` over the request's blocks in the index, for the one tenant ("") a replay has. */
static void retain(Engine *e, const int32_t *keys, int64_t len, double retain_s) {
    Hints *h = &e->h;
    double deadline = h->now + retain_s;
    for (int64_t i = 0; i < len; i++) {
        int32_t b = keys[i];
        if (e->num_copies[b] == 0)
            continue;  /* not in the index: a budget is not spent on misses */
        if (!h->has_until[b]) {
            if (h->num_retained >= h->tenant_cap || h->num_retained >= h->total_cap) {
                h->over_budget++;
                continue;
            }
            h->has_until[b] = 1;
            h->num_retained++;
        } else if (h->until[b] >= deadline) {
            continue;
        }
        h->until[b] = deadline;
        heap_push(e, deadline, b);
    }
}

/* `TierManager._doom`: queues doomed `b` in every tier holding a copy of it. */
static void doom(Engine *e, int32_t b) {
    if (e->num_copies[b] == 0)
        return;
    for (int i = 0; i < e->num_tiers; i++) {
        if (e->tier[i].state[b] != FREE)
            ring_push(e, &e->h.doomed[i], b);
    }
}

/* `HintBook.prune(indexed, keep)`: forgets unhinted and closed marks of blocks with no copy. */
static void prune(Engine *e) {
    Hints *h = &e->h;
    int64_t n = e->num_blocks;
    if (h->num_unhinted > h->prune_keep) {
        for (int64_t b = 0; b < n; b++) {
            if (h->unhinted[b] && e->num_copies[b] == 0) {
                h->unhinted[b] = 0;
                h->num_unhinted--;
            }
        }
    }
    if (h->num_closed > h->prune_keep) {
        for (int64_t b = 0; b < n; b++) {
            if (h->closed[b] && e->num_copies[b] == 0) {
                h->closed[b] = 0;
                h->num_closed--;
            }
        }
    }
}

/* `TierManager.apply_hint` for request `r`, after its store. The sessions' bookkeeping depends on
 * the trace alone, so the caller worked it out (`native_replay.hint_arrays`): per request, the
 * blocks used without a session, the blocks its session lists for the first time, and, where it
 * closed its session, every block that session listed, in the order `HintBook.close` visits them. */
static void apply_hint(Engine *e, Py_ssize_t r, const int32_t *keys, int64_t len) {
    Hints *h = &e->h;
    const int64_t *at = h->offsets + 3 * r;
    advance(e, h->now_s[r]);
    for (int64_t i = at[0]; i < at[1]; i++) {  /* `HintBook.use`: unhinted use */
        int32_t b = h->ids[i];
        if (!h->unhinted[b]) {
            h->unhinted[b] = 1;
            h->num_unhinted++;
        }
    }
    for (int64_t i = at[1]; i < at[2]; i++)  /* `HintBook.use`: listed by an open session */
        h->refs[h->ids[i]]++;
    if (h->retain_s[r] > 0)
        retain(e, keys, len, h->retain_s[r]);
    for (int64_t i = at[2]; i < at[3]; i++) {  /* `HintBook.close`, then what `apply_hint` does per doomed key */
        int32_t b = h->ids[i];
        if (h->refs[b] <= 0) {
            e->broken = "a closed session listed a block no open session holds";
            return;
        }
        if (--h->refs[b] || h->unhinted[b])
            continue;
        if (!h->closed[b]) {
            h->closed[b] = 1;
            h->num_closed++;
        }
        release(h, b);
        if (h->held[b] >= 0)
            release_held(e, b);
        doom(e, b);
    }
    prune(e);
}

/* `DoomedQueues.pop` through `TierManager._doomed_victim`: the first queued doomed block of `ti`
 * that is not protected (nor retained, in the last tier), taken out of its LRU order and queued in
 * the tiers below; or -1. One pass: entries passed over leave, but for copies still being written. */
static int32_t doomed_victim(Engine *e, int ti) {
    Hints *h = &e->h;
    Tier *t = &e->tier[ti];
    Ring *q = &h->doomed[ti];
    int last = ti == e->num_tiers - 1;
    for (int64_t n = q->len; n > 0; n--) {
        int32_t b = ring_pop(q);
        if (!is_doomed(h, b))
            continue;
        if (t->state[b] != FREE && !is_protected(t, b) && !(last && is_retained(h, b))) {
            if (lru_tracked(t, b))
                lru_unlink(t, b);
            for (int lo = ti + 1; lo < e->num_tiers; lo++)
                ring_push(e, &h->doomed[lo], b);
            h->doomed_evicted++;
            return b;
        }
        if (t->state[b] == WRITING)
            ring_push(e, q, b);
    }
    return -1;
}

/* `TierManager._victim[ti]()`: without hints, the LRU's oldest unprotected copy; with them
 * (`_bind_hinted_victims`), a doomed block first, and in the last tier every retained copy the
 * LRU walk meets is set aside (out of the order, kept) until its deadline lapses. */
static int32_t victim_one(Engine *e, int ti) {
    Tier *t = &e->tier[ti];
    Hints *h = &e->h;
    if (!h->on)
        return lru_evict_one(t);
    if (h->doomed[ti].len > 0) {
        int32_t b = doomed_victim(e, ti);
        if (b >= 0)
            return b;
    }
    if (ti != e->num_tiers - 1)
        return lru_evict_one(t);
    for (int32_t b = t->head, next; b != END; b = next) {
        next = t->next[b];
        if (is_protected(t, b))
            continue;
        lru_unlink(t, b);
        if (!is_retained(h, b))
            return b;
        h->held[b] = (int8_t)ti;  /* `_set_aside` */
    }
    return -1;
}

/* Whether `_victims[ti](n)` may answer: with hints, not while doomed blocks are queued in `ti`. */
static inline int batch_victims(const Engine *e, int ti) { return !e->h.on || e->h.doomed[ti].len == 0; }

/* ---- decisions ------------------------------------------------------------------------------- */

static void enqueue(Engine *e, int32_t b, int src, int dst, int kind) {
    if (e->queue_len == e->queue_cap) {
        e->broken = "more moves in flight than slots";
        return;
    }
    Queued *q = &e->queue[(e->queue_head + e->queue_len) % e->queue_cap];
    q->block = b;
    q->src = (int8_t)src;
    q->dst = (int8_t)dst;
    q->kind = (int8_t)kind;
    e->queue_len++;
}

/* `TierManager._evict`: `b`'s copy in `ti` (already out of its LRU order) is released, demoted
 * into the first tier below that admits it and has or can make room, or dropped. */
static void evict(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    t->evictions++;
    if (e->num_copies[b] > 1) {
        for (int i = 0; i < e->num_tiers; i++) {
            uint8_t s = e->tier[i].state[b];
            if (i != ti && s != FREE && s != FREEING) {
                retire_unlisted(e, b, ti, DROP_EVICTED);  /* never the last copy */
                return;
            }
        }
    }
    if (ti == e->num_tiers - 1) {
        retire_unlisted(e, b, ti, DROP_EVICTED);
        return;
    }
    int refused = 0;
    for (int lo = ti + 1; lo < e->num_tiers; lo++) {
        Tier *l = &e->tier[lo];
        if (l->state[b] != FREE)
            continue;
        if (!admits(l, 1, e->hits[b])) {
            refused = 1;
            continue;
        }
        if (l->num_free == 0) {
            int32_t victim = victim_one(e, lo);
            if (victim >= 0)
                evict(e, victim, lo);
        }
        if (l->num_free == 0)
            continue;
        l->num_free--;
        t->readers[b]++;  /* the demotion reads the source */
        l->state[b] = WRITING;
        e->num_copies[b]++;
        t->outgoing++;
        enqueue(e, b, ti, lo, DEMOTE);
        return;
    }
    retire_unlisted(e, b, ti, refused ? DROP_ADMISSION : DROP_LOWER_FULL);
}

/* `TierManager._take_slot`: takes a free slot of `ti` for a block it admits, evicting one victim
 * if that frees one now; returns whether it took one. */
static int take_slot(Engine *e, int ti, int demoted, int64_t hits) {
    Tier *t = &e->tier[ti];
    if (!admits(t, demoted, hits))
        return 0;
    if (t->num_free == 0) {
        int32_t victim = victim_one(e, ti);
        if (victim >= 0)
            evict(e, victim, ti);
    }
    if (t->num_free == 0)
        return 0;
    t->num_free--;
    return 1;
}

/* `TierManager._rebalance`: every watermarked tier above its high mark demotes down to its low mark. */
static void rebalance(Engine *e) {
    int over_high = 0;
    for (int ti = 0; ti < e->num_tiers; ti++) {
        Tier *t = &e->tier[ti];
        if (!t->watermarked)
            continue;
        int64_t used = t->num_slots - t->num_free - t->outgoing;
        if (used <= t->high_slots)
            continue;
        while (used > t->low_slots) {
            int64_t want = used - t->low_slots, got = 0;
            if (want > 1 && batch_victims(e, ti) && lru_evict_n(t, want))
                got = want;
            if (got == 0) {
                int32_t one = victim_one(e, ti);
                if (one < 0) {
                    over_high |= used > t->high_slots;
                    break;
                }
                t->victims[0] = one;
                got = 1;
            }
            for (int64_t i = 0; i < got; i++)
                evict(e, t->victims[i], ti);
            used = t->num_slots - t->num_free - t->outgoing;
        }
    }
    e->over_high = over_high;
}

/* `TierManager._finish_demotion`: returns whether the source was freed at once and was the only
 * other copy (then the watermark check after it may be skipped: see `complete_queued`). */
static int finish_demotion(Engine *e, int32_t b, int src, int dst) {
    Tier *s = &e->tier[src], *d = &e->tier[dst];
    if (s->readers[b] || e->num_copies[b] != 2) {
        make_ready(e, b, dst);
        e->demotions[src][dst]++;
        retire_unlisted(e, b, src, DROP_EVICTED);
        return 0;
    }
    if (d->state[b] != WRITING) {
        e->broken = "a demoted copy was completed twice";
        return 1;
    }
    d->state[b] = READY;
    lru_insert(e, d, b);
    e->demotions[src][dst]++;
    s->state[b] = FREE;
    s->num_free++;
    e->num_copies[b] = 1;
    e->ready[b] = (uint8_t)dst;
    return 1;
}

/* `TierManager._complete` for a promotion (`_land`, `_finish_move`, then `_rebalance`). */
static void finish_promotion(Engine *e, int32_t b, int src, int dst) {
    e->inbound[b] = -1;
    e->tier[src].readers[b]--;
    make_ready(e, b, dst);
    e->promotions[src][dst]++;
    if (e->inclusive)
        free_if_unread(e, b, src);
    else
        retire(e, b, src, DROP_EVICTED);  /* never the last copy: dst is READY */
    rebalance(e);
}

/* `TierManager._complete_queued`: the queued moves, and those their completions queue, in order. */
static void complete_queued(Engine *e) {
    e->over_high = 1;
    while (e->queue_len > 0 && e->broken == NULL) {
        Queued q = e->queue[e->queue_head];
        e->queue_head = (e->queue_head + 1) % e->queue_cap;
        e->queue_len--;
        if (q.kind == DEMOTE) {
            e->tier[q.src].outgoing--;
            e->tier[q.src].readers[q.block]--;
            if (!finish_demotion(e, q.block, q.src, q.dst) || e->over_high)
                rebalance(e);
        } else {
            finish_promotion(e, q.block, q.src, q.dst);
        }
    }
}

/* `TierManager._load_source` for a leased copy of `b` in `ti`: counts the hit, promotes the block
 * where the manager would; returns the tier the engine reads it from. */
static int load_source(Engine *e, int32_t b, int ti) {
    Tier *t = &e->tier[ti];
    e->hits[b]++;
    t->hits++;
    lru_touch(t, b);
    if (e->inbound[b] >= 0) {  /* already on its way up (this load listed it twice): read that copy */
        int dst = e->inbound[b];
        t->readers[b]--;
        e->tier[dst].readers[b]++;
        return dst;
    }
    int up = e->promote_to;
    if (up >= 0 && ti > up && e->tier[up].state[b] == FREE && take_slot(e, up, 0, e->hits[b])) {
        claim(e, b, up);  /* `_start_move(PROMOTE)`: the move leases the source; the load, the destination */
        e->inbound[b] = (int8_t)up;
        enqueue(e, b, ti, up, PROMOTE);
        e->tier[up].readers[b]++;
        return up;
    }
    return ti;
}

/* `TierManager.lookup`: the longest prefix of `keys` with a READY copy. */
static int64_t lookup(const Engine *e, const int32_t *keys, int64_t len) {
    int64_t n = 0;
    while (n < len && e->num_copies[keys[n]] != 0 && e->ready[keys[n]] != NO_TIER)
        n++;
    return n;
}

/* `TierManager.load_now`: `prepare_load`, its moves, `complete_load`, its moves. */
static void load(Engine *e, const int32_t *keys, int64_t len) {
    int64_t leased = 0;
    for (int64_t i = 0; i < len; i++) {  /* lease every source first, as `prepare_load` */
        int32_t b = keys[i];
        int ti = e->num_copies[b] ? e->ready[b] : NO_TIER;
        if (ti == NO_TIER)
            continue;  /* a miss: never here, since `lookup` found every key READY */
        e->tier[ti].readers[b]++;
        e->leased_block[leased] = b;
        e->leased_tier[leased++] = (int8_t)ti;
    }
    for (int64_t i = 0; i < leased; i++)
        e->source_tier[i] = (int8_t)load_source(e, e->leased_block[i], e->leased_tier[i]);
    complete_queued(e);
    for (int64_t i = 0; i < leased; i++) {  /* `complete_load` */
        int32_t b = e->leased_block[i];
        int ti = e->source_tier[i];
        Tier *t = &e->tier[ti];
        t->engine_reads++;
        if (t->state[b] == FREE)
            continue;  /* the manager skips a source whose copy is gone; a leased copy never goes */
        t->readers[b]--;
        free_if_unread(e, b, ti);
    }
    rebalance(e);
    complete_queued(e);
}

/* `TierManager._place_new`: claims a slot for `b` in the first tier with room, and in inclusive
 * mode one in every tier below too; returns whether it claimed any. */
static int place(Engine *e, int32_t b, int64_t *num_placed) {
    int claimed = 0;
    for (int ti = 0; ti < e->num_tiers; ti++) {
        if (claimed && !e->inclusive)
            break;
        if (e->tier[ti].state[b] != FREE)
            continue;  /* a copy of an earlier life is still leaving this tier */
        if (!take_slot(e, ti, 0, 0))
            continue;
        claim(e, b, ti);
        e->placed_block[*num_placed] = b;
        e->placed_tier[(*num_placed)++] = (int8_t)ti;
        claimed = 1;
    }
    return claimed;
}

/* `TierManager.store_now`: `_place`, its moves, the writes completed, the watermarks, their moves. */
static void store(Engine *e, const int32_t *keys, int64_t len) {
    int64_t placed = 0;
    for (int64_t i = 0; i < len; i++) {
        int32_t b = keys[i];
        if (e->num_copies[b] && is_live(e, b))
            continue;  /* already stored or being stored */
        if (!place(e, b, &placed))
            e->dropped[DROP_NO_SPACE]++;
    }
    complete_queued(e);
    for (int64_t i = 0; i < placed; i++) {
        make_ready(e, e->placed_block[i], e->placed_tier[i]);
        e->tier[(int)e->placed_tier[i]].stores++;
    }
    rebalance(e);
    complete_queued(e);
}

/* ---- arguments ------------------------------------------------------------------------------- */

/* A C-contiguous one-dimensional buffer of `itemsize`-byte items whose format is one of `formats`
 * (a byte order prefix of native order allowed); `name` is named in errors. 0 or -1 (raised). */
static int get_array(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t itemsize, const char *formats,
                     int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "replay_lru: %s must be a %scontiguous array of %zd-byte items, got %.100s",
                     name, writable ? "writable " : "", itemsize, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (view->ndim != 1 || view->itemsize != itemsize || strlen(f) != 1 || strchr(formats, *f) == NULL) {
        PyErr_Format(PyExc_TypeError, "replay_lru: %s must be a one-dimensional array of %zd-byte items "
                     "(format one of '%s'), got format '%s', itemsize %zd, %d dimensions",
                     name, itemsize, formats, view->format ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One tier's rules from its tuple (see `replay_lru`'s docstring); 0 or -1 (raised). */
static int parse_tier(PyObject *spec, int i, int last, Tier *t) {
    int admission, allow_demoted;
    long long num_slots, min_hits, high_slots, low_slots;
    double seconds_per_block;
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 7) {
        PyErr_Format(PyExc_TypeError, "replay_lru: tiers[%d] must be a tuple (num_slots, admission, min_hits, "
                     "allow_demoted, high_slots, low_slots, seconds_per_block)", i);
        return -1;
    }
    if (!PyArg_ParseTuple(spec, "LiLpLLd", &num_slots, &admission, &min_hits, &allow_demoted, &high_slots, &low_slots,
                          &seconds_per_block))
        return -1;
    if (num_slots < 1 || num_slots > INT32_MAX - 1) {
        PyErr_Format(PyExc_ValueError, "replay_lru: tiers[%d]: num_slots must be in [1, 2**31 - 2], got %lld", i,
                     num_slots);
        return -1;
    }
    if (admission < ADMIT_ALL || admission > ADMIT_REUSED || min_hits < 0) {
        PyErr_Format(PyExc_ValueError, "replay_lru: tiers[%d]: admission must be 0 (all), 1 (evicted) or 2 (reused) "
                     "with min_hits >= 0, got %d and %lld", i, admission, min_hits);
        return -1;
    }
    if (low_slots < 0 || low_slots > high_slots || high_slots > num_slots) {
        PyErr_Format(PyExc_ValueError, "replay_lru: tiers[%d]: need 0 <= low_slots <= high_slots <= num_slots, "
                     "got %lld, %lld, %lld", i, low_slots, high_slots, num_slots);
        return -1;
    }
    if (!(seconds_per_block >= 0)) {
        PyErr_Format(PyExc_ValueError, "replay_lru: tiers[%d]: seconds_per_block must be >= 0", i);
        return -1;
    }
    t->num_slots = t->num_free = num_slots;
    t->admission = admission;
    t->min_hits = min_hits;
    t->allow_demoted = allow_demoted;
    t->high_slots = high_slots;
    t->low_slots = low_slots;
    t->watermarked = high_slots < num_slots && !last;
    t->seconds_per_block = seconds_per_block;
    t->head = t->tail = END;
    return 0;
}

/* ---- the trace: private copies of the caller's arrays ----------------------------------------- */

/* The longest request, in blocks: a block's readers (int32) count at most one per listing in a request. */
#define MAX_REQUEST_BLOCKS (INT32_MAX - 16)

/* The replay reads its own copies of the trace and writes its own TTFT arrays, copied out at the
 * end: `on_progress` is Python code, free to rewrite, resize or free the caller's arrays (and other
 * threads run while it does), so no pointer into them is kept across a call of it. */
typedef struct {
    int32_t *ids;
    int64_t *starts, *lengths, *inputs;
    double *ttft, *ttft_no_cache;
    Py_ssize_t num_ids, num_requests;
} Trace;

static void trace_free(Trace *t) {
    PyMem_Free(t->ids);
    PyMem_Free(t->starts);
    PyMem_Free(t->lengths);
    PyMem_Free(t->inputs);
    PyMem_Free(t->ttft);
    PyMem_Free(t->ttft_no_cache);
}

/* Where an array's bytes lay when it was read (compared, never read again). */
typedef struct {
    const char *start;
    Py_ssize_t len;
} Range;

static inline int overlap(const Range *a, const Range *b) {
    return a->len > 0 && b->len > 0 && a->start < b->start + b->len && b->start < a->start + a->len;
}

/* The six arrays, in the order `replay_lru` takes them: inputs, then outputs. */
static const char *const ARRAY_NAMES[6] = {"ids", "starts", "lengths", "input_tokens", "ttft_s", "ttft_no_cache_s"};
static const char *const ARRAY_FORMATS[6] = {"il", "lq", "lq", "lq", "d", "d"};
enum { NUM_INPUTS = 4 };

/* Reads array `i` of the six from `obj` (checked as `get_array` checks it): notes where it lies
 * and, if `copy` is not NULL, sets it to a private copy of its bytes. Holds nothing of `obj`
 * afterwards. 0 or -1 (raised). */
static int take_array(PyObject *obj, int i, Range *where, void **copy) {
    Py_buffer view;
    if (get_array(obj, &view, ARRAY_NAMES[i], i == 0 ? 4 : 8, ARRAY_FORMATS[i], i >= NUM_INPUTS) < 0)
        return -1;
    where->start = view.buf;
    where->len = view.len;
    int rc = 0;
    if (copy != NULL) {
        *copy = PyMem_Malloc(view.len > 0 ? (size_t)view.len : 1);
        if (*copy == NULL) {
            PyErr_NoMemory();
            rc = -1;
        } else if (view.len > 0) {
            memcpy(*copy, view.buf, (size_t)view.len);
        }
    }
    PyBuffer_Release(&view);
    return rc;
}

/* Checks where the six arrays lay: one item per request in all but `ids`, and outputs that share
 * no byte with any other array. 0 or -1 (raised). */
static int check_ranges(const Range where[6]) {
    Py_ssize_t num_requests = where[1].len / 8;
    for (int i = 2; i < 6; i++) {
        if (where[i].len / 8 != num_requests) {
            PyErr_Format(PyExc_ValueError, "replay_lru: starts, lengths, input_tokens, ttft_s and ttft_no_cache_s "
                         "must have one item per request (%zd)", num_requests);
            return -1;
        }
    }
    for (int out = NUM_INPUTS; out < 6; out++) {
        for (int i = 0; i < 6; i++) {
            if (i != out && overlap(&where[out], &where[i])) {
                PyErr_Format(PyExc_ValueError, "replay_lru: %s shares memory with %s: an output must be an array "
                             "of its own", ARRAY_NAMES[out], ARRAY_NAMES[i]);
                return -1;
            }
        }
    }
    return 0;
}

/* Takes the trace out of the six arrays `objs` into `t`: private copies of the inputs, room for
 * the outputs, each array checked and none held afterwards (whatever Python code runs as the
 * next is read, a copy made is what the replay reads). 0 or -1 (raised). */
static int read_trace(PyObject *const objs[6], Trace *t) {
    Range where[6];
    void *copies[NUM_INPUTS] = {NULL, NULL, NULL, NULL};
    int rc = 0;
    for (int i = 0; i < 6 && rc == 0; i++)
        rc = take_array(objs[i], i, &where[i], i < NUM_INPUTS ? &copies[i] : NULL);
    t->ids = copies[0];  /* freed by trace_free, taken or not */
    t->starts = copies[1];
    t->lengths = copies[2];
    t->inputs = copies[3];
    if (rc < 0 || check_ranges(where) < 0)
        return -1;
    t->num_ids = where[0].len / 4;
    t->num_requests = where[1].len / 8;
    size_t n = (size_t)(t->num_requests > 0 ? t->num_requests : 1);
    t->ttft = PyMem_Malloc(n * sizeof(double));
    t->ttft_no_cache = PyMem_Malloc(n * sizeof(double));
    if (t->ttft == NULL || t->ttft_no_cache == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Checks the trace's copies: every id a block, every request inside `ids` and no longer than
 * MAX_REQUEST_BLOCKS, every input_tokens >= 0. 0 or -1 (raised). Sets the longest request's length. */
static int check_trace(const Trace *t, long long num_blocks, int64_t *max_len) {
    for (Py_ssize_t i = 0; i < t->num_ids; i++) {
        if (t->ids[i] < 0 || t->ids[i] >= num_blocks) {
            PyErr_Format(PyExc_ValueError, "replay_lru: ids[%zd] = %d is not a block id in [0, num_blocks = %lld)", i,
                         (int)t->ids[i], num_blocks);
            return -1;
        }
    }
    *max_len = 0;
    for (Py_ssize_t r = 0; r < t->num_requests; r++) {
        int64_t start = t->starts[r], length = t->lengths[r];
        if (start < 0 || length < 0 || start > t->num_ids || length > t->num_ids - start) {
            PyErr_Format(PyExc_ValueError, "replay_lru: request %zd: ids[%lld : %lld + %lld] is not inside the %zd ids",
                         r, (long long)start, (long long)start, (long long)length, t->num_ids);
            return -1;
        }
        if (length > MAX_REQUEST_BLOCKS) {
            PyErr_Format(PyExc_ValueError, "replay_lru: request %zd: lengths[%zd] = %lld is more than the %d blocks a "
                         "request may have", r, r, (long long)length, MAX_REQUEST_BLOCKS);
            return -1;
        }
        if (t->inputs[r] < 0) {
            PyErr_Format(PyExc_ValueError, "replay_lru: request %zd: input_tokens must be >= 0, got %lld", r,
                         (long long)t->inputs[r]);
            return -1;
        }
        if (length > *max_len)
            *max_len = length;
    }
    return 0;
}

/* Copies the replay's TTFTs into the caller's arrays, taken again now that no more Python code
 * runs before the copy: whatever `on_progress` did to them, they are checked as they are now.
 * 0 or -1 (raised). */
static int write_ttfts(PyObject *ttft_obj, PyObject *ttft_no_cache_obj, const Trace *t) {
    PyObject *objs[2] = {ttft_obj, ttft_no_cache_obj};
    const double *values[2] = {t->ttft, t->ttft_no_cache};
    for (int i = 0; i < 2; i++) {
        Py_buffer view;
        if (get_array(objs[i], &view, ARRAY_NAMES[NUM_INPUTS + i], 8, "d", 1) < 0)
            return -1;
        if (view.len / 8 != t->num_requests) {
            PyErr_Format(PyExc_ValueError, "replay_lru: %s changed size during the replay (%zd items, %zd requests)",
                         ARRAY_NAMES[NUM_INPUTS + i], view.len / 8, t->num_requests);
            PyBuffer_Release(&view);
            return -1;
        }
        memcpy(view.buf, values[i], (size_t)t->num_requests * sizeof(double));
        PyBuffer_Release(&view);
    }
    return 0;
}

/* ---- the trace's hints ----------------------------------------------------------------------- */

/* A private copy of array `obj` (checked as `get_array` checks it) of `count` items, or count < 0:
 * any number, set into *count. 0 or -1 (raised). */
static int copy_hint_array(PyObject *obj, const char *name, Py_ssize_t itemsize, const char *formats, void **copy,
                           Py_ssize_t *count) {
    Py_buffer view;
    if (get_array(obj, &view, name, itemsize, formats, 0) < 0)
        return -1;
    Py_ssize_t n = view.len / itemsize;
    if (*count >= 0 && n != *count) {
        PyErr_Format(PyExc_ValueError, "replay_lru: hints: %s must have %zd items, got %zd", name, *count, n);
        PyBuffer_Release(&view);
        return -1;
    }
    *count = n;
    *copy = PyMem_Malloc(view.len > 0 ? (size_t)view.len : 1);
    if (*copy == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory(), -1;
    }
    if (view.len > 0)
        memcpy(*copy, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

/* Reads `hints` (see `replay_lru`'s docstring) into `h`, checked against the trace: copies, so that
 * `on_progress` cannot change what the replay reads. 0 or -1 (raised). */
static int read_hints(PyObject *hints, Py_ssize_t num_requests, long long num_blocks, Hints *h) {
    PyObject *now_obj, *retain_obj, *ids_obj, *offsets_obj;
    long long tenant_cap, total_cap, prune_keep;
    if (!PyTuple_Check(hints) || PyTuple_GET_SIZE(hints) != 7) {
        PyErr_SetString(PyExc_TypeError, "replay_lru: hints must be None or a tuple (now_s, retain_s, ids, offsets, "
                        "tenant_cap, total_cap, prune_keep)");
        return -1;
    }
    if (!PyArg_ParseTuple(hints, "OOOOLLL", &now_obj, &retain_obj, &ids_obj, &offsets_obj, &tenant_cap, &total_cap,
                          &prune_keep))
        return -1;
    Py_ssize_t n = num_requests, num_offsets = 3 * num_requests + 1, num_ids = -1;
    if (copy_hint_array(now_obj, "now_s", 8, "d", (void **)&h->now_s, &n) < 0
        || copy_hint_array(retain_obj, "retain_s", 8, "d", (void **)&h->retain_s, &n) < 0
        || copy_hint_array(ids_obj, "ids", 4, "il", (void **)&h->ids, &num_ids) < 0
        || copy_hint_array(offsets_obj, "offsets", 8, "lq", (void **)&h->offsets, &num_offsets) < 0)
        return -1;
    for (Py_ssize_t r = 0; r < num_requests; r++) {
        if (!isfinite(h->now_s[r]) || !isfinite(h->retain_s[r]) || h->retain_s[r] < 0) {
            PyErr_Format(PyExc_ValueError, "replay_lru: hints: request %zd: now_s must be finite and retain_s finite "
                         "and >= 0 (0: none)", r);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < num_offsets; i++) {
        if (h->offsets[i] < (i ? h->offsets[i - 1] : 0) || h->offsets[i] > num_ids
            || (i == 0 && h->offsets[0] != 0)) {
            PyErr_Format(PyExc_ValueError, "replay_lru: hints: offsets must rise from 0 to at most the %zd ids, "
                         "offsets[%zd] = %lld does not", num_ids, i, (long long)h->offsets[i]);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < num_ids; i++) {
        if (h->ids[i] < 0 || h->ids[i] >= num_blocks) {
            PyErr_Format(PyExc_ValueError, "replay_lru: hints: ids[%zd] = %d is not a block id", i, (int)h->ids[i]);
            return -1;
        }
    }
    if (tenant_cap < 0 || total_cap < 0 || prune_keep < 0) {
        PyErr_SetString(PyExc_ValueError, "replay_lru: hints: tenant_cap, total_cap and prune_keep must be >= 0");
        return -1;
    }
    h->tenant_cap = tenant_cap;
    h->total_cap = total_cap;
    h->prune_keep = prune_keep;
    h->on = 1;
    return 0;
}

/* ---- the engine's memory --------------------------------------------------------------------- */

static void engine_free(Engine *e) {
    for (int i = 0; i < MAX_TIERS; i++) {
        Tier *t = &e->tier[i];
        PyMem_Free(t->state);
        PyMem_Free(t->readers);
        PyMem_Free(t->prev);
        PyMem_Free(t->next);
        PyMem_Free(t->victims);
    }
    PyMem_Free(e->num_copies);
    PyMem_Free(e->ready);
    PyMem_Free(e->hits);
    PyMem_Free(e->inbound);
    PyMem_Free(e->queue);
    PyMem_Free(e->leased_block);
    PyMem_Free(e->leased_tier);
    PyMem_Free(e->source_tier);
    PyMem_Free(e->placed_block);
    PyMem_Free(e->placed_tier);
    Hints *h = &e->h;
    PyMem_Free(h->refs);
    PyMem_Free(h->unhinted);
    PyMem_Free(h->closed);
    PyMem_Free(h->has_until);
    PyMem_Free(h->until);
    PyMem_Free(h->held);
    PyMem_Free(h->heap);
    for (int i = 0; i < MAX_TIERS; i++)
        PyMem_Free(h->doomed[i].ids);
    PyMem_Free(h->now_s);
    PyMem_Free(h->retain_s);
    PyMem_Free(h->ids);
    PyMem_Free(h->offsets);
}

/* Allocates the per-block and scratch arrays of `e` (tiers parsed); 0 or -1 (MemoryError). */
static int engine_alloc(Engine *e, int64_t num_blocks, int64_t max_len) {
    size_t n = (size_t)(num_blocks > 0 ? num_blocks : 1), m = (size_t)(max_len > 0 ? max_len : 1);
    int64_t total_slots = 0;
    for (int i = 0; i < e->num_tiers; i++) {
        Tier *t = &e->tier[i];
        t->state = PyMem_Calloc(n, 1);
        t->readers = PyMem_Calloc(n, sizeof(int32_t));
        t->prev = PyMem_Malloc(n * sizeof(int32_t));
        t->next = PyMem_Malloc(n * sizeof(int32_t));
        t->victims = PyMem_Malloc((size_t)t->num_slots * sizeof(int32_t));
        if (!t->state || !t->readers || !t->prev || !t->next || !t->victims)
            return PyErr_NoMemory(), -1;
        for (size_t b = 0; b < n; b++)
            t->prev[b] = OUT;
        total_slots += t->num_slots;
    }
    e->num_copies = PyMem_Calloc(n, 1);
    e->ready = PyMem_Malloc(n);
    e->hits = PyMem_Calloc(n, sizeof(int64_t));
    e->inbound = PyMem_Malloc(n);
    e->queue_cap = total_slots + 1;
    e->queue = PyMem_Malloc((size_t)e->queue_cap * sizeof(Queued));
    e->leased_block = PyMem_Malloc(m * sizeof(int32_t));
    e->leased_tier = PyMem_Malloc(m);
    e->source_tier = PyMem_Malloc(m);
    e->placed_block = PyMem_Malloc(m * MAX_TIERS * sizeof(int32_t));
    e->placed_tier = PyMem_Malloc(m * MAX_TIERS);
    if (!e->num_copies || !e->ready || !e->hits || !e->inbound || !e->queue || !e->leased_block || !e->leased_tier
        || !e->source_tier || !e->placed_block || !e->placed_tier)
        return PyErr_NoMemory(), -1;
    memset(e->ready, NO_TIER, n);
    memset(e->inbound, -1, n);
    e->num_blocks = num_blocks;
    Hints *h = &e->h;
    if (!h->on)
        return 0;
    h->now = -INFINITY;
    h->refs = PyMem_Calloc(n, sizeof(int32_t));
    h->unhinted = PyMem_Calloc(n, 1);
    h->closed = PyMem_Calloc(n, 1);
    h->has_until = PyMem_Calloc(n, 1);
    h->until = PyMem_Malloc(n * sizeof(double));
    h->held = PyMem_Malloc(n);
    if (!h->refs || !h->unhinted || !h->closed || !h->has_until || !h->until || !h->held)
        return PyErr_NoMemory(), -1;
    memset(h->held, -1, n);
    return 0;
}

/* ---- results --------------------------------------------------------------------------------- */

static PyObject *tier_counts(const Engine *e, size_t offset) {
    PyObject *out = PyList_New(e->num_tiers);
    for (int i = 0; out != NULL && i < e->num_tiers; i++) {
        PyObject *v = PyLong_FromLongLong(*(const int64_t *)((const char *)&e->tier[i] + offset));
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *route_counts(const Engine *e, const int64_t counts[MAX_TIERS][MAX_TIERS]) {
    PyObject *out = PyList_New(e->num_tiers);
    for (int i = 0; out != NULL && i < e->num_tiers; i++) {
        PyObject *row = PyList_New(e->num_tiers);
        for (int j = 0; row != NULL && j < e->num_tiers; j++) {
            PyObject *v = PyLong_FromLongLong(counts[i][j]);
            if (v == NULL)
                Py_CLEAR(row);
            else
                PyList_SET_ITEM(row, j, v);
        }
        if (row == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, row);
    }
    return out;
}

/* Per tier, its LRU order (block ids, oldest first). */
static PyObject *lru_orders(const Engine *e) {
    PyObject *out = PyList_New(e->num_tiers);
    for (int i = 0; out != NULL && i < e->num_tiers; i++) {
        const Tier *t = &e->tier[i];
        PyObject *order = PyList_New(0);
        for (int32_t b = t->head; order != NULL && b != END; b = t->next[b]) {
            PyObject *v = PyLong_FromLong(b);
            if (v == NULL || PyList_Append(order, v) < 0)
                Py_CLEAR(order);
            Py_XDECREF(v);
        }
        if (order == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, order);
    }
    return out;
}

/* `v` as a Python int. */
static PyObject *long_from_u128(u128 v) {
    PyObject *high = PyLong_FromUnsignedLongLong((unsigned long long)(v >> 64));
    PyObject *shift = PyLong_FromLong(64);
    PyObject *shifted = high && shift ? PyNumber_Lshift(high, shift) : NULL;
    PyObject *low = PyLong_FromUnsignedLongLong((unsigned long long)v);
    PyObject *out = shifted && low ? PyNumber_Or(shifted, low) : NULL;
    Py_XDECREF(high);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    Py_XDECREF(low);
    return out;
}

static PyObject *results(const Engine *e, const Totals *totals, int with_orders) {
    PyObject *used = PyList_New(e->num_tiers);
    for (int i = 0; used != NULL && i < e->num_tiers; i++) {
        PyObject *v = PyLong_FromLongLong(e->tier[i].num_slots - e->tier[i].num_free);
        if (v == NULL)
            Py_CLEAR(used);
        else
            PyList_SET_ITEM(used, i, v);
    }
    PyObject *out = Py_BuildValue(
        "{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:(LLLL),s:N,s:N,s:N}",
        "hits", tier_counts(e, offsetof(Tier, hits)), "stores", tier_counts(e, offsetof(Tier, stores)),
        "evictions", tier_counts(e, offsetof(Tier, evictions)),
        "engine_reads", tier_counts(e, offsetof(Tier, engine_reads)), "used_slots", used,
        "demotions", route_counts(e, e->demotions), "promotions", route_counts(e, e->promotions),
        "dropped", (long long)e->dropped[DROP_EVICTED], (long long)e->dropped[DROP_ADMISSION],
        (long long)e->dropped[DROP_LOWER_FULL], (long long)e->dropped[DROP_NO_SPACE],
        "num_accesses", long_from_u128(totals->num_accesses), "cached_tokens", long_from_u128(totals->cached_tokens),
        "input_tokens", long_from_u128(totals->input_tokens));
    if (out != NULL && with_orders) {
        PyObject *orders = lru_orders(e);
        if (orders == NULL || PyDict_SetItemString(out, "lru_orders", orders) < 0)
            Py_CLEAR(out);
        Py_XDECREF(orders);
    }
    if (out != NULL && e->h.on) {
        PyObject *hints = Py_BuildValue("{s:L,s:L,s:L}", "over_budget", (long long)e->h.over_budget, "doomed_evicted",
                                        (long long)e->h.doomed_evicted, "num_retained", (long long)e->h.num_retained);
        if (hints == NULL || PyDict_SetItemString(out, "hints", hints) < 0)
            Py_CLEAR(out);
        Py_XDECREF(hints);
    }
    return out;
}

/* ---- the entry point ------------------------------------------------------------------------- */

/* min(n * block_tokens, input_tokens), without computing a product past int64. */
static inline int64_t cached_tokens(int64_t n, int64_t block_tokens, int64_t input_tokens) {
    return n > input_tokens / block_tokens ? input_tokens : n * block_tokens;
}

/* Serves request `r` of `t`; fills its TTFTs and adds it to `totals`. 0, or -1 (RuntimeError: an
 * invariant broke). */
static int serve(Engine *e, Trace *t, Py_ssize_t r, int64_t block_tokens, double seconds_per_token,
                 Totals *totals) {
    int64_t before[MAX_TIERS];
    const int32_t *keys = t->ids + t->starts[r];
    int64_t len = t->lengths[r], n = lookup(e, keys, len), input = t->inputs[r];
    double load_s = 0.0;
    if (n) {
        for (int i = 0; i < e->num_tiers; i++)
            before[i] = e->tier[i].hits;
        load(e, keys, n);
        for (int i = 0; i < e->num_tiers; i++)  /* left to right, as `_Replay.run` sums them */
            load_s += (double)(e->tier[i].hits - before[i]) * e->tier[i].seconds_per_block;
    }
    if (n < len)
        store(e, keys + n, len - n);
    if (e->h.on && e->broken == NULL)
        apply_hint(e, r, keys, len);
    if (e->broken != NULL) {
        PyErr_Format(PyExc_RuntimeError, "replay_lru: request %zd: %s (a bug in kvtier._replay)", r, e->broken);
        return -1;
    }
    int64_t cached = cached_tokens(n, block_tokens, input);
    int64_t computed = input - cached > 1 ? input - cached : 1;
    totals->num_accesses += (u128)len;
    totals->cached_tokens += (u128)cached;
    totals->input_tokens += (u128)input;
    t->ttft[r] = (double)computed * seconds_per_token + load_s;
    t->ttft_no_cache[r] = (double)input * seconds_per_token;
    return 0;
}

/* Serves every request of `t`, calling `on_progress` (if not None) every `progress_every`
 * requests; 0, or -1 with an exception set. */
static int run(Engine *e, Trace *t, int64_t block_tokens, double seconds_per_token, PyObject *on_progress,
               long long progress_every, Totals *totals) {
    for (Py_ssize_t r = 0; r < t->num_requests; r++) {
        if (serve(e, t, r, block_tokens, seconds_per_token, totals) < 0)
            return -1;
        if (on_progress != Py_None && r % progress_every == progress_every - 1) {
            PyObject *done = PyObject_CallFunction(on_progress, "L", progress_every);
            if (done == NULL)
                return -1;
            Py_DECREF(done);
        }
    }
    return 0;
}

PyDoc_STRVAR(replay_lru_doc,
"replay_lru(ids, starts, lengths, input_tokens, num_blocks, tiers, inclusive, promote_to, block_tokens,\n"
"           seconds_per_token, ttft_s, ttft_no_cache_s, on_progress=None, progress_every=256,\n"
"           lru_orders=False, hints=None) -> dict\n"
"\n"
"Replays a trace through LRU tiers exactly as kvtier's TierManager decides (see the module source).\n"
"\n"
"Args:\n"
"    ids: int32 array, every request's block ids back to back, each in [0, num_blocks).\n"
"    starts, lengths: int64 arrays, per request: where its ids start and how many it has.\n"
"    input_tokens: int64 array, per request.\n"
"    num_blocks: the number of distinct block ids.\n"
"    tiers: 1 to 4 tuples, fastest first: (num_slots, admission (0 all, 1 evicted, 2 reused),\n"
"        min_hits, allow_demoted, high_slots = floor(high_watermark * num_slots),\n"
"        low_slots = floor(low_watermark * num_slots), seconds_per_block). The last tier's marks\n"
"        are ignored (it evicts on demand).\n"
"    inclusive: stores write through to every lower tier (else exclusive).\n"
"    promote_to: index of the tier hits below it are promoted into, or -1.\n"
"    block_tokens: tokens per block; seconds_per_token: the TTFT model's prefill cost.\n"
"    ttft_s, ttft_no_cache_s: writable float64 arrays, one item per request, sharing no memory\n"
"        with another of the six arrays; filled when the replay ends.\n"
"    on_progress: called with progress_every after every progress_every requests; the replay\n"
"        reads copies of the arrays taken when it began, whatever on_progress does to them.\n"
"    lru_orders: also return each tier's final LRU order (block ids, oldest first).\n"
"    hints: None, or retention hints applied after every request as TierManager.apply_hint does:\n"
"        (now_s, retain_s, ids, offsets, tenant_cap, total_cap, prune_keep). now_s, retain_s:\n"
"        float64 per request (retain_s 0: none); ids: int32 block ids; offsets: int64, 3 per\n"
"        request + 1, rising from 0: request r's blocks used without a session are\n"
"        ids[offsets[3r]:offsets[3r+1]], those its session lists for the first time the next\n"
"        segment, and those of the session it closes (in HintBook.close's order) the third;\n"
"        tenant_cap, total_cap: the retention budgets in blocks; prune_keep: HintBook.prune's keep.\n"
"Returns:\n"
"    A dict of lists per tier (hits, stores, evictions, engine_reads, used_slots), per route\n"
"    (demotions, promotions: [src][dst]), dropped (evicted, admission, lower_full, no_space), and\n"
"    num_accesses, cached_tokens, input_tokens (exact, however far past 2**63); with hints, also\n"
"    hints: {over_budget, doomed_evicted, num_retained}.\n"
"Raises:\n"
"    TypeError, ValueError: an argument is malformed (the message names it), an output shares\n"
"        memory with another array, or an output changed size during the replay.\n"
"    RuntimeError: an invariant broke (a bug).\n");

static PyObject *replay_lru(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ids", "starts", "lengths", "input_tokens", "num_blocks", "tiers", "inclusive",
                             "promote_to", "block_tokens", "seconds_per_token", "ttft_s", "ttft_no_cache_s",
                             "on_progress", "progress_every", "lru_orders", "hints", NULL};
    PyObject *ids_obj, *starts_obj, *lengths_obj, *inputs_obj, *tiers, *ttft_obj, *ttft_nc_obj;
    PyObject *on_progress = Py_None, *hints = Py_None;
    long long num_blocks, block_tokens, progress_every = 256;
    int inclusive, promote_to, with_orders = 0;
    double seconds_per_token;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOLOpiLdOO|OLpO:replay_lru", kwlist, &ids_obj, &starts_obj,
                                     &lengths_obj, &inputs_obj, &num_blocks, &tiers, &inclusive, &promote_to,
                                     &block_tokens, &seconds_per_token, &ttft_obj, &ttft_nc_obj, &on_progress,
                                     &progress_every, &with_orders, &hints))
        return NULL;
    if (num_blocks < 0 || num_blocks > INT32_MAX - 1) {
        PyErr_Format(PyExc_ValueError, "replay_lru: num_blocks must be in [0, 2**31 - 2], got %lld", num_blocks);
        return NULL;
    }
    if (block_tokens < 1 || progress_every < 1 || !(seconds_per_token >= 0)) {
        PyErr_SetString(PyExc_ValueError, "replay_lru: block_tokens and progress_every must be >= 1 and "
                        "seconds_per_token >= 0");
        return NULL;
    }
    if (on_progress != Py_None && !PyCallable_Check(on_progress)) {
        PyErr_SetString(PyExc_TypeError, "replay_lru: on_progress must be callable or None");
        return NULL;
    }
    if (!PyTuple_Check(tiers) || PyTuple_GET_SIZE(tiers) < 1 || PyTuple_GET_SIZE(tiers) > MAX_TIERS) {
        PyErr_SetString(PyExc_ValueError, "replay_lru: tiers must be a tuple of 1 to 4 tier tuples");
        return NULL;
    }
    Engine e;
    memset(&e, 0, sizeof e);
    e.num_tiers = (int)PyTuple_GET_SIZE(tiers);
    e.inclusive = inclusive;
    if (promote_to < -1 || promote_to >= e.num_tiers) {
        PyErr_Format(PyExc_ValueError, "replay_lru: promote_to must be -1 or a tier index below %d, got %d",
                     e.num_tiers, promote_to);
        return NULL;
    }
    e.promote_to = promote_to;
    for (int i = 0; i < e.num_tiers; i++) {
        if (parse_tier(PyTuple_GET_ITEM(tiers, i), i, i == e.num_tiers - 1, &e.tier[i]) < 0)
            return NULL;
    }
    PyObject *const objs[6] = {ids_obj, starts_obj, lengths_obj, inputs_obj, ttft_obj, ttft_nc_obj};
    Trace trace;
    memset(&trace, 0, sizeof trace);
    Totals totals = {0, 0, 0};
    int64_t max_len;
    PyObject *out = NULL;
    if (read_trace(objs, &trace) == 0 && check_trace(&trace, num_blocks, &max_len) == 0
        && (hints == Py_None || read_hints(hints, trace.num_requests, num_blocks, &e.h) == 0)
        && engine_alloc(&e, num_blocks, max_len) == 0
        && run(&e, &trace, block_tokens, seconds_per_token, on_progress, progress_every, &totals) == 0
        && write_ttfts(ttft_obj, ttft_nc_obj, &trace) == 0)
        out = results(&e, &totals, with_orders);
    trace_free(&trace);
    engine_free(&e);
    return out;
}

static PyMethodDef replay_methods[] = {
    {"replay_lru", (PyCFunction)(void (*)(void))replay_lru, METH_VARARGS | METH_KEYWORDS, replay_lru_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef replay_module = {
    PyModuleDef_HEAD_INIT, "kvtier._replay", "kvtier simulate's trace replay for LRU tiers, in C.", -1,
    replay_methods,
};

PyMODINIT_FUNC PyInit__replay(void) { return PyModule_Create(&replay_module); }
