"""`lily serve` driven by the official `openai` Python client, as users drive it.

Servers are started from $LILY_BIN (default target/release/lily) on a free port (`--port 0`; the
address is read from the log). The embedded demo model (random weights, so its text is random
but deterministic under greedy decoding) exercises streaming, completions, stop strings, usage,
concurrency, disconnects and memory; the scripted fixture (tests/fixtures/scripted, a model whose
greedy reply is a thought followed by a tool call) exercises reasoning and tool-call parsing.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
LILY_BIN = Path(os.environ.get("LILY_BIN", REPO / "target" / "release" / "lily"))
SCRIPTED = REPO / "tests" / "fixtures" / "scripted"
STARTUP_PATIENCE_S = 60
# The demo's end-of-sequence ids (<|endoftext|>, <|im_end|>), banned where a stream must run long.
NO_EOS = {"256": -100, "258": -100}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


class Server:
    """A `lily serve` process; its log is collected in the background."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [str(LILY_BIN), "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        self.address = None
        found = threading.Event()

        def read_log():
            for line in self.proc.stderr:
                self.log.append(line)
                match = re.search(r"listening on (http://\S+)", line)
                if match and self.address is None:
                    self.address = match.group(1)
                    found.set()
            found.set()

        self.reader = threading.Thread(target=read_log, daemon=True)
        self.reader.start()
        if not found.wait(STARTUP_PATIENCE_S) or self.address is None:
            self.proc.kill()
            raise RuntimeError("lily serve did not start:\n" + "".join(self.log))
        self.base_url = self.address + "/v1"

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.address + path, timeout=30) as response:
            return response.read().decode()

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.reader.join(timeout=10)
        return code


@pytest.fixture(scope="module")
def demo():
    server = Server()
    yield server
    assert server.stop() == 0, "".join(server.log)


@pytest.fixture(scope="module")
def scripted():
    server = Server("--model", str(SCRIPTED))
    yield server
    assert server.stop() == 0, "".join(server.log)


def wait_for_idle(server, patience_s=60):
    """Waits until no sequence runs (they are retired just after their last event)."""
    deadline = time.time() + patience_s
    while server.metric("lily_running_sequences") != 0:
        assert time.time() < deadline, "sequences still running"
        time.sleep(0.05)


def greedy_chat(client, content, **kwargs):
    return client.chat.completions.create(
        model="lily-demo",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kwargs,
    )


def collect_stream(stream):
    """Reasoning, content, tool calls (merged by index), finish reason and usage of a stream."""
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, usage


def test_models_lists_the_demo(demo):
    models = demo.client().models.list()
    assert [m.id for m in models.data] == ["lily-demo"]
    assert "demo" in "".join(demo.log)
    assert json.loads(demo.get("/health"))["status"] == "ok"


