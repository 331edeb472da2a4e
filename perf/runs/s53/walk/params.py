# Parameters of every @triton.jit function: python params.py OLD_PKG_DIR NEW_PKG_DIR
import ast, sys, pathlib
def counts(root):
    out = {}
    for p in sorted(pathlib.Path(root).glob("*.py")):
        t = ast.parse(p.read_text())
        for n in ast.walk(t):
            if isinstance(n, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in n.decorator_list):
                a = n.args
                out[n.name] = (p.stem, len(a.args) + len(a.kwonlyargs))
    return out
old = counts(sys.argv[1]); new = counts(sys.argv[2])
for name in sorted(set(old) | set(new), key=lambda k: (new.get(k, old.get(k))[0], k)):
    o = old.get(name); n = new.get(name)
    if (n and n[0] in ("exercises",)) or (o and o[0] in ("exercises", "bench", "bench_decode")): continue
    print(f"{(n or o)[0]:10s} {name:32s} {o[1] if o else '-':>4} -> {n[1] if n else '-':>4}")
