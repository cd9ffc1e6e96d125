"""The OpenAI-compatible server over real HTTP: the official `openai` client, raw
requests for every kind of bad input, and a client that walks away mid-stream."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from edgespec.server import create_app

KEY = "sk-test-123"
MODEL = "edgespec-demo"


@pytest.fixture(scope="module")
def server(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(engine, MODEL, api_key=KEY), host="127.0.0.1",
                            port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_chat_completion_equals_the_engine(client, engine):
    messages = [{"role": "user", "content": "Write a Python function `add`: Add numbers."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                       temperature=0)
    want = engine.generate(engine.tokenizer.encode_chat(messages), max_new_tokens=24)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["edgespec"]
    assert stats["mode"] == "spec" and stats["target_passes"] >= 1


def test_a_begun_answer_is_continued_with_continue_final_message(client, engine):
    messages = [{"role": "user", "content": "Write a Python function `add`: Add numbers."},
                {"role": "assistant", "content": "def add("}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0,
                                       extra_body={"continue_final_message": True})
    want = engine.generate(engine.tokenizer.encode_chat(messages, continue_final=True),
                           max_new_tokens=16)
    assert r.choices[0].message.content == want.text
    closed = engine.generate(engine.tokenizer.encode_chat(messages), max_new_tokens=16)
    assert want.token_ids != closed.token_ids  # a continuation, not a new turn
    with pytest.raises(openai.BadRequestError, match="the last message must be the assistant"):
        client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4,
                                       extra_body={"continue_final_message": True})


def test_chat_streaming(client):
    kwargs = dict(model=MODEL, max_tokens=32, temperature=0,
                  messages=[{"role": "user", "content": "Write a Python function `f`."}])
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    chunks = [c for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completion_with_stop_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                  max_tokens=40, temperature=0)
    text = r.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                    max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=MODEL, prompt="import", max_tokens=16,
                                      temperature=0.9, seed=5).choices[0].text
            for _ in range(2))
    assert a == b


def test_a_completion_without_max_tokens_stops_at_16_as_openais(client):
    r = client.completions.create(model=MODEL, prompt="def quicksort(items):", temperature=0)
    longer = client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                       temperature=0, max_tokens=40)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert longer.usage.completion_tokens > 16
    assert longer.choices[0].text.startswith(r.choices[0].text)


def test_top_k_reaches_the_sampler_and_other_servers_extras_are_refused(client, engine):
    """top_k, which vLLM and llama.cpp's server take beyond OpenAI's fields, samples from
    the k best tokens: k = 1 at a high temperature is the greedy answer, for any seed.
    Their other sampling settings are refused unless neutral, never ignored."""
    greedy = engine.generate("def quicksort(items):", max_new_tokens=24, mode="ar").text
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                      max_tokens=24, temperature=1.5, seed=seed,
                                      extra_body={"top_k": 1})
        assert r.choices[0].text == greedy
    hot = {client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                     max_tokens=24, temperature=1.5, seed=seed,
                                     extra_body={"top_k": -1}).choices[0].text
           for seed in range(3)}
    assert hot != {greedy}  # -1 (their "off"), as without top_k: the temperature is felt
    for extra in ({"min_p": 0.1}, {"repetition_penalty": 1.2}, {"ignore_eos": True}):
        with pytest.raises(openai.BadRequestError, match=f"{next(iter(extra))} is not"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                      extra_body=extra)
    neutral = client.completions.create(model=MODEL, prompt="def quicksort(items):",
                                        max_tokens=24, temperature=0,
                                        extra_body={"min_p": 0, "repetition_penalty": 1})
    assert neutral.choices[0].text == greedy


def test_completion_streaming(client):
    stream = client.completions.create(model=MODEL, prompt="class A:", max_tokens=20,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    whole = client.completions.create(model=MODEL, prompt="class A:", max_tokens=20,
                                      temperature=0).choices[0].text
    assert text == whole


def post(server, path, body=None, content=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{server}{path}", json=body, content=content, headers=headers,
                      timeout=60)


@pytest.mark.parametrize("kwargs,status,fragment", [
    (dict(content=b"{not json", key=KEY), 400, "not valid JSON"),
    (dict(content=b"[1, 2]", key=KEY), 400, "must be a JSON object"),
    (dict(body={"model": MODEL, "messages": "hi"}), 422, "messages"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "temperature": "hot"}), 422, "temperature"),
    (dict(body={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), 422,
     "role"),
    (dict(body={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404,
     "gpt-9"),
    # the model first, whatever else the request asks (it was a 400 about n, or about a
    # base model's missing chat template)
    (dict(body={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}], "n": 3}),
     404, "gpt-9"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}),
     400, "n=1"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, key=None),
     401, "API key"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
          key="wrong"), 401, "API key"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": None}]}), 400,
     "needs its content"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "required"}), 400, "tool_choice needs tools"),
    (dict(content=b"x" * (2 << 20)), 413, "body over"),
    (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x = 1\n" * 700}]}),
     400, "context"),
])
def test_bad_requests_get_openai_errors(server, kwargs, status, fragment):
    r = post(server, "/v1/chat/completions", **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]
    assert httpx.get(f"{server}/health").status_code == 200  # still serving


def test_a_json_body_without_its_content_type_is_told_which_header_to_send(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    for headers in ({}, {"Content-Type": "text/plain"}):
        r = httpx.post(f"{server}/v1/chat/completions", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", **headers})
        assert r.status_code == 400
        assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_the_bearer_scheme_is_read_in_any_case_and_the_key_exactly(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for scheme, status in (("bearer ", 200), ("BEARER ", 200), ("Bearer  ", 200),
                           ("Bearer\t", 200), ("Basic ", 401), ("Bearer", 401)):
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"{scheme}{KEY}"})
        assert r.status_code == status, (scheme, r.text)
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY.upper()}"})
    assert r.status_code == 401


def test_unknown_route_is_a_json_404(server):
    r = httpx.get(f"{server}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_cancels_and_server_keeps_serving(server, client):
    def health():
        return httpx.get(f"{server}/health").json()

    before = health()["cancelled"]
    body = {"model": MODEL, "prompt": "def main(", "temperature": 0, "stream": True,
            "mode": "ar", "max_tokens": 1 << 20}  # cut to the context's room: a long run
    with httpx.stream("POST", f"{server}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    deadline = time.time() + 30
    while health()["busy"] and time.time() < deadline:
        time.sleep(0.05)
    assert health()["cancelled"] == before + 1  # stopped, not run to the end
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
