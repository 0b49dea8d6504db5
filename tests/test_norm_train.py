"""The training path's one-launch BatchNorm passes (csrc/norm_train.cuh, ``igemm._norm_kernels.train_kernel``): on
the CPU their grids and compilation; on the GPU every output against float64 from poisoned buffers -- the forward's
mean, invstd, running statistics, num_batches_tracked, y and mask bits; the backward's sums, dgamma, dbeta, dz
coefficients, dz and the residual's gradient -- over geometries whose reduction is one slice per channel (Final) or
many, C a power of two or not."""
from __future__ import annotations

import pytest

from igemm import _norm_kernels as nk

GEOMS = [(2, 64, 49), (8, 200, 196), (4, 2048, 49), (32, 256, 784)]   # (N, C, HW)


def test_train_grids_are_one_resident_wave():
    """At most 3 blocks an SM (the launch bounds) for any SM count, and the forward's elementwise phase at most a
    block for each of the grid's, its threads' channels fixed where they are for the separate kernel."""
    for sms in (132, 114, 78):
        for N, C, HW in GEOMS + [(1, 8, 1), (256, 64, 12544)]:
            for bwd in (False, True):
                cfg = nk.reduction_config("NHWC", N, C, HW, 2, 16, sms, 2 if bwd else 4, 3)
                assert cfg.blocks <= 3 * sms and cfg.S * cfg.L >= N * HW
                ec = nk.elemt_config("NHWC", N, C, HW, 2, 16, sms, cfg.blocks)
                assert ec.blocks <= cfg.blocks and ec.fixed == nk.elemt_config("NHWC", N, C, HW, 2, 16, sms).fixed
    assert nk._TRAIN_BLOCKS_PER_SM == 3
    for s in (nk.stub_train("float16", False, False, 2, True), nk.stub_train("bfloat16", True, True)):
        assert "__launch_bounds__(256, 3)" in s
    assert len(set(nk.train_stubs())) == 20


@pytest.mark.compile
def test_train_stubs_compile():
    from igemm import _build
    try:
        _build.find_toolchain()
    except _build.ToolchainNotFoundError:
        pytest.skip("no CUDA compiler")
    for s in (nk.stub_train("float16", False, False, 2, True), nk.stub_train("bfloat16", True, True)):
        cubin, _ = _build.compile_cubin(s, "sm_90a", name="bn_train_ci")
        assert len(cubin) > 1000


# ============================================================================================ GPU
def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def _bits(words, n):
    """The first n bits of int32 words, LSB first (the mask's format)."""
    torch = _torch()
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[:, None] >> torch.arange(32, device=w.device)) & 1).reshape(-1)[:n].bool()


def _kernel(torch, backward, dtype, N, C, HW, **kw):
    got = nk.train_kernel(0, backward=backward, dtype=dtype, N=N, C=C, HW=HW, **kw)
    assert got is not None, "the grid is one resident wave on an sm_90 GPU"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act,res", [(2, True), (2, False), (0, False), (0, True)])
