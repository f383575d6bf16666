// Gather / scatter between vLLM's paged KV cache (on the GPU) and contiguous chunks.
//
// Runs on the GPU; compiled at run time by CuPy (NVRTC) from services/engine/paged_copy.py, and by
// nvcc in the CI compile check. No headers: NVRTC has none by default, and the built-in vector types
// (uint4, uint2) are all we need.
//
// Every per-token layout is described, per layer, by a canonical strided view
//   cache[plane][block][offset][head][0 .. head_bytes)
// (plane = K/V, or one latent plane for MLA) with byte strides s_plane, s_block, s_offset, s_head; a
// head's bytes are contiguous. All layers share the strides, and differ only by their base pointer
// (a device array of layer base pointers, so all layers go in ONE launch: grid.y = layer).
// The chunk is contiguous [layer][plane][token][head][head_bytes].
//
// Copies move V-sized vectors (16, 8, 4, 2 or 1 bytes); the host picks the widest V that divides every
// pointer, stride and head_bytes, so fp16, bf16 and fp32 all go through the same byte-agnostic code.
// The chunk may live in device memory or in pinned host memory (accessed over PCIe through unified
// addressing), which is why each thread issues UNROLL loads before its stores: enough bytes in flight.

typedef long long i64;
typedef unsigned long long u64;

#define KVM_UNROLL 4
#define KVM_MAX_TOKENS_PER_CTA 64  // must match paged_copy.py

struct KvmGeom {
    i64 s_plane, s_block, s_offset, s_head;  // byte strides of the canonical cache view
    int num_tokens;                          // tokens in the chunk
    int num_planes, num_heads, head_vecs;    // head_vecs = head_bytes / sizeof(V)
    int block_size;                          // tokens per block (slot = block * block_size + offset)
    int tokens_per_cta;
    int skip_prefix;                         // scatter: chunk tokens [0, skip_prefix) are not written
};

// One CTA copies tokens [blockIdx.x * tokens_per_cta, +tokens_per_cta) of layer blockIdx.y.
// GATHER: cache -> chunk; else chunk -> cache (tokens before skip_prefix and negative slots skipped).
// threadIdx.x walks the vectors of one token (coalesced on both sides), threadIdx.y the tokens. The
// slot -> byte offset math (a 64-bit division) is done once per token into shared memory, and the
// vector -> (plane, head) split once per thread, so the copy loop is loads and stores.
template <typename V, bool GATHER>
__device__ __forceinline__ void kvm_copy(const u64* __restrict__ layer_ptrs, const i64* __restrict__ slots,
                                         u64 chunk_ptr, const KvmGeom g) {
    __shared__ i64 tok_off[KVM_MAX_TOKENS_PER_CTA];  // byte offset of the token's cell in a layer; -1: skip
    const int layer = blockIdx.y;
    const int tok0 = blockIdx.x * g.tokens_per_cta;
    const int ntok = min(g.tokens_per_cta, g.num_tokens - tok0);
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int t = tid; t < ntok; t += blockDim.x * blockDim.y) {
        const i64 slot = slots[tok0 + t];
        i64 off = -1;
        if (slot >= 0 && (GATHER || tok0 + t >= g.skip_prefix)) {
            const i64 block = slot / g.block_size;
            off = block * g.s_block + (slot - block * g.block_size) * g.s_offset;
        }
        tok_off[t] = off;
    }
    __syncthreads();

    const int per_plane = g.num_heads * g.head_vecs;
    const int per_token = g.num_planes * per_plane;
    const char* const cache = reinterpret_cast<const char*>(layer_ptrs[layer]);
    V* const chunk = reinterpret_cast<V*>(chunk_ptr) + (i64)layer * g.num_planes * g.num_tokens * per_plane;
    for (int u = threadIdx.x; u < per_token; u += blockDim.x) {
        const int plane = u / per_plane;
        const int r = u - plane * per_plane;
        const int head = r / g.head_vecs;
        const int vec = r - head * g.head_vecs;
        char* const cache_u = const_cast<char*>(cache) + plane * g.s_plane + head * g.s_head + (i64)vec * sizeof(V);
        V* const chunk_u = chunk + ((i64)plane * g.num_tokens + tok0) * per_plane + r;
        for (int t0 = threadIdx.y; t0 < ntok; t0 += blockDim.y * KVM_UNROLL) {
            V vals[KVM_UNROLL];
#pragma unroll
            for (int k = 0; k < KVM_UNROLL; ++k) {  // all loads first: several in flight per thread
                const int t = t0 + k * blockDim.y;
                if (t < ntok && tok_off[t] >= 0) {
                    vals[k] = GATHER ? *reinterpret_cast<const V*>(cache_u + tok_off[t]) : chunk_u[(i64)t * per_plane];
                }
            }
#pragma unroll
            for (int k = 0; k < KVM_UNROLL; ++k) {
                const int t = t0 + k * blockDim.y;
                if (t < ntok && tok_off[t] >= 0) {
                    if (GATHER) {
                        chunk_u[(i64)t * per_plane] = vals[k];
                    } else {
                        *reinterpret_cast<V*>(cache_u + tok_off[t]) = vals[k];
                    }
                }
            }
        }
    }
}

// One kernel per (direction, vector width); extern "C" so CuPy finds them by name. Plain scalar
// parameters (pointers as u64) keep the host side free of struct packing.
#define KVM_KERNELS(V, SUFFIX)                                                                          \
    extern "C" __global__ void kvm_gather_##SUFFIX(                                                     \
        u64 layer_ptrs, u64 slots, u64 chunk, i64 s_plane, i64 s_block, i64 s_offset, i64 s_head,       \
        int num_tokens, int num_planes, int num_heads, int head_vecs, int block_size, int tokens_per_cta, \
        int skip_prefix) {                                                                              \
        const KvmGeom g = {s_plane, s_block, s_offset, s_head, num_tokens, num_planes,                  \
                           num_heads, head_vecs, block_size, tokens_per_cta, skip_prefix};              \
        kvm_copy<V, true>(reinterpret_cast<const u64*>(layer_ptrs), reinterpret_cast<const i64*>(slots), \
                          chunk, g);                                                                    \
    }                                                                                                   \
    extern "C" __global__ void kvm_scatter_##SUFFIX(                                                    \
        u64 layer_ptrs, u64 slots, u64 chunk, i64 s_plane, i64 s_block, i64 s_offset, i64 s_head,       \
        int num_tokens, int num_planes, int num_heads, int head_vecs, int block_size, int tokens_per_cta, \
        int skip_prefix) {                                                                              \
        const KvmGeom g = {s_plane, s_block, s_offset, s_head, num_tokens, num_planes,                  \
                           num_heads, head_vecs, block_size, tokens_per_cta, skip_prefix};              \
        kvm_copy<V, false>(reinterpret_cast<const u64*>(layer_ptrs), reinterpret_cast<const i64*>(slots), \
                           chunk, g);                                                                   \
    }

KVM_KERNELS(uint4, v16)
KVM_KERNELS(uint2, v8)
KVM_KERNELS(unsigned int, v4)
KVM_KERNELS(unsigned short, v2)
KVM_KERNELS(unsigned char, v1)
