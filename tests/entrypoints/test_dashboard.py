"""The live dashboard (/dashboard) of a real server: its files and API-key policy, the
rate limit of the engine snapshots, and the page itself in headless Chromium (Debian's
`chromium`, which scripts/setup.sh installs, driven by Playwright) showing the KV grid
and counters change while requests run."""

from __future__ import annotations

import base64
import shutil
import threading
import time
from array import array

import httpx
import pytest

from tests.entrypoints.utils import MODEL_NAME, RemoteServer

API_KEY = "dash-key"
NUM_BLOCKS = 96
BLOCK_SIZE = 16
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks",
               str(NUM_BLOCKS), "--max-num-seqs", "8"]
CHROMIUM = "/usr/bin/chromium"
# No internet here: without these Chromium keeps trying to reach Google's services.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 180_000  # the CI machine is shared: steps can take a second under load


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS, api_key=API_KEY)
    yield srv
    srv.stop()


def get_state(server: RemoteServer) -> dict:
    r = httpx.get(server.url + "/dashboard/state", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def decode_states(b64: str) -> list[int]:
    states = array("H")
    states.frombytes(base64.b64decode(b64))
    return list(states)


def test_files_need_no_key_and_the_feed_does(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="kv-grid"' in page.text and "/dashboard/dashboard.js" in page.text
    for name, media in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        r = httpx.get(f"{server.url}/dashboard/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
    # Nothing else is served from the package directory.
    assert httpx.get(server.url + "/dashboard/feed.py").status_code in (401, 404)

    assert httpx.get(server.url + "/dashboard/state").status_code == 401
    state = get_state(server)
    kv = state["kv"]
    assert state["engine_alive"] and state["model"] == MODEL_NAME
    assert kv["num_blocks"] == NUM_BLOCKS and kv["block_size"] == BLOCK_SIZE
    states = decode_states(kv["states"])
    assert len(states) == NUM_BLOCKS and states[0] == 2  # the null block
    # Idle: nothing in use, and the counts add up to the pool.
    assert kv["num_in_use"] == 0 and kv["req_ids"] == []
    assert kv["num_free"] + kv["num_cached"] == NUM_BLOCKS - 1
    assert kv["num_free"] == states.count(0) and kv["num_cached"] == states.count(1)


def test_polls_share_snapshots(server):
    """However often pages poll, the core is asked at most every snapshot_s."""
    start = time.monotonic()
    seqs = [get_state(server)["kv"]["seq"] for _ in range(30)]
    elapsed = time.monotonic() - start
    interval = get_state(server)["intervals"]["snapshot_s"]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) <= elapsed / interval + 2, (seqs, elapsed)


def completion(server: RemoteServer, prompt: str, max_tokens: int, errors: list) -> None:
    try:
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=600,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    except BaseException as e:  # reported by the test thread
        errors.append(e)


def page_values(page) -> dict:
    """The numbers the page shows: the grid's counts (decoded by its script from the
    snapshot) and the counters' values."""
    return page.evaluate("""() => {
        const grid = document.getElementById('kv-grid').dataset;
        const v = (id) => Number(document.getElementById(id).dataset.value);
        return {seq: Number(grid.seq), in_use: Number(grid.inUse), cached: Number(grid.cached),
                free: Number(grid.free), shared: Number(grid.shared),
                in_use_counter: v('c-kv-in-use'), running: v('c-running'),
                finished: v('c-finished'), tokens: v('c-tokens'), hit_rate: v('c-hit-rate'),
                phases: JSON.parse(document.getElementById('timeline').dataset.phases),
                updates: Number(document.body.dataset.updates)};
    }""")


def grid_colours(page) -> int:
    """Distinct opaque colours drawn on the KV grid's canvas."""
    return page.evaluate("""() => {
        const c = document.getElementById('kv-grid');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const seen = new Set();
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] === 255)
            seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        return seen.size;
    }""")


def test_page_shows_the_engine_working(server, tmp_path):
    assert shutil.which("chromium"), "chromium is missing: run scripts/setup.sh"
    from playwright.sync_api import sync_playwright

    # Long enough that the 1 Hz history samples some steps while requests run (48 tokens
    # each finished between two samples on the native quantized path).
    num_requests, max_tokens = 4, 160
    # A shared prefix of 3 full blocks: the later requests hit the prefix cache and
    # share those blocks with the first.
    prefix = " ".join(f"word{i}" for i in range(40))
    prompts = [f"{prefix} request {i} says" for i in range(num_requests)]
    errors: list[BaseException] = []
    page_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1200})
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            # The key travels in the fragment, which the page keeps and sends as a header.
            page.goto(f"{server.url}/dashboard#key={API_KEY}")
            page.wait_for_function("document.getElementById('kv-grid').dataset.seq !== ''",
                                   timeout=WAIT_MS)
            before = page_values(page)
            assert before["in_use"] == 0 and before["running"] == 0
            assert before["free"] + before["cached"] == NUM_BLOCKS - 1

            threads = [threading.Thread(target=completion, args=(server, prompt, max_tokens,
                                                                 errors))
                       for prompt in prompts]
            threads[0].start()
            # The first request's prompt is in the cache before the others arrive.
            page.wait_for_function("Number(document.getElementById('c-running')"
                                   ".dataset.value) >= 1", timeout=WAIT_MS)
            for t in threads[1:]:
                t.start()

            # While they run: blocks in use, some shared, several requests running.
            page.wait_for_function("""() => {
                const g = document.getElementById('kv-grid').dataset;
                return Number(g.inUse) > 0 && Number(g.shared) > 0 &&
                    Number(document.getElementById('c-running').dataset.value) >= 2; }""",
                timeout=WAIT_MS)
            during = page_values(page)
            colours = grid_colours(page)
            page.screenshot(path=str(tmp_path / "dashboard-running.png"), full_page=True)
            # Each request holds at most cdiv(prompt + max_tokens, block_size) blocks.
            assert 0 < during["in_use"] <= num_requests * (512 // BLOCK_SIZE)
            assert during["in_use"] == during["in_use_counter"]  # decoded == served
            assert 2 <= during["running"] <= num_requests
            assert during["phases"]["decode"] + during["phases"]["prefill"] >= 2
            # Free, null, shared and at least one request's own colour.
            assert colours >= 4, colours

            # The values move while the requests run: a newer snapshot, more tokens.
            page.wait_for_function(
                f"""() => Number(document.getElementById('kv-grid').dataset.seq) > {during['seq']}
                    && Number(document.getElementById('c-tokens').dataset.value) >
                       {during['tokens']}""", timeout=WAIT_MS)

            for t in threads:
                t.join(600)
            assert not errors, errors
            # Done: every request finished, nothing in use, the prompts' blocks cached.
            page.wait_for_function(f"""() => {{
                const g = document.getElementById('kv-grid').dataset;
                const v = (id) => Number(document.getElementById(id).dataset.value);
                return v('c-finished') >= {before['finished'] + num_requests}
                    && Number(g.inUse) === 0 && Number(g.cached) > 0 && v('c-running') === 0;
                }}""", timeout=WAIT_MS)
            after = page_values(page)
            page.screenshot(path=str(tmp_path / "dashboard-finished.png"), full_page=True)
        finally:
            browser.close()
    assert not page_errors, page_errors
    assert after["tokens"] >= before["tokens"] + num_requests * max_tokens
    assert after["hit_rate"] > 0  # the shared prefix was served from the cache
    assert after["phases"]["finished"] >= num_requests
    # The page agrees with the engine's own stats once it is idle.
    stats = server.stats()
    assert after["free"] + after["cached"] == stats["num_free_blocks"]
    # The feed's history saw the tokens go by, and its timeline the requests' stages.
    state = get_state(server)
    assert max(p["generation_tps"] for p in state["history"]) > 0
    assert max(p["running"] for p in state["history"]) >= 1
    done = [r for r in state["requests"] if r["phase"] == "finished"]
    assert len(done) >= num_requests
    for r in done[:num_requests]:
        assert r["arrival"] <= r["scheduled"] <= r["first_token"] <= r["finished"]
        assert r["output_tokens"] == max_tokens and r["reason"] == "length"
    for name in ("dashboard-running.png", "dashboard-finished.png"):
        assert (tmp_path / name).stat().st_size > 10_000
