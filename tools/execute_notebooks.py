#!/usr/bin/env python3
"""Execute the book's notebooks in place and record where they ran.

The one command that (re)produces the outputs stored in book/*.ipynb:

    python tools/execute_notebooks.py                      # every notebook of _toc.yml, in order
    python tools/execute_notebooks.py book/02_naive.ipynb  # only these

Each notebook runs top to bottom in a fresh ``python3`` Jupyter kernel (nbclient), with
``book/`` as the working directory and a generous per-cell timeout. On success its outputs are
written back in place and its metadata gets::

    "rerope_run": {"device": "NVIDIA H200" | "CPU (Triton interpreter)", "torch": "...",
                   "triton": "...", "python": "...", "date": "<ISO 8601, UTC>", "seconds": ...}

A notebook that raises is NOT written (its stored outputs stay as they were); the failing cell is
printed and the command exits non-zero after trying the others. A cell that writes to stderr is
reported too and also makes the exit status non-zero (nbval compares stderr, so a stored warning
breaks ``pytest --nbval``); that notebook is still written, so the output can be inspected.

On the GPU machine, Jupyter comes from the wheels in ``.whl/`` (see
``../shared/tools/device-jupyter-wheels.sh``); start the device command with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
    python3 tools/execute_notebooks.py; cp book/*.ipynb "$OUT"/     # only $OUT comes back

If no ``python3`` kernel spec is found, this script registers one for the running interpreter
(``python -m ipykernel install --user --name python3``).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
KERNEL = "python3"

# Run in a subprocess, so that this process never holds a CUDA context while notebooks run.
_PROVENANCE_PROBE = r"""
import json, platform
import torch
try:
    import triton
    triton_version = triton.__version__
except Exception:                      # no triton at all: say so rather than fail
    triton_version = "not installed"
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
print(json.dumps({"device": device, "torch": torch.__version__, "triton": triton_version,
                  "python": platform.python_version()}))
"""


def toc_pages():
    """Every page of _toc.yml in book order, root first, without suffix (e.g. 'book/01_rope').

    Uses PyYAML when it is installed; the GPU machine may lack it, so a line-based reader of the
    ``root:`` / ``file:`` entries (all this book's _toc.yml uses) is the fallback. The tests
    read the table of contents through this function too.
    """
    text = (ROOT / "_toc.yml").read_text()
    try:
        import yaml
    except ImportError:
        pages = re.findall(r"^\s*(?:-\s*)?(?:root|file):\s*(\S+)\s*$", text, flags=re.M)
    else:
        toc = yaml.safe_load(text)
        pages = [toc["root"]]

        def walk(entries):
            for entry in entries or []:
                if "file" in entry:
                    pages.append(entry["file"])
                walk(entry.get("sections"))
                walk(entry.get("chapters"))

        walk(toc.get("chapters"))
        for part in toc.get("parts") or []:
            walk(part.get("chapters"))
    return [str(Path(page).with_suffix("")) for page in pages]


def toc_notebooks():
    """The notebooks listed in _toc.yml, in book order (pages that are not .ipynb are left out)."""
    notebooks = []
    for page in toc_pages():
        stem = ROOT / page
        if stem.with_suffix(".ipynb").is_file():
            notebooks.append(stem.with_suffix(".ipynb"))
        elif not any(stem.with_suffix(s).is_file() for s in (".md", ".rst")):
            notebooks.append(stem.with_suffix(".ipynb"))     # missing: reported when run
    return notebooks


def provenance():
    result = subprocess.run([sys.executable, "-c", _PROVENANCE_PROBE], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"could not read torch/triton versions:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_kernel(name):
    """Make sure a kernel spec ``name`` exists; register the running interpreter otherwise."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
        return
    except NoSuchKernel:
        pass
    print(f"no '{name}' kernel spec found: registering {sys.executable} as '{name}'", flush=True)
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", name],
                   check=True, stdout=subprocess.DEVNULL)
    KernelSpecManager().get_kernel_spec(name)             # raises if it still is not there


def short_source(cell, lines=3):
    src = cell.source.strip().splitlines()
    shown = "\n".join("    | " + line for line in src[:lines])
    return shown + ("\n    | ..." if len(src) > lines else "")


def failing_cell(nb):
    """(index, cell, error output) of the first code cell with an error output, or None."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return index, cell, output
    return None


def stderr_cells(nb):
    return [index for index, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and any(o.get("output_type") == "stream" and o.get("name") == "stderr"
                    for o in cell.get("outputs", []))]


def coalesce_streams(nb):
    """Merge consecutive stdout (or stderr) chunks of a cell into one output, as Jupyter shows them.

    How a print loop's text is split into chunks depends on timing; merged, the stored notebook
    is the same from run to run.
    """
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged = []
        for output in cell.get("outputs", []):
            previous = merged[-1] if merged else None
            if (output.get("output_type") == "stream" and previous is not None
                    and previous.get("output_type") == "stream"
                    and previous.get("name") == output.get("name")):
                previous["text"] = previous["text"] + output["text"]
            else:
                merged.append(output)
        cell.outputs = merged


def execute(path, run_info, timeout, kernel):
    """Execute one notebook. Returns a list of problems (empty: fine)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel, timeout=timeout, startup_timeout=180,
                            record_timing=False, resources={"metadata": {"path": str(BOOK)}})
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    start = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as exc:
        found = failing_cell(nb)
        if found is None:
            return [f"execution failed: {str(exc).strip().splitlines()[-1]}"]
        index, cell, output = found
        return [f"cell {index} (0-based, markdown cells counted) raised {output.get('ename')}: {output.get('evalue')}\n"
                f"{short_source(cell)}"]
    seconds = round(time.perf_counter() - start, 1)
    coalesce_streams(nb)
    nb.metadata["rerope_run"] = {**run_info, "date": date, "seconds": seconds}
    nbformat.write(nb, path)
    return [f"cell {index} wrote to stderr (nbval compares stderr: silence the warning)"
            for index in stderr_cells(nb)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to run (default: every notebook of _toc.yml)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell (1200)")
    parser.add_argument("--kernel", default=KERNEL, help="Jupyter kernel name (python3)")
    args = parser.parse_args(argv)

    notebooks = [p.resolve() for p in args.notebooks] or toc_notebooks()
    ensure_kernel(args.kernel)
    run_info = provenance()
    print(f"executing {len(notebooks)} notebook(s) on {run_info['device']} "
          f"(torch {run_info['torch']}, triton {run_info['triton']}, "
          f"python {run_info['python']})", flush=True)

    failed = {}
    for number, path in enumerate(notebooks, 1):
        name = os.path.relpath(path, ROOT)
        # Whole lines only: the kernel process shares this terminal and may log in between.
        print(f"[{number}/{len(notebooks)}] {name}: running", flush=True)
        start = time.perf_counter()
        problems = (execute(path, run_info, args.timeout, args.kernel) if path.is_file()
                    else ["no such notebook"])
        status = "FAILED" if problems else "ok"
        print(f"[{number}/{len(notebooks)}] {name}: {status} ({time.perf_counter() - start:.1f} s)",
              flush=True)
        if problems:
            failed[name] = problems
            for problem in problems:
                print("    " + problem.replace("\n", "\n    "), flush=True)

    if failed:
        print(f"{len(failed)} of {len(notebooks)} notebook(s) failed: {', '.join(failed)}",
              flush=True)
        return 1
    print(f"all {len(notebooks)} notebook(s) executed and written in place", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
