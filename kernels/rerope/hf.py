"""ReRoPE in a Hugging Face ``transformers`` model, through transformers' own attention registry.

Chapter 10 of the book. One call switches every attention layer of a Llama-style model::

    import rerope.hf
    model = rerope.hf.enable_rerope(model, window=512)     # leaky=, logn_len=, group= as rerope.rerope
    model.generate(input_ids, max_new_tokens=100)                # prefill and decode run ReRoPE
    rerope.hf.disable_rerope(model)                             # back to what it ran before

No model class or method is replaced. transformers looks attention up by name
(``config._attn_implementation``) in two registries: ``AttentionInterface`` (the function that
attends) and ``AttentionMaskInterface`` (the function that builds the mask handed to it, called
once per forward). :func:`enable_rerope` registers one of each under a name that spells the
settings (e.g. ``rerope_w512``) and calls ``model.set_attn_implementation(name)``.

What the model hands the attention function (transformers 5.x, Llama / Mistral / Qwen2):
``query`` ``(B, Hq, Nq, D)`` and ``key, value`` ``(B, Hkv, Nk, D)``, RoPE already applied at each
token's position, ``key, value`` the whole dynamic KV cache (rotated keys, one slot per token in
order, the new tokens last); ``attention_mask`` is what our mask function returned; ``scaling``
the score scale; ``position_ids`` ``(B or 1, Nq)`` in ``kwargs``. It returns
``(out (B, Nq, Hq, D), None)``. Rotated inputs are all ReRoPE needs (see
:mod:`rerope.rotary`): inside the window ``q_rot · k_rot`` is RoPE's score as is; outside it
the kernels turn the pair to the clamped position in registers. So prefill runs
``rerope.rerope(..., rotated=True)``, a generation step ``rerope.rerope_decode`` on the
model's own cache: no second cache, no re-rotation of the cache.

Positions. The kernels take key slot ``j`` as position ``j`` and the queries as the last ``Nq``
slots. ReRoPE's scores depend only on differences of positions, so a row whose tokens sit at
``j + c`` for a constant ``c`` is fine; log-n scaling (absolute positions) is then done here from
``position_ids``. Padding: a row's real tokens must be contiguous in the cache (left padding,
as ``generate`` wants for decoder-only models, or right padding in a single forward); such rows
run one kernel call each on their slice. Anything else — padding between tokens (right-padded
prompts in ``generate``), packed sequences, sliding-window caches, custom 4D masks,
positions that do not step by one along the cache — raises a ``ValueError``: never a silently
wrong result.

Fast generation. transformers' recipe — a static cache (``cache_implementation="static"``) and
``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``, which
replays each step as CUDA graphs — works for unpadded batches: with a static cache every layer
gets the whole preallocated cache, and a step runs the decode kernel on it with per-row lengths
computed on the device (:class:`StaticRows`), no slicing, no host sync. The ops are registered
``torch.library`` ops, opaque to the compiler. With the dynamic cache a compiled forward breaks
the graph where the mask function reads the padding mask on the host (as transformers' own
sdpa mask does): use the static cache for compiled generation.

RoPE types. ``default``, ``linear``, ``llama3`` (Llama 3.x) and static ``yarn`` differ only in
the per-frequency angles ``θ_t`` (and YaRN's attention factor, below). The kernels turn tiles by
a table of angles, so the table is built from the model's own frequencies: the ``inv_freq`` of
its rotary embedding (``model.model.rotary_emb``), read once by :func:`enable_rerope` and passed
as ``inv_freq=`` to every kernel call. YaRN's attention factor ``s`` (``attention_scaling``)
multiplies cos and sin, so it is inside the rotated ``q`` and ``k`` the layers hand over:
``q_rot · k_rot = s² · (R(i) q · R(j) k)``, and the kernels' turned pair outside the window is
``R(w − i) q_rot · R(−j) k_rot = s² · R(w) q · k``: every score, in both products, carries
``s²``, as in the stock model; nothing is applied twice. ``dynamic`` (frequencies that change
with the sequence length) and ``longrope`` (two sets switched by length) are refused.

transformers is imported inside the functions, so ``import rerope`` stays light.
"""

import copy
import functools
import hashlib
import math
import numbers
import os
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from ._validate import DEFAULT_BASE, HEAD_DIMS, Frequencies, as_frequencies, check_rope_settings
from .attention import rerope
from .decode import MAX_QUERIES, _call as _decode_call, rerope_decode
from .rope import rope_frequencies

# Model types whose attention layers are verified to match what this module expects
# (``rotate_half`` RoPE applied before the registry call, the dynamic cache updated with the
# rotated keys, ``position_ids`` passed through): tests/test_hf.py runs each one.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# RoPE types (``rope_parameters["rope_type"]``) whose angles are fixed per frequency, so that the
# kernels' angle tables built from the model's ``inv_freq`` are exact: tests/test_hf.py runs each.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_PREFIX = "rerope_w"
_PREVIOUS = weakref.WeakKeyDictionary()   # model -> attention implementation before ReRoPE


