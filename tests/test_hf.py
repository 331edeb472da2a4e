"""``rerope.hf``: ReRoPE in Hugging Face transformers models through the attention registry.

CPU, no downloads: tiny models (2 layers, hidden 64, 4 heads) built from configs with random
weights, fp32, the kernels in Triton's interpreter. What is checked:

* window >= sequence length: the stock model's logits (sdpa), for Llama with GQA and MHA,
  Mistral, Qwen2 and Qwen3 (those the installed transformers has);
* window < length: the logits of a model whose attention (our own registered function)
  un-rotates the model's rotated q, k in float64 and runs ``rerope.reference.rerope`` on every
  layer; ReRoPE, Leaky ReRoPE and log-n, GQA and MHA, a non-default RoPE base;
* ``generate`` with the cache (greedy, window smaller than the final length) gives exactly the
  tokens of recomputing every step from scratch without a cache (the prefill path), and the
  steps really ran ``rerope.rerope_decode``;
* padded batches: left-padded ``generate`` equals each prompt generated alone; a right-padded
  forward equals each row alone; right-padded ``generate`` (padding between tokens) raises;
* RoPE types ``linear``, ``llama3`` and ``yarn`` (the model's own frequencies, YaRN's attention
  factor): the stock logits for window >= length, a float64 reference that un-rotates with the
  model's frequencies for a shorter window, ``generate`` with the cache equal to recomputation;
  a default-RoPE model whose frequencies were rounded by ``model.to(bfloat16)`` uses those;
  ``dynamic`` and ``longrope`` are refused;
* ``disable_rerope`` restores stock behaviour; bad input raises a clear error;
* beside Hugging Face's package ``kernels`` (which transformers >= 5.25 requires): ``import
  kernels`` never finds this repository, and a model runs with ``rerope.hf`` imported.
"""

import copy
import inspect
import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install "
    "'transformers>=5,<6'); rerope.hf needs it")

import rerope  # noqa: E402
import rerope.hf as hf  # noqa: E402
from rerope import reference  # noqa: E402

from transformers import AttentionInterface, LlamaConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

VOCAB = 97


def tiny_config(kind="llama", kv_heads=2, head_dim=16, rope_theta=10000.0, heads=4, **overrides):
    """A 2-layer, hidden-64 config of ``kind`` (4 heads unless told); a fresh object every call
    (models built from one config object share their attention implementation). Weights drawn
    with std 0.15 (not 0.02) so that attention is far from uniform and positions matter."""
    config_class = {"llama": LlamaConfig,
                    "mistral": getattr(transformers, "MistralConfig", None),
                    "qwen2": getattr(transformers, "Qwen2Config", None),
                    "qwen3": getattr(transformers, "Qwen3Config", None)}[kind]
    if config_class is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {kind} model")
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                    max_position_embeddings=512, rope_theta=rope_theta, bos_token_id=None,
                    eos_token_id=None, pad_token_id=0, initializer_range=0.15)
    if kind == "mistral":
        settings["sliding_window"] = None
    settings.update(overrides)
    return config_class(**settings)


