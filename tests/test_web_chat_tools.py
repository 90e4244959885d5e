"""Tool calls in the web chat, in headless Chromium (tests/test_web_chat.py's browser and
daemon): each call streams into its own block under the answer, keyed by index, its
arguments pretty-printed once whole; the calls stay in the conversation and go back to the
daemon with the next turn (less a call cut mid-arguments, which the daemon would refuse).

Two sources of calls: the page's own fetch replaced by a scripted stream, so that the test
decides where each chunk ends and looks between chunks; and the real daemon with the
Tools setting and `tool_choice: required`, where stories260k must call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.http.server import BackgroundServer
from tests.test_web_chat import (
    answered,
    api,
    chromium,
    open_page,
    send,
    settings,
    severe,
    start_server,
    wait,
)

pytestmark = pytest.mark.browser

from selenium.webdriver.common.by import By  # noqa: E402 (tests.test_web_chat skips without it)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# The page's fetch of /v1/chat/completions answered by a stream the test writes: __push(event)
# sends one SSE event, __end() the [DONE] and the end of the body; Stop ends it as it ends a
# real fetch. Each request's body is kept in __sent. Every other fetch (the machine panel) goes to the daemon.
SCRIPTED_STREAM = """
const real = window.fetch;
window.__sent = [];
window.fetch = (url, options) => {
  if (url !== "/v1/chat/completions") return real(url, options);
  window.__sent.push(JSON.parse(options.body));
  const encoder = new TextEncoder();
  let control;
  const body = new ReadableStream({ start(c) { control = c; } });
  window.__push = (event) => control.enqueue(encoder.encode(`data: ${JSON.stringify(event)}\\n\\n`));
  window.__end = () => { control.enqueue(encoder.encode("data: [DONE]\\n\\n")); control.close(); };
  // Stop aborts the request: the body errors, as a real fetch's does.
  options.signal.addEventListener("abort", () => control.error(new DOMException("", "AbortError")));
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""

# The page's fetch recorded (__sent) and passed on to the daemon.
RECORDED = """
const real = window.fetch;
window.__sent = [];
window.fetch = (url, options) => {
  if (url === "/v1/chat/completions") window.__sent.push(JSON.parse(options.body));
  return real(url, options);
};
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path) -> Iterator[BackgroundServer]:
    with start_server(stories_target, stories_draft) as srv:
        yield srv


def push(driver: Any, delta: dict[str, Any], finish: str | None = None) -> None:
    """One chunk as the daemon streams it (daemon/http/openai_responses.py)."""
    event: dict[str, Any] = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if finish:
        event["specd"] = {"tokens_per_second": 40.0, "tokens_per_target_pass": 2.0}
    driver.execute_script("window.__push(arguments[0])", event)


def call_start(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}  # fmt: skip


def fragment(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def shown_calls(answer: Any) -> list[tuple[str, str, str]]:
    """(index, name, arguments) of each call block in an answer, in page order."""
    return [
        (
            block.get_attribute("data-index"),
            block.find_element(By.CSS_SELECTOR, ".call-name").text,
            block.find_element(By.CSS_SELECTOR, ".call-arguments").get_attribute("textContent"),
        )
        for block in answer.find_elements(By.CSS_SELECTOR, ".call")
    ]


def whole(arguments: str) -> bool:
    try:
        json.loads(arguments)
        return True
    except ValueError:
        return False


def last_answer(driver: Any) -> Any:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def shows(driver: Any, expected: list[tuple[str, str, str]]) -> bool:
    return shown_calls(last_answer(driver)) == expected


def test_streamed_calls_render_by_index_and_go_back_with_the_next_turn(
    browser: Any, server: BackgroundServer
) -> None:
    open_page(browser, server.url)
    browser.execute_script(SCRIPTED_STREAM)
    send(browser, "Weather in Paris, and the time?")
    answered(browser, 1, state="streaming")
    push(browser, {"role": "assistant", "content": ""})
    push(browser, call_start(0, "call_a", "get_weather"))
    push(browser, fragment(0, '{"city":'))
    # Half an argument object is shown as it came.
    wait(browser, lambda d: shows(d, [("0", "get_weather", '{"city":')]))
    # A second call starts while the first is unfinished; each grows under its own index.
    push(browser, {"tool_calls": [call_start(1, "call_b", "get_time")["tool_calls"][0],
                                  fragment(0, '"Paris"}')["tool_calls"][0]]})  # fmt: skip
    pretty = '{\n  "city": "Paris"\n}'
    wait(browser, lambda d: shows(d, [("0", "get_weather", pretty), ("1", "get_time", "")]))
    push(browser, fragment(1, "{}"))
    push(browser, {}, finish="tool_calls")
    browser.execute_script("window.__end()")
    answer = answered(browser, 1)
    assert shown_calls(answer) == [("0", "get_weather", pretty), ("1", "get_time", "{}")]
    assert answer.find_element(By.CSS_SELECTOR, ".content").text == ""
    assert answer.find_element(By.CSS_SELECTOR, '[data-stat="tokens/s"] b').text == "40.0"

    # The next turn sends the calls back as the assistant's message.
    send(browser, "Thanks")
    answered(browser, 2, state="streaming")
    push(browser, {"content": "You are welcome."})
    push(browser, {}, finish="stop")
    browser.execute_script("window.__end()")
    answered(browser, 2)
    sent = browser.execute_script("return window.__sent")
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }  # fmt: skip
    assert "tools" not in sent[1]  # the Tools setting is empty: no tools offered

    # Kept in the browser: a reload shows the calls again.
    browser.refresh()
    answered(browser, 2)
    first = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[0]
    assert shown_calls(first) == [("0", "get_weather", pretty), ("1", "get_time", "{}")]
    assert severe(browser) == []


def test_a_call_stopped_mid_arguments_is_shown_but_not_sent_back(
    browser: Any, server: BackgroundServer
) -> None:
    open_page(browser, server.url)
    browser.execute_script(SCRIPTED_STREAM)
    send(browser, "Weather?")
    answered(browser, 1, state="streaming")
    push(browser, call_start(0, "call_a", "get_weather"))
    push(browser, fragment(0, '{"city":"Pa'))
    wait(browser, lambda d: shows(d, [("0", "get_weather", '{"city":"Pa')]))
    browser.find_element(By.ID, "stop").click()
    answered(browser, 1, state="stopped")
    assert shows(browser, [("0", "get_weather", '{"city":"Pa')])
    send(browser, "Never mind")
    answered(browser, 2, state="streaming")
    sent = browser.execute_script("return window.__sent")
    assert sent[1]["messages"][1] == {"role": "assistant", "content": ""}


def test_tools_that_are_not_a_json_list_are_said_and_nothing_is_sent(
    browser: Any, server: BackgroundServer
) -> None:
    open_page(browser, server.url)
    browser.execute_script(SCRIPTED_STREAM)
    settings(browser, tools='{"type": "function"}')
    send(browser, "Weather?")
    wait(browser, lambda d: d.find_element(By.ID, "notice").is_displayed())
    assert "Tools must be a JSON list" in browser.find_element(By.ID, "notice-text").text
    assert browser.execute_script("return window.__sent") == []
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Weather?"


def test_the_daemon_calls_a_tool_from_the_tools_setting(
    browser: Any, server: BackgroundServer
) -> None:
    open_page(browser, server.url)
    browser.execute_script(RECORDED)
    settings(
        browser, temperature="0", max_tokens="60", tools=json.dumps([WEATHER]),
        tool_choice="required",
    )  # fmt: skip
    send(browser, "Lily")
    answer = answered(browser, 1)
    sent = browser.execute_script("return window.__sent")
    assert sent[0]["tools"] == [WEATHER] and sent[0]["tool_choice"] == "required"
    # The same calls as the daemon's whole (non-streamed) greedy answer.
    request = {key: sent[0][key] for key in ("messages", "tools", "tool_choice", "max_tokens")}
    status, body = api(server.url + "/v1/chat/completions", {**request, "temperature": 0})
    assert status == 200
    calls = body["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)

    def pretty(arguments: str) -> str:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)

    def shown(arguments: str) -> str:
        return pretty(arguments) if whole(arguments) else arguments  # a call cut by max_tokens

    assert shown_calls(answer) == [
        (str(i), "get_weather", shown(c["function"]["arguments"])) for i, c in enumerate(calls)
    ]
    # The next turn carries the whole calls back, and the daemon takes it.
    settings(browser, tool_choice="none")
    send(browser, "And then?")
    answered(browser, 2)
    assert not browser.find_element(By.ID, "notice").is_displayed()
    sent = browser.execute_script("return window.__sent")
    back = sent[1]["messages"][1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in back["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in calls
        if whole(c["function"]["arguments"])
    ]
    assert severe(browser) == []


def test_reasoning_streams_apart_folds_when_the_answer_begins_and_goes_back(
    browser: Any, server: BackgroundServer
) -> None:
    """A reasoning model's `reasoning_content` (a Qwen3 think block, a harmony model's
    analysis): shown open above the answer while it streams, folded once the answer
    begins, kept over a reload and sent back with the next turn."""
    open_page(browser, server.url)
    browser.execute_script(SCRIPTED_STREAM)
    send(browser, "Is 7 prime?")
    answered(browser, 1, state="streaming")
    push(browser, {"role": "assistant", "content": ""})
    push(browser, {"reasoning_content": "Divisors of 7:"})
    push(browser, {"reasoning_content": " only 1 and 7."})

    def reasoning(d: Any) -> Any:
        found = last_answer(d).find_elements(By.CSS_SELECTOR, ".reasoning")
        return found[0] if found else None

    wait(browser, lambda d: reasoning(d) is not None
         and reasoning(d).get_attribute("open") is not None
         and "only 1 and 7." in reasoning(d).text)  # fmt: skip
    push(browser, {"content": "Yes."})
    wait(browser, lambda d: last_answer(d).find_element(By.CSS_SELECTOR, ".content").text == "Yes.")
    assert reasoning(browser).get_attribute("open") is None  # folded under the answer
    push(browser, {}, finish="stop")
    browser.execute_script("window.__end()")
    answer = answered(browser, 1)
    text = answer.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute("textContent")
    assert text == "Divisors of 7: only 1 and 7."

    send(browser, "And 9?")
    answered(browser, 2, state="streaming")
    push(browser, {"content": "No."})
    push(browser, {}, finish="stop")
    browser.execute_script("window.__end()")
    answered(browser, 2)
    sent = browser.execute_script("return window.__sent")
    assert sent[1]["messages"][1] == {
        "role": "assistant", "content": "Yes.", "reasoning_content": "Divisors of 7: only 1 and 7.",
    }  # fmt: skip
    browser.refresh()
    answered(browser, 2)
    first = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[0]
    shown = first.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute("textContent")
    assert shown == "Divisors of 7: only 1 and 7."
    assert severe(browser) == []
