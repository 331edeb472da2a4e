"""What every benchmark here shares: timing, the run's metadata, and the results file.

Timing (all on a CUDA GPU):

- :func:`event_times_ms`: GPU milliseconds of each of ``count`` runs of a step, one CUDA-event
  pair per run, optionally after flushing the L2 cache (:func:`l2_flush_buffer`) so that no run
  profits from the previous one's data;
- :func:`repetitions`: how many runs fit a time budget, given one run's estimate;
- :func:`back_to_back_us`: microseconds per call of many calls in a row and one synchronisation
  at the end: the host's time whenever it exceeds the GPU's (what a Python loop sees);
- :func:`wall_ms`: the median wall-clock time of a call synchronised before and after.

Metadata: :func:`environment` (device, versions, date). Results: one JSON file per run,
``{"meta": {...}, "rows": [{...}, ...], ...}``, written atomically after every row or group by
:func:`write_results` (a run cut short keeps what it measured) and read back by
:func:`read_results` and :func:`select_rows`, which need no GPU.
"""

import datetime
import json
import os
import statistics
import time

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024   # more than any L2 cache (H200: 50 MB)


# --- timing --------------------------------------------------------------------------------------

def l2_flush_buffer(device="cuda"):
    """A buffer larger than the L2 cache: ``buffer.zero_()`` before a run evicts the last one's
    data (not timed when done outside the run's events)."""
    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)


def event_times_ms(step, count, *, flush=None, sync_each=False):
    """GPU milliseconds of ``count`` runs of ``step()``, one CUDA-event pair around each.

    ``flush``: a buffer (:func:`l2_flush_buffer`) zeroed before each run, outside its events.
    By default the runs are enqueued back to back and synchronised once at the end, so the host
    runs ahead and each pair times the GPU alone; ``sync_each=True`` synchronises after every
    run, so a pair also holds the host's latency before the first kernel of a short step.
    """
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        step()
        end.record()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def repetitions(estimate_s, budget_s, least, most):
    """How many runs of ``estimate_s`` seconds each fit ``budget_s``, within ``[least, most]``."""
    return int(min(most, max(least, budget_s / max(estimate_s, 1e-6))))


def back_to_back_us(step, calls, warmup=5):
    """Microseconds per call of ``calls`` calls of ``step()`` in a row, one synchronisation at
    the end (after ``warmup`` calls): the host's time per call whenever it exceeds the GPU's."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def wall_ms(step, reps, device="cuda"):
    """Median wall-clock milliseconds of ``step()``, synchronised before and after each run
    (``device="cpu"``: no synchronisation, e.g. under Triton's interpreter)."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def wait_for_gpu_sharer():
    """Return once the process named by the environment variable ``WAIT_PID`` (one sharing the
    GPU, e.g. a test run started beside the warm-up) has ended; at once when it is unset."""
    wait = os.environ.get("WAIT_PID")
    while wait and os.path.exists(f"/proc/{wait}"):
        time.sleep(0.5)


# --- the run's metadata ----------------------------------------------------------------------------

def utc_now():
    """The current UTC time, ISO 8601 to the second (a results file's ``date``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment(device="cuda", *, day=False):
    """``{"gpu", "torch", "triton", "cuda", "date"}`` of this run (``gpu`` says the CPU
    interpreter when ``device`` is not CUDA; ``triton`` is None where it is not installed;
    ``day=True``: the date without the time, as the older results files have it)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "date": utc_now()[:10] if day else utc_now()}


def describe_error(error):
    """One line for a failed case: the exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


# --- the results file -------------------------------------------------------------------------------

def write_results(path, rows, meta, **extra):
    """Write ``{"meta": meta, "rows": rows, **extra}`` to ``path`` (:func:`write_json`)."""
    write_json(path, {"meta": meta, "rows": rows, **extra})


def write_json(path, data):
    """Write ``data`` as indented JSON to ``path``, atomically (never half a file), creating its
    folder if needed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        json.dump(data, file, indent=1)
        file.write("\n")
    os.replace(temporary, path)


def read_results(path, what="benchmark results"):
    """The whole results file (a dict with a ``rows`` list); ``ValueError`` naming ``what`` if
    ``path`` holds something else."""
    with open(path) as file:
        results = json.load(file)
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise ValueError(f"{path}: not a {what} file (no 'rows' list)")
    return results


def select_rows(rows, **where):
    """The rows whose fields equal every ``key=value`` of ``where`` (``None`` matches all)."""
    return [row for row in rows
            if all(value is None or row.get(key) == value for key, value in where.items())]
