/* The selective scan and the conv for one dtype: cpu_kernel.c includes this file once for fp32 and once
 * for fp64, with REAL (the scalar type), SFX (f32 / f64: the suffix of every function here), VEC and V
 * (the lane vector and its lane count) and SPECIALIZE (whether the hot loops are also compiled for the
 * constant N and bf16 masks a Mamba block uses) defined. Every function name below is an alias for its
 * suffixed name (gather -> gather_f32, ...), set up and removed at the ends of this file. */

#define PASTE_(a, b) a##_##b
#define PASTE(a, b) PASTE_(a, b)
#define FN(name) PASTE(name, SFX)
#define Args FN(Args)
#define VecU FN(VecU)
#define EXP FN(exp2)
#define SIGMOID FN(sigmoid)
#define SOFTPLUS FN(softplus)
#define VEXP FN(vexp2)
#define VSIGMOID FN(vsigmoid)
#define VSOFTPLUS FN(vsoftplus)
#define VSOFTPLUS_SIG FN(vsoftplus_sig)
#define gather FN(gather)
#define recur FN(recur)
#define fwd_item FN(fwd_item)
#define bwd_item FN(bwd_item)
#define fwd_range FN(fwd_range)
#define bwd_range FN(bwd_range)
#define lgather FN(lgather)
#define lscatter FN(lscatter)
#define lat FN(lat)
#define lst FN(lst)
#define lfwd_item FN(lfwd_item)
#define lbwd_block FN(lbwd_block)
#define lbwd_seg FN(lbwd_seg)
#define lanes_of FN(lanes_of)
#define lfwd_range FN(lfwd_range)
#define lbwd_range FN(lbwd_range)
#define run FN(run)
#define unpack FN(unpack)
#define Conv FN(Conv)
#define conv_pre FN(conv_pre)
#define conv_fwd_range FN(conv_fwd_range)
#define conv_bwd_range FN(conv_bwd_range)
#define conv_run FN(conv_run)
#define conv_unpack FN(conv_unpack)

/* One thread's view of a ScanArgs: its Part (range of work items, index, work buffer) and typed
 * pointers. */
typedef struct {
    struct {
        PART_FIELDS; /* work: 10 chunk arrays of T, then (T + 1) * N states, T * N decays (sequence path) */
    };
    i64 batch, dim, L, N, T, softplus, nblk; /* nblk: channel blocks (lane path) */
    const REAL *delta, *bias, *u, *z, *D, *A2, *A, *B, *C, *dlast, *dout;
    Strides sdl, su, sz, sB, sC, sy, sdo, sdu, sdd, sdz, pB, pC;
    i64 gsB, gsC;
    REAL *y, *starts, *last, *du, *ddelta, *dz, *dA, *dB, *dC, *dD, *dbias;
    int bfm;    /* BF_* bits: which per-step tensors are bf16 (lane path only) */
} Args;

/* ---- sequence path: a work item is one (b, d) sequence, its state an N-vector */

/* dt (and raw = delta + bias) and u of steps s..s+k of item (b, d) into chunk arrays */
INLINE void gather(const Args *a, i64 b, i64 d, i64 s, i64 k, REAL *raw, REAL *dt, REAL *u) {
    const REAL bias = a->bias ? a->bias[d] : 0;
    for (i64 j = 0; j < k; j++) {
        raw[j] = a->delta[at(a->sdl, b, d, s + j)] + bias;
        u[j] = a->u[at(a->su, b, d, s + j)];
    }
    if (a->softplus) {
        #pragma omp simd
        for (i64 j = 0; j < k; j++) dt[j] = SOFTPLUS(raw[j]);
    } else {
        memcpy(dt, raw, k * sizeof(REAL));
    }
}

/* k steps from s of the recurrence h = exp(dt A) h + dt u B, y = C.h + D u, from state h (left as the
 * state after step s + k - 1). keep (a constant 0 or 1 where it is inlined, so the branch folds away): also
 * keep each step's state in Hb row j + 1 and its decay in Ab row j, for the backward pass's recompute. */
INLINE void recur(const Args *a, const REAL *A2, const REAL *Bp, const REAL *Cp, REAL Dd, i64 s, i64 k,
                  const i64 N, const REAL *dt, const REAL *u, REAL *h, REAL *y, const int keep, REAL *Hb,
                  REAL *Ab) {
    for (i64 j = 0; j < k; j++) {
        const REAL x = dt[j] * u[j];
        const REAL *Bt = Bp + (s + j) * a->sB.t, *Ct = Cp + (s + j) * a->sC.t;
        REAL acc = 0;
#pragma omp simd reduction(+ : acc)
        for (i64 n = 0; n < N; n++) {
            const REAL e = EXP(dt[j] * A2[n]);
            h[n] = e * h[n] + x * Bt[n];
            acc += Ct[n] * h[n];
            if (keep) {
                Ab[j * N + n] = e;
                Hb[(j + 1) * N + n] = h[n];
            }
        }
        y[j] = acc + Dd * u[j];
    }
}

