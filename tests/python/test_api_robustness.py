"""`lily serve` under seeded-random, mutated and abusive HTTP requests.

test_openai_server.py drives the server as well-behaved clients do, and tests/server.rs checks one
malformed request per refusal through the router. This file throws a few hundred seeded-random
requests at one running server (the embedded demo model) over plain HTTP, so that bodies can be
broken exactly (wrong types, invalid JSON, NaN, invalid UTF-8, truncation, wrong methods), and
checks the server's promises for every one of them:

* it never panics, dies or hangs: every request gets a whole response within a time limit;
* a valid request gets a valid success: a `chat.completion` / `text_completion` body, or an SSE
  stream of well-formed chunks (each choice finished exactly once, usage where asked for) ending
  in `data: [DONE]`; stop strings never show; streamed and whole replies agree where sampling is
  deterministic;
* a bad request gets a 4xx whose body is an OpenAI error,
  `{"error": {"message", "type", "param", "code"}}`, and whose `param` names the field at fault
  (never a 5xx, an empty or non-JSON body);
* abandoned streams and requests are cancelled without disturbing the others;
* a huge prompt does not stall the server for everyone else;
* afterwards the server still answers `/health`, `/v1/models` and a greedy completion exactly as
  before the barrage, its /metrics count no 5xx response, and it exits cleanly on SIGTERM.

The random cases derive from SEED (set LILY_ROBUSTNESS_SEED to explore others). A failure sorts
the failing cases by what went wrong and shows two of each, with the seed, the case's name and
number, the request and the response.
"""

import http.client
import json
import math
import os
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import pytest

from test_openai_server import NO_EOS, WEATHER_TOOL, Server, wait_for_idle

SEED = int(os.environ.get("LILY_ROBUSTNESS_SEED", "1205"))
MODEL = "lily-demo"
VOCAB = 265  # the demo's 256 byte tokens and 9 added tokens
CONTEXT = 8192  # the demo's context (the server's default is larger)
RESPONSE_PATIENCE_S = 30
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
JSON_HEADERS = {"Content-Type": "application/json"}
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "find_city",
        "description": "Cities matching a name",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        "strict": True,
    },
}
# Tokens that push the demo's random text towards tags and tool-call syntax.
TAG_TOKENS = [259, 260, 261, 262, 263, 264] + list(b"<>=/{}\":\n_fnpu")
TEXTS = ["hi", "Say something.", "Hé, 日本語 🙂", "a\u0000b", "\u200b\u202e\ufeff",
         "tab\tnew\nline", "</think>", "<tool_call>", "<|im_end|>", "{\"json\": true}", "x" * 300]

