"""Launch-configuration sweep of the pre-turned backward at D = 128, and where its time goes
(issue 20). One command on the GPU:

    REROPE_AUTOTUNE=0 python -m benchmarks.sweep_bwd128 --out sweep_bwd128.json

(from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``). Only the ``breakdown`` rows reach a chapter (6, through
``book/data/preturn_bwd_h200.json``); the other parts' answers are in perf/NOTES.md v9-v12.

Shape: B = 1, H = 32, N = 8192, W = 2048, causal, D = 128. The pre-turned backward
(``attention.rerope_backward(..., preturn=True)``) runs the five-tensor kernels on the turned
operands (``SPLIT=False``, ``TURN_BACK=True``), so its configurations come from
``configs._CANDIDATES["dkdv"/"dq"][128]`` (not ``_FUSED_CANDIDATES``).

Parts, one process (plus compile workers, all started first, in parallel, filling Triton's disk
cache):

1. ``kernel``: each candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of one backward
   kernel (the other at its first candidate), fp16 and bf16, raw inputs: the backward timed as
   a whole and per piece — CUDA events around every launch (``attention._launch``) and around
   the turn pass (``attention.turn_operands``), after an L2 flush and a GPU sleep that lets the
   host run ahead (the pieces then measure the GPU, not the launch path). Each candidate's
   gradients are compared with the first candidate's (``max_rel_diff``).
2. ``breakdown``: at the first candidates, fp16 and bf16, raw and rotated: the forward (and its
   key turn), the backward's turn pass, dK/dV, dQ and the rest (the δ kernel), and forward +
   backward with ``benchmarks.attention.measure_case`` beside torch RoPE + SDPA cuDNN's, forward and
   forward + backward, in the same run.
3. ``warp_specialize``: a probe, not a change — a copy of the package in a temporary folder
   whose backward loops run ``tl.range(..., warp_specialize=not MASKED)`` (the unmasked
   passes), timed as in part 1 (fp16 raw, first candidates), or the error it raised.
4. ``step``: the benchmark's own step (``benchmarks.attention.build_case``: forward, then
   ``torch.autograd.grad``) of ``rerope_raw`` and ``rope_sdpa_cudnn``, fp16: timed as
   ``measure_case`` does, and again with a ~1 ms GPU sleep before the start event (the host's
   launch path then hidden) and an event between the forward and the backward, plus the host
   time of each half. The difference says how much of a measured step is the host, not the GPU.

5. ``clocks`` (not in the default set): ``nvidia-smi`` sampled every 50 ms while the
   benchmark's step of ``rerope_raw`` and of ``rope_sdpa_cudnn`` (fp16) runs back to back for
   4 s, then 4 s with the ~1 ms GPU sleep before each step: SM and memory clocks, power,
   temperature and the throttle reasons per phase (``clock_rows``); the raw samples go to
   ``<out>_smi.json``. Read-only: no clock or power setting is touched.

6. ``ws_variants`` (not in the default set): part 3 with ``warp_specialize`` on one loop only —
   the dQ kernel's, or the forward's (``WS_VARIANTS``) — timed with the forward's pieces and
   checked against a float32 reference (``reference_errors``).

``--parts`` picks parts (default all but ``clocks`` and ``ws_variants``, e.g. ``--parts step``);
``--configs 'dq:64,128,4,2;...'`` runs part 1 on those configurations only, fp16. The
breakdown, step and clocks rows of runs go to the book's data file, beside what
``python -m benchmarks.preturn_bwd`` writes there (no GPU needed; the file's other keys are kept):

    python -m benchmarks.sweep_bwd128 --merge perf/runs/sweep_bwd128_h200.json \
        perf/runs/step_bwd128_h200.json perf/runs/bwd_probe1_h200.json \
        --book book/data/preturn_bwd_h200.json

which sets its key ``breakdown`` to ``{"source", "runs": [{"meta", "rows"}, ...]}``.

Rows go to ``--out`` after each one (``benchmarks.harness.write_results``: ``meta`` and ``rows``).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

import rerope  # (before triton: the interpreter is chosen at import)
from rerope import attention, configs

import triton  # noqa: I100

from . import attention as bench
from .harness import environment, l2_flush_buffer, read_results, write_results

N, D, WINDOW, HEADS = 8192, 128, 2048, 32
DTYPES = ("float16", "bfloat16")
SWEEP = {   # first: the current first candidate (configs._CANDIDATES[kernel][128][0])
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3),
             (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 3), (64, 128, 8, 2),
             (128, 64, 8, 2)],
    "dq": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2),
           (128, 32, 4, 3), (128, 32, 4, 4), (128, 32, 8, 3), (128, 32, 8, 2)],
}
CASES = [(dtype, kernel, cfg) for dtype in DTYPES for kernel, cfgs in SWEEP.items()
         for cfg in (cfgs if kernel == "dkdv" else cfgs[1:])]   # dq's first = dkdv's first
WS_LOOP = {"BLOCK_M": "for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_M)):",
           "BLOCK_N": "for t in range(0, n1 + _tile_count(lo2, hi2, BLOCK_N)):"}
TIMING = ("kernel and breakdown pieces: median of 20 CUDA-event runs, each after an L2 flush "
          "and a ~1 ms GPU sleep (the host runs ahead), events around each launch and turn "
          "pass; breakdown fwd_bwd_ms, rope_cudnn_* and step measure_case_*: "
          "benchmarks.attention.measure_case; step plain_* / sleep_*: median of 20 runs of the "
          "benchmark's step after an L2 flush, without / with the sleep before the start event, "
          "an event between forward and backward; host_*: perf_counter of each half's Python")
SLEEP_CYCLES = 2_000_000          # ~1 ms: the host enqueues the backward while the GPU sleeps


@contextmanager
def forced(kernel=None, cfg=None):
    """The pre-turned backward's ``kernel`` launched with ``cfg`` (the others: first candidate);
    every cache that keeps a compiled kernel or a bound launch is cleared on entry and exit."""
    original = configs.launch_configs

    def patched(name, head_dim, capability, elem_bytes=2, split=False, autotune=None):
        if name == kernel and not split:
            bm, bn, w, s = cfg
            return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
        return original(name, head_dim, capability, elem_bytes, split)[:1]

    def clear():
        attention._autotuned.cache_clear()
        attention._LAUNCHERS.clear()
        attention.PLANS.clear()

    clear()
    configs.launch_configs = patched
    try:
        yield
    finally:
        configs.launch_configs = original
        clear()


@contextmanager
def recording(segments):
    """Append ``(name, start event, end event)`` for every kernel launch and turn pass."""
    launch, turn = attention._launch, attention.turn_operands

    def timed(name, fn, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        segments.append((name, start, end))
        return result

    attention._launch = lambda kernel, *a, **k: timed(kernel, launch, kernel, *a, **k)
    attention.turn_operands = lambda *a, **k: timed("turn", turn, *a, **k)
    try:
        yield
    finally:
        attention._launch, attention.turn_operands = launch, turn


def inputs(dtype, n=N, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, HEADS, n, D, device="cuda", dtype=getattr(torch, dtype),
                        generator=gen) for _ in range(4)]


def operands(n, rotated):
    return attention._rotations(n, D, 10000.0, WINDOW, None, None, rotated,
                                torch.device("cuda"))


def segments_ms(step, reps=20):
    """Median ms of the whole ``step()`` and of each named piece in it (summed per name)."""
    flush = l2_flush_buffer()
    step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        segments = []
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with recording(segments):
            start.record()
            step()
            end.record()
        runs.append((start, end, segments))
    torch.cuda.synchronize()
    pieces = {}
    totals = []
    for start, end, segments in runs:
        totals.append(start.elapsed_time(end))
        summed = {}
        for name, s, e in segments:
            summed[name] = summed.get(name, 0.0) + s.elapsed_time(e)
        for name, ms in summed.items():
            pieces.setdefault(name, []).append(ms)
    result = {f"{name}_ms": statistics.median(v) for name, v in pieces.items()}
    result["total_ms"] = statistics.median(totals)
    result["other_ms"] = result["total_ms"] - sum(v for k, v in result.items()
                                                  if k != "total_ms")
    return result


def backward_step(dtype, rotated, n=N, seed=0):
    """``step()``: the pre-turned backward (``(dq, dk, dv)``) of a fresh forward on fresh
    inputs."""
    q, k, v, dout = inputs(dtype, n, seed)
    ops = operands(n, rotated)
    scale = D ** -0.5
    out, lse = attention.rerope_forward(q, q, k, k, v, WINDOW, True, scale, ops)

    def step():
        return attention.rerope_backward(dout, q, q, k, k, v, out, lse, WINDOW, True, scale,
                                         ops, preturn=True)
    return step


def max_rel_diff(got, want):
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
               for g, w in zip(got, want))


# --- compile workers -------------------------------------------------------------------------


def warm(job):
    """Compile one job's kernels. A ``case`` compiles its own kernel only (the other one's
    launch is skipped: the ``combo`` jobs compile every kernel at its first candidate)."""
    if job["kind"] == "case":
        launch = attention._launch
        attention._launch = lambda kernel, *a, **k: (launch(kernel, *a, **k)
                                                     if kernel == job["kernel"] else None)
        with forced(job["kernel"], tuple(job["cfg"])):
            backward_step(job["dtype"], False, n=1024)()
    elif job["kind"] == "combo":        # forward + backward at the first candidates, N = 4096
        q, k, v, dout = (t.requires_grad_() for t in inputs(job["dtype"], 4096))
        out = rerope.rerope(q, k, v, WINDOW, rotated=job["rotated"])
        torch.autograd.grad(out, (q, k, v), dout)
    elif job["kind"] == "ws":           # N = 4096: the forward's keys pre-turned, as at N
        backward_step("float16", False, n=4096)()
    elif job["kind"] == "fwd":          # the forward at N = 4096 (its keys pre-turned)
        q, k, v, _ = inputs(job["dtype"], 4096)
        rerope.rerope(q, k, v, WINDOW, rotated=job["rotated"])
    torch.cuda.synchronize()


def spawn(args, root=None):
    """``python -m benchmarks.sweep_bwd128 *args`` in a new process; with ``root`` (a folder
    from :func:`warp_specialized_copy`), on that folder's copy of the package."""
    env = None
    if root is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(root, "kernels"), root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "benchmarks.sweep_bwd128", *args], cwd=root,
                            env=env)


