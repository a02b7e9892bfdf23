//! Tool calls survive the round trip through Qwen3.5's chat template and lily's tool-call parser.
//!
//! The model learns its tool-call format from the template, which writes the assistant
//! `tool_calls` of the history in that format: what the template writes for a call is what the
//! model writes when it makes the call, and what the server must turn back into the same call.
//! For a thousand seeded random cases (random tools whose parameter schemas are strings,
//! integers, numbers, booleans, null, arrays, objects, type lists, enums and `anyOf`/`oneOf`,
//! nested; one to three random calls of them, with random content and reasoning), the test
//! renders an assistant message holding the calls with lily's [`ChatTemplate`] and the official
//! template, cuts out the reply the model would have generated (after the prompt's `<think>\n`, up
//! to `<|im_end|>`), runs it through the server's pipeline ([`ReasoningSplitter`], then
//! [`ToolCallParser`]) whole and in random small pieces, and checks that
//! - both give the same answer;
//! - the reasoning and the content come back, trimmed as the template trims them;
//! - the calls come back: the same names in order, and arguments (read from the JSON text the
//!   server sends) equal to the originals.
//!
//! Arguments are compared as JSON values, numbers by value (`1.0` and `1`, `-0.0` and `0` are
//! one JSON number). They must round-trip exactly:
//! - strings with their newlines and surrounding whitespace: the template puts one newline on
//!   each side of a value and the parser, like vLLM's `qwen3_coder` parser (the reference),
//!   removes one;
//! - tag-like text inside values: the reference takes `</parameter>`, `</function>` and
//!   `</tool_call>` for the structure only where the structure continues after them, and
//!   `<parameter=` only at the start of a line; the generated values hold the tags only between
//!   other text, where that rule is unambiguous;
//! - integers of any size: the template writes them in full and the reference reads them with
//!   Python's `int()`.
//!
//! Where the template's format cannot tell values apart, the expected answer follows the
//! reference:
//! - a parameter whose schema gives no type (one the tool does not declare, or an `enum` alone)
//!   comes back as the text the template wrote, Python's `str()` of the value (`7` as `"7"`,
//!   `true` as `"True"`): the reference leaves untyped parameters strings;
//! - the template writes strings raw, so a string whose text reads as a value of another type
//!   its schema allows (`"5"` for `["integer", "string"]`, `"None"` for a nullable string,
//!   `"[1]"` where arrays are allowed) comes back as that value, as the reference reads nullable
//!   parameters' `None` and type lists' values. Once surrounding whitespace is removed (as
//!   Python's `int()` and `float()` remove it), text reads as an integer if it is an integer
//!   literal, as a number if it is JSON number text, as a boolean if it is `true` or `false` in
//!   any case (the template writes Python's `True`), as null if it is `null` or `None`, and as an
//!   array or object if it is the JSON text of one. The schema's non-string types (its `type`, or
//!   those of its `anyOf`/`oneOf` branches) are tried in order. (lily also reads integral
//!   decimals such as `3.0` as integers, where the reference keeps the string; no generated
//!   string is one.)

use lily::server::openai::Tool;
use lily::server::reasoning::{ReasoningSplitter, Split};
use lily::server::tool_calls::{ParsedCall, ToolCallParser};
use lily::text::chat_template::ChatTemplate;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde_json::{Map, Number, Value, json};

/// How many random cases the property test checks.
const CASES: u64 = 1000;
const TEMPLATE: &str = include_str!("data/qwen3.5-chat_template.jinja");
const TYPES: [&str; 7] = [
    "string", "integer", "number", "boolean", "null", "array", "object",
];

/// A seeded source of random choices.
struct Gen(ChaCha8Rng);

