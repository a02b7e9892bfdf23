//! Token sampling: logits processors (penalties, temperature, top-k/top-p/min-p) and seeded draws.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde::Deserialize;

use crate::backend::{DeviceDraw, Penalties, PenaltyHistory};

/// Temperatures below this decode greedily, as in vLLM: dividing logits by a vanishing temperature
/// overflows f32 to infinity (NaN after the softmax), and long before that the draw is the argmax
/// unless logits tie to within float precision.
const MIN_SAMPLING_TEMPERATURE: f32 = 1e-5;

/// How many candidates the first top-p round sorts; later rounds grow geometrically. LLM
/// distributions concentrate their mass on few tokens, so one small round usually suffices.
const FIRST_TOP_P_ROUND: usize = 64;

/// What [`Sampler::sample`] fails with when no logit is finite (or none stays finite once
/// divided by the temperature): only broken weights or configurations produce that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the model produced no finite logit (its weights or configuration are broken)")]
pub struct NoFiniteLogit;

/// How to choose the next token. Every field has an "off" value, and the default is greedy
/// decoding with all filters and penalties off.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits before the softmax; 0 selects greedy decoding (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability mass reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely token's probability; 0 = off.
    pub min_p: f32,
    /// HF-style penalty on every token id seen in the prompt or output: positive logits are
    /// divided by it, negative ones multiplied; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI-style: subtracted once from the logit of every token generated at least once.
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Seed for the draws; `None` seeds from OS entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

/// A sampling parameter outside its valid range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}` = {value}: must be {requirement}")]
pub struct InvalidSamplingParam {
    pub field: &'static str,
    pub value: f32,
    pub requirement: &'static str,
}

impl SamplingParams {
    /// Whether a draw needs nothing but the logits and the filters (temperature above the greedy
    /// threshold, no penalties), so a backend can make it without the history.
    pub fn is_drawable_anywhere(&self) -> bool {
        self.temperature >= MIN_SAMPLING_TEMPERATURE && !self.penalises()
    }

    /// Whether a backend that draws tokens itself can make this draw: one that needs no history
    /// ([`SamplingParams::is_drawable_anywhere`]), or a penalised one (greedy or not) where the
    /// backend applies penalties itself (`backend_penalises`).
    pub fn is_drawable_on(&self, backend_penalises: bool) -> bool {
        self.is_drawable_anywhere() || (backend_penalises && self.penalises())
    }

    /// Whether any penalty is on.
    pub fn penalises(&self) -> bool {
        !self.penalties().is_none()
    }

    pub fn penalties(&self) -> Penalties {
        Penalties {
            repetition: self.repetition_penalty,
            presence: self.presence_penalty,
            frequency: self.frequency_penalty,
        }
    }

    /// Whether the choice is always the plain argmax of the logits (no temperature, no
    /// penalties), which a backend can then make on its own without returning the logits.
    pub fn is_greedy(&self) -> bool {
        self.temperature < MIN_SAMPLING_TEMPERATURE && !self.penalises()
    }

    /// Checks every field's range (NaN is always out of range); the error names the first bad field.
    pub fn validate(&self) -> Result<(), InvalidSamplingParam> {
        let checks = [
            (
                "temperature",
                self.temperature,
                self.temperature.is_finite() && self.temperature >= 0.0,
                "a finite number >= 0",
            ),
            (
                "top_p",
                self.top_p,
                self.top_p > 0.0 && self.top_p <= 1.0,
                "in (0, 1]",
            ),
            (
                "min_p",
                self.min_p,
                (0.0..=1.0).contains(&self.min_p),
                "in [0, 1]",
            ),
            (
                "repetition_penalty",
                self.repetition_penalty,
                self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
                "a finite number > 0",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                (-2.0..=2.0).contains(&self.presence_penalty),
                "in [-2, 2]",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                (-2.0..=2.0).contains(&self.frequency_penalty),
                "in [-2, 2]",
            ),
        ];
        match checks.into_iter().find(|&(_, _, valid, _)| !valid) {
            Some((field, value, _, requirement)) => Err(InvalidSamplingParam {
                field,
                value,
                requirement,
            }),
            None => Ok(()),
        }
    }
}

/// The chosen token and its log-probability under the distribution it was drawn from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
    pub logprob: f32,
}

/// One entry of a `top_logprobs` list.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// Chooses the tokens of one sequence: applies the penalties and filters of its
/// [`SamplingParams`] to each step's logits and draws from a seeded RNG.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// Distinct ids of the prompt and generated tokens: the repetition penalty applies once per id.
    seen: HashSet<u32>,
    /// Times each id was generated; presence and frequency penalties ignore the prompt.
    generated_counts: HashMap<u32, u32>,
    /// Reused across steps so that a draw does not allocate a vocabulary-sized buffer per token.
    candidates: Vec<Candidate>,
}

