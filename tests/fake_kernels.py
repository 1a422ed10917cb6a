"""CPU stand-ins for the CUDA kernels' functions (same signatures as mamba_ssm's selective_scan_fn,
causal_conv1d_fn and flash_attn_func), for tests that fake a GPU (packages/core/tests/test_probes.py)."""

import torch.nn.functional as F
from memfit.ops import attention as A
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
