/* kvtier.moving._movers: a whole batch of host-memory copies or file I/O in one call, outside the GIL.
 *
 * The transfer engine hands each route a batch (every block of one load or store, one layer span
 * at a time) as arrays of descriptors: where each range starts, where it goes, how long it is.
 * Per block, a Python loop costs several µs (a view, a NumPy copy, a lookup): more than a 64 KiB
 * memcpy. Here the loop is C, and the GIL is released for the whole of it, so the engine's own
 * Python threads (an API server, a scheduler) run while the bytes move.
 *
 *   copy(src, dst, lengths, seeds=None, sums=None, expect=None, bad=None, threads=1) -> int
 *       For each i: the xxh3-64 of src[i]'s bytes seeded with seeds[i] (where seeds are given)
 *       into sums[i]; where expect is given and differs, bad[i] = 1 and the range is not copied;
 *       then memcpy(dst[i], src[i], lengths[i]) (dst=None: check only, nothing copied).
 *       Checksum and copy run in one pass over each range, while it is in cache. Returns the
 *       number of mismatches. With threads > 1, `threads` native threads share the batch; plain
 *       copies (no seeds) are cut into pieces of at least PIECE_BYTES so that one large range is
 *       shared too (a checksum is one sequential pass, so a checked range stays whole).
 *   copy_layers(src, dst, rel, lengths, seeds, layer0, sums, expect=None, bad=None, threads=1) -> int
 *       `copy` of the same layers of k blocks (block j's layer l at src[j] + rel[l], seeded
 *       seeds[j] + layer0 + l), its k x L descriptors computed here (see below).
 *   copy_slots(slab, slab_stride, slab_rows, rows, row_stride, slots, length, to_rows, threads=1)
 *       `copy` between rows `slots[i]` of a slab and rows `i` of a caller's buffer (see below),
 *       its descriptors computed here from the two bases and strides and the int32 `slots`.
 *   xxh3(data, seed, portable=False) -> int
 *       The checksum `copy` computes, of one buffer (`portable`: xxHash's portable code, not AVX2).
 *   recv_layers(fd, buffer, have, rel, lengths, seed, layer0, sums, deadline) -> (received, error)
 *       Fills `buffer` from stream socket `fd`, its first `have` bytes already there, and hashes
 *       each layer (buffer[rel[l]:][:lengths[l]], seeded seed + layer0 + l) into sums[l] as soon
 *       as its bytes are in, while they are in cache: the check of a block read off a socket costs
 *       no second pass over it. Waits (poll) at most until `deadline` (time.monotonic()). Returns
 *       the bytes now in `buffer` and 0, or the errno that stopped it (ETIMEDOUT past the
 *       deadline; -1: the peer closed first); layers not yet in are left unhashed then.
 *   pread(fds, offsets, addresses, lengths, errors, threads=1, *, rel=None, layer_lengths=None, seeds=None,
 *         layer0=0, sums=None) -> int
 *   pwrite(fds, offsets, addresses, lengths, errors, threads=1) -> int
 *       For each i: the whole range read from (written to) file descriptor fds[i] at offsets[i],
 *       retried on EINTR and short transfers; errors[i] = 0, or the errno that failed it (a read
 *       past the end of the file: ENODATA, never zeros). `threads` native threads take
 *       descriptors in turn, so that many are in flight at once (the queue depth). Returns the
 *       number of failed descriptors. A pread given layers hashes each read range's layers
 *       (addresses[i] + rel[l], layer_lengths[l] bytes, seeded seeds[i] + layer0 + l) into
 *       sums[i * L + l] in the thread that read it, right after the read (the check's pass in
 *       the read's, spread over the readers): as `copy_layers` would, but not after the batch.
 *
 * Every array is a C-contiguous buffer of 8-byte unsigned integers (NumPy uint64; `errors` and
 * `bad` int32 and uint8), all of the same length. Addresses are raw: the caller (the transfer
 * engine, which computes them from tensors and tier memory it holds for the call's duration)
 * guarantees that each range is valid memory. That is the same contract as ctypes.memmove; the
 * module is private to kvtier.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* xxh3-64 seeded: xxHash's portable (SSE2 on x86-64) code, or where the CPU has AVX2 the same
 * function compiled for it (kvtier/moving/_xxh3_avx2.c, 2.4x as fast), chosen when the module
 * loads; `XXH3_VECTOR` names the one in use. */
