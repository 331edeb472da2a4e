# Setup, identical in every chapter (a test checks): find the `kernels` package, or fetch it on Colab.
import os, subprocess, sys
REPO_URL, REPO_REF = "https://github.com/rerope-triton/rerope-triton", "main"
if "google.colab" in sys.modules:            # Colab: clone once, never reinstall torch/triton
    ROOT = "/content/rerope-triton"
    if not os.path.isdir(ROOT):
        subprocess.run(["git", "clone", "--depth", "1", "--branch", REPO_REF, REPO_URL, ROOT], check=True)
else:                                        # a checkout: walk up to the repository root
    ROOT = os.path.abspath("")
    while not os.path.isfile(os.path.join(ROOT, "kernels", "__init__.py")):
        if os.path.dirname(ROOT) == ROOT:
            raise RuntimeError("run this notebook from inside the repository")
        ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)
import torch
try:
    import kernels
except ImportError as error:                 # too old a torch/Triton (Colab): one line, what to do
    if type(error).__name__ != "UnsupportedVersionError":
        raise
    raise SystemExit(f"Setup stopped: {error}") from None
GPU = torch.cuda.is_available()              # no GPU: Triton's CPU interpreter and small sizes
DEVICE = "cuda" if GPU else "cpu"
print("kernels from", os.path.relpath(kernels.__file__, ROOT), "| GPU" if GPU else "| CPU interpreter")
