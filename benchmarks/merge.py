"""Merge several ``python -m benchmarks.attention --out ...`` files into one (the book's
``book/data/bench_h200.json``)::

    python -m benchmarks.merge OUT.json IN1.json IN2.json ...

``meta`` is the last file's gpu/torch/triton/date, plus ``runs``: every input's
arguments and elapsed time (an input that is itself a merge contributes its own
``runs``). Rows are concatenated; a later file's row replaces an earlier one of the same
case, so ``OUT.json OLD.json NEW.json`` refreshes OLD with NEW's cases. No GPU needed.
"""
import sys

from .harness import read_results, write_results

KEY = ("impl", "mode", "causal", "B", "H", "N", "D", "window", "dtype")


def merge(out, *inputs):
    """Write the merge of the results files ``inputs`` to ``out``; returns the number of
    rows."""
    merged, meta, runs = {}, None, []
    for path in inputs:
        data = read_results(path)
        meta = {k: data["meta"][k] for k in ("gpu", "torch", "triton", "date")}
        runs += data["meta"].get("runs") or [{"args": data["meta"].get("args"),
                                              "elapsed_s":
                                                  data["meta"].get("elapsed_s"),
                                              "date": data["meta"].get("date")}]
        for row in data["rows"]:
            merged[tuple(row[k] for k in KEY)] = row
    meta["runs"] = runs
    write_results(out, list(merged.values()), meta)
    return len(merged)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    print(f"wrote {merge(*argv)} rows to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