# The JSON kinds each field lily reads accepts (`int` excludes fractions; `any`: tool_choice).
COMMON_KINDS = {
    "model": {"str"}, "stream": {"bool"}, "stream_options": {"object"},
    "max_tokens": {"int"}, "temperature": {"int", "float"}, "top_p": {"int", "float"},
    "top_k": {"int"}, "min_p": {"int", "float"}, "presence_penalty": {"int", "float"},
    "frequency_penalty": {"int", "float"}, "repetition_penalty": {"int", "float"},
    "seed": {"int"}, "stop": {"str", "list"}, "n": {"int"}, "logit_bias": {"object"},
    "return_token_ids": {"bool"},
}
KINDS = {
    CHAT: COMMON_KINDS | {
        "messages": {"list"}, "max_completion_tokens": {"int"}, "logprobs": {"bool"},
        "top_logprobs": {"int"}, "tools": {"list"}, "tool_choice": {"any"},
        "chat_template_kwargs": {"object"}, "response_format": {"object"},
    },
    COMPLETIONS: COMMON_KINDS | {
        "prompt": {"str", "list"}, "logprobs": {"int"}, "echo": {"bool"}, "suffix": {"str"},
        "best_of": {"int"}, "response_format": {"object"},
    },
}
# Values of each kind that a mutation puts in place of a field's value.
JUNK = {
    "str": ["", "0.5", "true", "null", "é" * 300],
    "bool": [True, False],
    "int": [0, 7, -3, 2**63 - 1, -(2**63), 2**64 - 1, 10**30],
    "float": [1.5, -0.25, 2.0**64 + 1, 1e308, -1e-300],
    "list": [[], [1, "a"], [{"role": "user"}], [[[[[]]]]]],
    "object": [{}, {"a": 1}, {"type": None}, {"": {"": {"": []}}}],
}
# Right-kind values every field must refuse (out of range, unsupported, malformed inside).
REFUSED = {
    CHAT: {
        "model": ["gpt-4", "", "lily-demo "],
        "max_tokens": [0, -1, 10**6, 2**63 - 1],
        "max_completion_tokens": [0, -5, 10**6, 2**63 - 1],
        "temperature": [-0.5, -1e-30, 1e39],
        "top_p": [0, 1.5, -1, 1e39],
        "top_k": [-2, -(2**63)],
        "min_p": [-0.1, 1.5],
        "presence_penalty": [2.5, -3, 1e39],
        "frequency_penalty": [2.01, -100],
        "repetition_penalty": [0, -1, 1e39],
        "n": [0, 17, -1],
        "stop": [["s"] * 17, [None], ["a", 5]],
        "logit_bias": [{"999": 1}, {"5": 101}, {"x": 1}, {"5": "1"}, {"-1": 0}, {"5": None}],
        "messages": [
            [],
            [{"role": "wizard", "content": "x"}],
            [{"content": "x"}],
            [{"role": 1, "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [5]}],
            [{"role": "assistant", "content": "only me"}],
            [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}],
            [{"role": "user", "content": "x", "name": 5}],
            ["user: hi"],
        ],
        "top_logprobs": [21, -1],
        "response_format": [{"type": "yaml"}, {"type": "json_schema"}, {},
                            {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
                            {"type": "json_schema", "json_schema": {"schema": [1]}}],
        "tool_choice": ["required", "sometimes", {"type": "function", "function": {"name": "f"}}],
        "tools": [[{"type": "retrieval", "function": {"name": "f"}}], [{"type": "function"}],
                  [{"type": "function", "function": {}}], [5]],
    },
    COMPLETIONS: {
        "model": ["gpt-4"],
        "max_tokens": [0, -1, 10**6],
        "prompt": ["", [], [[]], ["a", ""], [1, VOCAB], [[1], [VOCAB]], [-1], [2**32], [1.5]],
        "logprobs": [21, -1],
        "suffix": ["tail"],
        "best_of": [2, 0],
        "n": [0, 17],
        "stop": [["s"] * 17],
    },
}
# Spellings a lenient JSON parser might take as numbers; they are not JSON.
NOT_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "01", ".5", "+1", "0x1F", "1_000",
                    "1.", "--1", "True", "None", "'x'"]
INVALID_UTF8 = [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]


class Reply(NamedTuple):
    status: int
    headers: dict  # lower-case names
    body: bytes


@dataclass
class Case:
    """One request and what must come of it: `ok` (a success), `error` (a 4xx OpenAI error,
    naming `param` where given) or `either`."""

    name: str
    path: str
    body: bytes | None
    expect: str
    request: dict | None = None  # the body as sent, when it is a JSON object
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    headers: dict = field(default_factory=lambda: dict(JSON_HEADERS))

    def describe(self) -> str:
        body = (self.body or b"")[:800]
        more = f" ... ({len(self.body)} bytes)" if self.body and len(self.body) > 800 else ""
        return (f"seed {SEED}, {self.name}: {self.method} {self.path} "
                f"{self.headers} {body!r}{more} (expected {self.expect}"
                f"{', param ' + self.param if self.param else ''})")


def json_case(name, path, request, expect, param=None) -> Case:
    return Case(name, path, json.dumps(request).encode(), expect, request=request, param=param)


# --- the server and plain HTTP -------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    server = Server()
    server.reference = reference_completion(server)
    yield server
    code = server.stop()
    assert code == 0 and not panics(server), "".join(server.log[-50:])


def reference_completion(server) -> str:
    """The text of a greedy completion, to compare with after the barrage."""
    reply = send(server, Case("reference", COMPLETIONS, json.dumps(
        {"prompt": "The same again", "max_tokens": 16, "temperature": 0}).encode(), "ok"))
    assert reply.status == 200, reply
    return json.loads(reply.body)["choices"][0]["text"]


def address(server) -> tuple[str, int]:
    url = urlsplit(server.address)
    return url.hostname, url.port


def send(server, case: Case) -> Reply:
    connection = http.client.HTTPConnection(*address(server), timeout=RESPONSE_PATIENCE_S)
    try:
        connection.request(case.method, case.path, body=case.body, headers=case.headers)
        response = connection.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return Reply(response.status, headers, response.read())
    finally:
        connection.close()


# What a check raises on a reply that breaks a promise (a body that does not parse, a missing key).
CHECK_ERRORS = (AssertionError, KeyError, TypeError, ValueError)


def reason(e: Exception) -> str:
    """What a check found, without pytest's explanation of the failed expression."""
    if isinstance(e, AssertionError):
        return str(e).split("\n")[0]
    return f"{type(e).__name__}: {e}"


def panics(server) -> list[str]:
    return [line for line in server.log if "panicked" in line or "RUST_BACKTRACE" in line]


def run_cases(server, cases: list[Case], also=None):
    """Sends every case and judges its reply; fails listing the failing cases, two of each kind
    of failure. `also(case, reply)` checks more on a success (it may send further requests)."""
    failures: dict[str, list[str]] = {}
    for case in cases:
        try:
            reply = send(server, case)
        except (OSError, http.client.HTTPException) as e:
            failures.setdefault(f"no whole response ({type(e).__name__})", []).append(
                f"{case.describe()}\n  -> {e!r}")
            if server.proc.poll() is not None:
                break
            continue
        try:
            judge(case, reply)
            if also is not None and reply.status == 200:
                also(case, reply)
        except CHECK_ERRORS as e:
            failures.setdefault(f"{reply.status}: {reason(e)}", []).append(
                f"{case.describe()}\n  -> {reply.status} {reply.body[:600]!r}")
    assert server.proc.poll() is None, "the server died:\n" + "".join(server.log[-50:])
    assert not panics(server), "the server panicked:\n" + "".join(panics(server))
    if failures:
        count = sum(map(len, failures.values()))
        report = [f"{count} of {len(cases)} cases failed ({len(failures)} kinds of failure):"]
        for what, examples in failures.items():
            report.append(f"\n== {what} ({len(examples)} cases), e.g.:")
            report += examples[:2]
        pytest.fail("\n".join(report), pytrace=False)


# --- judging replies -----------------------------------------------------------------------


def judge(case: Case, reply: Reply):
    if case.expect == "ok":
        assert reply.status == 200, "a valid request was refused"
    elif case.expect == "error":
        assert 400 <= reply.status < 500, "a bad request was not refused with a 4xx"
    else:
        assert reply.status == 200 or 400 <= reply.status < 500, "neither a success nor a 4xx"
    if reply.status == 200:
        check_success(case, reply)
    else:
        check_error(case, reply)


def check_error(case: Case, reply: Reply):
    assert reply.headers.get("content-type", "").startswith("application/json"), (
        f"an error without a JSON body (content-type {reply.headers.get('content-type')!r})"
    )
    body = json.loads(reply.body)
    assert isinstance(body, dict) and set(body) == {"error"}, "not an OpenAI error body"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, "not an OpenAI error object"
    assert isinstance(error["message"], str) and error["message"], "no error message"
    assert isinstance(error["type"], str) and error["type"], "no error type"
    assert error["param"] is None or isinstance(error["param"], str), "param is not a string"
    assert error["code"] is None or isinstance(error["code"], str), "code is not a string"
    if case.param is not None:
        assert field_root(error["param"]) == case.param, f"the error names {error['param']!r}"
    elif error["param"] is not None and case.path in KINDS:
        assert field_root(error["param"]) in KINDS[case.path], "the error names no known field"
    if case.code is not None:
        assert error["code"] == case.code, f"the error code is {error['code']!r}"


def field_root(param: str | None) -> str | None:
    """The top-level field of a param (`messages[0].content` -> `messages`)."""
    return None if param is None else re.split(r"[.\[]", param)[0]


def check_success(case: Case, reply: Reply):
    if case.path == RESPONSES:
        assert case.request is not None, "a broken body was answered as a success"
        check_response(case, reply)
        return
    if case.path not in (CHAT, COMPLETIONS):
        assert reply.headers.get("content-type", "").startswith("application/json")
        json.loads(reply.body)
        return
    assert case.request is not None, "a broken body was answered as a success"
    outcome(case, reply)


def outcome(case: Case, reply: Reply) -> tuple:
    """Checks a generation reply; returns what each choice said and how it finished, and usage."""
    if case.request.get("stream") is True:
        return check_stream(case, reply)
    return check_whole(case, reply)


def budget(request: dict) -> int:
    chosen = request.get("max_completion_tokens") or request.get("max_tokens")
    assert chosen is not None, "generated requests always cap their tokens"
    return chosen


def check_whole(case: Case, reply: Reply) -> tuple:
    request, chat = case.request, case.path == CHAT
    assert reply.headers.get("content-type", "").startswith("application/json")
    body = json.loads(reply.body)
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["model"] == MODEL and isinstance(body["id"], str)
    assert isinstance(body["created"], int)
    n = request.get("n") or 1
    assert [c["index"] for c in body["choices"]] == list(range(n)), "choices out of order"
    said = []
    for choice in body["choices"]:
        finish = choice["finish_reason"]
        assert finish in ("stop", "length", "tool_calls"), f"finish_reason {finish!r}"
        if chat:
            message = choice["message"]
            assert message["role"] == "assistant"
            calls = message.get("tool_calls", [])
            check_tool_calls(calls, request, whole=True)
            assert isinstance(message["content"], str) or (message["content"] is None and calls)
            assert finish != "tool_calls" or calls, "finish_reason tool_calls without a call"
            reasoning = message.get("reasoning_content") or ""
            said.append((message["content"] or "", reasoning, calls_said(calls), finish))
            check_chat_logprobs(choice["logprobs"], request)
            check_no_stop(request, [message["content"] or "", reasoning])
        else:
            assert isinstance(choice["text"], str)
            said.append((choice["text"], finish))
            check_legacy_logprobs(choice["logprobs"], request)
            if not request.get("echo"):
                check_no_stop(request, [choice["text"]])
        if request.get("return_token_ids"):
            assert isinstance(choice["token_ids"], list)
    usage = body["usage"]
    check_usage(usage, request, [s[-1] for s in said])
    if request.get("return_token_ids"):
        assert len(body["prompt_token_ids"]) == usage["prompt_tokens"]
        emitted = sum(len(c["token_ids"]) for c in body["choices"])
        assert emitted == usage["completion_tokens"], "token_ids do not add up to the usage"
    return said, usage


def check_stream(case: Case, reply: Reply) -> tuple:
    request, chat = case.request, case.path == CHAT
    assert reply.headers.get("content-type", "").startswith("text/event-stream")
    events = sse_data(reply.body)
    assert events and events[-1] == "[DONE]", "the stream does not end with data: [DONE]"
    assert events.count("[DONE]") == 1, "data: [DONE] more than once"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), "a valid request's stream carries an error"
    assert len({c["id"] for c in chunks}) == 1, "chunks of one stream with different ids"
    n = request.get("n") or 1
    include_usage = (request.get("stream_options") or {}).get("include_usage") is True
    texts = [["", "", []] for _ in range(n)]
    finishes = {}
    scored = set()  # choices whose logprobs have started
    usage = None
    token_ids = prompt_ids = 0
    for i, c in enumerate(chunks):
        assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert c["model"] == MODEL
        if c.get("usage") is not None:
            assert include_usage, "usage streamed without stream_options.include_usage"
            assert i == len(chunks) - 1 and c["choices"] == [], "the usage chunk is not last"
            usage = c["usage"]
            continue
        assert "usage" in c or not include_usage, "include_usage chunks must carry usage: null"
        if "prompt_token_ids" in c:
            assert request.get("return_token_ids"), "prompt_token_ids nobody asked for"
            prompt_ids = len(c["prompt_token_ids"])
        for choice in c["choices"]:
            if request.get("return_token_ids"):
                token_ids += len(choice["token_ids"])
            index = choice["index"]
            assert 0 <= index < n, f"choice index {index}"
            assert index not in finishes, f"choice {index} continues after its finish_reason"
            if chat:
                delta = choice["delta"]
                texts[index][0] += delta.get("content") or ""
                texts[index][1] += delta.get("reasoning_content") or ""
                calls = delta.get("tool_calls", [])
                check_tool_calls(calls, request, whole=False)
                texts[index][2] += calls_said(calls)
                if choice["logprobs"] is not None:
                    check_chat_logprobs(choice["logprobs"], request)
            else:
                texts[index][0] += choice["text"]
                if choice["logprobs"] is not None:
                    check_legacy_logprobs(choice["logprobs"], request, index not in scored)
                    scored.add(index)
            if choice["finish_reason"] is not None:
                assert choice["finish_reason"] in ("stop", "length", "tool_calls")
                finishes[index] = choice["finish_reason"]
    assert sorted(finishes) == list(range(n)), f"choices finished: {sorted(finishes)} of {n}"
    assert (usage is not None) == include_usage, "include_usage asked for usage"
    if usage is not None:
        check_usage(usage, request, [finishes[i] for i in range(n)])
        if request.get("return_token_ids"):
            assert prompt_ids == usage["prompt_tokens"], "prompt_token_ids differ from the usage"
            assert token_ids == usage["completion_tokens"], "token_ids differ from the usage"
    if chat:
        said = [(t[0], t[1], t[2], finishes[i]) for i, t in enumerate(texts)]
        for content, reasoning, _, _ in said:
            check_no_stop(request, [content, reasoning])
    else:
        said = [(t[0], finishes[i]) for i, t in enumerate(texts)]
        if not request.get("echo"):
            for text, _ in said:
                check_no_stop(request, [text])
    return said, usage


