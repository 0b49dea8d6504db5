import json, os, sys
from pathlib import Path
tree = Path(sys.argv[1]).resolve()
os.environ["IGEMM_CACHE_DIR"] = str(tree / ".cache/igemm")
sys.path.insert(0, str(tree)); sys.path.insert(0, str(tree / "tools/probes")); sys.path.insert(0, str(tree / "benchmarks"))
import igemm._build as b
b.csrc_dir = lambda: (tree / "csrc")
import igemm
assert str(Path(igemm.__file__).resolve()).startswith(str(tree)), igemm.__file__
import cfg_probe
cases = json.load(open(sys.argv[2]))
print(tree.name, cfg_probe.precompile(cases), "kernels")
