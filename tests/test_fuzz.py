"""Fuzzing every kernel family against the float64 oracle (issue 8: users must never get a silent wrong answer).

Two tiers:

* **GPU-free (CI)**: hypothesis with a fixed seed (``derandomize=True``) runs every public function on the
  numpy backend over small random problems, against *independent* formulas (im2col/FFT conv, ``np.packbits``,
  loops, ``np.mean``/``np.var``, concatenated data for the merges): the API glue, casts, ``out=`` handling and
  return types are checked the same way on every run.
* **GPU** (``@gpu @slow``): random valid problems through the real kernels against ``igemm.reference``
  (float64, on the inputs as rounded to their dtype), outputs NaN/0xAA-poisoned first:

  - conv: fp16/bf16 (wgmma), fp32 strict (SIMT FFMA), tf32, and the mma.sync path forced on fp16/bf16, x
    NCHW/NHWC x 11 epilogue chains, random stride/padding/dilation/split-K, function and plan APIs;
  - BatchNorm statistics (``welford``, ``batch_norm_stats`` with running stats), ``batch_norm_gather_stats``;
  - ``index_add`` (atomic and deterministic), ``prelu``/``prelu_backward``, ``relu_mask``/``relu_backward``.

  Examples per test item: ``$IGEMM_FUZZ_EXAMPLES`` (default 24: 82 conv items + 22 others, ~2,500
  problems a run). ``$IGEMM_FUZZ_SEED`` fixes hypothesis's seed (default: random, the failing example is
  printed); ``$IGEMM_FUZZ_SHRINK=1`` turns shrinking on (off by default: shrinking a GPU failure compiles new
  kernels); ``$IGEMM_FUZZ_LOG=<file>`` appends ``<item> <examples run>`` per item (sum it for the total).

Bounded compilation. A conv kernel costs ~4 s of nvcc, so the conv problems are drawn from *cells*: a
mainloop class (fixes the load modes and the pipeline depth) x a store class (fixes the store mode, its
vector width and whether the ReLU mask is fused), chosen per (dtype, layout, chain) so that the whole fuzz
needs ~150 conv kernels (``test_conv_fuzz_domain_is_bounded`` keeps it so). Compile them ahead, in
parallel, with ``python tests/test_fuzz.py precompile [arch]`` (into ``$IGEMM_CACHE_DIR``).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest

import igemm
from igemm import epilogues as ep
from igemm import reference
from igemm.reference.epilogue import apply_chain

from helpers import TOL, poison, rel_err, to_numpy

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_epilogues import CHAINS as EPI_CHAINS  # noqa: E402
from test_epilogues import bn_vectors  # noqa: E402
from test_index_add import _naive as index_add_loops  # noqa: E402
from test_prelu import _loops as prelu_loops  # noqa: E402
from test_validation import tf32_round  # noqa: E402

ia = importlib.import_module("igemm.index_add")
pm = importlib.import_module("igemm.prelu")

EXAMPLES = int(os.environ.get("IGEMM_FUZZ_EXAMPLES", "24"))
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
             HealthCheck.filter_too_much]

CPU_SETTINGS = settings(max_examples=int(os.environ.get("IGEMM_FUZZ_CPU_EXAMPLES", "20")), derandomize=True,
                        deadline=None, database=None, suppress_health_check=_SUPPRESS, print_blob=False,
                        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


def gpu_fuzz(fn):
    """hypothesis settings of the GPU tier (see the module doc for the environment knobs)."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("IGEMM_FUZZ_SHRINK", "") not in ("", "0"):
        phases.append(Phase.shrink)
    fn = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=phases, derandomize=False,
                  suppress_health_check=_SUPPRESS, report_multiple_bugs=False, print_blob=True)(fn)
    if os.environ.get("IGEMM_FUZZ_SEED"):
        fn = hypothesis.seed(int(os.environ["IGEMM_FUZZ_SEED"]))(fn)
    return fn


def _report(item: str, n: int) -> None:
    print(f"fuzz {item}: {n} examples")
    path = os.environ.get("IGEMM_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{item} {n}\n")


class _Count:
    n = 0


# ================================================================================================ drawing
class _Hyp:
    """Choices drawn by hypothesis (inside an ``st.composite``)."""

    def __init__(self, draw):
        self.draw = draw

    def pick(self, xs):
        return self.draw(st.sampled_from(list(xs)))

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def bool(self) -> bool:
        return self.draw(st.booleans())


class _Rng:
    """The same choices from a numpy generator (to enumerate what a fuzz run can compile, on the CPU)."""

    def __init__(self, rng):
        self.rng = rng

    def pick(self, xs):
        xs = list(xs)
        return xs[int(self.rng.integers(len(xs)))]

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def bool(self) -> bool:
        return bool(self.rng.integers(2))


def _composite(gen):
    """A hypothesis strategy from a generator written against the ``_Hyp``/``_Rng`` interface."""
    @st.composite
    def strat(draw, *args):
        return gen(_Hyp(draw), *args)
    return strat


def _np_rng(seed: int):
    return np.random.default_rng(seed)


def _torch():
    return pytest.importorskip("torch")


def _tdev(torch, a, dtype: str, offset: int = 0):
    """A CUDA tensor of ``dtype`` holding ``a`` (rounded), ``offset`` elements into a bigger buffer (0: aligned)."""
    a = np.asarray(a, dtype=np.float32)
    buf = torch.empty(a.size + offset, dtype=getattr(torch, dtype), device="cuda")
    t = buf[offset:].view(a.shape)
    t.copy_(torch.from_numpy(np.ascontiguousarray(a)).to("cuda"))
    return t


# ================================================================================================ conv cells
#: mainloop classes: (C, R, S) triples that fix the loaders and the pipeline depth of every math path
#: (wgmma BK=64, mma.sync BK=32, tf32 BK=16, SIMT BK=8): vec_* have C % 8 == 0 and C*R*S % 8 == 0 (16-byte
#: loads), gather_* an odd C*R*S (element gathers: plan API with unfold=False); *_shallow/gather have
#: C*R*S <= 32 (2 stages everywhere), *_deep C*R*S > 128 (the deep pipeline everywhere).
MAINLOOP = {
    "vec_deep": [(16, 3, 3), (24, 3, 3), (32, 3, 3)],
    "vec_shallow": [(8, 1, 1), (16, 1, 1), (32, 1, 1)],
    "gather": [(1, 1, 1), (3, 1, 1), (5, 1, 1), (1, 3, 3), (3, 3, 3), (1, 1, 3), (3, 3, 1), (5, 1, 3), (1, 5, 5)],
    "gather_deep": [(3, 7, 7), (5, 5, 7), (1, 13, 13)],
    # 16-bit C < 8 on copies padded to 8 channels (pad_channels=True)
    "padded": [(1, 3, 3), (3, 3, 3), (5, 3, 3), (7, 1, 1), (3, 3, 1), (6, 1, 5)],
    # x and w unfolded along the width (unfold="copy": C -> roundup(S*C, 16 bytes), S -> 1; conv1's default
    # where the patch kernel cannot run); R * roundup(S*C) > 128 for 2- and 4-byte elements: the deep pipeline
    "unfold": [(3, 7, 7), (5, 5, 5), (7, 3, 7), (6, 3, 7), (3, 11, 5)],
    # the width unfold in shared memory (unfold="patch": 16-bit NHWC, dilation 1, W*C % 8 == 0; conv1's
    # default on sm_90): three k-tiles each (the whole filter tile resident: stages = 3)
    "patch": [(3, 7, 7), (5, 5, 5), (7, 3, 7), (6, 3, 7), (3, 11, 5)],
}
#: NHWC store classes by K (every K > 128 is "rows" for every tile width in use: 64, 128; on the 16-bit
#: wgmma paths every K % 8 == 0 takes the register epilogue, "regs", unless split):
#: lin: K <= 64 (the CTA owns whole output rows; K % 8 != 0 wraps rows inside a vector),
#: rows: K % 32 == 0 (mask fused), rows_nofuse: K % 8 == 0 but K % 32 != 0 (the fp32 C tile's "rows" store
#: leaves the mask to the relu_mask kernel; the 16-bit register epilogue fuses it, a byte per vector),
#: rows_scalar: K % 4 != 0 (scalar stores).
NHWC_K = {"lin": [5, 8, 13, 24, 30, 64], "rows": [160, 192, 256], "rows_nofuse": [136, 200],
          "rows_scalar": [130, 150]}
#: NCHW store classes by the output map P x Q (16-bit wgmma paths: the register epilogue "regsnchw" unless
#: split or the chain has an fp32 residual): pq32 (P*Q % 32 == 0: vector stores, mask fused), pq_vec
#: (P*Q % 8 == 0 only), pq_pair (P*Q % 4 == 2: 2-element vectors), pq_scalar (P*Q odd).
NCHW_PQ = {"pq32": [(4, 8), (8, 4), (2, 16), (8, 8), (1, 32)], "pq_vec": [(2, 4), (4, 4), (3, 8), (6, 4), (5, 8)],
           "pq_pair": [(6, 5), (2, 3), (3, 2), (5, 2), (2, 7)],
           "pq_scalar": [(3, 3), (5, 3), (1, 7), (7, 7), (3, 5), (1, 1)]}
