"""``return_lse=True`` on ``rerope``, ``rerope_attention`` and ``rerope_decode``.

The log-sum-exp is natural-log ``log Σ_j exp(s_ij)`` over each row's unmasked scaled scores,
float32 ``(B, Hq, Nq)``, checked against the float64 references
(``rerope.reference.rerope_with_lse``, ``rerope_attention_with_lse``) on fresh random inputs;
it is not differentiable, the output and its gradients are the same as without it, the decode
merge writes it for any split count, and it merges partial attentions exactly (the reason
engines want it). Tiny CPU sizes; ``-m gpu`` a larger case.
"""

import pytest
import torch

import rerope
from rerope import reference, rope
from rerope_testing import close_problems, describe, kernel_device, poisoned_empty, randn, tolerance

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def lse_tolerance(dtype):
    """The lse is a float32 row statistic: judged with the fp32 row for fp32 inputs, the
    dtype's row otherwise (its inputs were rounded)."""
    return tolerance(dtype)


def qkv(gen, b, hq, hkv, nq, nk, d, dtype, device=None):
    device = device or kernel_device()
    return (randn(gen, b, hq, nq, d, dtype=dtype, device=device),
            randn(gen, b, hkv, nk, d, dtype=dtype, device=device),
            randn(gen, b, hkv, nk, d, dtype=dtype, device=device))


CASES = [  # (B, Hq, Hkv, Nq, Nk, D, window, dtype, causal, options)
    (1, 2, 1, 19, 19, 16, 5, F32, True, {}),
    (2, 2, 2, 7, 23, 16, 1, F32, True, {"rotated": True}),              # w = 1, Nq < Nk
    (1, 4, 2, 17, 17, 32, 64, F16, False, {}),                          # w >= N
    (1, 2, 1, 13, 21, 16, 4, BF16, True, {"leaky": 4.0, "logn_len": 8.0}),
    (1, 2, 1, 18, 18, 16, 4, F32, True, {"group": 2}),
]


def case_id(case):
    b, hq, hkv, nq, nk, d, w, dtype, causal, options = case
    return (f"B{b}H{hq}kv{hkv}q{nq}k{nk}D{d}w{w}-{str(dtype)[6:]}-"
            f"{'causal' if causal else 'full'}" + "".join(f"-{k}{v}" for k, v in options.items()))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rerope_lse_matches_reference(gen, case):
    b, hq, hkv, nq, nk, d, w, dtype, causal, options = case
    q, k, v = qkv(gen, b, hq, hkv, nq, nk, d, dtype)
    with poisoned_empty():
        out, lse = rerope.rerope(q, k, v, w, causal=causal, return_lse=True, **options)
    want_out, want_lse = reference.rerope_with_lse(q.double(), k.double(), v.double(), w,
                                                   causal=causal, **options)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, nq)
    problems = (close_problems("out", out, want_out, tolerance(dtype))
                + close_problems("lse", lse, want_lse, lse_tolerance(dtype)))
    assert not problems, describe(gen, case=case_id(case)) + "\n" + "\n".join(problems)


def test_rerope_attention_lse_matches_reference(gen):
    q1, q2 = (randn(gen, 1, 2, 15, 16, dtype=F32, device=kernel_device()) for _ in range(2))
    k1, k2, v = (randn(gen, 1, 1, 15, 16, dtype=F32, device=kernel_device()) for _ in range(3))
    out, lse = rerope.rerope_attention(q1, q2, k1, k2, v, 4, return_lse=True)
    want_out, want_lse = reference.rerope_attention_with_lse(
        *(t.double() for t in (q1, q2, k1, k2, v)), 4)
    problems = (close_problems("out", out, want_out, tolerance(F32))
                + close_problems("lse", lse, want_lse, tolerance(F32)))
    assert not problems, "\n".join(problems)