def sse_data(body: bytes) -> list[str]:
    """The data of each event of an SSE body (comments, such as keep-alives, left out)."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), "the stream ends inside an event"
    events = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert all(line.startswith(("data:", ":")) for line in lines), f"odd SSE event {block!r}"
        data = [line[len("data:"):].removeprefix(" ") for line in lines if line.startswith("data:")]
        if data:
            events.append("\n".join(data))
    return events


def sse_events(body: bytes) -> list[tuple[str | None, str]]:
    """Each event of an SSE body as (its `event:` name, its data)."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), "the stream ends inside an event"
    events = []
    for block in text[:-2].split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        names = [line[len("event:"):].strip() for line in lines if line.startswith("event:")]
        data = [line[len("data:"):].removeprefix(" ") for line in lines if line.startswith("data:")]
        assert len(names) <= 1 and len(names) + len(data) == len(lines), f"odd event {block!r}"
        events.append((names[0] if names else None, "\n".join(data)))
    return events


OUTPUT_ITEMS = {"reasoning", "message", "function_call"}


def check_response_object(response: dict, request: dict, final: bool):
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["store"] is False, "nothing is stored"
    for item in response["output"]:
        assert item["type"] in OUTPUT_ITEMS, f"an output item of type {item['type']!r}"
        if item["type"] == "message":
            assert [c["type"] for c in item["content"]] == ["output_text"]
        if item["type"] == "function_call":
            names = {t["name"] for t in request.get("tools") or []}
            assert item["name"] in names, "a call to an unknown function"
            assert isinstance(json.loads(item["arguments"]), dict)
    if not final:
        return
    assert response["status"] in ("completed", "incomplete")
    usage = response["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 1 <= usage["output_tokens"] <= request["max_output_tokens"], "more tokens than asked"
    assert 0 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"]
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]
    if response["status"] == "incomplete":
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert usage["output_tokens"] == request["max_output_tokens"]


