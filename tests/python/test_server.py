"""deltafin serve, driven by the official `openai` and `anthropic` SDKs (and raw HTTP where the
SDKs cannot express the request).

Run by tests/python/run.sh, which starts the server on the tiny fixture model and sets
DELTAFIN_BASE_URL (http://127.0.0.1:PORT), DELTAFIN_MODEL and DELTAFIN_API_KEY. The server runs
with a small per-step delay so that concurrency and disconnect tests can overlap generations.
The fixture model has random weights: the tests check protocol and semantics, not prose.
"""

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from typing import Annotated, Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

BASE = os.environ["DELTAFIN_BASE_URL"].rstrip("/")
MODEL = os.environ["DELTAFIN_MODEL"]
KEY = os.environ["DELTAFIN_API_KEY"]
HOST = urllib.parse.urlparse(BASE)

# Keep generating after end-of-sequence (a deltafin extension) so that texts are long enough.
NO_EOS = {"ignore_eos": True}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


def raw(method, path, body=None, headers=None, timeout=60):
    """One HTTP request; returns (status, headers dict, parsed JSON or text)."""
    conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=timeout)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h.update(headers or {})
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read().decode("utf-8")
    conn.close()
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def metric(name):
    _, _, text = raw("GET", "/metrics")
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def assert_openai_error(data, status_hint=""):
    assert set(data) == {"error"}, data
    assert set(data["error"]) >= {"message", "type", "param", "code"}, data
    assert data["error"]["message"], status_hint


# ---------------------------------------------------------------- models, health, auth


def test_models(oa):
    ids = [m.id for m in oa.models.list().data]
    assert ids == [MODEL]
    m = oa.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("no-such-model")


def test_health_and_metrics_need_no_generation():
    assert raw("GET", "/health", headers={"Authorization": ""})[0] == 200
    status, headers, text = raw("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in [
        "deltafin_requests_total",
        "deltafin_prompt_tokens_total",
        "deltafin_completion_tokens_total",
        "deltafin_decode_tokens_per_second",
        "deltafin_expert_bytes_read_total",
        "deltafin_expert_cache_hit_rate",
    ]:
        assert f"# TYPE {name} " in text


def test_auth():
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad_an = anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_an.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert e.value.body["type"] == "error"
    status, _, data = raw("GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401
    assert_openai_error(data)


# ---------------------------------------------------------------- completions and chat


def test_completion_string_and_token_ids(oa):
    r = oa.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, extra_body=NO_EOS)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    r2 = oa.completions.create(model=MODEL, prompt=[0, 100, 200, 300], max_tokens=4, extra_body=NO_EOS)
    assert r2.usage.prompt_tokens == 4 and r2.usage.completion_tokens == 4


def test_chat_basic_and_content_parts(oa):
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, extra_body=NO_EOS)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    # Text parts are joined with "\n", as vLLM joins them for a string-content template.
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "who are you?"}]
    r2 = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=10, extra_body=NO_EOS
    )
    joined = [{"role": "user", "content": "Hello,\nwho are you?"}]
    r1 = oa.chat.completions.create(model=MODEL, messages=joined, max_tokens=10, extra_body=NO_EOS)
    assert r2.choices[0].message.content == r1.choices[0].message.content
    assert r2.usage.prompt_tokens == r1.usage.prompt_tokens
    # max_completion_tokens is honoured like max_tokens
    r3 = oa.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=3, extra_body=NO_EOS)
    assert r3.usage.completion_tokens == 3


def test_multi_turn_with_system_and_tool_messages(oa):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ]
    try:
        r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=NO_EOS)
        assert r.usage.completion_tokens == 4
    except openai.BadRequestError as e:
        # The fixture's minimal template cannot render a null content; that must be a 400.
        assert "template" in str(e)


def stream_chat(oa, **kw):
    chunks = list(oa.chat.completions.create(model=MODEL, stream=True, **kw))
    return chunks


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_matches_non_stream(oa, include_usage):
    kw = dict(messages=HELLO, max_tokens=12, extra_body=NO_EOS)
    full = oa.chat.completions.create(model=MODEL, **kw)
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = stream_chat(oa, **kw, **opts)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    # The chunk carrying finish_reason is the last content chunk (it has content).
    assert content_chunks[-1].choices[0].delta.content
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.choices for c in chunks)


def test_raw_stream_ends_with_done():
    conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=60)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": True, **NO_EOS}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [l[6:] for l in r.read().decode().splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        json.loads(e)  # every chunk is valid JSON (hence valid UTF-8)


