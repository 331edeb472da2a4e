"""Checkers for chapter 12's exercises. Each returns ``"correct"`` or says what is wrong."""

import torch

CORRECT = "correct"


def check_smallest_leak(fn):
    """``fn(window, train_len, length)``: the smallest integer factor ``k`` for which Leaky
    ReRoPE's largest relative position, ``w + (L - 1 - w) / k`` (query ``L - 1``, key ``0``), is at
    most ``train_len - 1``, the largest the model was trained on."""
    for w, t, n in ((2048, 8192, 65536), (512, 4096, 65536), (1024, 4096, 16384), (64, 256, 4096),
                    (100, 1000, 900)):
        got = fn(w, t, n)
        if got is None:
            return "not solved yet: it returned None"
        k = 1
        while w + (n - 1 - w) / k > t - 1:
            k += 1
        if got != k:
            return f"w={w}, T={t}, L={n}: got {got}, want {k}"
    return CORRECT


def check_loss_kernel(loss_kernel):
    """``loss_kernel(Logits, Targets, Loss, vocab, stride, BLOCK_V: tl.constexpr)``, one program
    per row of a float32 ``(rows, vocab)`` ``Logits`` (row stride ``stride``), must write
    ``Loss[row] = logsumexp(Logits[row]) - Logits[row, Targets[row]]`` (float32), reading the
    row in blocks of ``BLOCK_V`` with a running maximum and sum (an online logsumexp), so that no
    block's ``exp`` overflows.

    Cases: a vocabulary that is a multiple of the block, a ragged one, rows with logits near
    1e4 (a kernel that exponentiates without subtracting the maximum gives inf), and a strided
    view. Reports the case and the wrong rows.
    """

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    cases = (("vocab 256, BLOCK_V 64", 5, 256, 64, 1.0, False),
             ("vocab 1000, BLOCK_V 128 (ragged last block)", 4, 1000, 128, 3.0, False),
             ("logits near 1e4", 3, 300, 64, 1e4, False),
             ("a strided view (every other row of a wider tensor)", 3, 200, 64, 2.0, True))
    for what, rows, vocab, block, scale, strided in cases:
        logits = torch.randn(rows * (2 if strided else 1), vocab + (8 if strided else 0),
                             generator=gen) * scale
        if scale > 100:
            logits = logits.abs() / 10 + scale
        if strided:
            logits = logits[::2, :vocab]
        targets = torch.randint(0, vocab, (rows,), generator=gen)
        want = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")
        logits, targets = logits.to(device), targets.to(device)
        out = torch.full((rows,), float("nan"), device=device)
        loss_kernel[(rows,)](logits, targets, out, vocab, logits.stride(0), BLOCK_V=block)
        bad = [r for r in range(rows) if not abs(float(out[r]) - float(want[r])) <= 1e-3 * (
            1 + abs(float(want[r])))]
        if bad:
            return (f"{what}: rows {bad} wrong, got {out.cpu()[bad].tolist()}, want "
                    f"{want[bad].tolist()}")
    return CORRECT
