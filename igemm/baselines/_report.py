"""The comparison's report: the summary per algorithm, the markdown table and the plot."""
from __future__ import annotations

import statistics

import numpy as np

def _fmt(v, digits=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.1f}" if abs(v) < 1e5 else f"{v:.3g}"
        return f"{v:.{digits}g}"
    return str(v)


def summary(result: dict) -> list[dict]:
    """Per algorithm: cases run/skipped/failed, geometric-mean time relative to the baseline (implicit GEMM
    when it ran, else the first algorithm) over the layers both ran, on how many layers it was the fastest,
    and its median / max extra memory."""
    import math
    rows, algos = result["rows"], result["algorithms"]
    if not rows:
        return []
    base = "implicit" if "implicit" in algos else algos[0]
    by = {(r["layer"], r["algorithm"]): r for r in rows}
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fastest = {a: 0 for a in algos}
    for l in layers:
        ok = [(by[(l, a)]["time_us"], a) for a in algos if (l, a) in by and by[(l, a)]["status"] == "ok"]
        if ok:
            fastest[min(ok)[1]] += 1
    out = []
    for a in algos:
        mine = [r for r in rows if r["algorithm"] == a]
        ok = [r for r in mine if r["status"] == "ok"]
        ratios = [r["time_us"] / by[(r["layer"], base)]["time_us"] for r in ok
                  if by.get((r["layer"], base), {}).get("status") == "ok" and by[(r["layer"], base)]["time_us"]]
        mem = sorted(r["extra_mib"] for r in ok)
        out.append({"algorithm": a, "baseline": base, "ok": len(ok),
                    "skipped": sum(r["status"] == "skipped" for r in mine),
                    "errors": sum(r["status"] == "error" for r in mine),
                    "geomean_vs_baseline": math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                    if ratios and all(x > 0 for x in ratios) else None,
                    "fastest": fastest[a], "median_extra_mib": statistics.median(mem) if mem else None,
                    "max_extra_mib": mem[-1] if mem else None})
    return out


def markdown(result: dict) -> str:
    rows, algos = result["rows"], result["algorithms"]
    labels = result["labels"]
    unit = "µs" if result["backend"] == "cuda" else "µs, host"
    mem = "extra device memory (MiB)" if result["backend"] == "cuda" else "extra host memory (MiB)"
    lines = [f"## igemm compare: convolution algorithms ({result['backend']} backend)", "",
             f"Command: `{result['command']}`", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in result["env"].items()), ""]
    if result["backend"] != "cuda":
        lines += ["**Ran on the numpy backend (no CUDA GPU visible): numpy implementations on small sizes.**", ""]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    by = {(r["layer"], r["algorithm"]): r for r in rows}

    def pivot(title, key, fmt):
        out = [f"### {title}", "", "| layer | " + " | ".join(labels[a] for a in algos) + " |",
               "|---|" + "---:|" * len(algos)]
        for l in layers:
            cells = []
            for a in algos:
                r = by.get((l, a))
                if r is None:
                    cells.append("")
                elif r["status"] != "ok":
                    cells.append(r["status"])
                else:
                    cells.append(fmt(r[key]))
            out.append(f"| {l} | " + " | ".join(cells) + " |")
        return out + [""]

    summ = summary(result)
    if summ:
        base = summ[0]["baseline"]
        lines += ["### Summary", "",
                  f"| algorithm | cases run | skipped | errors | geomean time / {labels.get(base, base)} | "
                  f"fastest on | median extra MiB | max extra MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for sm in summ:
            lines.append(f"| {labels[sm['algorithm']]} | {sm['ok']} | {sm['skipped']} | {sm['errors']} | "
                         f"{_fmt(sm['geomean_vs_baseline'])} | {sm['fastest']} | {_fmt(sm['median_extra_mib'])} | "
                         f"{_fmt(sm['max_extra_mib'])} |")
        lines.append("")
    lines += pivot(f"Time ({unit}, median)", "time_us", lambda v: _fmt(v))
    lines += pivot(mem, "extra_mib", lambda v: _fmt(v, 3))
    lines += pivot("TFLOP/s", "tflops", lambda v: _fmt(v))
    lines += pivot("max relative error", "max_rel_err", lambda v: f"{v:.2e}")
    lines += ["### All rows", "",
              f"| layer | algorithm | time ({unit}) | p10 | p90 | TFLOP/s | {mem} | max rel err | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        status = r["status"] + (f": {r['note']}" if r["note"] else "")
        err = f"{r['max_rel_err']:.2e}" if r["max_rel_err"] is not None else "–"
        lines.append(f"| {r['layer']} | {r['label']} | {_fmt(r['time_us'])} | {_fmt(r['p10_us'])} | "
                     f"{_fmt(r['p90_us'])} | {_fmt(r['tflops'])} | {_fmt(r['extra_mib'])} | {err} | {status} |")
    lines += ["", "### Notes", ""] + [f"- {n}" for n in result["notes"]]
    if result.get("plot"):
        lines += ["", f"Plot: `{result['plot']}`"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> str | None:
    """Time and extra memory per layer and algorithm (two log-scale bar charts); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, algos = result["rows"], result["algorithms"]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    by = {(r["layer"], r["algorithm"]): r for r in rows}
    xs = np.arange(len(layers))
    width = 0.8 / max(1, len(algos))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10.0, 0.55 * len(layers) + 4), 10), sharex=True)
    for i, a in enumerate(algos):
        t = [by[(l, a)]["time_us"] if (l, a) in by and by[(l, a)]["status"] == "ok" else np.nan for l in layers]
        m = [by[(l, a)]["extra_mib"] if (l, a) in by and by[(l, a)]["status"] == "ok" else np.nan for l in layers]
        off = xs - 0.4 + width * (i + 0.5)
        ax1.bar(off, t, width, label=result["labels"][a])
        ax2.bar(off, m, width, label=result["labels"][a])
    ax1.set_yscale("log")
    ax1.set_ylabel("time per call (µs" + (", host" if result["backend"] != "cuda" else "") + ")")
    ax2.set_yscale("symlog", linthresh=1.0)
    ax2.set_ylabel("extra " + ("device" if result["backend"] == "cuda" else "host") + " memory (MiB)")
    ax1.grid(True, axis="y", alpha=0.3)
    ax2.grid(True, axis="y", alpha=0.3)
    ax1.legend(fontsize=8, ncol=min(5, len(algos)))
    ax2.set_xticks(xs)
    ax2.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    cfg = result["config"]
    ax1.set_title(f"igemm compare: {cfg['dtype']} {cfg['layout']}"
                  + (f" on {result['env'].get('device')}" if result["backend"] == "cuda"
                     else " (numpy backend, small sizes)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
