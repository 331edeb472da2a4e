"""Correctness and speed of perf/gluon/rerope_fwd.py (run by device_rerope.sh).

    PYTHONPATH=kernels:. REROPE_AUTOTUNE=0 python perf/gluon/bench_rerope.py --out $OUT/gluon_rerope.json

1. Correctness (causal, B1, D 64/128, fp16/bf16, every config): against a float32 torch evaluation of
   the five-tensor formula (``ref_rows``). N=1024, H=--heads: windows 1, 100, 129, 300, 1024, 4096
   (all rows; non-multiples of 128 put i-j = w-1 / w inside tiles). N=8192: windows 2048, 1000,
   float32 reference on sampled row ranges, and the package's Triton ``rerope.rerope_attention`` on
   all rows (reported as ``max_abs_vs_triton``). O and LSE; pass: O below 1e-2 fp16 / 4e-2 bf16
   (or 2x the Triton kernel's own error on the same rows), LSE below 1e-2.
2. Speed, B1 H32 N8192 window 2048 causal, D 64/128, fp16/bf16: SDPA cuDNN (plain causal on
   q1, k1, v), the package's Triton kernel (REROPE_AUTOTUNE=0), each Gluon config; median of 5
   windows of --reps calls (CUDA events); ratio = cuDNN ms / impl ms.
The JSON is rewritten after every row. --smoke FILE: each config once at N=1024 H=2 window 300
(start/ok/bad KEY lines for device_rerope.sh). --cpu-dry-run: no GPU, kernels replaced by the reference.
Configs: rerope_fwd.all_configs (default + EXTRA_CONFIGS, incl. the BAND_TWICE ones, whose seventh
field is 1, and their FA3-scheduled variants: sixth field PIPE / eighth PINGPONG); --all-configs adds
RETIRED_CONFIGS; --quick: quick_configs (default, one BAND_TWICE and its three FA3-scheduled variants).
--list-keys prints the config keys; --precompile KEY...: only JIT-compile those configs (with and
without LSE) into Triton's on-disk cache, nothing launched (device_rerope.sh: one process per key).
--d64 (device_rerope.sh D64=1): D64 only, rerope_fwd.d64_configs (the best D64 configs, the
band-twice SPLIT=3 one and the LEAN ones, BLOCK_M 192; seventh field 2) and the plain Gluon kernel
(plain_fwd) at SPLIT=2 and SPLIT=3 on
(q1, k1, v) beside cuDNN, checked against the same reference with window > N; plain keys read
``plain:64:dtype:config``.
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_plain import cuda_ms, die, wall_ms  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "gluon_rerope.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="rerope_fwd.quick_configs: default + one BAND_TWICE (+ PIPE/PINGPONG)")
    ap.add_argument("--all-configs", action="store_true", help="also rerope_fwd.RETIRED_CONFIGS")
    ap.add_argument("--list-keys", action="store_true", help="print the config keys and exit")
    ap.add_argument("--precompile", nargs="+", metavar="KEY", help="only JIT-compile these configs")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--check-n", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--time-n", type=int, default=8192)
    ap.add_argument("--time-window", type=int, default=2048)
    ap.add_argument("--smoke", metavar="PROGRESS_FILE")
    ap.add_argument("--skip", nargs="*", default=[], metavar="KEY",
                    help="D:dtype:BLOCK_M,BLOCK_N,STAGES,WARPS,SPLIT,PIPE[,BAND_TWICE[,PINGPONG]]")
    ap.add_argument("--d64", action="store_true",
                    help="D64 only: rerope_fwd.d64_configs and plain Gluon SPLIT 2 / 3")
    ap.add_argument("--cpu-dry-run", action="store_true")
    return ap.parse_args(argv)


def plain_d64_configs():
    """--d64: plain_fwd's best config (SPLIT=2, 0.91-0.92 of cuDNN at D64 on the H100) and its
    SPLIT=3 ones."""
    import plain_fwd as pf
    return [(128, 128, 2, 4, 2, 0)] + list(pf.SPLIT3_CONFIGS)


def rerope_configs(args, D):
    import rerope_fwd as rf
    if args.d64:
        return rf.d64_configs() if D == 64 else []
    return rf.quick_configs(D) if args.quick else rf.all_configs(D, retired=args.all_configs)


def head_dims(args):
    return (64,) if args.d64 else (64, 128)


def ref_rows(q1, q2, k1, k2, v, window, rows, sm_scale=None):
    """float32 five-tensor ReRoPE, causal, for query rows `rows` (1-D long tensor): (o, lse)."""
    import torch
    N, D = q1.shape[-2], q1.shape[-1]
    sm_scale = sm_scale or 1.0 / math.sqrt(D)
    f = lambda t: t.float()  # noqa: E731
    s1 = f(q1[..., rows, :]) @ f(k1).transpose(-1, -2)
    s2 = f(q2[..., rows, :]) @ f(k2).transpose(-1, -2)
    d = rows[:, None] - torch.arange(N, device=q1.device)[None, :]
    s = torch.where(d < window, s1, s2) * sm_scale
    del s1, s2
    s = s.masked_fill(d < 0, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - lse[..., None]) @ f(v)
    return o, lse


def sample_rows(N, device):
    import torch
    if N <= 2048:
        return torch.arange(N, device=device)
    parts = [torch.arange(0, 256), torch.arange(N // 2 - 128, N // 2 + 128), torch.arange(N - 256, N)]
    return torch.cat(parts).to(device)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("REROPE_AUTOTUNE", "0")
    if args.list_keys:  # no torch.cuda needed
        import torch
        for D in head_dims(args):
            for dt in ("float16", "bfloat16"):
                keys = [f"{D}:{dt}:{','.join(map(str, c))}" for c in rerope_configs(args, D)]
                if args.d64:
                    keys += [f"plain:{D}:{dt}:{','.join(map(str, c))}" for c in plain_d64_configs()]
                for k in keys:
                    if k not in args.skip:
                        print(k)
        return 0
    if args.cpu_dry_run:
        import torch
        dev, timer = "cpu", wall_ms
    else:
        import torch
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            die("bench_rerope: needs an sm_90 CUDA device (H100/H200); nothing run")
        dev, timer = "cuda", cuda_ms
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import plain_fwd as pf
    import rerope_fwd as rf

    def full_ref(q1, q2, k1, k2, v, window, sm_scale=None, return_lse=False, config=None, causal=True):
        o, lse = ref_rows(q1, q2, k1, k2, v, window, torch.arange(q1.shape[-2], device=q1.device))
        o = o.to(q1.dtype)
        return (o, lse) if return_lse else o

    def plain_ref(q, k, v, return_lse=False, config=None):  # --cpu-dry-run's plain_fwd.attention
        return full_ref(q, q, k, k, v, q.shape[-2] + 1, return_lse=return_lse)

    gluon = full_ref if args.cpu_dry_run else rf.rerope_attention
    plain = plain_ref if args.cpu_dry_run else pf.attention
    try:
        if args.cpu_dry_run:
            raise ImportError("dry run")
        sys.path.insert(0, os.path.join(ROOT, "kernels"))
        import rerope as pkg
        def triton_impl(*a, **k):  # the Triton kernels (the package would run its Gluon ones)
            with pkg.using_config(gluon=False):
                return pkg.rerope_attention(*a, causal=True, **k)
    except Exception as e:
        print(f"package Triton kernel not used: {e}", flush=True)
        triton_impl = full_ref
    cudnn = SDPBackend.MATH if args.cpu_dry_run else SDPBackend.CUDNN_ATTENTION

    res = {"device": "cpu dry run" if args.cpu_dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "B": 1, "causal": True,
           "skipped": list(args.skip), "checks": [], "timing": [], "errors": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def key(D, dt, cfg):
        return f"{D}:{str(dt).replace('torch.', '')}:{','.join(map(str, cfg))}"

    def configs(D, dt):
        return [c for c in rerope_configs(args, D) if key(D, dt, c) not in args.skip]

    def plain_configs(D, dt):  # --d64 only
        cfgs = plain_d64_configs() if args.d64 and D == 64 else []
        return [c for c in cfgs if "plain:" + key(D, dt, c) not in args.skip]

    def inputs(B, H, N, D, dt, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randn(B, H, N, D, device=dev, dtype=dt, generator=g) for _ in range(5)]

    dtypes = [torch.float16, torch.bfloat16]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    t0 = time.time()

    if args.precompile:
        for kk in args.precompile:
            is_plain = kk.startswith("plain:")
            D, dts, cfg = kk.removeprefix("plain:").split(":")
            D, dt, cfg = int(D), getattr(torch, dts), tuple(int(x) for x in cfg.split(","))
            ts = [torch.empty(1, 1, 1024, D, device=dev, dtype=dt) for _ in range(5)]
            t1 = time.time()
            for lse in (True, False):
                if args.cpu_dry_run:
                    continue
                if is_plain:
                    pf.attention(ts[0], ts[2], ts[4], return_lse=lse, config=cfg, _warmup=True)
                else:
                    rf.rerope_attention(*ts, 300, return_lse=lse, config=cfg, _warmup=True)
            print(f"precompiled {kk} in {time.time() - t1:.1f} s", flush=True)
        return 0

    if args.smoke:
        fails = 0
        with open(args.smoke, "a") as prog:
            for D in head_dims(args):
                for dt in dtypes:
                    ts = inputs(1, 2, 1024, D, dt, D)
                    ref, _ = ref_rows(*ts, 300, torch.arange(1024, device=dev))
                    q1, _, k1, _, v = ts
                    ref_plain, _ = ref_rows(q1, q1, k1, k1, v, 1025, torch.arange(1024, device=dev))
                    runs = [(key(D, dt, c), ref,
                             lambda c=c: gluon(*ts, 300, return_lse=True, config=c))
                            for c in configs(D, dt)]
                    runs += [("plain:" + key(D, dt, c), ref_plain,
                              lambda c=c: plain(q1, k1, v, return_lse=True, config=c))
                             for c in plain_configs(D, dt)]
                    for kk, want, run in runs:
                        prog.write(f"start {kk}\n"); prog.flush(); os.fsync(prog.fileno())  # noqa: E702
                        try:
                            o, _ = run()
                            err = (o.float() - want).abs().max().item()
                            ok = math.isfinite(err) and err < 5e-2
                        except Exception as e:
                            err, ok = f"{type(e).__name__}: {e}"[:300], False
                        fails += not ok
                        prog.write(f"{'ok' if ok else 'bad'} {kk}\n"); prog.flush()  # noqa: E702
                        print(f"smoke {kk}: {'ok' if ok else 'BAD'} (max err {err})", flush=True)
        return 1 if fails else 0

    # ------------------------------------------------------------ correctness
    bad = set()
    print(f"{'N':>5} {'win':>5} {'D':>3} {'dtype':>8} {'config':>22} {'max|dO|':>9} {'max|dLSE|':>9} "
          f"{'triton':>9} {'vsTriton':>9}  ok")
    for N in args.check_n:
        windows = [1, 100, 129, 300, 1024, 4096] if N <= 2048 else [2048, 1000]
        for D in head_dims(args):
            for dt in dtypes:
                pcfgs = plain_configs(D, dt)  # --d64: plain_fwd (SPLIT 2 / 3) on (q1, k1, v)
                if pcfgs:
                    ts = inputs(1, args.heads, N, D, dt, N + D)
                    rows = sample_rows(N, dev)
                    ref_o, ref_lse = ref_rows(ts[0], ts[0], ts[2], ts[2], ts[4], N + 1, rows)
                for c in pcfgs:
                    row = {"N": N, "window": None, "D": D, "dtype": str(dt).replace("torch.", ""),
                           "kernel": "plain", "config": list(c)}
                    try:
                        o, lse = plain(ts[0], ts[2], ts[4], return_lse=True, config=c)
                        sync()
                        row["max_abs_err"] = (o[..., rows, :].float() - ref_o).abs().max().item()
                        row["lse_max_abs_err"] = (lse[..., rows] - ref_lse).abs().max().item()
                        tol = 4e-2 if dt == torch.bfloat16 else 1e-2
                        err_o, err_l = row["max_abs_err"], row["lse_max_abs_err"]
                        row["ok"] = bool(math.isfinite(err_o) and err_o < tol and err_l < 1e-2)
                    except Exception as e:
                        row["ok"] = False
                        row["error"] = f"{type(e).__name__}: {e}"[:2000]
                        res["errors"].append(traceback.format_exc()[-4000:])
                    if not row["ok"]:
                        bad.add(("plain", D, dt, tuple(c)))
                    res["checks"].append(row)
                    save()
                    err_o = row.get("max_abs_err", float("nan"))
                    err_l = row.get("lse_max_abs_err", float("nan"))
                    print(f"{N:>5} {'-':>5} {D:>3} {row['dtype']:>8} {'plain' + str(c):>22} "
                          f"{err_o:>9.2e} {err_l:>9.2e}  {row['ok']}  {row.get('error', '')[:200]}",
                          flush=True)
                if pcfgs:
                    del ts, ref_o, ref_lse
                for w in windows:
                    ts = inputs(1, args.heads, N, D, dt, N + D + w)
                    rows = sample_rows(N, dev)
                    ref_o, ref_lse = ref_rows(*ts, w, rows)
                    try:
                        tri = triton_impl(*ts, w)
                        tri_err = (tri[..., rows, :].float() - ref_o).abs().max().item()
                    except Exception as e:
                        tri, tri_err = None, float("nan")
                        res["errors"].append(f"triton N{N} D{D} w{w}: {type(e).__name__}: {e}"[:1000])
                    for cfg in configs(D, dt):
                        row = {"N": N, "window": w, "D": D, "dtype": str(dt).replace("torch.", ""),
                               "config": list(cfg), "triton_max_abs_err": tri_err}
                        try:
                            o, lse = gluon(*ts, w, return_lse=True, config=cfg)
                            sync()
                            row["max_abs_err"] = (o[..., rows, :].float() - ref_o).abs().max().item()
                            row["lse_max_abs_err"] = (lse[..., rows] - ref_lse).abs().max().item()
                            row["max_abs_vs_triton"] = None if tri is None else (o.float() - tri.float()).abs().max().item()
                            tol = 4e-2 if dt == torch.bfloat16 else 1e-2
                            if math.isfinite(tri_err):
                                tol = max(tol, 2 * tri_err)
                            row["ok"] = bool(math.isfinite(row["max_abs_err"]) and row["max_abs_err"] < tol
                                             and row["lse_max_abs_err"] < 1e-2)
                        except Exception as e:
                            row["ok"] = False
                            row["error"] = f"{type(e).__name__}: {e}"[:2000]
                            res["errors"].append(traceback.format_exc()[-4000:])
                        if not row["ok"]:
                            bad.add((D, dt, tuple(cfg)))
                        res["checks"].append(row)
                        save()
                        g = lambda k: row.get(k) if row.get(k) is not None else float("nan")  # noqa: E731
                        print(f"{N:>5} {w:>5} {D:>3} {row['dtype']:>8} {str(cfg):>22} {g('max_abs_err'):>9.2e} "
                              f"{g('lse_max_abs_err'):>9.2e} {tri_err:>9.2e} {g('max_abs_vs_triton'):>9.2e}  {row['ok']}"
                              + (f"  {row['error'][:200]}" if "error" in row else ""), flush=True)
                    del ts, ref_o, ref_lse, tri
    print(f"correctness: {time.time() - t0:.0f} s", flush=True)

    # ------------------------------------------------------------ timing
    N, w = args.time_n, args.time_window
    print(f"\n{'N':>5} {'win':>5} {'D':>3} {'dtype':>8} {'impl':>36} {'ms':>8} {'1-call':>8} {'cuDNN/impl':>10}")
    for D in head_dims(args):
        for dt in dtypes:
            ts = inputs(1, args.heads, N, D, dt, 7)
            q1, q2, k1, k2, v = ts

            def f_cudnn():
                with sdpa_kernel(cudnn):
                    return F.scaled_dot_product_attention(q1, k1, v, is_causal=True)
            impls = [("sdpa_cudnn", f_cudnn), ("triton_rerope", lambda: triton_impl(*ts, w))]
            impls += [(f"gluon{list(c)}", lambda c=c: gluon(*ts, w, config=c))
                      for c in configs(D, dt) if (D, dt, tuple(c)) not in bad]
            impls += [(f"plain_gluon{list(c)}", lambda c=c: plain(q1, k1, v, config=c))
                      for c in plain_configs(D, dt) if ("plain", D, dt, tuple(c)) not in bad]
            base = None
            for name, f in impls:
                row = {"N": N, "window": w, "D": D, "dtype": str(dt).replace("torch.", ""), "impl": name}
                try:
                    row["ms"], row["ms_single_call"] = timer(f, args.reps, args.warmup)
                    if name == "sdpa_cudnn":
                        base = row["ms"]
                    row["cudnn_over_impl"] = None if base is None else base / row["ms"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                res["timing"].append(row)
                save()
                r = row.get("cudnn_over_impl")
                print(f"{N:>5} {w:>5} {D:>3} {row['dtype']:>8} {name:>36} {row.get('ms', float('nan')):>8.3f} "
                      f"{row.get('ms_single_call', float('nan')):>8.3f} {(r if r is not None else float('nan')):>10.2f}"
                      + (f"  {row['error'][:200]}" if "error" in row else ""), flush=True)
            del ts, q1, q2, k1, k2, v
    res["seconds"] = time.time() - t0
    save()
    print(f"total {res['seconds']:.0f} s; wrote {args.out}")
    return 1 if any(not r["ok"] for r in res["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
