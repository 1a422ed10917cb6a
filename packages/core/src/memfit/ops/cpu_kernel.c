/* Mamba-1's CPU kernels, fused: the selective scan (memfit.ops.scan.selective_scan) and, at the end of the
 * file, the block's depthwise causal conv1d + SiLU (memfit.ops.mamba). memfit/ops/cpu_kernel.py compiles this
 * file on first use and memfit.ops.scan falls back to its torch-op path when there is no C compiler.
 *
 *   dt_t = softplus(delta_t + bias)                       (softplus when asked)
 *   h_t  = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t     (per batch b, channel d: a vector over N)
 *   out_t = (<C_t, h_t> + D * u_t) * silu(z_t)
 *
 * One work item is one (b, d) sequence: its state (N values) stays in registers for the whole
 * sequence, so no (batch, L, N, dim) tensor ever exists, and every per-step tensor is read or written
 * once per pass. The sequence is walked in chunks of T steps: each chunk's per-step values are first
 * gathered into small contiguous arrays (so softplus, the gate and their gradients run as vector loops
 * over the chunk), then the recurrence runs over the chunk with N as the vector axis.
 *
 * Layouts (element strides passed in): per-step tensors index [b*s_b + d*s_d + t*s_t]. B/C index
 * [b*s_b + (d / gs)*s_g + t*s_t + n] (n contiguous): per-step B/C is one group of size dim, grouped
 * is G groups, shared (dim, N) is gs 1 with s_b = s_t = 0. A2 is (dim, N) contiguous: A * log2(e)
 * in fp32 (decays via exp2), A itself in fp64. Forward keeps the state entering every chunk but the
 * first, starts (batch, n_chunks - 1, dim, N); backward recomputes one chunk's states and decays from
 * there into a (T + 1) x N buffer per thread. Gradient accumulators (dA, dB, dC, dD, dbias) are
 * private per thread ([thread][...] blocks, zeroed by the caller and summed over threads by it).
 */
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

/* Every helper and the per-item bodies are inlined into the loops that call them, whatever the optimisation
 * level: at -O2 (the build's level: -O3 took ten times as long to compile and was no faster) gcc otherwise
 * keeps some lane helpers (lgather, vexp2) as calls inside the per-step loop. */
#define INLINE static inline __attribute__((always_inline))

#define NMAX 64 /* largest state size N the kernel takes (memfit.ops.scan checks) */

/* fp32 lanes: 2^x as 2^k * 2^f, k = round(x), |f| <= 1/2, 2^f by its degree-7 Taylor polynomial in
 * f*ln2 (relative error < 1e-8 before rounding). Branch-free, so loops over N or over a chunk vectorise. */
INLINE float exp2_f32(float x) {
    x = x < -125.0f ? -125.0f : (x > 125.0f ? 125.0f : x);
    float k = __builtin_floorf(x + 0.5f);
    float f = (x - k) * 0.6931471805599453f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f +
              f * (8.3333338e-3f + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

INLINE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp2_f32(-1.4426950408889634f * x)); }

/* softplus(x) = max(x, 0) + log1p(y), y = exp(-|x|) in (0, 1]; log1p(y) = 2 atanh(s), s = y / (2 + y)
 * <= 1/3, by its series to s^15 (relative error < 2e-8). */
INLINE float softplus_f32(float x) {
    float y = exp2_f32(-1.4426950408889634f * fabsf(x));
    float s = y / (2.0f + y), q = s * s;
    float p = 1.0f + q * (1.0f / 3 + q * (1.0f / 5 + q * (1.0f / 7 + q * (1.0f / 9 + q * (1.0f / 11 +
              q * (1.0f / 13 + q * (1.0f / 15)))))));
    return (x > 0 ? x : 0.0f) + 2.0f * s * p;
}

/* fp64 (tests, exactness): libm, and A2 holds A itself; softplus with torch's threshold of 20. */
INLINE double exp2_f64(double x) { return exp(x); }
INLINE double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
INLINE double softplus_f64(double x) { return x > 20.0 ? x : log1p(exp(x)); }

/* Lane vectors for the channel-lane path (GCC/Clang vector extensions): 16 fp32 lanes (one AVX-512
 * register) or 8 where the CPU has no AVX-512; fp64 has half as many. */
