"""The report at atlas scale in a real headless browser: a synthetic store of 100k models
(8 layers each: their own files and the tables; tests/support/synthstore.py), write_report
to a folder, then
index.html and one per-model page opened in headless Chromium (Playwright, the system's
Chromium: no browser download). Checks what a person sees: the title, the distributions
and the top / bottom tables, every image decoded (naturalWidth > 0), no console error or page
error, and the index's size.

Skipped only when Playwright or a Chromium executable is not installed (CI installs both:
the `chromium` Debian package and the `playwright` wheel).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from controller.results.report import ReportSettings, write_report
from esd_worker.core.store.opener import open_store
from tests.support.synthstore import SynthSpec, write_synth_store

# In CI (.ci/run installs both) a missing browser is a failure, not a skip.
IN_CI = os.environ.get("CI") == "true"
if not IN_CI:
    pytest.importorskip("playwright.sync_api",
                        reason="playwright is not installed (pip install playwright)")
from playwright import sync_api  # noqa: E402

MODELS = 100_000
LAYERS = 8
MAX_INDEX_BYTES = 5 * 2**20
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    configured = os.environ.get("ESD_CHROMIUM")
    if configured:
        return configured
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


CHROMIUM = chromium_path()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not IN_CI,
    reason="no Chromium executable (apt-get install chromium, or ESD_CHROMIUM)")

# Every <img> made eager and decoded; naturalWidth of each (0: did not load).
IMAGE_WIDTHS = """async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(async (img) => {
    img.loading = "eager";
    try { await img.decode(); } catch (e) { /* naturalWidth stays 0 */ }
  }));
  return imgs.map((img) => [img.getAttribute("src"), img.naturalWidth]);
}"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("atlas")
    store = open_store(str(root / "results"))
    write_synth_store(store, SynthSpec(models=MODELS, layers=LAYERS, failures=20))
    out = root / "report"
    write_report(ReportSettings(results=str(root / "results"), out=str(out),
                                max_model_plots=5))
    return out


def open_page(browser: object, url: str) -> tuple[object, list[str]]:
    page = browser.new_page()  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url}"))
    page.goto(url, wait_until="load")
    return page, errors


def check_images(page: object) -> int:
    widths = page.evaluate(IMAGE_WIDTHS)  # type: ignore[attr-defined]
    broken = [src for src, width in widths if width <= 0]
    assert not broken, f"images that did not load: {broken[:5]}"
    return len(widths)


def test_report_renders_in_chromium(report: Path) -> None:
    index = report / "index.html"
    size = index.stat().st_size
    print(f"index.html of {MODELS:,} models: {size / 2**20:.2f} MiB")
    assert size < MAX_INDEX_BYTES
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--allow-file-access-from-files"])
        try:
            page, errors = open_page(browser, index.as_uri())
            assert page.title().startswith("ESD report")  # type: ignore[attr-defined]
            headings = page.locator("h2").all_inner_texts()  # type: ignore[attr-defined]
            assert "Distributions" in headings
            assert any(h.startswith("Top") for h in headings), headings
            body = page.inner_text("body")  # type: ignore[attr-defined]
            assert f"{MODELS} models" in body
            assert page.locator("h4", has_text="Top").count() > 0  # type: ignore[attr-defined]
            assert page.locator("h4", has_text="Bottom").count() > 0  # type: ignore[attr-defined]
            assert check_images(page) > 0
            assert not errors, errors
            links = page.locator("a[href$='index.html']")  # type: ignore[attr-defined]
            assert links.count() > 0, "no per-model page linked from the index"
            href = links.first.get_attribute("href")
            model, model_errors = open_page(browser, (report / href).as_uri())
            assert model.locator("h1").count() == 1  # type: ignore[attr-defined]
            check_images(model)
            assert not model_errors, model_errors
        finally:
            browser.close()
