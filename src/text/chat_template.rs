//! Chat templates: a conversation turned into prompt text exactly as Hugging Face transformers'
//! `tokenizer.apply_chat_template(..., tokenize=False)` turns it.
//!
//! This module owns:
//! - finding a checkpoint's template (`chat_template.jinja`, else `chat_template` in
//!   `tokenizer_config.json`, else a built-in ChatML template) and the special tokens that
//!   transformers hands to every template;
//! - a `minijinja` environment set up like transformers' jinja2 sandbox (`trim_blocks`,
//!   `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, its own `tojson`), with the
//!   Python behaviour minijinja lacks filled in (Python's `str()` of values, jinja2's `sequence`
//!   test, Python string methods);
//! - preparing the render context as transformers does before it calls jinja2.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::ErrorKind as IoErrorKind;
use std::path::Path;

use anyhow::{Context as _, Result, anyhow, bail};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind, from_args};
use minijinja::{Environment, Error, ErrorKind, Output, State};
use serde_json::{Map, Value as Json};

/// The template file transformers prefers over `tokenizer_config.json`.
const TEMPLATE_FILE: &str = "chat_template.jinja";
/// The tokenizer configuration, holding the special tokens and possibly the template.
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// Used when a checkpoint carries no template: one ChatML turn per message.
const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
/// The name a single template is registered under, as in transformers' template dictionaries.
const DEFAULT_NAME: &str = "default";
/// The named template transformers picks instead of `default` when tools are passed.
const TOOL_USE_NAME: &str = "tool_use";
/// Message fields that carry reasoning, in the order transformers looks them up.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
/// The positional parameters of transformers' `tojson` filter, in order.
const TOJSON_PARAMS: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];

/// A compiled chat template (or set of named templates) and the variables it sees by default.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Names of the compiled templates, in the order the checkpoint lists them.
    names: Vec<String>,
    /// Special tokens from `tokenizer_config.json` (`bos_token`, `eos_token`, ...).
    special_tokens: Map<String, Json>,
    /// Where the template came from, for error messages.
    origin: String,
}