impl Gen {
    fn new(seed: u64) -> Self {
        Self(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A number in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// A function or parameter name: identifier-like, sometimes with `.`, `-` or non-ASCII letters.
fn name(g: &mut Gen) -> String {
    const PARTS: &str = "get weather city x max_tokens user.id dry-run météo 名前 _private A1 v2";
    let parts: Vec<&str> = PARTS.split(' ').collect();
    let name: Vec<&str> = (0..1 + g.below(2)).map(|_| *g.pick(&parts)).collect();
    name.join("_")
}

/// `count` pieces, each from a group picked at random, joined.
fn joined_pieces(g: &mut Gen, groups: &[&[&str]], count: usize) -> String {
    (0..count)
        .map(|_| {
            let group = g.pick(groups);
            *g.pick(group)
        })
        .collect()
}

/// Reasoning or content: words, whitespace, non-ASCII text and markup that is not the format's.
fn prose(g: &mut Gen) -> String {
    const GROUPS: [&[&str]; 3] = [
        &["I will check.", "München", "🙂"],
        &[" ", "\n", "\n\n"],
        &["a < b", "x > y", "<b>bold</b>", "<"],
    ];
    let count = g.below(5);
    joined_pieces(g, &GROUPS, count)
}

/// A string value: sometimes one whose whole text reads as a value of another JSON type, else
/// pieces of words, non-ASCII text, whitespace, JSON and Python literals, markup, and the
/// format's own tags between other text (where they cannot be taken for the structure).
fn text(g: &mut Gen) -> String {
    const READABLE: [&[&str]; 3] = [
        &["5", " 7 ", "-12", "2.5", "\n0.1\n", "18446744073709551615"],
        &["True", "false", "None", "null"],
        &["[1, \"a\"]", "{\"k\": null}", "[]"],
    ];
    if g.one_in(3) {
        return joined_pieces(g, &READABLE, 1);
    }
    const GROUPS: [&[&str]; 7] = [
        &["Paris", "hello world", "a", "é", "東京", "🙂"],
        &[" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u{2028}"],
        &["5", "42", "-", "true", "None", "null"],
        &["{", "}", "[", "]", ",", "\"", "'", "\\"],
        &["<", ">", "a < b > c", "<b>"],
        &["<tool_call>", "<function=g>", "a<parameter=b>c", "</think>"],
        &["x</parameter>y", "f</function>g", "t</tool_call>u"],
    ];
    let count = g.below(6);
    joined_pieces(g, &GROUPS, count)
}

/// An integer: small, random, at the edges of 64 bits, past 2^53 and past `i64::MAX`.
fn integer(g: &mut Gen) -> Value {
    match g.below(4) {
        0 => json!(*g.pick(&[0, 1, -1, i64::MAX, i64::MIN, 9_007_199_254_740_993])),
        1 => json!(*g.pick(&[1u64 << 63, u64::MAX])),
        2 => json!(g.0.next_u64() as i64),
        _ => json!(g.below(1000) as i64 - 500),
    }
}

/// A number: an integer, or a finite float (negative zero, integral, tiny, huge, random bits).
fn number(g: &mut Gen) -> Value {
    let x = match g.below(4) {
        0 => return integer(g),
        1 => *g.pick(&[
            0.0,
            -0.0,
            1.0,
            2.5,
            0.1 + 0.2,
            1e15,
            1e16,
            1e-7,
            5e-324,
            f64::MAX,
            -1e300,
            123_456.789,
        ]),
        2 => f64::from_bits(g.0.next_u64()),
        _ => (g.below(2000) as f64 - 1000.0) / 8.0,
    };
    if x.is_finite() { json!(x) } else { json!(0.5) }
}

/// Any JSON value, nested up to three levels.
fn any_json(g: &mut Gen, depth: usize) -> Value {
    match g.below(if depth < 3 { 7 } else { 5 }) {
        0 => text(g).into(),
        1 => number(g),
        2 => g.one_in(2).into(),
        3 => Value::Null,
        4 => integer(g),
        5 => (0..g.below(4)).map(|_| any_json(g, depth + 1)).collect(),
        _ => any_object(g, depth),
    }
}

/// A JSON object of any values, nested up to three levels.
fn any_object(g: &mut Gen, depth: usize) -> Value {
    Value::Object(
        (0..g.below(4))
            .map(|_| (text(g), any_json(g, depth + 1)))
            .collect(),
    )
}

/// A parameter's JSON schema; `depth` bounds the nesting of arrays, objects and unions.
fn schema(g: &mut Gen, depth: usize) -> Value {
    let mut schema = match g.below(if depth < 2 { 10 } else { 7 }) {
        0..=3 => json!({"type": g.pick(&TYPES)}),
        4 | 5 => {
            let mut types = TYPES.to_vec();
            g.shuffle(&mut types);
            types.truncate(2 + g.below(2));
            // Strings make the text of values ambiguous: allow them in half the lists.
            if !types.contains(&"string") && g.one_in(2) {
                types.push("string");
            }
            json!({"type": types})
        }
        6 => enum_schema(g),
        7 => json!({"type": "array", "items": schema(g, depth + 1)}),
        8 => json!({"type": "object", "properties": properties(g, depth + 1)}),
        _ => {
            let union = *g.pick(&["anyOf", "oneOf"]);
            let branches = vec![schema(g, depth + 1), schema(g, depth + 1)];
            Value::Object(Map::from_iter([(union.to_owned(), branches.into())]))
        }
    };
    if g.one_in(3) {
        schema["description"] = prose(g).into();
    }
    schema
}

/// An `enum` of strings, or one without a type that mixes strings, integers, booleans and null.
fn enum_schema(g: &mut Gen) -> Value {
    let mut options: Vec<Value> = (0..1 + g.below(3)).map(|_| text(g).into()).collect();
    if g.one_in(2) {
        return json!({"type": "string", "enum": options});
    }
    options.push(
        g.pick(&[json!(7), json!(-3), json!(true), Value::Null])
            .clone(),
    );
    json!({"enum": options})
}

/// The `properties` of an object schema.
fn properties(g: &mut Gen, depth: usize) -> Map<String, Value> {
    (0..g.below(5))
        .map(|_| (name(g), schema(g, depth)))
        .collect()
}

/// A value that fits `schema`.
fn value_for(g: &mut Gen, schema: &Value) -> Value {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        return g.pick(options).clone();
    }
    if let Some(branches) = ["anyOf", "oneOf"]
        .iter()
        .find_map(|k| schema.get(*k)?.as_array())
    {
        let branch = g.pick(branches);
        return value_for(g, branch);
    }
    let kind = match &schema["type"] {
        Value::Array(types) => g.pick(types).as_str().unwrap_or_default(),
        kind => kind.as_str().unwrap_or_default(),
    };
    match kind {
        "integer" => integer(g),
        "number" => number(g),
        "boolean" => g.one_in(2).into(),
        "null" => Value::Null,
        "array" => (0..g.below(4))
            .map(|_| match schema.get("items") {
                Some(items) => value_for(g, items),
                None => any_json(g, 1),
            })
            .collect(),
        "object" => match schema.get("properties").and_then(Value::as_object) {
            Some(properties) => {
                let mut object = Map::new();
                for (key, schema) in properties {
                    if !g.one_in(3) {
                        object.insert(key.clone(), value_for(g, schema));
                    }
                }
                Value::Object(object)
            }
            None => any_object(g, 1),
        },
        _ => text(g).into(),
    }
}

/// The types a schema allows: its `type` (a name or a list), else those of its `anyOf`/`oneOf`
/// branches, in order.
fn schema_types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(kind)) => vec![kind.as_str()],
        Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
        _ => ["anyOf", "oneOf"]
            .iter()
            .filter_map(|k| schema.get(*k)?.as_array())
            .flatten()
            .flat_map(schema_types)
            .collect(),
    }
}