INLINE void fwd_item(const Args *a, i64 item, const i64 N) {
    const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T;
    const i64 nch = (L + T - 1) / T;
    const REAL *A2 = a->A2 + d * N, Dd = a->D ? a->D[d] : 0;
    const REAL *Bp = a->B + b * a->sB.b + (d / a->gsB) * a->sB.g;
    const REAL *Cp = a->C + b * a->sC.b + (d / a->gsC) * a->sC.g;
    REAL *raw = a->work, *dt = raw + T, *u = dt + T, *y = u + T, *zc = y + T;
    REAL h[NMAX];
    for (i64 n = 0; n < N; n++) h[n] = 0;
    for (i64 c = 0; c < nch; c++) {
        const i64 s = c * T, k = (s + T < L ? s + T : L) - s;
        if (c > 0) {
            REAL *st = a->starts + ((b * (nch - 1) + c - 1) * a->dim + d) * N;
            for (i64 n = 0; n < N; n++) st[n] = h[n];
        }
        gather(a, b, d, s, k, raw, dt, u);
        recur(a, A2, Bp, Cp, Dd, s, k, N, dt, u, h, y, 0, NULL, NULL);
        if (a->z) {
            for (i64 j = 0; j < k; j++) zc[j] = a->z[at(a->sz, b, d, s + j)];
            #pragma omp simd
            for (i64 j = 0; j < k; j++) y[j] *= zc[j] * SIGMOID(zc[j]);
        }
        for (i64 j = 0; j < k; j++) a->y[at(a->sy, b, d, s + j)] = y[j];
    }
    REAL *last = a->last + (b * a->dim + d) * N;
    for (i64 n = 0; n < N; n++) last[n] = h[n];
}

INLINE void bwd_item(const Args *a, i64 item, const i64 N) {
    const i64 b = item / a->dim, d = item % a->dim, L = a->L, T = a->T, th = a->th;
    const i64 nch = (L + T - 1) / T;
    const REAL *A2 = a->A2 + d * N, *Ar = a->A + d * N, Dd = a->D ? a->D[d] : 0;
    const i64 gB = d / a->gsB, gC = d / a->gsC;
    const REAL *Bp = a->B + b * a->sB.b + gB * a->sB.g;
    const REAL *Cp = a->C + b * a->sC.b + gC * a->sC.g;
    REAL *dBp = a->dB + th * a->pB.d + b * a->pB.b + gB * a->pB.g;
    REAL *dCp = a->dC + th * a->pC.d + b * a->pC.b + gC * a->pC.g;
    REAL *raw = a->work, *dt = raw + T, *u = dt + T, *yp = u + T, *zc = yp + T, *dy = zc + T;
    REAL *du = dy + T, *dd = du + T, *dz = dd + T, *go = dz + T;
    REAL *Hb = go + T, *Ab = Hb + (T + 1) * N;
    REAL g[NMAX], dAl[NMAX], hv[NMAX], dDl = 0, dbl = 0;
    for (i64 n = 0; n < N; n++) {
        g[n] = a->dlast ? a->dlast[(b * a->dim + d) * N + n] : 0;
        dAl[n] = 0;
    }
    for (i64 c = nch - 1; c >= 0; c--) {
        const i64 s = c * T, k = (s + T < L ? s + T : L) - s;
        gather(a, b, d, s, k, raw, dt, u);
        for (i64 j = 0; j < k; j++) go[j] = a->dout ? a->dout[at(a->sdo, b, d, s + j)] : 0;
        /* recompute: Hb row j + 1 = state after step s + j, Ab row j = its decay, Hb row 0 = the state
         * entering the chunk */
        if (c == 0)
            for (i64 n = 0; n < N; n++) hv[n] = 0;
        else
            memcpy(hv, a->starts + ((b * (nch - 1) + c - 1) * a->dim + d) * N, N * sizeof(REAL));
        memcpy(Hb, hv, N * sizeof(REAL));
        recur(a, A2, Bp, Cp, Dd, s, k, N, dt, u, hv, yp, 1, Hb, Ab);
        /* the gate: dy = d loss / d (C.h + D u), dz */
        if (a->z) {
            for (i64 j = 0; j < k; j++) zc[j] = a->z[at(a->sz, b, d, s + j)];
            #pragma omp simd
            for (i64 j = 0; j < k; j++) {
                const REAL sg = SIGMOID(zc[j]);
                dy[j] = go[j] * zc[j] * sg;
                dz[j] = go[j] * yp[j] * sg * (1 + zc[j] * (1 - sg));
            }
            for (i64 j = 0; j < k; j++) a->dz[at(a->sdz, b, d, s + j)] = dz[j];
        } else {
            for (i64 j = 0; j < k; j++) dy[j] = go[j];
        }
        #pragma omp simd reduction(+ : dDl)
        for (i64 j = 0; j < k; j++) {
            dDl += dy[j] * u[j];
            du[j] = dy[j] * Dd;
        }
        /* state gradients, backwards: g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1} */
        for (i64 j = k - 1; j >= 0; j--) {
            const REAL x = dt[j] * u[j], dyj = dy[j], dtj = dt[j];
            const REAL *restrict Bt = Bp + (s + j) * a->sB.t, *restrict Ct = Cp + (s + j) * a->sC.t;
            REAL *restrict dBt = dBp + (s + j) * a->pB.t, *restrict dCt = dCp + (s + j) * a->pC.t;
            const REAL *restrict hp = Hb + j * N, *restrict hn = Hb + (j + 1) * N;
            const REAL *restrict an = Ab + j * N;
            REAL W = 0, ddt = 0;
#pragma omp simd reduction(+ : W, ddt)
            for (i64 n = 0; n < N; n++) {
                const REAL gn = g[n] + dyj * Ct[n];
                dCt[n] += dyj * hn[n];
                dBt[n] += gn * x;
                W += gn * Bt[n];
                const REAL p = gn * an[n] * hp[n]; /* gradient of dt * A */
                ddt += p * Ar[n];
                dAl[n] += p * dtj;
                g[n] = gn * an[n];
            }
            du[j] += W * dt[j];
            dd[j] = W * u[j] + ddt;
        }
        if (a->softplus) {
            #pragma omp simd
            for (i64 j = 0; j < k; j++) dd[j] *= SIGMOID(raw[j]);
        }
        for (i64 j = 0; j < k; j++) {
            dbl += dd[j];
            a->du[at(a->sdu, b, d, s + j)] = du[j];
            a->ddelta[at(a->sdd, b, d, s + j)] = dd[j];
        }
    }
    REAL *dA = a->dA + (th * a->dim + d) * N;
    for (i64 n = 0; n < N; n++) dA[n] += dAl[n];
    if (a->dD) a->dD[th * a->dim + d] += dDl;
    if (a->dbias) a->dbias[th * a->dim + d] += dbl;
}

