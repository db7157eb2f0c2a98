// kv_copy.c: batched GPU <-> pinned host copies, submitted from a native thread per mover.
//
// A *mover* owns one worker thread and a queue of *jobs*. A job is a batch of (dst, src, size)
// descriptors for one CUDA stream, optionally after an event. The worker makes the stream wait on that
// event, enqueues the copies and records a completion event; the caller holds the job as a *ticket*
// (its address as a uint64) and polls or waits on it, then releases it.
//
// How the copies are enqueued (the mover's *path*, fixed at creation):
//   KVC_PATH_BATCH_V2   cuMemcpyBatchAsync_v2   (CUDA 13 drivers: no failIdx)
//   KVC_PATH_BATCH_V1   cuMemcpyBatchAsync      (CUDA 12.8+ drivers: with failIdx)
//   KVC_PATH_LOOP       one cuMemcpyAsync per descriptor, in a C loop (older drivers, or asked for:
//                       batched copies have faulted on cudaHostRegister'ed memory on some systems)
// A job on the legacy default stream (0 or CU_STREAM_LEGACY) always takes the loop: the batch API
// refuses that stream.
//
// libcuda is opened with dlopen at run time (or another library with the same symbols: the tests'
// stand-in), so this file builds and loads without linking it. cuda.h is read for types only; no
// function of it is called by name, so its version macros (cuEventDestroy -> cuEventDestroy_v2, ...)
// do not apply: every symbol is looked up by its exact exported name below.
//
// Build: nvcc -O2 -shared -Xcompiler -fPIC -cudart none -o libkv_copy.so kv_copy.c -ldl -lpthread
// (kvtier/moving/cuda_copy.py does this on first use; native/Makefile's `copy` target too).

#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KVC_VERSION 1

// Results below zero are this library's; above zero a CUresult from the driver; 0 is success.
#define KVC_OK 0
#define KVC_PENDING (-1)
#define KVC_TIMEOUT (-2)
#define KVC_EINVAL (-3)
#define KVC_ENOMEM (-4)
#define KVC_ECLOSED (-5)
#define KVC_ENOSYM (-6)
#define KVC_ENODRIVER (-7)
#define KVC_ETHREAD (-8)

#define KVC_MODE_AUTO 0   // the batch API if the driver has it, else the loop
#define KVC_MODE_BATCH 1  // the batch API, or fail at creation
#define KVC_MODE_LOOP 2   // always the loop

#define KVC_PATH_BATCH_V2 0
#define KVC_PATH_BATCH_V1 1
#define KVC_PATH_LOOP 2

#define KVC_NO_INDEX ((uint64_t)-1)

enum { JOB_QUEUED, JOB_SUBMITTED };

// Counters are bumped by the worker and read by any thread: relaxed atomics, no lock.
#define STAT_ADD(m, k, n) __atomic_fetch_add(&(m)->stats[k], (uint64_t)(n), __ATOMIC_RELAXED)

// Counters, in the order kvc_stats writes them.
enum { ST_JOBS, ST_DESCRIPTORS, ST_BYTES, ST_BATCH_CALLS, ST_LOOP_CALLS, ST_LOOP_JOBS, ST_FAILED_JOBS,
       ST_EVENTS_CREATED, ST_COUNT };

typedef CUresult (*fn_batch_v1)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                                size_t, size_t*, CUstream);
typedef CUresult (*fn_batch_v2)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                                size_t, CUstream);
typedef CUresult (*fn_memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_device_get)(CUdevice*, int);
typedef CUresult (*fn_primary_retain)(CUcontext*, CUdevice);
typedef CUresult (*fn_primary_release)(CUdevice);
typedef CUresult (*fn_ctx_set)(CUcontext);
typedef CUresult (*fn_ctx_get)(CUcontext*);
typedef CUresult (*fn_event_create)(CUevent*, unsigned int);
typedef CUresult (*fn_event_destroy)(CUevent);
typedef CUresult (*fn_event_record)(CUevent, CUstream);
typedef CUresult (*fn_event_query)(CUevent);
typedef CUresult (*fn_event_sync)(CUevent);
typedef CUresult (*fn_stream_wait)(CUstream, CUevent, unsigned int);
typedef CUresult (*fn_error_name)(CUresult, const char**);

