"""Compile the kernels of the GPU tests whose configs are not a default (so not in the precompile sets):
the persistent kernel, cluster k-split and small-batch cases of tests/test_conv.py (262 kernels that
otherwise compile on the GPU machine, where a command has 600 s).
Dev machine; tools/precompile_all.sh runs it and tools/cache_subset.py carries its kernels.

    python tools/precompile_tests.py [arch=sm_90a]
"""
import sys

import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from igemm import _build, epilogues as ep  # noqa: E402
from igemm.conv import Conv2dOptions, Conv2dPlan  # noqa: E402
from igemm.conv._spec import stub as _stub  # noqa: E402

PERS = {"math": "wgmma_ws", "bm": 64, "splits": 1}
V = [np.random.rand(256 * 4) + 0.5 for _ in range(4)]


def chains(K, residual=True):
    g = [v[:K] for v in V]
    out = [None, ep.chain(ep.BatchNorm(*g), ep.ReLU(mask=True))]
    if residual:
        out.append(ep.chain(ep.BatchNorm(*g), ep.Add(), ep.ReLU(mask=True)))
    return out


def shape(s, layout):
    return (s[0], s[2], s[3], s[1]) if layout == "NHWC" else s


def test_stubs() -> dict:
    """{key: (kernel name, stub)} of the cases below, every dtype, layout and chain."""
    cases = []   # (xs NCHW, ws KCRS, stride, pad, dil, config)
    for xs, ws, st, pd, dl, cfg in [((2, 64, 9, 11), (40, 64, 3, 3), 1, 1, 1, {"bn": 64, "stages": 3}),
                                    ((3, 128, 13, 7), (72, 128, 3, 3), 2, 1, 1, {"bn": 128, "stages": 3}),
                                    ((4, 64, 14, 14), (256, 64, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4}),
                                    ((2, 192, 8, 8), (130, 192, 1, 1), 1, 0, 1, {"bn": 128, "stages": 3}),
                                    ((2, 64, 12, 12), (64, 64, 3, 3), 1, 2, 2, {"bn": 64, "stages": 4}),
                                    ((2, 256, 7, 7), (136, 256, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4})]:
        for wm in (1, 2):
            c = {**PERS, "wm": wm, **cfg}
            if wm == 1:
                c["stages"] = 8 if cfg["bn"] == 64 else 6
            cases += [(xs, ws, st, pd, dl, c), (xs, ws, st, pd, dl, {"math": "wgmma", "bm": 64, "wm": 1,
                                                                      "bn": cfg["bn"], "splits": 1})]
    for xs, ws, st, pd, dl, cfg in [((2, 512, 7, 7), (136, 512, 3, 3), 1, 1, 1, {"bn": 64, "stages": 6}),
                                    ((3, 192, 9, 10), (64, 192, 3, 3), 1, 1, 1, {"bn": 64, "stages": 4}),
                                    ((2, 128, 8, 8), (200, 128, 3, 3), 2, 1, 1, {"bn": 128, "stages": 6}),
                                    ((1, 64, 12, 12), (64, 64, 3, 3), 1, 2, 2, {"bn": 64, "stages": 8})]:
        cases.append((xs, ws, st, pd, dl, {**PERS, "wm": 1, "csplit": 2, **cfg}))
    for n, c, h in ((1, 256, 14), (8, 512, 7), (1, 512, 7), (1, 128, 28), (8, 256, 14), (8, 128, 28), (32, 512, 7)):
        cases.append(((n, c, h, h), (c, c, 3, 3), 1, 1, 1, None))
    specs = bitwise_stubs()
    specs.update(epilogue_stubs())
    specs.update(conv_statistics_stubs())
    from test_conv import SEVERAL_CTAS_CASES, several_ctas_plans
    for xs, ws, st, pd, dl, *rest in SEVERAL_CTAS_CASES:  # test_gpu_persistent_several_ctas (NCHW: as the test runs it)
        bn, stages = (rest or [128])[0], (rest[1:] or [0])[0]
        for dtype in ("float16", "bfloat16"):
            for layout in ("NCHW", "NHWC"):
                runs = [(ch, None) for ch in chains(ws[0])] + ([(chains(ws[0])[2], "float32")] if bn == 64 else [])
                for ch, rdt in runs:                    # (64-column cases: an fp32 residual too)
                    for p in several_ctas_plans(shape(xs, layout), shape(ws, layout), dtype, layout, st, pd, dl,
                                                epilogue=ch, device="numpy", bn=bn, stages=stages,
                                                residual_dtype=rdt).values():
                        s = p.spec()
                        specs[s.name() + str(s.epilogue)] = (s.name(), _stub(s))
    for xs, ws, st, pd, dl, cfg in cases:
        for dtype in ("float16", "bfloat16"):
            for layout in ("NCHW", "NHWC"):
                for ch in chains(ws[0]):
                    _add(specs, (xs, ws, cfg, layout, dtype), shape(xs, layout), shape(ws, layout), dtype, layout,
                         st, pd, dl, config=cfg, epilogue=ch, nchw_path="transpose" if layout == "NCHW" else "auto")
    return specs


