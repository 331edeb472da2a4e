"""Tensor parallelism: ``rerope.hf`` in a model transformers shards over two processes.

A tiny random Llama (4 query heads, 2 key/value heads of 16) loaded with
``DistributedConfig(tp_plan="auto")`` under ``torchrun`` on the CPU (gloo, Triton's
interpreter): each rank's attention receives half the heads, and prefill plus greedy
``generate`` give the same tokens as the one-process model, with ReRoPE and with stock SDPA
(``benchmarks/tp.py``, whose GPU form measures the same on two H200s).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--tiny", "--context", "24", "--window", "8", "--steps", "6", "--reps", "1"]


def _run(command, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), str(ROOT)]))
    done = subprocess.run(command + ["--world-dir", str(tmp_path), "--out",
                                     str(tmp_path / "tp.json")] + ARGS,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_equal_one_process(tmp_path):
    pytest.importorskip("transformers.distributed")
    _run([sys.executable, "-m", "benchmarks.tp"], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
          "2", "-m", "benchmarks.tp"], tmp_path)
    rows = json.loads((tmp_path / "tp.json").read_text())["rows"]
    assert {(r["world_size"], r["impl"], r["phase"]) for r in rows} == {
        (w, impl, phase) for w in (1, 2) for impl in ("rerope", "stock_sdpa")
        for phase in ("prefill", "decode")}
    for row in rows:
        assert row["tokens_equal"], f"{row}: the tokens differ from the one-process run"
        want = [4, 2] if row["world_size"] == 1 else [2, 1]
        assert row["heads_per_rank"] == want, f"{row}: attention saw the wrong heads"
        assert row["logits_max_diff"] < 1e-4, f"{row}: the logits differ from one process's"
    first = json.loads((tmp_path / "tokens.json").read_text())
    assert len(first["rerope"]["tokens"]) == 6
    moved = max(abs(a - b) for a, b in zip(first["rerope"]["logits"],
                                            first["stock_sdpa"]["logits"]))
    assert moved > 1e-3, "ReRoPE (window 8, 24 tokens) left the logits as stock RoPE's"
