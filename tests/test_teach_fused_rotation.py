"""Chapter 7's teaching kernel (rerope.teach.fused_rotation) against the float64 oracle and
against the finished op, ``rerope.rerope`` on raw ``q, k``."""

import pytest
import torch

import rerope
from rerope import reference
from rerope.teach import fused_rotation
from conftest import close_problems, kernel_device, randn, tolerance

# (N, window, causal, Hq, Hkv): odd lengths; windows that put i − j = w − 1 and w inside one
# 16 × 16 tile and across tiles, w = 1 (RoPE on the diagonal only), w >= N (plain RoPE)
CASES = [
    (37, 7, True, 2, 1),
    (37, 16, False, 2, 2),
    (45, 1, True, 4, 2),
    (45, 1, False, 1, 1),
    (29, 29, True, 2, 2),
    (23, 64, False, 2, 1),
]


def _inputs(gen, n, hq, hkv, d, dtype):
    q = randn(gen, 1, hq, n, d, dtype=dtype, device=kernel_device())
    k, v = (randn(gen, 1, hkv, n, d, dtype=dtype, device=kernel_device()) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, window, causal, hq, hkv", CASES)
def test_matches_oracle_and_finished_op(gen, n, window, causal, hq, hkv, dtype):
    q, k, v = _inputs(gen, n, hq, hkv, 32, dtype)
    got = fused_rotation.rerope_turning(q, k, v, window, causal=causal)
    assert got.shape == q.shape and got.dtype == dtype
    oracle = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(),
                                                      window, causal=causal)
    finished = rerope.rerope(q, k, v, window, causal=causal)
    tol = tolerance(dtype)
    problems = close_problems("vs float64", got, oracle, tol)
    problems += close_problems("vs rerope.rerope", got, finished.double(), tol)
    assert not problems, problems


def test_window_off_by_one_would_show(gen):
    """The cases above can tell w from w ± 1: the oracle moves by more than the tolerance."""
    q, k, v = _inputs(gen, 37, 2, 1, 32, torch.float32)
    args = (q.double(), k.double(), v.double())
    at_w = reference.rerope_from_relative_positions(*args, 7)
    for other in (6, 8):
        moved = reference.rerope_from_relative_positions(*args, other)
        assert close_problems("w ± 1", moved, at_w, tolerance(torch.float32))


def test_head_dim_64_and_larger_blocks(gen):
    q, k, v = _inputs(gen, 70, 2, 2, 64, torch.float32)
    got = fused_rotation.rerope_turning(q, k, v, 20, block_m=32, block_n=16)
    oracle = reference.rerope_from_relative_positions(q.double(), k.double(), v.double(), 20)
    assert not close_problems("D = 64", got, oracle, tolerance(torch.float32))


def test_table_is_float64_accurate():
    table = fused_rotation.rope_table(100_000, 64)
    p = torch.tensor([99_999.0], dtype=torch.float64)
    angles = p[:, None] * rerope.rope.rope_frequencies(64)[None, :]
    exact = torch.cat((angles.cos(), angles.sin()), -1)
    assert (table[-1:].double() - exact).abs().max() < 1e-7


def test_bad_arguments_name_the_argument(gen):
    q, k, v = _inputs(gen, 16, 2, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="window"):
        fused_rotation.rerope_turning(q, k, v, 0)
    with pytest.raises(ValueError, match="head dim"):
        fused_rotation.rerope_turning(*_inputs(gen, 16, 2, 2, 16, torch.float32), 4)
    with pytest.raises((ValueError, TypeError), match="k"):
        fused_rotation.rerope_turning(q, k[:, :, :8], v, 4)