impl ChatTemplate {
    /// Loads the template a checkpoint directory carries: `chat_template.jinja`, else
    /// `chat_template` in `tokenizer_config.json` (a string, or a list of `{name, template}`),
    /// else the built-in ChatML template. Special tokens come from `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        // Checked first so that a mistyped path is not mistaken for a checkpoint without files.
        if !dir.is_dir() {
            bail!("{}: not a model directory", dir.display());
        }
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                let json: Json = serde_json::from_str(&text)
                    .with_context(|| format!("{}: invalid JSON", config_path.display()))?;
                match json {
                    Json::Object(map) => Some(map),
                    _ => bail!("{}: not a JSON object", config_path.display()),
                }
            }
            Err(e) if e.kind() == IoErrorKind::NotFound => None,
            Err(e) => return Err(anyhow!(e).context(config_path.display().to_string())),
        };
        let special_tokens = config.as_ref().map(special_tokens).unwrap_or_default();

        let template_path = dir.join(TEMPLATE_FILE);
        let mut template = match std::fs::read_to_string(&template_path) {
            Ok(source) => Self::compile(
                vec![(DEFAULT_NAME.to_owned(), source)],
                template_path.display().to_string(),
            )?,
            Err(e) if e.kind() == IoErrorKind::NotFound => {
                let origin = format!("{} (chat_template)", config_path.display());
                match config.as_ref().and_then(|c| c.get("chat_template")) {
                    None | Some(Json::Null) => Self::compile(
                        vec![(DEFAULT_NAME.to_owned(), CHATML_TEMPLATE.to_owned())],
                        "built-in ChatML template".to_owned(),
                    )?,
                    Some(json) => {
                        Self::compile(named_templates(json).context(origin.clone())?, origin)?
                    }
                }
            }
            Err(e) => return Err(anyhow!(e).context(template_path.display().to_string())),
        };
        template.special_tokens = special_tokens;
        Ok(template)
    }

    /// Compiles a template from its source text (no special tokens).
    pub fn from_source(source: &str) -> Result<Self> {
        Self::compile(
            vec![(DEFAULT_NAME.to_owned(), source.to_owned())],
            "chat template".to_owned(),
        )
    }

    fn compile(templates: Vec<(String, String)>, origin: String) -> Result<Self> {
        let mut env = environment();
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), prepare_source(&source))
                .map_err(|e| anyhow!("{origin}: {}", describe(&e)))?;
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            special_tokens: Map::new(),
            origin,
        })
    }

    /// Renders the template with `context`: an object holding `messages` and any other template
    /// variable (`tools`, `documents`, `add_generation_prompt`, `enable_thinking`, ...).
    ///
    /// The context is prepared as transformers prepares it: message fields that are `null` are
    /// dropped, reasoning given as `thinking` or `reasoning` is also offered as
    /// `reasoning_content` (and as `thinking`), `tools` and `documents` are `None` when absent,
    /// `add_generation_prompt` is false when absent, and special tokens are defined unless the
    /// caller passes them.
    pub fn render(&self, context: &Json) -> Result<String> {
        let vars = context
            .as_object()
            .ok_or_else(|| anyhow!("chat template context must be a JSON object"))?;
        let mut ctx = self.special_tokens.clone();
        ctx.extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        let messages = prepare_messages(vars.get("messages"))?;
        ctx.insert("messages".to_owned(), messages);
        for key in ["tools", "documents"] {
            let value = ctx.entry(key).or_insert(Json::Null);
            check_list_of_objects(key, value)?;
        }
        ctx.entry("add_generation_prompt")
            .or_insert(Json::Bool(false));

        let name = self.select(!ctx["tools"].is_null())?;
        let template = self
            .env
            .get_template(name)
            .map_err(|e| anyhow!("{}: {}", self.origin, describe(&e)))?;
        template
            .render(minijinja::value::Serde(&ctx))
            .map_err(|e| anyhow!("{}: {}", self.origin, describe(&e)))
    }

    /// Picks the template transformers would: `tool_use` when tools are passed and it exists,
    /// else `default`.
    fn select(&self, has_tools: bool) -> Result<&str> {
        let has = |name: &str| self.names.iter().any(|n| n == name);
        if has_tools && has(TOOL_USE_NAME) {
            Ok(TOOL_USE_NAME)
        } else if has(DEFAULT_NAME) {
            Ok(DEFAULT_NAME)
        } else {
            bail!(
                "{}: several chat templates and none named `default` (have: {})",
                self.origin,
                self.names.join(", ")
            )
        }
    }
}

/// The `chat_template` entry of `tokenizer_config.json`: a string, or a list of
/// `{name, template}` objects (a later entry replaces an earlier one of the same name).
fn named_templates(json: &Json) -> Result<Vec<(String, String)>> {
    if let Some(source) = json.as_str() {
        return Ok(vec![(DEFAULT_NAME.to_owned(), source.to_owned())]);
    }
    let entries = json
        .as_array()
        .ok_or_else(|| anyhow!("must be a string or a list of {{name, template}} objects"))?;
    let mut templates: Vec<(String, String)> = Vec::new();
    for entry in entries {
        let field = |key: &str| entry.get(key).and_then(Json::as_str).map(str::to_owned);
        let (Some(name), Some(source)) = (field("name"), field("template")) else {
            bail!("each entry must be an object with string `name` and `template`");
        };
        match templates.iter_mut().find(|(n, _)| *n == name) {
            Some(existing) => existing.1 = source,
            None => templates.push((name, source)),
        }
    }
    if templates.is_empty() {
        bail!("empty list of templates");
    }
    Ok(templates)
}

/// The special tokens transformers passes to templates: every `*_token` entry of the
/// configuration that is a string or an added-token object (`{"content": ...}`), and the
/// named entries of `extra_special_tokens`. Other `*_token` entries (`add_bos_token: false`,
/// `pad_token: null`) are not tokens.
fn special_tokens(config: &Map<String, Json>) -> Map<String, Json> {
    let content = |value: &Json| match value {
        Json::String(s) => Some(s.clone()),
        Json::Object(obj) => obj.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    };
    let extra = config.get("extra_special_tokens").and_then(Json::as_object);
    config
        .iter()
        .filter(|(key, _)| key.ends_with("_token"))
        .chain(extra.into_iter().flatten())
        .filter_map(|(key, value)| Some((key.clone(), Json::String(content(value)?))))
        .collect()
}

