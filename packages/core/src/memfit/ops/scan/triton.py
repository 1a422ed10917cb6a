"""Mamba-1 selective scan (``selective_scan_fn``'s semantics) as two Triton kernels, forward and backward.

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t        state (batch, dim, N), fp32
    y_t = <C_t, h_t> + D * u_t ;   out = y * silu(z)

u, delta, z: (batch, dim, L), any strides, fp32/bf16/fp16; A: (dim, N) real; D, delta_bias: (dim,); B and C
each one of (dim, N) shared over time, (batch, N, L) per step, or (batch, G, N, L) grouped (channel d in group
d // (dim // G)). ``delta_softplus`` applies torch's softplus (threshold 20) to delta + delta_bias. The output
has u's dtype, the last state is fp32, and the gradient of the last state propagates. fp64 is refused (route
it to memfit's own scan).

Kernels (see NOTES.md for the memory formulas)
----------------------------------------------
* Grid (cdiv(dim, BLOCK_D), batch): one program per batch row and block of BLOCK_D channels, sequential
  over L, the state h (BLOCK_D x NP, NP = next power of two >= N, masked) in registers in fp32. Every
  per-step load is issued one step ahead (register double buffering), so its latency overlaps the step
  before it: the loads never depend on the recurrence.
* Forward (``_scan_fwd_kernel``) writes out (u's dtype), the last state and ``states`` (batch,
  n_chunks - 1, dim, N) fp32: ``states[:, c]`` is the state LEAVING chunk c (= entering chunk c + 1) for
  c < n_chunks - 1. The state entering chunk 0 is zero and the one leaving the last chunk is the last
  state, so nothing is stored twice. Nothing of size batch*dim*L*N is kept.
* Backward (``_scan_bwd_kernel``), same grid, walks the chunks in reverse: recomputes the chunk's states
  from its boundary state into a per-program fp32 scratch of chunk x BLOCK_D x NP (allocated by the op,
  (batch, cdiv(dim, BLOCK_D), chunk, BLOCK_D, NP) in all, i.e. ~batch*dim*chunk*N*4 bytes), then runs
  g_t = C_t dy_t + exp(delta_{t+1} A) g_{t+1} backwards from the carried gradient (dlast for the last
  chunk). It writes du, ddelta, dz in their inputs' dtypes and accumulates dA, dB, dC, dD, ddelta_bias in
  fp32 buffers.
* Reductions: fp32 ``tl.atomic_add`` (relaxed) into zeroed fp32 buffers, not per-block partial buffers.
  Per-step/grouped dB and dC are sums over the channels of a group: each program first sums its BLOCK_D
  channels in registers, then adds one N-vector per step; partial buffers would cost
  cdiv(dim, BLOCK_D) x the (batch, G, L, N) gradient (hundreds of MB at Mamba sizes), the atomics need
  no memory beyond the gradient. dA, dD, ddelta_bias and shared dB/dC are accumulated in registers over
  the whole sequence and added once per program at the end (a batch-way reduction). Consequence: the float
  summation order of those gradients is not deterministic run to run on a GPU (differences at fp32
  rounding level).
  Grouped B/C need every channel block inside one group: BLOCK_D is lowered to a power of two dividing
  dim // G (1 in the worst case), so each block reads one N-vector of B/C per step.

Registration
------------
``memfit::triton_scan_fwd`` and ``memfit::triton_scan_bwd`` are ``torch.library.custom_op``s with
``register_fake``; each op's body and its fake implementation make their outputs with the same helper
(``_fwd_outputs``/``_bwd_outputs``), so FakeTensorMode, torch.compile and memfit's estimator see exactly
what the real op allocates; the backward's scratch is an op output too (dropped right after), so it is
visible to a storage-tracking estimator. ``torch.library.triton_op`` + ``wrap_triton`` was the preferred
choice but cannot run here: under TRITON_INTERPRET=1 ``triton.jit`` returns an ``InterpretedFunction``
and ``wrap_triton`` rejects it ("wrap_triton only works on functions annotated with triton.jit or
triton.autotune", torch 2.11 / triton 3.6), so the CPU tests could not exercise the op. One registration
for both modes keeps the tested path the shipped one; torch.compile treats the ops as opaque nodes, which
loses nothing for a sequential kernel. The ops carry ``needs_fixed_stride_order`` so compiled graphs pass
them the strides eager mode would.

Checked compiled on an NVIDIA H200 (triton 3.6, torch 2.11): the whole test file passes with
SCAN_TEST_DEVICE=cuda, fwd+bwd at batch 2, dim 384, L 300 is within 1.1e-6 (relative to each tensor's
max) of the fp32 reference for BLOCK_D 4/8/16, torch.compile(fullgraph=True) with inductor gives eager's
gradients, and Mamba's batch 4, dim 1536, L 2048, N 16 (bf16) runs fwd 0.92 ms, fwd+bwd 3.20 ms
(bench.py). ptxas (sm_90a, bf16, Mamba strides): forward 58 registers/thread at BLOCK_D 4, backward 166
(no spills); at BLOCK_D 16 the backward uses 255 with an 8-byte spill.

Loops are ``while`` loops: the interpreter cannot use a runtime scalar as a ``range`` bound (it calls
``int()`` on a 1-element array, an error with numpy 2), and ``while`` compiles to scf.while on GPUs.
Launch choices (BLOCK_D, num_warps, chunk) live in ``launch_config`` and ``default_chunk``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["selective_scan_triton", "launch_config", "default_chunk"]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_F32 = torch.float32


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _softplus(x):
    """torch's softplus: x above 20, else log1p(exp(x)); log1p(e) = log(w) * e / (w - 1) with w = 1 + e
    (Goldberg's trick: accurate for tiny e, where log(1 + e) would lose it)."""
    e = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + e
    den = tl.where(w == 1.0, 1.0, w - 1.0)
    lp = tl.where(w == 1.0, e, (tl.log2(w) * _LN2) * (e / den))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-tl.maximum(x, -80.0)))