#ifdef __AVX512F__
#define LANES32 16
#else
#define LANES32 8
#endif
#define LANES64 (LANES32 / 2)
typedef float vf32 __attribute__((vector_size(LANES32 * 4)));
typedef int32_t vi32 __attribute__((vector_size(LANES32 * 4)));
typedef double vf64 __attribute__((vector_size(LANES64 * 8)));

INLINE vf32 vsel_f32(vi32 m, vf32 a, vf32 b) { return (vf32)((m & (vi32)a) | (~m & (vi32)b)); }

#ifdef __AVX512F__
#include <immintrin.h>
/* exp2_f32 on 16 lanes with AVX-512: the same clamp, reduction and polynomial; k = round(x) by
 * vrndscaleps and 2^k applied by vscalefps (no integer round trip: 12 instructions instead of ~18) */
INLINE vf32 vexp2_f32(vf32 x) {
    /* max/min return their second operand when one is NaN: x second, so NaN stays NaN (as the generic
     * version and torch.exp) instead of becoming 2^-125 */
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(125.0f), _mm512_max_ps(_mm512_set1_ps(-125.0f), (__m512)x));
    const __m512 k = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf32 f = (vf32)_mm512_sub_ps(xc, k) * 0.6931471805599453f;
    const vf32 p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f +
                   f * (8.3333338e-3f + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    return (vf32)_mm512_scalef_ps((__m512)p, k);
}
#else
/* exp2_f32 on every lane: the same reduction and polynomial (k = round(x) taken as trunc(x + 128.5) -
 * 128, exact in integers, so the compiler cannot reassociate it) */
INLINE vf32 vexp2_f32(vf32 x) {
    const vf32 lo = (vf32){0} - 125.0f, hi = lo + 250.0f;
    x = vsel_f32(x < lo, lo, x);
    x = vsel_f32(x > hi, hi, x);
    const vi32 k = __builtin_convertvector(x + 128.5f, vi32) - 128;
    const vf32 f = (x - __builtin_convertvector(k, vf32)) * 0.6931471805599453f;
    const vf32 p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f +
                   f * (8.3333338e-3f + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    return p * (vf32)((k + 127) << 23);
}
#endif

INLINE vf32 vsigmoid_f32(vf32 x) { return 1.0f / (1.0f + vexp2_f32(-1.4426950408889634f * x)); }

/* softplus(x) = max(x, 0) + log1p(y), as softplus_f32, with y = exp(-|x|) into *y */
INLINE vf32 vsoftplus_y_f32(vf32 x, vf32 *y_out) {
    const vf32 ax = (vf32)((vi32)x & 0x7fffffff);
    const vf32 y = vexp2_f32(-1.4426950408889634f * ax);
    const vf32 s = y / (2.0f + y), q = s * s;
    const vf32 p = 1.0f + q * (1.0f / 3 + q * (1.0f / 5 + q * (1.0f / 7 + q * (1.0f / 9 + q * (1.0f / 11 +
                   q * (1.0f / 13 + q * (1.0f / 15)))))));
    *y_out = y;
    return vsel_f32(x > 0.0f, x, (vf32){0}) + 2.0f * s * p;
}

INLINE vf32 vsoftplus_f32(vf32 x) {
    vf32 y;
    return vsoftplus_y_f32(x, &y);
}

/* softplus(x) and, into *sg, sigmoid(x) = (x > 0 ? 1 : y) / (1 + y) from the same y = exp(-|x|) */
INLINE vf32 vsoftplus_sig_f32(vf32 x, vf32 *sg) {
    vf32 y;
    const vf32 sp = vsoftplus_y_f32(x, &y);
    *sg = vsel_f32(x > 0.0f, (vf32){0} + 1.0f, y) / (1.0f + y);
    return sp;
}

/* fp64 lanes: libm per lane (tests, exactness; speed does not matter there) */
INLINE vf64 vexp2_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = exp(x[l]);
    return x;
}
INLINE vf64 vsigmoid_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = sigmoid_f64(x[l]);
    return x;
}
INLINE vf64 vsoftplus_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = softplus_f64(x[l]);
    return x;
}
INLINE vf64 vsoftplus_sig_f64(vf64 x, vf64 *sg) {
    *sg = vsigmoid_f64(x);
    return vsoftplus_f64(x);
}

/* out[r] = the sum over the lanes of row r of P (R rows); out may be P itself (it is written behind
 * what has been read). With 16 lanes, 16 rows at a time by a transposing tree of shuffles and adds
 * (rows taken in bit-reversed order so that lane i ends up holding row i). */
