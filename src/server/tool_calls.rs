//! Tool calls in a reply: the `<tool_call>...</tool_call>` blocks a model writes, parsed into
//! OpenAI tool calls as the reply streams.
//!
//! Two forms are read inside a block: Qwen3.5/3.6's XML form (what its chat template teaches,
//! Qwen3-Coder style)
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! and the JSON form of earlier Qwen models, `{"name": ..., "arguments": {...}}`. XML parameter
//! values are text; they become JSON values of the types the tool's JSON schema gives (a
//! parameter without a schema stays a string). The format cannot escape markup inside values,
//! so `</parameter>`, `</function>` and `</tool_call>` end a part only where the call's
//! structure continues after them, and `<parameter=` starts one only at the start of a line
//! (as vLLM's `qwen3_coder` parser reads them). A block that cannot be parsed is returned as
//! content, unchanged. Text around the blocks is content, without the whitespace that separates
//! it from them.

use serde_json::{Map, Number, Value};

use super::openai::Tool;
use super::reasoning::partial_tag_len;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A parsed call: the function's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// What one piece of content text gave: plain content and completed calls.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// Separates tool calls from content in streamed reply text.
#[derive(Debug)]
pub struct ToolCallParser {
    tools: Vec<Tool>,
    pending: String,
    in_call: bool,
    calls_made: usize,
    /// A block has just closed: the whitespace after it is not content.
    after_block: bool,
}

impl ToolCallParser {
    /// `tools`: the request's tools, whose parameter schemas type the XML form's values.
    pub fn new(tools: Vec<Tool>) -> Self {
        Self {
            tools,
            pending: String::new(),
            in_call: false,
            calls_made: 0,
            after_block: false,
        }
    }

    /// Takes the next piece of content text.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut out = Parsed::default();
        loop {
            if self.in_call {
                let Some(at) = block_end(&self.pending) else {
                    return out;
                };
                let block = self.pending[..at].to_owned();
                self.pending.drain(..at + CLOSE.len());
                self.in_call = false;
                self.take_block(&block, true, &mut out);
                self.after_block = self.calls_made > 0;
                continue;
            }
            if self.after_block {
                let trimmed_len = self.pending.trim_start().len();
                self.pending.drain(..self.pending.len() - trimmed_len);
                if self.pending.is_empty() {
                    return out;
                }
                self.after_block = false;
            }
            if let Some(at) = self.pending.find(OPEN) {
                out.content.push_str(self.pending[..at].trim_end());
                self.pending.drain(..at + OPEN.len());
                self.in_call = true;
                continue;
            }
            // Hold a possible start of `<tool_call>` and the whitespace before it.
            let cut = self.pending.len() - partial_tag_len(&self.pending, OPEN);
            let cut = self.pending[..cut].trim_end().len();
            out.content.push_str(&self.pending[..cut]);
            self.pending.drain(..cut);
            return out;
        }
    }

    /// Ends the reply. A block left open is parsed if it holds a whole call (models sometimes
    /// stop right after `</function>`), else returned as content.
    pub fn finish(&mut self) -> Parsed {
        let pending = std::mem::take(&mut self.pending);
        let mut out = Parsed::default();
        if self.in_call {
            self.in_call = false;
            self.take_block(&pending, false, &mut out);
        } else if self.calls_made == 0 || !pending.trim().is_empty() {
            out.content = pending;
        }
        out
    }

    /// Whether any call has been parsed.
    pub fn made_calls(&self) -> bool {
        self.calls_made > 0
    }

    fn take_block(&mut self, block: &str, closed: bool, out: &mut Parsed) {
        match parse_block(block, &self.tools) {
            Some(calls) => {
                self.calls_made += calls.len();
                out.calls.extend(calls);
            }
            None => {
                out.content.push_str(OPEN);
                out.content.push_str(block);
                if closed {
                    out.content.push_str(CLOSE);
                }
            }
        }
    }
}

