"""The chat page that `edgespec serve` serves at /, in a real headless Chromium (Debian's
chromium and chromium-driver, driven by selenium; nothing is downloaded at test time).

A person's session: open the page, meet the API key prompt, type a question, watch the
answer stream in with its stats, change mode and temperature, press Stop mid-answer.
"""

from __future__ import annotations

import shutil

import httpx
import pytest

import edgespec
from edgespec.server import create_app
from tests.http_server import running, slowed

KEY = "sk-web-42"
MODEL = "edgespec-demo"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
QUESTION = "Write a Python function `add`: Add two numbers."


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("the web page test needs Debian's chromium and chromium-driver: "
                    "apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1000,700",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    """A target slowed to 10 ms a pass, so that Stop lands mid-answer."""
    with running(create_app(slowed(edgespec.load()), MODEL, api_key=KEY)) as url:
        yield url


def wait(driver, condition, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())


def by_id(driver, name):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def answers(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def messages(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".message")


def ask(driver, question):
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


def settings(driver, mode, temperature, max_tokens):
    from selenium.webdriver.support.ui import Select

    Select(by_id(driver, "mode")).select_by_value(mode)
    for name, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        field = by_id(driver, name)
        field.clear()
        field.send_keys(str(value))


def opened(driver, server, max_tokens):
    """The page, connected with the key, greedy AR answers of `max_tokens`."""
    driver.get(server + "/")
    wait(driver, lambda: "edgespec-demo on cpu" in by_id(driver, "model").text)
    if not by_id(driver, "api-key").get_attribute("value"):
        by_id(driver, "api-key").send_keys(KEY)
    by_id(driver, "prompt").click()  # the key field's change event stores it
    settings(driver, "ar", 0, max_tokens)


def test_chat_page_streams_answers_with_stats_and_stops(browser, server, engine):
    browser.get(server + "/")
    wait(browser, lambda: "edgespec-demo on cpu" in by_id(browser, "model").text)
    wait(browser, lambda: "API key" in by_id(browser, "error").text)  # it says what it needs

    settings(browser, "spec", 0, 24)
    ask(browser, QUESTION)  # without the key: refused, and the page says why
    wait(browser, lambda: "API key" in by_id(browser, "error").text and
         browser.find_element("css selector", "body").get_attribute("data-state") == "idle")
    assert answers(browser) == [] and messages(browser) == []  # nothing half-shown
    assert by_id(browser, "prompt").get_attribute("value") == QUESTION  # back, to resend
    by_id(browser, "prompt").clear()
    by_id(browser, "api-key").send_keys("sk-wrong")
    by_id(browser, "prompt").click()
    ask(browser, QUESTION)
    wait(browser, lambda: "did not accept this API key" in by_id(browser, "error").text)
    by_id(browser, "prompt").clear()
    by_id(browser, "api-key").clear()

    by_id(browser, "api-key").send_keys(KEY)
    by_id(browser, "prompt").click()  # the key field's change event stores it
    ask(browser, QUESTION)
    wait(browser, lambda: answers(browser) and "tok/s" in
         answers(browser)[-1].find_element("css selector", ".stats").text)
    answer = answers(browser)[-1]
    want = engine.generate(engine.tokenizer.encode_chat(
        [{"role": "user", "content": QUESTION}]), max_new_tokens=24, mode="ar")
    assert answer.find_element("css selector", ".text").get_attribute("textContent") == want.text
    assert int(answer.get_attribute("data-chunks")) > 1  # it arrived in pieces
    stats = answer.find_element("css selector", ".stats").text
    assert f"{len(want.token_ids)} tokens" in stats and "tokens/pass" in stats
    assert "acceptance" in stats and "[spec, cpu]" in stats

    settings(browser, "ar", 0.8, 2000)  # mode and temperature reach the server
    before = httpx.get(f"{server}/health").json()
    ask(browser, "Write a long Python module.")
    wait(browser, lambda: len(answers(browser)) == 2 and
         int(answers(browser)[-1].get_attribute("data-chunks")) >= 3)
    by_id(browser, "stop").click()
    wait(browser, lambda: answers(browser)[-1].find_element("css selector", ".stats").text
         == "stopped")
    wait(browser, lambda: not httpx.get(f"{server}/health").json()["busy"])
    after = httpx.get(f"{server}/health").json()
    assert after["cancelled"] == before["cancelled"] + 1  # the server stopped generating

    # the conversation goes on after a Stop; a short answer, since at T=0.8 an unbounded one
    # can fill the demo's 512-token context and leave no room for the next question
    settings(browser, "ar", 0.8, 24)
    ask(browser, "and now?")
    wait(browser, lambda: len(answers(browser)) == 3 and
         "[ar, cpu]" in answers(browser)[-1].find_element("css selector", ".stats").text)

    settings(browser, "ar", 0.8, 2000)
    ask(browser, "Write a long Python module.")  # "New chat" in the middle of an answer
    wait(browser, lambda: len(answers(browser)) == 4 and
         int(answers(browser)[-1].get_attribute("data-chunks")) >= 3)
    by_id(browser, "new-chat").click()
    wait(browser, lambda: browser.find_element("css selector", "body")
         .get_attribute("data-state") == "idle")
    assert messages(browser) == [] and browser.execute_script("return state.history") == []
    settings(browser, "ar", 0, 8)
    ask(browser, QUESTION)  # the new conversation holds none of the old answer
    wait(browser, lambda: answers(browser) and "[ar, cpu]" in
         answers(browser)[-1].find_element("css selector", ".stats").text)
    assert [m["role"] for m in browser.execute_script("return state.history")] == [
        "user", "assistant"]
    assert not [e for e in browser.get_log("browser") if "favicon" in e["message"]]


def test_a_conversation_longer_than_the_context_is_told_to_start_over(browser, server):
    """The demo holds 512 tokens: a first message too long for it is to be shortened; a
    conversation that outgrows it, to be started afresh."""
    opened(browser, server, max_tokens=8)
    long = "x = 1; " * 200  # ~810 tokens
    ask(browser, long)
    wait(browser, lambda: "Shorten your message" in by_id(browser, "error").text)
    assert "context holds 512" in by_id(browser, "error").text
    assert answers(browser) == [] and by_id(browser, "prompt").get_attribute("value") == long
    by_id(browser, "prompt").clear()
    ask(browser, "x = 1; " * 100)  # ~410 tokens and its answer of 8: it fits
    wait(browser, lambda: answers(browser) and "[ar, cpu]" in
         answers(browser)[-1].find_element("css selector", ".stats").text)
    ask(browser, "x = 1; " * 30)  # not beside the first
    wait(browser, lambda: "start a new chat" in by_id(browser, "error").text)
    assert len(answers(browser)) == 1


def test_text_goes_as_typed_an_input_method_enter_is_no_send_and_fields_are_checked(
        browser, server):
    opened(browser, server, max_tokens=4)
    enter = ("const p = document.getElementById('prompt'); p.value = arguments[0];"
             "p.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true,"
             "cancelable: true, isComposing: arguments[1]}));")
    browser.execute_script(enter, "にほんご", True)  # Enter confirms the composition
    assert messages(browser) == [] and by_id(browser, "prompt").get_attribute(
        "value") == "にほんご"
    code = "    def f():\n        return 1\n"
    browser.execute_script(enter, code, False)
    wait(browser, lambda: answers(browser) and "[ar, cpu]" in
         answers(browser)[-1].find_element("css selector", ".stats").text)
    sent = browser.execute_script("return document.querySelector('.message.user .text')"
                                  ".textContent")
    assert sent == code  # its indentation kept, as the terminal chat keeps it
    by_id(browser, "temperature").clear()  # an empty field is not a temperature of 0
    browser.execute_script(enter, "and now?", False)
    wait(browser, lambda: "Temperature must be a number" in by_id(browser, "error").text)
    assert len(answers(browser)) == 1


def test_a_model_without_a_chat_template_is_said_at_once(browser, tmp_path, demo_target):
    import json

    from edgespec.export import export

    plain = shutil.copytree(demo_target, tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    export(plain, tmp_path / "b", precision="fp32")
    with running(create_app(edgespec.load(tmp_path / "b"), MODEL)) as url:
        browser.get(url + "/")
        wait(browser, lambda: "no chat template" in by_id(browser, "error").text)
        assert not by_id(browser, "send").is_enabled()  # it never looks ready to chat
        by_id(browser, "new-chat").click()  # it cleared the banner, and Send was on
        assert "no chat template" in by_id(browser, "error").text
        assert not by_id(browser, "send").is_enabled()
        browser.execute_script("document.getElementById('error').textContent = ''")
        ask(browser, QUESTION)  # Enter still submits: told again
        wait(browser, lambda: "no chat template" in by_id(browser, "error").text)
        sent = browser.execute_script("return performance.getEntriesByType('resource')"
                                      ".filter(e => e.name.endsWith('/v1/chat/completions'))"
                                      ".length")
        assert sent == 0 and messages(browser) == []  # told before any request


def test_page_assets_ship_in_the_package():
    from importlib.resources import files

    web = files("edgespec") / "web"
    assert {p.name for p in web.iterdir()} >= {"index.html", "app.js", "style.css"}
    for name in ("index.html", "app.js", "style.css"):
        text = (web / name).read_text()
        assert "://" not in text  # no CDN, no remote fonts: it works offline
