"""Root conftest: `import rerope` finds the checkout's package, in tests and in notebooks.

pytest's `pythonpath = ["kernels", "."]` (pyproject.toml) covers the test process. The notebook
kernels that nbval starts are separate processes that run in book/, so the package's source root
(kernels/) and the repo root also go on their PYTHONPATH, which they inherit.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
_first = [str(ROOT / "kernels"), str(ROOT)]
_rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _first]
os.environ["PYTHONPATH"] = os.pathsep.join([*_first, *_rest])