const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Where the block that `pending` holds (after its `<tool_call>`) ends: the first `</tool_call>`
/// that follows the end of a call (`</function>`, `</parameter>` where a model left the function
/// open, or the `}` of the JSON form). One inside a parameter's value is text.
fn block_end(pending: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = pending[from..].find(CLOSE).map(|i| from + i) {
        let before = pending[..at].trim_end();
        if [FUNCTION_END, PARAMETER_END, "}"]
            .iter()
            .any(|end| before.ends_with(end))
        {
            return Some(at);
        }
        from = at + CLOSE.len();
    }
    None
}

/// The first `tag` in `text` that the structure continues after: followed (past whitespace)
/// by the end of `text` or by one of `next`. A closing tag followed by anything else is part
/// of a value (a parameter holding markup, say), as the model's format cannot escape it.
fn structural_end(text: &str, tag: &str, next: &[&str]) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find(tag).map(|i| from + i) {
        let rest = text[at + tag.len()..].trim_start();
        if rest.is_empty() || next.iter().any(|n| rest.starts_with(n)) {
            return Some(at);
        }
        from = at + tag.len();
    }
    None
}

/// The first `<parameter=` in `text` that starts a line (or `text`).
fn parameter_start(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find(PARAMETER).map(|i| from + i) {
        if at == 0 || text[..at].ends_with('\n') {
            return Some(at);
        }
        from = at + PARAMETER.len();
    }
    None
}

/// Parses the inside of a `<tool_call>` block (XML or JSON form); `None` if it is neither.
fn parse_block(block: &str, tools: &[Tool]) -> Option<Vec<ParsedCall>> {
    let block = block.trim();
    if block.starts_with('{') {
        return parse_json_call(block).map(|call| vec![call]);
    }
    let mut calls = Vec::new();
    let mut rest = block;
    while let Some(start) = rest.find("<function=") {
        let after = &rest[start + "<function=".len()..];
        let name_end = after.find('>')?;
        let name = after[..name_end].trim();
        if name.is_empty() {
            return None;
        }
        let body = &after[name_end + 1..];
        let (body, next) = match structural_end(body, FUNCTION_END, &["<function="]) {
            Some(end) => (&body[..end], &body[end + FUNCTION_END.len()..]),
            None => (body, ""),
        };
        let schema = parameter_schemas(tools, name);
        calls.push(ParsedCall {
            name: name.to_owned(),
            arguments: parse_parameters(body, schema)?,
        });
        rest = next;
    }
    (!calls.is_empty() && rest.trim().is_empty()).then_some(calls)
}

/// `{"name": ..., "arguments": {...}}`; the arguments may also be a JSON string of an object,
/// or come as `parameters`.
fn parse_json_call(block: &str) -> Option<ParsedCall> {
    let Value::Object(mut call) = serde_json::from_str::<Value>(block).ok()? else {
        return None;
    };
    let Value::String(name) = call.remove("name")? else {
        return None;
    };
    let arguments = match call
        .remove("arguments")
        .or_else(|| call.remove("parameters"))
    {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map,
        Some(Value::String(text)) => match serde_json::from_str(&text).ok()? {
            Value::Object(map) => map,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// The `properties` of the named tool's parameter schema.
fn parameter_schemas<'a>(tools: &'a [Tool], name: &str) -> Option<&'a Map<String, Value>> {
    tools
        .iter()
        .find(|t| t.function.name == name)?
        .function
        .parameters
        .as_ref()?
        .get("properties")?
        .as_object()
}

/// `<parameter=NAME>\nVALUE\n</parameter>` entries, in order. A missing `</parameter>` ends the
/// value at the next parameter (or the end of the function).
fn parse_parameters(
    body: &str,
    schemas: Option<&Map<String, Value>>,
) -> Option<Map<String, Value>> {
    let mut arguments = Map::new();
    let mut rest = body.trim_start();
    loop {
        let Some(start) = parameter_start(rest) else {
            return rest.trim().is_empty().then_some(arguments);
        };
        if !rest[..start].trim().is_empty() {
            return None;
        }
        let after = &rest[start + PARAMETER.len()..];
        let name_end = after.find('>')?;
        let name = after[..name_end].trim();
        let value_and_rest = &after[name_end + 1..];
        let end = structural_end(value_and_rest, PARAMETER_END, &[PARAMETER]);
        let (raw, next) = match (end, parameter_start(value_and_rest)) {
            (Some(end), next_tag) if next_tag.is_none_or(|t| end < t) => (
                &value_and_rest[..end],
                &value_and_rest[end + PARAMETER_END.len()..],
            ),
            (_, Some(t)) => (&value_and_rest[..t], &value_and_rest[t..]),
            (_, None) => (value_and_rest, ""),
        };
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let schema = schemas.and_then(|s| s.get(name));
        arguments.insert(name.to_owned(), typed_value(raw, schema));
        rest = next;
    }
}

/// The JSON types a schema allows, in its order (`type` as a string or list, or `anyOf`/`oneOf`).
fn schema_types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => ["anyOf", "oneOf"]
            .iter()
            .filter_map(|k| schema.get(*k)?.as_array())
            .flatten()
            .flat_map(schema_types)
            .collect(),
    }
}