# L, T and n_chunks are never specialised (an int argument equal to 1 would become a constexpr, and the
# loop counters made from them must be loop-carried tensors).
#
# Every value is a 2-D tile: per-channel values are (BLOCK_D, 1), per-state-entry vectors (1, NP), sums over
# N keep their axis. Loading the per-channel inputs as 1-D vectors made the compiler convert each of them
# to the state's layout every step (shared-memory round trips with barriers at BLOCK_D >= 8); as (BLOCK_D, 1)
# tiles they are loaded in a layout that broadcasts against the state directly.
@triton.jit(do_not_specialize=["L", "T", "n_chunks"])
def _scan_fwd_kernel(
    u_ptr, dl_ptr, z_ptr, out_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, states_ptr, last_ptr,
    dim, L, N, T, n_chunks,
    s_ub, s_ud, s_ut, s_lb, s_ld, s_lt, s_zb, s_zd, s_zt, s_ob, s_od, s_ot,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, dpg_B,
    s_Cb, s_Cg, s_Cn, s_Ct, dpg_C,
    BLOCK_D: tl.constexpr, NP: tl.constexpr, B_SHARED: tl.constexpr, C_SHARED: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
):  # fmt: skip
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d0 = pid_d * BLOCK_D
    d = d0 + tl.arange(0, BLOCK_D)[:, None]  # (BLOCK_D, 1)
    dm = d < dim
    n = tl.arange(0, NP)[None, :]  # (1, NP)
    nm = n < N
    m2 = dm & nm

    A = tl.load(A_ptr + d * s_Ad + n * s_An, mask=m2, other=0.0).to(tl.float32)
    Dv = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=dm, other=0.0).to(tl.float32)
    bv = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    if HAS_BIAS:
        bv = tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)

    u_p = u_ptr + b * s_ub + d * s_ud
    l_p = dl_ptr + b * s_lb + d * s_ld
    z_p = z_ptr + b * s_zb + d * s_zd
    o_p = out_ptr + b * s_ob + d * s_od
    # B/C: a (BLOCK_D, NP) tile loaded once when shared; else one N-vector per step (the block's group)
    B_p = B_ptr + b * s_Bb + (d0 // dpg_B) * s_Bg + n * s_Bn
    C_p = C_ptr + b * s_Cb + (d0 // dpg_C) * s_Cg + n * s_Cn
    Bm = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    if B_SHARED:
        Bm = tl.load(B_ptr + d * s_Bg + n * s_Bn, mask=m2, other=0.0).to(tl.float32)
    Cm = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    if C_SHARED:
        Cm = tl.load(C_ptr + d * s_Cg + n * s_Cn, mask=m2, other=0.0).to(tl.float32)

    # step 0's inputs; inside the loop, step t + 1's are loaded before step t is computed. The pointers
    # are loop-carried and advanced by one step each time (cheaper than t * stride in 64 bits per tensor).
    u_n = tl.load(u_p, mask=dm, other=0.0).to(tl.float32)
    l_n = tl.load(l_p, mask=dm, other=0.0).to(tl.float32)
    z_n = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    if HAS_Z:
        z_n = tl.load(z_p, mask=dm, other=0.0).to(tl.float32)
    B_n = tl.zeros([1, NP], dtype=tl.float32)
    if not B_SHARED:
        B_n = tl.load(B_p, mask=nm, other=0.0).to(tl.float32)
    C_n = tl.zeros([1, NP], dtype=tl.float32)
    if not C_SHARED:
        C_n = tl.load(C_p, mask=nm, other=0.0).to(tl.float32)

    h = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    t = L * 0  # tensors, also in the interpreter
    c = L * 0
    while c < n_chunks:
        e = tl.minimum(t + T, L)
        while t < e:
            u_c = u_n
            l_c = l_n
            z_c = z_n
            B_c = B_n
            C_c = C_n
            ok = t + 1 < L
            u_p += s_ut
            l_p += s_lt
            u_n = tl.load(u_p, mask=dm & ok, other=0.0).to(tl.float32)
            l_n = tl.load(l_p, mask=dm & ok, other=0.0).to(tl.float32)
            if HAS_Z:
                z_p += s_zt
                z_n = tl.load(z_p, mask=dm & ok, other=0.0).to(tl.float32)
            if not B_SHARED:
                B_p += s_Bt
                B_n = tl.load(B_p, mask=nm & ok, other=0.0).to(tl.float32)
            if not C_SHARED:
                C_p += s_Ct
                C_n = tl.load(C_p, mask=nm & ok, other=0.0).to(tl.float32)

            dt = l_c + bv
            if SOFTPLUS:
                dt = _softplus(dt)
            if B_SHARED:
                Bt = Bm
            else:
                Bt = B_c
            if C_SHARED:
                Ct = Cm
            else:
                Ct = C_c
            h = tl.exp2((dt * _LOG2E) * A) * h + (dt * u_c) * Bt
            y = tl.sum(h * Ct, axis=1, keep_dims=True)
            if HAS_D:
                y += Dv * u_c
            if HAS_Z:
                y = y * (z_c * _sigmoid(z_c))
            tl.store(o_p, y.to(out_ptr.dtype.element_ty), mask=dm)
            o_p += s_ot
            t += 1
        if c < n_chunks - 1:  # the state leaving chunk c
            tl.store(states_ptr + ((b * (n_chunks - 1) + c) * dim + d) * N + n, h, mask=m2)
        c += 1
    tl.store(last_ptr + (b * dim + d) * N + n, h, mask=m2)


@triton.jit(do_not_specialize=["L", "T", "n_chunks"])
def _scan_bwd_kernel(
    u_ptr, dl_ptr, z_ptr, go_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, states_ptr, dlast_ptr,
    du_ptr, ddl_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr, scr_ptr,
    dim, L, N, T, n_chunks,
    s_ub, s_ud, s_ut, s_lb, s_ld, s_lt, s_zb, s_zd, s_zt, s_gb, s_gd, s_gt,
    s_dub, s_dud, s_dut, s_dlb, s_dld, s_dlt, s_dzb, s_dzd, s_dzt,
    s_Ad, s_An,
    s_Bb, s_Bg, s_Bn, s_Bt, dpg_B,
    s_Cb, s_Cg, s_Cn, s_Ct, dpg_C,
    s_hb, s_hd, s_hn,
    s_dBb, s_dBg, s_dBn, s_dBt,
    s_dCb, s_dCg, s_dCn, s_dCt,
    BLOCK_D: tl.constexpr, NP: tl.constexpr, B_SHARED: tl.constexpr, C_SHARED: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DOUT: tl.constexpr, HAS_DLAST: tl.constexpr,
):  # fmt: skip
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d0 = pid_d * BLOCK_D
    d = d0 + tl.arange(0, BLOCK_D)[:, None]  # (BLOCK_D, 1)
    dm = d < dim
    n = tl.arange(0, NP)[None, :]  # (1, NP)
    nm = n < N
    m2 = dm & nm
    SSTEP: tl.constexpr = BLOCK_D * NP  # one step's state in the scratch

    A = tl.load(A_ptr + d * s_Ad + n * s_An, mask=m2, other=0.0).to(tl.float32)
    Dv = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=dm, other=0.0).to(tl.float32)
    bv = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    if HAS_BIAS:
        bv = tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)

    u_p = u_ptr + b * s_ub + d * s_ud
    l_p = dl_ptr + b * s_lb + d * s_ld
    z_p = z_ptr + b * s_zb + d * s_zd
    g_p = go_ptr + b * s_gb + d * s_gd
    du_p = du_ptr + b * s_dub + d * s_dud
    dl_o = ddl_ptr + b * s_dlb + d * s_dld
    dz_p = dz_ptr + b * s_dzb + d * s_dzd
    B_p = B_ptr + b * s_Bb + (d0 // dpg_B) * s_Bg + n * s_Bn
    C_p = C_ptr + b * s_Cb + (d0 // dpg_C) * s_Cg + n * s_Cn
    dB_p = dB_ptr + b * s_dBb + (d0 // dpg_B) * s_dBg + n * s_dBn
    dC_p = dC_ptr + b * s_dCb + (d0 // dpg_C) * s_dCg + n * s_dCn
    Bm = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    if B_SHARED:
        Bm = tl.load(B_ptr + d * s_Bg + n * s_Bn, mask=m2, other=0.0).to(tl.float32)
    Cm = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    if C_SHARED:
        Cm = tl.load(C_ptr + d * s_Cg + n * s_Cn, mask=m2, other=0.0).to(tl.float32)

    # gradient w.r.t. the state leaving the current chunk (from the chunks after it / dlast)
    gc = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    if HAS_DLAST:
        gc = tl.load(dlast_ptr + b * s_hb + d * s_hd + n * s_hn, mask=m2, other=0.0).to(tl.float32)
    dA_acc = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    dB_acc = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    dC_acc = tl.zeros([BLOCK_D, NP], dtype=tl.float32)
    dD_acc = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    zero_v = tl.zeros([BLOCK_D, 1], dtype=tl.float32)
    zero_n = tl.zeros([1, NP], dtype=tl.float32)

    scr = scr_ptr + (b * tl.num_programs(0) + pid_d) * T * SSTEP + (tl.arange(0, BLOCK_D)[:, None] * NP + n)
    st_base = states_ptr + (b * (n_chunks - 1) * dim + d) * N + n

    c = n_chunks - 1
    while c >= 0:
        s = c * T
        e = tl.minimum(s + T, L)
        # the state entering chunk c (zero for chunk 0)
        h0 = tl.load(st_base + tl.maximum(c - 1, 0).to(tl.int64) * dim * N, mask=m2 & (c > 0), other=0.0)

        # ---- recompute the chunk's states h_s .. h_{e-1} into the scratch
        sl = s.to(tl.int64)
        u_q = u_p + sl * s_ut
        l_q = l_p + sl * s_lt
        B_q = B_p + sl * s_Bt
        u_n = tl.load(u_q, mask=dm, other=0.0).to(tl.float32)
        l_n = tl.load(l_q, mask=dm, other=0.0).to(tl.float32)
        B_n = zero_n
        if not B_SHARED:
            B_n = tl.load(B_q, mask=nm, other=0.0).to(tl.float32)
        h = h0
        t = s
        while t < e:
            u_c = u_n
            l_c = l_n
            B_c = B_n
            ok = t + 1 < e
            u_q += s_ut
            l_q += s_lt
            u_n = tl.load(u_q, mask=dm & ok, other=0.0).to(tl.float32)
            l_n = tl.load(l_q, mask=dm & ok, other=0.0).to(tl.float32)
            if not B_SHARED:
                B_q += s_Bt
                B_n = tl.load(B_q, mask=nm & ok, other=0.0).to(tl.float32)
            dt = l_c + bv
            if SOFTPLUS:
                dt = _softplus(dt)
            if B_SHARED:
                Bt = Bm
            else:
                Bt = B_c
            h = tl.exp2((dt * _LOG2E) * A) * h + (dt * u_c) * Bt
            tl.store(scr + (t - s) * SSTEP, h)
            t += 1
        tl.debug_barrier()  # the scratch is read back below, possibly by other threads of the program

        # ---- reverse pass over the chunk: step t needs h_t (carried) and h_{t-1} (scratch, or h0).
        # Pointers (loop-carried, stepped back once per step): the loads' point at the step prefetched,
        # the stores' at the step computed.
        t = e - 1
        tl_ = t.to(tl.int64)
        u_q = u_p + tl_ * s_ut
        l_q = l_p + tl_ * s_lt
        z_q = z_p + tl_ * s_zt
        g_q = g_p + tl_ * s_gt
        B_q = B_p + tl_ * s_Bt
        C_q = C_p + tl_ * s_Ct
        du_q = du_p + tl_ * s_dut
        dl_q = dl_o + tl_ * s_dlt
        dz_q = dz_p + tl_ * s_dzt
        dB_q = dB_p + tl_ * s_dBt
        dC_q = dC_p + tl_ * s_dCt
        u_n = tl.load(u_q, mask=dm, other=0.0).to(tl.float32)
        l_n = tl.load(l_q, mask=dm, other=0.0).to(tl.float32)
        z_n = zero_v
        if HAS_Z:
            z_n = tl.load(z_q, mask=dm, other=0.0).to(tl.float32)
        g_n = zero_v
        if HAS_DOUT:
            g_n = tl.load(g_q, mask=dm, other=0.0).to(tl.float32)
        B_n = zero_n
        if not B_SHARED:
            B_n = tl.load(B_q, mask=nm, other=0.0).to(tl.float32)
        C_n = zero_n
        if not C_SHARED:
            C_n = tl.load(C_q, mask=nm, other=0.0).to(tl.float32)
        hp_n = tl.load(scr + tl.maximum(t - 1 - s, 0) * SSTEP, mask=m2 & (t > s), other=0.0)
        hp_n = tl.where(t > s, hp_n, h0)
        h_c = h
        while t >= s:
            u_c = u_n
            l_c = l_n
            z_c = z_n
            go_c = g_n
            B_c = B_n
            C_c = C_n
            hp_c = hp_n
            t1 = t - 1
            ok = t1 >= s
            u_q -= s_ut
            l_q -= s_lt
            u_n = tl.load(u_q, mask=dm & ok, other=0.0).to(tl.float32)
            l_n = tl.load(l_q, mask=dm & ok, other=0.0).to(tl.float32)
            if HAS_Z:
                z_q -= s_zt
                z_n = tl.load(z_q, mask=dm & ok, other=0.0).to(tl.float32)
            if HAS_DOUT:
                g_q -= s_gt
                g_n = tl.load(g_q, mask=dm & ok, other=0.0).to(tl.float32)
            if not B_SHARED:
                B_q -= s_Bt
                B_n = tl.load(B_q, mask=nm & ok, other=0.0).to(tl.float32)
            if not C_SHARED:
                C_q -= s_Ct
                C_n = tl.load(C_q, mask=nm & ok, other=0.0).to(tl.float32)
            hp_n = tl.load(scr + tl.maximum(t1 - 1 - s, 0) * SSTEP, mask=m2 & (t1 > s), other=0.0)
            hp_n = tl.where(t1 > s, hp_n, h0)

            raw = l_c + bv
            dt = raw
            if SOFTPLUS:
                dt = _softplus(raw)
            if B_SHARED:
                Bt = Bm
            else:
                Bt = B_c
            if C_SHARED:
                Ct = Cm
            else:
                Ct = C_c
            decay = tl.exp2((dt * _LOG2E) * A)

            dy = go_c
            if HAS_Z:
                y = tl.sum(h_c * Ct, axis=1, keep_dims=True)
                if HAS_D:
                    y += Dv * u_c
                sz = _sigmoid(z_c)
                dz = dy * y * sz * (1.0 + z_c * (1.0 - sz))
                tl.store(dz_q, dz.to(dz_ptr.dtype.element_ty), mask=dm)
                dz_q -= s_dzt
                dy = dy * z_c * sz
            du = zero_v
            if HAS_D:
                dD_acc += dy * u_c
                du = dy * Dv
            dCt = dy * h_c
            if C_SHARED:
                dC_acc += dCt
            else:
                tl.atomic_add(dC_q, tl.sum(dCt, axis=0, keep_dims=True), mask=nm, sem="relaxed")
                dC_q -= s_dCt

            g = gc + Ct * dy  # gradient w.r.t. h_t
            W = tl.sum(g * Bt, axis=1, keep_dims=True)
            dtu = dt * u_c
            du += W * dt
            ddt = W * u_c
            dBt = g * dtu
            if B_SHARED:
                dB_acc += dBt
            else:
                tl.atomic_add(dB_q, tl.sum(dBt, axis=0, keep_dims=True), mask=nm, sem="relaxed")
                dB_q -= s_dBt
            P = g * hp_c * decay  # gradient w.r.t. delta_t * A
            ddt += tl.sum(P * A, axis=1, keep_dims=True)
            dA_acc += P * dt
            if SOFTPLUS:
                ddt = ddt * tl.where(raw > 20.0, 1.0, _sigmoid(raw))
            if HAS_BIAS:
                db_acc += ddt
            tl.store(du_q, du.to(du_ptr.dtype.element_ty), mask=dm)
            tl.store(dl_q, ddt.to(ddl_ptr.dtype.element_ty), mask=dm)
            du_q -= s_dut
            dl_q -= s_dlt
            gc = decay * g  # gradient w.r.t. h_{t-1} through the recurrence
            h_c = hp_c
            t = t1
        tl.debug_barrier()  # the next chunk's recompute overwrites the scratch
        c -= 1

    tl.atomic_add(dA_ptr + d * N + n, dA_acc, mask=m2, sem="relaxed")
    if B_SHARED:
        tl.atomic_add(dB_ptr + d * s_dBg + n * s_dBn, dB_acc, mask=m2, sem="relaxed")
    if C_SHARED:
        tl.atomic_add(dC_ptr + d * s_dCg + n * s_dCn, dC_acc, mask=m2, sem="relaxed")
    if HAS_D:
        tl.atomic_add(dD_ptr + d, dD_acc, mask=dm, sem="relaxed")
    if HAS_BIAS:
        tl.atomic_add(dbias_ptr + d, db_acc, mask=dm, sem="relaxed")


# ----------------------------------------------------------------------------------------------------
# Launch choices (tune these on a GPU)
# ----------------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200; also what the interpreter (CPU) plans for, so results match the GPU's


def launch_config(batch: int, dim: int, N: int, group_size: int | None = None, n_sm: int = 132):
    """(BLOCK_D, num_warps) for a (batch, dim, N) scan.

    The kernels are latency/issue-bound (one dependent chain of exp2/FMA/reductions per step, one warp per
    program), so what matters is how many programs each SM interleaves. BLOCK_D is the largest of 16, 8, 4
    that still leaves 8 programs per SM (batch * cdiv(dim, BLOCK_D) >= 8 * n_sm), else 4. Larger blocks
    mean fewer dB/dC atomics (one N-vector per block and step) but fewer programs in flight.
    Measured on an H200 (bench.py, fwd+bwd, bf16, per-step B/C): Mamba's batch 4, dim 1536, L 2048 took
    3.20 ms at BLOCK_D 4 (1536 programs), 3.68 at 8, 3.42 at 16; mbsnet's batch 180, dim 128, L 200 about
    1.0 ms at 16 (1440 programs) and at 8; at dim 64 all of 4, 8, 16 were within 2% (1.08 ms).
    One warp up to 256 state entries per program keeps the sums over N and over channels inside a warp
    (the backward uses ~128 registers a thread at BLOCK_D 4, N 16, no spills).
    ``group_size``: channels per B/C group when B/C are grouped; BLOCK_D is lowered to a power of two
    dividing it (every block must read one group's B/C)."""
    NP = _next_pow2(N)
    bd = 16
    while bd > 4 and batch * triton.cdiv(dim, bd) < 8 * n_sm:
        bd //= 2
    bd = min(bd, _next_pow2(dim))
    if group_size is not None:
        while group_size % bd:
            bd //= 2
    num_warps = max(1, min(4, bd * NP // 256))
    return bd, num_warps


def default_chunk(L: int) -> int:
    """Steps per chunk: the power of two nearest sqrt(L), in [4, 64] (at most L). The forward keeps one
    state per chunk, the backward's scratch holds one chunk per program: their sum, (L/T + T) states of
    the whole batch, is least at T = sqrt(L). Mamba's L 2048 -> 64, mbsnet's L ~200 -> 16 and its
    cross-band L 30 -> 4 (16 there made the scratch 16 states of 1,200 sequences: 225 MiB of mbsnet's
    0.70 GiB CUDA step, estimated; 4 keeps 7 + 4 states instead of 1 + 16)."""
    T = 1 << round(math.log2(max(1.0, math.sqrt(L))))
    return max(1, min(L, max(4, min(64, T))))


# ----------------------------------------------------------------------------------------------------
# Host side: layouts, strides, the ops
# ----------------------------------------------------------------------------------------------------


def _new_bdl(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (batch, dim, L) tensor laid out like x: a transposed (batch, L, dim) tensor when x's
    channel stride is 1 (a Mamba block's activations: the per-step stores are coalesced), else
    contiguous."""
    batch, dim, L = x.shape
    if dim > 1 and x.stride(1) == 1:
        return x.new_empty((batch, L, dim), dtype=dtype).transpose(1, 2)
    return x.new_empty((batch, dim, L), dtype=dtype)


def _bc_form(X: torch.Tensor, dim: int) -> tuple:
    """(shared, strides (b, g, n, t), channels per group) of B or C. Shared (dim, N): the 'group' axis is
    the channel; per step (batch, N, L): one group of all channels."""
    if X.dim() == 2:
        return True, (0, X.stride(0), X.stride(1), 0), 1
    if X.dim() == 3:
        return False, (X.stride(0), 0, X.stride(1), X.stride(2)), dim
    return False, tuple(X.stride()), dim // X.shape[1]


def _bc_grad_buffer(X: torch.Tensor, batch: int, L: int) -> torch.Tensor:
    """fp32 accumulator for dB/dC, N contiguous: (dim, N) shared, (batch, L, N) per step, (batch, G, L, N)
    grouped."""
    if X.dim() == 2:
        return X.new_zeros(X.shape, dtype=_F32)
    if X.dim() == 3:
        return X.new_zeros((batch, L, X.shape[1]), dtype=_F32)
    return X.new_zeros((batch, X.shape[1], L, X.shape[2]), dtype=_F32)


def _bc_grad_strides(buf: torch.Tensor) -> tuple:
    """(b, g, n, t) strides of a _bc_grad_buffer (shared: g is the channel)."""
    if buf.dim() == 2:
        return 0, buf.stride(0), buf.stride(1), 0
    if buf.dim() == 3:
        return buf.stride(0), 0, buf.stride(2), buf.stride(1)
    return buf.stride(0), buf.stride(1), buf.stride(3), buf.stride(2)


def _bc_grad(buf: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A _bc_grad_buffer as X's gradient (X's shape and dtype)."""
    g = buf if buf.dim() == 2 else buf.transpose(-1, -2)
    return g if g.dtype == X.dtype else g.to(X.dtype)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """Stands for an absent optional output (ops cannot return None)."""
    return like.new_empty(0, dtype=_F32)


def _opt(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.dim() == 1 and t.numel() == 0 else t


def _fwd_outputs(u: torch.Tensor, N: int, chunk: int):
    """(out (batch, dim, L) in u's dtype and layout, states (batch, n_chunks - 1, dim, N) fp32: the state
    leaving each chunk but the last, last (batch, dim, N) fp32)."""
    batch, dim, L = u.shape
    out = _new_bdl(u, u.dtype)
    states = u.new_empty((batch, triton.cdiv(L, chunk) - 1, dim, N), dtype=_F32)
    last = u.new_empty((batch, dim, N), dtype=_F32)
    return out, states, last


def _bwd_outputs(u, delta, z, A, B, C, D, delta_bias, chunk: int, block_d: int):
    """(du, ddelta, dz in their inputs' dtypes and layouts; dA (dim, N), dB, dC (_bc_grad_buffer), dD,
    ddelta_bias (dim,), all fp32 and zeroed (atomic accumulators); the kernel's scratch (batch,
    cdiv(dim, block_d), chunk, block_d, NP) fp32). Absent ones (no z, D, delta_bias) are empty."""
    batch, dim, L = u.shape
    N = A.shape[1]
    du = _new_bdl(u, u.dtype)
    ddelta = _new_bdl(delta, delta.dtype)
    dz = _new_bdl(z, z.dtype) if z is not None else _empty(u)
    dA = u.new_zeros((dim, N), dtype=_F32)
    dB = _bc_grad_buffer(B, batch, L)
    dC = _bc_grad_buffer(C, batch, L)
    dD = u.new_zeros((dim,), dtype=_F32) if D is not None else _empty(u)
    dbias = u.new_zeros((dim,), dtype=_F32) if delta_bias is not None else _empty(u)
    scratch = u.new_empty((batch, triton.cdiv(dim, block_d), chunk, block_d, _next_pow2(N)), dtype=_F32)
    return du, ddelta, dz, dA, dB, dC, dD, dbias, scratch


def _common_meta(u, A, B, C, D, z, delta_bias, softplus, block_d):
    batch, dim, L = u.shape
    N = A.shape[1]
    B_shared, sB, dpg_B = _bc_form(B, dim)
    C_shared, sC, dpg_C = _bc_form(C, dim)
    meta = dict(
        BLOCK_D=block_d, NP=_next_pow2(N), B_SHARED=B_shared, C_SHARED=C_shared,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus),
    )  # fmt: skip
    return meta, (*sB, dpg_B), (*sC, dpg_C)


def _interpreted() -> bool:
    """Whether the kernels run under the Triton interpreter (TRITON_INTERPRET=1 when this module was
    imported): then they take CPU tensors."""
    return not isinstance(
        _scan_fwd_kernel, triton.runtime.JITFunction
    )  # the interpreter's InterpretedFunction


def _check_launchable(u: torch.Tensor) -> None:
    """Real (not fake) tensors the kernels can read: CUDA tensors compiled, CPU tensors interpreted."""
    if u.device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "selective_scan_triton: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before "
            "importing scan_triton); use memfit's selective_scan on the CPU"
        )


OP_TAGS = (torch.Tag.needs_fixed_stride_order,)


@torch.library.custom_op("memfit::triton_scan_fwd", mutates_args=(), tags=OP_TAGS)
def triton_scan_fwd(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None, delta_softplus: bool,
    chunk: int, block_d: int, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward: (out, states, last) as _fwd_outputs describes."""
    _check_launchable(u)
    batch, dim, L = u.shape
    N = A.shape[1]
    out, states, last = _fwd_outputs(u, N, chunk)
    meta, sB, sC = _common_meta(u, A, B, C, D, z, delta_bias, delta_softplus, block_d)
    zz = z if z is not None else u
    grid = (triton.cdiv(dim, block_d), batch)
    _scan_fwd_kernel[grid](
        u, delta, zz, out, A, B, C, D if D is not None else A, delta_bias if delta_bias is not None else A,
        states if states.numel() else last, last,
        dim, L, N, chunk, triton.cdiv(L, chunk),
        *u.stride(), *delta.stride(), *zz.stride(), *out.stride(),
        *A.stride(), *sB, *sC,
        num_warps=num_warps, **meta,
    )  # fmt: skip
    return out, states, last


@triton_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk, block_d, num_warps):
    return _fwd_outputs(u, A.shape[1], chunk)


@torch.library.custom_op("memfit::triton_scan_bwd", mutates_args=(), tags=OP_TAGS)
def triton_scan_bwd(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None, delta_softplus: bool,
    chunk: int, block_d: int, num_warps: int, states: torch.Tensor, dout: torch.Tensor | None,
    dlast: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:  # fmt: skip
    """Backward from the forward's ``states`` and the gradients of out and of the last state (None:
    zero): (du, ddelta, dz, dA, dB, dC, dD, ddelta_bias, scratch) as _bwd_outputs describes."""
    _check_launchable(u)
    batch, dim, L = u.shape
    N = A.shape[1]
    outs = _bwd_outputs(u, delta, z, A, B, C, D, delta_bias, chunk, block_d)
    du, ddelta, dz, dA, dB, dC, dD, dbias, scratch = outs
    meta, sB, sC = _common_meta(u, A, B, C, D, z, delta_bias, delta_softplus, block_d)
    zz = z if z is not None else u
    dzz = dz if z is not None else du
    go = dout if dout is not None else u
    hl = dlast if dlast is not None else dA  # a dummy pointer when absent (never read)
    s_hl = dlast.stride() if dlast is not None else (0, 0, 0)
    grid = (triton.cdiv(dim, block_d), batch)
    _scan_bwd_kernel[grid](
        u, delta, zz, go, A, B, C, D if D is not None else A, delta_bias if delta_bias is not None else A,
        states if states.numel() else dA, hl,
        du, ddelta, dzz, dA, dB, dC, dD if D is not None else dA, dbias if delta_bias is not None else dA,
        scratch,
        dim, L, N, chunk, triton.cdiv(L, chunk),
        *u.stride(), *delta.stride(), *zz.stride(), *go.stride(),
        *du.stride(), *ddelta.stride(), *dzz.stride(),
        *A.stride(), *sB, *sC, *s_hl,
        *_bc_grad_strides(dB), *_bc_grad_strides(dC),
        num_warps=num_warps, HAS_DOUT=dout is not None, HAS_DLAST=dlast is not None, **meta,
    )  # fmt: skip
    return outs


@triton_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk, block_d, num_warps, states, dout, dlast):
    return _bwd_outputs(u, delta, z, A, B, C, D, delta_bias, chunk, block_d)


# ----------------------------------------------------------------------------------------------------
# Autograd and the public function
# ----------------------------------------------------------------------------------------------------


def _same(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, x itself when it has it (a no-op ``to`` confuses dynamo's autograd.Function outputs)."""
    return x if x.dtype == dtype else x.to(dtype)


class _TritonScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, softplus, chunk, block_d, num_warps):
        with torch.autocast(device_type=u.device.type, enabled=False):
            out, states, last = torch.ops.memfit.triton_scan_fwd(
                u, delta, A, B, C, D, z, delta_bias, softplus, chunk, block_d, num_warps
            )
        ctx.cfg = (softplus, chunk, block_d, num_warps)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states)
        ctx.set_materialize_grads(False)
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, states = ctx.saved_tensors
        softplus, chunk, block_d, num_warps = ctx.cfg
        with torch.autocast(device_type=u.device.type, enabled=False):
            du, ddelta, dz, dA, dB, dC, dD, dbias, scratch = torch.ops.memfit.triton_scan_bwd(
                u, delta, A, B, C, D, z, delta_bias, softplus, chunk, block_d, num_warps, states, dout, dlast
            )
            del scratch
            dz, dD, dbias = _opt(dz), _opt(dD), _opt(dbias)
            grads = (
                du,
                ddelta,
                _same(dA, A.dtype),
                _bc_grad(dB, B),
                _bc_grad(dC, C),
                _same(dD, D.dtype) if D is not None else None,
                dz,
                _same(dbias, delta_bias.dtype) if delta_bias is not None else None,
            )
        return (*grads, None, None, None, None)


def _check_args(u, delta, A, B, C, D, z, delta_bias) -> tuple[int, int, int, int]:
    """The scan's shape checks (``memfit.ops.scan.ref.check_args``), and no fp64: the kernels compute in
    fp32 (memfit's other scans take fp64)."""
    from memfit.ops.scan.ref import check_args

    dims = check_args(u, delta, A, B, C, D, z, delta_bias)
    for t in (u, delta, z, A, B, C, D, delta_bias):
        if t is not None and t.dtype == torch.float64:
            raise TypeError("selective_scan_triton: fp64 is not supported (use memfit's scan for fp64)")
    return dims


def selective_scan_triton(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
    *, chunk_size=None, block_d=None,
):  # fmt: skip
    """Selective scan in Triton: u, delta (batch, dim, L) -> out (batch, dim, L) [, last (batch, dim, N)].

    Same arguments and result as mamba_ssm's ``selective_scan_fn`` (and memfit's ``selective_scan_ref``);
    the gradient of the last state propagates. ``chunk_size``: steps per chunk (None: ``default_chunk``);
    ``block_d``: channels per program, a power of two (None: ``launch_config``; with grouped B/C it must
    divide dim // groups). Inputs are used in their own dtypes (autocast is off inside).
    """
    batch, dim, L, N = _check_args(u, delta, A, B, C, D, z, delta_bias)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"selective_scan_triton: chunk_size must be a positive int, got {chunk_size!r}")
    chunk = min(L, chunk_size or default_chunk(L))
    groups = [dim // X.shape[1] for X in (B, C) if X.dim() == 4]
    group_size = math.gcd(*groups) if groups else None
    bd, num_warps = launch_config(batch, dim, N, group_size, _num_sms(u.device))
    if block_d is not None:
        if block_d < 1 or block_d & (block_d - 1) or (group_size is not None and group_size % block_d):
            raise ValueError(
                "selective_scan_triton: block_d must be a power of two dividing the group size, "
                f"got {block_d}"
            )
        bd = block_d
        num_warps = max(1, min(4, bd * _next_pow2(N) // 256))
    out, last = _TritonScan.apply(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk, bd, num_warps
    )
    return (out, last) if return_last_state else out


def scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size):
    """The registry's calling convention (``memfit.ops.registry``)."""
    return selective_scan_triton(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size=chunk_size
    )


def why_unavailable() -> str | None:
    """None when the kernels can run here (CUDA tensors compiled by Triton; CPU tensors only under the
    interpreter, which the registry never sends them to), else why not."""
    return None
