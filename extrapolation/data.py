"""The corpus: the Python standard library's own ``.py`` sources, read as bytes (a 256-symbol vocabulary).

They exist on every machine with Python, so the experiment needs no download. The split is by
**file**: a file is held out when a hash of ``"<seed>:<relative path>"`` falls below
``val_fraction``, so validation text is never seen in training, the split does not depend on the
order the files are listed in, and adding or removing a file moves no other file across it.

Different Python versions ship different files, so the run's exact file list (with sizes) is
stored in ``book/data/extrapolation_split.json`` and the held-out evaluation documents themselves
(windows of the validation files) in ``book/data/extrapolation_heldout.safetensors``: the chapter re-evaluates from those on any
machine.
"""

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch

SEPARATOR = 0          # byte between two files in the training stream (a document boundary)
VOCAB_SIZE = 256       # bytes
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir():
    """The directory of this interpreter's standard library (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root):
    """Sorted relative POSIX paths of every ``*.py`` file under ``root``.

    Installed third-party packages (``site-packages``, ``dist-packages``) and ``__pycache__``
    are skipped: the corpus is the standard library alone.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root must be an existing directory, got {str(root)!r}")
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        rel = Path(directory).relative_to(root)
        paths += [(rel / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(paths)


def _unit_hash(seed, path):
    """A number in [0, 1) from ``sha256("<seed>:<path>")``: the same on every machine."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def split_files(paths, seed=0, val_fraction=0.05):
    """Split file paths into ``(train, val)``, both sorted; a file is in ``val`` when its hash < fraction.

    Deterministic and order-independent: the same paths and seed always give the same split.
    """
    if isinstance(paths, (str, bytes)):
        raise TypeError("paths must be a list of relative paths, not a single string")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    paths = sorted(set(paths))
    val = [p for p in paths if _unit_hash(seed, p) < val_fraction]
    held = set(val)
    return [p for p in paths if p not in held], val


def read_stream(root, paths):
    """The files' bytes joined into one ``(total,)`` ``torch.uint8`` tensor, ``SEPARATOR`` after each."""
    root = Path(root)
    chunks = []
    for path in paths:
        chunks += [(root / path).read_bytes(), bytes([SEPARATOR])]
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def heldout_documents(root, val_paths, length, count):
    """Up to ``count`` held-out documents: consecutive, non-overlapping ``length``-byte windows of
    the validation files (in ``val_paths`` order; a file shorter than ``length`` gives none).

    Returns ``(tokens, names)``: ``tokens`` ``(count', length)`` ``torch.uint8``, ``count' <= count``;
    ``names`` like ``"json/decoder.py@4097"`` (file and byte offset).
    """
    root = Path(root)
    rows, names = [], []
    for path in val_paths:
        data = (root / path).read_bytes()
        for start in range(0, len(data) - length + 1, length):
            if len(rows) == count:
                break
            rows.append(torch.frombuffer(bytearray(data[start:start + length]), dtype=torch.uint8))
            names.append(f"{path}@{start}")
    if not rows:
        raise ValueError(f"no validation file has {length} bytes or more")
    return torch.stack(rows), names


def random_crops(stream, count, length, generator):
    """``count`` random windows of ``length`` bytes from ``stream``, as a ``(count, length)`` int64 tensor."""
    if stream.numel() <= length:
        raise ValueError(f"stream of {stream.numel()} bytes is too short for windows of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator,
                           device=generator.device)
    offsets = torch.arange(length, device=stream.device)
    return stream[starts.to(stream.device)[:, None] + offsets[None, :]].long()


def split_manifest(root, train, val, seed, val_fraction):
    """A JSON-able record of the split: rule, counts, bytes, and every file with its size."""
    root = Path(root)
    sizes = {p: (root / p).stat().st_size for p in train + val}
    return {"rule": "file is held out when sha256(f'{seed}:{path}') / 2**256 < val_fraction",
            "seed": seed, "val_fraction": val_fraction, "root": str(root),
            "train_files": len(train), "val_files": len(val),
            "train_bytes": sum(sizes[p] for p in train), "val_bytes": sum(sizes[p] for p in val),
            "train": [[p, sizes[p]] for p in train], "val": [[p, sizes[p]] for p in val]}


def save_heldout(path, tokens, names, meta=None):
    """Write held-out documents ``(count, length)`` uint8 and their file names as safetensors."""
    from safetensors.torch import save_file
    if tokens.dtype != torch.uint8 or tokens.dim() != 2:
        raise ValueError(f"tokens must be a (count, length) uint8 tensor, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if len(names) != tokens.shape[0]:
        raise ValueError(f"{len(names)} names for {tokens.shape[0]} documents")
    metadata = {"names": json.dumps(list(names)), "meta": json.dumps(meta or {})}
    save_file({"tokens": tokens.contiguous().cpu()}, str(path), metadata=metadata)


def load_heldout(path):
    """Read ``save_heldout``'s file: ``(tokens (count, length) uint8, names, meta dict)``."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as file:
        tokens = file.get_tensor("tokens")
        metadata = file.metadata()
    return tokens, json.loads(metadata["names"]), json.loads(metadata["meta"])