def build(config, seed=0):
    """A model of ``config`` with seeded random weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def max_error(actual, expected):
    return (actual - expected).abs().max().item()


# --- the reference model: float64 rerope.reference.rerope on un-rotated q, k, every layer ------


def unrotate(x, positions, base, inv_freq=None):
    """Undo the model's RoPE (rotate_half convention) in float64: ``R(-p) x`` per position.
    ``x`` ``(B, H, N, D)``, ``positions`` ``(1 or B, N)``; the frequencies of ``base``, or
    ``inv_freq`` (float64 ``(D/2,)``) when given."""
    d = x.shape[-1]
    theta = (base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) if inv_freq is None
             else inv_freq)
    angles = -positions.double()[:, None, :, None] * torch.cat([theta, theta])
    x = x.double()
    halves = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * torch.cos(angles) + halves * torch.sin(angles)


def register_reference(window, base, leaky=None, logn_len=None, inv_freq=None):
    """Register an attention implementation that runs ``rerope.reference.rerope`` in float64
    on the un-rotated inputs; returns its name. Positions come from ``position_ids`` (keys at
    the queries' positions when there is no cache, else at 0 … Nk-1); log-n is applied here at
    those positions, so that shifted position ids are judged too. ``inv_freq``: the model's
    frequencies (float64), used to un-rotate and re-rotate instead of ``base``'s."""
    name = f"test_reference_w{window}_b{base}_l{leaky}_n{logn_len}"
    if inv_freq is not None:
        name += "_f" + "_".join(f"{x:.17g}" for x in inv_freq.tolist())

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
        assert attention_mask is None, "the reference model takes unpadded inputs only"
        n_q, n_k = query.shape[2], key.shape[2]
        positions = kwargs["position_ids"][:1]
        key_positions = positions if n_q == n_k else torch.arange(n_k)[None]
        assert n_q == n_k or torch.equal(positions[0], torch.arange(n_k - n_q, n_k))
        q_raw = unrotate(query, positions, base, inv_freq)
        if logn_len is not None:
            scale = torch.clamp(torch.log(positions.double() + 1) / math.log(logn_len), min=1.0)
            q_raw = q_raw * scale[:, None, :, None]
        k_raw = unrotate(key, key_positions, base, inv_freq)
        rope = dict(base=base) if inv_freq is None else dict(inv_freq=inv_freq)
        out = reference.rerope(q_raw, k_raw, value.double(), window, sm_scale=scaling,
                               leaky=leaky, **rope)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# --- beside Hugging Face's `kernels` --------------------------------------------------------------


def test_package_lives_beside_hugging_faces_kernels():
    """The import name is ``rerope``; ``kernels/`` is a source folder with no ``__init__.py``,
    so ``import kernels`` never finds this repository: where Hugging Face's package of that
    name is installed (transformers >= 5.25 requires it), transformers' hub-kernel integration
    gets it, and a model runs with ``rerope.hf`` imported."""
    import importlib.util
    import os

    source_root = os.path.dirname(os.path.dirname(os.path.abspath(rerope.__file__)))
    assert not os.path.exists(os.path.join(source_root, "__init__.py"))
    found = importlib.util.find_spec("kernels")
    if found is not None and found.origin not in (None, "namespace"):   # a regular package
        assert not os.path.realpath(found.origin).startswith(
            os.path.realpath(source_root) + os.sep), found.origin
    model = hf.enable_rerope(build(tiny_config()), window=3)
    assert logits_of(model, torch.arange(5)[None]).shape == (1, 5, VOCAB)


# --- prefill: stock logits, reference logits ----------------------------------------------------

STOCK_CASES = {
    "llama-gqa": dict(kind="llama", kv_heads=2),
    "llama-mha-d32": dict(kind="llama", kv_heads=4, head_dim=32),
    "mistral": dict(kind="mistral", kv_heads=2),
    "qwen2": dict(kind="qwen2", kv_heads=2),
    "qwen3": dict(kind="qwen3", kv_heads=2),
}


@pytest.mark.parametrize("case", list(STOCK_CASES), ids=list(STOCK_CASES))
def test_window_covering_the_sequence_gives_the_stock_logits(case):
    config = tiny_config(**STOCK_CASES[case])
    model = build(config)
    batch = 2 if case == "llama-gqa" else 1
    ids = torch.randint(0, VOCAB, (batch, 21), generator=torch.Generator().manual_seed(1))
    stock = logits_of(model, ids)
    hf.enable_rerope(model, window=21)
    assert model.config._attn_implementation == "rerope_w21"
    assert max_error(logits_of(model, ids), stock) < 1e-4


REFERENCE_CASES = {
    "llama-gqa-base1000": (dict(kv_heads=2, rope_theta=1000.0), dict()),
    "llama-mha-d32-leaky": (dict(kv_heads=4, head_dim=32), dict(leaky=4.0)),
    "llama-gqa-leaky-logn": (dict(kv_heads=2), dict(leaky=2.0, logn_len=8)),
    "qwen2-logn": (dict(kind="qwen2", kv_heads=2), dict(logn_len=6)),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES), ids=list(REFERENCE_CASES))
