"""``python -m realmodel``: the quick start. SmolLM2-135M reads a long Python text with stock RoPE
and with ReRoPE, prints both losses by position, and continues the text with ReRoPE.

    python -m realmodel                     # a GPU: 32768 tokens (4x the training length)
    python -m realmodel --length 65536      # 8x

On a CPU the ReRoPE kernels run through Triton's interpreter, seconds per layer even for a few
tokens, so the default there is a 16-token smoke run (several minutes for the 30 layers) that
checks the pipeline but cannot show the point: that needs a GPU.

The text is the evaluation's first document (``realmodel.smollm2.source_documents``: standard
library files, whole, concatenated), or any file with ``--file``. On a GPU the model runs in
bf16, on a CPU in float32.
"""

import argparse
import os
import sys
import time

import torch

from . import smollm2


def main(argv=None):
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=None, help="text to read (default: standard library "
                        "files, concatenated as in the evaluation)")
    parser.add_argument("--length", type=int, default=32768 if gpu else 16,
                        help="tokens to read (default 32768 on a GPU, 16 on a CPU)")
    parser.add_argument("--window", type=int, default=2048 if gpu else 4,
                        help="ReRoPE's window (default 2048 on a GPU, 4 on a CPU)")
    parser.add_argument("--no-logn", action="store_true", help="ReRoPE without log-n scaling")
    parser.add_argument("--new-tokens", type=int, default=48 if gpu else 2,
                        help="tokens to generate after the text (default 48 on a GPU, 2 on a CPU)")
    parser.add_argument("--bins", type=int, default=8 if gpu else 2, help="rows of the loss table")
    args = parser.parse_args(argv)
    if args.length < 2 * args.bins:
        parser.error(f"--length must be at least {2 * args.bins}")

    from tqdm.auto import tqdm

    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    bar = tqdm(total=3 + args.new_tokens, unit="step", file=sys.stdout,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
    bar.set_description("loading the model")
    model, tokenizer = smollm2.load(device, dtype)
    if args.file is None:
        docs, files = smollm2.source_documents(tokenizer, 1, args.length + 1)
        ids, name = docs.to(device), f"standard-library files ({len(files[0])})"
    else:
        with open(args.file, encoding="utf-8", errors="replace") as file:
            ids = tokenizer(file.read())["input_ids"]
        if len(ids) < args.length + 1:
            raise SystemExit(f"{args.file} holds {len(ids)} tokens, fewer than --length "
                             f"{args.length} + 1")
        ids, name = torch.tensor([ids[:args.length + 1]], device=device), os.path.basename(args.file)
    bar.update()
    stock = smollm2.Method("rope", "RoPE (stock)", "rope")
    rerope = smollm2.Method("rerope", f"ReRoPE w={args.window}" + ("" if args.no_logn
                                                                   else " + log-n"),
                            "rerope", window=args.window, logn=not args.no_logn)
    losses, seconds = {}, {}
    for method in (stock, rerope):
        bar.set_description(f"reading {args.length} tokens: {method.label}")
        smollm2.set_method(model, method, args.length)
        start = time.perf_counter()
        losses[method.key] = smollm2.token_losses(model, ids)[0].double().cpu()
        seconds[method.key] = time.perf_counter() - start
        bar.update()
    bar.set_description(f"generating {args.new_tokens} tokens with {rerope.label}")
    new = smollm2.greedy(model, ids[:, :-1], args.new_tokens, step=bar.update)
    bar.close()

    print(f"\n{name}, {args.length} tokens ({args.length / smollm2.TRAIN_LEN:.2g}x the "
          f"training length {smollm2.TRAIN_LEN}), {dtype} on {device}; loss in nats per token")
    print(f"{'positions':>15}  {stock.label:>14}  {rerope.label:>22}")
    edges = torch.linspace(0, args.length, args.bins + 1).long().tolist()
    for lo, hi in zip(edges, edges[1:]):
        print(f"{lo:>7}-{hi:<7}  {losses['rope'][lo:hi].mean():>14.3f}  "
              f"{losses['rerope'][lo:hi].mean():>22.3f}")
    print(f"{'all':>15}  {losses['rope'].mean():>14.3f}  {losses['rerope'].mean():>22.3f}")
    print(f"{'seconds':>15}  {seconds['rope']:>14.2f}  {seconds['rerope']:>22.2f}")
    print(f"\nthe last line read:\n  {tokenizer.decode(ids[0, -20:-1]).splitlines()[-1]!r}")
    print(f"continued by {rerope.label} (greedy):\n  {tokenizer.decode(new[0])!r}")


if __name__ == "__main__":
    main()
