#!/usr/bin/env python3
"""`lily serve --device cuda` end to end, on the GPU machine (standard library only: that machine
has no `openai` client). The embedded demo model is served twice, with the prefix cache and
without it, and each server is asked:

  - a two-turn chat, greedy with logprobs: the second turn must start from the cache (its
    `cached_tokens`, the `/metrics` counter) and its first token's top logprobs must be those of
    the server without the cache within TOLERANCE (a wrong cached state, e.g. a spare slot not
    copied, moves them by whole units);
  - `response_format` with a JSON schema, sampled with n=3 (constrained rows take the host
    logits path): every reply parses and has the schema's keys;
  - `tool_choice: "required"`: the reply is a call of the tool;
  - `/v1/responses`: a completed response with output text;
  - two greedy completions beside a sampled one, one with logprobs (its logits go to the host
    every step), one with `min_tokens` (to the host for its first steps, then argmax on the
    device): the same tokens (checks a sequence moving between the mixed step's host and device
    rows);
  - greedy completions with penalties chosen on the host (logprobs), drawn on the device over the
    slot's history, and host-then-device (`min_tokens`): the same tokens;
  - a 360-token prompt scored by `echo` with `logprobs` and `max_tokens: 0` (prefilled 256
    tokens at a time, every row's logits read back): its last token, the greedy continuation of
    the rest, must score what generating it reported within TOLERANCE;
  - all of these at once from several threads, streamed and not: every one succeeds.

Usage: scripts/gpu_server_check.py --lily target/gpu/lily [--device cpu]
"""

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

# Logprob differences allowed between the cached and uncached servers: the cached prefix moves
# the DeltaNet's prefill chunks, which changes rounding only (~1e-3 on the tiny random model).
TOLERANCE = 2e-2
# The demo's end-of-sequence ids, banned so that greedy replies run their whole length.
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
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}


class Server:
    def __init__(self, lily: str, device: str, *args: str):
        self.proc = subprocess.Popen(
            [lily, "serve", "--port", "0", "--device", device, "--context", "4096", "--max-batch", "4", *args],
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

        threading.Thread(target=read_log, daemon=True).start()
        if not found.wait(120) or self.address is None:
            self.proc.kill()
            raise RuntimeError("lily serve did not start:\n" + "".join(self.log))

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.address + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def stream(self, path: str, body: dict) -> list[str]:
        request = urllib.request.Request(
            self.address + path, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return [line.decode().strip() for line in response if line.startswith(b"data:")]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.address + "/metrics", timeout=30) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


def two_turns(server: Server) -> tuple[dict, dict]:
    system = {"role": "system", "content": "You are terse. Use the tools you are given. " * 4}
    user = {"role": "user", "content": "What is the weather in Paris?"}
    common = dict(model="lily-demo", temperature=0, max_tokens=10, tools=[WEATHER_TOOL], logit_bias=NO_EOS,
                  logprobs=True, top_logprobs=5)
    first = server.post("/v1/chat/completions", {"messages": [system, user], **common})
    message = first["choices"][0]["message"]
    reply = {"role": "assistant", "content": message["content"], "reasoning_content": message.get("reasoning_content")}
    follow_up = {"role": "user", "content": "And in Rome?"}
    second = server.post("/v1/chat/completions", {"messages": [system, user, reply, follow_up], **common})
    return first, second


def first_top_logprobs(response: dict) -> dict[str, float]:
    first = response["choices"][0]["logprobs"]["content"][0]
    return {entry["token"]: entry["logprob"] for entry in first["top_logprobs"]}


def structured(server: Server) -> list[str]:
    response = server.post("/v1/chat/completions", {
        "model": "lily-demo", "messages": [{"role": "user", "content": "Name and count."}], "n": 3,
        "temperature": 1.0, "seed": 7, "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
        "chat_template_kwargs": {"enable_thinking": False},
    })
    problems = []
    for choice in response["choices"]:
        if choice["finish_reason"] != "stop":
            problems.append(f"structured reply stopped by {choice['finish_reason']}: {choice['message']}")
            continue
        value = json.loads(choice["message"]["content"])
        if set(value) != {"name", "count"} or not isinstance(value["count"], int):
            problems.append(f"structured reply does not follow the schema: {value}")
    return problems


def forced_call(server: Server) -> list[str]:
    response = server.post("/v1/chat/completions", {
        "model": "lily-demo", "messages": [{"role": "user", "content": "Weather?"}], "temperature": 0.7,
        "seed": 3, "max_tokens": 96, "tools": [WEATHER_TOOL], "tool_choice": "required",
        "chat_template_kwargs": {"enable_thinking": False},
    })
    calls = response["choices"][0]["message"].get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "get_weather":
        return [f"tool_choice required gave no call: {response['choices'][0]}"]
    json.loads(calls[0]["function"]["arguments"])
    return []


def responses_api(server: Server) -> list[str]:
    response = server.post("/v1/responses", {"model": "lily-demo", "input": "Hello", "max_output_tokens": 16})
    return [] if response["status"] in ("completed", "incomplete") else [f"response: {response}"]


def streamed(server: Server) -> list[str]:
    lines = server.stream("/v1/chat/completions", {
        "model": "lily-demo", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 24,
        "temperature": 0.8, "seed": 5,
    })
    return [] if lines and lines[-1] == "data: [DONE]" else [f"stream ended with {lines[-1:]}"]


def host_then_device(server: Server) -> list[str]:
    common = {"model": "lily-demo", "prompt": "The history of", "max_tokens": 12, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True}
    bodies = [{**common, "logprobs": 1}, {**common, "min_tokens": 5},
              {**common, "temperature": 0.9, "seed": 4, "max_tokens": 24}]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: server.post("/v1/completions", b), bodies))
    host, switched = (r["choices"][0]["token_ids"] for r in replies[:2])
    return [] if host == switched else [f"host-chosen {host} against host-then-device {switched}"]