impl Sampler {
    /// Validates `params` and prepares to sample the continuation of `prompt_ids`.
    pub fn new(params: SamplingParams, prompt_ids: &[u32]) -> Result<Self, InvalidSamplingParam> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => seeded_rng(seed),
            None => ChaCha20Rng::from_os_rng(),
        };
        Ok(Self {
            params,
            rng,
            seen: prompt_ids.iter().copied().collect(),
            generated_counts: HashMap::new(),
            candidates: Vec::new(),
        })
    }

    /// Chooses the next token from one step's `logits` (indexed by token id) and records it as
    /// generated. Applies, in order: repetition penalty, presence/frequency penalties,
    /// temperature, top-k, top-p, min-p, then draws (or takes the argmax when greedy, lowest id
    /// on ties). Non-finite logits are never chosen, so `-inf` masks a token.
    ///
    /// On return `logits` holds the final logits the choice was made from (filtered-out tokens
    /// set to `-inf`), so [`top_logprobs`] on it agrees with [`Sampled::logprob`]. When greedy,
    /// that is the penalised logits without temperature or filters, which do not change the argmax.
    ///
    /// # Panics
    /// If a prompt or generated id is not an index of `logits`.
    pub fn sample(&mut self, logits: &mut [f32]) -> Result<Sampled, NoFiniteLogit> {
        self.apply_penalties(logits);
        let sampled = if self.params.temperature < MIN_SAMPLING_TEMPERATURE {
            greedy(logits)
        } else {
            self.draw(logits)
        }?;
        self.record(sampled.token_id);
        Ok(sampled)
    }

    /// This step's draw for a backend that samples on its own (ids from `allowed` up excluded),
    /// with a seed from this sampler's generator; `None` when the choice needs the host: greedy
    /// decoding without penalties (the backend's argmax does that), or penalties where the
    /// backend does not apply them (`backend_penalises`, see
    /// [`SamplingParams::is_drawable_on`]). Record the token the backend chose with
    /// [`Sampler::record`]; a penalised draw also needs the backend to hold this sampler's
    /// [`Sampler::penalty_history`].
    pub fn device_draw(&mut self, allowed: usize, backend_penalises: bool) -> Option<DeviceDraw> {
        self.params
            .is_drawable_on(backend_penalises)
            .then(|| self.next_draw(allowed))
    }

    /// [`Sampler::device_draw`] for every step of a run: `None` when the choice needs the host.
    /// The drawn ids need no [`Sampler::record`]: penalised draws count them in the history the
    /// backend holds, loaded from [`Sampler::penalty_history`] before the run.
    pub fn device_draws(
        &mut self,
        allowed: usize,
        backend_penalises: bool,
    ) -> Option<impl FnMut() -> DeviceDraw + '_> {
        let drawable = self.params.is_drawable_on(backend_penalises);
        drawable.then_some(move || self.next_draw(allowed))
    }

    /// Whether this sampler's choices depend on the history (any penalty on).
    pub fn penalises(&self) -> bool {
        self.params.penalises()
    }

    /// The ids seen so far and the generated counts, in id order, for a backend that applies
    /// the penalties itself.
    pub fn penalty_history(&self) -> PenaltyHistory {
        let mut seen: Vec<u32> = self.seen.iter().copied().collect();
        seen.sort_unstable();
        let mut generated: Vec<(u32, u32)> = self
            .generated_counts
            .iter()
            .map(|(&id, &count)| (id, count))
            .collect();
        generated.sort_unstable();
        PenaltyHistory { seen, generated }
    }

    /// A draw with these settings; greedy decoding (with penalties, or the draw would not be
    /// made elsewhere) takes the most likely id, every filter off.
    fn next_draw(&mut self, allowed: usize) -> DeviceDraw {
        let p = &self.params;
        let greedy = p.temperature < MIN_SAMPLING_TEMPERATURE;
        DeviceDraw {
            temperature: if greedy { 1.0 } else { p.temperature },
            top_k: if greedy { 0 } else { p.top_k },
            top_p: if greedy { 1.0 } else { p.top_p },
            min_p: if greedy { 0.0 } else { p.min_p },
            allowed,
            penalties: p.penalties(),
            greedy,
            seed: self.rng.next_u64(),
        }
    }

    /// Records a token chosen elsewhere (by the backend) as generated.
    pub fn record(&mut self, token_id: u32) {
        self.seen.insert(token_id);
        *self.generated_counts.entry(token_id).or_insert(0) += 1;
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let repetition = self.params.repetition_penalty;
        if repetition != 1.0 {
            for &id in &self.seen {
                let logit = &mut logits[id as usize];
                *logit = if *logit > 0.0 {
                    *logit / repetition
                } else {
                    *logit * repetition
                };
            }
        }
        let presence = self.params.presence_penalty;
        let frequency = self.params.frequency_penalty;
        if presence != 0.0 || frequency != 0.0 {
            for (&id, &count) in &self.generated_counts {
                logits[id as usize] -= presence + frequency * count as f32;
            }
        }
    }

    fn draw(&mut self, logits: &mut [f32]) -> Result<Sampled, NoFiniteLogit> {
        let params = &self.params;
        for logit in logits.iter_mut() {
            *logit /= params.temperature;
        }
        let candidates = &mut self.candidates;
        candidates.clear();
        candidates.extend(finite_candidates(logits));
        if candidates.is_empty() {
            return Err(NoFiniteLogit);
        }
        let finite_count = candidates.len();

        // Both orders the draw may walk the candidates in (by id, or by descending logit with
        // ties by id) are canonical, so a seed gives the same tokens whatever the sort algorithm.
        if params.top_k > 0 && params.top_k < candidates.len() {
            candidates.select_nth_unstable_by(params.top_k - 1, Candidate::more_likely_first);
            candidates.truncate(params.top_k);
            candidates.sort_unstable_by(Candidate::more_likely_first);
        }
        if params.top_p < 1.0 {
            keep_top_p(candidates, params.top_p);
        }
        if params.min_p > 0.0 {
            keep_min_p(candidates, params.min_p);
        }
        let sampled = draw_from(candidates, uniform(&mut self.rng));

        if candidates.len() < finite_count {
            logits.fill(f32::NEG_INFINITY);
            for candidate in candidates.iter() {
                logits[candidate.token_id as usize] = candidate.logit;
            }
        }
        Ok(sampled)
    }
}

