"""Fused region affinity aggregation in Triton: Y = norm(theta phi^T) g, forward and backward.

One program per image: the K x K affinity is built in registers from D-chunks of theta and phi,
normalised (count or softmax, padded columns dropped), and multiplied into g chunk by chunk, so it
never goes to memory. The backward recomputes it the same way (as flash attention does) and
produces d_theta, d_phi and d_g in one pass over D. K up to 128 fits one block (VSRN: 36, L2C: 9).

On CPU it runs only under TRITON_INTERPRET=1 (set before this module is imported); the
dispatcher in region_affinity.py uses the PyTorch reference there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_K = 128
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    if INTERPRET:  # the interpreter would "benchmark" every config at numpy speed
        return [triton.Config({"BLOCK_D": 32}, num_warps=4)]
    return [triton.Config({"BLOCK_D": d}, num_warps=w) for d in (32, 64, 128) for w in (4, 8)]


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _chunk(base, rows, d0, K, D, stride_k, BLOCK_D: tl.constexpr):
    """Offsets and bounds of the (BLOCK_K x BLOCK_D) tile of one image starting at column d0."""
    d = d0 + tl.arange(0, BLOCK_D)
    return base + rows[:, None] * stride_k + d[None, :], (rows < K)[:, None] & (d[None, :] < D)


@triton.jit
def _normalized_affinity(
    theta_ptr,
    phi_ptr,
    mask_ptr,
    base,
    base_mask,
    K,
    D,
    stride_k,
    HAS_MASK: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    """P (BLOCK_K x BLOCK_K, fp32) for one image, and its row/column validity."""
    rows = tl.arange(0, BLOCK_K)
    in_k = rows < K
    s = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs, ld = _chunk(base, rows, d0, K, D, stride_k, BLOCK_D)
        th = tl.load(theta_ptr + offs, mask=ld, other=0.0)
        ph = tl.load(phi_ptr + offs, mask=ld, other=0.0)
        s += _dot(th, tl.trans(ph), IEEE)
    if HAS_MASK:
        valid = tl.load(mask_ptr + base_mask + rows, mask=in_k, other=0) != 0
    else:
        valid = in_k
    col_ok = valid[None, :] & (rows[:, None] >= 0)
    if SOFTMAX:
        s = tl.where(col_ok, s, float("-inf"))
        row_max = tl.max(s, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e = tl.where(col_ok, tl.exp(s - row_max[:, None]), 0.0)
        total = tl.sum(e, axis=1)
        p = e / tl.where(total == 0.0, 1.0, total)[:, None]
    else:
        count = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
        p = tl.where(col_ok, s / count, 0.0)
    return p, valid


@triton.autotune(configs=_configs(), key=["K", "D"])
@triton.jit
def _forward_kernel(
    theta_ptr,
    phi_ptr,
    g_ptr,
    mask_ptr,
    out_ptr,
    K,
    D,
    stride_b,
    stride_k,
    stride_mb,
    HAS_MASK: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    base, base_mask = b * stride_b, b * stride_mb
    p, valid = _normalized_affinity(
        theta_ptr, phi_ptr, mask_ptr, base, base_mask, K, D, stride_k, HAS_MASK, SOFTMAX, BLOCK_K, BLOCK_D, IEEE
    )
    rows = tl.arange(0, BLOCK_K)
    for d0 in range(0, D, BLOCK_D):
        offs, ld = _chunk(base, rows, d0, K, D, stride_k, BLOCK_D)
        gg = tl.load(g_ptr + offs, mask=ld, other=0.0)
        y = tl.where(valid[:, None], _dot(p.to(gg.dtype), gg, IEEE), 0.0)  # padded regions receive nothing
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ld)


@triton.autotune(configs=_configs(), key=["K", "D"])
@triton.jit
def _backward_kernel(
    theta_ptr,
    phi_ptr,
    g_ptr,
    mask_ptr,
    dy_ptr,
    dtheta_ptr,
    dphi_ptr,
    dg_ptr,
    K,
    D,
    stride_b,
    stride_k,
    stride_mb,
    HAS_MASK: tl.constexpr,
    SOFTMAX: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    base, base_mask = b * stride_b, b * stride_mb
    p, valid = _normalized_affinity(
        theta_ptr, phi_ptr, mask_ptr, base, base_mask, K, D, stride_k, HAS_MASK, SOFTMAX, BLOCK_K, BLOCK_D, IEEE
    )
    rows = tl.arange(0, BLOCK_K)
    # dP = dY g^T, over D (rows of padded regions had their output zeroed: no gradient)
    dp = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs, ld = _chunk(base, rows, d0, K, D, stride_k, BLOCK_D)
        dy = tl.where(valid[:, None], tl.load(dy_ptr + offs, mask=ld, other=0.0), 0.0)
        gg = tl.load(g_ptr + offs, mask=ld, other=0.0)
        dp += _dot(dy, tl.trans(gg), IEEE)
    dp = tl.where(valid[:, None], dp, 0.0)
    col_ok = valid[None, :] & (rows[:, None] >= 0)
    if SOFTMAX:
        ds = p * (dp - tl.sum(dp * p, axis=1)[:, None])
    else:
        count = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
        ds = tl.where(col_ok, dp / count, 0.0)
    # d_theta = dS phi, d_phi = dS^T theta, d_g = P^T dY, chunk by chunk over D
    for d0 in range(0, D, BLOCK_D):
        offs, ld = _chunk(base, rows, d0, K, D, stride_k, BLOCK_D)
        th = tl.load(theta_ptr + offs, mask=ld, other=0.0)
        ph = tl.load(phi_ptr + offs, mask=ld, other=0.0)
        dy = tl.where(valid[:, None], tl.load(dy_ptr + offs, mask=ld, other=0.0), 0.0)
        tl.store(dtheta_ptr + offs, _dot(ds.to(ph.dtype), ph, IEEE).to(dtheta_ptr.dtype.element_ty), mask=ld)
        tl.store(dphi_ptr + offs, _dot(tl.trans(ds).to(th.dtype), th, IEEE).to(dphi_ptr.dtype.element_ty), mask=ld)
        tl.store(dg_ptr + offs, _dot(tl.trans(p).to(dy.dtype), dy, IEEE).to(dg_ptr.dtype.element_ty), mask=ld)


def _launch_args(theta: torch.Tensor, mask: torch.Tensor | None, normalize: str) -> dict:
    B, K, D = theta.shape
    if K > MAX_K:
        raise ValueError(f"the Triton region affinity handles up to {MAX_K} regions, got K={K}; use gcn_kernel=torch")
    return dict(
        K=K,
        D=D,
        stride_b=K * D,
        stride_k=D,
        stride_mb=K if mask is not None else 0,
        HAS_MASK=mask is not None,
        SOFTMAX=normalize == "softmax",
        BLOCK_K=max(16, triton.next_power_of_2(K)),
        IEEE=theta.dtype == torch.float32,  # fp32 in, fp32 math (no TF32 rounding)
    )


class RegionAffinityFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, theta, phi, g, mask, normalize):
        theta, phi, g = theta.contiguous(), phi.contiguous(), g.contiguous()
        mask_arg = mask.to(torch.int8).contiguous() if mask is not None else theta  # unused without HAS_MASK
        args = _launch_args(theta, mask, normalize)
        out = torch.empty_like(theta)
        _forward_kernel[(theta.shape[0],)](theta, phi, g, mask_arg, out, **args)
        ctx.save_for_backward(theta, phi, g, mask_arg)
        ctx.args = args
        return out

    @staticmethod
    def backward(ctx, dy):
        theta, phi, g, mask_arg = ctx.saved_tensors
        dtheta, dphi, dg = torch.empty_like(theta), torch.empty_like(phi), torch.empty_like(g)
        _backward_kernel[(theta.shape[0],)](theta, phi, g, mask_arg, dy.contiguous(), dtheta, dphi, dg, **ctx.args)
        return dtheta, dphi, dg, None, None


def region_affinity_triton(theta, phi, g, normalize: str = "count", mask=None):
    if not theta.shape == phi.shape == g.shape or theta.dim() != 3:
        raise ValueError(
            f"theta, phi, g must all be (B, K, D); got {tuple(theta.shape)}, {tuple(phi.shape)}, {tuple(g.shape)}"
        )
    if normalize not in ("count", "softmax"):
        raise ValueError(f"normalize must be 'count' or 'softmax', not {normalize!r}")
    return RegionAffinityFunction.apply(theta, phi, g, mask, normalize)
