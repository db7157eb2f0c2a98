// fake_cuda.c: a host-memory stand-in for the few libcuda entry points kv_copy.c uses, for tests on
// machines without a GPU. It proves kv_copy.c's queueing, tickets, paths and error reporting, and
// nothing about a GPU.
//
// Copies are queued in one FIFO (every stream shares it) and run with memcpy, at once unless the
// queue is paused (fake_cuda_pause / fake_cuda_resume), so tests can see work in flight. An event
// completes when the queue has run past its record. Which batch entry points exist is chosen at
// build time, as drivers differ:
//   -DFAKE_BATCH_V2   exports cuMemcpyBatchAsync_v2 (a CUDA 13 driver)
//   -DFAKE_BATCH_V1   exports cuMemcpyBatchAsync with failIdx (a CUDA 12.8+ driver)
//   neither           a driver older than 12.8
// fake_cuda_fail_next(kind, code, index) makes the next batch call (kind 0) or the index-th next
// cuMemcpyAsync (kind 1) fail with `code`.

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

// The driver's types and codes, written out (values from cuda.h): including cuda.h would declare
// these entry points under its versioned names, which this file defines itself.
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUstream_st* CUstream;
typedef struct CUctx_st* CUcontext;
typedef struct CUevent_st* CUevent;
typedef struct {
    int srcAccessOrder;  // the first field of CUmemcpyAttributes; the rest is not read here
} CUmemcpyAttributes;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_ILLEGAL_ADDRESS 700
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CU_MEMCPY_SRC_ACCESS_ORDER_INVALID 0
#define CU_STREAM_LEGACY ((CUstream)0x1)

typedef struct op {
    struct op* next;
    void* dst;
    const void* src;
    size_t size;
    uint64_t seq;  // nonzero: an event record, done when this op runs
} op_t;

struct CUevent_st {
    uint64_t seq;  // 0: never recorded (complete)
};

enum { C_BATCH_V1, C_BATCH_V2, C_MEMCPY, C_STREAM_WAIT, C_LAST_WAIT_EVENT, C_EVENTS_CREATED,
       C_EVENTS_DESTROYED, C_CONTEXT_REFS, C_LAST_STREAM, C_BYTES, C_COUNT };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ran = PTHREAD_COND_INITIALIZER;
static op_t *head, *tail;
static uint64_t next_seq, done_seq;
static int paused;
static uint64_t counts[C_COUNT];
static int fail_kind = -1, fail_code;
static size_t fail_index;
static int fake_context;
static __thread CUcontext current;

static void run_queue(void) {  // with lock held
    while (head != NULL) {
        op_t* o = head;
        head = o->next;
        if (o->seq != 0) done_seq = o->seq; else memcpy(o->dst, o->src, o->size);
        free(o);
    }
    tail = NULL;
    pthread_cond_broadcast(&ran);
}

static CUresult push(void* dst, const void* src, size_t size, uint64_t seq) {  // with lock held
    op_t* o = calloc(1, sizeof(*o));
    if (o == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    o->dst = dst;
    o->src = src;
    o->size = size;
    o->seq = seq;
    if (tail != NULL) tail->next = o; else head = o;
    tail = o;
    if (!paused) run_queue();
    return CUDA_SUCCESS;
}

static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream stream) {
    counts[C_LAST_STREAM] = (uint64_t)(uintptr_t)stream;
    counts[C_BYTES] += size;
    return push((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, size, 0);
}

static int take_failure(int kind) {  // with lock held
    if (fail_kind != kind) return 0;
    if (kind == 1 && fail_index-- > 0) return 0;
    fail_kind = -1;
    return 1;
}

__attribute__((unused)) static CUresult batch(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count, CUmemcpyAttributes* attrs,
                      size_t* attrs_idxs, size_t num_attrs, size_t* fail_idx, CUstream stream) {
    if (stream == NULL || stream == CU_STREAM_LEGACY || count == 0 || num_attrs != 1 || attrs_idxs[0] != 0 ||
        attrs[0].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_INVALID)
        return CUDA_ERROR_INVALID_VALUE;
    if (take_failure(0)) {
        if (fail_idx != NULL) *fail_idx = fail_index;
        return (CUresult)fail_code;
    }
    for (size_t i = 0; i < count; i++) {
        CUresult r = copy(dsts[i], srcs[i], sizes[i], stream);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

#ifdef FAKE_BATCH_V1
EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                   CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, size_t* fail_idx,
                                   CUstream stream) {
    pthread_mutex_lock(&lock);
    counts[C_BATCH_V1]++;
    CUresult r = batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream);
    pthread_mutex_unlock(&lock);
    return r;
}
#endif

#ifdef FAKE_BATCH_V2
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                      CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, CUstream stream) {
    pthread_mutex_lock(&lock);
    counts[C_BATCH_V2]++;
    CUresult r = batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, NULL, stream);
    pthread_mutex_unlock(&lock);
    return r;
}
#endif

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream stream) {
    pthread_mutex_lock(&lock);
    counts[C_MEMCPY]++;
    CUresult r = take_failure(1) ? (CUresult)fail_code : copy(dst, src, size, stream);
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
    (void)device;
    pthread_mutex_lock(&lock);
    counts[C_CONTEXT_REFS]++;
    pthread_mutex_unlock(&lock);
    *ctx = (CUcontext)&fake_context;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    (void)device;
    pthread_mutex_lock(&lock);
    counts[C_CONTEXT_REFS]--;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
    *ctx = current;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(CUevent* event, unsigned int flags) {
    (void)flags;
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *event = calloc(1, sizeof(**event));
    if (*event == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    counts[C_EVENTS_CREATED]++;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent event) {
    pthread_mutex_lock(&lock);
    counts[C_EVENTS_DESTROYED]++;
    pthread_mutex_unlock(&lock);
    free(event);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
    (void)stream;
    pthread_mutex_lock(&lock);
    event->seq = ++next_seq;
    CUresult r = push(NULL, NULL, 0, event->seq);
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuEventQuery(CUevent event) {
    pthread_mutex_lock(&lock);
    CUresult r = event->seq <= done_seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuEventSynchronize(CUevent event) {
    pthread_mutex_lock(&lock);
    while (event->seq > done_seq) pthread_cond_wait(&ran, &lock);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
    (void)stream;
    pthread_mutex_lock(&lock);
    counts[C_STREAM_WAIT]++;
    counts[C_LAST_WAIT_EVENT] = (uint64_t)(uintptr_t)event;
    pthread_mutex_unlock(&lock);
    return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char** name) {
    switch (error) {
        case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; return CUDA_SUCCESS;
        case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; return CUDA_SUCCESS;
        case CUDA_ERROR_NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
        default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

// ---- controls for tests ------------------------------------------------------------------------------

EXPORT void fake_cuda_pause(void) {
    pthread_mutex_lock(&lock);
    paused = 1;
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_resume(void) {
    pthread_mutex_lock(&lock);
    paused = 0;
    run_queue();
    pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_fail_next(int kind, int code, size_t index) {
    pthread_mutex_lock(&lock);
    fail_kind = kind;
    fail_code = code;
    fail_index = index;
    pthread_mutex_unlock(&lock);
}

// Writes the C_COUNT counters (see the enum) into out and returns how many.
EXPORT int fake_cuda_counts(uint64_t* out, int capacity) {
    int n = capacity < C_COUNT ? capacity : C_COUNT;
    pthread_mutex_lock(&lock);
    memcpy(out, counts, (size_t)n * sizeof(uint64_t));
    pthread_mutex_unlock(&lock);
    return n;
}
