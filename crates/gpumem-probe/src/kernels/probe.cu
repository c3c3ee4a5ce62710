// gpumem probe kernels. Compiled at run time by NVRTC for the device's own architecture
// (see compile.rs), so a user needs no nvcc. No headers: NVRTC supplies the CUDA built-ins.
//
// Every kernel writes a result that the host checks against its own computation, so none of
// the work can be optimised away and a wrong kernel cannot report a number.

typedef unsigned int u32;
typedef unsigned long long u64;

// Nanoseconds of the GPU's global timer. Read beside clock64() in the same thread, it gives the
// SM clock the kernel really ran at (cycles / ns) instead of a nominal figure.
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 thread_index() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 thread_count() {
    return (u64)gridDim.x * blockDim.x;
}

// Poison: fill a buffer with a 32-bit pattern before a kernel that must overwrite all of it.
extern "C" __global__ void fill_u32(u32* dst, u64 n, u32 value) {
    for (u64 i = thread_index(); i < n; i += thread_count()) dst[i] = value;
}

// ---------------------------------------------------------------------------------------------
// Pointer chase. a[] holds word indices: a[line * stride] = next_line * stride, one cycle
// through every line. One thread walks it: each load's address is the previous load's value,
// so the loads cannot overlap and the time per step is the latency of the level holding a[].
// out[0] = cycles (clock64), out[1] = ns (globaltimer), out[2] = the index the walk ended on.

// Lays the chain out on the device from the compact successor list (line -> next line).
extern "C" __global__ void chase_build(u32* a, const u32* next, u64 n_lines, u32 stride_words) {
    for (u64 i = thread_index(); i < n_lines; i += thread_count())
        a[i * stride_words] = next[i] * stride_words;
}

#define CHASE_TIMED(LOAD)                                                                    \
    u32 j = start;                                                                           \
    for (u32 i = 0; i < warm; ++i) j = LOAD;                                                 \
    u64 c0 = clock64();                                                                      \
    u64 g0 = global_ns();                                                                    \
    for (u32 i = 0; i < iters; ++i) j = LOAD;                                                \
    u64 g1 = global_ns();                                                                    \
    u64 c1 = clock64();                                                                      \
    out[0] = c1 - c0;                                                                        \
    out[1] = g1 - g0;                                                                        \
    out[2] = j;

// Default global loads (ld.global, cached in L1 on sm_70 and later): a small set stays in L1.
extern "C" __global__ void chase_l1(const u32* a, u32 start, u32 warm, u32 iters, u64* out) {
    CHASE_TIMED(a[j])
}

// ld.global.cg: cached in L2 only, so L1 never answers; with a set larger than L2, HBM answers.
extern "C" __global__ void chase_cg(const u32* a, u32 start, u32 warm, u32 iters, u64* out) {
    CHASE_TIMED(__ldcg(a + j))
}

// Shared memory: the chain is copied into dynamic shared memory first.
extern "C" __global__ void chase_smem(const u32* a, u32 n_words, u32 start, u32 warm, u32 iters,
                                      u64* out) {
    extern __shared__ u32 s[];
    for (u32 i = 0; i < n_words; ++i) s[i] = a[i];
    __syncthreads();
    CHASE_TIMED(s[j])
}

// ---------------------------------------------------------------------------------------------
// Streaming bandwidth. n4 counts float4 (16-byte) elements; grid-stride loops, so element i
// belongs to thread i mod (threads in the grid).

extern "C" __global__ void copy_f4(const float4* __restrict__ src, float4* __restrict__ dst,
                                   u64 n4) {
    for (u64 i = thread_index(); i < n4; i += thread_count()) dst[i] = src[i];
}

// Four independent 16-byte loads in flight per thread before the first store.
extern "C" __global__ void copy_f4_x4(const float4* __restrict__ src, float4* __restrict__ dst,
                                      u64 n4) {
    const u64 t = thread_count();
    u64 i = thread_index();
    for (; i + 3 * t < n4; i += 4 * t) {
        float4 v0 = src[i], v1 = src[i + t], v2 = src[i + 2 * t], v3 = src[i + 3 * t];
        dst[i] = v0; dst[i + t] = v1; dst[i + 2 * t] = v2; dst[i + 3 * t] = v3;
    }
    for (; i < n4; i += t) dst[i] = src[i];
}

