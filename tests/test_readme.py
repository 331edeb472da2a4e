"""README.md's "Quick start" examples run as they stand, and print and compute what they say.

Each ```python block of that section is run in a fresh interpreter from an empty folder, with
only the package's source root (kernels/) on PYTHONPATH: as a user who installed the package
would paste it, from anywhere (``import rerope`` must pick the CPU interpreter by itself on a
machine with no GPU). Checked after each run:

* every ``max |difference| ...: X`` line it prints has ``X`` below the bound the README states
  ("each max |difference| is below 1e-4"), and every block prints at least one;
* the first block's ``# ≈ ...`` comments are claims (``out_rot = ...  # ≈ out``), checked with
  ``torch.testing.assert_close`` after it ran;
* the transformers block generated the new tokens it asked for.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Quick start"
DIFFERENCE = re.compile(r"max \|difference\|[^:\n]*:\s*(\S+)")


def readme():
    return (ROOT / "README.md").read_text(encoding="utf-8")


def section():
    match = re.search(rf"^{re.escape(SECTION)}\n(.*?)(?=^## )", readme(), flags=re.M | re.S)
    assert match, f'README.md has no "{SECTION}" section'
    return match.group(1)


def usage_blocks():
    return re.findall(r"^```python\n(.*?)^```", section(), flags=re.M | re.S)


def stated_bound():
    """The bound the section's prose gives for every printed max |difference|."""
    match = re.search(r"max \|difference\| is below (\d(?:\.\d+)?e-\d+)", section())
    assert match, "the quick start does not state the bound its printed differences stay below"
    return float(match.group(1))


def claims(block):
    """``name = …  # ≈ expr`` lines: (name, expr) pairs."""
    return re.findall(r"^(\w+) = .*#\s*≈\s*(.+?)\s*$", block, flags=re.M)


def run(code, folder):
    """The code in a fresh interpreter, from ``folder``, with only kernels/ added to the path."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() not in (ROOT, ROOT / "kernels")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), *rest]))
    result = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (
        f"README example failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def check_differences(stdout):
    bound = stated_bound()
    values = [float(v) for v in DIFFERENCE.findall(stdout)]
    assert values, f"the example printed no max |difference| line:\n{stdout}"
    assert all(v < bound for v in values), (
        f"a printed difference is not below the README's {bound:g}:\n{stdout}")


def test_quick_start_has_examples():
    blocks = usage_blocks()
    assert len(blocks) >= 2, blocks
    assert claims(blocks[0]), "the first example states no ≈ results to check"
    for block in blocks:
        assert '"cuda"' not in block or "torch.cuda.is_available()" in block, (
            "an example hard-codes the CUDA device")
        assert "max |difference|" in block, "an example prints no visible check"


def test_kernels_example_runs_and_agrees(tmp_path):
    block = usage_blocks()[0]
    checks = "\n".join(
        f"torch.testing.assert_close({name}.float(), ({expr}).float(), atol=3e-3, rtol=3e-3)"
        for name, expr in claims(block))
    names = sorted(set(re.findall(r"^(\w+) = ", block, flags=re.M)))
    stdout = run(block + "\n" + checks + "\nprint('checked', " + repr(names) + ")\n", tmp_path)
    assert "checked" in stdout
    check_differences(stdout)


def test_hf_example_runs(tmp_path):
    pytest.importorskip("transformers")
    block = usage_blocks()[1]
    stdout = run(block + "\nassert tokens.shape == (1, prompt.shape[1] + 4), tokens.shape"
                 "\nassert not rerope.hf.is_rerope_enabled(model)"
                 "\nprint('generated', tokens.shape)\n", tmp_path)
    assert "generated" in stdout and "new tokens: [" in stdout
    check_differences(stdout)


def test_readme_is_a_front_door():
    """The README stays short (the measurements live in the book's appendix)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= 8000, f"README.md has {len(text)} characters; keep it at 8,000 or fewer"
