"""GET /cache, /cache/tree and the live page /cache/view against a real server with an API key: the
JSON shapes and bounds, 401 without the key (Bearer, or Basic for the page in a browser), and the
page itself in headless Chromium (Debian's `chromium`; .ci/run installs it), which must find the
node of a shared system prompt with its hit count, offline."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import pytest

from radixlm.server.launch import launch_server

pytestmark = pytest.mark.slow

KEY = "cache-view-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are the bakery's assistant. Always answer in one short, friendly sentence about bread. " * 4
REQUESTS = 4  # sharing SYSTEM, one after the other: its node is passed by the last 3 (3 hits)
STATIC = Path(__file__).resolve().parents[1] / "server" / "static"


@pytest.fixture(scope="module")
def server(make_tiny_model):
    with launch_server(model=str(make_tiny_model()), port=0, log_level="warning", api_key=KEY) as handle:
        with httpx.Client(base_url=handle.url, timeout=120, headers=AUTH) as client:
            for i in range(REQUESTS):
                r = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Bread {i}?"}],
                    "max_tokens": 6, "temperature": 0})
                assert r.status_code == 200, r.text
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_cache_routes_need_the_key(http):
    for path in ("/cache", "/cache/summary", "/cache/tree", "/cache/view", "/cache/view.js", "/cache/view.css"):
        r = http.get(path)
        assert r.status_code == 401, (path, r.text)
        assert "cached" not in r.text.lower() and SYSTEM[:20] not in r.text
        assert r.headers["www-authenticate"].startswith("Basic")  # so a browser asks for it
        assert http.get(path, auth=("anyone", "wrong")).status_code == 401
        assert http.get(path, headers=AUTH).status_code == 200, path
        assert http.get(path, auth=("anyone", KEY)).status_code == 200, path
    for path in ("/cache/save", "/cache/load"):
        assert http.post(path).status_code == 401
        assert http.post(path, auth=("anyone", KEY)).status_code == 401  # Basic only for pages a browser opens
    assert http.get("/v1/models", auth=("anyone", KEY)).status_code == 401


def test_cache_summary_shape(http):
    s = http.get("/cache", headers=AUTH).json()
    assert s["cached_tokens"] == s["locked_tokens"] + s["evictable_tokens"] > 0
    assert s["pool_tokens"] == s["free_tokens"] + s["cached_tokens"] + s["running_tokens"]
    assert s["nodes"] >= REQUESTS and not s["truncated"]
    assert set(s["hit_rate"]) == {"all", "1m", "5m", "15m"} and 0 < s["hit_rate"]["1m"]["hit_rate"] < 1
    best = s["top_prefixes"][0]
    assert SYSTEM[:40] in best["text"] and best["hits"] == REQUESTS - 1
    assert best["tokens_saved"] == best["hits"] * best["prefix_tokens"] and best["locked"] is False
    assert set(best) >= {"id", "text", "tail", "prefix_tokens", "hits", "tokens_saved", "last_used", "locked"}
    assert set(s["evictions"]) == {"tokens", "by_reason", "recent"}
    assert s["snapshot"]["configured"] is False
    points = s["series"]["points"]
    assert points and any(p["ttft_avg"] for p in points) and all(set(p) >= {"t", "running", "waiting"} for p in points)
    assert http.get("/cache?top=1", headers=AUTH).json()["top_prefixes"] == [best]


def test_cache_tree_shape_and_bounds(http):
    t = http.get("/cache/tree", headers=AUTH).json()
    ids = {n["id"] for n in t["nodes"]}
    assert len(ids) == t["nodes_total"] and not t["truncated"]
    for n in t["nodes"]:
        assert n["parent"] == t["root"] or n["parent"] in ids
        assert n["subtree_tokens"] >= n["edge_tokens"] >= 1 and isinstance(n["text"], str)
    assert sum(n["subtree_tokens"] for n in t["nodes"] if n["parent"] == t["root"]) == t["cached_tokens"]
    one = http.get("/cache/tree?max_nodes=1", headers=AUTH).json()
    assert len(one["nodes"]) == 1 and one["nodes"][0]["hidden_children"] > 0
    shallow = http.get("/cache/tree?depth=1", headers=AUTH).json()
    assert all(n["depth"] == 1 for n in shallow["nodes"])
    big = http.get(f"/cache/tree?min_tokens={t['cached_tokens'] + 1}", headers=AUTH).json()
    assert big["nodes"] == [] and big["root_hidden_tokens"] == t["cached_tokens"]
    for query, param in (("depth=0", "depth"), ("max_nodes=100000", "max_nodes"), ("depth=x", "depth"),
                         ("path=/etc/passwd", "path"), ("depth=\u0663", "depth"), ("depth=%20%2B8", "depth"),
                         ("max_nodes=1_0", "max_nodes")):
        r = http.get(f"/cache/tree?{query}", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_snapshots_need_the_operators_flag(http):
    r = http.post("/cache/save", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_unconfigured"
    r = http.post("/cache/load", headers=AUTH, json={"path": "/etc/passwd"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"


def test_page_is_self_contained():
    """No CDN, no build step: three plain files whose only URLs are relative (or the SVG namespace)."""
    for name in ("cache_view.html", "cache_view.js", "cache_view.css"):
        text = (STATIC / name).read_text()
        assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) <= {"http://www.w3.org/2000/svg"}, name
    js = (STATIC / "cache_view.js").read_text()
    assert "innerHTML" not in js and "eval(" not in js  # cached text is user text: never parsed as markup


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it with apt where it can)")
    pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
    return path


def test_browser_shows_the_shared_system_prompt_with_its_hits(server, tmp_path):
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            # a person's browser: the page asks for the key as a Basic password
            context = browser.new_context(http_credentials={"username": "ops", "password": KEY},
                                          viewport={"width": 1280, "height": 1000})

            def offline(route):  # the page must work with no network beyond the server
                if route.request.url.startswith(server.url):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            context.route("**/*", offline)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/cache/view")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            node = page.locator(f'#tree rect.node[data-text*="{SYSTEM[:30]}"]')
            assert node.count() == 1, page.locator("#tree rect.node").evaluate_all("n => n.map(x => x.dataset.text)")
            assert node.get_attribute("data-hits") == str(REQUESTS - 1)
            node.hover()
            tip = page.locator("#tip")
            tip.wait_for(state="visible")
            assert f"{REQUESTS - 1} hits" in tip.inner_text() and SYSTEM[:30] in tip.inner_text()
            assert SYSTEM[:30] in page.locator("#top tbody tr").first.inner_text()
            assert page.locator("#chart-ttft polyline").count() >= 1
            shot = tmp_path / "cache_view.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            assert not errors, errors
        finally:
            browser.close()
    assert outside == []