/// Whether `value` is of the JSON schema type `kind` (not counting `"string"`, see [`expected_value`]).
fn is_of_type(value: &Value, kind: &str) -> bool {
    match kind {
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        _ => false,
    }
}

/// Python's `str()` of a value the template writes with `| string` (not a list or dict).
fn python_str(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Bool(true) => "True".to_owned(),
        Value::Bool(false) => "False".to_owned(),
        Value::Null => "None".to_owned(),
        Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
        other => panic!("no {other} is generated where the schema does not allow its type"),
    }
}

/// `text` read as a value of JSON type `kind`, if it is one (see the module documentation).
fn read_as(kind: &str, text: &str) -> Option<Value> {
    let text = text.trim();
    let json = || serde_json::from_str::<Value>(text).ok();
    match kind {
        "integer" => json().filter(|v| v.is_i64() || v.is_u64()),
        "number" => json().filter(Value::is_number),
        "boolean" => match text.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "null" => matches!(text, "null" | "None").then_some(Value::Null),
        "array" => json().filter(Value::is_array),
        "object" => json().filter(Value::is_object),
        _ => None,
    }
}

/// What the parser should give for `value` written under `schema` (`None`: an undeclared
/// parameter): the value itself where the schema allows its type, else its text as the
/// template wrote it, read as the first other type the schema allows that it reads as.
fn expected_value(value: &Value, schema: Option<&Value>) -> Value {
    let types = schema.map(schema_types).unwrap_or_default();
    if !value.is_string() && types.iter().any(|t| is_of_type(value, t)) {
        return value.clone();
    }
    let text = python_str(value);
    types
        .iter()
        .filter(|t| **t != "string")
        .find_map(|t| read_as(t, &text))
        .unwrap_or(Value::String(text))
}

