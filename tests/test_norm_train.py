"""The training path's one-launch BatchNorm passes (csrc/norm_train.cuh, ``igemm._norm_train.train_kernel``): on
the CPU their grids and compilation; on the GPU every output against float64 from poisoned buffers -- the forward's
mean, invstd, running statistics, num_batches_tracked, y and mask bits; the backward's sums, dgamma, dbeta, dz
coefficients, dz and the residual's gradient -- over geometries whose reduction is one slice per channel (Final) or
many, C a power of two or not."""
from __future__ import annotations

import pytest

from igemm import _norm_kernels as nk
from igemm import _norm_train as nt

# (N, C, HW); the backward's grid at 1, 1, 1, 2 and 3 blocks an SM (train_backward_blocks_per_sm, 132 SMs)
GEOMS = [(2, 64, 49), (8, 200, 196), (4, 2048, 49), (32, 128, 784), (32, 256, 784)]
# more geometries of the held backward: one slice per channel (Final), 6 rows a thread at a block an SM, 8 with
# channel tiles
HELD_GEOMS = [(1, 64, 16), (32, 256, 196), (32, 2048, 49)]


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
    assert nt._TRAIN_BLOCKS_PER_SM == 3
    assert [nt.train_backward_blocks_per_sm(2 * N * C * HW, 132) for N, C, HW in GEOMS] == [1, 1, 1, 2, 3]
    for s in (nt.stub_train("float16", False, False, 2, True), nt.stub_train("bfloat16", True, True)):
        assert "__launch_bounds__(256, 3)" in s
    assert len(set(nt.train_stubs())) == 34