/* the sequence path at -O3 (the rest of the file is built at -O2): its N-loops are omp simd loops over
 * arrays of N, which only -O3's complete peeling keeps in registers once vectorised (-O2: 35% slower).
 * One thread's items [lo, hi) through item (fwd_item or bwd_item), with N 16 a constant where SPECIALIZE
 * (with SPECIALIZE 0 the compiler drops that branch before it inlines anything). */
#define SEQ_RANGE(name, item)                                                                            \
    __attribute__((optimize("O3"))) static void *name(void *p) {                                         \
        const Args *a = p;                                                                               \
        if (SPECIALIZE && a->N == 16) {                                                                  \
            for (i64 i = a->lo; i < a->hi; i++) item(a, i, 16);                                          \
            return NULL;                                                                                 \
        }                                                                                                \
        for (i64 i = a->lo; i < a->hi; i++) item(a, i, a->N);                                            \
        return NULL;                                                                                     \
    }
SEQ_RANGE(fwd_range, fwd_item)
SEQ_RANGE(bwd_range, bwd_item)
#undef SEQ_RANGE

/* ---- channel-lane path: a work item is (b, a block of V consecutive channels), the lanes of VEC; the
 * state is N vectors of V lanes (one per state entry) and every step is N independent lane recurrences,
 * no sums over N. Needs B/C broadcast over the block (per step, or groups holding whole blocks: the
 * caller checks). Lanes past dim (the last block's tail) run on zeros, which keeps every value they make
 * finite and every gradient they add zero. */
typedef REAL VecU __attribute__((vector_size(sizeof(VEC)), aligned(sizeof(REAL))));

INLINE VEC lgather(const REAL *p, i64 stride, int nl) {
    VEC v = {0};
    if (nl == V && stride == 1) return *(const VecU *)p;
    for (int l = 0; l < nl; l++) v[l] = p[l * stride];
    return v;
}

INLINE void lscatter(REAL *p, i64 stride, int nl, VEC v) {
    if (nl == V && stride == 1) {
        *(VecU *)p = v;
        return;
    }
    for (int l = 0; l < nl; l++) p[l * stride] = v[l];
}

/* per-step tensor P at (b, d0.., t) as lanes, and back; bf: P holds bf16 */
INLINE VEC lat(const REAL *P, Strides S, i64 b, i64 d0, i64 t, int nl, int bf) {
    const i64 o = at(S, b, d0, t);
    if (!bf) return lgather(P + o, S.d, nl);
    const uint16_t *p = (const uint16_t *)(const void *)P + o;
    VEC v = {0};
    if (nl == V && S.d == 1) return FN(vload_bf16)(p);
    for (int l = 0; l < nl; l++) v[l] = bf16_f32(p[l * S.d]);
    return v;
}