/// The `n` most likely tokens under `logits` (indexed by token id) with their log-softmax values,
/// most likely first, lowest id first on ties. Non-finite logits are left out, so the list is
/// shorter than `n` when fewer tokens are possible.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<TokenLogprob> {
    if n == 0 {
        return Vec::new();
    }
    top_under(logits, n, &LogSoftmax::over(finite_candidates(logits)))
}

/// The log-softmax of `logits` at `token_id` (non-finite logits are impossible tokens; an
/// impossible `token_id` gets minus infinity).
pub fn logprob_of(logits: &[f32], token_id: u32) -> f32 {
    logprob_under(
        logits,
        token_id,
        &LogSoftmax::over(finite_candidates(logits)),
    )
}

/// [`logprob_of`] and [`top_logprobs`] together, the log-softmax's normaliser formed once (a
/// pass over the vocabulary fewer per scored token).
pub fn logprob_and_top(logits: &[f32], token_id: u32, n: usize) -> (f32, Vec<TokenLogprob>) {
    let normaliser = LogSoftmax::over(finite_candidates(logits));
    (
        logprob_under(logits, token_id, &normaliser),
        top_under(logits, n, &normaliser),
    )
}

fn logprob_under(logits: &[f32], token_id: u32, normaliser: &LogSoftmax) -> f32 {
    match logits.get(token_id as usize) {
        Some(&logit) if logit.is_finite() => normaliser.logprob(logit),
        _ => f32::NEG_INFINITY,
    }
}

fn top_under(logits: &[f32], n: usize, normaliser: &LogSoftmax) -> Vec<TokenLogprob> {
    let mut candidates: Vec<Candidate> = finite_candidates(logits).collect();
    let n = n.min(candidates.len());
    if n == 0 {
        return Vec::new();
    }
    candidates.select_nth_unstable_by(n - 1, Candidate::more_likely_first);
    candidates.truncate(n);
    candidates.sort_unstable_by(Candidate::more_likely_first);
    candidates
        .iter()
        .map(|candidate| TokenLogprob {
            token_id: candidate.token_id,
            logprob: normaliser.logprob(candidate.logit),
        })
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    logit: f32,
    token_id: u32,
}

impl Candidate {
    /// Descending logit, then ascending id: a total order, so selections and sorts are
    /// deterministic and ties keep the lowest id, like `torch.argmax`.
    fn more_likely_first(a: &Candidate, b: &Candidate) -> Ordering {
        b.logit
            .total_cmp(&a.logit)
            .then(a.token_id.cmp(&b.token_id))
    }
}

