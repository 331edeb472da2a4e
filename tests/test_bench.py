"""CPU tests of the benchmark module: its pure helpers, the Flex two-pass math, and the no-GPU exit.

The timing itself needs a GPU (``python -m benchmarks.attention``); nothing here does.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]   # on sys.path first (pyproject.toml)

try:
    from benchmarks import attention as bench
except Exception as error:  # the package is being written; nothing to test until it imports
    pytest.skip(f"benchmarks.attention does not import: {error!r}", allow_module_level=True)


# --- FLOP counts, by hand -----------------------------------------------------------------

def test_attention_flops_counts_plain_attention():
    # 4·B·H·N²·D = 4 · 1 · 32 · 8192² · 64 = 2^2 · 2^5 · 2^26 · 2^6 = 2^39
    assert bench.attention_flops(1, 32, 8192, 64, causal=False, mode="fwd") == 2.0 ** 39
    assert bench.attention_flops(1, 32, 8192, 64, causal=True, mode="fwd") == 2.0 ** 38
    assert bench.attention_flops(1, 32, 8192, 64, causal=True, mode="fwd+bwd") == 3.5 * 2.0 ** 38
    # B=2 H=3 N=10 D=5, non-causal fwd+bwd: 4 · 2 · 3 · 100 · 5 · 3.5 = 42000
    assert bench.attention_flops(2, 3, 10, 5, causal=False, mode="fwd+bwd") == 42000.0


def test_attention_flops_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        bench.attention_flops(1, 1, 16, 16, causal=True, mode="bwd")


def test_tflops_of_a_row_use_the_plain_attention_count():
    shape = bench.Shape(B=1, H=32, N=8192, D=64, window=2048, dtype="float16", causal=True)
    # 2^38 FLOPs in 2^38 / 1e12 ms is 1e15 FLOP/s
    row = bench.make_row("rerope", "fwd", shape, ms=2.0 ** 38 / 1e12, peak_bytes=3e9)
    assert row["tflops"] == pytest.approx(1000.0)
    assert row["peak_gb"] == pytest.approx(3.0)
    assert set(bench.ROW_KEYS) == set(row)
    assert bench.make_row("rope_inputs", "fwd", shape, ms=1.0, peak_bytes=1e9)["tflops"] is None
    skipped = bench.make_row("naive", "fwd", shape, skipped="too big")
    assert skipped["ms"] is None and skipped["tflops"] is None and skipped["skipped"] == "too big"


def test_naive_memory_estimate_fits_8k_but_not_16k_on_an_h200():
    h200_bytes = 140e9
    at_8k = bench.naive_peak_bytes(1, 32, 8192, 64, element_size=2)
    assert 41e9 < at_8k < h200_bytes                       # measured: 41 GB peak, and it ran
    assert bench.naive_peak_bytes(1, 32, 16384, 64, element_size=2) > h200_bytes


# --- results file, summary, table, plot ---------------------------------------------------

def _row(impl, ms, N=8192, mode="fwd+bwd", causal=True, D=64, dtype="float16", **extra):
    row = dict(impl=impl, mode=mode, causal=causal, B=1, H=32, N=N, D=D, window=2048, dtype=dtype,
               ms=ms, tflops=None if ms is None else 1.0 / ms, peak_gb=None if ms is None else 1.0)
    row.update(extra)
    return row


def test_load_results_reads_a_hand_written_file(tmp_path):
    rows = [_row("rerope", 2.5), _row("naive", None, skipped="naive needs ~206 GB, 140 GB free")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": {"gpu": "H200", "torch": "2.11.0", "triton": "3.6.0",
                                         "date": "2026-11-29T12:00:00+00:00"}, "rows": rows}))
    assert bench.load_results(path) == rows


def test_write_then_load_round_trips(tmp_path):
    rows = [_row("sdpa_cudnn", 1.25), _row("flex_two_pass", 4.0, causal=False)]
    path = tmp_path / "out.json"
    bench.write_results(path, rows, {"gpu": "test"})
    assert bench.load_results(path) == rows
    assert json.loads(path.read_text())["meta"] == {"gpu": "test"}
    assert list(tmp_path.iterdir()) == [path]              # no temporary file left behind


def test_load_results_rejects_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match="rows"):
        bench.load_results(path)


def test_summary_gives_speedups_of_rerope_per_shape():
    rows = [_row("rerope", 2.0), _row("sdpa_cudnn", 1.0), _row("flex_two_pass", 4.0),
            _row("rerope", 8.0, N=16384), _row("sdpa_cudnn", 4.0, N=16384),
            _row("flex_two_pass", None, N=16384, skipped="out of memory"),
            _row("sdpa_cudnn", 1.0, N=1024)]                  # no rerope time: no summary row
    result = bench.summary(rows)
    assert [r["N"] for r in result] == [8192, 16384]
    at_8k, at_16k = result
    assert at_8k["rerope_ms"] == 2.0
    assert at_8k["speedup_vs_sdpa_cudnn"] == pytest.approx(0.5)      # half of cuDNN's speed
    assert at_8k["speedup_vs_flex_two_pass"] == pytest.approx(2.0)   # twice the Flex two-pass
    assert at_16k["speedup_vs_sdpa_cudnn"] == pytest.approx(0.5)
    assert at_16k["flex_two_pass_ms"] is None and at_16k["speedup_vs_flex_two_pass"] is None


def test_summary_keeps_shapes_apart_and_filters():
    rows = [_row("rerope", 2.0), _row("sdpa_cudnn", 1.0),
            _row("rerope", 3.0, mode="fwd"), _row("sdpa_cudnn", 6.0, mode="fwd"),
            _row("rerope", 5.0, dtype="bfloat16"), _row("sdpa_cudnn", 5.0, dtype="bfloat16")]
    assert len(bench.summary(rows)) == 3
    (fwd,) = bench.summary(rows, baselines=("sdpa_cudnn",), mode="fwd", N=8192, D=64)
    assert fwd["speedup_vs_sdpa_cudnn"] == pytest.approx(2.0)
    assert "flex_two_pass_ms" not in fwd
    (bf16,) = bench.summary(rows, dtype="bfloat16")
    assert bf16["speedup_vs_sdpa_cudnn"] == pytest.approx(1.0)
    assert bench.summary(rows, D=128) == []


def test_format_table_has_one_line_per_row():
    rows = [_row("rerope", 2.0), _row("naive", None, skipped="out of memory")]
    lines = bench.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert "rerope" in lines[2] and "2.000" in lines[2]
    assert "naive" in lines[3] and "out of memory" in lines[3]


def test_plot_tflops_draws_one_line_per_impl():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [_row(impl, ms, N=n) for impl in ("rerope", "sdpa_cudnn")
            for n, ms in ((1024, 1.0), (2048, 3.0))]
    rows += [_row("naive", None, N=2048, skipped="out of memory"),
             _row("rerope", 1.0, N=2048, D=128)]
    ax = bench.plot_tflops(rows, D=64)
    assert sorted(line.get_label() for line in ax.get_lines()) == ["rerope", "sdpa_cudnn"]
    assert all(len(line.get_xdata()) == 2 for line in ax.get_lines())
    plt.close(ax.figure)


# --- command line -------------------------------------------------------------------------

def test_parse_args_defaults_are_the_full_grid():
    args = bench.parse_args([])
    assert args.n == [1024, 2048, 4096, 8192, 16384, 32768]
    assert args.d == [64, 128] and args.dtype == ["float16", "bfloat16"]
    assert args.causal == [True, False] and args.mode == ["fwd", "fwd+bwd"]
    assert args.impl == list(bench.IMPLS)
    assert (args.batch, args.heads, args.window, args.out) == (1, 32, 2048, "bench.json")


def test_parse_args_restricts_the_grid():
    args = bench.parse_args(["--n", "8192", "--d", "64", "--dtype", "float16", "--causal", "false",
                             "--impl", "rerope,sdpa_cudnn", "--mode", "fwd", "--heads", "8",
                             "--reps", "3", "--out", "x.json"])
    assert (args.n, args.d, args.dtype, args.causal) == ([8192], [64], ["float16"], [False])
    assert (args.impl, args.mode, args.heads, args.reps, args.out) == (
        ["rerope", "sdpa_cudnn"], ["fwd"], 8, 3, "x.json")


def test_parse_args_quick_is_small_but_flags_still_win():
    quick = bench.parse_args(["--quick"])
    assert len(quick.n) * len(quick.d) * len(quick.dtype) < 6
    assert max(quick.n) > quick.window                      # reaches beyond the window
    assert bench.parse_args(["--quick", "--n", "512"]).n == [512]


@pytest.mark.parametrize("argv", [["--impl", "flash"], ["--mode", "bwd"], ["--dtype", "float8"],
                                  ["--causal", "maybe"], ["--window", "0"]])
def test_parse_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2


def test_without_a_gpu_the_module_exits_1_with_one_clear_line(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), str(ROOT)]))
    out = tmp_path / "never.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.attention", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stderr
    assert not out.exists()



@pytest.mark.parametrize("module", ["benchmarks.attention", "benchmarks.decode", "benchmarks.hf",
                                    "benchmarks.host", "benchmarks.preturn",
                                    "benchmarks.preturn_bwd", "benchmarks.short_n",
                                    "benchmarks.self_extend", "benchmarks.sweep_bwd128",
                                    "benchmarks.merge", "benchmarks.tp", "benchmarks.varlen",
                                    "benchmarks.compile_block", "benchmarks.compile_graph",
                                    "benchmarks.hf_host", "benchmarks.hf_profile",
                                    "extrapolation.self_extend"])
def test_every_benchmark_runs_from_the_root_with_the_source_root_on_the_path(module):
    """``python -m MODULE --help`` with ``PYTHONPATH=kernels:.``, as the docstrings say: no
    sys.path edits in the scripts, every import resolves."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower() or module in done.stdout