/// A number's exact value: an integer where it is one (`2.0`, `-0.0`), else the float.
fn exact(n: &Number) -> Result<i128, f64> {
    if let Some(i) = n.as_i64() {
        return Ok(i.into());
    }
    if let Some(u) = n.as_u64() {
        return Ok(u.into());
    }
    let x = n.as_f64().unwrap_or(f64::NAN);
    // Every integral float below 2^127 is exactly an i128.
    if x.fract() == 0.0 && x.abs() < 1.7e38 {
        Ok(x as i128)
    } else {
        Err(x)
    }
}

/// JSON equality with numbers compared by value.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => match (exact(a), exact(b)) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a == b,
            _ => false,
        },
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same(a, b))
        }
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| same(v, w)))
        }
        (a, b) => a == b,
    }
}

/// The server's answer for a reply: reasoning, content, and calls as the client reads them.
#[derive(Debug, Default, PartialEq)]
struct Answer {
    reasoning: String,
    content: String,
    /// Names and arguments (parsed from the JSON text the server sends).
    calls: Vec<(String, Value)>,
}

impl Answer {
    fn matches(&self, want: &Answer) -> bool {
        self.reasoning == want.reasoning
            && self.content == want.content
            && self.calls.len() == want.calls.len()
            && self
                .calls
                .iter()
                .zip(&want.calls)
                .all(|((name, args), (want_name, want_args))| {
                    name == want_name && same(args, want_args)
                })
    }
}

/// A conversation's last turn: the request's tools and an assistant message that calls them.
struct Case {
    tools: Value,
    content: String,
    reasoning: String,
    /// Function names and arguments.
    calls: Vec<(String, Map<String, Value>)>,
}

impl Case {
    /// One to three random tools, and one to three calls of them (some leaving parameters out,
    /// some passing one the tool does not declare).
    fn random(g: &mut Gen) -> Self {
        let tools: Vec<(String, Map<String, Value>)> = (0..1 + g.below(3))
            .map(|i| (format!("{}{i}", name(g)), properties(g, 0)))
            .collect();
        let calls = (0..1 + g.below(3))
            .map(|_| {
                let (name, properties) = g.pick(&tools);
                let mut declared: Vec<(&String, &Value)> =
                    properties.iter().filter(|_| !g.one_in(4)).collect();
                g.shuffle(&mut declared);
                let mut arguments: Map<String, Value> = declared
                    .into_iter()
                    .map(|(key, schema)| (key.clone(), value_for(g, schema)))
                    .collect();
                if g.one_in(5) {
                    let value = if g.one_in(2) {
                        text(g).into()
                    } else {
                        integer(g)
                    };
                    arguments.insert(format!("undeclared_{name}"), value);
                }
                (name.clone(), arguments)
            })
            .collect();
        let tools = tools
            .into_iter()
            .map(|(name, properties)| {
                json!({"type": "function", "function": {
                    "name": name,
                    "description": prose(g),
                    "parameters": {"type": "object", "properties": properties},
                }})
            })
            .collect();
        Self {
            tools,
            content: prose(g),
            reasoning: prose(g),
            calls,
        }
    }

