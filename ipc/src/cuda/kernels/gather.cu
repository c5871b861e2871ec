// Baton's batched copy: many device-to-device copies between one base buffer and many
// pointers, in one kernel launch (`ipc/src/cuda/copy.rs` loads it). The PTX beside this
// file is what Baton ships; regenerate it after a change with
//   nvcc -ptx -arch=compute_75 -o gather.ptx gather.cu
// (CUDA 13's nvcc has no compute_70), then set its `.version` line to 7.4 and its `.target`
// to sm_70 — CUDA 11.4, the oldest driver Baton supports, and Volta: the kernel uses
// nothing newer — and re-run the GPU tests.
//
// Each copy ("span") is cut into chunks of `chunk` bytes; block `c` copies chunk `c`,
// finding its span by binary search over the spans' first chunks. A chunk whose source and
// destination share their alignment modulo 16 is copied as 16-byte words between a head
// and a tail of bytes; otherwise byte by byte.

struct Span {
    unsigned long long ptr;    // the pointer side of the copy
    unsigned long long off;    // offset in the base buffer
    unsigned long long len;    // bytes (never 0)
    unsigned long long first;  // index of this span's first chunk
};

extern "C" __global__ void baton_gather(unsigned long long base, const Span* spans,
                                        unsigned int n, unsigned long long chunk, int into) {
    unsigned long long c = (unsigned long long)blockIdx.y * gridDim.x + blockIdx.x;
    unsigned int lo = 0, hi = n;  // the last span whose first chunk is <= c
    while (hi - lo > 1) {
        unsigned int mid = lo + (hi - lo) / 2;
        if (spans[mid].first <= c) lo = mid; else hi = mid;
    }
    const Span s = spans[lo];
    unsigned long long at = (c - s.first) * chunk;
    if (at >= s.len) return;  // past the last chunk (the grid is rounded up)
    unsigned long long len = s.len - at < chunk ? s.len - at : chunk;
    const unsigned char* src;
    unsigned char* dst;
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
    const uint4* s4 = (const uint4*)(src + head);
    uint4* d4 = (uint4*)(dst + head);
    for (unsigned long long k = threadIdx.x; k < words; k += blockDim.x) d4[k] = s4[k];
    unsigned long long tail = head + words * 16;
    for (unsigned long long k = tail + threadIdx.x; k < len; k += blockDim.x) dst[k] = src[k];
}