@pytest.mark.parametrize("N,C,HW", GEOMS)
def test_gpu_train_forward(dtype, act, res, N, C, HW):
    torch = _torch()
    td = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(N * C + HW + act)
    z = (torch.randn(N, HW, C, device="cuda", generator=g) * 3 + torch.linspace(-5, 5, C, device="cuda")).to(td)
    r = torch.randn(N, HW, C, device="cuda", generator=g).to(td) if res else None
    gamma, beta = torch.rand(C, device="cuda", generator=g) + 0.5, torch.randn(C, device="cuda", generator=g)
    rm, rv = torch.randn(C, device="cuda", generator=g), torch.rand(C, device="cuda", generator=g) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    nbt = torch.tensor(41, device="cuda")
    k, nws = _kernel(torch, False, dtype, N, C, HW, act=act, res=res)
    n = N * HW * C
    words = (n + 31) // 32
    buf = torch.full((2 * C + nws + words,), float("nan"), device="cuda")
    y = torch.full_like(z, float("nan"))
    b = buf.data_ptr()
    ptrs = dict(x=z.data_ptr(), part=b + 8 * C, out0=b, out1=b + 4 * C, mean=b, invstd=b + 4 * C,
                run_mean=rm.data_ptr(), run_var=rv.data_ptr(), res=r.data_ptr() if res else 0, y=y.data_ptr(),
                mask=b + 4 * (2 * C + nws), weight=gamma.data_ptr(), bias=beta.data_ptr(), nbt=nbt.data_ptr())
    k.run(torch.cuda.current_stream().cuda_stream, k.slots(list(ptrs)), list(ptrs.values()),
          ((k.slot["eps"], 1e-5), (k.slot["momentum"], 0.1)))
    torch.cuda.synchronize()
    z64 = z.double().reshape(-1, C)
    mean, var = z64.mean(0), z64.var(0, unbiased=False)
    invstd = 1 / (var + 1e-5).sqrt()
    assert _rel(buf[:C], mean) < 1e-5 and _rel(buf[C:2 * C], invstd) < 1e-5 and int(nbt) == 42
    M = N * HW
    assert _rel(rm, 0.9 * rm0.double() + 0.1 * mean) < 1e-5
    assert _rel(rv, 0.9 * rv0.double() + 0.1 * var * M / (M - 1)) < 1e-5
    ref = (z.double() - mean) * (invstd * gamma.double()) + beta.double()
    if res:
        ref = ref + r.double()
    if act:
        ref = ref.clamp_min(0)
    assert not y.isnan().any() and _rel(y, ref) < 1e-2
    if act == 2:
        assert torch.equal(_bits(buf[2 * C + nws:].view(torch.int32), n), y.reshape(-1) > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask,sel", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("N,C,HW", GEOMS)
def test_gpu_train_backward(dtype, mask, sel, N, C, HW):
    torch = _torch()
    td = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(N * C + HW + 2 * mask + sel)
    z = (torch.randn(N, HW, C, device="cuda", generator=g) * 2 + 1).to(td)
    dy = torch.randn(N, HW, C, device="cuda", generator=g).to(td)
    n = N * HW * C
    words = torch.randint(-2**31, 2**31 - 1, ((n + 31) // 32,), device="cuda", generator=g, dtype=torch.int32)
    z64 = z.double().reshape(-1, C)
    mean = z64.mean(0).float()
    invstd = (1 / (z64.var(0, unbiased=False) + 1e-5).sqrt()).float()
    gamma = torch.rand(C, device="cuda", generator=g) + 0.5
    k, nws = _kernel(torch, True, dtype, N, C, HW)
    sums = torch.full((7 * C + nws,), float("nan"), device="cuda")
    dz, dres = torch.full_like(dy, float("nan")), torch.full_like(dy, float("nan"))
    b = sums.data_ptr()
    ptrs = dict(x=z.data_ptr(), dy=dy.data_ptr(), mask=words.data_ptr() if mask else 0, mean=mean.data_ptr(),
                invstd=invstd.data_ptr(), part=b + 28 * C, out0=b, out1=b + 4 * C, out2=b + 8 * C, out3=b + 12 * C,
                gamma=gamma.data_ptr(), coef=b + 16 * C, src=dy.data_ptr(), dst=dz.data_ptr(), z=z.data_ptr(),
                sel=dres.data_ptr() if sel else 0)
    k.run(torch.cuda.current_stream().cuda_stream, k.slots(list(ptrs)), list(ptrs.values()))
    torch.cuda.synchronize()
    bit = _bits(words, n).reshape(dy.shape) if mask else torch.ones_like(dy, dtype=torch.bool)
    d = torch.where(bit, dy.double(), 0.0)
    mu, is_, ga, M = mean.double(), invstd.double(), gamma.double(), N * HW
    sdy, sdx = d.reshape(-1, C).sum(0), (d * (z.double() - mu)).reshape(-1, C).sum(0)
    for got, want in ((sums[:C], sdy), (sums[C:2 * C], sdx), (sums[2 * C:3 * C], sdx * is_),
                      (sums[3 * C:4 * C], sdy)):
        assert _rel(got, want) < 1e-5
    a = ga * is_
    coef = torch.stack([a, -a * is_ ** 2 * sdx / M, a * (mu * is_ ** 2 * sdx / M - sdy / M)])
    assert _rel(sums[4 * C:7 * C].reshape(3, C), coef) < 1e-5
    assert not dz.isnan().any() and _rel(dz, coef[0] * d + coef[1] * z.double() + coef[2]) < 1e-2
    if sel:
        assert torch.equal(dres, torch.where(bit, dy, torch.zeros_like(dy)))
    else:
        assert dres.isnan().all()
