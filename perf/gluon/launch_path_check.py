"""Exercise plain_fwd.attention's real JIT launch path (argument binding, specialization, compile)
with a mock sm_90 driver and warmup=True (nothing launched), on CPU tensors: every config, both
dtypes, with and without LSE.   /work/venv36/bin/python perf/gluon/launch_path_check.py"""
import sys, torch, triton
from triton.backends.compiler import GPUTarget
import triton.runtime.driver as drv
from triton.runtime.jit import JITFunction

class MockDriver:
    def get_current_device(self): return 0
    def get_current_stream(self, d=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def __getattr__(self, name): raise AttributeError(f"MockDriver has no {name}")

triton.runtime.driver.set_active(MockDriver())
compiled = []
def getitem(self, grid):
    def f(*a, **k):
        kern = self.run(*a, grid=grid, warmup=True, **k)
        compiled.append((grid, kern.metadata.num_warps, kern.metadata.shared, k))
        return kern
    return f
JITFunction.__getitem__ = getitem
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import plain_fwd as pf
for D in (64, 128):
    for dt in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(1, 2, 256, D, dtype=dt) for _ in range(3))
        for cfg in [pf.default_config(D)] + pf.EXTRA_CONFIGS[D]:
            for lse in (False, True):
                pf.attention(q, k, v, return_lse=lse, config=cfg)
# SPLIT=3 (BLOCK_M 192): grid cdiv(N, 192) for N that 192 does not divide; N % 128 != 0 refused
q, k, v = (torch.randn(1, 2, 256, 64, dtype=torch.float16) for _ in range(3))
for cfg in pf.SPLIT3_CONFIGS:
    pf.attention(q, k, v, config=cfg)
    assert compiled[-1][0] == (2, 2), compiled[-1][0]
    try:
        pf.attention(*(t[:, :, :192] for t in (q, k, v)), config=cfg)
        raise SystemExit(f"{cfg}: N=192 was not refused")
    except AssertionError:
        pass
print("SPLIT=3: grid (2, 2) at N=256, N=192 refused")
for c in compiled[:3]: print(c)
print(len(compiled), "launch-path compiles OK")
