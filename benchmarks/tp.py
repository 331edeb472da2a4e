"""ReRoPE in a tensor-parallel Hugging Face model: tokens and time against one process.

transformers shards a Llama-style model over the ranks of a ``torchrun`` job when it is loaded
with ``distributed_config=DistributedConfig(tp_plan="auto")``: each rank holds ``Hq / world``
query heads and ``Hkv / world`` key/value heads, and its attention function sees only those.
ReRoPE is per head, so :func:`rerope.hf.enable_rerope` needs no change; this script checks it
and times it. Run from the repository root, once per world size (the first run writes the model
and the one-process tokens that the later runs compare with)::

    PYTHONPATH=kernels:. python -m benchmarks.tp --world-dir /tmp/tp --out tp.json
    PYTHONPATH=kernels:. torchrun --standalone --nproc-per-node 2 -m benchmarks.tp \\
        --world-dir /tmp/tp --out tp.json

On GPUs: a 1B-shaped random Llama (16 layers, hidden 2048, 32:8 heads of 64), bf16, NCCL,
a ``--context`` token prompt (32768 by default), window ``--window``; rows per impl
(``rerope``: :func:`rerope.hf.enable_rerope`; ``stock_sdpa``: transformers' SDPA) and phase
(``prefill``: ms for the prompt; ``decode``: mean ms per generated token over ``--steps``
greedy steps), with ``tokens_equal``: the greedy tokens equal those of the one-process run of
the same impl, and ``logits_max_diff``: the largest difference of the prompt's last logits
from that run's. ``--tiny``: a 2-layer float32 model on the CPU (gloo, Triton's interpreter),
what ``tests/test_tp.py`` runs. JSON rows: ``{"world_size", "impl", "phase", "ms",
"tokens_equal", "logits_max_diff", "heads_per_rank", "context", "window"}``, appended to ``--out`` by rank 0.
"""

import argparse
import json
import os
import statistics
import time

import rerope  # noqa: F401  (first: decides Triton's interpreter before transformers imports it)
import rerope.hf
import torch

from .harness import environment, utc_now, write_results

FULL = dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192, vocab=32000)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=97)


def rank_and_world():
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def build_and_save(shape, dtype, path):
    """A random Llama of ``shape`` saved to ``path`` (rank 0 of the one-process run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["mlp"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                         max_position_embeddings=131072, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)


def load(path, dtype, device, world):
    """The saved model, sharded over the ranks when ``world > 1``."""
    from transformers import LlamaForCausalLM

    if world > 1:
        from transformers.distributed import DistributedConfig

        return LlamaForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto")).eval()
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def attention_heads(model):
    """``(query heads, key/value heads)`` that this rank's attention function receives."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[name]
    seen = {}

    def spy(module, query, key, value, *args, **kwargs):
        seen.setdefault("heads", (query.shape[1], key.shape[1]))
        return inner(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("tp_spy", spy)
    model.set_attn_implementation("tp_spy")
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long, device=model.device))
    model.set_attn_implementation(name)
    return seen["heads"]


def timed_ms(fn, device, reps):
    """Median wall-clock ms of ``fn()`` (synchronised), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(model, ids, steps, device, reps):
    """``(prefill ms, decode ms per token, greedy tokens, the prompt's last logits)`` of
    ``model`` on ``ids``."""
    with torch.no_grad():
        prefill_ms = timed_ms(lambda: model(ids, logits_to_keep=1), device, reps)
        logits = model(ids, logits_to_keep=1).logits[0, -1].float().cpu().tolist()
        tokens = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps,
                                do_sample=False)[0, ids.shape[1]:].tolist()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        one = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
        if device == "cuda":
            torch.cuda.synchronize()
        decode_ms = (time.perf_counter() - start - one) / steps * 1e3
    return prefill_ms, decode_ms, tokens, logits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-dir", required=True,
                        help="folder of the saved model and the one-process tokens")
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--impl", default="rerope,stock_sdpa")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer fp32 model on the CPU")
    args = parser.parse_args(argv)
    rank, world = rank_and_world()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    shape, dtype = (TINY, torch.float32) if args.tiny else (FULL, torch.bfloat16)
    model_dir = os.path.join(args.world_dir, "model")
    tokens_file = os.path.join(args.world_dir, "tokens.json")
    if world == 1 and not os.path.exists(os.path.join(model_dir, "config.json")):
        build_and_save(shape, dtype, model_dir)
    if world > 1 and not os.path.exists(tokens_file):
        raise SystemExit(f"{tokens_file}: run this script in one process first")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(shape["vocab"], (1, args.context), generator=generator).to(device)
    reference = json.load(open(tokens_file)) if world > 1 else {}
    rows = []
    for impl in args.impl.split(","):
        model = load(model_dir, dtype, device, world)
        if impl == "rerope":
            rerope.hf.enable_rerope(model, args.window)
        elif impl != "stock_sdpa":
            raise SystemExit(f"--impl: unknown {impl!r} (rerope, stock_sdpa)")
        heads = attention_heads(model)
        prefill_ms, decode_ms, tokens, logits = measure(model, ids, args.steps, device,
                                                        args.reps)
        if world == 1:
            reference[impl] = {"tokens": tokens, "logits": logits}
        equal = reference[impl]["tokens"] == tokens
        difference = max(abs(a - b) for a, b in zip(logits, reference[impl]["logits"]))
        for phase, ms in (("prefill", prefill_ms), ("decode", decode_ms)):
            rows.append({"world_size": world, "impl": impl, "phase": phase, "ms": ms,
                         "tokens_equal": equal, "logits_max_diff": difference,
                         "heads_per_rank": list(heads),
                         "context": args.context, "window": args.window})
        del model
    if rank == 0:
        if world == 1:
            with open(tokens_file, "w") as file:
                json.dump(reference, file)
        old = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
        meta = {**environment(device), "date": utc_now(), "shape": shape,
                "dtype": str(dtype).replace("torch.", ""), "steps": args.steps,
                "backend": "gloo" if args.tiny else "nccl",
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
        write_results(args.out, old + rows, meta)
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
