"""The package's caches answer only for the inputs they were filled from, and stay bounded;
``sm_scale`` is refused where the scaled fp32 scores could overflow. Project issue
"Reliability III", items 1, 2 and 5: each probe's case, now computed right or refused.

* item 1: ``position_ids`` changed in place between two forwards of a ``rerope.hf`` model (with
  ``add_`` or through ``.data``) give the logits of a fresh tensor with the same values, or
  the same error; an ``inv_freq`` tensor changed through ``.data`` (no version bump) is read
  again by ``rerope.rerope`` and ``rerope.rerope_decode``;
* item 2: every cache of the package is bounded by :data:`rerope.caches.CACHE_SIZE`; 150
  distinct ``leaky`` factors or RoPE bases leave at most that many tables, and an evicted
  setting is rebuilt right;
* item 5: ``sm_scale=1e38`` (NaN rows before) raises a ``ValueError`` naming ``sm_scale`` in
  every kernel op; at the largest accepted scale the result is finite and right.

CPU only: the kernels run in Triton's interpreter, the model is ``tests/test_hf.py``'s tiny one.
"""

import functools

import pytest
import torch

import rerope
from rerope import attention, decode, launch, reference, rotary
from rerope._validate import SCORE_INPUT_ABS, SM_SCALE_MAX
from rerope.caches import CACHE_SIZE, LRUCache
from rerope.rope import rope_frequencies
from rerope_testing import kernel_device, randn, results_problems, tolerance

F32 = torch.float32


def qkv(gen, n=6, d=16, dtype=F32, heads=1):
    device = kernel_device()
    return [randn(gen, 1, heads, n, d, dtype=dtype, device=device) for _ in range(3)]


def oracle(q, k, v, window, **kwargs):
    return reference.rerope_from_relative_positions(q.double().cpu(), k.double().cpu(),
                                                    v.double().cpu(), window, **kwargs)


# --- item 1: position_ids changed in place (rerope.hf) ---------------------------------------


def _hf():
    """``tests/test_hf.py``'s helpers (that module skips itself without transformers)."""
    pytest.importorskip("transformers")
    import test_hf
    return test_hf


