"""The extrapolation experiment (chapter 11) on CPU: model shapes, the kernel path, the data split.

Tiny configurations only (head dim 16, a few dozen positions), so the Triton interpreter keeps
the whole file well under a minute.
"""

import json
import random
from pathlib import Path

import pytest
import torch

from extrapolation import data, evaluate
from extrapolation.model import (ByteLM, ModelConfig, Positions, load_model, save_weights,
                                 token_losses)

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, train_len=16)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return ByteLM(TINY).eval()


def tokens(batch, n, seed=0):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes():
    model = tiny_model()
    x = tokens(2, 24)
    assert model(x).shape == (2, 24, 256) and model(x).dtype == torch.float32
    assert token_losses(model, x).shape == (2, 23)
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))


def test_config_rejects_head_dims_the_kernels_lack():
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(d_model=96, n_heads=2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)


@pytest.mark.parametrize("options", [
    {"kind": "rerope", "window": 8},
    {"kind": "leaky", "window": 8, "leaky": 4.0, "logn_len": 16},
])
def test_kernel_path_equals_reference(options):
    """The model's ReRoPE attention through rerope.rerope (interpreter) == the naive oracle."""
    model, x = tiny_model(), tokens(2, 40)
    with torch.no_grad():
        fused = model(x, Positions(**options))
        naive = model(x, Positions(**options, backend="reference"))
    torch.testing.assert_close(fused, naive, rtol=1e-4, atol=1e-4)


def test_window_at_least_n_is_rope():
    """ReRoPE through the kernel with w >= N equals the RoPE path (apply_rope + SDPA)."""
    model, x = tiny_model(), tokens(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x, Positions("rerope", window=32)), model(x),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(x, Positions("rerope", window=32, logn_len=8)),
                                   model(x, Positions("rope", logn_len=8)), rtol=1e-4, atol=1e-4)


def test_prefix_of_a_long_forward_is_a_short_forward():
    """evaluate.py reads every length off one long forward: causal + relative positions."""
    model, x = tiny_model(), tokens(1, 48)
    scheme = Positions("rerope", window=8, logn_len=16)
    with torch.no_grad():
        torch.testing.assert_close(token_losses(model, x, scheme)[:, :23],
                                   token_losses(model, x[:, :24], scheme), rtol=1e-4, atol=1e-4)


def test_ntk_alpha_one_is_rope():
    model, x = tiny_model(), tokens(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(x, Positions("ntk", ntk_alpha=1.0)), model(x))


@pytest.mark.parametrize("options, match", [
    ({"kind": "alibi"}, "kind"),
    ({"kind": "rerope"}, "window"),
    ({"kind": "rerope", "window": 0}, "window"),
    ({"kind": "rope", "window": 8}, "window"),
    ({"kind": "leaky", "window": 8}, "leaky"),
    ({"kind": "leaky", "window": 8, "leaky": 1.0}, "leaky"),
    ({"kind": "ntk"}, "ntk_alpha"),
    ({"kind": "rope", "logn_len": 1}, "logn_len"),
    ({"kind": "rerope", "window": 8, "backend": "flash"}, "backend"),
])
def test_positions_reject_bad_input(options, match):
    with pytest.raises(ValueError, match=match):
        Positions(**options)


def test_split_is_deterministic_and_by_file():
    paths = [f"pkg{i % 7}/module_{i}.py" for i in range(2000)]
    train, val = data.split_files(paths, seed=0)
    shuffled = paths[:]
    random.Random(1).shuffle(shuffled)
    assert data.split_files(shuffled, seed=0) == (train, val)          # order-independent
    assert not set(train) & set(val) and set(train) | set(val) == set(paths)
    assert 0.03 < len(val) / len(paths) < 0.07                          # ~5 %
    assert data.split_files(paths, seed=1)[1] != val                    # the seed matters
    train_more, val_more = data.split_files(paths + ["new.py"], seed=0)
    assert set(val) <= set(val_more) and set(train) <= set(train_more)  # no file moves
    with pytest.raises(TypeError):
        data.split_files("a.py")
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_files(paths, val_fraction=1.5)


def test_stored_split_follows_the_rule():
    """The committed file list was split by the same rule (on the GPU machine's Python)."""
    path = ROOT / "book" / "data" / "extrapolation_split.json"
    if not path.is_file():
        pytest.skip("no stored split yet")
    split = json.loads(path.read_text())
    names = [name for name, _ in split["train"] + split["val"]]
    train, val = data.split_files(names, seed=split["seed"], val_fraction=split["val_fraction"])
    assert val == [name for name, _ in split["val"]] and len(train) == split["train_files"]


def test_corpus_helpers(tmp_path):
    for name, text in {"a.py": "x = 1\n" * 50, "sub/b.py": "y = 2\n", "c.txt": "no",
                       "site-packages/d.py": "skip"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert data.list_sources(tmp_path) == ["a.py", "sub/b.py"]
    stream = data.read_stream(tmp_path, ["sub/b.py"])
    assert bytes(stream.tolist()) == b"y = 2\n" + bytes([data.SEPARATOR])
    docs, names = data.heldout_documents(tmp_path, ["sub/b.py", "a.py"], length=100, count=4)
    assert names == ["a.py@0", "a.py@100", "a.py@200"] and docs.shape == (3, 100)
    assert bytes(docs[1].tolist()) == (tmp_path / "a.py").read_bytes()[100:200]
    assert data.heldout_documents(tmp_path, ["a.py"], length=100, count=2)[0].shape == (2, 100)
    data.save_heldout(tmp_path / "h.safetensors", docs, names, {"k": 1})
    again, again_names, meta = data.load_heldout(tmp_path / "h.safetensors")
    assert torch.equal(again, docs) and again_names == names and meta == {"k": 1}
    crops = data.random_crops(stream.repeat(10), 3, 8, torch.Generator().manual_seed(0))
    assert crops.shape == (3, 8) and crops.dtype == torch.int64
    with pytest.raises(ValueError, match="root"):
        data.list_sources(tmp_path / "missing")


def test_weights_round_trip(tmp_path):
    model = tiny_model()
    save_weights(model, tmp_path / "w.safetensors", {"steps": 3}, dtype=torch.float32)
    again, meta = load_model(tmp_path / "w.safetensors")
    assert again.cfg == TINY and meta == {"steps": 3}
    x = tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_passkey_prompt():
    docs = torch.full((3, 300), ord("#"), dtype=torch.uint8)
    batch, answers = evaluate.passkey_batch(docs, 256, 4, seed=0)
    assert batch.shape == (4, 257) and answers.shape == (4, 5)
    for row, answer in zip(batch, answers):
        text = bytes(row.tolist())
        key = bytes(answer.tolist())
        assert text.endswith(b"\nPASSKEY = " + key) and text.count(key) == 2
    assert evaluate.passkey_batch(docs, 16, 4, seed=0) is None