@dataclass(frozen=True)
class Settings:
    """One registered ReRoPE implementation: its window and options (as :func:`rerope.rerope`)
    and the model's RoPE frequencies, resolved once by :func:`enable_rerope`: ``base`` (the
    frequencies ``base ** (-2t / D)``) or ``inv_freq`` (:class:`rerope.rope.Frequencies`, the
    model's own; ``base`` then stays at its default), and the RoPE type they came from."""

    window: int
    leaky: Optional[float] = None
    logn_len: Optional[float] = None
    base: float = DEFAULT_BASE
    inv_freq: Optional[Frequencies] = None
    rope_type: str = "default"
    group: Optional[int] = None
    # (type, scaling) -> rerope_decode's settings and their types, made once per scaling
    _decode: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def name(self):
        """The registry name, e.g. ``rerope_w512``, ``rerope_w512_leaky16.0_logn4096.0``,
        ``rerope_w512_group8`` (Self-Extend), ``rerope_w512_base500000.0``,
        ``rerope_w512_llama3_3c1f0e9a2b`` (the frequencies' digest)."""
        name = f"{_PREFIX}{self.window}"
        if self.leaky is not None:
            name += f"_leaky{self.leaky!r}"
        if self.group is not None:
            name += f"_group{self.group}"
        if self.logn_len is not None:
            name += f"_logn{self.logn_len!r}"
        if self.inv_freq is not None:
            digest = hashlib.sha1(repr(tuple(self.inv_freq)).encode()).hexdigest()[:10]
            name += f"_{self.rope_type}_{digest}"
        elif self.base != DEFAULT_BASE:
            name += f"_base{self.base!r}"
        return name

    def _decode_settings(self, scaling):
        """``(settings, types)``: :func:`rerope.rerope_decode`'s settings tuple for a call of
        these settings with ``sm_scale=scaling`` on rotated inputs (as ``_attend`` makes it),
        and ``tuple(map(type, settings))``; made on first use and kept, so that a generation
        step's layers pass the same objects (their exact signature compares by identity)."""
        key = (type(scaling), scaling)
        held = self._decode.get(key)
        if held is None:
            inv_freq = as_frequencies(self.inv_freq)
            settings = (self.window, scaling, self.base, self.leaky, self.logn_len, True,
                        None, inv_freq, self.group)
            held = (settings, tuple(map(type, settings)))
            if inv_freq is self.inv_freq:     # not a tensor: its values are read per call
                self._decode[key] = held
        return held


# --- the public calls ---------------------------------------------------------------------------


def enable_rerope(model, window, leaky=None, logn_len=None, group=None):
    """Switch every attention layer of ``model`` to (Leaky) ReRoPE or Self-Extend.

    Args:
        model: a transformers ``PreTrainedModel`` of a Llama-style architecture (``model_type``
            in :data:`SUPPORTED_MODEL_TYPES`), with RoPE of a type in
            :data:`SUPPORTED_ROPE_TYPES` (``default``, ``linear``, ``llama3``, static ``yarn``;
            not ``dynamic`` nor ``longrope``) over the whole head dim, full causal attention
            (no sliding window), a head dim in ``16, 32, 64, 128, 256`` and fp16, bf16 or fp32
            weights.
        window: int ``>= 1``, ReRoPE's window ``w``: relative positions below ``w`` keep RoPE,
            the rest are clamped to ``w`` (or grow as ``w + (d - w) / leaky``).
        leaky: ``None`` (ReRoPE) or Leaky ReRoPE's factor, a float ``> 1``.
        logn_len: ``None`` or the training length, a number ``> 1``: queries are scaled by
            ``max(1, log(i + 1) / log(logn_len))`` at their position ``i``.
        group: ``None``, or Self-Extend's group size ``G`` (an int ``>= 1`` dividing
            ``window``; not with ``leaky``): relative positions ``d >= w`` become
            ``⌊i/G⌋ - ⌊j/G⌋ + w - w/G`` (:func:`rerope.rerope`). Grouping depends on absolute
            positions: a row whose ``position_ids`` are not its cache slots counted from its
            first real token (``generate``'s own, with left padding too) raises ``ValueError``.

    Returns:
        ``model`` itself, switched (its ``config._attn_implementation`` is the registered
        name, e.g. ``rerope_w512``).

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``model`` is not a ``PreTrainedModel``, or a setting has the wrong type.
        ValueError: a model or a setting this module does not support (the message says which).
        RuntimeError: transformers did not switch the model (its code does not dispatch
            attention through transformers' registry).

    RoPE's frequencies are read here, once, from the model's rotary embedding (its
    ``inv_freq`` buffer: what really rotates ``q`` and ``k``, also after ``model.to(bfloat16)``
    rounded it), or computed from the config when the model has none; for ``default`` RoPE
    whose buffer is ``rope_theta``'s frequencies, the base itself. Enable after casting the
    model (``model.to(dtype)`` casts that buffer too). YaRN's attention factor is already in
    the rotated ``q, k`` (module docstring). The switch is made on ``model.config``: models
    built from the same config object switch together. Undo with :func:`disable_rerope`.
    Prefill (and training: the op is differentiable) runs :func:`rerope.rerope`, generation
    steps of up to 16 new tokens :func:`rerope.rerope_decode`, both with ``rotated=True`` on
    the model's own cache.
    """
    config = _check_model(model)
    rope_type, base, inv_freq = _model_frequencies(model, config)
    check_rope_settings(window, base, leaky, logn_len, inv_freq=inv_freq, group=group)
    settings = Settings(int(window), None if leaky is None else float(leaky),
                        None if logn_len is None else float(logn_len), base, inv_freq,
                        rope_type, None if group is None else int(group))
    _register(settings)
    current = config._attn_implementation
    if not _is_rerope(current):
        _PREVIOUS[model] = current
    _set_implementation(model, settings.name)
    return model