/// Source text as jinja2's lexer sees it: every line break becomes `\n`, and transformers'
/// `{% generation %}` block (which only marks assistant text for training masks) renders its
/// body, so it becomes an always-true `if` with the same whitespace control.
fn prepare_source(source: &str) -> String {
    let source = source.replace("\r\n", "\n").replace('\r', "\n");
    let mut out = String::with_capacity(source.len());
    let mut rest = source.as_str();
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match generation_tag(tag) {
            Some((len, open, replacement, close)) => {
                write!(out, "{{%{open} {replacement} {close}%}}").ok();
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Recognises `{%- generation -%}` / `{% endgeneration %}` at the start of `tag`; returns the tag's
/// length, its whitespace-control markers and the statement that replaces it.
fn generation_tag(tag: &str) -> Option<(usize, &str, &'static str, &str)> {
    let body_start = 2 + marker_len(&tag[2..]);
    let open = &tag[2..body_start];
    let end = tag.find("%}")?;
    let inner = &tag[body_start..end];
    let close_len = inner.len() - inner.trim_end_matches(['-', '+']).len();
    let close = &inner[inner.len() - close_len..];
    let replacement = match inner[..inner.len() - close_len].trim() {
        "generation" => "if true",
        "endgeneration" => "endif",
        _ => return None,
    };
    Some((end + 2, open, replacement, close))
}

fn marker_len(s: &str) -> usize {
    usize::from(s.starts_with(['-', '+']))
}

/// Messages as transformers hands them to the template: fields set to `null` dropped, and
/// reasoning found under any of its names copied to `thinking` (first) and `reasoning_content`.
fn prepare_messages(messages: Option<&Json>) -> Result<Json> {
    let messages = messages
        .and_then(Json::as_array)
        .ok_or_else(|| anyhow!("chat template context needs `messages`, a list of messages"))?;
    if messages.is_empty() {
        bail!("cannot apply a chat template to an empty conversation");
    }
    messages
        .iter()
        .map(|message| {
            let fields = message
                .as_object()
                .ok_or_else(|| anyhow!("each message must be a JSON object, got {message}"))?;
            let fields: Map<String, Json> = fields
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|k| fields.get(*k))
                .cloned();
            Ok(Json::Object(match reasoning {
                Some(reasoning) => {
                    let mut aliased = Map::new();
                    aliased.insert("thinking".to_owned(), reasoning.clone());
                    aliased.extend(fields);
                    aliased.insert("reasoning_content".to_owned(), reasoning);
                    aliased
                }
                None => fields,
            }))
        })
        .collect::<Result<Vec<_>>>()
        .map(Json::Array)
}

/// transformers rejects `tools` and `documents` that are not lists of objects.
fn check_list_of_objects(key: &str, value: &Json) -> Result<()> {
    match value {
        Json::Null => Ok(()),
        Json::Array(items) if items.iter().all(Json::is_object) => Ok(()),
        _ => bail!("`{key}` must be a list of JSON objects"),
    }
}

/// A render or syntax error in one line: what went wrong, and where in the template.
fn describe(e: &Error) -> String {
    let what = match e.detail() {
        Some(detail) if is_raised(e) => format!("raised: {detail}"),
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    match e.line() {
        Some(line) => format!("{what} (line {line})"),
        None => what,
    }
}

/// Marks errors that the template raised itself through `raise_exception`.
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

fn is_raised(e: &Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<Raised>())
}

/// The environment transformers builds: jinja2 with `trim_blocks`, `lstrip_blocks`, loop
/// controls, and the `raise_exception`, `strftime_now` and `tojson` helpers.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    // transformers' environment never escapes output, whatever a template's name.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(py_method);
    env.set_formatter(|out: &mut Output, _: &mut State, value: &Value| {
        out.write_str(&py_str(value)).map_err(Error::from)
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| py_str(value));
    env.add_filter("trim", |value: &Value, chars: Option<Cow<'_, str>>| {
        py_strip(&py_str(value), chars.as_deref(), Ends::Both).to_owned()
    });
    env.add_filter(
        "int",
        |state: &State,
         value: &Value,
         default: Option<Value>,
         base: Option<u32>,
         kwargs: Kwargs| {
            // jinja2 falls back to 0 (not an error) for what it cannot convert, and strips whitespace.
            let default = default.or(kwargs.get("default")?).unwrap_or(Value::from(0));
            minijinja::filters::int(state, &stripped(value), Some(default), base, kwargs)
        },
    );
    env.add_filter(
        "float",
        |state: &State, value: &Value, default: Option<Value>, kwargs: Kwargs| {
            let default = default
                .or(kwargs.get("default")?)
                .unwrap_or(Value::from(0.0));
            minijinja::filters::float(state, &stripped(value), Some(default), kwargs)
        },
    );
    env.add_test("sequence", is_sequence);
    env.add_test("iterable", is_iterable);
    env
}

fn raise_exception(message: Cow<'_, str>) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.into_owned()).with_source(Raised))
}

/// Python's `datetime.now().strftime(format)`: local time, microseconds for `%f`, and empty
/// `%z`/`%Z` because the datetime is naive.
fn strftime_now(format: Cow<'_, str>) -> Result<String, Error> {
    let mut translated = String::with_capacity(format.len());
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            translated.push(c);
            continue;
        }
        let mut spec = String::from('%');
        for c in chars.by_ref() {
            spec.push(c);
            if !matches!(c, '-' | '_' | '0' | '^' | '#') {
                break;
            }
        }
        match spec.chars().last() {
            Some('f') => translated.push_str("%6f"),
            Some('z' | 'Z') => {}
            _ => translated.push_str(&spec),
        }
    }
    let items: Vec<_> = chrono::format::StrftimeItems::new(&translated).collect();
    if items.contains(&chrono::format::Item::Error) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    Ok(chrono::Local::now()
        .format_with_items(items.into_iter())
        .to_string())
}