fn finite_candidates(logits: &[f32]) -> impl Iterator<Item = Candidate> + Clone + '_ {
    logits
        .iter()
        .enumerate()
        .filter(|(_, logit)| logit.is_finite())
        .map(|(token_id, &logit)| Candidate {
            logit,
            token_id: token_id as u32,
        })
}

/// The log-softmax normaliser of a set of logits, accumulated in f64 because a vocabulary of
/// 248k terms loses precision in an f32 sum.
struct LogSoftmax {
    max_logit: f32,
    log_total: f64,
}

impl LogSoftmax {
    fn over(candidates: impl Iterator<Item = Candidate> + Clone) -> Self {
        let max_logit = max_logit(candidates.clone());
        let total: f64 = candidates.map(|c| weight(c.logit, max_logit)).sum();
        Self {
            max_logit,
            log_total: total.ln(),
        }
    }

    fn logprob(&self, logit: f32) -> f32 {
        (f64::from(logit - self.max_logit) - self.log_total) as f32
    }
}

fn max_logit(candidates: impl Iterator<Item = Candidate>) -> f32 {
    candidates
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Unnormalised probability, relative to the most likely token's.
fn weight(logit: f32, max_logit: f32) -> f64 {
    f64::from((logit - max_logit).exp())
}

fn greedy(logits: &[f32]) -> Result<Sampled, NoFiniteLogit> {
    let best = finite_candidates(logits)
        .min_by(Candidate::more_likely_first)
        .ok_or(NoFiniteLogit)?;
    Ok(Sampled {
        token_id: best.token_id,
        logprob: LogSoftmax::over(finite_candidates(logits)).logprob(best.logit),
    })
}

/// Keeps the smallest set of most likely candidates whose probability mass reaches `top_p`: a
/// candidate survives if the mass of those more likely than it is below `top_p` (HF's
/// `TopPLogitsWarper`). Leaves the survivors sorted most likely first, but sorts only as far as
/// needed, in rounds of growing size, instead of the whole vocabulary.
fn keep_top_p(candidates: &mut Vec<Candidate>, top_p: f32) {
    let max_logit = max_logit(candidates.iter().copied());
    let total: f64 = candidates.iter().map(|c| weight(c.logit, max_logit)).sum();
    let mass_to_reach = f64::from(top_p) * total;
    let mut mass_before = 0.0;
    let mut sorted_len = 0;
    let mut round = FIRST_TOP_P_ROUND;
    while sorted_len < candidates.len() {
        let round_end = (sorted_len + round).min(candidates.len());
        let unsorted = &mut candidates[sorted_len..];
        let round_len = round_end - sorted_len;
        if round_len < unsorted.len() {
            unsorted.select_nth_unstable_by(round_len - 1, Candidate::more_likely_first);
        }
        unsorted[..round_len].sort_unstable_by(Candidate::more_likely_first);
        for index in sorted_len..round_end {
            if mass_before >= mass_to_reach {
                candidates.truncate(index);
                return;
            }
            mass_before += weight(candidates[index].logit, max_logit);
        }
        sorted_len = round_end;
        round *= 4;
    }
}

/// Keeps candidates at least `min_p` times as likely as the most likely one. The ratio does not
/// depend on normalisation, so it is the same before or after top-k/top-p renormalise.
fn keep_min_p(candidates: &mut Vec<Candidate>, min_p: f32) {
    let max_logit = max_logit(candidates.iter().copied());
    let min_weight = f64::from(min_p);
    candidates.retain(|c| weight(c.logit, max_logit) >= min_weight);
}

/// Inverse-CDF draw over the candidates in their current order, `unit` being uniform in [0, 1).
fn draw_from(candidates: &[Candidate], unit: f64) -> Sampled {
    let normaliser = LogSoftmax::over(candidates.iter().copied());
    let weights = candidates
        .iter()
        .map(|c| weight(c.logit, normaliser.max_logit));
    let target = unit * weights.clone().sum::<f64>();
    let mut cumulative = 0.0;
    // Rounding can leave `target` at the total; then the last candidate that can be drawn is taken.
    let mut chosen = None;
    for (candidate, weight) in candidates.iter().zip(weights) {
        if weight > 0.0 {
            chosen = Some(candidate);
        }
        cumulative += weight;
        if target < cumulative {
            break;
        }
    }
    let chosen = chosen.expect("the largest candidate has weight 1");
    Sampled {
        token_id: chosen.token_id,
        logprob: normaliser.logprob(chosen.logit),
    }
}

/// The seed is the ChaCha20 key (little-endian, zero-padded) rather than going through
/// `seed_from_u64`'s expansion, so a seed's stream is fixed by the ChaCha20 definition alone.
fn seeded_rng(seed: u64) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    ChaCha20Rng::from_seed(key)
}

