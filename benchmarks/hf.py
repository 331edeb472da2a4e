"""A 1B-sized Llama in transformers: prefill and per-token generation, ReRoPE against stock SDPA.

Run on a CUDA GPU from the repository root (about 2-3 minutes on an H200), with ``rerope`` and
transformers importable (``pip install -e .[hf]``, or ``PYTHONPATH=kernels:.`` in a checkout)::

    REROPE_AUTOTUNE=0 python -m benchmarks.hf --out book/data/hf_h200.json
    python -m benchmarks.hf --tiny --out /tmp/hf.json    # a 2-layer model on the CPU interpreter

The model: a random-weight ``LlamaForCausalLM`` shaped like Llama 3.2 1B (16 layers, hidden
2048, 32 heads, 8 KV heads, head dim 64, MLP 8192, vocab 128256, tied embeddings; default RoPE,
base 500000), bf16. Two phases, each for ``stock_sdpa`` (the model as built,
``attn_implementation="sdpa"``, torch choosing the SDPA backend: cuDNN on the H200),
``stock_sdpa_flash`` (the same with cuDNN excluded, so FlashAttention-2: cuDNN rebuilds its
attention plan on the host for every new key length, about 2.7 ms per call at decode on the
H200 host: perf/runs/profile_hf_decode.txt, perf/NOTES.md v6) and ``rerope`` (``rerope.hf.enable_rerope(model,
window)``):

* ``prefill``: one forward over ``context`` tokens, batch 1, building the dynamic cache, logits
  of the last token only (``logits_to_keep=1``): ``ms`` and ``tokens_per_s`` = context / time;
* ``decode``: after such a prefill, ``--steps`` greedy generation steps of one token each (a
  plain Python loop of ``model(next_token, cache=...)``, what ``generate`` does per step), the
  cache growing from ``context``: mean ``ms`` per token, ``tokens_per_s`` and the slowest step
  (``max_step_ms``); with ``--generate`` also ``generate_ms``, the same per token from plain
  ``model.generate`` (dynamic cache, an all-ones ``attention_mask``: :func:`generate_ms`).

The attention's share: the same attention op alone at the same shapes (``rerope.rerope`` /
``rerope.rerope_decode`` on rotated inputs, ``F.scaled_dot_product_attention`` with
``enable_gqa``), timed with CUDA events (:func:`benchmarks.harness.event_times_ms`), times 16 layers: ``attention_ms``; ``rest_ms`` =
``ms - attention_ms``. A correctness check first: with a window covering the sequence,
ReRoPE's logits equal the stock model's (bf16); and on a small bf16 model, ``generate`` with
the cache against recomputation without it, and a left-padded batch against each prompt alone
(:func:`generate_check`). JSON::

    {"meta": {...}, "rows": [{"impl", "phase", "context", "ms", "tokens_per_s",
                              "attention_ms", "rest_ms", "window", "max_step_ms" (decode)}]}
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

import rerope
import rerope.hf

from .harness import environment, event_times_ms, read_results, wall_ms, write_results

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, BASE = 16, 2048, 32, 8, 64, 8192, 128256, 5e5
DEVICE = "cuda"


def use_tiny_model():
    """``--tiny``: a 2-layer model on the CPU (Triton's interpreter), to test this script."""
    global LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, DEVICE
    LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, DEVICE = 2, 64, 4, 2, 16, 128, 97, "cpu"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cache_keyword(model):
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Llama 3.2's own RoPE frequency scaling (``--rope llama3``; its config.json's values)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def build_model(dtype, rope="default"):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope_parameters = {"rope_type": "default", "rope_theta": BASE}
    if rope == "llama3":
        rope_parameters = {**LLAMA3_ROPE, "rope_theta": BASE}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=131072, rope_parameters=rope_parameters,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def event_ms(fn, reps=20):
    """Median GPU ms of ``fn()`` by CUDA events, each run synchronised (after two warm-up
    calls); on the CPU the wall-clock time of two runs."""
    fn(), fn()
    if DEVICE != "cuda":
        return wall_ms(fn, 2, DEVICE)
    return statistics.median(event_times_ms(fn, reps, sync_each=True))


def prefill(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=True, logits_to_keep=1)