typedef struct {
    void* lib;
    fn_batch_v1 batch_v1;
    fn_batch_v2 batch_v2;
    fn_memcpy_async memcpy_async;
    fn_init init;
    fn_device_get device_get;
    fn_primary_retain primary_retain;
    fn_primary_release primary_release;
    fn_ctx_set ctx_set;
    fn_ctx_get ctx_get;
    fn_event_create event_create;
    fn_event_destroy event_destroy;
    fn_event_record event_record;
    fn_event_query event_query;
    fn_event_sync event_sync;
    fn_stream_wait stream_wait;
    fn_error_name error_name;
} driver_t;

typedef struct job {
    struct job* next;
    CUdeviceptr* dsts;  // dsts, srcs and sizes share one allocation
    CUdeviceptr* srcs;
    size_t* sizes;
    size_t count;
    CUstream stream;
    CUevent after;      // 0: none
    CUevent done;       // recorded after the copies; 0 if recording failed
    int state;
    int result;         // KVC_OK or the CUresult that failed the job
    uint64_t fail_index;
    int refs;           // the queue's and the caller's
} job_t;

typedef struct event_node {
    struct event_node* next;
    CUevent event;
} event_node_t;

typedef struct {
    driver_t drv;
    int path;
    CUdevice device;
    CUcontext ctx;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;      // the worker: a job arrived or stop
    pthread_cond_t progress;  // waiters: a job left the queue
    job_t* head;
    job_t* tail;
    event_node_t* free_events;
    int stop;
    uint64_t stats[ST_COUNT];
} mover_t;

static void set_error(char* err, size_t err_len, const char* fmt, const char* arg) {
    if (err != NULL && err_len > 0) snprintf(err, err_len, fmt, arg);
}

static void* find(void* lib, const char* name) { return dlsym(lib, name); }

// Looks up every symbol; the batch entry points may be missing, the rest may not.
static int open_driver(driver_t* d, const char* path, char* err, size_t err_len) {
    const char* name = (path != NULL && path[0] != '\0') ? path : "libcuda.so.1";
    d->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (d->lib == NULL) {
        set_error(err, err_len, "dlopen failed: %s", dlerror());
        return KVC_ENODRIVER;
    }
    d->batch_v2 = (fn_batch_v2)find(d->lib, "cuMemcpyBatchAsync_v2");
    d->batch_v1 = (fn_batch_v1)find(d->lib, "cuMemcpyBatchAsync");
    struct { void** slot; const char* name; } need[] = {
        {(void**)&d->memcpy_async, "cuMemcpyAsync"},
        {(void**)&d->init, "cuInit"},
        {(void**)&d->device_get, "cuDeviceGet"},
        {(void**)&d->primary_retain, "cuDevicePrimaryCtxRetain"},
        {(void**)&d->primary_release, "cuDevicePrimaryCtxRelease_v2"},
        {(void**)&d->ctx_set, "cuCtxSetCurrent"},
        {(void**)&d->ctx_get, "cuCtxGetCurrent"},
        {(void**)&d->event_create, "cuEventCreate"},
        {(void**)&d->event_destroy, "cuEventDestroy_v2"},
        {(void**)&d->event_record, "cuEventRecord"},
        {(void**)&d->event_query, "cuEventQuery"},
        {(void**)&d->event_sync, "cuEventSynchronize"},
        {(void**)&d->stream_wait, "cuStreamWaitEvent"},
        {(void**)&d->error_name, "cuGetErrorName"},
    };
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++) {
        *need[i].slot = find(d->lib, need[i].name);
        if (*need[i].slot == NULL) {
            set_error(err, err_len, "the driver has no %s", need[i].name);
            dlclose(d->lib);
            d->lib = NULL;
            return KVC_ENOSYM;
        }
    }
    return KVC_OK;
}

