"""Which tiles the kernels visit, and with which product: :mod:`rerope.regions` by brute force.

The contract, per tile of ``OTHER_BLOCK`` along the axis a program walks (its own rows are the
``SELF_BLOCK`` queries of the forward/dQ programs, or keys of the dK/dV programs):

* every valid pair (in range, and causal if so) with ``|i - j| < w`` is seen by exactly one
  ``q1·k1`` pass, and every valid pair with ``|i - j| >= w`` by exactly one ``q2·k2`` pass;
* an unmasked ("clean") pass only visits tiles whose pairs are all valid, all of its kind, and
  entirely inside the sequence (it loads without masks);
* every walk starts on the tile grid (the kernels promise ``tl.multiple_of``);
* tiles without any valid pair are skipped (not a correctness matter: wasted work).

Two ways in: :func:`rerope.regions.tile_map` (the book's drawing, run through the kernels' own
``_schedule``) for a few cases — slow under the interpreter, about a second per map — and a
vectorized probe of ``_schedule`` itself for thousands of ``(N, window, block)`` cases in one
launch per block shape, which also counts visits exactly (``tile_map`` sums bit flags, so a
tile visited twice by one pass would alias another flag).

The block shapes are those of every launch configuration in :mod:`rerope.configs` (the CPU
kernel tests only ever run 16 × 16 tiles).
"""

import pytest
import torch

from rerope import configs, regions   # first: decides Triton's mode before triton is imported
from rerope.regions import _schedule
from rerope_testing import kernel_device

import triton  # noqa: E402  (isort: skip)
import triton.language as tl  # noqa: E402  (isort: skip)

IN, OUT = "inside", "outside"


