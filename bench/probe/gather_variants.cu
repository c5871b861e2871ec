// Variants of Baton's gather kernel (`ipc/src/cuda/kernels/gather.cu`) for
// `bench/probe/gather_tuning.py --variants`: the same arguments and chunking, with more
// memory operations in flight per thread and cache hints. Each entry point is one variant.
//
// - `u<N>`: each thread loads N 16-byte words (a block-stride apart) before it stores
//   them, with `__restrict__` pointers, so that N loads are in flight at once;
// - `cs`: streaming cache hints (`ld.global.cs`, `st.global.cs`): the bytes are touched
//   once, so they need not stay in L2.
//
// Everything but the word loop is the shipped kernel's, copied, so that the variants differ
// from it in that loop alone.

struct Span {
    unsigned long long ptr;
    unsigned long long off;
    unsigned long long len;
    unsigned long long first;
};

template <int U, bool CS>
__device__ __forceinline__ void gather(unsigned long long base, const Span* __restrict__ spans,
                                       unsigned int n, unsigned long long chunk, int into) {
    unsigned long long c = (unsigned long long)blockIdx.y * gridDim.x + blockIdx.x;
    unsigned int lo = 0, hi = n;
    while (hi - lo > 1) {
        unsigned int mid = lo + (hi - lo) / 2;
        if (spans[mid].first <= c) lo = mid; else hi = mid;
    }
    const Span s = spans[lo];
    unsigned long long at = (c - s.first) * chunk;
    if (at >= s.len) return;
    unsigned long long len = s.len - at < chunk ? s.len - at : chunk;
    const unsigned char* __restrict__ src;
    unsigned char* __restrict__ dst;
    if (into) {
        src = (const unsigned char*)(base + s.off + at);
        dst = (unsigned char*)(s.ptr + at);
    } else {
        src = (const unsigned char*)(s.ptr + at);
        dst = (unsigned char*)(base + s.off + at);
    }
    unsigned long long head = 0, words = 0;
    if ((((unsigned long long)src ^ (unsigned long long)dst) & 15) == 0) {
        head = (16 - ((unsigned long long)src & 15)) & 15;
        if (head > len) head = len;
        words = (len - head) / 16;
    } else {
        head = len;
    }
    for (unsigned long long k = threadIdx.x; k < head; k += blockDim.x) dst[k] = src[k];
    const uint4* __restrict__ s4 = (const uint4*)(src + head);
    uint4* __restrict__ d4 = (uint4*)(dst + head);
    const unsigned long long stride = blockDim.x;
    unsigned long long k = threadIdx.x;
    for (; k + (U - 1) * stride < words; k += U * stride) {
        uint4 r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) r[u] = CS ? __ldcs(s4 + k + u * stride) : s4[k + u * stride];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (CS) __stcs(d4 + k + u * stride, r[u]); else d4[k + u * stride] = r[u];
        }
    }
    for (; k < words; k += stride) d4[k] = s4[k];
    unsigned long long tail = head + words * 16;
    for (unsigned long long t = tail + threadIdx.x; t < len; t += blockDim.x) dst[t] = src[t];
}

#define VARIANT(name, U, CS)                                                                  \
    extern "C" __global__ void name(unsigned long long base, const Span* spans,              \
                                    unsigned int n, unsigned long long chunk, int into) {    \
        gather<U, CS>(base, spans, n, chunk, into);                                          \
    }

VARIANT(baton_gather_u1, 1, false)
VARIANT(baton_gather_u2, 2, false)
VARIANT(baton_gather_u4, 4, false)
VARIANT(baton_gather_u8, 8, false)
VARIANT(baton_gather_u4cs, 4, true)
VARIANT(baton_gather_u8cs, 8, true)
