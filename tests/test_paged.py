"""``rerope.rerope_decode`` on a paged KV cache (``block_table``, FlashAttention's
layout).

The same data as a contiguous cache, scattered into random, non-monotone pages of a pool
``(num_blocks, block_size, Hkv, D)``: the paged call must give the contiguous call's
output (and the float64 oracle's). Every page a row does not use, and every slot past a
row's length inside its last page, is NaN; block-table entries past a row's length point
at NaN pages or out of the pool (a kernel that read one would return NaN, or fail).
Per-row lengths, GQA, ``Nq > 1``, rotated and raw caches, Leaky ReRoPE, batch > 1, pages
smaller and larger than the key tile (the interpreter's 16-key tiles, and 64-key ones).
Bad block tables raise errors naming the argument; on a GPU an out-of-range entry gives
NaN rows (no host check). The ``torch.library`` op is opchecked on a paged call, and a
paged call compiles under ``torch.compile(fullgraph=True)``. CPU (Triton's interpreter),
small and fast; ``-m gpu``: 32k-key caches in pages, a CUDA graph over a changing block
table.
"""

from dataclasses import dataclass

import pytest
import torch

import rerope
from rerope import decode, exercises, reference
from rerope_testing import close_problems, kernel_device, poisoned_empty, randn, tolerance

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


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


CASES = [
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


def oracle(q, k, v, lengths, case):
    return torch.cat([reference.rerope_from_relative_positions(
        q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(),
        case.window, causal=True, leaky=case.leaky, rotated=case.rotated, group=case.group)
        for b, n in enumerate(lengths.tolist())])


@pytest.mark.parametrize("case", CASES, ids=PagedCase.id)
def test_paged_equals_contiguous(case, gen):
    q, k, v, k_pages, v_pages, table, lengths = build(gen, case, kernel_device())
    want = decode_call(q, k, v, lengths, case)
    got = decode_call(q, k_pages, v_pages, lengths, case, block_table=table)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "the paged call read a NaN slot or page"
    problems = close_problems("paged vs contiguous", got, want, tolerance(case.dtype))
    problems += close_problems("paged vs float64", got, oracle(q, k, v, lengths, case),
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
    problems = close_problems("paged", got, oracle(q, k, v, lengths, case), tolerance(F32))
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
    assert not close_problems("row 0", got[:1], oracle(q, k, v, lengths, case)[:1],
                              tolerance(F32))


# --- bad arguments -----------------------------------------------------------------------------


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


# --- the chapter-8 exercise's checker ---------------------------------------------------------


def test_page_address_checker():
    def right(block_table, cache_seqlens, block_size):
        return [block_table[b, torch.arange(n) // block_size].long() * block_size
                + torch.arange(n) % block_size for b, n in enumerate(cache_seqlens.tolist())]

    assert exercises.check_page_slots(right) == exercises.CORRECT

    def page_only(block_table, cache_seqlens, block_size):          # forgets the slot
        return [block_table[b, torch.arange(n) // block_size].long() * block_size
                for b, n in enumerate(cache_seqlens.tolist())]

    def logical(block_table, cache_seqlens, block_size):             # ignores the table
        return [torch.arange(n) for n in cache_seqlens.tolist()]

    def swapped(block_table, cache_seqlens, block_size):             # j % and // swapped
        return [block_table[b, torch.arange(n) % block_size].long() * block_size
                + torch.arange(n) // block_size for b, n in enumerate(cache_seqlens.tolist())]

    def full_rows(block_table, cache_seqlens, block_size):           # every table entry
        width = block_table.shape[1] * block_size
        return [block_table[b, torch.arange(width) // block_size].long() * block_size
                + torch.arange(width) % block_size for b in range(block_table.shape[0])]

    def floats(block_table, cache_seqlens, block_size):
        return [s.double() for s in right(block_table, cache_seqlens, block_size)]

    def crashes(block_table, cache_seqlens, block_size):
        return block_table[99]

    exercises.assert_rejected(exercises.check_page_slots, {
        "page only": page_only, "logical slots": logical, "swapped": swapped,
        "whole table": full_rows, "floats": floats, "raises": crashes,
        "one tensor": lambda t, n, s: torch.cat(right(t, n, s))})


# --- the benchmark's reading of paged rows (no GPU) ---------------------------------------------


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


# --- GPU: full size, and a CUDA graph over a changing block table -------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    want = oracle(q, k, v, lengths.cpu(), case)
    assert not close_problems("replay", captured, want, tolerance(F16, "gpu"))
    table[2, 0] = k_pages.shape[0] + 5                      # out of the pool: no host check
    graph.replay()
    torch.cuda.synchronize()
    assert captured[2].isnan().all() and torch.isfinite(captured[:2]).all()
