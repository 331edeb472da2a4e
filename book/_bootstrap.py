# Setup, identical in every chapter (a test checks): import `rerope`; on Colab, install it first.
import importlib.util, os, subprocess, sys
REPO_URL, REPO_REF = "https://github.com/rerope-triton/rerope-triton", "main"
if "google.colab" in sys.modules:            # Colab: clone once (the book's data and helpers) and
    ROOT = "/content/rerope-triton"          # pip-install the package, never touching torch/triton
    if not os.path.isdir(ROOT):
        subprocess.run(["git", "clone", "--depth", "1", "--branch", REPO_REF, REPO_URL, ROOT], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", ROOT], check=True)
else:                                        # a checkout: walk up to the repository root
    ROOT = os.path.abspath("")
    while not os.path.isfile(os.path.join(ROOT, "kernels", "rerope", "__init__.py")):
        if os.path.dirname(ROOT) == ROOT:
            raise RuntimeError("run this notebook from inside the repository")
        ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)                     # the book's helpers: extrapolation/, realmodel/
if importlib.util.find_spec("rerope") is None:   # not installed: the checkout's copy
    sys.path.insert(0, os.path.join(ROOT, "kernels"))
import torch
if not torch.cuda.is_available():          # no GPU: the reader's own @triton.jit kernels run in
    os.environ.setdefault("TRITON_INTERPRET", "1")   # the CPU interpreter too (the book's choice)
try:
    import rerope
except ImportError as error:                 # too old a torch/Triton (Colab): one line, what to do
    if type(error).__name__ != "UnsupportedVersionError":
        raise
    raise SystemExit(f"Setup stopped: {error}") from None
GPU = torch.cuda.is_available()              # no GPU: Triton's CPU interpreter and small sizes
DEVICE = "cuda" if GPU else "cpu"
print("rerope from", os.path.dirname(rerope.__file__), "| GPU" if GPU else "| CPU interpreter")
