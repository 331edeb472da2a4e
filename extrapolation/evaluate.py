"""Evaluate the trained model past its training length with every position scheme, with no fine-tuning.

    python -m extrapolation.evaluate          # on a GPU: about a minute after the kernel compiles

Reads the weights and held-out documents that :mod:`extrapolation.train` wrote, and writes
``book/data/extrapolation_h200.json`` (``--out``): for each scheme of :func:`methods` the loss
per position (binned) over the held-out documents read at 16x the training length, the mean
loss at 1x, 2x, 4x, 8x and 16x, a window ablation, a passkey-retrieval test, and the device and
versions of the run.

Causality makes one long forward enough: the loss at position ``p`` depends only on bytes
``<= p``, and every scheme here except NTK positions depends only on ``i`` and ``i - j``, so
the first ``L`` positions of a forward at 16x are exactly a forward at length ``L``. NTK-aware
RoPE picks its base from the target length, so it runs once per length.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from . import data
from .model import Positions, load_model, token_losses
from .train import ROOT, environment

DATA = ROOT / "book" / "data"
FACTORS = (1, 2, 4, 8, 16)
BIN = 32                    # positions per bin of the stored per-position curves
PASSKEY_DEPTH = 0.1         # the passkey line sits this far into the filler


def methods(train_len):
    """The schemes of the main table: ``{key: Positions or a function length -> Positions}``.

    RoPE, NTK-aware RoPE (``α = length / train_len``), ReRoPE at windows ¼, ½ and exactly the
    training length, Leaky ReRoPE (``w = ¼``, ``κ = 16``); each with and without log-n.
    """
    out = {}
    for logn in (None, train_len):
        tag = "+logn" if logn else ""
        out["rope" + tag] = Positions("rope", logn_len=logn)
        out["ntk" + tag] = (lambda n, logn=logn: Positions(
            "ntk", ntk_alpha=max(1.0, n / train_len), logn_len=logn))
        for window in (train_len // 4, train_len // 2, train_len):
            out[f"rerope{window}" + tag] = Positions("rerope", window=window, logn_len=logn)
        out[f"leaky{train_len // 4}" + tag] = Positions("leaky", window=train_len // 4,
                                                        leaky=16.0, logn_len=logn)
    return out


def label(key, train_len):
    """The display name of a :func:`methods` key (NTK's α depends on the length)."""
    scheme = methods(train_len)[key]
    if callable(scheme):
        return "NTK-aware RoPE α=L/" + str(train_len) + (" + log-n" if "logn" in key else "")
    return scheme.name


@torch.no_grad()
def position_losses(model, docs, positions, chunk):
    """Per-document, per-position losses ``(docs, N-1)`` of ``docs`` ``(docs, N)`` bytes, in chunks."""
    parts = [token_losses(model, docs[i:i + chunk], positions) for i in range(0, len(docs), chunk)]
    return torch.cat(parts).float()


def summarise(losses, lengths, train_len):
    """Mean loss over positions ``[0, L)`` (``mean``), over the last ``train_len`` of them
    (``last``), the standard error of ``mean`` over documents, and each document's mean
    (``per_doc``, for paired comparisons), for each ``L`` in ``lengths``."""
    out = {"mean": {}, "last": {}, "stderr": {}, "per_doc": {}}
    for n in lengths:
        per_doc = losses[:, :n].mean(dim=1)
        out["per_doc"][n] = [round(x, 4) for x in per_doc.tolist()]
        out["mean"][n] = round(per_doc.mean().item(), 5)
        out["stderr"][n] = round((per_doc.std() / len(per_doc) ** 0.5).item(), 5)
        out["last"][n] = round(losses[:, n - train_len:n].mean().item(), 5)
    return out


def binned(curve, size=BIN):
    """Means of consecutive bins of ``size`` positions of a ``(N,)`` curve, as a list."""
    n = curve.numel() // size * size
    return [round(x, 4) for x in curve[:n].view(-1, size).mean(dim=1).tolist()]


def passkey_batch(docs, length, count, seed):
    """Passkey prompts of ``length + 1`` bytes: filler with ``PASSKEY = ddddd`` planted early,
    ending in ``PASSKEY = ddddd``; the last five bytes are the answer.

    Returns ``(tokens (count, length + 1) int64, answers (count, 5) int64)``, or ``None`` when
    ``length`` is too short for the prompt.
    """
    rng = random.Random(seed * 100003 + length)
    rows, answers = [], []
    for i in range(count):
        key = str(rng.randrange(10000, 100000)).encode()
        plant, query = b"\nPASSKEY = " + key + b"\n", b"\nPASSKEY = "
        budget = length + 1 - len(plant) - len(query) - len(key)
        if budget < 16:
            return None
        filler = bytes(docs[i % len(docs)].tolist())
        depth = int(PASSKEY_DEPTH * budget)
        seq = filler[:depth] + plant + filler[depth:budget] + query + key
        assert len(seq) == length + 1
        rows.append(torch.frombuffer(bytearray(seq), dtype=torch.uint8))
        answers.append(torch.frombuffer(bytearray(key), dtype=torch.uint8))
    return torch.stack(rows).long(), torch.stack(answers).long()


@torch.no_grad()
def passkey_accuracy(model, tokens, answers, positions, chunk):
    """Teacher-forced retrieval: ``(all five digits right, per-digit)`` accuracy, argmax of the logits."""
    hits = []
    for i in range(0, len(tokens), chunk):
        logits = model(tokens[i:i + chunk, :-1], positions)
        hits.append(logits[:, -5:].argmax(-1) == answers[i:i + chunk].to(logits.device))
    hits = torch.cat(hits)
    return round(hits.all(dim=1).float().mean().item(), 4), round(hits.float().mean().item(), 4)


def slice_loss(model, docs, length, positions):
    """Mean loss of the first held-out document read at ``length`` (``docs`` ``(count, >length)``).

    The chapter re-computes this on a CPU, ReRoPE through the Triton interpreter."""
    return token_losses(model, docs[:1, :length + 1], positions).mean().item()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", type=Path, default=DATA / "extrapolation_model.safetensors")
    p.add_argument("--heldout", type=Path, default=DATA / "extrapolation_heldout.safetensors")
    p.add_argument("--out", type=Path, default=DATA / "extrapolation_h200.json")
    p.add_argument("--docs", type=int, default=128, help="held-out documents to evaluate")
    p.add_argument("--chunk", type=int, default=16, help="documents per forward")
    p.add_argument("--max-factor", type=int, default=16, help="longest length / training length")
    p.add_argument("--passkey-count", type=int, default=64)
    p.add_argument("--slice-length", type=int, default=None,
                   help="length of the CPU re-check slice (default half the training length: "
                        "the Triton interpreter is slow)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", action="store_true",
                   help="only compile the kernel variants the evaluation uses (a random model of "
                        "the default config), e.g. in the background while training runs")
    return p.parse_args(argv)


@torch.no_grad()
def warmup(device):
    """Run every ReRoPE scheme once on a random default-config model, so that Triton compiles
    (and caches on disk) each kernel variant: ReRoPE and Leaky ReRoPE, with and without log-n."""
    from .model import ByteLM, ModelConfig
    cfg = ModelConfig()
    model = ByteLM(cfg).to(device).eval()
    tokens = torch.randint(0, 256, (2, 2 * cfg.train_len + 1), device=device)
    for key, scheme in methods(cfg.train_len).items():
        if not callable(scheme) and scheme.kind in ("rerope", "leaky"):
            t0 = time.perf_counter()
            token_losses(model, tokens, scheme)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"warm-up {scheme.name}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.warmup:
        return warmup(device)
    model, meta = load_model(args.weights, device=device)   # evaluated in float32
    train_len = model.cfg.train_len
    docs, names, _ = data.load_heldout(args.heldout)
    factors = [f for f in FACTORS if f <= args.max_factor]
    lengths = [train_len * f for f in factors]
    longest = lengths[-1]
    if docs.shape[1] < longest + 1:
        raise ValueError(f"held-out documents have {docs.shape[1]} bytes, need {longest + 1}")
    docs = docs[:args.docs, :longest + 1].long().to(device)
    print(f"{len(docs)} held-out documents, lengths {lengths}, model trained at {train_len} "
          f"for {meta.get('steps')} steps", flush=True)

    results = {}
    schemes = methods(train_len)
    for key, scheme in schemes.items():
        t0 = time.perf_counter()
        if callable(scheme):    # NTK: its base depends on the length, one forward per length
            per_length = {n: position_losses(model, docs[:, :n + 1], scheme(n), args.chunk)
                          for n in lengths}
            summary = {"mean": {}, "last": {}, "stderr": {}, "per_doc": {}}
            for n, losses in per_length.items():
                part = summarise(losses, [n], train_len)
                for field in summary:
                    summary[field][n] = part[field][n]
            losses = per_length[longest]
            definition = scheme(longest).as_dict() | {"ntk_alpha": "length / train_len"}
        else:
            losses = position_losses(model, docs, scheme, args.chunk)
            summary = summarise(losses, lengths, train_len)
            definition = scheme.as_dict()
        results[key] = {"label": label(key, train_len), "positions": definition, **summary,
                        "per_position": binned(losses.mean(dim=0))}
        print(f"{label(key, train_len):<36} " + "  ".join(
            f"{n}: {summary['mean'][n]:.4f}" for n in lengths)
            + f"   ({time.perf_counter() - t0:.1f} s)", flush=True)

    # window ablation at every length, ReRoPE and Leaky ReRoPE, with and without log-n
    windows = sorted({w for w in (8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 240, 256)
                      if w <= train_len} | {train_len // 4, train_len // 2, train_len})
    ablation = {"windows": windows, "lengths": lengths, "rerope": {}, "rerope+logn": {},
                "leaky_factors": [4.0, 8.0, 16.0, 32.0, 64.0], "leaky": {}, "leaky+logn": {}}
    for logn, tag in ((None, ""), (train_len, "+logn")):
        for w in windows:
            losses = position_losses(model, docs, Positions("rerope", window=w, logn_len=logn),
                                     args.chunk)
            ablation["rerope" + tag][w] = summarise(losses, lengths, train_len)
        for factor in ablation["leaky_factors"]:
            losses = position_losses(model, docs, Positions(
                "leaky", window=train_len // 4, leaky=factor, logn_len=logn), args.chunk)
            ablation["leaky" + tag][factor] = summarise(losses, lengths, train_len)
    best = min(windows, key=lambda w: ablation["rerope"][w]["mean"][longest])
    print(f"window ablation: best ReRoPE window at {longest} is {best} "
          f"({ablation['rerope'][best]['mean'][longest]:.4f})", flush=True)

    # passkey retrieval, teacher-forced, at every length
    passkey = {"depth": PASSKEY_DEPTH, "count": args.passkey_count, "lengths": [], "methods": {}}
    batches = {n: passkey_batch(docs.cpu(), n, args.passkey_count, seed=0) for n in lengths}
    batches = {n: b for n, b in batches.items() if b is not None}
    passkey["lengths"] = list(batches)
    for key, scheme in schemes.items():
        row = {"label": label(key, train_len), "all_digits": {}, "per_digit": {}}
        for n, (tokens, answers) in batches.items():
            positions = scheme(n) if callable(scheme) else scheme
            row["all_digits"][n], row["per_digit"][n] = passkey_accuracy(
                model, tokens.to(device), answers, positions, args.chunk)
        passkey["methods"][key] = row
    print("passkey (all 5 digits): " + "; ".join(
        f"{row['label']}: " + " ".join(f"{v:.2f}" for v in row["all_digits"].values())
        for row in passkey["methods"].values()), flush=True)

    # the slice the chapter re-evaluates on a CPU through the Triton interpreter
    slice_length = args.slice_length or train_len // 2
    check = {"document": 0, "name": names[0], "length": slice_length, "losses": {}}
    for key in ("rope", f"rerope{train_len // 4}"):
        check["losses"][key] = round(slice_loss(model, docs, slice_length, schemes[key]), 5)

    out = {"environment": environment(), "command": "python -m extrapolation.evaluate "
           + " ".join(sys.argv[1:]), "model": {"train_len": train_len, "steps": meta.get("steps"),
                                              "seed": meta.get("seed")},
           "documents": len(docs), "document_names": names[:len(docs)], "lengths": lengths,
           "bin": BIN, "dtype": "float32", "methods": results, "window_ablation": ablation,
           "passkey": passkey, "slice_check": check,
           "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
