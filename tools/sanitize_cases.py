#!/usr/bin/env python3
"""Small cases of every kernel family and config kind, for tools/sanitize.sh (compute-sanitizer).

    python tools/sanitize_cases.py FAMILY [--case SUBSTRING] [--list]
    FAMILY: conv | relu | norm | syncbn | index_add | prelu | compare | backward | pool | all

Each case calls one igemm function once (one launch, or the two or three kernels that function is made of)
on a small problem and checks the result on the host against igemm.reference. Inputs are made on the host
and copied in (every input byte is initialised); outputs are fresh ``torch.empty`` tensors that the kernels
must write in full (initcheck flags the copy-back of any byte they leave unwritten), except dgrad's dx: initcheck
does not see the native dgrad's asynchronous stores (TMA and bulk copies: it flagged every byte of such a dx), so dx
is NaN-filled first and a byte left unwritten fails the comparison instead. Run it under
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so every tensor is its own allocation and memcheck sees its bounds.
Prints one line per case and ``sanitize_cases: all ok`` at the end; exits 1 if a case fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import igemm  # noqa: E402
from igemm import epilogues as ep  # noqa: E402
from igemm import reference  # noqa: E402
from igemm.reference.epilogue import apply_chain  # noqa: E402

TOL = {"float32": 1e-5, "tf32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}
RNG = np.random.default_rng(0)


# ------------------------------------------------------------------------------------------ helpers
def dev(a, dtype="float32", offset: int = 0):
    """A CUDA tensor holding ``a`` (converted on the host), ``offset`` elements into its allocation."""
    a = np.asarray(a)
    if a.dtype.kind == "f" and dtype in ("float16", "bfloat16", "float32"):
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(getattr(torch, dtype))
    else:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
    if offset:
        buf = torch.cat([torch.zeros(offset, dtype=t.dtype), t.reshape(-1)])
        return buf.cuda()[offset:].view(t.shape)
    return t.cuda()


def host(t) -> np.ndarray:
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return t.detach().cpu().double().numpy()
    return t.detach().cpu().numpy()


def randn(*shape):
    return RNG.standard_normal(shape)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    den = np.linalg.norm(ref.ravel())
    return float(np.linalg.norm((got - ref).ravel()) / (den if den > 0 else 1.0))


def close(got, ref, tol, what):
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol}"


def check_mask(mask, y_host, what):
    words = (y_host.size + 31) // 32
    m = host(mask).view(np.uint32)[:words]
    np.testing.assert_array_equal(m, reference.pack_mask(y_host > 0), err_msg=what)


def bn_vecs(K):
    return [dev(v) for v in (RNG.uniform(0.5, 1.5, K), RNG.standard_normal(K) * 0.2, RNG.standard_normal(K) * 0.2,
                             RNG.uniform(0.5, 2, K))]


# ------------------------------------------------------------------------------------------ conv
#: the persistent kernel with one consumer, 2 stages and 3 CTAs an SM (64x128 tiles)
_WS_CTAS = {"math": "wgmma_ws", "bm": 64, "wm": 1, "splits": 1, "bn": 128, "stages": 2, "ctas": 3}


def _conv(name, dtype, layout, xs, ws, stride=1, padding=0, chain=None, precision="strict", config=None,
          x_offset=0, residual_dtype=None, **plan_kw):
    x_np = randn(*xs)
    w_np = randn(*ws) / np.sqrt(np.prod(ws[1:]))
    x, w = dev(x_np, dtype, x_offset), dev(w_np, dtype)
    pre = reference.conv2d_im2col(host(x), host(w), stride, padding, 1, layout)
    K = ws[0]
    V = bn_vecs(K)
    res = dev(randn(*pre.shape), residual_dtype or dtype)
    ops = {"none": [], "bn_relu_mask": [ep.BatchNorm(*V), ep.ReLU(mask=True)],
           "bn_add_relu": [ep.BatchNorm(*V), ep.Add(res), ep.ReLU()],
           "bn_add_relu_mask": [ep.BatchNorm(*V), ep.Add(res), ep.ReLU(mask=True)],
           "bias_relu": [ep.Bias(V[1]), ep.ReLU()], "prelu_channel": [ep.PReLU(V[0] - 1.0)],
           "add_relu_mask": [ep.Add(res), ep.ReLU(mask=True)]}[chain or "none"]
    c = ep.chain(*ops)
    plan = igemm.Conv2dPlan(x.shape, w.shape, dtype, layout, stride, padding, epilogue=c if ops else None,
                            precision=precision, residual_dtype=residual_dtype if c.residual_op else None, options=igemm.Conv2dOptions(config=config, **plan_kw))
    spec = plan.spec(x_aligned=x_offset == 0)
    r = plan(x, w)
    y, mask = r if c.mask else (r, None)
    ref = apply_chain(pre, c, layout, residual=host(res) if c.residual_op else None)
    yh = host(y)
    close(yh, ref, TOL["tf32" if precision == "tf32" else dtype], name)
    if mask is not None:
        check_mask(mask, yh, name)
    return f"{spec.name()} splits={spec.splits} fuse_mask={spec.fuse_mask}"


from igemm.conv._rules import FFMA_CONFIG as FFMA  # noqa: E402  (the strict-fp32 FFMA kernel)

CONV = {
    "wgmma_fp16_nhwc_bn_relu_fused_mask": lambda: _conv("wgmma fp16", "float16", "NHWC", (2, 9, 9, 64), (128, 3, 3, 64),
                                                        padding=1, chain="bn_relu_mask"),
    "wgmma_bf16_nchw_residual": lambda: _conv("wgmma bf16", "bfloat16", "NCHW", (2, 32, 10, 10), (48, 32, 3, 3),
                                              padding=1, chain="bn_add_relu"),
    # the TMA loader (C % 64 == 0): 128-row tiles, a stride-2 odd map with an M tail; and the cp.async gather forced
    "tma_bf16_nhwc_bm128_stride2": lambda: _conv("TMA bf16", "bfloat16", "NHWC", (3, 13, 7, 128), (72, 3, 3, 128),
                                                 stride=2, padding=1, chain="bn_add_relu",
                                                 config={"bm": 128, "wm": 2}),
    "persistent_fp16_nhwc_mask": lambda: _conv("persistent fp16", "float16", "NHWC", (3, 9, 9, 64), (200, 3, 3, 64),
                                               padding=1, chain="bn_relu_mask",
                                               config={"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1, "bn": 64,
                                                       "stages": 3}),
    "persistent_fp16_nhwc_fused_mask": lambda: _conv("persistent fp16 regs", "float16", "NHWC", (2, 9, 7, 64),
                                                     (192, 3, 3, 64), padding=1, chain="add_relu_mask",
                                                     config={"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1,
                                                             "bn": 128, "stages": 3}),
    "streamk_fp16_nhwc_mask": lambda: _conv("stream-K fp16", "float16", "NHWC", (2, 7, 7, 256), (128, 3, 3, 256),
                                            padding=1, chain="bn_relu_mask",
                                            config={"bm": 64, "wm": 1, "bn": 64, "stages": 4, "streamk": 2}),
    "gather_fp16_nhwc_c64": lambda: _conv("gather fp16", "float16", "NHWC", (2, 9, 9, 64), (40, 3, 3, 64), padding=1,
                                          config={"load_a": "vec", "load_b": "vec"}),
    "mma_sync_fp16_nhwc": lambda: _conv("mma.sync fp16", "float16", "NHWC", (2, 8, 8, 32), (64, 3, 3, 32), padding=1,
                                        chain="bias_relu", config={"math": "tensorop"}),
    "mma_sync_bf16_nchw_split_k": lambda: _conv("mma.sync bf16 split", "bfloat16", "NCHW", (1, 64, 6, 6),
                                                (40, 64, 3, 3), padding=1, config={"math": "tensorop", "splits": 2}),
    "simt_fp32_nchw": lambda: _conv("simt fp32", "float32", "NCHW", (2, 16, 9, 9), (24, 16, 3, 3), padding=1,
                                    chain="prelu_channel", config={**FFMA, "splits": 1}),
    "simt_fp32_nhwc_split_k": lambda: _conv("simt fp32 split", "float32", "NHWC", (1, 6, 6, 32), (20, 3, 3, 32),
                                            padding=1, config={**FFMA, "splits": 3}),
    # strict fp32's default on Hopper, 3xTF32 on wgmma (Kred 144 and 288: the accumulators promoted after k-tiles 4,
    # 8, ... and at the end), and on mma.sync (the default elsewhere)
    "tf32x3_fp32_nchw": lambda: _conv("3xTF32 fp32", "float32", "NCHW", (2, 16, 9, 9), (24, 16, 3, 3), padding=1,
                                      chain="prelu_channel"),
    "tf32x3_fp32_nhwc_split_k": lambda: _conv("3xTF32 fp32 split", "float32", "NHWC", (1, 6, 6, 32), (20, 3, 3, 32),
                                              padding=1, config={"splits": 2}),
    "tf32x3_mma_sync_fp32_nhwc": lambda: _conv("3xTF32 mma.sync fp32", "float32", "NHWC", (2, 9, 9, 16),
                                               (24, 3, 3, 16), padding=1,
                                               config={"math": "tf32x3", "bm": 64, "wm": 2, "wn": 2}),
    "tf32_nhwc": lambda: _conv("tf32", "float32", "NHWC", (2, 8, 8, 16), (32, 3, 3, 16), padding=1, precision="tf32"),
    "split_k_fp16_nhwc_mask": lambda: _conv("split-K fp16", "float16", "NHWC", (1, 7, 7, 128), (64, 3, 3, 128),
                                            padding=1, chain="bn_relu_mask", config={"splits": 3}),
    "gather_c3_nhwc_7x7s2": lambda: _conv("gather C=3", "float16", "NHWC", (2, 17, 17, 3), (32, 7, 7, 3), stride=2,
                                          padding=3, chain="bn_relu_mask"),
    "patch_c3_nhwc_7x7s2": lambda: _conv("patch C=3", "float16", "NHWC", (2, 21, 48, 3), (64, 7, 7, 3), stride=2,
                                         padding=3, chain="bn_relu_mask", unfold="patch"),
    "unfused_mask_nchw": lambda: _conv("unfused mask", "float16", "NCHW", (2, 8, 7, 7), (16, 8, 3, 3), padding=1,
                                       chain="bn_relu_mask"),
    "residual_fp32_on_fp16": lambda: _conv("fp32 residual", "float16", "NHWC", (2, 5, 5, 16), (24, 3, 3, 16),
                                           padding=1, chain="add_relu_mask", residual_dtype="float32"),
    "misaligned_x_nhwc": lambda: _conv("misaligned x", "float16", "NHWC", (2, 6, 6, 16), (32, 3, 3, 16), padding=1,
                                       x_offset=1),
    # NCHW transpose path with 16-byte tiles (H*W % 8 == 0), the native NCHW gather, channel padding
    "transpose_vec_nchw_mask": lambda: _conv("transpose vec", "float16", "NCHW", (2, 64, 8, 8), (72, 64, 3, 3),
                                             padding=1, chain="bn_relu_mask"),
    "native_nchw_fp16": lambda: _conv("native NCHW", "float16", "NCHW", (2, 16, 8, 8), (24, 16, 3, 3), padding=1,
                                      nchw_path="native"),
    "padded_c3_nchw": lambda: _conv("padded C=3", "bfloat16", "NCHW", (2, 3, 17, 17), (32, 3, 7, 7), stride=2,
                                    padding=3, chain="bn_relu_mask", pad_channels=True),
    "padded_c3_nhwc": lambda: _conv("padded C=3", "float16", "NHWC", (2, 17, 17, 3), (32, 7, 7, 3), stride=2,
                                    padding=3, pad_channels=True),
    # the NCHW register epilogue (regsnchw): MN-major 1x1 in place with a fused mask, 1-pixel vectors (7x7),
    # the subsampled copy's pair loads (SUBVEC), the NCHW patch path; a deep reduction's residual L2 prefetch
    "regsnchw_mn_1x1_mask": lambda: _conv("regsnchw MN 1x1", "float16", "NCHW", (2, 64, 8, 8), (96, 64, 1, 1),
                                          chain="bn_relu_mask"),
    # 16-bit residuals staged in the C tile (cp.async, zero-filled tails, read and overwritten in place)
    "regsnchw_residual_mn_1x1_mask": lambda: _conv("regsnchw residual MN 1x1", "float16", "NCHW", (2, 64, 8, 8),
                                                   (96, 64, 1, 1), chain="add_relu_mask"),
    "regsnchw_residual_v1_persistent": lambda: _conv("regsnchw residual 7x7", "bfloat16", "NCHW", (2, 64, 7, 7),
                                                     (72, 64, 3, 3), padding=1, chain="bn_add_relu",
                                                     residual_dtype="float16",
                                                     config={"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1,
                                                             "bn": 128, "stages": 3}),
    "regsnchw_v1_prelu": lambda: _conv("regsnchw 7x7", "bfloat16", "NCHW", (2, 64, 7, 7), (72, 64, 3, 3), padding=1,
                                       chain="prelu_channel"),
    "regsnchw_mask_across_images": lambda: _conv("regsnchw mask words", "float16", "NCHW", (3, 64, 8, 12),
                                                 (72, 64, 3, 3), padding=1, chain="bn_relu_mask"),
    "subvec_nchw_1x1s2_mask": lambda: _conv("subsampled pairs", "float16", "NCHW", (2, 64, 16, 16), (128, 64, 1, 1),
                                            stride=2, chain="bn_relu_mask"),
    "patch_c3_nchw_mask": lambda: _conv("patch C=3 NCHW", "float16", "NCHW", (2, 3, 21, 48), (64, 3, 7, 7), stride=2,
                                        padding=3, chain="bn_relu_mask"),
    # the residual staged during the mainloop (a freed stage: NCHW as the C tile, built in place; the
    # persistent kernel's C tile before the mainloop) and the NCHW mask's byte stores (P*Q % 32 != 0)
    "regsnchw_residual_staged_mask_bytes": lambda: _conv("regsnchw staged residual", "float16", "NCHW",
                                                         (2, 64, 12, 12), (72, 64, 3, 3), padding=1,
                                                         chain="add_relu_mask", config={"bm": 128, "wm": 2}),
    "regsnchw_residual_staged_persistent": lambda: _conv("regsnchw staged residual persistent", "bfloat16", "NCHW",
                                                         (2, 64, 14, 14), (136, 64, 3, 3), padding=1,
                                                         chain="bn_add_relu",
                                                         config={"math": "wgmma_ws", "bm": 64, "wm": 2, "splits": 1,
                                                                 "bn": 128, "stages": 3}),
    # the persistent kernel with 3 CTAs an SM (its 16-bit C tile, a producer skipping B copies it holds; 5
    # column blocks: a CTA's block changes between its tiles), NHWC and NCHW read in place (MN-major A)
    "persistent_ctas_nhwc_mask": lambda: _conv("persistent 3 CTAs", "float16", "NHWC", (2, 16, 16, 64),
                                               (600, 1, 1, 64), chain="bn_relu_mask",
                                               config=_WS_CTAS),
    "persistent_ctas_nchw_mn_mask": lambda: _conv("persistent 3 CTAs NCHW", "bfloat16", "NCHW", (2, 64, 16, 16),
                                                  (256, 64, 1, 1), chain="bn_relu_mask",
                                                  config=_WS_CTAS),
    # the conv alone on it (the default for 1x1 convs of one or two k-tiles at 5-12 tiles an SM)
    "persistent_ctas_nhwc_plain": lambda: _conv("persistent 3 CTAs conv alone", "bfloat16", "NHWC", (2, 16, 16, 64),
                                                (600, 1, 1, 64), config=_WS_CTAS),
    "persistent_ctas_nchw_mn_plain": lambda: _conv("persistent 3 CTAs NCHW conv alone", "float16", "NCHW",
                                                   (2, 64, 16, 16), (256, 64, 1, 1),
                                                   config=_WS_CTAS),
    # two k-tiles with a residual: 2 CTAs an SM, 3 stages, the residual staged in the fp32 C tile's upper half
    "persistent_ctas2_nhwc_residual": lambda: _conv("persistent 2 CTAs residual", "float16", "NHWC", (2, 16, 16, 128),
                                                    (200, 1, 1, 128), chain="bn_add_relu_mask",
                                                    config={**_WS_CTAS, "stages": 3, "ctas": 2}),
    # 64-column tiles of 3-4 k-tiles (1x1 256->64 @56's default from 5 tiles an SM): 3 CTAs, 3 stages, with a
    # 16-bit residual (NHWC, staged) and an fp32 one (NCHW: x read in place as MN-major A; the shared-memory store)
    "persistent_ctas_64col_nhwc_residual": lambda: _conv("persistent 3 CTAs 64 columns residual", "float16", "NHWC",
                                                         (2, 12, 12, 256), (72, 1, 1, 256), chain="bn_add_relu_mask",
                                                         config={**_WS_CTAS, "bn": 64, "stages": 3}),
    "persistent_ctas_64col_nchw_res32": lambda: _conv("persistent 3 CTAs 64 columns fp32 residual", "bfloat16", "NCHW",
                                                      (2, 192, 16, 16), (64, 192, 1, 1), chain="bn_add_relu_mask",
                                                      config={**_WS_CTAS, "bn": 64, "stages": 3},
                                                      residual_dtype="float32"),
    "tma_deep_residual_prefetch": lambda: _conv("TMA residual prefetch", "float16", "NHWC", (2, 9, 9, 128),
                                                (64, 3, 3, 128), padding=1, chain="bn_add_relu"),
    # the width unfold (conv1's default for 16-bit): the unfold kernel, then the conv on its copies
    "unfold_c3_nchw_mask": lambda: _conv("unfold C=3", "bfloat16", "NCHW", (2, 3, 17, 17), (32, 3, 7, 7), stride=2,
                                         padding=3, chain="bn_relu_mask"),
    "unfold_c3_nhwc_misaligned": lambda: _conv("unfold C=3", "float16", "NHWC", (2, 17, 19, 3), (40, 7, 7, 3),
                                               stride=2, padding=3, x_offset=1),
    "unfold_fp32_split": lambda: _conv("unfold fp32", "float32", "NHWC", (2, 37, 41, 3), (16, 7, 7, 3), stride=2,
                                       padding=3, unfold=True),
}


# ------------------------------------------------------------------------------------------ relu
def _relu(n, dtype, offset):
    y_np = randn(n)
    y_np[::7] = 0.0
    y = dev(y_np, dtype, offset)
    m = igemm.relu_mask(y)
    check_mask(m, host(y), f"relu_mask n={n}")
    dy = dev(randn(n), dtype, offset)
    dx = igemm.relu_backward(dy, m)
    np.testing.assert_array_equal(host(dx), np.where(host(y) > 0, host(dy), 0.0))
    return f"n={n} {dtype} offset={offset}"


RELU = {
    "vec_fp16": lambda: _relu(4096 + 8, "float16", 0),
    "tail_fp32": lambda: _relu(1000 + 3, "float32", 0),
    "scalar_bf16": lambda: _relu(777, "bfloat16", 1),
}


# ------------------------------------------------------------------------------------------ norm
def _x_bn(N, C, HW, layout, dtype="float32", offset=0):
    x = randn(N, C, HW) * RNG.uniform(0.5, 2, (1, C, 1)) + RNG.uniform(-2, 2, (1, C, 1))
    if layout == "NHWC":
        x = np.moveaxis(x, 1, -1)
    return dev(x, dtype, offset)


def _stats(N, C, HW, layout, dtype="float32", offset=0):
    x = _x_bn(N, C, HW, layout, dtype, offset)
    mean, invstd = igemm.batch_norm_stats(x, 1e-5, layout)
    rm, rv, _ = reference.welford_stats(host(x), layout)
    np.testing.assert_allclose(host(mean), rm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(invstd), 1 / np.sqrt(rv + 1e-5), rtol=1e-4)
    from igemm import norm
    cfg = norm.reduction_config(layout, N, C, HW, x.element_size(), 16 if not offset else x.element_size(),
                                torch.cuda.get_device_properties(0).multi_processor_count)
    return f"S={cfg.S} V={cfg.vec} final={cfg.final} block_finalize={norm.finalize_per_block(C, cfg.S)}"


def _welford_f64():
    x = _x_bn(3, 5, 49, "NCHW")
    outs = tuple(torch.empty(5, dtype=torch.float64, device="cuda") for _ in range(3))
    m, v, n = igemm.welford(x, out=outs)
    rm, rv, rn = reference.welford_stats(host(x))
    np.testing.assert_allclose(host(m), rm, rtol=1e-5)
    np.testing.assert_allclose(host(v), rv, rtol=1e-5)
    np.testing.assert_array_equal(host(n), rn)


def _bn_relu(layout, dtype, residual):
    N, C, HW = 2, 24, 49
    x = _x_bn(N, C, HW, layout, dtype)
    mean, invstd = dev(RNG.standard_normal(C)), dev(RNG.uniform(0.5, 2, C))
    g, b = dev(RNG.uniform(0.5, 1.5, C)), dev(RNG.standard_normal(C) * 0.2)
    r = dev(randn(*x.shape), dtype) if residual else None
    y, mask = igemm.batch_norm_relu(x, mean, invstd, g, b, r, layout=layout)
    ref = reference.batch_norm_elemt_ref(host(x), host(mean), host(invstd), host(g), host(b), layout,
                                         host(r) if residual else None, relu=True)
    close(host(y), ref, TOL[dtype], "batch_norm_relu")
    check_mask(mask, host(y), "batch_norm_relu mask")


def _bn_backward(layout, dtype):
    N, C, HW = 4, 16, 49
    x = _x_bn(N, C, HW, layout, dtype)
    dy = dev(randn(*x.shape), dtype)
    mean, invstd = dev(RNG.standard_normal(C) * 0.1), dev(RNG.uniform(0.5, 2, C))
    g = dev(RNG.uniform(0.5, 1.5, C))
    mask = igemm.relu_mask(dev(randn(*x.shape), dtype))
    sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mask, layout=layout)
    ref = reference.batch_norm_backward_reduce_ref(host(dy), host(x), host(mean), host(invstd), layout,
                                                   host(mask).view(np.uint32))
    for got, want in zip((sdy, sdx, gw, gb), ref):
        np.testing.assert_allclose(host(got), want, rtol=1e-4, atol=1e-3)
    dx, dres = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, N * HW, mask=mask, layout=layout,
                                               residual_grad=True)
    ref_dx = reference.batch_norm_backward_elemt_ref(host(dy), host(x), host(mean), host(invstd), host(g), host(sdy),
                                                     host(sdx), N * HW, layout, host(mask).view(np.uint32))
    close(host(dx), ref_dx, TOL[dtype], "backward_elemt")
    np.testing.assert_array_equal(host(dres), host(igemm.relu_backward(dy, mask)))


def _gather():
    W, C = 4, 37
    means, vars_ = RNG.standard_normal((W, C)), RNG.uniform(0.1, 2, (W, C))
    counts = np.array([3, 0, 5, 7], np.int64)
    m, v, n = igemm.batch_norm_gather_stats(dev(means, "float64"), dev(vars_, "float64"), dev(counts, "int64"))
    rm, rv, rn = reference.chan_merge(means, vars_, counts)
    np.testing.assert_allclose(host(m), rm, rtol=1e-12)
    np.testing.assert_allclose(host(v), rv, rtol=1e-10)


def _empty_batch():
    x = torch.empty(0, 3, 4, 4, device="cuda")
    mean, invstd = igemm.batch_norm_stats(x, 0.25)
    assert host(invstd).tolist() == [2.0] * 3 and host(mean).tolist() == [0.0] * 3


NORM = {
    "stats_nchw_one_kernel": lambda: _stats(2, 3, 49, "NCHW"),
    "stats_nchw_two_kernels": lambda: _stats(8, 4, 4096, "NCHW"),
    "stats_nchw_block_finalize_fp16": lambda: _stats(64, 2, 12544, "NCHW", "float16"),
    "stats_nhwc_two_kernels_bf16": lambda: _stats(16, 64, 49, "NHWC", "bfloat16"),
    "stats_nhwc_misaligned": lambda: _stats(4, 5, 9, "NHWC", "float32", 1),
    "welford_fp64_out": _welford_f64,
    "bn_relu_nhwc_fp16_residual": lambda: _bn_relu("NHWC", "float16", True),
    "bn_relu_nchw_fp32": lambda: _bn_relu("NCHW", "float32", False),
    "backward_nchw_fp16_mask": lambda: _bn_backward("NCHW", "float16"),
    "backward_nhwc_fp32_mask": lambda: _bn_backward("NHWC", "float32"),
    "gather_stats": _gather,
    "empty_batch": _empty_batch,
}


def _sync_stats():
    x = _x_bn(3, 6, 25, "NCHW", "float16")
    m, i, n = igemm.sync_batch_norm_stats(x, 1e-5, return_count=True)
    rm, rv, rn = reference.welford_stats(host(x))
    np.testing.assert_allclose(host(m), rm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host(i), 1 / np.sqrt(rv + 1e-5), rtol=1e-4)


def _sync_reduce():
    x = _x_bn(3, 6, 25, "NHWC", "float32")
    dy = dev(randn(*x.shape))
    mean, invstd = dev(RNG.standard_normal(6) * 0.1), dev(RNG.uniform(0.5, 2, 6))
    got = igemm.sync_batch_norm_backward_reduce(dy, x, mean, invstd, layout="NHWC")
    ref = reference.batch_norm_backward_reduce_ref(host(dy), host(x), host(mean), host(invstd), "NHWC")
    for a, b in zip(got, ref):
        np.testing.assert_allclose(host(a), b, rtol=1e-4, atol=1e-4)


SYNCBN = {"stats_local": _sync_stats, "backward_reduce_local": _sync_reduce}


# ------------------------------------------------------------------------------------------ index_add
def _index_add(shape, dim, n, dtype="float32", deterministic=False, bad=False):
    x_np = randn(*shape)
    sshape = list(shape)
    sshape[dim] = n
    src_np = randn(*sshape)
    idx = RNG.integers(0, shape[dim], n)
    x, src, index = dev(x_np, dtype), dev(src_np, dtype), dev(idx, "int64")
    if bad:
        index[n // 2] = shape[dim]
        x0 = host(x)
        try:
            igemm.index_add(x, dim, index, src)
        except IndexError:
            np.testing.assert_array_equal(host(x), x0)
            return "IndexError raised, x unchanged"
        raise AssertionError("no IndexError")
    ref = reference.index_add(host(x), dim, idx, host(src))
    igemm.index_add(x, dim, index, src, deterministic=deterministic)
    close(host(x), ref, TOL[dtype] * 3, "index_add")


INDEX_ADD = {
    "many_fp32": lambda: _index_add((40, 33), 0, 100),
    "many_fp16_vec": lambda: _index_add((3, 20, 64), 1, 50, "float16"),
    "few_wide_columns": lambda: _index_add((4, 135169), 0, 3),
    "deterministic_sweep": lambda: _index_add((9, 40), 0, 3, deterministic=True),
    "deterministic_sort_bf16": lambda: _index_add((30, 256), 0, 300, "bfloat16", deterministic=True),
    "bad_index_check_kernel": lambda: _index_add((12, 8), 0, 20, bad=True),
}


# ------------------------------------------------------------------------------------------ prelu
def _prelu(shape, layout, alpha_kind, dtype="float32", offset=0):
    x = dev(randn(*shape), dtype, offset)
    C = shape[1] if layout == "NCHW" else shape[-1]
    if alpha_kind == "number":
        alpha, a_ref = -0.3, np.array([float(torch.tensor(-0.3).to(getattr(torch, dtype)))])
    else:
        a_np = RNG.uniform(-1, 1, 1 if alpha_kind == "one" else C)
        alpha = dev(a_np)
        a_ref = host(alpha)
    y = igemm.prelu(x, alpha, layout=layout)
    close(host(y), reference.prelu(host(x), a_ref, layout), TOL[dtype], "prelu")
    dy = dev(randn(*shape), dtype, offset)
    dx, da = igemm.prelu_backward(dy, x, alpha, layout=layout)
    rdx, rda = reference.prelu_backward(host(dy), host(x), a_ref, layout)
    close(host(dx), rdx, TOL[dtype], "prelu_backward dx")
    close(host(da).reshape(-1), rda, 1e-3 if dtype == "float32" else 2e-2, "prelu_backward dalpha")


PRELU = {
    "scalar_value": lambda: _prelu((3, 5, 7), "NCHW", "number", "float16"),
    "scalar_pointer": lambda: _prelu((2, 3, 8), "NCHW", "one"),
    "plane_nchw": lambda: _prelu((2, 16, 8, 8), "NCHW", "channel", "float16"),
    "row_nhwc": lambda: _prelu((2, 5, 5, 16), "NHWC", "channel", "bfloat16"),
    "step_nhwc_odd_c": lambda: _prelu((3, 4, 4, 7), "NHWC", "channel"),
    "step_nchw_odd_plane": lambda: _prelu((2, 3, 7, 7), "NCHW", "channel", "float16"),
    "misaligned": lambda: _prelu((2, 6, 5, 9), "NCHW", "channel", "float32", 1),
}


# ------------------------------------------------------------------------------------------ compare (direct, im2col)
def _direct(layout, dtype):
    from igemm.baselines import _algorithms as al
    pb = al.Problem(2, 8, 9, 9, 12, 3, 3, 1, 1, 1, dtype, layout)
    alg = al.make_gpu("direct", pb)
    x, w = dev(randn(*pb.x_shape), dtype), dev(randn(*pb.w_shape) / 5, dtype)
    alg.setup(x, w)
    y = alg()
    close(host(y), reference.conv2d_im2col(host(x), host(w), 1, 1, 1, layout), TOL[dtype], "direct")


def _im2col(layout, dtype):
    from igemm.baselines import _algorithms as al
    from igemm import _kernel
    pb = al.Problem(2, 8, 9, 9, 12, 3, 3, 2, 1, 1, dtype, layout)
    x = dev(randn(*pb.x_shape), dtype)
    cols = torch.empty(al.im2col_cols_shape(pb), dtype=x.dtype, device="cuda")
    vec = al.im2col_vec(pb, x.data_ptr(), cols.data_ptr())
    vals = al.im2col_launch_values(pb, vec)
    vals.update(x=x.data_ptr(), cols=cols.data_ptr())
    k = _kernel.load(al.im2col_stub(dtype, layout, vec), al.im2col_name(dtype, layout, vec), "igemm_im2col", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = max(1, min(-(-vals["rows"] // vals["rows_per_iter"]), sms * 16))
    _kernel.Launcher(k, grid, 256)(torch.cuda.current_stream().cuda_stream, _kernel.pack_args(al.IM2COL_PARAMS, vals))
    np.testing.assert_array_equal(host(cols).reshape(-1), al.im2col_cols_numpy(host(x), pb).reshape(-1))


COMPARE = {
    "direct_nchw_fp32": lambda: _direct("NCHW", "float32"),
    "direct_nhwc_fp16": lambda: _direct("NHWC", "float16"),
    "im2col_nhwc_fp16": lambda: _im2col("NHWC", "float16"),
    "im2col_nchw_fp32": lambda: _im2col("NCHW", "float32"),
}

# ------------------------------------------------------------------------------------------ backward
def _backward(op, layout, dtype, xs, ws, stride, padding, mode="plain", out_dtype=None, accumulate=False):
    """One grad call (its moves and forward kernels) against the float64 reference."""
    x, w = dev(randn(*xs), dtype), dev(randn(*ws), dtype)
    nchw = layout == "NCHW"
    N, C, H, W = xs if nchw else (xs[0], xs[3], xs[1], xs[2])
    K, R, S = ws[0], (ws[2] if nchw else ws[1]), (ws[3] if nchw else ws[2])
    P = (H + 2 * padding - R) // stride + 1
    Q = (W + 2 * padding - S) // stride + 1
    ys = (N, K, P, Q) if nchw else (N, P, Q, K)
    dy = dev(randn(*ys), dtype)
    mask = igemm.relu_mask(dev(randn(*ys), dtype)) if mode != "plain" else None
    pro = igemm.GradPrologue(dev(randn(*ys), dtype), dev(randn(3, K))) if mode == "bn" else None
    g = reference.grad_prologue_ref(host(dy), host(mask).view(np.uint32) if mask is not None else None,
                                    (host(pro.z), *host(pro.coef)) if pro is not None else None, layout)
    if op == "dgrad":                # (dx NaN-filled, not fresh: the module doc)
        got = igemm.conv2d_grad_input(dy, w, xs, stride, padding, layout=layout, mask=mask, prologue=pro,
                                      out=dev(np.full(xs, np.nan), dtype))
        ref = reference.conv2d_grad_input_ref(g, host(w), xs, stride, padding, 1, layout)
    else:
        out = None
        if out_dtype or accumulate:
            out = dev(np.zeros(ws), out_dtype or dtype)
        got = igemm.conv2d_grad_weight(x, dy, ws, stride, padding, layout=layout, mask=mask, prologue=pro,
                                       out=out, accumulate=accumulate)
        ref = reference.conv2d_grad_weight_ref(host(x), g, ws, stride, padding, 1, layout)
    close(host(got), ref, TOL[dtype], f"{op} {layout} {dtype}")
    return f"{op} {layout} {dtype} x {xs} w {ws} stride {stride} {mode}"


BACKWARD = {
    "dgrad_strided_nhwc_fp16_mask": lambda: _backward("dgrad", "NHWC", "float16", (2, 9, 11, 16), (24, 3, 3, 16),
                                                      2, 1, "mask"),
    "dgrad_nchw_fp32_bn": lambda: _backward("dgrad", "NCHW", "float32", (2, 5, 7, 6), (3, 5, 3, 3), 1, 1, "bn"),
    "wgrad_turned_nhwc_bf16": lambda: _backward("wgrad", "NHWC", "bfloat16", (3, 10, 9, 8), (12, 3, 3, 8), 2, 1,
                                                out_dtype="float32", accumulate=True),
    "wgrad_gemm_nhwc_fp16_bn": lambda: _backward("wgrad", "NHWC", "float16", (2, 8, 8, 64), (128, 1, 1, 64), 1, 0,
                                                 "bn"),
    "wgrad_nchw_fp32_mask": lambda: _backward("wgrad", "NCHW", "float32", (2, 3, 8, 7), (5, 3, 2, 2), 3, 2, "mask"),
    # the native kernels (16-bit NHWC on sm_90a): persistent 64x128 and 128x64 dgrad, persistent 128x128 and
    # per-tile 64x64 wgrad, a 1x1's deep rings (128x64, 6 stages; 64x64, 8 stages, masked) (igemm/conv/_native.py's
    # and _native_dgrad.py's rules pick them at these sizes)
    "dgrad_native_ws_nhwc_fp16_bn": lambda: _backward("dgrad", "NHWC", "float16", (2, 9, 10, 72), (64, 3, 3, 72), 1,
                                                      1, "bn"),
    "dgrad_native_ws_strided_nhwc_bf16": lambda: _backward("dgrad", "NHWC", "bfloat16", (2, 9, 10, 64),
                                                           (64, 1, 1, 64), 2, 0),
    "wgrad_native_ws_nhwc_fp16_mask": lambda: _backward("wgrad", "NHWC", "float16", (2, 9, 10, 128), (128, 3, 3, 128),
                                                        1, 1, "mask"),
    "wgrad_native_tile_nhwc_fp16": lambda: _backward("wgrad", "NHWC", "float16", (2, 9, 10, 64), (64, 3, 3, 64), 1, 1),
    "wgrad_native_1x1_nhwc_bf16": lambda: _backward("wgrad", "NHWC", "bfloat16", (2, 9, 10, 128), (256, 1, 1, 128),
                                                    1, 0),
    "wgrad_native_1x1_nhwc_fp16_mask": lambda: _backward("wgrad", "NHWC", "float16", (2, 9, 10, 64), (256, 1, 1, 64),
                                                         1, 0, "mask"),
    # an NCHW wgrad on its NHWC twin's native kernel (x and dy moved, the prologue on dy's move, dw transposed back)
    "wgrad_nchw_native_fp16_bn": lambda: _backward("wgrad", "NCHW", "float16", (2, 64, 9, 10), (128, 64, 3, 3), 1, 1,
                                                   "bn"),
    # a stride-1 NCHW dgrad on the forward's transpose path, its filter flipped in the preparation's launch (kVecFlip)
    "dgrad_nchw_flip_fp16_mask": lambda: _backward("dgrad", "NCHW", "float16", (2, 64, 9, 10), (40, 64, 3, 3), 1, 1,
                                                   "mask"),
    # an NCHW twin's dw' moved into an fp32 dw, accumulating; the few-channel twin's dw' (conv1's form) transposed back
    "wgrad_nchw_twin_bf16_acc": lambda: _backward("wgrad", "NCHW", "bfloat16", (2, 128, 9, 10), (64, 128, 5, 3), 1, 1,
                                                  out_dtype="float32", accumulate=True),
    "wgrad_nchw_twin_small_fp16": lambda: _backward("wgrad", "NCHW", "float16", (2, 3, 20, 22), (64, 3, 7, 7), 2, 3),
    # the NCHW 1x1 wgrad (x and dy in place; P·Q = 56: a partial k-tile an image; K = 40: a partial tile)
    "wgrad_nchw_1x1_fp16_mask": lambda: _backward("wgrad", "NCHW", "float16", (2, 64, 7, 8), (40, 64, 1, 1), 1, 0,
                                                  "mask"),
    # the few-channel wgrad (conv1's form: 3 channels, 7x7 / 2; Q = 70, a partial unit a row; K = 72, two row blocks)
    "wgrad_small_nhwc_fp16_mask": lambda: _backward("wgrad", "NHWC", "float16", (2, 11, 140, 3), (72, 7, 7, 3), 2, 3,
                                                    "mask"),
}

# ------------------------------------------------------------------------------------------ a training step
def _train_step(add: bool, C: int, conv_stats: bool):
    """One training step of igemm.nn's conv -> BN [-> + identity] -> ReLU on channels-last fp16 through the eager
    path (TrainCall: the conv, the one-launch BatchNorm passes of csrc/norm_train.cuh, dgrad, wgrad) against the same
    modules in PyTorch fp16; ``conv_stats``: z's statistics come from the conv's epilogue (else a pass over z)."""
    import copy

    import torch.nn as tnn
    from igemm.nn import Conv2dBNAddReLU, Conv2dBNReLU, _train_fast
    torch.manual_seed(C)
    conv, bn = tnn.Conv2d(C, C, 3, 1, 1, bias=False).cuda().half(), tnn.BatchNorm2d(C).cuda()
    m = (Conv2dBNAddReLU if add else Conv2dBNReLU)(conv, bn)
    mods = [m, copy.deepcopy(m)]
    x = dev(randn(2, C, 9, 10), "float16").contiguous(memory_format=torch.channels_last)
    r = dev(randn(2, C, 9, 10), "float16").contiguous(memory_format=torch.channels_last)
    got = []
    for m, ours in zip(mods, (True, False)):
        xi, ri = x.clone().requires_grad_(), r.clone().requires_grad_()
        if ours:
            y = m(xi, ri) if add else m(xi)
            y.float().square().sum().backward()
        else:                        # (cuDNN's batch norm reads memory it never wrote: initcheck would flag it)
            with torch.backends.cudnn.flags(enabled=False):
                y = m._torch(xi, ri if add else None)
                y.float().square().sum().backward()
        got.append([y, xi.grad, m.conv.weight.grad, m.bn.weight.grad, m.bn.bias.grad, m.bn.running_var]
                   + ([ri.grad] if add else []))
    tc = [t for per in _train_fast._calls.values() for t in per.values() if t is not None]
    if not tc or tc[-1].one_fwd is None or tc[-1].one_bwd is None:
        raise AssertionError("the eager path did not take the one-launch passes")
    if (tc[-1].conv_stats is not None) != conv_stats:
        raise AssertionError(f"the statistics {'did not come' if conv_stats else 'came'} from the conv's epilogue")
    for a, b in zip(*got):
        close(host(a), host(b), 2e-2, "training step against PyTorch")
    return (f"{'conv+BN+Add+ReLU' if add else 'conv+BN+ReLU'} C {C}, one-launch BatchNorm passes, statistics "
            f"{'from the conv epilogue' if conv_stats else 'by a pass over z'}")


NORM["train_step_one_launch_relu"] = lambda: _train_step(False, 16, True)
NORM["train_step_one_launch_add_c200"] = lambda: _train_step(True, 200, False)
# the residual staged beside z in shared memory (bn-train-staged)
NORM["train_step_one_launch_add_conv_stats"] = lambda: _train_step(True, 16, True)


def _train_backward(N: int, C: int, HW: int):
    """The one-launch BatchNorm backward that reads dy and z twice (not the held one): its dz pass staged in shared
    memory on sm_90 (bn-train-staged), the mask's select and the residual's gradient, against float64."""
    from igemm import _norm_kernels as nk
    from igemm import _norm_train as nt
    sms = nk._sms(0)
    cfg = nk.reduction_config("NHWC", N, C, HW, 2, 16, sms, nk._GRAD_UNROLL,
                              nt.train_backward_blocks_per_sm(2 * N * HW * C, sms))
    k, nws = nt._train_kernel(0, True, "float16", N, C, HW, sms, cfg, False)
    M = N * HW
    z, dy = dev(randn(M, C) * 2 + 1, "float16"), dev(randn(M, C), "float16")
    words = dev(RNG.integers(0, 2 ** 32, (M * C + 31) // 32, dtype=np.uint32).view(np.int32), "int32")
    z64 = host(z).astype(np.float64)
    mean, invstd = z64.mean(0), 1 / np.sqrt(z64.var(0) + 1e-5)
    gamma = RNG.uniform(0.5, 1.5, C)
    sums, dz, sel = (torch.full(s, float("nan"), device="cuda", dtype=t)
                     for s, t in (((7 * C + nws,), torch.float32), ((M, C), torch.float16), ((M, C), torch.float16)))
    b = sums.data_ptr()
    md, ivd, gd = dev(mean), dev(invstd), dev(gamma)
    ptrs = dict(x=z.data_ptr(), dy=dy.data_ptr(), mask=words.data_ptr(), mean=md.data_ptr(), invstd=ivd.data_ptr(),
                part=b + 28 * C, out0=b, out1=b + 4 * C, out2=b + 8 * C, out3=b + 12 * C, gamma=gd.data_ptr(),
                coef=b + 16 * C, src=dy.data_ptr(), dst=dz.data_ptr(), z=z.data_ptr(), sel=sel.data_ptr())
    k.run(torch.cuda.current_stream().cuda_stream, k.slots(list(ptrs)), list(ptrs.values()))
    bits = np.unpackbits(host(words).view(np.uint8), bitorder="little")[:M * C].reshape(M, C).astype(bool)
    d = np.where(bits, host(dy).astype(np.float64), 0.0)
    sdy, sdx = d.sum(0), (d * (z64 - mean)).sum(0)
    a = gamma * invstd
    ref = a * d - a * invstd ** 2 * sdx / M * z64 + a * (mean * invstd ** 2 * sdx / M - sdy / M)
    close(host(dz), ref, 1e-2, "the one-launch backward's dz")
    close(host(sel), d, 0, "the residual's gradient")
    return f"one-launch BatchNorm backward (dy and z read twice), M {M} C {C}"


# a part-filled last tile; 250-thread dz blocks (C = 200)
NORM["train_backward_one_launch"] = lambda: _train_backward(4, 64, 49)
NORM["train_backward_one_launch_c200"] = lambda: _train_backward(2, 200, 63)


def _dgrad_adds(xs, ws, stride, padding):
    """The native dgrad's store adding into dx (the training path's identity gradient) against dgrad + a torch add."""
    from igemm import Conv2dGradInputPlan
    plan = Conv2dGradInputPlan(xs, ws, "float16", "NHWC", stride, padding)
    if not plan.adds:
        raise AssertionError("not the native dgrad kernel")
    P, Q = ((xs[1] + 2 * padding - ws[1]) // stride + 1, (xs[2] + 2 * padding - ws[2]) // stride + 1)
    dy, w, old = (dev(randn(*s), "float16") for s in ((xs[0], P, Q, ws[0]), ws, xs))
    plain, dx = torch.full_like(old, float("nan")), old.clone()     # (NaN-filled: the module doc)
    h, fp = torch.cuda.current_stream().cuda_stream, {"mask": 0, "z": 0, "coef": 0}
    plan._run(h, dy.data_ptr(), w.data_ptr(), plain.data_ptr(), fp)
    plan._run(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), fp, add=True)
    if not torch.equal(dx, plain + old):
        raise AssertionError("dgrad's adding store differs from dgrad + add")
    return f"dgrad adding into dx, x {xs} w {ws} stride {stride}"


BACKWARD["dgrad_native_adds_strided"] = lambda: _dgrad_adds((2, 9, 10, 64), (64, 3, 3, 64), 2, 1)


def _dgrad_sums(xs, ws, stride, padding):
    """The native dgrad that also writes the layer before's BatchNorm backward sums per tile (bn-sums-in-dgrad; that
    layer's z of dx's shape, its mask and mean) and its ReLU(BN(z)) (remake-in-dgrad), then the one-launch backward
    from those sums: dx against the plain kernel's, the sums against float64's over dx, the remade x against
    igemm.batch_norm_relu's, dz finite."""
    from igemm import Conv2dGradInputPlan, batch_norm_relu
    from igemm._norm_train import TRAIN_BWD_PTRS, train_kernel
    plan = Conv2dGradInputPlan(xs, ws, "float16", "NHWC", stride, padding)
    T = plan.native.sums_tiles if plan.native is not None else 0
    if not T:
        raise AssertionError("no sums from this dgrad")
    (N, H, W, C), K = xs, ws[0]
    P, Q = ((H + 2 * padding - ws[1]) // stride + 1, (W + 2 * padding - ws[2]) // stride + 1)
    dy, w, z = (dev(randn(*s), "float16") for s in ((N, P, Q, K), ws, xs))
    n = N * H * W * C
    words = dev(RNG.integers(0, 2 ** 32, (n + 31) // 32, dtype=np.uint32).view(np.int32), "int32")
    mean = z.double().reshape(-1, C).mean(0).float()
    plain, dx, x = (torch.full_like(z, float("nan")) for _ in range(3))
    out = torch.full((2 * T * C,), float("nan"), device="cuda")
    invstd, gamma, beta = dev(RNG.uniform(0.5, 2, C)), dev(RNG.uniform(0.5, 1.5, C)), dev(RNG.uniform(-1, 1, C))
    h, fp = torch.cuda.current_stream().cuda_stream, {"mask": 0, "z": 0, "coef": 0}
    plan._run(h, dy.data_ptr(), w.data_ptr(), plain.data_ptr(), fp)
    plan._run(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), fp, False,
              (z.data_ptr(), words.data_ptr(), mean.data_ptr(), out.data_ptr(), x.data_ptr(), invstd.data_ptr(),
               gamma.data_ptr(), beta.data_ptr()))
    if not torch.equal(dx, plain):
        raise AssertionError("the sums twin's dx differs from the plain kernel's")
    if not torch.equal(x, batch_norm_relu(z, mean, invstd, gamma, beta, return_mask=False, layout="NHWC")):
        raise AssertionError("the sums twin's remade x differs from batch_norm_relu's")
    bits = np.unpackbits(host(words).view(np.uint8), bitorder="little")[:n].reshape(-1, C).astype(bool)
    d = np.where(bits, host(dx).reshape(-1, C), 0.0)
    got = host(out).reshape(2, T, C).sum(1)
    close(got[0], d.sum(0), 1e-5, "dgrad's sum dy'")
    close(got[1], (d * (host(z).reshape(-1, C) - host(mean))).sum(0), 1e-5, "dgrad's sum dy'(z - mean)")
    k, nws = train_kernel(0, backward=True, dtype="float16", N=N, C=C, HW=H * W, tiles=T)
    sums, dz = torch.full((7 * C + nws,), float("nan"), device="cuda"), torch.full_like(z, float("nan"))
    b = sums.data_ptr()
    k.run(h, k.slots(TRAIN_BWD_PTRS + ("tiles",)),
          [z.data_ptr(), dx.data_ptr(), words.data_ptr(), mean.data_ptr(), invstd.data_ptr(), b + 28 * C, b, b + 4 * C,
           b + 8 * C, b + 12 * C, gamma.data_ptr(), b + 16 * C, dx.data_ptr(), dz.data_ptr(), z.data_ptr(), 0,
           out.data_ptr()])
    close(host(sums[:2 * C]), got.ravel(), 1e-5, "the backward's sums from dgrad's")
    if not torch.isfinite(dz).all():
        raise AssertionError("dz not written")
    name = plan.native._spec(False, False, True).name()
    return f"dgrad with the BatchNorm sums and the remade x, x {xs} w {ws} stride {stride}, {name}"


# a 3x3 and a 1x1 (C < BN) on its 128 x 64 tiles, the last tile row part-filled
BACKWARD["dgrad_native_bn_sums"] = lambda: _dgrad_sums((2, 9, 10, 64), (128, 3, 3, 64), 1, 1)
BACKWARD["dgrad_native_bn_sums_1x1"] = lambda: _dgrad_sums((2, 11, 9, 40), (128, 1, 1, 40), 1, 0)


def _dgrad_w_in_place(xs, ws, config=None):
    """An NCHW 1x1 dgrad reading w [K][C] in place (the MN-major TMA B tiles) against the float64 reference."""
    from igemm import Conv2dGradInputPlan, Conv2dOptions
    plan = Conv2dGradInputPlan(xs, ws, "float16", "NCHW", 1, 0,
                               options=Conv2dOptions(config=config) if config else None)
    (sub,) = plan.sub_plans()
    if not sub._w_mn:
        raise AssertionError("not the in-place filter")
    dy, w = dev(randn(xs[0], ws[0], xs[2], xs[3]), "float16"), dev(randn(*ws), "float16")
    got = plan(dy, w)
    close(host(got), reference.conv2d_grad_input_ref(host(dy), host(w), xs, 1, 0, 1, "NCHW"), TOL["float16"],
          "dgrad w in place")
    return f"dgrad NCHW 1x1, w in place, x {xs} w {ws} {sub.spec().name()}"


# dgrad's in-place filter on the per-tile kernel (64 columns) and the persistent one (128 columns, a partial tile)
BACKWARD["dgrad_nchw_w_in_place"] = lambda: _dgrad_w_in_place((2, 96, 8, 8), (128, 96, 1, 1))
BACKWARD["dgrad_nchw_w_in_place_ws"] = lambda: _dgrad_w_in_place(
    (2, 192, 8, 8), (64, 192, 1, 1), {"math": "wgmma_ws", "bm": 64, "wm": 1, "bn": 128, "stages": 3, "splits": 1,
                                      "ctas": 2})
# strict fp32 wgrad of a 1x1 as the NHWC forward with N taps: dy in place (x subsampled, the mask on dy's pass), and
# x in place (dy moved, accumulating into dw)
BACKWARD["wgrad_nchw_taps_fp32_mask"] = lambda: _backward("wgrad", "NCHW", "float32", (2, 12, 8, 8), (20, 12, 1, 1),
                                                          2, 0, "mask")
BACKWARD["wgrad_nchw_taps_fp32_x"] = lambda: _backward("wgrad", "NCHW", "float32", (3, 24, 8, 8), (8, 24, 1, 1), 1,
                                                       0, out_dtype="float32", accumulate=True)


# ------------------------------------------------------------------------------------------ pool (igemm.nn.MaxPool2d)
def _pool(dtype, shape, k, s, p, d, ceil):
    """The max pool's forward (with its window taps) and backward against torch.nn.MaxPool2d on channels-last x."""
    import torch.nn.functional as F
    from igemm.nn import MaxPool2d
    x = dev(randn(*shape), dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = MaxPool2d(k, s, p, d, ceil_mode=ceil)(x)
    yr = F.max_pool2d(x, k, s, p, d, ceil)
    g = torch.randn_like(y)
    dx, dxr = torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yr, x, g)[0]
    if not (torch.equal(y, yr) and torch.equal(dx, dxr)):
        raise AssertionError("max pool differs from torch.nn.MaxPool2d")
    return f"max pool {dtype} x {shape} k {k} s {s} p {p} d {d} ceil {ceil}"


def _pool_band(dtype, shape):
    """The band backward (ResNet's 3x3 / 2, several bands an image: the launch as if on two SMs) against
    torch.nn.MaxPool2d's dx."""
    import torch.nn.functional as F
    from igemm import pool
    N, C, H, W = shape
    x = dev(randn(*shape), dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
    yr = F.max_pool2d(x, 3, 2, 1)
    g = torch.randn_like(yr).contiguous(memory_format=torch.channels_last)
    dxr = torch.autograd.grad(yr, x, g)[0]
    OH, OW = yr.shape[2:]
    geom = (N, C, H, W, OH, OW, (3, 3), (2, 2), (1, 1), (1, 1))
    assert pool.band_rows(dtype, 8, geom, 2) > 0
    y = torch.empty_like(yr)
    idx = torch.empty((N, OH, OW, C), dtype=torch.uint8, device="cuda")
    dx = torch.empty_like(x)
    h = torch.cuda.current_stream().cuda_stream
    pool.launch_forward(0, h, dtype, geom, x.data_ptr(), y.data_ptr(), idx.data_ptr())
    pool.launch_backward(0, h, dtype, geom, g.data_ptr(), idx.data_ptr(), dx.data_ptr(), sms=2)
    if not torch.equal(dx, dxr):
        raise AssertionError("the band backward differs from torch.nn.MaxPool2d's")
    return f"max pool band backward {dtype} x {shape}"


POOL = {
    "resnet_fp16_v8": lambda: _pool("float16", (2, 16, 9, 10), 3, 2, 1, 1, False),
    "band_bf16": lambda: _pool_band("bfloat16", (3, 16, 20, 18)),
    "dilated_ceil_fp32_v1": lambda: _pool("float32", (2, 5, 9, 8), 3, 2, 1, 2, True),
}

FAMILIES = {"conv": CONV, "relu": RELU, "norm": NORM, "syncbn": SYNCBN, "index_add": INDEX_ADD, "prelu": PRELU,
            "compare": COMPARE, "backward": BACKWARD, "pool": POOL}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=[*FAMILIES, "all"])
    p.add_argument("--case", default="", help="only cases whose name contains this")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    fams = list(FAMILIES) if a.family == "all" else [a.family]
    failed = 0
    for fam in fams:
        for name, fn in FAMILIES[fam].items():
            if a.case not in name:
                continue
            if a.list:
                print(f"{fam}/{name}")
                continue
            try:
                info = fn()
                torch.cuda.synchronize()
                print(f"ok    {fam}/{name}" + (f"  ({info})" if info else ""), flush=True)
            except Exception:
                failed += 1
                print(f"FAIL  {fam}/{name}\n{traceback.format_exc()}", flush=True)
    if a.list:
        return 0
    print("sanitize_cases: all ok" if not failed else f"sanitize_cases: {failed} case(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
