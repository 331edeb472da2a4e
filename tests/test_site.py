"""The rendered site: every page of _toc.yml, opened in headless Chromium.

Needs a built book (`jupyter-book build .`, done by `make test`) and Debian's chromium and
chromedriver; skipped with the reason otherwise. One screenshot per page goes to
_build/screenshots/ for review.
"""

import shutil
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


@pytest.mark.parametrize("page", PAGES)
def test_page(browser, page):
    html = HTML / f"{page}.html"
    assert html.is_file(), f"{page} is in _toc.yml but {html} was not built"
    browser.set_window_size(1280, 800)
    browser.get(html.as_uri())

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

    tracebacks = text_of(browser, "div.cell_output .output.traceback")
    assert not tracebacks, f"{page}: a cell output is a traceback:\n{tracebacks[0][:2000]}"
    stderr_errors = [t for t in text_of(browser, "div.cell_output .output.stderr") if "Error" in t]
    assert not stderr_errors, f"{page}: stderr output with an error:\n{stderr_errors[0][:2000]}"
    outputs = "\n".join(text_of(browser, "div.cell_output"))
    assert "Traceback (most recent call last)" not in outputs, f"{page}: a traceback in an output"