def check_response(case: Case, reply: Reply):
    """A Responses reply: the response object, or its events in order (created first, each item
    added before its deltas and done before the end, text deltas adding up)."""
    if case.request.get("stream") is not True:
        check_response_object(json.loads(reply.body), case.request, final=True)
        return
    events = sse_events(reply.body)
    assert events, "an empty stream"
    texts: dict[int, str] = {}
    open_items: set[int] = set()
    for i, (name, data) in enumerate(events):
        event = json.loads(data)
        assert name == event["type"], "the event name differs from its type"
        assert event["sequence_number"] == i, "sequence numbers must count from 0"
        kind = event["type"]
        if i == 0:
            assert kind == "response.created", "the first event is not response.created"
        if kind in ("response.created", "response.in_progress"):
            check_response_object(event["response"], case.request, final=False)
        elif kind == "response.output_item.added":
            assert event["output_index"] not in open_items, "an item added twice"
            open_items.add(event["output_index"])
            texts[event["output_index"]] = ""
        elif kind.endswith(".delta"):
            assert event["output_index"] in open_items, f"{kind} outside its item"
            texts[event["output_index"]] += event["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event["text"] == texts[event["output_index"]], "deltas do not add up"
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == texts[event["output_index"]], "deltas do not add up"
        elif kind == "response.output_item.done":
            open_items.remove(event["output_index"])
    assert not open_items, "items left open"
    last = json.loads(events[-1][1])
    assert last["type"] in ("response.completed", "response.incomplete"), last["type"]
    check_response_object(last["response"], case.request, final=True)
    assert len(last["response"]["output"]) == len(texts), "the output lacks streamed items"


def check_usage(usage: dict, request: dict, finishes: list[str]):
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert usage["total_tokens"] == prompt + completion, "usage does not add up"
    assert 1 <= prompt < CONTEXT
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached < prompt, "cached tokens must leave a prompt token to prefill"
    assert 0 <= completion <= len(finishes) * budget(request), "more tokens than asked for"
    if finishes == ["length"]:
        assert completion == budget(request), "finish_reason length before max_tokens"


def check_tool_calls(calls: list, request: dict, whole: bool):
    names = {t["function"]["name"] for t in request.get("tools") or []}
    assert not calls or names, "tool calls without tools"
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert ("index" in call) != whole, "index belongs to streamed tool calls only"
        assert call["function"]["name"] in names, f"a call to unknown {call['function']['name']!r}"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def calls_said(calls: list) -> list:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def check_no_stop(request: dict, texts: list[str]):
    stop = request.get("stop") or []
    for s in [stop] if isinstance(stop, str) else stop:
        for text in texts:
            assert not s or s not in text, f"stop string {s!r} in the reply"


def requested_top(request: dict, chat: bool) -> int | None:
    """How many alternatives a request's log-probabilities list, or None if it asks for none."""
    if chat:
        return (request.get("top_logprobs") or 0) if request.get("logprobs") else None
    return request.get("logprobs")


def check_chat_logprobs(logprobs, request: dict):
    top = requested_top(request, chat=True)
    if top is None:
        assert logprobs is None, "log-probabilities nobody asked for"
        return
    for entry in logprobs["content"]:
        check_logprob(entry["logprob"])
        assert isinstance(entry["token"], str) and all(0 <= b < 256 for b in entry["bytes"])
        alternatives = [t["logprob"] for t in entry["top_logprobs"]]
        # Tokens the sampling settings rule out (probability 0) are left out.
        assert (top == 0) == (not alternatives) and len(alternatives) <= top, (
            f"{len(alternatives)} top_logprobs, asked for {top}"
        )
        for value in alternatives:
            check_logprob(value)
        assert alternatives == sorted(alternatives, reverse=True), "top_logprobs out of order"


def check_legacy_logprobs(logprobs, request: dict, opens: bool = True):
    """`opens`: the lists start at the choice's first token (a whole reply, or its first
    streamed chunk with logprobs), which with `echo` is the prompt's first, scored against
    nothing."""
    top = requested_top(request, chat=False)
    if top is None:
        assert logprobs is None, "log-probabilities nobody asked for"
        return
    lists = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    lengths = {len(logprobs[k]) for k in lists}
    assert len(lengths) == 1, "logprobs lists of different lengths"
    for i, (value, alternatives) in enumerate(zip(logprobs["token_logprobs"], logprobs["top_logprobs"])):
        if i == 0 and opens and request.get("echo"):
            # An echoed prompt's first token has nothing before it to be scored against.
            assert value is None and alternatives is None, "the prompt's first token scored"
            continue
        check_logprob(value)
        # The token itself is listed beside the `top` most likely; tokens with the same text
        # (invalid UTF-8 pieces) share one key.
        assert len(alternatives) <= top + 1
        for alternative in alternatives.values():
            check_logprob(alternative)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def check_logprob(value):
    assert isinstance(value, (int, float)) and math.isfinite(value) and value <= 1e-6, (
        f"log-probability {value!r}"
    )


# --- generating requests -------------------------------------------------------------------


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF),
                                       rng.randint(0x1F300, 0x1F6FF)]))
                       for _ in range(rng.randint(1, 40)))
    return rng.choice(TEXTS)