# --- the shared harness and the merge (no GPU) --------------------------------------------

def test_harness_repetitions_fill_the_budget_within_bounds():
    from benchmarks import harness
    assert harness.repetitions(0.01, 0.5, 3, 20) == 20       # 50 fit, capped at 20
    assert harness.repetitions(0.1, 0.5, 3, 20) == 5
    assert harness.repetitions(10.0, 0.5, 3, 20) == 3        # a slow step still runs 3 times
    assert harness.repetitions(0.0, 0.5, 3, 20) == 20        # no division by zero


def test_harness_environment_names_the_versions_and_the_date():
    from benchmarks import harness
    env = harness.environment("cpu")
    assert env["gpu"] == "cpu (interpreter)" and env["torch"] == torch.__version__
    assert set(env) == {"gpu", "torch", "triton", "cuda", "date"}
    assert len(harness.environment("cpu", day=True)["date"]) == len("2026-12-04")


def test_harness_write_makes_the_folder_and_keeps_extra_keys(tmp_path):
    from benchmarks import harness
    path = tmp_path / "new" / "run.json"
    harness.write_results(path, [{"impl": "a"}], {"gpu": "test"}, sweep=[{"impl": "b"}])
    assert harness.read_results(path) == {"meta": {"gpu": "test"}, "rows": [{"impl": "a"}],
                                          "sweep": [{"impl": "b"}]}
    assert harness.select_rows([{"impl": "a", "N": 1}, {"impl": "b", "N": 1}], impl="a",
                               N=None) == [{"impl": "a", "N": 1}]