typedef uint64_t (*Hash)(const void *data, size_t length, uint64_t seed);
static uint64_t xxh3_portable(const void *data, size_t length, uint64_t seed) {
    return XXH3_64bits_withSeed(data, length, seed);
}
#if defined(__x86_64__) && defined(__GNUC__)
uint64_t kvtier_xxh3_avx2(const void *data, size_t length, uint64_t seed);
#endif
static Hash xxh3 = xxh3_portable;

#define MAX_THREADS 64
#define PIECE_BYTES (512u << 10) /* the least a thread copies of a split range */

/* ---- arguments ---------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Arg;

/* Takes `obj` as an array of `n` items of `itemsize` bytes (n < 0: sets it). None gives NULL data. */
static int take(Arg *arg, PyObject *obj, const char *name, Py_ssize_t itemsize, Py_ssize_t *n, int writable) {
    arg->held = 0;
    if (obj == NULL || obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, &arg->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    arg->held = 1;
    const char *format = arg->view.format ? arg->view.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    if (arg->view.itemsize != itemsize || arg->view.ndim != 1 || strlen(format) != 1 || !strchr("bBhHiIlLqQ", *format)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D array of %zd-byte integers, got format '%s', "
                     "%zd-byte items in %d dims", name, itemsize, arg->view.format ? arg->view.format : "B",
                     arg->view.itemsize, arg->view.ndim);
        return -1;
    }
    Py_ssize_t len = arg->view.len / itemsize;
    if (*n < 0) {
        *n = len;
    } else if (len != *n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items where the batch has %zd", name, len, *n);
        return -1;
    }
    return 0;
}

static void release(Arg *args, int count) {
    for (int i = 0; i < count; i++)
        if (args[i].held) PyBuffer_Release(&args[i].view);
}

static void *data(Arg *arg) { return arg->held ? arg->view.buf : NULL; }

static int check_threads(long threads) {
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads: expected 1..%d, got %ld", MAX_THREADS, threads);
        return -1;
    }
    return 0;
}

/* ---- workers: `threads` threads (the caller's one of them) take descriptors in turn --------- */

typedef struct Batch Batch;
typedef void (*Step)(Batch *b, Py_ssize_t i);

struct Batch {
    Py_ssize_t n;
    Py_ssize_t next;  /* the next descriptor to take (atomic) */
    Step step;
    const uint64_t *src, *dst, *lengths, *seeds, *expect, *fds, *offsets;
    const uint64_t *rel, *layer_lengths;  /* pread's layers to hash after each read (NULL: none) */
    Py_ssize_t layers;
    uint64_t layer0;
    uint64_t *sums;
    uint8_t *bad;
    int32_t *errors;
    Py_ssize_t failed;  /* atomic */
};

static void *work(void *arg) {
    Batch *b = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->n) return NULL;
        b->step(b, i);
    }
}

/* Runs `b` on `threads` threads; a thread that cannot be started leaves its share to the others. */
static void run(Batch *b, long threads) {
    pthread_t ids[MAX_THREADS];
    long started = 0;
    if (threads > b->n) threads = (long)b->n;
    for (long t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, work, b) == 0) started++;
    }
    work(b);
    for (long t = 0; t < started; t++) pthread_join(ids[t], NULL);
}

/* ---- copy --------------------------------------------------------------------------------- */

static void copy_step(Batch *b, Py_ssize_t i) {
    const void *src = (const void *)(uintptr_t)b->src[i];
    size_t length = (size_t)b->lengths[i];
    if (b->seeds != NULL) {
        uint64_t sum = xxh3(src, length, b->seeds[i]);
        if (b->sums != NULL) b->sums[i] = sum;
        if (b->expect != NULL && sum != b->expect[i]) {
            b->bad[i] = 1;
            __atomic_fetch_add(&b->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    if (b->dst != NULL && length) memcpy((void *)(uintptr_t)b->dst[i], src, length);
}

/* Cuts the ranges of plain copies `b` into about 2 pieces per thread, each at least PIECE_BYTES,
 * so that a batch of few large ranges (one 4 MiB block) keeps every thread busy; `b` then points
 * at the pieces, in `*pieces` (one allocation, freed by the caller). Returns -1 out of memory. */
static int split(Batch *b, long threads, uint64_t **pieces) {
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) total += b->lengths[i];
    uint64_t piece = total / (uint64_t)(threads * 2);
    piece = piece < PIECE_BYTES ? PIECE_BYTES : (piece + 4095) & ~(uint64_t)4095;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) count += b->lengths[i] ? (Py_ssize_t)((b->lengths[i] + piece - 1) / piece) : 0;
    if (count <= b->n) return 0;  /* nothing to cut */
    uint64_t *p = PyMem_RawMalloc(sizeof(uint64_t) * 3 * (size_t)count);
    if (p == NULL) return -1;
    uint64_t *src = p, *dst = p + count, *len = p + 2 * count;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        for (uint64_t done = 0; done < b->lengths[i]; done += piece, k++) {
            src[k] = b->src[i] + done;
            dst[k] = b->dst[i] + done;
            len[k] = b->lengths[i] - done < piece ? b->lengths[i] - done : piece;
        }
    }
    b->src = src, b->dst = dst, b->lengths = len, b->n = count;
    *pieces = p;
    return 0;
}

