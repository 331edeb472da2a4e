"""Does ReRoPE extrapolate? A small byte-level Llama-style model, trained here, evaluated past its length.

Chapter 11 of the book. The modules, in the order the experiment runs:

1. :mod:`extrapolation.data`      the corpus (the Python standard library's sources, bytes),
                                   its train / validation split by file, the held-out slice
2. :mod:`extrapolation.model`     the model (RMSNorm, SwiGLU, RoPE in the ``rotate_half``
                                   convention, grouped-query attention) and the position schemes
                                   it can be evaluated with (RoPE, NTK-aware RoPE, ReRoPE, Leaky
                                   ReRoPE, each with or without log-n); ReRoPE runs through
                                   :func:`rerope.rerope`
3. :mod:`extrapolation.train`     ``python -m extrapolation.train --seed 0``: trains with
                                   ordinary RoPE at 256 bytes, writes the weights and loss curve
4. :mod:`extrapolation.evaluate`  ``python -m extrapolation.evaluate``: held-out loss per position
                                   at 1x ... 16x the training length, the window ablation, a
                                   passkey test; writes ``book/data/extrapolation_h200.json``
"""