def test_completion_stream_matches_non_stream(oa):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, extra_body=NO_EOS)
    full = oa.completions.create(**kw).choices[0].text
    chunks = list(oa.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 12


def ascii_window(text, n=3):
    for i in range(2, len(text) - n):
        w = text[i:i + n]
        if w.isascii() and w.strip() == w and w.isprintable() and text.find(w) == i:
            return i, w
    return None


def test_stop_strings(oa):
    base = oa.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=30, extra_body=NO_EOS)
    text = base.choices[0].text
    found = ascii_window(text)
    assert found, f"no usable stop window in {text!r}"
    i, stop = found
    r = oa.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=30, stop=[stop, "\u2603never"],
                              extra_body=NO_EOS)
    assert r.choices[0].text == text[:i]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oa.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=30, stop=stop,
                                        stream=True, extra_body=NO_EOS))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text[:i]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat, streamed: the stop string never leaks, not even partially at the end
    full = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, extra_body=NO_EOS)
    ctext = full.choices[0].message.content
    found = ascii_window(ctext)
    assert found
    j, cstop = found
    chunks = stream_chat(oa, messages=HELLO, max_tokens=30, stop=cstop, extra_body=NO_EOS)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == ctext[:j]


def test_seeded_sampling(oa):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, top_p=0.95, extra_body=NO_EOS)
    a = oa.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = oa.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {oa.chat.completions.create(seed=s, **kw).choices[0].message.content for s in range(1, 6)}
    assert len(others | {a}) > 1, "different seeds should give different samples"
    # top_k restricts: with top_k=1 sampling is greedy
    greedy = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, extra_body=NO_EOS)
    k1 = oa.chat.completions.create(seed=9, **{**kw, "extra_body": {**NO_EOS, "top_k": 1}})
    assert k1.choices[0].message.content == greedy.choices[0].message.content
    # temperature 0 is greedy and deterministic
    t0 = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0, extra_body=NO_EOS)
    assert t0.choices[0].message.content == greedy.choices[0].message.content


def test_chat_logprobs(oa):
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=5,
                                   extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.token == t.top_logprobs[0].token  # greedy picks the most likely
        assert abs(t.logprob - lps[0]) < 1e-6
    chunks = stream_chat(oa, messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_completion_logprobs(oa):
    r = oa.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=3, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("body,needle", [
    ({"model": MODEL, "messages": []}, "at least one message"),
    ({"model": MODEL, "messages": HELLO, "n": 2}, "n"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": "ten"}, "invalid type"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, "at least 1"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": -5}, "at least 1"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 100000}, "maximum context length"),
    ({"model": MODEL, "messages": HELLO, "temperature": 7}, "temperature"),
    ({"model": MODEL, "messages": HELLO, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": MODEL, "messages": HELLO, "stop": [""]}, "stop"),
    ({"messages": HELLO}, "model"),
])
def test_chat_client_errors_are_400(body, needle):
    status, _, data = raw("POST", "/v1/chat/completions", body)
    assert status == 400, data
    assert_openai_error(data)
    assert needle in data["error"]["message"] or data["error"]["param"] == needle


@pytest.mark.parametrize("body,needle", [
    ({"model": MODEL, "prompt": ""}, "empty"),
    ({"model": MODEL, "prompt": []}, "empty"),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 6]}, "out of range"),
    ({"model": MODEL, "prompt": [1, -2]}, "out of range"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
])
def test_completion_client_errors_are_400(body, needle):
    status, _, data = raw("POST", "/v1/completions", body)
    assert status == 400, data
    assert_openai_error(data)
    assert needle in data["error"]["message"]


def test_malformed_json_unknown_fields_and_sdk_errors(oa):
    status, _, data = raw("POST", "/v1/chat/completions", b"{not json")
    assert status == 400
    assert_openai_error(data)
    status, _, data = raw("POST", "/v1/chat/completions", b"[1, 2]")
    assert status == 400
    # unknown fields are ignored
    status, _, data = raw("POST", "/v1/chat/completions",
                          {"model": MODEL, "messages": HELLO, "max_tokens": 2, "frobnicate": {"x": 1}})
    assert status == 200, data
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1000)
    assert "128" in e.value.message  # says the limit