def test_chat_whole_and_streamed_agree_with_usage(demo):
    client = demo.client()
    kwargs = dict(max_tokens=20, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = greedy_chat(client, "Say something.", **kwargs)
    assert whole.object == "chat.completion"
    assert whole.model == "lily-demo"
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert message.content
    assert whole.usage.completion_tokens == 20
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 20
    stream = greedy_chat(
        client, "Say something.", stream=True, stream_options={"include_usage": True}, **kwargs
    )
    reasoning, content, calls, finish, usage = collect_stream(stream)
    assert (reasoning, content, calls, finish) == ("", message.content, [], "length")
    assert usage.model_dump() == whole.usage.model_dump()


def test_thinking_goes_to_reasoning_content(demo):
    # Qwen's template opens `<think>`; the demo's random text never closes it.
    whole = greedy_chat(demo.client(), "Think first.", max_tokens=12)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert message.content == ""
    reasoning, content, _, _, _ = collect_stream(
        greedy_chat(demo.client(), "Think first.", max_tokens=12, stream=True)
    )
    assert (reasoning, content) == (message.model_extra["reasoning_content"], "")


def test_completions_and_stop_strings(demo):
    client = demo.client()
    whole = client.completions.create(model="lily-demo", prompt="Once", max_tokens=30, temperature=0)
    text = whole.choices[0].text
    assert len(text) >= 15 and whole.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="lily-demo", prompt="Once", max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text
    stop = text[8:11]
    cut = text[: text.index(stop)]
    for stream in (False, True):
        result = client.completions.create(
            model="lily-demo", prompt="Once", max_tokens=30, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = [c for c in result if c.choices]
            got = "".join(c.choices[0].text for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            got = result.choices[0].text
            assert result.choices[0].finish_reason == "stop"
        assert got == cut


def test_loglikelihood_requests_as_lm_evaluation_harness_sends_them(demo):
    """lm-evaluation-harness's `local-completions` model scores a continuation by sending the
    context and continuation's token ids with `echo`, `logprobs=1` and `max_tokens=1`, summing
    `token_logprobs[ctxlen:-1]` and calling it greedy when each is its position's best. The
    continuation here is the context's own greedy reply, so it must come out greedy, and its
    summed logprob must equal what generating it reported."""
    client = demo.client()
    kwargs = dict(model="lily-demo", temperature=0)
    context = list(b"Once upon a time")  # the demo's tokenizer: a token per byte
    reply = client.completions.create(
        prompt=context, max_tokens=4, logprobs=1, extra_body={"return_token_ids": True}, **kwargs
    )
    continuation = reply.choices[0].model_extra["token_ids"]
    generated = reply.choices[0].logprobs.token_logprobs
    other = [(t + 1) % 200 + 1 for t in continuation]
    out = client.completions.create(
        prompt=[context + continuation, context + other], max_tokens=1, logprobs=1, echo=True,
        **kwargs,
    )
    results = []
    for choice in sorted(out.choices, key=lambda c: c.index):
        logprobs = choice.logprobs.token_logprobs[len(context):-1]
        tops = choice.logprobs.top_logprobs[len(context):-1]
        assert len(logprobs) == len(continuation) and choice.logprobs.token_logprobs[0] is None
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops))
        results.append((sum(logprobs), greedy))
    (own, own_greedy), (changed, changed_greedy) = results
    assert own_greedy and not changed_greedy
    assert abs(own - sum(generated)) < 1e-3 and changed < own


def test_tool_call_and_reasoning_from_the_scripted_model(scripted):
    client = scripted.client()
    request = dict(
        model="scripted",
        messages=[{"role": "user", "content": "What's the weather in Paris for 3 days?"}],
        tools=[WEATHER_TOOL],
    )
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "I should check the weather in Paris."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    reasoning, content, calls, finish, _ = collect_stream(
        client.chat.completions.create(stream=True, **request)
    )
    assert reasoning == "I should check the weather in Paris."
    assert content == ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]

    # The tool's answer goes back in the conversation, as an agent loop sends it.
    followup = client.chat.completions.create(
        model="scripted",
        messages=request["messages"]
        + [choice.message.model_dump(exclude_none=True)]
        + [{"role": "tool", "tool_call_id": call.id, "content": "Sunny"}],
        tools=[WEATHER_TOOL],
    )
    assert followup.choices[0].finish_reason == "tool_calls"


def test_concurrent_streams_match_solo_runs(demo):
    client = demo.client(timeout=300)
    prompts = [f"Client {i} says {'hi ' * (i % 5)}" for i in range(32)]

    def run(prompt):
        _, content, _, finish, _ = collect_stream(
            greedy_chat(
                client,
                prompt,
                max_tokens=24,
                stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
        )
        return content, finish

    solo = [run(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, prompts))
    assert together == solo
    assert len(set(solo)) > 1


def test_a_disconnect_does_not_disturb_other_streams(demo):
    client = demo.client(timeout=300)
    kwargs = dict(model="lily-demo", max_tokens=40, temperature=0)
    expected = client.completions.create(prompt="steady", **kwargs).choices[0].text
    cancelled_before = demo.metric("lily_requests_cancelled_total")

    def steady():
        stream = client.completions.create(prompt="steady", stream=True, **kwargs)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(steady) for _ in range(3)]
        leaving = client.completions.create(
            model="lily-demo", prompt="long", max_tokens=4000, temperature=0, stream=True,
            logit_bias=NO_EOS,
        )
        for i, _ in enumerate(leaving):
            if i == 3:
                break
        leaving.close()
        assert [f.result() for f in others] == [expected] * 3
    deadline = time.time() + 60
    while demo.metric("lily_requests_cancelled_total") <= cancelled_before:
        assert time.time() < deadline, "the disconnected stream was never cancelled"
        time.sleep(0.05)
    wait_for_idle(demo)


