"""Session 48 (issue 37): where a Hugging Face decode step's extra host time goes at 8k.

1. The 1B-shaped random Llama of ``benchmarks.hf`` (16 layers, 32:8 heads of 64, bf16, B=1),
   prefilled with 8192 tokens; the eager decode loop (``hf.decode_ms``, 32 steps, synchronised
   per step), in alternating rounds, with four attention implementations:
   ``stock_sdpa_flash`` (transformers' sdpa under SDPA's FlashAttention-2), ``rerope``
   (window 2048), ``null`` (an attention function that returns its query, sdpa's mask
   function: the model without attention) and ``rerope_mask_null`` (ReRoPE's mask function,
   the null attention function). Differences to ``null`` are what attention and mask cost
   inside the model.
2. The attention functions alone, on one layer's tensors at 8192 keys (host µs per call:
   ``--calls`` calls, one synchronisation, median of 5), and their parts: three
   ``torch.empty``, ``rerope.rerope_decode``, ``rerope.hf.rerope_attention_forward``,
   transformers' ``sdpa_attention_forward`` (FlashAttention-2), ``F.scaled_dot_product_attention``
   (FlashAttention-2, ``enable_gqa``), the kept decode step's split and merge launches alone.

    PYTHONPATH=kernels:. python perf/runs/s48/host_parts.py --out X.json
"""
import argparse
import functools
import json
import statistics

import torch
import torch.nn.functional as F

import rerope
import rerope.hf
from benchmarks import hf
from benchmarks.harness import back_to_back_us


def per_call_us(fn, calls, rounds=5):
    """Host µs per call: the median of ``rounds`` rounds of :func:`back_to_back_us`, and the
    rounds."""
    out = [back_to_back_us(fn, calls, warmup=2 if r == 0 else 0) for r in range(rounds)]
    return round(statistics.median(out), 2), [round(x, 2) for x in out]


def null_attention(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2), None


def model_rounds(context, rounds, steps):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("null_attn", null_attention)
    AttentionMaskInterface.register("null_attn", sdpa_mask)
    AttentionInterface.register("rerope_mask_null", null_attention)
    AttentionMaskInterface.register("rerope_mask_null", rerope.hf.rerope_mask)
    model = hf.build_model(torch.bfloat16)
    ids = torch.randint(0, hf.VOCAB, (1, context), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    impls = ("stock_sdpa_flash", "rerope", "null", "rerope_mask_null")
    times = {impl: [] for impl in impls}

    def use(impl):
        if rerope.hf.is_rerope_enabled(model):
            rerope.hf.disable_rerope(model)
        if impl == "rerope":
            rerope.hf.enable_rerope(model, window=2048)
        elif impl == "null":
            model.set_attn_implementation("null_attn")
        elif impl == "rerope_mask_null":
            model.set_attn_implementation("rerope_mask_null")
        else:
            model.set_attn_implementation("sdpa")

    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            use(impl)
            with hf.sdpa_backends(impl):
                ms, _ = hf.decode_ms(model, ids, steps)
            times[impl].append(round(ms, 4))
            print("model", r, impl, round(ms, 4), flush=True)
    use("stock_sdpa_flash")
    del model
    torch.cuda.empty_cache()
    return {impl: {"ms_per_token": statistics.median(v), "rounds": v}
            for impl, v in times.items()}


def parts(context, calls):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rerope import decode
    from benchmarks.hf_host import _Layer

    gen = torch.Generator("cuda").manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(1, 32, 1, 64, device="cuda", dtype=dt, generator=gen)
    k = torch.randn(1, 8, context, 64, device="cuda", dtype=dt, generator=gen)
    v = torch.randn(1, 8, context, 64, device="cuda", dtype=dt, generator=gen)
    settings = rerope.hf.Settings(2048, base=500000.0)
    module = _Layer()
    pos = torch.full((1, 1), context - 1, device="cuda", dtype=torch.long)
    flash = functools.partial(sdpa_kernel, [SDPBackend.FLASH_ATTENTION])
    res = {}

    def empties():
        torch.empty(q.shape, dtype=dt, device="cuda")
        torch.empty((4, 32, 64), dtype=torch.float32, device="cuda")
        torch.empty((4, 32), dtype=torch.float32, device="cuda")

    res["python_noop"] = per_call_us(lambda: None, calls)
    res["torch_empty_x3"] = per_call_us(empties, calls)
    res["rerope_decode"] = per_call_us(
        lambda: rerope.rerope_decode(q, k, v, 2048, base=500000.0, rotated=True), calls)
    res["rerope_attention_forward"] = per_call_us(
        lambda: rerope.hf.rerope_attention_forward(settings, module, q, k, v, None,
                                                   scaling=0.125, position_ids=pos), calls)
    with flash():
        res["sdpa_attention_forward_flash"] = per_call_us(
            lambda: sdpa_attention_forward(module, q, k, v, None, scaling=0.125,
                                           position_ids=pos), calls)
        res["F_sdpa_flash_gqa"] = per_call_us(
            lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True),
            calls)
    # the kept step of the rerope_attention_forward call above
    step, n_max, args = decode._STEPS.values()[-1]
    out, part, lse, final = decode._outputs(step.plan, step.num_splits, q)
    seqlens = None
    res["num_splits"] = step.num_splits
    res["outputs"] = per_call_us(lambda: decode._outputs(step.plan, step.num_splits, q), calls)
    res["split_launch"] = per_call_us(
        lambda: step.split(q, k, v, seqlens, None, part, lse, *args), calls)
    if step.merge is not None:
        res["merge_launch"] = per_call_us(lambda: step.merge(part, lse, out, final), calls)
    res["exact_key"] = per_call_us(
        lambda: decode._exact_key(q, k, v, None, None, (2048, None, 500000.0, None, None, True,
                                                        None, None, None)), calls)
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    import transformers
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "context": args.context,
              "unit": "parts: host µs per call (median of 5 rounds); model: ms per token"}
    result["parts"] = parts(args.context, args.calls)
    print(json.dumps(result["parts"], indent=1), flush=True)
    if args.rounds:
        result["model"] = model_rounds(args.context, args.rounds, args.steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result.get("model"), indent=1))


if __name__ == "__main__":
    main()
