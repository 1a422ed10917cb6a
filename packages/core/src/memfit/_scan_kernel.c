/* Mamba-1's CPU kernels, fused: the selective scan (memfit.ssm.selective_scan) and, at the end of the
 * file, the block's depthwise causal conv1d + SiLU (memfit.mamba). memfit/_scan_kernel.py compiles this
 * file on first use and memfit.ssm falls back to its torch-op path when there is no C compiler.
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
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#define NMAX 64 /* largest state size N the kernel takes (memfit.ssm checks) */

/* fp32 lanes: 2^x as 2^k * 2^f, k = round(x), |f| <= 1/2, 2^f by its degree-7 Taylor polynomial in
 * f*ln2 (relative error < 1e-8 before rounding). Branch-free, so loops over N or over a chunk vectorise. */
static inline float exp2_f32(float x) {
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

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp2_f32(-1.4426950408889634f * x)); }

/* softplus(x) = max(x, 0) + log1p(y), y = exp(-|x|) in (0, 1]; log1p(y) = 2 atanh(s), s = y / (2 + y)
 * <= 1/3, by its series to s^15 (relative error < 2e-8). */
static inline float softplus_f32(float x) {
    float y = exp2_f32(-1.4426950408889634f * fabsf(x));
    float s = y / (2.0f + y), q = s * s;
    float p = 1.0f + q * (1.0f / 3 + q * (1.0f / 5 + q * (1.0f / 7 + q * (1.0f / 9 + q * (1.0f / 11 +
              q * (1.0f / 13 + q * (1.0f / 15)))))));
    return (x > 0 ? x : 0.0f) + 2.0f * s * p;
}

/* fp64 (tests, exactness): libm, and A2 holds A itself; softplus with torch's threshold of 20. */
static inline double exp2_f64(double x) { return exp(x); }
static inline double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }
static inline double softplus_f64(double x) { return x > 20.0 ? x : log1p(exp(x)); }

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

static inline vf32 vsel_f32(vi32 m, vf32 a, vf32 b) { return (vf32)((m & (vi32)a) | (~m & (vi32)b)); }

#ifdef __AVX512F__
#include <immintrin.h>
/* exp2_f32 on 16 lanes with AVX-512: the same clamp, reduction and polynomial; k = round(x) by
 * vrndscaleps and 2^k applied by vscalefps (no integer round trip: 12 instructions instead of ~18) */
static inline vf32 vexp2_f32(vf32 x) {
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
static inline vf32 vexp2_f32(vf32 x) {
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

static inline vf32 vsigmoid_f32(vf32 x) { return 1.0f / (1.0f + vexp2_f32(-1.4426950408889634f * x)); }

/* softplus(x) = max(x, 0) + log1p(y), as softplus_f32, with y = exp(-|x|) into *y */
static inline vf32 vsoftplus_y_f32(vf32 x, vf32 *y_out) {
    const vf32 ax = (vf32)((vi32)x & 0x7fffffff);
    const vf32 y = vexp2_f32(-1.4426950408889634f * ax);
    const vf32 s = y / (2.0f + y), q = s * s;
    const vf32 p = 1.0f + q * (1.0f / 3 + q * (1.0f / 5 + q * (1.0f / 7 + q * (1.0f / 9 + q * (1.0f / 11 +
                   q * (1.0f / 13 + q * (1.0f / 15)))))));
    *y_out = y;
    return vsel_f32(x > 0.0f, x, (vf32){0}) + 2.0f * s * p;
}

static inline vf32 vsoftplus_f32(vf32 x) {
    vf32 y;
    return vsoftplus_y_f32(x, &y);
}

/* softplus(x) and, into *sg, sigmoid(x) = (x > 0 ? 1 : y) / (1 + y) from the same y = exp(-|x|) */
static inline vf32 vsoftplus_sig_f32(vf32 x, vf32 *sg) {
    vf32 y;
    const vf32 sp = vsoftplus_y_f32(x, &y);
    *sg = vsel_f32(x > 0.0f, (vf32){0} + 1.0f, y) / (1.0f + y);
    return sp;
}

/* fp64 lanes: libm per lane (tests, exactness; speed does not matter there) */
static inline vf64 vexp2_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = exp(x[l]);
    return x;
}
static inline vf64 vsigmoid_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = sigmoid_f64(x[l]);
    return x;
}
static inline vf64 vsoftplus_f64(vf64 x) {
    for (int l = 0; l < LANES64; l++) x[l] = softplus_f64(x[l]);
    return x;
}
static inline vf64 vsoftplus_sig_f64(vf64 x, vf64 *sg) {
    *sg = vsigmoid_f64(x);
    return vsoftplus_f64(x);
}

/* lanes the channel-lane path runs in (memfit.ssm checks that groups of B/C hold whole blocks) */
int scan_lanes_f32(void) { return LANES32; }
int scan_lanes_f64(void) { return LANES64; }

/* out[r] = the sum over the lanes of row r of P (R rows); out may be P itself (it is written behind
 * what has been read). With 16 lanes, 16 rows at a time by a transposing tree of shuffles and adds
 * (rows taken in bit-reversed order so that lane i ends up holding row i). */
#if defined(__has_builtin) /* __builtin_shufflevector: GCC >= 12, clang; others sum lane by lane */
#if __has_builtin(__builtin_shufflevector) && LANES32 == 16
#define LANE_TREE16 1
#endif
#endif
#ifdef LANE_TREE16
static inline vf32 tree16_f32(const vf32 *r) {
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

typedef struct {
    i64 b, d, g, t;
} Strides;

/* bf16 per-step tensors on the lane path (autocast): read widened to fp32, written rounded to nearest
 * even as torch's .to(torch.bfloat16) (NaN stays NaN). Bits of Args.bfm say which tensors are bf16. */
enum { BF_U = 1, BF_DELTA = 2, BF_Z = 4, BF_DOUT = 8, BF_Y = 16, BF_DU = 32, BF_DDELTA = 64, BF_DZ = 128 };
/* what a Mamba block passes under bf16 autocast (compiled as constants: runtime bits slowed the loop) */
#define BF_AUTOCAST_FWD (BF_U | BF_DELTA | BF_Z | BF_Y)
#define BF_AUTOCAST_BWD (BF_U | BF_DELTA | BF_Z | BF_DOUT | BF_DU | BF_DDELTA | BF_DZ)

static inline float bf16_f32(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)((b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : rounded);
}

/* a whole lane vector of bf16 from / to p (contiguous) */
static inline vf32 vload_bf16_f32(const uint16_t *p) {
#if defined(__AVX512F__) && LANES32 == 16
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf32)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    vf32 v;
    for (int l = 0; l < LANES32; l++) v[l] = bf16_f32(p[l]);
    return v;
#endif
}

