"""The web dashboard in a real browser (Playwright driving Debian's chromium, headless): it
draws the nodes and their links, each instance over the nodes it uses rank by rank, places
a model from a chosen preview, chats with TTFT and live tokens/s, shows the settings
``shardline connect`` prints, greys a node that dies, and shows why a placement is refused;
with no error in the browser's console."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from conftest import CAPITAL_QUESTION, local_cluster, placed, wait_until

from shardline.connect import CLIENTS, connection

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LINK_LABEL = re.compile(r"^\d+\.\d\d ms · \d+ MB/s$")


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


def watched(browser, width: int = 1400, height: int = 900):
    """A page of ``width`` x ``height`` and the list its console errors and uncaught
    exceptions are collected in."""
    page = browser.new_page(viewport={"width": width, "height": height})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    return page, problems


def rank_share(rank: dict) -> str:
    """A rank's share as the page writes it (layers, or heads)."""
    share = rank.get("tensor_share")
    if share:
        return f"heads {share['heads'][0]}–{share['heads'][1] - 1}"
    return f"layers {rank['layer_start']}–{rank['layer_end'] - 1}"


def test_the_dashboard_draws_the_cluster_chats_and_connects(cluster3, browser):
    url = cluster3.url(1)
    page, problems = watched(browser)
    page.goto(url + "/", wait_until="domcontentloaded")
    page.wait_for_selector(".node .name")
    view = httpx.get(f"{url}/cluster/nodes", timeout=10).json()
    nodes = view["nodes"]
    assert page.locator(".node").count() == 3
    # the coordinator marked, and the node this page came from
    assert page.locator(".node.coord").count() == page.locator(".node .badge.coord").count() == 1
    assert page.locator(".node.coord").get_attribute("data-node") == view["coordinator"]
    assert page.locator(f'.node[data-node="{view["node_id"]}"] .badge.self').count() == 1
    # memory as `shardline nodes` gives it: free of what the node offers
    card = page.locator(f'.node[data-node="{nodes[0]["node_id"]}"]').inner_text()
    assert f"{nodes[0]['offered_bytes'] / 1e9:.2f} GB offered" in card, card
    # the links: an edge for each pair, labelled with latency and bandwidth
    page.wait_for_function("document.querySelectorAll('#edges line.edge').length === 3", timeout=30_000)
    labels = page.locator(".edge-label").all_inner_texts()
    assert len(labels) == 3 and all(LINK_LABEL.match(t) for t in labels), labels

    instance = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"][0]
    card = page.locator(f'.instance[data-instance="{instance["instance_id"]}"]')
    card.wait_for()
    assert card.locator(".badge.ready").count() == 1 + 3  # the instance and its 3 ranks
    rows = card.locator("tr[data-rank]")
    assert [rows.nth(k).get_attribute("data-node") for k in range(3)] == [r["node_id"] for r in instance["ranks"]]
    assert rows.locator(".share").all_inner_texts() == [rank_share(r) for r in instance["ranks"]]
    assert "weights" in rows.first.locator(".mem").inner_text()
    assert "predicted" in card.locator(".speed").inner_text()
    # each node holds its rank: drawn on the node's card
    for k, rank in enumerate(instance["ranks"]):
        holds = page.locator(f'.node[data-node="{rank["node_id"]}"] .holds').inner_text()
        assert f"r{k}/3" in holds and rank_share(rank) in holds, holds
    # the instance's path through its nodes
    assert page.locator(f'#edges line.inst-path[data-instance="{instance["instance_id"]}"]').count() == 2

    chat(page, instance["instance_id"])
    connects(page, url)
    assert problems == []
    page.close()


