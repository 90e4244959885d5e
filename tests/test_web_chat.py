"""The web chat at / in a real browser: Debian's headless Chromium driven by Selenium, over
a live daemon serving the real stories260k pair. The page loads without console errors,
answers stream in and equal the API's greedy answer, Stop cancels the generation in the
engine, Regenerate is served from the prefix cache, a context overflow is said (and the
oldest turn dropped only when asked), the API key prompt works, and the machine panel
shows the plan. A screenshot of the page after an answer lands in the test's tmp_path.

Skipped, with the reason, when no Chromium or chromedriver is installed (`.ci/run`
installs Debian's); never downloads a browser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings

pytestmark = pytest.mark.browser

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.expected_conditions import staleness_of  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
KEY = "browser-test-key"
PROMPT = "Once upon a time"


def find_chromium() -> tuple[str, str]:
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which("chromedriver") or next(
        (p for p in ("/usr/lib/chromium/chromedriver",) if os.access(p, os.X_OK)), None
    )
    if browser is None or driver is None:
        missing = "Chromium" if browser is None else "chromedriver"
        pytest.skip(
            f"no {missing} found: install Debian's (apt-get install chromium chromium-driver)"
        )
    return browser, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


def chromium() -> Iterator[Any]:
    """A headless Chromium driven by Selenium, quit when the generator is closed."""
    binary, driver_path = find_chromium()
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,800",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def start_server(target: Path, draft: Path, key_file: Path | None = None) -> BackgroundServer:
    overrides: dict[str, tuple[Any, str]] = {
        "models.target": (str(target), "test"),
        "runtime.compile": ("off", "test"),
        "models.draft": (str(draft), "test"),
        "server.port": (0, "test"),
        "server.keepalive_seconds": (0.05, "test"),
    }
    if key_file is not None:
        overrides["server.api_key_file"] = (str(key_file), "test")
    return BackgroundServer(load_settings(environ={}, overrides=overrides))


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path) -> Iterator[BackgroundServer]:
    with start_server(stories_target, stories_draft) as srv:
        yield srv


def api(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def metric(server: BackgroundServer, name: str) -> float:
    _, text = api(server.url + "/metrics")
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def wait(driver: Any, what: Callable[[Any], Any], seconds: float = 20) -> Any:
    # The page re-renders its messages: an element may go stale between two looks.
    return WebDriverWait(
        driver, seconds, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    ).until(what)


def open_page(driver: Any, url: str) -> None:
    """A fresh page: no conversations or settings left from another test."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#machine-body dl"))
    driver.get_log("browser")  # what the page logged so far was checked by its own test


def settings(driver: Any, **values: str) -> None:
    summary = driver.find_element(By.CSS_SELECTOR, "#settings summary")
    if not driver.find_element(By.ID, "settings").get_attribute("open"):
        summary.click()
    for field, value in values.items():
        box = driver.find_element(By.ID, field.replace("_", "-"))
        driver.execute_script(
            "arguments[0].value = arguments[1];arguments[0].dispatchEvent(new Event('change'))",
            box,
            value,
        )


def send(driver: Any, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    driver.execute_script("arguments[0].value = arguments[1]", box, text)
    box.send_keys(Keys.ENTER)  # Enter sends (Shift+Enter would add a line)


def answered(driver: Any, count: int, state: str = "done", seconds: float = 30) -> Any:
    def ready(d: Any) -> Any:
        answers = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        if len(answers) >= count and answers[-1].get_attribute("data-state") == state:
            return answers[-1]
        return None

    return wait(driver, ready, seconds)


def text_of(driver: Any, element: Any) -> str:
    return driver.execute_script(
        "return arguments[0].querySelector('.content').textContent", element
    )


def stat(element: Any, name: str) -> str:
    return element.find_element(By.CSS_SELECTOR, f'[data-stat="{name}"] b').text


def severe(driver: Any) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_page_loads_with_no_console_errors(browser: Any, server: BackgroundServer) -> None:
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#machine-body dl"))
    assert browser.title == "specd chat"
    assert browser.find_element(By.ID, "model-name").text == "stories260k"
    assert severe(browser) == []


def test_an_answer_streams_in_and_equals_the_api_greedy_answer(
    browser: Any, server: BackgroundServer, tmp_path: Path
) -> None:
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="40", budget="16")
    send(browser, PROMPT)
    answer = answered(browser, 1)
    request = {
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": 40,
        "strategy": "autoregressive",
    }
    status, body = api(server.url + "/v1/chat/completions", request)
    assert status == 200
    expected = body["choices"][0]["message"]["content"]
    assert expected and text_of(browser, answer) == expected
    # What speculation did, from the final chunk's `specd` figures.
    assert float(stat(answer, "tokens/s")) > 0
    assert float(stat(answer, "tokens/pass")) >= 1
    assert stat(answer, "tree budget") == "16"
    assert stat(answer, "strategy") == "tree"
    assert stat(answer, "first token").endswith(" s")
    # The conversation is kept in the browser and named after its first message.
    assert browser.find_element(By.ID, "chat-title").text == PROMPT
    browser.refresh()
    answer = answered(browser, 1)
    assert text_of(browser, answer) == expected
    shot = tmp_path / "web-chat.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"
    assert severe(browser) == []


