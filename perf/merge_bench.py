"""Merge several `python -m benchmarks.attention --out ...` files into one (the book's bench_h200.json).

    python perf/merge_bench.py OUT.json IN1.json IN2.json ...

`meta` is the last file's gpu/torch/triton/date, plus `runs`: every input's arguments and
elapsed time (an input that is itself a merge contributes its own `runs`). Rows are concatenated;
a later file's row replaces an earlier one of the same case, so `OUT.json OLD.json NEW.json`
refreshes OLD with NEW's cases.
"""
import json
import sys

KEY = ("impl", "mode", "causal", "B", "H", "N", "D", "window", "dtype")


def main(out, *inputs):
    merged, meta, runs = {}, None, []
    for path in inputs:
        with open(path) as f:
            data = json.load(f)
        meta = {k: data["meta"][k] for k in ("gpu", "torch", "triton", "date")}
        runs += data["meta"].get("runs") or [{"args": data["meta"].get("args"),
                                              "elapsed_s": data["meta"].get("elapsed_s"),
                                              "date": data["meta"].get("date")}]
        for row in data["rows"]:
            merged[tuple(row[k] for k in KEY)] = row
    meta["runs"] = runs
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": list(merged.values())}, f, indent=1)
    print(f"wrote {len(merged)} rows to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