def decode_step(model, token, cache, keyword):
    """One greedy generation step on ``cache``: the next token ``(1, 1)``."""
    return model(token, use_cache=True, **{keyword: cache}).logits[:, -1:].argmax(-1)


def warm_decoder(model, ids, warmup=3):
    """Prefill ``ids``, then ``warmup`` greedy steps (compiles, tables): ``(step, token)``, where
    ``step(token)`` runs one more step on the prefilled cache. Call under ``torch.no_grad()``."""
    keyword = cache_keyword(model)
    out = prefill(model, ids)
    cache = getattr(out, "cache", None) or out.past_key_values
    token = out.logits[:, -1:].argmax(-1)

    def step(token):
        return decode_step(model, token, cache, keyword)

    for _ in range(warmup):
        token = step(token)
    return step, token


def decode_ms(model, ids, steps):
    """``(mean, max)`` ms per generated token over ``steps`` greedy steps after a prefill of
    ``ids`` (each step timed alone, so a slow one — a compile, say — shows in the max)."""
    with torch.no_grad():
        step, token = warm_decoder(model, ids)
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            token = step(token)
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        return sum(times) / steps, max(times)


def generate_ms(model, ids, steps, reps):
    """Plain ``generate()`` with the default dynamic cache, eager, greedy, an all-ones
    ``attention_mask`` passed as users do: ms per generated token, the difference between
    ``generate`` of ``steps + 1`` and of 1 new token over ``steps`` (medians of ``reps`` runs
    each, after a warm-up generation). Unlike :func:`decode_ms`'s loop this holds
    ``generate``'s own per-step work too (mask update and mask function, logits processing,
    stopping criteria)."""
    mask = torch.ones_like(ids)

    def generate(new_tokens):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False)

    generate(4)
    short = wall_ms(lambda: generate(1), reps, DEVICE)
    long = wall_ms(lambda: generate(steps + 1), reps, DEVICE)
    return (long - short) / steps


def static_generator(model, ids, steps, compile_config=None):
    """``generate(n)``: greedy ``generate`` of exactly ``n <= steps + 1`` tokens on one
    preallocated ``StaticCache``, reset before each call (one cache object for every call: a new
    cache per length would make new static buffers, a recompile and, under CUDA graphs, outputs
    of one graph overwritten by the next — what the first harness met). With ``compile_config``
    (a ``transformers.CompileConfig``) ``generate`` compiles the decode steps itself."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 8)
    keyword = cache_keyword(model)
    options = {} if compile_config is None else {"compile_config": compile_config}

    def generate(new_tokens):
        cache.reset()
        if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, **{keyword: cache}, **options)

    return generate


def static_compiled_ms(model, ids, steps, reps):
    """transformers' fast-generation recipe: a static cache, whose decode steps ``generate``
    compiles itself (``CompileConfig(fullgraph=True, mode="reduce-overhead")``: one CUDA graph
    per step; the prefill runs eager, which also allocates the cache's buffers as static
    addresses). ``(prefill ms, decode ms per token, compile s)``: the prefill is ``generate`` of
    one token, a token's decode the difference to ``generate`` of ``steps + 1`` over ``steps``
    (medians of ``reps`` runs each, after two warm-up generations that compile and capture).

    (Wrapping ``model.forward`` in ``torch.compile`` instead, the older recipe, also compiles
    the prefill, and the cache then initialises inside the graph: Inductor skips CUDA graphs
    for the "mutated inputs", and on the H200's torch 2.11 its static launcher crashed.)"""
    import torch._dynamo
    from transformers import CompileConfig

    generate = static_generator(model, ids, steps,
                                CompileConfig(fullgraph=True, mode="reduce-overhead"))
    try:
        start = time.time()
        generate(4), generate(4)
        compile_s = time.time() - start
        short = wall_ms(lambda: generate(1), reps, DEVICE)
        long = wall_ms(lambda: generate(steps + 1), reps, DEVICE)
    finally:
        torch._dynamo.reset()
        for name in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, name):
                delattr(model, name)
    return short, (long - short) / steps, compile_s