def random_stop(rng: random.Random):
    def one():
        return rng.choice(["", "\n", "a", "E", "é", "🙂", "</think>", "<tool_call>",
                           random_text(rng), "long stop " * 100])

    return rng.choice([one(), [], [one()], [one() for _ in range(rng.randint(2, 16))]])


def random_messages(rng: random.Random) -> list:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": rng.choice(["system", "developer"]), "content": random_text(rng)})
    for _ in range(rng.randint(0, 2)):
        messages.append({"role": "user", "content": random_content(rng)})
        if rng.random() < 0.3:
            arguments = rng.choice(['{"city": "Paris"}', "", "{}"])
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]})
            messages.append({"role": "tool", "tool_call_id": "call_1", "content": random_text(rng)})
        else:
            messages.append({"role": "assistant", "content": random_content(rng)})
    messages.append({"role": "user", "content": random_content(rng),
                     **({"name": "fuzzer"} if rng.random() < 0.1 else {})})
    return messages


def random_content(rng: random.Random):
    if rng.random() < 0.25:
        return [{"type": "text", "text": random_text(rng)} for _ in range(rng.randint(1, 3))]
    return random_text(rng)


def random_sampling(rng: random.Random) -> dict:
    """Common fields, each present or not, with values the API accepts."""
    options = {
        "model": lambda: MODEL,
        "temperature": lambda: rng.choice([0, 0.0, rng.uniform(0, 2), 2, 30]),
        "top_p": lambda: rng.choice([1, rng.uniform(0.01, 1), 1e-9]),
        "top_k": lambda: rng.choice([-1, 0, 1, 5, 50, VOCAB, 10**9]),
        "min_p": lambda: rng.choice([0, rng.random(), 1]),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.choice([-2, 2, rng.uniform(-2, 2)]),
        "repetition_penalty": lambda: rng.choice([1, rng.uniform(0.5, 2), 1e-3]),
        "seed": lambda: rng.choice([0, -1, rng.randint(-(2**63), 2**63 - 1)]),
        "n": lambda: rng.randint(1, 3),
        "stop": lambda: random_stop(rng),
        "logit_bias": lambda: {str(rng.choice(TAG_TOKENS + [rng.randrange(VOCAB)])):
                               rng.choice([-100, 100, rng.uniform(-100, 100), 0])
                               for _ in range(rng.randint(0, 6))},
        "return_token_ids": lambda: rng.random() < 0.5,
        "user": lambda: random_text(rng),
        "metadata": lambda: {"run": str(SEED)},
        "x_unknown_field": lambda: rng.choice([None, 1, "x", [1, {"deep": [[]]}]]),
    }
    return {k: make() for k, make in options.items() if rng.random() < 0.3}


