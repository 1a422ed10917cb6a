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

typedef struct {
    i64 b, d, g, t;
} Strides;

#define AT(P_, S_, B_, D_, T_) (P_)[(B_) * (S_).b + (D_) * (S_).d + (T_) * (S_).t]

#define DEFINE_SCAN(REAL, SFX, EXP, SIGMOID, SOFTPLUS)                                                    \
    typedef struct {                                                                                      \
        i64 batch, dim, L, N, T, lo, hi, th, softplus;                                                    \
        const REAL *delta, *bias, *u, *z, *D, *A2, *A, *B, *C, *dlast, *dout;                             \
        Strides sdl, su, sz, sB, sC, sy, sdo, sdu, sdd, sdz, pB, pC;                                      \
        i64 gsB, gsC;                                                                                     \
        REAL *y, *starts, *last, *du, *ddelta, *dz, *dA, *dB, *dC, *dD, *dbias;                           \
        REAL *work; /* this thread's: 10 chunk arrays of T, then (T + 1) * N states, T * N decays */     \
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
    static inline __attribute__((always_inline)) void fwd_item_##SFX(const Args_##SFX *a, i64 item,      \
                                                                      const i64 N) {                      \
        const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T;                              \
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
    static inline __attribute__((always_inline)) void bwd_item_##SFX(const Args_##SFX *a, i64 item,      \
                                                                      const i64 N) {                      \
        const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T, th = a->th;                  \
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
        REAL g[NMAX], dAl[NMAX], hv[NMAX], av[NMAX], dDl = 0, dbl = 0;                                        \
        for (i64 n = 0; n < N; n++) {                                                                     \
            g[n] = a->dlast ? a->dlast[(b * a->dim + d) * N + n] : 0;                                    \
            dAl[n] = 0;                                                                                   \
        }                                                                                                 \
        for (i64 c = nch - 1; c >= 0; c--) {                                                              \
            const i64 s = c * T, k = (s + T < L ? s + T : L) - s;                                         \
            gather_##SFX(a, b, d, s, k, raw, dt, u);                                                      \
            for (i64 j = 0; j < k; j++) go[j] = a->dout ? AT(a->dout, a->sdo, b, d, s + j) : 0;          \
            /* recompute: Hb row j + 1 = state after step s + j, Ab row j = its decay, Hb row 0 = the   \
             * state entering the chunk */                                                                \
            if (c == 0)                                                                                   \
                for (i64 n = 0; n < N; n++) hv[n] = 0;                                                    \
            else                                                                                          \
                memcpy(hv, a->starts + ((b * (nch - 1) + c - 1) * a->dim + d) * N, N * sizeof(REAL));    \
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
                const REAL x = dt[j] * u[j], dyj = dy[j], dtj = dt[j];                                        \
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
                    const REAL p = gn * an[n] * hp[n]; /* gradient of dt * A */                          \
                    ddt += p * Ar[n];                                                                     \
                    dAl[n] += p * dtj;                                                                      \
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
    /* Splits the batch * dim items into contiguous ranges, one per thread; returns 0 on success, -1    \
     * when a work buffer could not be allocated (nothing computed then). */                              \
    static int run_##SFX(Args_##SFX *a, int nthreads, void *(*fn)(void *)) {                              \
        const i64 items = a->batch * a->dim;                                                              \
        if (nthreads > items) nthreads = (int)items;                                                      \
        if (nthreads < 1) nthreads = 1;                                                                   \
        const i64 per = 10 * a->T + (2 * a->T + 1) * a->N;                                                \
        REAL *work = malloc(sizeof(REAL) * per * nthreads);                                               \
        if (!work) return -1;                                                                             \
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
                fn(&parts[k]); /* no thread to be had: run its range here */                             \
        }                                                                                                 \
        free(work);                                                                                       \
        return 0;                                                                                         \
    }                                                                                                     \
                                                                                                          \
    static Strides st3_##SFX(const i64 *s) { return (Strides){s[0], s[1], 0, s[2]}; }                     \
                                                                                                          \
    /* dims = (batch, dim, L, N, T, softplus); per-step strides are (b, d, t) triples; sB/sC are       \
     * (b, group, t); y is the gated output. */                                                           \
    int scan_fwd_##SFX(const i64 *dims, const REAL *delta, const i64 *sdl, const REAL *bias,              \
                       const REAL *u, const i64 *su, const REAL *z, const i64 *sz, const REAL *D,          \
                       const REAL *A2, const REAL *B, const i64 *sB, i64 gsB, const REAL *C,               \
                       const i64 *sC, i64 gsC, REAL *y, const i64 *sy, REAL *starts, REAL *last,           \
                       int nthreads) {                                                                    \
        Args_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.dim = dims[1], a.L = dims[2], a.N = dims[3], a.T = dims[4];                  \
        a.softplus = dims[5];                                                                             \
        a.delta = delta, a.bias = bias, a.u = u, a.z = z, a.D = D, a.A2 = A2, a.B = B, a.C = C;           \
        a.y = y, a.starts = starts, a.last = last;                                                        \
        a.sdl = st3_##SFX(sdl), a.su = st3_##SFX(su), a.sy = st3_##SFX(sy);                               \
        if (z) a.sz = st3_##SFX(sz);                                                                      \
        a.sB = (Strides){sB[0], 0, sB[1], sB[2]}, a.sC = (Strides){sC[0], 0, sC[1], sC[2]};               \
        a.gsB = gsB, a.gsC = gsC;                                                                         \
        return run_##SFX(&a, nthreads, fwd_range_##SFX);                                                  \
    }                                                                                                     \
                                                                                                          \
    /* dout may be NULL (no gradient reached the output), dlast NULL, z NULL (then dz unused), D and   \
     * bias NULL (then dD / dbias unused). dA (threads, dim, N), dD and dbias (threads, dim), and dB / dC \
     * with strides pB / pC = (thread, b, group, t), n contiguous: zeroed, accumulated into. */           \
    int scan_bwd_##SFX(const i64 *dims, const REAL *delta, const i64 *sdl, const REAL *bias,              \
                       const REAL *u, const i64 *su, const REAL *z, const i64 *sz, const REAL *D,          \
                       const REAL *A2, const REAL *A, const REAL *B, const i64 *sB, i64 gsB,               \
                       const REAL *C, const i64 *sC, i64 gsC, const REAL *starts, const REAL *dlast,       \
                       const REAL *dout, const i64 *sdo, REAL *du, const i64 *sdu, REAL *ddelta,           \
                       const i64 *sdd, REAL *dz, const i64 *sdz, REAL *dA, REAL *dB, const i64 *pB,        \
                       REAL *dC, const i64 *pC, REAL *dD, REAL *dbias, int nthreads) {                    \
        Args_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.dim = dims[1], a.L = dims[2], a.N = dims[3], a.T = dims[4];                  \
        a.softplus = dims[5];                                                                             \
        a.delta = delta, a.bias = bias, a.u = u, a.z = z, a.D = D, a.A2 = A2, a.A = A, a.B = B, a.C = C;  \
        a.starts = (REAL *)starts, a.dlast = dlast, a.dout = dout;                                        \
        a.du = du, a.ddelta = ddelta, a.dz = dz, a.dA = dA, a.dB = dB, a.dC = dC, a.dD = dD;              \
        a.dbias = dbias;                                                                                  \
        a.sdl = st3_##SFX(sdl), a.su = st3_##SFX(su), a.sdu = st3_##SFX(sdu), a.sdd = st3_##SFX(sdd);    \
        if (z) a.sz = st3_##SFX(sz), a.sdz = st3_##SFX(sdz);                                              \
        if (dout) a.sdo = st3_##SFX(sdo);                                                                 \
        a.sB = (Strides){sB[0], 0, sB[1], sB[2]}, a.sC = (Strides){sC[0], 0, sC[1], sC[2]};               \
        a.pB = (Strides){pB[1], pB[0], pB[2], pB[3]}, a.pC = (Strides){pC[1], pC[0], pC[2], pC[3]};       \
        a.gsB = gsB, a.gsC = gsC;                                                                         \
        return run_##SFX(&a, nthreads, bwd_range_##SFX);                                                  \
    }

