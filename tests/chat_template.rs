//! Chat template loading and rendering without Python: the ChatML fallback, the
//! `tokenizer_config.json` forms, special tokens, `raise_exception`, `tojson`, and errors that
//! name the file at fault. (Byte equality with transformers is checked by
//! tests/python/test_chat_template.py.)

use std::path::Path;

use lily::text::chat_template::ChatTemplate;
use serde_json::json;
use tempfile::TempDir;

fn model_dir(files: &[(&str, &str)]) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn render_dir(dir: &Path, context: serde_json::Value) -> anyhow::Result<String> {
    ChatTemplate::from_model_dir(dir)?.render(&context)
}

fn render_source(source: &str, context: serde_json::Value) -> String {
    ChatTemplate::from_source(source)
        .unwrap()
        .render(&context)
        .unwrap()
}

fn conversation() -> serde_json::Value {
    json!([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi 你好"},
        {"role": "assistant", "content": "Hello"},
    ])
}

const CHATML: &str = "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n\
                      <|im_start|>assistant\nHello<|im_end|>\n";

#[test]
fn chatml_fallback_without_any_file() {
    let dir = model_dir(&[]);
    let messages = conversation();
    let with_prompt = render_dir(
        dir.path(),
        json!({"messages": messages, "add_generation_prompt": true}),
    );
    assert_eq!(
        with_prompt.unwrap(),
        format!("{CHATML}<|im_start|>assistant\n")
    );
    let without_prompt = render_dir(dir.path(), json!({"messages": messages}));
    assert_eq!(without_prompt.unwrap(), CHATML);
}

#[test]
fn chatml_fallback_when_config_has_no_template() {
    let dir = model_dir(&[(
        "tokenizer_config.json",
        r#"{"eos_token": "<|im_end|>", "chat_template": null}"#,
    )]);
    let out = render_dir(dir.path(), json!({"messages": conversation()}));
    assert_eq!(out.unwrap(), CHATML);
}

#[test]
fn template_string_in_tokenizer_config() {
    let config = json!({"chat_template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"});
    let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
    let out = render_dir(dir.path(), json!({"messages": conversation()}));
    assert_eq!(out.unwrap(), "[system][user][assistant]");
}

#[test]
fn named_templates_in_tokenizer_config() {
    let config = json!({"chat_template": [
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        {"name": "default", "template": "default"},
    ]});
    let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
    let messages = conversation();
    let plain = render_dir(dir.path(), json!({"messages": messages}));
    assert_eq!(plain.unwrap(), "default");
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let with_tools = render_dir(dir.path(), json!({"messages": messages, "tools": tools}));
    assert_eq!(with_tools.unwrap(), "tools: 1");
}

#[test]
fn named_templates_without_default_is_an_error() {
    let config = json!({"chat_template": [{"name": "tool_use", "template": "x"}]});
    let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
    let err = render_dir(dir.path(), json!({"messages": conversation()})).unwrap_err();
    assert!(err.to_string().contains("default"), "{err:#}");
}

#[test]
fn jinja_file_wins_over_tokenizer_config() {
    let dir = model_dir(&[
        ("chat_template.jinja", "from the file"),
        (
            "tokenizer_config.json",
            r#"{"chat_template": "from the config"}"#,
        ),
    ]);
    let out = render_dir(dir.path(), json!({"messages": conversation()}));
    assert_eq!(out.unwrap(), "from the file");
}

#[test]
fn special_tokens_are_template_variables_unless_passed() {
    let config = json!({
        "add_bos_token": false,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "unk_token": {"__type": "AddedToken", "content": "<unk>", "special": true},
        "image_token": "<|image_pad|>",
        "extra_special_tokens": {"audio_token": "<|audio_pad|>"},
    });
    let template = "{{ bos_token is defined }} {{ add_bos_token is defined }} {{ eos_token }} \
                    {{ unk_token }} {{ image_token }} {{ audio_token }}";
    let dir = model_dir(&[
        ("tokenizer_config.json", &config.to_string()),
        ("chat_template.jinja", template),
    ]);
    let messages = conversation();
    let from_config = render_dir(dir.path(), json!({"messages": messages}));
    assert_eq!(
        from_config.unwrap(),
        "False False <|im_end|> <unk> <|image_pad|> <|audio_pad|>"
    );
    let overridden = render_dir(
        dir.path(),
        json!({"messages": messages, "eos_token": "mine", "bos_token": "<s>"}),
    );
    assert_eq!(
        overridden.unwrap(),
        "True False mine <unk> <|image_pad|> <|audio_pad|>"
    );
}

#[test]
fn raise_exception_is_a_clear_error() {
    let dir = model_dir(&[(
        "chat_template.jinja",
        "{% if messages[0].role != 'user' %}{{ raise_exception('First message must be from the user.') }}{% endif %}",
    )]);
    let err = render_dir(dir.path(), json!({"messages": conversation()})).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("raised: First message must be from the user."),
        "{text}"
    );
    assert!(text.contains("chat_template.jinja"), "{text}");
}