def test_a_full_browser_storage_still_shows_the_answer_and_says_so(
    browser: Any, server: BackgroundServer
) -> None:
    """With the origin's storage full, saving threw: the answer stayed marked streaming,
    with no stats and no notice, and "New chat" did nothing."""
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="20", budget="16")
    filled = browser.execute_script(
        """let i = 0;  // blocks of 1 MiB, then halves, down to one character: full
        for (let size = 1 << 20; size >= 1; size >>= 1) {
          const block = 'x'.repeat(size);
          try { for (; i < 200; i++) localStorage.setItem('filler' + i, block); } catch (e) {}
        }
        return i;"""
    )
    assert filled < 200, "the browser's storage never filled"
    try:
        send(browser, "Tom saw a big blue box.")
        answer = answered(browser, 1)
        assert stat(answer, "strategy") == "tree"  # (the stats line: the answer was rendered)
        notice = browser.find_element(By.ID, "notice-text")
        assert notice.is_displayed() and "storage for this page is full" in notice.text
    finally:
        browser.execute_script(
            "for (let i = 0; i < 200; i++) localStorage.removeItem('filler' + i)"
        )


def test_regenerate_reports_prefix_cache_hits(browser: Any, server: BackgroundServer) -> None:
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="30", budget="16")
    send(browser, "Lily had a red ball.")
    old = answered(browser, 1)
    first = text_of(browser, old)
    old.find_element(By.CSS_SELECTOR, ".regenerate").click()
    # The old answer goes; the new one is the same greedy text, drawn from verified tree
    # nodes the first answer left in the prefix cache.
    wait(browser, staleness_of(old), 10)
    again = answered(browser, 1)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1
    assert text_of(browser, again) == first
    assert int(stat(again, "prefix-cache hits")) > 0


def test_the_tree_view_renders_for_a_tree_request(
    browser: Any, server: BackgroundServer, tmp_path: Path
) -> None:
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="40", budget="12", strategy="tree")
    send(browser, "Tom found a shiny stone by the river.")  # new to the prefix cache
    answer = answered(browser, 1)
    tree = answer.find_element(By.CSS_SELECTOR, "details.tree")
    assert tree.get_attribute("open") is not None
    summary = tree.find_element(By.TAG_NAME, "summary").text
    match = re.search(r"round (\d+).*: (\d+) nodes, (\d+) accepted", summary)
    assert match, summary
    nodes, accepted = int(match.group(2)), int(match.group(3))
    assert 1 <= nodes <= 12
    # Every node drawn once, the root marked, the accepted path (and the root) highlighted.
    assert len(tree.find_elements(By.CSS_SELECTOR, ".tok")) == nodes + 1
    assert len(tree.find_elements(By.CSS_SELECTOR, ".tok.root")) == 1
    assert len(tree.find_elements(By.CSS_SELECTOR, ".tok.accepted")) == accepted + 1
    # The page shows the round that bought the most tokens; the others are a click away.
    shown = re.search(r"\(tree (\d+) of (\d+) kept\)", summary)
    assert shown, summary
    for _ in range(int(shown.group(1)) - 1):
        tree.find_element(By.CSS_SELECTOR, '[aria-label="Previous round"]').click()
    assert f"(tree 1 of {shown.group(2)} kept)" in tree.find_element(By.TAG_NAME, "summary").text
    for _ in range(int(shown.group(1)) - 1):
        tree.find_element(By.CSS_SELECTOR, '[aria-label="Next round"]').click()
    assert tree.find_element(By.TAG_NAME, "summary").text == summary
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()  # closed for the picture
    browser.execute_script("arguments[0].scrollIntoView()", answer)
    browser.save_screenshot(str(tmp_path / "web-chat-tree.png"))
    assert severe(browser) == []


@pytest.fixture
def slow_engine(server: BackgroundServer) -> Iterator[None]:
    """Each engine step waits a little, so that a generation is still running when the page
    stops it (the tiny model is otherwise done in a blink)."""
    engine = server.server.engine
    step = engine._step

    def slow_step() -> None:
        time.sleep(0.05)
        step()

    engine._step = slow_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine._step


def test_stop_cancels_the_generation_and_the_next_is_served(
    browser: Any, server: BackgroundServer, slow_engine: None
) -> None:
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="400", budget="4")
    cancelled = metric(server, "specd_cancelled_total")
    send(browser, PROMPT)
    answer = answered(browser, 1, state="streaming")
    wait(browser, lambda d: text_of(d, answer))
    assert browser.find_element(By.ID, "stop").is_displayed()
    browser.find_element(By.ID, "input").send_keys(Keys.ESCAPE)  # Esc stops
    answer = answered(browser, 1, state="stopped", seconds=5)
    assert browser.find_element(By.ID, "send").is_displayed()
    # The server noticed the closed stream and dropped the generation.
    deadline = time.monotonic() + 10
    while metric(server, "specd_cancelled_total") <= cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "specd_cancelled_total") == cancelled + 1
    assert server.server.engine.active_count == 0
    settings(browser, max_tokens="5")
    send(browser, "And then?")
    assert text_of(browser, answered(browser, 2))
    assert severe(browser) == []