static inline void vstore_bf16_f32(uint16_t *p, vf32 v) {
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

static inline vf64 vload_bf16_f64(const uint16_t *p) {
    vf64 v;
    for (int l = 0; l < LANES64; l++) v[l] = bf16_f32(p[l]);
    return v;
}

static inline void vstore_bf16_f64(uint16_t *p, vf64 v) {
    for (int l = 0; l < LANES64; l++) p[l] = f32_bf16((float)v[l]);
}

#define AT(P_, S_, B_, D_, T_) (P_)[(B_) * (S_).b + (D_) * (S_).d + (T_) * (S_).t]

#define DEFINE_SCAN(REAL, SFX, EXP, SIGMOID, SOFTPLUS, VEC, V, VEXP, VSIGMOID, VSOFTPLUS, VSOFTPLUS_SIG) \
    typedef struct {                                                                                      \
        i64 batch, dim, L, N, T, lo, hi, th, softplus, nblk; /* nblk: channel blocks (lane path) */       \
        const REAL *delta, *bias, *u, *z, *D, *A2, *A, *B, *C, *dlast, *dout;                             \
        Strides sdl, su, sz, sB, sC, sy, sdo, sdu, sdd, sdz, pB, pC;                                      \
        i64 gsB, gsC;                                                                                     \
        REAL *y, *starts, *last, *du, *ddelta, *dz, *dA, *dB, *dC, *dD, *dbias;                           \
        REAL *work; /* this thread's: 10 chunk arrays of T, then (T + 1) * N states, T * N decays */      \
        int bfm;    /* BF_* bits: which per-step tensors are bf16 (lane path only) */                     \
    } Args_##SFX;                                                                                         \
                                                                                                          \
    /* dt (and raw = delta + bias) and u of steps s..e of item (b, d) into chunk arrays */                \
    static inline void gather_##SFX(const Args_##SFX *a, i64 b, i64 d, i64 s, i64 k, REAL *raw,           \
                                    REAL *dt, REAL *u) {                                                  \
        const REAL bias = a->bias ? a->bias[d] : 0;                                                       \
        for (i64 j = 0; j < k; j++) {                                                                     \
            raw[j] = AT(a->delta, a->sdl, b, d, s + j) + bias;                                            \
            u[j] = AT(a->u, a->su, b, d, s + j);                                                          \
        }                                                                                                 \
        if (a->softplus)                                                                                  \
            for (i64 j = 0; j < k; j++) dt[j] = SOFTPLUS(raw[j]);                                         \
        else                                                                                              \
            for (i64 j = 0; j < k; j++) dt[j] = raw[j];                                                   \
    }                                                                                                     \
                                                                                                          \
    static inline __attribute__((always_inline)) void fwd_item_##SFX(const Args_##SFX *a, i64 item,       \
                                                                      const i64 N) {                      \
        const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T;                               \
        const i64 nch = (L + T - 1) / T;                                                                  \
        const REAL *A2 = a->A2 + d * N, Dd = a->D ? a->D[d] : 0;                                          \
        const REAL *Bp = a->B + b * a->sB.b + (d / a->gsB) * a->sB.g;                                     \
        const REAL *Cp = a->C + b * a->sC.b + (d / a->gsC) * a->sC.g;                                     \
        REAL *raw = a->work, *dt = raw + T, *u = dt + T, *y = u + T, *zc = y + T;                         \
        REAL h[NMAX];                                                                                     \
        for (i64 n = 0; n < N; n++) h[n] = 0;                                                             \
        for (i64 c = 0; c < nch; c++) {                                                                   \
            const i64 s = c * T, k = (s + T < L ? s + T : L) - s;                                         \
            if (c > 0) {                                                                                  \
                REAL *st = a->starts + ((b * (nch - 1) + c - 1) * a->dim + d) * N;                        \
                for (i64 n = 0; n < N; n++) st[n] = h[n];                                                 \
            }                                                                                             \
            gather_##SFX(a, b, d, s, k, raw, dt, u);                                                      \
            for (i64 j = 0; j < k; j++) {                                                                 \
                const REAL x = dt[j] * u[j];                                                              \
                const REAL *Bt = Bp + (s + j) * a->sB.t, *Ct = Cp + (s + j) * a->sC.t;                    \
                REAL acc = 0;                                                                             \
                _Pragma("omp simd reduction(+ : acc)")                                                    \
                for (i64 n = 0; n < N; n++) {                                                             \
                    h[n] = EXP(dt[j] * A2[n]) * h[n] + x * Bt[n];                                         \
                    acc += Ct[n] * h[n];                                                                  \
                }                                                                                         \
                y[j] = acc + Dd * u[j];                                                                   \
            }                                                                                             \
            if (a->z) {                                                                                   \
                for (i64 j = 0; j < k; j++) zc[j] = AT(a->z, a->sz, b, d, s + j);                         \
                for (i64 j = 0; j < k; j++) y[j] *= zc[j] * SIGMOID(zc[j]);                               \
            }                                                                                             \
            for (i64 j = 0; j < k; j++) AT(a->y, a->sy, b, d, s + j) = y[j];                              \
        }                                                                                                 \
        REAL *last = a->last + (b * a->dim + d) * N;                                                      \
        for (i64 n = 0; n < N; n++) last[n] = h[n];                                                       \
    }                                                                                                     \
                                                                                                          \
    static inline __attribute__((always_inline)) void bwd_item_##SFX(const Args_##SFX *a, i64 item,       \
                                                                      const i64 N) {                      \
        const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T, th = a->th;                   \
        const i64 nch = (L + T - 1) / T;                                                                  \
        const REAL *A2 = a->A2 + d * N, *Ar = a->A + d * N, Dd = a->D ? a->D[d] : 0;                      \
        const i64 gB = d / a->gsB, gC = d / a->gsC;                                                       \
        const REAL *Bp = a->B + b * a->sB.b + gB * a->sB.g;                                               \
        const REAL *Cp = a->C + b * a->sC.b + gC * a->sC.g;                                               \
        REAL *dBp = a->dB + th * a->pB.d + b * a->pB.b + gB * a->pB.g;                                    \
        REAL *dCp = a->dC + th * a->pC.d + b * a->pC.b + gC * a->pC.g;                                    \
        REAL *raw = a->work, *dt = raw + T, *u = dt + T, *yp = u + T, *zc = yp + T, *dy = zc + T;         \
        REAL *du = dy + T, *dd = du + T, *dz = dd + T, *go = dz + T;                                      \
        REAL *Hb = go + T, *Ab = Hb + (T + 1) * N;                                                        \
        REAL g[NMAX], dAl[NMAX], hv[NMAX], av[NMAX], dDl = 0, dbl = 0;                                    \
        for (i64 n = 0; n < N; n++) {                                                                     \
            g[n] = a->dlast ? a->dlast[(b * a->dim + d) * N + n] : 0;                                     \
            dAl[n] = 0;                                                                                   \
        }                                                                                                 \
        for (i64 c = nch - 1; c >= 0; c--) {                                                              \
            const i64 s = c * T, k = (s + T < L ? s + T : L) - s;                                         \
            gather_##SFX(a, b, d, s, k, raw, dt, u);                                                      \
            for (i64 j = 0; j < k; j++) go[j] = a->dout ? AT(a->dout, a->sdo, b, d, s + j) : 0;           \
            /* recompute: Hb row j + 1 = state after step s + j, Ab row j = its decay, Hb row 0 = the     \
             * state entering the chunk */                                                                \
            if (c == 0)                                                                                   \
                for (i64 n = 0; n < N; n++) hv[n] = 0;                                                    \
            else                                                                                          \
                memcpy(hv, a->starts + ((b * (nch - 1) + c - 1) * a->dim + d) * N, N * sizeof(REAL));     \
            memcpy(Hb, hv, N * sizeof(REAL));                                                             \
            for (i64 j = 0; j < k; j++) {                                                                 \
                const REAL x = dt[j] * u[j];                                                              \
                const REAL *Bt = Bp + (s + j) * a->sB.t, *Ct = Cp + (s + j) * a->sC.t;                    \
                REAL acc = 0;                                                                             \
                _Pragma("omp simd reduction(+ : acc)")                                                    \
                for (i64 n = 0; n < N; n++) {                                                             \
                    av[n] = EXP(dt[j] * A2[n]);                                                           \
                    hv[n] = av[n] * hv[n] + x * Bt[n];                                                    \
                    acc += Ct[n] * hv[n];                                                                 \
                }                                                                                         \
                memcpy(Hb + (j + 1) * N, hv, N * sizeof(REAL));                                           \
                memcpy(Ab + j * N, av, N * sizeof(REAL));                                                 \
                yp[j] = acc + Dd * u[j];                                                                  \
            }                                                                                             \
            /* the gate: dy = d loss / d (C.h + D u), dz */                                               \
            if (a->z) {                                                                                   \
                for (i64 j = 0; j < k; j++) zc[j] = AT(a->z, a->sz, b, d, s + j);                         \
                for (i64 j = 0; j < k; j++) {                                                             \
                    const REAL sg = SIGMOID(zc[j]);                                                       \
                    dy[j] = go[j] * zc[j] * sg;                                                           \
                    dz[j] = go[j] * yp[j] * sg * (1 + zc[j] * (1 - sg));                                  \
                }                                                                                         \
                for (i64 j = 0; j < k; j++) AT(a->dz, a->sdz, b, d, s + j) = dz[j];                       \
            } else {                                                                                      \
                for (i64 j = 0; j < k; j++) dy[j] = go[j];                                                \
            }                                                                                             \
            for (i64 j = 0; j < k; j++) {                                                                 \
                dDl += dy[j] * u[j];                                                                      \
                du[j] = dy[j] * Dd;                                                                       \
            }                                                                                             \
            /* state gradients, backwards: g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1} */                    \
            for (i64 j = k - 1; j >= 0; j--) {                                                            \
                const REAL x = dt[j] * u[j], dyj = dy[j], dtj = dt[j];                                    \
                const REAL *restrict Bt = Bp + (s + j) * a->sB.t, *restrict Ct = Cp + (s + j) * a->sC.t;  \
                REAL *restrict dBt = dBp + (s + j) * a->pB.t, *restrict dCt = dCp + (s + j) * a->pC.t;    \
                const REAL *restrict hp = Hb + j * N, *restrict hn = Hb + (j + 1) * N;                    \
                const REAL *restrict an = Ab + j * N;                                                     \
                REAL W = 0, ddt = 0;                                                                      \
                _Pragma("omp simd reduction(+ : W, ddt)")                                                 \
                for (i64 n = 0; n < N; n++) {                                                             \
                    const REAL gn = g[n] + dyj * Ct[n];                                                   \
                    dCt[n] += dyj * hn[n];                                                                \
                    dBt[n] += gn * x;                                                                     \
                    W += gn * Bt[n];                                                                      \
                    const REAL p = gn * an[n] * hp[n]; /* gradient of dt * A */                           \
                    ddt += p * Ar[n];                                                                     \
                    dAl[n] += p * dtj;                                                                    \
                    g[n] = gn * an[n];                                                                    \
                }                                                                                         \
                du[j] += W * dt[j];                                                                       \
                dd[j] = W * u[j] + ddt;                                                                   \
            }                                                                                             \
            if (a->softplus)                                                                              \
                for (i64 j = 0; j < k; j++) dd[j] *= SIGMOID(raw[j]);                                     \
            for (i64 j = 0; j < k; j++) {                                                                 \
                dbl += dd[j];                                                                             \
                AT(a->du, a->sdu, b, d, s + j) = du[j];                                                   \
                AT(a->ddelta, a->sdd, b, d, s + j) = dd[j];                                               \
            }                                                                                             \
        }                                                                                                 \
        REAL *dA = a->dA + (th * a->dim + d) * N;                                                         \
        for (i64 n = 0; n < N; n++) dA[n] += dAl[n];                                                      \
        if (a->dD) a->dD[th * a->dim + d] += dDl;                                                         \
        if (a->dbias) a->dbias[th * a->dim + d] += dbl;                                                   \
    }                                                                                                     \
                                                                                                          \
    static void *fwd_range_##SFX(void *p) {                                                               \
        const Args_##SFX *a = p;                                                                          \
        if (a->N == 16)                                                                                   \
            for (i64 i = a->lo; i < a->hi; i++) fwd_item_##SFX(a, i, 16);                                 \
        else                                                                                              \
            for (i64 i = a->lo; i < a->hi; i++) fwd_item_##SFX(a, i, a->N);                               \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
    static void *bwd_range_##SFX(void *p) {                                                               \
        const Args_##SFX *a = p;                                                                          \
        if (a->N == 16)                                                                                   \
            for (i64 i = a->lo; i < a->hi; i++) bwd_item_##SFX(a, i, 16);                                 \
        else                                                                                              \
            for (i64 i = a->lo; i < a->hi; i++) bwd_item_##SFX(a, i, a->N);                               \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
    /* ---- channel-lane path: a work item is (b, a block of V consecutive channels), the lanes of VEC;   \
     * the state is N vectors of V lanes (one per state entry) and every step is N independent lane       \
     * recurrences, no sums over N. Needs B/C broadcast over the block (per step, or groups holding whole  \
     * blocks: the caller checks). Lanes past dim (the last block's tail) run on zeros, which keeps every  \
     * value they make finite and every gradient they add zero. */                                        \
    typedef REAL VEC##_unaligned __attribute__((vector_size(sizeof(VEC)), aligned(sizeof(REAL))));        \
                                                                                                          \
    static inline VEC lgather_##SFX(const REAL *p, i64 stride, int nl) {                                  \
        VEC v = {0};                                                                                      \
        if (nl == V && stride == 1) return *(const VEC##_unaligned *)p;                                   \
        for (int l = 0; l < nl; l++) v[l] = p[l * stride];                                                \
        return v;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    static inline void lscatter_##SFX(REAL *p, i64 stride, int nl, VEC v) {                               \
        if (nl == V && stride == 1) {                                                                     \
            *(VEC##_unaligned *)p = v;                                                                    \
            return;                                                                                       \
        }                                                                                                 \
        for (int l = 0; l < nl; l++) p[l * stride] = v[l];                                                \
    }                                                                                                     \
                                                                                                          \
    /* per-step tensor P at (b, d0.., t) as lanes, and back; bf: P holds bf16 */                          \
    static inline VEC lat_##SFX(const REAL *P, Strides S, i64 b, i64 d0, i64 t, int nl, int bf) {         \
        const i64 o = b * S.b + d0 * S.d + t * S.t;                                                       \
        if (!bf) return lgather_##SFX(P + o, S.d, nl);                                                    \
        const uint16_t *p = (const uint16_t *)(const void *)P + o;                                        \
        VEC v = {0};                                                                                      \
        if (nl == V && S.d == 1) return vload_bf16_##SFX(p);                                              \
        for (int l = 0; l < nl; l++) v[l] = bf16_f32(p[l * S.d]);                                         \
        return v;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    static inline void lst_##SFX(REAL *P, Strides S, i64 b, i64 d0, i64 t, int nl, VEC v, int bf) {       \
        const i64 o = b * S.b + d0 * S.d + t * S.t;                                                       \
        if (!bf) {                                                                                        \
            lscatter_##SFX(P + o, S.d, nl, v);                                                            \
            return;                                                                                       \
        }                                                                                                 \
        uint16_t *p = (uint16_t *)(void *)P + o;                                                          \
        if (nl == V && S.d == 1) {                                                                        \
            vstore_bf16_##SFX(p, v);                                                                      \
            return;                                                                                       \
        }                                                                                                 \
        for (int l = 0; l < nl; l++) p[l * S.d] = f32_bf16((float)v[l]);                                  \
    }                                                                                                     \
                                                                                                          \
    static inline __attribute__((always_inline)) void lfwd_item_##SFX(const Args_##SFX *a_, i64 item,     \
                                                                       const i64 N, const int bfm) {      \
        const Args_##SFX args = *a_, *a = &args; /* a local copy: stores through the data pointers cannot \
                                                    change it, so its fields stay in registers */         \
        const i64 nb = a->nblk, b = item / nb, d0 = (item % nb) * V, L = a->L, T = a->T, dim = a->dim;    \
        const int nl = (int)(dim - d0 < V ? dim - d0 : V);                                                \
        const i64 nch = (L + T - 1) / T;                                                                  \
        const REAL *Bp = a->B + b * a->sB.b + (d0 / a->gsB) * a->sB.g;                                    \
        const REAL *Cp = a->C + b * a->sC.b + (d0 / a->gsC) * a->sC.g;                                    \
        const VEC bias = a->bias ? lgather_##SFX(a->bias + d0, 1, nl) : (VEC){0};                         \
        const VEC Dv = a->D ? lgather_##SFX(a->D + d0, 1, nl) : (VEC){0};                                 \
        VEC A2v[NMAX], h[NMAX];                                                                           \
        for (i64 n = 0; n < N; n++) {                                                                     \
            A2v[n] = ((const VEC *)a->work)[(item % nb) * N + n]; /* lfwd_range's lane copy of A2 */      \
            h[n] = (VEC){0};                                                                              \
        }                                                                                                 \
        for (i64 t = 0; t < L; t++) {                                                                     \
            if (t > 0 && t % T == 0) {                                                                    \
                REAL *st = a->starts + ((b * (nch - 1) + t / T - 1) * dim + d0) * N;                      \
                for (i64 n = 0; n < N; n++) lscatter_##SFX(st + n, N, nl, h[n]);                          \
            }                                                                                             \
            const VEC raw = lat_##SFX(a->delta, a->sdl, b, d0, t, nl, bfm & BF_DELTA) + bias;                             \
            const VEC dt = a->softplus ? VSOFTPLUS(raw) : raw;                                            \
            const VEC uu = lat_##SFX(a->u, a->su, b, d0, t, nl, bfm & BF_U);                                          \
            const VEC x = dt * uu;                                                                        \
            const REAL *Bt = Bp + t * a->sB.t, *Ct = Cp + t * a->sC.t;                                    \
            VEC acc0 = Dv * uu, acc1 = {0};                                                               \
            _Pragma("GCC unroll 16") for (i64 n = 0; n < N; n++) {                                        \
                h[n] = VEXP(dt * A2v[n]) * h[n] + x * Bt[n];                                              \
                if (n & 1)                                                                                \
                    acc1 += Ct[n] * h[n];                                                                 \
                else                                                                                      \
                    acc0 += Ct[n] * h[n];                                                                 \
            }                                                                                             \
            VEC y = acc0 + acc1;                                                                          \
            if (a->z) {                                                                                   \
                const VEC zz = lat_##SFX(a->z, a->sz, b, d0, t, nl, bfm & BF_Z);                                      \
                y *= zz * VSIGMOID(zz);                                                                   \
            }                                                                                             \
            lst_##SFX(a->y, a->sy, b, d0, t, nl, y, bfm & BF_Y);                                                      \
        }                                                                                                 \
        REAL *last = a->last + (b * dim + d0) * N;                                                        \
        for (i64 n = 0; n < N; n++) lscatter_##SFX(last + n, N, nl, h[n]);                                \
    }                                                                                                     \
                                                                                                          \
    /* Backward of blocks j0..j1 of batch row b (one thread's), chunk by chunk from the end; within a     \
     * chunk block by block, each block recomputing its chunk's states into Hb / decays into Ab, then     \
     * walking back. The sums over channels that dB_t and dC_t need are kept per lane in P (k steps x 2N  \
     * lane vectors, added to by every block) and reduced over lanes once per chunk. G holds each block's \
     * state gradient between chunks. */                                                                  \
    static inline __attribute__((always_inline)) void lbwd_seg_##SFX(const Args_##SFX *a_, i64 b, i64 j0, \
                                                                      i64 j1, const i64 N, const int bfm) { \
        const Args_##SFX args = *a_, *a = &args; /* a local copy, as in lfwd_item */                      \
        const i64 L = a->L, T = a->T, th = a->th, dim = a->dim;                                           \
        const i64 nch = (L + T - 1) / T;                                                                  \
        const i64 gB = j0 * V / a->gsB, gC = j0 * V / a->gsC;                                             \
        const REAL *Bp = a->B + b * a->sB.b + gB * a->sB.g;                                               \
        const REAL *Cp = a->C + b * a->sC.b + gC * a->sC.g;                                               \
        REAL *dBp = a->dB + th * a->pB.d + b * a->pB.b + gB * a->pB.g;                                    \
        REAL *dCp = a->dC + th * a->pC.d + b * a->pC.b + gC * a->pC.g;                                    \
        /* lbwd_range's lane copies of A2 and A and its dA accumulators (nblk x N lane vectors each), then \
         * this segment's buffers */                                                                      \
        VEC *A2T = (VEC *)a->work, *AT = A2T + a->nblk * N, *dAT = AT + a->nblk * N;                      \
        VEC *Hb = dAT + a->nblk * N, *Ab = Hb + (T + 1) * N, *P = Ab + T * N, *G = P + 2 * T * N;         \
        VEC *sgv = G + (j1 - j0) * N, *dtv = sgv + T, *uv = dtv + T, *yp = uv + T; /* per step */         \
        for (i64 j = j0; j < j1; j++) {                                                                   \
            const i64 d0 = j * V;                                                                         \
            const int nl = (int)(dim - d0 < V ? dim - d0 : V);                                            \
            for (i64 n = 0; n < N; n++)                                                                   \
                G[(j - j0) * N + n] =                                                                     \
                    a->dlast ? lgather_##SFX(a->dlast + (b * dim + d0) * N + n, N, nl) : (VEC){0};        \
        }                                                                                                 \
        for (i64 c = nch - 1; c >= 0; c--) {                                                              \
            const i64 s = c * T, k = (s + T < L ? s + T : L) - s;                                         \
            memset(P, 0, sizeof(VEC) * 2 * N * k);                                                        \
            for (i64 j = j0; j < j1; j++) {                                                               \
                const i64 d0 = j * V;                                                                     \
                const int nl = (int)(dim - d0 < V ? dim - d0 : V);                                        \
                const VEC bias = a->bias ? lgather_##SFX(a->bias + d0, 1, nl) : (VEC){0};                 \
                const VEC Dv = a->D ? lgather_##SFX(a->D + d0, 1, nl) : (VEC){0};                         \
                VEC A2v[NMAX], Arv[NMAX], hv[NMAX], g[NMAX], dAl[NMAX];                                   \
                for (i64 n = 0; n < N; n++) {                                                             \
                    A2v[n] = A2T[j * N + n];                                                              \
                    Arv[n] = AT[j * N + n];                                                               \
                    const i64 so = ((b * (nch - 1) + c - 1) * dim + d0) * N + n; /* its saved start */    \
                    hv[n] = c == 0 ? (VEC){0} : lgather_##SFX(a->starts + so, N, nl);                     \
                    Hb[n] = hv[n];                                                                        \
                }                                                                                         \
                /* recompute: Hb row i + 1 = state after step s + i, Ab row i = its decays */             \
                for (i64 i = 0; i < k; i++) {                                                             \
                    const VEC r = lat_##SFX(a->delta, a->sdl, b, d0, s + i, nl, bfm & BF_DELTA) + bias;                   \
                    VEC sg = {0}; /* sigmoid(r), the softplus' derivative */                              \
                    const VEC dt = a->softplus ? VSOFTPLUS_SIG(r, &sg) : r;                               \
                    const VEC uu = lat_##SFX(a->u, a->su, b, d0, s + i, nl, bfm & BF_U);                              \
                    const VEC x = dt * uu;                                                                \
                    const REAL *Bt = Bp + (s + i) * a->sB.t, *Ct = Cp + (s + i) * a->sC.t;                \
                    VEC acc0 = Dv * uu, acc1 = {0};                                                       \
                    _Pragma("GCC unroll 16") for (i64 n = 0; n < N; n++) {                                \
                        const VEC av = VEXP(dt * A2v[n]);                                                 \
                        hv[n] = av * hv[n] + x * Bt[n];                                                   \
                        Ab[i * N + n] = av;                                                               \
                        Hb[(i + 1) * N + n] = hv[n];                                                      \
                        if (n & 1)                                                                        \
                            acc1 += Ct[n] * hv[n];                                                        \
                        else                                                                              \
                            acc0 += Ct[n] * hv[n];                                                        \
                    }                                                                                     \
                    sgv[i] = sg, dtv[i] = dt, uv[i] = uu, yp[i] = acc0 + acc1;                            \
                }                                                                                         \
                VEC dDl = {0}, dbl = {0};                                                                 \
                for (i64 n = 0; n < N; n++) g[n] = G[(j - j0) * N + n], dAl[n] = (VEC){0};                \
                for (i64 i = k - 1; i >= 0; i--) {                                                        \
                    const VEC go = a->dout ? lat_##SFX(a->dout, a->sdo, b, d0, s + i, nl, bfm & BF_DOUT) : (VEC){0};     \
                    VEC dy = go;                                                                          \
                    if (a->z) {                                                                           \
                        const VEC zz = lat_##SFX(a->z, a->sz, b, d0, s + i, nl, bfm & BF_Z), sg = VSIGMOID(zz);       \
                        dy = go * zz * sg;                                                                \
                        const VEC one = (VEC){0} + 1;                                                     \
                        const VEC dzv = go * yp[i] * sg * (one + zz * (one - sg));                        \
                        lst_##SFX(a->dz, a->sdz, b, d0, s + i, nl, dzv, bfm & BF_DZ);                                  \
                    }                                                                                     \
                    const VEC uu = uv[i], dt = dtv[i], x = dt * uu;                                       \
                    dDl += dy * uu;                                                                       \
                    const REAL *Bt = Bp + (s + i) * a->sB.t, *Ct = Cp + (s + i) * a->sC.t;                \
                    VEC *Pi = P + i * 2 * N;                                                              \
                    const VEC *hn = Hb + (i + 1) * N, *hp = Hb + i * N, *an = Ab + i * N;                 \
                    VEC W = {0}, ddt = {0};                                                               \
                    _Pragma("GCC unroll 16") for (i64 n = 0; n < N; n++) {                                \
                        const VEC gn = g[n] + dy * Ct[n];                                                 \
                        Pi[n] += dy * hn[n];                                                              \
                        Pi[N + n] += gn * x;                                                              \
                        W += gn * Bt[n];                                                                  \
                        const VEC p = gn * an[n] * hp[n]; /* gradient of dt * A */                        \
                        ddt += p * Arv[n];                                                                \
                        dAl[n] += p * dt;                                                                 \
                        g[n] = gn * an[n];                                                                \
                    }                                                                                     \
                    VEC dd = W * uu + ddt;                                                                \
                    if (a->softplus) dd *= sgv[i];                                                        \
                    dbl += dd;                                                                            \
                    lst_##SFX(a->du, a->sdu, b, d0, s + i, nl, dy * Dv + W * dt, bfm & BF_DU);                         \
                    lst_##SFX(a->ddelta, a->sdd, b, d0, s + i, nl, dd, bfm & BF_DDELTA);                                   \
                }                                                                                         \
                for (i64 n = 0; n < N; n++) G[(j - j0) * N + n] = g[n];                                   \
                for (i64 n = 0; n < N; n++) dAT[j * N + n] += dAl[n];                                     \
                for (int l = 0; l < nl; l++) {                                                            \
                    if (a->dD) a->dD[th * dim + d0 + l] += dDl[l];                                        \
                    if (a->dbias) a->dbias[th * dim + d0 + l] += dbl[l];                                  \
                }                                                                                         \
            }                                                                                             \
            /* the chunk's dC_t[n] (P rows 0..N-1) and dB_t[n] (rows N..2N-1): sums over the lanes */     \
            REAL *Pr = (REAL *)P;                                                                         \
            lane_sums_##SFX(P, 2 * N * k, Pr);                                                            \
            for (i64 i = 0; i < k; i++) {                                                                 \
                REAL *dCt = dCp + (s + i) * a->pC.t, *dBt = dBp + (s + i) * a->pB.t;                      \
                for (i64 n = 0; n < N; n++) {                                                             \
                    dCt[n] += Pr[i * 2 * N + n];                                                          \
                    dBt[n] += Pr[i * 2 * N + N + n];                                                      \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* X (dim, N) as nblk x N lane vectors: out[j * N + n] lane l = X[j * V + l, n] (zeros past dim) */   \
    static void lanes_of_##SFX(const Args_##SFX *a, const REAL *X, VEC *out) {                            \
        const i64 N = a->N;                                                                               \
        for (i64 j = 0; j < a->nblk; j++) {                                                               \
            const int nl = (int)(a->dim - j * V < V ? a->dim - j * V : V);                                \
            for (i64 n = 0; n < N; n++) out[j * N + n] = lgather_##SFX(X + j * V * N + n, N, nl);         \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    static void *lfwd_range_##SFX(void *p) {                                                              \
        const Args_##SFX *a = p;                                                                          \
        lanes_of_##SFX(a, a->A2, (VEC *)a->work);                                                         \
        /* N and "no bf16" as constants where it matters: the compiler then drops the bf16 branches */    \
        if (a->N == 16 && !a->bfm)                                                                        \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, 16, 0);                             \
        else if (a->N == 8 && !a->bfm)                                                                    \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, 8, 0);                              \
        else if (a->N == 16 && a->bfm == BF_AUTOCAST_FWD) /* a Mamba block under bf16 autocast */       \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, 16, BF_AUTOCAST_FWD);               \
        else if (a->N == 16)                                                                              \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, 16, a->bfm);                        \
        else if (a->N == 8)                                                                               \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, 8, a->bfm);                         \
        else                                                                                              \
            for (i64 i = a->lo; i < a->hi; i++) lfwd_item_##SFX(a, i, a->N, a->bfm);                      \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
    static void *lbwd_range_##SFX(void *p) {                                                              \
        const Args_##SFX *a = p;                                                                          \
        const i64 N = a->N, dim = a->dim;                                                                 \
        VEC *A2T = (VEC *)a->work, *AT = A2T + a->nblk * N, *dAT = AT + a->nblk * N;                      \
        lanes_of_##SFX(a, a->A2, A2T);                                                                    \
        lanes_of_##SFX(a, a->A, AT);                                                                      \
        memset(dAT, 0, sizeof(VEC) * a->nblk * N);                                                        \
        /* blocks per group of B and of C (a group holds whole blocks) */                                 \
        const i64 gb = a->gsB >= a->dim ? a->nblk : a->gsB / V;                                           \
        const i64 gc = a->gsC >= a->dim ? a->nblk : a->gsC / V;                                           \
        /* one segment at a time: this thread's blocks of one batch row and one group */                  \
        for (i64 i = a->lo; i < a->hi;) {                                                                 \
            const i64 b = i / a->nblk, j0 = i - b * a->nblk;                                              \
            i64 j1 = (j0 / gb + 1) * gb < (j0 / gc + 1) * gc ? (j0 / gb + 1) * gb : (j0 / gc + 1) * gc;   \
            if (j1 > a->nblk) j1 = a->nblk;                                                               \
            if (b * a->nblk + j1 > a->hi) j1 = a->hi - b * a->nblk;                                       \
            const i64 e = b * a->nblk + j1;                                                               \
            if (a->N == 16 && !a->bfm)                                                                    \
                lbwd_seg_##SFX(a, b, j0, j1, 16, 0);                                                      \
            else if (a->N == 8 && !a->bfm)                                                                \
                lbwd_seg_##SFX(a, b, j0, j1, 8, 0);                                                       \
            else if (a->N == 16 && a->bfm == BF_AUTOCAST_BWD)                                             \
                lbwd_seg_##SFX(a, b, j0, j1, 16, BF_AUTOCAST_BWD);                                        \
            else if (a->N == 16)                                                                          \
                lbwd_seg_##SFX(a, b, j0, j1, 16, a->bfm);                                                 \
            else if (a->N == 8)                                                                           \
                lbwd_seg_##SFX(a, b, j0, j1, 8, a->bfm);                                                  \
            else                                                                                          \
                lbwd_seg_##SFX(a, b, j0, j1, a->N, a->bfm);                                               \
            i = e;                                                                                        \
        }                                                                                                 \
        REAL *dA = a->dA + a->th * dim * N; /* this thread's (dim, N) accumulator */                      \
        for (i64 j = 0; j < a->nblk; j++)                                                                 \
            for (i64 l = 0; l < V && j * V + l < dim; l++)                                                \
                for (i64 n = 0; n < N; n++) dA[(j * V + l) * N + n] += dAT[j * N + n][l];                 \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
                                                                                                          \
    /* Splits the items (sequences, or channel blocks on the lane path) into contiguous ranges, one per   \
     * thread; returns 0 on success, -1 when a work buffer could not be allocated (nothing computed    \
     * then). */                                                                                          \
    static int run_##SFX(Args_##SFX *a, int nthreads, void *(*fn)(void *), i64 items, i64 per) {          \
        if (nthreads > items) nthreads = (int)items;                                                      \
        if (nthreads < 1) nthreads = 1;                                                                   \
        per = (per + 15) / 16 * 16; /* whole 64-byte lines per thread: lane vectors live there */         \
        REAL *work = NULL;                                                                                \
        if (posix_memalign((void **)&work, 64, sizeof(REAL) * per * nthreads)) return -1;                 \
        Args_##SFX parts[nthreads];                                                                       \
        pthread_t tids[nthreads];                                                                         \
        int started[nthreads];                                                                            \
        for (int k = 0; k < nthreads; k++) {                                                              \
            parts[k] = *a;                                                                                \
            parts[k].lo = items * k / nthreads;                                                           \
            parts[k].hi = items * (k + 1) / nthreads;                                                     \
            parts[k].th = k;                                                                              \
            parts[k].work = work + per * k;                                                               \
        }                                                                                                 \
        for (int k = 1; k < nthreads; k++) started[k] = pthread_create(&tids[k], NULL, fn, &parts[k]) == 0; \
        fn(&parts[0]);                                                                                    \
        for (int k = 1; k < nthreads; k++) {                                                              \
            if (started[k])                                                                               \
                pthread_join(tids[k], NULL);                                                              \
            else                                                                                          \
                fn(&parts[k]); /* no thread to be had: run its range here */                              \
        }                                                                                                 \
        free(work);                                                                                       \
        return 0;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    static Strides st3_##SFX(const i64 *s) { return (Strides){s[0], s[1], 0, s[2]}; }                     \
                                                                                                          \
    /* dims = (batch, dim, L, N, T, softplus); per-step strides are (b, d, t) triples; sB/sC are          \
     * (b, group, t); y is the gated output. */                                                           \
    int scan_fwd_##SFX(const i64 *dims, const REAL *delta, const i64 *sdl, const REAL *bias,              \
                       const REAL *u, const i64 *su, const REAL *z, const i64 *sz, const REAL *D,         \
                       const REAL *A2, const REAL *B, const i64 *sB, i64 gsB, const REAL *C,              \
                       const i64 *sC, i64 gsC, REAL *y, const i64 *sy, REAL *starts, REAL *last,          \
                       int nthreads, int bfm, int lanes) {                                                \
        Args_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.dim = dims[1], a.L = dims[2], a.N = dims[3], a.T = dims[4];                  \
        a.softplus = dims[5];                                                                             \
        a.delta = delta, a.bias = bias, a.u = u, a.z = z, a.D = D, a.A2 = A2, a.B = B, a.C = C;           \
        a.y = y, a.starts = starts, a.last = last, a.bfm = lanes ? bfm : 0;                               \
        a.sdl = st3_##SFX(sdl), a.su = st3_##SFX(su), a.sy = st3_##SFX(sy);                               \
        if (z) a.sz = st3_##SFX(sz);                                                                      \
        a.sB = (Strides){sB[0], 0, sB[1], sB[2]}, a.sC = (Strides){sC[0], 0, sC[1], sC[2]};               \
        a.gsB = gsB, a.gsC = gsC;                                                                         \
        if (lanes) {                                                                                      \
            a.nblk = (a.dim + V - 1) / V;                                                                 \
            const i64 per = V * a.nblk * a.N; /* A2 as lane vectors */                                    \
            return run_##SFX(&a, nthreads, lfwd_range_##SFX, a.batch * a.nblk, per);                      \
        }                                                                                                 \
        return run_##SFX(&a, nthreads, fwd_range_##SFX, a.batch * a.dim, 10 * a.T + (2 * a.T + 1) * a.N); \
    }                                                                                                     \
                                                                                                          \
    /* dout may be NULL (no gradient reached the output), dlast NULL, z NULL (then dz unused), D and      \
     * bias NULL (then dD / dbias unused). dA (threads, dim, N), dD and dbias (threads, dim), and dB / dC \
     * with strides pB / pC = (thread, b, group, t), n contiguous: zeroed, accumulated into. */           \
    int scan_bwd_##SFX(const i64 *dims, const REAL *delta, const i64 *sdl, const REAL *bias,              \
                       const REAL *u, const i64 *su, const REAL *z, const i64 *sz, const REAL *D,         \
                       const REAL *A2, const REAL *A, const REAL *B, const i64 *sB, i64 gsB,              \
                       const REAL *C, const i64 *sC, i64 gsC, const REAL *starts, const REAL *dlast,      \
                       const REAL *dout, const i64 *sdo, REAL *du, const i64 *sdu, REAL *ddelta,          \
                       const i64 *sdd, REAL *dz, const i64 *sdz, REAL *dA, REAL *dB, const i64 *pB,       \
                       REAL *dC, const i64 *pC, REAL *dD, REAL *dbias, int nthreads, int bfm, int lanes) { \
        Args_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.dim = dims[1], a.L = dims[2], a.N = dims[3], a.T = dims[4];                  \
        a.softplus = dims[5];                                                                             \
        a.delta = delta, a.bias = bias, a.u = u, a.z = z, a.D = D, a.A2 = A2, a.A = A, a.B = B, a.C = C;  \
        a.starts = (REAL *)starts, a.dlast = dlast, a.dout = dout;                                        \
        a.du = du, a.ddelta = ddelta, a.dz = dz, a.dA = dA, a.dB = dB, a.dC = dC, a.dD = dD;              \
        a.dbias = dbias, a.bfm = lanes ? bfm : 0;                                                         \
        a.sdl = st3_##SFX(sdl), a.su = st3_##SFX(su), a.sdu = st3_##SFX(sdu), a.sdd = st3_##SFX(sdd);     \
        if (z) a.sz = st3_##SFX(sz), a.sdz = st3_##SFX(sdz);                                              \
        if (dout) a.sdo = st3_##SFX(sdo);                                                                 \
        a.sB = (Strides){sB[0], 0, sB[1], sB[2]}, a.sC = (Strides){sC[0], 0, sC[1], sC[2]};               \
        a.pB = (Strides){pB[1], pB[0], pB[2], pB[3]}, a.pC = (Strides){pC[1], pC[0], pC[2], pC[3]};       \
        a.gsB = gsB, a.gsC = gsC;                                                                         \
        if (lanes) { /* per thread: A2, A, dA lanes; Hb, Ab, P (4T + 1 rows of N vectors), G, 4 chunk     \
                      * arrays */                                                                         \
            a.nblk = (a.dim + V - 1) / V;                                                                 \
            const i64 per = V * ((4 * a.T + 1) * a.N + 4 * a.nblk * a.N + 4 * a.T);                       \
            return run_##SFX(&a, nthreads, lbwd_range_##SFX, a.batch * a.nblk, per);                      \
        }                                                                                                 \
        return run_##SFX(&a, nthreads, bwd_range_##SFX, a.batch * a.dim, 10 * a.T + (2 * a.T + 1) * a.N); \
    }

