"""Supported versions: the stated floor is the checked floor is the tested floor.

* :mod:`rerope._compat` refuses too old a Triton (and, under the interpreter, Triton < 3.7 with
  numpy >= 2.4) at ``import rerope``, with a message naming what was found and what is needed;
* ``requirements.txt``, the README and the Makefile's ``test-floor`` job name the same floor;
* a few kernel runs, forward and backward, on whatever Triton is installed: ``make test-floor``
  runs this file and ``tests/test_compile.py`` with the floor Triton (``FLOOR_TRITON`` in the
  Makefile) in a venv of its own, and ``make test`` runs it with the current one.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from rerope import _compat
from rerope_testing import (F16, F32, Case, check_kernel_against_reference, describe,
                            make_inputs)

ROOT = Path(__file__).resolve().parents[1]
FLOOR = ".".join(map(str, _compat.TRITON_MIN))


# --- the check, on given versions ---------------------------------------------------------------


@pytest.mark.parametrize("text, parsed", [
    ("3.4.0", (3, 4)), ("3.5.0+git7416ffcb", (3, 5)), ("3.10.1", (3, 10)), ("2.3.0rc1", (2, 3)),
    ("v3.6", (3, 6)), ("unknown", None), ("", None),
])
def test_parse_version(text, parsed):
    assert _compat.parse_version(text) == parsed


@pytest.mark.parametrize("triton_version", ["3.2.0", "3.3.1", "3.3.0+git1234abcd", "2.3.1"])
@pytest.mark.parametrize("interpret", [False, True], ids=["compiled", "interpreter"])
def test_old_triton_is_refused_naming_both_versions(triton_version, interpret):
    found = _compat.problems(triton_version, "2.3.5", interpret, "2.7.1+cu126")
    assert len(found) == 1, found
    message = found[0]
    assert f"found Triton {triton_version}" in message
    assert f"Triton >= {FLOOR}" in message
    assert "torch 2.7.1+cu126" in message
    assert f"pip install -U 'torch>={_compat.TORCH_FOR_TRITON_MIN}'" in message
    assert "Colab" in message and "Restart session" in message


@pytest.mark.parametrize("triton_version", ["3.4.0", "3.5.1", "3.6.0", "3.7.0", "3.9.0",
                                            "3.5.0+git7416ffcb", "4.0.0"])
@pytest.mark.parametrize("numpy_version", ["1.26.4", "2.3.5", "2.4.0", "2.5.1"])
def test_supported_triton_compiled_accepts_any_numpy(triton_version, numpy_version):
    """On a GPU (compiled kernels) numpy's version does not matter."""
    assert _compat.problems(triton_version, numpy_version, interpret=False) == []


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.4.0", "2.3.5", False), ("3.6.0", "2.3.99", False), ("3.6.0", "1.26.4", False),
    ("3.4.0", "2.4.0", True), ("3.5.1", "2.4.6", True), ("3.6.0", "2.5.0", True),
    ("3.7.0", "2.4.6", False), ("3.9.0", "2.5.0", False),
])
def test_interpreter_numpy_rule(triton_version, numpy_version, refused):
    """Under the interpreter, Triton < 3.7 needs numpy < 2.4 (else every kernel fails)."""
    found = _compat.problems(triton_version, numpy_version, interpret=True)
    assert bool(found) == refused, found
    if refused:
        assert f"found Triton {triton_version} with numpy {numpy_version}" in found[0]
        assert "pip install -U 'triton>=3.7'" in found[0]
        assert "pip install 'numpy<2.4'" in found[0]


def test_missing_triton_is_named():
    found = _compat.problems(None, "2.4.0", interpret=True, torch_version="2.13.0+cpu")
    assert len(found) == 1 and "no Triton is installed" in found[0]
    assert f"pip install 'triton>={FLOOR}'" in found[0]


def test_odd_version_string_is_let_through():
    assert _compat.problems("unknown", "2.4.0", interpret=True) == []


def test_installed_versions_pass():
    """This environment imported ``rerope``, so the check passed here; it agrees directly."""
    from rerope.runtime import INTERPRET

    triton_version, numpy_version, torch_version = _compat.installed_versions()
    assert _compat.problems(triton_version, numpy_version, INTERPRET, torch_version) == []
    _compat.check(INTERPRET)   # does not raise


