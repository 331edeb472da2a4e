# The package functions one rerope and one rerope_decode call pass through (any rerope/ on PYTHONPATH).
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
import rerope
from rerope import launch
launch.Launcher._slow_launch = lambda self, a: None
def walk(fn):
    seq = []
    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if "/rerope/" in f:
                seq.append(f.split("/rerope/")[1][:-3] + ":" + frame.f_code.co_name)
    sys.setprofile(prof); fn(); sys.setprofile(None)
    return seq
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 4, 64, 64, generator=g); k = torch.randn(1, 4, 64, 64, generator=g); v = torch.randn_like(k)
call = lambda: rerope.rerope(q, k, v, 16)
first = walk(call); second = walk(call)
qd = torch.randn(1, 4, 1, 64, generator=g)
dcall = lambda: rerope.rerope_decode(qd, k, v, 16)
dfirst = walk(dcall); dsecond = walk(dcall)
k2, v2 = torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2)   # a cache one key longer
dgrown = walk(lambda: rerope.rerope_decode(qd, k2, v2, 16))
for name, s in (("rerope first", first), ("rerope second", second), ("rerope_decode first", dfirst),
                ("rerope_decode second", dsecond), ("rerope_decode one key longer", dgrown)):
    print(f"{name}: {len(s)} stops"); print("  " + " -> ".join(s))