    /// The reply the model writes to make the calls: the assistant turn the template renders
    /// for them, after the `<think>\n` that ends the prompt, up to `<|im_end|>`.
    fn reply(&self, template: &ChatTemplate) -> String {
        let tool_calls: Vec<Value> = self
            .calls
            .iter()
            .enumerate()
            .map(|(i, (name, arguments))| {
                json!({"id": format!("call_{i}"), "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        let rendered = template
            .render(&json!({
                "messages": [
                    {"role": "user", "content": "Go."},
                    {"role": "assistant", "content": self.content,
                     "reasoning_content": self.reasoning, "tool_calls": tool_calls},
                ],
                "tools": self.tools,
            }))
            .expect("the template renders");
        const START: &str = "<|im_start|>assistant\n<think>\n";
        let start = rendered.rfind(START).expect("an assistant turn") + START.len();
        let end = rendered.rfind("<|im_end|>").expect("the end of the turn");
        rendered[start..end].to_owned()
    }

    /// What the server should answer for the reply.
    fn expected(&self) -> Answer {
        let schema = |function: &str, parameter: &str| {
            self.tools
                .as_array()?
                .iter()
                .find(|t| t["function"]["name"] == function)?["function"]["parameters"]
                ["properties"]
                .get(parameter)
        };
        let calls = self.calls.iter().map(|(name, arguments)| {
            let arguments = arguments
                .iter()
                .map(|(key, value)| (key.clone(), expected_value(value, schema(name, key))))
                .collect();
            (name.clone(), Value::Object(arguments))
        });
        Answer {
            reasoning: self.reasoning.trim().to_owned(),
            content: self.content.trim().to_owned(),
            calls: calls.collect(),
        }
    }

    /// Renders the reply and checks the server's answers for it, whole and streamed in random
    /// pieces from `g`.
    fn check(&self, template: &ChatTemplate, g: &mut Gen) -> Result<(), String> {
        let tools: Vec<Tool> = serde_json::from_value(self.tools.clone()).expect("valid tools");
        let reply = self.reply(template);
        let whole = serve(&tools, &[&reply]);
        let streamed = serve(&tools, &pieces(g, &reply));
        let want = self.expected();
        if !whole.matches(&want) {
            Err(format!(
                "reply: {reply:?}\nexpected: {want:?}\nanswered: {whole:?}"
            ))
        } else if whole != streamed {
            Err(format!(
                "streamed and whole answers differ\nreply: {reply:?}\nwhole: {whole:?}\n\
                 streamed: {streamed:?}"
            ))
        } else {
            Ok(())
        }
    }
}

/// `text` cut into pieces of one to eight characters, as a stream of tokens delivers it.
fn pieces<'a>(g: &mut Gen, text: &'a str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let at = rest
            .char_indices()
            .nth(1 + g.below(8))
            .map_or(rest.len(), |(i, _)| i);
        out.push(&rest[..at]);
        rest = &rest[at..];
    }
    out
}

/// The server's pipeline for a reply streamed in `pieces` after a prompt that opened a thought
/// (as `chat.rs` runs it): reasoning split off, then tool calls parsed from the content.
fn serve(tools: &[Tool], pieces: &[&str]) -> Answer {
    let mut splitter = ReasoningSplitter::new(true);
    let mut splits: Vec<Split> = pieces.iter().map(|p| splitter.push(p)).collect();
    splits.push(splitter.finish());
    let mut parser = ToolCallParser::new(tools.to_vec());
    let mut answer = Answer::default();
    let mut calls: Vec<ParsedCall> = Vec::new();
    for split in splits {
        answer.reasoning.push_str(&split.reasoning);
        let parsed = parser.push(&split.content);
        answer.content.push_str(&parsed.content);
        calls.extend(parsed.calls);
    }
    let parsed = parser.finish();
    answer.content.push_str(&parsed.content);
    calls.extend(parsed.calls);
    answer.calls = calls
        .into_iter()
        .map(|call| {
            let sent = Value::Object(call.arguments).to_string();
            let arguments = serde_json::from_str(&sent).expect("arguments are JSON");
            (call.name, arguments)
        })
        .collect();
    answer
}

#[test]
fn random_tool_calls_round_trip_through_the_chat_template() {
    let template = ChatTemplate::from_source(TEMPLATE).unwrap();
    let failures: Vec<String> = (0..CASES)
        .filter_map(|seed| {
            let mut g = Gen::new(seed);
            let case = Case::random(&mut g);
            let result = case.check(&template, &mut g);
            result.err().map(|why| format!("seed {seed}: {why}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {CASES} cases fail; the first three:\n\n{}",
        failures.len(),
        failures[..failures.len().min(3)].join("\n\n")
    );
}

/// Checks the round trip of one call of a tool `f` whose parameters have the schemas
/// `properties`.
fn check_call(properties: Value, arguments: Value) {
    let case = Case {
        tools: json!([{"type": "function", "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": properties},
        }}]),
        content: String::new(),
        reasoning: String::new(),
        calls: vec![("f".to_owned(), arguments.as_object().unwrap().clone())],
    };
    let template = ChatTemplate::from_source(TEMPLATE).unwrap();
    if let Err(why) = case.check(&template, &mut Gen::new(0)) {
        panic!("{why}");
    }
}

/// Checks that `value` under `schema` is expected back as `want`, and comes back so.
fn check_normalised(schema: Value, value: Value, want: Value) {
    let got = expected_value(&value, Some(&schema));
    assert!(same(&got, &want), "{value} under {schema}: {got}");
    check_call(json!({"p": schema}), json!({"p": value}));
}

/// The normalisations the format forces (see the module documentation).
#[test]
fn values_the_format_cannot_tell_apart_come_back_normalised() {
    check_normalised(json!({"type": ["integer", "string"]}), json!("5"), json!(5));
    check_normalised(
        json!({"type": ["string", "null"]}),
        json!("None"),
        Value::Null,
    );
    let array_or_string = json!({"anyOf": [{"type": "array"}, {"type": "string"}]});
    check_normalised(array_or_string, json!(" [1] "), json!([1]));
    check_normalised(
        json!({"type": ["boolean", "string"]}),
        json!("true"),
        json!(true),
    );
    check_normalised(json!({"enum": ["a", 7]}), json!(7), json!("7"));
    check_normalised(json!({"enum": [true, "a"]}), json!(true), json!("True"));
    check_normalised(json!({"type": "number"}), json!(1.0), json!(1));
    check_normalised(json!({"type": "number"}), json!(-0.0), json!(0));
    assert_eq!(expected_value(&json!(7), None), json!("7"));
    check_call(json!({}), json!({"undeclared": 7}));
}

// Minimal reproductions of the failures the property test finds. The reference (vLLM's
// qwen3_coder parser) takes `</parameter>`, `</function>` and `</tool_call>` for the structure
// only where the structure continues after them, and `<parameter=` only at a line's start.

#[test]
fn a_closing_parameter_tag_inside_a_value_is_text() {
    check_call(
        json!({"s": {"type": "string"}}),
        json!({"s": "a</parameter>b"}),
    );
}

#[test]
fn an_opening_parameter_tag_inside_a_value_is_text() {
    check_call(
        json!({"s": {"type": "string"}}),
        json!({"s": "a<parameter=b>c"}),
    );
}

#[test]
fn a_closing_function_tag_inside_a_value_is_text() {
    check_call(
        json!({"s": {"type": "string"}}),
        json!({"s": "f</function>g"}),
    );
}

#[test]
fn a_closing_tool_call_tag_inside_a_value_is_text() {
    check_call(
        json!({"s": {"type": "string"}}),
        json!({"s": "t</tool_call>u"}),
    );
}

#[test]
fn tags_inside_strings_of_json_values_are_text() {
    check_call(
        json!({"a": {"type": "array"}}),
        json!({"a": ["x</parameter>y"]}),
    );
}

/// For `number`, the reference's `float()` loses the last digits too; the exact integer is the
/// faithful reading of the text.
#[test]
fn integers_past_i64_max_stay_exact() {
    check_call(
        json!({"i": {"type": "integer"}, "n": {"type": "number"}}),
        json!({"i": 1u64 << 63, "n": u64::MAX}),
    );
}

/// The template writes nothing after the calls, but a model may: that text must not depend on
/// how the stream cut it.
#[test]
fn text_after_a_call_streams_as_it_parses_whole() {
    let reply = "</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>\nsee a b";
    let whole = serve(&[], &[reply]);
    let streamed = serve(&[], &reply.split_inclusive(' ').collect::<Vec<_>>());
    assert_eq!(streamed, whole);
}
