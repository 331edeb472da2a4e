"""Exercise rerope_fwd.rerope_attention's real JIT launch path (binding, specialization incl.
window=1 with do_not_specialize, compile) with a mock sm_90 driver and warmup=True (nothing
launched), on CPU tensors: every config (fp16), windows 1 and 300, LSE on; defaults also bf16.
    /work/venv36/bin/python perf/gluon/launch_path_check_rerope.py"""
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
import rerope_fwd as rf
for D in (64, 128):
    for dt in (torch.float16, torch.bfloat16):
        ts = [torch.randn(1, 2, 256, D, dtype=dt) for _ in range(5)]
        cfgs = rf.all_configs(D) if dt == torch.float16 else [rf.default_config(D)]
        for cfg in cfgs:
            for w in (1, 300):
                rf.rerope_attention(*ts, w, return_lse=True, config=cfg)
for c in compiled[:3]: print(c)
print(len(compiled), "launch-path compiles OK")