DEFINE_SCAN(float, f32, exp2_f32, sigmoid_f32, softplus_f32)
DEFINE_SCAN(double, f64, exp2_f64, sigmoid_f64, softplus_f64)

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
            for (i64 d = 0; d < dim; d++) pre[d] += a->w[k * dim + d] * xr[d];                              \
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
        REAL *pre = a->work, *gp = pre + dim; /* gp: (L, dim) gradient of the pre-activation */          \
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
                    const i64 to = t + K - 1 - k; /* the output step that reads x[t] through tap k */    \
                    if (to >= L) continue;                                                                \
                    const REAL *g = gp + to * dim;                                                        \
                    for (i64 d = 0; d < dim; d++) {                                                       \
                        gxr[d] += a->w[k * dim + d] * g[d];                                                 \
                        gw[k * dim + d] += g[d] * xr[d];                                                    \
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
    int conv_fwd_##SFX(const i64 *dims, const REAL *x, const i64 *sx, const REAL *w, const REAL *bias,   \
                       REAL *u, int nthreads) {                                                           \
        Conv_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.L = dims[1], a.dim = dims[2], a.K = dims[3], a.sx_b = sx[0], a.sx_t = sx[1]; \
        a.x = x, a.w = w, a.bias = bias, a.u = u;                                                         \
        return conv_run_##SFX(&a, nthreads, conv_fwd_range_##SFX, a.dim);                                 \
    }                                                                                                     \
                                                                                                          \
    /* gx (batch, L, dim) contiguous, written; gw (threads, K, dim), gb (threads, dim): zeroed by the    \
     * caller, accumulated into */                                                                        \
    int conv_bwd_##SFX(const i64 *dims, const REAL *x, const i64 *sx, const REAL *w, const REAL *bias,   \
                       const REAL *gu, REAL *gx, REAL *gw, REAL *gb, int nthreads) {                      \
        Conv_##SFX a = {0};                                                                               \
        a.batch = dims[0], a.L = dims[1], a.dim = dims[2], a.K = dims[3], a.sx_b = sx[0], a.sx_t = sx[1]; \
        a.x = x, a.w = w, a.bias = bias, a.gu = gu, a.gx = gx, a.gw = gw, a.gb = gb;                      \
        return conv_run_##SFX(&a, nthreads, conv_bwd_range_##SFX, a.dim * (a.L + 1));                     \
    }

DEFINE_CONV(float, f32, sigmoid_f32)
DEFINE_CONV(double, f64, sigmoid_f64)