static PyObject *movers_copy(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"src", "dst", "lengths", "seeds", "sums", "expect", "bad", "threads", NULL};
    PyObject *src, *dst, *lengths, *seeds = Py_None, *sums = Py_None, *expect = Py_None, *bad = Py_None;
    long threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OOOOl:copy", names, &src, &dst, &lengths, &seeds,
                                     &sums, &expect, &bad, &threads))
        return NULL;
    Arg a[7];
    memset(a, 0, sizeof a);
    Py_ssize_t n = -1;
    PyObject *result = NULL;
    if (check_threads(threads) < 0 || take(&a[0], src, "src", 8, &n, 0) < 0 || take(&a[1], dst, "dst", 8, &n, 0) < 0 ||
        take(&a[2], lengths, "lengths", 8, &n, 0) < 0 || take(&a[3], seeds, "seeds", 8, &n, 0) < 0 ||
        take(&a[4], sums, "sums", 8, &n, 1) < 0 || take(&a[5], expect, "expect", 8, &n, 0) < 0 ||
        take(&a[6], bad, "bad", 1, &n, 1) < 0)
        goto done;
    if (src == Py_None || lengths == Py_None) {
        PyErr_SetString(PyExc_TypeError, "copy: src and lengths are required arrays");
        goto done;
    }
    if ((sums != Py_None || expect != Py_None) && seeds == Py_None) {
        PyErr_SetString(PyExc_ValueError, "copy: sums and expect need seeds");
        goto done;
    }
    if ((expect == Py_None) != (bad == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "copy: expect and bad go together (bad flags each mismatch)");
        goto done;
    }
    Batch b = {.n = n, .step = copy_step, .src = data(&a[0]), .dst = data(&a[1]), .lengths = data(&a[2]),
               .seeds = data(&a[3]), .sums = data(&a[4]), .expect = data(&a[5]), .bad = data(&a[6])};
    uint64_t *pieces = NULL;
    if (threads > 1 && b.seeds == NULL && b.dst != NULL && split(&b, threads, &pieces) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    run(&b, threads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(pieces);
    result = PyLong_FromSsize_t(b.failed);
done:
    release(a, 7);
    return result;
}

/* copy_slots(slab, slab_stride, slab_rows, rows, row_stride, slots, length, to_rows, threads=1):
 * `copy` of `length` bytes between row slots[i] of a slab (at slab + slots[i] * slab_stride) and
 * row i of a caller's buffer (rows + i * row_stride), for each i: into the buffer where `to_rows`,
 * else out of it. The descriptors are computed here, from the two bases and an int32 array of
 * slots, so that the caller builds none. A slot outside [0, slab_rows) is a ValueError, before
 * anything is copied. */
static PyObject *movers_copy_slots(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"slab", "slab_stride", "slab_rows", "rows", "row_stride", "slots", "length", "to_rows",
                            "threads", NULL};
    unsigned long long slab, slab_stride, rows, row_stride, length;
    Py_ssize_t slab_rows;
    PyObject *slots;
    int to_rows;
    long threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnKKOKp|l:copy_slots", names, &slab, &slab_stride, &slab_rows,
                                     &rows, &row_stride, &slots, &length, &to_rows, &threads))
        return NULL;
    Arg a[1];
    memset(a, 0, sizeof a);
    Py_ssize_t n = -1;
    uint64_t *descriptors = NULL, *pieces = NULL;
    PyObject *result = NULL;
    if (check_threads(threads) < 0 || take(&a[0], slots, "slots", 4, &n, 0) < 0)
        goto done;
    if (!a[0].held) {
        PyErr_SetString(PyExc_TypeError, "copy_slots: slots is a required array");
        goto done;
    }
    const int32_t *at = data(&a[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || at[i] >= slab_rows) {
            PyErr_Format(PyExc_ValueError, "copy_slots: slot %d of a slab of %zd rows", (int)at[i], slab_rows);
            goto done;
        }
    }
    descriptors = PyMem_RawMalloc(sizeof(uint64_t) * 3 * (size_t)(n ? n : 1));
    if (descriptors == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *in_slab = descriptors, *in_rows = descriptors + n, *lengths = descriptors + 2 * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        in_slab[i] = slab + (uint64_t)at[i] * slab_stride;
        in_rows[i] = rows + (uint64_t)i * row_stride;
        lengths[i] = length;
    }
    Batch b = {.n = n, .step = copy_step, .src = to_rows ? in_slab : in_rows, .dst = to_rows ? in_rows : in_slab,
               .lengths = lengths};
    if (threads > 1 && split(&b, threads, &pieces) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    run(&b, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_RawFree(pieces);
    PyMem_RawFree(descriptors);
    release(a, 1);
    return result;
}

/* copy_layers(src, dst, rel, lengths, seeds, layer0, sums, expect=None, bad=None, threads=1) -> mismatches:
 * `copy` of the same layers of k blocks, its k x L descriptors computed here: layer l of block j
 * at src[j] + rel[l] (to dst[j] + rel[l]; dst None: checked only), lengths[l] bytes, seeded
 * seeds[j] + layer0 + l (mod 2**64: the block's seed plus the layer's number), its checksum into
 * sums[j * L + l], checked against expect[j * L + l] where given. A caller then builds k-item
 * arrays, not k x L ones (NumPy calls cost several µs each, more than hashing a 64 KiB block). */
static PyObject *movers_copy_layers(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"src", "dst", "rel", "lengths", "seeds", "layer0", "sums", "expect", "bad", "threads",
                            NULL};
    PyObject *src, *dst, *rel, *lengths, *seeds, *sums, *expect = Py_None, *bad = Py_None;
    unsigned long long layer0;
    long threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOKO|OOl:copy_layers", names, &src, &dst, &rel, &lengths,
                                     &seeds, &layer0, &sums, &expect, &bad, &threads))
        return NULL;
    Arg a[8];
    memset(a, 0, sizeof a);
    Py_ssize_t k = -1, layers = -1, all = -1;
    uint64_t *descriptors = NULL;
    PyObject *result = NULL;
    if (check_threads(threads) < 0 || take(&a[0], src, "src", 8, &k, 0) < 0 || take(&a[1], dst, "dst", 8, &k, 0) < 0 ||
        take(&a[2], seeds, "seeds", 8, &k, 0) < 0 || take(&a[3], rel, "rel", 8, &layers, 0) < 0 ||
        take(&a[4], lengths, "lengths", 8, &layers, 0) < 0 || take(&a[5], sums, "sums", 8, &all, 1) < 0 ||
        take(&a[6], expect, "expect", 8, &all, 0) < 0 || take(&a[7], bad, "bad", 1, &all, 1) < 0)
        goto done;
    if (!a[0].held || !a[2].held || !a[3].held || !a[4].held || !a[5].held) {
        PyErr_SetString(PyExc_TypeError, "copy_layers: src, rel, lengths, seeds and sums are required arrays");
        goto done;
    }
    if (all != k * layers) {
        PyErr_Format(PyExc_ValueError, "copy_layers: sums has %zd items for %zd blocks of %zd layers", all, k, layers);
        goto done;
    }
    if ((expect == Py_None) != (bad == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "copy_layers: expect and bad go together (bad flags each mismatch)");
        goto done;
    }
    descriptors = PyMem_RawMalloc(sizeof(uint64_t) * 4 * (size_t)(all ? all : 1));
    if (descriptors == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *from = descriptors, *to = descriptors + all, *size = descriptors + 2 * all, *seed = descriptors + 3 * all;
    const uint64_t *s = data(&a[0]), *d = data(&a[1]), *bs = data(&a[2]), *r = data(&a[3]), *len = data(&a[4]);
    for (Py_ssize_t j = 0, i = 0; j < k; j++) {
        for (Py_ssize_t l = 0; l < layers; l++, i++) {
            from[i] = s[j] + r[l];
            to[i] = d != NULL ? d[j] + r[l] : 0;
            size[i] = len[l];
            seed[i] = bs[j] + (uint64_t)layer0 + (uint64_t)l;
        }
    }
    Batch b = {.n = all, .step = copy_step, .src = from, .dst = d != NULL ? to : NULL, .lengths = size,
               .seeds = seed, .sums = data(&a[5]), .expect = data(&a[6]), .bad = data(&a[7])};
    Py_BEGIN_ALLOW_THREADS
    run(&b, threads);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(b.failed);
done:
    PyMem_RawFree(descriptors);
    release(a, 8);
    return result;
}

