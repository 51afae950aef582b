"""A real headless chromium for the report page's tests: the system's browser (Debian's
``chromium``), driven by Playwright, which downloads nothing when given the binary to run.

The page is opened from its file with the browser context offline and every request that is not
the file itself refused and recorded, so a page that needed the network shows it. Console errors
and uncaught exceptions are collected. Where no chromium is installed (or Playwright), the test is
skipped with one line that says what to install (``make browser`` does it on Debian).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ENV = "TAILOR_CHROMIUM"  # a chromium binary to use instead of the one on PATH
NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium() -> str | None:
    """The browser binary: ``$TAILOR_CHROMIUM``, else the first chromium on PATH."""
    given = os.environ.get(CHROMIUM_ENV)
    if given:
        return given
    return next((found for name in NAMES if (found := shutil.which(name))), None)


@dataclass
class Seen:
    """What the page did while it was open: console errors, page errors, and requests refused."""

    page: Any
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def evaluate(self, script: str) -> Any:
        return self.page.evaluate(script)


@contextmanager
def open_page(path: Path, *, screenshot: Path | None = None, timeout_s: float = 60.0) -> Iterator[Seen]:
    """The page at ``path`` loaded offline and drawn (its script sets ``body[data-rendered]``)."""
    binary = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        binary = None
    if binary is None:
        pytest.skip(f"no chromium and Playwright here: apt-get install chromium (or set ${CHROMIUM_ENV}); make install")
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900}, offline=True)
            page = context.new_page()
            seen = Seen(page)
            page.on("console", lambda m: seen.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen.errors.append(f"uncaught: {e}"))
            own = path.resolve().as_uri()

            def only_the_file(route: Any) -> None:
                if route.request.url == own:
                    route.continue_()
                else:
                    seen.requests.append(route.request.url)
                    route.abort()

            context.route("**/*", only_the_file)
            page.goto(own)
            page.wait_for_function("document.body.dataset.rendered === 'yes'", timeout=timeout_s * 1000)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
            yield seen
        finally:
            browser.close()
