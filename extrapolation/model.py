"""A small Llama-style byte-level language model, and the position schemes it is evaluated with.

The model is trained with ordinary RoPE only. At evaluation time the *same weights* run with a
different :class:`Positions` scheme — plain RoPE, NTK-aware RoPE (a larger base), ReRoPE or Leaky
ReRoPE (through the fused kernel :func:`rerope.rerope`), each optionally with log-n query
scaling — with no fine-tuning. RoPE itself is :func:`rerope.rope.apply_rope` (the Llama /
Hugging Face ``rotate_half`` convention), the one definition the whole project uses.

Shapes: tokens ``(B, N)`` int64 bytes; hidden states ``(B, N, d_model)``; per-head tensors
``(B, H, N, D)`` with ``D = d_model / n_heads``; logits ``(B, N, 256)``.
"""

import json
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

import rerope
from rerope import reference
from rerope.rope import apply_rope, logn_scale

from .data import VOCAB_SIZE

KINDS = ("rope", "ntk", "rerope", "leaky")
BACKENDS = ("kernels", "reference")


@dataclass(frozen=True)
class Positions:
    """How attention encodes positions when the model runs.

    Attributes:
        kind: ``"rope"`` (what the model was trained with), ``"ntk"`` (RoPE with the NTK-aware
            base ``base · α^(D/(D-2))``), ``"rerope"`` (relative positions capped at ``window``)
            or ``"leaky"`` (beyond ``window`` they grow again by ``1/leaky`` per step).
        window: ReRoPE window ``w >= 1`` (``rerope``/``leaky`` only).
        leaky: Leaky ReRoPE factor ``κ > 1`` (``leaky`` only).
        ntk_alpha: NTK scale ``α >= 1``, usually target length / training length (``ntk`` only).
        logn_len: if set, queries at position ``i`` are scaled by ``max(1, log(i+1)/log(logn_len))``
            (log-n scaling; ``logn_len`` is the training length). Any kind.
        backend: ``"kernels"`` (the fused Triton kernel, :func:`rerope.rerope`) or
            ``"reference"`` (the naive two-matrix oracle) for ``rerope``/``leaky``.
    """

    kind: str = "rope"
    window: int | None = None
    leaky: float | None = None
    ntk_alpha: float | None = None
    logn_len: int | None = None
    backend: str = "kernels"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        windowed = self.kind in ("rerope", "leaky")
        if windowed and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"{self.kind} needs an int window >= 1, got {self.window!r}")
        if not windowed and self.window is not None:
            raise ValueError(f"window is for rerope/leaky, not {self.kind}")
        if (self.kind == "leaky") != (self.leaky is not None):
            raise ValueError("leaky (the factor κ > 1) is set exactly when kind is 'leaky'")
        if self.leaky is not None and not self.leaky > 1:
            raise ValueError(f"leaky must be > 1, got {self.leaky}")
        if (self.kind == "ntk") != (self.ntk_alpha is not None):
            raise ValueError("ntk_alpha is set exactly when kind is 'ntk'")
        if self.ntk_alpha is not None and not self.ntk_alpha >= 1:
            raise ValueError(f"ntk_alpha must be >= 1, got {self.ntk_alpha}")
        if self.logn_len is not None and (not isinstance(self.logn_len, int) or self.logn_len < 2):
            raise ValueError(f"logn_len must be an int >= 2 or None, got {self.logn_len!r}")

    @property
    def name(self):
        """A short label, e.g. ``'ReRoPE w=64 + log-n'``."""
        if self.kind == "rope":
            label = "RoPE"
        elif self.kind == "ntk":
            label = f"NTK-aware RoPE α={self.ntk_alpha:g}"
        elif self.kind == "rerope":
            label = f"ReRoPE w={self.window}"
        else:
            label = f"Leaky ReRoPE w={self.window} κ={self.leaky:g}"
        return label + (" + log-n" if self.logn_len is not None else "")

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}


ROPE = Positions()


def ntk_base(base, head_dim, alpha):
    """The NTK-aware RoPE base ``base · α^(D/(D-2))``: the lowest frequency slows by ``α``, the highest not at all."""
    return base * alpha ** (head_dim / (head_dim - 2))


