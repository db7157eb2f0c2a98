// kv_blocks.cu: gather/scatter between an engine's paged KV tensors and kvtier's contiguous blocks.
//
// Memory layout
// -------------
// Engine side: one tensor per layer, paged by engine block. What engine block b holds for one layer
// is a set of *runs*, each run_bytes of contiguous bytes, laid out along up to three strided
// dimensions (counts c0, c1, c2 and byte strides s0, s1, s2, outermost first; an unused dimension
// has count 1). Run (i0, i1, i2) of block b starts at
//     engine + b * engine_block_stride + i0 * s0 + i1 * s1 + i2 * s2
// Examples (page = block_size * num_kv_heads * head_dim * dtype_bytes):
//     layout                                   runs                        run_bytes
//     [2, N, page...]  (K/V first)             c = (2), s = (N * page)     page
//     [N, 2, page...]  (block first)           one run                     2 * page
//     MLA [N, page...], vLLM LBHNC/LBNHC/BL*   one run                     page
//     vLLM LHBNC [H, N, tokens, C]             c = (H), s = (N * tokens*C) tokens * C  (one run per KV head)
//     vLLM BHLNC [N, H, L, tokens, C]          c = (H), s = (L * tokens*C) tokens * C
// The Python side (kvtier.moving.native.PagedLayer) derives these from a tensor's shape and strides.
//
// kvtier side: a block is one contiguous byte range, layer-major. Layer l's slice is the block's
// runs back to back, in row-major (i0, i1, i2) order, starting at
//     blocks + block_offset(i) + layer_offset(l)
// where block_offset(i) = block_offsets[i] when an offset array is given (blocks in arbitrary slots
// of a slab), else i * block_stride. The single-layer kernels take `blocks` already advanced by the
// layer's offset.
//
// Launch shape
// ------------
// grid.x = num_blocks * num_runs    one (kvtier block i, run r) pair per x index
// grid.y = chunks per run            a run is split into grid.y 16-byte-aligned chunks
// grid.z = layers                    batched kernels only (every layer has num_runs runs)
// Each CTA copies its chunk with 16-byte vectors when source and destination share their
// alignment mod 16 (the usual case), with single bytes for the unaligned head and tail, and with
// single bytes throughout otherwise. There is no shared memory and no __syncthreads.
//
// The source has no #include so that NVRTC (cupy.RawModule) compiles it as is.
//
// Scatter with a repeated engine block id is a write race; the Python side rejects it.

typedef long long i64;
typedef unsigned long long u64;

// Fields of one row of the batched kernels' layer table (int64, row-major [num_layers][LAYER_FIELDS]),
// in the order of the single-layer kernels' geometry arguments.
#define LAYER_ENGINE_PTR 0    // device address of the layer's engine tensor
#define LAYER_BLOCK_STRIDE 1  // bytes between consecutive engine blocks
#define LAYER_RUN_BYTES 2     // bytes of one run
#define LAYER_COUNT0 3        // runs along dimension 0, then its stride in bytes; likewise 1 and 2
#define LAYER_STRIDE0 4
#define LAYER_COUNT1 5
#define LAYER_STRIDE1 6
#define LAYER_COUNT2 7
#define LAYER_STRIDE2 8
#define LAYER_OFFSET 9        // byte offset of the layer's slice inside a kvtier block
#define LAYER_FIELDS 10

// Copies len bytes; all threads of the CTA take part.
__device__ __forceinline__ void copy_range(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src, i64 len) {
    const i64 tid = threadIdx.x;
    const i64 num_threads = blockDim.x;
    if ((((u64)dst ^ (u64)src) & 15) != 0) {  // alignments differ: no vector can be aligned on both
        for (i64 k = tid; k < len; k += num_threads) dst[k] = src[k];
        return;
    }
    i64 head = (i64)((16 - ((u64)src & 15)) & 15);
    if (head > len) head = len;
    const i64 num_vectors = (len - head) / 16;
    const i64 tail = head + num_vectors * 16;
    for (i64 k = tid; k < head; k += num_threads) dst[k] = src[k];
    const uint4* src4 = (const uint4*)(src + head);
    uint4* dst4 = (uint4*)(dst + head);
    for (i64 k = tid; k < num_vectors; k += num_threads) dst4[k] = src4[k];
    for (i64 k = tail + tid; k < len; k += num_threads) dst[k] = src[k];
}

// Copies this CTA's chunk (blockIdx.y of gridDim.y) of one run, in the direction asked.
__device__ __forceinline__ void copy_run_chunk(unsigned char* engine_run, unsigned char* block_run,
                                               i64 run_bytes, bool to_engine) {
    i64 chunk_bytes = (run_bytes + gridDim.y - 1) / gridDim.y;
    chunk_bytes = (chunk_bytes + 15) & ~(i64)15;
    const i64 begin = (i64)blockIdx.y * chunk_bytes;
    if (begin >= run_bytes) return;
    const i64 end = begin + chunk_bytes < run_bytes ? begin + chunk_bytes : run_bytes;
    if (to_engine) {
        copy_range(engine_run + begin, block_run + begin, end - begin);
    } else {
        copy_range(block_run + begin, engine_run + begin, end - begin);
    }
}

