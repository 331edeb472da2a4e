"""Exercise rerope_fwd.rerope_attention's real JIT launch path (binding, specialization incl.
window=1 with do_not_specialize, compile) with a mock sm_90 driver and warmup=True (nothing
launched), on CPU tensors: every config of all_configs (fp16; incl. BAND_TWICE, which goes to
rerope_fwd_twice_kernel), windows 1 and 300, LSE on; the defaults, the BAND_TWICE and the SPLIT=3
configs also bf16; then the `_warmup=True` path (bench_rerope.py --precompile) with LSE off
(SPLIT=3: also the grid cdiv(256, 192) and that N=192 is refused). ``--twice``: BAND_TWICE only;
``--split3``: SPLIT=3 only.
    /work/venv36/bin/python perf/gluon/launch_path_check_rerope.py [--twice | --split3]"""
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
warm = []
_warmup_orig = JITFunction.warmup
def warmup(self, *a, grid, **k):
    kern = _warmup_orig(self, *a, grid=grid, **k)
    warm.append((self.fn.__name__, grid, kern.metadata.num_warps, kern.metadata.shared))
    return kern
JITFunction.warmup = warmup
for D in (64, 128):
    for dt in (torch.float16, torch.bfloat16):
        ts = [torch.randn(1, 2, 256, D, dtype=dt) for _ in range(5)]
        cfgs = [c for c in rf.all_configs(D) if dt == torch.float16 or rf.band_twice(c)
                or c == rf.default_config(D) or c in rf.SPLIT3_CONFIGS]
        if "--twice" in sys.argv:
            cfgs = [c for c in cfgs if rf.band_twice(c)]
        if "--split3" in sys.argv:
            cfgs = [c for c in cfgs if c in rf.SPLIT3_CONFIGS]
        for cfg in cfgs:
            for w in (1, 300):
                rf.rerope_attention(*ts, w, return_lse=True, config=cfg)
            print(f"D{D} {dt} {cfg}: {rf.kernel_for(cfg).fn.__name__} grid={compiled[-1][0]} "
                  f"shared={compiled[-1][2]} OK", flush=True)
            if rf.band_twice(cfg) or cfg in rf.SPLIT3_CONFIGS:
                assert rf.rerope_attention(*ts, 300, config=cfg, _warmup=True) is None
            if cfg in rf.SPLIT3_CONFIGS:  # grid cdiv(256, 192) = 2; N % 128 != 0 refused
                assert compiled[-1][0] == (2, 2), compiled[-1][0]
                try:
                    rf.rerope_attention(*(t[:, :, :192] for t in ts), 300, config=cfg)
                    raise SystemExit(f"{cfg}: N=192 was not refused")
                except AssertionError:
                    pass
for c in compiled[:3]: print(c)
print(len(compiled), "launch-path calls OK;", len(warm), "_warmup compiles OK:", warm[:2])