/// Python methods on values (`s.startswith(...)`, `d.items()`, ...), from `minijinja_contrib`,
/// except those where Python's idea of whitespace and line breaks (wider than Rust's) matters,
/// and `title`, which Python and jinja2's filter of the same name do differently.
fn py_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let Some(s) = value.as_str().filter(|_| value.kind() == ValueKind::String) else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    };
    let strip = |ends| -> Result<Value, Error> {
        let (chars,): (Option<&str>,) = from_args(args)?;
        Ok(Value::from(py_strip(s, chars, ends)))
    };
    match method {
        "strip" => strip(Ends::Both),
        "lstrip" => strip(Ends::Start),
        "rstrip" => strip(Ends::End),
        "split" | "rsplit" => {
            let (positional, kwargs): (&[Value], Kwargs) = from_args(args)?;
            let sep: Option<Value> = positional.first().cloned().or(kwargs.get("sep")?);
            let maxsplit: Option<i64> = match positional.get(1) {
                Some(v) => Some(i64::try_from(v.clone())?),
                None => kwargs.get("maxsplit")?,
            };
            kwargs.assert_all_used()?;
            let sep = match sep.as_ref().filter(|v| !v.is_none()) {
                Some(v) => Some(
                    v.as_str()
                        .ok_or_else(|| type_error("split: sep must be a string"))?,
                ),
                None => None,
            };
            let maxsplit = maxsplit.and_then(|n| usize::try_from(n).ok());
            py_split(s, sep, maxsplit, method == "rsplit").map(Value::from)
        }
        "title" => {
            let () = from_args(args)?;
            Ok(Value::from(py_title(s)))
        }
        "splitlines" => {
            let (keepends,): (Option<bool>,) = from_args(args)?;
            Ok(Value::from(py_splitlines(s, keepends.unwrap_or(false))))
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Python's `str.isspace()` for one character: Rust's whitespace plus the ASCII separators
/// U+001C to U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[derive(Clone, Copy)]
enum Ends {
    Start,
    End,
    Both,
}

/// Python's `str.strip(chars)` / `lstrip` / `rstrip`: whitespace when `chars` is `None`.
fn py_strip<'a>(s: &'a str, chars: Option<&str>, ends: Ends) -> &'a str {
    let strip = |c: char| chars.map_or_else(|| is_py_space(c), |set| set.contains(c));
    match ends {
        Ends::Start => s.trim_start_matches(strip),
        Ends::End => s.trim_end_matches(strip),
        Ends::Both => s.trim_matches(strip),
    }
}

