"""What OpenAI clients send beyond a plain chat, driven by the official ``openai`` client against the real vLLM
test server: ``/v1/completions`` (LlamaIndex's ``OpenAILike`` calls it by default), structured output passed to
vLLM, every parameter prefixrag cannot honour refused by name instead of silently dropped, and LangChain's
``ChatOpenAI`` as a chain's code uses it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.servers import http_requests

pytestmark = pytest.mark.vllm
QUESTION = "What does the ingest command do?"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
VERDICT = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": {
    "type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
    "additionalProperties": False}}}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_text_completion_answers_the_prompt_as_a_question_with_sources(client):
    completion = client.completions.create(model="prefixrag", prompt=QUESTION, max_tokens=8)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 8 and completion.usage.prompt_tokens > 0
    sources = completion.model_extra["sources"]
    assert sources and {"id", "chunk_id", "document", "snippet"} <= set(sources[0])
    again = client.completions.create(model="prefixrag", prompt=[QUESTION], max_tokens=8, temperature=0)
    assert again.model_extra["sources"] == sources  # a list of one prompt is the same question


def test_a_streamed_text_completion_ends_with_its_reason_then_usage(client):
    chunks = list(client.completions.create(model="prefixrag", prompt=QUESTION, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["sources"]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("chat", {"n": 2}, "n"),
    ("chat", {"tools": [TOOL]}, "tools"),
    ("chat", {"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ("chat", {"functions": [TOOL["function"]]}, "tools"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "logprobs"),
    ("completions", {"n": 3}, "n"),
    ("completions", {"best_of": 2}, "n"),
    ("completions", {"logprobs": 1}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "!"}, "suffix"),
    ("completions", {"prompt": [QUESTION, QUESTION]}, "prompt"),
])
def test_what_prefixrag_cannot_honour_is_a_400_naming_it(client, route, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            client.chat.completions.create(model="prefixrag", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=4, **fields)
        else:
            client.completions.create(**{"model": "prefixrag", "prompt": QUESTION, "max_tokens": 4} | fields)
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter", "invalid_request_error")


def test_a_conversation_ending_in_a_tool_result_is_refused_by_name(server):
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ingest reads files"}]
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "prefixrag", "messages": messages, "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text


def test_tools_with_tool_choice_none_are_answered_without_them(client):
    answer = client.chat.completions.create(model="prefixrag", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=4, tools=[TOOL], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_json_schema_response_format_constrains_the_answer(client, route):
    """The test model's text is noise: only vLLM's guided decoding can make it an object of this schema."""
    if route == "chat":
        text = client.chat.completions.create(model="prefixrag", messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=48, response_format=VERDICT).choices[0].message.content
    else:
        text = client.completions.create(model="prefixrag", prompt=QUESTION, max_tokens=48,
                                         extra_body={"response_format": VERDICT}).choices[0].text
    # The test model's tokenizer (wordpieces) decodes with a space between pieces: ' { " v er d i ct " : " no " }'.
    assert json.loads(text.replace(" ", "")) in ({"verdict": "yes"}, {"verdict": "no"}), text


def test_langchains_chat_openai_converses_and_streams_with_usage(server):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    chat = chat_openai(server, max_tokens=8, stream_usage=True)
    reply = chat.invoke([SystemMessage("Answer in one sentence."), HumanMessage(QUESTION)])
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["input_tokens"] > 0 and reply.usage_metadata["output_tokens"] <= 8
    turns = [HumanMessage(QUESTION), AIMessage(reply.content), HumanMessage("And what does it skip?")]
    chunks = list(chat.stream(turns))
    assert "".join(chunk.content for chunk in chunks)
    usage = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
    assert len(usage) == 1 and usage[0]["output_tokens"] <= 8 and usage[0]["input_tokens"] > 0


def test_langchains_structured_output_goes_through_vllms_guided_decoding(server):
    """``with_structured_output`` sends a json_schema ``response_format``; only vLLM's guided decoding makes the
    test model's noise an object of that schema (its wordpieces decode with spaces between them)."""
    chat = chat_openai(server, max_tokens=48)
    schema = VERDICT["json_schema"]["schema"] | {"title": "verdict", "description": "yes or no"}
    found = chat.with_structured_output(schema, method="json_schema", strict=True).invoke(QUESTION)
    assert {key.replace(" ", ""): value.replace(" ", "") for key, value in found.items()} in (
        {"verdict": "yes"}, {"verdict": "no"}), found


def chat_openai(server, **options):
    """LangChain's ``ChatOpenAI`` pointed at the service, as a chain's code would build it."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="prefixrag", max_retries=0, timeout=120,
                      **options)


LLAMAINDEX = """
import json, sys
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

url, question = sys.argv[1], sys.argv[2]
common = dict(model="prefixrag", api_base=url, api_key="unused", max_tokens=8, timeout=120, max_retries=0)
text = OpenAILike(**common)  # is_chat_model False by default: /v1/completions
chat = OpenAILike(**common, is_chat_model=True)
print(json.dumps({
    "complete": text.complete(question).text,
    "stream": "".join(part.delta for part in text.stream_complete(question)),
    "chat": chat.chat([ChatMessage(role="user", content=question)]).message.content,
}))
"""


def test_llamaindexs_openai_like_completes_streams_and_chats(server):
    """LlamaIndex's ``OpenAILike`` as its users build it, from an environment of its own (its OpenAI integration
    needs openai<3): text completions by default, streamed, and chat; each reaches the route it should."""
    import subprocess

    from tests.support.env import ROOT

    python = ROOT / ".venv-llamaindex" / "bin" / "python"
    assert python.exists(), "scripts/setup.sh makes .venv-llamaindex"
    before = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
    result = subprocess.run([str(python), "-c", LLAMAINDEX, server.url + "/v1", QUESTION], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    answers = json.loads(result.stdout)
    assert all(answers[kind].strip() for kind in ("complete", "stream", "chat")), answers
    after = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
    for handler, count in (("/v1/completions", 2), ("/v1/chat/completions", 1)):
        key = (handler, "POST", "200")
        assert after.get(key, 0) - before.get(key, 0) == count, handler

