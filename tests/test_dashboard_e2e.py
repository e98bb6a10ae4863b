"""The web dashboard in a real browser (Playwright driving Debian's chromium, headless):
it shows the nodes and the instance's ranks, chats with live tokens/s, and shows why a
placement is refused."""

from __future__ import annotations

import shutil

import httpx
import pytest
from conftest import CAPITAL_QUESTION, placed

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (scripts/test.sh installs Debian's as root)")
    with sync_api.sync_playwright() as playwright:
        # Flags as this sandbox needs them: no sandbox as root, no background connections.
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield browser
        browser.close()


def test_the_dashboard_shows_the_cluster_and_chats(cluster3, browser):
    page = browser.new_page()
    page.goto(cluster3.url(1) + "/", wait_until="domcontentloaded")
    page.wait_for_selector(".node .id")
    ids = sorted(httpx.get(f"{cluster3.url(0)}/cluster/nodes", timeout=10).json()["nodes"], key=lambda n: n["node_id"])
    assert page.locator(".node").count() == 3
    assert page.locator(".badge.coord").count() == 1
    assert ids[0]["node_id"] in page.locator(".badge.coord").locator("xpath=..").inner_text()
    # memory as `shardline nodes` gives it: free of what the node offers
    card = page.locator(f'.node[data-node="{ids[0]["node_id"]}"]').inner_text()
    assert f"{ids[0]['offered_bytes'] / 1e9:.2f} GB offered" in card, card
    instance = httpx.get(f"{cluster3.url(0)}/cluster/instances", timeout=10).json()["instances"][0]
    row = page.locator(f'tr[data-instance="{instance["instance_id"]}"]')
    row.wait_for()
    assert row.locator(".badge.ready").count() == 1 + 3  # the instance and its 3 ranks

    page.wait_for_function("document.querySelector('#chat-model').value !== ''")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", CAPITAL_QUESTION)
    page.click("#chat-send")
    page.wait_for_function(
        "document.querySelector('#chat-send').disabled === false "
        "&& document.querySelectorAll('.msg.assistant').length === 1 "
        "&& document.querySelector('.msg.assistant').textContent.length > 0",
        timeout=60_000,
    )
    assert "Paris" in page.locator(".msg.assistant").inner_text()
    assert page.locator(".msg.error").count() == 0
    assert "tokens/s" in page.locator("#chat-stats").inner_text()
    # the instance's prefix cache as this node's rank reports it, the chat's prompt counted
    # (a prompt this short is not kept: its one chunk is not computed as a whole chunk is)
    page.wait_for_function(
        f"""document.querySelector('tr[data-instance="{instance["instance_id"]}"] .cache')
                               .textContent.includes(' of 0 prompt') === false""",
        timeout=10_000,
    )
    cache = row.locator(".cache").inner_text()
    assert cache.startswith("prefix cache:") and "prompt tokens cached" in cache, cache
    page.close()


def test_a_refused_placement_says_why(cluster1, browser):
    page = browser.new_page()
    page.goto(cluster1.url(0) + "/", wait_until="domcontentloaded")
    page.wait_for_function("document.querySelector('#place-model').options.length > 0")
    before = placed(cluster1.url(0))
    page.select_option("#place-sharding", "ring")
    page.click("#place")
    page.wait_for_function("document.querySelector('#place-status').textContent.includes('at least 2 nodes')")
    assert placed(cluster1.url(0)) == before
    page.close()


def test_the_place_form_offers_every_sharding():
    """auto and each sharding placement takes (expert too: a mixture-of-experts model's
    whole experts a rank; the form offered the first four only)."""
    import re
    from pathlib import Path

    import shardline.api
    from shardline.placement.ranks import SHARDING_NAMES

    html = (Path(shardline.api.__file__).parent / "static" / "dashboard.html").read_text()
    select = html.split('id="place-sharding"', 1)[1].split("</select>", 1)[0]
    assert re.findall(r"<option>(\w+)</option>", select) == ["auto", *SHARDING_NAMES]