def _add(specs: dict, label: tuple, *args, **kw) -> None:
    """``Conv2dPlan(*args, **kw)``'s kernel (no device) into ``specs``, or a line where the plan refuses it."""
    try:
        opts = {k: kw.pop(k) for k in ("config", "nchw_path", "pad_channels", "unfold") if k in kw}
        s = Conv2dPlan(*args, device="numpy", options=Conv2dOptions(**opts), **kw).spec()
    except Exception as e:  # noqa: BLE001
        print("skip", *label, e)
        return
    specs[s.name() + str(s.epilogue)] = (s.name(), _stub(s))


def bitwise_stubs() -> dict:
    """The kernels of test_conv.py's test_gpu_register_epilogue_nchw_bitwise and
    test_gpu_register_epilogue_bitwise: each case's chains (the residual ones among them) on the register
    epilogue and on the fp32 C tile's store."""
    from test_conv import NCHW_BITWISE_CASES, REGS_BITWISE_CASES
    specs = {}

    def add(xs, ws, layout, st, pd, cfg, fp32_store, last_chain):
        """Each dtype's seven chains (the 16-bit residual one, then ``last_chain(g, dtype)``: (chain, residual
        dtype)) on the register epilogue and on the fp32 C tile's ``fp32_store``."""
        g = [v[:ws[0]] for v in V]
        for dtype in ("float16", "bfloat16"):
            for ch, rdt in ((None, None), (ep.chain(ep.BatchNorm(*g), ep.ReLU(mask=True)), None),
                            (ep.chain(ep.PReLU(g[0] - 1.0)), None), (ep.chain(ep.Bias(g[1]), ep.ReLU()), None),
                            (ep.chain(ep.Bias(g[1]), ep.PReLU(0.25)), None),
                            (ep.chain(ep.BatchNorm(*g), ep.Add(), ep.ReLU(mask=True)), dtype), last_chain(g, dtype)):
                for c in (cfg, {**(cfg or {}), "store": fp32_store}):
                    _add(specs, (xs, ws, c, dtype), xs, ws, dtype, layout, st, pd, 1, config=c or None, epilogue=ch,
                         residual_dtype=rdt)

    for xs, K, R, st, cfg in REGS_BITWISE_CASES:      # the fp32 residual's chain
        add(xs, (K, R, R, xs[-1]), "NHWC", st, R // 2, cfg, "rows",
            lambda g, dt: (ep.chain(ep.Add(), ep.BatchNorm(*g), ep.ReLU()), "float32"))
    for xs, ws, st, pd, cfg in NCHW_BITWISE_CASES:    # the other 16-bit type's residual
        add(xs, ws, "NCHW", st, pd, cfg, "nchw",
            lambda g, dt: (ep.chain(ep.Add(), ep.Bias(g[1]), ep.PReLU(g[0] - 1.0)),
                           "bfloat16" if dt == "float16" else "float16"))
    return specs


def conv_statistics_stubs() -> dict:
    """tests/test_norm_train.py's test_gpu_train_forward_from_conv_statistics: each geometry's conv with z's
    statistics and the plain one it is compared with."""
    from test_norm_train import CONV_GEOMS

    from igemm.nn._train_call import stats_plan
    specs = {}
    for xs, K, R, st in CONV_GEOMS:
        for dtype in ("float16", "bfloat16"):
            ws = (K, R, R, xs[3])
            s = stats_plan(xs, ws, dtype, (st, st), (R // 2, R // 2), (1, 1), "numpy").spec()
            specs[s.name() + str(s.epilogue)] = (s.name(), _stub(s))
            _add(specs, (xs, ws, dtype), xs, ws, dtype, "NHWC", st, R // 2, 1, _skeleton=True)
    return specs


def epilogue_stubs() -> dict:
    """The kernels of tests/test_epilogues.py's test_gpu_chains: its random problems, drawn from the same
    per-test generator (conftest's ``rng``: seeded from the test id) in the same order of draws."""
    import zlib

    import test_epilogues as te
    specs = {}
    for dtype in ("float16", "bfloat16", "float32"):
        for layout in ("NCHW", "NHWC"):
            for name in te.CHAINS:
                rng = np.random.default_rng(zlib.crc32(
                    f"tests/test_epilogues.py::test_gpu_chains[{dtype}-{layout}-{name}]".encode()))
                for _ in range(50):
                    xs, ws, st, pd = te._shape_family(rng, layout)
                    x64, w64 = te.to_layout(rng.standard_normal(xs), rng.standard_normal(ws), layout)
                    N, K, R = xs[0], ws[0], ws[2]
                    P, Q = ((xs[2] + 2 * pd - R) // st + 1, (xs[3] + 2 * pd - R) // st + 1)
                    V = te.bn_vectors(rng, K)
                    rng.standard_normal((N, K, P, Q))                   # the residual
                    chain = ep.chain(te.CHAINS[name](V, None))
                    _add(specs, (xs, ws, layout, dtype, name), x64.shape, w64.shape, dtype, layout, st, pd,
                         epilogue=chain, residual_dtype=dtype if chain.residual_op else None)
    return specs


if __name__ == "__main__":
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90a"
    print(_build.compile_many(test_stubs().values(), arch, None), "kernels")
