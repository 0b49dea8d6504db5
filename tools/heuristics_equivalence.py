"""Check that a refactor of igemm/_heuristics.py keeps choose_config: run it before and after (git stash) on
6,000 random problems x 2 paths x 2 SM counts, and compare the two files with cmp.

    python tools/heuristics_equivalence.py OUT.txt
"""
import sys, random, itertools; sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from igemm._heuristics import ConvProblem, choose_config, kernel_setup
from igemm import epilogues as ep
rng = random.Random(0)
chains = [ep.chain(), ep.chain(ep.BatchNorm(0,0,0,0), ep.ReLU(mask=True)), ep.chain(ep.BatchNorm(0,0,0,0), ep.Add(), ep.ReLU(mask=True))]
out = []
for _ in range(6000):
    N = rng.choice([1,2,3,4,8,16,32,64,128]); C = rng.choice([3,8,16,32,64,96,128,192,256,512,1024,2048])
    K = rng.choice([16,40,64,72,128,130,256,512,1024,2048]); H = rng.choice([7,9,14,15,28,56])
    R = rng.choice([1,1,3,5]); st = rng.choice([1,2]); pd = R//2
    dt = rng.choice(["float16","bfloat16","float32"]); lay = rng.choice(["NHWC","NCHW"])
    ci = rng.randrange(3); ch = chains[ci]
    rdt = rng.choice([dt, "float32", "float16"]) if ci == 2 else None
    for sms in (132, 114):
        try:
            pb = ConvProblem(N,C,H,H,K,R,R,(st,st),(pd,pd),(1,1),dt,lay,"tensorop" if dt!="float32" else "strict",ch.signature(),rdt)
            for path in ("auto","native"):
                kp = kernel_setup(pb, path, None, None, "sm_90a")[1]
                s = choose_config(kp, "sm_90a", sms=sms)
                out.append(repr(s))
        except Exception as e:
            out.append(type(e).__name__)
print(len(out), "choices written to", sys.argv[1])
open(sys.argv[1], "w").write("\n".join(out))