def random_chat(rng: random.Random) -> dict:
    request = {"messages": random_messages(rng), **random_sampling(rng)}
    request[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.choice([1, 2, 5, 12])
    if rng.random() < 0.3:
        request["logprobs"] = True
        if rng.random() < 0.7:
            request["top_logprobs"] = rng.randint(0, 20)
    elif rng.random() < 0.1:
        request["logprobs"] = False
    if rng.random() < 0.3:
        request["tools"] = rng.choice([[WEATHER_TOOL], [WEATHER_TOOL, CITY_TOOL]])
        if rng.random() < 0.5:
            request["tool_choice"] = rng.choice([
                "auto", "none", "required",
                {"type": "function", "function": {"name": request["tools"][-1]["function"]["name"]}},
            ])
        if rng.random() < 0.5:  # tags and tool-call syntax for the parsers to sort out
            bias = {str(t): rng.uniform(1, 6) for t in rng.sample(TAG_TOKENS, 8)}
            request["logit_bias"] = bias
    if rng.random() < 0.2:
        request["response_format"] = rng.choice([
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema",
             "json_schema": {"name": "weather", "schema": WEATHER_TOOL["function"]["parameters"]}},
        ])
    if rng.random() < 0.2:
        request["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return with_stream(rng, request)


def random_completion(rng: random.Random) -> dict:
    prompts = [
        lambda: random_text(rng),
        lambda: [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
        lambda: [random_text(rng)],
        lambda: [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]],
    ]
    request = {"prompt": rng.choice(prompts)(), **random_sampling(rng),
               "max_tokens": rng.choice([1, 3, 12])}
    if rng.random() < 0.3:
        request["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        request["echo"] = True
    if rng.random() < 0.1:
        request["suffix"] = ""
    if rng.random() < 0.1:
        request["best_of"] = request.get("n", 1)
    return with_stream(rng, request)


def with_stream(rng: random.Random, request: dict) -> dict:
    if rng.random() < 0.5:
        request["stream"] = True
        if rng.random() < 0.5:
            request["stream_options"] = {"include_usage": rng.random() < 0.7}
    elif rng.random() < 0.2:
        request["stream"] = False
    return request


def random_request(rng: random.Random) -> tuple[str, dict]:
    return (CHAT, random_chat(rng)) if rng.random() < 0.6 else (COMPLETIONS, random_completion(rng))


def minimal(path: str, rng: random.Random) -> dict:
    """A small valid request, with a few fields no refusal depends on."""
    request = ({"messages": [{"role": "user", "content": random_text(rng)}]} if path == CHAT
               else {"prompt": random_text(rng)})
    request["max_tokens"] = 2
    for key, value in [("stream", True), ("temperature", 0.7), ("seed", 3), ("user", "u")]:
        if rng.random() < 0.3:
            request[key] = value
    return request


def kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):  # JSON parsers read integers beyond 64 bits as floats
        return "int" if -(2**63) <= value < 2**64 else "float"
    if isinstance(value, float):
        return "int" if value.is_integer() and abs(value) < 2**63 else "float"
    return {str: "str", list: "list", dict: "object"}[type(value)]


MESSAGE_KINDS = {"role": {"str"}, "content": {"str", "list", "null"}, "name": {"str"},
                 "tool_call_id": {"str"}, "reasoning_content": {"str"}, "tool_calls": {"list"}}


def junk(rng: random.Random, allow_null: bool = True):
    values = JUNK[rng.choice(sorted(JUNK))]
    return rng.choice(values + [None] if allow_null else values)


def mutation_case(rng: random.Random, i: int) -> Case:
    """A valid request with one field (or one message's field) replaced by junk. A value of a
    kind the field does not take must be refused naming the field; anything else may be taken
    or refused."""
    path, request = random_request(rng)
    if path == CHAT and rng.random() < 0.25:
        message = rng.choice(request["messages"])
        key = rng.choice(sorted(MESSAGE_KINDS))
        message[key] = value = junk(rng)
        wrong = kind(value) not in MESSAGE_KINDS[key] | {"null"}
        return json_case(f"mutated message #{i} ({key})", path, request,
                         "error" if wrong else "either", param="messages")
    key = rng.choice(sorted(KINDS[path]))
    # Without a token cap the demo would write the whole context: keep one.
    request[key] = value = junk(rng, allow_null=key not in ("max_tokens", "max_completion_tokens"))
    taken = KINDS[path][key]
    wrong = ("any" not in taken and kind(value) not in taken | {"null"}) or (
        key == "tool_choice" and value not in (None, "auto", "none"))
    return json_case(f"mutated #{i} ({key})", path, request, "error" if wrong else "either",
                     param=key if wrong else None)


def refused_cases(rng: random.Random) -> list[Case]:
    cases = []
    for path, fields in REFUSED.items():
        for key, values in fields.items():
            for value in values:
                request = minimal(path, rng)
                if key == "top_logprobs":
                    request["logprobs"] = True
                request[key] = value
                cases.append(json_case(f"refused {key}={value!r}", path, request, "error", key))
    return cases


def raw_json(request: dict, key: str, raw: str) -> bytes:
    """`request` as JSON with `key`'s value spelled `raw` (which need not be JSON)."""
    request = {**request, key: "@@RAW@@"}
    return json.dumps(request).replace('"@@RAW@@"', raw).encode()


def broken_body_cases(rng: random.Random) -> list[Case]:
    cases = []
    for raw in NOT_JSON_NUMBERS:
        path = rng.choice([CHAT, COMPLETIONS])
        key = rng.choice(["temperature", "top_p", "max_tokens", "seed", "n", "presence_penalty"])
        body = raw_json(minimal(path, rng), key, raw)
        cases.append(Case(f"{key}={raw}", path, body, "error", code="invalid_json"))
    for raw in ["-0", "1E0", "1e-999", "0.0"]:
        body = raw_json(minimal(CHAT, rng), "temperature", raw)
        cases.append(Case(f"temperature={raw}", CHAT, body, "either", request=json.loads(body)))
    for i in range(25):
        path, request = random_request(rng)
        body = json.dumps(request).encode()
        cases.append(Case(f"truncated #{i}", path, body[: rng.randrange(len(body))], "error",
                          code="invalid_json"))
    for bad in INVALID_UTF8:
        path = rng.choice([CHAT, COMPLETIONS])
        body = raw_json(minimal(path, rng), "messages" if path == CHAT else "prompt",
                        '[{"role": "user", "content": "@@BAD@@"}]' if path == CHAT else '"@@BAD@@"')
        body = body.replace(b"@@BAD@@", b"x" + bad + b"y")
        cases.append(Case(f"invalid UTF-8 {bad!r}", path, body, "error", code="invalid_json"))
    for body in [b"", b"[]", b"5", b'"x"', b"null", b"true", b"[{}]", b"{", b"}", b"{}}",
                 b'{"prompt": "x"} {"prompt": "y"}', b"\x00", b"\xef\xbb\xbf{}",
                 b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"]:
        path = rng.choice([CHAT, COMPLETIONS])
        cases.append(Case(f"not an object {body[:20]!r}", path, body, "error"))
    deep = {"prompt": "deep", "max_tokens": 2, "x_deep": json.loads("[" * 100 + "]" * 100)}
    cases.append(json_case("deep unknown field", COMPLETIONS, deep, "ok"))
    twice = b'{"prompt": "a", "max_tokens": 2, "prompt": "b"}'
    cases.append(Case("duplicate key", COMPLETIONS, twice, "either", request=json.loads(twice)))
    huge = {"prompt": "huge", "max_tokens": 2, "x_padding": "p" * (4 << 20)}
    cases.append(json_case("4 MiB body", COMPLETIONS, huge, "ok"))
    many = {"messages": [{"role": "user", "content": f"m{i}"} for i in range(300)], "max_tokens": 2}
    cases.append(json_case("300 messages", CHAT, many, "ok"))
    for content_type in [None, "text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/json; charset=latin-1"]:
        case = json_case(f"content type {content_type}", CHAT, minimal(CHAT, rng), "either")
        case.headers = {} if content_type is None else {"Content-Type": content_type}
        cases.append(case)
    return cases


def routing_cases() -> list[Case]:
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    cases = [Case(f"{method} {path}", path, body, "error", method=method)
             for path in (CHAT, COMPLETIONS)
             for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS")]
    cases += [Case(f"{method} {path}", path, body, "error", method=method)
              for path in ("/v1/models", "/v1/models/lily-demo", "/health", "/metrics")
              for method in ("POST", "PUT", "DELETE")]
    cases += [Case(f"unknown {path}", path, body, "error", method=method)
              for path in ("/v1/chat/completion", "/v1/chat/completions/", "/v2/completions",
                           "/", "/v1", "/%ff%fe", "/v1/models/gpt-4", "/v1/embeddings",
                           "/v1/responses", "/v1/models/%ff", "/" + "a" * 5000)
              for method in ("GET", "POST")]
    return cases


# --- the tests -----------------------------------------------------------------------------


def test_random_valid_requests_get_valid_replies(server):
    rng = random.Random(SEED)
    cases = [json_case(f"valid #{i}", *random_request(rng), "ok") for i in range(160)]

    def replays_alike(case: Case, reply: Reply):
        """Deterministic sampling gives the same reply streamed and whole."""
        request = case.request
        deterministic = request.get("temperature", 1) == 0 or request.get("seed") is not None
        if not deterministic or rng.random() < 0.5:
            return
        other = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        if not request.get("stream"):
            other.update(stream=True, stream_options={"include_usage": True})
        twin = json_case(case.name + " replayed", case.path, other, "ok")
        twin_reply = send(server, twin)
        judge(twin, twin_reply)
        said, usage = outcome(case, reply)
        twin_said, twin_usage = outcome(twin, twin_reply)
        assert said == twin_said, f"streamed and whole differ: {said} vs {twin_said}"
        # The replay may take its prompt from the prefix cache: only that count may differ.
        counts = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}
        assert usage is None or twin_usage is None or counts(usage) == counts(twin_usage), (
            "usage differs"
        )

    run_cases(server, cases, also=replays_alike)


def random_response_request(rng: random.Random) -> dict:
    """A Responses API request the server must take: input items made from a random chat."""
    items = []
    for m in random_messages(rng):
        if m.get("tool_calls"):
            call = m["tool_calls"][0]
            if rng.random() < 0.3:
                items.append({"type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": random_text(rng)}]})
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"] or "{}"})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            content = m["content"]
            if isinstance(content, list):
                kind = "output_text" if m["role"] == "assistant" else "input_text"
                content = [{"type": kind, "text": part["text"]} for part in content]
            item = {"role": m["role"], "content": content}
            if rng.random() < 0.5:
                item["type"] = "message"
            items.append(item)
    request = {"input": rng.choice([items, random_text(rng) or "x"]),
               "max_output_tokens": rng.choice([1, 2, 5, 12])}
    for key, make in {
        "model": lambda: MODEL,
        "instructions": lambda: random_text(rng),
        "temperature": lambda: rng.choice([0, rng.uniform(0, 2)]),
        "top_p": lambda: rng.uniform(0.01, 1),
        "seed": lambda: rng.randint(0, 2**31),
        "reasoning": lambda: {"effort": rng.choice(["none", "low", "high"])},
        "store": lambda: False,
        "metadata": lambda: {"run": str(SEED)},
        "parallel_tool_calls": lambda: rng.random() < 0.5,
        "stream": lambda: rng.random() < 0.6,
        "text": lambda: {"format": rng.choice([
            {"type": "text"}, {"type": "json_object"},
            {"type": "json_schema", "name": "w", "schema": WEATHER_TOOL["function"]["parameters"]},
        ])},
    }.items():
        if rng.random() < 0.4:
            request[key] = make()
    if rng.random() < 0.4:
        tools = [{"type": "function", **t["function"]} for t in (WEATHER_TOOL, CITY_TOOL)]
        request["tools"] = tools[: rng.randint(1, 2)]
        if rng.random() < 0.5:
            request["tool_choice"] = rng.choice([
                "auto", "none", "required",
                {"type": "function", "name": request["tools"][-1]["name"]},
            ])
    return request