def test_import_fails_clearly_with_an_old_triton(tmp_path):
    """End to end: ``import rerope`` with Triton 3.3.1 installed (a stand-in package that
    only has a version) raises the check's ImportError, not an error from inside Triton."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "3.3.1"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "kernels")])}
    code = ("import rerope\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("rerope._compat.UnsupportedVersionError: rerope needs Triton >= "
                           f"{FLOOR}, found Triton 3.3.1"), run.stderr[-3000:]
    assert issubclass(_compat.UnsupportedVersionError, ImportError)


# --- one floor, stated everywhere -----------------------------------------------------------------


def _requirement(name):
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    found = [line.split("#")[0].strip() for line in lines
             if re.match(rf"\s*{name}\s*(>=|==|<|~=|$)", line)]
    assert len(found) == 1, f"one {name} line expected in requirements.txt, found {found}"
    return found[0]


def test_requirements_state_the_checked_floor():
    assert _requirement("triton") == f"triton>={FLOOR}"
    assert _requirement("torch") == f"torch>={_compat.TORCH_FOR_TRITON_MIN}"


def test_ci_floor_job_tests_the_checked_floor():
    """The Makefile's floor job installs exactly the floor Triton, with numpy below 2.4 (the
    interpreter needs it with Triton < 3.7), and .ci/run runs that job."""
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"^(FLOOR_\w+)\s*\?=\s*(.*?)\s*$", makefile, re.M))
    assert re.fullmatch(rf"triton=={re.escape(FLOOR)}\.\d+", pins.get("FLOOR_TRITON", "")), pins
    assert pins.get("FLOOR_NUMPY") == "numpy<2.4", pins
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\s*make test-floor\b", ci, re.M), "the floor job is not in .ci/run"
    assert re.search(r"^\s*make test\b(?!-)", ci, re.M), "the main job is not in .ci/run"


def test_readme_states_the_floor():
    readme = (ROOT / "README.md").read_text()
    assert f"Triton {FLOOR}" in readme and f"torch {_compat.TORCH_FOR_TRITON_MIN}" in readme
    assert "numpy < 2.4" in readme


# --- the kernels run on this Triton: forward and backward against the float64 reference ----------

# A handful of interpreter cases (about a second each) that the floor job runs: band tiles and
# the causal edge, non-causal, one token, grouped-query attention, a layout per tensor.
SMOKE_CASES = [Case(77, 15, dtype=F16), Case(50, 31, causal=False), Case(1, 1),
               Case(40, 12, hq=4, hkv=2, dtype=F16),
               Case(40, 10, batch=2, hq=2, hkv=2, layout="mixed", dtype=F16)]


@pytest.mark.parametrize("case", SMOKE_CASES, ids=Case.id)
def test_kernels_match_reference(case, gen):
    tensors, dout = make_inputs(gen, case.batch, case.hq, case.hkv, case.n, case.d, case.dtype,
                                layout=case.layout)
    check_kernel_against_reference(tensors, dout, case.window, case.causal, case.sm_scale,
                                   context=describe(gen, triton=_compat.installed_versions()[0],
                                                    **asdict(case)))


def test_descriptor_path_matches_reference(gen):
    """The TMA tensor-descriptor path (``REROPE_TMA=1``) through this Triton's interpreter:
    its descriptor API is the part that changed most across Triton releases."""
    import rerope
    from rerope import attention

    case = Case(77, 30, causal=False, dtype=F16)
    tensors, dout = make_inputs(gen, 1, 2, 1, case.n, case.d, case.dtype)
    assert attention._use_tma("on", *tensors, dout), "the descriptor path is not taken"
    with rerope.using_config(tma="on"):
        check_kernel_against_reference(tensors, dout, case.window, case.causal,
                                       context=describe(gen, tma="on", **asdict(case)))


def test_descriptor_path_compiles_for_hopper():
    """The default compile matrix of ``tests/test_compile.py`` has no job that reads through
    TMA descriptors (its riskiest configurations are fp32); compile one here, with this Triton:
    the forward kernel for sm_90, fp16, D = 64, its first configuration."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without the NVIDIA backend")
    import test_compile

    job = next(j for j in test_compile.jobs(full=True) if j["kernel"] == "fwd"
               and j["capability"] == [9, 0] and j["dtype"] == "fp16" and j["head_dim"] == 64)
    assert test_compile.uses_tma(job), f"{test_compile.job_id(job)} would not use TMA"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "kernels"), str(ROOT),
                                             os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "test_compile.py")],
                         input=json.dumps([job]), capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(results) == 1, run.stderr[-3000:]
    result = results[0]
    assert result["error"] is None, f"{test_compile.job_id(job)}:\n{result['error']}"
    assert 0 < result["shared"] <= job["limit"], result


def test_the_wheel_lists_every_subpackage():
    """``pyproject.toml``'s ``packages`` names every package under ``kernels/rerope`` (a
    missing one installs a wheel whose ``import rerope`` fails; ``make test-install`` would
    catch it, later)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    listed = set(re.findall(r'"(rerope(?:\.\w+)*)"', re.search(r"^packages = \[(.*)\]$", text,
                                                               re.M).group(1)))
    source = ROOT / "kernels"
    found = {".".join(p.parent.relative_to(source).parts)
             for p in source.rglob("__init__.py") if "__pycache__" not in p.parts}
    assert listed == found, f"pyproject.toml lists {sorted(listed)}, kernels/ has {sorted(found)}"