def test_body_over_limit_is_413():
    # The server answers from the declared Content-Length, before the body arrives, and closes
    # the connection (a client still sending then gets a broken pipe): send the headers and a
    # few bytes only, then read the answer.
    s = socket.create_connection((HOST.hostname, HOST.port), timeout=10)
    s.sendall(
        (
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {3 << 20}\r\n\r\n"
        ).encode()
        + b'{"model": "'
    )
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"413", head
    assert b'"error"' in body, body


def test_unknown_route_is_404_json():
    status, _, data = raw("GET", "/v1/nothing")
    assert status == 404
    assert_openai_error(data)


# ---------------------------------------------------------------- Anthropic Messages


def test_anthropic_messages(an):
    m = an.messages.create(model=MODEL, max_tokens=10, system="Be brief.", messages=HELLO)
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 10
    with an.messages.stream(model=MODEL, max_tokens=10, system="Be brief.", messages=HELLO) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_anthropic_event_sequence(an):
    events = [e.type for e in an.messages.create(model=MODEL, max_tokens=6, messages=HELLO, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) <= {"content_block_delta"}
    # ping is sent (the SDK skips it); check it on the wire
    conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=60)
    conn.request("POST", "/v1/messages",
                 json.dumps({"model": MODEL, "max_tokens": 3, "messages": HELLO, "stream": True}),
                 {"x-api-key": KEY, "content-type": "application/json"})
    names = [l[7:] for l in conn.getresponse().read().decode().splitlines() if l.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "message_stop"


def test_anthropic_stop_sequence(an):
    base = an.messages.create(model=MODEL, max_tokens=30, messages=HELLO)
    text = base.content[0].text
    found = ascii_window(text)
    if not found:
        pytest.skip(f"no ASCII window in {text!r}")
    i, stop = found
    m = an.messages.create(model=MODEL, max_tokens=30, messages=HELLO, stop_sequences=[stop])
    assert m.content[0].text == text[:i]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_anthropic_errors(an):
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="claude-x", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    status, _, data = raw("POST", "/v1/messages", {"model": MODEL, "messages": HELLO},
                          headers={"x-api-key": KEY, "Authorization": ""})
    assert status == 400 and data["type"] == "error" and "max_tokens" in data["error"]["message"]


def test_anthropic_tools_thinking_and_count_tokens(an):
    tools = [{"name": "get_weather", "description": "Wetter für eine Stadt",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    kw = dict(model=MODEL, messages=HELLO, tools=tools)
    m = an.messages.create(max_tokens=6, tool_choice={"type": "auto"},
                           thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    n = an.messages.count_tokens(**kw)
    assert n.input_tokens == m.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(max_tokens=6, tool_choice={"type": "tool", "name": "nope"}, **kw)
    assert "tool_choice" in e.value.body["error"]["message"]


# ---------------------------------------------------------------- structured output
# The fixture model has random weights and a context of 128 tokens: the schemas bound every
# value so that the grammar's end comes within a short reply.

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 4},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    city: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=4)]
    unit: Literal["c", "f"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def test_response_format_json_schema_and_object(oa):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}}
    for kw in ({}, {"temperature": 1.0, "seed": 11}):
        r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=80, response_format=fmt, **kw)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    # The SDK's typed helper: a pydantic model's schema in, an instance of it out.
    parsed = oa.chat.completions.parse(model=MODEL, messages=HELLO, max_tokens=80, response_format=City)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and 1 <= len(city.city) <= 4 and city.unit in ("c", "f")
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=80,
                                   response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/x.json"}}})
    assert e.value.body["param"] == "response_format"