#[test]
fn qwen_template_errors_are_raised() {
    let template = std::fs::read_to_string("tests/data/qwen3.5-chat_template.jinja").unwrap();
    let template = ChatTemplate::from_source(&template).unwrap();
    let no_query = json!({"messages": [{"role": "system", "content": "s"}]});
    let err = template.render(&no_query).unwrap_err();
    assert!(
        err.to_string().contains("No user query found in messages."),
        "{err}"
    );
    let late_system = json!({"messages": [
        {"role": "user", "content": "u"}, {"role": "system", "content": "s"},
    ]});
    let err = template.render(&late_system).unwrap_err();
    assert!(
        err.to_string()
            .contains("System message must be at the beginning."),
        "{err}"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    let context = json!({
        "messages": conversation(),
        "v": {"name": "天气 🌦", "q": "a\"b\\c\nd\u{1}", "n": [1, 2.5, 1e20, 3.0, null, true], "e": {}, "l": []},
    });
    let out = render_source("{{ v | tojson }}", context.clone());
    assert_eq!(
        out,
        r#"{"name": "天气 🌦", "q": "a\"b\\c\nd\u0001", "n": [1, 2.5, 1e+20, 3.0, null, true], "e": {}, "l": []}"#
    );
    let out = render_source("{{ v.n | tojson(indent=2) }}", context.clone());
    assert_eq!(out, "[\n  1,\n  2.5,\n  1e+20,\n  3.0,\n  null,\n  true\n]");
    let out = render_source(
        "{{ {'b': {'c': [1]}, 'a': {}} | tojson(indent=1, sort_keys=true) }}",
        context.clone(),
    );
    assert_eq!(
        out,
        "{\n \"a\": {},\n \"b\": {\n  \"c\": [\n   1\n  ]\n }\n}"
    );
    let out = render_source(
        "{{ v.name | tojson(ensure_ascii=true) }} {{ [1, 'x'] | tojson(separators=(',', ':')) }}",
        context.clone(),
    );
    assert_eq!(out, r#""\u5929\u6c14 \ud83c\udf26" [1,"x"]"#);
    // Markup characters are not HTML-escaped, unlike jinja2's own tojson.
    let out = render_source("{{ '<a href=\"x\">&</a>' | tojson }}", context);
    assert_eq!(out, r#""<a href=\"x\">&</a>""#);
}

#[test]
fn python_value_printing() {
    let context = json!({"messages": conversation(), "v": [true, null, 1.0, 1e16, 1e-5, 0.1, "s"]});
    let out = render_source(
        "{{ v }} {{ v[0] }} {{ v[1] | string }} {{ v[3] }} {{ v[4] }}",
        context,
    );
    assert_eq!(
        out,
        "[True, None, 1.0, 1e+16, 1e-05, 0.1, 's'] True None 1e+16 1e-05"
    );
}

/// Strings inside printed lists and dicts are Python's `repr`: the quote chosen by content,
/// and every character Python does not print escaped (non-breaking and ideographic spaces,
/// zero-width and other format characters, C1 controls, private use, line separators).
#[test]
fn strings_in_printed_values_are_python_reprs() {
    let v = [
        "\u{a0}",
        "it's",
        "a\"b'c",
        "\u{200b}",
        "\u{85}\u{7f}\t",
        "é中😀",
        "\u{e0001}",
        "\u{e000}",
        "\u{2028}",
        "back\\slash",
    ];
    let context = json!({"messages": conversation(), "v": v, "d": {"\u{3000}": "x"}});
    let out = render_source("{{ v }} {{ d }}", context);
    assert_eq!(
        out,
        r#"['\xa0', "it's", 'a"b\'c', '\u200b', '\x85\x7f\t', 'é中😀', '\U000e0001', '\ue000', '\u2028', 'back\\slash'] {'\u3000': 'x'}"#
    );
}

/// Where a float lies exactly halfway between two shortest decimal forms, Python's `repr`
/// (and so `tojson`) takes the even last digit: 1000000000000000.25 is `...0.2`, not `...0.3`.
#[test]
fn floats_halfway_between_two_shortest_forms_print_as_python_does() {
    let v = [
        1_000_000_000_000_000.2,
        -1_000_000_000_000_003.2,
        1_000_000_000_000_000.8,
        5e-324,
        1.797_693_134_862_315_7e308,
        2.5e-5,
    ];
    let context = json!({"messages": conversation(), "v": v});
    let out = render_source("{{ v }} {{ v | tojson }}", context);
    let python = "1000000000000000.2, -1000000000000003.2, 1000000000000000.8, 5e-324, \
                  1.7976931348623157e+308, 2.5e-05";
    assert_eq!(out, format!("[{python}] [{python}]"));
}

#[test]
fn missing_or_corrupt_files_name_the_file() {
    let cases = [
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", "[1, 2]"),
        ("tokenizer_config.json", r#"{"chat_template": 42}"#),
        (
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "default"}]}"#,
        ),
        ("chat_template.jinja", "{% for x in %}"),
        ("chat_template.jinja", "{% if true %}unclosed"),
    ];
    for (name, text) in cases {
        let dir = model_dir(&[(name, text)]);
        let err = ChatTemplate::from_model_dir(dir.path())
            .err()
            .unwrap_or_else(|| panic!("{name} holding {text:?} was accepted"));
        let message = format!("{err:#}");
        assert!(message.contains(name), "{name}: {message}");
    }

    let dir = model_dir(&[]);
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        b"\xff\xfe bad utf-8",
    )
    .unwrap();
    let err = ChatTemplate::from_model_dir(dir.path()).err().unwrap();
    assert!(
        format!("{err:#}").contains("chat_template.jinja"),
        "{err:#}"
    );

    let missing = Path::new("/nonexistent/lily-model-dir");
    let err = ChatTemplate::from_model_dir(missing).err().unwrap();
    assert!(
        format!("{err:#}").contains("/nonexistent/lily-model-dir"),
        "{err:#}"
    );
}

#[test]
fn bad_context_is_an_error() {
    let template = ChatTemplate::from_source("x").unwrap();
    for context in [
        json!([]),
        json!({}),
        json!({"messages": []}),
        json!({"messages": ["not an object"]}),
        json!({"messages": conversation(), "tools": {"not": "a list"}}),
    ] {
        assert!(template.render(&context).is_err(), "{context} was accepted");
    }
}
