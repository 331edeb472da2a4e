"""The book's notebooks as files: structure, stored outputs and provenance.

``pytest --nbval book`` re-runs the notebooks and compares their outputs; these tests check what
nbval does not: every chapter of _toc.yml exists, starts with the shared setup cell
(book/_bootstrap.py, verbatim), stores the outputs of a clean run (figures, no errors, no stderr)
together with where it ran (metadata ``rerope_run``, written by tools/execute_notebooks.py), ends
with exercises, and shows the package's real code (``rerope.source(...)``) rather than a copy.
"""

import json
import re
from pathlib import Path

import pytest
from rerope_testing import toc_pages
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "book" / "_bootstrap.py"
# The chapters that build or explain code print the package's source; 6 (speed) and 11 (the
# extrapolation experiment) are about measurements.
SOURCE_CHAPTERS = {1, 2, 3, 4, 5, 7, 8, 9, 10}


def toc_chapters():
    """The chapter pages of _toc.yml in book order, e.g. 'book/01_rope': every page but the root
    and the appendix's markdown pages (a chapter whose notebook is missing stays listed)."""
    return [page for page in toc_pages()[1:] if not (ROOT / f"{page}.md").is_file()]


CHAPTERS = toc_chapters()
APPENDIX = [page for page in toc_pages()[1:] if (ROOT / f"{page}.md").is_file()]
NUMBERED = [pytest.param(number, page, id=page) for number, page in enumerate(CHAPTERS, 1)]