/// A parameter's text as the JSON value its schema asks for; text that fits none of the
/// schema's types (or a parameter without a schema) stays a string.
fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let types = schema.map(schema_types).unwrap_or_default();
    let text = raw.trim();
    for kind in types.iter().filter(|&&t| t != "string") {
        let value = match *kind {
            "integer" => exact_integer(text).or_else(|| integral_float(text)),
            "number" => exact_integer(text).or_else(|| {
                text.parse::<f64>()
                    .ok()
                    .and_then(Number::from_f64)
                    .map(Value::Number)
            }),
            "boolean" => match text.to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "null" => matches!(text, "null" | "None").then_some(Value::Null),
            "object" => serde_json::from_str(text).ok().filter(Value::is_object),
            "array" => serde_json::from_str(text).ok().filter(Value::is_array),
            _ => None,
        };
        if let Some(value) = value {
            return value;
        }
    }
    Value::String(raw.to_owned())
}

/// An integer that JSON numbers hold exactly here: from i64's least to u64's greatest.
fn exact_integer(text: &str) -> Option<Value> {
    text.parse::<i64>()
        .map(Value::from)
        .or_else(|_| text.parse::<u64>().map(Value::from))
        .ok()
}

/// `"3.0"` as the integer 3.
fn integral_float(text: &str) -> Option<Value> {
    let f = text.parse::<f64>().ok()?;
    (f.fract() == 0.0 && f.abs() < 9.0e15).then(|| Value::from(f as i64))
}

