"""Property-based fuzzing of the request schema, driven by the server's own OpenAPI document.

Bodies are drawn from the JSON schemas /openapi.json publishes (so a field added to the
schema is fuzzed without touching this file), then some fields are swapped for arbitrary
JSON and unknown keys are added. Properties, over real HTTP:

- a body the document accepts is never refused as malformed (no 422) and never a 500;
- any body gets 200 or an OpenAI-shaped 4xx error, and the server keeps answering;
- a 200 is a well-formed completion (or an SSE stream ending in [DONE]) whose usage adds up.

Bounded: a fixed number of examples and an engine whose context holds 48 tokens, so no
generation is long (about a minute in all on two busy cores).
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgespec
from edgespec.server import create_app
from tests.http_server import running

KEY = "sk-fuzz"
MODEL = "edgespec-demo"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERRORS = {400, 404, 413, 422}


@pytest.fixture(scope="module")
def server():
    with running(create_app(edgespec.load(context=48), MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def schemas(server):
    doc = httpx.get(f"{server}/openapi.json", headers=AUTH).json()
    return doc["components"]["schemas"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values valid under one JSON schema, as FastAPI writes them (a small subset)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -2 ** 70 - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2 ** 70 + 1) - 1)
        if "exclusiveMaximum" in schema:  # 2^64 written as a float
            high = math.ceil(schema["exclusiveMaximum"]) - 1
        return st.integers(math.ceil(low), math.floor(high))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return st.text(max_size=min(schema.get("maxLength", 24), 24))
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs) if schema.get("items") else json_values
        return st.lists(items, min_size=schema.get("minItems", 0),
                        max_size=max(schema.get("minItems", 0), 3))
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        props = schema["properties"]
        return st.fixed_dictionaries(
            {k: from_schema(v, defs) for k, v in props.items() if k in required},
            optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    if kind == "object":
        return st.dictionaries(st.text(max_size=6),
                               from_schema(schema.get("additionalProperties") or {}, defs)
                               if isinstance(schema.get("additionalProperties"), dict)
                               and schema["additionalProperties"] else json_values,
                               max_size=3)
    return json_values


# fields whose every non-default value is refused (400): usually left out, so that many
# bodies get as far as generating, streamed or not
REFUSED = ("n", "frequency_penalty", "presence_penalty", "logit_bias", "best_of", "echo",
           "suffix", "tools", "functions", "response_format", "stream_options")


def body(schemas, name: str):
    """A schema-valid body, usually for the model actually served."""
    def finish(b, model, keep):
        return {k: v for k, v in {**b, "model": model}.items()
                if k not in REFUSED or k in keep}

    return from_schema(schemas[name], schemas).flatmap(
        lambda b: st.builds(finish, st.just(b), st.sampled_from([MODEL] * 3 + [b["model"]]),
                            st.sets(st.sampled_from(REFUSED), max_size=1)
                            | st.just(set(REFUSED))))


def check_response(r: httpx.Response, stream: bool) -> None:
    assert r.status_code == 200 or r.status_code in ERRORS, (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]
        return
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
        return
    out = r.json()
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def send(server, path, payload):
    stream = isinstance(payload, dict) and payload.get("stream") is True
    r = httpx.post(f"{server}{path}", content=json.dumps(payload), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    check_response(r, stream)
    return r


FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path,name", [("/v1/chat/completions", "ChatRequest"),
                                       ("/v1/completions", "CompletionRequest")])
def test_schema_valid_bodies_are_never_malformed(server, schemas, path, name):
    @FUZZ
    @given(payload=body(schemas, name))
    def check(payload):
        r = send(server, path, payload)
        assert r.status_code != 422, r.text

    check()


@pytest.mark.parametrize("path,name", [("/v1/chat/completions", "ChatRequest"),
                                       ("/v1/completions", "CompletionRequest")])
def test_mutated_bodies_get_openai_errors(server, schemas, path, name):
    fields = list(schemas[name]["properties"])

    @FUZZ
    @given(base=body(schemas, name),
           swaps=st.dictionaries(st.sampled_from(fields), json_values, max_size=3),
           extra=st.dictionaries(st.text(max_size=6), json_values, max_size=2),
           whole=st.one_of(st.none(), json_values))
    def check(base, swaps, extra, whole):
        send(server, path, whole if whole is not None else {**base, **extra, **swaps})

    check()
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