INLINE void lst(REAL *P, Strides S, i64 b, i64 d0, i64 t, int nl, VEC v, int bf) {
    const i64 o = at(S, b, d0, t);
    if (!bf) {
        lscatter(P + o, S.d, nl, v);
        return;
    }
    uint16_t *p = (uint16_t *)(void *)P + o;
    if (nl == V && S.d == 1) {
        FN(vstore_bf16)(p, v);
        return;
    }
    for (int l = 0; l < nl; l++) p[l * S.d] = f32_bf16((float)v[l]);
}

INLINE void lfwd_item(const Args *a_, i64 item, const i64 N,
                                                            const int bfm) {
    /* a local copy: stores through the data pointers cannot change it, so its fields stay in registers */
    const Args args = *a_, *a = &args;
    const i64 nb = a->nblk, b = item / nb, d0 = (item % nb) * V, L = a->L, T = a->T, dim = a->dim;
    const int nl = (int)(dim - d0 < V ? dim - d0 : V);
    const i64 nch = (L + T - 1) / T;
    const REAL *Bp = a->B + b * a->sB.b + (d0 / a->gsB) * a->sB.g;
    const REAL *Cp = a->C + b * a->sC.b + (d0 / a->gsC) * a->sC.g;
    const VEC bias = a->bias ? lgather(a->bias + d0, 1, nl) : (VEC){0};
    const VEC Dv = a->D ? lgather(a->D + d0, 1, nl) : (VEC){0};
    VEC A2v[NMAX], h[NMAX];
    for (i64 n = 0; n < N; n++) {
        A2v[n] = ((const VEC *)a->work)[(item % nb) * N + n]; /* lfwd_range's lane copy of A2 */
        h[n] = (VEC){0};
    }
    for (i64 t = 0; t < L; t++) {
        if (t > 0 && t % T == 0) {
            REAL *st = a->starts + ((b * (nch - 1) + t / T - 1) * dim + d0) * N;
            for (i64 n = 0; n < N; n++) lscatter(st + n, N, nl, h[n]);
        }
        const VEC raw = lat(a->delta, a->sdl, b, d0, t, nl, bfm & BF_DELTA) + bias;
        const VEC dt = a->softplus ? VSOFTPLUS(raw) : raw;
        const VEC uu = lat(a->u, a->su, b, d0, t, nl, bfm & BF_U);
        const VEC x = dt * uu;
        const REAL *Bt = Bp + t * a->sB.t, *Ct = Cp + t * a->sC.t;
        VEC acc0 = Dv * uu, acc1 = {0};
#pragma GCC unroll 16
        for (i64 n = 0; n < N; n++) {
            h[n] = VEXP(dt * A2v[n]) * h[n] + x * Bt[n];
            if (n & 1)
                acc1 += Ct[n] * h[n];
            else
                acc0 += Ct[n] * h[n];
        }
        VEC y = acc0 + acc1;
        if (a->z) {
            const VEC zz = lat(a->z, a->sz, b, d0, t, nl, bfm & BF_Z);
            y *= zz * VSIGMOID(zz);
        }
        lst(a->y, a->sy, b, d0, t, nl, y, bfm & BF_Y);
    }
    REAL *last = a->last + (b * dim + d0) * N;
    for (i64 n = 0; n < N; n++) lscatter(last + n, N, nl, h[n]);
}

/* One block's part of a chunk's backward (lbwd_seg): block j (channels d0 = j V ..) of batch row b, steps
 * s..s+k. Recomputes the chunk's states into Hb and decays into Ab from the saved start, then walks back
 * from the state gradient g (G's row of the block, updated), writing dz, du, ddelta, adding dB_t / dC_t's
 * lane partials into P and dA's into dAT. */