def cdiv(a, b):
    return -(-a // b)


class PairStats:
    """Brute force over every (query, key) pair of a sequence, reduced per (program row, tile):
    the least and largest ``|i - j|`` among the tile's valid pairs, and whether all of its pairs
    are valid (padding rows of a program's own block never count: their results are never
    stored). Window-independent, so one instance serves every window."""

    def __init__(self, n_ctx, block_self, block_other, causal, self_is_query):
        rows, tiles = cdiv(n_ctx, block_self), cdiv(n_ctx, block_other)
        own = torch.arange(rows * block_self)[:, None]
        other = torch.arange(tiles * block_other)[None, :]
        q, k = (own, other) if self_is_query else (other, own)
        real = own < n_ctx
        valid = real & (other < n_ctx)
        if causal:
            valid = valid & (k <= q)
        distance = (q - k).abs()
        big = 1 << 30

        def per_tile(m):
            return m.view(rows, block_self, tiles, block_other).transpose(1, 2).flatten(2)

        self.min_valid = per_tile(torch.where(valid, distance, big)).amin(-1)
        self.max_valid = per_tile(torch.where(valid, distance, -1)).amax(-1)
        self.all_valid = per_tile(valid | ~real).all(-1)

    def truth(self, window):
        """``(any_in, any_out, clean_in, clean_out)``, each ``[row][tile]``: does the tile hold
        valid pairs inside / outside the window; may a clean (unmasked) pass of that kind visit
        it (all pairs valid and of that kind)?"""
        any_in = self.min_valid < window
        any_out = self.max_valid >= window
        return (any_in.tolist(), any_out.tolist(), (self.all_valid & ~any_out).tolist(),
                (self.all_valid & ~any_in).tolist())


def visit_problems(visits, truth, where):
    """Check one program's visit counts ``visits[pass] = [count per tile]`` against ``truth``
    (that row of :meth:`PairStats.truth`). ``pass`` is ``(product, clean)``.

    Returns ``(problems, wasted)``: contract violations, and visits to tiles that hold no valid
    pair at all.
    """
    n_tiles = len(visits[(IN, True)])
    any_in, any_out, clean_in, clean_out = truth
    problems, wasted = [], 0
    for tile in range(n_tiles):
        for product, has, clean_ok in ((IN, any_in, clean_in), (OUT, any_out, clean_out)):
            clean, masked = int(visits[(product, True)][tile]), int(visits[(product, False)][tile])
            if has[tile] and clean + masked != 1:
                problems.append(f"{where}: tile {tile}: {product} pairs seen {clean + masked} "
                                f"times ({clean} clean, {masked} masked)")
            if not has[tile] and clean:
                problems.append(f"{where}: tile {tile}: clean {product} pass on a tile without "
                                f"valid {product} pairs")
            if clean and not clean_ok[tile]:
                problems.append(f"{where}: tile {tile}: clean {product} pass on a tile that needs "
                                "masks")
        if not (any_in[tile] or any_out[tile]):
            wasted += sum(int(visits[(p, c)][tile]) for p in (IN, OUT) for c in (True, False))
    return problems, wasted


# --- tile_map, the book's drawing ---------------------------------------------------------------


def decode(flags_row):
    """``tile_map`` flags of one row to visit counts (flags are sums of distinct bits)."""
    def bit(flag):
        return [int(bool(f & flag)) for f in flags_row]

    return {(IN, True): bit(regions.INSIDE_CLEAN), (IN, False): bit(regions.INSIDE_MASKED),
            (OUT, True): bit(regions.OUTSIDE_CLEAN), (OUT, False): bit(regions.OUTSIDE_MASKED)}


TILE_MAP_CASES = [
    # n_ctx, window, block_self, block_other, causal, self_is_query
    (77, 16, 16, 16, True, True), (77, 17, 16, 16, False, True), (77, 1, 16, 16, True, False),
    (77, 33, 16, 16, False, False), (1, 1, 16, 16, True, True), (40, 100, 16, 16, True, False),
    (300, 65, 128, 64, True, True), (300, 64, 64, 128, True, False),
    (200, 31, 64, 32, False, True), (200, 40, 32, 64, False, False),
]


@pytest.mark.parametrize("n_ctx, window, block_self, block_other, causal, self_is_query",
                         TILE_MAP_CASES)
def test_tile_map(n_ctx, window, block_self, block_other, causal, self_is_query):
    flags = regions.tile_map(n_ctx, window, block_self, block_other, causal=causal,
                             self_is_query=self_is_query)
    assert flags.shape == (cdiv(n_ctx, block_self), cdiv(n_ctx, block_other))
    assert int(flags.min()) >= 0 and int(flags.max()) <= 15, "a flag was added twice"
    truth = PairStats(n_ctx, block_self, block_other, causal, self_is_query).truth(window)
    problems = []
    for row in range(flags.shape[0]):
        found, _ = visit_problems(decode(flags[row].tolist()), [t[row] for t in truth],
                                  f"row {row}")
        problems += found
    assert not problems, "\n".join(problems[:20])
    # the package's own checker agrees
    assert regions.tile_problems(flags, n_ctx, window, block_self, block_other, causal=causal,
                                 self_is_query=self_is_query) == []


def test_checker_catches_a_wrong_map():
    """The brute force is not vacuous: a band tile missing its q2·k2 pass, or a clean pass on
    the diagonal, is reported."""
    n_ctx, window, block = 64, 16, 16
    flags = regions.tile_map(n_ctx, window, block, block, causal=True, self_is_query=True)
    truth = [t[2] for t in PairStats(n_ctx, block, block, True, True).truth(window)]
    row = flags[2].tolist()               # queries 32..47: tile 1 (keys 16..31) is a band tile
    assert visit_problems(decode(row), truth, "row 2")[0] == []
    broken = list(row)
    broken[1] &= ~regions.OUTSIDE_MASKED
    assert visit_problems(decode(broken), truth, "row 2")[0]
    broken = list(row)
    broken[2] = regions.INSIDE_CLEAN      # the diagonal tile needs the causal mask
    assert visit_problems(decode(broken), truth, "row 2")[0]
    broken = list(row)
    broken[3] = regions.INSIDE_MASKED     # beyond the diagonal: nothing valid there
    assert visit_problems(decode(broken), truth, "row 2")[1]


# --- _schedule itself, vectorized --------------------------------------------------------------


@triton.jit
def _store_walk(Out, walk, offs, mask):
    lo1, hi1, lo2, hi2 = walk
    zero = offs * 0
    tl.store(Out + offs * 20 + 0, lo1 + zero, mask=mask)
    tl.store(Out + offs * 20 + 1, hi1 + zero, mask=mask)
    tl.store(Out + offs * 20 + 2, lo2 + zero, mask=mask)
    tl.store(Out + offs * 20 + 3, hi2 + zero, mask=mask)


@triton.jit
def _schedule_probe(Out, Start, N, Window, count, SELF_BLOCK: tl.constexpr,
                    OTHER_BLOCK: tl.constexpr, CAUSAL: tl.constexpr, SELF_IS_QUERY: tl.constexpr,
                    BLOCK: tl.constexpr):
    """``regions._schedule`` for ``BLOCK`` cases at once (start, n_ctx, window as vectors)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    start = tl.load(Start + offs, mask=mask, other=0)
    n_ctx = tl.load(N + offs, mask=mask, other=1)
    window = tl.load(Window + offs, mask=mask, other=1)
    outside_clean, inside_clean, band, edge_inside, edge_outside = _schedule(
        start, SELF_BLOCK, OTHER_BLOCK, n_ctx, window, CAUSAL, SELF_IS_QUERY)
    _store_walk(Out, outside_clean, offs, mask)
    _store_walk(Out + 4, inside_clean, offs, mask)
    _store_walk(Out + 8, band, offs, mask)
    _store_walk(Out + 12, edge_inside, offs, mask)
    _store_walk(Out + 16, edge_outside, offs, mask)


def walk_tiles(lo1, hi1, lo2, hi2, block):
    """Tile starts a kernel's loop visits for a walk, exactly as ``_nth_tile`` enumerates them."""
    n1 = cdiv(max(hi1 - lo1, 0), block)
    n2 = cdiv(max(hi2 - lo2, 0), block)
    return [lo1 + t * block for t in range(n1)] + [lo2 + t * block for t in range(n2)]


# (walk index, product, clean) for the six passes every kernel runs
PASSES = [(0, OUT, True), (1, IN, True), (2, IN, False), (2, OUT, False), (3, IN, False),
          (4, OUT, False)]

SEQ_LENS = [1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 200, 257, 300]
WINDOWS = [1, 2, 3, 4, 14, 15, 16, 17, 18, 19, 30, 31, 32, 33, 34, 35, 63, 64, 65, 66, 100, 127,
           128, 129, 130, 200, 255, 256, 257, 1000]


def block_shapes():
    """(block_self, block_other, self_is_query) of every launch configuration, plus the
    interpreter's 16 × 16."""
    shapes = {(16, 16, True), (16, 16, False)}
    for kernel in configs._CANDIDATES:
        tables = (configs._CANDIDATES[kernel], configs._FUSED_CANDIDATES.get(kernel, {}))
        for candidates in (c for table in tables for c in table.values()):
            for block_m, block_n, _, _ in candidates:
                shapes.add((block_n, block_m, False) if kernel == "dkdv"
                           else (block_m, block_n, True))
    return sorted(shapes)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block_self, block_other, self_is_query", block_shapes(),
                         ids=lambda v: str(v))