def test_memory_returns_to_idle_after_500_requests(demo):
    client = demo.client(timeout=300)

    def one(i):
        if i % 2:
            stream = greedy_chat(client, f"request {i}", max_tokens=8, stream=True)
            return sum(1 for _ in stream)
        return client.completions.create(
            model="lily-demo", prompt=f"request {i}", max_tokens=8, temperature=0
        ).usage.completion_tokens

    def batch(indices):
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, indices))

    batch(range(100))  # warm up: thread pools, allocator arenas, connection buffers
    time.sleep(0.5)
    idle = demo.rss_bytes()
    batch(range(500))
    wait_for_idle(demo)
    time.sleep(0.5)
    after = demo.rss_bytes()
    # A leaked sequence state alone (about 50 kB on the demo) would add 25 MB over 500 requests.
    assert after <= idle + (6 << 20), f"RSS grew from {idle} to {after} bytes"


def test_errors_reach_the_client_as_openai_errors(demo):
    client = demo.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as bad:
        greedy_chat(client, "x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        greedy_chat(client, "x", top_p=0)
    with pytest.raises(openai.BadRequestError) as bad:
        greedy_chat(client, "x" * 9000)
    assert bad.value.body["code"] == "context_length_exceeded"
    assert greedy_chat(client, "still fine", max_tokens=2).choices[0].finish_reason == "length"


def test_the_next_turn_reports_cached_tokens_and_the_same_reply(demo):
    """An agent's second turn starts from the prefix cache (`usage.prompt_tokens_details`) and
    gets the reply a server without the cache gives."""
    system = {"role": "system", "content": "You are terse. Use the tools you are given. " * 4}
    user = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(model="lily-demo", temperature=0, max_tokens=10, tools=[WEATHER_TOOL],
                  logit_bias=NO_EOS, extra_body={"return_token_ids": True})
    uncached = Server("--prefix-cache", "0")
    try:
        turns = []
        for server in (demo, uncached):
            client = server.client()
            first = client.chat.completions.create(messages=[system, user], **kwargs)
            reply = {"role": "assistant", "content": first.choices[0].message.content,
                     "reasoning_content": first.choices[0].message.model_extra["reasoning_content"]}
            follow_up = {"role": "user", "content": "And in Rome?"}
            second = client.chat.completions.create(
                messages=[system, user, reply, follow_up], **kwargs
            )
            turns.append((first, second))
    finally:
        assert uncached.stop() == 0
    (first, second), (first_u, second_u) = turns
    assert first.choices[0].message == first_u.choices[0].message
    assert second.choices[0].message == second_u.choices[0].message
    assert second_u.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least the first prompt up to its last message, the opened assistant turn.
    ids = first.model_extra["prompt_token_ids"]
    generation_prompt = max(i for i, t in enumerate(ids) if t == ids[0])
    assert generation_prompt <= cached < second.usage.prompt_tokens
    assert demo.metric("lily_prefix_cache_hits_total") >= 1


def test_structured_output_parses_into_a_pydantic_model(demo):
    """`response_format` from a pydantic model (the client's `parse`, strict JSON schema with
    `$defs` and `additionalProperties: false`): the random demo model's reply parses."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Colour(BaseModel):
        name: Literal["red", "green", "blue"]
        bright: bool

    class Pick(BaseModel):
        colour: Colour
        count: int = Field(ge=0, le=99)
        alternatives: list[Literal["cyan", "magenta"]] = Field(max_length=2)

    client = demo.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="lily-demo",
            messages=[{"role": "user", "content": "Pick a colour."}],
            response_format=Pick,
            temperature=1.0,
            seed=seed,
            max_tokens=96,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pick), choice.message.content


def test_a_named_tool_choice_gives_a_parsed_call(demo):
    """Function calling as LangChain's structured output uses it: a pydantic model as a strict
    tool (`openai.pydantic_function_tool`) and `tool_choice` naming it; the call parses."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class SetMode(BaseModel):
        mode: Literal["fast", "slow"]
        level: int = Field(ge=1, le=5)

    client = demo.client()
    completion = client.chat.completions.parse(
        model="lily-demo",
        messages=[{"role": "user", "content": "Go fast."}],
        tools=[openai.pydantic_function_tool(SetMode)],
        tool_choice={"type": "function", "function": {"name": "SetMode"}},
        temperature=0,
        max_tokens=300,
        # The demo's random thought never closes.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "SetMode"
    assert isinstance(call.function.parsed_arguments, SetMode), call.function.arguments


def test_responses_api_whole_streamed_and_agent_loop(demo):
    """The Responses API as the official client drives it: a reply (reasoning item, then the
    message) whole and through `responses.stream` (which checks the event sequence); a forced
    function call fed back with its output; structured output parsed into a pydantic model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    client = demo.client()
    kwargs = dict(model="lily-demo", temperature=0, max_output_tokens=16)
    whole = client.responses.create(input="Say something.", instructions="Be brief.", **kwargs)
    assert whole.object == "response" and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["reasoning"]
    assert whole.usage.output_tokens == 16 and whole.usage.output_tokens_details.reasoning_tokens
    thought = whole.output[0].content[0].text
    assert thought

    with client.responses.stream(
        input="Say something.", instructions="Be brief.", **kwargs
    ) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == thought

    no_thinking = dict(model="lily-demo", temperature=0, reasoning={"effort": "none"})
    answer = client.responses.create(input="Hi", max_output_tokens=8, **no_thinking)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text

    # Logprobs through `include`: the message's tokens, as chat reports them for the same reply.
    scored = client.responses.create(input="Hi", max_output_tokens=8, top_logprobs=2,
                                     include=["message.output_text.logprobs"], **no_thinking)
    (text,) = scored.output[0].content
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=8, logprobs=True, top_logprobs=2,
        model="lily-demo", temperature=0, reasoning_effort="none",
    )
    assert text.text == chat.choices[0].message.content == answer.output_text
    expected = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in text.logprobs] == [(t.token, t.logprob) for t in expected]
    assert [len(t.top_logprobs) for t in text.logprobs] == [2] * len(expected) and expected

    class SetMode(BaseModel):
        mode: Literal["fast", "slow"]
        level: int = Field(ge=1, le=5)

    tool = {"type": "function", "name": "set_mode", "parameters": SetMode.model_json_schema()}
    first = client.responses.create(
        input="Go.", tools=[tool], tool_choice={"type": "function", "name": "set_mode"},
        max_output_tokens=300, **no_thinking,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "set_mode" and first.status == "completed"
    SetMode.model_validate_json(call.arguments)
    follow_up = [
        {"role": "user", "content": "Go."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "done"},
    ]
    second = client.responses.create(input=follow_up, tools=[tool], max_output_tokens=8,
                                     **no_thinking)
    assert second.status in ("completed", "incomplete")

    parsed = client.responses.parse(
        input="Pick.", text_format=SetMode, max_output_tokens=96, **no_thinking
    )
    assert isinstance(parsed.output_parsed, SetMode)
    with client.responses.stream(
        input="Pick.", text_format=SetMode, max_output_tokens=96, **no_thinking
    ) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed

    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="x", previous_response_id="resp_1", model="lily-demo")
    assert refused.value.body["param"] == "previous_response_id"


def test_api_key():
    server = Server("--api-key", "sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert server.client(api_key="sekrit").models.list().data[0].id == "lily-demo"
    finally:
        assert server.stop() == 0


def test_sigterm_cancels_running_streams_after_the_grace_period():
    server = Server("--shutdown-grace", "1")
    client = server.client(timeout=120)
    stream = client.completions.create(
        model="lily-demo", prompt="x", max_tokens=8000, temperature=0, stream=True,
        logit_bias=NO_EOS,
    )
    next(iter(stream))
    server.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            pass
    assert server.stop() == 0
    assert any("shutting down" in line for line in server.log)