def test_short_window_matches_the_reference_model(case):
    config_args, options = REFERENCE_CASES[case]
    config = tiny_config(**config_args)
    window, n = 5, 23
    batch = 2 if case == "llama-gqa-base1000" else 1
    ids = torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(2))
    expected_model = build(config)
    stock = logits_of(expected_model, ids)
    expected_model.set_attn_implementation(
        register_reference(window, config.rope_parameters["rope_theta"], **options))
    expected = logits_of(expected_model, ids)
    model = hf.enable_rerope(build(config), window, **options)
    actual = logits_of(model, ids)
    assert max_error(actual, expected) < 1e-4
    assert max_error(expected, stock) > 0.1, "ReRoPE should change these logits"



def test_shifted_positions_with_logn_match_the_reference_model():
    """position_ids starting at 40 (not 0): ReRoPE's scores do not change, log-n's scale does;
    rerope.hf then scales the queries itself from position_ids."""
    config = tiny_config(kv_heads=2)
    window, n, logn_len = 5, 19, 8
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(11))
    positions = torch.arange(40, 40 + n)[None]
    expected_model = build(config)
    expected_model.set_attn_implementation(register_reference(window, 10000.0, logn_len=logn_len))
    expected = logits_of(expected_model, ids, position_ids=positions)
    model = hf.enable_rerope(build(config), window, logn_len=logn_len)
    assert max_error(logits_of(model, ids, position_ids=positions), expected) < 1e-4
    assert max_error(logits_of(model, ids), expected) > 1e-2, "log-n should see the shift"


# --- generation with the cache ------------------------------------------------------------------


def greedy_by_recomputation(model, ids, new_tokens):
    """Greedy decoding with every step recomputed from scratch, without a cache (prefill path)."""
    for _ in range(new_tokens):
        logits = logits_of(model, ids, use_cache=False)[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def recorded_decode_calls(monkeypatch):
    """A list that gets, per decode call of ``rerope.hf``'s layers, ``(q.shape, settings)``
    (``settings``: ``rerope_decode``'s keywords), whether the call went through
    ``rerope_decode`` or the one-token generation step's fast path (``decode._call``,
    with ``rerope_decode``'s settings as a tuple)."""
    from rerope import decode

    calls = []
    names = ("window", "sm_scale", "base", "leaky", "logn_len", "rotated", "num_splits",
             "inv_freq", "group")

    def through_rerope_decode(q, k, v, window, **kwargs):
        calls.append((q.shape, dict(kwargs, window=window)))
        return rerope.rerope_decode(q, k, v, window, **kwargs)

    def through_fast_path(q, k, v, cache_seqlens, block_table, settings, **kwargs):
        calls.append((q.shape, dict(zip(names, settings))))
        return decode._call(q, k, v, cache_seqlens, block_table, settings, **kwargs)

    monkeypatch.setattr(hf, "rerope_decode", through_rerope_decode)
    monkeypatch.setattr(hf, "_decode_call", through_fast_path)
    return calls


def test_generate_with_the_cache_equals_recomputation(monkeypatch):
    """20 new tokens after a 5-token prompt, window 6, GQA (2 query heads, 1 KV head: the
    interpreter's cost grows with heads): the cache path runs the decode kernel on the model's
    rotated cache; its tokens equal those of recomputing each step."""
    model = build(tiny_config(heads=2, kv_heads=1))
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=20, do_sample=False)
    hf.enable_rerope(model, window=6)
    decode_calls = recorded_decode_calls(monkeypatch)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert len(decode_calls) == 2 * 19 and all(s[2] == 1 for s, _ in decode_calls)
    assert cached.shape == (1, 25)
    assert torch.equal(cached, greedy_by_recomputation(model, prompt, 20))
    assert not torch.equal(cached, stock), "past the window ReRoPE should change the tokens"


def test_left_padded_generate_equals_each_prompt_alone():
    """A batch of prompts of lengths 7 and 4, padded on the left, with log-n: each row's new
    tokens are those of generating its prompt alone (no padding)."""
    model = hf.enable_rerope(build(tiny_config(kv_heads=2)), window=4, logn_len=5)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=gen) for n in (7, 4)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 7 - p.shape[1]:], mask[row, 7 - p.shape[1]:] = p[0], 1
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for row, p in enumerate(prompts):
            alone = model.generate(p, max_new_tokens=6, do_sample=False)
            assert torch.equal(batched[row, 7:], alone[0, p.shape[1]:]), f"row {row}"


