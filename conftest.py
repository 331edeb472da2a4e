"""Root conftest: `import kernels` finds this repo's package, in tests and in notebooks.

pytest's `pythonpath = ["."]` (pyproject.toml) covers the test process. The notebook kernels
that nbval starts are separate processes that run in book/, so the repo root also goes on
their PYTHONPATH, which they inherit.
"""

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent)
_rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *_rest])