def test_merge_keeps_every_run_and_lets_a_later_row_replace_an_earlier_one(tmp_path):
    from benchmarks import merge
    old, new, out = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "out.json"
    meta = {"gpu": "H200", "torch": "2.11", "triton": "3.6"}
    bench.write_results(old, [_row("rerope", 2.0), _row("sdpa_cudnn", 1.0)],
                        {**meta, "date": "1", "args": {"n": [8192]}, "elapsed_s": 5})
    bench.write_results(new, [_row("rerope", 1.5)],
                        {**meta, "date": "2", "args": {"n": [8192]}, "elapsed_s": 3})
    assert merge.merge(out, old, new) == 2
    merged = bench.read_results(out)
    assert [r["ms"] for r in bench.select_rows(merged["rows"], impl="rerope")] == [1.5]
    assert [run["date"] for run in merged["meta"]["runs"]] == ["1", "2"]
    assert merged["meta"]["date"] == "2"
    assert merge.merge(out, out, new) == 2                  # a merge merges again
    assert len(bench.read_results(out)["meta"]["runs"]) == 3


def test_run_benchmark_records_every_case_and_skips_failures(tmp_path, monkeypatch, capsys):
    """The driver loop with the GPU parts replaced: rows, skips, progress, table and JSON."""
    def fake_measure(impl, mode, shape, reps):
        if impl == "flex_two_pass":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
        if impl == "sdpa_cudnn":
            raise RuntimeError("No available kernel.\nmore detail")
        return 2.0, 3e9, 0.1

    monkeypatch.setattr(bench, "measure_case", fake_measure)
    monkeypatch.setattr(bench, "naive_skip_reason",
                        lambda shape: "too big" if shape.N > 1024 else None)
    monkeypatch.setattr(bench, "check_against_reference",
                        lambda impls, dtype, D, causal: [f"check {impls} causal={causal} ok"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU")
    out = tmp_path / "bench.json"
    args = bench.parse_args(["--n", "1024,2048", "--d", "64", "--dtype", "bfloat16",
                             "--causal", "true", "--out", str(out)])
    rows = bench.run_benchmark(args)

    assert len(rows) == 2 * len(bench.IMPLS) * len(bench.MODES)
    assert bench.load_results(out) == rows
    by_case = {(r["impl"], r["mode"], r["N"]): r for r in rows}
    ours = by_case["rerope", "fwd+bwd", 2048]
    assert ours["ms"] == 2.0 and ours["dtype"] == "bfloat16" and ours["causal"] is True
    assert ours["tflops"] == pytest.approx(
        bench.attention_flops(1, 32, 2048, 64, True, "fwd+bwd") / 2e-3 / 1e12)
    assert by_case["naive", "fwd", 1024]["ms"] == 2.0
    assert by_case["naive", "fwd", 2048]["skipped"] == "too big"
    assert by_case["flex_two_pass", "fwd", 1024]["skipped"] == "out of memory"
    cudnn_error = by_case["sdpa_cudnn", "fwd", 1024]["skipped"]
    assert cudnn_error == "error: RuntimeError: No available kernel."       # first line only
    assert by_case["rope_inputs", "fwd", 1024]["tflops"] is None

    meta = json.loads(out.read_text())["meta"]
    assert {"gpu", "torch", "triton", "date"} <= set(meta) and meta["gpu"] == "Fake GPU"
    printed = capsys.readouterr()
    assert printed.out.count("skipped:") == 2 + 2 * 2 + 2 * 2     # naive at 2048; flex; cuDNN
    assert "elapsed" in printed.out
    assert printed.err.count("Traceback") == 1                 # once per (impl, kind of error)

# --- the Flex two-pass competitor: its math, on CPU ---------------------------------------

def _attention_with_lse(q, k, v, allowed):
    """Masked softmax attention and its natural-log LSE, the slow way (float64)."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return probs @ v, lse


def _naive_rerope(q1, q2, k1, k2, v, window, causal):
    n = q1.shape[-2]
    idx = torch.arange(n)
    in_window = (idx[:, None] - idx[None, :]).abs() < window
    scores = torch.where(in_window, q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2))
    scores = scores.double() / math.sqrt(q1.shape[-1])
    if causal:
        scores = scores.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


def _five_tensors(n, d=16, heads=2, dtype=torch.float64, requires_grad=False):
    torch.manual_seed(0)
    return [torch.randn(1, heads, n, d, dtype=dtype, requires_grad=requires_grad) for _ in range(5)]


@pytest.mark.parametrize("causal, window", [(True, 12), (False, 30)])
def test_merge_of_two_disjoint_passes_is_attention_over_their_union(causal, window):
    n = 48
    q, k, v = _five_tensors(n)[:3]
    idx = torch.arange(n)
    allowed = idx[None, :] <= idx[:, None] if causal else torch.ones(n, n, dtype=torch.bool)
    near = (idx[:, None] - idx[None, :]).abs() < window
    out_near, lse_near = _attention_with_lse(q, k, v, allowed & near)
    out_far, lse_far = _attention_with_lse(q, k, v, allowed & ~near)
    assert torch.isneginf(lse_far).any()      # rows with no far key (causal: first; else middle)
    merged = bench.merge_attention_passes(out_near, lse_near, out_far, lse_far)
    expected, _ = _attention_with_lse(q, k, v, allowed)
    torch.testing.assert_close(merged, expected)


def test_merge_gradients_have_no_nan_where_a_pass_is_empty():
    q, k, v, q_far, k_far = _five_tensors(32, requires_grad=True)
    idx = torch.arange(32)
    causal = idx[None, :] <= idx[:, None]
    near = (idx[:, None] - idx[None, :]).abs() < 8
    out_near, lse_near = _attention_with_lse(q, k, v, causal & near)
    out_far, lse_far = _attention_with_lse(q_far, k_far, v, causal & ~near)
    merged = bench.merge_attention_passes(out_near, lse_near, out_far, lse_far)
    grads = torch.autograd.grad(merged.sum(), [q, k, v, q_far, k_far])
    assert all(torch.isfinite(g).all() for g in grads)
    expected = _naive_rerope(q, q_far, k, k_far, v, 8, causal=True)
    torch.testing.assert_close(merged, expected)
    expected_grads = torch.autograd.grad(expected.sum(), [q, k, v, q_far, k_far])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_merge_of_two_empty_passes_is_zero_not_nan():
    out = torch.randn(1, 1, 4, 8)
    lse = torch.full((1, 1, 4), float("-inf"))
    merged = bench.merge_attention_passes(0 * out, lse, 0 * out, lse)
    assert torch.equal(merged, torch.zeros_like(out))


@pytest.mark.parametrize("n, window, causal",
                         [(256, 40, True), (256, 40, False), (256, 300, False)])
def test_flex_two_pass_matches_naive_rerope_on_cpu(n, window, causal):
    """Unfused FlexAttention on CPU, forward only: checks the masks and that the LSE is natural-log.

    The last case has no key outside the window: the second pass is empty in every row."""
    q1, q2, k1, k2, v = _five_tensors(n, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # "flex_attention called without torch.compile"
        try:
            out = bench.flex_two_pass_rerope(q1, q2, k1, k2, v, window, causal=causal,
                                             compiled=False)
        except (NotImplementedError, RuntimeError) as error:
            pytest.skip(f"FlexAttention does not run on this CPU build: {error}")
    expected = _naive_rerope(q1, q2, k1, k2, v, window, causal).float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


# --- the decode benchmark's targets ----------------------------------------------------------


def test_bench_targets_keep_layouts_head_dims_and_queries_apart():
    from benchmarks import decode as bench_decode

    def row(impl, us, **kw):
        return bench_decode.make_row(impl, 8, 2048, 32768, us, None, 100.0, **kw)

    rows = [row("rerope_decode", 200.0, D=64), row("sdpa_cudnn", 150.0, D=64),
            row("sdpa_flash", 180.0, D=64), row("rerope_decode", 250.0, D=64, page_size=16,
                                                 layout="paged"),
            row("rerope_decode", 400.0, D=128), row("sdpa_cudnn", 300.0, D=128),
            row("rerope_decode", 210.0, D=64, Nq=4), row("sdpa_cudnn", 630.0, D=64, Nq=4),
            row("rerope_decode", 190.0, D=64, rotated=False)]
    (plain,) = bench_decode.targets(rows, D=64)
    assert plain["us"] == 200.0 and plain["vs_best_sdpa"] == 150.0 / 200.0
    (paged,) = bench_decode.targets(rows, D=64, layout="paged")
    assert paged["page_size"] == 16 and paged["vs_contiguous"] == 200.0 / 250.0
    (spec,) = bench_decode.targets(rows, D=64, Nq=4)
    assert spec["vs_best_sdpa"] == 3.0
    (big,) = bench_decode.targets(rows, D=128)
    assert big["hbm_fraction"] == 100.0 / 400.0
