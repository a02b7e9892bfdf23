"""`lily render` must print exactly what transformers' chat templating produces.

The reference is transformers' own `tokenizer.apply_chat_template(..., tokenize=False)` (jinja2
inside, set up by transformers), run on a throwaway model directory that holds a tiny tokenizer,
the case's template and Qwen-like special tokens; lily renders the same directory. Outputs are
compared as bytes, and a case the reference rejects must make lily fail too.

Cases live in tests/data/chat_cases.json: each has `name`, `input` (the JSON object lily reads on
stdin: `messages`, `tools`, `add_generation_prompt`, other template variables), optionally
`template` (inline source; the official Qwen3.5/3.6 template otherwise) and, for cases that must
fail, `error` (text the reference's error message contains).

Run with: LILY_BIN=target/release/lily pytest tests/python/test_chat_template.py
"""

import copy
import datetime
import difflib
import json
import os
import subprocess
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
LILY = Path(os.environ.get("LILY_BIN", REPO / "target" / "release" / "lily"))
QWEN_TEMPLATE = (DATA / "qwen3.5-chat_template.jinja").read_text(encoding="utf-8")
CASES = json.loads((DATA / "chat_cases.json").read_text(encoding="utf-8"))

# Special tokens as the Qwen3.5/3.6 tokenizer_config.json declares them (strings, nulls, a flag
# ending in `_token`), plus the added-token object form and a model-specific named token.
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": False,
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "normalized": False,
                  "rstrip": False, "single_word": False, "special": True},
    "image_token": "<|image_pad|>",
}

# Prints every special-token variable, so a missing or extra one shows up as a difference.
SPECIAL_TOKENS_TEMPLATE = (
    "{{ bos_token is defined }} {{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|"
    "{{ image_token }}|{{ sep_token is defined }}|{{ add_bos_token is defined }}|{{ audio_token }}"
)


def case_id(case):
    return case["name"]


def write_model(directory, jinja=None, config_template=None, config=None):
    """A model directory transformers can load: tiny tokenizer, config, optional template file."""
    directory.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    config = dict(TOKENIZER_CONFIG if config is None else config)
    if config_template is not None:
        config["chat_template"] = config_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja, encoding="utf-8", newline="")
    return directory


def reference(directory, case_input):
    """transformers' rendering, or the exception it raises."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    kwargs = copy.deepcopy(case_input)
    messages = kwargs.pop("messages")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=kwargs.pop("tools", None),
            documents=kwargs.pop("documents", None),
            # `lily render` defaults it to true.
            add_generation_prompt=kwargs.pop("add_generation_prompt", True),
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - every failure of the reference is a case outcome
        return e


def lily(directory, case_input):
    assert LILY.is_file(), f"{LILY} not found: build with `cargo build --release` or set LILY_BIN"
    return subprocess.run(
        [str(LILY), "render", "--model", str(directory)],
        input=json.dumps(case_input, ensure_ascii=False).encode("utf-8"),
        capture_output=True,
        timeout=60,
    )


def assert_same(expected, proc):
    """lily's run must print exactly `expected`, or fail like the reference failed."""
    if isinstance(expected, Exception):
        assert proc.returncode != 0, f"reference raised {expected!r} but lily printed:\n{proc.stdout.decode()}"
        assert proc.stdout == b""
        stderr = proc.stderr.decode("utf-8")
        assert stderr.startswith("error: "), stderr
        if type(expected) is jinja2.exceptions.TemplateError:
            # Raised by the template through raise_exception: lily must pass the message on.
            assert str(expected) in stderr, stderr
        return
    assert proc.returncode == 0, proc.stderr.decode("utf-8", errors="replace")
    if proc.stdout != expected.encode("utf-8"):
        diff = difflib.unified_diff(
            expected.splitlines(keepends=True),
            proc.stdout.decode("utf-8", errors="replace").splitlines(keepends=True),
            "transformers",
            "lily",
        )
        pytest.fail("rendering differs:\n" + "".join(repr(line) + "\n" for line in diff))