# which loops a warp-specialize probe patches: file -> WS_LOOP keys ("warp_specialize": both
# backward loops; part "ws_variants": the dQ loop alone, and the forward's loop alone)
WS_VARIANTS = {"both_bwd": {"backward.py": ("BLOCK_M", "BLOCK_N")},
               "dq": {"backward.py": ("BLOCK_N",)}, "fwd": {"forward.py": ("BLOCK_N",)}}


def warp_specialized_copy(variant="both_bwd"):
    """A temporary copy of the package whose loops named by ``WS_VARIANTS[variant]`` carry
    ``warp_specialize=not MASKED``; returns its folder (holding ``kernels/`` and
    ``benchmarks/``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix=f"ws_probe_{variant}_")
    for tree in ("kernels", "benchmarks"):
        shutil.copytree(os.path.join(root, tree), os.path.join(folder, tree),
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name, blocks in WS_VARIANTS[variant].items():
        path = os.path.join(folder, "kernels", "rerope", name)
        with open(path) as f:
            source = f.read()
        for block in blocks:
            line = WS_LOOP[block]
            assert source.count(line) == 1, f"loop over {block} not found once in {name}"
            source = source.replace(line, line.replace(
                "range(", "tl.range(").replace("):", ", warp_specialize=not MASKED):"))
        with open(path, "w") as f:
            f.write(source)
    return folder


def reference_errors(dtype, rotated, seed):
    """The forward's and the pre-turned backward's max |err| / max |ref| on the first two heads
    against a float32 reference (``rerope.reference.rerope``), inputs as ``backward_step``'s."""
    from rerope import reference

    q, k, v, dout = inputs(dtype, seed=seed)
    ops, scale = operands(N, rotated), D ** -0.5
    out, lse = attention.rerope_forward(q, q, k, k, v, WINDOW, True, scale, ops)
    grads = attention.rerope_backward(dout, q, q, k, k, v, out, lse, WINDOW, True, scale, ops,
                                      preturn=True)
    leaves = [t[:, :2].float().requires_grad_() for t in (q, k, v)]
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_out = reference.rerope(*leaves, WINDOW, causal=True, rotated=rotated)
        ref = torch.autograd.grad(ref_out, leaves, dout[:, :2].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
    errors = {"out_err": ((out[:, :2].float() - ref_out).abs().max()
                          / ref_out.abs().max()).item()}
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        errors[f"{name}_err"] = ((g[:, :2].float() - r).abs().max() / r.abs().max()).item()
    return errors


def ws_time(out, variant="both_bwd"):
    """In the patched copy: the fp16 raw backward at the first candidates, as in part 1 (and,
    for the other variants, the forward's pieces and both halves' errors against float32)."""
    row = {"part": "warp_specialize", "variant": variant, "dtype": "float16", "rotated": False,
           "D": D, "N": N}
    try:
        with forced():
            if variant != "both_bwd":
                row.update(reference_errors("float16", False, 3))
                q, k, v, _ = inputs("float16", seed=2)
                ops = operands(N, False)
                fwd = segments_ms(lambda: attention.rerope_forward(q, q, k, k, v, WINDOW, True,
                                                                   D ** -0.5, ops))
                row.update({f"forward_{k}": v for k, v in fwd.items()})
            row.update(segments_ms(backward_step("float16", False)))
    except Exception as error:      # a probe: the error is the result
        row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    with open(out, "w") as f:
        json.dump(row, f)


def step_rows(dtype="float16", reps=20):
    """Part 4: one row per impl (see the module docstring)."""
    shape = bench.Shape(B=1, H=HEADS, N=N, D=D, window=WINDOW, dtype=dtype, causal=True)
    flush = l2_flush_buffer()
    rows = []
    for impl in ("rerope_raw", "rope_sdpa_cudnn"):
        row = {"part": "step", "impl": impl, "dtype": dtype, "D": D, "N": N,
               "measure_case_ms": bench.measure_case(impl, "fwd+bwd", shape)[0],
               "measure_case_fwd_ms": bench.measure_case(impl, "fwd", shape)[0]}
        torch.manual_seed(0)
        forward, leaves = bench.build_case(impl, shape)
        upstream = tuple(torch.randn_like(o) for o in bench._as_tuple(forward()))
        host = {"fwd": [], "bwd": []}

        def step(mid=None):
            t0 = time.perf_counter()
            outs = bench._as_tuple(forward())
            t1 = time.perf_counter()
            if mid is not None:
                mid.record()
            torch.autograd.grad(outs, leaves, grad_outputs=upstream)
            host["fwd"].append(t1 - t0)
            host["bwd"].append(time.perf_counter() - t1)

        for sleep in (False, True):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            host["fwd"].clear()
            host["bwd"].clear()
            runs = []
            for _ in range(reps):
                events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                flush.zero_()
                if sleep:
                    torch.cuda._sleep(SLEEP_CYCLES)
                events[0].record()
                step(events[1])
                events[2].record()
                runs.append(events)
            torch.cuda.synchronize()
            tag = "sleep" if sleep else "plain"
            row[f"{tag}_ms"] = statistics.median(a.elapsed_time(c) for a, _, c in runs)
            row[f"{tag}_fwd_ms"] = statistics.median(a.elapsed_time(b) for a, b, _ in runs)
            row[f"{tag}_bwd_ms"] = statistics.median(b.elapsed_time(c) for _, b, c in runs)
            row[f"{tag}_host_fwd_ms"] = 1e3 * statistics.median(host["fwd"])
            row[f"{tag}_host_bwd_ms"] = 1e3 * statistics.median(host["bwd"])
        rows.append(row)
        del forward, leaves, upstream
        torch.cuda.empty_cache()
    return rows


CLOCKS = ("clocks rows: nvidia-smi --query-gpu=<fields> -lms 50 (read only) while the benchmark's "
          "fp16 step (forward, then torch.autograd.grad) runs for 4 s back to back (sleep false) "
          "or with a ~1 ms GPU sleep before each step (sleep true); step_ms_* from CUDA events "
          "around each step; *_median/min/max over the samples of the phase after its first "
          "0.5 s; reasons: the throttle-reason bit masks seen (0x4 = software power cap)")
SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def clock_rows(seconds=4.0):
    """Part ``clocks``: ``nvidia-smi`` sampled every 50 ms (read only, no setting changed) while
    the benchmark's fp16 step runs back to back, then with a ~1 ms GPU sleep before each step,
    for ``rerope_raw`` and ``rope_sdpa_cudnn``; per phase the median step time and the samples'
    medians, minima and maxima (the first 0.5 s of each phase left out), and the throttle
    reasons seen (a bit mask: 0x4 is the software power cap)."""
    import threading

    samples = []
    fields = SMI_FIELDS
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                           capture_output=True, text=True)
    if probe.returncode != 0:               # newer drivers: "clocks_event_reasons"
        fields = fields.replace("clocks_throttle_reasons", "clocks_event_reasons")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)

    def read():
        for line in smi.stdout:
            samples.append((time.time(), line.strip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    shape = bench.Shape(B=1, H=HEADS, N=N, D=D, window=WINDOW, dtype="float16", causal=True)
    rows = []
    try:
        time.sleep(1.0)
        for impl in ("rerope_raw", "rope_sdpa_cudnn"):
            with forced():
                torch.manual_seed(0)
                forward, leaves = bench.build_case(impl, shape)
                upstream = tuple(torch.randn_like(o) for o in bench._as_tuple(forward()))

                def step():
                    torch.autograd.grad(bench._as_tuple(forward()), leaves,
                                        grad_outputs=upstream)

                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                for sleep in (False, True):
                    events, t0 = [], time.time()
                    while time.time() - t0 < seconds:
                        pair = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                        if sleep:
                            torch.cuda._sleep(SLEEP_CYCLES)
                        pair[0].record()
                        step()
                        pair[1].record()
                        events.append(pair)
                        if len(events) % 50 == 0:
                            torch.cuda.synchronize()
                    torch.cuda.synchronize()
                    t1 = time.time()
                    times = [a.elapsed_time(b) for a, b in events]
                    inside = [line for t, line in samples if t0 + 0.5 <= t <= t1]
                    cols = [c.split(",") for c in inside]
                    row = {"part": "clocks", "impl": impl, "sleep": sleep, "steps": len(times),
                           "step_ms_median": statistics.median(times),
                           "step_ms_first10": statistics.median(times[:10]),
                           "step_ms_last10": statistics.median(times[-10:]),
                           "fields": fields, "samples": len(cols)}
                    for i, name in enumerate(("sm_mhz", "mem_mhz", "power_w", "temp_c")):
                        vals = [float(c[i]) for c in cols if len(c) > i and
                                c[i].strip().replace(".", "", 1).isdigit()]
                        if vals:
                            row[f"{name}_median"] = statistics.median(vals)
                            row[f"{name}_min"] = min(vals)
                            row[f"{name}_max"] = max(vals)
                    row["reasons"] = sorted({c[4].strip() for c in cols if len(c) > 4})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    time.sleep(1.0)
                del forward, leaves, upstream
                torch.cuda.empty_cache()
    finally:
        smi.terminate()
        smi.wait()
    return rows, samples


BOOK_PARTS = ("breakdown", "step", "clocks")


def merge(runs, book):
    """Put the ``BOOK_PARTS`` rows of the run files ``runs`` under ``book``'s key
    ``breakdown`` (see the module docstring)."""
    data = read_results(book)
    merged = []
    for path in runs:
        run = read_results(path)
        # (clocks rows of the atomic-dQ variant, measured and removed in this session, stay out)
        rows = [r for r in run["rows"] if r["part"] in BOOK_PARTS
                and r.get("atomic_dq", "0") == "0"]
        if not rows:
            raise ValueError(f"{path}: no rows of the parts {BOOK_PARTS}")
        meta = dict(run["meta"], file=path)
        if any(r["part"] == "clocks" for r in rows):
            meta["clocks"] = CLOCKS
        merged.append({"meta": meta, "rows": rows})
    data["breakdown"] = {"source": "python -m benchmarks.sweep_bwd128 (parts breakdown and step)",
                         "runs": merged}
    extra = {k: v for k, v in data.items() if k not in ("meta", "rows")}
    write_results(book, data["rows"], data["meta"], **extra)


# --- the run ---------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_bwd128",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="sweep_bwd128.json")
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    parser.add_argument("--ws-time", help=argparse.SUPPRESS)
    parser.add_argument("--ws-variant", default="both_bwd", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help="part kernel: only these, fp16, e.g. "
                        "'dq:64,128,8,2;dkdv:128,64,4,2' (default: the SWEEP lists, both dtypes)")
    parser.add_argument("--parts", default="kernel,breakdown,warp_specialize,step",
                        help="comma-separated parts to run (see the module docstring)")
    parser.add_argument("--merge", nargs="+", metavar="RUN",
                        help="no run: merge these run files' rows into --book")
    parser.add_argument("--book", default="book/data/preturn_bwd_h200.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if args.merge:
        merge(args.merge, args.book)
        return
    if args.warm:
        warm(json.loads(args.warm))
        return
    if args.ws_time:
        ws_time(args.ws_time, args.ws_variant)
        return

    env = environment()
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"], "date": env["date"],
            "autotune": rerope.config().autotune, "tma": rerope.config().tma,
            "shape": dict(B=1, H=HEADS, N=N, D=D, window=WINDOW, causal=True),
            "first_candidates": {k: configs.candidate_configs(k, D)[0] for k in ("dkdv", "dq")},
            "timing": TIMING}
    rows = []

    def save(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_results(args.out, rows, meta)

    global CASES, SWEEP, DTYPES
    if args.configs:                      # part kernel on these configurations only, fp16
        SWEEP = {}
        for item in args.configs.split(";"):
            kernel, cfg = item.split(":")
            SWEEP.setdefault(kernel, []).append(tuple(int(x) for x in cfg.split(",")))
        DTYPES = ("float16",)
        CASES = [("float16", kernel, cfg) for kernel, cfgs in SWEEP.items() for cfg in cfgs]
        meta["configs"] = args.configs

    # compile everything first, all workers at once
    jobs = []
    if "kernel" in parts:
        jobs += [{"kind": "case", "dtype": dt, "kernel": kern, "cfg": cfg}
                 for dt, kern, cfg in CASES]
    if parts & {"kernel", "breakdown"}:
        jobs += [{"kind": "combo", "dtype": dt, "rotated": rot} for dt in DTYPES
                 for rot in (False, True)]
    elif "step" in parts:               # fp16 raw only: each kernel in its own worker
        first = {k: configs.candidate_configs(k, D)[0] for k in ("dkdv", "dq")}
        jobs += [{"kind": "case", "dtype": "float16", "kernel": k, "cfg": c}
                 for k, c in first.items()]
        jobs += [{"kind": "fwd", "dtype": "float16", "rotated": False}]
    if "clocks" in parts and not parts & {"kernel", "breakdown"}:
        jobs += [{"kind": "combo", "dtype": "float16", "rotated": False}]
    variants = (["both_bwd"] if "warp_specialize" in parts else []) + (
        ["dq", "fwd"] if "ws_variants" in parts else [])
    ws_folders = {variant: warp_specialized_copy(variant) for variant in variants}
    start = time.time()
    procs = [spawn(["--warm", json.dumps(job)]) for job in jobs]
    for variant, folder in ws_folders.items():
        procs.append(spawn(["--warm", json.dumps({"kind": "ws"})], root=folder))
        jobs.append({"kind": "ws", "variant": variant})
    codes = [p.wait() for p in procs]
    meta["warm"] = {"workers": len(procs), "seconds": round(time.time() - start),
                    "failed": [j for j, c in zip(jobs, codes) if c]}
    print(f"warm-up: {meta['warm']}", flush=True)

    # part 1: the sweep
    for dtype in DTYPES if "kernel" in parts else ():
        step = backward_step(dtype, False, seed=1)
        with forced():
            reference_grads = step()
        for kernel, cfgs in SWEEP.items():
            for cfg in cfgs:
                row = {"part": "kernel", "dtype": dtype, "rotated": False, "kernel": kernel,
                       "config": list(cfg)}
                try:
                    with forced(kernel, cfg):
                        row["max_rel_diff"] = max_rel_diff(step(), reference_grads)
                        row.update(segments_ms(step))
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                save(row)
        del step, reference_grads
        torch.cuda.empty_cache()

    # part 2: the breakdown at the first candidates, beside torch RoPE + cuDNN
    for dtype in DTYPES if "breakdown" in parts else ():
        shape = bench.Shape(B=1, H=HEADS, N=N, D=D, window=WINDOW, dtype=dtype, causal=True)
        base = {mode: bench.measure_case("rope_sdpa_cudnn", mode, shape)[0]
                for mode in ("fwd", "fwd+bwd")}
        for rotated in (False, True):
            with forced():
                q, k, v, _ = inputs(dtype, seed=2)
                ops = operands(N, rotated)
                fwd = segments_ms(lambda: attention.rerope_forward(q, q, k, k, v, WINDOW, True,
                                                                   D ** -0.5, ops))
                bwd = segments_ms(backward_step(dtype, rotated, seed=2))
                impl = "rerope_rotated" if rotated else "rerope_raw"
                whole = bench.measure_case(impl, "fwd+bwd", shape)[0]
            save({"part": "breakdown", "dtype": dtype, "rotated": rotated, "D": D, "N": N,
                  "fwd_ms": fwd["total_ms"], "fwd_kernel_ms": fwd.get("fwd_ms"),
                  "fwd_key_turn_ms": fwd.get("turn_ms", 0.0),
                  "bwd_ms": bwd["total_ms"], "bwd_turn_ms": bwd.get("turn_ms", 0.0),
                  "dkdv_ms": bwd["dkdv_ms"], "dq_ms": bwd["dq_ms"],
                  "bwd_delta_other_ms": bwd["other_ms"], "fwd_bwd_ms": whole,
                  "rope_cudnn_fwd_ms": base["fwd"], "rope_cudnn_fwd_bwd_ms": base["fwd+bwd"],
                  "vs_rope_cudnn": round(base["fwd+bwd"] / whole, 3)})
            torch.cuda.empty_cache()

    # part 3: the warp-specialize probes, each in its own process (kernels in the disk cache)
    for variant, folder in ws_folders.items():
        result = os.path.join(folder, "ws.json")
        code = spawn(["--ws-time", result, "--ws-variant", variant], root=folder).wait()
        if os.path.exists(result):
            with open(result) as f:
                save(json.load(f))
        else:
            save({"part": "warp_specialize", "variant": variant,
                  "error": f"probe process exited {code}"})

    # part 4: the benchmark's step, with and without the host's launch path hidden
    if "step" in parts:
        for row in step_rows():
            save(row)

    if "clocks" in parts:
        clock, samples = clock_rows()
        for row in clock:
            save(row)
        with open(os.path.splitext(args.out)[0] + "_smi.json", "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main()