static int choose_path(const driver_t* d, int mode) {
    if (mode == KVC_MODE_LOOP) return KVC_PATH_LOOP;
    if (d->batch_v2 != NULL) return KVC_PATH_BATCH_V2;
    if (d->batch_v1 != NULL) return KVC_PATH_BATCH_V1;
    return mode == KVC_MODE_BATCH ? KVC_ENOSYM : KVC_PATH_LOOP;
}

// Makes the mover's context current on this thread if none is.
static void ensure_context(mover_t* m) {
    CUcontext current = NULL;
    if (m->drv.ctx_get(&current) != CUDA_SUCCESS || current == NULL) m->drv.ctx_set(m->ctx);
}

// ---- the worker ----------------------------------------------------------------------------------

static CUresult copy_loop(mover_t* m, job_t* j) {
    STAT_ADD(m, ST_LOOP_JOBS, 1);
    for (size_t i = 0; i < j->count; i++) {
        STAT_ADD(m, ST_LOOP_CALLS, 1);
        CUresult r = m->drv.memcpy_async(j->dsts[i], j->srcs[i], j->sizes[i], j->stream);
        if (r != CUDA_SUCCESS) {
            j->fail_index = i;
            return r;
        }
    }
    return CUDA_SUCCESS;
}

static CUresult copy_batch(mover_t* m, job_t* j) {
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));  // no location hints: they matter only for managed/pageable memory
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t first = 0;
    STAT_ADD(m, ST_BATCH_CALLS, 1);
    if (m->path == KVC_PATH_BATCH_V2)
        return m->drv.batch_v2(j->dsts, j->srcs, j->sizes, j->count, &attr, &first, 1, j->stream);
    size_t fail = (size_t)-1;
    CUresult r = m->drv.batch_v1(j->dsts, j->srcs, j->sizes, j->count, &attr, &first, 1, &fail, j->stream);
    if (r != CUDA_SUCCESS && fail != (size_t)-1) j->fail_index = fail;
    return r;
}