def chat(page, instance_id: str) -> None:
    """A chat with the heat map on: the answer streams, TTFT, tokens/s and the instance
    shown, and the instance's prefix cache counts the prompt."""
    page.wait_for_function("document.querySelector('#chat-model').value !== ''")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-system", "Answer in one sentence.")
    page.check("#chat-logprobs")
    page.fill("#chat-input", CAPITAL_QUESTION)
    page.press("#chat-input", "Enter")
    page.wait_for_function(
        "document.querySelector('#chat-send').disabled === false "
        "&& document.querySelectorAll('.msg.assistant').length === 1 "
        "&& document.querySelector('.msg.assistant .text').textContent.length > 0",
        timeout=60_000,
    )
    assert "Paris" in page.locator(".msg.assistant .text").inner_text()
    assert page.locator(".msg.error").count() == 0
    assert page.locator(".msg.assistant .tok").count() > 0  # a token's probability as its colour
    stats = page.locator("#chat-stats").inner_text()
    assert "TTFT" in stats and "tokens/s" in stats, stats
    answered = re.search(r"instance (\w+) \(pipeline3", stats)  # its stream's system_fingerprint
    assert answered and answered.group(1) in {i["instance_id"] for i in placed(page.url.rstrip("/"))}, stats
    assert page.locator(".msg.assistant .meta").inner_text() == stats
    # the instance's prefix cache as this node's rank reports it, the chat's prompt counted
    # (a prompt this short is not kept: its one chunk is not computed as a whole chunk is)
    cache = page.locator(f'.instance[data-instance="{instance_id}"] .cache')
    page.wait_for_function(
        f"""document.querySelector('.instance[data-instance="{instance_id}"] .cache')
                               .textContent.includes(' of 0 prompt') === false""",
        timeout=10_000,
    )
    assert cache.inner_text().startswith("prefix cache:") and "prompt tokens cached" in cache.inner_text()


def connects(page, url: str) -> None:
    """The connect panel shows what ``shardline connect CLIENT --url URL`` prints."""
    printed = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "connect", "claude", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    page.wait_for_function(
        "expected => document.querySelector('#connect-text').textContent === expected", arg=printed, timeout=10_000
    )
    assert page.locator("#connect-copy").is_enabled()
    instance = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"][0]
    for client in ("codex", "opencode", "aider"):
        page.click(f'#connect-clients button[data-client="{client}"]')
        expected = connection(client, url, instance["model_id"], instance["context"]).text()
        page.wait_for_function(
            "expected => document.querySelector('#connect-text').textContent === expected", arg=expected, timeout=10_000
        )


def test_placing_a_chosen_preview_puts_it_on_its_nodes(cluster3, browser):
    """The preview's 2-node pipeline chosen (from the keyboard) and placed: the instance
    appears on those nodes, rank by rank, with the preview's layer ranges; deleted from
    the page again."""
    url = cluster3.url(0)
    before = {i["instance_id"] for i in placed(url)}
    page, problems = watched(browser)
    try:
        page.goto(url + "/", wait_until="domcontentloaded")
        page.wait_for_function("document.querySelector('#place-model').options.length > 0")
        page.select_option("#place-sharding", "pipeline")
        page.fill("#place-context", "512")
        page.fill("#place-max-batch", "2")
        page.press("#place-max-batch", "Enter")  # the keyboard: Enter in the form previews
        choice = page.locator('.cand[data-sharding="pipeline"]').filter(has_text="on 2 nodes").first
        choice.wait_for(timeout=30_000)
        node_ids = choice.get_attribute("data-nodes").split()
        shown = choice.locator(".cand-nodes").inner_text()
        assert "MB" in shown and "free" in shown, shown  # each rank's memory of its node's free
        choice.locator("input").focus()
        page.keyboard.press("Space")
        assert page.locator('input[name="candidate"]:checked').count() == 1
        assert page.locator("#place").inner_text() == "Place the chosen placement"
        page.click("#place")
        page.wait_for_function("document.querySelector('#place-status').textContent.includes('loading')")
        new = wait_until(lambda: {i["instance_id"] for i in placed(url)} - before, 10, "the new instance listed")
        (instance_id,) = new
        card = page.locator(f'.instance[data-instance="{instance_id}"]')
        card.wait_for()
        inst = next(i for i in placed(url) if i["instance_id"] == instance_id)
        assert [r["node_id"] for r in inst["ranks"]] == node_ids
        preview = httpx.post(
            f"{url}/cluster/placements/preview",
            json={"sharding": "pipeline", "context": 512, "max_batch": 2, "nodes": node_ids},
            timeout=30,
        ).json()["candidates"]
        shares = next(c["shares"] for c in preview if c["node_ids"] == node_ids)
        assert [rank_share(s) for s in shares] == [rank_share(r) for r in inst["ranks"]]
        rows = card.locator("tr[data-rank]")
        assert [rows.nth(k).get_attribute("data-node") for k in range(2)] == node_ids
        assert rows.locator(".share").all_inner_texts() == [rank_share(r) for r in inst["ranks"]]
        card.locator(".inst-head .badge.ready").wait_for(timeout=90_000)
        for k, node_id in enumerate(node_ids):
            holds = page.locator(f'.node[data-node="{node_id}"] .holds').inner_text()
            assert f"r{k}/2 · {rank_share(inst['ranks'][k])}" in holds, holds
        # deleted from the page: a second click confirms
        page.click(f'button[data-delete="{instance_id}"]')
        page.click(f'button[data-delete="{instance_id}"]')
        card.wait_for(state="detached", timeout=30_000)
        assert {i["instance_id"] for i in placed(url)} == before
        assert problems == []
    finally:
        page.close()
        for inst in placed(url):
            if inst["instance_id"] not in before:
                httpx.delete(f"{url}/cluster/instances/{inst['instance_id']}", timeout=30)