def test_lse_is_not_differentiable_and_grads_unchanged(gen):
    q, k, v = (t.requires_grad_() for t in qkv(gen, 1, 2, 1, 11, 11, 16, F32))
    out, lse = rerope.rerope(q, k, v, 4, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn(out.shape, generator=gen).to(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out2 = rerope.rerope(q, k, v, 4)
    assert torch.equal(out, out2)
    grads2 = torch.autograd.grad(out2, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # the lse's own graph: a loss mixing in the lse still differentiates through out only
    out3, lse3 = rerope.rerope(q, k, v, 4, return_lse=True)
    (out3.sum() + lse3.sum()).backward()
    assert q.grad is not None


def test_lse_with_grad_five_tensor_form(gen):
    tensors = [randn(gen, 1, 2, 9, 16, dtype=F32, device=kernel_device()).requires_grad_()
               for _ in range(5)]
    out, lse = rerope.rerope_attention(*tensors, 3, return_lse=True)
    assert not lse.requires_grad
    out.sum().backward()
    assert all(t.grad is not None for t in tensors)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_lse_matches_reference(gen, num_splits, paged):
    b, hq, hkv, nq, d, n_max, w = 2, 4, 2, 2, 32, 32, 7
    q, k, v = qkv(gen, b, hq, hkv, nq, n_max, d, F32)
    lengths = torch.tensor([19, 32], dtype=torch.int32)
    kwargs = dict(cache_seqlens=lengths, num_splits=num_splits, rotated=False,
                  return_lse=True)
    if paged:
        pages = k.transpose(1, 2).reshape(b * 2, 16, hkv, d)
        vpages = v.transpose(1, 2).reshape(b * 2, 16, hkv, d)
        table = torch.arange(b * 2, dtype=torch.int32).view(b, 2)
        with poisoned_empty():
            out, lse = rerope.rerope_decode(q, pages, vpages, w, block_table=table, **kwargs)
    else:
        with poisoned_empty():
            out, lse = rerope.rerope_decode(q, k, v, w, **kwargs)
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    for row in range(b):
        n = int(lengths[row])
        want_out, want_lse = reference.rerope_with_lse(
            q[row:row + 1].double(), k[row:row + 1, :, :n].double(),
            v[row:row + 1, :, :n].double(), w)
        problems = (close_problems("out", out[row:row + 1], want_out, tolerance(F32))
                    + close_problems("lse", lse[row:row + 1], want_lse, tolerance(F32)))
        assert not problems, "\n".join(problems)


def test_decode_through_rerope_returns_lse(gen):
    """A ``rerope`` call that is a decode step goes to the split-KV kernel: with its lse."""
    q, k, v = qkv(gen, 1, 2, 1, 3, 24, 16, F32)
    out, lse = rerope.rerope(q, k, v, 5, return_lse=True)
    want_out, want_lse = reference.rerope_with_lse(q.double(), k.double(), v.double(), 5)
    assert not close_problems("lse", lse, want_lse, tolerance(F32))
    assert not close_problems("out", out, want_out, tolerance(F32))


def test_lse_merges_partial_attention_exactly(gen):
    """What engines use the lse for: attention over keys split in two parts (cascade /
    chunked attention) merges back, ``out = Σ_p exp(lse_p - lse) out_p``. With ``w`` at
    least the sequence, ReRoPE is plain RoPE, so the parts are two rerope calls on rotated
    inputs: the part before the chunk (not causal: all of it is in the past) and the
    chunk itself."""
    n_prefix, n_chunk, d = 12, 7, 16
    q, k, v = qkv(gen, 1, 2, 1, n_chunk, n_prefix + n_chunk, d, F32)
    positions = torch.arange(n_prefix + n_chunk, dtype=torch.float64)
    q = rope.apply_rope(q.double(), positions[n_prefix:]).float()
    k = rope.apply_rope(k.double(), positions).float()
    big = 10 * (n_prefix + n_chunk)
    whole, lse = rerope.rerope(q, k, v, big, rotated=True, return_lse=True)
    # the prefix part: each query sees every prefix key; positions stay absolute since the
    # inputs are rotated (relative positions come out of the rotations)
    o1, l1 = rerope.rerope(q, k[:, :, :n_prefix], v[:, :, :n_prefix], big, causal=False,
                           rotated=True, return_lse=True)
    o2, l2 = rerope.rerope(q, k[:, :, n_prefix:], v[:, :, n_prefix:], big, rotated=True,
                           return_lse=True)
    merged_lse = torch.logaddexp(l1, l2)
    merged = (torch.exp(l1 - merged_lse)[..., None] * o1
              + torch.exp(l2 - merged_lse)[..., None] * o2)
    assert torch.allclose(merged_lse, lse, atol=1e-5)
    assert torch.allclose(merged, whole, atol=1e-5)


def test_return_lse_must_be_a_bool(gen):
    q, k, v = qkv(gen, 1, 2, 1, 4, 4, 16, F32)
    for call in (lambda: rerope.rerope(q, k, v, 2, return_lse=1),
                 lambda: rerope.rerope_decode(q, k, v, 2, return_lse="yes")):
        with pytest.raises(TypeError, match="return_lse"):
            call()


def test_decode_lse_under_compile(gen):
    """Compiled, the decode takes its own op (``torch.ops.rerope.rerope_decode_lse``): the
    same output and lse as eagerly; the op passes ``torch.library.opcheck``."""
    q, k, v = qkv(gen, 1, 2, 1, 1, 8, 16, F32)
    assert_compiled_equals_eager(lambda q, k, v: rerope.rerope_decode(q, k, v, 3,
                                                                      return_lse=True), q, k, v)
    torch.library.opcheck(torch.ops.rerope.rerope_decode_lse.default,
                          (q, k, v, None, 3, None, 10000.0, None, None, True, None, None,
                           None, None), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gpu_lse(gen, dtype):
    q, k, v = qkv(gen, 2, 8, 2, 700, 1100, 128, dtype, device="cuda")
    out, lse = rerope.rerope(q, k, v, 256, return_lse=True, rotated=True)
    want_out, want_lse = reference.rerope_with_lse(q.double(), k.double(), v.double(), 256,
                                                   rotated=True)
    problems = (close_problems("out", out, want_out, tolerance(dtype))
                + close_problems("lse", lse, want_lse, tolerance(dtype)))
    qd = q[:, :, -1:].contiguous()
    out_d, lse_d = rerope.rerope_decode(qd, k, v, 256, return_lse=True)
    problems += close_problems("decode lse", lse_d, want_lse[:, :, -1:], tolerance(dtype))
    assert not problems, "\n".join(problems)


def test_rerope_lse_under_compile(gen):
    """The compiled path (the ``torch.library`` op) returns the same lse."""
    q, k, v = qkv(gen, 1, 2, 1, 20, 20, 16, F32)
    assert_compiled_equals_eager(lambda q, k, v: rerope.rerope(q, k, v, 5, return_lse=True),
                                 q, k, v)


def assert_compiled_equals_eager(call, *args):
    """``call(*args) -> (out, lse)`` compiled whole (``fullgraph``) gives the eager bits."""
    out, lse = torch.compile(call, backend="eager", fullgraph=True)(*args)
    want_out, want_lse = call(*args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