def test_right_padded_forward_equals_each_row_alone():
    model = hf.enable_rerope(build(tiny_config(kv_heads=2)), window=4, leaky=3.0)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    padded = logits_of(model, ids, attention_mask=mask)
    assert max_error(padded[0], logits_of(model, ids[:1])[0]) < 1e-5
    assert max_error(padded[1, :6], logits_of(model, ids[1:, :6])[0]) < 1e-5


def test_right_padded_generate_raises():
    """generate appends new tokens after the padding of a right-padded row: its tokens are no
    longer contiguous in the cache, which the kernels cannot express."""
    model = hf.enable_rerope(build(tiny_config(kv_heads=2)), window=4)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad(), pytest.raises(ValueError, match="padding between real tokens.*left"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_positions_that_skip_along_the_cache_raise():
    model = hf.enable_rerope(build(tiny_config()), window=4)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="position_ids of row 0 do not step by one"):
        logits_of(model, ids, position_ids=torch.tensor([[0, 1, 2, 5, 6, 7]]))


# --- switching back, shared configs -------------------------------------------------------------


@pytest.mark.parametrize("start", ["sdpa", "eager"])
def test_disable_restores_the_stock_model(start):
    config = tiny_config(attn_implementation=start)
    model = build(config)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(8))
    stock = logits_of(model, ids)
    hf.enable_rerope(model, window=3)
    assert hf.is_rerope_enabled(model)
    assert max_error(logits_of(model, ids), stock) > 1e-3
    hf.enable_rerope(model, window=4)                 # switching settings keeps the original
    assert hf.disable_rerope(model) is model
    assert model.config._attn_implementation == start and not hf.is_rerope_enabled(model)
    assert torch.equal(logits_of(model, ids), stock)
    with pytest.raises(ValueError, match="ReRoPE is not enabled"):
        hf.disable_rerope(model)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    model = build(tiny_config())
    for window, error, message in ((0, ValueError, "window must be >= 1"),
                                   (-3, ValueError, "window must be >= 1"),
                                   (2.5, TypeError, "window must be an int"),
                                   ("8", TypeError, "window must be an int")):
        with pytest.raises(error, match=message):
            hf.enable_rerope(model, window)
    with pytest.raises(ValueError, match="leaky must be a finite float > 1"):
        hf.enable_rerope(model, 4, leaky=1.0)
    with pytest.raises(ValueError, match="logn_len must be > 1"):
        hf.enable_rerope(model, 4, logn_len=1)
    assert model.config._attn_implementation == "sdpa"       # nothing switched on failure
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        hf.enable_rerope(torch.nn.Linear(4, 4), 4)


def test_models_that_are_not_llama_style_raise():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model_type 'gpt2'.*not a supported Llama-style"):
        hf.enable_rerope(gpt2, 4)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 128, "rope_theta": 10000.0},
], ids=["dynamic", "longrope"])
def test_length_dependent_rope_raises(rope):
    model = build(tiny_config(rope_parameters=rope))
    expected = (f"rope_type '{rope['rope_type']}'.*change with the sequence length.*"
                "supported rope types: default, linear, llama3, yarn")
    with pytest.raises(ValueError, match=expected):
        hf.enable_rerope(model, 4)
    assert model.config._attn_implementation == "sdpa"


def test_rope_type_of_the_rotary_module_is_checked():
    """The model's rotary embedding is what rotates q, k: a dynamic one is refused even where
    the config was changed to a supported type after building the model."""
    model = build(tiny_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                               "rope_theta": 10000.0}))
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="LlamaRotaryEmbedding.rope_type.*'dynamic'"):
        hf.enable_rerope(model, 4)
    model.model.rotary_emb.rope_type = "mystery"
    with pytest.raises(ValueError, match="rope_type 'mystery'.*rerope.hf does not support"):
        hf.enable_rerope(model, 4)
    assert model.config._attn_implementation == "sdpa"


# --- RoPE types: the model's own frequencies ------------------------------------------------------

# Scaled RoPE of each supported type, chosen so that the tiny models' 8 frequencies (head dim 16)
# really change: llama3 keeps the two fastest, smooths one and divides the rest by 8; YaRN (its
# attention factor 0.1·ln 4 + 1 ≈ 1.139 multiplies cos and sin) interpolates the slow ones.
ROPE_TYPES = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
               "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "rope_theta": 10000.0},
}