def penalised(server: Server) -> list[str]:
    """Greedy decoding with penalties: chosen on the host (logprobs asked for), drawn on the device
    over the history its slot holds, and host-then-device (min_tokens) give the same ids."""
    common = {"model": "lily-demo", "prompt": "The history of", "max_tokens": 16, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True, "presence_penalty": 1.5,
              "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    bodies = [{**common, "logprobs": 1}, common, {**common, "min_tokens": 5}]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: server.post("/v1/completions", b), bodies))
    host, device, switched = (r["choices"][0]["token_ids"] for r in replies)
    if host == device == switched:
        return []
    return [f"penalised: host-chosen {host}, drawn on the device {device}, host then device {switched}"]


def scored_prompt(server: Server) -> list[str]:
    context = "The quick brown fox jumps over the lazy dog; " * 8
    common = {"model": "lily-demo", "temperature": 0, "logprobs": 1, "logit_bias": NO_EOS}
    first = server.post("/v1/completions", {**common, "prompt": context, "max_tokens": 1})["choices"][0]
    generated = first["logprobs"]["token_logprobs"][0]
    scored = server.post("/v1/completions", {**common, "prompt": context + first["text"], "max_tokens": 0,
                                             "echo": True})
    logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
    if len(logprobs) != scored["usage"]["prompt_tokens"] or logprobs[0] is not None:
        return [f"scored prompt: {len(logprobs)} logprobs for {scored['usage']['prompt_tokens']} tokens"]
    print(f"scored prompt: last token {logprobs[-1]:.5f}, as generated {generated:.5f}")
    return [] if abs(logprobs[-1] - generated) <= TOLERANCE else [f"scored {logprobs[-1]} vs generated {generated}"]


def check(lily: str, device: str) -> list[str]:
    problems = []
    cached, uncached = Server(lily, device), Server(lily, device, "--prefix-cache", "0")
    try:
        (first, second), (first_u, second_u) = two_turns(cached), two_turns(uncached)
        hits = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        print(f"second turn: {second['usage']['prompt_tokens']} prompt tokens, {hits} from the cache")
        if hits <= 0 or cached.metric("lily_prefix_cache_hits_total") < 1:
            problems.append("the second turn did not start from the prefix cache")
        for name, a, b in (("first", first, first_u), ("second", second, second_u)):
            top, top_u = first_top_logprobs(a), first_top_logprobs(b)
            shared = set(top) & set(top_u)
            worst = max((abs(top[t] - top_u[t]) for t in shared), default=float("inf"))
            print(f"{name} turn: top logprobs differ by {worst:.2e} with and without the cache")
            if len(shared) < 3 or worst > TOLERANCE:
                problems.append(f"{name} turn's logprobs differ with the cache: {top} against {top_u}")
            same = a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
            print(f"{name} turn: greedy replies {'equal' if same else 'differ (near-tie rounding?)'}")
        for server in (cached, uncached):
            problems += structured(server) + forced_call(server) + responses_api(server)
            problems += host_then_device(server) + penalised(server) + scored_prompt(server)
            with ThreadPoolExecutor(8) as pool:
                jobs = [pool.submit(job, server) for job in (structured, forced_call, responses_api, streamed) * 2]
                for job in jobs:
                    problems += job.result()
    finally:
        for server in (cached, uncached):
            if server.stop() != 0:
                problems.append("a server did not stop cleanly:\n" + "".join(server.log[-20:]))
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lily", required=True)
    parser.add_argument("--device", default="cuda", help="cpu runs the same checks on the reference backend")
    args = parser.parse_args()
    problems = check(args.lily, args.device)
    for problem in problems:
        print("PROBLEM:", problem)
    print(f"server on {args.device}:", "FAILED" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