/// Python's `str.split(sep, maxsplit)` and `str.rsplit(...)`; `maxsplit` `None` means no limit.
fn py_split(
    s: &str,
    sep: Option<&str>,
    maxsplit: Option<usize>,
    from_end: bool,
) -> Result<Vec<String>, Error> {
    let limit = maxsplit.unwrap_or(usize::MAX);
    let mut parts: Vec<String> = Vec::new();
    match sep {
        Some("") => return Err(type_error("split: empty separator")),
        Some(sep) if from_end => {
            let mut rest = s;
            while parts.len() < limit {
                let Some(at) = rest.rfind(sep) else { break };
                parts.push(rest[at + sep.len()..].to_owned());
                rest = &rest[..at];
            }
            parts.push(rest.to_owned());
            parts.reverse();
        }
        Some(sep) => {
            let mut rest = s;
            while parts.len() < limit {
                let Some(at) = rest.find(sep) else { break };
                parts.push(rest[..at].to_owned());
                rest = &rest[at + sep.len()..];
            }
            parts.push(rest.to_owned());
        }
        // Runs of whitespace separate words; the unsplit remainder keeps its inner whitespace
        // but loses it on the side the split started from.
        None if from_end => {
            let mut rest = py_strip(s, None, Ends::End);
            while !rest.is_empty() {
                if parts.len() == limit {
                    parts.push(rest.to_owned());
                    break;
                }
                let at = rest
                    .char_indices()
                    .rev()
                    .find(|&(_, c)| is_py_space(c))
                    .map_or(0, |(i, c)| i + c.len_utf8());
                parts.push(rest[at..].to_owned());
                rest = py_strip(&rest[..at], None, Ends::End);
            }
            parts.reverse();
        }
        None => {
            let mut rest = py_strip(s, None, Ends::Start);
            while !rest.is_empty() {
                if parts.len() == limit {
                    parts.push(rest.to_owned());
                    break;
                }
                let at = rest.find(is_py_space).unwrap_or(rest.len());
                parts.push(rest[..at].to_owned());
                rest = py_strip(&rest[at..], None, Ends::Start);
            }
        }
    }
    Ok(parts)
}

/// Python's `str.title()`: a cased letter is upper-cased after an uncased character and
/// lower-cased after a cased one (so "they're" becomes "They'Re", unlike jinja2's `title` filter).
fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_cased = false;
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        match (cased, previous_cased) {
            (true, true) => out.extend(c.to_lowercase()),
            (true, false) => out.extend(c.to_uppercase()),
            (false, _) => out.push(c),
        }
        previous_cased = cased;
    }
    out
}

/// Python's `str.splitlines(keepends)`, which breaks at every Unicode line boundary.
fn py_splitlines(s: &str, keepends: bool) -> Vec<String> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if !matches!(
            c,
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}'
                ..='\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        ) {
            continue;
        }
        let mut end = i + c.len_utf8();
        if c == '\r' && chars.peek().is_some_and(|&(_, next)| next == '\n') {
            chars.next();
            end += 1;
        }
        lines.push(s[start..if keepends { end } else { i }].to_owned());
        start = end;
    }
    if start < s.len() {
        lines.push(s[start..].to_owned());
    }
    lines
}

/// jinja2's `sequence` test: anything with a length and items, so strings and mappings too.
fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes
        )
}

/// jinja2's `iterable` test: what Python's `iter()` accepts, so not `none` or numbers.
fn is_iterable(value: &Value) -> bool {
    is_sequence(value) || value.kind() == ValueKind::Iterable
}

/// A string without the surrounding whitespace Python's `int()` and `float()` ignore.
fn stripped(value: &Value) -> Value {
    match value.as_str().filter(|_| value.kind() == ValueKind::String) {
        Some(s) => Value::from(py_strip(s, None, Ends::Both)),
        None => value.clone(),
    }
}

