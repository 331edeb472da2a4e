"""The tables of ``perf/decode_issue19.md`` from a ``kernels.bench_decode`` results file (issue 19,
session 7; no GPU needed)::

    python perf/runs/issue19_tables_h19s7.py book/data/decode_h200.json [previous.json]

Prints Markdown: the contiguous grid (``x best SDPA`` = the faster of SDPA flash and cuDNN over
ours, > 1: ours faster; ``tma``: K and V read through TMA descriptors), speculative decoding,
the paged layout against the contiguous one, the accuracy checks, the raw-key cache, graph
against eager; with a previous file, a ``x prev`` column (previous time / this time).
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def index(data):
    rows = {}
    for r in data["rows"]:
        key = (r["impl"], r["D"], r["dtype"], r["window"], r["B"], r["context"], r.get("Nq", 1),
               r.get("page_size"), r.get("rotated", True))
        rows[key] = r
    return rows


def best_sdpa(rows, d, dtype, b, n, nq=1):
    times = [rows[k]["us"] for k in ((s, d, dtype, 2048, b, n, nq, None, True)
                                     for s in ("sdpa_flash", "sdpa_cudnn"))
             if k in rows and rows[k].get("us")]
    return min(times) if times else None


def main(path, previous=None):
    data = load(path)
    rows = index(data)
    prev = index(load(previous)) if previous else {}
    out = []
    head = "| D | dtype | window | B | context | µs | of bound | x best SDPA | tma | x rerotate |"
    if prev:
        head += " x prev |"
    out += ["## Contiguous cache, Nq = 1", "", head,
            "|" + "---|" * (head.count("|") - 1)]
    for d in (64, 128):
        for dtype in ("bfloat16", "float16"):
            for window in (2048, 512):
                for b in (1, 8, 32):
                    for n in (4096, 32768, 131072):
                        key = ("rerope_decode", d, dtype, window, b, n, 1, None, True)
                        r = rows.get(key)
                        if not r or not r.get("us"):
                            continue
                        sdpa = best_sdpa(rows, d, dtype, b, n)
                        rr = rows.get(("rerotate_torch", d, dtype, 2048, b, n, 1, None, True))
                        x_rr = (f"{rr['us'] / r['us']:.1f}" if rr and rr.get("us")
                                and window == 2048 else "")
                        line = (f"| {d} | {dtype} | {window} | {b} | {n} | {r['us']:.1f} | "
                                f"{r['hbm_fraction']:.2f} | {sdpa / r['us']:.2f} | "
                                f"{'yes' if r.get('tma') else 'no'} | {x_rr} |")
                        if prev:
                            p = prev.get(key)
                            line += f" {p['us'] / r['us']:.2f} |" if p and p.get("us") else " |"
                        out.append(line)
    out += ["", "## Speculative decoding (B=8, bf16, window 2048; SDPA without a causal mask)", "",
            "| D | Nq | context | µs | of bound | x best SDPA |", "|---|---|---|---|---|---|"]
    for d in (64, 128):
        for nq in (2, 4, 8):
            for n in (32768, 131072):
                r = rows.get(("rerope_decode", d, "bfloat16", 2048, 8, n, nq, None, True))
                if r and r.get("us"):
                    sdpa = best_sdpa(rows, d, "bfloat16", 8, n, nq)
                    out.append(f"| {d} | {nq} | {n} | {r['us']:.1f} | {r['hbm_fraction']:.2f} | "
                               f"{sdpa / r['us']:.2f} |")
    out += ["", "## Paged cache (bf16, window 2048; the same data in random non-monotone pages; "
            "pointer loads; `max |diff|` against the contiguous call)", "",
            "| D | B | context | page | µs | x contiguous | x best SDPA | of bound | max diff |",
            "|---|---|---|---|---|---|---|---|---|"]
    for d in (64, 128):
        for b, n in ((1, 131072), (8, 32768), (8, 131072), (32, 32768)):
            cont = rows.get(("rerope_decode", d, "bfloat16", 2048, b, n, 1, None, True))
            for page in (16, 32, 64, 128, 256):
                r = rows.get(("rerope_decode", d, "bfloat16", 2048, b, n, 1, page, True))
                if r and r.get("us") and cont:
                    sdpa = best_sdpa(rows, d, "bfloat16", b, n)
                    out.append(f"| {d} | {b} | {n} | {page} | {r['us']:.1f} | "
                               f"{cont['us'] / r['us']:.2f} | {sdpa / r['us']:.2f} | "
                               f"{r['hbm_fraction']:.2f} | "
                               f"{r.get('max_abs_diff_vs_contiguous', float('nan')):g} |")
    checks = data["meta"].get("checks", [])
    out += ["", "Accuracy checks of the run (B=1, against a float32 reference): " + ", ".join(
        f"D={c['D']} {c['dtype']} {c['context']} keys: max|err| {c['max_abs_err']:.1e} "
        f"(max|ref| {c['max_abs_ref']:.3f})" for c in checks)]
    raw = [rows.get(("rerope_decode", d, "bfloat16", 2048, 1, 131072, 1, None, False))
           for d in (64, 128)]
    out += ["", "Raw-key cache (`rotated=False`, B=1, 128k, bf16): " + ", ".join(
        f"D={r['D']} {r['us']:.1f} µs" for r in raw if r and r.get("us"))]
    parts = []
    for d in (64, 128):
        for impl in ("rerope_decode", "sdpa_cudnn"):
            r = rows.get((impl, d, "bfloat16", 2048, 8, 131072, 1, None, True))
            if r and r.get("us") and r.get("us_eager"):
                parts.append(f"D={d} {impl} {r['us']:.1f} / {r['us_eager']:.1f} µs")
    out += ["", "Graph replay against eager at B=8, 128k keys, bf16: " + ", ".join(parts)]
    print("\n".join(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