NCHW_K = [1, 8, 24, 64, 100, 136]
NCHW_K_TF32 = [72, 100, 136]     # tf32 tiles are 64 wide up to K = 64, 128 above: one width per cell

#: math paths: (id, dtype, precision, forced math)
CONV_PATHS = [("fp16", "float16", "strict", None), ("bf16", "bfloat16", "strict", None),
              ("fp32", "float32", "strict", None), ("tf32", "float32", "tf32", None),
              ("fp16-mma", "float16", "strict", "tensorop"), ("bf16-mma", "bfloat16", "strict", "tensorop")]


def _other_dtype(dtype: str) -> str:
    return "float32" if dtype != "float32" else "float16"


# chain builders: (V = [gamma, beta, mean, var], residual) -> epilogue; the test_epilogues chains and more
CONV_CHAINS = {"none": lambda V, r: None, **EPI_CHAINS,
               "add_res_relu_mask": lambda V, r: ep.chain(ep.Add(r), ep.ReLU(mask=True)),      # residual dtype != y
               "add_bias_bn_prelu": lambda V, r: ep.chain(ep.Add(r), ep.Bias(V[1]), ep.BatchNorm(*V, eps=1e-3),
                                                          ep.PReLU(V[0] - 1.0))}
_MASK_CHAINS = {"bn_relu_mask", "bn_add_relu_mask", "add_res_relu_mask"}


#: chains per math path: every chain on the three dtypes' default paths; the tf32 and forced mma.sync paths
#: (the same epilogue code) the plain chain and a few representative ones
PATH_CHAINS = {"tf32": ("none", "bn_relu_mask", "add_res_relu_mask", "add_bias_bn_prelu"),
               "fp16-mma": ("none", "bn_add_relu_mask"), "bf16-mma": ("none", "bn_add_relu_mask")}


def conv_items():
    """(path, layout, chain) test items."""
    return [(pid, layout, chain) for pid, *_ in CONV_PATHS for layout in ("NCHW", "NHWC")
            for chain in CONV_CHAINS if chain in PATH_CHAINS.get(pid, CONV_CHAINS)]


def conv_cells(pid: str, layout: str, chain: str) -> list[tuple[str, str]]:
    """(mainloop class, store class) pairs drawn for an item: the mainloop classes on the plain chain, and
    for the epilogue chains a rotation of the store classes (mask chains always get a fused and an unfused
    one), so every (chain, store mode) meets on some path while each item compiles 1-4 kernels."""
    j = [p[0] for p in CONV_PATHS].index(pid)
    names = list(CONV_CHAINS)
    i = names.index(chain)
    if layout == "NHWC":
        stores = ["lin", "rows", "rows_nofuse", "rows_scalar"]
        fused, unfused = ["lin", "rows"], ["rows_nofuse", "rows_scalar"]
    else:
        stores = ["pq32", "pq_vec", "pq_pair", "pq_scalar"]
        fused, unfused = ["pq32"], ["pq_vec", "pq_pair", "pq_scalar"]
    if chain == "none":
        _, dtype, _, math = next(p for p in CONV_PATHS if p[0] == pid)
        fp32 = dtype == "float32"
        return [(ml, stores[(k + j) % len(stores)]) for k, ml in enumerate(MAINLOOP)
                if not (fp32 and ml == "padded")           # fp32 is never padded: that cell is "gather"
                and not (ml == "patch" and (fp32 or math or layout == "NCHW"))]   # the patch kernel's domain
    ml = ["vec_deep", "vec_shallow"][(i + j) % 2]
    if chain in _MASK_CHAINS:
        return [(ml, fused[(i + j) % len(fused)]), (ml, unfused[(i + j) % len(unfused)])]
    return [(ml, stores[(i + j) % len(stores)])]


@dataclass(frozen=True)
class ConvCase:
    pid: str
    dtype: str
    precision: str
    math: str | None
    layout: str
    chain: str
    cell: tuple
    N: int
    C: int
    K: int
    R: int
    S: int
    H: int
    W: int
    stride: tuple
    padding: tuple
    dilation: tuple
    splits: int
    api: str            # "function" | "plan"
    out: bool           # pass preallocated (poisoned) outputs
    x_offset: int       # elements: 1 makes x 2/4-byte aligned only (narrow loads)
    vec_on_host: bool   # BN/bias/alpha vectors as numpy (folded on the host) instead of CUDA tensors
    residual_kw: bool   # the residual as residual= rather than inside ep.Add
    seed: int

    @property
    def x_shape(self):
        return (self.N, self.C, self.H, self.W) if self.layout == "NCHW" else (self.N, self.H, self.W, self.C)

    @property
    def w_shape(self):
        return (self.K, self.C, self.R, self.S) if self.layout == "NCHW" else (self.K, self.R, self.S, self.C)

    @property
    def res_dtype(self):
        return _other_dtype(self.dtype) if self.chain == "add_res_relu_mask" else self.dtype

    @property
    def pad_channels(self):
        """The padded cells run on channel-padded copies (an opt-in of the plan API)."""
        return True if self.cell[0] == "padded" else None

    @property
    def unfold(self):
        """The unfold cells' way (copies or the patch kernel); the gather cells keep the element gather
        (unfold=False)."""
        if self.cell[0] in ("unfold", "patch"):
            return {"unfold": "copy", "patch": "patch"}[self.cell[0]]
        return False if self.cell[0].startswith("gather") else None

    def config(self):
        cfg = {}
        if self.math:
            cfg["math"] = self.math
        if self.splits > 1:
            cfg["splits"] = self.splits
        return cfg or None


def _in_size(out: int, k: int, st_: int, pad: int, dil: int, extra: int) -> int:
    return (out - 1) * st_ + dil * (k - 1) + 1 - 2 * pad + extra