INLINE void lbwd_block(const Args *a, VEC *work, i64 b, i64 j,
                                                             VEC *G, i64 c, i64 k, const i64 N,
                                                             const int bfm) {
    const i64 L = a->L, T = a->T, dim = a->dim, s = c * T, nch = (L + T - 1) / T, d0 = j * V;
    const int nl = (int)(dim - d0 < V ? dim - d0 : V);
    const REAL *Bp = a->B + b * a->sB.b + (d0 / a->gsB) * a->sB.g;
    const REAL *Cp = a->C + b * a->sC.b + (d0 / a->gsC) * a->sC.g;
    VEC *A2T = work, *Alanes = A2T + a->nblk * N, *dAT = Alanes + a->nblk * N;
    VEC *Hb = dAT + a->nblk * N, *Ab = Hb + (T + 1) * N, *P = Ab + T * N;
    VEC *sgv = P + 2 * T * N, *dtv = sgv + T, *uv = dtv + T, *yp = uv + T; /* per step */
    const VEC bias = a->bias ? lgather(a->bias + d0, 1, nl) : (VEC){0};
    const VEC Dv = a->D ? lgather(a->D + d0, 1, nl) : (VEC){0};
    VEC A2v[NMAX], Arv[NMAX], hv[NMAX], g[NMAX], dAl[NMAX];
    for (i64 n = 0; n < N; n++) {
        A2v[n] = A2T[j * N + n];
        Arv[n] = Alanes[j * N + n];
        const i64 so = ((b * (nch - 1) + c - 1) * dim + d0) * N + n; /* its saved start */
        hv[n] = c == 0 ? (VEC){0} : lgather(a->starts + so, N, nl);
        Hb[n] = hv[n];
    }
    /* recompute: Hb row i + 1 = state after step s + i, Ab row i = its decays */
    for (i64 i = 0; i < k; i++) {
        const VEC r = lat(a->delta, a->sdl, b, d0, s + i, nl, bfm & BF_DELTA) + bias;
        VEC sg = {0}; /* sigmoid(r), the softplus' derivative */
        const VEC dt = a->softplus ? VSOFTPLUS_SIG(r, &sg) : r;
        const VEC uu = lat(a->u, a->su, b, d0, s + i, nl, bfm & BF_U);
        const VEC x = dt * uu;
        const REAL *Bt = Bp + (s + i) * a->sB.t, *Ct = Cp + (s + i) * a->sC.t;
        VEC acc0 = Dv * uu, acc1 = {0};
#pragma GCC unroll 16
        for (i64 n = 0; n < N; n++) {
            const VEC av = VEXP(dt * A2v[n]);
            hv[n] = av * hv[n] + x * Bt[n];
            Ab[i * N + n] = av;
            Hb[(i + 1) * N + n] = hv[n];
            if (n & 1)
                acc1 += Ct[n] * hv[n];
            else
                acc0 += Ct[n] * hv[n];
        }
        sgv[i] = sg, dtv[i] = dt, uv[i] = uu, yp[i] = acc0 + acc1;
    }
    VEC dDl = {0}, dbl = {0};
    for (i64 n = 0; n < N; n++) g[n] = G[n], dAl[n] = (VEC){0};
    for (i64 i = k - 1; i >= 0; i--) {
        const VEC go = a->dout ? lat(a->dout, a->sdo, b, d0, s + i, nl, bfm & BF_DOUT) : (VEC){0};
        VEC dy = go;
        if (a->z) {
            const VEC zz = lat(a->z, a->sz, b, d0, s + i, nl, bfm & BF_Z), sg = VSIGMOID(zz);
            dy = go * zz * sg;
            const VEC one = (VEC){0} + 1;
            const VEC dzv = go * yp[i] * sg * (one + zz * (one - sg));
            lst(a->dz, a->sdz, b, d0, s + i, nl, dzv, bfm & BF_DZ);
        }
        const VEC uu = uv[i], dt = dtv[i], x = dt * uu;
        dDl += dy * uu;
        const REAL *Bt = Bp + (s + i) * a->sB.t, *Ct = Cp + (s + i) * a->sC.t;
        VEC *Pi = P + i * 2 * N;
        const VEC *hn = Hb + (i + 1) * N, *hp = Hb + i * N, *an = Ab + i * N;
        VEC W = {0}, ddt = {0};
#pragma GCC unroll 16
        for (i64 n = 0; n < N; n++) {
            const VEC gn = g[n] + dy * Ct[n];
            Pi[n] += dy * hn[n];
            Pi[N + n] += gn * x;
            W += gn * Bt[n];
            const VEC p = gn * an[n] * hp[n]; /* gradient of dt * A */
            ddt += p * Arv[n];
            dAl[n] += p * dt;
            g[n] = gn * an[n];
        }
        VEC dd = W * uu + ddt;
        if (a->softplus) dd *= sgv[i];
        dbl += dd;
        lst(a->du, a->sdu, b, d0, s + i, nl, dy * Dv + W * dt, bfm & BF_DU);
        lst(a->ddelta, a->sdd, b, d0, s + i, nl, dd, bfm & BF_DDELTA);
    }
    for (i64 n = 0; n < N; n++) G[n] = g[n];
    for (i64 n = 0; n < N; n++) dAT[j * N + n] += dAl[n];
    for (int l = 0; l < nl; l++) {
        if (a->dD) a->dD[a->th * dim + d0 + l] += dDl[l];
        if (a->dbias) a->dbias[a->th * dim + d0 + l] += dbl[l];
    }
}

/* Backward of blocks j0..j1 of batch row b (one thread's), chunk by chunk from the end; within a chunk
 * block by block (lbwd_block). The sums over channels that dB_t and dC_t need are kept per lane in P (k
 * steps x 2N lane vectors, added to by every block) and reduced over lanes once per chunk. G holds each
 * block's state gradient between chunks. */
