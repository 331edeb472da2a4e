"""Session 48 (issue 34): a re-run benchmark grid against the book's file, cell by cell.

    python perf/runs/s48/compare_grid.py OLD.json NEW.json [--baseline sdpa_cudnn] [--impl rerope]

Rows match on every field but the measurements (``ms``/``us``, ``tflops``, ``peak_gb``,
``hbm_fraction``, ``us_eager``). Prints, per implementation, the median, lowest and highest of
new time / old time, then the ReRoPE cells (``--impl``) whose time grew more than 5 % *and*
whose ratio to the baseline implementation in the same run (``--baseline``, same cell) grew
more than 5 % (a machine that is slower that run slows the baseline too). Writes nothing.
"""
import argparse
import json
import statistics

MEASURED = {"ms", "us", "tflops", "peak_gb", "hbm_fraction", "us_eager", "gbps", "python_us"}


def key(row, drop=()):
    return tuple(sorted((k, v) for k, v in row.items() if k not in MEASURED and k not in drop))


def time_of(row):
    for name in ("ms", "us", "python_us"):
        if row.get(name) is not None:
            return row[name]
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--baseline", default="sdpa_cudnn")
    parser.add_argument("--impl", default="rerope")
    args = parser.parse_args()
    old = {key(r): r for r in json.load(open(args.old))["rows"]}
    new = json.load(open(args.new))["rows"]
    ratios, base = {}, {}
    for row in new:
        o = old.get(key(row))
        if o is None or not time_of(o) or not time_of(row):
            continue
        r = time_of(row) / time_of(o)
        ratios.setdefault(row["impl"], []).append((r, row))
        base[key(row, drop=("impl",))] = base.get(key(row, drop=("impl",)), {})
        base[key(row, drop=("impl",))][row["impl"]] = (time_of(row), time_of(o))
    print(f"{'impl':<22}{'cells':>6}{'median':>8}{'min':>8}{'max':>8}  (new / old time)")
    for impl, rs in sorted(ratios.items()):
        xs = [r for r, _ in rs]
        print(f"{impl:<22}{len(xs):>6}{statistics.median(xs):>8.3f}{min(xs):>8.3f}"
              f"{max(xs):>8.3f}")
    rel = []
    for r, row in ratios.get(args.impl, []):
        cell = base[key(row, drop=("impl",))]
        if args.baseline not in cell:
            continue
        (n, o), (bn, bo) = cell[args.impl], cell[args.baseline]
        rel.append(((n / bn) / (o / bo), r, row))
    if rel:
        xs = [x for x, _, _ in rel]
        print(f"\n{args.impl} / {args.baseline}, new over old: {len(xs)} cells, median "
              f"{statistics.median(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}")
    worse = [(x, r, row) for x, r, row in rel if x > 1.05 and r > 1.05]
    print(f"cells slower by > 5 % in both time and ratio to {args.baseline}: {len(worse)}")
    for x, r, row in sorted(worse, key=lambda t: -t[0]):
        fields = {k: v for k, v in row.items() if k not in MEASURED}
        print(f"  {x:.3f} (time {r:.3f}) {fields}")


if __name__ == "__main__":
    main()
