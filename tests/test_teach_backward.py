"""The teaching backward of chapter 5 (rerope.teach.backward) against float64 autograd
of the reference and against the gradients of the finished op, rerope_attention."""

import pytest
import torch

from conftest import (GRAD_NAMES, kernel_device, kernel_results, make_inputs,
                      reference_results, results_problems, tolerance,
                      window_contrast_inputs)
from rerope.teach.backward import ThreeRegionsAttention, _delta_kernel

NAMES = ("out",) + GRAD_NAMES

# (N, window, causal, Hq, Hkv, block_m, block_n): odd N, the window cutting through
# tiles, w = 1, w >= N, GQA (two and three query heads per key/value head), odd tiles
CASES = [
    (37, 13, True, 4, 2, 16, 16),
    (37, 13, False, 2, 2, 16, 16),
    (33, 1, True, 2, 1, 16, 16),
    (29, 40, False, 2, 2, 16, 16),
    (45, 20, True, 3, 1, 32, 16),
    (45, 7, False, 2, 1, 16, 32),
]


def teaching_results(tensors, dout, window, causal):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = ThreeRegionsAttention.apply(*leaves, window, causal, None)
    grads = torch.autograd.grad(out, leaves, dout)
    return {"out": out.detach(), **dict(zip(GRAD_NAMES, grads))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, window, causal, hq, hkv, block_m, block_n", CASES)
def test_gradients_match_reference_and_finished_op(n, window, causal, hq, hkv, block_m,
                                                   block_n, dtype, gen):
    tensors, dout = make_inputs(gen, 1, hq, hkv, n, 32, dtype)
    got = teaching_results(tensors, dout, window, causal)
    for name, t in zip(GRAD_NAMES, tensors):
        assert got[name].dtype == dtype and got[name].shape == t.shape, name
    want = reference_results(tensors, dout, window, causal)
    problems = results_problems(got, want, tolerance(dtype), NAMES)
    assert not problems, problems
    finished = kernel_results(tensors, dout, window, causal)
    problems = results_problems(got, finished, tolerance(dtype), NAMES)
    assert not problems, ["against rerope_attention: " + p for p in problems]


@pytest.mark.parametrize("strong", ["outside", "inside"])
def test_gradients_route_by_the_window_edge(strong, gen):
    # the two products differ a lot: dS routed to the wrong pair at i - j = w or w - 1
    # would be far beyond the tolerance
    tensors, dout = window_contrast_inputs(gen, 1, 2, 1, 41, 32, torch.float32, strong)
    got = teaching_results(tensors, dout, 11, True)
    want = reference_results(tensors, dout, 11, True)
    problems = results_problems(got, want, tolerance(torch.float32), NAMES)
    assert not problems, problems


def test_delta_is_the_row_sum(gen):
    bh, n, d = 3, 37, 32
    out, dout = (torch.randn(bh, n, d, generator=gen).half().to(kernel_device())
                 for _ in range(2))
    delta = torch.full((bh, n), float("nan"), device=kernel_device())
    _delta_kernel[(3, bh)](out, dout, delta, n, BLOCK_M=16, HEAD_DIM=d)
    want = (out.double() * dout.double()).sum(-1)
    torch.testing.assert_close(delta.double(), want, atol=1e-4, rtol=1e-4)
