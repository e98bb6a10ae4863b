"""The dashboard's screenshots in docs/img/ (docs/dashboard.md), taken of a real cluster:
3 local nodes serving the default model, a chat answer with its token heat map, a preview
with a placement chosen, and a node killed.

    .venv/bin/python scripts/dashboard_screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

Desktop views at 1400x900, phone views at 390x844, in the dark scheme. Needs Playwright
and Debian's chromium, as tests/test_dashboard_e2e.py does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

QUESTION = "What is the name of the capital of France?"
DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    from conftest import start_cluster
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(3, tmp)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
                shoot(browser, cluster, out)
                browser.close()
        finally:
            cluster.stop()


def opened(browser, url: str, viewport: dict):
    page = browser.new_page(viewport=viewport, color_scheme="dark")
    page.goto(url + "/", wait_until="domcontentloaded")
    page.wait_for_selector(".instance .inst-head .badge.ready")
    page.wait_for_function("document.querySelectorAll('#edges line.edge').length === 3", timeout=30_000)
    return page


def ask(page) -> None:
    page.wait_for_function("document.querySelector('#chat-model').value !== ''")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "40")
    page.fill("#chat-system", "Answer in one sentence.")
    page.check("#chat-logprobs")
    page.fill("#chat-input", QUESTION)
    page.press("#chat-input", "Enter")
    page.wait_for_function(
        "!document.querySelector('#chat-send').disabled && document.querySelector('.msg.assistant .meta')"
        ".textContent.includes('tokens/s')",
        timeout=60_000,
    )


def at(page, selector: str, path: Path) -> None:
    page.evaluate(f"document.querySelector('{selector}').scrollIntoView({{block: 'start'}})")
    page.wait_for_timeout(400)
    page.screenshot(path=str(path))
    print(path, path.stat().st_size // 1024, "KB")


def shoot(browser, cluster, out: Path) -> None:
    url = cluster.url(0)
    page = opened(browser, url, DESKTOP)
    ask(page)
    page.wait_for_timeout(2500)  # the instance's measured speed and prefix cache polled
    at(page, "body", out / "dashboard-cluster.png")
    page.select_option("#place-sharding", "pipeline")
    page.fill("#place-context", "2048")
    page.fill("#place-max-batch", "4")
    page.click("#place-preview")
    choice = page.locator(".cand").filter(has_text="on 2 nodes").first
    choice.wait_for()
    choice.click()
    at(page, "#placing", out / "dashboard-place.png")
    page.close()

    phone = opened(browser, url, PHONE)
    at(phone, "body", out / "dashboard-phone-topology.png")
    ask(phone)
    at(phone, "#chat", out / "dashboard-phone-chat.png")
    at(phone, "#connect", out / "dashboard-phone-connect.png")
    phone.close()

    page = opened(browser, url, DESKTOP)
    cluster.procs[2].kill()
    page.wait_for_selector(".node.down", timeout=20_000)
    page.wait_for_selector(".instance[data-replaced] .inst-head .badge.ready", timeout=60_000)
    time.sleep(2.5)
    at(page, "body", out / "dashboard-node-down.png")
    page.close()


if __name__ == "__main__":
    main()
