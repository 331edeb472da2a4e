"""Correctness and speed of perf/gluon/plain_fwd.py against SDPA (run by device_plain.sh).

    python perf/gluon/bench_plain.py --out $OUT/gluon_plain.json [--quick] [--reps 20]

1. Correctness, causal, B1 H32 N {1024, 8192}, D {64, 128}, fp16/bf16: every config of
   plain_fwd (default + EXTRA_CONFIGS) against SDPA on float32 copies (math backend); max and
   mean abs error of O (pass: below 1e-2 fp16 / 4e-2 bf16, or 2x the error of SDPA's own
   low-precision result), and of the LSE (checked against logsumexp of float32 scores at N=1024).
2. Speed, causal, B1 H32 N 8192 (and 1024), D {64, 128}, fp16/bf16: CUDA events, median of
   5 windows of --reps back-to-back calls after warm-up (and the median of --reps single calls,
   which includes the Python launch cost), gluon (each config that passed) vs SDPA cuDNN
   (SDPBackend.CUDNN_ATTENTION) and SDPA FlashAttention-2 (FLASH_ATTENTION) for reference;
   ratio = cuDNN ms / gluon ms (>1: gluon is faster) and TFLOP/s (causal: 2*B*H*N*N*D flops).
The JSON is rewritten after every row so a run cut short keeps what it measured.
Exits with a clear message (status 2) when CUDA or an sm_90 device is missing.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "gluon_plain.json"))
    ap.add_argument("--reps", type=int, default=20, help="timed calls per row (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="default configs only, N=8192 timing only")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--check-n", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--time-n", type=int, nargs="+", default=[8192, 1024])
    ap.add_argument("--smoke", metavar="PROGRESS_FILE",
                    help="only run every config once at N=512 H=2 (both dtypes, LSE on), writing "
                         "'start KEY' before and 'ok KEY' / 'bad KEY' after each to PROGRESS_FILE, so that a "
                         "wrapper can tell which config hung or crashed the process")
    ap.add_argument("--skip", nargs="*", default=[], metavar="KEY",
                    help="configs to leave out, as D:dtype:BLOCK_M,BLOCK_N,STAGES,WARPS,SPLIT")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="test this script without a GPU: CPU tensors, the Gluon kernel replaced by SDPA, "
                         "wall-clock timing; use with small --heads/--check-n/--time-n")
    return ap.parse_args(argv)


def die(msg):
    print(msg, file=sys.stderr)
    sys.exit(2)


def require_sm90():
    try:
        import torch
    except ImportError:
        die("bench_plain: torch is not installed")
    if not torch.cuda.is_available():
        die("bench_plain: no CUDA device (this needs an sm_90 GPU: H100/H200); nothing run")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        die(f"bench_plain: device capability {cap}, this kernel is sm_90 only (wgmma, TMA); nothing run")
    return torch


def wall_ms(fn, reps, warmup, windows=5):
    """cuda_ms's stand-in for --cpu-dry-run."""
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t.append((time.perf_counter() - t0) * 1e3 / reps)
    t.sort()
    return t[len(t) // 2], t[len(t) // 2]


def fake_attention(q, k, v, sm_scale=None, return_lse=False, config=None):
    """--cpu-dry-run: what plain_fwd.attention returns, computed by torch on the CPU."""
    import torch
    import torch.nn.functional as F
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if not return_lse:
        return o
    N, D = q.shape[-2], q.shape[-1]
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return o, torch.logsumexp(s, -1)


def cuda_ms(fn, reps, warmup, windows=5):
    """(batched, single) ms per call. batched: median over `windows` windows of the mean of `reps`
    back-to-back calls between two CUDA events (the host runs ahead, so Python launch cost is hidden
    when the kernel is longer); single: median of `reps` calls timed one by one (includes launch)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    batched = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        batched.append(a.elapsed_time(b) / reps)
    single = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        single.append(a.elapsed_time(b))
    return sorted(batched)[len(batched) // 2], sorted(single)[len(single) // 2]


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_dry_run:
        import torch
        dev, timer = "cpu", wall_ms
    else:
        torch = require_sm90()
        dev, timer = "cuda", cuda_ms
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    import plain_fwd as pf
    if args.cpu_dry_run:
        pf.attention = fake_attention

    res = {"device": "cpu (dry run: no Gluon kernel ran)" if args.cpu_dry_run else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "B": 1, "H": args.heads, "causal": True,
           "checks": [], "timing": [], "errors": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def key(D, dt, cfg):
        return f"{D}:{str(dt).replace('torch.', '')}:{','.join(map(str, cfg))}"

    res["skipped"] = list(args.skip)

    def configs(D, dt):
        cfgs = [pf.default_config(D)] + ([] if args.quick else list(pf.EXTRA_CONFIGS[D]))
        return [c for c in cfgs if key(D, dt, c) not in args.skip]

    dtypes = [torch.float16, torch.bfloat16]
    B, H = 1, args.heads
    t0 = time.time()
    bad = set()  # (D, dtype, config) that failed correctness: not timed

    if args.smoke:
        fails = 0
        with open(args.smoke, "a") as prog:
            for D in (64, 128):
                for dt in dtypes:
                    q, k, v = (torch.randn(1, 2, 512, D, device=dev, dtype=dt) for _ in range(3))
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
                    for cfg in configs(D, dt):
                        kk = key(D, dt, cfg)
                        prog.write(f"start {kk}\n")
                        prog.flush()
                        os.fsync(prog.fileno())
                        try:
                            o, _ = pf.attention(q, k, v, return_lse=True, config=cfg)
                            err = (o.float() - ref).abs().max().item()  # synchronises
                            ok = math.isfinite(err) and err < 5e-2
                        except Exception as e:
                            err, ok = f"{type(e).__name__}: {e}"[:300], False
                        fails += not ok
                        prog.write(f"{'ok' if ok else 'bad'} {kk}\n")
                        prog.flush()
                        print(f"smoke {kk}: {'ok' if ok else 'BAD'} (max err {err})", flush=True)
        return 1 if fails else 0

    # ---------------------------------------------------------------- correctness
    print(f"{'N':>5} {'D':>3} {'dtype':>8} {'config':>18} {'max|dO|':>9} {'mean|dO|':>9} {'max|dLSE|':>9} {'sdpa max':>9}  ok")
    for N in args.check_n:
        for D in (64, 128):
            for dt in dtypes:
                g = torch.Generator(device=dev).manual_seed(N + D)
                q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dt, generator=g) for _ in range(3))
                with sdpa_kernel(SDPBackend.MATH):
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
                ref_lse = None
                if N <= 2048:
                    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
                    s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
                    ref_lse = torch.logsumexp(s, -1)
                    del s
                # the low-precision SDPA's own error sets the scale of what is acceptable
                try:
                    sdpa_err = (F.scaled_dot_product_attention(q, k, v, is_causal=True).float() - ref).abs().max().item()
                except Exception:
                    sdpa_err = float("nan")
                for cfg in configs(D, dt):
                    row = {"N": N, "D": D, "dtype": str(dt).replace("torch.", ""), "config": list(cfg),
                           "sdpa_max_abs_err": sdpa_err}
                    try:
                        o, lse = pf.attention(q, k, v, return_lse=True, config=cfg)
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        err = (o.float() - ref).abs()
                        row["max_abs_err"] = err.max().item()
                        row["mean_abs_err"] = err.mean().item()
                        row["lse_max_abs_err"] = None if ref_lse is None else (lse - ref_lse).abs().max().item()
                        tol = 4e-2 if dt == torch.bfloat16 else 1e-2
                        if math.isfinite(sdpa_err):
                            tol = max(tol, 2 * sdpa_err)
                        row["ok"] = bool(math.isfinite(row["max_abs_err"]) and row["max_abs_err"] < tol
                                         and (ref_lse is None or row["lse_max_abs_err"] < 1e-2))
                    except Exception as e:
                        row["ok"] = False
                        row["error"] = f"{type(e).__name__}: {e}"[:2000]
                        res["errors"].append(traceback.format_exc()[-4000:])
                    if not row["ok"]:
                        bad.add((D, dt, tuple(cfg)))
                    res["checks"].append(row)
                    save()
                    lse_e = row.get("lse_max_abs_err")
                    print(f"{N:>5} {D:>3} {row['dtype']:>8} {str(cfg):>18} {row.get('max_abs_err', float('nan')):>9.2e} "
                          f"{row.get('mean_abs_err', float('nan')):>9.2e} "
                          f"{(lse_e if lse_e is not None else float('nan')):>9.2e} {sdpa_err:>9.2e}  {row['ok']}"
                          + (f"  {row['error'][:200]}" if "error" in row else ""), flush=True)
                del q, k, v, ref
    print(f"correctness: {time.time() - t0:.0f} s", flush=True)

    # ---------------------------------------------------------------- timing
    print(f"\n{'N':>5} {'D':>3} {'dtype':>8} {'impl':>26} {'ms':>8} {'1-call':>8} {'TFLOP/s':>8} {'cuDNN/impl':>10}")
    for N in ([8192] if args.quick else args.time_n):
        for D in (64, 128):
            for dt in dtypes:
                q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dt) for _ in range(3))
                flops = 2 * B * H * N * N * D  # causal: half of 4*B*H*N*N*D
                impls = []
                for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash2", SDPBackend.FLASH_ATTENTION)):
                    def f(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    impls.append((name, f))
                for cfg in configs(D, dt):
                    if (D, dt, tuple(cfg)) in bad:
                        continue
                    impls.append((f"gluon{list(cfg)}", lambda cfg=cfg: pf.attention(q, k, v, config=cfg)))
                base = None
                for name, f in impls:
                    row = {"N": N, "D": D, "dtype": str(dt).replace("torch.", ""), "impl": name}
                    try:
                        ms, ms_single = timer(f, args.reps, args.warmup)
                        row["ms"] = ms
                        row["ms_single_call"] = ms_single
                        row["tflops"] = flops / ms / 1e9
                        if name == "sdpa_cudnn":
                            base = ms
                        row["cudnn_over_impl"] = None if base is None else base / ms
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    res["timing"].append(row)
                    save()
                    r = row.get("cudnn_over_impl")
                    print(f"{N:>5} {D:>3} {row['dtype']:>8} {name:>26} {row.get('ms', float('nan')):>8.3f} "
                          f"{row.get('ms_single_call', float('nan')):>8.3f} {row.get('tflops', float('nan')):>8.1f} {(r if r is not None else float('nan')):>10.2f}"
                          + (f"  {row['error'][:200]}" if "error" in row else ""), flush=True)
                del q, k, v
    res["seconds"] = time.time() - t0
    save()
    print(f"total {res['seconds']:.0f} s; wrote {args.out}")
    n_bad = sum(1 for r in res["checks"] if not r["ok"])
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
