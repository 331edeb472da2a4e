"""Compare the sm_90 code of the kernels one rerope_attention fwd+bwd launches, new package vs
old (capture.py outputs under out/): per launched kernel (the final launch, first config, not the
autotune candidates) the normalised TTGIR and PTX (locations, debug info, comments, kernel
parameter numbers stripped), an opcode histogram of the PTX (differences listed), and registers /
spills from the bundled ptxas -v (sm_90a).

    /work/venv36/bin/python perf/runs/s53/ptx/compare.py [CASE ...]   (> compare.txt)
CASE like N32768_bfloat16_cfalse (default: every case under out/). Also: old vs old candidates
(ALL) at --candidates.
"""
import collections
import difflib
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")


SASS = {}


def read(path):
    """A capture output, plain or gzipped (the kept copies in out/ are gzipped)."""
    if os.path.exists(path):
        return open(path).read()
    with gzip.open(path + ".gz", "rt") as f:
        return f.read()


def ptxas_info(ptx):
    """(registers, spill stores/loads bytes, stack bytes); the SASS (nvdisasm) kept in SASS."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        SASS[ptx] = subprocess.run([cuobjdump, "-sass", os.path.join(d, "k.cubin")],
                                   capture_output=True, text=True).stdout
    info = r.stderr + r.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stack = re.search(r"(\d+) bytes stack frame", info)
    return (int(regs.group(1)) if regs else None,
            f"{spills.group(1)}/{spills.group(2)}" if spills else None,
            int(stack.group(1)) if stack else None)


def norm_ptx(text, name):
    text = text.split("\t.section\t.debug")[0]
    lines = []
    for line in text.splitlines():
        line = line.split("//")[0].rstrip()
        s = line.strip()
        if not s or s.startswith(".loc") or s.startswith(".file") or s.startswith("$L__func") \
                or s.startswith("$L__tmp"):
            continue
        line = re.sub(rf"{name}_param_\d+", "PARAM", line)
        lines.append(line)
    return lines


def norm_ttgir(text):
    out = []
    for line in text.splitlines():
        if line.startswith("#loc") or not line.strip():
            continue
        line = re.sub(r"\s*loc\((#loc\d*|\"[^\"]*\"[^)]*|[^)]*)\)", "", line)
        line = re.sub(r"%arg\d+", "%arg", line)
        out.append(line.rstrip())
    return out


def sass_opcodes(sass):
    """Opcode histogram of cuobjdump -sass (predicates dropped, full opcode with modifiers)."""
    c = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        ins = m.group(1).strip()
        if ins.startswith("@"):
            ins = ins.split(None, 1)[1]
        c[ins.split()[0]] += 1
    return c


def anonymise_regs(lines):
    return [re.sub(r"%(r|rd|p|f|fd|rs|h|hh)\d+", r"%\1", x) for x in lines]


def opcodes(lines):
    c = collections.Counter()
    for line in lines:
        s = line.strip()
        if s.startswith("@"):
            s = s.split(None, 1)[1] if " " in s else s
        if not s or s[0] in ".{}$(" or s.endswith(":") or s.startswith(")"):
            continue
        c[s.split()[0].rstrip(";")] += 1
    return c


def final_launches(case_dir):
    launches = json.load(open(os.path.join(case_dir, "launches.json")))
    return [r for r in launches if not r["tag"]]


def stem(case_dir, r):
    return os.path.join(case_dir, f"{r['i']:02d}_{r['kernel']}" + (f"_{r['tag']}" if r["tag"] else ""))


def describe(r):
    a = r["args"]
    keys = ("BLOCK_M", "BLOCK_N", "CAUSAL", "TMA", "HEADS_FIRST")
    return (f"grid={tuple(r['grid'])} warps={r['num_warps']} stages={r['num_stages']} "
            f"shared={r['shared']} " + " ".join(f"{k}={a[k]}" for k in keys if k in a))


def compare_pair(new_dir, rn, old_dir, ro, show_diff=40):
    name = rn["kernel"]
    pn, po = read(stem(new_dir, rn) + ".ptx"), read(stem(old_dir, ro) + ".ptx")
    gn, go = read(stem(new_dir, rn) + ".ttgir"), read(stem(old_dir, ro) + ".ttgir")
    ln, lo = norm_ptx(pn, name), norm_ptx(po, name)
    tn, to = norm_ttgir(gn), norm_ttgir(go)
    cn, co = opcodes(ln), opcodes(lo)
    print(f"  {name}")
    print(f"    new: {describe(rn)}")
    print(f"    old: {describe(ro)}")
    print(f"    ptxas new regs/spill(st/ld)/stack: {ptxas_info(pn)}   old: {ptxas_info(po)}")
    print(f"    PTX lines (normalised) new {len(ln)} old {len(lo)}; identical: {ln == lo}; "
          f"TTGIR identical (normalised): {tn == to}")
    diffc = {k: (cn[k], co[k]) for k in sorted(set(cn) | set(co)) if cn[k] != co[k]}
    print(f"    PTX opcode counts differing (new, old): {diffc if diffc else 'none'}")
    an, ao = anonymise_regs(ln), anonymise_regs(lo)
    sm = difflib.SequenceMatcher(None, ao, an, autojunk=False)
    changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal")
    print(f"    PTX lines differing once register numbers are anonymised: {changed} of {len(ln)}")
    sn, so = sass_opcodes(SASS[pn]), sass_opcodes(SASS[po])
    sdiff = {k: (sn[k], so[k]) for k in sorted(set(sn) | set(so)) if sn[k] != so[k]}
    print(f"    SASS instructions new {sum(sn.values())} old {sum(so.values())}; opcode counts "
          f"differing (new, old): {sdiff if sdiff else 'none'}")
    for key in ("LDG.E.128", "LDG.E.64", "STG.E.128", "STG.E.64", "HGMMA.64x64x16.F32.BF16",
                "HGMMA.64x64x16.F32", "UTMALDG.2D", "LDL", "STL", "IMAD.WIDE", "BAR.SYNC.DEFER_BLOCKING"):
        if sn[key] or so[key]:
            print(f"      {key}: new {sn[key]} old {so[key]}")
    if an != ao and show_diff:
        d = list(difflib.unified_diff(ao, an, "old", "new", n=1, lineterm=""))
        print(f"    PTX diff old->new (registers anonymised): {sum(1 for x in d if x[:1] in '+-' and x[:3] not in ('+++', '---'))} changed lines; first {show_diff}:")
        for x in d[:show_diff]:
            print("      " + x)
    return ln == lo


def across_n():
    """Is any kernel's code N-dependent? The same package's final launches at N=16384 and
    N=32768 (same dtype, non-causal): PTX identical after normalisation?"""
    print("== N-dependence: N=16384 vs N=32768, same package (final launches)")
    for pkg in ("new", "old"):
        for dt in ("bfloat16", "float16"):
            a = os.path.join(OUT, f"{pkg}_N16384_{dt}_cfalse")
            b = os.path.join(OUT, f"{pkg}_N32768_{dt}_cfalse")
            if not (os.path.isdir(a) and os.path.isdir(b)):
                continue
            for ra, rb in zip(final_launches(a), final_launches(b)):
                pa = norm_ptx(read(stem(a, ra) + ".ptx"), ra["kernel"])
                pb = norm_ptx(read(stem(b, rb) + ".ptx"), rb["kernel"])
                print(f"  {pkg} {dt} {ra['kernel']:20s} grid {tuple(ra['grid'])} -> {tuple(rb['grid'])}; "
                      f"specialisation equal: {ra['attrs'] == rb['attrs']}; PTX identical: {pa == pb}")


def main():
    if sys.argv[1:] == ["--across-n"]:
        return across_n()
    cases = sys.argv[1:] or sorted({d[4:] for d in os.listdir(OUT)
                                    if d.startswith("new_") and os.path.isdir(os.path.join(OUT, d))})
    for case in cases:
        new_dir, old_dir = os.path.join(OUT, "new_" + case), os.path.join(OUT, "old_" + case)
        print(f"== {case}")
        rn_all, ro_all = final_launches(new_dir), final_launches(old_dir)
        print("  launches new: " + ", ".join(r["kernel"] for r in rn_all))
        print("  launches old: " + ", ".join(r["kernel"] for r in ro_all))
        for rn, ro in zip(rn_all, ro_all):
            assert rn["kernel"] == ro["kernel"]
            compare_pair(new_dir, rn, old_dir, ro)
        # the old autotune candidates (what the old package could have picked on the H100)
        launches = json.load(open(os.path.join(old_dir, "launches.json")))
        cands = [r for r in launches if r["tag"]]
        if cands:
            print("  old package autotune candidates (REROPE_AUTOTUNE is not read by it):")
            for r in cands:
                try:
                    regs = ptxas_info(read(stem(old_dir, r) + ".ptx"))
                except FileNotFoundError:   # pruned from out/: rerun run_all.sh
                    regs = "(PTX not kept; see compare.txt)"
                print(f"    {r['kernel']:20s} {describe(r)} regs/spill/stack={regs}")


if __name__ == "__main__":
    main()
