"""``rerope.rerope_decode``: split-KV decoding against the float64 oracle, and its bad
input.

CPU (Triton's interpreter, 16-key tiles): ``Nq`` 1, 2, 5 over caches of 1, 17, 100 and
300 slots, ``cache_seqlens`` different per row (1 and ``Nmax`` among them), GQA groups
1, 2 and 4, rotated and raw caches, Leaky ReRoPE and log-n, windows below and above the
cache length, ``num_splits`` 1, 3 and more splits than key tiles. Every slot at or past
a row's length is NaN (a kernel that reads one returns NaN), and every buffer the
launcher allocates starts as NaN (``poisoned_empty``: an output element never written
shows). The oracle is ``reference.rerope_from_relative_positions`` in float64, per batch
row on the valid keys only.

A decode step must equal the matching rows of a prefill (``rerope.rerope`` and the
reference).

GPU (``-m gpu``, skipped without CUDA): the benchmark shapes at 128k keys against a
float32 reference computed per batch row and KV-head group; out-of-range
``cache_seqlens`` give NaN rows; a CUDA-graph replay with lengths updated in place
equals eager calls.

Paged caches (``block_table``, FlashAttention's layout): the same data scattered into random,
non-monotone pages of a pool ``(num_blocks, block_size, Hkv, D)`` must give the contiguous
call's output; unused pages and slots are NaN, table entries past a row's length point at NaN
pages or out of the pool; ``-m gpu``: 32k-key caches in pages, a CUDA graph over a changing
block table.
"""

from dataclasses import asdict, dataclass

import pytest
import torch

import rerope
from rerope import decode, reference, rope
from rerope_testing import (close_problems, cross_compile, describe, kernel_device,
                            poisoned_empty, randn, results_problems, tolerance,
                            true_float32)

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


@dataclass(frozen=True)
class DecodeCase:
    n_max: int
    lengths: tuple
    n_queries: int
    window: int
    hq: int = 2
    hkv: int = 1
    d: int = 32
    dtype: torch.dtype = F32
    rotated: bool = True
    leaky: float = None
    logn_len: float = None
    num_splits: int = None
    sm_scale: float = None
    layout: str = "contiguous"

    def id(self):
        parts = [f"N{self.n_max}", "L" + "-".join(map(str, self.lengths)), f"q{self.n_queries}",
                 f"w{self.window}", f"H{self.hq}kv{self.hkv}", f"D{self.d}",
                 str(self.dtype).replace("torch.", ""), "rot" if self.rotated else "raw"]
        for name in ("leaky", "logn_len", "num_splits", "sm_scale"):
            if getattr(self, name) is not None:
                parts.append(f"{name}{getattr(self, name):g}")
        if self.layout != "contiguous":
            parts.append(self.layout)
        return "-".join(parts)


CASES = [
    # a cache of one key: one query, window 1 (only the diagonal) and beyond the cache
    DecodeCase(1, (1,), 1, 1, hq=1),
    DecodeCase(1, (1, 1), 1, 4, rotated=False, dtype=F16),
    # 17 slots (one full 16-key tile and one key): lengths 17, 1, 9
    DecodeCase(17, (17, 1, 9), 1, 5, hq=4, hkv=2),
    DecodeCase(17, (2, 17), 2, 16, hq=4, hkv=1, rotated=False),
    DecodeCase(17, (17, 5), 5, 3, leaky=4.0, num_splits=3),
    # 100 slots
    DecodeCase(100, (100, 5, 63), 5, 20, hq=4, hkv=2, num_splits=3, leaky=8.0),
    DecodeCase(100, (100, 37), 5, 200, rotated=False, logn_len=16),      # window > cache
    DecodeCase(100, (100, 1), 1, 7, dtype=BF16, num_splits=3),
    DecodeCase(100, (64, 100), 2, 33, hq=4, hkv=1, dtype=F16, logn_len=8, rotated=False,
               num_splits=1),
    DecodeCase(100, (100, 48), 1, 10, hq=2, hkv=2, layout="transposed", sm_scale=1.0),
    # 300 slots: the long unmasked loop outside the window
    DecodeCase(300, (300, 123), 1, 64, num_splits=1),
    DecodeCase(300, (300, 250), 2, 33, leaky=16.0, logn_len=32, num_splits=24),   # 19 tiles
    DecodeCase(300, (300,), 5, 299, hq=4, hkv=1, dtype=F16, rotated=False),
    DecodeCase(300, (17, 300), 5, 40, hq=4, hkv=2, num_splits=3, rotated=False, leaky=2.0),
    # other head dims
    DecodeCase(40, (40, 23), 2, 9, d=16, rotated=False),
    DecodeCase(40, (40, 23), 1, 9, d=128, dtype=F16, num_splits=3),
]


def make_cache(gen, case, batch, device):
    """``q, k_cache, v_cache, lengths``: every slot at or past a row's length is NaN."""
    q = randn(gen, batch, case.hq, case.n_queries, case.d, dtype=case.dtype, device=device)
    caches = []
    for _ in range(2):
        values = randn(gen, batch, case.hkv, case.n_max, case.d, dtype=case.dtype, device=device)
        for b, length in enumerate(case.lengths):
            values[b, :, length:] = float("nan")
        if case.layout == "transposed":   # a (B, Nmax, Hkv, D) buffer, the flash-attn layout
            values = values.transpose(1, 2).contiguous().transpose(1, 2)
        caches.append(values)
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    return q, *caches, lengths


def oracle(q, k_cache, v_cache, lengths, case, window=None):
    """float64 ``rerope_from_relative_positions``, one batch row at a time on its valid keys."""
    rows = []
    for b, length in enumerate(lengths.tolist()):
        rows.append(reference.rerope_from_relative_positions(
            q[b:b + 1].double(), k_cache[b:b + 1, :, :length].double(),
            v_cache[b:b + 1, :, :length].double(), case.window if window is None else window,
            causal=True, sm_scale=case.sm_scale, leaky=case.leaky, logn_len=case.logn_len,
            rotated=case.rotated))
    return torch.cat(rows)


def run_kernel(q, k_cache, v_cache, lengths, case, window=None):
    with poisoned_empty(), torch.no_grad():
        return rerope.rerope_decode(
            q, k_cache, v_cache, case.window if window is None else window,
            cache_seqlens=lengths, sm_scale=case.sm_scale, leaky=case.leaky,
            logn_len=case.logn_len, rotated=case.rotated, num_splits=case.num_splits)


