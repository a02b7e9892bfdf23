//! Structured output: a JSON schema the reply must follow, enforced while sampling by masking
//! the logits of every token that would break it (llguidance's parser over a trie of the
//! tokenizer's token bytes). With the thought still open (Qwen's template opens `<think>`), the
//! grammar applies from the token that closes it, so the model reasons freely and then answers
//! in the format.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::text::tokenizer::Tokenizer;

/// How constrained JSON is written (llguidance's `x-guidance` options): compactly, with the
/// separators Python's `json.dumps` uses and no other whitespace between values, since a model
/// that may add whitespace may never end its reply.
pub fn json_style() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// Builds constraints for one tokenizer (the trie of its tokens is made once).
pub struct Grammars {
    factory: ParserFactory,
    /// The token that closes a thought (`</think>`), if the tokenizer has one.
    think_end: Option<u32>,
}

impl Grammars {
    /// `eos` is the token that ends a reply (`<|im_end|>`): the grammar allows it once complete.
    pub fn new(tokenizer: Arc<Tokenizer>, eos: u32) -> Result<Self> {
        let think_end = tokenizer.token_id("</think>");
        let env = TrieEnv::new(tokenizer, eos);
        let tok_env: TokEnv = Arc::new(env);
        let mut factory = ParserFactory::new_simple(&tok_env)
            .context("building the structured-output parser for this tokenizer")?;
        factory.quiet();
        Ok(Self { factory, think_end })
    }

    /// A constraint to a JSON value matching `schema` (any JSON object without one), after at
    /// most two newlines (what Qwen writes after `</think>`; the reply's content leaves them
    /// out). Errors name what in the schema is not supported.
    pub fn json(&self, schema: Option<&Value>) -> Result<Constraint> {
        let mut schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
        let object = schema
            .as_object_mut()
            .ok_or_else(|| anyhow!("a JSON schema must be an object"))?;
        object.insert("x-guidance".into(), json_style());
        self.lark(&format!("start: /\\n{{1,2}}/? %json {schema}"))
    }

    /// A constraint to a grammar in llguidance's Lark syntax.
    pub fn lark(&self, grammar: &str) -> Result<Constraint> {
        self.constraint(TopLevelGrammar::from_lark(grammar.to_owned()))
    }

    fn constraint(&self, grammar: TopLevelGrammar) -> Result<Constraint> {
        let parser = self.factory.create_parser(grammar)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            anyhow::bail!("{e}");
        }
        Ok(Constraint {
            matcher,
            active: true,
            think_end: self.think_end,
        })
    }
}

/// One reply's grammar and how far it has got.
pub struct Constraint {
    matcher: Matcher,
    /// False while the thought is open: nothing is masked until `think_end`.
    active: bool,
    think_end: Option<u32>,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            active: self.active,
            think_end: self.think_end,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("active", &self.active)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Applies the grammar only after the thought the prompt opened is closed (if the tokenizer
    /// has no closing token, from the start).
    pub fn after_thought(mut self) -> Self {
        self.active = self.think_end.is_none();
        self
    }

    /// Sets the logits of every token the grammar does not allow next to minus infinity.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        if !self.active {
            return Ok(());
        }
        // Once the grammar is complete only the end of the reply is allowed.
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("structured output: {e}"))?;
        for (id, logit) in logits.iter_mut().enumerate() {
            if id >= allowed.len() || !allowed.is_allowed(id as TokenId) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Moves the grammar past the chosen token.
    pub fn advance(&mut self, id: u32) -> Result<()> {
        if self.active && self.matcher.is_stopped() {
            // The end-of-reply token that follows a complete grammar: nothing left to check.
            Ok(())
        } else if self.active {
            self.matcher
                .consume_token(id)
                .map_err(|e| anyhow!("structured output: {e}"))
        } else {
            self.active = Some(id) == self.think_end;
            Ok(())
        }
    }
}

/// The tokenizer as llguidance sees it: every token's bytes (special tokens marked), and
/// tokenisation of grammar literals.
struct TrieEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TrieEnv {
    fn new(tokenizer: Arc<Tokenizer>, eos: u32) -> Self {
        let vocab = tokenizer.vocab_size();
        let words = (0..vocab as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend(bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect::<Vec<_>>();
        let info = TokRxInfo::new(vocab as u32, eos);
        Self {
            trie: TokTrie::from(&info, &words),
            tokenizer,
        }
    }
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // Grammar literals are text; bytes that are not UTF-8 fall back to the trie's greedy split.
        match std::str::from_utf8(s).map(|text| self.tokenizer.encode(text)) {
            Ok(Ok(ids)) => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// Whether the tokens of `text` and then `<|im_end|>` are each allowed in turn (for tests of
/// grammars).
#[cfg(test)]
pub(crate) fn allows(constraint: &mut Constraint, tokenizer: &Tokenizer, text: &str) -> bool {
    let im_end = tokenizer.token_id("<|im_end|>").unwrap();
    let mut logits = vec![0.0f32; tokenizer.vocab_size()];
    for id in tokenizer.encode(text).unwrap().into_iter().chain([im_end]) {
        logits.fill(0.0);
        constraint.mask(&mut logits).unwrap();
        if !logits[id as usize].is_finite() {
            return false;
        }
        constraint.advance(id).unwrap();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_replies_are_compact_and_may_follow_two_newlines() {
        let tokenizer = Arc::new(crate::model::demo::demo().unwrap().tokenizer);
        let im_end = tokenizer.token_id("<|im_end|>").unwrap();
        let grammars = Grammars::new(tokenizer.clone(), im_end).unwrap();
        let schema = json!({"type": "object", "properties": {"a": {"type": "array"}},
                            "required": ["a"], "additionalProperties": false});
        for (text, allowed) in [
            (r#"{"a": [1, "x"]}"#, true),
            ("\n\n{\"a\": []}", true),
            ("\n{\"a\": []}", true),
            ("\n\n\n{\"a\": []}", false),
            (r#"{"a":[1]}"#, false),
            (r#"{ "a": [] }"#, false),
            (r#"{"a": [], "b": 1}"#, false),
            (r#"{"a": []} trailing"#, false),
        ] {
            let mut c = grammars.json(Some(&schema)).unwrap();
            assert_eq!(allows(&mut c, &tokenizer, text), allowed, "{text:?}");
        }
        // With the thought open, anything goes until `</think>`, then the grammar.
        let mut c = grammars.json(None).unwrap().after_thought();
        assert!(allows(&mut c, &tokenizer, "free { text </think>\n\n{}"));
        let mut c = grammars.json(None).unwrap().after_thought();
        assert!(!allows(&mut c, &tokenizer, "thought</think>not json"));
        assert!(grammars.json(Some(&json!([1]))).is_err());
    }
}
