"""The kernel choice on random problems, written one line per problem, to check that a change of
igemm/conv/ (the rules, the paths, the overrides) keeps every choice it should: run it before and after the
change (e.g. with ``git stash``) and compare the two files with ``cmp``/``diff``.

    python tools/heuristics_equivalence.py OUT.txt [N=12000]

Each line: the path, the kernel problem, the chosen KernelSpec and a hash of its generated source; for 30% of
the problems an override (``Conv2dOptions.config``) applied too; for every 10th, a hash of the autotune
candidates. Problems cover every dtype, layout, precision, chain kind, residual dtype, NCHW path, unfold and
channel-pad option, alignment, architecture (sm_90a, sm_80) and SM count (132, 114, 78).
"""
import hashlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from igemm import epilogues as ep  # noqa: E402
from igemm.conv._paths import kernel_setup  # noqa: E402
from igemm.conv._plan import override  # noqa: E402
from igemm.conv._problem import ConvProblem  # noqa: E402
from igemm.conv._rules import candidates, choose_config  # noqa: E402
from igemm.conv._spec import stub  # noqa: E402

CHAINS = [ep.chain(), ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.ReLU(mask=True)),
          ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.Add(), ep.ReLU(mask=True)), ep.chain(ep.Bias(0), ep.PReLU(0.1)),
          ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.Bias(0), ep.ReLU()), ep.chain(ep.Add(), ep.PReLU(np.zeros(1)))]
CONFIGS = [{"math": "wgmma_ws", "bm": 64, "splits": 1, "wm": 1},
           {"math": "wgmma_ws", "bm": 64, "splits": 1, "wm": 2, "bn": 64, "stages": 3}, {"bn": 128, "splits": 2},
           {"streamk": 1}, {"math": "simt"}, {"math": "wgmma", "bm": 128, "wm": 2, "bn": 64},
           {"math": "wgmma_ws", "bm": 64, "wm": 1, "csplit": 2, "bn": 64, "stages": 6, "splits": 1},
           {"store": "rows"}, {"ctas": 3, "math": "wgmma_ws", "bm": 64, "wm": 1, "splits": 1, "stages": 2}]


def h(s: str) -> str:
    return hashlib.sha1(s.encode()).hexdigest()[:16]


def one(rng: random.Random, i: int) -> str:
    N = rng.choice([1, 2, 3, 4, 8, 16, 32, 64, 128])
    C = rng.choice([3, 4, 8, 16, 24, 32, 64, 96, 128, 192, 256, 512, 1024, 2048])
    K = rng.choice([16, 40, 64, 72, 128, 130, 256, 512, 1024, 2048])
    H = rng.choice([7, 9, 14, 15, 28, 56, 112, 224])
    R = rng.choice([1, 1, 3, 5, 7])
    S = R if rng.random() < 0.9 else rng.choice([1, 3])
    st, pd, dl = rng.choice([1, 2]), R // 2 if rng.random() < 0.8 else 0, 1 if rng.random() < 0.9 else 2
    dt, lay = rng.choice(["float16", "bfloat16", "float32"]), rng.choice(["NHWC", "NCHW"])
    ch = CHAINS[rng.randrange(len(CHAINS))]
    rdt = rng.choice([dt, "float32", "float16", "bfloat16"]) if ch.residual_op else None
    prec = rng.choice(["strict", "tf32"])
    path = rng.choice(["auto", "auto", "native", "transpose"])
    pad = True if rng.random() < 0.05 else None
    unf = rng.choice([False, "copy", True, "patch"]) if rng.random() < 0.1 else None
    arch, sms = rng.choice(["sm_90a", "sm_90a", "sm_80"]), rng.choice([132, 114, 78])
    xa, wa = rng.random() < 0.9, rng.random() < 0.9
    cfg = rng.choice(CONFIGS) if rng.random() < 0.3 else None
    try:
        pb = ConvProblem.of(N, C, H, H, K, R, S, (st, st), (pd, pd), (dl, dl), dt, lay, prec, ch, rdt)
        p, kp = kernel_setup(pb, path, pad, unf, arch)
        line = [p, repr((kp.N, kp.C, kp.H, kp.W, kp.K, kp.R, kp.S, kp.stride, kp.padding, kp.dilation, kp.dtype,
                         kp.layout, kp.out_layout, kp.patch, kp.residual_dtype))]
        s = choose_config(kp, arch, x_aligned=xa, w_aligned=wa, sms=sms)
        line += [repr(s), h(stub(s))]
        if cfg:
            try:
                s2 = override(s, kp, cfg, sms)
                line.append("cfg " + repr(s2) + " " + h(stub(s2)))
            except Exception as e:  # noqa: BLE001 - the refusal is part of the output
                line.append("cfg " + type(e).__name__ + str(e)[:80])
        if i % 10 == 0:
            line.append("cands " + h(repr(candidates(kp, arch, sms))))
        return " | ".join(line)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__ + ": " + str(e)[:120]


def main() -> int:
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12000
    rng = random.Random(0)
    out = [one(rng, i) for i in range(n)]
    Path(sys.argv[1]).write_text("\n".join(out) + "\n")
    print(len(out), "problems,", sum(" | " in ln for ln in out), "choices written to", sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