DEFINE_SCAN(float, f32, exp2_f32, sigmoid_f32, softplus_f32, vf32, LANES32, vexp2_f32, vsigmoid_f32,
            vsoftplus_f32, vsoftplus_sig_f32)
DEFINE_SCAN(double, f64, exp2_f64, sigmoid_f64, softplus_f64, vf64, LANES64, vexp2_f64, vsigmoid_f64,
            vsoftplus_f64, vsoftplus_sig_f64)

/* Mamba's depthwise causal conv1d + SiLU, channels last: x[b, t, d] (row stride sx_t, batch stride
 * sx_b, d contiguous), weight w (K, dim) contiguous (the conv's (dim, 1, K) transposed), bias (dim) or
 * NULL; out u (batch, L, dim) contiguous: u[t, d] = silu(bias[d] + sum_k w[k, d] x[t - K + 1 + k, d])
 * (x is zero before t = 0). Backward recomputes the pre-activation; gw (threads, K, dim) and gb
 * (threads, dim) are private per thread. Items are batch rows; every loop over d vectorises. */
#define DEFINE_CONV(REAL, SFX, SIGMOID)                                                                   \
    typedef struct {                                                                                      \
        i64 batch, L, dim, K, sx_b, sx_t, lo, hi, th;                                                     \
        const REAL *x, *w, *bias, *gu;                                                                    \
        REAL *u, *gx, *gw, *gb, *work;                                                                    \
    } Conv_##SFX;                                                                                         \
                                                                                                          \
    static inline void conv_pre_##SFX(const Conv_##SFX *a, i64 b, i64 t, REAL *pre) {                     \
        const i64 dim = a->dim, K = a->K;                                                                 \
        for (i64 d = 0; d < dim; d++) pre[d] = a->bias ? a->bias[d] : 0;                                  \
        for (i64 k = 0; k < K; k++) {                                                                     \
            const i64 ts = t - K + 1 + k;                                                                 \
            if (ts < 0) continue;                                                                         \
            const REAL *xr = a->x + b * a->sx_b + ts * a->sx_t;                                           \
            for (i64 d = 0; d < dim; d++) pre[d] += a->w[k * dim + d] * xr[d];                            \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    static void *conv_fwd_range_##SFX(void *p) {                                                          \
        const Conv_##SFX *a = p;                                                                          \
        const i64 dim = a->dim;                                                                           \
        REAL *pre = a->work;                                                                              \
        for (i64 b = a->lo; b < a->hi; b++)                                                               \
            for (i64 t = 0; t < a->L; t++) {                                                              \
                conv_pre_##SFX(a, b, t, pre);                                                             \
                REAL *ur = a->u + (b * a->L + t) * dim;                                                   \
                for (i64 d = 0; d < dim; d++) ur[d] = pre[d] * SIGMOID(pre[d]);                           \
            }                                                                                             \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
    static void *conv_bwd_range_##SFX(void *p) {                                                          \
        const Conv_##SFX *a = p;                                                                          \
        const i64 dim = a->dim, K = a->K, L = a->L;                                                       \
        REAL *pre = a->work, *gp = pre + dim; /* gp: (L, dim) gradient of the pre-activation */           \
        REAL *gw = a->gw + a->th * dim * K, *gb = a->gb ? a->gb + a->th * dim : NULL;                     \
        for (i64 b = a->lo; b < a->hi; b++) {                                                             \
            for (i64 t = 0; t < L; t++) {                                                                 \
                conv_pre_##SFX(a, b, t, pre);                                                             \
                const REAL *gr = a->gu + (b * L + t) * dim;                                               \
                REAL *g = gp + t * dim;                                                                   \
                for (i64 d = 0; d < dim; d++) {                                                           \
                    const REAL s = SIGMOID(pre[d]);                                                       \
                    g[d] = gr[d] * s * (1 + pre[d] * (1 - s));                                            \
                }                                                                                         \
                if (gb)                                                                                   \
                    for (i64 d = 0; d < dim; d++) gb[d] += g[d];                                          \
            }                                                                                             \
            for (i64 t = 0; t < L; t++) {                                                                 \
                const REAL *xr = a->x + b * a->sx_b + t * a->sx_t;                                        \
                REAL *gxr = a->gx + (b * L + t) * dim;                                                    \
                for (i64 d = 0; d < dim; d++) gxr[d] = 0;                                                 \
                for (i64 k = 0; k < K; k++) {                                                             \
                    const i64 to = t + K - 1 - k; /* the output step that reads x[t] through tap k */     \
                    if (to >= L) continue;                                                                \
                    const REAL *g = gp + to * dim;                                                        \
                    for (i64 d = 0; d < dim; d++) {                                                       \
                        gxr[d] += a->w[k * dim + d] * g[d];                                               \
                        gw[k * dim + d] += g[d] * xr[d];                                                  \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        return NULL;                                                                                      \
    }                                                                                                     \
                                                                                                          \
    static int conv_run_##SFX(Conv_##SFX *a, int nthreads, void *(*fn)(void *), i64 per) {                \
        if (nthreads > a->batch) nthreads = (int)a->batch;                                                \
        if (nthreads < 1) nthreads = 1;                                                                   \
        REAL *work = malloc(sizeof(REAL) * per * nthreads);                                               \
        if (!work) return -1;                                                                             \
        Conv_##SFX parts[nthreads];                                                                       \
        pthread_t tids[nthreads];                                                                         \
        int started[nthreads];                                                                            \
        for (int k = 0; k < nthreads; k++) {                                                              \
            parts[k] = *a;                                                                                \
            parts[k].lo = a->batch * k / nthreads;                                                        \
            parts[k].hi = a->batch * (k + 1) / nthreads;                                                  \
            parts[k].th = k;                                                                              \
            parts[k].work = work + per * k;                                                               \
        }                                                                                                 \
        for (int k = 1; k < nthreads; k++) started[k] = pthread_create(&tids[k], NULL, fn, &parts[k]) == 0; \
        fn(&parts[0]);                                                                                    \
        for (int k = 1; k < nthreads; k++) {                                                              \
            if (started[k])                                                                               \
                pthread_join(tids[k], NULL);                                                              \
            else                                                                                          \
                fn(&parts[k]);                                                                            \
        }                                                                                                 \
        free(work);                                                                                       \
        return 0;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    /* dims = (batch, L, dim, K), sx = (batch, t) strides of x */                                         \
    int conv_fwd_##SFX(const i64 *dims, const REAL *x, const i64 *sx, const REAL *w, const REAL *bias,    \
                       REAL *u, int nthreads) {                                                           \
        Conv_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.L = dims[1], a.dim = dims[2], a.K = dims[3], a.sx_b = sx[0], a.sx_t = sx[1]; \
        a.x = x, a.w = w, a.bias = bias, a.u = u;                                                         \
        return conv_run_##SFX(&a, nthreads, conv_fwd_range_##SFX, a.dim);                                 \
    }                                                                                                     \
                                                                                                          \
    /* gx (batch, L, dim) contiguous, written; gw (threads, K, dim), gb (threads, dim): zeroed by the     \
     * caller, accumulated into */                                                                        \
    int conv_bwd_##SFX(const i64 *dims, const REAL *x, const i64 *sx, const REAL *w, const REAL *bias,    \
                       const REAL *gu, REAL *gx, REAL *gw, REAL *gb, int nthreads) {                      \
        Conv_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.L = dims[1], a.dim = dims[2], a.K = dims[3], a.sx_b = sx[0], a.sx_t = sx[1]; \
        a.x = x, a.w = w, a.bias = bias, a.gu = gu, a.gx = gx, a.gw = gw, a.gb = gb;                      \
        return conv_run_##SFX(&a, nthreads, conv_bwd_range_##SFX, a.dim * (a.L + 1));                     \
    }

DEFINE_CONV(float, f32, sigmoid_f32)
DEFINE_CONV(double, f64, sigmoid_f64)