INLINE void lbwd_seg(const Args *a_, i64 b, i64 j0, i64 j1,
                                                           const i64 N, const int bfm) {
    const Args args = *a_, *a = &args; /* a local copy, as in lfwd_item */
    const i64 L = a->L, T = a->T, th = a->th, dim = a->dim;
    const i64 nch = (L + T - 1) / T;
    const i64 gB = j0 * V / a->gsB, gC = j0 * V / a->gsC;
    REAL *dBp = a->dB + th * a->pB.d + b * a->pB.b + gB * a->pB.g;
    REAL *dCp = a->dC + th * a->pC.d + b * a->pC.b + gC * a->pC.g;
    /* lbwd_range's lane copies of A2 and A and its dA accumulators (nblk x N lane vectors each), then
     * this segment's buffers: Hb, Ab, P, 4 per-step arrays (lbwd_block), G */
    VEC *work = (VEC *)a->work;
    VEC *P = work + 3 * a->nblk * N + (2 * T + 1) * N, *G = P + 2 * T * N + 4 * T;
    for (i64 j = j0; j < j1; j++) {
        const i64 d0 = j * V;
        const int nl = (int)(dim - d0 < V ? dim - d0 : V);
        for (i64 n = 0; n < N; n++)
            G[(j - j0) * N + n] = a->dlast ? lgather(a->dlast + (b * dim + d0) * N + n, N, nl) : (VEC){0};
    }
    for (i64 c = nch - 1; c >= 0; c--) {
        const i64 s = c * T, k = (s + T < L ? s + T : L) - s;
        memset(P, 0, sizeof(VEC) * 2 * N * k);
        for (i64 j = j0; j < j1; j++) lbwd_block(a, work, b, j, G + (j - j0) * N, c, k, N, bfm);
        /* the chunk's dC_t[n] (P rows 0..N-1) and dB_t[n] (rows N..2N-1): sums over the lanes */
        REAL *Pr = (REAL *)P;
        FN(lane_sums)(P, 2 * N * k, Pr);
        for (i64 i = 0; i < k; i++) {
            REAL *dCt = dCp + (s + i) * a->pC.t, *dBt = dBp + (s + i) * a->pB.t;
            for (i64 n = 0; n < N; n++) {
                dCt[n] += Pr[i * 2 * N + n];
                dBt[n] += Pr[i * 2 * N + N + n];
            }
        }
    }
}

/* X (dim, N) as nblk x N lane vectors: out[j * N + n] lane l = X[j * V + l, n] (zeros past dim) */
static void lanes_of(const Args *a, const REAL *X, VEC *out) {
    const i64 N = a->N;
    for (i64 j = 0; j < a->nblk; j++) {
        const int nl = (int)(a->dim - j * V < V ? a->dim - j * V : V);
        for (i64 n = 0; n < N; n++) out[j * N + n] = lgather(X + j * V * N + n, N, nl);
    }
}

static void *lfwd_range(void *p) {
    const Args *a = p;
    lanes_of(a, a->A2, (VEC *)a->work);
#if SPECIALIZE
    /* N (16, 8) and the bf16 mask (none, or a Mamba block's under autocast) as constants where it matters:
     * the compiler then drops the bf16 branches. Each copy costs build time (one with a runtime mask about
     * 0.7 s at -O2), so N 16 with another mask runs the generic copy; N 8 keeps one for any mask, whose
     * results then equal the fp32 copy's bit for bit (test_lane_path_bf16_inputs_equal_fp32_inputs_...) */
    if (a->N == 16 && !a->bfm)
        for (i64 i = a->lo; i < a->hi; i++) lfwd_item(a, i, 16, 0);
    else if (a->N == 8 && !a->bfm)
        for (i64 i = a->lo; i < a->hi; i++) lfwd_item(a, i, 8, 0);
    else if (a->N == 16 && a->bfm == BF_AUTOCAST_FWD) /* a Mamba block under bf16 autocast */
        for (i64 i = a->lo; i < a->hi; i++) lfwd_item(a, i, 16, BF_AUTOCAST_FWD);
    else if (a->N == 8)
        for (i64 i = a->lo; i < a->hi; i++) lfwd_item(a, i, 8, a->bfm);
    else
#endif
        for (i64 i = a->lo; i < a->hi; i++) lfwd_item(a, i, a->N, a->bfm);
    return NULL;
}