/// Python's `str(value)`, which jinja2 uses to print values and in the `string` filter.
fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` for the types JSON and templates produce.
fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            f64::try_from(value.clone()).map_or_else(|_| value.to_string(), py_float_repr)
        }
        ValueKind::Seq => {
            let items: Vec<String> = value
                .try_iter()
                .into_iter()
                .flatten()
                .map(|v| py_repr(&v))
                .collect();
            if value.is_tuple() {
                let trailing = if items.len() == 1 { "," } else { "" };
                format!("({}{trailing})", items.join(", "))
            } else {
                format!("[{}]", items.join(", "))
            }
        }
        ValueKind::Map => {
            let items: Vec<String> = value
                .try_iter()
                .into_iter()
                .flatten()
                .map(|k| {
                    let v = value.get_item(&k).unwrap_or_default();
                    format!("{}: {}", py_repr(&k), py_repr(&v))
                })
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default()),
        // minijinja writes the remaining scalars as Python does.
        _ => format!("{value:?}"),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds one and no double quote; the
/// quote, backslashes, tab, newline and carriage return escaped, and so is every character
/// Python does not print (`str.isprintable`: control, format, surrogate, private-use and
/// unassigned characters, and separators other than the space) as `\xNN`, `\uNNNN` or
/// `\UNNNNNNNN`.
fn py_str_repr(s: &str) -> String {
    use unicode_general_category::{GeneralCategory as G, get_general_category};
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            ' ' => out.push(' '),
            c => match get_general_category(c) {
                G::Control
                | G::Format
                | G::Surrogate
                | G::PrivateUse
                | G::Unassigned
                | G::LineSeparator
                | G::ParagraphSeparator
                | G::SpaceSeparator => {
                    let code = c as u32;
                    let escaped = if code < 0x100 {
                        format!("\\x{code:02x}")
                    } else if code < 0x10000 {
                        format!("\\u{code:04x}")
                    } else {
                        format!("\\U{code:08x}")
                    };
                    out.push_str(&escaped);
                }
                _ => out.push(c),
            },
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(float)`: the shortest digits that read back as the same number
/// ([`shortest_digits`]), laid out in positional notation for exponents -4 to 15, else as
/// `1e+16`.
fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let (digits, exp) = shortest_digits(x.abs());
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!(
            "{sign}{first}{dot}{rest}e{exp_sign}{:02}",
            exp.unsigned_abs()
        )
    } else if exp < 0 {
        let zeros = "0".repeat(exp.unsigned_abs() as usize - 1);
        format!("{sign}0.{zeros}{digits}")
    } else {
        let point = exp as usize + 1;
        if digits.len() <= point {
            format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
        } else {
            format!("{sign}{}.{}", &digits[..point], &digits[point..])
        }
    }
}

/// The significant digits and decimal exponent of `{x:e}` (x finite, not negative).
fn scientific(x: f64, precision: Option<usize>) -> (String, i32) {
    let sci = match precision {
        Some(p) => format!("{x:.p$e}"),
        None => format!("{x:e}"),
    };
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits = mantissa.chars().filter(|c| *c != '.').collect();
    (digits, exp.parse().unwrap_or(0))
}

/// The shortest digits that read back as `x` (finite, not negative) and its decimal exponent,
/// as Python's `repr` picks them: Rust's `{:e}` gives the shortest digits closest to `x`, but
/// where `x` lies exactly halfway between two such candidates it takes the upper one and
/// Python the even one (1000000000000000.25 is `...0.2` in Python, `...0.3` in Rust).
fn shortest_digits(x: f64) -> (String, i32) {
    let (digits, exp) = scientific(x, None);
    let n = digits.len();
    let last = digits.as_bytes()[n - 1];
    if (last - b'0').is_multiple_of(2) {
        return (digits, exp);
    }
    // Rounded up from an exact tie: x's exact expansion (at most 767 significant digits) is the
    // candidate below, then a 5, then only zeros.
    let below = format!("{}{}", &digits[..n - 1], (last - 1) as char);
    let (exact, exact_exp) = scientific(x, Some(800));
    let tie = exact_exp == exp
        && exact.starts_with(&below)
        && exact.as_bytes().get(n) == Some(&b'5')
        && exact[n + 1..].bytes().all(|b| b == b'0');
    let reads_back = || {
        let text = format!("{below}e{}", exp - (n as i32 - 1));
        text.parse::<f64>() == Ok(x)
    };
    if tie && reads_back() {
        (below, exp)
    } else {
        (digits, exp)
    }
}

