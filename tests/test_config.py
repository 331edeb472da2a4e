"""The package's environment variables and Triton's mode (``rerope.configs``, ``rerope.runtime``).

Every ``REROPE_*`` variable is read once, at import, by ``configs.Config``: a bad value fails
``import rerope`` with a ``ValueError`` that names the variable, the value and the accepted values;
booleans take ``0/1, true/false, yes/no, on/off`` in any case. Without CUDA, ``import rerope``
runs its own kernels in Triton's interpreter without writing ``TRITON_INTERPRET`` into
``os.environ``. The imports run in subprocesses, with a clean environment.
"""

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from rerope import configs

KERNELS = str(Path(__file__).resolve().parents[1] / "kernels")


def run_python(code, **env):
    """Run ``code`` (from a file: ``@triton.jit`` needs one) in a fresh interpreter with
    ``rerope`` importable, no ``REROPE_*`` nor ``TRITON_INTERPRET`` inherited, and ``env``."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("REROPE_") and k != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = KERNELS + os.pathsep + base.get("PYTHONPATH", "")
    base.update(env)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "probe.py"
        script.write_text(code, encoding="utf-8")
        return subprocess.run([sys.executable, str(script)], env=base, capture_output=True,
                              text=True, timeout=300)


def settings(**env):
    return configs.Config.from_environment(env)


BAD = [("REROPE_DECODE_CONFIG", "128,3"), ("REROPE_DECODE_CONFIG", "64,4,3,x"),
       ("REROPE_DECODE_CONFIG", "48,4,3,2"), ("REROPE_DECODE_CONFIG", "64,3,4,3,2"),
       ("REROPE_PRETURN_BWD_MAX_BYTES", "lots"),
       ("REROPE_PRETURN_BWD_MAX_BYTES", "-1"), ("REROPE_PRETURN_BWD_MAX_BYTES", "1.5"),
       ("REROPE_TMA", "maybe"), ("REROPE_AUTOTUNE", "2")]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError) as error:
        settings(**{name: value})
    message = str(error.value)
    assert name in message and repr(value) in message and "accepted values are" in message


@pytest.mark.parametrize("name, value", [BAD[0], ("REROPE_PRETURN_BWD_MAX_BYTES", "1e9x")])
def test_bad_value_fails_the_import(name, value):
    """The issue's two: ``import rerope`` itself fails, and says which variable."""
    done = run_python("import rerope", **{name: value})
    assert done.returncode != 0
    assert "ValueError" in done.stderr and name in done.stderr, done.stderr[-2000:]


def test_good_spellings():
    for word in ("0", "false", "No", "OFF"):
        assert settings(REROPE_AUTOTUNE=word).autotune is False
        assert settings(REROPE_TMA=word).tma == "off"
    for word in ("1", "True", "yes", "on"):
        assert settings(REROPE_AUTOTUNE=word).autotune is True
        assert settings(REROPE_TMA=word).tma == "on"
    assert settings(REROPE_TMA="AUTO").tma == "auto" and settings(REROPE_TMA="").tma == "auto"
    assert settings(REROPE_PRETURN_BWD_MAX_BYTES="1e9").preturn_bwd_max_bytes == 10**9
    assert settings(REROPE_PRETURN_BWD_MAX_BYTES="2_000").preturn_bwd_max_bytes == 2000
    assert settings(REROPE_DECODE_CONFIG=" 128,8,2,1").decode_config == (128, 8, 2, 1)
    assert settings() == configs.Config()          # unset: the defaults


def test_misspelt_variable_warns():
    with pytest.warns(UserWarning, match="REROPE_AUTOTUNED .*REROPE_AUTOTUNE"):
        settings(REROPE_AUTOTUNED="0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # the repository's own tools' variables
        settings(REROPE_FUZZ_PROFILE="long", REROPE_BENCH_RESULTS="x", REROPE_DECODE_RESULTS="y")


def test_retired_variable_warns():
    """``REROPE_FUSED_MERGE`` (the decode merge fused into the split kernel, removed) is
    no longer read: set, it says so, whatever its value."""
    for value in ("1", "rule", "sometimes"):
        with pytest.warns(UserWarning, match="REROPE_FUSED_MERGE is no longer read"):
            assert settings(REROPE_FUSED_MERGE=value) == configs.Config()


def test_settings_reach_the_modules():
    """Good spellings, read at import, land in the names the code reads."""
    done = run_python(
        "import rerope\nfrom rerope import decode\nc = rerope.config()\n"
        "print(c.autotune, c.tma, c.preturn_bwd_max_bytes, decode.launch_config(64))",
        REROPE_AUTOTUNE="false", REROPE_TMA="off",
        REROPE_PRETURN_BWD_MAX_BYTES="1e9", REROPE_DECODE_CONFIG="128,8,2,3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == (
        "False off 1000000000 ({'BLOCK_N': 128, 'num_warps': 8, 'num_stages': 2}, 3)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen without CUDA")
def test_import_leaves_the_environment_alone():
    """``import rerope`` (and ``rerope.exercises``) on CPU: no ``TRITON_INTERPRET`` in
    ``os.environ`` or a child's, the package's kernels interpreted and right, a kernel defined
    afterwards by the caller in Triton's default (compiled) mode."""
    done = run_python(
        "import os, subprocess, sys, torch, rerope, rerope.exercises\n"
        "import triton, triton.language as tl\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; "
        "print(os.environ.get(\"TRITON_INTERPRET\"))'], capture_output=True, text=True)\n"
        "assert child.stdout.strip() == 'None', child.stdout\n"
        "assert rerope.runtime.INTERPRET and rerope.runtime.CHOSEN\n"
        "assert type(rerope.forward._rerope_fwd_kernel).__name__ == 'InterpretedFunction'\n"
        "assert type(rerope.exercises._step_trace_kernel).__name__ == 'InterpretedFunction'\n"
        "@triton.jit\n"
        "def mine(x):\n"
        "    pass\n"
        "assert type(mine).__name__ == 'JITFunction', type(mine)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))\n"
        "out = rerope.rerope(q, k, v, window=5)\n"
        "want = rerope.reference.rerope(q.double(), k.double(), v.double(), window=5)\n"
        "assert (out.double() - want).abs().max() < 1e-5\n"
        "print('ok')\n")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen without CUDA")
def test_triton_imported_first_is_named():
    """Triton's own helpers are fixed at its first import: imported before ``rerope`` in
    compiled mode they cannot serve interpreted kernels, and ``import rerope`` says so (it
    used to import, then fail at the first call with an ``InterpreterError``)."""
    done = run_python("import triton\nimport rerope")
    assert done.returncode != 0 and "InterpreterModeError" in done.stderr
    assert "Import rerope before triton" in done.stderr
    done = run_python("import triton\nimport rerope\nprint('ok')", TRITON_INTERPRET="1")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