/* ---- socket receive --------------------------------------------------------------------------- */

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Hashes the layers of `buf` complete within its first `got` bytes, from layer `*next` on. */
static void hash_complete(const char *buf, uint64_t got, const uint64_t *rel, const uint64_t *len, Py_ssize_t layers,
                          uint64_t seed, uint64_t *sums, Py_ssize_t *next) {
    while (*next < layers && rel[*next] + len[*next] <= got) {
        Py_ssize_t l = *next;
        sums[l] = xxh3(buf + rel[l], (size_t)len[l], seed + (uint64_t)l);
        (*next)++;
    }
}

static PyObject *movers_recv_layers(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fd", "buffer", "have", "rel", "lengths", "seed", "layer0", "sums", "deadline", NULL};
    int fd;
    Py_buffer buffer;
    Py_ssize_t have;
    PyObject *rel, *lengths, *sums;
    unsigned long long seed, layer0;
    double deadline;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iw*nOOKKOd:recv_layers", names, &fd, &buffer, &have, &rel,
                                     &lengths, &seed, &layer0, &sums, &deadline))
        return NULL;
    Arg a[3];
    memset(a, 0, sizeof a);
    Py_ssize_t layers = -1;
    PyObject *result = NULL;
    if (take(&a[0], rel, "rel", 8, &layers, 0) < 0 || take(&a[1], lengths, "lengths", 8, &layers, 0) < 0 ||
        take(&a[2], sums, "sums", 8, &layers, 1) < 0)
        goto done;
    if (!a[0].held || !a[1].held || !a[2].held) {
        PyErr_SetString(PyExc_TypeError, "recv_layers: rel, lengths and sums are required arrays");
        goto done;
    }
    const uint64_t *r = data(&a[0]), *len = data(&a[1]);
    uint64_t *out = data(&a[2]), n = (uint64_t)buffer.len;
    if (have < 0 || (uint64_t)have > n) {
        PyErr_Format(PyExc_ValueError, "recv_layers: have=%zd outside the buffer's %zd bytes", have, buffer.len);
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++) {
        if (r[l] > n || len[l] > n - r[l] || (l && r[l] < r[l - 1])) {
            PyErr_Format(PyExc_ValueError, "recv_layers: layer %zd (%llu bytes at %llu) outside the buffer's %zd "
                         "bytes or out of order", l, (unsigned long long)len[l], (unsigned long long)r[l], buffer.len);
            goto done;
        }
    }
    char *buf = buffer.buf;
    uint64_t got = (uint64_t)have, first_seed = (uint64_t)seed + (uint64_t)layer0;
    Py_ssize_t next = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    hash_complete(buf, got, r, len, layers, first_seed, out, &next);
    while (got < n) {
        ssize_t k = recv(fd, buf + got, (size_t)(n - got), MSG_DONTWAIT);
        if (k > 0) {
            got += (uint64_t)k;
            hash_complete(buf, got, r, len, layers, first_seed, out, &next);
            continue;
        }
        if (k == 0) { error = -1; break; }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) { error = errno; break; }
        double left = deadline - monotonic_s();
        if (left <= 0) { error = ETIMEDOUT; break; }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ready = poll(&p, 1, left > 3600.0 ? 3600000 : (int)(left * 1000.0) + 1);
        if (ready < 0 && errno != EINTR) { error = errno; break; }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(Ki)", (unsigned long long)got, error);