def config_frequencies(config):
    """The frequencies transformers computes for ``config`` (its ROPE_INIT_FUNCTIONS, not the
    module rerope.hf reads), float64, and the attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](
        copy.deepcopy(config), "cpu")
    return inv_freq.double(), factor


@pytest.mark.parametrize("kind", list(ROPE_TYPES))
def test_scaled_rope_window_covering_the_sequence_gives_the_stock_logits(kind):
    config = tiny_config(kv_heads=2, rope_parameters=dict(ROPE_TYPES[kind]))
    model = build(config)
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(12))
    stock = logits_of(model, ids)
    hf.enable_rerope(model, window=21)
    assert model.config._attn_implementation.startswith(f"rerope_w21_{kind}_")
    assert max_error(logits_of(model, ids), stock) < 1e-4


@pytest.mark.parametrize("kind", list(ROPE_TYPES))
def test_scaled_rope_short_window_matches_the_reference_model(kind):
    """Window 5 < 23 tokens: equal to the float64 reference that un-rotates q, k with the
    model's frequencies, clamps and re-rotates; different from the reference with the default
    frequencies (so the frequencies are really used), and from stock."""
    config = tiny_config(kv_heads=2, rope_parameters=dict(ROPE_TYPES[kind]))
    inv_freq, attention_factor = config_frequencies(config)
    default = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert (inv_freq / default - 1).abs().max() > 0.4, "the scaling should change frequencies"
    if kind == "yarn":
        assert attention_factor > 1.1, "YaRN's attention factor should be in play"
    window, n = 5, 23
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(13))
    expected_model = build(config)
    stock = logits_of(expected_model, ids)
    expected_model.set_attn_implementation(register_reference(window, 10000.0,
                                                              inv_freq=inv_freq))
    expected = logits_of(expected_model, ids)
    expected_model.set_attn_implementation(register_reference(window, 10000.0))
    with_default_frequencies = logits_of(expected_model, ids)
    model = hf.enable_rerope(build(config), window)
    actual = logits_of(model, ids)
    assert max_error(actual, expected) < 1e-4
    assert max_error(with_default_frequencies, expected) > 1e-2
    assert max_error(expected, stock) > 0.1, "ReRoPE should change these logits"


@pytest.mark.parametrize("kind", list(ROPE_TYPES))
def test_scaled_rope_generate_with_the_cache_equals_recomputation(kind, monkeypatch):
    model = build(tiny_config(heads=2, kv_heads=1, rope_parameters=dict(ROPE_TYPES[kind])))
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(14))
    hf.enable_rerope(model, window=4, leaky=3.0 if kind == "llama3" else None)
    decode_calls = recorded_decode_calls(monkeypatch)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert len(decode_calls) == 2 * 7
    assert all(type(s["inv_freq"]) is rerope.rope.Frequencies for _, s in decode_calls)
    assert torch.equal(cached, greedy_by_recomputation(model, prompt, 8))


def test_frequencies_are_resolved_once_at_enable_time(monkeypatch):
    """Layer calls pass the frequencies stored in the registered settings: the config is not
    read again, and two models with other RoPE and the same window keep their own."""
    linear = hf.enable_rerope(build(tiny_config(rope_parameters=dict(ROPE_TYPES["linear"]))), 4)
    yarn = hf.enable_rerope(build(tiny_config(rope_parameters=dict(ROPE_TYPES["yarn"]))), 4)
    assert linear.config._attn_implementation != yarn.config._attn_implementation
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(15))
    before = logits_of(linear, ids)

    def no_config_reading(*args):
        raise AssertionError("RoPE parameters read during a forward")

    monkeypatch.setattr(hf, "_rope_parameters", no_config_reading)
    monkeypatch.setattr(hf, "_model_frequencies", no_config_reading)
    assert torch.equal(logits_of(linear, ids), before)
    expected = build(tiny_config(rope_parameters=dict(ROPE_TYPES["linear"])))
    expected.set_attn_implementation(register_reference(
        4, 10000.0, inv_freq=config_frequencies(expected.config)[0]))
    assert max_error(before, logits_of(expected, ids)) < 1e-4


@pytest.mark.parametrize("kind", ["default", *ROPE_TYPES])
def test_frequencies_without_a_rotary_module_come_from_the_config(kind, monkeypatch):
    """A model without a module holding ``inv_freq`` (none of the supported ones today): the
    frequencies transformers computes from the config, the same as the module's."""
    rope = {"rope_type": "default", "rope_theta": 500.0} if kind == "default" else ROPE_TYPES[kind]
    model = build(tiny_config(rope_parameters=dict(rope)))
    from_module = hf._model_frequencies(model, model.config)
    monkeypatch.setattr(hf, "_rotary_embedding", lambda model: None)
    from_config = hf._model_frequencies(model, model.config)
    assert from_config == from_module
    assert from_config[1:] == ((500.0, None) if kind == "default" else
                               (10000.0, tuple(config_frequencies(model.config)[0].tolist())))


