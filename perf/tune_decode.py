"""Issue 19, first H200 call: launch configurations of the decode kernel per head dim, the
split rule's programs per SM, the paged layout against the contiguous one, and the read bound.

Run from the repository root on a CUDA GPU (``REROPE_AUTOTUNE=0``)::

    python perf/tune_decode.py            # writes $OUT/tune_decode.json

Every kernel variant is compiled first, in parallel worker processes on small caches with the
same specialisation (Triton's on-disk cache), so the timing loop only times. All timings: the
benchmark's own ``bench_decode.graph_us`` (CUDA-graph replay, L2 flushed), bf16, Hq=32, Hkv=8,
window 2048, one query, a full rotated cache.
"""

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

HQ, HKV, WINDOW = 32, 8, 2048
CONFIGS = {   # (BLOCK_N, ANGLES, num_warps, num_stages); the first is the current default
    64: [(64, 3, 4, 3), (128, 3, 4, 3), (128, 3, 4, 4), (128, 3, 8, 3), (256, 3, 8, 3),
         (64, 3, 4, 4), (128, 3, 4, 2)],
    128: [(64, 3, 4, 3), (64, 3, 4, 4), (128, 3, 8, 3), (128, 3, 4, 3), (64, 3, 4, 2)],
}
SHAPES = [(1, 131072), (8, 32768), (8, 131072), (32, 32768)]
PER_SM = (2, 3, 4)
PAGES = (16, 64, 256)
BUDGET_S = 190