def test_a_conversation_past_the_context_is_said_and_trimmed_on_request(
    browser: Any, server: BackgroundServer
) -> None:
    runtime = server.server.engine.runtime
    assert runtime is not None
    sentence = "The little dog ran to the big tree in the park. "
    per = len(runtime.tokenizer.encode(sentence))
    long_turn = sentence * (runtime.context * 6 // 10 // per)  # ~60% of the context
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="4")
    send(browser, long_turn)
    answered(browser, 1)
    send(browser, long_turn)  # two of them do not fit
    notice = wait(browser, lambda d: d.find_element(By.ID, "notice").is_displayed())
    assert notice
    assert "no longer fits" in browser.find_element(By.ID, "notice-text").text
    # Nothing was dropped on its own: both turns are still there.
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2
    browser.find_element(By.ID, "drop-oldest").click()
    answered(browser, 1)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
    assert not browser.find_element(By.ID, "notice").is_displayed()


def test_the_machine_panel_shows_the_plan(browser: Any, server: BackgroundServer) -> None:
    open_page(browser, server.url)

    def field(name: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, f'#machine-body [data-field="{name}"]').text

    assert field("layers") == "5 resident · 0 streamed"
    assert field("host tier") == "–"  # nothing streams: the whole target is resident
    assert field("strategy") == "tree"
    assert field("context") == "512 tokens"
    assert field("stream GB/s") == "nothing streamed"
    assert "ready" in field("state")


def test_readable_at_400_px(browser: Any, server: BackgroundServer, tmp_path: Path) -> None:
    browser.set_window_size(400, 800)
    try:
        open_page(browser, server.url)
        width = browser.execute_script("return document.documentElement.scrollWidth")
        assert width <= 400  # no sideways scrolling
        assert browser.find_element(By.ID, "input").is_displayed()
        browser.save_screenshot(str(tmp_path / "web-chat-400px.png"))
    finally:
        browser.set_window_size(1100, 800)


def test_the_api_key_prompt(
    browser: Any, stories_target: Path, stories_draft: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text(KEY)
    with start_server(stories_target, stories_draft, key_file) as srv:
        browser.get(srv.url + "/")  # the page itself needs no key
        dialog = wait(browser, lambda d: d.find_element(By.ID, "key-dialog"))
        wait(browser, lambda d: dialog.get_attribute("open") is not None)
        browser.find_element(By.ID, "key-input").send_keys(KEY, Keys.ENTER)
        wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#machine-body dl"))
        assert browser.execute_script("return localStorage.getItem('specd.apiKey')") == KEY
        settings(browser, temperature="0", max_tokens="5")
        send(browser, PROMPT)
        assert text_of(browser, answered(browser, 1))
        # Kept: a reload asks no more.
        browser.refresh()
        wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#machine-body dl"))
        assert browser.find_element(By.ID, "key-dialog").get_attribute("open") is None


def test_conversations_new_rename_delete(browser: Any, server: BackgroundServer) -> None:
    open_page(browser, server.url)
    settings(browser, temperature="0", max_tokens="3")
    send(browser, "First story")
    answered(browser, 1)
    browser.find_element(By.ID, "new-chat").click()
    send(browser, "Second story")
    answered(browser, 1)
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations button")]
    assert titles == ["Second story", "First story"]
    browser.find_element(By.ID, "rename-chat").click()
    prompt = browser.switch_to.alert
    prompt.send_keys("Renamed")
    prompt.accept()
    assert browser.find_element(By.ID, "chat-title").text == "Renamed"
    browser.find_element(By.ID, "delete-chat").click()
    browser.switch_to.alert.accept()
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversations button")]
    assert titles == ["First story"]
    assert browser.find_element(By.ID, "chat-title").text == "First story"
    assert text_of(browser, answered(browser, 1))  # its answer is still there


def test_keyboard_and_colour_scheme(browser: Any, server: BackgroundServer) -> None:
    open_page(browser, server.url)
    box = browser.find_element(By.ID, "input")
    box.send_keys("one", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "two")  # Shift+Enter: a new line
    assert box.get_attribute("value") == "one\ntwo"
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []

    def background() -> str:
        return browser.execute_script("return getComputedStyle(document.body).backgroundColor")

    try:
        for scheme, colour in (("light", "rgb(255, 255, 255)"), ("dark", "rgb(22, 24, 28)")):
            browser.execute_cdp_cmd(
                "Emulation.setEmulatedMedia",
                {"features": [{"name": "prefers-color-scheme", "value": scheme}]},
            )
            assert background() == colour
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