def gen_conv_case(D, item) -> ConvCase:
    pid, layout, chain = item
    _, dtype, precision, math = next(p for p in CONV_PATHS if p[0] == pid)
    cell = D.pick(conv_cells(pid, layout, chain))
    ml, store = cell
    C, R, S = D.pick(MAINLOOP[ml])
    if layout == "NHWC":
        K = D.pick(NHWC_K[store])
        # (patch cells: few pixels a line would put too many lines' patches in one tile's shared memory)
        P, Q = D.int(1, 8), (D.int(1, 8) if ml != "patch" else D.int(6, 12))
    else:
        K = D.pick(NCHW_K_TF32 if precision == "tf32" else NCHW_K)
        P, Q = D.pick(NCHW_PQ[store])
    N = D.int(1, 3)
    st_ = (D.int(1, 2), D.int(1, 2))
    dl = (D.int(1, 2), D.int(1, 2)) if ml != "patch" else (1, 1)
    pd = (D.int(0, min(3, ((P - 1) * st_[0] + dl[0] * (R - 1)) // 2)),
          D.int(0, min(3, ((Q - 1) * st_[1] + dl[1] * (S - 1)) // 2)))
    H = _in_size(P, R, st_[0], pd[0], dl[0], D.int(0, st_[0] - 1))
    W = _in_size(Q, S, st_[1], pd[1], dl[1], D.int(0, st_[1] - 1))
    if ml == "patch":               # rows of x in whole 16 bytes (the patch's tensor map); Q follows W
        W = -(-W // (8 // int(np.gcd(C, 8)))) * (8 // int(np.gcd(C, 8)))
    kt = -(-(C * R * S) // 64)                     # k-tiles at the widest BK in use: any split fits every path
    splits = min(D.pick([1, 1, 2, 3]), kt) if ml != "patch" else 1     # (the patch kernel has no split-K)
    # channel padding is a plan option: the padded cells use a plan
    # (the gather cells keep the element gather: unfold=False, a plan option, as the default unfolds C < 8)
    api = "plan" if (math or splits > 1 or ml in ("padded", "unfold", "patch") or ml.startswith("gather")) \
        else D.pick(["function", "plan"])
    # a misaligned x adds the narrow-load variant of a kernel: only where the loads are element gathers
    # anyway (NCHW, gather cells) or on the plain chain
    # (a patch plan hands a misaligned x to its copy-path twin: test_conv.py's test_gpu_patch)
    x_off = (D.pick([0, 1]) if (chain == "none" or layout == "NCHW" or ml.startswith("gather")) and ml != "patch"
             else 0)
    return ConvCase(pid, dtype, precision, math, layout, chain, cell, N, C, K, R, S, H, W, st_, pd, dl, splits,
                    api, D.bool(), x_off, D.bool(), D.bool(), D.int(0, 2 ** 32 - 1))


conv_cases = _composite(gen_conv_case)


def conv_case_spec(case: ConvCase):
    """The kernel a case runs (pure: the plan's choice for sm_90a with 132 SMs, as on H100/H200)."""
    from igemm.conv import Conv2dPlan
    chain = ep.chain(*_chain_ops(case)).skeleton()
    plan = Conv2dPlan(case.x_shape, case.w_shape, case.dtype, case.layout, case.stride, case.padding, case.dilation,
                      chain, case.precision, case.res_dtype if chain.residual_op else None, device="numpy", _skeleton=True, options=igemm.Conv2dOptions(config=case.config(), pad_channels=case.pad_channels, unfold=case.unfold))
    return plan.spec(x_aligned=case.x_offset == 0)


def _chain_ops(case: ConvCase):
    K = case.K
    dummy = [np.ones(K, np.float32)] * 4
    e = CONV_CHAINS[case.chain](dummy, None)
    return ep.chain(e).ops if e is not None else ()


def conv_stubs(pid_filter=None, n: int = 300, seed: int = 0) -> dict:
    """{(stub, name)} the conv fuzz can compile (sampled: ``n`` draws per item), for precompiling / bounds."""
    from igemm.conv._spec import stub as _stub
    out = {}
    rng = np.random.default_rng(seed)
    for item in conv_items():
        if pid_filter and item[0] not in pid_filter:
            continue
        D = _Rng(rng)
        for _ in range(n):
            spec = conv_case_spec(gen_conv_case(D, item))
            out[_stub(spec)] = spec.name()
    return out


ACC = 1e-5      # fp32 accumulation error allowed, relative to the magnitude of the summed terms


def _magnitude(abs_pre, chain, layout, res_abs):
    """An elementwise bound of the terms behind each output: the chain applied to |x| * |w| with |vectors|."""
    from igemm.reference.epilogue import host_f64
    shp = [1, -1, 1, 1] if layout == "NCHW" else [1, 1, 1, -1]

    def vec(v):
        return np.abs(host_f64(v)).reshape(shp)
    m = abs_pre
    for o in chain.ops:
        if isinstance(o, ep.BatchNorm):
            m = vec(o.gamma) / np.sqrt(host_f64(o.var).reshape(shp) + o.eps) * (m + vec(o.mean)) + vec(o.beta)
        elif isinstance(o, ep.Bias):
            m = m + vec(o.b)
        elif isinstance(o, ep.Add):
            m = m + res_abs
        elif isinstance(o, ep.PReLU):
            m = m * (np.maximum(1.0, vec(o.alpha)) if o.per_channel else max(1.0, abs(float(o.alpha))))
    return m


def run_conv_case(torch, case: ConvCase) -> None:
    from igemm.conv import Conv2dPlan
    rng = _np_rng(case.seed)
    Kred = case.C * case.R * case.S
    x = _tdev(torch, rng.standard_normal(case.x_shape), case.dtype, case.x_offset)
    w = _tdev(torch, rng.standard_normal(case.w_shape) / np.sqrt(Kred), case.dtype)
    x64, w64 = to_numpy(x), to_numpy(w)
    if case.precision == "tf32":            # the kernel rounds x and w to TF32 (rna): so does the reference
        x64, w64 = tf32_round(x64), tf32_round(w64)
    pre = reference.conv2d_im2col(x64, w64, case.stride, case.padding, case.dilation, case.layout)
    lib = (lambda a: a) if case.vec_on_host else (lambda a: torch.from_numpy(a).cuda())
    V = bn_vectors(rng, case.K, lib)
    res = _tdev(torch, rng.standard_normal(pre.shape), case.res_dtype)
    built = CONV_CHAINS[case.chain](V, None if case.residual_kw else res)
    chain = ep.chain(built) if built is not None else ep.chain()
    has_res = chain.residual_op is not None
    res64 = to_numpy(res) if has_res else None
    ref = apply_chain(pre, chain, case.layout, residual=res64)
    tdt = getattr(torch, case.dtype)
    out = poison(torch.empty(pre.shape, dtype=tdt, device="cuda")) if case.out else None
    words = (pre.size + 31) // 32
    mask_out = poison(torch.empty(words, dtype=torch.int32, device="cuda")) if (case.out and chain.mask) else None
    kw = dict(out=out, mask_out=mask_out)
    if has_res and case.residual_kw:
        kw["residual"] = res
    label = (f"{case.pid} {case.layout} {case.chain} cell={case.cell} x{case.x_shape} w{case.w_shape} "
             f"stride={case.stride} pad={case.padding} dil={case.dilation} splits={case.splits} api={case.api}")
    if case.api == "function":
        r = igemm.conv2d(x, w, case.stride, case.padding, case.dilation, layout=case.layout,
                         epilogue=chain if chain.ops else None, precision=case.precision, **kw)
    else:
        plan = Conv2dPlan(x.shape, w.shape, case.dtype, case.layout, case.stride, case.padding, case.dilation,
                          chain if chain.ops else None, case.precision,
                          case.res_dtype if has_res else None, options=igemm.Conv2dOptions(config=case.config(), pad_channels=case.pad_channels, unfold=case.unfold))
        if case.splits > 1:
            assert plan.spec().splits == case.splits, label
        if case.math:
            assert plan.spec().math == case.math, label
        r = plan(x, w, **kw)
    y, mask = (r if chain.mask else (r, None))
    if case.out:
        assert y is out, label
        if chain.mask:
            assert mask is mask_out, label
    assert tuple(y.shape) == pre.shape and y.dtype == tdt, label
    y64 = to_numpy(y)
    tol = TOL["tf32" if case.precision == "tf32" else case.dtype]
    # the output's rounding is relative to it; fp32 accumulation errors to the magnitude of the terms
    mag = _magnitude(reference.conv2d_im2col(np.abs(x64), np.abs(w64), case.stride, case.padding, case.dilation,
                                             case.layout), chain, case.layout, np.abs(res64) if has_res else None)
    err = float(np.linalg.norm((y64 - ref).ravel())) if np.all(np.isfinite(y64)) else float("inf")
    bound = tol * float(np.linalg.norm(ref.ravel())) + ACC * float(np.linalg.norm(mag.ravel()))
    assert err <= bound, f"{label}: error {err:.3g} > {bound:.3g} (rel {rel_err(y64, ref):.3g})"
    if chain.mask:
        assert mask.dtype == torch.int32 and mask.numel() >= words, label
        m = mask.cpu().numpy().view(np.uint32)[:words]
        bits = reference.unpack_mask(m, y64.size).reshape(y64.shape)
        np.testing.assert_array_equal(bits, y64 > 0, err_msg=f"{label}: mask != (stored y > 0)")
        if y64.size % 32:
            assert m[-1] >> (y64.size % 32) == 0, f"{label}: mask bits past the end"
        pre_act = apply_chain(pre, ep.chain(*[o for o in chain.ops if not isinstance(o, ep.ReLU)]), case.layout,
                              residual=res64)
        sure = np.abs(pre_act) > 4 * ACC * mag + 1e-7
        np.testing.assert_array_equal(bits[sure], (pre_act > 0)[sure], err_msg=f"{label}: mask vs reference")
    if case.api == "plan" and plan.spec().splits > 1:      # split-K is deterministic and resets its tickets
        again = plan(x, w, **({"residual": res} if (has_res and case.residual_kw) else {}))
        assert torch.equal(again[0] if chain.mask else again, y), f"{label}: split-K not deterministic"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("item", conv_items(), ids=lambda it: "-".join(it))
def test_gpu_fuzz_conv(item):
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=conv_cases(item))
    def inner(case):
        count.n += 1
        run_conv_case(torch, case)

    inner()
    _report("conv/" + "-".join(item), count.n)


# ================================================================================================ BatchNorm
#: spatial shapes (NCHW: HW = product; its divisibility picks the vector width) and channel counts (NHWC)
BN_SPATIAL = [(), (1,), (7,), (3, 5), (4, 4), (2, 6), (8, 8), (1, 33), (2, 3, 4), (10, 10), (16, 16)]
BN_C = [1, 2, 3, 5, 8, 12, 16, 24, 33, 64, 100]
BN_N = [0, 1, 1, 2, 3, 4, 8, 16]


@dataclass(frozen=True)
class BnCase:
    dtype: str
    layout: str
    shape: tuple
    offset: int
    f64: bool
    running: bool
    eps: float
    momentum: float
    seed: int


def gen_bn_case(D, item) -> BnCase:
    dtype, layout = item
    N, C, sp = D.pick(BN_N), D.pick(BN_C), D.pick(BN_SPATIAL)
    shape = (N, C, *sp) if layout == "NCHW" else (N, *sp, C)
    return BnCase(dtype, layout, shape, D.pick([0, 0, 1]), D.bool(), D.bool(), D.pick([1e-5, 1e-3, 0.0]),
                  D.pick([0.1, 0.5]), D.int(0, 2 ** 32 - 1))


bn_cases = _composite(gen_bn_case)
BN_ITEMS = [(dt, lay) for dt in ("float32", "float16", "bfloat16") for lay in ("NCHW", "NHWC")]


def _bn_data(rng, shape, layout):
    C = shape[1] if layout == "NCHW" else shape[-1]
    ax = 1 if layout == "NCHW" else len(shape) - 1
    bshape = [1] * len(shape)
    bshape[ax] = C
    mu = rng.uniform(-3, 3, C).reshape(bshape)
    sd = rng.uniform(0.3, 2, C).reshape(bshape)
    return rng.standard_normal(shape) * sd + mu


def _assert_stats(mean, var, ref_m, ref_v, tol, what):
    mean, var = np.asarray(mean, np.float64), np.asarray(var, np.float64)
    scale = np.abs(ref_m) + np.sqrt(ref_v) + 1e-30
    assert np.all(np.abs(mean - ref_m) <= tol * scale), f"{what}: mean err {np.max(np.abs(mean - ref_m) / scale):.3g}"
    assert np.all(np.abs(var - ref_v) <= tol * ref_v + 1e-30), \
        f"{what}: var rel err {np.max(np.abs(var - ref_v) / (ref_v + 1e-30)):.3g}"


def run_bn_case(torch, case: BnCase) -> None:
    rng = _np_rng(case.seed)
    x = _tdev(torch, _bn_data(rng, case.shape, case.layout), case.dtype, case.offset)
    xs = to_numpy(x)
    C = case.shape[1] if case.layout == "NCHW" else case.shape[-1]
    ref_m, ref_v, ref_n = reference.welford_stats(xs, case.layout)
    what = f"{case}"
    odt = torch.float64 if case.f64 else torch.float32
    outs = tuple(poison(torch.empty(C, dtype=odt, device="cuda")) for _ in range(3))
    m, v, n = igemm.welford(x, case.layout, out=outs)
    assert all(a is b for a, b in zip((m, v, n), outs)), what
    _assert_stats(to_numpy(m), to_numpy(v), ref_m, ref_v, 1e-5, what)
    np.testing.assert_array_equal(to_numpy(n), ref_n, err_msg=what)
    rm = torch.from_numpy(rng.standard_normal(C).astype(np.float32)).cuda() if case.running else None
    rv = torch.from_numpy(rng.uniform(0.5, 2, C).astype(np.float32)).cuda() if case.running else None
    rm0, rv0 = (to_numpy(rm), to_numpy(rv)) if case.running else (None, None)
    mean, invstd = igemm.batch_norm_stats(x, case.eps, case.layout, running_mean=rm, running_var=rv,
                                          momentum=case.momentum)
    assert mean.dtype == torch.float32 and tuple(mean.shape) == (C,), what
    scale = np.abs(ref_m) + np.sqrt(ref_v) + 1e-30
    assert np.all(np.abs(to_numpy(mean) - ref_m) <= 1e-5 * scale), what
    ref_i = reference.invstd_from_var(ref_v, case.eps)
    finite = np.isfinite(ref_i)
    np.testing.assert_allclose(to_numpy(invstd)[finite], ref_i[finite], rtol=1e-5, err_msg=what)
    assert np.all(~np.isfinite(to_numpy(invstd)[~finite])), what
    if case.running:
        erm, erv = reference.update_running_stats_ref(rm0, rv0, ref_m, ref_v, ref_n, case.momentum)
        np.testing.assert_allclose(to_numpy(rm), erm, rtol=1e-5, atol=1e-5 * (1 + np.abs(ref_m).max()), err_msg=what)
        np.testing.assert_allclose(to_numpy(rv), erv, rtol=1e-4, atol=1e-6, err_msg=what)
    m2, i2 = igemm.batch_norm_stats(x, case.eps, case.layout)
    assert torch.equal(m2, mean) and torch.equal(i2, invstd), f"{what}: not deterministic"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("item", BN_ITEMS, ids=lambda it: "-".join(it))
def test_gpu_fuzz_bn_stats(item):
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=bn_cases(item))
    def inner(case):
        count.n += 1
        run_bn_case(torch, case)

    inner()
    _report("bn_stats/" + "-".join(item), count.n)


@dataclass(frozen=True)
class GatherCase:
    W: int
    C: int
    mdtype: str
    cdtype: str
    per_channel: bool
    seed: int


def gen_gather_case(D, item=None) -> GatherCase:
    return GatherCase(D.int(1, 6), D.int(1, 40), D.pick(["float32", "float64"]), D.pick(["float32", "int64"]),
                      D.bool(), D.int(0, 2 ** 32 - 1))


gather_cases = _composite(gen_gather_case)


def _gather_data(rng, case):
    """Per-rank data, its partials (mean, biased var, count per channel), and the merged truth."""
    cnt = rng.integers(0, 6, (case.W, case.C) if case.per_channel else case.W)
    if not case.per_channel:
        cnt = np.repeat(cnt[:, None], case.C, axis=1)
    means = np.zeros((case.W, case.C))
    vars_ = np.zeros((case.W, case.C))
    allm, allv, alln = np.zeros(case.C), np.zeros(case.C), np.zeros(case.C)
    for c in range(case.C):
        parts = [rng.standard_normal(cnt[w, c]) * rng.uniform(0.5, 2) + rng.uniform(-2, 2) for w in range(case.W)]
        for w, p in enumerate(parts):
            if p.size:
                means[w, c], vars_[w, c] = p.mean(), p.var()
            else:
                means[w, c] = vars_[w, c] = np.nan if rng.random() < 0.5 else 0.0   # ignored: count 0
        cat = np.concatenate(parts)
        if cat.size:
            allm[c], allv[c], alln[c] = cat.mean(), cat.var(), cat.size
    counts = cnt if case.per_channel else cnt[:, 0]
    return means, vars_, counts, (allm, allv, alln)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_fuzz_bn_gather():
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=gather_cases())
    def inner(case):
        count.n += 1
        rng = _np_rng(case.seed)
        means, vars_, counts, (tm, tv, tn) = _gather_data(rng, case)
        mdt, cdt = getattr(torch, case.mdtype), getattr(torch, case.cdtype)
        outs = tuple(poison(torch.empty(case.C, dtype=mdt, device="cuda")) for _ in range(3))
        m, v, n = igemm.batch_norm_gather_stats(torch.tensor(means, dtype=mdt, device="cuda"),
                                                torch.tensor(vars_, dtype=mdt, device="cuda"),
                                                torch.tensor(counts, dtype=cdt, device="cuda"), out=outs)
        # partials rounded to the means' dtype: compare against the merge of those
        rm, rv, rn = reference.chan_merge(to_numpy(torch.tensor(means, dtype=mdt)),
                                          to_numpy(torch.tensor(vars_, dtype=mdt)), counts)
        rtol = 1e-5 if case.mdtype == "float32" else 1e-11
        np.testing.assert_array_equal(to_numpy(n), rn, err_msg=str(case))
        np.testing.assert_allclose(to_numpy(m), rm, rtol=rtol, atol=rtol, err_msg=str(case))
        np.testing.assert_allclose(to_numpy(v), rv, rtol=rtol, atol=rtol, err_msg=str(case))
        np.testing.assert_allclose(rm, tm, rtol=1e-5, atol=1e-5)          # the reference itself, on the data
        np.testing.assert_allclose(rv, tv, rtol=1e-4, atol=1e-5)

    inner()
    _report("bn_gather", count.n)


# ================================================================================================ index_add
#: inner (after-dim) shapes by class: odd products (1-element packs), multiples of 8 (16-byte packs), >= 16
#: packs per row (the sort path's 32-lane accumulation), and one very wide row (the "few"/sweep kernels)
IA_INNER = {"odd": [(), (1,), (3,), (5,), (3, 1), (1, 7), (9,)], "vec": [(8,), (16,), (2, 8), (24,), (40,)],
            "wide": [(128,), (256,), (2, 128)], "few": [(135169,)]}


@dataclass(frozen=True)
class IndexAddCase:
    dtype: str
    deterministic: bool
    outer: tuple
    D: int
    inner: tuple
    n_index: int
    idtype: str
    alpha: float
    exact: bool         # small integers: every sum exact in the dtype, so the result must be bit-exact
    seed: int

    @property
    def shape(self):
        return (*self.outer, self.D, *self.inner)

    @property
    def dim(self):
        return len(self.outer)


def gen_index_add_case(D, item) -> IndexAddCase:
    dtype, det = item
    cls = D.pick(["odd", "odd", "vec", "vec", "wide", "few"])
    inner = D.pick(IA_INNER[cls])
    outer = () if cls == "few" else D.pick([(), (), (2,), (3,), (2, 2)])
    size = D.int(1, 6) if cls == "few" else D.int(1, 40)
    n = D.int(0, 8) if cls == "few" else D.int(0, 2 * size + 4)
    exact = D.bool()
    alpha = D.pick([1.0, -1.0, 2.0] if exact else [1.0, -0.5, 3.0, 0.1])
    return IndexAddCase(dtype, det, outer, size, inner, n, D.pick(["int32", "int64"]), alpha, exact,
                        D.int(0, 2 ** 32 - 1))


index_add_cases = _composite(gen_index_add_case)
IA_ITEMS = [(dt, det) for dt in ("float32", "float16", "bfloat16") for det in (False, True)]


def run_index_add_case(torch, case: IndexAddCase) -> None:
    rng = _np_rng(case.seed)
    sshape = list(case.shape)
    sshape[case.dim] = case.n_index
    if case.exact:      # |x| <= 2, |alpha * src| <= 4 (bf16: 2), <= 84 indices a row: exact in every dtype
        x = _tdev(torch, rng.integers(-2, 3, case.shape).astype(np.float64), case.dtype)
        hi = 2 if case.dtype == "bfloat16" else 3
        src = _tdev(torch, rng.integers(-hi + 1, hi, sshape).astype(np.float64), case.dtype)
    else:
        x = _tdev(torch, rng.standard_normal(case.shape), case.dtype)
        src = _tdev(torch, rng.standard_normal(sshape) / 2, case.dtype)
    idx_np = rng.integers(0, case.D, case.n_index).astype(case.idtype)
    index = torch.from_numpy(idx_np).cuda()
    x0 = x.clone()
    a = ia._round_alpha(case.alpha, case.dtype)
    ref = reference.index_add(to_numpy(x0), case.dim, idx_np, to_numpy(src), a)
    r = igemm.index_add(x, case.dim, index, src, alpha=case.alpha, deterministic=case.deterministic)
    assert r is x
    what = str(case)
    dup = int(np.bincount(idx_np.astype(np.int64), minlength=case.D).max()) if case.n_index else 0
    touched = np.unique(idx_np.astype(np.int64))
    if case.exact:
        np.testing.assert_array_equal(to_numpy(x), ref, err_msg=what)
    elif touched.size:
        # one rounding per index hitting a row, in the storage precision (fp16/bf16 atomics) or in fp32:
        # bounded by the magnitude of the terms (a dropped or doubled term is far outside it)
        mag = reference.index_add(np.abs(to_numpy(x0)), case.dim, idx_np, np.abs(to_numpy(src)), abs(a))
        unit = {"float32": 1.2e-7, "float16": 1e-3, "bfloat16": 8e-3}[case.dtype]
        got, want = (np.take(v, touched, axis=case.dim) for v in (to_numpy(x), ref))
        err = float(np.linalg.norm((got - want).ravel())) if np.all(np.isfinite(got)) else float("inf")
        bound = TOL[case.dtype] * float(np.linalg.norm(want.ravel())) + \
            unit * (1 + np.sqrt(dup)) * float(np.linalg.norm(np.take(mag, touched, axis=case.dim).ravel()))
        assert err <= bound, f"{what}: error {err:.3g} > {bound:.3g}"
    untouched = np.setdiff1d(np.arange(case.D), touched)
    if untouched.size:
        u = torch.from_numpy(untouched).cuda()
        assert torch.equal(x.index_select(case.dim, u), x0.index_select(case.dim, u)), f"{what}: untouched rows changed"
    if case.deterministic:
        x2 = x0.clone()
        igemm.index_add(x2, case.dim, index, src, alpha=case.alpha, deterministic=True)
        assert torch.equal(x2, x), f"{what}: not deterministic"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("item", IA_ITEMS, ids=lambda it: f"{it[0]}-{'det' if it[1] else 'atomic'}")
def test_gpu_fuzz_index_add(item):
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=index_add_cases(item))
    def inner(case):
        count.n += 1
        run_index_add_case(torch, case)

    inner()
    _report(f"index_add/{item[0]}-{item[1]}", count.n)


# ================================================================================================ PReLU
@dataclass(frozen=True)
class PreluCase:
    dtype: str
    layout: str
    shape: tuple
    alpha_kind: str      # "number" | "one" | "channel"
    alpha_dtype: str
    out: str             # "none" | "out" | "inplace"
    offset: int
    seed: int

    @property
    def channels(self):
        if len(self.shape) < 2:
            return 1
        return self.shape[1] if self.layout == "NCHW" else self.shape[-1]


def gen_prelu_case(D, item) -> PreluCase:
    dtype, layout = item
    rank = D.pick([1, 2, 3, 4, 4, 5])
    # extents odd or multiples of 8 (the packs the kernels pick follow the channel/plane extents)
    dims = [D.pick([1, 3, 5, 7, 8, 16]) for _ in range(rank)]
    shape = tuple(dims)
    kinds = ["number", "one"] + (["channel", "channel"] if rank >= 2 else [])
    kind = D.pick(kinds)
    adt = D.pick([dtype, "float32"]) if (kind != "number" and dtype == "float16") else dtype   # bf16: own dtype
    offset = D.pick([0, 0, 1]) if dtype == "float16" else 0    # the narrow-pack kernels: on one dtype
    return PreluCase(dtype, layout, shape, kind, adt, D.pick(["none", "out", "inplace"]), offset,
                     D.int(0, 2 ** 32 - 1))


prelu_cases = _composite(gen_prelu_case)
PRELU_ITEMS = [(dt, lay) for dt in ("float32", "float16", "bfloat16") for lay in ("NCHW", "NHWC")]


def run_prelu_case(torch, case: PreluCase) -> None:
    rng = _np_rng(case.seed)
    xv = rng.standard_normal(case.shape)
    xv.reshape(-1)[:: 7] = 0.0
    x = _tdev(torch, xv, case.dtype, case.offset)
    dy = _tdev(torch, rng.standard_normal(case.shape), case.dtype, case.offset)
    if case.alpha_kind == "number":
        alpha = float(rng.uniform(-1, 1))
        a_ref = np.array([ia._round_alpha(alpha, case.dtype)])
    else:
        alpha = _tdev(torch, rng.uniform(-1, 1, 1 if case.alpha_kind == "one" else case.channels), case.alpha_dtype)
        a_ref = to_numpy(alpha)
    x64, dy64 = to_numpy(x), to_numpy(dy)
    what = str(case)
    ref = reference.prelu(x64, a_ref, case.layout)
    rdx, rda = reference.prelu_backward(dy64, x64, a_ref, case.layout)
    # dalpha: fp32 sums; compare against the sum of |terms| per channel
    terms = np.where(x64 > 0, 0.0, np.abs(x64 * dy64))
    if case.alpha_kind == "channel":
        axis = 1 if case.layout == "NCHW" else len(case.shape) - 1
        sabs = terms.sum(axis=tuple(j for j in range(len(case.shape)) if j != axis))
    else:
        sabs = np.array([terms.sum()])
    dx, da = igemm.prelu_backward(dy, x, alpha, layout=case.layout)      # before any in-place forward
    assert rel_err(to_numpy(dx), rdx) <= TOL[case.dtype], what
    da_dt = case.alpha_dtype if case.alpha_kind != "number" else case.dtype
    assert str(da.dtype) == f"torch.{da_dt}", what
    da_tol = 1e-4 if da_dt == "float32" else 1e-2
    assert np.all(np.abs(to_numpy(da).reshape(-1) - rda) <= da_tol * (sabs + np.abs(rda)) + 1e-30), what
    if case.out == "out":
        out = poison(torch.empty(case.shape, dtype=x.dtype, device="cuda"))
        y = igemm.prelu(x, alpha, layout=case.layout, out=out)
        assert y is out, what
    elif case.out == "inplace":
        y = igemm.prelu(x, alpha, layout=case.layout, out=x)
        assert y is x, what
    else:
        y = igemm.prelu(x, alpha, layout=case.layout)
    assert rel_err(to_numpy(y), ref) <= TOL[case.dtype], what


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("item", PRELU_ITEMS, ids=lambda it: "-".join(it))
def test_gpu_fuzz_prelu(item):
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=prelu_cases(item))
    def inner(case):
        count.n += 1
        run_prelu_case(torch, case)

    inner()
    _report("prelu/" + "-".join(item), count.n)


# ================================================================================================ ReLU mask
@dataclass(frozen=True)
class ReluCase:
    dtype: str
    n: int
    offset: int
    extra_words: int
    specials: bool
    out: bool
    seed: int


def gen_relu_case(D, item) -> ReluCase:
    n = D.pick([0, 1, 7, 31, 32, 33, 64, 100, 255, 256, 1000, 4097, 65536 + 13, 300000])
    return ReluCase(item, n, D.pick([0, 0, 1]), D.pick([0, 0, 3]), D.bool(), D.bool(), D.int(0, 2 ** 32 - 1))


relu_cases = _composite(gen_relu_case)


def _specials(rng, v):
    """NaN, +-inf and signed zeros sprinkled in."""
    v = v.copy()
    if v.size:
        for val in (np.nan, np.inf, -np.inf, 0.0, -0.0):
            v[rng.integers(0, v.size, max(1, v.size // 50))] = val
    return v


def run_relu_case(torch, case: ReluCase) -> None:
    rng = _np_rng(case.seed)
    yv = rng.standard_normal(case.n)
    dyv = rng.standard_normal(case.n)
    if case.specials:
        yv, dyv = _specials(rng, yv), _specials(rng, dyv)
    y = _tdev(torch, yv, case.dtype, case.offset)
    dy = _tdev(torch, dyv, case.dtype, case.offset)
    y64 = to_numpy(y)
    words = (case.n + 31) // 32
    what = str(case)
    ref_mask = reference.pack_mask(y64 > 0)
    if case.out:
        m = poison(torch.empty(words + case.extra_words, dtype=torch.int32, device="cuda"))
        r = igemm.relu_mask(y, out=m)
        assert r is m, what
        tail = m.cpu().numpy().view(np.uint32)[words:]
        assert np.all(tail == 0xAAAAAAAA), f"{what}: wrote past ceil(n/32) words"
    else:
        m = igemm.relu_mask(y)
        assert m.dtype == torch.int32 and m.numel() == words, what
    np.testing.assert_array_equal(m.cpu().numpy().view(np.uint32)[:words], ref_mask, err_msg=what)
    # relu_backward from a random mask (garbage bits past n included): a select
    rnd = rng.integers(0, 2 ** 32, words + case.extra_words, dtype=np.uint64).astype(np.uint32)
    mask = torch.from_numpy(rnd.view(np.int32)).cuda()
    dy64 = to_numpy(dy)
    expect = np.where(reference.unpack_mask(rnd, case.n), dy64, 0.0)
    if case.out:
        dx = poison(torch.empty(case.n + case.offset, dtype=dy.dtype, device="cuda"))[case.offset:]
        r = igemm.relu_backward(dy, mask, out=dx)
        assert r is dx, what
    else:
        dx = igemm.relu_backward(dy, mask)
    np.testing.assert_array_equal(to_numpy(dx), expect, err_msg=what)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_fuzz_relu(dtype):
    torch = _torch()
    count = _Count()

    @gpu_fuzz
    @given(case=relu_cases(dtype))
    def inner(case):
        count.n += 1
        run_relu_case(torch, case)

    inner()
    _report("relu/" + dtype, count.n)


# ================================================================================================ CPU tier
# Every public function on the numpy backend, fixed seed, against independent formulas.
def _packbits_mask(b) -> np.ndarray:
    b = np.asarray(b, bool).ravel()
    raw = np.packbits(b, bitorder="little")
    words = (b.size + 31) // 32
    return np.pad(raw, (0, words * 4 - raw.size)).view("<u4").astype(np.uint32)


def _to_layout(a, layout):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)) if layout == "NHWC" else a


@st.composite
def _np_conv(draw):
    D = _Hyp(draw)
    layout = D.pick(["NCHW", "NHWC"])
    dtype = D.pick(["float32", "float16"])
    N, C, K = D.int(1, 2), D.int(1, 5), D.int(1, 6)
    R, S = D.int(1, 3), D.int(1, 3)
    st_, dl = (D.int(1, 3), D.int(1, 3)), (D.int(1, 2), D.int(1, 2))
    P, Q = D.int(1, 4), D.int(1, 4)
    pd = (D.int(0, ((P - 1) * st_[0] + dl[0] * (R - 1)) // 2), D.int(0, ((Q - 1) * st_[1] + dl[1] * (S - 1)) // 2))
    H = _in_size(P, R, st_[0], pd[0], dl[0], D.int(0, st_[0] - 1))
    W = _in_size(Q, S, st_[1], pd[1], dl[1], D.int(0, st_[1] - 1))
    return dict(layout=layout, dtype=dtype, N=N, C=C, K=K, R=R, S=S, H=H, W=W, stride=st_, padding=pd, dilation=dl,
                chain=D.pick(list(CONV_CHAINS)), out=D.bool(), plan=D.bool(), seed=D.int(0, 2 ** 32 - 1))


@CPU_SETTINGS
@given(p=_np_conv())
def test_numpy_fuzz_conv(p, numpy_backend):
    from igemm.conv import Conv2dPlan
    rng = _np_rng(p["seed"])
    dt = np.dtype(p["dtype"])
    x = _to_layout(rng.standard_normal((p["N"], p["C"], p["H"], p["W"])), p["layout"]).astype(dt)
    w = _to_layout(rng.standard_normal((p["K"], p["C"], p["R"], p["S"])), p["layout"]).astype(dt)
    pre = reference.conv2d_fft(x, w, p["stride"], p["padding"], p["dilation"], p["layout"])
    np.testing.assert_allclose(reference.conv2d_im2col(x, w, p["stride"], p["padding"], p["dilation"], p["layout"]),
                               pre, rtol=1e-9, atol=1e-9)
    V = bn_vectors(rng, p["K"])
    rdt = _other_dtype(p["dtype"]) if p["chain"] == "add_res_relu_mask" else p["dtype"]
    res = rng.standard_normal(pre.shape).astype(rdt)
    built = CONV_CHAINS[p["chain"]](V, res)
    chain = ep.chain(built) if built is not None else ep.chain()
    # independent of apply_chain: the chain's definition written out per op
    y_ref = pre.copy()
    shp = [1, -1, 1, 1] if p["layout"] == "NCHW" else [1, 1, 1, -1]
    for o in chain.ops:
        if isinstance(o, ep.BatchNorm):
            g, b, m, v = (np.asarray(a, np.float64).reshape(shp) for a in (o.gamma, o.beta, o.mean, o.var))
            y_ref = g * (y_ref - m) / np.sqrt(v + o.eps) + b
        elif isinstance(o, ep.Bias):
            y_ref = y_ref + np.asarray(o.b, np.float64).reshape(shp)
        elif isinstance(o, ep.Add):
            y_ref = y_ref + res.astype(np.float64)
        elif isinstance(o, ep.ReLU):
            y_ref = np.maximum(y_ref, 0)
        else:
            a = np.asarray(o.alpha, np.float64).reshape(shp) if o.per_channel else o.alpha
            y_ref = np.where(y_ref >= 0, y_ref, a * y_ref)
    kw = {}
    if p["out"]:
        kw["out"] = np.full(pre.shape, np.nan, dt)
        if chain.mask:
            kw["mask_out"] = np.full((pre.size + 31) // 32 + 2, 0xAAAAAAAA, np.uint32)
    args = (p["stride"], p["padding"], p["dilation"])
    if p["plan"]:
        plan = Conv2dPlan(x.shape, w.shape, p["dtype"], p["layout"], *args, chain if chain.ops else None,
                          residual_dtype=rdt if chain.residual_op else None, device="numpy")
        r = plan(x, w, **kw)
    else:
        r = igemm.conv2d(x, w, *args, layout=p["layout"], epilogue=chain if chain.ops else None, **kw)
    y, m = r if chain.mask else (r, None)
    assert isinstance(y, np.ndarray) and y.dtype == dt and y.shape == pre.shape
    if p["out"]:
        assert y is kw["out"]
    tol = 1e-5 if dt == np.float32 else 2e-3
    assert np.all(np.abs(y - y_ref) <= tol * (1 + np.abs(y_ref)))
    if chain.mask:
        words = (y.size + 31) // 32
        got = np.asarray(m).view(np.uint32)[:words]
        np.testing.assert_array_equal(got, _packbits_mask(y > 0))
        if p["out"]:
            assert m is kw["mask_out"] and np.all(kw["mask_out"][words:] == 0xAAAAAAAA)


@CPU_SETTINGS
@given(n=st.integers(0, 300), dtype=st.sampled_from(["float32", "float16"]), specials=st.booleans(),
       extra=st.integers(0, 2), out=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_numpy_fuzz_relu(n, dtype, specials, extra, out, seed, numpy_backend):
    rng = _np_rng(seed)
    y = rng.standard_normal(n)
    dy = rng.standard_normal(n)
    if specials:
        y, dy = _specials(rng, y), _specials(rng, dy)
    y, dy = y.astype(dtype), dy.astype(dtype)
    words = (n + 31) // 32
    if out:
        m = np.full(words + extra, 0xAAAAAAAA, np.uint32)
        assert igemm.relu_mask(y, out=m) is m
        assert np.all(m[words:] == 0xAAAAAAAA)
    else:
        m = igemm.relu_mask(y)
    np.testing.assert_array_equal(np.asarray(m)[:words], _packbits_mask(y > 0))
    mask = rng.integers(0, 2 ** 32, words + extra, dtype=np.uint64).astype(np.uint32)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n].astype(bool)
    expect = np.where(bits, dy, np.zeros_like(dy))
    if out:
        o = np.full(n, np.nan, dtype)
        r = igemm.relu_backward(dy, mask, out=o)
        assert r is o
    else:
        r = igemm.relu_backward(dy, mask)
    assert r.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(r, expect)


@CPU_SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_numpy_fuzz_index_add(shape, data, seed, numpy_backend):
    rng = _np_rng(seed)
    nd = len(shape)
    dim = data.draw(st.integers(-nd, nd - 1))
    n = data.draw(st.integers(0, 7))
    dtype = data.draw(st.sampled_from(["float32", "float16"]))
    idtype = data.draw(st.sampled_from(["int32", "int64"]))
    alpha = data.draw(st.sampled_from([1, -2, 0.5, 1.25]))
    d = dim % nd
    x = rng.standard_normal(shape).astype(dtype)
    sshape = list(shape)
    sshape[d] = n
    src = rng.standard_normal(sshape).astype(dtype)
    idx = rng.integers(0, shape[d], n).astype(idtype)
    expect = index_add_loops(x, dim, idx, src, ia._round_alpha(float(alpha), dtype)).astype(dtype)
    r = igemm.index_add(x, dim, idx, src, alpha=alpha)
    assert r is x
    tol = 2e-3 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(x.astype(np.float64), expect.astype(np.float64), rtol=tol, atol=tol)
    if n:
        bad = idx.copy()
        bad[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from([-1, shape[d], 10 ** 6]))
        keep = x.copy()
        with pytest.raises(IndexError, match="out of range"):
            igemm.index_add(x, dim, bad, src)
        np.testing.assert_array_equal(x, keep)


@CPU_SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), layout=st.sampled_from(["NCHW", "NHWC"]),
       kind=st.sampled_from(["number", "one", "channel"]), dtype=st.sampled_from(["float32", "float16"]),
       inplace=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_numpy_fuzz_prelu(shape, layout, kind, dtype, inplace, seed, numpy_backend):
    rng = _np_rng(seed)
    shape = tuple(shape)
    if len(shape) < 2 and kind == "channel":
        kind = "one"
    c = (shape[1] if layout == "NCHW" else shape[-1]) if len(shape) >= 2 else 1
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    if kind == "number":
        alpha = float(rng.uniform(-1, 1))
        a_ref = np.array([ia._round_alpha(alpha, dtype)])
    else:
        alpha = rng.uniform(-1, 1, 1 if kind == "one" else c).astype(dtype)
        a_ref = alpha.astype(np.float64)
    expect = prelu_loops(x, a_ref, layout)
    tol = 1e-6 if dtype == "float32" else 1e-3
    dx, da = igemm.prelu_backward(dy, x, alpha, layout=layout)
    xd, dyd = x.astype(np.float64), dy.astype(np.float64)
    axis = 1 if layout == "NCHW" else len(shape) - 1
    aw = a_ref[0] if a_ref.size == 1 else a_ref.reshape([-1 if j == axis else 1 for j in range(len(shape))])
    np.testing.assert_allclose(dx.astype(np.float64), np.where(xd > 0, dyd, aw * dyd), rtol=tol, atol=tol)
    g = np.where(xd > 0, 0.0, xd * dyd)
    da_ref = np.array([g.sum()]) if a_ref.size == 1 else g.sum(axis=tuple(j for j in range(len(shape)) if j != axis))
    np.testing.assert_allclose(np.asarray(da, np.float64).reshape(-1), da_ref, rtol=tol,
                               atol=tol * (1 + np.abs(g).sum()))
    y = igemm.prelu(x, alpha, layout=layout, out=x if inplace else None)
    if inplace:
        assert y is x
    np.testing.assert_allclose(np.asarray(y, np.float64), expect, rtol=tol, atol=tol)


@st.composite
def _np_bn(draw):
    D = _Hyp(draw)
    layout = D.pick(["NCHW", "NHWC"])
    N, C = D.int(0, 3), D.int(1, 5)
    sp = tuple(D.int(1, 4) for _ in range(D.int(0, 2)))
    shape = (N, C, *sp) if layout == "NCHW" else (N, *sp, C)
    return dict(layout=layout, shape=shape, C=C, dtype=D.pick(["float32", "float16"]), eps=D.pick([0.0, 1e-5, 0.1]),
                residual=D.bool(), seed=D.int(0, 2 ** 32 - 1))


def _chan_axes(shape, layout):
    ax = 1 if layout == "NCHW" else len(shape) - 1
    return ax, tuple(j for j in range(len(shape)) if j != ax)


@CPU_SETTINGS
@given(p=_np_bn())
def test_numpy_fuzz_batch_norm(p, numpy_backend):
    """welford, batch_norm_stats (+ running), batch_norm_elemt/relu (+ mask), backward reduce/elemt,
    batch_norm_relu_backward and the local (one-process) SyncBN functions against the formulas."""
    rng = _np_rng(p["seed"])
    shape, layout, C, eps = p["shape"], p["layout"], p["C"], p["eps"]
    x = _bn_data(rng, shape, layout).astype(p["dtype"])
    xd = x.astype(np.float64)
    ax, red = _chan_axes(shape, layout)
    bshape = [C if j == ax else 1 for j in range(len(shape))]
    n = int(np.prod([shape[j] for j in red])) if red else 1
    m, v, cnt = igemm.welford(x, layout)
    if n:
        np.testing.assert_allclose(m, xd.mean(axis=red), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, xd.var(axis=red), rtol=1e-4, atol=1e-5)
    else:
        assert np.all(m == 0) and np.all(v == 0)
    assert np.all(cnt == n)
    rm = rng.standard_normal(C).astype(np.float32)
    rv = rng.uniform(0.5, 2, C).astype(np.float32)
    rm0, rv0 = rm.copy(), rv.copy()
    mean, invstd = igemm.batch_norm_stats(x, eps, layout, running_mean=rm, running_var=rv, momentum=0.2)
    var = xd.var(axis=red) if n else np.zeros(C)
    with np.errstate(divide="ignore"):
        inv_ref = np.where((var == 0) & (eps == 0), 0.0, 1 / np.sqrt(var + eps))
    np.testing.assert_allclose(invstd, inv_ref, rtol=1e-4)
    if n > 1:
        np.testing.assert_allclose(rm, 0.8 * rm0 + 0.2 * xd.mean(axis=red), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rv, 0.8 * rv0 + 0.2 * xd.var(axis=red, ddof=1), rtol=1e-4, atol=1e-5)
    sm, si = igemm.sync_batch_norm_stats(x, eps, layout=layout)
    np.testing.assert_allclose(sm, mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(si, invstd, rtol=1e-6)
    # forward
    g = rng.uniform(0.5, 1.5, C).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, C).astype(np.float32)
    res = rng.standard_normal(shape).astype(p["dtype"]) if p["residual"] else None
    z = (xd - mean.reshape(bshape)) * invstd.reshape(bshape) * g.reshape(bshape) + b.reshape(bshape)
    if res is not None:
        z = z + res
    tol = 1e-5 if p["dtype"] == "float32" else 4e-3
    y0 = igemm.batch_norm_elemt(x, mean, invstd, g, b, residual=res, layout=layout)
    np.testing.assert_allclose(y0.astype(np.float64), z, rtol=tol, atol=tol)
    y, mk = igemm.batch_norm_relu(x, mean, invstd, g, b, res, layout=layout)
    assert y.dtype == x.dtype
    np.testing.assert_allclose(y.astype(np.float64), np.maximum(z, 0), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(mk)[: (y.size + 31) // 32], _packbits_mask(y > 0))
    # backward (mask select), PyTorch's formulas
    dy = rng.standard_normal(shape).astype(p["dtype"])
    bits = (y > 0)
    dsel = np.where(bits, dy.astype(np.float64), 0.0)
    sdy, sdx, gw, gb = igemm.batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mk, layout=layout)
    e_sdy = dsel.sum(axis=red) if red else dsel.reshape(C)
    xmu = xd - mean.reshape(bshape)
    e_sdx = (dsel * xmu).sum(axis=red) if red else (dsel * xmu).reshape(C)
    scale = np.abs(dsel).sum(axis=red) + (np.abs(dsel) * np.abs(xmu)).sum(axis=red) + 1e-6 if red else 1.0
    assert np.all(np.abs(sdy - e_sdy) <= 1e-5 * scale) and np.all(np.abs(sdx - e_sdx) <= 1e-5 * scale)
    np.testing.assert_allclose(gb, sdy)
    np.testing.assert_allclose(gw, sdx * invstd, rtol=1e-5, atol=1e-6)
    s2 = igemm.sync_batch_norm_backward_reduce(dy, x, mean, invstd, g, mask=mk, layout=layout)
    for a, bb in zip(s2, (sdy, sdx, gw, gb)):
        np.testing.assert_allclose(a, bb, rtol=1e-6, atol=1e-6)
    if n:
        dx = igemm.batch_norm_backward_elemt(dy, x, mean, invstd, g, sdy, sdx, n, mask=mk, layout=layout)
        inv = invstd.reshape(bshape).astype(np.float64)
        e_dx = (dsel - sdy.reshape(bshape) / n - xmu * inv ** 2 * sdx.reshape(bshape) / n) * g.reshape(bshape) * inv
        sc = np.abs(dsel).max() + np.abs(sdy).max() / n + np.abs(xmu * inv ** 2 * sdx.reshape(bshape) / n).max() + 1e-6
        assert np.all(np.abs(dx.astype(np.float64) - e_dx) <= 4 * tol * sc * (np.abs(g).max() * np.abs(inv).max() + 1))
        r = igemm.batch_norm_relu_backward(dy, x, mk, mean, invstd, g, layout=layout, residual=res is not None)
        np.testing.assert_allclose(r[0].astype(np.float64), dx.astype(np.float64), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r[1], gw, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r[2], gb, rtol=1e-6, atol=1e-6)
        if res is not None:
            np.testing.assert_array_equal(r[3], dsel.astype(x.dtype))


@CPU_SETTINGS
@given(case=gather_cases())
def test_numpy_fuzz_gather_stats(case, numpy_backend):
    rng = _np_rng(case.seed)
    means, vars_, counts, (tm, tv, tn) = _gather_data(rng, case)
    m, v, n = igemm.batch_norm_gather_stats(means.astype(case.mdtype), vars_.astype(case.mdtype),
                                            counts.astype(case.cdtype))
    assert m.dtype == np.dtype(case.mdtype)
    tol = 1e-5 if case.mdtype == "float32" else 1e-9
    np.testing.assert_array_equal(n, tn)
    np.testing.assert_allclose(m, tm, rtol=tol, atol=tol)
    np.testing.assert_allclose(v, tv, rtol=10 * tol, atol=tol)


# ================================================================================================ compile bounds
def test_conv_fuzz_domain_is_bounded():
    """The conv fuzz compiles a bounded set of kernels (each ~4 s of nvcc): keep it so when editing cells."""
    stubs = conv_stubs(n=60)
    # (184 with the register epilogue; 203 with 3xTF32 strict fp32; 234 with strict fp32 NCHW on both of its paths
    # on Hopper, transposed or gathered by stride and taps: tf32x3-wgmma-nchw)
    assert len(stubs) <= 250, len(stubs)
    items = len(conv_items()) + len(BN_ITEMS) + 1 + len(IA_ITEMS) + len(PRELU_ITEMS) + 3
    assert items * 24 >= 2000          # the default IGEMM_FUZZ_EXAMPLES gives >= 2,000 GPU problems a run


def test_conv_cells_pin_the_spec():
    """Each cell fixes load modes, pipeline depth and store mode: redrawn shapes within a cell land on the
    same kernel (so a run's kernel count does not grow with the number of examples)."""
    rng = np.random.default_rng(1)
    for item in conv_items():
        for cell in conv_cells(*item):
            specs = set()
            D = _Rng(rng)
            for _ in range(12):
                while True:
                    case = gen_conv_case(D, item)
                    if case.cell == cell and case.x_offset == 0:
                        break
                s = conv_case_spec(case)
                specs.add((s.load_a, s.load_b, s.stages, s.store, s.vec_o, s.fuse_mask, s.math))
            # the register epilogues (NHWC "regs", NCHW "regsnchw") run without split-K: a cell's split draws
            # add the fp32 C tile's kernel;
            # it fuses the mask for K % 8 == 0 (the fp32 C tile for K % 32 == 0), so a mask chain's "lin" cell
            # (K = 5..64) may take both
            # (a draw-dependent third kernel: seen once the patch cells shifted the draws)
            if item[:2] == ("fp32", "NCHW"):
                # strict fp32 NCHW takes transposed copies (16-byte loads) where 9+ taps run at stride 1 or a 1x1
                # is strided, else the NCHW gather (tf32x3-wgmma-nchw): a cell's stride draws take both loads
                specs = {("any",) + k[1:] for k in specs}
            regs = [k for k in specs if k[3] in ("regs", "regsnchw")]
            assert len(specs) == 1 or (len(specs) - len(regs) <= 1 and len({k[4] for k in regs}) <= 1
                                       and len(regs) <= (2 if cell[1] == "lin" else 1)
                                       and len({k[:3] + k[6:] for k in specs}) == 1), (item, cell, specs)


# ================================================================================================ precompile
def fuzz_stubs(n: int = 300) -> dict:
    """{stub: cache name} of every kernel a GPU fuzz run can compile on H100/H200 (sm_90a, 132 SMs), sampled
    from the same generators (``n`` draws per item). A kernel missed here still compiles at first use."""
    from igemm import norm, relu
    from igemm._norm_kernels import _cache_name
    from igemm._runtime import DTYPE_SIZES
    out = dict(conv_stubs(n=n))
    rng = np.random.default_rng(0)
    for item in BN_ITEMS:
        D = _Rng(rng)
        for _ in range(n):
            c = gen_bn_case(D, item)
            C = c.shape[1] if c.layout == "NCHW" else c.shape[-1]
            HW = int(np.prod(c.shape[2:] if c.layout == "NCHW" else c.shape[1:-1], dtype=np.int64))
            isz = DTYPE_SIZES[c.dtype]
            for s in norm.instances_for(c.layout, c.shape[0], C, HW, c.dtype, sms=132,
                                        align=16 if c.offset == 0 else isz, grad=False, forward=(), backward=()):
                out[s] = _cache_name(s)
    for i in ("float32", "float64"):
        for cnt in ("float32", "int64"):
            s = norm.stub_gather(i, cnt)
            out[s] = _cache_name(s)
    for dt in ("float32", "float16", "bfloat16"):
        for vec in (1, 16 // DTYPE_SIZES[dt]):
            for func in ("relu_mask", "relu_backward"):
                out[relu._stub(func, dt, vec)] = func
    from igemm.conv import _transpose
    for name, stub in _transpose.all_variants():
        out[stub] = name
    try:        # index_add and prelu mirror their dispatch here; they may change: best effort
        out.update(_index_add_stubs(rng, n))
        out.update(_prelu_stubs(rng, n))
    except Exception as e:  # pragma: no cover
        print(f"(index_add/prelu kernels not enumerated: {type(e).__name__}: {e}; they compile at first use)")
    return out


def _index_add_stubs(rng, n) -> dict:
    out = {}
    for item in IA_ITEMS:
        D = _Rng(rng)
        for _ in range(n):
            c = gen_index_add_case(D, item)
            outer = int(np.prod(c.outer, dtype=np.int64))
            inner = int(np.prod(c.inner, dtype=np.int64))
            if c.n_index:
                for kind, s in ia.stubs_for(ia.IndexAddConfig("many", 1), c.dtype, c.idtype)[:1]:
                    out[s] = f"index_add_{kind}"
            if outer * inner * c.n_index == 0:
                continue
            cfg = ia.choose_config(outer, c.D, inner, c.n_index, c.dtype, deterministic=c.deterministic, sms=132,
                                   vec=ia.max_vec(c.dtype, inner))
            for kind, s in ia.stubs_for(cfg, c.dtype, c.idtype, check=False):
                out[s] = f"index_add_{kind}"
    return out


def _prelu_stubs(rng, n) -> dict:
    from igemm._runtime import DTYPE_SIZES
    out = {}

    def add(kind, *args):
        out[pm._stub(kind, *args)] = f"prelu_{kind}"
    for item in PRELU_ITEMS:
        D = _Rng(rng)
        for _ in range(n):
            c = gen_prelu_case(D, item)
            off = c.offset * DTYPE_SIZES[c.dtype]
            numel = int(np.prod(c.shape, dtype=np.int64))
            if c.alpha_kind == "channel":
                kind, C = "channel", c.channels
                inner = int(np.prod(c.shape[2:], dtype=np.int64)) if (c.layout == "NCHW" and len(c.shape) > 2) else 1
            else:
                kind, C, inner = ("value" if c.alpha_kind == "number" else "one"), 1, numel
            adt = c.alpha_dtype if c.alpha_kind != "number" else c.dtype
            for yoff in ({off, 0} if c.out != "inplace" else {off}):
                vec = pm._vec_aligned(c.dtype, 256 + off, 256 + yoff)
                cfg = pm.forward_config(numel, C, inner, c.dtype, alpha_kind=kind, vec=vec, alpha_dtype=adt,
                                        alpha_ptr=256)
                add("forward", c.dtype, adt, cfg.vec, pm._MODES[cfg.mode], cfg.wide)
            extent = 16 if kind != "channel" else (inner if inner > 1 else C)
            vec = pm._bwd_vec(c.dtype, extent, (256 + off, 256 + off, 256))
            if kind != "channel":
                add("backward_flat", c.dtype, adt, vec, pm._MODES["scalar_val" if kind == "value" else "scalar_ptr"],
                    False)
            else:
                add("backward_plane" if inner > 1 else "backward_row", c.dtype, adt, vec, 0, False)
            add("backward_finish", "float32", adt, 1, 0, False)
    return out


def precompile(arch: str = "sm_90a", jobs: int | None = None) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from igemm import _build
    stubs = fuzz_stubs()
    print(f"compiling {len(stubs)} fuzz kernels for {arch} into {_build.cache_dir()}", flush=True)
    with ThreadPoolExecutor(jobs or os.cpu_count() or 2) as ex:
        list(ex.map(lambda kv: _build.compile_cubin(kv[0], arch, name=kv[1]), stubs.items()))
    return len(stubs)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "precompile":
        precompile(sys.argv[2] if len(sys.argv) > 2 else "sm_90a")
    else:
        print("usage: python tests/test_fuzz.py precompile [arch]")