def load(page):
    path = ROOT / f"{page}.ipynb"
    if not path.is_file():
        pytest.fail(f"{page}.ipynb is listed in _toc.yml but does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def text(value):
    """A notebook string field: stored either as one string or as a list of lines."""
    return "".join(value) if isinstance(value, list) else value


def code_cells(nb):
    return [(index, cell) for index, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"]


def outputs(nb):
    return [(index, output) for index, cell in code_cells(nb) for output in cell.get("outputs", [])]


def test_toc_lists_the_chapters():
    """At least the six chapters that build the kernel, numbered 01, 02, … in _toc.yml order."""
    numbers = [int(Path(page).name[:2]) for page in CHAPTERS]
    assert len(CHAPTERS) >= 6 and numbers == list(range(1, len(CHAPTERS) + 1)), (
        f"_toc.yml lists {CHAPTERS}")


def test_appendix_follows_the_chapters():
    """Markdown pages (the appendix, e.g. book/measurements) come after the last chapter."""
    assert toc_pages()[1:] == CHAPTERS + APPENDIX, f"_toc.yml lists {toc_pages()}"


@pytest.mark.parametrize("page", CHAPTERS)
def test_notebook_exists(page):
    assert (ROOT / f"{page}.ipynb").is_file(), f"{page}.ipynb is listed in _toc.yml but missing"


@pytest.mark.parametrize("number, page", NUMBERED)
def test_title_and_kernelspec(number, page):
    nb = load(page)
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown", f"{page}: the first cell must be the title (markdown)"
    assert text(first["source"]).startswith(f"# {number}. "), (
        f"{page}: the first cell must start with the title '# {number}. ...'")
    spec = nb["metadata"].get("kernelspec", {})
    assert spec.get("name") == "python3" and spec.get("language") == "python", (
        f"{page}: kernelspec must be python3, got {spec}")


@pytest.mark.parametrize("page", CHAPTERS)
def test_first_code_cell_is_the_bootstrap(page):
    nb = load(page)
    cells = code_cells(nb)
    assert cells, f"{page}: no code cell"
    index, cell = cells[0]
    want = BOOTSTRAP.read_text(encoding="utf-8").rstrip("\n")
    assert text(cell["source"]).rstrip("\n") == want, (
        f"{page}: cell {index} must be book/_bootstrap.py verbatim")
    tags = cell.get("metadata", {}).get("tags", [])
    assert "nbval-ignore-output" in tags, (
        f"{page}: the setup cell prints CPU vs GPU; tag it nbval-ignore-output (tags: {tags})")
    assert "hide-cell" in tags, (
        f"{page}: tag the setup cell hide-cell, so that the page opens with its content "
        f"(tags: {tags})")


def test_bootstrap_repository_matches_config():
    source = BOOTSTRAP.read_text(encoding="utf-8")
    match = re.search(r'^REPO_URL,\s*REPO_REF\s*=\s*"([^"]+)",\s*"([^"]+)"', source, flags=re.M)
    assert match, "book/_bootstrap.py must set REPO_URL, REPO_REF = \"...\", \"...\""
    repository = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    assert match.group(1) == repository["url"], (
        f"REPO_URL {match.group(1)} != repository.url {repository['url']} in _config.yml")
    assert match.group(2) == repository["branch"], (
        f"REPO_REF {match.group(2)} != repository.branch {repository['branch']} in _config.yml")


@pytest.mark.parametrize("page", CHAPTERS)
def test_has_a_stored_figure(page):
    nb = load(page)
    assert any("image/png" in output.get("data", {}) for _, output in outputs(nb)), (
        f"{page}: no image/png output stored (execute it: python tools/execute_notebooks.py)")


@pytest.mark.parametrize("page", CHAPTERS)
def test_no_stored_errors(page):
    nb = load(page)
    errors = [f"cell {index}: {output.get('ename')}: {output.get('evalue')}"
              for index, output in outputs(nb) if output["output_type"] == "error"]
    assert not errors, f"{page} stores error outputs:\n" + "\n".join(errors)


@pytest.mark.parametrize("page", CHAPTERS)
def test_no_stored_stderr(page):
    nb = load(page)
    stderr = [f"cell {index}: {text(output['text'])[:200]!r}" for index, output in outputs(nb)
              if output["output_type"] == "stream" and output.get("name") == "stderr"]
    assert not stderr, (f"{page} stores stderr output (nbval compares it; silence it):\n"
                        + "\n".join(stderr))


@pytest.mark.parametrize("page", CHAPTERS)
def test_run_provenance(page):
    nb = load(page)
    run = nb["metadata"].get("rerope_run")
    assert isinstance(run, dict), (
        f"{page}: no metadata 'rerope_run'; execute it with python tools/execute_notebooks.py")
    assert isinstance(run.get("device"), str) and run["device"].strip(), (
        f"{page}: rerope_run has no device name: {run}")
    missing = {"torch", "triton", "python", "date", "seconds"} - set(run)
    assert not missing, f"{page}: rerope_run lacks {sorted(missing)}"


@pytest.mark.parametrize("page", CHAPTERS)
def test_has_exercises(page):
    nb = load(page)
    headings = [line for cell in nb["cells"] if cell["cell_type"] == "markdown"
                for line in text(cell["source"]).splitlines()]
    assert any(re.match(r"#+\s+Exercises\b", line) for line in headings), (
        f"{page}: no 'Exercises' heading")


@pytest.mark.parametrize("page", CHAPTERS)
def test_exercise_solutions_are_hidden_and_checked(page):
    """Every solution cell (a code cell right after an answer cell that defines the same thing)
    is collapsed on the site (hide-input / hide-cell) and compared by nbval (no ignore tag)."""
    nb = load(page)
    cells = nb["cells"]
    for index, cell in enumerate(cells[1:], 1):
        previous = cells[index - 1]
        if cell["cell_type"] != "code" or previous["cell_type"] != "code":
            continue
        if not text(previous["source"]).lstrip().startswith("# Your answer"):
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        assert {"hide-input", "hide-cell"} & set(tags), (
            f"{page}: cell {index} follows an answer cell but is not hidden (tags: {tags})")
        assert not {"nbval-ignore-output", "nbval-skip"} & set(tags), (
            f"{page}: solution cell {index} must be checked by nbval (tags: {tags})")
        assert "correct" in "".join(text(o.get("text", "")) for o in cell.get("outputs", [])), (
            f"{page}: solution cell {index} does not print the checker's 'correct'")


@pytest.mark.parametrize("page", [p for p in CHAPTERS if int(Path(p).name[:2]) >= 3])
def test_has_a_triton_exercise(page):
    """From chapter 3 on, an exercise asks for Triton code and a rerope.exercises checker runs it."""
    nb = load(page)
    sources = [text(cell["source"]) for _, cell in code_cells(nb)]
    assert any("@triton.jit" in s and "exercises.check_" in s for s in sources), (
        f"{page}: no Triton exercise (a @triton.jit answer passed to a rerope.exercises checker)")


@pytest.mark.parametrize("number, page", [p for p in NUMBERED if p.values[0] in SOURCE_CHAPTERS])
def test_shows_package_source(number, page):
    nb = load(page)
    assert any("rerope.source(" in text(cell["source"]) for _, cell in code_cells(nb)), (
        f"{page} (chapter {number}) never shows the package's code with rerope.source(...)")


# The modules whose functions the book prints with rerope.source(...), into boxes about 96
# characters wide on the site: a wider line wraps there and breaks the listing's indentation.
LISTING_WIDTH = 96
LISTED_MODULES = ["attention", "launch", "rotary", "forward", "backward", "decode", "varlen",
                  "online_softmax", "regions", "reference", "rope", "configs", "runtime"]
LISTED_FILES = ([ROOT / "kernels" / "rerope" / f"{name}.py" for name in LISTED_MODULES]
                + sorted((ROOT / "kernels" / "rerope" / "teach").glob("*.py")))


@pytest.mark.parametrize("path", LISTED_FILES, ids=lambda path: path.name)
def test_listed_modules_fit_the_page(path):
    """Every line of a module the book lists is at most 96 characters (not bytes: ``⌊i/G⌋``)."""
    wide = [f"{path.relative_to(ROOT)}:{number} ({len(line)} characters)"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > LISTING_WIDTH]
    assert not wide, f"lines wider than {LISTING_WIDTH} characters: " + ", ".join(wide)


# The stored listings themselves (issue 35): a cell that prints source (``rerope.source(...)``,
# ``Code(...)``) stores it as text; at most 88 characters a line, nothing wraps on the site.
STORED_LISTING_WIDTH = 88
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_stored_listings_fit_88_columns(path):
    """Every line of the stored text/plain (or stream) outputs of a code cell that calls
    ``source(`` or ``Code(`` is at most 88 characters (not bytes)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    wide = []
    for index, cell in code_cells(nb):
        source = text(cell["source"])
        if "source(" not in source and "Code(" not in source:
            continue
        for output in cell.get("outputs", []):
            stored = text(output.get("data", {}).get("text/plain") or output.get("text") or "")
            wide += [f"cell {cell.get('id', index)}: a line of {len(line)} characters: "
                     f"{line.strip()[:60]!r}"
                     for line in stored.splitlines() if len(line) > STORED_LISTING_WIDTH]
    assert not wide, (f"{path.relative_to(ROOT)}: stored listings wider than "
                      f"{STORED_LISTING_WIDTH} characters:\n" + "\n".join(wide))


# --- numbers in the prose, against the data files they describe ---------------------------------

DATA = ROOT / "book" / "data"


def markdown(page):
    return "\n".join(text(cell["source"]) for cell in load(page)["cells"]
                     if cell["cell_type"] == "markdown")


def _bench_ms(impl, n, d, mode="fwd"):
    rows = json.loads((DATA / "bench_h200.json").read_text())["rows"]
    found = [r["ms"] for r in rows if r["impl"] == impl and r["N"] == n and r["D"] == d
             and r["mode"] == mode and r["dtype"] == "float16" and r["causal"]
             and (r["B"], r["H"], r["window"]) == (1, 32, 2048) and r["ms"] is not None]
    return found[0]


def _cost_range(d):
    """Chapter 11's 'price': ReRoPE forward over cuDNN plain attention, N from 4k to 32k."""
    ratios = [_bench_ms("rerope", n, d) / _bench_ms("sdpa_cudnn", n, d)
              for n in (4096, 8192, 16384, 32768)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def _extrapolation():
    return json.loads((DATA / "extrapolation_h200.json").read_text())


def _mean(key, n):
    return f"{_extrapolation()['methods'][key]['mean'][str(n)]:.3f}"


def _best_ablation_window():
    ablation = _extrapolation()["window_ablation"]
    longest = max(ablation["lengths"])
    return str(min(ablation["windows"], key=lambda w: ablation["rerope"][str(w)]["mean"][str(longest)]))


def _hf(impl, phase, field="ms", model="llama3.2-1b-shape"):
    rows = json.loads((DATA / "hf_h200.json").read_text())["rows"]
    return next(r[field] for r in rows if (r["impl"], r["phase"]) == (impl, phase)
                and r.get("model", model) == model)


def _attention_share(impl):
    return f"{_hf(impl, 'decode', 'attention_ms') / _hf(impl, 'decode'):.0%}".replace("%", " %")


def _smollm2(key, n, file="smollm2_h200.json"):
    return f"{json.loads((DATA / file).read_text())['methods'][key]['loss'][str(n)]:.3f}"


def _self_extend(key, n):
    return _smollm2(key, n, "smollm2_self_extend_h200.json")


def _step(name, **where):
    """One entry's value of book/data/production_steps.json (chapter 9's steps)."""
    steps = json.loads((DATA / "production_steps.json").read_text())["steps"][name]
    (entry,) = [e for e in steps if all(e.get(k) == v for k, v in where.items())]
    return entry["value"]


def _span(values, form=""):
    return f"{values[0]:{form}}–{values[1]:{form}}"


def _host_cut():
    """Chapter 9's summary: the cuts of host time per call (medians), as a range."""
    runs = json.loads((DATA / "host_h200.json").read_text())["meta"]["before_after"]
    cuts = [1 - runs[k]["after_median"] / runs[k]["before_median"]
            for k in ("rerope_fwd", "rerope_decode", "rerope_fwd_bwd")]
    return f"{100 * min(cuts):.0f}–{100 * max(cuts):.0f} %"


PROSE_NUMBERS = [
    ("book/09_production", "the forward went from {} to {} ms",
     lambda: (_step("configs", variant="v1"), _step("configs", variant="v2"))),
    ("book/09_production", "spilled {} KB",
     lambda: _span(_step("fused_rotation", unit="KB"))),
    ("book/09_production", "sat at {} registers",
     lambda: _step("fused_rotation", unit="registers")),
    ("book/09_production", "It took {} % off a step",
     lambda: _span(_step("fused_merge", variant="summary"))),
    ("book/09_production", "host time per call down {} (medians)", _host_cut),
    ("book/09_production", "16-key pages from about two thirds to {} of",
     lambda: _span(_step("paged_pages", D=128, page=16, variant="scalars"), ".2f")),
    # (page, a template whose {} holds the number, how the number comes from the data)
    ("book/06_speed", "headline\ntable's {}", lambda: f"{_bench_ms('sdpa_cudnn', 8192, 64) / _bench_ms('rerope', 8192, 64):.2f}"),
    ("book/10_huggingface", "the attention op is {} of\nReRoPE's step", lambda: _attention_share("rerope")),
    ("book/10_huggingface", "and {} of FlashAttention-2's", lambda: _attention_share("stock_sdpa_flash")),
    ("book/10_huggingface", "and {} ms now, in the same run", lambda: f"{_hf('rerope', 'decode'):.2f}"),
    ("book/11_extrapolation", "takes {} plain\nattention's time at D = 64", lambda: _cost_range(64)),
    ("book/11_extrapolation", "and {} at D = 128", lambda: _cost_range(128)),
    ("book/11_extrapolation", "makes RoPE worse ({}", lambda: f"{_mean('rope', 4096)} → {_mean('rope+logn', 4096)}"),
    ("book/11_extrapolation", "slightly worse ({})", lambda: f"{_mean('ntk', 4096)} → {_mean('ntk+logn', 4096)}"),
    ("book/11_extrapolation", "Here it is {} of 256 in the window ablation", _best_ablation_window),
    ("book/11_extrapolation", "the best window is {} at every length", _best_ablation_window),
    ("book/11_extrapolation", "goes from 0.926 at 1× to {} at 2× and", lambda: _mean("rope", 512)),
    ("book/11_extrapolation", "at 2× and {} at 16×", lambda: _mean("rope", 4096)),
    ("book/11_extrapolation", "the mean loss *falls* from {} at 1×", lambda: _mean("rerope128", 256)),
    ("book/11_extrapolation", "at 16× it is {} ({} with log-n)", lambda: (_mean("rerope128", 4096), _mean("rerope128+logn", 4096))),
    ("book/11_extrapolation", "drifts up to {} at 16×", lambda: _mean("rerope256", 4096)),
    ("book/12_real_model", "at\n64k **{}** for $w = 2048$ against {} for ReRoPE", lambda: (_self_extend("selfextend2048", 65536), _self_extend("rerope2048", 65536))),
    ("book/12_real_model", "{} for $w = 1024$ against ReRoPE's {}", lambda: (_self_extend("selfextend1024", 65536), _smollm2("rerope1024", 65536))),
    ("book/12_real_model", "log-n the Self-Extend rows, {} and {}, tie Leaky ReRoPE's {}", lambda: (_self_extend("selfextend1024+logn", 65536), _self_extend("selfextend2048+logn", 65536), _smollm2("leaky2048+logn", 65536))),
    ("book/12_real_model", "give the same mean loss ({})", lambda: _smollm2("leaky2048", 65536)),
    ("book/12_real_model", "does a little better ({}\nagainst {}", lambda: (_self_extend("selfextend2048", 16384), _smollm2("leaky2048", 16384))),
    ("book/11_extrapolation", "$L \\le w + \\kappa (T - w) = {}$", lambda: f"{512 + 16 * (4096 - 512):,}".replace(",", "\\,")),
]


@pytest.mark.parametrize("page, template, value", PROSE_NUMBERS,
                         ids=[f"{page}: {template[:40]}" for page, template, _ in PROSE_NUMBERS])
def test_prose_numbers_match_data(page, template, value):
    """A number quoted in a chapter's text is the one its data file gives (so text and tables
    cannot drift apart again)."""
    got = value()
    expected = template.format(*(got if isinstance(got, tuple) else (got,)))
    prose = markdown(page)
    flat = " ".join(prose.split())
    assert expected in prose or " ".join(expected.split()) in flat, (
        f"{page}: the text should say {expected!r} (from book/data), and does not")


@pytest.mark.parametrize("page", CHAPTERS)
def test_every_checker_has_wrong_answers(page):
    """Each checker a chapter defines (``def check_exercise_N``) is tested on plausible wrong
    answers in the same notebook (a cell calling ``exercises.assert_rejected``, run by nbval and
    removed from the site); the checkers of rerope.exercises have theirs in
    tests/test_exercises.py."""
    sources = [text(cell["source"]) for _, cell in code_cells(load(page))]
    for name in sorted({m for s in sources for m in re.findall(r"^def (check_exercise_\d+)\(", s,
                                                                   flags=re.M)}):
        tests = [(i, s) for i, (_, cell) in enumerate(code_cells(load(page)))
                 for s in [text(cell["source"])] if f"assert_rejected({name}," in s]
        assert tests, f"{page}: {name} has no wrong-answer test (exercises.assert_rejected)"
        for index, _ in tests:
            tags = code_cells(load(page))[index][1].get("metadata", {}).get("tags", [])
            assert "remove-cell" in tags and not {"nbval-skip", "nbval-ignore-output"} & set(tags), (
                f"{page}: the wrong-answer test of {name} must be checked by nbval and left out "
                f"of the site (tags: {tags})")