@pytest.mark.parametrize("change", ["add_", "data"])
@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_position_ids_changed_in_place_are_read_again(change, device, monkeypatch):
    """``m(ids, position_ids=pos); pos.add_(37); m(ids, position_ids=pos)`` (or the change
    through ``pos.data``): the second forward gives exactly the logits of a fresh tensor holding
    the shifted positions. Log-n (``logn_len=2.0``) makes the shift visible in the logits.
    ``gpu``: positions taken as costly to read (as on a GPU), so that one forward's layers
    share the first layer's reading: the next forward still reads them again."""
    t = _hf()
    import rerope.hf as hf

    if device == "gpu":
        monkeypatch.setattr(hf, "_reading_syncs", lambda t: True)

    ids = torch.randint(0, t.VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    model = hf.enable_rerope(t.build(t.tiny_config()), 4, logn_len=2.0)
    pos = torch.arange(9)[None]
    before = t.logits_of(model, ids, position_ids=pos)
    (pos.data if change == "data" else pos).add_(37)
    after = t.logits_of(model, ids, position_ids=pos)
    fresh = t.logits_of(model, ids, position_ids=torch.arange(37, 46)[None])
    assert torch.equal(after, fresh)
    assert t.max_error(after, before) > 1e-3, "log-n should see the shift"


@pytest.mark.parametrize("change", ["add_", "data"])
def test_position_ids_changed_in_place_raise_like_a_fresh_tensor(change):
    """Self-Extend (``group=2``) groups absolute positions: positions shifted by 37 raise, also
    when the same tensor was accepted unshifted by the forward before."""
    t = _hf()
    import rerope.hf as hf

    ids = torch.randint(0, t.VOCAB, (1, 8), generator=torch.Generator().manual_seed(6))
    model = hf.enable_rerope(t.build(t.tiny_config()), 4, group=2)
    pos = torch.arange(8)[None]
    t.logits_of(model, ids, position_ids=pos)
    (pos.data if change == "data" else pos).add_(37)
    for given in (pos, torch.arange(37, 45)[None]):
        with pytest.raises(ValueError, match="group .Self-Extend. groups absolute positions"):
            t.logits_of(model, ids, position_ids=given)


# --- item 1: inv_freq changed through .data ----------------------------------------------------


def test_inv_freq_changed_through_data_is_read_again(gen):
    """``f.data.mul_(3)`` bumps no version counter; the next call with ``inv_freq=f`` must still
    use the new values (it was off by 1.7 when a cache answered by identity and version)."""
    q, k, v = qkv(gen, n=8)
    window = 3
    f = rope_frequencies(16).to(F32)
    rerope.rerope(q, k, v, window, inv_freq=f)
    with torch.no_grad():
        rerope.rerope_decode(q[:, :, -1:], k, v, window, rotated=False, inv_freq=f)
    f.data.mul_(3)
    want = oracle(q, k, v, window, inv_freq=f.double())
    got = rerope.rerope(q, k, v, window, inv_freq=f)
    assert not results_problems({"out": got}, {"out": want}, tolerance(F32))
    with torch.no_grad():
        step = rerope.rerope_decode(q[:, :, -1:], k, v, window, rotated=False, inv_freq=f)
    assert not results_problems({"out": step}, {"out": want[:, :, -1:]}, tolerance(F32))
    stale = oracle(q, k, v, window, inv_freq=f.double() / 3)
    assert (want - stale).abs().max() > 1e-2, "the change should matter"


# --- item 2: every cache bounded ---------------------------------------------------------------


def test_every_cache_is_bounded_by_one_constant():
    """The package's caches: LRU caches of ``CACHE_SIZE`` entries, and ``functools.lru_cache``
    functions of the same size."""
    for cache in (rotary._TABLES, rotary._OFFSETS, attention._OPERANDS, attention.PLANS,
                  attention._LAUNCHERS, decode.PLANS):
        assert isinstance(cache, LRUCache) and cache.size == CACHE_SIZE
    for function in (attention._autotuned, attention._device_memory, decode._sm_count,
                     launch._capability):
        assert isinstance(function, functools._lru_cache_wrapper)
        assert function.cache_parameters()["maxsize"] == CACHE_SIZE


def test_lru_cache_keeps_the_recently_used():
    cache = LRUCache(size=3)
    for i in range(10):
        cache[i] = str(i)
        assert cache.get(0) == "0" and len(cache) <= 3
    assert cache.get(9) == "9" and cache.get(1) is None
    with pytest.raises(TypeError):
        cache.get([1])                         # unhashable: as a dict


def test_lru_cache_repeated_key_is_the_entry_and_keeps_the_order():
    """A repeat of the last key used (a decode step's layers) is answered without the dict:
    the same value, the same order of eviction; a key whose ``==`` is no truth value (a
    tensor in it) goes to the dict; a cache of size 0 answers nothing."""
    cache = LRUCache(size=2)
    cache[(1, "a")] = "first"
    cache[(2, "b")] = "second"
    assert cache.get((1, "a")) == "first" and cache.get((1, "a")) == "first"
    cache[(3, "c")] = "third"                  # evicts (2, "b"), the least recently used
    assert cache.get((2, "b")) is None
    assert [cache.get((1, "a")), cache.get((3, "c"))] == ["first", "third"]
    cache[(torch.zeros(2),)] = "tensor"
    assert cache.get((torch.zeros(2),)) is None          # a new tensor: another key (by hash)
    assert cache.get((3, "c")) == "third" and cache.get((1, "a")) is None   # evicted by it
    empty = LRUCache(size=0)
    empty[(1,)] = "dropped"
    assert empty.get((1,)) is None and len(empty) == 0


@pytest.mark.parametrize("setting", ["leaky", "base"])
def test_many_settings_keep_the_tables_bounded(setting, gen):
    """150 distinct ``leaky`` factors (or RoPE bases) at one shape: at most ``CACHE_SIZE``
    tables, offset vectors and operands are kept (each ≈ 0.5 MiB at D=32 before, never freed),
    and the first setting, evicted by then, is rebuilt right."""
    q, k, v = qkv(gen, n=4, d=16)
    values = ([2.0 + i / 8 for i in range(150)] if setting == "leaky"
              else [100.0 + 7 * i for i in range(150)])
    with torch.no_grad():
        for value in values:
            rerope.rerope(q, k, v, 2, **{setting: value})
            assert len(rotary._TABLES) <= CACHE_SIZE and len(rotary._OFFSETS) <= CACHE_SIZE
    assert len(attention._OPERANDS) <= CACHE_SIZE and len(attention.PLANS) <= CACHE_SIZE
    assert len(rotary._TABLES) == CACHE_SIZE, "the tables should have filled the cache"
    for value in (values[0], values[-1]):
        got = rerope.rerope(q, k, v, 2, **{setting: value})
        want = oracle(q, k, v, 2, **{setting: value})
        assert not results_problems({"out": got}, {"out": want}, tolerance(F32))


# --- item 5: sm_scale whose scaled scores overflow fp32 ----------------------------------------


@pytest.mark.parametrize("op", ["rerope", "rerope_attention", "rerope_decode"])
def test_overflowing_sm_scale_is_refused(op, gen):
    """``sm_scale=1e38`` returned NaN rows where the float64 reference is finite; now every
    kernel op refuses it with a ``ValueError`` naming ``sm_scale`` and the accepted range."""
    q, k, v = qkv(gen)
    assert torch.isfinite(oracle(q, k, v, 3, sm_scale=1e38)).all()
    with pytest.raises(ValueError, match=r"sm_scale must be between .* and 1\.074e\+26"):
        if op == "rerope":
            rerope.rerope(q, k, v, 3, sm_scale=1e38)
        elif op == "rerope_attention":
            rerope.rerope_attention(q, q, k, k, v, 3, sm_scale=1e38)
        else:
            rerope.rerope_decode(q[:, :, -1:], k, v, 3, sm_scale=1e38)


@pytest.mark.parametrize("dtype", [torch.float16, F32])
def test_largest_sm_scale_gives_finite_right_rows(dtype, gen):
    """At ``SM_SCALE_MAX`` the softmax is a hard maximum: finite and the reference's, also with
    entries near fp16's largest magnitude (the bound is made for them; 0.7 of it, so that RoPE's
    rotation of a pair of such entries stays within fp16)."""
    q, k, v = qkv(gen, n=5, dtype=dtype)
    q[0, 0, 1], k[0, 0, 0] = 0.7 * SCORE_INPUT_ABS, 0.7 * SCORE_INPUT_ABS   # huge scores
    got = rerope.rerope(q, k, v, 2, sm_scale=SM_SCALE_MAX)
    want = oracle(q, k, v, 2, sm_scale=SM_SCALE_MAX)
    assert torch.isfinite(want).all()
    assert not results_problems({"out": got}, {"out": want}, tolerance(dtype))