def test_default_rope_rounded_by_a_cast_uses_the_models_frequencies():
    """``model.to(torch.bfloat16)`` rounds the rotary embedding's ``inv_freq`` buffer to bf16,
    and the model rotates q, k with those frequencies: ReRoPE must un-rotate with the same ones.
    (Emulated in fp32: the buffer replaced by its bf16 rounding.)"""
    config = tiny_config(kv_heads=2)
    window, n = 5, 23
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(16))

    def rounded(model):
        buffer = model.model.rotary_emb.inv_freq
        buffer.copy_(buffer.to(torch.bfloat16).float())
        return model

    model = hf.enable_rerope(rounded(build(config)), window)
    assert model.config._attn_implementation.startswith("rerope_w5_default_")
    expected_model = rounded(build(config))
    bf16_frequencies = expected_model.model.rotary_emb.inv_freq.double()
    expected_model.set_attn_implementation(register_reference(window, 10000.0,
                                                              inv_freq=bf16_frequencies))
    expected = logits_of(expected_model, ids)
    expected_model.set_attn_implementation(register_reference(window, 10000.0))
    exact_frequencies = logits_of(expected_model, ids)
    assert max_error(logits_of(model, ids), expected) < 1e-4
    assert max_error(exact_frequencies, expected) > 1e-3, "the rounding should show"
    unrounded = hf.enable_rerope(build(tiny_config(kv_heads=2, rope_theta=1000.0)), window)
    assert unrounded.config._attn_implementation == "rerope_w5_base1000.0"


def test_unsupported_attention_layouts_raise():
    with pytest.raises(ValueError, match="sliding_window = 16"):
        hf.enable_rerope(build(tiny_config("mistral", sliding_window=16)), 4)
    with pytest.raises(ValueError, match="head dim is 8"):
        hf.enable_rerope(build(tiny_config(head_dim=8)), 4)
    model = hf.enable_rerope(build(tiny_config()), 4)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    custom = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="custom \\(4D\\) masks are not supported"):
        logits_of(model, ids, attention_mask=custom)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=16)
    # the forward's name for it: ``cache`` from transformers 5.2x, ``past_key_values`` before
    names = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in names else "past_key_values"
    # a static cache is supported (tests/test_generation.py): the same logits as the dynamic one
    static = logits_of(model, ids, use_cache=True, **{keyword: cache})
    assert max_error(static, logits_of(model, ids)) < 1e-5


def test_training_mode_needs_no_dropout_and_backpropagates():
    """In train mode the prefill op is differentiable, and every weight's gradient is the one
    of the same model with the float64 reference attention; attention dropout is refused."""
    config = tiny_config(attention_dropout=0.1)
    model = hf.enable_rerope(build(config), window=3)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(10))
    model.train()
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        model(ids)
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    expected = build(tiny_config())                     # the same weights (same seed)
    expected.set_attn_implementation(
        register_reference(3, config.rope_parameters["rope_theta"]))
    expected.train()
    losses = []
    for m in (model, expected):
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and abs(losses[0] - losses[1]) < 1e-5, losses
    compared = 0
    for (name, got), (_, want) in zip(model.named_parameters(), expected.named_parameters()):
        if want.grad is None:
            continue
        compared += 1
        assert got.grad is not None, name
        error = (got.grad - want.grad).abs().max().item()
        assert error <= 1e-4 * max(want.grad.abs().max().item(), 1e-6), (name, error)
    assert compared > 0 and model.model.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0


# --- chapter 10's Triton exercise ------------------------------------------------------------------