def test_held_backward_grids():
    """The held backward takes a tensor whose rows fit 8 a thread at one block an SM, else at two, else none; its
    grid covers every row and is one resident wave of at most two blocks an SM."""
    got = {g: nt.held_config(*g, 132) for g in GEOMS + HELD_GEOMS}
    assert [g for g, c in got.items() if c is None] == [(32, 256, 784)]
    for (N, C, HW), c in got.items():
        if c is not None:
            ty = nk.THREADS // c.tx
            assert c.S * c.L >= N * HW and c.L <= nt.HELD_ROWS * ty and c.blocks <= 2 * 132
            assert c.gx * c.tx * 8 >= C
    assert got[(1, 64, 16)].final and got[(32, 256, 196)].blocks <= 132 and got[(32, 128, 784)].blocks > 132
    for sms in (132, 114, 78):
        for N, C, HW in GEOMS + HELD_GEOMS + [(1, 8, 1), (256, 64, 12544)]:
            c = nt.held_config(N, C, HW, sms)
            assert c is None or (c.blocks <= 2 * sms and c.L <= nt.HELD_ROWS * (nk.THREADS // c.tx))
    assert "__launch_bounds__(256, 2)" in nt.stub_train("float16", False, True, held=True)


@pytest.mark.compile
def test_train_stubs_compile():
    from igemm import _build
    try:
        _build.find_toolchain()
    except _build.ToolchainNotFoundError:
        pytest.skip("no CUDA compiler")
    for s in (nt.stub_train("float16", False, False, 2, True), nt.stub_train("bfloat16", True, True),
              nt.stub_train("float16", False, False, 2, True, conv=True),
              nt.stub_train("bfloat16", False, True, held=True)):
        cubin, _ = _build.compile_cubin(s, "sm_90a", name="bn_train_ci")
        assert len(cubin) > 1000


@pytest.mark.compile
@pytest.mark.parametrize("xs,K,R,st", [((2, 17, 17, 64), 200, 1, 1), ((16, 28, 28, 128), 128, 3, 1)])
def test_conv_statistics_kernels_compile(xs, K, R, st):
    """The training forward's conv with z's statistics (KernelSpec.bn_stats): its kernel, BN 64 and 128."""
    from igemm import _build
    from igemm.nn._train_call import stats_plan
    try:
        _build.find_toolchain()
    except _build.ToolchainNotFoundError:
        pytest.skip("no CUDA compiler")
    sp = stats_plan(xs, (K, R, R, xs[3]), "float16", (st, st), (R // 2, R // 2), (1, 1), "numpy", arch="sm_90a",
                    sms=132)
    spec = sp.spec()
    assert spec.bn_stats and sp.bn_stats_tiles == -(-sp.problem.M // spec.bm) and spec.name().endswith("_bs")
    name, src = sp.kernel()
    cubin, _ = _build.compile_cubin(src, "sm_90a", name=name)
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
    got = nt.train_kernel(0, backward=backward, dtype=dtype, N=N, C=C, HW=HW, **kw)
    assert got is not None, "the grid is one resident wave on an sm_90 GPU"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act,res", [(2, True), (2, False), (0, False), (0, True)])
@pytest.mark.parametrize("N,C,HW", GEOMS)
def test_gpu_train_forward(dtype, act, res, N, C, HW):
    torch = _torch()
    g = torch.Generator("cuda").manual_seed(N * C + HW + act)
    z = (torch.randn(N, HW, C, device="cuda", generator=g) * 3 + torch.linspace(-5, 5, C, device="cuda"))
    _forward_case(torch, g, z.to(getattr(torch, dtype)), act, res, _kernel(torch, False, dtype, N, C, HW, act=act,
                                                                           res=res))


# (x_shape NHWC, K, R, stride): tiles of 64 x 64 (gathered and TMA loads), 64 x 128 and 128 x 128 (two warpgroups),
# the last tile row part-filled, K % BN != 0
CONV_GEOMS = [((3, 20, 20, 64), 64, 1, 1), ((2, 17, 17, 64), 200, 1, 1), ((4, 15, 15, 32), 128, 3, 2),
              ((8, 28, 28, 128), 512, 1, 1), ((16, 28, 28, 128), 128, 3, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act,res", [(2, True), (0, False)])
@pytest.mark.parametrize("xs,K,R,st", CONV_GEOMS)
def test_gpu_train_forward_from_conv_statistics(dtype, act, res, xs, K, R, st):
    """The conv whose epilogue writes z's per-tile statistics (KernelSpec.bn_stats) stores the plain kernel's z bit for
    bit, and the forward pass from those statistics gives every output the pass over z gives (float64 bounds)."""
    torch = _torch()
    from igemm.nn import _ops
    from igemm.nn._train_call import stats_plan
    td = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(xs[0] * K + R + act)
    x = torch.randn(*xs, device="cuda", generator=g).to(td)
    w = (torch.randn(K, R, R, xs[3], device="cuda", generator=g) / (R * R * xs[3]) ** 0.5 + 0.02).to(td)
    sp = stats_plan(xs, tuple(w.shape), dtype, (st, st), (R // 2, R // 2), (1, 1), 0)
    tiles = sp.bn_stats_tiles
    assert tiles > 0 and sp.spec().bn_stats
    zs = sp.y_shape
    z, z_ref = torch.full(zs, float("nan"), device="cuda").to(td), torch.full(zs, float("nan"), device="cuda").to(td)
    part = torch.full((3 * tiles * K,), float("nan"), device="cuda")
    h = torch.cuda.current_stream().cuda_stream
    sp._launch(h, True, True, x.data_ptr(), w.data_ptr(), z.data_ptr(), 0, part.data_ptr(), _ops._Vectors(None, None))
    plain = _ops._plan(_ops._plan_key(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), None, None, None, (st, st),
                                      (R // 2, R // 2), (1, 1), False), 0)
    assert not plain.spec().bn_stats
    plain._launch(h, True, True, x.data_ptr(), w.data_ptr(), z_ref.data_ptr(), 0, 0, _ops._Vectors(None, None))
    torch.cuda.synchronize()
    assert torch.equal(z, z_ref) and not part.isnan().any()
    N, P, Q, _ = zs
    k = _kernel(torch, False, dtype, N, K, P * Q, act=act, res=res, tiles=tiles)
    _forward_case(torch, g, z.reshape(N, P * Q, K), act, res, k, tiles=part.data_ptr())


def _forward_case(torch, g, z, act, res, kernel, **extra):
    """One forward pass on z (N, HW, C) from poisoned buffers, every output against float64."""
    N, HW, C = z.shape
    k, nws = kernel
    r = torch.randn(N, HW, C, device="cuda", generator=g).to(z.dtype) if res else None
    gamma, beta = torch.rand(C, device="cuda", generator=g) + 0.5, torch.randn(C, device="cuda", generator=g)
    rm, rv = torch.randn(C, device="cuda", generator=g), torch.rand(C, device="cuda", generator=g) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    nbt = torch.tensor(41, device="cuda")
    n = N * HW * C
    words = (n + 31) // 32
    buf = torch.full((2 * C + nws + words,), float("nan"), device="cuda")
    y = torch.full_like(z, float("nan"))
    b = buf.data_ptr()
    ptrs = dict(x=z.data_ptr(), part=b + 8 * C, out0=b, out1=b + 4 * C, mean=b, invstd=b + 4 * C,
                run_mean=rm.data_ptr(), run_var=rv.data_ptr(), res=r.data_ptr() if res else 0, y=y.data_ptr(),
                mask=b + 4 * (2 * C + nws), weight=gamma.data_ptr(), bias=beta.data_ptr(), nbt=nbt.data_ptr(),
                **extra)
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
        # the elementwise pass's bits (the one-launch pass stages its loads differently, not its arithmetic)
        import igemm
        yr = igemm.batch_norm_relu(z, buf[:C], buf[C:2 * C], gamma, beta, r, return_mask=False, layout="NHWC")
        assert torch.equal(y, yr)


def _backward_kernel(N, C, HW, dtype, held):
    """The held backward (``held``) or the other one-launch backward on this geometry."""
    sms = nk._sms(0)
    if held:
        cfg = nt.held_config(N, C, HW, sms)
        assert cfg is not None
    else:
        cfg = nk.reduction_config("NHWC", N, C, HW, 2, 16, sms, nk._GRAD_UNROLL,
                                  nt.train_backward_blocks_per_sm(2 * N * HW * C, sms))
    got = nt._train_kernel(0, True, dtype, N, C, HW, sms, cfg, held)
    assert got is not None, "the grid is one resident wave on an sm_90 GPU"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask,sel", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("N,C,HW,held", [g + (False,) for g in GEOMS + HELD_GEOMS[:1]] +
                         [g + (True,) for g in GEOMS + HELD_GEOMS if g != (32, 256, 784)])
def test_gpu_train_backward(dtype, mask, sel, N, C, HW, held):
    """Both one-launch backwards (the held one where it applies); train_kernel picks the held one where it does."""
    torch = _torch()
    td = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(N * C + HW + 2 * mask + sel)
    z = (torch.randn(N, HW, C, device="cuda", generator=g) * 2 + 1).to(td)
    dy = torch.randn(N, HW, C, device="cuda", generator=g).to(td)
    words = torch.randint(-2**31, 2**31 - 1, ((N * HW * C + 31) // 32,), device="cuda", generator=g,
                          dtype=torch.int32)
    k, nws = _backward_kernel(N, C, HW, dtype, held)
    if (nt.held_config(N, C, HW, nk._sms(0)) is not None) == held:     # the kernel and grid train_kernel picks
        assert (nt.train_kernel(0, backward=True, dtype=dtype, N=N, C=C, HW=HW)[0].base == k.base).all()
    _backward_case(torch, g, z, dy, words if mask else None, sel, (k, nws))


def _backward_case(torch, g, z, dy, words, sel, kernel, **extra):
    """One backward pass on z and dy (N, HW, C) with the mask ``words`` (None: none) from poisoned buffers, every
    output against float64."""
    N, HW, C = z.shape
    n = N * HW * C
    z64 = z.double().reshape(-1, C)
    mean = z64.mean(0).float()
    invstd = (1 / (z64.var(0, unbiased=False) + 1e-5).sqrt()).float()
    gamma = torch.rand(C, device="cuda", generator=g) + 0.5
    k, nws = kernel
    sums = torch.full((7 * C + nws,), float("nan"), device="cuda")
    dz, dres = torch.full_like(dy, float("nan")), torch.full_like(dy, float("nan"))
    b = sums.data_ptr()
    ptrs = dict(x=z.data_ptr(), dy=dy.data_ptr(), mask=words.data_ptr() if words is not None else 0,
                mean=mean.data_ptr(), invstd=invstd.data_ptr(), part=b + 28 * C, out0=b, out1=b + 4 * C,
                out2=b + 8 * C, out3=b + 12 * C, gamma=gamma.data_ptr(), coef=b + 16 * C, src=dy.data_ptr(),
                dst=dz.data_ptr(), z=z.data_ptr(), sel=dres.data_ptr() if sel else 0, **extra)
    k.run(torch.cuda.current_stream().cuda_stream, k.slots(list(ptrs)), list(ptrs.values()))
    torch.cuda.synchronize()
    bit = _bits(words, n).reshape(dy.shape) if words is not None else torch.ones_like(dy, dtype=torch.bool)
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


# dgrad's BatchNorm sums (bn-sums-in-dgrad): (x_shape NHWC, K, R, stride, padding) of the dgrad that writes dx, the
# layer before's z of dx's shape: the persistent kernel's 128 x 64 tiles (C <= 64), a 3x3 and a 1x1, C < BN, the last
# tile row part-filled
SUMS_GEOMS = [((4, 14, 14, 64), 128, 3, 1, 1), ((3, 13, 11, 64), 256, 1, 1, 0), ((5, 7, 9, 40), 64, 3, 1, 1),
              ((32, 28, 28, 64), 64, 3, 1, 1)]


def test_dgrad_bn_sums_where():
    """The sums twin: the plain kernel's where that is the persistent kernel with TMA stores (stride 1) at two CTAs an
    SM (128 x 64 tiles, C <= 64); none on 64 x 128 and 128 x 128 tiles (one CTA an SM) or for a strided dgrad (bulk
    rows, four phases; a strided 1x1's zeros), whose launch refuses them."""
    import igemm
    for xs, K, R, st, pd in SUMS_GEOMS:
        plan = igemm.Conv2dGradInputPlan(xs, (K, R, R, xs[3]), "float16", "NHWC", st, pd, device="numpy",
                                         arch="sm_90a", sms=132)
        assert plan.native.sums_tiles == -(-xs[0] * xs[1] * xs[2] // 128)
        assert [k.name() for k in plan.native.kernels()][-1] == "dgrad_float16_128x64_s3_ws_tma_bs"
    for xs, K, R, st, pd in (((8, 28, 28, 128), 128, 3, 1, 1), ((32, 14, 14, 256), 256, 3, 1, 1),
                             ((2, 15, 13, 64), 128, 3, 2, 1), ((2, 14, 13, 64), 256, 1, 2, 0)):
        plan = igemm.Conv2dGradInputPlan(xs, (K, R, R, xs[3]), "float16", "NHWC", st, pd, device="numpy",
                                         arch="sm_90a", sms=132)
        assert plan.native.sums_tiles == 0 and not any(k.sums for k in plan.native.kernels())
        with pytest.raises(ValueError, match="sums"):
            plan.native.launch(0, 16, 16, 16, sums=(16, 16, 16, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("xs,K,R,st,pd", SUMS_GEOMS)
def test_gpu_dgrad_bn_sums(dtype, xs, K, R, st, pd):
    """The dgrad that also writes the per-tile BatchNorm backward sums of the layer before (from its z, mask and
    mean) stores the plain kernel's dx bit for bit, its sums add up to float64's over dx as stored, and the
    one-launch backward from them gives every output the pass over dy and z would (_backward_case's bounds). With
    that layer's invstd, gamma and beta it also writes its ReLU(BN(z)), igemm.batch_norm_relu's bits."""
    torch = _torch()
    import igemm
    from igemm.nn._train_call import _PLAIN
    td = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(xs[0] * K + R + st)
    N, H, W, C = xs
    P, Q = (H + 2 * pd - R) // st + 1, (W + 2 * pd - R) // st + 1
    plan = igemm.Conv2dGradInputPlan(xs, (K, R, R, C), dtype, "NHWC", st, pd, device=0)
    T = plan.native.sums_tiles
    assert T > 0
    dy = torch.randn(N, P, Q, K, device="cuda", generator=g).to(td)
    w = (torch.randn(K, R, R, C, device="cuda", generator=g) / (R * R * K) ** 0.5).to(td)
    z = (torch.randn(N, H, W, C, device="cuda", generator=g) * 2 + 1).to(td)
    n = N * H * W * C
    words = torch.randint(-2**31, 2**31 - 1, ((n + 31) // 32,), device="cuda", generator=g, dtype=torch.int32)
    z64 = z.double().reshape(-1, C)
    mean = z64.mean(0).float()
    dx, ref = (torch.full((N, H, W, C), float("nan"), device="cuda").to(td) for _ in range(2))
    out = torch.full((2 * T * C,), float("nan"), device="cuda")
    h = torch.cuda.current_stream().cuda_stream
    plan._run(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), _PLAIN, False,
              (z.data_ptr(), words.data_ptr(), mean.data_ptr(), out.data_ptr()))
    plan._run(h, dy.data_ptr(), w.data_ptr(), ref.data_ptr(), _PLAIN)
    torch.cuda.synchronize()
    assert torch.equal(dx, ref) and not out.isnan().any()
    d = torch.where(_bits(words, n).reshape(dx.shape), dx.double(), 0.0).reshape(-1, C)
    t = out.double().reshape(2, T, C).sum(1)
    assert _rel(t[0], d.sum(0)) < 1e-5 and _rel(t[1], (d * (z64 - mean.double())).sum(0)) < 1e-5
    inv = torch.rand(C, device="cuda", generator=g) + 0.5
    for gam, bet in ((torch.randn(C, device="cuda", generator=g), torch.randn(C, device="cuda", generator=g)),
                     (None, None)):
        x, out2 = torch.full_like(z, float("nan")), torch.full_like(out, float("nan"))
        plan._run(h, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), _PLAIN, False,
                  (z.data_ptr(), words.data_ptr(), mean.data_ptr(), out2.data_ptr(), x.data_ptr(), inv.data_ptr(),
                   gam.data_ptr() if gam is not None else 0, bet.data_ptr() if bet is not None else 0))
        xr = igemm.batch_norm_relu(z, mean, inv, gam, bet, return_mask=False, layout="NHWC")
        torch.cuda.synchronize()
        assert torch.equal(dx, ref) and torch.equal(out2, out) and torch.equal(x, xr)
    k = _kernel(torch, True, dtype, N, C, H * W, tiles=T)
    _backward_case(torch, g, z.reshape(N, H * W, C), dx.reshape(N, H * W, C), words, True, k, tiles=out.data_ptr())
