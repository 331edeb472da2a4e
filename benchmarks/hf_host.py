"""Host time of ReRoPE's Hugging Face attention function per decode step, without a model: the
calls one ``generate()`` step makes, layer after layer, on a growing dynamic cache::

    python -m benchmarks.hf_host --out /tmp/hf_host.json          # CPU, launches skipped
    REROPE_AUTOTUNE=0 python -m benchmarks.hf_host --device cuda   # a GPU, real launches

Each step: the mask function once (``rerope.hf.rerope_mask`` with a 2D all-ones padding mask, as
``generate`` passes), then ``--layers`` calls of ``rerope.hf.rerope_attention_forward`` with one
new query ``(1, Hq, 1, D)``, the layer's cache ``(1, Hkv, N, D)`` one token longer than the last
step's (a new tensor, as ``DynamicCache``'s ``torch.cat`` makes; on the CPU an unwritten
``torch.empty`` of that length) and ``position_ids`` ``(1,
1)``. Shapes of the 1B-shaped Llama of :mod:`benchmarks.hf` (32:8 heads of 64; bf16 on a GPU,
fp32 on the CPU). On the CPU every Triton launch of the package is skipped
(``rerope.launch.Launcher`` made a no-op, outputs garbage): what is timed is the Python around
the kernels; on a GPU the kernels run and a step ends with a synchronisation.

``--impl stock_sdpa_flash``: the yardstick, the same loop through transformers'
``sdpa_attention_forward`` under SDPA's FlashAttention-2 backend, after transformers'
``sdpa_mask`` (the stock model's mask function; like ReRoPE's it reads the padding mask on the
host, one sync per step), so that one call measures what a layer costs each way.

Reports ``us_per_step`` (median over ``--steps``), ``us_per_layer`` (= step / layers),
``us_mask`` (the mask function), ``us_first_layer`` / ``us_other_layers`` (where a new cache length costs more), and the decode
plan cache's counters (``rerope.decode.PLANS``: ``plans_built`` over the whole run, 1 when a
growing cache keeps its plan).
"""

import argparse
import json
import os
import statistics
import time

import torch

from .harness import write_json


IMPLS = ("rerope", "stock_sdpa_flash")


class _Layer(torch.nn.Module):
    """What the attention functions read of a model's attention layer (32:8 heads)."""

    is_causal = True
    num_key_value_groups = 4


def _stock_mask(n, attention_mask, device):
    """transformers' ``sdpa_mask`` for one new token after ``n - 1`` cached ones (the stock
    model's mask function for SDPA; ``q_length`` in recent 5.x releases, ``cache_position``
    in earlier ones)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    try:
        return sdpa_mask(1, q_length=1, kv_length=n, q_offset=n - 1,
                         mask_function=causal_mask_function, attention_mask=attention_mask,
                         device=device)
    except TypeError:
        return sdpa_mask(1, cache_position=torch.tensor([n - 1], device=device), kv_length=n,
                         mask_function=causal_mask_function, attention_mask=attention_mask)


def run(device="cpu", layers=16, steps=32, context=1024, heads=32, kv_heads=8, head_dim=64,
        window=256, impl="rerope"):
    """One run; ``impl`` ``"rerope"`` (ReRoPE's mask and attention functions) or
    ``"stock_sdpa_flash"`` (transformers' ``sdpa_mask``, then its ``sdpa_attention_forward``
    under SDPA's FlashAttention-2 backend: what the stock model calls per step and layer)."""
    import rerope.hf as hf
    from rerope import decode

    from .hf import sdpa_backends

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "stock_sdpa_flash":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    settings = hf.Settings(window, base=500000.0)
    module = _Layer()
    gen = torch.Generator(device).manual_seed(0)
    caches = [torch.randn(1, kv_heads, context, head_dim, dtype=dtype, device=device,
                          generator=gen) for _ in range(layers)]
    query = torch.randn(1, heads, 1, head_dim, dtype=dtype, device=device, generator=gen)
    mask = torch.ones(1, context, dtype=torch.long, device=device)
    decode.PLANS.clear()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    step_us, mask_us, first_us, other_us = [], [], [], []
    for step in range(steps + 3):
        n = caches[0].shape[2] + 1
        new = torch.randn(1, kv_heads, 1, head_dim, dtype=dtype, device=device, generator=gen)
        if device == "cuda":
            caches = [torch.cat([c, new], dim=2) for c in caches]   # DynamicCache.update
        else:       # a new cache, unwritten: writing 16 caches' megabytes through the CPU's
            # caches before each step would evict the interpreter's own data, and the first
            # layer would pay for it (seen: 300 µs at 1k keys, 730 at 4k), not the code timed
            caches = [torch.empty(1, kv_heads, n, head_dim, dtype=dtype) for _ in caches]
        mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)        # generate's update
        position_ids = torch.full((1, 1), n - 1, dtype=torch.long, device=device)
        sync()
        start = time.perf_counter()
        if impl == "rerope":
            rows = hf.rerope_mask(1, q_length=1, kv_length=n, q_offset=n - 1,
                                  attention_mask=mask.bool())
        else:                 # what the stock model's mask costs (it syncs once too)
            _stock_mask(n, mask.bool(), device)
        marks = [time.perf_counter()]
        with sdpa_backends(impl):
            for cache in caches:
                if impl == "rerope":
                    hf.rerope_attention_forward(settings, module, query, cache, cache, rows,
                                                scaling=head_dim ** -0.5,
                                                position_ids=position_ids)
                else:
                    sdpa_attention_forward(module, query, cache, cache, None,
                                           scaling=head_dim ** -0.5,
                                           position_ids=position_ids)
                marks.append(time.perf_counter())
        sync()
        end = time.perf_counter()
        if step >= 3:                            # warm: plans, tables
            step_us.append((end - start) * 1e6)
            mask_us.append((marks[0] - start) * 1e6)
            first_us.append((marks[1] - marks[0]) * 1e6)
            other_us.append((marks[-1] - marks[1]) * 1e6 / max(1, layers - 1))
    median = statistics.median
    return {"impl": impl, "device": device, "layers": layers, "steps": steps,
            "context": context,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": window,
            "launches": ("run" if device == "cuda" else
                         "skipped" if impl == "rerope" else "CPU math"),
            "us_per_step": round(median(step_us), 1),
            "us_per_layer": round(median(step_us) / layers, 1),
            "us_mask": round(median(mask_us), 1),
            "us_first_layer": round(median(first_us), 1),
            "us_other_layers": round(median(other_us), 1),
            "plans_built": decode.PLANS.built if impl == "rerope" else None}


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_host",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--impl", default="rerope", choices=IMPLS,
                        help="ReRoPE's functions, or transformers' SDPA attention function "
                             "(FlashAttention-2 backend) as the yardstick")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")     # CPU tensors: before rerope loads
        torch.set_num_threads(1)
    from rerope import launch

    if args.device == "cpu":
        launch.Launcher._slow_launch = lambda self, launch_args: None   # Python only
    result = run(args.device, args.layers, args.steps, args.context, impl=args.impl)
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
