"""CPU stand-ins for the CUDA kernels' functions (same signatures as mamba_ssm's selective_scan_fn,
causal_conv1d_fn and flash_attn_func), for tests that fake a GPU (packages/core/tests/test_probes.py)."""

import torch.nn.functional as F
from memfit.ops import attention as A
from memfit.ops import registry
from memfit.ops import scan as ssm


def fake_scan(u, delta, A_, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, last=False):
    return ssm.selective_scan_ref(u, delta, A_, B, C, D, z, delta_bias, delta_softplus, last)


def fake_conv(x, weight, bias=None, activation=None):
    dim, width = weight.shape
    y = F.conv1d(x, weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype),
                 padding=width - 1, groups=dim)[..., : x.shape[-1]]  # fmt: skip
    return F.silu(y) if activation == "silu" else y


def fake_flash(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1)):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return A.attention_ref(q, k, v, window=window_size[0] + 1, scale=softmax_scale).transpose(1, 2)


# The registry's load specs of the CUDA kernels, and adapters from the functions above (the kernels' own
# signatures) to the registry's calling conventions.
KERNELS = {("scan", "mamba_ssm"), ("scan", "triton"), ("conv", "causal_conv1d"), ("attention", "flash")}
SPECS = {r.name: r.load for r in registry.RECORDS if (r.op, r.name) in KERNELS}


def _adapt(name, fn):
    if fn is None:
        return fn
    if name == "triton":  # selective_scan_triton's own signature
        return lambda u, delta, A_, B, C, D, z, bias, sp, last, chunk: fn(
            u, delta, A_, B, C, D, z, bias, sp, last, chunk_size=chunk
        )
    if name == "mamba_ssm":
        return lambda u, delta, A_, B, C, D, z, bias, sp, last, chunk: fn(
            u, delta, A_, B, C, D, z, bias, sp, last
        )
    if name == "causal_conv1d":
        from memfit.ops.conv import conv_layout

        return lambda x, w, b: fn(conv_layout(x), w.squeeze(1), b, activation="silu")
    return lambda q, k, v, window, scale: fn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True,
        window_size=(window - 1, 0),
    ).transpose(1, 2)  # fmt: skip


def install(monkeypatch, name, fn):
    """Make the registry see ``fn`` (a kernel's own signature; None: not installed) as kernel ``name``."""
    from memfit.ops import registry

    monkeypatch.setitem(registry._loaded, SPECS[name], _adapt(name, fn))


def fake_gpu(monkeypatch, cap=(8, 0)):
    """Real CPU tensors dispatched as CUDA tensors of a GPU of capability ``cap``; no kernel installed."""
    from memfit.ops import registry

    fake = registry._is_fake
    monkeypatch.setattr(registry, "device_type", lambda t: "cuda" if not fake(t) else t.device.type)
    monkeypatch.setattr(registry, "is_cuda", lambda t: not fake(t))
    monkeypatch.setattr(registry, "capability", lambda device: cap)
    for name in SPECS:
        install(monkeypatch, name, None)
