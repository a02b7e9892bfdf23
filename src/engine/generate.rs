//! Generating one sequence: prefill, then sample and decode until a stop condition.
//!
//! [`Output`] turns chosen ids into streamed text and decides when a sequence ends (EOS id, stop
//! string, token budget); [`generate`] drives a backend for one sequence with it. The server's
//! scheduler uses [`Output`] the same way for many sequences at once.

use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

use super::sampler::{Sampler, SamplingParams};
use super::stop::{StopCheck, StopChecker};
use crate::backend::{Backend, LogitsFor, RunChoice};
use crate::text::tokenizer::{IncrementalDecoder, Tokenizer};

/// What a request asks of generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before any of them, which are never emitted.
    pub stop: Vec<String>,
    /// Token ids that end generation (not emitted as text).
    pub eos_token_ids: Vec<u32>,
    /// Token ids that end generation once emitted as text (`</tool_call>` where the request
    /// allows one tool call only).
    pub end_after_ids: Vec<u32>,
    /// Tokens generated before the reply may end: the end-of-sequence ids are banned until then,
    /// and stop strings only match text that ends in a later token (vLLM's rule).
    pub min_tokens: usize,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// The token budget ran out.
    Length,
}

/// What one chosen token produced.
pub struct Pushed {
    /// Text now safe to emit (may be empty while a character or stop string is incomplete).
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// The output side of a sequence: ids so far, streaming detokenisation, stop conditions.
pub struct Output<'t> {
    pub ids: Vec<u32>,
    tokenizer: Option<&'t Tokenizer>,
    decoder: Option<IncrementalDecoder<'t>>,
    /// Leave special (control) tokens out of the text, as OpenAI-style servers do.
    skip_special_tokens: bool,
    stop: StopChecker,
    eos_token_ids: Vec<u32>,
    end_after_ids: Vec<u32>,
    min_tokens: usize,
    max_tokens: usize,
}

impl<'t> Output<'t> {
    pub fn new(params: &GenerationParams, tokenizer: Option<&'t Tokenizer>) -> Self {
        Self {
            ids: Vec::new(),
            tokenizer,
            decoder: tokenizer.map(Tokenizer::incremental_decoder),
            skip_special_tokens: false,
            stop: StopChecker::new(params.stop.clone()),
            eos_token_ids: params.eos_token_ids.clone(),
            end_after_ids: params.end_after_ids.clone(),
            min_tokens: params.min_tokens,
            max_tokens: params.max_tokens,
        }
    }

    /// Whether the reply may not end yet (`min_tokens` not reached): its end-of-sequence ids
    /// are to be banned when the next token is chosen.
    pub fn holds_back_eos(&self) -> bool {
        self.ids.len() < self.min_tokens
    }

    /// The most tokens the reply may have.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The ids that end generation unwritten.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Leaves special tokens (`<|im_start|>`, say) out of the text; tags the model writes as text
    /// (`<think>`, `<tool_call>`) are not special and stay.
    pub fn skipping_special_tokens(mut self) -> Self {
        self.skip_special_tokens = true;
        self
    }

    /// Records the next chosen id.
    pub fn push(&mut self, id: u32) -> Result<Pushed> {
        if self.eos_token_ids.contains(&id) {
            self.ids.push(id);
            return Ok(Pushed {
                text: self.flush()?,
                finish: Some(FinishReason::Stop),
            });
        }
        self.ids.push(id);
        let skipped = self.skip_special_tokens && self.tokenizer.is_some_and(|t| t.is_special(id));
        let piece = match &mut self.decoder {
            Some(d) if !skipped => d.push(id)?,
            _ => String::new(),
        };
        // Before the minimum the text passes unchecked: a stop string must end in a token
        // from the `min_tokens`-th on.
        let checked = if self.ids.len() < self.min_tokens {
            StopCheck {
                text: piece,
                matched_stop: None,
            }
        } else {
            self.stop.push(&piece)
        };
        if checked.matched_stop.is_some() {
            return Ok(Pushed {
                text: checked.text,
                finish: Some(FinishReason::Stop),
            });
        }
        let mut text = checked.text;
        if self.end_after_ids.contains(&id) {
            text.push_str(&self.flush()?);
            return Ok(Pushed {
                text,
                finish: Some(FinishReason::Stop),
            });
        }
        if self.ids.len() >= self.max_tokens {
            text.push_str(&self.flush()?);
            return Ok(Pushed {
                text,
                finish: Some(FinishReason::Length),
            });
        }
        Ok(Pushed { text, finish: None })
    }

