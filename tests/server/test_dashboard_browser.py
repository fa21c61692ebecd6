"""The dashboard in a real browser: Playwright driving headless Chromium (Debian's ``chromium``,
which .ci/run installs; else Playwright's own download) against a live server on a tiny model.

One server (40 blocks of 8 tokens, swap preemption into a small CPU pool, a disk KV tier) and one
page, the tests in order: the page loads offline with no console errors and one cell per block; a
request turns cells in use and shows in the running list (click: its blocks outlined; hover: its
id as owner); two requests with a shared 64-token prefix share cells with reference count 2, which
turn cached-free when they finish; a preemption shows blocks being swapped; a prefix evicted to
disk comes back as a load from disk. Screenshots go to test-artifacts/dashboard/.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
from live_server import server_model_dir, start_server  # noqa: F401 - fixtures

playwright_api = pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is not installed")

KEY = "browser-key"
NUM_BLOCKS, BLOCK = 40, 8
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
COLORS = {"free": (0x2b, 0x2f, 0x36), "cached": (0x3f, 0x6f, 0xb5), "used": (0x3f, 0xae, 0x5a),
          "shared": (0xe0, 0xa0, 0x30)}  # dashboard.js COLORS
PREFIX = list(range(10, 74))  # 64 tokens: 8 full blocks
STEP_DELAY = 0.03  # seconds added to every step: a 100-token request runs for 3 s or more


def chromium_path() -> str | None:
    """Debian's chromium (what CI installs), else a browser Playwright downloaded itself."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    with playwright_api.sync_playwright() as p:
        path = p.chromium.executable_path
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def server(server_model_dir, tmp_path_factory):  # noqa: F811
    srv = start_server(server_model_dir, api_key=KEY, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=8,
                       preemption_mode="swap", swap_space=48 * 2048 / 2**30,
                       kv_offload_dir=str(tmp_path_factory.mktemp("kv-disk")), kv_offload_disk_gb=0.002)
    # every step a little slower, so a short request stays on the page long enough to be clicked
    slow_steps(srv.engine.engine, STEP_DELAY)
    yield srv
    srv.stop()


def slow_steps(engine, seconds: float) -> None:
    """Each engine step starts ``seconds`` late (the engine loop calls ``engine.step()``; a hook on
    the model's forward is not enough: a CPU decode step runs the C decoder without it)."""
    step = engine.step

    def late():
        time.sleep(seconds)
        return step()
    engine.step = late


@pytest.fixture(scope="module")
def page(server):
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium found: apt-get install chromium (as .ci/run does) or `playwright install chromium`")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, offline=False)
        # offline: nothing but the server itself may be fetched
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server.url)
                      else route.abort())
        pg = context.new_page()
        pg.errors = []
        pg.on("console", lambda msg: pg.errors.append(msg.text) if msg.type == "error" else None)
        pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))
        pg.goto(f"{server.url}/dashboard#key={KEY}")
        pg.wait_for_function("() => window.pagedllmDashboard && window.pagedllmDashboard.panels[0].n > 0")
        yield pg
        browser.close()


def js(page, expr: str, *args):
    return page.evaluate(f"(args) => {{ const p = window.pagedllmDashboard.panels[0]; return {expr}; }}", list(args))


def wait(page, expr: str, timeout: float = 60, *args):
    deadline = time.time() + timeout
    while not (value := js(page, expr, *args)):
        if time.time() > deadline:
            page.screenshot(path=str(ARTIFACTS / "timeout.png"))
            raise AssertionError(f"timed out waiting for {expr}")
        time.sleep(0.05)
    return value


def stream(server, prompt: list[int], max_tokens: int) -> threading.Thread:
    """A streaming completion in a thread (the page watches it run); ``join()`` waits for its end."""
    def run():
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        for _ in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def pixel(page, block_id: int, dx: float = 0.5, dy: float = 0.5) -> tuple[int, int, int]:
    """The colour drawn at a point of a block's cell (fractions of the cell from its corner)."""
    return tuple(page.evaluate("""([id, dx, dy]) => {
        const p = window.pagedllmDashboard.panels[0];
        const [x, y] = p.cellOrigin(id);
        const ctx = p.canvas.getContext('2d');
        const d = ctx.getImageData(x + Math.floor(dx * p.cell), y + Math.floor(dy * p.cell), 1, 1).data;
        return [d[0], d[1], d[2]];
    }""", [block_id, dx, dy]))


def hover(page, block_id: int) -> str:
    box = page.locator("canvas.blockmap").bounding_box()
    x, y = js(page, "p.cellOrigin(args[0])", block_id)
    cell = js(page, "p.cell")
    page.mouse.move(box["x"] + x + cell / 2, box["y"] + y + cell / 2)
    tooltip = page.get_by_test_id("tooltip")
    tooltip.wait_for(state="visible")
    return tooltip.inner_text()


