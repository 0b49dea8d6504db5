import sys, re, os
sys.path.insert(0,'benchmarks')
from pathlib import Path
from bench_conv import RESNET50
from igemm import epilogues as ep, _build
from igemm._heuristics import ConvProblem, choose_config, kernel_setup, SMEM_PER_SM
from igemm.conv2d import _stub
from concurrent.futures import ThreadPoolExecutor
chains = {'a': ep.chain(), 'b': ep.chain(ep.BatchNorm(0,0,0,0), ep.ReLU(mask=True)), 'c': ep.chain(ep.BatchNorm(0,0,0,0), ep.Add(), ep.ReLU(mask=True))}
rows = []
stubs = {}
for N in (8, 16, 32, 64, 128):
  for layout in ('NHWC','NCHW'):
    for li, (name, C, K, H, R, st, pd) in enumerate(RESNET50):
      for cn, ch in chains.items():
        pb = ConvProblem(N, C, H, H, K, R, R, (st, st), (pd, pd), (1, 1), 'float16', layout, 'tensorop', ch.signature(), 'float16' if ch.residual_op else None)
        s = choose_config(kernel_setup(pb, 'auto', None, None, 'sm_90a')[1], 'sm_90a')
        stubs[_stub(s)] = s
        rows.append((N, layout, name, cn, s, _stub(s)))
def one(stub):
    s = stubs[stub]
    _, key = _build.compile_cubin(stub, 'sm_90a', name=s.name())
    log = (_build.cache_dir() / f"{s.name()}-{key}.log").read_text()
    return stub, int(re.search(r'Used (\d+) registers', log).group(1))
with ThreadPoolExecutor(2) as ex:
    regs = dict(ex.map(one, list(stubs)))
def ctas(s, r):
    sm = SMEM_PER_SM // (s.smem + s.static_smem + 1024)
    regs_per_cta = ((r + 7) // 8 * 8) * s.threads
    rc = 65536 // regs_per_cta
    return min(sm, rc, 32), sm, rc
import collections
g = collections.defaultdict(dict)
for N, layout, name, cn, s, stub in rows:
    r = regs[stub]; c = ctas(s, r)
    g[(N, layout, name)][cn] = (s.name()[18:], r, c, s.persistent)
for k, v in g.items():
    cs = {cn: x[2][0] for cn, x in v.items()}
    flag = " <== " if not v['c'][3] and (cs['c'] < cs['b'] or cs['b'] < cs['a']) else ""
    print(k, {cn: (x[1], x[2]) for cn, x in v.items()}, flag)