def sdpa_backends(impl):
    """The SDPA backends an implementation may use: all of them for ``stock_sdpa`` (torch picks;
    on the H200 that is cuDNN), all but cuDNN for ``stock_sdpa_flash``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "stock_sdpa_flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.MATH])
    return contextlib.nullcontext()


def attention_alone_ms(impl, phase, context, window, dtype):
    """16 layers' worth of the attention op alone at the model's shapes."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    n_q = context if phase == "prefill" else 1
    q = torch.randn(1, HEADS, n_q, HEAD_DIM, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=dtype, generator=gen)
            for _ in range(2))
    if impl.startswith("stock_sdpa"):
        def run():
            with sdpa_backends(impl):
                return F.scaled_dot_product_attention(q, k, v, is_causal=phase == "prefill",
                                                      enable_gqa=True)
    elif phase == "prefill":
        def run():
            return rerope.rerope(q, k, v, window, base=BASE, rotated=True)
    else:
        def run():
            return rerope.rerope_decode(q, k, v, window, base=BASE, rotated=True)
    return LAYERS * event_ms(run)


def check(model, window_note, n=1024):
    """Max |logit difference| of ReRoPE (window = n) against stock on ``n`` tokens, bf16."""
    ids = torch.randint(0, VOCAB, (1, n), device=DEVICE,
                        generator=torch.Generator(DEVICE).manual_seed(1))
    with torch.no_grad():
        stock = model(ids, logits_to_keep=64).logits.float()
        rerope.hf.enable_rerope(model, window=n)
        ours = model(ids, logits_to_keep=64).logits.float()
        rerope.hf.disable_rerope(model)
    return {"tokens": n, "max_abs_logit_diff": (ours - stock).abs().max().item(),
            "max_abs_logit": stock.abs().max().item(), "note": window_note}


