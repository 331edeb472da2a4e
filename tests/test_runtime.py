"""State that outlives a call: threads, an interrupted launch, a non-finite ``v``.

Triton's CPU interpreter is not thread-safe (it patches ``triton.language`` while a
launch runs), so the package launches under one lock there
(``rerope.runtime.INTERPRETER_LOCK``); calls from several threads then give the
single-thread bits. A decode launch interrupted part-way leaves nothing behind for the
next call. An ``inf`` in ``v`` spreads within a tile, no further (documented on the
ops).
"""

import threading

import pytest
import torch

import rerope
from rerope import reference
from rerope_testing import kernel_device


def _calls(device):
    """Small calls of each public op, each a function of no arguments."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(device) for _ in range(3))
    qd = torch.randn(2, 2, 1, 16, generator=g).to(device)
    kc, vc = (torch.randn(2, 1, 40, 16, generator=g).to(device) for _ in range(2))
    lengths = torch.tensor([40, 23], dtype=torch.int32, device=device)
    return [
        lambda: rerope.rerope(q, k, v, window=5),
        lambda: rerope.rerope(q, k, v, window=7, causal=False),
        lambda: rerope.rerope_decode(qd, kc, vc, 6, cache_seqlens=lengths,
                                     num_splits=3),
    ]


def test_threads_give_the_single_thread_bits():
    """4 threads × 3 calls each (two forward, one decode sharing one plan) equal the
    results of one thread, bit for bit."""
    calls = _calls(kernel_device())
    want = [call() for call in calls]
    got, errors = {}, []

    def work(index):
        try:
            for turn in range(len(calls)):
                which = (index + turn) % len(calls)   # threads in different ops at once
                got[index, which] = calls[which]()
        except Exception as error:                     # reported below, with its thread
            errors.append((index, repr(error)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(got) == 4 * len(calls)
    for (index, which), out in got.items():
        assert torch.equal(out, want[which]), f"thread {index}, call {which} differs"


def test_interrupted_interpreted_launch_then_next_call(monkeypatch):
    """A real interruption: the split launch raises after some programs ran (the
    interpreter's grid stops part-way); the next call is still right."""
    if not rerope.runtime.INTERPRET:
        pytest.skip("the interpreter runs programs one by one; a GPU kernel runs whole")
    decode_call = _calls("cpu")[2]
    want = decode_call()
    from triton.runtime import interpreter
    builder, programs = interpreter.interpreter_builder, []
    set_grid_idx = builder.set_grid_idx

    def stop_at_the_third_program(*index):    # the interpreter starts each program so
        programs.append(index)
        if len(programs) == 3:
            raise KeyboardInterrupt
        return set_grid_idx(*index)

    monkeypatch.setattr(builder, "set_grid_idx", stop_at_the_third_program)
    with pytest.raises(KeyboardInterrupt):
        decode_call()
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    assert len(programs) == 3, "not interrupted"
    assert torch.equal(decode_call(), want)


def test_inf_in_v_stays_within_its_tiles():
    """``inf`` in one row of ``v`` (key 200): query tiles that never read its key tile
    (causal rows below 128, whatever the tile size here) keep their exact output; the
    key's own tile rows come out non-finite, even rows that give it no weight (the
    documented limit)."""
    device = kernel_device()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 256, 16, generator=g) for _ in range(3))
    bad = v.clone()
    bad[0, 0, 200] = float("inf")
    out = rerope.rerope(q.to(device), k.to(device), bad.to(device), window=8).cpu()
    clean = rerope.rerope(q.to(device), k.to(device), v.to(device), window=8).cpu()
    assert torch.equal(out[..., :128, :], clean[..., :128, :])
    assert not out[..., 200:, :].isfinite().any()
    want = reference.rerope(q.double(), k.double(), bad.double(), window=8)
    assert want[..., 201:, :].isinf().any(-1).all()   # exactly: inf past key 200
