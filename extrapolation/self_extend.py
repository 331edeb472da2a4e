"""Chapter 11's small model read past its training length with Self-Extend, beside ReRoPE.

    python -m extrapolation.self_extend      # on a GPU: well under a minute after compiling
    python -m extrapolation.self_extend --reference --device cpu --out /tmp/se.json   # CPU dry run

(from the repository root, ``rerope`` importable: ``pip install -e .`` or
``PYTHONPATH=kernels:.``)

Writes ``book/data/extrapolation_self_extend.json``: the same held-out documents, lengths and
summaries as ``python -m extrapolation.evaluate`` (its ``summarise``, ``binned`` and passkey
test), for Self-Extend (``rerope.rerope(..., group=G)`` on the model's raw ``q, k``) at the
windows of the ReRoPE rows (``w`` = ¼ and ½ of the training length), with and without log-n:

* ``per_length``: the authors' rule for the group size, the smallest ``G`` (a power of two
  dividing ``w``) with ``(L_train - w)·G + w >= L``: one forward per length ``L``, ``G = 1``
  (plain RoPE) at ``L = L_train``;
* ``fixed``: the group of the longest length (16x) for every length, one forward.

ReRoPE ``w = ¼`` is evaluated again here and compared with the stored chapter-10 file
(``rerope_check``), so that the rows sit on one footing. A separate file: the main data file's
schema (one scheme per key, fixed settings) does not hold a per-length group.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import rerope

from . import data, evaluate
from . import model as lm
from .train import ROOT, environment



class SelfExtend:
    """A position scheme for :func:`extrapolation.model.attend` (patched below)."""

    kind = "self_extend"

    def __init__(self, window, group, logn_len=None):
        self.window, self.group, self.logn_len = window, group, logn_len

    def as_dict(self):
        return {"kind": "self_extend", "window": self.window, "group": self.group,
                "logn_len": self.logn_len}


_stock_attend = lm.attend


OP = {"op": rerope.rerope}    # --reference: rerope.reference.rerope (a CPU dry run)


def attend(q, k, v, positions, base):
    if isinstance(positions, SelfExtend):
        return OP["op"](q, k, v, positions.window, causal=True, base=base,
                        group=positions.group, logn_len=positions.logn_len)
    return _stock_attend(q, k, v, positions, base)


lm.attend = attend


# the authors' rule for G, as rerope.rope states it (the package's copy, since the run)
recommended_group = rerope.rope.self_extend_group


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m extrapolation.self_extend",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "book" / "data" /
                   "extrapolation_self_extend.json")
    p.add_argument("--docs", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--passkey-count", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-factor", type=int, default=16)
    p.add_argument("--reference", action="store_true",
                   help="Self-Extend and ReRoPE through rerope.reference (a quick CPU dry run)")
    args = p.parse_args(argv)
    if args.reference:
        from rerope import reference
        OP["op"] = reference.rerope
    started = time.perf_counter()
    device = torch.device(args.device)
    net, meta = lm.load_model(ROOT / "book" / "data" / "extrapolation_model.safetensors",
                              device=device)
    train_len = net.cfg.train_len
    docs, names, _ = data.load_heldout(ROOT / "book" / "data" /
                                       "extrapolation_heldout.safetensors")
    lengths = [train_len * f for f in evaluate.FACTORS if f <= args.max_factor]
    longest = lengths[-1]
    docs = docs[:args.docs, :longest + 1].long().to(device)
    batches = {n: evaluate.passkey_batch(docs.cpu(), n, args.passkey_count, seed=0)
               for n in lengths}
    batches = {n: b for n, b in batches.items() if b is not None}

    def passkey(scheme_of):
        row = {"all_digits": {}, "per_digit": {}}
        for n, (tokens, answers) in batches.items():
            row["all_digits"][n], row["per_digit"][n] = evaluate.passkey_accuracy(
                net, tokens.to(device), answers, scheme_of(n), args.chunk)
        return row

    results = {}
    for window in (train_len // 4, train_len // 2):
        for logn in (None, train_len):
            tag = "+logn" if logn else ""
            groups = {n: recommended_group(train_len, window, n) for n in lengths}
            t0 = time.perf_counter()
            summary = {"mean": {}, "last": {}, "stderr": {}, "per_doc": {}}
            for n in lengths:
                losses = evaluate.position_losses(net, docs[:, :n + 1],
                                                  SelfExtend(window, groups[n], logn), args.chunk)
                part = evaluate.summarise(losses, [n], train_len)
                for field in summary:
                    summary[field][n] = part[field][n]
            results[f"self_extend{window}_per_length{tag}"] = {
                "label": f"Self-Extend w={window}, G by length" + (" + log-n" if logn else ""),
                "positions": {"kind": "self_extend", "window": window, "group": groups,
                              "logn_len": logn, "rule": "(train_len - w)·G + w >= L"},
                **summary, "per_position": evaluate.binned(losses.mean(dim=0)),
                "passkey": passkey(lambda n: SelfExtend(window, groups[n], logn))}
            g = groups[longest]
            losses = evaluate.position_losses(net, docs, SelfExtend(window, g, logn), args.chunk)
            results[f"self_extend{window}_g{g}{tag}"] = {
                "label": f"Self-Extend w={window} G={g}" + (" + log-n" if logn else ""),
                "positions": SelfExtend(window, g, logn).as_dict(),
                **evaluate.summarise(losses, lengths, train_len),
                "per_position": evaluate.binned(losses.mean(dim=0)),
                "passkey": passkey(lambda n: SelfExtend(window, g, logn))}
            for key in (f"self_extend{window}_per_length{tag}", f"self_extend{window}_g{g}{tag}"):
                print(f"{results[key]['label']:<40} " + "  ".join(
                    f"{n}: {results[key]['mean'][n]:.4f}" for n in lengths)
                    + "  passkey " + " ".join(f"{v:.2f}" for v in
                                              results[key]["passkey"]["all_digits"].values())
                    + f"   ({time.perf_counter() - t0:.1f} s)", flush=True)

    # ReRoPE w = ¼ again, against the stored chapter-10 numbers
    stored = json.loads((ROOT / "book" / "data" / "extrapolation_h200.json").read_text())
    key = f"rerope{train_len // 4}"
    losses = evaluate.position_losses(net, docs, lm.Positions(
        "rerope", window=train_len // 4, backend="reference" if args.reference else "kernels"),
        args.chunk)
    again = evaluate.summarise(losses, lengths, train_len)["mean"]
    check = {"key": key, "here": again,
             "stored": {n: stored["methods"][key]["mean"][str(n)] for n in lengths}}
    check["max_abs_difference"] = max(abs(again[n] - check["stored"][n]) for n in lengths)
    print(f"ReRoPE w={train_len // 4} again: max |difference| to the stored means "
          f"{check['max_abs_difference']:.2e}", flush=True)

    out = {"environment": environment(),
           "command": "python -m extrapolation.self_extend " + " ".join(argv or sys.argv[1:]),
           "model": {"train_len": train_len, "steps": meta.get("steps"), "seed": meta.get("seed")},
           "documents": len(docs), "lengths": lengths, "bin": evaluate.BIN, "dtype": "float32",
           "passkey": {"depth": evaluate.PASSKEY_DEPTH, "count": args.passkey_count,
                       "lengths": list(batches)},
           "methods": results, "rerope_check": check,
           "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
