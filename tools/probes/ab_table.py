"""Side by side: bench_epilogues.json files of A/B runs (e.g. two trees, alternated in one GPU call).

    python3 tools/probes/ab_table.py NAME=DIR [NAME=DIR ...]

Prints (a) / (b) / (c) in us and (b)/(a), (c)/(a) per config and layer, one column per run, and each run's
relu_backward ratio."""
import json
import sys
from pathlib import Path


def load(d):
    p = Path(d)
    p = p / "bench_epilogues.json" if p.is_dir() else p
    return json.loads(p.read_text())["rows"]


def main(argv):
    runs = [(a.split("=", 1) if "=" in a else (a, a)) for a in argv]
    tables = [(name, load(d)) for name, d in runs]
    keys = [(r["config"], r["layer"]) for r in tables[0][1] if "conv_us" in r and r.get("bn_relu_mask_us")]
    print("| config | layer | " + " | ".join(f"{n}: a / b / c (b/a, c/a)" for n, _ in tables) + " |")
    print("|---|---|" + "---|" * len(tables))
    for k in keys:
        cells = []
        for _, rows in tables:
            r = next((r for r in rows if (r["config"], r["layer"]) == k), None)
            cells.append("-" if r is None else
                         f"{r['conv_us']:.1f} / {r['bn_relu_mask_us']:.1f} / {r['bn_add_relu_mask_us']:.1f} "
                         f"({r['b_over_a']:.3f}, {r['c_over_a']:.3f})")
        print(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    for n, rows in tables:
        rb = [r for r in rows if "threshold_backward_us" in r]
        if rb:
            print(f"{n}: relu_backward {rb[0]['igemm_us']:.1f} us, ratio {rb[0]['ratio']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