def disable_rerope(model):
    """Undo :func:`enable_rerope`: back to the attention implementation ``model`` had before.

    Args:
        model: a transformers model on which :func:`enable_rerope` switched ReRoPE on.

    Returns:
        ``model`` itself, on its earlier attention implementation (``"sdpa"`` if that is
        unknown, e.g. for a model loaded with a ReRoPE name).

    Raises:
        ValueError: ReRoPE is not enabled on ``model``.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not _is_rerope(current):
        raise ValueError(f"ReRoPE is not enabled on this model (its attention implementation "
                         f"is {current!r}); call rerope.hf.enable_rerope(model, window) first")
    _set_implementation(model, _PREVIOUS.pop(model, None) or "sdpa")
    return model


def is_rerope_enabled(model):
    """Whether ``model`` currently runs a ReRoPE implementation of this module.

    Args:
        model: any object; a transformers model is looked at through
            ``model.config._attn_implementation``.

    Returns:
        bool.
    """
    return _is_rerope(getattr(getattr(model, "config", None), "_attn_implementation", None))


def _is_rerope(name):
    return isinstance(name, str) and name.startswith(_PREFIX)


def _set_implementation(model, name):
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:      # transformers only logs a warning then
        raise RuntimeError(
            f"{type(model).__name__} did not switch to the attention implementation {name!r} "
            f"(it still runs {model.config._attn_implementation!r}): transformers refuses to "
            "switch models whose code does not dispatch through ALL_ATTENTION_FUNCTIONS")


# --- what a model must be -----------------------------------------------------------------------


def _check_model(model):
    """The checks of :func:`enable_rerope`; returns ``model.config``."""
    try:
        from transformers import PreTrainedModel
    except ImportError as error:
        raise ImportError("rerope.hf needs Hugging Face transformers (pip install "
                          "'transformers>=5.17,<6'); never the PyPI package named 'kernels'"
                          ) from error
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model has model_type {model_type!r}, which is not a supported Llama-style model "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}): ReRoPE here needs rotate_half RoPE "
            "applied before transformers' attention registry and a dynamic KV cache of rotated "
            "keys. Another architecture with that layout can be added to "
            "rerope.hf.SUPPORTED_MODEL_TYPES after checking it against tests/test_hf.py")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config.layer_types has {sorted(set(layer_types))}: sliding-window or "
                         "other non-full attention layers are not supported with ReRoPE")
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"config.sliding_window = {config.sliding_window}: sliding-window "
                         "attention is not supported with ReRoPE (set config.sliding_window = "
                         "None before building the model)")
    if not getattr(config, "is_causal", True):
        raise ValueError("config.is_causal is False: ReRoPE here supports causal attention only")
    head_dim = _head_dim(config)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the model's head dim is {head_dim}; the kernels take {HEAD_DIMS}")
    _rope_type(_rope_parameters(config))
    return config


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_type(params, where="config.rope_parameters"):
    """``params``' RoPE type; ``ValueError`` unless it is in :data:`SUPPORTED_ROPE_TYPES`."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(
            f"the model's RoPE has rope_type {rope_type!r} ({where} = {params!r}): its "
            "frequencies change with the sequence length, so no fixed table of angles matches "
            "them; supported rope types: " + ", ".join(SUPPORTED_ROPE_TYPES))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"the model's RoPE has rope_type {rope_type!r} ({where} = {params!r}), which "
            "rerope.hf does not support; supported rope types: "
            + ", ".join(SUPPORTED_ROPE_TYPES))
    return rope_type