/// A grammar (llguidance's Lark syntax) for a reply that is only tool calls in the XML form:
/// for `tool_choice: "required"` one or more calls to any of `tools` (one if not `parallel`),
/// for a named function (`only`) one call to it. A call lists its parameters in the schema's
/// order, the required ones always. A value the parser keeps as text (a string, or a parameter
/// without a schema) is free text up to `</parameter>`, or one of its `enum` strings; any other
/// is JSON of its schema, written as structured output writes it.
pub fn forced_calls_grammar(
    tools: &[Tool],
    only: Option<&str>,
    parallel: bool,
    json_style: &Value,
) -> String {
    let literal = |text: &str| serde_json::to_string(text).expect("a string is JSON");
    let end = literal("\n</parameter>\n");
    let mut rules = vec![format!(r#"text[suffix={end}]: /(?s:.*)/"#)];
    let mut calls = Vec::new();
    for (i, function) in tools
        .iter()
        .map(|t| &t.function)
        .enumerate()
        .filter(|(_, f)| only.is_none_or(|name| f.name == name))
    {
        let parameters = function.parameters.as_ref();
        let required: Vec<&str> = parameters
            .and_then(|p| p.get("required")?.as_array())
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let mut body = literal(&format!("<tool_call>\n<function={}>\n", function.name));
        let properties = parameters.and_then(|p| p.get("properties")?.as_object());
        for (j, (name, schema)) in properties.into_iter().flatten().enumerate() {
            let rule = format!("call{i}_{j}");
            let head = literal(&format!("<parameter={name}>\n"));
            let value = match text_choices(schema) {
                Some(None) => "text".to_owned(),
                Some(Some(choices)) => format!(
                    "({}) {end}",
                    choices
                        .iter()
                        .map(|c| literal(c))
                        .collect::<Vec<_>>()
                        .join(" | ")
                ),
                None => {
                    let mut schema = schema.clone();
                    if let Some(object) = schema.as_object_mut() {
                        object.insert("x-guidance".into(), json_style.clone());
                    }
                    format!("%json {schema} {end}")
                }
            };
            rules.push(format!("{rule}: {head} {value}"));
            let optional = if required.contains(&name.as_str()) {
                ""
            } else {
                "?"
            };
            body.push_str(&format!(" {rule}{optional}"));
        }
        body.push_str(&format!(" {}", literal("</function>\n</tool_call>")));
        rules.push(format!("call{i}: {body}"));
        calls.push(format!("call{i}"));
    }
    let call = calls.join(" | ");
    let start = if only.is_some() || !parallel {
        format!("start: /\\n{{1,2}}/? ({call})")
    } else {
        format!(r#"start: /\n{{1,2}}/? ({call}) ("\n" ({call}))*"#)
    };
    rules.insert(0, start);
    rules.join("\n")
}

/// How a parameter's value is written as text: `Some(None)` free text, `Some(Some(choices))` one
/// of its `enum` strings, `None` not as text (JSON), following what `typed_value` reads back.
fn text_choices(schema: &Value) -> Option<Option<Vec<String>>> {
    let types = schema_types(schema);
    if !types.is_empty() && !types.contains(&"string") {
        return None;
    }
    let strings: Option<Vec<String>> =
        schema
            .get("enum")
            .and_then(Value::as_array)
            .and_then(|values| {
                values
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect()
            });
    Some(strings.filter(|s| !s.is_empty()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn weather_tool() -> Vec<Tool> {
        serde_json::from_value(json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "metric": {"type": "boolean"},
                        "ratio": {"type": ["number", "null"]},
                        "tags": {"type": "array"},
                        "where": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                    }
                }
            }
        }]))
        .unwrap()
    }

    fn run(text: &str, chunk: usize) -> Parsed {
        let mut parser = ToolCallParser::new(weather_tool());
        let mut out = Parsed::default();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(chunk.max(1)) {
            let p = parser.push(&piece.iter().collect::<String>());
            out.content.push_str(&p.content);
            out.calls.extend(p.calls);
        }
        let p = parser.finish();
        out.content.push_str(&p.content);
        out.calls.extend(p.calls);
        out
    }

    fn check(text: &str, content: &str, calls: Value) {
        for chunk in [1, 2, 3, 5, 7, 1000] {
            let out = run(text, chunk);
            assert_eq!(out.content, content, "content, chunks of {chunk}: {text:?}");
            let got: Vec<Value> = out
                .calls
                .iter()
                .map(|c| json!({"name": c.name, "arguments": c.arguments}))
                .collect();
            assert_eq!(
                Value::Array(got),
                calls,
                "calls, chunks of {chunk}: {text:?}"
            );
        }
    }

    #[test]
    fn the_xml_form_of_qwen_templates_is_parsed_with_schema_types() {
        let text = "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan \
                    Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\
                    \nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n\
                    [\"a\", 1]\n</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n\
                    <parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>";
        check(
            text,
            "I will check.",
            json!([{"name": "get_weather", "arguments": {
                "city": "San Francisco", "days": 3, "metric": true, "ratio": 0.5,
                "tags": ["a", 1], "where": {"lat": 1}, "extra": "42"
            }}]),
        );
    }

    #[test]
    fn multi_line_values_and_several_calls() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n\
                    </parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=other>\n\
                    </function>\n</tool_call>";
        check(
            text,
            "",
            json!([
                {"name": "get_weather", "arguments": {"city": "line one\nline two"}},
                {"name": "other", "arguments": {}},
            ]),
        );
    }

    #[test]
    fn the_json_form_is_parsed() {
        check(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "",
            json!([{"name": "get_weather", "arguments": {"city": "Paris"}}]),
        );
        check(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 2}\"}</tool_call>",
            "",
            json!([{"name": "f", "arguments": {"x": 2}}]),
        );
    }

    #[test]
    fn values_that_do_not_fit_the_schema_stay_strings() {
        let schema = json!({"type": "integer"});
        assert_eq!(typed_value("three", Some(&schema)), json!("three"));
        assert_eq!(typed_value("3.0", Some(&schema)), json!(3));
        assert_eq!(typed_value(" 7 ", None), json!(" 7 "));
        assert_eq!(
            typed_value("null", Some(&json!({"type": ["integer", "null"]}))),
            Value::Null
        );
    }

    #[test]
    fn unparseable_blocks_and_text_without_calls_are_content() {
        check("Hello <tool", "Hello <tool", json!([]));
        check(
            "a <tool_call>not a call</tool_call> b",
            "a<tool_call>not a call</tool_call> b",
            json!([]),
        );
        check(
            "x <tool_call>\n<function=f>",
            "x",
            json!([{"name": "f", "arguments": {}}]),
        );
        check("x <tool_call>\n<funct", "x<tool_call>\n<funct", json!([]));
    }

    #[test]
    fn a_missing_parameter_close_ends_at_the_next_parameter() {
        check(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n\
             </function>\n</tool_call>",
            "",
            json!([{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]),
        );
    }

    /// Whether `text` is a whole reply the grammar allows: each of its tokens allowed in turn,
    /// then `<|im_end|>`.
    fn grammar_allows(grammar: &str, text: &str) -> bool {
        use crate::engine::constraint::{Grammars, allows};
        let demo = crate::model::demo::demo().unwrap();
        let tokenizer = std::sync::Arc::new(demo.tokenizer);
        let im_end = tokenizer.token_id("<|im_end|>").unwrap();
        let grammars = Grammars::new(tokenizer.clone(), im_end).unwrap();
        allows(&mut grammars.lark(grammar).unwrap(), &tokenizer, text)
    }

    #[test]
    fn forced_calls_follow_the_xml_form_and_the_schema() {
        let mut tools = weather_tool();
        tools[0].function.parameters.as_mut().unwrap()["required"] = json!(["city"]);
        tools[0].function.parameters.as_mut().unwrap()["properties"]["unit"] =
            json!({"enum": ["c", "f"]});
        tools.extend(
            serde_json::from_value::<Vec<Tool>>(json!([
                {"type": "function", "function": {"name": "now"}}
            ]))
            .unwrap(),
        );
        let style = crate::engine::constraint::json_style();
        let required = forced_calls_grammar(&tools, None, true, &style);
        let named = forced_calls_grammar(&tools, Some("get_weather"), true, &style);
        let one = forced_calls_grammar(&tools, None, false, &style);
        let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"France\"\n\
                    </parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\nnull\n\
                    </parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n<parameter=unit>\n\
                    f\n</parameter>\n</function>\n</tool_call>";
        let now = "<tool_call>\n<function=now>\n</function>\n</tool_call>";
        for grammar in [&required, &named] {
            assert!(grammar_allows(grammar, call), "{grammar}");
            assert!(grammar_allows(grammar, &format!("\n\n{call}")));
            // Only `city` is required; parameters keep the schema's order.
            assert!(grammar_allows(
                grammar,
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n\
                 </function>\n</tool_call>"
            ));
            for broken in [
                format!("Sure. {call}"),
                call.replace("\n3\n", "\nthree\n"),
                call.replace("\nf\n", "\nkelvin\n"),
                call.replace("<parameter=city>\nParis, \"France\"\n</parameter>\n", ""),
                format!("{call} and more"),
            ] {
                assert!(!grammar_allows(grammar, &broken), "{broken:?}");
            }
        }
        assert!(grammar_allows(&required, now));
        assert!(grammar_allows(&required, &format!("{call}\n{now}")));
        assert!(grammar_allows(&one, now) && grammar_allows(&one, call));
        assert!(!grammar_allows(&one, &format!("{call}\n{now}")));
        assert!(!grammar_allows(&named, now));
        assert!(!grammar_allows(&named, &format!("{call}\n{call}")));
        // What the grammar allows, the parser reads back with the schema's types.
        check(
            call,
            "",
            json!([{"name": "get_weather", "arguments": {
                "city": "Paris, \"France\"", "days": 3, "ratio": null, "tags": ["a", 1],
                "unit": "f"}}]),
        );
    }
}
