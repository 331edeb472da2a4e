"""Session 47 (issue 37): is a Hugging Face decode step with ReRoPE slower than stock
FlashAttention-2 at 8k context because of noise, or because something in it waits on the GPU?

1. Alternating rounds (rerope, stock_sdpa_flash, rerope, ...) of the decode loop of
   ``benchmarks.hf`` (32 steps each, synchronised per step) and of plain ``generate()`` on one
   prefilled 8k-token prompt, the 1B-shaped random Llama.
2. One decode step per implementation under ``torch.cuda.set_sync_debug_mode("error")``: the
   first host<->device synchronisation raises; its traceback says where.

    PYTHONPATH=kernels:. python perf/runs/s47/decode_sync_check.py --out X.json
"""
import argparse
import json
import statistics
import time
import traceback

import torch

import rerope
import rerope.hf
from benchmarks import hf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = hf.build_model(torch.bfloat16)
    ids = torch.randint(0, hf.VOCAB, (1, args.context), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    impls = ("rerope", "stock_sdpa_flash")
    times = {impl: {"loop": [], "generate": []} for impl in impls}
    syncs = {}

    def use(impl):
        if impl == "rerope":
            rerope.hf.enable_rerope(model, window=2048)
        elif rerope.hf.is_rerope_enabled(model):
            rerope.hf.disable_rerope(model)

    for r in range(args.rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            use(impl)
            with hf.sdpa_backends(impl):
                loop, _ = hf.decode_ms(model, ids, 32)
                gen = hf.generate_ms(model, ids, 16, 3)
            times[impl]["loop"].append(round(loop, 3))
            times[impl]["generate"].append(round(gen, 3))
            print(r, impl, round(loop, 3), round(gen, 3), flush=True)
    for impl in impls:
        use(impl)
        with hf.sdpa_backends(impl), torch.no_grad():
            step, token = hf.warm_decoder(model, ids)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                token = step(token)
                syncs[impl] = "no synchronisation in one decode step"
            except RuntimeError:
                syncs[impl] = traceback.format_exc()[-3000:]
            finally:
                torch.cuda.set_sync_debug_mode(0)
        print(impl, syncs[impl][-1500:], flush=True)
    summary = {impl: {k: statistics.median(v) for k, v in t.items()} for impl, t in times.items()}
    json.dump({"context": args.context, "times": times, "medians": summary, "syncs": syncs,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
              open(args.out, "w"), indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