def test_page_loads_offline_with_one_cell_per_block(page):
    assert js(page, "p.n") == NUM_BLOCKS
    canvas = page.locator("canvas.blockmap")
    assert int(canvas.get_attribute("data-num-blocks")) == NUM_BLOCKS
    cols, cell = js(page, "p.cols"), js(page, "p.cell")
    rows = -(-NUM_BLOCKS // cols)
    assert js(page, "[p.canvas.width, p.canvas.height]") == [cols * cell, rows * cell]
    assert js(page, "p.counts().free") == NUM_BLOCKS
    assert pixel(page, NUM_BLOCKS - 1) == COLORS["free"]
    assert page.get_by_test_id("config").inner_text().count("40 blocks") == 1
    page.screenshot(path=str(ARTIFACTS / "loaded.png"))
    assert page.errors == []


def test_a_request_fills_cells_click_outlines_them_hover_names_the_owner(page, server):
    run = stream(server, [5, 6, 7, 8, 9], max_tokens=100)
    row = page.locator("tr.req[data-queue=running]").first
    row.wait_for(timeout=60_000)
    rid = row.get_attribute("data-request-id")
    wait(page, "p.counts().used > 0")
    row.click()
    wait(page, "p.selected === args[0]", 10, rid)
    first = js(page, "p.tables.get(args[0])[0]", rid)
    assert pixel(page, first) == COLORS["used"]
    assert pixel(page, first, dx=0.05)[0] == 0xff  # the outline of the selected request's block
    text = hover(page, first)
    assert f"block {first}" in text and "ref count 1" in text and rid in text
    page.screenshot(path=str(ARTIFACTS / "running.png"))
    run.join(120)
    wait(page, "p.counts().used === 0 && p.requests.length === 0")
    assert page.errors == []


def test_a_shared_prefix_shows_ref_count_2_then_cached_free(page, server):
    first = stream(server, PREFIX + [80], max_tokens=50)
    wait(page, "p.requests.some(r => r.queue === 'running' && r.computed >= 64)")
    second = stream(server, PREFIX + [81], max_tokens=50)
    wait(page, "p.counts().shared >= 8")
    shared = js(page, "[...Array(p.n).keys()].filter(i => p.blockInfo(i).state === 'shared')")
    owners = js(page, "p.blockInfo(args[0]).owners", shared[0])
    running = js(page, "p.requests.filter(r => r.queue === 'running').map(r => r.id)")
    assert len(owners) == 2 and set(owners) <= set(running)
    text = hover(page, shared[0])
    assert "shared" in text and "ref count 2" in text and all(o in text for o in owners)
    assert pixel(page, shared[0]) == COLORS["shared"]
    page.screenshot(path=str(ARTIFACTS / "shared.png"))
    first.join(120)
    second.join(120)
    wait(page, "p.counts().used === 0 && p.counts().shared === 0")
    assert all(js(page, "p.blockInfo(args[0]).state", b) == "cached" for b in shared)
    assert pixel(page, shared[0]) == COLORS["cached"]
    assert "cached" in hover(page, shared[0])
    assert page.errors == []


def test_a_preemption_shows_blocks_being_swapped(page, server):
    runs = [stream(server, [20 + i] * 12, max_tokens=100) for i in range(5)]  # ~15 blocks each: 40 cannot hold them
    wait(page, "p.seen.swapping > 0 && p.seen.swapped > 0", 120)
    page.screenshot(path=str(ARTIFACTS / "swapping.png"))
    for run in runs:
        run.join(180)
    wait(page, "p.counts().used === 0 && p.counts().swapping === 0")
    assert page.errors == []


def test_a_prefix_evicted_to_disk_comes_back_as_a_load(page, server):
    # the preemption test's requests took every block, evicting the shared prefix to the disk tier;
    # its writes run in the background: let them land
    server.on_loop(server.engine.collective_rpc("sync_kv_tiers", args=(False,)))
    stream(server, PREFIX + [82], max_tokens=4).join(120)
    wait(page, "p.seen.loading >= 8 && p.seen.tiers.includes('disk')")
    page.screenshot(path=str(ARTIFACTS / "loaded-from-disk.png"))
    assert page.errors == []


def test_the_router_page_shows_one_live_panel_per_replica(page, server):
    from test_router import _router_in_thread
    port = server.url.rsplit(":", 1)[1]
    with _router_in_thread([server.url, f"http://localhost:{port}"], api_key=KEY) as url:
        routed = page.context.new_page()
        routed.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
        routed.goto(f"{url}/dashboard#key={KEY}")
        routed.wait_for_function("() => window.pagedllmDashboard.panels.every(p => p.n > 0 && p.connected)")
        assert routed.evaluate("window.pagedllmDashboard.panels.map(p => [p.spec.base, p.n])") == [
            ["router/replicas/0/", NUM_BLOCKS], ["router/replicas/1/", NUM_BLOCKS]]
        assert routed.get_by_test_id("panel").count() == 2
        routed.screenshot(path=str(ARTIFACTS / "router.png"))
        routed.close()
