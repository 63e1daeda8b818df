"""Tool calls, reasoning and content end to end, from a model whose greedy output is known.

Run by tests/python/run.sh against a second server on tests/fixtures/scripted/qwen_tools (see
its make_scripted.py): a DeepSeek-V3-architecture checkpoint whose layers add nothing and whose
`lm_head` maps each token of a chain to its successor, so that after the chat template's
generation prompt it always writes, in Qwen3's real markup,

    <think>\\nLet me check the weather first.\\n</think>\\n\\nSure, checking Paris now.\\n
    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call><|im_end|>

The tests check that the official SDKs (and LangChain) get that back as reasoning, content and
a `get_weather` call, non-streaming and streaming. Environment: DELTAFIN_SCRIPTED_BASE_URL,
DELTAFIN_SCRIPTED_MODEL, DELTAFIN_API_KEY.
"""

import json
import os

import langchain_openai
from langchain_core.tools import tool

BASE = os.environ["DELTAFIN_SCRIPTED_BASE_URL"].rstrip("/")
MODEL = os.environ["DELTAFIN_SCRIPTED_MODEL"]
KEY = os.environ["DELTAFIN_API_KEY"]

REASONING = "Let me check the weather first."
CONTENT = "Sure, checking Paris now."
ARGS = {"city": "Paris"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OA_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": PARAMS}}]
AN_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}]
THINKING = {"type": "enabled", "budget_tokens": 1024}
# The Anthropic SDK takes no `temperature` with thinking on; the default sampling still follows
# the chain (the next token's logit leads the others by 80).


def extra(obj, name):
    """A field the SDK's types do not declare (e.g. `reasoning_content`), or None."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


# ---------------------------------------------------------------- OpenAI


def test_openai_tool_call_reasoning_and_content(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=OA_TOOLS, max_tokens=64, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", r
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    assert extra(c.message, "reasoning_content").strip() == REASONING
    assert c.message.content.strip() == CONTENT
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"):
        assert marker not in c.message.content


def test_openai_stream_tool_call_reasoning_and_content(oa):
    stream = oa.chat.completions.create(model=MODEL, messages=ASK, tools=OA_TOOLS, max_tokens=64,
                                        temperature=0, stream=True)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        reasoning += extra(d, "reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # OpenAI streams the id and the name in a call's first delta.
                assert tc.id and tc.function.name, chunk
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning.strip() == REASONING
    assert content.strip() == CONTENT
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == ARGS


def test_openai_tool_markup_stays_text_without_tools(oa):
    # No `tools` in the request: the call is not extracted (the markup is the model's text),
    # the reasoning still is.
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert extra(c.message, "reasoning_content").strip() == REASONING
    assert CONTENT in c.message.content and '"get_weather"' in c.message.content


# ---------------------------------------------------------------- Anthropic


def check_blocks(m):
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"], m
    thinking, text, use = m.content
    assert thinking.thinking.strip() == REASONING
    assert text.text.strip() == CONTENT
    assert use.name == "get_weather" and use.input == ARGS and use.id


def test_anthropic_thinking_text_and_tool_use(an):
    m = an.messages.create(model=MODEL, messages=ASK, tools=AN_TOOLS, max_tokens=64, thinking=THINKING)
    check_blocks(m)


def test_anthropic_stream_thinking_text_and_tool_use(an):
    kinds = set()
    with an.messages.stream(model=MODEL, messages=ASK, tools=AN_TOOLS, max_tokens=64, thinking=THINKING) as s:
        for ev in s:
            if ev.type == "content_block_delta":
                kinds.add(ev.delta.type)
        m = s.get_final_message()
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= kinds, kinds
    check_blocks(m)


# ---------------------------------------------------------------- LangChain


def test_langchain_bind_tools_gets_a_tool_call():
    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key=KEY, temperature=0,
                                      max_tokens=64, max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert msg.tool_calls, msg
    assert msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"] == ARGS
    # The agent loop's second turn: the call and its result go back through the chat template
    # (assistant `tool_calls`, a `tool` message); the scripted model answers with the call again.
    result = get_weather.invoke(msg.tool_calls[0])
    assert result.content == "sunny in Paris" and result.tool_call_id == msg.tool_calls[0]["id"]
    again = llm.bind_tools([get_weather]).invoke(["What is the weather in Paris?", msg, result])
    assert again.tool_calls[0]["name"] == "get_weather" and again.tool_calls[0]["args"] == ARGS