def test_schedule_by_brute_force(block_self, block_other, self_is_query, causal):
    cases = [(start, n, w) for n in SEQ_LENS for w in WINDOWS
             for start in range(0, n, block_self)]
    device = kernel_device()
    starts, lens, windows = (torch.tensor(c, dtype=torch.int32, device=device)
                             for c in zip(*cases))
    out = torch.full((len(cases), 20), -1, dtype=torch.int32, device=device)
    block = 1024
    _schedule_probe[(cdiv(len(cases), block),)](
        out, starts, lens, windows, len(cases), SELF_BLOCK=block_self, OTHER_BLOCK=block_other,
        CAUSAL=causal, SELF_IS_QUERY=self_is_query, BLOCK=block)
    walks = out.view(len(cases), 5, 4).cpu().tolist()
    problems, wasted, stats, truths = [], 0, {}, {}
    for (start, n, w), case_walks in zip(cases, walks):
        if n not in stats:
            stats[n] = PairStats(n, block_self, block_other, causal, self_is_query)
        if (n, w) not in truths:
            truths[(n, w)] = stats[n].truth(w)
        truth = [t[start // block_self] for t in truths[(n, w)]]
        n_tiles = cdiv(n, block_other)
        visits = {(p, c): [0] * n_tiles for p in (IN, OUT) for c in (True, False)}
        for index, product, clean in PASSES:
            lo1, hi1, lo2, hi2 = case_walks[index]
            for tile_start in walk_tiles(lo1, hi1, lo2, hi2, block_other):
                if tile_start % block_other or not 0 <= tile_start < n_tiles * block_other:
                    problems.append(f"N={n} w={w} start={start}: walk {index} visits a tile at "
                                    f"{tile_start} (tiles of {block_other}, {n_tiles} tiles)")
                    continue
                visits[(product, clean)][tile_start // block_other] += 1
        found, waste = visit_problems(visits, truth, f"N={n} w={w} start={start}")
        problems += found
        wasted += waste
    assert not problems, f"{len(problems)} problems, e.g.\n" + "\n".join(problems[:15])
    assert wasted == 0, f"{wasted} visits to tiles with no valid pair"
