"""The HTML report in a real headless Chromium (Debian's `chromium` + `chromium-driver`,
driven by selenium): the page loads without console errors, every image loads, and a
screenshot lands in the test's folder. Without a browser the check is skipped locally and FAILS
under CI (CI=true): `make test` installs Chromium when it is missing."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def _first(paths) -> str | None:
    return next((p for p in paths if os.path.exists(p)), None)


def _need_browser() -> tuple[str, str]:
    browser = _first(CHROMIUM) or shutil.which("chromium")
    driver = _first(DRIVER) or shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    message = "no Chromium/chromedriver (apt-get install chromium chromium-driver)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}: the report's browser test cannot run in CI")
    pytest.skip(message)


@contextlib.contextmanager
def headless_chrome(profile: Path, *extra: str):
    """A selenium Chrome driver on Debian's headless Chromium (the flags a closed network
    needs), with the browser console's log kept; quit on exit."""
    browser, driver_path = _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,2000",
        *extra,
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def check_report_in_browser(index: Path, screenshot: Path) -> dict:
    """Open `index` (file://) headless; returns what the page reported."""
    profile = screenshot.parent / "chromium-profile"
    with headless_chrome(profile, "--allow-file-access-from-files") as driver:
        driver.get(index.resolve().as_uri())
        state = driver.execute_script(
            "return {ready: document.readyState, title: document.title,"
            " images: Array.from(document.images).map(i => ({src: i.getAttribute('src'),"
            " complete: i.complete, width: i.naturalWidth}))};"
        )
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        driver.save_screenshot(str(screenshot))
    assert state["ready"] == "complete" and state["title"] == "ncl-pipeline report", state
    assert errors == [], errors
    broken = [i["src"] for i in state["images"] if not (i["complete"] and i["width"] > 0)]
    assert state["images"] and broken == [], broken
    assert screenshot.stat().st_size > 10_000
    return state