def test_a_refused_placement_says_why(cluster1, browser):
    page, problems = watched(browser)
    page.goto(cluster1.url(0) + "/", wait_until="domcontentloaded")
    page.wait_for_function("document.querySelector('#place-model').options.length > 0")
    before = placed(cluster1.url(0))
    page.select_option("#place-sharding", "ring")
    page.click("#place")
    page.wait_for_function("document.querySelector('#place-status').textContent.includes('at least 2 nodes')")
    assert placed(cluster1.url(0)) == before
    # the preview says the same of its candidate, as the API gives it
    page.click("#place-preview")
    page.locator(".cand.refused").first.wait_for(timeout=30_000)
    assert "at least 2 nodes" in page.locator(".cand.refused").first.inner_text()
    page.fill("#place-context", "1000000")  # more than the model was trained on
    page.locator("#preview .error-box").wait_for(timeout=30_000)
    assert "context" in page.locator("#preview .error-box").inner_text()
    # the browser reports each refused request (409, 400) as an error; nothing else
    assert [p for p in problems if not re.search(r"status of (400|409)\b", p)] == []
    page.close()


def test_the_icon_is_served_without_a_key(cluster1):
    for path in ("/favicon.svg", "/favicon.ico"):
        response = httpx.get(cluster1.url(0) + path, timeout=10)
        assert response.status_code == 200 and response.headers["content-type"] == "image/svg+xml", path
        assert response.text.startswith("<svg")