def test_random_responses_requests_get_valid_responses(server):
    rng = random.Random(SEED + 7)
    cases = [json_case(f"responses #{i}", RESPONSES, random_response_request(rng), "ok")
             for i in range(80)]
    for junk_case in [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ]:
        cases.append(json_case(f"refused {junk_case[1]}", RESPONSES, junk_case[0], "error",
                               param=junk_case[1]))
    run_cases(server, cases)


def test_mutated_fields_are_refused_naming_the_field_or_taken(server):
    rng = random.Random(SEED + 1)
    run_cases(server, [mutation_case(rng, i) for i in range(200)])


def test_out_of_range_and_unsupported_values_are_refused_naming_the_field(server):
    run_cases(server, refused_cases(random.Random(SEED + 2)))


def test_broken_bodies_get_openai_errors(server):
    run_cases(server, broken_body_cases(random.Random(SEED + 3)))


def test_wrong_methods_and_unknown_paths_get_openai_errors(server):
    run_cases(server, routing_cases())


def long_stream(rng: random.Random) -> tuple[str, dict]:
    """A request that would run for seconds, to be abandoned."""
    path = rng.choice([CHAT, COMPLETIONS])
    return path, {**minimal(path, rng), "max_tokens": 4000, "logit_bias": NO_EOS, "n": 1}


def abandon(server, path: str, request: dict, events: int):
    """Sends `request`, reads `events` SSE events (none: does not wait for a reply), hangs up."""
    connection = http.client.HTTPConnection(*address(server), timeout=RESPONSE_PATIENCE_S)
    try:
        connection.request("POST", path, body=json.dumps(request), headers=JSON_HEADERS)
        if events == 0:
            time.sleep(0.3)
            return
        response = connection.getresponse()
        assert response.status == 200, response.read()
        seen = 0
        while seen < events:
            line = response.readline()
            assert line, "the stream ended early"
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk and chunk["choices"] is not None
                seen += 1
    finally:
        connection.close()