def test_positions_exercise_checker():
    """The checker accepts a right kernel and names the slots a wrong one gets wrong (here:
    padding left at -1 instead of 0)."""
    import triton
    import triton.language as tl

    from rerope import exercises

    @triton.jit
    def positions(Mask, Positions, n, BLOCK: tl.constexpr, PAD_AT_ZERO: tl.constexpr):
        row = tl.program_id(0)
        slots = tl.arange(0, BLOCK)
        live = slots < n
        mask = tl.load(Mask + row * n + slots, mask=live, other=0)
        result = tl.cumsum(mask, 0) - 1
        if PAD_AT_ZERO:
            result = tl.where(mask != 0, result, 0)
        tl.store(Positions + row * n + slots, result, mask=live)

    class Bound:                       # the checker launches kernel[grid](mask, out, n, BLOCK=)
        def __init__(self, pad_at_zero):
            self.pad_at_zero = pad_at_zero

        def __getitem__(self, grid):
            return lambda *args, **kw: positions[grid](*args, PAD_AT_ZERO=self.pad_at_zero, **kw)

    assert exercises.check_positions_kernel(Bound(True)) == "correct"
    verdict = exercises.check_positions_kernel(Bound(False))
    assert verdict.startswith("left padding") and "slots 0–2 wrong, got [-1, -1, -1]" in verdict


# --- Self-Extend through rerope.hf -----------------------------------------------------------


def _hf():
    transformers = pytest.importorskip("transformers")
    import test_hf  # the tiny-model setup of tests/test_hf.py
    return transformers, test_hf


def _register_self_extend_reference(window, group, base=10000.0):
    """An attention implementation that un-rotates the model's q, k in float64 and runs
    ``reference.rerope(..., group=)``, positions from ``position_ids`` (unpadded rows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    _, test_hf = _hf()
    name = f"test_self_extend_w{window}_g{group}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        positions = kw["position_ids"][:1]
        n_q, n_k = query.shape[2], key.shape[2]
        key_positions = positions if n_q == n_k else torch.arange(n_k)[None]
        q_raw = test_hf.unrotate(query, positions, base)
        k_raw = test_hf.unrotate(key, key_positions, base)
        out = reference.rerope(q_raw, k_raw, value.double(), window, sm_scale=scaling,
                               group=group)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def test_hf_self_extend_matches_the_reference_model():
    import rerope.hf as hf
    _, test_hf = _hf()
    config = test_hf.tiny_config(kv_heads=2)
    ids = torch.randint(1, test_hf.VOCAB, (2, 29), generator=torch.Generator().manual_seed(3))
    model = test_hf.build(config)
    reference_model = test_hf.build(config)
    reference_model.set_attn_implementation(_register_self_extend_reference(8, 4))
    want = test_hf.logits_of(reference_model, ids)
    hf.enable_rerope(model, 8, group=4)
    assert model.config._attn_implementation == "rerope_w8_group4"
    got = test_hf.logits_of(model, ids)
    assert test_hf.max_error(got, want) < 2e-4
    plain = hf.disable_rerope(model)
    assert test_hf.max_error(test_hf.logits_of(plain, ids), want) > 1e-3   # the group matters


def test_hf_generate_with_the_cache_equals_recomputation(monkeypatch):
    import rerope.hf as hf
    _, test_hf = _hf()
    model = hf.enable_rerope(test_hf.build(test_hf.tiny_config()), 8, group=4)
    ids = torch.randint(1, test_hf.VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    calls = test_hf.recorded_decode_calls(monkeypatch)
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=3, do_sample=False)
        seq = ids
        for _ in range(3):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq)
    assert calls and {s["group"] for _, s in calls} == {4}


def test_hf_bad_group_and_shifted_positions_raise():
    import rerope.hf as hf
    _, test_hf = _hf()
    model = test_hf.build(test_hf.tiny_config())
    with pytest.raises(ValueError, match="group must divide window"):
        hf.enable_rerope(model, 8, group=3)
    with pytest.raises(ValueError, match="group .* and leaky"):
        hf.enable_rerope(model, 8, leaky=2.0, group=2)
    hf.enable_rerope(model, 8, group=4)
    ids = torch.randint(1, test_hf.VOCAB, (1, 20))
    with pytest.raises(ValueError, match="groups absolute positions"):
        test_hf.logits_of(model, ids, position_ids=torch.arange(3, 23)[None])