done:
    release(a, 3);
    PyBuffer_Release(&buffer);
    return result;
}

/* ---- file I/O ----------------------------------------------------------------------------- */

static void pread_step(Batch *b, Py_ssize_t i) {
    int fd = (int)b->fds[i];
    char *buf = (char *)(uintptr_t)b->dst[i];
    size_t left = (size_t)b->lengths[i];
    off_t offset = (off_t)b->offsets[i];
    int error = 0;
    while (left > 0) {
        ssize_t got = pread(fd, buf, left, offset);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { error = errno; break; }
        if (got == 0) { error = ENODATA; break; }  /* past the end of the file: never zeros */
        buf += got;
        left -= (size_t)got;
        offset += got;
    }
    b->errors[i] = error;
    if (error) {
        __atomic_fetch_add(&b->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const char *block = (const char *)(uintptr_t)b->dst[i];  /* hashed by this thread, just read */
    for (Py_ssize_t l = 0; b->rel != NULL && l < b->layers; l++)
        b->sums[i * b->layers + l] = xxh3(block + b->rel[l], (size_t)b->layer_lengths[l], b->seeds[i] + b->layer0 + (uint64_t)l);
}

static void pwrite_step(Batch *b, Py_ssize_t i) {
    int fd = (int)b->fds[i];
    const char *buf = (const char *)(uintptr_t)b->src[i];
    size_t left = (size_t)b->lengths[i];
    off_t offset = (off_t)b->offsets[i];
    int error = 0;
    while (left > 0) {
        ssize_t put = pwrite(fd, buf, left, offset);
        if (put < 0 && errno == EINTR) continue;
        if (put < 0) { error = errno; break; }
        if (put == 0) { error = EIO; break; }
        buf += put;
        left -= (size_t)put;
        offset += put;
    }
    b->errors[i] = error;
    if (error) __atomic_fetch_add(&b->failed, 1, __ATOMIC_RELAXED);
}

static PyObject *file_io(PyObject *args, PyObject *kwargs, int writing) {
    static char *names[] = {"fds", "offsets", "addresses", "lengths", "errors", "threads", "rel", "layer_lengths",
                            "seeds", "layer0", "sums", NULL};
    PyObject *fds, *offsets, *addresses, *lengths, *errors, *rel = Py_None, *layer_lengths = Py_None,
             *seeds = Py_None, *sums = Py_None;
    long threads = 1;
    unsigned long long layer0 = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, writing ? "OOOOO|l$OOOKO:pwrite" : "OOOOO|l$OOOKO:pread", names, &fds,
                                     &offsets, &addresses, &lengths, &errors, &threads, &rel, &layer_lengths, &seeds,
                                     &layer0, &sums))
        return NULL;
    Arg a[9];
    memset(a, 0, sizeof a);
    Py_ssize_t n = -1, layers = -1, all = -1;
    PyObject *result = NULL;
    if (check_threads(threads) < 0 || take(&a[0], fds, "fds", 8, &n, 0) < 0 || take(&a[1], offsets, "offsets", 8, &n, 0) < 0 ||
        take(&a[2], addresses, "addresses", 8, &n, 0) < 0 || take(&a[3], lengths, "lengths", 8, &n, 0) < 0 ||
        take(&a[4], errors, "errors", 4, &n, 1) < 0 || take(&a[5], rel, "rel", 8, &layers, 0) < 0 ||
        take(&a[6], layer_lengths, "layer_lengths", 8, &layers, 0) < 0 || take(&a[7], seeds, "seeds", 8, &n, 0) < 0 ||
        take(&a[8], sums, "sums", 8, &all, 1) < 0)
        goto done;
    if (!a[0].held || !a[1].held || !a[2].held || !a[3].held || !a[4].held) {
        PyErr_SetString(PyExc_TypeError, "fds, offsets, addresses, lengths and errors are required arrays");
        goto done;
    }
    int hashing = a[5].held || a[6].held || a[7].held || a[8].held;
    if (hashing && (writing || !a[5].held || !a[6].held || !a[7].held || !a[8].held)) {
        PyErr_SetString(PyExc_TypeError, writing ? "pwrite hashes nothing: rel, layer_lengths, seeds and sums are pread's"
                                                 : "pread: rel, layer_lengths, seeds and sums go together");
        goto done;
    }
    if (hashing && all != n * layers) {
        PyErr_Format(PyExc_ValueError, "pread: sums has %zd items for %zd reads of %zd layers", all, n, layers);
        goto done;
    }
    Batch b = {.n = n, .step = writing ? pwrite_step : pread_step, .fds = data(&a[0]), .offsets = data(&a[1]),
               .lengths = data(&a[3]), .errors = data(&a[4]), .rel = data(&a[5]), .layer_lengths = data(&a[6]),
               .layers = hashing ? layers : 0, .layer0 = (uint64_t)layer0, .seeds = data(&a[7]), .sums = data(&a[8])};
    if (writing) b.src = data(&a[2]); else b.dst = data(&a[2]);
    for (Py_ssize_t l = 0; hashing && l < layers; l++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (b.rel[l] > b.lengths[i] || b.layer_lengths[l] > b.lengths[i] - b.rel[l]) {
                PyErr_Format(PyExc_ValueError, "pread: layer %zd (%llu bytes at %llu) outside read %zd's %llu bytes", l,
                             (unsigned long long)b.layer_lengths[l], (unsigned long long)b.rel[l], i,
                             (unsigned long long)b.lengths[i]);
                goto done;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* a descriptor a signed off_t or an int cannot hold is a bug */
        if (b.offsets[i] > (uint64_t)INT64_MAX || b.fds[i] > (uint64_t)INT32_MAX || b.lengths[i] > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "descriptor %zd: fd %llu, offset %llu or length %llu out of range", i,
                         (unsigned long long)b.fds[i], (unsigned long long)b.offsets[i], (unsigned long long)b.lengths[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run(&b, threads);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(b.failed);
done:
    release(a, 9);
    return result;
}

/* xxh3(data, seed, portable=False) -> int: the checksum `copy` computes, of one buffer; `portable`
 * takes xxHash's portable code whatever the CPU has (tests hold both to Python's xxhash). */
static PyObject *movers_xxh3(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "seed", "portable", NULL};
    Py_buffer data;
    unsigned long long seed;
    int portable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*K|p:xxh3", names, &data, &seed, &portable)) return NULL;
    uint64_t sum = (portable ? xxh3_portable : xxh3)(data.buf, (size_t)data.len, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *movers_pread(PyObject *self, PyObject *args, PyObject *kwargs) { return file_io(args, kwargs, 0); }
static PyObject *movers_pwrite(PyObject *self, PyObject *args, PyObject *kwargs) { return file_io(args, kwargs, 1); }

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))movers_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(src, dst, lengths, seeds=None, sums=None, expect=None, bad=None, threads=1) -> mismatches"},
    {"copy_layers", (PyCFunction)(void (*)(void))movers_copy_layers, METH_VARARGS | METH_KEYWORDS,
     "copy_layers(src, dst, rel, lengths, seeds, layer0, sums, expect=None, bad=None, threads=1) -> mismatches"},
    {"copy_slots", (PyCFunction)(void (*)(void))movers_copy_slots, METH_VARARGS | METH_KEYWORDS,
     "copy_slots(slab, slab_stride, slab_rows, rows, row_stride, slots, length, to_rows, threads=1)"},
    {"xxh3", (PyCFunction)(void (*)(void))movers_xxh3, METH_VARARGS | METH_KEYWORDS,
     "xxh3(data, seed, portable=False) -> checksum"},
    {"recv_layers", (PyCFunction)(void (*)(void))movers_recv_layers, METH_VARARGS | METH_KEYWORDS,
     "recv_layers(fd, buffer, have, rel, lengths, seed, layer0, sums, deadline) -> (received, error)"},
    {"pread", (PyCFunction)(void (*)(void))movers_pread, METH_VARARGS | METH_KEYWORDS,
     "pread(fds, offsets, addresses, lengths, errors, threads=1, *, rel, layer_lengths, seeds, layer0, sums) -> failures"},
    {"pwrite", (PyCFunction)(void (*)(void))movers_pwrite, METH_VARARGS | METH_KEYWORDS,
     "pwrite(fds, offsets, addresses, lengths, errors, threads=1) -> failures"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef movers_module = {
    PyModuleDef_HEAD_INIT, "kvtier.moving._movers", "Batched host copies and file I/O outside the GIL (see kvtier/moving/_movers.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__movers(void) {
    const char *vector = "portable";
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        xxh3 = kvtier_xxh3_avx2;
        vector = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&movers_module);
    if (m != NULL && (PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0 ||
                      PyModule_AddStringConstant(m, "XXH3_VECTOR", vector) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