def _model_frequencies(model, config):
    """``(rope_type, base, inv_freq)`` of ``model``, for :class:`Settings` (called once, by
    :func:`enable_rerope`).

    The frequencies are the model's rotary embedding's ``inv_freq`` (what rotates its ``q, k``;
    its ``rope_type`` is checked too), or, without such a module, those transformers' own
    ``ROPE_INIT_FUNCTIONS`` compute from the config. For ``default`` RoPE whose frequencies are
    ``rope_theta``'s (to float32 rounding), ``inv_freq`` is ``None`` and the kernels compute
    them in float64 from the base; otherwise (a scaled RoPE, or a buffer rounded by
    ``model.to(bfloat16)``) ``base`` is the default and ``inv_freq`` the model's values.
    """
    params = _rope_parameters(config)
    rope_type = _rope_type(params)
    base = _rope_base(params)
    head_dim = _head_dim(config)
    rotary = _rotary_embedding(model)
    values = None
    if rotary is not None:
        module_type = getattr(rotary, "rope_type", rope_type)
        if module_type != rope_type:
            _rope_type({"rope_type": module_type}, where=f"{type(rotary).__name__}.rope_type")
            rope_type = module_type            # the module is what rotates q and k
        if rotary.inv_freq.device.type != "meta":
            values = rotary.inv_freq
    if values is None:
        values = _frequencies_from_config(config, rope_type, base, head_dim)
    inv_freq = as_frequencies(values, name="the model's inv_freq")
    if len(inv_freq) != head_dim // 2:
        raise ValueError(f"the model's rotary embedding has {len(inv_freq)} frequencies, but its "
                         f"head dim {head_dim} needs {head_dim // 2}: RoPE on part of the head "
                         "dim is not supported, the kernels rotate every dimension")
    if rope_type == "default":
        exact = rope_frequencies(head_dim, base)
        error = (torch.tensor(inv_freq, dtype=torch.float64) - exact).abs()
        if bool((error <= 1e-6 * exact).all()):      # the base's, rounded to float32 at most
            return rope_type, base, None
    return rope_type, DEFAULT_BASE, inv_freq


def _rotary_embedding(model):
    """The model's one rotary embedding module (the module with an ``inv_freq`` tensor), or
    ``None``; ``ValueError`` if several hold different frequencies."""
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    for other in found[1:]:
        if (other.inv_freq.shape != found[0].inv_freq.shape
                or not torch.equal(other.inv_freq.cpu(), found[0].inv_freq.cpu())):
            raise ValueError(f"the model has {len(found)} rotary embeddings with different "
                             "frequencies (per-layer RoPE), which rerope.hf does not support")
    return found[0] if found else None


def _frequencies_from_config(config, rope_type, base, head_dim):
    """RoPE's frequencies as transformers computes them from ``config`` (float32, CPU)."""
    if rope_type == "default":
        return rope_frequencies(head_dim, base)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # a copy: these functions may rewrite the config's RoPE parameters in place
    inv_freq, _attention_factor = ROPE_INIT_FUNCTIONS[rope_type](copy.deepcopy(config), "cpu")
    return inv_freq


def _rope_parameters(config):
    """RoPE's parameters from ``config`` as one dict; ``ValueError`` for per-layer-type RoPE
    or RoPE on part of the head dim.

    transformers 5 keeps ``config.rope_parameters = {"rope_type": ..., "rope_theta": ...}``;
    4.x kept ``config.rope_theta`` and ``config.rope_scaling`` (``None`` for default RoPE).
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None))
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.rope_parameters = {params!r}: per-layer-type RoPE parameters "
                         "are not supported; expected one dict with rope_type and rope_theta")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor = {partial}: RoPE on part of the head dim is "
                         "not supported, the kernels rotate every dimension")
    return params


def _rope_base(params):
    """``rope_theta`` from :func:`_rope_parameters`' dict, as a float."""
    base = params.get("rope_theta")
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise ValueError(f"the config has no usable rope_theta (RoPE base): got {base!r}")
    return float(base)


# --- the registry -------------------------------------------------------------------------------


