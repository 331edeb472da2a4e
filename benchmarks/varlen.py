"""Packed variable-length ReRoPE (``rerope.rerope_varlen``) against its alternatives.

Run it on a CUDA GPU from the repository root, with ``rerope`` importable (``pip install -e .``,
or ``PYTHONPATH=kernels:.`` in a checkout)::

    python -m benchmarks.varlen --out book/data/varlen_h200.json     # about a minute

One packed batch of 8 sequences of mixed lengths (512 to 16k tokens; ``--lengths``), D 128,
32 query heads over 8 key/value heads, bf16, window 2048, RoPE-rotated inputs as an engine's
cache holds them, forward only. Two scenarios: ``prefill`` (each sequence's whole prompt:
``Lq = Lk``) and ``chunk`` (a chunk of the last quarter of each sequence after a cached
prefix: ``Lq = Lk / 4``); ``--scenarios prefill,chunk,train`` adds ``train``, forward and
backward of the prefill shapes (packed training; ``rerope_varlen`` contiguous against
``rerope`` per sequence only). The implementations (``impl``):

- ``rerope_varlen``: ours, one launch over the packed batch; ``paged`` False with contiguous
  ``k, v`` ``(total_k, Hkv, D)``, ``paged`` True from a page pool of 64-key pages in shuffled
  order, read in place by the kernel.
- ``rerope_per_sequence``: ``rerope.rerope`` on each sequence as a ``(1, H, L, D)`` call, the
  eight calls back to back, timed together (the sum of their times).
- ``flex_document_mask``: plain causal attention (not ReRoPE) by FlexAttention with a document
  mask over the same packed batch (GQA), compiled: the yardstick of plain attention.

Each row: the median GPU time of repetitions (CUDA events, after warm-up calls that absorb
autotuning and compilation). Rows go to ``--out`` as ``{"meta": ..., "rows": [{"impl",
"paged", "scenario", "ms", "lengths", "total_q", "total_k", "Hq", "Hkv", "D", "dtype",
"window", "page_size"}], "ratios": {...}}``, ``ratios`` giving ``per_sequence / varlen``
(the target: at least 0.95) and ``contiguous / paged`` (at least 0.9) per scenario, and
``max_abs_diff`` the largest difference between the varlen and per-sequence outputs.
"""

import argparse
import statistics
import sys
import traceback

import torch

from .harness import describe_error, environment, event_times_ms, repetitions, write_results

LENGTHS = (512, 16384, 1024, 8192, 2048, 4096, 768, 12288)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
WINDOW = 2048
PAGE_SIZE = 64
WARMUP_CALLS = 3
MIN_REPS, MAX_REPS, BUDGET_S = 5, 50, 1.0


