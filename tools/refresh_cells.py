#!/usr/bin/env python3
"""Re-execute a notebook on this machine and keep the new outputs of a few cells only.

The book's outputs come from the H200 (tools/execute_notebooks.py). When a cell changes after
that run and its output does not depend on the GPU (a source listing, a checker's verdict, a
table or figure drawn from book/data), it can be refreshed on a CPU without losing the GPU
outputs of the other cells:

    python tools/refresh_cells.py book/04_three_regions.ipynb CELL_ID [CELL_ID ...] \\
        --why "Exercise 3 rewritten (the band walk with both products)"

The whole notebook runs top to bottom in a fresh kernel (book/ as working directory, as nbval
runs it), in memory; only the named cells' outputs are written back. Their ids are added to the
notebook's metadata, ``rerope_run.cells_run_on_cpu = {"ids": [...], "why": "..."}``, with this
machine's torch and Triton versions (the rest of ``rerope_run`` still describes the GPU run). A named cell that raises or writes to stderr is an error and nothing is written.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import execute_notebooks as ex  # noqa: E402  (the same kernel, provenance and stream handling)


def refresh(path, ids, why, timeout, kernel):
    import nbformat
    from nbclient import NotebookClient

    original = nbformat.read(path, as_version=4)
    missing = set(ids) - {cell.get("id") for cell in original.cells}
    if missing:
        sys.exit(f"{path}: no cell with id {sorted(missing)}")
    fresh = nbformat.read(path, as_version=4)
    NotebookClient(fresh, kernel_name=kernel, timeout=timeout, startup_timeout=180,
                   record_timing=False, resources={"metadata": {"path": str(ex.BOOK)}}).execute()
    ex.coalesce_streams(fresh)
    by_id = {cell.get("id"): cell for cell in fresh.cells}
    for cell_id in ids:
        for output in by_id[cell_id].get("outputs", []):
            if output.get("output_type") == "error" or (
                    output.get("output_type") == "stream" and output.get("name") == "stderr"):
                sys.exit(f"{path}: cell {cell_id} wrote an error or stderr:\n{output}")
    for cell in original.cells:
        if cell.get("id") in ids:
            cell.outputs = by_id[cell["id"]].outputs
            # nbval refuses a cell with outputs and no execution count ("unrun reference cell")
            cell.execution_count = by_id[cell["id"]].execution_count
    run = original.metadata.setdefault("rerope_run", {})
    info = ex.provenance()
    on_cpu = run.get("cells_run_on_cpu") or {"ids": [], "why": ""}
    on_cpu["ids"] = list(dict.fromkeys(list(on_cpu["ids"]) + list(ids)))
    note = f"{why}: executed on CPU (torch {info['torch']}, Triton {info['triton']})"
    reasons = [r for r in on_cpu["why"].split("; ") if r]
    if note not in reasons:                  # the same cells refreshed again: said once
        reasons.append(note)
    on_cpu["why"] = "; ".join(reasons)
    run["cells_run_on_cpu"] = on_cpu
    nbformat.write(original, path)
    print(f"{path}: refreshed {len(ids)} cell(s): {', '.join(ids)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("ids", nargs="+", help="ids of the cells whose outputs to keep")
    parser.add_argument("--why", required=True, help="what changed (goes into the metadata)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell (1200)")
    parser.add_argument("--kernel", default=ex.KERNEL)
    args = parser.parse_args(argv)
    ex.ensure_kernel(args.kernel)
    refresh(args.notebook.resolve(), args.ids, args.why, args.timeout, args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
