"""The library's modules import each other without a cycle.

Every import of a ``rerope`` module counts, also one inside a function: a function-level import
that closes a circle hides the circle, it does not remove it. The graph is read from the source
(``ast``), nothing is imported.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kernels" / "rerope"


def imports(path, modules):
    """The package modules that the module at ``path`` imports, anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 0 and name.split(".")[0] != "rerope":
                continue
            name = name.removeprefix("rerope").lstrip(".")
            found.update([name.split(".")[0]] if name else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("rerope."))
    return found & modules


def import_graph():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {m: imports(PACKAGE / f"{m}.py", modules) for m in modules}


def cycle(graph):
    """One import cycle of ``graph`` as a list of modules (first repeated last), or ``None``."""
    state = {}                                 # module -> "open" (on the path) or "done"

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert "attention" in graph and "decode" in graph, f"package not found at {PACKAGE}"
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_decode_does_not_import_the_prefill_ops():
    assert "attention" not in import_graph()["decode"]


def test_the_check_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