def attend(q, k, v, positions, base):
    """Causal attention of raw (un-rotated) ``q`` ``(B, Hq, N, D)``, ``k, v``
    ``(B, Hkv, N, D)``.

    RoPE / NTK run through :func:`rerope.rope.apply_rope` and PyTorch's
    ``scaled_dot_product_attention``; ReRoPE / Leaky ReRoPE through
    :func:`rerope.rerope` (or the naive reference). Returns ``(B, Hq, N, D)``.
    """
    if positions.kind in ("rerope", "leaky"):
        op = rerope.rerope if positions.backend == "kernels" else reference.rerope
        return op(q, k, v, positions.window, causal=True, base=base,
                  leaky=positions.leaky, logn_len=positions.logn_len)
    n = q.shape[-2]
    if positions.kind == "ntk":
        base = ntk_base(base, q.shape[-1], positions.ntk_alpha)
    if positions.logn_len is not None:
        q = q * logn_scale(n, positions.logn_len, device=q.device).to(q.dtype)[:, None]
    idx = torch.arange(n, device=q.device)
    q, k = apply_rope(q, idx, base), apply_rope(k, idx, base)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`ByteLM`; ``head_dim = d_model / n_heads`` must be 16, 32, 64, 128 or 256."""

    vocab_size: int = VOCAB_SIZE
    d_model: int = 256
    n_layers: int = 5
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 640
    rope_base: float = 10000.0
    train_len: int = 256
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"need d_model % n_heads == 0 and n_heads % n_kv_heads == 0, got "
                             f"{self.d_model}, {self.n_heads}, {self.n_kv_heads}")
        if self.head_dim not in (16, 32, 64, 128, 256):
            raise ValueError(f"head_dim = d_model / n_heads must be a power of two in 16..256 "
                             f"(the kernels' head dims), got {self.head_dim}")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` over the last dimension, computed in float32."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Grouped-query self-attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def forward(self, x, positions):
        batch, n, _ = x.shape
        hd = self.cfg.head_dim

        def heads(t, count):   # (B, N, count·D) -> (B, count, N, D)
            return t.view(batch, n, count, hd).transpose(1, 2)

        q = heads(self.wq(x), self.cfg.n_heads)
        k, v = heads(self.wk(x), self.cfg.n_kv_heads), heads(self.wv(x), self.cfg.n_kv_heads)
        out = attend(q, k, v, positions, self.cfg.rope_base)
        return self.wo(out.transpose(1, 2).reshape(batch, n, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``."""

    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.d_model, cfg.norm_eps), SwiGLU(cfg)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class ByteLM(nn.Module):
    """Decoder-only byte-level language model; ``forward(tokens (B, N), positions)`` -> logits ``(B, N, 256)``."""

    def __init__(self, cfg=ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for block in self.blocks:   # residual branches scaled down with depth (GPT-2 style)
            for proj in (block.attn.wo, block.mlp.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, positions=ROPE):
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32, torch.uint8):
            raise ValueError(f"tokens must be a (B, N) integer tensor, got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        x = self.embed(tokens.long())
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x)).float()


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def token_losses(model, tokens, positions=ROPE):
    """Cross-entropy (nats) of predicting byte ``t+1`` from bytes ``<= t``: ``(B, N-1)`` float32.

    ``tokens`` is ``(B, N)``; the model reads ``tokens[:, :-1]`` (``N - 1`` positions).
    """
    logits = model(tokens[:, :-1], positions)
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:].long(), reduction="none")


def save_weights(model, path, meta=None, dtype=torch.bfloat16):
    """Write the weights (as ``dtype``) and the :class:`ModelConfig` (metadata) to a safetensors file."""
    from safetensors.torch import save_file
    tensors = {name: t.detach().to(dtype).cpu().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"config": json.dumps(asdict(model.cfg)),
                                            "meta": json.dumps(meta or {})})


def load_model(path, device="cpu", dtype=torch.float32):
    """Read ``save_weights``'s file: returns ``(model in eval mode on device, meta dict)``."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        state = {name: file.get_tensor(name) for name in file.keys()}
    model = ByteLM(ModelConfig(**json.loads(metadata["config"])))
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()})
    return model.to(device=device, dtype=dtype).eval(), json.loads(metadata.get("meta", "{}"))