// A layer's geometry: see "Memory layout" above.
struct RunGeometry {
    i64 block_stride, run_bytes, c0, s0, c1, s1, c2, s2;
};

// One layer: the pair (kvtier block i, run r) picked by blockIdx.x.
// `blocks` points at the layer's slice of kvtier block 0 (i.e. already advanced by layer_offset).
__device__ __forceinline__ void copy_layer(unsigned char* engine, const RunGeometry& g,
                                           const i64* __restrict__ block_ids, i64 num_blocks,
                                           unsigned char* blocks, const i64* __restrict__ block_offsets,
                                           i64 block_stride, bool to_engine) {
    const i64 num_runs = g.c0 * g.c1 * g.c2;
    const i64 i = (i64)blockIdx.x / num_runs;
    const i64 run = (i64)blockIdx.x % num_runs;
    if (i >= num_blocks) return;
    const i64 i2 = run % g.c2;
    const i64 i1 = (run / g.c2) % g.c1;
    const i64 i0 = run / (g.c2 * g.c1);
    unsigned char* engine_run = engine + block_ids[i] * g.block_stride + i0 * g.s0 + i1 * g.s1 + i2 * g.s2;
    const i64 block_offset = block_offsets != 0 ? block_offsets[i] : i * block_stride;
    unsigned char* block_run = blocks + block_offset + run * g.run_bytes;
    copy_run_chunk(engine_run, block_run, g.run_bytes, to_engine);
}

// One layer of the batched kernels: the layer is blockIdx.z, its geometry a row of `layers`.
__device__ __forceinline__ void copy_layer_from_table(const i64* __restrict__ layers,
                                                      const i64* __restrict__ block_ids, i64 num_blocks,
                                                      unsigned char* blocks,
                                                      const i64* __restrict__ block_offsets,
                                                      i64 block_stride, bool to_engine) {
    const i64* row = layers + (i64)blockIdx.z * LAYER_FIELDS;
    unsigned char* engine = (unsigned char*)(u64)row[LAYER_ENGINE_PTR];
    const RunGeometry g = {row[LAYER_BLOCK_STRIDE], row[LAYER_RUN_BYTES], row[LAYER_COUNT0], row[LAYER_STRIDE0],
                           row[LAYER_COUNT1], row[LAYER_STRIDE1], row[LAYER_COUNT2], row[LAYER_STRIDE2]};
    copy_layer(engine, g, block_ids, num_blocks, blocks + row[LAYER_OFFSET], block_offsets, block_stride,
               to_engine);
}

#define GEOMETRY_PARAMS i64 engine_block_stride, i64 run_bytes, i64 c0, i64 s0, i64 c1, i64 s1, i64 c2, i64 s2
#define GEOMETRY {engine_block_stride, run_bytes, c0, s0, c1, s1, c2, s2}

// Engine runs of `num_blocks` engine blocks -> one layer's slice of `num_blocks` kvtier blocks.
// block_offsets may be null (then block i is at i * block_stride).
extern "C" __global__ void gather_layer(const unsigned char* engine, GEOMETRY_PARAMS,
                                        const i64* block_ids, i64 num_blocks, unsigned char* blocks,
                                        const i64* block_offsets, i64 block_stride) {
    const RunGeometry g = GEOMETRY;
    copy_layer((unsigned char*)engine, g, block_ids, num_blocks, blocks, block_offsets, block_stride, false);
}

// The reverse of gather_layer: one layer's slice of kvtier blocks -> engine runs.
extern "C" __global__ void scatter_layer(unsigned char* engine, GEOMETRY_PARAMS,
                                         const i64* block_ids, i64 num_blocks,
                                         const unsigned char* blocks, const i64* block_offsets,
                                         i64 block_stride) {
    const RunGeometry g = GEOMETRY;
    copy_layer(engine, g, block_ids, num_blocks, (unsigned char*)blocks, block_offsets, block_stride, true);
}

// gather_layer for gridDim.z layers at once, all with the same number of runs (grid.x / num_blocks);
// `blocks` points at kvtier block 0 itself.
extern "C" __global__ void gather_layers(const i64* layers, const i64* block_ids, i64 num_blocks,
                                         unsigned char* blocks, const i64* block_offsets, i64 block_stride) {
    copy_layer_from_table(layers, block_ids, num_blocks, blocks, block_offsets, block_stride, false);
}

// scatter_layer for gridDim.z layers at once; `blocks` points at kvtier block 0 itself.
extern "C" __global__ void scatter_layers(const i64* layers, const i64* block_ids, i64 num_blocks,
                                          const unsigned char* blocks, const i64* block_offsets,
                                          i64 block_stride) {
    copy_layer_from_table(layers, block_ids, num_blocks, (unsigned char*)blocks, block_offsets,
                          block_stride, true);
}