static void *lbwd_range(void *p) {
    const Args *a = p;
    const i64 N = a->N, dim = a->dim;
    VEC *A2T = (VEC *)a->work, *Alanes = A2T + a->nblk * N, *dAT = Alanes + a->nblk * N;
    lanes_of(a, a->A2, A2T);
    lanes_of(a, a->A, Alanes);
    memset(dAT, 0, sizeof(VEC) * a->nblk * N);
    /* blocks per group of B and of C (a group holds whole blocks) */
    const i64 gb = a->gsB >= a->dim ? a->nblk : a->gsB / V;
    const i64 gc = a->gsC >= a->dim ? a->nblk : a->gsC / V;
    /* one segment at a time: this thread's blocks of one batch row and one group */
    for (i64 i = a->lo; i < a->hi;) {
        const i64 b = i / a->nblk, j0 = i - b * a->nblk;
        i64 j1 = (j0 / gb + 1) * gb < (j0 / gc + 1) * gc ? (j0 / gb + 1) * gb : (j0 / gc + 1) * gc;
        if (j1 > a->nblk) j1 = a->nblk;
        if (b * a->nblk + j1 > a->hi) j1 = a->hi - b * a->nblk;
#if SPECIALIZE
        if (a->N == 16 && !a->bfm)
            lbwd_seg(a, b, j0, j1, 16, 0);
        else if (a->N == 8 && !a->bfm)
            lbwd_seg(a, b, j0, j1, 8, 0);
        else if (a->N == 16 && a->bfm == BF_AUTOCAST_BWD)
            lbwd_seg(a, b, j0, j1, 16, BF_AUTOCAST_BWD);
        else if (a->N == 8)
            lbwd_seg(a, b, j0, j1, 8, a->bfm);
        else
#endif
            lbwd_seg(a, b, j0, j1, a->N, a->bfm);
        i = b * a->nblk + j1;
    }
    REAL *dA = a->dA + a->th * dim * N; /* this thread's (dim, N) accumulator */
    for (i64 j = 0; j < a->nblk; j++)
        for (i64 l = 0; l < V && j * V + l < dim; l++)
            for (i64 n = 0; n < N; n++) dA[(j * V + l) * N + n] += dAT[j * N + n][l];
    return NULL;
}

/* the scan's items (sequences, or channel blocks on the lane path) over threads, `per` REALs of work each */
static int run(const Args *a, int nthreads, void *(*fn)(void *), i64 items, i64 per) {
    return run_parts(a, sizeof *a, nthreads, items, sizeof(REAL) * per, fn);
}

static Args unpack(const ScanArgs *s) {
    Args a = {0};
    a.batch = s->batch, a.dim = s->dim, a.L = s->L, a.N = s->N, a.T = s->T, a.softplus = s->softplus;
    a.delta = s->delta, a.bias = s->bias, a.u = s->u, a.z = s->z, a.D = s->D, a.A2 = s->A2, a.A = s->A;
    a.B = s->B, a.C = s->C, a.dlast = s->dlast, a.dout = s->dout;
    a.sdl = s->sdl, a.su = s->su, a.sz = s->sz, a.sB = s->sB, a.sC = s->sC, a.sy = s->sy, a.sdo = s->sdo;
    a.sdu = s->sdu, a.sdd = s->sdd, a.sdz = s->sdz, a.pB = s->pB, a.pC = s->pC;
    a.gsB = s->gsB, a.gsC = s->gsC;
    a.y = s->y, a.starts = s->starts, a.last = s->last, a.du = s->du, a.ddelta = s->ddelta, a.dz = s->dz;
    a.dA = s->dA, a.dB = s->dB, a.dC = s->dC, a.dD = s->dD, a.dbias = s->dbias;
    a.bfm = s->lanes ? (int)s->bfm : 0;
    a.nblk = (a.dim + V - 1) / V;
    return a;
}

int FN(scan_fwd)(const ScanArgs *s) {
    if (s->N < 1 || s->N > NMAX) return E_STATE; /* the kernels keep the state in REAL h[NMAX] */
    Args a = unpack(s);
    if (s->lanes) /* per thread: A2 as lane vectors */
        return run(&a, (int)s->nthreads, lfwd_range, a.batch * a.nblk, V * a.nblk * a.N);
    return run(&a, (int)s->nthreads, fwd_range, a.batch * a.dim, 10 * a.T + (2 * a.T + 1) * a.N);
}

int FN(scan_bwd)(const ScanArgs *s) {
    if (s->N < 1 || s->N > NMAX) return E_STATE;
    Args a = unpack(s);
    if (s->lanes) { /* per thread: A2, A, dA lanes; Hb, Ab, P (4T + 1 rows of N vectors), G, 4 chunk arrays */
        const i64 per = V * ((4 * a.T + 1) * a.N + 4 * a.nblk * a.N + 4 * a.T);
        return run(&a, (int)s->nthreads, lbwd_range, a.batch * a.nblk, per);
    }
    return run(&a, (int)s->nthreads, bwd_range, a.batch * a.dim, 10 * a.T + (2 * a.T + 1) * a.N);
}

int FN(scan_lanes)(void) { return V; }

/* ---- the conv (see ConvArgs): items are batch rows; every loop over d vectorises */

typedef struct {
    struct {
        PART_FIELDS; /* work: the pre-activation (dim), then backward's gradient of it (L, dim) */
    };
    i64 batch, L, dim, K, sx_b, sx_t;
    const REAL *x, *w, *bias, *gu;
    REAL *u, *gx, *gw, *gb;
} Conv;