/// Uniform in [0, 1) from the top 53 bits of one draw: every f64 value in the range is a
/// multiple of 2^-53, and the conversion is ours, not a version-dependent library's.
fn uniform(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Probabilities whose filter outcomes are easy to compute by hand.
    const PROBS: [f32; 4] = [0.5, 0.3, 0.15, 0.05];

    fn ln(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn seeded(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(7),
            ..SamplingParams::default()
        }
    }

    fn log_softmax(logits: &[f32], id: usize) -> f32 {
        let total: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        (f64::from(logits[id]) - total.ln()) as f32
    }

    #[test]
    fn device_draws_carry_the_filters_and_seeded_seeds() {
        let params = SamplingParams {
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            ..seeded(0.8)
        };
        let draws = |params: &SamplingParams| -> Vec<DeviceDraw> {
            let mut sampler = Sampler::new(params.clone(), &[1, 2]).unwrap();
            (0..4)
                .map(|_| sampler.device_draw(100, false).unwrap())
                .collect()
        };
        let first = draws(&params);
        assert_eq!(first, draws(&params), "same seed, same draws");
        let mut sampler = Sampler::new(params.clone(), &[1, 2]).unwrap();
        let mut next = sampler.device_draws(100, false).unwrap();
        let run: Vec<DeviceDraw> = (0..4).map(|_| next()).collect();
        assert_eq!(first, run, "a run's draws are the steps' draws");
        let d = first[0];
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p, d.allowed),
            (0.8, 40, 0.9, 0.05, 100)
        );
        assert_eq!((d.penalties, d.greedy), (Penalties::NONE, false));
        assert!(first.windows(2).all(|w| w[0].seed != w[1].seed));
        let other = draws(&SamplingParams {
            seed: Some(8),
            ..params.clone()
        });
        assert_ne!(first[0].seed, other[0].seed);
    }

    #[test]
    fn greedy_or_penalised_sampling_is_not_drawn_elsewhere() {
        let penalised = [
            SamplingParams {
                repetition_penalty: 1.1,
                ..seeded(1.0)
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..seeded(1.0)
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..seeded(1.0)
            },
        ];
        for params in penalised.iter().cloned().chain([seeded(0.0)]) {
            assert!(!params.is_drawable_anywhere(), "{params:?}");
            let mut sampler = Sampler::new(params, &[]).unwrap();
            assert_eq!(sampler.device_draw(10, false), None);
            assert!(sampler.device_draws(10, false).is_none());
        }
        assert!(seeded(1.0).is_drawable_anywhere());
        // Where the backend applies penalties, penalised draws are its too; plain greedy
        // decoding stays with its argmax.
        for params in penalised {
            let mut sampler = Sampler::new(params.clone(), &[]).unwrap();
            let d = sampler.device_draw(10, true).unwrap();
            assert_eq!(d.penalties, params.penalties());
            assert!(!d.greedy);
        }
        let mut sampler = Sampler::new(seeded(0.0), &[]).unwrap();
        assert_eq!(sampler.device_draw(10, true), None);
    }

    #[test]
    fn penalised_greedy_decoding_is_a_greedy_draw_without_filters() {
        let params = SamplingParams {
            top_k: 5,
            top_p: 0.5,
            min_p: 0.1,
            presence_penalty: 1.5,
            ..seeded(0.0)
        };
        let mut sampler = Sampler::new(params, &[3]).unwrap();
        let d = sampler.device_draw(10, true).unwrap();
        assert!(d.greedy);
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (1.0, 0, 1.0, 0.0)
        );
        assert_eq!(d.penalties.presence, 1.5);
    }

    #[test]
    fn the_penalty_history_holds_the_prompt_and_the_generated_counts() {
        let params = SamplingParams {
            presence_penalty: 1.0,
            ..seeded(1.0)
        };
        let mut sampler = Sampler::new(params, &[9, 4, 9, 2]).unwrap();
        for id in [4, 7, 4, 4] {
            sampler.record(id);
        }
        let history = sampler.penalty_history();
        assert_eq!(history.seen, [2, 4, 7, 9]);
        assert_eq!(history.generated, [(4, 3), (7, 1)]);
    }

    #[test]
    fn recorded_tokens_count_for_penalties() {
        let params = SamplingParams {
            frequency_penalty: 1.0,
            ..seeded(0.0)
        };
        let mut sampler = Sampler::new(params, &[]).unwrap();
        sampler.record(0);
        // Token 0 led by 0.5 in logit; one recorded use costs it 1.0, so token 1 wins.
        let mut logits = vec![1.0, 0.5, 0.0];
        assert_eq!(sampler.sample(&mut logits).unwrap().token_id, 1);
    }

    fn assert_close(actual: f32, expected: f32) {
        assert!(
            (actual - expected).abs() < 1e-5,
            "{actual} is not close to {expected}"
        );
    }

    /// Draws once and returns the ids the filters kept, i.e. those left finite in the logits.
    fn survivors(params: SamplingParams, logits: &[f32]) -> Vec<u32> {
        let mut logits = logits.to_vec();
        let sampled = Sampler::new(params, &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        let kept: Vec<u32> = (0..logits.len() as u32)
            .filter(|&id| logits[id as usize].is_finite())
            .collect();
        assert!(kept.contains(&sampled.token_id));
        kept
    }

    #[test]
    fn default_params_are_valid_and_greedy() {
        let params = SamplingParams::default();
        assert_eq!(params.validate(), Ok(()));
        let mut logits = [0.1, 0.4, 0.2];
        let sampled = Sampler::new(params, &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        assert_eq!(sampled.token_id, 1);
    }

    #[test]
    fn params_deserialize_with_defaults_for_missing_fields() {
        let params: SamplingParams =
            serde_json::from_str(r#"{"temperature": 0.7, "top_k": 20, "seed": 3}"#).unwrap();
        assert_eq!(
            params,
            SamplingParams {
                temperature: 0.7,
                top_k: 20,
                seed: Some(3),
                ..SamplingParams::default()
            }
        );
    }

    #[test]
    fn validation_names_the_out_of_range_field() {
        let defaults = SamplingParams::default;
        let cases = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..defaults()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..defaults()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..defaults()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..defaults()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.1,
                    ..defaults()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..defaults()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..defaults()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..defaults()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.5,
                    ..defaults()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..defaults()
                },
                "frequency_penalty",
            ),
        ];
        for (params, field) in cases {
            let error = params.validate().unwrap_err();
            assert_eq!(error.field, field);
            assert!(error.to_string().contains(&format!("`{field}`")), "{error}");
            assert_eq!(
                Sampler::new(params, &[]).err().map(|e| e.field),
                Some(field)
            );
        }
        let error = SamplingParams {
            top_p: 1.5,
            ..SamplingParams::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid sampling parameter `top_p` = 1.5: must be in (0, 1]"
        );
    }

    #[test]
    fn greedy_takes_the_argmax_with_the_lowest_id_on_ties() {
        let raw = [1.0, 3.0, 3.0, 2.0];
        let mut logits = raw;
        let sampled = Sampler::new(SamplingParams::default(), &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        assert_eq!(sampled.token_id, 1);
        assert_close(sampled.logprob, log_softmax(&raw, 1));
        assert_eq!(logits, raw);
    }

    #[test]
    fn non_finite_logits_are_never_chosen() {
        let mut logits = [f32::NAN, f32::NEG_INFINITY, 0.1, 0.5];
        let sampled = Sampler::new(SamplingParams::default(), &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        assert_eq!(sampled.token_id, 3);
        for seed in 0..50 {
            let params = SamplingParams {
                seed: Some(seed),
                ..seeded(1.0)
            };
            assert!(survivors(params, &[f32::NAN, f32::NEG_INFINITY, 0.1, 0.5]) == [2, 3]);
        }
    }

    #[test]
    fn sampling_without_a_finite_logit_is_an_error() {
        for params in [seeded(1.0), SamplingParams::default()] {
            let mut sampler = Sampler::new(params, &[]).unwrap();
            let mut logits = [f32::NEG_INFINITY, f32::NAN, f32::INFINITY];
            assert_eq!(sampler.sample(&mut logits), Err(NoFiniteLogit));
        }
        // Finite logits that the temperature takes out of range leave nothing to draw either.
        let mut sampler = Sampler::new(seeded(1e-5), &[]).unwrap();
        assert_eq!(sampler.sample(&mut [3e38, 3e38]), Err(NoFiniteLogit));
    }

    #[test]
    fn repetition_penalty_applies_once_per_id_seen_in_prompt_or_output() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let raw = [2.0, -2.0, 1.5, 0.5];
        let mut sampler = Sampler::new(params, &[0, 1, 3, 0]).unwrap();

        let mut logits = raw;
        assert_eq!(sampler.sample(&mut logits).unwrap().token_id, 2);
        assert_eq!(logits, [1.0, -4.0, 1.5, 0.25]);

        let mut logits = raw;
        assert_eq!(sampler.sample(&mut logits).unwrap().token_id, 0);
        assert_eq!(logits, [1.0, -4.0, 0.75, 0.25]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens_only() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let raw = [3.0, 2.9, 0.0];
        let mut sampler = Sampler::new(params, &[0, 0, 0]).unwrap();
        let expected_steps: [(u32, [f32; 3]); 4] = [
            (0, [3.0, 2.9, 0.0]),
            (1, [2.25, 2.9, 0.0]),
            (0, [2.25, 2.15, 0.0]),
            (1, [2.0, 2.15, 0.0]),
        ];
        for (expected_id, expected_logits) in expected_steps {
            let mut logits = raw;
            assert_eq!(sampler.sample(&mut logits).unwrap().token_id, expected_id);
            for (actual, expected) in logits.into_iter().zip(expected_logits) {
                assert_close(actual, expected);
            }
        }
    }

    #[test]
    fn temperature_divides_logits_and_logprob_uses_the_scaled_distribution() {
        let mut logits = [1.0, 2.0, 0.5];
        let sampled = Sampler::new(seeded(0.5), &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        assert_eq!(logits, [2.0, 4.0, 1.0]);
        assert_close(
            sampled.logprob,
            log_softmax(&logits, sampled.token_id as usize),
        );
    }

    #[test]
    fn tiny_temperatures_decode_greedily() {
        let raw = [1.0, 2.0, 0.5];
        let mut logits = raw;
        let sampled = Sampler::new(seeded(1e-6), &[])
            .unwrap()
            .sample(&mut logits)
            .unwrap();
        assert_eq!(sampled.token_id, 1);
        assert_eq!(logits, raw);
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_with_lowest_ids_on_ties() {
        let top_k = |top_k| SamplingParams {
            top_k,
            ..seeded(1.0)
        };
        assert_eq!(survivors(top_k(2), &[1.0, 3.0, 2.0, 0.0]), [1, 2]);
        assert_eq!(survivors(top_k(2), &[2.0, 1.0, 2.0, 2.0]), [0, 2]);
        assert_eq!(survivors(top_k(1), &[2.0, 1.0, 2.0, 2.0]), [0]);
        assert_eq!(survivors(top_k(4), &[1.0, 3.0, 2.0, 0.0]), [0, 1, 2, 3]);
        assert_eq!(survivors(top_k(9), &[1.0, 3.0, 2.0, 0.0]), [0, 1, 2, 3]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        let top_p = |top_p| SamplingParams {
            top_p,
            ..seeded(1.0)
        };
        // Shuffled so that the order of ids differs from the order of probabilities.
        let logits = ln(&[0.05, 0.5, 0.15, 0.3]);
        assert_eq!(survivors(top_p(0.4), &logits), [1]);
        assert_eq!(survivors(top_p(0.7), &logits), [1, 3]);
        assert_eq!(survivors(top_p(0.85), &logits), [1, 2, 3]);
        assert_eq!(survivors(top_p(0.99), &logits), [0, 1, 2, 3]);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_matches_a_full_sort() {
        // Deterministic pseudo-random logits spread over a few nats, so that top-p keeps
        // thousands of tokens and needs several sorting rounds.
        let logits: Vec<f32> = (0..20_000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) % 1000) as f32 / 250.0)
            .collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logits.iter().map(|&l| f64::from((l - max).exp())).collect();
        let total: f64 = weights.iter().sum();
        for top_p in [0.01, 0.3, 0.9, 0.999] {
            let mut by_likelihood: Vec<u32> = (0..logits.len() as u32).collect();
            by_likelihood.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let mut mass = 0.0;
            let mut expected: Vec<u32> = by_likelihood
                .into_iter()
                .take_while(|&id| {
                    let keep = mass < f64::from(top_p) * total;
                    mass += weights[id as usize];
                    keep
                })
                .collect();
            expected.sort_unstable();
            let params = SamplingParams {
                top_p,
                ..seeded(1.0)
            };
            assert_eq!(survivors(params, &logits), expected, "top_p = {top_p}");
        }
    }

    #[test]
    fn min_p_keeps_tokens_at_least_that_fraction_of_the_most_likely() {
        let min_p = |min_p| SamplingParams {
            min_p,
            ..seeded(1.0)
        };
        assert_eq!(survivors(min_p(0.2), &ln(&PROBS)), [0, 1, 2]);
        assert_eq!(survivors(min_p(0.5), &ln(&PROBS)), [0, 1]);
        assert_eq!(survivors(min_p(1.0), &ln(&PROBS)), [0]);
    }

    #[test]
    fn top_p_applies_to_the_distribution_renormalised_by_top_k() {
        let top_p_only = SamplingParams {
            top_p: 0.6,
            ..seeded(1.0)
        };
        assert_eq!(survivors(top_p_only.clone(), &ln(&PROBS)), [0, 1]);
        // After top-k = 2 the probabilities are 0.625 and 0.375: the first alone reaches 0.6.
        let with_top_k = SamplingParams {
            top_k: 2,
            ..top_p_only
        };
        assert_eq!(survivors(with_top_k, &ln(&PROBS)), [0]);
    }

    #[test]
    fn temperature_applies_before_min_p() {
        let min_p = |temperature| SamplingParams {
            min_p: 0.4,
            ..seeded(temperature)
        };
        assert_eq!(survivors(min_p(1.0), &ln(&PROBS)), [0, 1]);
        // At temperature 2 the ratios to the top probability are square-rooted: 0.77, 0.55, 0.32.
        assert_eq!(survivors(min_p(2.0), &ln(&PROBS)), [0, 1, 2]);
    }

    fn draw_sequence(params: SamplingParams, steps: usize) -> Vec<Sampled> {
        let raw: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut sampler = Sampler::new(params, &[]).unwrap();
        (0..steps)
            .map(|_| sampler.sample(&mut raw.clone()).unwrap())
            .collect()
    }

    #[test]
    fn the_same_seed_and_logits_give_the_same_tokens() {
        let params = |seed| SamplingParams {
            top_k: 30,
            top_p: 0.95,
            min_p: 0.05,
            seed: Some(seed),
            ..seeded(0.9)
        };
        assert_eq!(
            draw_sequence(params(42), 200),
            draw_sequence(params(42), 200)
        );
        assert_ne!(
            draw_sequence(params(42), 200),
            draw_sequence(params(43), 200)
        );
    }

    #[test]
    fn a_seed_always_gives_the_same_stream() {
        let ids: Vec<u32> = draw_sequence(seeded(1.0), 12)
            .iter()
            .map(|s| s.token_id)
            .collect();
        assert_eq!(ids, PINNED_SEED_7_IDS);
    }

    /// Recorded from this implementation; a change means seeded requests no longer reproduce.
    const PINNED_SEED_7_IDS: [u32; 12] = [13, 4, 10, 9, 47, 20, 15, 48, 13, 47, 10, 4];

    #[test]
    fn a_seed_is_the_chacha20_key() {
        // RFC 8439, appendix A.1, test vector 1: all-zero key, nonce and counter give a keystream
        // starting 76 b8 e0 ad a0 f1 3d 90, read here as one little-endian u64.
        assert_eq!(seeded_rng(0).next_u64(), 0x903d_f1a0_ade0_b876);
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let raw = [1.0, 2.0, 0.5, -1.0];
        let temperature = 0.7;
        let draws = 100_000;
        let mut sampler = Sampler::new(seeded(temperature), &[]).unwrap();
        let mut counts = [0u32; 4];
        for _ in 0..draws {
            counts[sampler.sample(&mut raw.clone()).unwrap().token_id as usize] += 1;
        }
        let scaled = raw.map(|l| l / temperature);
        for (id, count) in counts.into_iter().enumerate() {
            let expected = log_softmax(&scaled, id).exp();
            let observed = count as f32 / draws as f32;
            assert!(
                (observed - expected).abs() < 0.01,
                "token {id}: observed {observed}, expected {expected}"
            );
        }
    }

    #[test]
    fn top_logprobs_lists_the_most_likely_tokens_first() {
        let logits = [0.5, 2.0, 2.0, f32::NEG_INFINITY, 1.0];
        let finite = [0.5, 2.0, 2.0, 1.0];
        let top = top_logprobs(&logits, 3);
        assert_eq!(
            top.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            [1, 2, 4]
        );
        assert_close(top[0].logprob, log_softmax(&finite, 1));
        assert_close(top[2].logprob, log_softmax(&finite, 3));
        assert_eq!(top_logprobs(&logits, 10).len(), 4);
        assert!(top_logprobs(&logits, 0).is_empty());
        assert!(top_logprobs(&[f32::NEG_INFINITY], 2).is_empty());
    }

    #[test]
    fn sampled_logprob_matches_top_logprobs_of_the_final_logits() {
        let params = SamplingParams {
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            ..seeded(0.8)
        };
        let mut sampler = Sampler::new(params, &[]).unwrap();
        let mut logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.4).collect();
        let sampled = sampler.sample(&mut logits).unwrap();
        let listed = top_logprobs(&logits, logits.len());
        let entry = listed
            .iter()
            .find(|t| t.token_id == sampled.token_id)
            .unwrap();
        assert_close(entry.logprob, sampled.logprob);
        let total: f32 = listed.iter().map(|t| t.logprob.exp()).sum();
        assert_close(total, 1.0);
    }
}