    /// Releases text held back for an incomplete character or a possible stop string.
    fn flush(&mut self) -> Result<String> {
        let tail = match self.decoder.take() {
            Some(d) => d.finish()?,
            None => String::new(),
        };
        let checked = self.stop.push(&tail);
        let mut text = checked.text;
        if checked.matched_stop.is_none() {
            let stop = std::mem::replace(&mut self.stop, StopChecker::new(Vec::<String>::new()));
            text.push_str(&stop.finish());
        }
        Ok(text)
    }
}

/// The result of [`generate`].
#[derive(Debug, Serialize)]
pub struct Generation {
    pub ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// Generates a continuation of `prompt`, passing text to `on_text` as it becomes final.
pub fn generate<B: Backend>(
    backend: &B,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    params: &GenerationParams,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let mut sampler =
        Sampler::new(params.sampling.clone(), prompt).map_err(|e| anyhow::anyhow!("{e}"))?;
    // Plain greedy decoding can pick on the device; anything else needs the logits here.
    let device_greedy = params.sampling.is_greedy();
    // A backend that draws tokens itself does so unless penalties need a history it cannot hold.
    let penalises = backend.penalises_on_device();
    let device_draws = backend.samples_on_device() && params.sampling.is_drawable_on(penalises);
    let allowed = tokenizer.map_or(backend.config().vocab_size, Tokenizer::vocab_size);
    let mut output = Output::new(params, tokenizer);
    let mut state = backend.new_state()?;

    let start = Instant::now();
    let mut logits = backend.prefill(&mut state, prompt, LogitsFor::Last)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut id = sampler.sample(&mut logits)?.token_id;

    let start = Instant::now();
    let mut finish = None;
    // Records a chosen id; `false` once the sequence has ended.
    let mut take = |id: u32| -> Result<bool> {
        let pushed = output.push(id)?;
        if !pushed.text.is_empty() {
            on_text(&pushed.text)?;
        }
        finish = pushed.finish;
        Ok(finish.is_none())
    };
    if take(id)? {
        if device_greedy {
            backend.decode_run(state, id, RunChoice::Greedy, &mut take)?;
        } else if device_draws {
            if sampler.penalises() {
                backend.load_penalty_history(&mut state, &sampler.penalty_history())?;
            }
            let mut next = sampler
                .device_draws(allowed, penalises)
                .context("the sampling settings changed during generation")?;
            backend.decode_run(state, id, RunChoice::Drawn(&mut next), &mut take)?;
        } else {
            loop {
                let mut logits = backend.decode(&mut [&mut state], &[id])?;
                id = sampler.sample(&mut logits)?.token_id;
                if !take(id)? {
                    break;
                }
            }
        }
    }
    let finish = finish.context("generation ended without a finish reason")?;
    let decode_s = start.elapsed().as_secs_f64();
    let decoded = output.ids.len().saturating_sub(1);
    Ok(Generation {
        ids: output.ids,
        finish_reason: finish,
        prompt_tokens: prompt.len(),
        prefill_tok_s: prompt.len() as f64 / prefill_s,
        decode_tok_s: if decoded == 0 {
            0.0
        } else {
            decoded as f64 / decode_s
        },
    })
}