// The same with streaming (evict-first) cache hints: the data is touched once.
extern "C" __global__ void copy_f4_x4_cs(const float4* __restrict__ src, float4* __restrict__ dst,
                                         u64 n4) {
    const u64 t = thread_count();
    u64 i = thread_index();
    for (; i + 3 * t < n4; i += 4 * t) {
        float4 v0 = __ldcs(src + i), v1 = __ldcs(src + i + t);
        float4 v2 = __ldcs(src + i + 2 * t), v3 = __ldcs(src + i + 3 * t);
        __stcs(dst + i, v0); __stcs(dst + i + t, v1);
        __stcs(dst + i + 2 * t, v2); __stcs(dst + i + 3 * t, v3);
    }
    for (; i < n4; i += t) __stcs(dst + i, __ldcs(src + i));
}

// One tile of 4 x blockDim float4 per block, a grid as large as the data (no grid-stride): each
// thread loads four 16-byte words blockDim apart, then stores them (the layout PyTorch's
// vectorised element-wise kernels use). n4 must be a multiple of 4 * blockDim; the host
// checks that.
extern "C" __global__ void copy_f4_tile(const float4* __restrict__ src, float4* __restrict__ dst,
                                        u64 n4) {
    const u64 base = (u64)blockIdx.x * blockDim.x * 4 + threadIdx.x;
    const u32 b = blockDim.x;
    if (base + 3 * b >= n4) return;  // only past the last tile: tiles are complete
    float4 v0 = src[base], v1 = src[base + b], v2 = src[base + 2 * b], v3 = src[base + 3 * b];
    dst[base] = v0; dst[base + b] = v1; dst[base + 2 * b] = v2; dst[base + 3 * b] = v3;
}

__device__ __forceinline__ float hsum(float4 v) { return (v.x + v.y) + (v.z + v.w); }

// Reads n4 float4 `reps` times through L2 only (ld.global.cg, so L1 cannot serve re-reads) and
// writes each thread's sum to partial[thread]; the host checks every partial sum. A buffer
// much larger than L2 read once measures HBM; a few MB read many times measures L2.
extern "C" __global__ void read_f4_x4(const float4* __restrict__ src, u64 n4, u32 reps,
                                      float* partial) {
    const u64 t = thread_count();
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (u32 r = 0; r < reps; ++r) {
        u64 i = thread_index();
        for (; i + 3 * t < n4; i += 4 * t) {
            float4 v0 = __ldcg(src + i), v1 = __ldcg(src + i + t);
            float4 v2 = __ldcg(src + i + 2 * t), v3 = __ldcg(src + i + 3 * t);
            a0 += hsum(v0); a1 += hsum(v1); a2 += hsum(v2); a3 += hsum(v3);
        }
        for (; i < n4; i += t) a0 += hsum(__ldcg(src + i));
    }
    partial[thread_index()] = (a0 + a1) + (a2 + a3);
}

// Shared-memory read bandwidth: every thread loads 16 bytes (ld.shared.v4) per step, eight
// independent loads per loop trip, consecutive threads on consecutive 16-byte words (no bank
// conflicts). The base moves every trip so no load is loop-invariant; the table is padded so the
// eight offsets never wrap. Values are small integers, so the float sums are exact and the host
// checks every thread's result. Thread 0 of each block records clock64 and globaltimer around
// the loop: clocks[4 * block + 0..4] = c0, c1, g0, g1.
#define SMEM_BLOCK 256
#define SMEM_UNROLL 8
extern "C" __global__ void __launch_bounds__(SMEM_BLOCK)
smem_read(u32 trips, float* out, u64* clocks) {
    __shared__ float4 s[SMEM_BLOCK + SMEM_UNROLL * 32];
    for (u32 i = threadIdx.x; i < SMEM_BLOCK + SMEM_UNROLL * 32; i += SMEM_BLOCK)
        s[i] = make_float4((float)(i & 3), (float)((i >> 2) & 3), (float)((i >> 4) & 3),
                           (float)((i >> 6) & 3));
    __syncthreads();
    u64 c0 = clock64();
    u64 g0 = global_ns();
    float4 acc0 = make_float4(0.f, 0.f, 0.f, 0.f), acc1 = acc0;
    const u32 t = threadIdx.x;
    for (u32 r = 0; r < trips; ++r) {
        const float4* p = s + ((t + r) & (SMEM_BLOCK - 1));
#pragma unroll
        for (int u = 0; u < SMEM_UNROLL; u += 2) {
            float4 v = p[u * 32], w = p[(u + 1) * 32];
            acc0.x += v.x; acc0.y += v.y; acc0.z += v.z; acc0.w += v.w;
            acc1.x += w.x; acc1.y += w.y; acc1.z += w.z; acc1.w += w.w;
        }
    }
    __syncthreads();
    u64 g1 = global_ns();
    u64 c1 = clock64();
    out[thread_index()] = hsum(acc0) + hsum(acc1);
    if (threadIdx.x == 0) {
        clocks[4 * blockIdx.x + 0] = c0;
        clocks[4 * blockIdx.x + 1] = c1;
        clocks[4 * blockIdx.x + 2] = g0;
        clocks[4 * blockIdx.x + 3] = g1;
    }
}

