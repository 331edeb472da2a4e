"""README.md's "Use the kernels" examples run as they stand, and say what they compute.

Each ```python block of that section is run in a fresh interpreter from the repository root (as a
user would paste it: ``import rerope`` must pick the CPU interpreter by itself on a machine with
no GPU). The first block's ``# ≈ ...`` comments are claims (``out_rot ≈ out``): they are checked
after it ran.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def usage_blocks():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Use the kernels\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert match, 'README.md has no "## Use the kernels" section'
    return re.findall(r"^```python\n(.*?)^```", match.group(1), flags=re.M | re.S)


def claims(block):
    """``name = …  # ≈ expr`` lines: (name, expr) pairs."""
    return re.findall(r"^(\w+) = .*#\s*≈\s*(.+?)\s*$", block, flags=re.M)


def run(code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (
        f"README example failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def test_usage_section_has_examples():
    blocks = usage_blocks()
    assert len(blocks) >= 2, blocks
    assert claims(blocks[0]), "the first example states no ≈ results to check"
    for block in blocks:
        assert '"cuda"' not in block or "torch.cuda.is_available()" in block, (
            "an example hard-codes the CUDA device")


def test_kernels_example_runs_and_agrees():
    block = usage_blocks()[0]
    checks = "\n".join(
        f"torch.testing.assert_close({name}.float(), ({expr}).float(), atol=3e-3, rtol=3e-3)"
        for name, expr in claims(block))
    names = sorted(set(re.findall(r"^(\w+) = ", block, flags=re.M)))
    stdout = run(block + "\n" + checks + "\nprint('checked', " + repr(names) + ")\n")
    assert "checked" in stdout


@pytest.mark.parametrize("index", [1])
def test_hf_example_runs(index):
    pytest.importorskip("transformers")
    block = usage_blocks()[index]
    stdout = run(block + "\nassert tokens.shape == (1, prompt.shape[1] + 4), tokens.shape"
                 "\nprint('generated', tokens.shape)\n")
    assert "generated" in stdout