def _register(settings):
    """Register the attention and mask functions of ``settings`` under ``settings.name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(settings.name,
                                functools.partial(rerope_attention_forward, settings))
    AttentionMaskInterface.register(settings.name, rerope_mask)


@dataclass(frozen=True)
class PaddedRows:
    """What :func:`rerope_mask` hands the attention layers when some tokens are padding: the
    slots ``[starts[b], ends[b])`` of row ``b`` hold its real tokens (possibly none)."""

    starts: tuple
    ends: tuple
    n_keys: int


def rerope_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                mask_function=None, attention_mask=None, cache_position=None, **kwargs):
    """The mask function registered with ``AttentionMaskInterface``, called once per forward.

    transformers calls it with keywords, as it calls ``sdpa_mask``. The ``q_length`` new tokens
    are the last of the ``kv_length`` key slots (dynamic cache: ``q_offset + q_length ==
    kv_length``), the causal mask aligned to the bottom right corner, as the kernels apply it;
    this function builds no mask of its own, it only says which slots of each row are real.

    Args:
        batch_size: int ``B``.
        q_length: int ``Nq``, the new tokens (earlier 5.x releases, 5.0 among them, passed
            ``cache_position`` instead).
        kv_length: int ``Nk``, the key slots the layers will get.
        q_offset: the number of cached tokens before the new ones: an int, or a 0-dim integer
            tensor (a static cache inside a compiled forward).
        kv_offset: must be 0 (sliding-window caches are not supported).
        mask_function: ``None`` or transformers' ``causal_mask_function``; any other pattern
            raises ``ValueError``.
        attention_mask: ``None`` or the 2D padding mask ``(B, >= Nk)`` (bool or integer, 1 for
            a real token), on any device.
        cache_position: ``(Nq,)`` integer tensor, the new tokens' positions; read only when
            ``q_length`` is ``None``.
        kwargs: transformers' other keywords, ignored.

    Returns:
        ``None`` when no token is padding (the kernels' causal mask is all there is); a
        :class:`PaddedRows` when some are, with a dynamic cache; with a static cache (fewer
        filled slots than ``kv_length``, or a tensor ``q_offset``) the filled length of every
        row, ``q_offset + Nq``, as a ``(B, 1, 1, 1)`` int32 tensor on ``attention_mask``'s
        device (:func:`is_static_lengths`).

    Raises:
        ValueError: for what the kernels cannot express: any mask pattern other than causal
            (packed sequences, sliding windows, bidirectional or custom overlays), a cache
            other than a dynamic or static one, a padding mask that is not 2D, padding
            between a row's tokens, padding with a static cache (inside a compiled forward a
            device-side assertion instead).
    """
    from transformers.masking_utils import causal_mask_function

    _this_forward.update(key=None, tensor=None, offsets=None)    # a new forward: read again
    if mask_function is not None and mask_function is not causal_mask_function:
        raise ValueError(
            f"the model asked for a mask other than plain causal "
            f"({getattr(mask_function, '__name__', mask_function)}): "
            "packed sequences (position_ids restarting within a row), sliding windows, "
            "bidirectional attention and custom mask overlays are not supported with ReRoPE")
    if q_length is None:                                  # the cache_position convention
        q_length = len(cache_position)
        q_offset = cache_position[0] if q_length else 0
    if kv_offset != 0:
        raise ValueError(f"the cache layout is not supported: key slots from offset {kv_offset} "
                         "(sliding-window caches are not supported with ReRoPE)")
    if isinstance(q_offset, torch.Tensor) or int(q_offset) + q_length < kv_length:
        return _static_rows(batch_size, q_length, kv_length, q_offset, attention_mask)
    if int(q_offset) + q_length != kv_length:
        raise ValueError(
            f"the cache layout is not supported: {q_length} new tokens after {int(q_offset)} "
            f"cached ones, but {kv_length} key slots from offset {kv_offset}. ReRoPE needs a "
            "dynamic cache (transformers' default DynamicCache) whose slots are the tokens in "
            "order (a DynamicCache), or a static cache (StaticCache) of unpadded rows")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(f"attention_mask must be a 2D padding mask (batch, tokens), got shape "
                         f"{tuple(attention_mask.shape)}; custom 4D masks are not supported")
    if attention_mask.shape[1] < kv_length:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens, but the cache "
                         f"and the input hold {kv_length}")
    valid = attention_mask[:, :kv_length].bool()
    if bool(valid.all()):                   # one host sync per forward, as for sdpa's mask
        return None
    valid = valid.cpu()
    counts = valid.sum(1)
    starts = valid.int().argmax(1)          # the first real slot (0 for an empty row)
    ends = starts + counts
    slots = torch.arange(kv_length)
    contiguous = (slots >= starts[:, None]) & (slots < ends[:, None])
    broken = (contiguous != valid).any(1)
    if bool(broken.any()):
        row = int(broken.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding between real tokens: ReRoPE here needs each "
            "row's tokens contiguous in the cache. Right-padded prompts in generate() do this "
            "(the new tokens land after the padding): pad on the left instead "
            "(tokenizer.padding_side = 'left')")
    return PaddedRows(tuple(starts.tolist()), tuple(ends.tolist()), kv_length)


def is_static_lengths(mask):
    """Whether ``mask`` is what :func:`rerope_mask` returns for a static cache: the filled
    length of every row, ``q_offset + Nq``, as a ``(B, 1, 1, 1)`` int32 tensor.

    A 4D tensor, because transformers hands a 4D mask made ahead of the forward (as
    ``generate`` does for static caches) to the layers unchanged; int32, which no attention mask
    of transformers is (they are bool or float). It is computed on the device, so a compiled
    forward replays it in a CUDA graph, and the decode kernel reads it as ``cache_seqlens``.

    Args:
        mask: what the attention layers got as ``attention_mask`` (any object).

    Returns:
        bool.
    """
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4
            and tuple(mask.shape[1:]) == (1, 1, 1))


def _static_rows(batch_size, q_length, kv_length, q_offset, attention_mask):
    """The static-cache mask (:func:`is_static_lengths`); padding is refused (eagerly with a
    ``ValueError``; inside a compiled forward with a device-side assertion, since reading the
    mask on the host would break the graph)."""
    compiling = torch.compiler.is_compiling()
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ValueError(f"attention_mask must be a 2D padding mask (batch, tokens), got shape "
                             f"{tuple(attention_mask.shape)}; custom 4D masks are not supported")
        if compiling:
            torch._assert_async(attention_mask.bool().all(),
                                "rerope.hf: padding is not supported with a static cache")
        elif not bool(attention_mask.bool().all()):
            raise ValueError(
                "attention_mask has padding, and the model uses a static cache: ReRoPE supports "
                "padded batches with the default dynamic cache only (or run the rows one by one)")
    device = attention_mask.device if attention_mask is not None else None
    if isinstance(q_offset, torch.Tensor):
        n_keys = None if compiling else int(q_offset) + q_length
        seqlens = (q_offset.to(torch.int32) + q_length).reshape(1, 1, 1, 1)
    else:
        n_keys = int(q_offset) + q_length
        seqlens = torch.full((1, 1, 1, 1), n_keys, dtype=torch.int32, device=device)
    if n_keys is not None and n_keys > kv_length:
        raise ValueError(f"{q_length} new tokens after {n_keys - q_length} cached ones do not fit "
                         f"in the static cache of {kv_length} slots")
    return seqlens.expand(batch_size, 1, 1, 1).contiguous()


def rerope_attention_forward(settings, module, query, key, value, attention_mask, dropout=0.0,
                             scaling=None, is_causal=None, **kwargs):
    """The attention function registered with ``AttentionInterface`` (bound to ``settings``).

    The ``Nq`` queries are the new tokens, the last ``Nq`` of a row's ``L`` filled cache slots
    (dynamic cache: ``L = Nk``; static cache: ``L`` from ``attention_mask``), the causal mask
    aligned to the bottom right corner: query ``n`` attends slots ``j <= L - Nq + n`` (with
    padding, only the row's real tokens).

    Args:
        settings: the :class:`Settings` registered by :func:`enable_rerope`.
        module: the model's attention layer.
        query: ``(B, Hq, Nq, D)``, RoPE-rotated at each token's position; fp16, bf16 or fp32.
        key: ``(B, Hkv, Nk, D)``, the whole KV cache (keys rotated), ``Nk >= Nq``, the new
            tokens the last ``Nq`` filled slots; ``Hq % Hkv == 0`` (never repeated here);
            ``query``'s dtype and device.
        value: ``(B, Hkv, Nk, D)``, ``query``'s dtype and device.
        attention_mask: ``None``, a :class:`PaddedRows` or a ``(B, 1, 1, 1)`` int32 tensor of
            row lengths (:func:`is_static_lengths`), from :func:`rerope_mask`.
        dropout: must be 0 (the kernels have no dropout).
        scaling: float, the score scale (``1/sqrt(D)`` when ``None``).
        is_causal: ``None`` or ``True`` (``False`` raises ``ValueError``).
        kwargs: ``position_ids`` ``(B or 1, Nq)``; ``sliding_window`` / ``softcap`` /
            ``s_aux`` must be absent or ``None``.

    Returns:
        ``(out, None)``: ``out`` ``(B, Nq, Hq, D)`` in ``query``'s dtype, contiguous; rows'
        padding queries get zeros.

    A generation step of the dynamic cache — one new token, no padding, neither log-n nor
    Self-Extend, no gradient wanted, not compiling — takes the shortest path: no position
    is read (``position_ids``' shape is checked), the decode settings are those kept by
    ``settings``, and the decode step writes ``out`` in this layout (no transpose).
    """
    _check_call(module, attention_mask, dropout, is_causal, kwargs)
    n_q, n_k = query.shape[2], key.shape[2]
    rows = attention_mask
    if (rows is None and n_q == 1 and n_k > 1 and not _uses_positions(settings)
            and not _needs_grad(query, key, value) and not torch.compiler.is_compiling()):
        # a generation step: nothing to scale or group, no position to read (shape checked)
        _position_offsets(kwargs.get("position_ids"), None, query.shape[0], 1, n_k, False)
        decode_settings, types = settings._decode_settings(scaling)
        return _decode_call(query, key, value, None, None, decode_settings, types=types,
                            heads_last=True), None
    if is_static_lengths(rows):
        return _attend_static(settings, query, key, value, rows.view(-1), scaling,
                              kwargs), None
    offsets = _position_offsets(kwargs.get("position_ids"), rows, query.shape[0], n_q, n_k,
                                _uses_positions(settings))
    if rows is None:
        _check_group_positions(settings, offsets, kernel_offset=0)
        query, logn_len = _logn_here(query, settings, offsets, kwargs, kernel_offset=0)
        out = _attend(query, key, value, settings, scaling, logn_len)
    else:
        if rows.n_keys != n_k or len(rows.starts) != query.shape[0]:
            raise ValueError(f"the padding mask was made for {len(rows.starts)} rows of "
                             f"{rows.n_keys} keys, but the layer got {query.shape[0]} rows of "
                             f"{n_k} keys")
        out = query.new_zeros(query.shape)
        first_query = n_k - n_q                       # slot of query 0
        for b, (start, end) in enumerate(zip(rows.starts, rows.ends)):
            lo = max(start, first_query)              # the row's real queries: slots [lo, end)
            if lo >= end:
                continue
            q_b = query[b:b + 1, :, lo - first_query:end - first_query]
            _check_group_positions(settings, offsets[b:b + 1], kernel_offset=-start)
            q_b, logn_len = _logn_here(q_b, settings, offsets[b:b + 1], kwargs,
                                       kernel_offset=-start,
                                       rows=(b, lo - first_query, end - first_query))
            out[b:b + 1, :, lo - first_query:end - first_query] = _attend(
                q_b, key[b:b + 1, :, start:end], value[b:b + 1, :, start:end], settings,
                scaling, logn_len)
    return out.transpose(1, 2).contiguous(), None


def _check_call(module, attention_mask, dropout, is_causal, kwargs):
    if (attention_mask is not None and not isinstance(attention_mask, PaddedRows)
            and not is_static_lengths(attention_mask)):
        raise ValueError(
            f"the ReRoPE attention got an attention_mask of type {type(attention_mask).__name__}, "
            "not one made by rerope.hf.rerope_mask: custom (4D) masks are not supported; pass "
            "a 2D padding mask (batch, tokens) to the model instead")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by the ReRoPE kernels "
                         "(set config.attention_dropout = 0.0, or call model.eval())")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError("non-causal attention is not supported with ReRoPE here")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the attention layer passed {name}={kwargs[name]!r}, which the "
                             "ReRoPE kernels do not support")


def _attend_static(settings, query, key, value, seqlens, scaling, kwargs):
    """Attention over a static cache: ``key, value`` the whole preallocated cache,
    ``seqlens`` ``(B,)`` int32 the filled slots per row (:func:`is_static_lengths`). A generation
    step runs the decode kernel on the whole cache with ``cache_seqlens=seqlens`` (no slicing, no
    host sync: what a compiled forward captures in a CUDA graph); a prefill runs
    :func:`rerope.rerope` on the filled slots. Positions are the slots (rows are unpadded);
    log-n's positions are checked eagerly, not inside a compiled forward (that needs a sync)."""
    n_q = query.shape[2]
    compiling = torch.compiler.is_compiling()
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                              or value.requires_grad)
    decode = n_q <= MAX_QUERIES and not needs_grad
    logn_len = settings.logn_len
    n_keys = None
    if compiling:
        if not decode:      # compiled: a long chunk must be the prefill of an empty cache
            torch._assert_async(seqlens[0] == n_q, "rerope.hf: in a compiled forward a static "
                                "cache takes more than 16 new tokens only as its first chunk")
            n_keys = n_q
    elif not decode or logn_len is not None:
        n_keys = int(seqlens[0])                   # a host sync, eager prefill or log-n only
    if logn_len is not None and not compiling:
        offsets = _position_offsets(kwargs.get("position_ids"), None, query.shape[0], n_q,
                                    n_keys)
        query, logn_len = _logn_here(query, settings, offsets, kwargs, kernel_offset=0)
    if decode:
        out = rerope_decode(query, key, value, settings.window, cache_seqlens=seqlens,
                            sm_scale=scaling, base=settings.base, leaky=settings.leaky,
                            logn_len=logn_len, rotated=True, inv_freq=settings.inv_freq,
                            group=settings.group)
    else:
        out = rerope(query, key[:, :, :n_keys], value[:, :, :n_keys], settings.window,
                     causal=True, sm_scale=scaling, base=settings.base, leaky=settings.leaky,
                     logn_len=logn_len, rotated=True, inv_freq=settings.inv_freq,
                     group=settings.group)
    return out.transpose(1, 2).contiguous()


def _attend(q, k, v, settings, scaling, logn_len):
    """One kernel call: ``rerope.rerope_decode`` for a generation step (few new queries
    against a longer cache, no gradient needed), else ``rerope.rerope``; both on rotated
    inputs, with the model's RoPE frequencies (``settings.base`` or
    ``settings.inv_freq``)."""
    n_q, n_k = q.shape[2], k.shape[2]
    if n_q <= MAX_QUERIES and n_q < n_k and not _needs_grad(q, k, v):
        return rerope_decode(q, k, v, settings.window, sm_scale=scaling,
                             base=settings.base, leaky=settings.leaky,
                             logn_len=logn_len, rotated=True,
                             inv_freq=settings.inv_freq, group=settings.group)
    return rerope(q, k, v, settings.window, causal=True, sm_scale=scaling,
                  base=settings.base, leaky=settings.leaky, logn_len=logn_len,
                  rotated=True, inv_freq=settings.inv_freq, group=settings.group)


def _needs_grad(q, k, v):
    """Whether autograd wants a gradient of the attention (then :func:`rerope.rerope`)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


# --- positions ----------------------------------------------------------------------------------

# The offsets of the current forward's position_ids on a GPU (reading them is a host sync):
# kept for the layers after the first, forgotten when the next forward starts (rerope_mask).
_this_forward = {"key": None, "tensor": None, "offsets": None}


def _uses_positions(settings):
    """Whether the kernels' results depend on absolute positions (log-n, Self-Extend): only
    then are a row's offsets read for more than checking them."""
    return settings.logn_len is not None or settings.group is not None


def _position_offsets(position_ids, rows, batch, n_q, n_k, needed=True):
    """Per row, the constant ``c_b`` with position = slot + ``c_b`` for its real queries (list of
    ints; ``None`` for a row without real queries, or all rows when ``position_ids`` is
    ``None``). ``ValueError`` if a row's positions do not step by one along its slots.

    ``needed=False`` (neither log-n nor Self-Extend, :func:`_uses_positions`: the offsets serve
    only that check): a single new token (``n_q == 1``, a generation step) has nothing to
    check, one position per row always steps by one; its values are not read (on a GPU that
    would be a host sync per step) and every row's offset is ``None``.

    Computed from the values on every call, except on a GPU: there every layer of one forward
    gets the same ``position_ids``, and the first layer's result (one host sync) serves the
    others until :func:`rerope_mask` starts the next forward (a tensor changed in place
    between two forwards, even through ``.data``, is read again).
    """
    if position_ids is None:
        return [None] * batch
    if (position_ids.dim() != 2 or position_ids.shape[-1] != n_q
            or position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids must have shape ({batch} or 1, {n_q}), got "
                         f"{tuple(position_ids.shape)} (multi-dimensional RoPE positions are "
                         "not supported)")
    if n_q == 1 and not needed:
        return [None] * batch
    key = None
    if _reading_syncs(position_ids):
        try:
            version = position_ids._version
        except RuntimeError:                        # an inference-mode tensor has none
            version = None
        key = (id(position_ids), version, rows, (batch, n_q, n_k))
        held = _this_forward
        if held["key"] == key and held["tensor"]() is position_ids:
            return held["offsets"]
    slots = torch.arange(n_k - n_q, n_k, device=position_ids.device)
    offset = position_ids.expand(batch, n_q).long() - slots
    if rows is None:
        real = torch.ones(batch, n_q, dtype=torch.bool)
    else:
        starts, ends = torch.tensor(rows.starts), torch.tensor(rows.ends)
        real = (slots.cpu() >= starts[:, None]) & (slots.cpu() < ends[:, None])
    real = real.to(position_ids.device)
    huge = torch.iinfo(torch.long).max
    low = torch.where(real, offset, huge).amin(1)
    high = torch.where(real, offset, -huge).amax(1)
    low, high = torch.stack([low, high]).tolist()
    offsets = []
    for b in range(batch):
        if low[b] == huge:                 # no real query in this row
            offsets.append(None)
        elif low[b] != high[b]:
            raise ValueError(
                f"position_ids of row {b} do not step by one along the cache (position - slot "
                f"ranges from {low[b]} to {high[b]}): ReRoPE here needs each row's tokens at "
                "consecutive positions in cache order (packed sequences or custom "
                "position_ids are not supported)")
        else:
            offsets.append(low[b])
    if key is not None:
        _this_forward.update(key=key, tensor=weakref.ref(position_ids), offsets=offsets)
    return offsets


def _reading_syncs(t):
    """Whether reading ``t``'s values on the host waits for the device (any but a CPU tensor)."""
    return t.device.type != "cpu"


def _check_group_positions(settings, offsets, kernel_offset):
    """Self-Extend groups absolute positions (``⌊i/G⌋``): the kernels' positions (slots from
    the row's first key given) must be the model's, i.e. every row's offset ``c`` equal to
    ``kernel_offset`` (see :func:`_logn_here`); ``ValueError`` otherwise."""
    if settings.group is None:
        return
    for c in offsets:
        if c is not None and c != kernel_offset:
            raise ValueError(
                f"group (Self-Extend) groups absolute positions, but this row's position_ids "
                f"are its cache slots shifted by {c - kernel_offset}: the kernels would group "
                "other positions than the model's. Pass position_ids counted from the row's "
                "first real token (generate's own), or none")


def _logn_here(q, settings, offsets, kwargs, kernel_offset, rows=None):
    """Log-n scaling needs absolute positions, and the kernels take slot ``j`` of the keys they
    are given as position ``j``: the model's position ``slot + c`` matches that when ``c`` is
    ``kernel_offset`` (``0`` for the whole cache, ``-start`` for a padded row's slice from
    ``start``). Otherwise scale the queries here from ``position_ids`` (a scalar per query
    commutes with the rotation) and tell the kernel not to. ``rows``: ``(b, lo, hi)``, the
    batch row and query indices ``q`` was sliced from. Returns ``(q, logn_len for the kernel)``.
    """
    if settings.logn_len is None:
        return q, None
    if all(c is None or c == kernel_offset for c in offsets):
        return q, settings.logn_len
    positions = kwargs["position_ids"]
    if rows is not None:
        b, lo, hi = rows
        positions = positions[b if positions.shape[0] > 1 else 0][None, lo:hi]
    factor = torch.clamp(torch.log(positions.double() + 1) / math.log(settings.logn_len), min=1.0)
    scaled = q.to(torch.float32) * factor.to(torch.float32)[:, None, :, None]
    return scaled.to(q.dtype), None
