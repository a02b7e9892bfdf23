"""`lily render` must print what transformers prints for randomly generated conversations.

test_chat_template.py checks hand-written cases; this file checks the official Qwen3.5/3.6
template on many conversations built from a seeded RNG, so that combinations nobody thought to
write down are compared too. The generator aims at every branch of the template: a system message
first or not, user/assistant/tool turns in varied orders (several tool responses in a row, user
turns that are only a wrapped tool response), reasoning given as a field (or an alias of it), as
`<think>` tags inside the content or both, tool calls in all their shapes with arguments of every
JSON type, content as text or as parts (text, image, video), `tools` with varied JSON schemas,
`enable_thinking`, `add_generation_prompt`, `add_vision_id`, `documents`, and text mixing scripts,
emoji, whitespace Python strips, control characters and the template's own markers. Some conversations
get one fault the template (or transformers) rejects; lily must then fail too, with the
template's message when the template raised it.

Comparison as in test_chat_template.py: transformers' `apply_chat_template(..., tokenize=False)`
against lily on the same model directory, byte for byte. A failure names the seed and prints the
input JSON, which `lily render --model DIR` reads on stdin.

Run with: LILY_BIN=target/release/lily pytest tests/python/test_chat_template_random.py
"""

import json
import random

import pytest

from test_chat_template import QWEN_TEMPLATE, assert_same, lily, reference, write_model

CASES = 400

# Pieces random text is made of: words in several scripts and emoji, whitespace that Python's
# strip() removes (ASCII or not) and look-alikes it keeps, the template's markers and special
# tokens, template syntax, quotes and backslashes, control characters.
FRAGMENTS = [
    "Hello", "the answer is 42", "x", "Zürich", "你好，世界", "こんにちは", "Ελληνικά", "עברית", "مرحبا",
    "👋🏽", "🎉", "👨‍👩‍👧‍👦", "e\u0301",
    " ", "  ", "\n", "\n\n", "\t", "\r\n", "\r", "\u3000", "\xa0", "\x1c", "\x85", "\u2028",
    "\u200b", "\ufeff",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<function=f>", "</function>", "<parameter=p>",
    "</parameter>",
    "<|vision_start|>", "<|image_pad|>", "<IMPORTANT>",
    "{{ messages }}", "{% if true %}", "{#", "%}",
    '"', "'", "\\", "\\n", "`code`", "<b>&amp;</b>", "</script>",
    "\x00", "\x01", "\x1b[0m", "\x7f",
]
WHITESPACE = [" ", "\n", "\n\n", "\t", "\r\n", "\u3000", "\xa0", "\x1c", "\x85", "\u2028"]
# Tool, parameter and property names: mostly identifiers, some that only a careless renderer breaks.
NAMES = [
    "get_weather", "search", "run_python", "lookup_user", "location", "query", "days", "f", "天气查询",
    "get-time.v2", "with space", "", "<|im_end|>", "a\nb", 'q"uote',
]
IMAGE_PARTS = [
    {"type": "image", "image": "file:///tmp/cat.png"},
    {"type": "image"},
    {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
    {"image": "b.png"},
]
VIDEO_PARTS = [{"type": "video", "video": "clip.mp4"}, {"type": "video"}, {"video": ["f1.jpg", "f2.jpg"]}]
# Template variables and their values; only the literal `false` turns thinking off.
OPTIONS = {
    "add_generation_prompt": [True, False, None, 1],
    "enable_thinking": [True, False, None, 0, "false"],
    "add_vision_id": [True, False],
    "documents": [None, [], [{"title": "Paris", "text": "Paris is the capital of France."}]],
}
# The role of the next turn, weighted by the previous one (None: the conversation's start).
TURNS = ["user", "assistant", "tool", "wrapped"]
NEXT = {
    None: [85, 5, 5, 5],
    "user": [10, 80, 5, 5],
    "assistant": [45, 10, 40, 5],
    "tool": [10, 45, 40, 5],
    "wrapped": [20, 70, 5, 5],
}


def text(rng, most=6):
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, most)))


def padded(rng, s):
    """`s` with whitespace around it sometimes, for the template's trim() and strip('\\n')."""
    def pad():
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.choice([0, 0, 1, 2])))
    return pad() + s + pad()