INLINE void conv_pre(const Conv *a, i64 b, i64 t, REAL *pre) {
    const i64 dim = a->dim, K = a->K;
    for (i64 d = 0; d < dim; d++) pre[d] = a->bias ? a->bias[d] : 0;
    for (i64 k = 0; k < K; k++) {
        const i64 ts = t - K + 1 + k;
        if (ts < 0) continue;
        const REAL *xr = a->x + b * a->sx_b + ts * a->sx_t;
        #pragma omp simd
        for (i64 d = 0; d < dim; d++) pre[d] += a->w[k * dim + d] * xr[d];
    }
}

/* -O3 as the sequence path (-O2: the conv's forward 1.5x slower) */
__attribute__((optimize("O3"))) static void *conv_fwd_range(void *p) {
    const Conv *a = p;
    const i64 dim = a->dim;
    REAL *pre = a->work;
    for (i64 b = a->lo; b < a->hi; b++)
        for (i64 t = 0; t < a->L; t++) {
            conv_pre(a, b, t, pre);
            REAL *ur = a->u + (b * a->L + t) * dim;
            #pragma omp simd
            for (i64 d = 0; d < dim; d++) ur[d] = pre[d] * SIGMOID(pre[d]);
        }
    return NULL;
}

__attribute__((optimize("O3"))) static void *conv_bwd_range(void *p) {
    const Conv *a = p;
    const i64 dim = a->dim, K = a->K, L = a->L;
    REAL *pre = a->work, *gp = pre + dim; /* gp: (L, dim) gradient of the pre-activation */
    REAL *gw = a->gw + a->th * dim * K, *gb = a->gb ? a->gb + a->th * dim : NULL;
    for (i64 b = a->lo; b < a->hi; b++) {
        for (i64 t = 0; t < L; t++) {
            conv_pre(a, b, t, pre);
            const REAL *gr = a->gu + (b * L + t) * dim;
            REAL *g = gp + t * dim;
            #pragma omp simd
            for (i64 d = 0; d < dim; d++) {
                const REAL s = SIGMOID(pre[d]);
                g[d] = gr[d] * s * (1 + pre[d] * (1 - s));
            }
            if (gb) {
                #pragma omp simd
                for (i64 d = 0; d < dim; d++) gb[d] += g[d];
            }
        }
        for (i64 t = 0; t < L; t++) {
            const REAL *xr = a->x + b * a->sx_b + t * a->sx_t;
            REAL *gxr = a->gx + (b * L + t) * dim;
            #pragma omp simd
            for (i64 d = 0; d < dim; d++) gxr[d] = 0;
            for (i64 k = 0; k < K; k++) {
                const i64 to = t + K - 1 - k; /* the output step that reads x[t] through tap k */
                if (to >= L) continue;
                const REAL *g = gp + to * dim;
                #pragma omp simd
                for (i64 d = 0; d < dim; d++) {
                    gxr[d] += a->w[k * dim + d] * g[d];
                    gw[k * dim + d] += g[d] * xr[d];
                }
            }
        }
    }
    return NULL;
}

/* the conv's batch rows over threads, `per` REALs of work each */
static int conv_run(const Conv *a, int nthreads, void *(*fn)(void *), i64 per) {
    return run_parts(a, sizeof *a, nthreads, a->batch, sizeof(REAL) * per, fn);
}

static Conv conv_unpack(const ConvArgs *s) {
    Conv a = {0};
    a.batch = s->batch, a.L = s->L, a.dim = s->dim, a.K = s->K, a.sx_b = s->sx_b, a.sx_t = s->sx_t;
    a.x = s->x, a.w = s->w, a.bias = s->bias, a.gu = s->gu, a.u = s->u, a.gx = s->gx, a.gw = s->gw;
    a.gb = s->gb;
    return a;
}

int FN(conv_fwd)(const ConvArgs *s) {
    Conv a = conv_unpack(s);
    return conv_run(&a, (int)s->nthreads, conv_fwd_range, a.dim);
}

int FN(conv_bwd)(const ConvArgs *s) {
    Conv a = conv_unpack(s);
    return conv_run(&a, (int)s->nthreads, conv_bwd_range, a.dim * (a.L + 1));
}

#undef PASTE_
#undef PASTE
#undef FN
#undef Args
#undef VecU
#undef EXP
#undef SIGMOID
#undef SOFTPLUS
#undef VEXP
#undef VSIGMOID
#undef VSOFTPLUS
#undef VSOFTPLUS_SIG
#undef gather
#undef recur
#undef fwd_item
#undef bwd_item
#undef fwd_range
#undef bwd_range
#undef lgather
#undef lscatter
#undef lat
#undef lst
#undef lfwd_item
#undef lbwd_block
#undef lbwd_seg
#undef lanes_of
#undef lfwd_range
#undef lbwd_range
#undef run
#undef unpack
#undef Conv
#undef conv_pre
#undef conv_fwd_range
#undef conv_bwd_range
#undef conv_run
#undef conv_unpack
