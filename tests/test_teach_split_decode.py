"""Chapter 8's teaching kernels (rerope.teach.split_decode): the split kernel and the merge,
against the float64 oracle and the finished op, ``rerope.rerope_decode`` (rotated cache)."""

import pytest
import torch
import triton

import rerope
from rerope import reference
from rerope.rope import apply_rope
from rerope.teach import split_decode
from conftest import close_problems, kernel_device, randn, tolerance


def _step(gen, batch, hq, hkv, n, d, dtype):
    """A rotated cache of ``n`` keys and the new token's rotated query at ``n − 1``."""
    positions = torch.arange(n, dtype=torch.float64)
    q = apply_rope(randn(gen, batch, hq, 1, d), positions[-1:])
    k = apply_rope(randn(gen, batch, hkv, n, d), positions)
    v = randn(gen, batch, hkv, n, d)
    return [t.to(dtype).to(kernel_device()) for t in (q, k, v)]


# (N, window, Hq, Hkv, num_splits): odd lengths; the window's edge inside a tile, on a tile
# boundary, w = 1, w >= N; more splits than tiles (empty chunks), one split; GQA groups 1-4
CASES = [
    (37, 7, 4, 1, 3),
    (64, 16, 2, 2, 4),
    (45, 1, 8, 2, 5),
    (29, 40, 2, 1, 2),
    (5, 2, 2, 2, 3),
    (100, 33, 4, 4, 1),
    (61, 13, 4, 1, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, window, hq, hkv, num_splits", CASES)
def test_matches_oracle_and_finished_op(gen, n, window, hq, hkv, num_splits, dtype):
    q, k, v = _step(gen, 2, hq, hkv, n, 32, dtype)
    got = split_decode.split_decode(q, k, v, window, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == dtype
    oracle = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(),
                                                      window, rotated=True)
    finished = rerope.rerope_decode(q, k, v, window)
    tol = tolerance(dtype)
    problems = close_problems("vs float64", got, oracle, tol)
    problems += close_problems("vs rerope.rerope_decode", got, finished.double(), tol)
    assert not problems, problems


def test_default_splits_and_head_dim_64(gen):
    q, k, v = _step(gen, 1, 4, 2, 300, 64, torch.float32)
    got = split_decode.split_decode(q, k, v, 50)
    oracle = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 50,
                                                      rotated=True)
    assert not close_problems("D = 64", got, oracle, tolerance(torch.float32))


def test_partials_merge_to_one_softmax(gen):
    """Each chunk's partial and log-sum-exp, merged by hand, give the merge kernel's row."""
    q, k, v = _step(gen, 1, 2, 1, 50, 32, torch.float32)
    n_splits, block = 4, 16
    part = torch.empty(n_splits, 2, 32, device=q.device)
    lse = torch.empty(n_splits, 2, device=q.device)
    table = split_decode.rope_table(64 + block, 32, device=q.device)
    split_decode.split_kernel[(1, n_splits)](
        q.contiguous(), k.contiguous(), v.contiguous(), part, lse, table, 50, 2, n_splits, 9,
        32 ** -0.5 * 1.4426950408889634, BLOCK_M=16, BLOCK_N=block, HEAD_DIM=32,
        DOT_PRECISION="tf32x3")
    # chunks of cdiv(cdiv(50, 4), 16) * 16 = 16 keys: 0-15, 16-31, 32-47, 48-49
    assert torch.isfinite(lse).all()
    weights = torch.exp2(lse - lse.amax(0))
    by_hand = (weights[..., None] * part).sum(0) / weights.sum(0)[:, None]
    out = torch.empty(2, 32, device=q.device)
    split_decode.merge_kernel[(2,)](part, lse, out, n_splits, HEAD_DIM=32, SPLITS=4)
    torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-6)


def test_empty_chunks_weigh_nothing(gen):
    """Spare splits past the cache's end write lse = −inf and do not change the result."""
    q, k, v = _step(gen, 1, 2, 2, 5, 32, torch.float32)
    one = split_decode.split_decode(q, k, v, 2, num_splits=1)
    many = split_decode.split_decode(q, k, v, 2, num_splits=7)
    torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_the_argument(gen):
    q, k, v = _step(gen, 1, 2, 2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="window"):
        split_decode.split_decode(q, k, v, 0)
    with pytest.raises(ValueError, match="num_splits"):
        split_decode.split_decode(q, k, v, 4, num_splits=0)
    with pytest.raises(ValueError, match="q"):
        split_decode.split_decode(torch.cat([q, q], 2), k, v, 4)