def _cumulative(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def _time_ms(step):
    """Median GPU milliseconds of ``step()`` (after warm-up calls)."""
    for _ in range(WARMUP_CALLS):
        step()
    torch.cuda.synchronize()
    first = statistics.median(event_times_ms(step, 3))
    reps = repetitions(first / 1e3, BUDGET_S, MIN_REPS, MAX_REPS)
    return statistics.median(event_times_ms(step, reps))


def page_pool(k, v, lengths_k, page_size, generator, spare=8, fill=None, unused=0):
    """The keys and values of every sequence (packed ``k, v`` ``(total_k, Hkv, D)``, sequence
    ``b`` with ``lengths_k[b]`` keys) on shuffled pages of two pools ``(num_pages, page_size,
    Hkv, D)``, ``spare`` pages more than the sequences use, and the int32 block table ``(B,
    max_blocks)`` on ``k``'s device. Slots no key fills hold ``fill(shape)`` (``None``: zeros);
    table entries past a sequence's pages hold ``unused``. Shared with the tests."""
    total_pages = sum(-(-n // page_size) for n in lengths_k) + spare
    shape = (total_pages, page_size, *k.shape[1:])
    fill = fill or (lambda shape: torch.zeros(shape, dtype=k.dtype, device=k.device))
    k_pool, v_pool = (fill(shape).to(k.device, k.dtype) for _ in "kv")
    order = torch.randperm(total_pages, generator=generator).tolist()
    table = torch.full((len(lengths_k), max(-(-n // page_size) for n in lengths_k)), unused,
                       dtype=torch.int32)
    start = 0
    for b, n in enumerate(lengths_k):
        for j in range(-(-n // page_size)):
            page = order.pop()
            table[b, j] = page
            rows = slice(start + j * page_size, start + min(n, (j + 1) * page_size))
            k_pool[page, :rows.stop - rows.start] = k[rows]
            v_pool[page, :rows.stop - rows.start] = v[rows]
        start += n
    return k_pool, v_pool, table.to(k.device)


def _flex_step(q, k, v, lengths_q, lengths_k):
    """Plain causal attention with a document mask over the packed batch, FlexAttention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = q.device
    doc_q = torch.repeat_interleave(torch.arange(len(lengths_q), device=device),
                                    torch.tensor(lengths_q, device=device))
    doc_k = torch.repeat_interleave(torch.arange(len(lengths_k), device=device),
                                    torch.tensor(lengths_k, device=device))
    cu_q, cu_k = _cumulative(lengths_q).long(), _cumulative(lengths_k).long()
    shift = torch.tensor([lk - lq for lq, lk in zip(lengths_q, lengths_k)], device=device)
    # a query's position in its sequence: the last Lq of Lk positions
    pos_q = torch.arange(q.shape[0], device=device) - cu_q[doc_q] + shift[doc_q]
    pos_k = torch.arange(k.shape[0], device=device) - cu_k[doc_k]

    def mask(b, h, qi, ki):
        return (doc_q[qi] == doc_k[ki]) & (pos_q[qi] >= pos_k[ki])

    try:          # compiled: the mask is never materialised at total_q x total_k
        block_mask = create_block_mask(mask, None, None, q.shape[0], k.shape[0],
                                       device=device, _compile=True)
    except TypeError:
        block_mask = create_block_mask(mask, None, None, q.shape[0], k.shape[0], device=device)
    flex = torch.compile(flex_attention)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    return lambda: flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)


def _train_steps(q, k, v, lengths_k, window, impls):
    """Forward and backward (packed training): ``rerope_varlen`` on the packed leaves, and
    ``rerope`` on each sequence's own leaves (separate tensors, as a batch of one would
    hold them), gradients by ``torch.autograd.grad``."""
    import rerope

    cu = _cumulative(lengths_k)
    n = max(lengths_k)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    steps = {}
    if "rerope_varlen" in impls:
        def varlen_step():
            out = rerope.rerope_varlen(*leaves, cu, cu, n, n, window, rotated=True)
            return torch.autograd.grad(out, leaves, dout)

        steps[("rerope_varlen", False)] = varlen_step
    if "rerope_per_sequence" in impls:
        starts = [0]
        for length in lengths_k:
            starts.append(starts[-1] + length)
        seqs = [[t[a:b].transpose(0, 1)[None].detach().clone().requires_grad_()
                 for t in (q, k, v)] for a, b in zip(starts, starts[1:])]
        douts = [dout[a:b].transpose(0, 1)[None] for a, b in zip(starts, starts[1:])]

        def per_sequence_step():
            return [torch.autograd.grad(rerope.rerope(*seq, window, rotated=True), seq, d)
                    for seq, d in zip(seqs, douts)]

        steps[("rerope_per_sequence", False)] = per_sequence_step
    return steps


def run(lengths, window, dtype, page_size, scenarios, impls):
    import rerope

    generator = torch.Generator().manual_seed(0)
    rows, ratios, diffs = [], {}, {}
    for scenario in scenarios:
        lengths_k = list(lengths)
        lengths_q = (lengths_k if scenario in ("prefill", "train")
                     else [max(1, n // 4) for n in lengths_k])
        total_q, total_k = sum(lengths_q), sum(lengths_k)
        q = torch.randn(total_q, HEADS, HEAD_DIM, generator=generator).to(dtype).cuda()
        k = torch.randn(total_k, KV_HEADS, HEAD_DIM, generator=generator).to(dtype).cuda()
        v = torch.randn(total_k, KV_HEADS, HEAD_DIM, generator=generator).to(dtype).cuda()
        cu_q, cu_k = _cumulative(lengths_q), _cumulative(lengths_k)
        max_q, max_k = max(lengths_q), max(lengths_k)
        common = dict(scenario=scenario, lengths_q=lengths_q, lengths_k=lengths_k,
                      total_q=total_q, total_k=total_k, Hq=HEADS, Hkv=KV_HEADS, D=HEAD_DIM,
                      dtype=str(dtype).replace("torch.", ""), window=window)
        steps = {}
        if scenario == "train":
            steps = _train_steps(q, k, v, lengths_k, window, impls)
        elif "rerope_varlen" in impls:
            steps[("rerope_varlen", False)] = lambda: rerope.rerope_varlen(
                q, k, v, cu_q, cu_k, max_q, max_k, window, rotated=True)
            k_pool, v_pool, table = page_pool(k, v, lengths_k, page_size, generator)
            steps[("rerope_varlen", True)] = lambda: rerope.rerope_varlen(
                q, k_pool, v_pool, cu_q, cu_k, max_q, max_k, window, rotated=True,
                block_table=table)
        if "rerope_per_sequence" in impls and scenario != "train":
            slices = [(q[int(cu_q[b]):int(cu_q[b + 1])].transpose(0, 1)[None],
                       k[int(cu_k[b]):int(cu_k[b + 1])].transpose(0, 1)[None],
                       v[int(cu_k[b]):int(cu_k[b + 1])].transpose(0, 1)[None])
                      for b in range(len(lengths_k))]

            def per_sequence():
                return [rerope.rerope(qs, ks, vs, window, rotated=True)
                        for qs, ks, vs in slices]

            steps[("rerope_per_sequence", False)] = per_sequence
        if "flex_document_mask" in impls and scenario != "train":
            try:
                steps[("flex_document_mask", False)] = _flex_step(q, k, v, lengths_q,
                                                                  lengths_k)
            except Exception as error:     # an older torch: no FlexAttention
                rows.append({"impl": "flex_document_mask", "paged": False, "ms": None,
                             "skipped": describe_error(error), **common})
        if (("rerope_varlen", True) in steps
                and ("rerope_per_sequence", False) in steps):
            with torch.no_grad():
                packed = steps[("rerope_varlen", False)]()
                alone = torch.cat([o[0].transpose(0, 1)
                                   for o in steps[("rerope_per_sequence", False)]()])
                paged = steps[("rerope_varlen", True)]()
            diffs[scenario] = {"varlen_vs_per_sequence":
                               (packed.float() - alone.float()).abs().max().item(),
                               "paged_vs_contiguous":
                               (paged.float() - packed.float()).abs().max().item()}
        times = {}
        for (impl, is_paged), step in steps.items():
            try:
                with torch.set_grad_enabled(scenario == "train"):
                    ms = _time_ms(step)
                row = {"impl": impl, "paged": is_paged, "ms": ms,
                       "mode": "fwd+bwd" if scenario == "train" else "fwd", **common}
                if is_paged:
                    row["page_size"] = page_size
                times[(impl, is_paged)] = ms
            except Exception as error:
                traceback.print_exc()
                row = {"impl": impl, "paged": is_paged, "ms": None,
                       "skipped": describe_error(error), **common}
            rows.append(row)
            print(f"{scenario:8s} {impl:22s} paged={is_paged!s:5s} "
                  f"{row['ms'] if row['ms'] is None else round(row['ms'], 3)} ms", flush=True)
        varlen_ms = times.get(("rerope_varlen", False))
        ratios[scenario] = {
            "per_sequence_over_varlen": (times[("rerope_per_sequence", False)] / varlen_ms
                                         if varlen_ms and ("rerope_per_sequence", False)
                                         in times else None),
            "contiguous_over_paged": (varlen_ms / times[("rerope_varlen", True)]
                                      if varlen_ms and ("rerope_varlen", True) in times
                                      else None),
            "flex_over_varlen": (times[("flex_document_mask", False)] / varlen_ms
                                 if varlen_ms and ("flex_document_mask", False) in times
                                 else None),
        }
        print(f"{scenario}: {ratios[scenario]}", flush=True)
        del q, k, v, steps
        torch.cuda.empty_cache()
    return rows, ratios, diffs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.varlen",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON results file to write")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="the sequences' key counts, comma separated")
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE)
    parser.add_argument("--scenarios", default="prefill,chunk",
                        help="prefill, chunk and (forward + backward, not run by default) "
                             "train, comma separated")
    parser.add_argument("--impl", default="rerope_varlen,rerope_per_sequence,flex_document_mask")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.varlen needs a CUDA GPU", file=sys.stderr)
        return 1
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, ratios, diffs = run(lengths, args.window, getattr(torch, args.dtype), args.page_size,
                              args.scenarios.split(","), args.impl.split(","))
    meta = {**environment(), "lengths": lengths, "window": args.window,
            "page_size": args.page_size}
    write_results(args.out, rows, meta, ratios=ratios, max_abs_diff=diffs)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