@pytest.mark.parametrize("case", CASES, ids=DecodeCase.id)
def test_decode_matches_oracle(case, gen):
    q, k_cache, v_cache, lengths = make_cache(gen, case, len(case.lengths), kernel_device())
    out = run_kernel(q, k_cache, v_cache, lengths, case)
    assert out.dtype == case.dtype and out.shape == q.shape
    want = oracle(q, k_cache, v_cache, lengths, case)
    problems = close_problems("out", out, want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def test_oracle_comparison_catches_a_window_off_by_one(gen):
    """The check above is sharp: the kernel run with ``window + 1`` fails it."""
    case = DecodeCase(100, (100, 60), 2, 20, hq=2, hkv=1, num_splits=3)
    q, k_cache, v_cache, lengths = make_cache(gen, case, 2, kernel_device())
    want = oracle(q, k_cache, v_cache, lengths, case)
    assert not close_problems("out", run_kernel(q, k_cache, v_cache, lengths, case), want,
                              tolerance(F32))
    wrong = run_kernel(q, k_cache, v_cache, lengths, case, window=case.window + 1)
    assert close_problems("out", wrong, want, tolerance(F32))


@pytest.mark.parametrize("block_n", [16, 32])
def test_tile_sizes_from_the_config(block_n, gen):
    """``Config.decode_config`` sets the key tile (here under the interpreter too): 16-
    and 32-key tiles are exact for both conventions (the rotated cache turns keys
    outside the window, the raw one inside), and each configuration gets its own
    plan."""
    for rotated in (True, False):
        case = DecodeCase(100, (100, 41), 3, 20, hq=4, hkv=2, rotated=rotated, leaky=4.0,
                          num_splits=3)
        q, k_cache, v_cache, lengths = make_cache(gen, case, 2, kernel_device())
        with rerope.using_config(decode_config=(block_n, 4, 3, 2)):
            out = run_kernel(q, k_cache, v_cache, lengths, case)
            plan = decode.decode_plan(q, k_cache, v_cache, case.window, lengths,
                                      leaky=case.leaky, rotated=rotated, num_splits=3)
        assert plan.constexprs["BLOCK_N"] == block_n
        problems = close_problems("out", out, oracle(q, k_cache, v_cache, lengths, case),
                                  tolerance(F32))
        where = f"BLOCK_N={block_n} rotated={rotated}"
        assert not problems, where + "\n" + "\n".join(problems)


TMA_CASES = [   # the descriptor path: NaN past every length, ragged rows, both conventions
    DecodeCase(100, (100, 5, 63), 5, 20, hq=4, hkv=2, num_splits=3, leaky=8.0),
    DecodeCase(100, (100, 1), 1, 7, dtype=BF16, num_splits=3),
    DecodeCase(100, (64, 100), 2, 33, hq=4, hkv=1, dtype=F16, logn_len=8, rotated=False),
    DecodeCase(100, (100, 48), 1, 10, hq=2, hkv=2, layout="transposed", dtype=F16),
    DecodeCase(300, (300, 123), 1, 64, d=64, num_splits=1),
    DecodeCase(300, (17, 300), 5, 40, hq=4, hkv=2, num_splits=24, rotated=False, leaky=2.0),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=DecodeCase.id)
def test_tma_descriptors_match_oracle_and_pointer_loads(case, gen):
    """K and V through tensor descriptors (``TMA``, forced by ``tma="on"``: the
    interpreter runs it too) give the pointer loads' output bit for bit and match the
    oracle; the slots past each row's length (NaN) stay unread."""
    q, k_cache, v_cache, lengths = make_cache(gen, case, len(case.lengths), kernel_device())
    outs = {}
    for mode in ("off", "on"):
        with rerope.using_config(tma=mode):
            assert decode.use_tma(k_cache, v_cache, False, 1) == (mode == "on")
            outs[mode] = run_kernel(q, k_cache, v_cache, lengths, case)
    assert torch.isfinite(outs["on"]).all(), "a descriptor load read past a length"
    assert torch.equal(outs["on"], outs["off"]), "descriptor and pointer loads differ"
    want = oracle(q, k_cache, v_cache, lengths, case)
    problems = close_problems("out", outs["on"], want, tolerance(case.dtype))
    assert not problems, describe(gen, **asdict(case)) + "\n" + "\n".join(problems)


def test_tma_only_where_the_layout_allows(gen):
    """Forced or not, no descriptors for a paged cache or a layout TMA cannot take (a
    start or a row stride that is not 16-byte aligned): those calls read through
    pointers, and stay exact; under ``tma="auto"`` the interpreter never uses them, nor
    a GPU for head dims outside ``TMA_HEAD_DIMS`` or splits shorter than
    ``TMA_MIN_KEYS`` keys."""
    case = DecodeCase(40, (40, 31), 1, 8, hq=4, hkv=2, dtype=F16, d=16)
    q, k_cache, v_cache, lengths = make_cache(gen, case, 2, kernel_device())
    assert decode.use_tma(k_cache, v_cache, False, 1, "on")
    assert not decode.use_tma(k_cache, v_cache, True, 1 << 20, "on")
    wide = torch.zeros(2, 2, 40, 17, dtype=F16, device=k_cache.device)
    wide[..., 1:] = k_cache
    shifted = wide[..., 1:]          # unaligned start, 34-byte row stride
    assert not decode.use_tma(shifted, v_cache, False, 1 << 20, "on")
    with rerope.using_config(tma="on"):
        out = run_kernel(q, shifted, v_cache, lengths, case)
    problems = close_problems("out", out, oracle(q, shifted, v_cache, lengths, case),
                              tolerance(F16))
    assert not problems, "\n".join(problems)
    assert not decode.use_tma(k_cache, v_cache, False, 1 << 20, "auto")     # D=16
    k64, v64 = (torch.zeros(1, 1, 8, 64, dtype=F16, device=k_cache.device)
                for _ in "kv")
    on_hopper = kernel_device() == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert decode.use_tma(k64, v64, False, decode.TMA_MIN_KEYS, "auto") == on_hopper
    assert not decode.use_tma(k64, v64, False, decode.TMA_MIN_KEYS - 1, "auto")


def test_split_counts_agree(gen):
    """One split, three, and more splits than key tiles give the same output."""
    case = DecodeCase(300, (150,), 2, 50, hq=4, hkv=2, rotated=True)
    q, k_cache, v_cache, lengths = make_cache(gen, case, 1, kernel_device())
    outs = {s: run_kernel(q, k_cache, v_cache, lengths, DecodeCase(**{**asdict(case),
                                                                     "num_splits": s}))
            for s in (1, 3, 12)}     # 150 keys: 10 tiles
    for s in (3, 12):
        problems = close_problems(f"splits={s}", outs[s], outs[1], tolerance(F32))
        assert not problems, "\n".join(problems)


# --- a decode step is a row of the prefill --------------------------------------------


@pytest.mark.parametrize("rotated, leaky, logn_len", [(False, None, None), (True, None, None),
                                                     (True, 8.0, 16)],
                         ids=["raw", "rotated", "rotated-leaky-logn"])
def test_decode_equals_prefill_rows(rotated, leaky, logn_len, gen):
    """Prefill ``N`` tokens with ``rerope.rerope``; decoding the tokens ``t - Nq … t -
    1`` of each row against the cache of its first ``t`` keys gives the same rows."""
    device = kernel_device()
    batch, hq, hkv, n, d, window, n_queries = 2, 2, 1, 40, 32, 12, 2
    q, k, v = (randn(gen, batch, h, n, d, dtype=F32, device=device) for h in (hq, hkv, hkv))
    kwargs = dict(leaky=leaky, logn_len=logn_len)
    with torch.no_grad():
        prefill = rerope.rerope(q, k, v, window, **kwargs)
    prefill_oracle = reference.rerope(q.double(), k.double(), v.double(), window, **kwargs)
    ends = [n, 30]                                     # row 0: the last tokens; row 1: earlier
    if rotated:                                        # what a Llama model caches
        positions = torch.arange(n, dtype=torch.float64, device=device)
        q, k = rope.apply_rope(q, positions), rope.apply_rope(k, positions)
    q_new = torch.stack([q[b, :, t - n_queries:t] for b, t in enumerate(ends)])
    k_cache, v_cache = k.clone(), v.clone()
    for b, t in enumerate(ends):                        # slots past the length: never read
        k_cache[b, :, t:] = float("nan")
        v_cache[b, :, t:] = float("nan")
    with poisoned_empty(), torch.no_grad():
        out = rerope.rerope_decode(q_new, k_cache, v_cache, window,
                                   cache_seqlens=torch.tensor(ends, dtype=torch.int32,
                                                               device=device),
                                    rotated=rotated, num_splits=2, **kwargs)
    for name, full in (("rerope.rerope", prefill), ("reference.rerope", prefill_oracle)):
        want = torch.stack([full[b, :, t - n_queries:t] for b, t in enumerate(ends)])
        problems = close_problems(f"decode vs {name}", out, want, tolerance(F32))
        assert not problems, "\n".join(problems)


# --- how a split walks its keys -------------------------------------------------------


def chunk_problems(bounds, n_keys, n_queries, window, block_n):
    """Check ``decode.chunk_map`` against brute force: the splits partition ``[0,
    n_keys)`` in order; unmasked walks hold only keys of their kind for every query;
    every visible pair is seen by its product's walks."""
    problems, expected_lo = [], 0
    queries = range(n_keys - n_queries, n_keys)
    for split, (lo, c1, c2, c3, hi) in enumerate(bounds.tolist()):
        if not lo <= c1 <= c2 <= c3 <= hi:
            problems.append(f"split {split}: cut points out of order {(lo, c1, c2, c3, hi)}")
        if hi > lo:
            if lo != expected_lo:
                problems.append(f"split {split} starts at {lo}, expected {expected_lo}")
            expected_lo = hi
        for j in range(lo, hi):
            distances = [p - j for p in queries]
            if j < c1 and not all(d >= window for d in distances):
                problems.append(f"split {split}: key {j} in the unmasked outside walk")
            if c2 <= j < c3 and not all(0 <= d < window for d in distances):
                problems.append(f"split {split}: key {j} in the unmasked inside walk")
            if any(0 <= d < window for d in distances) and j < c1:
                problems.append(f"split {split}: key {j} inside for a query but never inside")
            if any(d >= window for d in distances) and j >= c2:
                problems.append(f"split {split}: key {j} outside for a query but never outside")
        for start in range(lo, c1, block_n):
            if start % block_n or start + block_n > n_keys:
                problems.append(f"split {split}: unmasked tile at {start} is ragged")
    if expected_lo != n_keys:
        problems.append(f"the splits cover [0, {expected_lo}), not [0, {n_keys})")
    return problems


@pytest.mark.parametrize("n_keys", [1, 17, 64, 100, 300])
def test_chunk_walks(n_keys):
    for n_queries in (1, 2, 5):
        for window in (1, 3, 16, 40, 299):
            for num_splits in (1, 3, 25):
                if n_queries > n_keys:
                    continue
                bounds = decode.chunk_map(n_keys, n_queries, window, num_splits, 16)
                problems = chunk_problems(bounds, n_keys, n_queries, min(window, n_keys), 16)
                assert not problems, (f"n_keys={n_keys} Nq={n_queries} w={window} "
                                      f"splits={num_splits}:\n" + "\n".join(problems[:10]))


# --- the splits rule ------------------------------------------------------------------


def test_default_num_splits():
    """The documented numbers: one wave of two programs per SM (132 SMs) at batch 1,
    fewer splits at batch 8, chunks of >= MIN_KEYS_PER_SPLIT keys, never more than
    MAX_SPLITS."""
    rule = decode.default_num_splits
    assert rule(1, 8, 4, 1, 131072, 132) == 33
    assert rule(8, 8, 4, 1, 131072, 132) == 4
    assert rule(33, 8, 4, 1, 131072, 132) == 1
    assert rule(1, 8, 4, 1, 4096, 132) == 16
    assert rule(1, 1, 1, 1, 10 ** 7, 132) == decode.MAX_SPLITS
    assert rule(64, 8, 4, 1, 131072, 132) == 1
    assert rule(1, 8, 4, 1, 1, 132) == 1
    for batch in (1, 3, 8, 32):
        for n_max in (1, 300, 4096, 131072):
            splits = rule(batch, 8, 4, 1, n_max, 132)
            assert 1 <= splits <= decode.MAX_SPLITS
            assert splits == 1 or splits * batch * 8 <= decode.PROGRAMS_PER_SM * 132
            assert splits == 1 or n_max / splits >= decode.MIN_KEYS_PER_SPLIT / 2


# --- bad input ------------------------------------------------------------------------


def _inputs(batch=2, hq=4, hkv=2, n_queries=2, n_max=20, d=32, dtype=F32):
    device = kernel_device()
    q = torch.randn(batch, hq, n_queries, d, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, n_max, d, dtype=dtype, device=device)
    return q, k, torch.randn_like(k)


def _lengths(*values):
    return torch.tensor(values, dtype=torch.int32, device=kernel_device())


BAD_INPUTS = [
    # (what, build the call's arguments, exception, words in the message)
    ("too many queries", lambda: (_inputs(n_queries=17, n_max=40), {}), ValueError, "1 to 16"),
    ("more queries than cache", lambda: (_inputs(n_queries=3, n_max=2), {}), ValueError,
     "Nq <= Nk"),
    ("heads not a multiple", lambda: (_inputs(hq=3, hkv=2), {}), ValueError, "multiple"),
    ("head dims differ", lambda: ((_inputs()[0], *_inputs(d=64)[1:]), {}), ValueError, "head dim"),
    ("unsupported head dim", lambda: (_inputs(d=48), {}), ValueError, "head dim"),
    ("k and v heads differ", lambda: ((*_inputs()[:2], _inputs(hkv=1)[2]), {}), ValueError,
     "heads"),
    ("dtypes differ", lambda: ((*_inputs()[:2], _inputs(dtype=F16)[2]), {}), TypeError, "dtype"),
    ("lengths int64", lambda: (_inputs(), dict(cache_seqlens=_lengths(5, 6).long())), TypeError,
     "int32"),
    ("lengths a list", lambda: (_inputs(), dict(cache_seqlens=[5, 6])), TypeError, "tensor"),
    ("lengths wrong shape", lambda: (_inputs(), dict(cache_seqlens=_lengths(5, 6, 7))),
     ValueError, "shape (2,)"),
    ("lengths 2-D", lambda: (_inputs(), dict(cache_seqlens=_lengths(5, 6)[None])), ValueError,
     "shape (2,)"),
    ("lengths other device", lambda: (_inputs(), dict(
        cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta"))), ValueError, "device"),
    ("length below Nq", lambda: (_inputs(), dict(cache_seqlens=_lengths(20, 1))), ValueError,
     "cache_seqlens[1] = 1"),
    ("length above Nmax", lambda: (_inputs(), dict(cache_seqlens=_lengths(21, 5))), ValueError,
     "exceeds"),
    ("num_splits 0", lambda: (_inputs(), dict(num_splits=0)), ValueError, "num_splits"),
    ("num_splits float", lambda: (_inputs(), dict(num_splits=2.0)), TypeError, "num_splits"),
    ("window 0", lambda: (_inputs(), dict(window=0)), ValueError, "window"),
    ("rotated not bool", lambda: (_inputs(), dict(rotated="yes")), TypeError, "rotated"),
    ("leaky <= 1", lambda: (_inputs(), dict(leaky=1.0)), ValueError, "leaky"),
    ("rank 3 q", lambda: ((_inputs()[0][0], *_inputs()[1:]), {}), ValueError, "rank 4"),
]


@pytest.mark.parametrize("what, build, error, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(what, build, error, words):
    (q, k_cache, v_cache), kwargs = build()
    kwargs = {"window": 4, **kwargs}
    if kernel_device() == "cuda" and what.startswith("length "):
        pytest.skip("lengths are not read on the host on a GPU (NaN rows instead: test_gpu_*)")
    with pytest.raises(error) as raised:
        rerope.rerope_decode(q, k_cache, v_cache, **kwargs)
    assert words in str(raised.value), f"{what}: message {str(raised.value)!r} lacks {words!r}"


def test_out_of_range_lengths_give_nan_rows(gen):
    """Where lengths are not checked on the host (a GPU), the kernel poisons the rows
    with an out-of-range length and computes the others normally. Here the plan's launch
    is called past the host check (``decode._launch``) to exercise that path on any
    device."""
    case = DecodeCase(20, (20, 1, 21, 9), 2, 4, hq=2, hkv=1, num_splits=2)
    q, k_cache, v_cache, _ = make_cache(gen, DecodeCase(**{**asdict(case), "lengths": (20,) * 4}),
                                        4, kernel_device())
    lengths = _lengths(*case.lengths)
    for splits in (1, 2):
        plan = decode.decode_plan(q, k_cache, v_cache, case.window, lengths,
                                  num_splits=splits)
        with poisoned_empty():
            out = decode._launch(plan, 20, q, k_cache, v_cache, lengths, None)
        assert out[1].isnan().all() and out[2].isnan().all(), "bad rows must be NaN"
        good = DecodeCase(**{**asdict(case), "lengths": (20, 9)})
        want = oracle(q[[0, 3]], k_cache[[0, 3]], v_cache[[0, 3]], _lengths(20, 9), good)
        problems = close_problems("good rows", out[[0, 3]], want, tolerance(F32))
        assert not problems, "\n".join(problems)


# --- plans ----------------------------------------------------------------------------


def test_a_growing_cache_uses_one_plan(gen):
    """20 decode steps, the cache one key longer each step (a new tensor each time, as a
    Hugging Face dynamic cache makes it) across the length where the splits rule goes
    from one split to two: one plan, and every step matches the oracle."""
    case = DecodeCase(270, (270,), 1, 100, hq=4, hkv=2)
    q, k_full, v_full, _ = make_cache(gen, case, 1, kernel_device())
    plans = set()
    for n in range(250, 270):
        k_cache, v_cache = k_full[:, :, :n].contiguous(), v_full[:, :, :n].contiguous()
        with torch.no_grad():
            out = rerope.rerope_decode(q, k_cache, v_cache, case.window)
        plan = decode.decode_plan(q, k_cache, v_cache, case.window)
        plans.add(id(plan))
        want = oracle(q, k_cache, v_cache, _lengths(n), case)
        problems = close_problems(f"step at {n} keys", out, want, tolerance(F32))
        assert not problems, "\n".join(problems)
    assert len(plans) == 1, f"{len(plans)} plans for one growing cache"
    assert {key[0] for key in plan.launches} == {1, 2}, "the split count did not change"


def test_a_plan_runs_grown_caches_and_refuses_other_layouts(gen):
    """``decode_plan`` / ``DecodePlan.run``: the plan of a short cache runs a cache long
    enough to outgrow its rotation tables (same result as ``rerope_decode``); tensors of
    another dtype or with the length below ``Nq`` are refused, naming what is wrong."""
    device = kernel_device()
    q = randn(gen, 1, 2, 2, 16, dtype=F32, device=device)
    k, v = (randn(gen, 1, 1, 4000, 16, dtype=F32, device=device) for _ in "kv")
    plan = decode.decode_plan(q, k[:, :, :10], v[:, :, :10], 64, num_splits=4)
    with torch.no_grad():
        plan.run(q, k[:, :, :10], v[:, :, :10])
        first = plan.tables.tables
        got = plan.run(q, k, v)
        want = rerope.rerope_decode(q, k, v, 64, num_splits=4)
    assert decode.decode_plan(q, k, v, 64, num_splits=4) is plan
    assert plan.tables.tables is not first and plan.tables.retired == [first]
    assert torch.equal(got, want)
    exact = reference.rerope_from_relative_positions(
        q.double(), k.double(), v.double(), 64, causal=True, rotated=True)
    assert not close_problems("long", got, exact, tolerance(F32))
    with pytest.raises(ValueError, match="do not match this DecodePlan"):
        plan.run(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="Nq <= Nk"):
        plan.run(q, k[:, :, :1], v[:, :, :1])


def _kept_steps(q):
    """The kept steps of :data:`rerope.decode._STEPS` whose calls had this ``q``."""
    return [step for (key, _), (step, _, _) in decode._STEPS._entries.items()
            if key[0][0][:2] == (q.shape, q.stride())]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_growing_cache_keeps_one_step(paged, gen):
    """A decode loop over a cache one key longer each call (contiguous: a new tensor each
    time, as a Hugging Face dynamic cache; paged: the pool and the block table one page
    larger as the lengths cross a page) binds its launches once: one plan, one kept step
    for every length (``plan.steps``, the same object in every ``_STEPS`` entry: one per
    exact signature), and each call
    equals, bit for bit, a fresh plan's call that keeps nothing, a repeated call, and the
    float64 oracle. A call with another head count or dtype gets its own plan and step;
    a value cache of another head dim is refused."""
    case = DecodeCase(64, (64,), 1, 12, hq=4, hkv=2, num_splits=2)
    q, k_full, v_full, _ = make_cache(gen, case, 1, kernel_device())
    settings = (case.window, None, 10000.0, None, None, True, 2, None, None)
    decode.PLANS.clear()
    decode._STEPS.clear()
    steps = set()
    for n in range(24, 44):
        lengths = _lengths(n)
        if paged:     # 16-key pages in order; the pool and the table hold the row's pages
            pages = -(-n // 16)
            k_cache, v_cache = (torch.nn.functional.pad(c, (0, 0, 0, 64 - n))
                                .reshape(2, 4, 16, 32).permute(1, 2, 0, 3)[:pages]
                                for c in (k_full[0, :, :n], v_full[0, :, :n]))
            table = torch.arange(pages, dtype=torch.int32, device=q.device)[None]
        else:
            k_cache, v_cache = k_full[:, :, :n].contiguous(), v_full[:, :, :n].contiguous()
            table = None
        with torch.no_grad():
            out = rerope.rerope_decode(q, k_cache, v_cache, case.window, lengths,
                                       num_splits=2, block_table=table)
            again = rerope.rerope_decode(q, k_cache, v_cache, case.window, lengths,
                                         num_splits=2, block_table=table)
            fresh = decode._make_plan(None, q, k_cache, v_cache, table, settings,
                                      rerope.configs.current())
            unkept = fresh._run(q, k_cache, v_cache, lengths, table)
        plan = decode.decode_plan(q, k_cache, v_cache, case.window, lengths, num_splits=2,
                                  block_table=table)
        steps.add(id(plan.steps[False]))
        assert torch.equal(out, unkept) and torch.equal(out, again), f"step at {n} keys"
        want = oracle(q, k_full[:, :, :n], v_full[:, :, :n], lengths, case)
        problems = close_problems(f"step at {n} keys", out, want, tolerance(F32))
        assert not problems, "\n".join(problems)
    assert decode.PLANS.built == 1 and len(steps) == 1 and len(plan.steps) == 1
    kept = _kept_steps(q)
    assert len(kept) == (2 if paged else 20) and all(step is plan.steps[False] for step in kept)
    for other in ({"hkv": 1}, {"dtype": F16}):   # another layout class: a plan of its own
        other_case = DecodeCase(**{**asdict(case), "n_max": 30, "lengths": (30,), **other})
        q2, k2, v2, lengths = make_cache(gen, other_case, 1, kernel_device())
        with torch.no_grad():
            got = rerope.rerope_decode(q2, k2, v2, case.window, lengths, num_splits=2)
        other_plan = decode.decode_plan(q2, k2, v2, case.window, lengths, num_splits=2)
        assert other_plan is not plan and other_plan.steps[False] is not plan.steps[False]
        want = oracle(q2, k2, v2, lengths, other_case)
        assert not close_problems(str(other), got, want, tolerance(other_case.dtype))
    assert decode.PLANS.built == 3
    if not paged:
        with pytest.raises(ValueError, match="head dim"):
            rerope.rerope_decode(q, k_full, v_full[..., :16].contiguous(), case.window)


@pytest.mark.parametrize("num_splits, split_cap, tma_min_keys",
                         [(None, 8, None), (None, 1, None), (3, 8, None), (None, 8, 64),
                          (None, 5, 0), (2, 8, 100)])
def test_a_step_range_launches_alike(num_splits, split_cap, tma_min_keys, gen):
    """``DecodePlan._step_range(n)``: every cache size in it launches as ``n`` does (the
    same split count and TMA choice, :meth:`DecodePlan.splits_for`) within the rotation
    tables' rows, and it holds ``n``: a kept step never serves a size it does not fit."""
    from dataclasses import replace

    q = randn(gen, 1, 2, 1, 16, dtype=F32, device=kernel_device())
    k = randn(gen, 1, 1, 8, 16, dtype=F32, device=kernel_device())
    base = decode.decode_plan(q, k, k, 4)
    base._rotation_tables(3000)
    plan = replace(base, num_splits=num_splits, split_cap=split_cap,
                   tma_min_keys=tma_min_keys, tables=base.tables)
    rows = plan.tables.rows
    launch = [None] + [plan.splits_for(n) for n in range(1, rows + 1)]
    for n in range(1, 3000):
        lo, hi = plan._step_range(n)
        assert 1 <= lo <= n <= hi <= rows - decode.TABLE_MARGIN, (n, lo, hi)
        assert set(launch[lo:hi + 1]) == {launch[n]}, (n, lo, hi)


# --- what the compiler takes (the interpreter accepts more) ---------------------------


_COMPILE_CHILD = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rerope import decode

def split_source(dtype, paged, lengths, tma):
    """The split kernel as a launch specialises it: tuple strides (the last one 1),
    ``None`` for absent lengths and block table."""
    fn, sig, const, attrs = decode._decode_split_kernel, {}, {}, {}
    div = [["tt.divisibility", 16]]
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            sig[n] = "constexpr"
        elif (n == "SeqLens" and not lengths) or (n == "BlockTable" and not paged):
            sig[n], const[n] = "constexpr", None
        elif n in ("SeqLens", "BlockTable"):
            sig[n], attrs[(i,)] = "*i32", div
        elif n in ("Out", "Lse", "TableIn", "OffsetIn", "TableOut", "OffsetOut"):
            sig[n], attrs[(i,)] = "*fp32", div
        elif n[0].isupper():
            sig[n], attrs[(i,)] = "*" + dtype, div
        elif n.endswith("_strides"):
            width = 2 if n == "table_strides" else 4
            sig[n] = ("i32",) * (width - 1) + ("constexpr",)
            const[(i, width - 1)] = 1
            attrs.update({(i, j): div for j in range(width - 1)})
        else:
            sig[n] = "fp32" if n in ("qk_scale", "logn_factor") else "i32"
    const.update(HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64, TURN_IN=False, TURN_OUT=True,
                 ROW_PER_KEY=paged, LOGN=True, WRITE_LSE=True,
                 PAGE_SIZE=16 if paged else 0,
                 TMA=tma, DOT_PRECISION="tf32x3" if dtype == "fp32" else "tf32")
    return ASTSource(fn, sig, const, attrs)

merge = ASTSource(decode._decode_merge_kernel,
                  {"Part": "*fp32", "PartLse": "*fp32", "Out": "*bf16", "FinalLse": "*fp32",
                   "n_rows": "i32",
                   "num_splits": "i32", "HEAD_DIM": "constexpr", "ROWS": "constexpr",
                   "SPLITS_BLOCK": "constexpr", "LSE_BLOCK": "constexpr"},
                  dict(HEAD_DIM=128, ROWS=1, SPLITS_BLOCK=64, LSE_BLOCK=64), {})
jobs = [(90, split_source("bf16", False, True, True)),
        (90, split_source("fp16", True, True, False)),
        (80, split_source("bf16", False, False, False)),
        (75, split_source("fp32", False, True, False)), (90, merge)]
for cap, source in jobs:
    kernel = triton.compile(source, target=GPUTarget("cuda", cap, 32),
                            options={"num_warps": 4, "num_stages": 3})
    print(json.dumps([cap, kernel.metadata.shared]))
'''


def test_kernels_compile_for_every_gpu(tmp_path):
    """The interpreter runs code the compiler refuses (a plain global in a kernel, say):
    the split kernel (tuple strides, ``None`` lengths, paged, TMA) and the merge kernel
    cross-compile for sm_75, sm_80 and sm_90 here, no GPU needed."""
    lines = cross_compile(tmp_path, _COMPILE_CHILD)
    assert len(lines) == 5, lines

# --- GPU ------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def full_precision_reference():
    with true_float32():
        yield


def float32_reference(q, k_cache, v_cache, lengths, window, leaky=None, logn_len=None,
                      rotated=True, kv_chunk=2):
    """``reference.rerope`` in float32, one batch row and ``kv_chunk`` KV heads at a time."""
    group = q.shape[1] // k_cache.shape[1]
    rows = []
    for b, length in enumerate(lengths.tolist()):
        heads = []
        for h0 in range(0, k_cache.shape[1], kv_chunk):
            kv = slice(h0, h0 + kv_chunk)
            qs = slice(h0 * group, (h0 + kv_chunk) * group)
            heads.append(reference.rerope(
                q[b:b + 1, qs].float(), k_cache[b:b + 1, kv, :length].float(),
                v_cache[b:b + 1, kv, :length].float(), window, leaky=leaky, logn_len=logn_len,
                rotated=rotated))
        rows.append(torch.cat(heads, dim=1))
    return torch.cat(rows)


GPU_CASES = [   # (batch, n_queries, window, rotated, leaky, logn_len, lengths)
    (1, 1, 2048, True, None, None, None),
    (8, 1, 2048, True, None, None, None),
    (1, 1, 512, True, None, None, None),
    (8, 4, 512, True, None, None, (131072, 1000, 65537, 4, 131071, 77777, 2048, 130000)),
    (1, 1, 2048, False, 16.0, 4096, None),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch, n_queries, window, rotated, leaky, logn_len, lengths", GPU_CASES)
@pytest.mark.usefixtures("full_precision_reference")
def test_gpu_128k(batch, n_queries, window, rotated, leaky, logn_len, lengths, gen):
    n_max, hq, hkv, d = 131072, 32, 8, 128
    q = randn(gen, batch, hq, n_queries, d, dtype=BF16, device="cuda")
    k_cache = torch.randn(batch, hkv, n_max, d, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.tensor(lengths or (n_max,) * batch, dtype=torch.int32, device="cuda")
    with poisoned_empty(), torch.no_grad():
        out = rerope.rerope_decode(q, k_cache, v_cache, window, cache_seqlens=lengths,
                                   leaky=leaky, logn_len=logn_len, rotated=rotated)
    want = float32_reference(q, k_cache, v_cache, lengths, window, leaky, logn_len, rotated)
    problems = close_problems("out", out, want, tolerance(BF16, "gpu"))
    stats = (out.float() - want).abs().max().item()
    print(f"\nB={batch} Nq={n_queries} w={window} rotated={rotated}: max|err| {stats:.3e}")
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_growing_cache_one_plan_bound_launches(paged, gen):
    """A cache growing one key per step on a GPU (contiguous: a new tensor each step,
    lengths given or not; paged: the lengths grow): one plan per kind of call; from the
    second call of each split count its launches skip Triton's launch path (tuple
    strides, ``None`` lengths through the bound launcher) and give the first call's
    bits; every step matches the float64 oracle."""
    case = DecodeCase(1040, (1040,), 2, 100, hq=8, hkv=2, d=64, dtype=BF16)
    q, k_full, v_full, _ = make_cache(gen, case, 2, "cuda")
    plans = set()
    for n in range(1020, 1040):
        k_cache, v_cache = k_full[:, :, :n].contiguous(), v_full[:, :, :n].contiguous()
        lengths = torch.full((2,), n, dtype=torch.int32, device="cuda")
        kwargs = {}
        if paged:       # a fixed pool and table of 16-key pages; the lengths grow
            k_cache, v_cache = (torch.nn.functional.pad(c, (0, 0, 0, 1056 - 1040))
                                .reshape(2, 2, 66, 16, 64).permute(0, 2, 3, 1, 4)
                                .reshape(2 * 66, 16, 2, 64) for c in (k_full, v_full))
            kwargs["block_table"] = torch.arange(2 * 66, dtype=torch.int32,
                                                 device="cuda").view(2, 66)
        seqlens = lengths if paged or n % 2 else None
        with torch.no_grad():
            first = rerope.rerope_decode(q, k_cache, v_cache, case.window,
                                         cache_seqlens=seqlens, **kwargs)
            again = rerope.rerope_decode(q, k_cache, v_cache, case.window,
                                         cache_seqlens=seqlens, **kwargs)
        plan = decode.decode_plan(q, k_cache, v_cache, case.window, seqlens, **kwargs)
        plans.add((seqlens is None, id(plan)))
        assert plan.bound, f"step at {n} keys: a launch took Triton's path twice"
        assert torch.equal(first, again), f"step at {n} keys: the bound launch differs"
        want = oracle(q, k_full[:, :, :n], v_full[:, :, :n], lengths.cpu(), case)
        problems = close_problems(f"step at {n} keys", first, want.to(first.device),
                                  tolerance(BF16, "gpu"))
        assert not problems, "\n".join(problems)
    assert len(plans) == (1 if paged else 2), plans


@pytest.mark.gpu
@needs_gpu
def test_gpu_out_of_range_lengths_and_graph_replay(gen):
    """On a GPU: out-of-range lengths give NaN rows (no host check); a CUDA graph
    captured once replays correctly after the lengths change in place."""
    case = DecodeCase(300, (300, 0, 301, 77), 1, 40, hq=4, hkv=2, dtype=F16)
    q, k_cache, v_cache, _ = make_cache(gen, DecodeCase(**{**asdict(case), "lengths": (300,) * 4}),
                                        4, "cuda")
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
    out = rerope.rerope_decode(q, k_cache, v_cache, case.window, cache_seqlens=lengths)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.isfinite(out[[0, 3]]).all()

    lengths.copy_(torch.tensor([300, 5, 150, 77], dtype=torch.int32))
    static = dict(cache_seqlens=lengths, num_splits=4)
    rerope.rerope_decode(q, k_cache, v_cache, case.window, **static)          # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rerope.rerope_decode(q, k_cache, v_cache, case.window, **static)
    for new in ([300, 5, 150, 77], [12, 299, 1, 200]):
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        eager = rerope.rerope_decode(q, k_cache, v_cache, case.window, **static)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), f"graph replay differs from eager at lengths {new}"
        want = oracle(q, k_cache, v_cache, lengths.cpu(), DecodeCase(**{**asdict(case),
                                                                       "lengths": tuple(new)}))
        problems = close_problems("replay", captured, want, tolerance(F16, "gpu"))
        assert not problems, "\n".join(problems)


def _tma_call(q, k_cache, v_cache, seqlens, d, tma, graph):
    """One call under the active ``tma`` mode, checking the plan's TMA decision at 32k
    keys; with ``graph``, also captured in a CUDA graph and replayed (the same bits)."""
    plan = decode.decode_plan(q, k_cache, v_cache, 2048, seqlens)
    splits, uses_tma = plan.splits_for(32768)
    rule = -(-32768 // splits) >= decode.TMA_MIN_KEYS
    assert uses_tma == {"off": False, "on": True,
                        "auto": rule and d in decode.TMA_HEAD_DIMS}[tma], (tma, splits)
    with poisoned_empty():
        out = rerope.rerope_decode(q, k_cache, v_cache, 2048, cache_seqlens=seqlens)
    if graph:                        # the bound launches, captured, replayed
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            captured = rerope.rerope_decode(q, k_cache, v_cache, 2048,
                                            cache_seqlens=seqlens)
        for _ in range(3):
            cuda_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out), ("graph", q.dtype, tma)
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_tma_gives_the_pointer_path_bits(d):
    """Benchmark-sized caches (32k keys, Hq=32, Hkv=8): B=8 in bf16 and fp16, B=1 (33
    splits of 993 keys), B=3 with ragged lengths and Nq=4, a transposed cache with
    ragged lengths: K and V through TMA descriptors (forced) give the output of pointer
    loads bit for bit, eager and (B=8) replayed from a CUDA graph, under poisoned
    allocations; ``REROPE_TMA=auto`` takes them where the splits are at least
    ``TMA_MIN_KEYS`` keys long."""
    torch.manual_seed(d)
    for dtype in (BF16, F16):
        k = torch.randn(8, 8, 32768, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        cases = [(8, 1, None, k, v)]
        if dtype == BF16:        # a (B, N, Hkv, D) buffer seen as (B, Hkv, N, D)
            kt = k[:2].transpose(1, 2).contiguous().transpose(1, 2)
            cases += [(1, 1, None, k, v), (3, 4, (32768, 5000, 17), k, v),
                      (2, 1, (32768, 20000), kt, v)]
        for batch, nq, lengths, kc, vc in cases:
            q = torch.randn(batch, 32, nq, d, device="cuda", dtype=dtype)
            seqlens = torch.tensor(lengths or (32768,) * batch, dtype=torch.int32,
                                   device="cuda")
            outs = {}
            for tma in ("off", "on", "auto"):
                with rerope.using_config(tma=tma):
                    outs[tma] = _tma_call(q, kc[:batch], vc[:batch], seqlens, d, tma,
                                          graph=batch == 8 and tma != "auto")
            torch.cuda.synchronize()
            assert torch.isfinite(outs["off"]).all()
            for tma in ("on", "auto"):
                assert torch.equal(outs[tma], outs["off"]), (dtype, batch, nq, tma)
        del k, v
        torch.cuda.empty_cache()


# --- paged KV caches (block_table, FlashAttention's layout) ----------------------------------


@dataclass(frozen=True)
class PagedCase:
    page: int
    lengths: tuple
    n_queries: int = 1
    window: int = 20
    hq: int = 4
    hkv: int = 2
    d: int = 32
    dtype: torch.dtype = F32
    rotated: bool = True
    leaky: float = None
    num_splits: int = None
    max_blocks: int = None      # table width; enough for the longest row when None
    group: int = None           # Self-Extend's group size

    def id(self):
        parts = [f"P{self.page}", "L" + "-".join(map(str, self.lengths)), f"q{self.n_queries}",
                 f"w{self.window}", f"H{self.hq}kv{self.hkv}", f"D{self.d}",
                 str(self.dtype).replace("torch.", ""), "rot" if self.rotated else "raw"]
        if self.leaky is not None:
            parts.append(f"leaky{self.leaky:g}")
        if self.num_splits is not None:
            parts.append(f"splits{self.num_splits}")
        if self.group is not None:
            parts.append(f"group{self.group}")
        return "-".join(parts)


PAGED_CASES = [
    PagedCase(16, (40,)),
    PagedCase(16, (100, 17, 64), n_queries=3, hq=4, hkv=1, num_splits=3),
    PagedCase(32, (90, 33), n_queries=2, rotated=False, leaky=4.0),
    PagedCase(64, (130, 5), n_queries=5, window=7, hq=2, hkv=2, dtype=F16, num_splits=2),
    PagedCase(256, (300, 257), window=100, hq=4, hkv=2, dtype=BF16, max_blocks=3),
    PagedCase(16, (48, 48), n_queries=2, window=200, rotated=False),     # window > cache
    # Self-Extend: G divides the interpreter's 16-key tile (angles split per tile) or
    # not
    PagedCase(16, (70, 41), n_queries=2, window=20, group=4),
    PagedCase(32, (66,), window=20, group=5, hkv=1),
]


def build(gen, case, device):
    """``q``, the contiguous caches (NaN past each length), the paged pools, the block
    table (random pages, non-monotone; entries past a row's length point at NaN pages or
    far out of the pool) and the lengths."""
    batch, page = len(case.lengths), case.page
    max_blocks = case.max_blocks or -(-max(case.lengths) // page)
    n_max = max_blocks * page
    q = randn(gen, batch, case.hq, case.n_queries, case.d, dtype=case.dtype, device=device)
    k, v = (randn(gen, batch, case.hkv, n_max, case.d, dtype=case.dtype, device=device)
            for _ in range(2))
    for b, length in enumerate(case.lengths):
        k[b, :, length:] = v[b, :, length:] = float("nan")
    used = [-(-length // page) for length in case.lengths]
    spare = 3                                                # NaN pages nobody owns
    blocks = sum(used) + spare
    order = torch.randperm(blocks, generator=gen)
    while bool((order[1:] > order[:-1]).all()):              # non-monotone, whatever the seed
        order = torch.randperm(blocks, generator=gen)
    table = torch.empty(batch, max_blocks, dtype=torch.int32)
    pools = [torch.full((blocks, page, case.hkv, case.d), float("nan"), dtype=case.dtype)
             for _ in range(2)]
    taken = 0
    for b in range(batch):
        for j in range(max_blocks):
            if j < used[b]:
                table[b, j] = int(order[taken])
                taken += 1
                for pool, src in zip(pools, (k, v)):
                    pool[table[b, j]] = src[b, :, j * page:(j + 1) * page].transpose(0, 1).cpu()
            else:                                            # past the length: garbage
                table[b, j] = int(order[-1 - j % spare]) if j % 2 else 10 ** 6 + j
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    return (q, k, v, pools[0].to(device), pools[1].to(device), table.to(device), lengths)


def decode_call(q, k, v, lengths, case, **kwargs):
    with poisoned_empty(), torch.no_grad():
        return rerope.rerope_decode(q, k, v, case.window, cache_seqlens=lengths,
                                    rotated=case.rotated, leaky=case.leaky,
                                    num_splits=case.num_splits, group=case.group, **kwargs)


def paged_oracle(q, k, v, lengths, case):
    return torch.cat([reference.rerope_from_relative_positions(
        q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(),
        case.window, causal=True, leaky=case.leaky, rotated=case.rotated, group=case.group)
        for b, n in enumerate(lengths.tolist())])


@pytest.mark.parametrize("case", PAGED_CASES, ids=PagedCase.id)
def test_paged_equals_contiguous(case, gen):
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    want = decode_call(q, k, v, lengths, case)
    got = decode_call(q, k_pages, v_pages, lengths, case, block_table=table)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "the paged call read a NaN slot or page"
    problems = close_problems("paged vs contiguous", got, want, tolerance(case.dtype))
    problems += close_problems("paged vs float64", got, paged_oracle(q, k, v, lengths, case),
                               tolerance(case.dtype))
    assert not problems, case.id() + "\n" + "\n".join(problems)


@pytest.mark.parametrize("block_n, page", [(64, 16), (64, 32), (32, 64), (128, 16)])
def test_pages_smaller_and_larger_than_the_tile(block_n, page, gen):
    """Pages smaller than the key tile (table entries per page of the tile: scalar loads
    up to ``MAX_SCALAR_PAGES`` pages, a gather per key beyond: 128-key tiles of 16-key
    pages) and larger (one entry per tile), the tile set through
    ``Config.decode_config``."""
    case = PagedCase(page, (150, 70, 9), n_queries=2, hq=4, hkv=2, num_splits=2)
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    with rerope.using_config(decode_config=(block_n, 4, 3, 2)):
        got = decode_call(q, k_pages, v_pages, lengths, case, block_table=table)
    problems = close_problems("paged", got, paged_oracle(q, k, v, lengths, case), tolerance(F32))
    assert not problems, "\n".join(problems)


def test_paged_strided_pools_tables_and_the_plan(gen):
    """Pools that are views of a ``(num_blocks, block_size, 2, Hkv, D)`` buffer and a
    block table that is a slice of a wider one (any strides), and the plan: made once,
    reused by the next call with the same layout, and by one whose block table and pool
    have grown."""
    case = PagedCase(16, (50, 31), n_queries=2)
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    joint = torch.stack([k_pages, v_pages], dim=2)           # (blocks, page, 2, Hkv, D)
    plan = decode.decode_plan(q, joint[:, :, 0], joint[:, :, 1], case.window, lengths,
                              block_table=table, num_splits=case.num_splits)
    assert plan.page_size == 16
    got = decode_call(q, joint[:, :, 0], joint[:, :, 1], lengths, case, block_table=table)
    again = decode_call(q, joint[:, :, 0], joint[:, :, 1], lengths, case, block_table=table)
    want = decode_call(q, k, v, lengths, case)
    assert not close_problems("strided pools", got, want, tolerance(F32))
    assert torch.equal(got, again)
    wide = torch.full((table.shape[0], table.shape[1] + 3), -7, dtype=torch.int32,
                      device=table.device)
    wide[:, :table.shape[1]] = table                          # a strided view of a wider table
    sliced = decode_call(q, k_pages, v_pages, lengths, case, block_table=wide[:, :table.shape[1]])
    assert torch.equal(sliced, got)
    grown = torch.cat([joint, joint[:2]])            # two more pages
    longer = torch.cat([table, table[:, :1]], dim=1)  # one more entry
    assert decode.decode_plan(q, grown[:, :, 0], grown[:, :, 1], case.window, lengths,
                              block_table=longer, num_splits=case.num_splits) is plan
    again = plan.run(q, grown[:, :, 0], grown[:, :, 1], lengths, longer)
    assert torch.equal(again, got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # numpy on the NaN rows
def test_out_of_range_entry_gives_nan_rows_without_host_check(gen):
    """What a GPU does (no host check there; here the plan's launch is called past it):
    a used entry outside the pool makes its row NaN, the other rows stay right, and
    nothing outside the pool is read."""
    case = PagedCase(16, (40, 40, 20), num_splits=2)
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    bad = table.clone()
    bad[1, 1] = k_pages.shape[0]                             # one past the last page
    bad[2, 0] = -1
    plan = decode.decode_plan(q, k_pages, v_pages, case.window, lengths,
                              block_table=bad, rotated=case.rotated,
                              num_splits=case.num_splits)
    with poisoned_empty(), torch.no_grad():
        got = decode._launch(plan, table.shape[1] * 16, q, k_pages, v_pages, lengths,
                             bad)
    assert got[1:].isnan().all()
    assert not close_problems("row 0", got[:1], paged_oracle(q, k, v, lengths, case)[:1],
                              tolerance(F32))


def _valid(gen):
    case = PagedCase(16, (40, 20))
    q, _, _, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    return q, k_pages, v_pages, table, lengths


def _bad_calls(gen):
    q, kp, vp, table, lengths = _valid(gen)
    used_past = table.clone()
    used_past[0, 1] = kp.shape[0]
    negative = table.clone()
    negative[1, 0] = -3
    return [
        ("dtype", dict(block_table=table.long()), TypeError, "block_table must have dtype"),
        ("not a tensor", dict(block_table=table.tolist()), TypeError, "block_table must be"),
        ("rank", dict(block_table=table.flatten()), ValueError, "block_table must have shape"),
        ("batch", dict(block_table=table[:1]), ValueError, "block_table must have shape"),
        ("range", dict(block_table=used_past), ValueError, r"block_table\[0, 1\]"),
        ("negative", dict(block_table=negative), ValueError, r"block_table\[1, 0\] = -3"),
        ("no lengths", dict(block_table=table, cache_seqlens=None), ValueError,
         "cache_seqlens is required"),
        ("page size", dict(block_table=table, k=kp.reshape(-1, 8, *kp.shape[2:]),
                           v=vp.reshape(-1, 8, *vp.shape[2:])), ValueError, "block_size 8"),
        ("odd page", dict(block_table=table, k=kp[:, :12], v=vp[:, :12]), ValueError,
         "block_size 12"),
        ("k/v disagree", dict(block_table=table, v=vp[:-1]), ValueError,
         "k_cache and v_cache pages disagree"),
        ("rank of k", dict(block_table=table, k=kp[0], v=vp[0]), ValueError,
         "paged cache of rank 4"),
        ("head dim", dict(block_table=table, k=kp[..., :16], v=vp[..., :16]), ValueError,
         "head dim"),
        ("dtype of k", dict(block_table=table, k=kp.double(), v=vp.double()), TypeError,
         "k_cache has dtype"),
        ("too long", dict(block_table=table, cache_seqlens=lengths + 100), ValueError,
         "exceeds the cache size"),
    ]


@pytest.mark.parametrize("index", range(14))
def test_bad_paged_arguments(index, gen):
    q, kp, vp, table, lengths = _valid(gen)
    what, change, error, message = _bad_calls(gen)[index]
    args = {**dict(k=kp, v=vp, cache_seqlens=lengths), **change}
    with pytest.raises(error, match=message):
        rerope.rerope_decode(q, args.pop("k"), args.pop("v"), 20, **args)


def test_block_table_on_another_device(gen):
    if kernel_device() != "cuda":
        pytest.skip("needs a second device")
    q, kp, vp, table, lengths = _valid(gen)
    with pytest.raises(ValueError, match="block_table must be on q's device"):
        rerope.rerope_decode(q, kp, vp, 20, cache_seqlens=lengths, block_table=table.cpu())


def test_opcheck_paged_decode_op(gen):
    """The torch.library op (what torch.compile calls) on a paged cache, with its fake."""
    case = PagedCase(16, (40, 23), n_queries=2)
    q, _, _, kp, vp, table, lengths = build(gen, case, kernel_device())
    kp, vp = (torch.nan_to_num(p) for p in (kp, vp))        # opcheck compares outputs too
    torch.library.opcheck(torch.ops.rerope.rerope_decode.default,
                          (q, kp, vp, lengths, 20, None, 10000.0, None, None, True, None, None,
                           table))


def test_compile_paged_decode_fullgraph(gen):
    """A paged call inside ``torch.compile(fullgraph=True)`` goes to the opaque op with
    its block table and gives the eager result."""
    import torch._dynamo

    case = PagedCase(16, (40, 23), n_queries=2)
    q, _, _, kp, vp, table, lengths = build(gen, case, kernel_device())
    want = rerope.rerope_decode(q, kp, vp, 20, cache_seqlens=lengths, block_table=table)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, n, t: rerope.rerope_decode(q, k, v, 20, cache_seqlens=n,
                                                                  block_table=t),
                       fullgraph=True, backend="aot_eager")
    got = fn(q, kp, vp, lengths, table)
    torch._dynamo.reset()
    assert torch.equal(got, want)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_paged_equals_contiguous_at_32k(d):
    """Benchmark-sized caches (B=3, 32k keys, bf16) in random pages of 16, 64 and 256
    keys: bit-identical to the contiguous call (the same tiles in the same order), rows
    of different lengths; pages past a length are NaN."""
    from benchmarks import decode as bench_decode

    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 8, 32768, d, device="cuda", dtype=BF16).unbind(0)
    q = torch.randn(3, 32, 1, d, device="cuda", dtype=BF16)
    lengths = torch.tensor([32768, 20000, 4099], dtype=torch.int32, device="cuda")
    want = rerope.rerope_decode(q, k, v, 2048, cache_seqlens=lengths)
    for page in (16, 64, 256):
        k_pages, v_pages, table = bench_decode.paged_copy(k, v, page)
        for b, n in enumerate(lengths.tolist()):        # the pages past each length: NaN
            unused = table[b, -(-n // page):].long()
            k_pages[unused] = v_pages[unused] = float("nan")
        with poisoned_empty():
            got = rerope.rerope_decode(q, k_pages, v_pages, 2048, cache_seqlens=lengths,
                                       block_table=table)
        assert torch.equal(got, want), f"page {page}: differs from the contiguous call"


@pytest.mark.gpu
@needs_gpu
def test_gpu_paged_graph_replay_and_bad_entries(gen):
    """A CUDA graph captured once replays a paged call after the lengths and the block
    table change in place (a sequence moved to other pages); an out-of-range entry gives
    a NaN row."""
    case = PagedCase(64, (300, 130, 64), n_queries=2, hq=8, hkv=2, d=64, dtype=F16,
                     num_splits=3, max_blocks=6)
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, "cuda")
    settings = dict(cache_seqlens=lengths, num_splits=3, block_table=table)
    eager = rerope.rerope_decode(q, k_pages, v_pages, case.window, **settings)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rerope.rerope_decode(q, k_pages, v_pages, case.window, **settings)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    # row 1's first two pages trade places in the pool and in its table; row 2 shrinks
    first, second = int(table[1, 0]), int(table[1, 1])
    for pool in (k_pages, v_pages):
        pool[[first, second]] = pool[[second, first]]
    table[1, :2] = torch.tensor([second, first], dtype=torch.int32)
    lengths[2] = 40
    graph.replay()
    torch.cuda.synchronize()
    want = paged_oracle(q, k, v, lengths.cpu(), case)
    assert not close_problems("replay", captured, want, tolerance(F16, "gpu"))
    table[2, 0] = k_pages.shape[0] + 5                      # out of the pool: no host check
    graph.replay()
    torch.cuda.synchronize()
    assert captured[2].isnan().all() and torch.isfinite(captured[:2]).all()


# --- the partials buffer kept between calls ---------------------------------------------


def _held_partials(device):
    """``(shape, part, lse)`` this thread keeps for ``device``, or ``None``."""
    return decode._SCRATCH.held.get(device)


def test_kept_partials_give_the_same_bits_and_are_never_read_stale(monkeypatch, gen):
    """Consecutive calls of different cache lengths, split counts and head counts reuse
    this thread's partials buffer where its shape matches (a new tensor each time, as
    Hugging Face's dynamic cache) and give, bit for bit, the result of a call with a new
    buffer; a kept buffer poisoned with NaN between calls (stale partials) changes
    nothing, because the split kernel writes every partial before the merge reads it."""
    device = kernel_device()
    decode._SCRATCH.held.clear()
    case = DecodeCase(120, (120,), 1, 20, hq=4, hkv=2)
    q, k_full, v_full, _ = make_cache(gen, case, 1, device)
    q8 = randn(gen, 1, 8, 1, 32, dtype=F32, device=device)
    buffers = []
    for n, splits, query in ((40, 3, q), (57, 3, q), (120, 3, q), (57, 2, q), (57, 2, q8),
                             (90, 3, q)):
        k_cache, v_cache = k_full[:, :, :n].contiguous(), v_full[:, :, :n].contiguous()
        with torch.no_grad():
            got = rerope.rerope_decode(query, k_cache, v_cache, case.window,
                                       num_splits=splits)
            held = _held_partials(q.device)
            assert held[0] == (splits, query.shape[1], 32), n
            buffers.append(held[1])
            held[1].fill_(float("nan"))
            held[2].fill_(float("nan"))
            again = rerope.rerope_decode(query, k_cache, v_cache, case.window,
                                         num_splits=splits)
            assert _held_partials(q.device)[1] is held[1]     # the same buffer, reused
            with monkeypatch.context() as m:                # nothing kept: a new buffer
                m.setattr(decode, "SCRATCH_BYTES", 0)
                m.setattr(decode._SCRATCH, "held", {})
                fresh = rerope.rerope_decode(query, k_cache, v_cache, case.window,
                                             num_splits=splits)
                assert not decode._SCRATCH.held
        assert torch.equal(got, again) and torch.equal(got, fresh), f"{n} keys"
        if query is q:
            want = oracle(q, k_cache, v_cache, _lengths(n), case)
            assert not close_problems(f"{n} keys", got, want, tolerance(F32))
    # one buffer while the shape stays; a new one for 2 splits, 8 heads, 3 splits again
    assert buffers[0] is buffers[1] is buffers[2]
    assert buffers[3] is not buffers[2] and buffers[4] is not buffers[3]
    assert buffers[5] is not buffers[4] and buffers[5] is not buffers[0]


def test_kept_partials_per_thread_and_not_under_filled_memory(monkeypatch, gen):
    """Another thread gets a buffer of its own (two threads' launches would interleave on
    one); under ``poisoned_empty`` (torch fills uninitialised memory with NaN) every call
    gets a new, poisoned buffer, not the kept one, so an unwritten partial still shows."""
    import threading

    device = kernel_device()
    case = DecodeCase(64, (64,), 1, 10, hq=4, hkv=2)
    q, k_cache, v_cache, _ = make_cache(gen, case, 1, device)
    with torch.no_grad():
        mine = rerope.rerope_decode(q, k_cache, v_cache, case.window, num_splits=2)
    held = _held_partials(q.device)
    theirs = {}

    def other():
        with torch.no_grad():
            theirs["out"] = rerope.rerope_decode(q, k_cache, v_cache, case.window,
                                                 num_splits=2)
        theirs["held"] = _held_partials(q.device)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert torch.equal(theirs["out"], mine)
    assert theirs["held"][1].data_ptr() != held[1].data_ptr()
    assert _held_partials(q.device)[1] is held[1]
    seen = []
    real = decode._partials
    monkeypatch.setattr(decode, "_partials", lambda *a: seen.append(real(*a)) or seen[-1])
    with poisoned_empty(), torch.no_grad():
        poisoned = rerope.rerope_decode(q, k_cache, v_cache, case.window, num_splits=2)
    assert torch.equal(poisoned, mine)
    assert seen and seen[0][0].data_ptr() != held[1].data_ptr()


@pytest.mark.gpu
@needs_gpu
def test_gpu_partials_kept_on_the_default_stream_only(monkeypatch, gen):
    """On a GPU the kept buffer serves the legacy default stream only: a call on a side
    stream gets a new one (its work is ordered on that stream alone), and so does a CUDA
    graph's capture (from the graph's pool); replays and eager calls between them give the
    eager call's bits."""
    case = DecodeCase(600, (600,), 1, 64, hq=8, hkv=2, d=64, dtype=F16)
    q, k_cache, v_cache, _ = make_cache(gen, case, 1, "cuda")
    decode._SCRATCH.held.clear()
    call = lambda: rerope.rerope_decode(q, k_cache, v_cache, case.window,   # noqa: E731
                                        num_splits=4)
    with torch.no_grad():
        eager = call()
        held = _held_partials(q.device)
        seen = []
        real = decode._partials
        monkeypatch.setattr(decode, "_partials", lambda *a: seen.append(real(*a)) or seen[-1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        assert len(seen) == 2 and all(p[0].data_ptr() != held[1].data_ptr() for p in seen)
        assert _held_partials(q.device)[1] is held[1]
        for _ in range(3):
            graph.replay()
            again = call()
        torch.cuda.synchronize()
    assert torch.equal(on_side, eager) and torch.equal(captured, eager)
    assert torch.equal(again, eager)


# --- gradients refused; Self-Extend ----------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache"])
def test_decode_refuses_inputs_that_want_gradients(name, gen):
    """``rerope_decode`` has no backward: with grad mode on, an input that requires grad used to
    give an output cut from the graph (no error, no gradient). Now: a clear error naming the
    input; under ``torch.no_grad()`` the same call runs."""
    device = kernel_device()
    tensors = {"q": randn(gen, 1, 2, 1, 16, dtype=F32, device=device),
               "k_cache": randn(gen, 1, 1, 9, 16, dtype=F32, device=device),
               "v_cache": randn(gen, 1, 1, 9, 16, dtype=F32, device=device)}
    tensors[name].requires_grad_()
    with pytest.raises(ValueError, match=f"{name} requires grad, but rerope_decode is "
                                         "forward-only.*use rerope.rerope for gradients"):
        rerope.rerope_decode(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4)
    with torch.no_grad():
        out = rerope.rerope_decode(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4)
    want = reference.rerope_from_relative_positions(
        *(t.detach().double() for t in tensors.values()), 4, rotated=True)
    assert not results_problems({"out": out}, {"out": want}, tolerance(F32))
    # rerope.rerope with grad mode on takes the differentiable path and gives gradients
    out = rerope.rerope(tensors["q"], tensors["k_cache"], tensors["v_cache"], 4, rotated=True)
    assert out.requires_grad
    out.sum().backward()
    assert tensors[name].grad is not None


@pytest.mark.parametrize("n_max, lengths, n_q, window, group, hq, hkv, rotated", [
    (70, (70,), 1, 16, 4, 2, 1, True),            # G divides the 16-key tile: the angle split
    (70, (70, 33), 3, 12, 3, 4, 2, True),         # G does not: one table row per key
    (90, (90, 41, 2), 2, 32, 32, 2, 2, True),     # G larger than a tile
    (64, (64, 50), 1, 8, 8, 2, 1, False),         # a raw cache
])
def test_decode_matches_the_prefill_op(n_max, lengths, n_q, window, group, hq, hkv, rotated, gen):
    device = kernel_device()
    batch = len(lengths)
    q = randn(gen, batch, hq, n_q, 32, dtype=F32, device=device)
    k_cache = randn(gen, batch, hkv, n_max, 32, dtype=F32, device=device)
    v_cache = randn(gen, batch, hkv, n_max, 32, dtype=F32, device=device)
    for b, length in enumerate(lengths):          # slots past a row's length are never read
        k_cache[b, :, length:] = float("nan")
        v_cache[b, :, length:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with poisoned_empty():
        got = rerope.rerope_decode(q, k_cache, v_cache, window, cache_seqlens=seqlens,
                                   rotated=rotated, group=group)
    for b, length in enumerate(lengths):
        rows = [t[b:b + 1] for t in (q, k_cache[:, :, :length], v_cache[:, :, :length])]
        # inputs that require grad: rerope.rerope runs its prefill kernels, not the decode one
        want = rerope.rerope(*(t.clone().requires_grad_() for t in rows), window,
                             rotated=rotated, group=group).detach()
        oracle = reference.rerope_from_relative_positions(
            *(t.double() for t in rows), window, rotated=rotated, group=group)
        problems = (close_problems(f"row {b} vs prefill", got[b:b + 1], want, tolerance(F32))
                    + close_problems(f"row {b} vs oracle", got[b:b + 1].double(), oracle,
                                     tolerance(F32)))
        assert not problems, describe(gen, lengths=lengths, group=group) + "\n".join(problems)
