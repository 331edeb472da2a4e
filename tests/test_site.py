"""The rendered site: every page of _toc.yml, opened in headless Chromium.

Needs a built book (`jupyter-book build .`, done by `make test`) and Debian's chromium and
chromedriver; skipped with the reason otherwise. One screenshot per page goes to
_build/screenshots/ for review. Chromium runs with no network, so the formulas checked here are
rendered by the MathJax copy inside the site (sphinx-mathjax-offline), as a reader offline sees them.
"""

import json
import shutil
import time
import tempfile
from pathlib import Path

import pytest
from rerope_testing import toc_pages

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # This machine's network is closed: without these Chromium keeps dialling out.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
]

pytestmark = [
    pytest.mark.skipif(
        not (HTML / "index.html").is_file(),
        reason=f"no built site at {HTML}: run `jupyter-book build .` (make test does)",
    ),
    pytest.mark.skipif(
        not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
        reason=f"needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver",
    ),
]


PAGES = toc_pages()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="site-test-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def text_of(driver, css):
    return [el.get_attribute("textContent") for el in driver.find_elements("css selector", css)]


# Formulas on the page (MyST puts each in a span/div of class "math") and those MathJax has
# typeset (one mjx-container each).
COUNT_MATH = "return document.querySelectorAll('span.math, div.math').length"
COUNT_TYPESET = "return document.querySelectorAll('.math mjx-container, mjx-container').length"
# The visible prose, without code: raw TeX delimiters left in it mean MathJax did not run.
VISIBLE_PROSE = """
const main = document.querySelector('main') || document.body;
const copy = main.cloneNode(true);
copy.querySelectorAll('pre, code, script, style, .cell_input, .cell_output').forEach(e => e.remove());
return copy.innerText;
"""


def wait_for_mathjax(driver, timeout=60):
    """Until every formula of the page is typeset (or the timeout): the number typeset."""
    wanted = driver.execute_script(COUNT_MATH)
    deadline = time.monotonic() + timeout
    while driver.execute_script(COUNT_TYPESET) < wanted and time.monotonic() < deadline:
        time.sleep(0.25)
    return wanted, driver.execute_script(COUNT_TYPESET)


@pytest.mark.parametrize("page", PAGES)
def test_page(browser, page):
    html = HTML / f"{page}.html"
    assert html.is_file(), f"{page} is in _toc.yml but {html} was not built"
    browser.set_window_size(1280, 800)
    browser.get(html.as_uri())
    formulas, typeset = wait_for_mathjax(browser)

    # Screenshot first, so a failing page can still be looked at: the window grows to fit
    # the whole page (capped at 8000 px).
    height = browser.execute_script(
        "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight"
    )
    browser.set_window_size(1280, max(800, min(int(height), 8000)))
    browser.save_screenshot(str(SHOTS / f"{page.replace('/', '__')}.png"))

    titles = [t.replace("#", "").replace("\u00b6", "").strip() for t in text_of(browser, "h1")]
    assert titles and titles[0], f"{page}: no h1 title"

    if (ROOT / f"{page}.ipynb").is_file():
        assert browser.find_elements("css selector", "div.cell .cell_input"), (
            f"{page}: a notebook page with no code cell"
        )
        figures = browser.find_elements("css selector", "div.cell_output img")
        assert figures, f"{page}: no figure rendered from a cell output"
        broken = [
            img.get_attribute("src")
            for img in figures
            if not browser.execute_script("return arguments[0].naturalWidth > 0", img)
        ]
        assert not broken, f"{page}: figures that do not load: {broken}"

        # where the outputs came from, near the top (tools/book_provenance.py)
        run = json.loads((ROOT / f"{page}.ipynb").read_text(encoding="utf-8"))["metadata"]["rerope_run"]
        lines = text_of(browser, "p.rerope-run")
        assert lines, f"{page}: no provenance line (p.rerope-run) under the title"
        for value in (run["device"], run["torch"], run["triton"]):
            assert value in lines[0], f"{page}: provenance line {lines[0]!r} lacks {value!r}"
        before_cells = browser.execute_script(
            "const p = document.querySelector('p.rerope-run'),"
            " c = document.querySelector('div.cell');"
            " return !!c && !!(p.compareDocumentPosition(c) & Node.DOCUMENT_POSITION_FOLLOWING);")
        assert before_cells, f"{page}: the provenance line must come before the first cell"

        # the setup cell (the first code cell) is collapsed: its source is not on screen
        first = browser.find_elements("css selector", "div.cell")[0]
        assert "tag_hide-cell" in first.get_attribute("class"), (
            f"{page}: the first cell (setup) is not tagged hide-cell")
        assert not first.find_element("css selector", ".cell_input").is_displayed(), (
            f"{page}: the setup cell's source is shown; it should be collapsed")

    assert "mathjax/tex-chtml.js" in browser.page_source and (HTML / "_static" / "mathjax"
                                                              / "tex-chtml.js").is_file(), (
        f"{page}: MathJax is not loaded from the site's own copy (_static/mathjax)")
    assert typeset >= formulas, (
        f"{page}: {formulas} formulas, only {typeset} typeset by MathJax (mjx-container)")
    prose = browser.execute_script(VISIBLE_PROSE)
    for delimiter in ("\\(", "\\)", "\\[", "$$"):
        assert delimiter not in prose, (
            f"{page}: raw TeX {delimiter!r} in the visible text: "
            f"{prose[max(0, prose.index(delimiter) - 80):prose.index(delimiter) + 80]!r}")

    tracebacks = text_of(browser, "div.cell_output .output.traceback")
    assert not tracebacks, f"{page}: a cell output is a traceback:\n{tracebacks[0][:2000]}"
    stderr_errors = [t for t in text_of(browser, "div.cell_output .output.stderr") if "Error" in t]
    assert not stderr_errors, f"{page}: stderr output with an error:\n{stderr_errors[0][:2000]}"
    outputs = "\n".join(text_of(browser, "div.cell_output"))
    assert "Traceback (most recent call last)" not in outputs, f"{page}: a traceback in an output"

    # nothing cut off behind a scroll bar at 1280 px: outputs wrap (tools/site_static/book.css)
    # and the code of the cells, written to 100 columns, fits the article column
    browser.set_window_size(1280, 800)
    clipped = browser.execute_script(
        "return Array.from(document.querySelectorAll('div.cell_output pre, div.cell_input pre'))"
        ".filter(p => p.offsetParent !== null && p.scrollWidth > p.clientWidth + 2)"
        ".map(p => p.textContent.split('\\n').reduce((a, b) => a.length >= b.length ? a : b))")
    assert not clipped, (f"{page}: {len(clipped)} code/output block(s) wider than the column, "
                         f"e.g. {clipped[0][:120]!r}")