def splits_for(batch, per_sm, nq=1):
    from rerope import decode

    saved = decode.PROGRAMS_PER_SM
    decode.PROGRAMS_PER_SM = per_sm
    try:
        return decode.default_num_splits(batch, HKV, HQ // HKV, nq, 131072, 132)
    finally:
        decode.PROGRAMS_PER_SM = saved


def run_meta(**extra):
    """A results file's ``meta``: the GPU and versions, plus ``extra``."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "cuda": torch.version.cuda, **extra}


def saver(result, name, started):
    """``save()``: ``result`` (its elapsed time updated) to ``$OUT/name``."""
    out_dir = os.environ.get("OUT", "/tmp")

    def save():
        result["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(result, f, indent=1)
    return save


def decode_once(d, batch, nq, splits, page):
    """One decode call on a 4096-key cache, contiguous (``page`` None) or in pages of ``page``
    keys: compiles that variant (the same specialisation as the timed calls). Returns seconds."""
    import rerope
    from benchmarks import decode as bench_decode as bd

    n = 4096
    q = torch.randn(batch, HQ, nq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    started = time.perf_counter()
    if page is None:
        rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits)
    else:
        kp, vp, table = bd.paged_copy(k, v, page)
        lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        rerope.rerope_decode(q, kp, vp, WINDOW, cache_seqlens=lengths, num_splits=splits,
                             block_table=table)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def timer(read):
    """``timed(step, batch, n, d, **info)``: a row of ``step``'s CUDA-graph time and its fraction
    of the read bound (``read`` bytes/s), printed."""
    from benchmarks import decode as bench_decode as bd

    def timed(step, batch, n, d, **info):
        bound = bd.kv_bytes(batch, n, d=d) / read * 1e6
        us = bd.graph_us(step)
        row = dict(D=d, B=batch, context=n, us=us, hbm_fraction=bound / us, **info)
        print(row, flush=True)
        return row
    return timed


def start_timing(result, budget_s, started=None):
    """After a round's warm-up: wait for a test run sharing the GPU to finish (its pid in
    ``WAIT_PID``; with ``started``, the seconds that took go to ``meta.tests_done_s``), measure
    the read bound into ``result["meta"]`` and set the timing budget. Returns ``(read bytes/s,
    timer(read))``."""
    from benchmarks import decode as bench_decode as bd

    bd.wait_for_gpu_sharer()
    if started is not None:
        result["meta"]["tests_done_s"] = round(time.perf_counter() - started, 1)
    read, reads = bd.triton_read_bandwidth()
    result["meta"].update(read_tb_s=read / 1e12,
                          read_configs_tb_s={k: v / 1e12 for k, v in reads.items()})
    bd.TIME_BUDGET_S, bd.MIN_REPS = budget_s, 5
    return read, timer(read)


def set_config(d, cfg):
    from rerope import decode

    decode.HEAD_DIM_CONFIGS[d] = dict(BLOCK_N=cfg[0], ANGLES=cfg[1], num_warps=cfg[2],
                                      num_stages=cfg[3])


def warm(spec):
    """Compile one variant on a small cache (same specialisation as the timed call)."""
    d, batch, nq, cfg, splits, page = spec
    set_config(d, cfg)
    return spec, decode_once(d, batch, nq, splits, page)


def main():
    import rerope
    from benchmarks import decode as bench_decode as bd

    started = time.perf_counter()
    result = {"meta": run_meta()}
    save = saver(result, "tune_decode.json", started)

    specs = set()
    for d, cfgs in CONFIGS.items():
        for cfg in cfgs:
            for batch, _ in SHAPES:
                for per_sm in PER_SM:
                    specs.add((d, batch, 1, cfg, splits_for(batch, per_sm), None))
        for page in PAGES:
            for cfg in cfgs[:2]:
                specs.add((d, 8, 1, cfg, splits_for(8, 2), page))
    specs = sorted(specs, key=lambda s: (s[3], s[0]), reverse=True)
    ctx = mp.get_context("spawn")
    compile_s = []
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=ctx) as pool:
        for spec, secs in pool.map(warm, specs):
            compile_s.append(secs)
    result["meta"]["warm"] = {"variants": len(specs), "wall_s": round(time.perf_counter() - started, 1),
                              "max_call_s": max(compile_s)}
    print(f"warmed {len(specs)} variants in {time.perf_counter() - started:.0f} s "
          f"(slowest call {max(compile_s):.0f} s)", flush=True)

    read, reads = bd.triton_read_bandwidth()
    result["meta"].update(read_tb_s=read / 1e12, read_configs={k: v / 1e12 for k, v in reads.items()},
                          copy_tb_s=bd.copy_bandwidth() / 1e12, amax_tb_s=bd.read_bandwidth() / 1e12)
    print("bandwidth", {k: result["meta"][k] for k in ("read_tb_s", "copy_tb_s", "amax_tb_s")},
          reads, flush=True)
    save()

    bd.TIME_BUDGET_S, bd.MIN_REPS = 0.05, 5
    torch.manual_seed(0)
    data = {}
    for d in CONFIGS:
        for batch, n in SHAPES:
            k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
            data[d, batch, n] = (torch.randn(batch, HQ, 1, d, device="cuda", dtype=torch.bfloat16),
                                 k, torch.randn_like(k))
    rows = result["rows"] = []
    for d in CONFIGS:                      # baselines
        for batch, n in SHAPES:
            q, k, v = data[d, batch, n]
            bound = bd.kv_bytes(batch, n, d=d) / read * 1e6
            for impl in ("sdpa_flash", "sdpa_cudnn"):
                us = bd.graph_us(bd.build_step(impl, q, k, v, WINDOW, None))
                rows.append(dict(impl=impl, D=d, B=batch, context=n, us=us, hbm_fraction=bound / us))
                print(rows[-1], flush=True)
    save()
    for per_sm_first in (True,):
        for d, cfgs in CONFIGS.items():
            for cfg in cfgs:
                set_config(d, cfg)
                for batch, n in SHAPES:
                    q, k, v = data[d, batch, n]
                    bound = bd.kv_bytes(batch, n, d=d) / read * 1e6
                    for per_sm in PER_SM:
                        splits = splits_for(batch, per_sm)
                        if time.perf_counter() - started > BUDGET_S:
                            break
                        us = bd.graph_us(lambda: rerope.rerope_decode(q, k, v, WINDOW,
                                                                      num_splits=splits))
                        rows.append(dict(impl="rerope_decode", D=d, B=batch, context=n,
                                         config=list(cfg), per_sm=per_sm, num_splits=splits,
                                         us=us, hbm_fraction=bound / us))
                        print(rows[-1], flush=True)
                save()
    # paged against contiguous, B=8
    paged = result["paged"] = []
    for d, cfgs in CONFIGS.items():
        for cfg in cfgs[:2]:
            set_config(d, cfg)
            for n in (32768, 131072):
                q, k, v = data[d, 8, n]
                splits = splits_for(8, 2)
                want = rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits)
                cont = bd.graph_us(lambda: rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits))
                for page in PAGES:
                    if time.perf_counter() - started > BUDGET_S + 40:
                        break
                    kp, vp, table = bd.paged_copy(k, v, page)
                    lengths = torch.full((8,), n, dtype=torch.int32, device="cuda")
                    step = lambda: rerope.rerope_decode(q, kp, vp, WINDOW, cache_seqlens=lengths,
                                                        num_splits=splits, block_table=table)
                    diff = (step().float() - want.float()).abs().max().item()
                    us = bd.graph_us(step)
                    paged.append(dict(D=d, config=list(cfg), context=n, page=page, us=us,
                                      contiguous_us=cont, max_abs_diff=diff))
                    print(paged[-1], flush=True)
                    del kp, vp
            save()
    # accuracy of each head dim's first two configs against the float32 reference
    checks = result["checks"] = []
    for d, cfgs in CONFIGS.items():
        for cfg in cfgs[:2]:
            set_config(d, cfg)
            q, k, v = data[d, 1, 131072]
            checks.append(dict(config=list(cfg), **bd.check_accuracy(q, k, v, WINDOW)))   # (it names D)
            print(checks[-1], flush=True)
    # the graph anomaly: eager against graph at B=8, 128k, D=128, default config
    set_config(128, CONFIGS[128][0])
    q, k, v = data[128, 8, 131072]
    step = lambda: rerope.rerope_decode(q, k, v, WINDOW)
    result["anomaly"] = dict(graph_us=bd.graph_us(step), eager_us=bd.eager_us(step),
                             graph_again_us=bd.graph_us(step))
    print(result["anomaly"], flush=True)
    save()


if __name__ == "__main__" and not {"--round2", "--round3", "--s5", "--s7"} & set(sys.argv):
    with torch.no_grad():
        main()


# --- round 2 (issue 19, second session): small pages, 4 stages, Nq = 8, the merge's share -------

R2_GRID = [(b, n) for b in (1, 8, 32) for n in (4096, 32768, 131072)]
R2_STAGES = {64: [(128, 3, 4, 3), (128, 3, 4, 4)], 128: [(64, 3, 4, 3), (64, 3, 4, 4)]}
R2_PAGED_SHAPES = [(1, 131072), (8, 32768), (8, 131072), (32, 32768)]
R2_PAGES = (16, 32, 64)         # the pages smaller than (or, at D=128, equal to) a key tile
R2_NQ8 = {64: [(128, 3, 4, 3), (128, 3, 8, 3), (64, 3, 4, 3), (128, 0, 4, 3)],
          128: [(64, 3, 4, 3), (64, 3, 8, 3), (32, 3, 4, 3), (64, 0, 4, 3)]}


def round2():
    """``python perf/tune_decode.py --round2``: writes ``$OUT/decode_round2.json``.

    * paged (one scalar block-table load per page of a tile, ``decode._key_rows``) against the
      contiguous layout, pages 16-256, output compared bit for bit;
    * 3 against 4 pipeline stages on the 9 (B, context) shapes of the grid, with both SDPA
      backends as the yardstick;
    * Nq = 8 (32-row tiles) under a few launch configurations;
    * the split kernel alone against split + merge at B = 1 (the merge launch's share).
    """
    import rerope
    from benchmarks import decode as bench_decode as bd
    from rerope import decode

    started = time.perf_counter()
    result = {"meta": run_meta(window=WINDOW, dtype="bfloat16", Hq=HQ, Hkv=HKV)}
    save = saver(result, "decode_round2.json", started)
    decode.FUSED_MERGE = False          # this round timed the two-launch path (split, merge)

    specs = set()
    for d, cfgs in R2_STAGES.items():
        for cfg in cfgs:
            for batch in (1, 8, 32):
                specs.add((d, batch, 1, cfg, splits_for(batch, 2), None))
            specs.add((d, 1, 1, cfg, 16, None))                  # B=1, 4k: 16 splits
        for batch, _ in R2_PAGED_SHAPES:
            for page in R2_PAGES:
                specs.add((d, batch, 1, cfgs[0], splits_for(batch, 2), page))
        for cfg in R2_NQ8[d]:
            specs.add((d, 8, 8, cfg, splits_for(8, 2, 8), None))
    specs = sorted(specs, key=str)
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=mp.get_context("spawn")) as pool:
        compile_s = [secs for _, secs in pool.map(warm, specs)]
    result["meta"]["warm"] = {"variants": len(specs), "wall_s": round(time.perf_counter() - started, 1),
                              "max_call_s": round(max(compile_s), 1)}
    print("warm", result["meta"]["warm"], flush=True)
    read, timed = start_timing(result, 0.04)
    rows = result["rows"] = []
    for d in (64, 128):
        for batch, n in R2_GRID:
            torch.manual_seed(0)
            k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, HQ, 1, d, device="cuda", dtype=torch.bfloat16)
            for impl in ("sdpa_flash", "sdpa_cudnn"):
                rows.append(timed(bd.build_step(impl, q, k, v, WINDOW, None), batch, n, d,
                                  impl=impl))
            for cfg in R2_STAGES[d]:
                set_config(d, cfg)
                rows.append(timed(lambda: rerope.rerope_decode(q, k, v, WINDOW), batch, n, d,
                                  impl="rerope_decode", config=list(cfg)))
                if batch == 1:     # the split kernel alone (its launch bound by the call above)
                    plan = decode._plan(q, k, v, WINDOW, None, None, 10000.0, None, None, True,
                                        None)
                    part = torch.empty(plan.part_shape, dtype=torch.float32, device="cuda")
                    lse = torch.empty(plan.part_shape[:-1], dtype=torch.float32, device="cuda")
                    lengths = plan.full_lengths
                    if not plan.launches:
                        continue
                    split = plan.launches[0]
                    rows.append(timed(lambda: split(q, k, v, lengths, lengths, part, lse,
                                                    part, part),
                                      batch, n, d, impl="split_only", config=list(cfg),
                                      num_splits=plan.num_splits))
            save()
            if (batch, n) in R2_PAGED_SHAPES:
                set_config(d, R2_STAGES[d][0])
                splits = splits_for(batch, 2)
                want = rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits)
                lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
                for page in R2_PAGES:
                    kp, vp, table = bd.paged_copy(k, v, page)
                    step = lambda: rerope.rerope_decode(q, kp, vp, WINDOW, cache_seqlens=lengths,
                                                        num_splits=splits, block_table=table)
                    diff = (step().float() - want.float()).abs().max().item()
                    rows.append(timed(step, batch, n, d, impl="rerope_decode_paged",
                                      page_size=page, config=list(R2_STAGES[d][0]),
                                      max_abs_diff_vs_contiguous=diff))
                    del kp, vp, table
                save()
            if batch == 8 and n >= 32768:
                q8 = torch.randn(batch, HQ, 8, d, device="cuda", dtype=torch.bfloat16)
                for cfg in R2_NQ8[d]:
                    set_config(d, cfg)
                    rows.append(timed(lambda: rerope.rerope_decode(q8, k, v, WINDOW), batch, n,
                                      d, impl="rerope_decode", Nq=8, config=list(cfg)))
                save()
            del k, v, q
            torch.cuda.empty_cache()
    save()
    print("done", round(time.perf_counter() - started, 1), flush=True)


if __name__ == "__main__" and "--round2" in sys.argv:
    with torch.no_grad():
        round2()


# --- round 3: how the block table is read, and the merge's step ---------------------------------

R3_PAGES = {64: (16, 32, 64), 128: (16, 32)}     # pages smaller than the key tile
R3_RULES = (0, 1, 2)   # decode.PAGE_LOADS_RULE: gather, scalars, the gather a tile ahead (since removed)
R3_MERGE = (16, 64, 128)                         # decode.MERGE_SPLITS_BLOCK


def warm3(spec):
    """Compile one round-3 variant on a small cache (same specialisation as the timed call)."""
    from rerope import decode

    d, batch, page, rule, merge_block, splits = spec
    decode.PAGE_LOADS_RULE, decode.MERGE_SPLITS_BLOCK = rule, merge_block
    return spec, decode_once(d, batch, 1, splits, page)


def round3():
    """``python perf/tune_decode.py --round3``: writes ``$OUT/decode_round3.json``: the three
    ways of reading a paged cache's block table (``decode.PAGE_LOADS_RULE``) on pages smaller
    than the key tile against the contiguous layout (bit-identical outputs checked), and the
    merge's partials per step (``decode.MERGE_SPLITS_BLOCK``) at B = 1."""
    import rerope
    from benchmarks import decode as bench_decode as bd
    from rerope import decode

    started = time.perf_counter()
    result = {"meta": run_meta(window=WINDOW, dtype="bfloat16", Hq=HQ, Hkv=HKV,
                               configs={str(d): decode.launch_config(d) for d in (64, 128)})}
    save = saver(result, "decode_round3.json", started)

    specs = set()
    for d, pages in R3_PAGES.items():
        for batch, _ in R2_PAGED_SHAPES:
            specs.add((d, batch, None, None, 16, splits_for(batch, 2)))
            for page in pages:
                for rule in R3_RULES:
                    specs.add((d, batch, page, rule, 16, splits_for(batch, 2)))
        for merge_block in R3_MERGE:
            for splits in (16, 33):
                specs.add((d, 1, None, None, merge_block, splits))
    specs = sorted(specs, key=str)
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=mp.get_context("spawn")) as pool:
        compile_s = [secs for _, secs in pool.map(warm3, specs)]
    result["meta"]["warm"] = {"variants": len(specs), "wall_s": round(time.perf_counter() - started, 1),
                              "max_call_s": round(max(compile_s), 1)}
    print("warm", result["meta"]["warm"], flush=True)
    read, _ = bd.triton_read_bandwidth()
    result["meta"]["read_tb_s"] = read / 1e12
    bd.TIME_BUDGET_S, bd.MIN_REPS = 0.04, 5
    rows = result["rows"] = []
    row_of = timer(read)

    def timed(step, batch, n, d, **info):
        rows.append(row_of(step, batch, n, d, **info))

    for d in (64, 128):
        shapes = sorted(set(R2_PAGED_SHAPES) | {(1, 4096), (1, 32768)})
        for batch, n in shapes:
            torch.manual_seed(0)
            k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, HQ, 1, d, device="cuda", dtype=torch.bfloat16)
            if batch == 1:
                for merge_block in R3_MERGE:
                    decode.PAGE_LOADS_RULE, decode.MERGE_SPLITS_BLOCK = None, merge_block
                    timed(lambda: rerope.rerope_decode(q, k, v, WINDOW), batch, n, d,
                          impl="rerope_decode", merge_splits_block=merge_block,
                          num_splits=decode.default_num_splits(batch, HKV, HQ // HKV, 1, n))
            decode.MERGE_SPLITS_BLOCK = 16
            if (batch, n) in R2_PAGED_SHAPES:
                splits = splits_for(batch, 2)
                decode.PAGE_LOADS_RULE = None
                want = rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits)
                timed(lambda: rerope.rerope_decode(q, k, v, WINDOW, num_splits=splits), batch,
                      n, d, impl="rerope_decode", layout="contiguous")
                lengths = torch.full((batch,), n, dtype=torch.int32, device="cuda")
                for page in R3_PAGES[d]:
                    kp, vp, table = bd.paged_copy(k, v, page)
                    for rule in R3_RULES:
                        decode.PAGE_LOADS_RULE = rule
                        step = lambda: rerope.rerope_decode(q, kp, vp, WINDOW,
                                                            cache_seqlens=lengths,
                                                            num_splits=splits, block_table=table)
                        diff = (step().float() - want.float()).abs().max().item()
                        timed(step, batch, n, d, impl="rerope_decode", layout="paged",
                              page_size=page, page_loads=rule, max_abs_diff_vs_contiguous=diff)
                    del kp, vp, table
                decode.PAGE_LOADS_RULE = None
            save()
            del k, v, q
            torch.cuda.empty_cache()
    save()
    print("done", round(time.perf_counter() - started, 1), flush=True)


if __name__ == "__main__" and "--round3" in sys.argv:
    with torch.no_grad():
        round3()


# --- issue 19, session 5 (h19): the merge folded into the split kernel; TMA reads ---------------

S5_GRID = [(b, n) for b in (1, 8, 32) for n in (4096, 32768, 131072)]
S5_EXTRA = [(1, 32768, 4), (1, 32768, 8), (8, 32768, 8)]       # (B, context, Nq), D = 128
# rerope_decode variants: (decode.FUSED_MERGE, rows merged at once: decode.MERGE_ROWS and
# decode.FUSED_MERGE_ROWS both); "base" is the code before (commit e8b0be5, imported as the
# package kernels_base when the device script provides it). Run once (session 5, call 1:
# perf/runs/decode_h19s5_call1_h200.json); s5_diagnose was added after it and has not run.
S5_VARIANTS = {"two_launch": (False, 1), "fused_rows1": (True, 1), "fused_rows4": (True, 4)}
S5_SDPA = ("sdpa_cudnn", "sdpa_flash")
S5_READ = {64: 128, 128: 64}            # the TMA probe: head dim -> keys per tile
S5_BUDGET_S = 240                       # no new shape after this many seconds


def s5_impl(name):
    """``(rerope_decode, decode module)`` of a variant, its switches set."""
    if name == "base":
        import kernels_base
        from kernels_base import decode as base_decode
        return kernels_base.rerope_decode, base_decode
    import rerope
    from rerope import decode

    decode.FUSED_MERGE, rows = S5_VARIANTS[name]
    decode.MERGE_ROWS = decode.FUSED_MERGE_ROWS = rows
    return rerope.rerope_decode, decode


def s5_splits(batch, n, nq=1):
    from rerope import decode

    return decode.default_num_splits(batch, HKV, HQ // HKV, nq, n, 132)


def s5_warm(spec):
    """Compile one variant on a 4096-key cache (the timed calls' specialisation)."""
    name, d, batch, nq, splits = spec
    if name == "read":                  # the TMA probe's kernel (nq: TMA or not)
        from rerope import attention

        attention._ensure_scratch_allocator()
        k = torch.randn(8, 8192, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(8 * 2, device="cuda", dtype=torch.float32)
        _s5_read_kernel()[(8, 2)](k, k, out, 8192, 4096, HEAD_DIM=d, BLOCK_N=S5_READ[d],
                                  TMA=bool(nq), num_warps=4, num_stages=3)
        torch.cuda.synchronize()
        return spec
    decode_fn, _ = s5_impl(name)
    q = torch.randn(batch, HQ, nq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, 4096, d, device="cuda", dtype=torch.bfloat16)
    decode_fn(q, k, torch.randn_like(k), WINDOW, num_splits=splits)
    torch.cuda.synchronize()
    return spec


def _s5_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kv(K, V, Out, n_keys, chunk, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                TMA: tl.constexpr):
        """The decode kernel's reads without its softmax: one program per (row, chunk) of a
        ``(rows, n_keys, D)`` K and V, a 16-row product per tile as the decode kernel does
        (``q kᵀ`` then ``p v``, so the loads are pipelined the same way), TMA tensor
        descriptors or pointer loads; one number out per program."""
        row = tl.program_id(0).to(tl.int64)
        lo = tl.program_id(1) * chunk
        k_row, v_row = K + row * n_keys * HEAD_DIM, V + row * n_keys * HEAD_DIM
        offs_n, dims = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
        if TMA:
            k_desc = tl.make_tensor_descriptor(k_row, shape=[n_keys, HEAD_DIM],
                                               strides=[HEAD_DIM, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
            v_desc = tl.make_tensor_descriptor(v_row, shape=[n_keys, HEAD_DIM],
                                               strides=[HEAD_DIM, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
        q = tl.full([16, HEAD_DIM], 0.01, K.dtype.element_ty)
        acc = tl.zeros([16, HEAD_DIM], tl.float32)
        for start in range(lo, lo + chunk, BLOCK_N):
            if TMA:
                k = k_desc.load([start, 0])
                v = v_desc.load([start, 0])
            else:
                k = tl.load(k_row + (start + offs_n)[:, None] * HEAD_DIM + dims[None, :])
                v = tl.load(v_row + (start + offs_n)[:, None] * HEAD_DIM + dims[None, :])
            scores = tl.dot(q, tl.trans(k))
            acc = tl.dot(scores.to(v.dtype), v, acc)
        tl.store(Out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))
    return read_kv


def s5_read_probe(read_bytes_s, rows_out):
    """TMA against pointer loads in :func:`_s5_read_kernel`, B=32 x Hkv=8 rows of 128k keys
    (the B=32 128k decode shape, one program per row) and B=1 128k in 32 chunks per row."""
    from rerope import attention

    attention._ensure_scratch_allocator()
    kernel = _s5_read_kernel()
    for d, block_n in S5_READ.items():
        for rows, n, chunks in ((256, 131072, 1), (8, 131072, 32)):
            k = torch.randn(rows, n, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            outs = {}
            for tma in (False, True):
                for stages in (3,):
                    out = torch.empty(rows * chunks, device="cuda", dtype=torch.float32)
                    step = lambda: kernel[(rows, chunks)](k, v, out, n, n // chunks, HEAD_DIM=d,
                                                          BLOCK_N=block_n, TMA=tma, num_warps=4,
                                                          num_stages=stages)
                    try:
                        from benchmarks import decode as bench_decode as bd
                        us = bd.graph_us(step)
                        outs[tma, stages] = out.clone()
                        rows_out.append(dict(probe="read_kv", D=d, rows=rows, context=n,
                                             chunks=chunks, tma=tma, num_stages=stages, us=us,
                                             tb_s=2 * k.numel() * 2 / us / 1e6,
                                             of_read_bound=2 * k.numel() * 2 / read_bytes_s
                                             * 1e6 / us))
                    except Exception as error:      # report it and go on
                        rows_out.append(dict(probe="read_kv", D=d, rows=rows, tma=tma,
                                             num_stages=stages,
                                             error=f"{type(error).__name__}: {error}"[:300]))
                    print(rows_out[-1], flush=True)
            if (False, 3) in outs and (True, 3) in outs:
                rows_out[-1]["tma_equals_pointer"] = bool(torch.equal(outs[False, 3],
                                                                      outs[True, 3]))
            del k, v
            torch.cuda.empty_cache()


def s5_diagnose(q, k, v, repeats=10):
    """Where a fused output could differ from the two-launch one: the partials and
    log-sum-exps the two split kernels write (``torch.equal``), the merge kernel's output from
    the two-launch partials against the fused output, and ``repeats`` fused calls into
    NaN-filled buffers (a merge that read a partial before it was written shows as NaN or as
    a difference between repeats). Written after call 1, for the one shape whose fused output
    differed there (D=128, B=8, Nq=8, one row at a time); not run yet."""
    import torch.utils.deterministic as det

    outs, parts = {}, {}
    for key, name in (("two_launch", "two_launch"), ("fused", "fused_rows1")):
        _, dec = s5_impl(name)
        dec.rerope_decode(q, k, v, WINDOW)
        plan = dec._plan(q, k, v, WINDOW, None, None, 10000.0, None, None, True, None)
        part = torch.full(plan.part_shape, float("nan"), dtype=torch.float32, device="cuda")
        lse = torch.full(plan.part_shape[:-1], float("nan"), dtype=torch.float32, device="cuda")
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        counters = dec.merge_counters(q.device, plan.n_counters) if plan.fused else out
        lengths = plan.full_lengths
        plan.launches[0](q, k, v, lengths, lengths, part, lse, out, counters)
        if not plan.fused:
            plan.launches[1](part, lse, out)
        outs[key], parts[key] = out, (part, lse)
    torch.cuda.synchronize()
    found = dict(partials_equal=bool(torch.equal(parts["fused"][0], parts["two_launch"][0])),
                 lse_equal=bool(torch.equal(parts["fused"][1], parts["two_launch"][1])),
                 outputs_equal=bool(torch.equal(outs["fused"], outs["two_launch"])),
                 outputs_max_abs_diff=(outs["fused"].float() - outs["two_launch"].float())
                 .abs().max().item())
    fn, _ = s5_impl("fused_rows1")
    was = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True           # torch.empty: NaN
    try:
        runs = [fn(q, k, v, WINDOW) for _ in range(repeats)]
    finally:
        det.fill_uninitialized_memory = was[1]
        torch.use_deterministic_algorithms(was[0])
    torch.cuda.synchronize()
    found.update(repeats_equal=all(torch.equal(r, runs[0]) for r in runs),
                 repeats_finite=all(bool(torch.isfinite(r).all()) for r in runs),
                 repeat_equals_fused=bool(torch.equal(runs[0], outs["fused"])))
    return found


def round_s5():
    """``python perf/tune_decode.py --s5``: writes ``$OUT/decode_h19s5.json``.

    * the grid's (D, B, context) shapes, bf16, window 2048, Nq = 1 (and a few Nq = 4 / 8 at
      D=128): ``base`` (the code before), the two-launch path, the fused merge with 1 and 4
      rows per step, SDPA cuDNN and flash; two rounds, the second in reverse order; at B <= 8
      the split kernel alone (the two-launch path's first launch); every variant's output
      against the two-launch one (``torch.equal``) and the base (max |diff|);
    * the TMA probe (:func:`s5_read_probe`).
    """
    from benchmarks import decode as bench_decode as bd

    started = time.perf_counter()
    result = {"meta": run_meta(window=WINDOW, dtype="bfloat16", Hq=HQ, Hkv=HKV,
                               variants=S5_VARIANTS)}
    save = saver(result, "decode_h19s5.json", started)
    try:
        import kernels_base  # noqa: F401
        names = ["base", *S5_VARIANTS]
    except ImportError:
        names = list(S5_VARIANTS)
    shapes = [(d, b, n, 1) for d in (64, 128) for b, n in S5_GRID]
    shapes += [(128, b, n, nq) for b, n, nq in S5_EXTRA]
    specs = sorted({(name, d, b, nq, s5_splits(b, n, nq)) for d, b, n, nq in shapes
                    for name in names}, key=str)
    specs += [("read", d, 0, tma, 0) for d in S5_READ for tma in (0, 1)]
    with cf.ProcessPoolExecutor(max_workers=15, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(s5_warm, specs))
    result["meta"]["warm"] = {"variants": len(specs),
                              "wall_s": round(time.perf_counter() - started, 1)}
    print("warm", result["meta"]["warm"], flush=True)
    read, timed = start_timing(result, 0.03)
    rows = result["rows"] = []
    checks = result["checks"] = []
    # a first capture on the default capture stream: its counters are allocated (and zeroed in
    # that graph) here, not in the first timed graph
    q0 = torch.randn(1, HQ, 1, 64, device="cuda", dtype=torch.bfloat16)
    k0 = torch.randn(1, HKV, 4096, 64, device="cuda", dtype=torch.bfloat16)
    fn, _ = s5_impl("fused_rows1")
    bd.graph_us(lambda: fn(q0, k0, k0, WINDOW))
    probe = result["read_probe"] = []
    for index, (d, batch, n, nq) in enumerate(shapes):
        if index == 2 * len(S5_GRID):       # the grid done: the TMA probe, then the extras
            try:
                s5_read_probe(read, probe)
            except Exception as error:
                probe.append(dict(error=f"{type(error).__name__}: {error}"[:300]))
            save()
        if time.perf_counter() - started > S5_BUDGET_S:
            result["meta"]["stopped_early"] = [d, batch, n, nq]
            break
        torch.manual_seed(0)
        k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, nq, d, device="cuda", dtype=torch.bfloat16)
        info = dict(Nq=nq, num_splits=s5_splits(batch, n, nq))
        outs = {}
        for name in names:
            fn, _ = s5_impl(name)
            outs[name] = fn(q, k, v, WINDOW)
        torch.cuda.synchronize()
        for name in names:
            checks.append(dict(D=d, B=batch, context=n, impl=name, **info,
                               equal_two_launch=bool(torch.equal(outs[name],
                                                                 outs["two_launch"])),
                               max_abs_diff_base=(outs[name].float() - outs[names[0]].float())
                               .abs().max().item()))
        _, new_decode = s5_impl("two_launch")
        print("checks", checks[-len(names):], "counters zero",
              all(not bool(c.any()) for c in new_decode._COUNTERS.values()), flush=True)
        if nq > 1:
            result.setdefault("diagnosis", []).append(dict(D=d, B=batch, context=n, Nq=nq,
                                                           **s5_diagnose(q, k, v)))
            print("diagnosis", result["diagnosis"][-1], flush=True)
        order = list(S5_SDPA) + names
        for round_ in (0, 1):
            for name in (order if round_ == 0 else order[::-1]):
                if name in S5_SDPA:
                    step = bd.build_step(name, q, k, v, WINDOW, None)
                else:
                    fn, _ = s5_impl(name)
                    step = lambda: fn(q, k, v, WINDOW)
                try:
                    rows.append(timed(step, batch, n, d, impl=name, round=round_, **info))
                except Exception as error:
                    rows.append(dict(D=d, B=batch, context=n, impl=name, round=round_,
                                     error=f"{type(error).__name__}: {error}"[:300], **info))
                    print(rows[-1], flush=True)
            if batch <= 8 and info["num_splits"] > 1:   # the split kernel alone
                _, dec = s5_impl("two_launch")
                plan = dec._plan(q, k, v, WINDOW, None, None, 10000.0, None, None, True, None)
                if plan.launches:
                    part = torch.empty(plan.part_shape, dtype=torch.float32, device="cuda")
                    lse = torch.empty(plan.part_shape[:-1], dtype=torch.float32, device="cuda")
                    split, lengths = plan.launches[0], plan.full_lengths
                    rows.append(timed(lambda: split(q, k, v, lengths, lengths, part, lse, part,
                                                    part), batch, n, d, impl="split_only",
                                      round=round_, **info))
        save()
        del k, v, q, outs
        torch.cuda.empty_cache()
    save()
    print("done", round(time.perf_counter() - started, 1), flush=True)


if __name__ == "__main__" and "--s5" in sys.argv:
    with torch.no_grad():
        round_s5()


# --- session 7 (issue 19): TMA loads of K and V, the merge as a dependent launch, registers ------
# Run once (call 1: perf/runs/decode_h19s7_call1_h200.json) on commit 45ac5d5, where TMA was
# used for every contiguous split (no TMA_MIN_KEYS yet) and decode.PDL_MERGE launched the merge
# kernel as a programmatic dependent launch (griddepcontrol; removed since: it lost). With the
# code since, "auto" follows decode.TMA_MIN_KEYS and the *_pdl variants equal their base.

# name -> (rerope.configs.TMA, decode.PDL_MERGE, launch-config changes, programs per SM)
S7_VARIANTS = {
    "ptr": ("0", False, {}, 2),                  # the code before: pointer loads, plain merge
    "ptr_pdl": ("0", True, {}, 2),
    "tma": ("auto", False, {}, 2),
    "tma_pdl": ("auto", True, {}, 2),
    "tma_pdl_s4": ("auto", True, {"num_stages": 4}, 2),
    "tma_pdl_r168": ("auto", True, {"maxnreg": 168}, 3),   # 3 programs per SM resident
    "tma_pdl_a1": ("auto", True, {"ANGLES": 1}, 2),        # no BLOCK_N x D/2 table held
}
S7_SDPA = ("sdpa_cudnn", "sdpa_flash")
S7_GRID = [(b, n) for b in (1, 8, 32) for n in (4096, 32768, 131072)]
S7_BUDGET_S = 200                       # no new shape after this many seconds


def _s7_base_configs():
    from rerope import decode

    return {d: dict(decode.launch_config(d)) for d in (64, 128)}


S7_BASE = None


def s7_set(name, d):
    """Switch the decode module to variant ``name`` for head dim ``d``; returns its splits
    rule's programs per SM."""
    global S7_BASE
    from rerope import configs, decode

    if S7_BASE is None:
        S7_BASE = _s7_base_configs()
    tma, pdl, changes, per_sm = S7_VARIANTS[name]
    configs.TMA = tma
    decode.TMA_HEAD_DIMS = (64, 128)
    decode.PDL_MERGE = pdl
    decode.PROGRAMS_PER_SM = per_sm
    decode.HEAD_DIM_CONFIGS[d] = {**S7_BASE[d], **changes}
    return per_sm


def s7_splits(name, batch, n):
    from rerope import decode

    per_sm = S7_VARIANTS[name][3]
    saved = decode.PROGRAMS_PER_SM
    decode.PROGRAMS_PER_SM = per_sm
    try:
        return decode.default_num_splits(batch, HKV, HQ // HKV, 1, n, 132)
    finally:
        decode.PROGRAMS_PER_SM = saved


def s7_warm(spec):
    """Compile one variant on a 4096-key cache (the timed calls' specialisation)."""
    import rerope

    name, d, batch, splits = spec
    s7_set(name, d)
    q = torch.randn(batch, HQ, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, 4096, d, device="cuda", dtype=torch.bfloat16)
    started = time.perf_counter()
    try:
        rerope.rerope_decode(q, k, torch.randn_like(k), WINDOW, num_splits=splits)
        torch.cuda.synchronize()
        error = None
    except Exception as exc:           # reported; the timing loop records it per shape
        error = f"{type(exc).__name__}: {exc}"[:300]
    return spec, time.perf_counter() - started, error


def round_s7():
    """``python perf/tune_decode.py --s7``: writes ``$OUT/decode_h19s7.json``.

    The main grid's (D, B, context) shapes, bf16, window 2048, Nq = 1, a full rotated cache:
    every variant of :data:`S7_VARIANTS` and SDPA cuDNN / flash, two rounds (the second in
    reverse order), each variant's output against ``ptr`` (the code before) bit for bit.
    """
    import rerope
    from benchmarks import decode as bench_decode as bd
    from rerope import decode

    started = time.perf_counter()
    result = {"meta": run_meta(window=WINDOW, dtype="bfloat16", Hq=HQ, Hkv=HKV,
                               variants={k: list(v) for k, v in S7_VARIANTS.items()},
                               base_configs={str(d): c for d, c in _s7_base_configs().items()},
                               pdl_available=getattr(decode, "pdl_merge", bool)())}
    save = saver(result, "decode_h19s7.json", started)
    names = list(S7_VARIANTS)
    specs = sorted({(name, d, b, s7_splits(name, b, n)) for name in names for d in (64, 128)
                    for b, n in S7_GRID}, key=str)
    errors = {}
    with cf.ProcessPoolExecutor(max_workers=12, mp_context=mp.get_context("spawn")) as pool:
        for spec, secs, error in pool.map(s7_warm, specs):
            if error:
                errors[str(spec)] = error
    result["meta"]["warm"] = {"variants": len(specs),
                              "wall_s": round(time.perf_counter() - started, 1),
                              "errors": errors}
    print("warm", result["meta"]["warm"], flush=True)
    read, timed = start_timing(result, 0.03, started)
    rows = result["rows"] = []
    checks = result["checks"] = []
    for d in (128, 64):
        for batch, n in S7_GRID:
            if time.perf_counter() - started > S7_BUDGET_S:
                result["meta"]["stopped_early"] = [d, batch, n]
                break
            torch.manual_seed(0)
            k = torch.randn(batch, HKV, n, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, HQ, 1, d, device="cuda", dtype=torch.bfloat16)
            outs, info = {}, {}
            for name in names:
                s7_set(name, d)
                try:
                    outs[name] = rerope.rerope_decode(q, k, v, WINDOW)
                    plan = decode._plan(q, k, v, WINDOW, None, None, 10000.0, None, None, True,
                                        None)
                    info[name] = dict(num_splits=plan.num_splits,
                                      tma=plan.split.constexprs.get("TMA"),
                                      pdl=plan.split.constexprs.get("PDL"))
                except Exception as error:
                    info[name] = dict(error=f"{type(error).__name__}: {error}"[:300])
            torch.cuda.synchronize()
            for name in names:
                row = dict(D=d, B=batch, context=n, impl=name, **info[name])
                if name in outs and "ptr" in outs:
                    row.update(equal_ptr=bool(torch.equal(outs[name], outs["ptr"])),
                               max_abs_diff_ptr=(outs[name].float() - outs["ptr"].float())
                               .abs().max().item())
                checks.append(row)
            print("checks", checks[-len(names):], flush=True)
            order = list(S7_SDPA) + [name for name in names if name in outs]
            for round_ in (0, 1):
                for name in (order if round_ == 0 else order[::-1]):
                    if name in S7_SDPA:
                        step = bd.build_step(name, q, k, v, WINDOW, None)
                        extra = {}
                    else:
                        s7_set(name, d)
                        step = lambda: rerope.rerope_decode(q, k, v, WINDOW)
                        extra = info[name]
                    try:
                        rows.append(timed(step, batch, n, d, impl=name, round=round_, **extra))
                    except Exception as error:
                        rows.append(dict(D=d, B=batch, context=n, impl=name, round=round_,
                                         error=f"{type(error).__name__}: {error}"[:300]))
                        print(rows[-1], flush=True)
            save()
            del k, v, q, outs
            torch.cuda.empty_cache()
    s7_summary(result)
    save()
    print("done", round(time.perf_counter() - started, 1), flush=True)


def s7_summary(result):
    """Per shape: each variant's mean time over both rounds, its ratio to ``ptr`` and to the
    faster SDPA; per variant and head dim: the geometric means. Printed and kept in
    ``result["summary"]``."""
    import math

    times = {}
    for row in result.get("rows", []):
        if row.get("us"):
            times.setdefault((row["D"], row["B"], row["context"]), {}).setdefault(
                row["impl"], []).append(row["us"])
    summary, logs = [], {}
    for (d, b, n), impls in sorted(times.items()):
        mean = {k: sum(v) / len(v) for k, v in impls.items()}
        sdpa = min(mean.get(k, math.inf) for k in S7_SDPA)
        line = dict(D=d, B=b, context=n, sdpa_best_us=sdpa, us={}, x_ptr={}, x_sdpa={})
        for name in S7_VARIANTS:
            if name in mean:
                line["us"][name] = round(mean[name], 2)
                line["x_sdpa"][name] = round(sdpa / mean[name], 3)
                if "ptr" in mean:
                    line["x_ptr"][name] = round(mean["ptr"] / mean[name], 3)
                    logs.setdefault((d, name), []).append(math.log(mean["ptr"] / mean[name]))
        summary.append(line)
        print(f"summary D={d} B={b} n={n} sdpa {sdpa:.1f} | "
              + " ".join(f"{k} {v:.1f} ({line['x_sdpa'][k]:.2f})" for k, v in line["us"].items()),
              flush=True)
    result["summary"] = summary
    result["geomean_x_ptr"] = {f"D{d} {name}": round(math.exp(sum(v) / len(v)), 3)
                               for (d, name), v in sorted(logs.items())}
    print("geomean x ptr", result["geomean_x_ptr"], flush=True)


if __name__ == "__main__" and "--s7" in sys.argv:
    with torch.no_grad():
        round_s7()
