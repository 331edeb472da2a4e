"""Smoke test of an installed ``rerope`` (``make test-install`` runs it from an empty folder).

What a user does first, on the CPU (Triton's interpreter) or a GPU: import the installed
package beside Hugging Face's ``kernels``, run the op against the float64 reference, and run a
tiny random Llama through ``rerope.hf``: prefill logits against a float64 reference model and
``generate`` with the cache against recomputation. Prints each check; exits non-zero on failure.
"""

import importlib.metadata
import importlib.util
import os

import torch

import rerope
import rerope.hf
from rerope import reference

where = os.path.realpath(rerope.__file__)
print(f"rerope {rerope.__version__} from {os.path.dirname(where)}")
assert not where.startswith(os.path.realpath(os.getcwd()) + os.sep), "a copy in this folder"
files = [str(f) for f in importlib.metadata.files("rerope-triton")]
others = [f for f in files
          if not f.startswith(("rerope/", "rerope_triton-", "__editable__.rerope_triton"))]
print(f"the distribution holds {len(files)} files, the library's alone: {not others}")
assert not others, others      # no tests, book, benchmarks or probes in the wheel
hub = importlib.util.find_spec("kernels")
print("Hugging Face's kernels:", hub.origin if hub else "not installed")
import transformers  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

print(f"torch {torch.__version__}, transformers {transformers.__version__}")
device = "cuda" if torch.cuda.is_available() else "cpu"

# 1. The op against the float64 reference (fp32, GQA 4:2 heads, causal, window 5 < 19 tokens).
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, h, 19, 32, generator=gen) for h in (4, 2, 2))
out = rerope.rerope(q.to(device), k.to(device), v.to(device), window=5)
expected = reference.rerope(q.double(), k.double(), v.double(), 5)
error = (out.cpu().double() - expected).abs().max().item()
print(f"rerope vs float64 reference: max |difference| = {error:.2e}")
assert error < 1e-4, error

# 2. A tiny random Llama: logits against a float64 reference model, generate against recompute.
config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                     pad_token_id=0, initializer_range=0.15)


def build():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(device)


def unrotate(x, positions, base=10000.0):
    """Undo the model's RoPE (rotate_half convention) in float64."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angles = -positions.double()[:, None, :, None] * torch.cat([theta, theta])
    x = x.double()
    halves = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * torch.cos(angles) + halves * torch.sin(angles)


def reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    positions = kwargs["position_ids"][:1]
    out = reference.rerope(unrotate(query, positions), unrotate(key, positions), value.double(),
                           5, sm_scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("smoke_reference", reference_attention)
AttentionMaskInterface.register("smoke_reference", sdpa_mask)
ids = torch.randint(0, 97, (1, 17), generator=gen).to(device)
with torch.no_grad():
    expected_model = build()
    expected_model.set_attn_implementation("smoke_reference")
    expected_logits = expected_model(ids).logits
    model = rerope.hf.enable_rerope(build(), window=5)
    logits = model(ids).logits
error = (logits - expected_logits).abs().max().item()
print(f"tiny Llama with rerope.hf vs float64 reference model: max |difference| = {error:.2e}")
assert error < 1e-4, error

prompt = ids[:, :5]
with torch.no_grad():
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False)
    recomputed = prompt
    for _ in range(12):
        step = model(recomputed, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        recomputed = torch.cat([recomputed, step], dim=1)
print("generate (window 5, 12 new tokens):", cached[0].tolist())
assert torch.equal(cached, recomputed), "generate with the cache differs from recomputation"
print("smoke test passed")