def generate_check(window=16, prompt_len=24, new_tokens=40):
    """On the GPU, a small bf16 model (head dim 64, the benchmark's kernels): greedy ``generate``
    with the cache against recomputing every step without one, and a left-padded batch of two
    prompts against each alone. Returns how many generated tokens agree (bf16: a near-tie of two
    logits may flip one argmax between the decode and the prefill kernel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, rope_theta=BASE, initializer_range=0.15,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    rerope.hf.enable_rerope(model, window=window)
    gen = torch.Generator(DEVICE).manual_seed(3)
    prompt = torch.randint(1, 97, (1, prompt_len), device=DEVICE, generator=gen)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        ids = prompt
        for _ in range(new_tokens):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        short = torch.randint(1, 97, (1, prompt_len // 2), device=DEVICE, generator=gen)
        batch = torch.zeros(2, prompt_len, dtype=torch.long, device=DEVICE)
        mask = torch.zeros_like(batch)
        batch[0], mask[0] = prompt[0], 1
        batch[1, prompt_len // 2:], mask[1, prompt_len // 2:] = short[0], 1
        padded = model.generate(batch, attention_mask=mask, max_new_tokens=new_tokens,
                                do_sample=False)[:, prompt_len:]
        alone = model.generate(short, max_new_tokens=new_tokens,
                               do_sample=False)[:, short.shape[1]:]
    return {"window": window, "prompt": prompt_len, "new_tokens": new_tokens,
            "cache_vs_recompute_equal": int((cached[0, prompt_len:] == ids[0, prompt_len:]).sum()),
            "left_padded_vs_alone_equal": [int((padded[0] == cached[0, prompt_len:]).sum()),
                                           int((padded[1] == alone[0]).sum())]}


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--out", default="book/data/hf_h200.json")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU")
    parser.add_argument("--rope", choices=("default", "llama3"), default="default",
                        help="the model's RoPE: default, or Llama 3.2's llama3 scaling")
    parser.add_argument("--impls", default="stock_sdpa,stock_sdpa_flash,rerope",
                        help="any of stock_sdpa, stock_sdpa_flash, rerope, stock_static_compiled,"
                             " rerope_static_compiled")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in --out (other impls, another --rope)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--generate", action="store_true",
                        help="also time plain generate() (dynamic cache, eager) per token: "
                             "generate_ms in the decode rows")
    args = parser.parse_args()
    if args.tiny:
        use_tiny_model()

    import transformers

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    env = environment(DEVICE, day=True)
    meta = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": env["date"], "autotune": rerope.config().autotune,
            "model": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, mlp=MLP, vocab=VOCAB, rope_theta=BASE,
                          rope=args.rope,
                          dtype=str(dtype).replace("torch.", ""), weights="random"),
            "window": args.window, "decode_steps": args.steps, "errors": []}
    rows = []
    if args.append and os.path.exists(args.out):
        previous = read_results(args.out, what="Hugging Face benchmark")
        meta = {**previous["meta"], **{k: v for k, v in meta.items() if k != "errors"},
                "errors": previous["meta"].get("errors", [])}
        rows = previous["rows"]

    def save():
        write_results(args.out, rows, meta)

    t0 = time.time()
    model = build_model(dtype, args.rope)
    print(f"model built in {time.time() - t0:.0f} s; transformers {transformers.__version__}",
          flush=True)
    impls = args.impls.split(",")
    checks = () if args.skip_checks else (
        ("generate_check", generate_check),
        ("check", lambda: check(model, "window = tokens: ReRoPE must equal RoPE",
                                args.check_tokens)))
    for key, run_check in checks:      # a failed check is recorded, and the timing goes on
        try:
            meta[key] = run_check()
            print(key.replace("_", " "), meta[key], flush=True)
        except Exception:
            meta["errors"].append(traceback.format_exc())
            print(meta["errors"][-1], flush=True)
    ids = torch.randint(0, VOCAB, (1, args.context), device=DEVICE,
                        generator=torch.Generator(DEVICE).manual_seed(2))
    model_name = "llama3.2-1b-shape" + ("" if args.rope == "default" else "-llama3-rope")
    for impl in impls:
        try:
            if impl.startswith("rerope"):
                rerope.hf.enable_rerope(model, window=args.window)
            elif rerope.hf.is_rerope_enabled(model):
                rerope.hf.disable_rerope(model)
            extra, slowest_step_ms, extra_decode = {}, None, {}
            if impl.endswith("static_compiled"):
                prefill_ms, step_ms, compile_s = static_compiled_ms(model, ids, args.steps,
                                                                    args.reps)
                extra = {"compile_s": round(compile_s, 1)}
                phases = (("prefill", prefill_ms), ("decode", step_ms))
            else:
                with sdpa_backends(impl):
                    prefill(model, ids)                            # warm-up (and compile)
                    prefill_ms = wall_ms(lambda: prefill(model, ids), args.reps, DEVICE)
                    step_ms, slowest_step_ms = decode_ms(model, ids, args.steps)
                    if args.generate:
                        extra_decode["generate_ms"] = round(
                            generate_ms(model, ids, args.steps, args.reps), 3)
                phases = (("prefill", prefill_ms), ("decode", step_ms))
            for phase, ms in phases:
                rows[:] = [r for r in rows if (r["impl"], r["phase"], r.get("model", "llama3.2-1b-shape"))
                           != (impl, phase, model_name)]
                tokens = args.context if phase == "prefill" else 1
                row = dict(impl=impl, phase=phase, context=args.context, ms=round(ms, 3),
                           tokens_per_s=round(tokens / ms * 1e3, 1),
                           window=args.window if impl.startswith("rerope") else None,
                           model=model_name, **extra)
                if not impl.endswith("static_compiled"):
                    attention = attention_alone_ms(impl, phase, args.context, args.window, dtype)
                    row.update(attention_ms=round(attention, 3), rest_ms=round(ms - attention, 3))
                if phase == "decode" and slowest_step_ms is not None:
                    row["max_step_ms"] = round(slowest_step_ms, 3)
                if phase == "decode":
                    row.update(extra_decode)
                rows.append(row)
                print(f"{time.time() - t0:5.0f} s  {rows[-1]}", flush=True)
        except Exception:
            meta["errors"].append(f"{impl} ({model_name}): {traceback.format_exc()}")
            print(meta["errors"][-1], flush=True)
        save()
    by = {(r["impl"], r["phase"]): r["ms"] for r in rows
          if r.get("model", "llama3.2-1b-shape") == "llama3.2-1b-shape"}
    for phase in ("prefill", "decode"):
        for ours, stock, name in (("rerope", "stock_sdpa", ""),
                                  ("rerope", "stock_sdpa_flash", "_vs_flash"),
                                  ("rerope_static_compiled", "stock_static_compiled",
                                   "_static_compiled")):
            if (ours, phase) in by and (stock, phase) in by:
                meta[f"{phase}_ratio{name}"] = round(by[ours, phase] / by[stock, phase], 3)
    meta["seconds"] = round(time.time() - t0)
    save()
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