def number(rng):
    """An int or a float, from small ones to the extremes: 64-bit bounds, tiny floats, and floats
    exactly halfway between two shortest decimal forms (Python prints the even one). Integers
    beyond 64 bits are left out: lily reads JSON numbers as 64-bit integers or doubles, so it
    prints such an integer as a float (a known limitation, rare in tool schemas and arguments)."""
    r = rng.random()
    if r < 0.3:
        return rng.randint(-100, 1000)
    if r < 0.42:
        return rng.randint(-2**63, 2**64 - 1)
    if r < 0.6:
        return round(rng.uniform(-1000, 1000), rng.randint(0, 4))
    if r < 0.8:
        return rng.uniform(-1, 1) * 10.0 ** rng.randint(-30, 30)
    if r < 0.88:
        return float(rng.randint(-10**6, 10**6))
    if r < 0.92:
        return rng.randint(2**49, 2**51) + rng.choice([0.25, 0.75])
    return rng.choice([0.0, -0.0, 0.1, 1e16, 1e-05, 5e-324, 1.7976931348623157e308])


def json_value(rng, depth=0):
    kinds = ["null", "bool", "number", "string", "string"] + (["list", "object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "number":
        return number(rng)
    if kind == "string":
        return text(rng)
    if kind == "list":
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(NAMES): json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def schema(rng, depth=0):
    """A parameter's JSON schema: scalar types with their keywords, arrays, objects, unions."""
    kinds = ["string", "integer", "number", "boolean", "null"]
    kind = rng.choice(kinds + (["array", "object", "anyOf", "types"] if depth < 2 else []))
    if kind == "array":
        s = {"type": "array", "items": schema(rng, depth + 1)}
    elif kind == "object":
        s = object_schema(rng, depth + 1)
    elif kind == "anyOf":
        s = {"anyOf": [schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    elif kind == "types":
        s = {"type": rng.sample(kinds, 2)}
    else:
        s = {"type": kind}
    if kind == "string" and rng.random() < 0.3:
        s["enum"] = [text(rng, 2) for _ in range(rng.randint(1, 3))]
    if kind in ("integer", "number") and rng.random() < 0.5:
        s["minimum"], s["maximum"] = number(rng), number(rng)
    if rng.random() < 0.5:
        s["description"] = text(rng)
    if rng.random() < 0.2:
        s["default"] = json_value(rng, depth + 1)
    return s


def object_schema(rng, depth=0):
    properties = {rng.choice(NAMES): schema(rng, depth) for _ in range(rng.randint(0, 4))}
    s = {"type": "object", "properties": properties}
    if properties and rng.random() < 0.7:
        s["required"] = rng.sample(list(properties), rng.randint(1, len(properties)))
    if rng.random() < 0.2:
        s["additionalProperties"] = rng.choice([False, True, {"type": "number"}])
    return s


def tool(rng):
    """A tool, OpenAI-style (`{"type": "function", "function": ...}`) or flat."""
    function = {"name": rng.choice(NAMES)}
    if rng.random() < 0.8:
        function["description"] = text(rng)
    if rng.random() < 0.9:
        function["parameters"] = object_schema(rng)
    return {"type": "function", "function": function} if rng.random() < 0.8 else function


def arguments(rng):
    return {rng.choice(NAMES): json_value(rng) for _ in range(rng.randint(0, 4))}


def tool_call(rng):
    """A tool call, OpenAI-style (with or without `id`/`type`) or flat, arguments as a dict or absent."""
    function = {"name": rng.choice(NAMES)}
    if rng.random() < 0.9:
        function["arguments"] = arguments(rng)
    form = rng.randrange(3)
    if form == 0:
        return {"id": f"call_{rng.randrange(1000)}", "type": "function", "function": function}
    return {"function": function} if form == 1 else function


def part(rng, media):
    """One content part: text (with or without `type`), an image or a video, or an odd item the
    template still renders (a text that is not a string, a bare string tested by substring)."""
    r = rng.random()
    if media and r < 0.3:
        return dict(rng.choice(IMAGE_PARTS))
    if media and r < 0.45:
        return dict(rng.choice(VIDEO_PARTS))
    if r < 0.48:
        return {"type": "text", "text": json_value(rng, 1)}
    if r < 0.5:
        return rng.choice(["plain text", "an image", "a video"])
    return {"type": "text", "text": text(rng)} if r < 0.85 else {"text": text(rng)}


def content(rng, s, media=True):
    """`s` as a message's content: the string itself, or text parts that join to it, with media
    parts among them sometimes."""
    if rng.random() < 0.75:
        return s
    cuts = sorted(rng.randint(0, len(s)) for _ in range(rng.randint(0, 2)))
    texts = [s[i:j] for i, j in zip([0, *cuts], [*cuts, len(s)])]
    parts = [{"type": "text", "text": t} for t in texts]
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        parts.insert(rng.randint(0, len(parts)), part(rng, media))
    return parts


def system(rng):
    return {"role": "system", "content": content(rng, padded(rng, text(rng)), media=False)}


def user(rng):
    return {"role": "user", "content": content(rng, padded(rng, text(rng)))}


def wrapped(rng):
    """A user turn holding only a tool response, which the template does not count as a query."""
    response = "<tool_response>" + padded(rng, text(rng)) + "</tool_response>"
    return {"role": "user", "content": content(rng, padded(rng, response), media=False)}


def tool_message(rng):
    response = rng.choice([text(rng), json.dumps(json_value(rng))])
    message = {"role": "tool", "content": content(rng, response)}
    if rng.random() < 0.5:
        message["tool_call_id"] = f"call_{rng.randrange(1000)}"
    return message


def assistant(rng):
    """An assistant turn: reasoning as a field (a string or not), an alias, `<think>` tags in the
    content (whole, closing tag only, or several), or a field and tags; content a string, parts,
    empty, null or absent; tool calls sometimes."""
    message = {"role": "assistant"}
    reasoning, answer = padded(rng, text(rng)), padded(rng, text(rng))
    style = rng.choice(
        ["none", "field", "alias", "tags", "closing_tag", "tags_twice", "field_and_tags", "odd_field"]
    )
    if style in ("field", "field_and_tags"):
        message["reasoning_content"] = reasoning
    elif style == "alias":
        message["reasoning_content"] = None
        message[rng.choice(["thinking", "reasoning"])] = reasoning
    elif style == "odd_field":
        message["reasoning_content"] = rng.choice([[reasoning], 5, True, {}])
    if style in ("tags", "field_and_tags", "odd_field"):
        answer = "<think>" + padded(rng, reasoning) + "</think>" + answer
    elif style == "closing_tag":
        answer = reasoning + "</think>" + answer
    elif style == "tags_twice":
        answer = "<think>" + reasoning + "</think><think>" + text(rng) + "</think>" + answer
    r = rng.random()
    if r < 0.8:
        message["content"] = content(rng, answer)
    elif r < 0.9:
        message["content"] = None
    if rng.random() < 0.35:
        message["tool_calls"] = [tool_call(rng) for _ in range(rng.randint(1, 3))]
    elif rng.random() < 0.1:
        message["tool_calls"] = rng.choice([None, [], {}, {"function": {"name": "f"}}, 5, True])
    return message


MESSAGES = {"user": user, "assistant": assistant, "tool": tool_message, "wrapped": wrapped}


def messages(rng):
    out = [system(rng)] if rng.random() < 0.5 else []
    turn = None
    for _ in range(rng.randint(1, 8)):
        turn = rng.choices(TURNS, NEXT[turn])[0]
        out.append(MESSAGES[turn](rng))
    return out


# Faults: each turns a conversation into one that the template (or transformers before it) rejects.
def late_system(rng, case_input):
    case_input["messages"].insert(rng.randint(1, len(case_input["messages"])), system(rng))


def odd_message(rng, case_input):
    """A message with a role the template does not know (or none), or one that is not an object."""
    role = rng.choice(["developer", "function", "User", "", None])
    message = rng.choice([{"role": role, "content": text(rng)}, "hello", None, ["user", "hello"]])
    case_input["messages"].insert(rng.randint(0, len(case_input["messages"])), message)


def no_user_query(rng, case_input):
    messages = case_input["messages"]
    case_input["messages"] = [wrapped(rng) if m["role"] == "user" else m for m in messages]


def media_in_system(rng, case_input):
    messages = case_input["messages"]
    if messages[0]["role"] != "system":
        messages.insert(0, system(rng))
    media = dict(rng.choice(IMAGE_PARTS + VIDEO_PARTS))
    messages[0]["content"] = [{"type": "text", "text": text(rng)}, media]


def unknown_part(rng, case_input):
    message = rng.choice(case_input["messages"])
    odd = rng.choice([{"type": "audio", "audio": "a.wav"}, {"type": "text"}, "other"])
    message["content"] = [{"type": "text", "text": text(rng)}, odd]


def content_not_text(rng, case_input):
    rng.choice(case_input["messages"])["content"] = rng.choice([42, 1.5, True, False, {"text": "x"}])


def malformed_tool_call(rng, case_input):
    """A tool call with arguments as a JSON string (transformers does not parse it), null or a list,
    without a string name, with a null function, or not an object."""
    good = {"name": rng.choice(NAMES), "arguments": arguments(rng)}
    call = rng.choice([
        {"function": {**good, "arguments": json.dumps(good["arguments"])}},
        {"function": {**good, "arguments": rng.choice([None, [1, 2]])}},
        {"function": {"arguments": good["arguments"]}},
        {"function": {**good, "name": rng.choice([None, 7, ["f"]])}},
        {"function": None},
        "get_weather",
        None,
    ])
    calls = [tool_call(rng) for _ in range(rng.randint(0, 2))]
    calls.insert(rng.randint(0, len(calls)), call)
    case_input["messages"].append({"role": "assistant", "content": text(rng), "tool_calls": calls})


def not_a_list(rng, case_input):
    """`tools` or `documents` that is not a list of objects. Both refuse these; left out are an
    empty mapping or string, which transformers iterates as nothing and lily refuses on purpose
    (an error naming the field rather than silently dropping what the caller sent)."""
    key = rng.choice(["tools", "documents"])
    case_input[key] = rng.choice([{"f": tool(rng)}, [tool(rng), "search"], 0])


FAULTS = [
    late_system, odd_message, no_user_query, media_in_system, unknown_part, content_not_text,
    malformed_tool_call, not_a_list,
]


def conversation(seed):
    """The input of case `seed`: messages, sometimes tools, template variables, at most one fault."""
    rng = random.Random(seed)
    case_input = {"messages": messages(rng)}
    if rng.random() < 0.4:
        case_input["tools"] = [tool(rng) for _ in range(rng.randint(0, 3))]
    for key, values in OPTIONS.items():
        if rng.random() < 0.6:
            case_input[key] = rng.choice(values)
    if rng.random() < 0.2:
        rng.choice(FAULTS)(rng, case_input)
    return case_input


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), jinja=QWEN_TEMPLATE)


@pytest.mark.parametrize("seed", range(CASES))
def test_random_conversation(seed, model_dir):
    case_input = conversation(seed)
    expected = reference(model_dir, case_input)
    try:
        assert_same(expected, lily(model_dir, case_input))
        return
    except (AssertionError, pytest.fail.Exception) as e:
        failure = str(e)
    case_json = json.dumps(case_input)  # ASCII, so that invisible characters show
    pytest.fail(f"seed {seed}: lily differs from transformers on this input:\n{case_json}\n{failure}",
                pytrace=False)


# Text that only one branch of the template prints, and every message it raises (but 'No messages
# provided.', as transformers rejects an empty conversation first): the cases above must reach all
# of them for the comparison to mean much.
BRANCH_TEXTS = [
    "</tools>\n\nIf you choose",  # tools
    "</IMPORTANT>\n\n",  # a system message after the tools
    "<|im_start|>system\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",  # thinking off, or a turn after the last query
    "<|im_start|>assistant\n<think>\n",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "Picture 2: ",
    "Video 1: ",
    "\n\n<tool_call>\n<function=",  # a call after content
    "<|im_start|>assistant\n<tool_call>",  # a call alone, before the last query
    "</tool_call>\n<tool_call>",  # several calls
    "</parameter>\n<parameter=",
    "<|im_start|>user\n<tool_response>\n",  # tool responses gathered into a user turn
    "</tool_response>\n<tool_response>",  # several in a row
]
RAISED = [
    "System message cannot contain images.",
    "System message cannot contain videos.",
    "Unexpected item type in content.",
    "Unexpected content type.",
    "No user query found in messages.",
    "System message must be at the beginning.",
    "Unexpected message role.",
]


def test_generator_reaches_every_branch(model_dir):
    outcomes = [reference(model_dir, conversation(seed)) for seed in range(CASES)]
    rendered = [o for o in outcomes if isinstance(o, str)]
    raised = {str(o) for o in outcomes if isinstance(o, Exception)}
    assert len(rendered) > CASES * 3 // 4
    assert [t for t in BRANCH_TEXTS if not any(t in r for r in rendered)] == []
    assert [m for m in RAISED if m not in raised] == []
