// kv_blocks.cu: gather/scatter between an engine's paged KV tensors and kvtier's contiguous blocks.
//
// Memory layout
// -------------
// Engine side: one tensor per layer, paged by engine block. vLLM's flash-attention backend uses
//     [2, num_engine_blocks, block_size, num_kv_heads, head_dim]    (K/V dimension first)
// and other backends
//     [num_engine_blocks, 2, block_size, num_kv_heads, head_dim]    (block dimension first).
// In both, the *page* of engine block b and part p (p = 0 for K, 1 for V) is one contiguous run of
//     page_bytes = block_size * num_kv_heads * head_dim * dtype_bytes
// bytes starting at
//     engine + b * engine_block_stride + p * part_stride           (both strides in bytes)
// so one kernel serves both layouts:
//     layout                engine_block_stride     part_stride
//     [2, N, page...]       page_bytes              N * page_bytes
//     [N, 2, page...]       2 * page_bytes          page_bytes
// MLA caches (one latent per token, no K/V split) are num_parts = 1, part_stride unused.
//
// kvtier side: a block is one contiguous byte range, layer-major. Layer l's slice is
//     [ part 0 page | part 1 page | ... ]     (K then V), page_bytes each,
// starting at
//     blocks + block_offset(i) + layer_offset(l)
// where block_offset(i) = block_offsets[i] when an offset array is given (blocks in arbitrary slots
// of a slab), else i * block_stride. The single-layer kernels take `blocks` already advanced by the
// layer's offset.
//
// Launch shape
// ------------
// grid.x = num_blocks * num_parts   one (kvtier block i, part p) pair per x index
// grid.y = chunks per page           a page is split into grid.y 16-byte-aligned chunks
// grid.z = layers                    batched kernels only
// Each CTA copies its chunk with 16-byte vectors when source and destination share their
// alignment mod 16 (the usual case), with single bytes for the unaligned head and tail, and with
// single bytes throughout otherwise. There is no shared memory and no __syncthreads.
//
// The source has no #include so that NVRTC (cupy.RawModule) compiles it as is.
//
// Scatter with a repeated engine block id is a write race; the Python side rejects it.

typedef long long i64;
typedef unsigned long long u64;

// Fields of one row of the batched kernels' layer table (int64, row-major [num_layers][5]).
#define LAYER_ENGINE_PTR 0    // device address of the layer's engine tensor
#define LAYER_BLOCK_STRIDE 1  // bytes between consecutive engine blocks
#define LAYER_PART_STRIDE 2   // bytes between K and V pages of one engine block
#define LAYER_PAGE_BYTES 3    // bytes of one page
#define LAYER_OFFSET 4        // byte offset of the layer's slice inside a kvtier block
#define LAYER_FIELDS 5

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

// Copies this CTA's chunk (blockIdx.y of gridDim.y) of one page, in the direction asked.
__device__ __forceinline__ void copy_page_chunk(unsigned char* engine_page, unsigned char* block_page,
                                                i64 page_bytes, bool to_engine) {
    i64 chunk_bytes = (page_bytes + gridDim.y - 1) / gridDim.y;
    chunk_bytes = (chunk_bytes + 15) & ~(i64)15;
    const i64 begin = (i64)blockIdx.y * chunk_bytes;
    if (begin >= page_bytes) return;
    const i64 end = begin + chunk_bytes < page_bytes ? begin + chunk_bytes : page_bytes;
    if (to_engine) {
        copy_range(engine_page + begin, block_page + begin, end - begin);
    } else {
        copy_range(block_page + begin, engine_page + begin, end - begin);
    }
}

// One layer: the page pair (kvtier block i, part p) picked by blockIdx.x.
// `blocks` points at the layer's slice of kvtier block 0 (i.e. already advanced by layer_offset).
__device__ __forceinline__ void copy_layer(unsigned char* engine, i64 engine_block_stride,
                                           i64 part_stride, int num_parts, i64 page_bytes,
                                           const i64* __restrict__ block_ids, i64 num_blocks,
                                           unsigned char* blocks, const i64* __restrict__ block_offsets,
                                           i64 block_stride, bool to_engine) {
    const i64 i = (i64)blockIdx.x / num_parts;
    const i64 part = (i64)blockIdx.x % num_parts;
    if (i >= num_blocks) return;
    unsigned char* engine_page = engine + block_ids[i] * engine_block_stride + part * part_stride;
    const i64 block_offset = block_offsets != 0 ? block_offsets[i] : i * block_stride;
    unsigned char* block_page = blocks + block_offset + part * page_bytes;
    copy_page_chunk(engine_page, block_page, page_bytes, to_engine);
}

// One layer of the batched kernels: the layer is blockIdx.z, its geometry a row of `layers`.
__device__ __forceinline__ void copy_layer_from_table(const i64* __restrict__ layers, int num_parts,
                                                      const i64* __restrict__ block_ids, i64 num_blocks,
                                                      unsigned char* blocks,
                                                      const i64* __restrict__ block_offsets,
                                                      i64 block_stride, bool to_engine) {
    const i64* row = layers + (i64)blockIdx.z * LAYER_FIELDS;
    unsigned char* engine = (unsigned char*)(u64)row[LAYER_ENGINE_PTR];
    copy_layer(engine, row[LAYER_BLOCK_STRIDE], row[LAYER_PART_STRIDE], num_parts, row[LAYER_PAGE_BYTES],
               block_ids, num_blocks, blocks + row[LAYER_OFFSET], block_offsets, block_stride, to_engine);
}

// Engine pages of `num_blocks` engine blocks -> one layer's slice of `num_blocks` kvtier blocks.
// block_offsets may be null (then block i is at i * block_stride).
extern "C" __global__ void gather_layer(const unsigned char* engine, i64 engine_block_stride,
                                        i64 part_stride, int num_parts, i64 page_bytes,
                                        const i64* block_ids, i64 num_blocks, unsigned char* blocks,
                                        const i64* block_offsets, i64 block_stride) {
    copy_layer((unsigned char*)engine, engine_block_stride, part_stride, num_parts, page_bytes,
               block_ids, num_blocks, blocks, block_offsets, block_stride, false);
}

// The reverse of gather_layer: one layer's slice of kvtier blocks -> engine pages.
extern "C" __global__ void scatter_layer(unsigned char* engine, i64 engine_block_stride,
                                         i64 part_stride, int num_parts, i64 page_bytes,
                                         const i64* block_ids, i64 num_blocks,
                                         const unsigned char* blocks, const i64* block_offsets,
                                         i64 block_stride) {
    copy_layer(engine, engine_block_stride, part_stride, num_parts, page_bytes, block_ids, num_blocks,
               (unsigned char*)blocks, block_offsets, block_stride, true);
}

// gather_layer for gridDim.z layers at once; `blocks` points at kvtier block 0 itself.
extern "C" __global__ void gather_layers(const i64* layers, int num_parts, const i64* block_ids,
                                         i64 num_blocks, unsigned char* blocks,
                                         const i64* block_offsets, i64 block_stride) {
    copy_layer_from_table(layers, num_parts, block_ids, num_blocks, blocks, block_offsets,
                          block_stride, false);
}

// scatter_layer for gridDim.z layers at once; `blocks` points at kvtier block 0 itself.
extern "C" __global__ void scatter_layers(const i64* layers, int num_parts, const i64* block_ids,
                                          i64 num_blocks, const unsigned char* blocks,
                                          const i64* block_offsets, i64 block_stride) {
    copy_layer_from_table(layers, num_parts, block_ids, num_blocks, (unsigned char*)blocks,
                          block_offsets, block_stride, true);
}