def test_the_connect_endpoint_gives_what_shardline_connect_prints(cluster1):
    url = cluster1.url(0)
    instance = placed(url)[0]
    for client in CLIENTS:
        answer = httpx.get(f"{url}/cluster/connect/{client}", params={"model": instance["model_id"]}, timeout=10)
        assert answer.status_code == 200, answer.text
        expected = connection(client, url, instance["model_id"], instance["context"])
        body = answer.json()
        assert body["text"] == expected.text() and body["env"] == expected.env and body["base_url"] == url
        assert (body["model"], body["context"]) == (instance["model_id"], instance["context"])
    # the key a request presented is the key the settings give (`shardline connect --api-key`)
    keyed = httpx.get(f"{url}/cluster/connect/aider", headers={"Authorization": "Bearer k-123"}, timeout=10).json()
    assert "--openai-api-key k-123" in keyed["text"]
    unknown = httpx.get(f"{url}/cluster/connect/emacs", timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "client"
    absent = httpx.get(f"{url}/cluster/connect/claude", params={"model": "no/such-model"}, timeout=10)
    assert absent.status_code == 404 and "not" in absent.json()["error"]["message"]
    # an empty model is no model (the default's settings); a long one is not sent back whole
    empty = httpx.get(f"{url}/cluster/connect/claude", params={"model": ""}, timeout=10)
    assert empty.status_code == 200 and empty.json()["model"] == instance["model_id"]
    long = httpx.get(f"{url}/cluster/connect/claude", params={"model": "x" * 20_000}, timeout=10)
    assert long.status_code == 404 and len(long.text) < 1_000 and "20000 characters" in long.text


API_KEY = "sk-dashboard-test-0123"


@pytest.mark.slow
def test_a_killed_node_greys_and_its_instance_changes_within_10_s(tmp_path, browser):
    """On a cluster with an API key (the page asks for it once): a node killed is drawn
    down, and its instance's status changes, within 10 s; the instance placed again on
    the other two is drawn there."""
    cluster = local_cluster(3, tmp_path, api_key=API_KEY)
    try:
        cluster.start()
        cluster.place(None, "pipeline")
        key = {"Authorization": f"Bearer {API_KEY}"}
        view = httpx.get(f"{cluster.url(0)}/cluster/nodes", headers=key, timeout=10).json()
        old = httpx.get(f"{cluster.url(0)}/cluster/instances", headers=key, timeout=10).json()["instances"][0]
        ids = [httpx.get(f"{cluster.url(i)}/health", timeout=10).json()["node_id"] for i in range(3)]
        victim = next(i for i in (1, 2) if ids[i] != view["coordinator"])
        page, problems = watched(browser)
        asked: list[str] = []

        def answer(dialog):
            asked.append(dialog.message)
            dialog.accept(API_KEY)

        page.on("dialog", answer)
        page.goto(cluster.url(0) + "/", wait_until="domcontentloaded")
        page.locator(f'.instance[data-instance="{old["instance_id"]}"] .inst-head .badge.ready').wait_for()
        assert len(asked) == 1 and "API key" in asked[0]
        for icon in ("/favicon.svg", "/favicon.ico"):  # asked by the browser before the key
            assert httpx.get(cluster.url(0) + icon, timeout=10).status_code == 200
        assert page.evaluate("sessionStorage.getItem('shardline-api-key')") == API_KEY
        assert page.locator(".node.down").count() == 0

        killed = time.monotonic()
        cluster.procs[victim].kill()
        gone = ids[victim]
        page.wait_for_function(
            f"""() => {{
                const down = document.querySelector('.node[data-node="{gone}"]');
                const inst = '.instance[data-instance="{old["instance_id"]}"]';
                const changed = !document.querySelector(inst) || document.querySelector(inst).dataset.status !== "ready"
                    || document.querySelector(inst + ' tbody .badge:not(.ready)');
                return down && down.classList.contains("down") && changed;
            }}""",
            timeout=10_000,
        )
        print(f"\nnode down and instance changed on the page {time.monotonic() - killed:.1f} s after the kill")
        again = page.locator(f'.instance[data-replaced~="{old["instance_id"]}"]')
        again.locator(".inst-head .badge.ready").wait_for(timeout=60_000)
        nodes = [again.locator("tr[data-rank]").nth(k).get_attribute("data-node") for k in range(2)]
        assert gone not in nodes and len(set(nodes)) == 2
        assert len(asked) == 1
        # the requests refused before the key was given (401) are the browser's only errors
        assert [p for p in problems if "status of 401" not in p] == []
        page.close()
    finally:
        cluster.stop()


def test_the_place_form_offers_every_sharding():
    """auto and each sharding placement takes (expert too: a mixture-of-experts model's
    whole experts a rank; the form offered the first four only)."""
    from pathlib import Path

    import shardline.api
    from shardline.placement.ranks import SHARDING_NAMES

    html = (Path(shardline.api.__file__).parent / "static" / "dashboard.html").read_text()
    select = html.split('id="place-sharding"', 1)[1].split("</select>", 1)[0]
    assert re.findall(r"<option>(\w+)</option>", select) == ["auto", *SHARDING_NAMES]
