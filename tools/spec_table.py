"""The default kernel of every ResNet-50 conv shape (all 23, not only bench_conv's seven), per batch,
layout and chain, as chosen on the dev machine (no GPU): run it before and after a rule change in
igemm/conv/_rules.py and diff the two, so that the GPU run measures every plan the change moves.

    python tools/spec_table.py [--batches 1,2,4,8,16,32,64] [--arch sm_90a] [--sms 132] > table.txt
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (C, K, H, R, stride, pad) of ResNet-50 v1.5's convolutions (H: the input's height and width)
RESNET50_ALL = [
    (3, 64, 224, 7, 2, 3),
    (64, 64, 56, 1, 1, 0), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 0), (256, 64, 56, 1, 1, 0),
    (256, 128, 56, 1, 1, 0), (128, 128, 56, 3, 2, 1), (128, 512, 28, 1, 1, 0), (256, 512, 56, 1, 2, 0),
    (512, 128, 28, 1, 1, 0), (128, 128, 28, 3, 1, 1),
    (512, 256, 28, 1, 1, 0), (256, 256, 28, 3, 2, 1), (256, 1024, 14, 1, 1, 0), (512, 1024, 28, 1, 2, 0),
    (1024, 256, 14, 1, 1, 0), (256, 256, 14, 3, 1, 1),
    (1024, 512, 14, 1, 1, 0), (512, 512, 14, 3, 2, 1), (512, 2048, 7, 1, 1, 0), (1024, 2048, 14, 1, 2, 0),
    (2048, 512, 7, 1, 1, 0), (512, 512, 7, 3, 1, 1),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    from igemm import epilogues as ep
    from igemm.conv._problem import ConvProblem
    from igemm.conv._rules import choose_config
    from igemm.conv._paths import kernel_setup
    chains = {"a": ep.chain(), "b": ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.ReLU(mask=True)),
              "c": ep.chain(ep.BatchNorm(0, 0, 0, 0), ep.Add(), ep.ReLU(mask=True))}
    for C, K, H, R, st, pd in RESNET50_ALL:
        for N in (int(b) for b in args.batches.split(",")):
            for layout in ("NHWC", "NCHW"):
                for cname, ch in chains.items():
                    pb = ConvProblem.of(N, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), "float16", layout, "strict",
                                        ch, "float16")
                    path, kpb = kernel_setup(pb, "auto", None, None, args.arch)
                    spec = choose_config(kpb, args.arch, sms=args.sms)
                    print(f"{R}x{R}/{st} {C}->{K} @{H} N={N} {layout} {cname}: {path} {spec.name()} splits={spec.splits}")


if __name__ == "__main__":
    main()
