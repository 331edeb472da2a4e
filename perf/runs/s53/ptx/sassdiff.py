"""SASS (cuobjdump -sass of the ptxas sm_90a cubin) diff, registers and immediates anonymised, old ->
new, for one kernel of one case:  /work/venv36/bin/python perf/runs/s53/ptx/sassdiff.py CASE KERNEL [LO HI]
(LO HI: print the differing instructions whose new position is in [LO, HI])."""
import sys, re, difflib
sys.path.insert(0, "perf/runs/s53/ptx")
import compare as C
def sass_lines(ptx):
    C.ptxas_info(ptx); s = C.SASS[ptx]
    out=[]
    for line in s.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins = re.sub(r"\bU?R\d+\b|\bU?P\d\b", "R", m.group(2))
            ins = re.sub(r"0x[0-9a-f]+", "IMM", ins)
            out.append(ins)
    return out
case, kern = sys.argv[1], sys.argv[2]
import json, os
def final(d):
    L=json.load(open(f"{d}/launches.json")); r=[x for x in L if not x["tag"] and x["kernel"]==kern][0]
    return C.read(C.stem(d,r)+".ptx")
n=sass_lines(final(f"perf/runs/s53/ptx/out/new_{case}")); o=sass_lines(final(f"perf/runs/s53/ptx/out/old_{case}"))
first_mma = lambda L: next((i for i,x in enumerate(L) if "HGMMA" in x), 0)
print("lines new", len(n), "old", len(o), "first HGMMA new", first_mma(n), "old", first_mma(o))
sm = difflib.SequenceMatcher(None, o, n, autojunk=False)
for tag,i1,i2,j1,j2 in sm.get_opcodes():
    if tag!="equal": print(tag, f"old[{i1}:{i2}] new[{j1}:{j2}]")
if len(sys.argv) > 3:
    lo_, hi_ = int(sys.argv[3]), int(sys.argv[4])
    for tag,i1,i2,j1,j2 in sm.get_opcodes():
        if tag!="equal" and lo_ <= j1 <= hi_:
            print("---", tag, i1, j1); print("  old:", o[i1:i2]); print("  new:", n[j1:j2])
