"""The teaching forward of chapter 4 (rerope.teach.three_regions) against the float64
reference and the finished op, rerope.rerope_attention."""

import pytest
import torch

import rerope
from conftest import (kernel_device, make_inputs, reference_results, results_problems,
                      tolerance, window_contrast_inputs)
from rerope import reference
from rerope.teach.three_regions import three_regions_attention

# (N, window, causal, Hq, Hkv, block_m, block_n): odd N, the window cutting through
# tiles and on a tile edge, w = 1 (only i = j inside), w >= N (plain RoPE), GQA, taller
# query blocks
CASES = [
    (37, 13, True, 4, 2, 16, 16),
    (37, 13, False, 4, 2, 16, 16),
    (40, 16, True, 2, 1, 16, 16),
    (33, 1, True, 2, 2, 16, 16),
    (33, 1, False, 2, 2, 16, 16),
    (29, 40, False, 2, 1, 16, 16),
    (45, 20, True, 3, 1, 32, 16),
    (45, 7, False, 2, 2, 16, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, window, causal, hq, hkv, block_m, block_n", CASES)
def test_matches_reference_and_finished_op(n, window, causal, hq, hkv, block_m, block_n,
                                           dtype, gen):
    tensors, _ = make_inputs(gen, 2, hq, hkv, n, 32, dtype)
    tensors = [t.detach() for t in tensors]
    out, lse = three_regions_attention(*tensors, window, causal=causal, block_m=block_m,
                                       block_n=block_n)
    assert out.dtype == dtype and out.shape == (2, hq, n, 32)
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, n)
    no_grad = torch.zeros_like(tensors[0])
    want = reference_results(tensors, no_grad, window, causal)["out"]
    problems = results_problems({"out": out}, {"out": want}, tolerance(dtype), ["out"])
    assert not problems, problems
    finished = rerope.rerope_attention(*tensors, window, causal=causal)
    torch.testing.assert_close(out, finished, **dict(
        atol=tolerance(dtype).atol * 4, rtol=tolerance(dtype).rtol * 4))


@pytest.mark.parametrize("strong", ["outside", "inside"])
def test_the_window_edge_is_exact(strong, gen):
    # rows attend almost only to one side of the window: i - j = w counted inside (or
    # w - 1 outside) would move most of a row's weight; the oracles at w ± 1 must miss
    n, window = 41, 11
    tensors, _ = window_contrast_inputs(gen, 1, 2, 2, n, 32, torch.float32, strong)
    tensors = [t.detach() for t in tensors]
    out, _ = three_regions_attention(*tensors, window, causal=True)
    f64 = [t.double() for t in tensors]
    torch.testing.assert_close(out.double(), reference.rerope_attention(*f64, window),
                               atol=2e-5, rtol=2e-5)
    for wrong in (window - 1, window + 1):
        miss = (out.double() - reference.rerope_attention(*f64, wrong)).abs().max()
        assert miss > 0.1, (wrong, miss)


def test_lse_is_the_log2_sum_of_exponentials(gen):
    n, window = 35, 9
    tensors, _ = make_inputs(gen, 1, 2, 1, n, 16, torch.float32)
    q1, q2, k1, k2, v = (t.detach() for t in tensors)
    _, lse = three_regions_attention(q1, q2, k1, k2, v, window, causal=True)
    i = torch.arange(n)
    inside = (i[:, None] - i[None, :]).abs() < window
    scores = torch.where(inside, q1.double() @ k1.double().transpose(-1, -2),
                         q2.double() @ k2.double().transpose(-1, -2)) * 16 ** -0.5
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    want = torch.logsumexp(scores, -1) / torch.tensor(2.0, dtype=torch.float64).log()
    torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_inputs():
    q = torch.zeros(1, 2, 8, 16, device=kernel_device())
    k = torch.zeros(1, 2, 9, 16, device=kernel_device())
    with pytest.raises(ValueError, match="k1"):
        three_regions_attention(q, q, k, k, k, 4)
    with pytest.raises(ValueError, match="window"):
        three_regions_attention(q, q, q, q, q, 0)
    with pytest.raises(TypeError, match="causal"):
        three_regions_attention(q, q, q, q, q, 4, causal=1)
    with pytest.raises(ValueError, match="block_n"):
        three_regions_attention(q, q, q, q, q, 4, block_n=24)