static CUevent take_event(mover_t* m) {
    CUevent event = NULL;
    pthread_mutex_lock(&m->lock);
    event_node_t* node = m->free_events;
    if (node != NULL) m->free_events = node->next;
    pthread_mutex_unlock(&m->lock);
    if (node != NULL) {
        event = node->event;
        free(node);
        return event;
    }
    if (m->drv.event_create(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return NULL;
    STAT_ADD(m, ST_EVENTS_CREATED, 1);
    return event;
}

static void run_job(mover_t* m, job_t* j) {
    CUresult r = CUDA_SUCCESS;
    if (j->after != NULL) r = m->drv.stream_wait(j->stream, j->after, 0);
    int legacy = j->stream == NULL || j->stream == CU_STREAM_LEGACY;
    if (r == CUDA_SUCCESS && j->count > 0)
        r = (m->path == KVC_PATH_LOOP || legacy) ? copy_loop(m, j) : copy_batch(m, j);
    // Recorded even after a failure: copies enqueued before it may still be running.
    CUevent done = take_event(m);
    if (done != NULL && m->drv.event_record(done, j->stream) != CUDA_SUCCESS) {
        m->drv.event_destroy(done);
        done = NULL;
    }
    if (r == CUDA_SUCCESS && done == NULL) r = CUDA_ERROR_UNKNOWN;
    pthread_mutex_lock(&m->lock);
    j->done = done;
    j->result = (int)r;
    j->state = JOB_SUBMITTED;
    STAT_ADD(m, ST_JOBS, 1);
    STAT_ADD(m, ST_DESCRIPTORS, j->count);
    uint64_t bytes = 0;
    for (size_t i = 0; i < j->count; i++) bytes += j->sizes[i];
    STAT_ADD(m, ST_BYTES, bytes);
    if (r != CUDA_SUCCESS) STAT_ADD(m, ST_FAILED_JOBS, 1);
    pthread_mutex_unlock(&m->lock);
}

static void free_job(mover_t* m, job_t* j) {  // with m->lock held
    if (j->done != NULL) {
        event_node_t* node = malloc(sizeof(*node));
        if (node != NULL) {
            node->event = j->done;
            node->next = m->free_events;
            m->free_events = node;
        }  // else the event leaks: out of memory for a list node
    }
    free(j->dsts);
    free(j);
}

static void drop_ref(mover_t* m, job_t* j) {  // with m->lock held
    if (--j->refs == 0) free_job(m, j);
}

static void* worker(void* arg) {
    mover_t* m = arg;
    m->drv.ctx_set(m->ctx);
    pthread_mutex_lock(&m->lock);
    for (;;) {
        while (m->head == NULL && !m->stop) pthread_cond_wait(&m->wake, &m->lock);
        job_t* j = m->head;
        if (j == NULL) break;  // stopping, and the queue is drained
        m->head = j->next;
        if (m->head == NULL) m->tail = NULL;
        pthread_mutex_unlock(&m->lock);
        run_job(m, j);
        pthread_mutex_lock(&m->lock);
        drop_ref(m, j);
        pthread_cond_broadcast(&m->progress);
    }
    while (m->free_events != NULL) {
        event_node_t* node = m->free_events;
        m->free_events = node->next;
        m->drv.event_destroy(node->event);
        free(node);
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

// ---- the C ABI -------------------------------------------------------------------------------------

int kvc_version(void) { return KVC_VERSION; }

// Opens the driver, retains device `ordinal`'s primary context (the one torch and the runtime use) and
// starts the worker. `driver_path` NULL or "" means libcuda.so.1. On failure writes a message to err.
int kvc_mover_create(const char* driver_path, int ordinal, int mode, void** out, char* err, size_t err_len) {
    if (out == NULL || mode < KVC_MODE_AUTO || mode > KVC_MODE_LOOP) return KVC_EINVAL;
    mover_t* m = calloc(1, sizeof(*m));
    if (m == NULL) return KVC_ENOMEM;
    int rc = open_driver(&m->drv, driver_path, err, err_len);
    if (rc != KVC_OK) {
        free(m);
        return rc;
    }
    m->path = choose_path(&m->drv, mode);
    CUresult r = CUDA_SUCCESS;
    if (m->path < 0) {
        set_error(err, err_len, "%s", "the driver has neither cuMemcpyBatchAsync_v2 nor cuMemcpyBatchAsync");
        rc = KVC_ENOSYM;
    } else if ((r = m->drv.init(0)) != CUDA_SUCCESS || (r = m->drv.device_get(&m->device, ordinal)) != CUDA_SUCCESS ||
               (r = m->drv.primary_retain(&m->ctx, m->device)) != CUDA_SUCCESS) {
        set_error(err, err_len, "%s", "CUDA initialisation failed (cuInit, cuDeviceGet or cuDevicePrimaryCtxRetain)");
        rc = (int)r;
    }
    if (rc == KVC_OK) {
        pthread_mutex_init(&m->lock, NULL);
        pthread_cond_init(&m->wake, NULL);
        pthread_cond_init(&m->progress, NULL);
        if (pthread_create(&m->thread, NULL, worker, m) != 0) {
            m->drv.primary_release(m->device);
            set_error(err, err_len, "%s", "pthread_create failed");
            rc = KVC_ETHREAD;
        }
    }
    if (rc != KVC_OK) {
        dlclose(m->drv.lib);
        free(m);
        return rc;
    }
    *out = m;
    return KVC_OK;
}

int kvc_mover_path(void* handle) { return ((mover_t*)handle)->path; }

// Submits what is queued, stops the worker and releases the context. Tickets must be released first.
int kvc_mover_destroy(void* handle) {
    mover_t* m = handle;
    pthread_mutex_lock(&m->lock);
    m->stop = 1;
    pthread_cond_broadcast(&m->wake);
    pthread_mutex_unlock(&m->lock);
    pthread_join(m->thread, NULL);
    m->drv.primary_release(m->device);
    pthread_mutex_destroy(&m->lock);
    pthread_cond_destroy(&m->wake);
    pthread_cond_destroy(&m->progress);
    dlclose(m->drv.lib);
    free(m);
    return KVC_OK;
}

// Queues `count` copies dsts[i] <- srcs[i] of sizes[i] bytes on `stream`, after `after_event` (0: none).
// The arrays are copied; the memory they point to must stay valid until the ticket is done.
int kvc_submit(void* handle, const uint64_t* dsts, const uint64_t* srcs, const uint64_t* sizes, size_t count,
               uint64_t stream, uint64_t after_event, uint64_t* ticket) {
    mover_t* m = handle;
    if (ticket == NULL || (count > 0 && (dsts == NULL || srcs == NULL || sizes == NULL))) return KVC_EINVAL;
    if ((CUstream)(uintptr_t)stream == CU_STREAM_PER_THREAD) return KVC_EINVAL;  // the worker's own stream
    job_t* j = calloc(1, sizeof(*j));
    void* arrays = malloc(3 * (count > 0 ? count : 1) * sizeof(uint64_t));
    if (j == NULL || arrays == NULL) {
        free(j);
        free(arrays);
        return KVC_ENOMEM;
    }
    j->dsts = arrays;
    j->srcs = j->dsts + count;
    j->sizes = (size_t*)(j->srcs + count);
    memcpy(j->dsts, dsts, count * sizeof(uint64_t));
    memcpy(j->srcs, srcs, count * sizeof(uint64_t));
    memcpy(j->sizes, sizes, count * sizeof(uint64_t));
    j->count = count;
    j->stream = (CUstream)(uintptr_t)stream;
    j->after = (CUevent)(uintptr_t)after_event;
    j->fail_index = KVC_NO_INDEX;
    j->refs = 2;
    pthread_mutex_lock(&m->lock);
    if (m->stop) {
        pthread_mutex_unlock(&m->lock);
        free(arrays);
        free(j);
        return KVC_ECLOSED;
    }
    if (m->tail != NULL) m->tail->next = j; else m->head = j;
    m->tail = j;
    pthread_cond_signal(&m->wake);
    pthread_mutex_unlock(&m->lock);
    *ticket = (uint64_t)(uintptr_t)j;
    return KVC_OK;
}

// KVC_OK when the copies finished, KVC_PENDING while queued or running, else the failure (a CUresult),
// reported once the copies enqueued before it finished. fail_index (may be NULL) gets the descriptor
// that failed, or KVC_NO_INDEX.
int kvc_ticket_query(void* handle, uint64_t ticket, uint64_t* fail_index) {
    mover_t* m = handle;
    job_t* j = (job_t*)(uintptr_t)ticket;
    pthread_mutex_lock(&m->lock);
    int queued = j->state == JOB_QUEUED;
    pthread_mutex_unlock(&m->lock);
    if (queued) return KVC_PENDING;
    if (fail_index != NULL) *fail_index = j->fail_index;
    if (j->done != NULL) {
        ensure_context(m);
        CUresult r = m->drv.event_query(j->done);
        if (r == CUDA_ERROR_NOT_READY) return KVC_PENDING;
        if (r != CUDA_SUCCESS && j->result == KVC_OK) return (int)r;
    }
    return j->result;
}

static void deadline_after(struct timespec* t, int64_t timeout_us) {
    clock_gettime(CLOCK_REALTIME, t);
    t->tv_sec += timeout_us / 1000000;
    t->tv_nsec += (long)(timeout_us % 1000000) * 1000;
    if (t->tv_nsec >= 1000000000L) {
        t->tv_sec++;
        t->tv_nsec -= 1000000000L;
    }
}

static int64_t micros_left(const struct timespec* deadline) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (int64_t)(deadline->tv_sec - now.tv_sec) * 1000000 + (deadline->tv_nsec - now.tv_nsec) / 1000;
}

// Blocks until the ticket is done or failed (as kvc_ticket_query reports), or KVC_TIMEOUT after
// timeout_us microseconds (negative: no limit).
int kvc_ticket_wait(void* handle, uint64_t ticket, int64_t timeout_us, uint64_t* fail_index) {
    mover_t* m = handle;
    job_t* j = (job_t*)(uintptr_t)ticket;
    struct timespec deadline;
    if (timeout_us >= 0) deadline_after(&deadline, timeout_us);
    pthread_mutex_lock(&m->lock);
    while (j->state == JOB_QUEUED) {
        if (timeout_us < 0) {
            pthread_cond_wait(&m->progress, &m->lock);
        } else if (pthread_cond_timedwait(&m->progress, &m->lock, &deadline) == ETIMEDOUT) {
            pthread_mutex_unlock(&m->lock);
            return KVC_TIMEOUT;
        }
    }
    pthread_mutex_unlock(&m->lock);
    if (j->done != NULL && timeout_us < 0) {
        ensure_context(m);
        m->drv.event_sync(j->done);
        return kvc_ticket_query(handle, ticket, fail_index);
    }
    long sleep_ns = 5000;  // polls with backoff up to 1 ms: cuEventSynchronize takes no timeout
    for (;;) {
        int rc = kvc_ticket_query(handle, ticket, fail_index);
        if (rc != KVC_PENDING) return rc;
        if (micros_left(&deadline) <= 0) return KVC_TIMEOUT;
        struct timespec pause = {0, sleep_ns};
        nanosleep(&pause, NULL);
        if (sleep_ns < 1000000L) sleep_ns *= 2;
    }
}

// Makes `stream` wait for the ticket's copies (cuStreamWaitEvent), waiting first for the worker to
// have enqueued them. Returns KVC_OK or the CUresult.
int kvc_ticket_stream_wait(void* handle, uint64_t ticket, uint64_t stream) {
    mover_t* m = handle;
    job_t* j = (job_t*)(uintptr_t)ticket;
    pthread_mutex_lock(&m->lock);
    while (j->state == JOB_QUEUED) pthread_cond_wait(&m->progress, &m->lock);
    pthread_mutex_unlock(&m->lock);
    if (j->done == NULL) return j->result;
    ensure_context(m);
    return (int)m->drv.stream_wait((CUstream)(uintptr_t)stream, j->done, 0);
}

// Gives the ticket back; it must not be used afterwards. Its event is reused by a later job.
int kvc_ticket_release(void* handle, uint64_t ticket) {
    mover_t* m = handle;
    pthread_mutex_lock(&m->lock);
    drop_ref(m, (job_t*)(uintptr_t)ticket);
    pthread_mutex_unlock(&m->lock);
    return KVC_OK;
}

// Writes the ST_COUNT counters (see the enum) into out; returns how many.
int kvc_stats(void* handle, uint64_t* out, int capacity) {
    mover_t* m = handle;
    int n = capacity < ST_COUNT ? capacity : ST_COUNT;
    for (int i = 0; i < n; i++) out[i] = __atomic_load_n(&m->stats[i], __ATOMIC_RELAXED);
    return n;
}

// The driver's name for a CUresult (e.g. "CUDA_ERROR_INVALID_VALUE"), or NULL if it has none.
const char* kvc_error_name(void* handle, int code) {
    mover_t* m = handle;
    const char* name = NULL;
    if (m->drv.error_name((CUresult)code, &name) != CUDA_SUCCESS) return NULL;
    return name;
}