def test_a_barrage_with_abandoned_requests(server):
    """Concurrent valid and broken requests, while other clients hang up mid-stream or before
    any reply; every abandoned generation is cancelled."""
    rng = random.Random(SEED + 4)
    cancelled_before = server.metric("lily_requests_cancelled_total")
    jobs, abandoned = [], 0
    for i in range(60):
        roll = rng.random()
        if roll < 0.25:
            path, request = long_stream(rng)
            events = rng.choice([0, 0, 1, 2, 5, 20])
            request["stream"] = events > 0
            jobs.append((f"abandoned #{i} after {events} events", path, request, events))
            abandoned += 1
        elif roll < 0.5:
            jobs.append(mutation_case(rng, i))
        else:
            jobs.append(json_case(f"valid #{i}", *random_request(rng), "ok"))

    def run(job):
        if isinstance(job, tuple):
            name, path, request, events = job
            try:
                abandon(server, path, request, events)
            except (*CHECK_ERRORS, OSError, http.client.HTTPException) as e:
                return f"seed {SEED}, {name}: {path} {json.dumps(request)}\n  -> {reason(e)}"
            return None
        try:
            reply = send(server, job)
        except (OSError, http.client.HTTPException) as e:
            return f"{job.describe()}\n  -> no whole response: {e!r}"
        try:
            judge(job, reply)
        except CHECK_ERRORS as e:
            return f"{job.describe()}\n  -> {reply.status} {reply.body[:600]!r}\n  {reason(e)}"
        return None

    with ThreadPoolExecutor(8) as pool:
        failures = [f for f in pool.map(run, jobs) if f]
    if failures:
        pytest.fail(f"{len(failures)} of {len(jobs)} requests failed:\n\n"
                    + "\n\n".join(failures[:12]), pytrace=False)
    wait_for_idle(server)
    cancelled = server.metric("lily_requests_cancelled_total") - cancelled_before
    assert cancelled >= abandoned, f"{abandoned} requests abandoned, {cancelled} cancelled"
    assert not panics(server), "".join(panics(server))


def raw_exchange(server, data: bytes) -> bytes:
    """Writes raw bytes on a fresh connection; returns what comes back before the server closes
    it or stays silent for a few seconds."""
    with socket.create_connection(address(server), timeout=RESPONSE_PATIENCE_S) as sock:
        try:
            sock.sendall(data)
        except OSError:
            return b""
        sock.settimeout(3)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return received


def test_broken_http_leaves_the_server_serving(server):
    """Torn connections, lying headers and garbage at the HTTP level: each complete request gets
    an HTTP answer, never a hang or a crash; pipelined requests are all answered; a valid request
    right after is served."""
    host = b"Host: lily\r\n"
    post = b"POST /v1/completions HTTP/1.1\r\n" + host
    valid = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    torn = [
        b"POST /v1/completions HTT",
        post,
        post + b"Content-Length: 100\r\n\r\n" + valid[:10],
        post + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro",
    ]
    for data in torn:
        with socket.create_connection(address(server), timeout=RESPONSE_PATIENCE_S) as sock:
            sock.sendall(data)
    answered = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/completions HTTP/9.9\r\n" + host + b"\r\n",
        post + b"Content-Length: -5\r\n\r\n",
        post + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n{}{}{}",
        post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        post + b"X-Bad: \xff\x00\r\n\r\n",
        post + b"Connection: close\r\nX-Long: " + b"a" * 200_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(valid) + valid,
    ]
    for data in answered:
        reply = raw_exchange(server, data)
        assert reply.startswith(b"HTTP/1."), f"{data[:80]!r} -> {reply[:200]!r}"
    one = post + b"Content-Length: %d\r\n\r\n" % len(valid) + valid
    last = one.replace(host, host + b"Connection: close\r\n")
    reply = raw_exchange(server, one * 2 + last)
    assert reply.count(b"HTTP/1.1 200 OK") == 3, reply[:1000]
    run_cases(server, [json_case("after broken HTTP", COMPLETIONS,
                                 {"prompt": "x", "max_tokens": 2}, "ok")])


def test_an_oversized_body_gets_a_413_error(server):
    """A body over the limit (32 MiB by default) is answered 413 with an OpenAI error while the
    client is still sending it (a client that writes and reads at once sees it)."""
    body = b'{"prompt": "x", "x_padding": "' + b"p" * (40 << 20) + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: lily\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(address(server), timeout=RESPONSE_PATIENCE_S) as sock:
        writer = threading.Thread(target=lambda: send_ignoring_reset(sock, head + body))
        writer.start()
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        writer.join()
    head, _, reply_body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    assert status_line.startswith("HTTP/1.1 413"), received[:300]
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    case = Case("40 MiB body", COMPLETIONS, None, "error", code="request_too_large")
    check_error(case, Reply(413, headers, reply_body))


def send_ignoring_reset(sock: socket.socket, data: bytes):
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server refused the rest of the body


def test_a_huge_prompt_does_not_stall_other_requests(server):
    """A prompt of megabytes is refused (it cannot fit the context) without holding up the
    server: /health answers promptly all the while such prompts are being read. One per CPU
    core (up to 8), so that every thread of the server's async runtime could be handed one."""
    workers = min(len(os.sched_getaffinity(0)), 8)
    big = json_case("8 MiB prompt", COMPLETIONS, {"prompt": "ab c" * (2 << 20), "max_tokens": 1},
                    "error", param="prompt")
    big.code = "context_length_exceeded"
    health = Case("health", "/health", None, "ok", method="GET", headers={})
    waits = []
    with ThreadPoolExecutor(workers) as pool:
        replies = [pool.submit(send, server, big) for _ in range(workers)]
        time.sleep(0.3)
        while not all(r.done() for r in replies):
            started = time.monotonic()
            reply = send(server, health)
            waits.append(time.monotonic() - started)
            assert reply.status == 200 and json.loads(reply.body)["status"] == "ok"
            time.sleep(0.1)
        for r in replies:
            judge(big, r.result())
    assert max(waits, default=0) < 1, (
        f"/health took up to {max(waits):.1f} s while {workers} huge prompts were read"
    )


def test_the_server_still_serves_after_the_barrage(server):
    assert json.loads(server.get("/health"))["status"] == "ok"
    models = json.loads(server.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert reference_completion(server) == server.reference
    failed = [line for line in server.get("/metrics").splitlines()
              if line.startswith("lily_http_requests_total") and re.search(r'status="5\d\d"', line)]
    assert not failed, failed
    assert not panics(server), "".join(panics(server))