#if defined(__has_builtin) /* __builtin_shufflevector: GCC >= 12, clang; others sum lane by lane */
#if __has_builtin(__builtin_shufflevector) && LANES32 == 16
#define LANE_TREE16 1
#endif
#endif
#ifdef LANE_TREE16
INLINE vf32 tree16_f32(const vf32 *r) {
#define SH_ __builtin_shufflevector
    vf32 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = SH_(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SH_(r[2 * i], r[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = SH_(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               SH_(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = SH_(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SH_(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return SH_(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SH_(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#undef SH_
}
#endif

static void lane_sums_f32(const vf32 *P, i64 R, float *out) {
    i64 r = 0;
#ifdef LANE_TREE16
    static const int bitrev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    for (; r + 16 <= R; r += 16) {
        vf32 t[16];
        for (int i = 0; i < 16; i++) t[i] = P[r + bitrev[i]];
        const vf32 s = tree16_f32(t);
        memcpy(out + r, &s, sizeof s);
    }
#endif
    for (; r < R; r++) {
        float s = 0;
        for (int l = 0; l < LANES32; l++) s += P[r][l];
        out[r] = s;
    }
}

static void lane_sums_f64(const vf64 *P, i64 R, double *out) {
    for (i64 r = 0; r < R; r++) {
        double s = 0;
        for (int l = 0; l < LANES64; l++) s += P[r][l];
        out[r] = s;
    }
}


/* bf16 per-step tensors on the lane path (autocast): read widened to fp32, written rounded to nearest
 * even as torch's .to(torch.bfloat16) (NaN stays NaN). Bits of ScanArgs.bfm say which tensors are bf16. */
/* what a kernel returns besides 0: its work buffers could not be allocated; N is outside 1..NMAX */
enum { E_NOMEM = -1, E_STATE = -2 };

enum { BF_U = 1, BF_DELTA = 2, BF_Z = 4, BF_DOUT = 8, BF_Y = 16, BF_DU = 32, BF_DDELTA = 64, BF_DZ = 128 };
/* what a Mamba block passes under bf16 autocast (compiled as constants: runtime bits slowed the loop) */
#define BF_AUTOCAST_FWD (BF_U | BF_DELTA | BF_Z | BF_Y)
#define BF_AUTOCAST_BWD (BF_U | BF_DELTA | BF_Z | BF_DOUT | BF_DU | BF_DDELTA | BF_DZ)

INLINE float bf16_f32(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

INLINE uint16_t f32_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)((b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : rounded);
}

/* a whole lane vector of bf16 from / to p (contiguous) */
INLINE vf32 vload_bf16_f32(const uint16_t *p) {
#if defined(__AVX512F__) && LANES32 == 16
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf32)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    vf32 v;
    for (int l = 0; l < LANES32; l++) v[l] = bf16_f32(p[l]);
    return v;
#endif
}

INLINE void vstore_bf16_f32(uint16_t *p, vf32 v) {
    /* integer rounding, not AVX512-BF16's vcvtneps2bf16, which flushes subnormals to zero */
#if defined(__AVX512BW__) && LANES32 == 16
    const __m512i b = _mm512_castps_si512((__m512)v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q);
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q)));
#else
    for (int l = 0; l < LANES32; l++) p[l] = f32_bf16(v[l]);
#endif
}

INLINE vf64 vload_bf16_f64(const uint16_t *p) {
    vf64 v = {0};
    for (int l = 0; l < LANES64; l++) v[l] = bf16_f32(p[l]);
    return v;
}

INLINE void vstore_bf16_f64(uint16_t *p, vf64 v) {
    for (int l = 0; l < LANES64; l++) p[l] = f32_bf16((float)v[l]);
}


/* One thread's share of a kernel call: its range of work items [lo, hi), its index th and its work
 * buffer. Args and Conv (the body's per-call structs) start with these fields, as an anonymous struct. */
#define PART_FIELDS                                                                                        \
    i64 lo, hi, th;                                                                                        \
    void *work
typedef struct {
    PART_FIELDS;
} Part;

/* Splits `items` work items into contiguous ranges, one per thread (at most one an item), and runs fn on
 * each: part k is a copy of *a (a struct of `size` bytes that starts with a Part) given its range, index
 * and `per` bytes of work buffer (rounded up to whole 64-byte lines: lane vectors live there). Part 0
 * runs here while the others run on threads of their own, and a part whose thread could not be started
 * runs here after. Returns 0, or -1 when the work buffers could not be allocated (nothing computed then). */
static int run_parts(const void *a, size_t size, int nthreads, i64 items, size_t per, void *(*fn)(void *)) {
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    per = (per + 63) / 64 * 64;
    char *work = NULL;
    if (posix_memalign((void **)&work, 64, per * nthreads)) return E_NOMEM;
    max_align_t store[(size * nthreads + sizeof(max_align_t) - 1) / sizeof(max_align_t)];
    char *parts = (char *)store;
    for (int k = 0; k < nthreads; k++) {
        Part *part = memcpy(parts + k * size, a, size);
        part->lo = items * k / nthreads;
        part->hi = items * (k + 1) / nthreads;
        part->th = k;
        part->work = work + per * k;
    }
    pthread_t tids[nthreads];
    int started[nthreads];
    for (int k = 1; k < nthreads; k++) started[k] = pthread_create(&tids[k], NULL, fn, parts + k * size) == 0;
    fn(parts);
    for (int k = 1; k < nthreads; k++) {
        if (started[k])
            pthread_join(tids[k], NULL);
        else
            fn(parts + k * size); /* no thread to be had: run its range here */
    }
    free(work);
    return 0;
}

/* Element strides of a tensor indexed by (batch b, channel d, group g, step t). Per-step (batch, dim, L)
 * tensors use b, d, t (g = 0); B/C use b, g, t (d = 0; n is contiguous); the per-thread gradient
 * accumulators of B/C (pB, pC) use d for the thread stride. */
typedef struct {
    i64 b, d, g, t;
} Strides;

INLINE i64 at(Strides s, i64 b, i64 d, i64 t) { return b * s.b + d * s.d + t * s.t; }

/* The arguments of scan_fwd_* and scan_bwd_*, mirrored field by field by memfit.ops.cpu_kernel.ScanArgs
 * (scan_abi() lets it check the layout). Data pointers are REAL (fp32 or fp64 by the function's suffix),
 * or bf16 where bfm says so; NULL marks an absent optional tensor.
 *   forward reads delta, bias, u, z, D, A2, B, C and writes y, starts, last;
 *   backward reads delta, bias, u, z, D, A2, A, B, C, starts, dlast, dout and writes du, ddelta, dz and
 *   accumulates into dA (threads, dim, N), dD, dbias (threads, dim) and dB / dC (strides pB / pC),
 *   zeroed by the caller. */
typedef struct {
    i64 batch, dim, L, N;
    i64 T;        /* chunk length: the forward saves the state entering every chunk but the first */
    i64 softplus; /* 1: dt = softplus(delta + bias) */
    i64 lanes;    /* 1: the channel-lane path (B/C broadcast over blocks of V channels), 0: the sequence path */
    i64 bfm;      /* BF_* bits (lane path only) */
    i64 nthreads;
    i64 gsB, gsC; /* channels per group of B / C (dim for per-step, 1 for shared (dim, N)) */
    const void *delta, *bias, *u, *z, *D, *A2, *A, *B, *C, *dlast, *dout;
    void *y, *starts, *last, *du, *ddelta, *dz, *dA, *dB, *dC, *dD, *dbias;
    Strides sdl, su, sz, sy, sdo, sdu, sdd, sdz, sB, sC, pB, pC;
} ScanArgs;

/* The arguments of conv_fwd_* and conv_bwd_*, mirrored by memfit.ops.cpu_kernel.ConvArgs. x[b, t, d] at
 * b * sx_b + t * sx_t + d; w (K, dim) contiguous (the conv's (dim, 1, K) transposed); bias (dim) or NULL;
 * forward writes u (batch, L, dim) contiguous, u[t, d] = silu(bias[d] + sum_k w[k, d] x[t - K + 1 + k, d])
 * (x is zero before t = 0); backward reads gu (batch, L, dim) contiguous, writes gx (batch, L, dim)
 * contiguous and accumulates into gw (threads, K, dim) and gb (threads, dim) or NULL, zeroed by the
 * caller. Backward recomputes the pre-activation. */
typedef struct {
    i64 batch, L, dim, K, sx_b, sx_t, nthreads;
    const void *x, *w, *bias, *gu;
    void *u, *gx, *gw, *gb;
} ConvArgs;

/* The whole boundary, by name: each struct's size, every field's offset, NMAX, the BF_* bits and the error
 * codes. memfit.ops.cpu_kernel builds the same table from its ctypes mirrors and refuses to call a kernel
 * unless the two are equal, entry for entry (two swapped pointer fields would otherwise pass). */
typedef struct {
    const char *name;
    i64 value;
} AbiEntry;
#define OFF(S, f) {#S "." #f, (i64)offsetof(S, f)}
static const AbiEntry ABI[] = {
    {"sizeof ScanArgs", sizeof(ScanArgs)},
    OFF(ScanArgs, batch),
    OFF(ScanArgs, dim),
    OFF(ScanArgs, L),
    OFF(ScanArgs, N),
    OFF(ScanArgs, T),
    OFF(ScanArgs, softplus),
    OFF(ScanArgs, lanes),
    OFF(ScanArgs, bfm),
    OFF(ScanArgs, nthreads),
    OFF(ScanArgs, gsB),
    OFF(ScanArgs, gsC),
    OFF(ScanArgs, delta),
    OFF(ScanArgs, bias),
    OFF(ScanArgs, u),
    OFF(ScanArgs, z),
    OFF(ScanArgs, D),
    OFF(ScanArgs, A2),
    OFF(ScanArgs, A),
    OFF(ScanArgs, B),
    OFF(ScanArgs, C),
    OFF(ScanArgs, dlast),
    OFF(ScanArgs, dout),
    OFF(ScanArgs, y),
    OFF(ScanArgs, starts),
    OFF(ScanArgs, last),
    OFF(ScanArgs, du),
    OFF(ScanArgs, ddelta),
    OFF(ScanArgs, dz),
    OFF(ScanArgs, dA),
    OFF(ScanArgs, dB),
    OFF(ScanArgs, dC),
    OFF(ScanArgs, dD),
    OFF(ScanArgs, dbias),
    OFF(ScanArgs, sdl),
    OFF(ScanArgs, su),
    OFF(ScanArgs, sz),
    OFF(ScanArgs, sy),
    OFF(ScanArgs, sdo),
    OFF(ScanArgs, sdu),
    OFF(ScanArgs, sdd),
    OFF(ScanArgs, sdz),
    OFF(ScanArgs, sB),
    OFF(ScanArgs, sC),
    OFF(ScanArgs, pB),
    OFF(ScanArgs, pC),
    {"sizeof ConvArgs", sizeof(ConvArgs)},
    OFF(ConvArgs, batch),
    OFF(ConvArgs, L),
    OFF(ConvArgs, dim),
    OFF(ConvArgs, K),
    OFF(ConvArgs, sx_b),
    OFF(ConvArgs, sx_t),
    OFF(ConvArgs, nthreads),
    OFF(ConvArgs, x),
    OFF(ConvArgs, w),
    OFF(ConvArgs, bias),
    OFF(ConvArgs, gu),
    OFF(ConvArgs, u),
    OFF(ConvArgs, gx),
    OFF(ConvArgs, gw),
    OFF(ConvArgs, gb),
    {"sizeof Strides", sizeof(Strides)},
    OFF(Strides, b),
    OFF(Strides, d),
    OFF(Strides, g),
    OFF(Strides, t),
    {"NMAX", NMAX},
    {"BF_U", BF_U},
    {"BF_DELTA", BF_DELTA},
    {"BF_Z", BF_Z},
    {"BF_DOUT", BF_DOUT},
    {"BF_Y", BF_Y},
    {"BF_DU", BF_DU},
    {"BF_DDELTA", BF_DDELTA},
    {"BF_DZ", BF_DZ},
    {"E_NOMEM", E_NOMEM},
    {"E_STATE", E_STATE},
};
#undef OFF

i64 abi_count(void) { return (i64)(sizeof ABI / sizeof ABI[0]); }
const char *abi_name(i64 i) { return ABI[i].name; }
i64 abi_value(i64 i) { return ABI[i].value; }

#define REAL float
#define SFX f32
#define VEC vf32
#define V LANES32
#define SPECIALIZE 1
#include "cpu_kernel_body.h"
#undef REAL
#undef SFX
#undef VEC
#undef V
#undef SPECIALIZE

/* fp64 runs the tests' exactness checks: its speed does not matter, so no specialised copies */
#define REAL double
#define SFX f64
#define VEC vf64
#define V LANES64
#define SPECIALIZE 0
#include "cpu_kernel_body.h"
