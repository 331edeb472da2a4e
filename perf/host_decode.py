"""Host time of one decode-attention call at the Hugging Face benchmark's shape (B=1, 32 query
and 8 KV heads of 64, bf16, 32k cache): many calls back to back, one synchronisation, so the
time per call is the host's whenever it exceeds the GPU's (``probe_fused.host_time``; the run in
perf/runs/host_decode_h200.json used 10 warm-up calls instead of its 5). Run on a GPU:
``python perf/host_decode.py --out perf/runs/host_decode_h200.json``."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rerope  # noqa: E402
import rerope.hf  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_fused import host_time as per_call_us  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="perf/runs/host_decode_h200.json")
    args = parser.parse_args()
    q = torch.randn(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 32768, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flash = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    rows = {}
    with sdpa_kernel(flash):
        rows["sdpa_flash"] = per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    rows["sdpa_default"] = per_call_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    rows["rerope_decode"] = per_call_us(lambda: rerope.rerope_decode(q, k, v, 2048, base=5e5))
    rows["rerope_decode_one_split"] = per_call_us(
        lambda: rerope.rerope_decode(q, k, v, 2048, base=5e5, num_splits=1))
    rows["empty_x3"] = per_call_us(lambda: [torch.empty(1, 32, 1, 64, device="cuda")
                                            for _ in range(3)])
    # a new cache length every call, as in generation: the plan is rebuilt each time
    lengths = iter(range(1, 10 ** 6))

    def new_length():
        n = 32768 - next(lengths) % 512
        return rerope.rerope_decode(q, k[:, :, :n], v[:, :, :n], 2048, base=5e5)

    rows["rerope_decode_new_length"] = per_call_us(new_length)
    settings = rerope.hf.Settings(window=2048)

    class Layer:            # what the attention function reads from the module
        is_causal = True
        layer_idx = 0

        class config:       # noqa: N801
            rope_parameters = {"rope_type": "default", "rope_theta": 5e5}

    positions = torch.tensor([[32767]], device="cuda")
    rows["hf_attention_function"] = per_call_us(lambda: rerope.hf.rerope_attention_forward(
        settings, Layer, q, k, v, None, scaling=0.125, position_ids=positions))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "shape": "B=1 Hq=32 Hkv=8 D=64 bf16, 32k cache",
            "unit": "microseconds per call, host-bound (200 calls, one sync)"}
    print(json.dumps(rows, indent=1))
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "us_per_call": {k2: round(v2, 1) for k2, v2 in rows.items()}},
                  f, indent=1)


if __name__ == "__main__":
    main()