/// transformers' `tojson` filter: Python's
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with the
/// same parameters, positional or by keyword.
fn tojson(value: &Value, positional: &[Value], kwargs: Kwargs) -> Result<String, Error> {
    if positional.len() > TOJSON_PARAMS.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments",
        ));
    }
    let mut params = [const { Value::UNDEFINED }; 4];
    for (i, name) in TOJSON_PARAMS.iter().enumerate() {
        let keyword: Option<Value> = kwargs.get(name)?;
        params[i] = match (positional.get(i), keyword) {
            (Some(_), Some(_)) => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            (Some(v), None) => v.clone(),
            (None, Some(v)) => v,
            (None, None) => Value::UNDEFINED,
        };
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = params;
    let indent = match indent.kind() {
        ValueKind::Undefined | ValueKind::None => None,
        ValueKind::String => Some(indent.as_str().unwrap_or_default().to_owned()),
        ValueKind::Bool | ValueKind::Number
            if indent.is_integer() || indent.kind() == ValueKind::Bool =>
        {
            Some(" ".repeat(usize::try_from(i64::try_from(indent)?).unwrap_or(0)))
        }
        _ => return Err(type_error("tojson: indent must be an integer or a string")),
    };
    let (item_sep, key_sep) = match separators.kind() {
        ValueKind::Undefined | ValueKind::None => {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_owned(), ": ".to_owned())
        }
        _ => {
            let seps: Vec<String> = separators
                .try_iter()?
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| type_error("tojson: separators must be two strings"))?;
            match <[String; 2]>::try_from(seps) {
                Ok([item, key]) => (item, key),
                Err(_) => return Err(type_error("tojson: separators must be two strings")),
            }
        }
    };
    let style = JsonStyle {
        ensure_ascii: ensure_ascii.is_true(),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_true(),
    };
    let mut out = String::new();
    style.write(&mut out, value, 0)?;
    Ok(out)
}

fn type_error(message: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.to_owned())
}

/// The options of Python's `json.dumps` that `tojson` exposes.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let x = f64::try_from(value.clone())?;
                out.push_str(&match x {
                    x if x.is_nan() => "NaN".to_owned(),
                    x if x.is_infinite() => {
                        if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned()
                    }
                    x => py_float_repr(x),
                });
            }
            ValueKind::String => self.write_str(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, ('[', ']'), &items, level, |out, item, level| {
                    self.write(out, item, level)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_container(out, ('{', '}'), &keys, level, |out, key, level| {
                    self.write_key(out, key)?;
                    out.push_str(&self.key_sep);
                    self.write(out, &value.get_item(key)?, level)
                })?;
            }
            _ => {
                return Err(type_error(&format!(
                    "tojson: object of type {} is not JSON serializable",
                    value.kind()
                )));
            }
        }
        Ok(())
    }

    /// Writes `[...]` or `{...}` the way Python's encoder lays out lists and dicts.
    fn write_container(
        &self,
        out: &mut String,
        (open, close): (char, char),
        items: &[Value],
        level: usize,
        mut write_item: impl FnMut(&mut String, &Value, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        let newline = |level: usize| {
            self.indent
                .as_ref()
                .map(|i| format!("\n{}", i.repeat(level)))
        };
        let inner = newline(level + 1);
        if let Some(nl) = &inner {
            out.push_str(nl);
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
                if let Some(nl) = &inner {
                    out.push_str(nl);
                }
            }
            write_item(out, item, level + 1)?;
        }
        if let Some(nl) = newline(level) {
            out.push_str(&nl);
        }
        out.push(close);
        Ok(())
    }

    /// Python converts `int`, `float`, `bool` and `None` keys to strings; others are an error.
    fn write_key(&self, out: &mut String, key: &Value) -> Result<(), Error> {
        match key.kind() {
            ValueKind::String => self.write_str(out, key.as_str().unwrap_or_default()),
            ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                let mut text = String::new();
                self.write(&mut text, key, 0)?;
                self.write_str(out, &text);
            }
            _ => {
                return Err(type_error(
                    "tojson: keys must be str, int, float, bool or None",
                ));
            }
        }
        Ok(())
    }

    /// A JSON string as Python writes it: `"`, `\` and control characters escaped, and with
    /// `ensure_ascii` everything outside printable ASCII as `\uXXXX` (surrogate pairs beyond
    /// the BMP).
    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if c < ' ' || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        write!(out, "\\u{unit:04x}").ok();
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}