def check_case(case, directory):
    expected = reference(directory, case["input"])
    if "error" in case:
        assert isinstance(expected, Exception), f"reference did not fail: {expected!r}"
        assert case["error"] in str(expected), repr(expected)
    elif isinstance(expected, Exception):
        raise expected
    assert_same(expected, lily(directory, case["input"]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_case_from_jinja_file(case, tmp_path):
    check_case(case, write_model(tmp_path, jinja=case.get("template", QWEN_TEMPLATE)))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_case_from_tokenizer_config(case, tmp_path):
    check_case(case, write_model(tmp_path, config_template=case.get("template", QWEN_TEMPLATE)))


def cases_named(*names):
    chosen = [case for case in CASES if case["name"] in names]
    assert len(chosen) == len(names)
    return chosen


# A list of named templates: transformers uses `tool_use` when tools are passed, else `default`.
NAMED_TEMPLATES = [
    {"name": "default", "template": "default:{% for m in messages %}{{ m.content }}{% endfor %}"},
    {"name": "tool_use", "template": "tool_use:{{ tools | tojson }}"},
    {"name": "other", "template": "other"},
]


@pytest.mark.parametrize("case", cases_named("single_user", "tools_with_system"), ids=case_id)
def test_named_templates(case, tmp_path):
    check_case(case, write_model(tmp_path, config_template=NAMED_TEMPLATES))


def test_named_templates_without_default(tmp_path):
    directory = write_model(tmp_path, config_template=[{"name": "tool_use", "template": "x"}])
    case = {"input": {"messages": [{"role": "user", "content": "Hi"}]}, "error": "with no default specified"}
    check_case(case, directory)


def test_jinja_file_wins_over_tokenizer_config(tmp_path):
    directory = write_model(tmp_path, jinja="from the file", config_template="from the config")
    case_input = {"messages": [{"role": "user", "content": "Hi"}]}
    assert reference(directory, case_input) == "from the file"
    check_case({"input": case_input}, directory)


@pytest.mark.parametrize(
    "case_input",
    [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "Hi"}], "eos_token": "caller's eos", "bos_token": None},
    ],
    ids=["from_config", "caller_overrides"],
)
def test_special_tokens(case_input, tmp_path):
    config = {**TOKENIZER_CONFIG, "extra_special_tokens": {"audio_token": "<|audio_pad|>"}}
    directory = write_model(tmp_path, jinja=SPECIAL_TOKENS_TEMPLATE, config=config)
    check_case({"input": case_input}, directory)


def chatml(messages, add_generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize("add_generation_prompt", [True, False, None])
@pytest.mark.parametrize("with_config", [True, False])
def test_chatml_fallback(add_generation_prompt, with_config, tmp_path):
    # transformers 5 has no default template any more (it raises), so the expectation is ChatML
    # written out here.
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi 你好 🎉"},
        {"role": "assistant", "content": "Hello"},
    ]
    case_input = {"messages": messages}
    if add_generation_prompt is not None:
        case_input["add_generation_prompt"] = add_generation_prompt
    tmp_path.mkdir(exist_ok=True)
    if with_config:
        write_model(tmp_path)
    proc = lily(tmp_path, case_input)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == chatml(messages, add_generation_prompt is not False)


def test_strftime_now(tmp_path):
    fmt = "%Y-%m-%d|%d %b %Y|%A %B|%j|%%|%-d"
    directory = write_model(tmp_path, jinja="{{ strftime_now('" + fmt + "') }}")
    case_input = {"messages": [{"role": "user", "content": "Hi"}]}
    before = datetime.datetime.now().strftime(fmt)
    proc = lily(directory, case_input)
    expected = reference(directory, case_input)
    after = datetime.datetime.now().strftime(fmt)
    assert expected in (before, after)
    assert_same(expected, proc)