@pytest.mark.parametrize("choice,name", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
])
def test_openai_forced_tool_call(oa, choice, name):
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100, tools=TOOLS,
                                   tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", r
    (call,) = c.message.tool_calls
    assert name is None or call.function.name == name
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), params)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use(an, choice):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    m = an.messages.create(model=MODEL, messages=HELLO, max_tokens=100, tools=tools,
                           tool_choice={**choice, "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert choice["type"] == "any" or use.name == "get_weather"
    schema = {t["name"]: t["input_schema"] for t in tools}[use.name]
    jsonschema.validate(use.input, schema)


def test_anthropic_multi_turn_tool_use_and_tool_result(an):
    """A conversation that echoes the model's thinking and tool_use back with a tool_result
    (the SDK's agent loop) is accepted and its turns reach the template (more prompt tokens than
    the first turn alone; count_tokens agrees). Byte-identity with transformers on real
    templates: crates/deltafin-server/src/chat_messages.rs."""
    tools = [{"name": "get_weather", "description": "Wetter für eine Stadt — 天気",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    first = [{"role": "user", "content": "Weather in Zürich?"}]
    turns = first + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 °C"}]}]},
    ]
    m = an.messages.create(model=MODEL, max_tokens=4, tools=tools, messages=turns)
    assert m.type == "message"
    short = an.messages.count_tokens(model=MODEL, tools=tools, messages=first).input_tokens
    assert m.usage.input_tokens > short
    assert an.messages.count_tokens(model=MODEL, tools=tools, messages=turns).input_tokens == m.usage.input_tokens


def test_openai_reasoning_effort_and_template_kwargs(oa):
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, reasoning_effort="high",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                   extra_body={"chat_template_kwargs": "x"})
    assert e.value.body["param"] == "chat_template_kwargs"


# ---------------------------------------------------------------- scheduling, cancellation, reuse


def test_twenty_concurrent_requests_one_runs_two_queue():
    # run.sh starts the server with --max-queue 2: one generation runs, two wait their turn in
    # arrival order, the other 17 get 429 at once, OpenAI- or Anthropic-shaped by endpoint.
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 80, **NO_EOS}
    msgs = {"model": MODEL, "messages": HELLO, "max_tokens": 80}
    barrier = threading.Barrier(20)
    results = [None] * 20

    def go(k):
        barrier.wait()
        if k % 2:
            results[k] = ("anthropic", raw("POST", "/v1/messages", msgs,
                                           headers={"x-api-key": KEY, "Authorization": ""}))
        else:
            results[k] = ("openai", raw("POST", "/v1/chat/completions", chat))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r[1][0] for r in results)
    assert statuses.count(200) == 3, statuses
    assert statuses.count(429) == 17, statuses
    for kind, (status, headers, data) in results:
        if status == 429:
            assert "retry-after" in headers
            if kind == "openai":
                assert_openai_error(data)
                assert data["error"]["type"] == "rate_limit_error"
            else:
                assert data["type"] == "error" and data["error"]["type"] == "rate_limit_error"
    assert raw("GET", "/health")[0] == 200
    assert raw("POST", "/v1/chat/completions", {**chat, "max_tokens": 2})[0] == 200


def test_models_health_metrics_answer_during_generation(oa):
    stream = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=80, stream=True, extra_body=NO_EOS)
    it = iter(stream)
    next(it)
    t0 = time.time()
    assert raw("GET", "/health")[0] == 200
    assert raw("GET", "/v1/models")[0] == 200
    assert raw("GET", "/metrics")[0] == 200
    assert metric("deltafin_generation_active") == 1
    assert metric("deltafin_queue_depth") == 0
    assert time.time() - t0 < 2
    # A second request waits its turn (the queue) and is answered after the running one.
    status, _, data = raw("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 200 and data["choices"][0]["finish_reason"] in ("stop", "length")
    rest = "".join(c.choices[0].delta.content or "" for c in it if c.choices)
    assert isinstance(rest, str)


def test_disconnect_cancels_generation():
    cancelled = metric("deltafin_generations_cancelled_total")
    tokens_before = metric("deltafin_completion_tokens_total")
    conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=60)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 100, "stream": True, **NO_EOS}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()  # first event
    conn.sock.shutdown(2)
    conn.close()
    # The next request starts at once (no 429).
    t0 = time.time()
    status, _, data = raw("POST", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert status == 200, data
    assert time.time() - t0 < 2
    assert metric("deltafin_generations_cancelled_total") == cancelled + 1
    # The cancelled generation stopped early: far fewer than its 100 tokens were produced.
    assert metric("deltafin_completion_tokens_total") - tokens_before < 100


def test_conversation_reuse_is_exact(oa):
    turn1 = [{"role": "user", "content": "Tell me about the sea."}]
    a1 = oa.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8, extra_body=NO_EOS)
    turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "And the mountains?"}]
    reused = oa.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, extra_body=NO_EOS)
    assert reused.usage.prompt_tokens_details.cached_tokens > 5
    # A fresh run of the same request: first push something unrelated through the cache.
    oa.completions.create(model=MODEL, prompt=[300, 301, 302], max_tokens=1)
    fresh = oa.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, extra_body=NO_EOS)
    assert fresh.usage.prompt_tokens_details.cached_tokens <= 1
    assert fresh.choices[0].message.content == reused.choices[0].message.content
    assert metric("deltafin_prompt_tokens_reused_total") > 0