// ---------------------------------------------------------------------------------------------
// fp32 FMA peak: eight independent dependency chains per thread, 16 steps of each per loop trip
// (128 FFMA per trip against ~3 instructions of loop overhead). The start values are exact
// (a small integer times a power of two) and the host replays the chains with f32::mul_add.
#define FMA_CHAINS 8
#define FMA_STEPS 16
extern "C" __global__ void __launch_bounds__(256)
fma_peak(u32 trips, float a, float b, float* out, u64* clocks) {
    const u32 lane = threadIdx.x & 7;
    float x[FMA_CHAINS];
#pragma unroll
    for (int c = 0; c < FMA_CHAINS; ++c) x[c] = (float)(lane + 8 * c) * 0.0009765625f;
    u64 c0 = clock64();
    u64 g0 = global_ns();
    for (u32 r = 0; r < trips; ++r) {
#pragma unroll
        for (int s = 0; s < FMA_STEPS; ++s) {
#pragma unroll
            for (int c = 0; c < FMA_CHAINS; ++c) x[c] = fmaf(x[c], a, b);
        }
    }
    u64 g1 = global_ns();
    u64 c1 = clock64();
    out[thread_index()] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    if (threadIdx.x == 0) {
        clocks[4 * blockIdx.x + 0] = c0;
        clocks[4 * blockIdx.x + 1] = c1;
        clocks[4 * blockIdx.x + 2] = g0;
        clocks[4 * blockIdx.x + 3] = g1;
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise add c = a + b, three ways.

// Naive: one float per thread, one thread per element.
extern "C" __global__ void add_scalar(const float* a, const float* b, float* c, u64 n) {
    u64 i = thread_index();
    if (i < n) c[i] = a[i] + b[i];
}

// Coalesced and vectorised: 16-byte accesses, grid-stride, two float4 of each input in flight.
extern "C" __global__ void add_f4(const float4* __restrict__ a, const float4* __restrict__ b,
                                  float4* __restrict__ c, u64 n4) {
    const u64 t = thread_count();
    u64 i = thread_index();
    for (; i + t < n4; i += 2 * t) {
        float4 x0 = a[i], y0 = b[i], x1 = a[i + t], y1 = b[i + t];
        c[i] = make_float4(x0.x + y0.x, x0.y + y0.y, x0.z + y0.z, x0.w + y0.w);
        c[i + t] = make_float4(x1.x + y1.x, x1.y + y1.y, x1.z + y1.z, x1.w + y1.w);
    }
    for (; i < n4; i += t) {
        float4 x = a[i], y = b[i];
        c[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
}

// Deliberately strided: within each tile of 1024 floats, the 32 lanes of a warp touch elements
// 32 apart (128 bytes: one cache line each), so every warp access spans 32 lines for 128 useful
// bytes. Every element is still written exactly once (n is a multiple of 1024).
extern "C" __global__ void add_strided(const float* a, const float* b, float* c, u64 n) {
    u64 t = thread_index();
    if (t >= n) return;
    u32 r = (u32)(t & 1023);
    u64 i = (t & ~(u64)1023) + (u64)(r & 31) * 32 + (r >> 5);
    c[i] = a[i] + b[i];
}
