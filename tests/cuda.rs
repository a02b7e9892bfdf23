//! The CUDA backend against the CPU reference on the tiny fixtures (needs a GPU: run on the
//! device with `scripts/gpu_check.sh`; built only with `--features cuda`).
//!
//! Tolerance: the GPU keeps weights and the KV cache in bf16, so it is calibrated on each
//! fixture as a multiple of the spread between the CPU backend in f32 and the same run with
//! bf16-rounded activations.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lily::backend::cpu::CpuBackend;
use lily::backend::cuda::{CudaBackend, CudaOptions, CudaState, DEFAULT_PREFILL_CHUNK};
use lily::backend::{Backend, DeviceDraw, LogitsFor, Penalties, RunChoice, argmax};
use lily::checkpoint::DType;
use lily::config::ModelConfig;
use lily::convert::{ConvertOptions, DEFAULT_MAX_SHARD_BYTES, convert};
use lily::engine::sampler::{Sampler, SamplingParams};
use lily::model::demo::{
    demo_config_json, random_model, random_safetensors, random_safetensors_in,
};
use lily::model::{Model, Storage};
use lily::quant::QuantSpec;

mod common;
use common::relative_error;

/// How many calibration spreads the GPU may differ by.
const SPREADS: f32 = 3.0;

fn fixtures() -> Vec<PathBuf> {
    // Relative to the repository root, where cargo runs tests and where gpu_check.sh runs this
    // binary on the device.
    let root = Path::new("tests/fixtures");
    ["tiny-wrapper", "tiny-text"]
        .iter()
        .map(|f| root.join(f))
        .collect()
}

/// The first fixture converted to MLX `bits`-bit with groups of `group_size`, written to `out`.
fn quantized_fixture(out: &Path, bits: u32, group_size: usize) -> PathBuf {
    convert_to(&fixtures()[0], out, bits, group_size);
    out.to_path_buf()
}

/// The first fixture as it is (bf16) and converted to 4-bit, groups of 64, under `tmp`.
fn bf16_and_q4_fixtures(tmp: &Path) -> [PathBuf; 2] {
    [
        fixtures()[0].clone(),
        quantized_fixture(&tmp.join("q4"), 4, 64),
    ]
}

fn prompts(dir: &Path) -> Vec<Vec<u32>> {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    serde_json::from_value(meta["prompts"].clone()).unwrap()
}

/// The tests' backend options: `max_context` and `max_sequences` slots, graphs on, the router
/// folded, the default prefill chunk, no spare slots (change a field with `..options(...)`).
fn options(max_context: usize, max_sequences: usize) -> CudaOptions {
    CudaOptions {
        max_context,
        max_sequences,
        spare_sequences: 0,
        fit_sequences: false,
        use_graphs: true,
        prefill_chunk: DEFAULT_PREFILL_CHUNK,
        fold_router: true,
    }
}

fn cuda(model: &Model, sequences: usize) -> CudaBackend {
    CudaBackend::new(model, options(256, sequences)).expect("CUDA backend starts")
}

fn all_logits<B: Backend>(b: &B, prompt: &[u32]) -> Vec<f32> {
    let mut state = b.new_state().unwrap();
    b.prefill(&mut state, prompt, LogitsFor::All).unwrap()
}

#[test]
fn logits_match_the_cpu_backend_within_calibrated_tolerance() {
    for dir in fixtures() {
        compare_with_cpu(&dir);
    }
}

/// MLX-quantised weights stay quantised on the GPU: compared with the CPU backend running the
/// same quantised checkpoint.
#[test]
fn quantized_logits_match_the_cpu_backend_within_calibrated_tolerance() {
    for (bits, group_size) in [(4, 64), (8, 32), (4, 128)] {
        let tmp = tempfile::tempdir().unwrap();
        let out = quantized_fixture(&tmp.path().join("q"), bits, group_size);
        std::fs::copy(fixtures()[0].join("golden.json"), out.join("golden.json")).unwrap();
        println!("{bits}-bit, group size {group_size}");
        compare_with_cpu(&out);
    }
}

fn compare_with_cpu(dir: &Path) {
    let model = Arc::new(Model::load(dir).unwrap());
    let cpu = CpuBackend::new(model.clone());
    let cpu_bf16 = CpuBackend::with_bf16_activations(model.clone());
    let gpu = cuda(&model, 1);
    for prompt in prompts(dir) {
        let want = all_logits(&cpu, &prompt);
        let spread = relative_error(&all_logits(&cpu_bf16, &prompt), &want);
        let got = all_logits(&gpu, &prompt);
        let err = relative_error(&got, &want);
        println!(
            "{}: {} tokens: GPU error {err:.2e}, bf16 spread {spread:.2e}",
            dir.display(),
            prompt.len()
        );
        assert!(
            err <= SPREADS * spread,
            "error {err} above {SPREADS} x spread {spread}"
        );
        // Same top-1 at (almost) every position.
        let vocab = model.config.vocab_size;
        let agree = got
            .chunks_exact(vocab)
            .zip(want.chunks_exact(vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        assert!(
            agree * 10 >= prompt.len() * 9,
            "top-1 agreement {agree}/{}",
            prompt.len()
        );
    }
}

#[test]
fn device_argmax_matches_host_argmax_and_forks_continue_identically() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let gpu = cuda(&model, 3);
    let prompt = &prompts(dir)[0];
    let mut a = gpu.new_state().unwrap();
    let logits = gpu.prefill(&mut a, prompt, LogitsFor::Last).unwrap();
    let first = argmax(&logits);
    let mut b = gpu.fork(&a).unwrap();
    let mut with_logits = gpu.fork(&a).unwrap();
    let (mut ta, mut tb, mut tl) = (first, first, first);
    for _ in 0..16 {
        ta = gpu.decode_greedy(&mut [&mut a], &[ta]).unwrap()[0];
        tb = gpu.decode_greedy(&mut [&mut b], &[tb]).unwrap()[0];
        tl = argmax(&gpu.decode(&mut [&mut with_logits], &[tl]).unwrap());
        assert_eq!(ta, tb);
        assert_eq!(ta, tl);
    }
    // All three slots are taken: a fourth sequence is a clear error.
    assert!(gpu.new_state().is_err());
    drop(b);
    gpu.new_state().expect("a dropped state frees its slot");
}

/// A slot's next sequence reads back its own ids: the previous one's last step, to the position
/// where the next one's first lands, chose another id there, and the next one must not be told
/// that one (the CUDA backend's steps tell the host their id through a word per slot).
#[test]
fn a_reused_slot_reads_back_its_new_sequences_ids() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let gpu = cuda(&model, 1);
    let vocab = model.config.vocab_size as u32;
    let prompt = &prompts(dir)[0];
    let greedy_step =
        |state: &mut CudaState, token: u32| gpu.decode_greedy(&mut [state], &[token]).unwrap()[0];
    // The previous sequence: the prompt and one greedy step.
    let mut previous = gpu.new_state().unwrap();
    let first = argmax(&gpu.prefill(&mut previous, prompt, LogitsFor::Last).unwrap());
    let previous_id = greedy_step(&mut previous, first);
    drop(previous);
    // The next one: a prompt of the same length whose first greedy id differs, its ids taken
    // by the host's argmax of the logits (no id read back)...
    let (other, expected) = (1..vocab)
        .find_map(|shift| {
            let mut other = prompt.clone();
            other[0] = (other[0] + shift) % vocab;
            let mut state = gpu.new_state().unwrap();
            let mut token = argmax(&gpu.prefill(&mut state, &other, LogitsFor::Last).unwrap());
            let mut ids = Vec::new();
            for _ in 0..4 {
                token = argmax(&gpu.decode(&mut [&mut state], &[token]).unwrap());
                ids.push(token);
            }
            (ids[0] != previous_id).then_some((other, ids))
        })
        .expect("some prompt of the same length chooses another first id");
    // ... then again in the slot, greedy, after the previous sequence's step once more.
    let mut previous = gpu.new_state().unwrap();
    gpu.prefill(&mut previous, prompt, LogitsFor::Last).unwrap();
    assert_eq!(greedy_step(&mut previous, first), previous_id);
    drop(previous);
    let mut next = gpu.new_state().unwrap();
    let mut token = argmax(&gpu.prefill(&mut next, &other, LogitsFor::Last).unwrap());
    let mut ids = Vec::new();
    for _ in 0..4 {
        token = greedy_step(&mut next, token);
        ids.push(token);
    }
    assert_eq!(ids, expected);
}

/// Runs (`decode_run`, which a backend may pipeline, queueing each step before the previous id
/// is read back) pass the ids that step-by-step decoding chooses, greedy and drawn, stop when
/// told, and end at the context limit with the same ids and the same error.
#[test]
fn decode_runs_choose_the_step_by_step_ids() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let prompt = &prompts(dir)[0];
    let max_context = prompt.len() + 12;
    let gpu = CudaBackend::new(&model, options(max_context, 2)).unwrap();
    let vocab = model.config.vocab_size;
    let prefilled = |gpu: &CudaBackend| {
        let mut state = gpu.new_state().unwrap();
        let first = argmax(&gpu.prefill(&mut state, prompt, LogitsFor::Last).unwrap());
        (state, first)
    };
    for drawn in [false, true] {
        // Step k's draw has seed k, so a run and the steps one by one draw alike.
        let draw = |k: u64| sample_draw(k, vocab);
        let (mut state, first) = prefilled(&gpu);
        let mut stepwise = Vec::new();
        let mut token = first;
        let limit = loop {
            let chosen = if drawn {
                gpu.decode_sample(&mut [&mut state], &[token], &[draw(stepwise.len() as u64)])
            } else {
                gpu.decode_greedy(&mut [&mut state], &[token])
            };
            match chosen {
                Ok(ids) => token = ids[0],
                Err(e) => break e.to_string(),
            }
            stepwise.push(token);
        };
        drop(state);
        assert_eq!(stepwise.len(), max_context - prompt.len());
        assert!(limit.contains("context limit"), "{limit}");

        let run = |wanted: usize| {
            let (state, first) = prefilled(&gpu);
            let mut ids = Vec::new();
            let mut k = 0;
            let mut next = || {
                k += 1;
                draw(k - 1)
            };
            let choice = if drawn {
                RunChoice::Drawn(&mut next)
            } else {
                RunChoice::Greedy
            };
            let result = gpu.decode_run(state, first, choice, &mut |id| {
                ids.push(id);
                Ok(ids.len() < wanted)
            });
            (ids, result)
        };
        for wanted in [1, 2, 5] {
            let (ids, result) = run(wanted);
            result.unwrap();
            assert_eq!(
                ids,
                stepwise[..wanted],
                "drawn {drawn}: stopped after {wanted} ids"
            );
        }
        let (ids, result) = run(usize::MAX);
        assert_eq!(ids, stepwise, "drawn {drawn}: a run to the context limit");
        assert_eq!(result.unwrap_err().to_string(), limit);
    }
    // The runs gave their slots back: both are free again.
    let _a = gpu.new_state().unwrap();
    let _b = gpu.new_state().unwrap();
}

/// A cached module the driver cannot load (a damaged file) is compiled again, not an error.
#[test]
fn damaged_kernel_cache_entries_are_compiled_again() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let prompt = &prompts(dir)[0];
    let before = all_logits(&cuda(&model, 1), prompt);
    let cache = lily::backend::cuda::kernels::cache_dir().expect("a kernel cache directory");
    let mut damaged = 0;
    for entry in std::fs::read_dir(&cache).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ptx") {
            std::fs::write(&path, "not PTX").unwrap();
            damaged += 1;
        }
    }
    assert!(damaged > 0, "no cached modules in {}", cache.display());
    let after = all_logits(&cuda(&model, 1), prompt);
    assert_eq!(before, after);
}

#[test]
fn context_limit_is_an_error() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let gpu = CudaBackend::new(&model, options(4, 1)).unwrap();
    let mut s = gpu.new_state().unwrap();
    let err = gpu
        .prefill(&mut s, &[1, 2, 3, 4, 5], LogitsFor::Last)
        .unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
}

#[test]
fn memory_use_counts_the_backends_own_buffers() {
    let model = Model::load(&fixtures()[0]).unwrap();
    let c = &model.config;
    let context = 256;
    let attention = c
        .layer_kinds
        .iter()
        .filter(|k| **k == lily::config::LayerKind::FullAttention)
        .count();
    let deltanet = c.num_layers() - attention;
    // Keys and values in bf16 up to the context, each DeltaNet layer's conv inputs and
    // recurrent state in f32, and the penalty history's 32-bit word per vocabulary id; a slot's
    // position, token and sampling settings are a few bytes.
    let state = attention * 2 * context * c.num_key_value_heads * c.head_dim * 2
        + deltanet
            * 4
            * (c.linear_conv_kernel_dim * c.linear_conv_dim()
                + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)
        + 4 * c.vocab_size;
    let one = cuda(&model, 1);
    let three = cuda(&model, 3);
    let (m1, m3) = (one.memory_use().unwrap(), three.memory_use().unwrap());
    assert!(
        (state..state + 64).contains(&m1.sequences),
        "one slot holds {} bytes, its caches, states and history {state}",
        m1.sequences
    );
    assert_eq!(m1.sequences, CudaBackend::slot_bytes(c, context));
    assert_eq!(m3.sequences, 3 * m1.sequences);
    assert_eq!(m1.weights, m3.weights);
    assert!(m3.scratch > m1.scratch, "activations have a row per slot");
    // The driver's count covers every process and context on the device, ours among them.
    let in_use = three.device_memory_in_use().unwrap();
    assert!(
        m1.total() + m3.total() <= in_use,
        "{m1:?} {m3:?} of {in_use}"
    );
}

/// Spare slots (the prefix cache's) come beside the required ones while memory allows, and the
/// pool holds exactly that many states.
#[test]
fn spare_slots_add_to_the_pool_of_states() {
    let model = Model::load(&fixtures()[0]).unwrap();
    let opts = CudaOptions {
        spare_sequences: 2,
        ..options(64, 1)
    };
    let gpu = CudaBackend::new(&model, opts).unwrap();
    assert_eq!(gpu.max_states(), Some(3));
    let states: Vec<_> = (0..3).map(|_| gpu.new_state().unwrap()).collect();
    assert!(gpu.new_state().is_err());
    drop(states);
    assert!(gpu.new_state().is_ok());
    assert_eq!(
        gpu.memory_use().unwrap().sequences,
        3 * CudaBackend::slot_bytes(&model.config, 64)
    );
}

/// Host reference of the device draw: softmax(logits / T), then top-k, then top-p over what
/// top-k kept (the smallest most likely set reaching `top_p` of its mass), then min-p (tokens at
/// least `min_p` times as likely as the most likely), renormalised. `top_k` 0: no top-k.
fn filtered_probabilities(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| f64::from((l - max) / temperature).exp())
        .collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let total: f64 = order.iter().map(|&i| weights[i]).sum();
    let mut kept = Vec::new();
    let mut mass = 0.0;
    for &i in &order {
        kept.push(i);
        mass += weights[i];
        if mass >= f64::from(top_p) * total {
            break;
        }
    }
    kept.retain(|&i| weights[i] >= f64::from(min_p));
    let mass: f64 = kept.iter().map(|&i| weights[i]).sum();
    let mut probs = vec![0.0; logits.len()];
    for &i in &kept {
        probs[i] = weights[i] / mass;
    }
    probs
}

/// Total variation distance between the draws' frequencies (`counts`) and `expected`, over bins
/// of tokens in order of expected probability, each holding at least 5% of it (the last bin
/// takes what remains): a broad distribution's per-token frequencies are too noisy to compare
/// at a few thousand draws, its bins are not.
fn binned_distance(counts: &[usize], expected: &[f64]) -> f64 {
    let draws = counts.iter().sum::<usize>() as f64;
    let mut order: Vec<usize> = (0..expected.len()).filter(|&i| expected[i] > 0.0).collect();
    order.sort_by(|&a, &b| expected[b].total_cmp(&expected[a]));
    let (mut distance, mut bin_expected, mut bin_count) = (0.0, 0.0, 0usize);
    for (n, &i) in order.iter().enumerate() {
        bin_expected += expected[i];
        bin_count += counts[i];
        if bin_expected >= 0.05 || n + 1 == order.len() {
            distance += (bin_count as f64 / draws - bin_expected).abs();
            (bin_expected, bin_count) = (0.0, 0);
        }
    }
    distance / 2.0
}

/// How often each id came up in `draws` draws (`draw` of the seeds 0..draws), each checked to
/// be one the filters keep (`expected` above 0).
fn draw_counts(
    draws: u64,
    expected: &[f64],
    setting: &str,
    mut draw: impl FnMut(u64) -> usize,
) -> Vec<usize> {
    let mut counts = vec![0usize; expected.len()];
    for seed in 0..draws {
        let id = draw(seed);
        assert!(
            expected[id] > 0.0,
            "{setting}: drew token {id}, which the filters drop"
        );
        counts[id] += 1;
    }
    counts
}

/// The first fixture's first prompt prefilled up to its last token on the GPU, for the draws of
/// that token's decode step: `logits` are the step's, `sample` decodes it in a fork with a draw.
struct DrawProbe {
    gpu: CudaBackend,
    base: CudaState,
    last: u32,
    logits: Vec<f32>,
}

impl DrawProbe {
    fn new(model: &Model, sequences: usize) -> Self {
        let gpu = cuda(model, sequences);
        let prompt = &prompts(&fixtures()[0])[0];
        let (&last, head) = prompt.split_last().unwrap();
        let mut base = gpu.new_state().unwrap();
        gpu.prefill(&mut base, head, LogitsFor::Last).unwrap();
        let logits = {
            let mut probe = gpu.fork(&base).unwrap();
            gpu.decode(&mut [&mut probe], &[last]).unwrap()
        };
        Self {
            gpu,
            base,
            last,
            logits,
        }
    }

    /// The id the step draws with `d`.
    fn sample(&self, d: DeviceDraw) -> usize {
        let mut s = self.gpu.fork(&self.base).unwrap();
        self.gpu
            .decode_sample(&mut [&mut s], &[self.last], &[d])
            .unwrap()[0] as usize
    }
}

#[test]
fn device_draws_follow_the_filtered_distribution_and_repeat_with_their_seed() {
    let model = Model::load(&fixtures()[0]).unwrap();
    let vocab = model.config.vocab_size;
    let probe = DrawProbe::new(&model, 3);
    assert!(probe.gpu.samples_on_device());
    let logits = &probe.logits;
    let draw = |seed: u64, top_k: usize| DeviceDraw {
        temperature: 0.8,
        top_k,
        top_p: 0.9,
        min_p: 0.0,
        allowed: vocab,
        penalties: Penalties::NONE,
        greedy: false,
        seed,
    };
    let sample = |d: DeviceDraw| probe.sample(d);

    let expected = filtered_probabilities(logits, 0.8, 50, 0.9, 0.0);
    let draws = 8000;
    let setting = "temperature 0.8, top-k 50, top-p 0.9";
    let counts = draw_counts(draws, &expected, setting, |seed| sample(draw(seed, 50)));
    let distance: f64 = counts
        .iter()
        .zip(&expected)
        .map(|(&c, &p)| (c as f64 / draws as f64 - p).abs())
        .sum::<f64>()
        / 2.0;
    println!("total variation distance over {draws} draws: {distance:.4}");
    assert!(distance < 0.06, "total variation distance {distance}");

    assert_eq!(
        sample(draw(7, 50)),
        sample(draw(7, 50)),
        "same seed, same token"
    );
    assert_eq!(
        sample(draw(3, 1)),
        argmax(logits) as usize,
        "top-1 is the argmax"
    );
}

/// The device draw's other paths (sample.cu) against the host reference, on the same logits:
/// temperature alone (each scan block draws from its slice), top-p or min-p alone with a kept
/// set among the scan blocks' candidates, and kept sets reaching below some block's candidates
/// (the finishing block filters the whole row: top-k beyond the candidates, and broad top-p or
/// min-p sets at higher temperatures), and top-k with top-p cutting inside its set (the
/// survivors of a coarse top-k threshold ordered by one warp). Which path a setting takes
/// depends on the fixture's logits (1,024 tokens dealt to 4 scan blocks in runs of 8, at most
/// 63 candidates each; the settings below keep ~1,024, ~35, ~216, 300, ~640, ~460 and fewer
/// than 40 tokens); all must follow the distribution.
#[test]
fn device_draws_follow_the_distribution_on_every_path() {
    let model = Model::load(&fixtures()[0]).unwrap();
    let vocab = model.config.vocab_size;
    let probe = DrawProbe::new(&model, 3);
    let sample = |d: DeviceDraw| probe.sample(d);
    // (temperature, top-k, top-p, min-p).
    for (temperature, top_k, top_p, min_p) in [
        (1.0, 0, 1.0, 0.0),
        (2.0, 0, 0.5, 0.0),
        (2.0, 0, 1.0, 0.01),
        (2.0, 300, 1.0, 0.0),
        (3.0, 0, 0.95, 0.0),
        (4.0, 0, 1.0, 0.05),
        (2.0, 40, 0.7, 0.0),
    ] {
        let draw = |seed: u64| DeviceDraw {
            temperature,
            top_k,
            top_p,
            min_p,
            allowed: vocab,
            penalties: Penalties::NONE,
            greedy: false,
            seed,
        };
        let expected = filtered_probabilities(&probe.logits, temperature, top_k, top_p, min_p);
        let setting =
            format!("temperature {temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p}");
        let draws = 6000;
        let counts = draw_counts(draws, &expected, &setting, |seed| sample(draw(seed)));
        let kept = expected.iter().filter(|&&p| p > 0.0).count();
        let distance = binned_distance(&counts, &expected);
        println!("{setting}: {kept} tokens kept, binned distance over {draws} draws {distance:.4}");
        assert!(distance < 0.04, "{setting}: binned distance {distance}");
        assert_eq!(
            sample(draw(11)),
            sample(draw(11)),
            "{setting}: same seed, same token"
        );
    }
}

/// Total variation distance between two distributions.
fn distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / 2.0
}

/// Penalised draws on the device, over a history loaded from a host sampler's
/// (`load_penalty_history`), follow the distribution of the host sampler's penalised logits;
/// greedy decoding with penalties chooses the host sampler's ids step by step in a batch (the
/// histories found through the batch tables), each chosen id counted in its sequence's history
/// as it goes; and a frequency penalty of 1,000 keeps a sequence alone from repeating an id.
#[test]
fn device_draws_apply_the_penalties_of_the_history() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let vocab = model.config.vocab_size;
    // The probe's base, a fork per draw, and the seven sequences of the greedy runs below.
    let probe = DrawProbe::new(&model, 8);
    let gpu = &probe.gpu;
    assert!(gpu.penalises_on_device());

    // The four most likely ids in the prompt, the next six generated one to three times.
    let mut order: Vec<u32> = (0..vocab as u32).collect();
    order.sort_by(|&a, &b| probe.logits[b as usize].total_cmp(&probe.logits[a as usize]));
    let penalties = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 1.5,
        frequency_penalty: 0.4,
        ..SamplingParams::default()
    };
    let mut host = Sampler::new(penalties.clone(), &order[..4]).unwrap();
    for (n, &id) in order[2..8].iter().enumerate() {
        for _ in 0..=n % 3 {
            host.record(id);
        }
    }
    let history = host.penalty_history();
    // Greedy sampling leaves the penalised logits in its buffer.
    let mut penalised = probe.logits.clone();
    host.sample(&mut penalised).unwrap();
    let sample = |d: DeviceDraw| {
        let mut s = gpu.fork(&probe.base).unwrap();
        gpu.load_penalty_history(&mut s, &history).unwrap();
        gpu.decode_sample(&mut [&mut s], &[probe.last], &[d])
            .unwrap()[0] as usize
    };
    for (temperature, top_k, top_p) in [(1.0, 0, 1.0), (0.8, 0, 0.9), (1.5, 20, 1.0)] {
        let setting = format!("temperature {temperature}, top-k {top_k}, top-p {top_p}");
        let expected = filtered_probabilities(&penalised, temperature, top_k, top_p, 0.0);
        let unpenalised = filtered_probabilities(&probe.logits, temperature, top_k, top_p, 0.0);
        let moved = distance(&expected, &unpenalised);
        assert!(moved > 0.1, "{setting}: the penalties move only {moved}");
        let draw = |seed: u64| DeviceDraw {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            allowed: vocab,
            penalties: penalties.penalties(),
            greedy: false,
            seed,
        };
        let draws = 4000;
        let counts = draw_counts(draws, &expected, &setting, |seed| sample(draw(seed)));
        let binned = binned_distance(&counts, &expected);
        println!(
            "{setting}, penalised: binned distance over {draws} draws {binned:.4} (the \
             penalties moved the distribution by {moved:.3})"
        );
        assert!(binned < 0.04, "{setting}: binned distance {binned}");
    }

    // Greedy decoding with penalties, two sequences in a batch: one penalising what it has
    // seen, one favouring it.
    let prompt = &prompts(dir)[0];
    let settings = [
        SamplingParams {
            repetition_penalty: 1.2,
            presence_penalty: 1.5,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        },
        SamplingParams {
            repetition_penalty: 0.2,
            presence_penalty: -2.0,
            frequency_penalty: 0.7,
            ..SamplingParams::default()
        },
    ];
    let steps = 16;
    let start = [probe.last, probe.last];
    let (mut host_states, mut device_states, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2 {
        host_states.push(gpu.fork(&probe.base).unwrap());
        device_states.push(gpu.fork(&probe.base).unwrap());
    }
    plain.push(gpu.fork(&probe.base).unwrap());
    let mut host_samplers: Vec<Sampler> = settings
        .iter()
        .map(|p| Sampler::new(p.clone(), prompt).unwrap())
        .collect();
    let mut device_samplers: Vec<Sampler> = settings
        .iter()
        .map(|p| Sampler::new(p.clone(), prompt).unwrap())
        .collect();
    for (state, sampler) in device_states.iter_mut().zip(&device_samplers) {
        gpu.load_penalty_history(state, &sampler.penalty_history())
            .unwrap();
    }
    let (mut host_tokens, mut device_tokens, mut plain_token) = (start, start, probe.last);
    let (mut host_ids, mut device_ids, mut plain_ids) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..steps {
        let logits = gpu
            .decode(
                &mut host_states.iter_mut().collect::<Vec<_>>(),
                &host_tokens,
            )
            .unwrap();
        for (row, (sampler, token)) in host_samplers.iter_mut().zip(&mut host_tokens).enumerate() {
            *token = sampler
                .sample(&mut logits[row * vocab..(row + 1) * vocab].to_vec())
                .unwrap()
                .token_id;
        }
        let draws: Vec<DeviceDraw> = device_samplers
            .iter_mut()
            .map(|s| s.device_draw(vocab, true).unwrap())
            .collect();
        assert!(draws.iter().all(|d| d.greedy));
        let ids = gpu
            .decode_sample(
                &mut device_states.iter_mut().collect::<Vec<_>>(),
                &device_tokens,
                &draws,
            )
            .unwrap();
        device_tokens = [ids[0], ids[1]];
        plain_token = gpu
            .decode_greedy(&mut [&mut plain[0]], &[plain_token])
            .unwrap()[0];
        host_ids.push(host_tokens);
        device_ids.push(device_tokens);
        plain_ids.push(plain_token);
    }
    assert_eq!(device_ids, host_ids, "greedy decoding with penalties");
    let favoured: Vec<u32> = host_ids.iter().map(|ids| ids[1]).collect();
    assert_ne!(favoured, plain_ids, "the penalties change the ids");

    // No id twice under a frequency penalty of 1,000 (outside the API's range, not the
    // device's), one sequence alone.
    let mut state = gpu.fork(&probe.base).unwrap();
    gpu.load_penalty_history(&mut state, &Default::default())
        .unwrap();
    let mut token = probe.last;
    let mut seen = Vec::new();
    for _ in 0..steps {
        let d = DeviceDraw {
            top_k: 0,
            penalties: Penalties {
                frequency: 1000.0,
                ..Penalties::NONE
            },
            greedy: true,
            ..DeviceDraw::most_likely(vocab)
        };
        token = gpu
            .decode_sample(&mut [&mut state], &[token], &[d])
            .unwrap()[0];
        assert!(!seen.contains(&token), "{token} again after {seen:?}");
        seen.push(token);
    }
}

/// A mixed step (`decode_mixed`: rows drawn on the device beside rows whose logits the host
/// takes) returns the host rows' logits of a plain `decode` of the same batch and the drawn rows'
/// ids of `decode_sample`, and the next step takes the host's choice as its input for those rows
/// (not the device's placeholder draw): it continues bit for bit as the plain batch does.
#[test]
fn mixed_steps_draw_some_rows_and_return_the_others_logits() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let vocab = model.config.vocab_size;
    // Three prefilled sequences, three copies of each and one more fork.
    let gpu = cuda(&model, 13);
    let prompt = &prompts(dir)[0];
    let mut bases = Vec::new();
    for cut in [prompt.len() - 1, prompt.len() - 2, prompt.len() - 3] {
        let mut state = gpu.new_state().unwrap();
        gpu.prefill(&mut state, &prompt[..cut], LogitsFor::Last)
            .unwrap();
        bases.push((state, prompt[cut]));
    }
    let tokens: Vec<u32> = bases.iter().map(|(_, t)| *t).collect();
    let copies = || -> Vec<_> { bases.iter().map(|(s, _)| gpu.fork(s).unwrap()).collect() };
    let (mut plain, mut mixed, mut sampled) = (copies(), copies(), copies());
    drop(bases);
    let drawn = DeviceDraw {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        allowed: vocab,
        penalties: Penalties::NONE,
        greedy: false,
        seed: 5,
    };
    let top = DeviceDraw::most_likely(vocab);

    let logits = gpu
        .decode(&mut plain.iter_mut().collect::<Vec<_>>(), &tokens)
        .unwrap();
    let step = gpu
        .decode_mixed(
            &mut mixed.iter_mut().collect::<Vec<_>>(),
            &tokens,
            &[Some(drawn), None, Some(top)],
        )
        .unwrap();
    let ids = gpu
        .decode_sample(
            &mut sampled.iter_mut().collect::<Vec<_>>(),
            &tokens,
            &[drawn, top, top],
        )
        .unwrap();
    assert_eq!(step.drawn, [Some(ids[0]), None, Some(ids[2])]);
    assert_eq!(ids[2], argmax(&logits[2 * vocab..]));
    assert_eq!(
        step.logits,
        logits[vocab..2 * vocab],
        "the host row's logits"
    );

    // The host picks a token the device's top-1 placeholder did not.
    let host_choice = (argmax(&step.logits) + 1) % vocab as u32;
    let next = [ids[0], host_choice, ids[2]];
    let after_plain = gpu
        .decode(&mut plain.iter_mut().collect::<Vec<_>>(), &next)
        .unwrap();
    let after_mixed = gpu
        .decode(&mut mixed.iter_mut().collect::<Vec<_>>(), &next)
        .unwrap();
    assert_eq!(after_mixed, after_plain);

    // One row alone, left to the host: the plain step's logits.
    let mut one = plain.pop().unwrap();
    let mut again = gpu.fork(&one).unwrap();
    let alone = gpu.decode(&mut [&mut one], &[3]).unwrap();
    let step = gpu.decode_mixed(&mut [&mut again], &[3], &[None]).unwrap();
    assert_eq!((step.drawn, step.logits), (vec![None], alone));
}

/// The prefill path's tensor-core product (4- and 8-bit weights dequantised in registers, inputs
/// in fp16; dense weights in bf16, converted to fp16 in registers) against an f64 product of the
/// same weights: every quantised matrix of the fixture (the routers stay 8-bit in a 4-bit
/// conversion) at three group sizes and both widths, and of the wide random model (see
/// `wide_random_checkpoint`: k up to 1,536, many k steps), and every dense matrix of the fixtures
/// and of the wide model, times a token count that leaves the last block partly empty, whole and
/// split along k.
#[test]
fn tensor_core_matmul_matches_the_dequantised_product() {
    let tmp = tempfile::tempdir().unwrap();
    let wide = wide_random_checkpoint(&tmp.path().join("wide"));
    let mut failures = Vec::new();
    for (bits, group_size) in [(4, 32), (4, 64), (4, 128), (8, 64), (8, 32)] {
        let out = quantized_fixture(
            &tmp.path().join(format!("q{bits}-{group_size}")),
            bits,
            group_size,
        );
        failures.extend(tensor_core_errors(
            &out,
            &format!("fixture {bits}-bit group {group_size}"),
        ));
    }
    for (bits, group_size) in [(4, 64), (8, 64), (8, 32)] {
        let out = tmp.path().join(format!("wide-q{bits}-{group_size}"));
        convert_to(&wide, &out, bits, group_size);
        failures.extend(tensor_core_errors(
            &out,
            &format!("wide {bits}-bit group {group_size}"),
        ));
    }
    for dir in fixtures().iter().chain([&wide]) {
        failures.extend(tensor_core_errors(dir, &format!("{} dense", dir.display())));
    }
    assert!(failures.is_empty(), "above 5e-3:\n{}", failures.join("\n"));
}

/// The tensor-core product's relative error on every matrix of the checkpoint in `dir` that it
/// takes (4- or 8-bit, or dense, which the GPU holds in bf16), as messages for those above 5e-3.
fn tensor_core_errors(dir: &Path, label: &str) -> Vec<String> {
    let model = Model::load(dir).unwrap();
    let gpu = cuda(&model, 1);
    let tokens = 77;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (mut checked, mut failures, mut worst) = (0, Vec::new(), 0.0f32);
    for w in model.matrices() {
        let dense_weights = matches!(&w.storage, Storage::Dense { .. });
        if !dense_weights
            && !matches!(&w.storage, Storage::Quantized(q) if q.spec.bits == 4 || q.spec.bits == 8)
        {
            continue;
        }
        let x: Vec<f32> = (0..tokens * w.cols)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect();
        let mut dense = vec![0.0f32; w.rows * w.cols];
        w.rows_to_f32(0, &mut dense);
        if dense_weights {
            dense
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        let want: Vec<f32> = (0..tokens)
            .flat_map(|t| {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                dense.chunks_exact(w.cols).map(move |row| {
                    row.iter()
                        .zip(xt)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>() as f32
                })
            })
            .collect();
        // One split, and three (the router's split product; with few k steps some splits get
        // none and must write zeros).
        for splits in [1, 3] {
            let got = gpu.matmul_q(w, &x, tokens, splits).unwrap();
            let err = relative_error(&got, &want);
            worst = worst.max(err);
            // fp16 inputs and weights (scale * q + bias in fp16) round at 2^-11.
            if err >= 5e-3 {
                failures.push(format!(
                    "{label}, {}x{}, {splits} splits: relative error {err:.2e}",
                    w.rows, w.cols
                ));
            }
        }
        checked += 1;
    }
    println!("{label}: {checked} matrices, worst relative error {worst:.2e}");
    assert!(
        checked > 0,
        "{label}: the checkpoint has matrices to multiply"
    );
    failures
}

/// The decode mat-vec of every quantised matrix against the f64 product of its dequantised
/// weights, for checkpoints whose scales and biases are fp16 (made from an fp16 model) and bf16:
/// the GPU keeps either exactly. The integer dot rounds each x at 2^-16 of its chunk's largest
/// magnitude, so its error is about 1e-5 of the products' magnitude (a row's sum of |w x|, which
/// the error is measured against: the output of a one-row matrix can cancel far below it);
/// fp16 scales rounded to bf16 on the way would put it near 1e-3.
#[test]
fn decode_mat_vec_keeps_fp16_and_bf16_scales_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for dtype in ["float16", "bfloat16"] {
        let source = random_checkpoint_of(&tmp.path().join(dtype), &[], dtype);
        for (bits, group_size) in [(4, 64), (8, 32)] {
            let out = tmp.path().join(format!("{dtype}-q{bits}-g{group_size}"));
            convert_to(&source, &out, bits, group_size);
            let model = Model::load(&out).unwrap();
            let gpu = cuda(&model, 1);
            let mut seed = 0x2545_F491_4F6C_DD1Du64;
            let (mut checked, mut worst) = (0, 0.0f32);
            for w in model.matrices() {
                let Storage::Quantized(q) = &w.storage else {
                    continue;
                };
                let stored = if dtype == "float16" {
                    DType::F16
                } else {
                    DType::BF16
                };
                assert_eq!(q.scale_dtype, stored, "scales as {dtype} models store them");
                let x: Vec<f32> = (0..w.cols)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                    })
                    .collect();
                let mut dense = vec![0.0f32; w.rows * w.cols];
                w.rows_to_f32(0, &mut dense);
                let want: Vec<f32> = dense
                    .chunks_exact(w.cols)
                    .map(|row| {
                        row.iter()
                            .zip(&x)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>() as f32
                    })
                    .collect();
                let magnitude = dense
                    .chunks_exact(w.cols)
                    .map(|row| row.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum::<f32>())
                    .fold(0.0, f32::max);
                let got = gpu.mat_vec(w, &x).unwrap();
                let diff = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                let err = diff / magnitude;
                worst = worst.max(err);
                checked += 1;
            }
            println!(
                "{dtype} scales, {bits}-bit g{group_size}: {checked} matrices, worst error {worst:.2e} of the products' magnitude"
            );
            assert!(checked > 0, "the checkpoint has quantised matrices");
            if worst > 5e-5 {
                failures.push(format!("{dtype} {bits}-bit g{group_size}: {worst:.2e}"));
            }
        }
    }
    assert!(failures.is_empty(), "above 5e-5: {failures:?}");
}

/// A prompt longer than a prefill chunk (2,500 tokens: three chunks of up to 1,024, the last
/// partial) against the CPU: the last position's logits, then greedy decode steps continuing
/// from the state prefill left (DeltaNet state and conv history, KV cache, position), in bf16
/// and in 4- and 8-bit (whose projections and experts take the tensor-core products).
#[test]
fn long_prefill_in_chunks_matches_the_cpu_and_hands_its_state_to_decode() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = vec![fixtures()[0].clone()];
    for bits in [4, 8] {
        dirs.push(quantized_fixture(
            &tmp.path().join(format!("q{bits}")),
            bits,
            64,
        ));
    }
    for dir in dirs {
        let model = Arc::new(Model::load(&dir).unwrap());
        let vocab = model.config.vocab_size as u64;
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let prompt: Vec<u32> = (0..2500)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % vocab) as u32
            })
            .collect();
        let gpu = CudaBackend::new(
            &model,
            CudaOptions {
                prefill_chunk: 1024,
                ..options(4096, 1)
            },
        )
        .unwrap();
        let label = dir.display().to_string();
        prefill_then_decode_against_cpu(&model, &gpu, &prompt, LogitsFor::Last, 8, &label);
    }
}

/// A prefill chunk of a single token (a one-token prompt, or a prompt one token longer than
/// whole chunks) leaves its conv input in the ring like any other: decode after it matches the
/// CPU (it once read zeros there instead).
#[test]
fn single_token_prefill_chunks_hand_their_conv_inputs_to_decode() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in bf16_and_q4_fixtures(tmp.path()) {
        let model = Arc::new(Model::load(&dir).unwrap());
        let vocab = model.config.vocab_size as u32;
        let gpu = CudaBackend::new(
            &model,
            CudaOptions {
                prefill_chunk: 8,
                ..options(64, 1)
            },
        )
        .unwrap();
        for len in [1, 17] {
            let prompt: Vec<u32> = (0..len).map(|i| (i * 31 + 7) % vocab).collect();
            let label = format!("{}, {len}-token prompt in chunks of 8", dir.display());
            prefill_then_decode_against_cpu(&model, &gpu, &prompt, LogitsFor::Last, 4, &label);
        }
    }
}

/// Decode with the router's own launch (`CudaOptions::fold_router` off, as a layer whose fold
/// does not fit in shared memory decodes), one sequence and a batch, on bf16 and 4-bit weights:
/// the router folded into the mixer's output projection is what every other decode test runs.
#[test]
fn unfolded_router_decodes_like_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in bf16_and_q4_fixtures(tmp.path()) {
        let model = Arc::new(Model::load(&dir).unwrap());
        let vocab = model.config.vocab_size as u32;
        let gpu = CudaBackend::new(
            &model,
            CudaOptions {
                fold_router: false,
                ..options(128, 4)
            },
        )
        .unwrap();
        let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % vocab).collect();
        let label = format!("{}, router unfolded", dir.display());
        prefill_then_decode_against_cpu(&model, &gpu, &prompt, LogitsFor::Last, 4, &label);
        // A batch of two: the batched kernels' router path, against each sequence decoded alone.
        let (mut a, mut b) = (gpu.new_state().unwrap(), gpu.new_state().unwrap());
        let next = argmax(&gpu.prefill(&mut a, &prompt, LogitsFor::Last).unwrap());
        gpu.prefill(&mut b, &prompt, LogitsFor::Last).unwrap();
        let mut alone = gpu.fork(&a).unwrap();
        let batch = gpu.decode(&mut [&mut a, &mut b], &[next, next]).unwrap();
        let want = gpu.decode(&mut [&mut alone], &[next]).unwrap();
        let vocab = vocab as usize;
        for row in 0..2 {
            let err = relative_error(&batch[row * vocab..(row + 1) * vocab], &want);
            assert!(
                err < 1e-3,
                "{label}: batch row {row} differs from the sequence alone by {err}"
            );
        }
    }
}

/// A row whose routing on the CPU is this close to a tie (`CpuBackend::routing_margins`) may
/// route to another expert on the GPU, whose rounding differs: that moves the row's logits by
/// 3-9% on these models, a jump no float tolerance covers, and the next few rows by up to ~2%
/// (through the DeltaNet convolution's window; swapping the two experts of such a row in
/// MLX-LM, top1-tied: row 44 moved 2.3e-2 after a flip at row 42, rows 26-29 up to 6e-3 after
/// one at row 25). Such rows and the `linear_conv_kernel_dim` rows after each are left out of the
/// calibration spread and excused where they exceed the tolerance. Found by the layouts test:
/// on f32 weights of wide-value-heads row 17 of 70 differed by 3.1e-2 on both paths, its margin
/// 2.5e-3 at the third MoE layer, every other row by at most 2.8e-3.
const NEAR_TIE: f32 = 1e-2;

/// How `got` compares with `want` row by row (`vocab` logits each, differences over the largest
/// |logit| of `want`), the rows being the last of `margins` (the routing margin of every row
/// the sequence has had so far): the largest difference among the rows not excused, the
/// calibration spread (`spread_logits`' largest difference over the rows not in a near tie's
/// shadow, a near-tie row and the `reach` rows after it, or over all rows where every one is),
/// and how many rows were excused: those in a shadow beyond SPREADS spreads.
struct RowComparison {
    error: f32,
    spread: f32,
    excused: usize,
}

fn compare_rows(
    got: &[f32],
    want: &[f32],
    spread_logits: &[f32],
    vocab: usize,
    margins: &[f32],
    reach: usize,
) -> RowComparison {
    assert_eq!(got.len(), want.len());
    assert_eq!(spread_logits.len(), want.len());
    let rows = want.len() / vocab;
    assert!(rows * vocab == want.len() && rows <= margins.len());
    let first = margins.len() - rows;
    let shadowed = |r: usize| {
        let at = first + r;
        margins[at.saturating_sub(reach)..=at]
            .iter()
            .any(|&m| m < NEAR_TIE)
    };
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let row_error = |a: &[f32], r: usize| {
        let b = &want[r * vocab..(r + 1) * vocab];
        let a = &a[r * vocab..(r + 1) * vocab];
        a.iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    };
    let clear: Vec<usize> = (0..rows).filter(|&r| !shadowed(r)).collect();
    let calibration = if clear.is_empty() {
        (0..rows).collect()
    } else {
        clear
    };
    let spread = calibration
        .iter()
        .map(|&r| row_error(spread_logits, r))
        .fold(0.0, f32::max);
    let (mut error, mut excused) = (0.0f32, 0);
    for r in 0..rows {
        let e = row_error(got, r);
        if e > SPREADS * spread && shadowed(r) {
            excused += 1;
        } else {
            error = error.max(e);
        }
    }
    RowComparison {
        error,
        spread,
        excused,
    }
}

/// `compare_rows` excuses a row beyond the tolerance only in a near tie's shadow (the tie and the
/// `reach` rows after it), and calibrates on the other rows alone.
#[test]
fn row_comparison_excuses_only_near_ties_beyond_the_tolerance() {
    let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
    // Five rows of two logits after one earlier row (the prompt's, say), whose margin is decisive;
    // row 2 is a near tie, and with a reach of 1 its shadow is rows 2 and 3.
    let margins = [0.5, 0.5, 0.5, 1e-3, 0.5, 0.5];
    let want = [2.0, 0.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.0];
    // The bf16 run differs by 0.02 (1% of the largest logit) on row 0, flips row 2, and moves
    // row 3 by more.
    let spread_logits = [2.02, 0.0, 0.0, 2.0, 0.0, 2.0, 1.1, 1.0, 2.0, 0.0];
    let c = compare_rows(&want, &want, &spread_logits, 2, &margins, 1);
    assert!(c.error == 0.0 && close(c.spread, 0.01) && c.excused == 0);
    // Jumps in the shadow are excused; within the tolerance they still count.
    let got = [2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 1.2, 1.0, 2.0, 0.0];
    let c = compare_rows(&got, &want, &spread_logits, 2, &margins, 1);
    assert!(c.error == 0.0 && c.excused == 2);
    let got = [2.0, 0.0, 0.0, 2.0, 1.02, 1.0, 1.0, 1.0, 2.0, 0.0];
    let c = compare_rows(&got, &want, &spread_logits, 2, &margins, 1);
    assert!(close(c.error, 0.01) && c.excused == 0);
    // The same jump past the shadow, or before the tie, is not.
    for row in [0, 1, 4] {
        let mut got = want;
        got[2 * row] += 1.0;
        let c = compare_rows(&got, &want, &spread_logits, 2, &margins, 1);
        assert!(close(c.error, 0.5) && c.excused == 0, "row {row}");
    }
    // A step of one row whose shadow is cast by an earlier step's tie.
    let c = compare_rows(&[2.0, 0.0], &[1.0, 1.0], &[1.0, 1.0], 2, &margins[..5], 1);
    assert!(c.error == 0.0 && c.excused == 1);
}

/// Prefills `prompt` (logits for `which`) on the GPU and on the CPU, then takes `steps` greedy
/// decode steps from the states prefill left; at every stage the GPU's logits must stay within
/// SPREADS calibrated bf16 spreads of the CPU's (`compare_rows`: rows whose routing is a near tie
/// are excused).
fn prefill_then_decode_against_cpu(
    model: &Arc<Model>,
    gpu: &CudaBackend,
    prompt: &[u32],
    which: LogitsFor,
    steps: usize,
    label: &str,
) {
    let cpu = CpuBackend::new(model.clone());
    let cpu_bf16 = CpuBackend::with_bf16_activations(model.clone());
    let vocab = model.config.vocab_size;
    let (mut c, mut c16, mut g) = (
        cpu.new_state().unwrap(),
        cpu_bf16.new_state().unwrap(),
        gpu.new_state().unwrap(),
    );
    let mut want = cpu.prefill(&mut c, prompt, which).unwrap();
    let mut spread_logits = cpu_bf16.prefill(&mut c16, prompt, which).unwrap();
    let mut got = gpu.prefill(&mut g, prompt, which).unwrap();
    // Every row's routing margin so far, prompt and decoded tokens.
    let mut margins = cpu.routing_margins();
    let reach = model.config.linear_conv_kernel_dim;
    for step in 0..steps {
        let RowComparison {
            error,
            spread,
            excused,
        } = compare_rows(&got, &want, &spread_logits, vocab, &margins, reach);
        println!(
            "{label}: step {step}: GPU error {error:.2e}, bf16 spread {spread:.2e}, {excused} of {} \
             rows excused near routing ties",
            want.len() / vocab
        );
        assert!(
            error <= SPREADS * spread,
            "{label}: step {step}: error {error} above {SPREADS} x spread {spread}"
        );
        let next = argmax(&want[want.len() - vocab..]);
        want = cpu.decode(&mut [&mut c], &[next]).unwrap();
        margins.extend(cpu.routing_margins());
        spread_logits = cpu_bf16.decode(&mut [&mut c16], &[next]).unwrap();
        got = gpu.decode(&mut [&mut g], &[next]).unwrap();
    }
}

/// The demo config with `fields` set.
fn demo_config_with(fields: &[(&str, usize)]) -> serde_json::Value {
    let mut config = demo_config_json();
    for (name, value) in fields {
        config[*name] = (*value).into();
    }
    config
}

/// The demo config with `fields` set, on random weights: the logits of a prompt of `tokens` ids
/// (i * stride + offset, wrapped to the vocabulary) at every position, then 4 greedy decode
/// steps, against the CPU (see prefill_then_decode_against_cpu).
fn random_shape_matches_the_cpu(
    fields: &[(&str, usize)],
    tokens: u32,
    stride: u32,
    offset: u32,
    label: &str,
) {
    config_matches_the_cpu(&demo_config_with(fields), tokens, stride, offset, label);
}

/// `random_model`'s weights rounded to bf16, as real checkpoints store them: the GPU holds f32
/// weights in bf16, so on f32 weights it differs from the CPU by that rounding (1.5-2.8e-3 of
/// the largest logit on the layouts test's models, ten times what it does on bf16 weights), and
/// routes more rows differently.
fn bf16_random_model(config: ModelConfig) -> Model {
    let bytes = random_safetensors_in(&config, DType::BF16).unwrap();
    let checkpoint = lily::checkpoint::Checkpoint::from_memory("bf16 random", &bytes).unwrap();
    Model::from_checkpoint(config, &checkpoint).unwrap()
}

/// As `random_shape_matches_the_cpu`, for the whole `config.json` given.
fn config_matches_the_cpu(
    config: &serde_json::Value,
    tokens: u32,
    stride: u32,
    offset: u32,
    label: &str,
) {
    let config = ModelConfig::from_json_str(&config.to_string()).unwrap();
    let model = Arc::new(bf16_random_model(config));
    let gpu = cuda(&model, 1);
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..tokens).map(|i| (i * stride + offset) % vocab).collect();
    prefill_then_decode_against_cpu(&model, &gpu, &prompt, LogitsFor::All, 4, label);
}

/// DeltaNet heads the chunkwise kernels do not take (key_dim 16, value_dim 24: not whole 16-wide
/// tiles) run their prefill recurrence in `deltanet_scan` and decode in `deltanet_step` split
/// over two-block clusters: a 100-token prompt's logits at every position, then greedy decode,
/// against the CPU on random weights of that shape.
#[test]
fn deltanet_heads_outside_the_chunkwise_kernels_match_the_cpu() {
    let fields = [("linear_key_head_dim", 16), ("linear_value_head_dim", 24)];
    random_shape_matches_the_cpu(&fields, 100, 37, 11, "key_dim 16, value_dim 24");
}

/// Routing on the GPU when the last run of 32 experts holds fewer experts than top_k (36 experts,
/// top-8: the second run has 4): a 60-token prompt's logits at every position, then greedy
/// decode, against the CPU on random weights of that shape.
#[test]
fn routing_with_a_short_last_run_of_experts_matches_the_cpu() {
    let fields = [("num_experts", 36), ("num_experts_per_tok", 8)];
    random_shape_matches_the_cpu(&fields, 60, 53, 7, "36 experts, top-8");
}

/// More experts than a routing block has threads (600, top-10, against the 256 threads of
/// `moe_route` and of a bf16 `moe_gate_up`, the 512 of a 4-bit one), so that `rank_experts` gives
/// each thread several keys and ends on a short run of 24: prefill and decode against the CPU in
/// bf16 and at 4 bits, then a batched decode of two sequences (`moe_route`) bit for bit as each
/// decoded alone.
#[test]
fn routing_over_more_experts_than_a_block_has_threads_matches_the_cpu() {
    let fields = [("num_experts", 600), ("num_experts_per_tok", 10)];
    random_shape_matches_the_cpu(&fields, 40, 31, 5, "600 experts, top-10");
    let tmp = tempfile::tempdir().unwrap();
    let source = random_checkpoint(&tmp.path().join("f32"), &fields);
    quantized_decode_against_cpu(&source, &[(4, 64)], "600 experts, top-10");

    let config = ModelConfig::from_json_str(&demo_config_with(&fields).to_string()).unwrap();
    let model = bf16_random_model(config);
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = [3, 11]
        .iter()
        .map(|offset| (0..20).map(|i| (i * 17 + offset) % vocab as u32).collect())
        .collect();
    batch_decodes_as_each_alone(&cuda(&model, 4), vocab, &prompts, 3, "600 experts");
}

/// The proportions of the family's larger sibling (Qwen3.5-397B-A17B: 4 DeltaNet value heads
/// per key head, 16 query heads per KV head, top-10 of 512 experts) rather than the 35B's 2, 8
/// and top-8 of 256, scaled down: value heads sharing a key head four ways in the step, two
/// tiles of 8 query heads per KV head in the decode attention, and 10 routed slots ranked from
/// runs of 32 experts. A 70-token prompt's logits at every position, then greedy decode, against
/// the CPU on random weights of that shape.
#[test]
fn the_larger_siblings_proportions_match_the_cpu() {
    let fields = [
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 8),
        ("num_attention_heads", 32),
        ("num_key_value_heads", 2),
        ("num_experts", 64),
        ("num_experts_per_tok", 10),
    ];
    random_shape_matches_the_cpu(
        &fields,
        70,
        41,
        3,
        "value heads 4x key heads, 16 query heads per KV head, top-10 of 64",
    );
}

/// Layouts of the architecture other than the 35B's, from tests/data/layouts/ (whose modules CI
/// compiles with `lily kernels --check --config`): DeltaNet-only and attention-only models, a
/// value head per key head and four, key and value head dims that differ either way, 2- and
/// 3-tap convolutions, head_dim 64 and 128 with half and full rotary, one query head per KV
/// head, top-1 of 4 experts with a shared expert twice their width, a hidden size of 192 and
/// tied embeddings. A 70-token prompt (more than one 64-token DeltaNet chunk) at every position,
/// then greedy decode, against the CPU on random weights of each. `LILY_LAYOUTS=DIR` runs the
/// layouts of another folder instead (to narrow a failure down on the GPU machine).
#[test]
fn other_layouts_of_the_architecture_match_the_cpu() {
    let dir = std::env::var_os("LILY_LAYOUTS").map_or_else(
        // Relative to the repository root, as `fixtures()`: a test binary built in another
        // checkout (a git worktree) still finds them where it runs.
        || PathBuf::from("tests/data/layouts"),
        PathBuf::from,
    );
    let mut layouts: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    layouts.sort();
    assert!(layouts.len() >= 4, "{layouts:?}");
    // Every layout runs, so that one failure does not hide whether the others pass.
    let failed: Vec<String> = layouts
        .iter()
        .filter_map(|path| {
            let config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            let label = path.file_stem().unwrap().to_string_lossy().into_owned();
            let run = || config_matches_the_cpu(&config, 70, 29, 5, &label);
            std::panic::catch_unwind(run).is_err().then_some(label)
        })
        .collect();
    assert!(failed.is_empty(), "layouts off the CPU: {failed:?}");
}

/// The demo config with `fields` set, bf16 (converted to bf16 scales and biases, as real
/// checkpoints are), on random weights: an f32 checkpoint directory `lily convert` takes.
fn random_checkpoint(dir: &Path, fields: &[(&str, usize)]) -> PathBuf {
    random_checkpoint_of(dir, fields, "bfloat16")
}

/// As `random_checkpoint`, its `torch_dtype` (what `lily convert` casts scales and biases to)
/// set to `dtype`.
fn random_checkpoint_of(dir: &Path, fields: &[(&str, usize)], dtype: &str) -> PathBuf {
    let mut config = demo_config_with(fields);
    config["torch_dtype"] = dtype.into();
    let parsed = ModelConfig::from_json_str(&config.to_string()).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        random_safetensors(&parsed).unwrap(),
    )
    .unwrap();
    dir.to_path_buf()
}

/// The demo config widened (hidden 1,536; 48 DeltaNet value heads: out_proj 1,536 inputs too;
/// so the down projections have 1,536 rows of 64 inputs, and every product many k steps).
fn wide_random_checkpoint(dir: &Path) -> PathBuf {
    random_checkpoint(
        dir,
        &[("hidden_size", 1536), ("linear_num_value_heads", 48)],
    )
}

/// `bits`-bit conversions of `source` with each group size, a 24-token prompt prefilled and 6
/// greedy decode steps against the CPU running the same quantised checkpoint.
fn quantized_decode_against_cpu(source: &Path, formats: &[(u32, usize)], label: &str) {
    for &(bits, group_size) in formats {
        let out = source.with_file_name(format!("q{bits}-g{group_size}"));
        convert_to(source, &out, bits, group_size);
        let model = Arc::new(Model::load(&out).unwrap());
        let gpu = cuda(&model, 1);
        let vocab = model.config.vocab_size as u32;
        let prompt: Vec<u32> = (0..24).map(|i| (i * 29 + 5) % vocab).collect();
        let label = format!("{label}, {bits}-bit, group {group_size}");
        prefill_then_decode_against_cpu(&model, &gpu, &prompt, LogitsFor::Last, 6, &label);
    }
}

fn convert_to(source: &Path, out: &Path, bits: u32, group_size: usize) {
    let options = ConvertOptions {
        spec: QuantSpec::new(bits, group_size).unwrap(),
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        progress: false,
    };
    convert(source, out, &options).unwrap();
}

/// Prefill and decode of the wide random model (`wide_random_checkpoint`) quantised at both
/// widths and three group sizes against the CPU.
#[test]
fn wide_quantized_rows_decode_like_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let source = wide_random_checkpoint(&tmp.path().join("f32"));
    let formats = [(4, 64), (8, 64), (8, 32), (4, 128)];
    quantized_decode_against_cpu(&source, &formats, "hidden 1536");
}

/// Experts of 512 intermediates, as the real model's (moe_gate_up's 16 row blocks per slot at 4 bits,
/// moe_down's gathered rows of 8 groups per expert at 4-bit g64): prefill and decode against the
/// CPU, 4- and 8-bit at three group sizes.
#[test]
fn experts_of_512_decode_like_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let fields = [
        ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512),
    ];
    let source = random_checkpoint(&tmp.path().join("f32"), &fields);
    let formats = [(4, 64), (8, 32), (8, 64), (4, 128)];
    quantized_decode_against_cpu(&source, &formats, "experts of 512");
}

/// Decode attention (`attention_split` on tensor cores, then `attention_combine`) against an f64
/// softmax over the same bf16 cache, at query groups that fill part of one block's 8 heads, all
/// of them, and two blocks (the second partly), head dims 32 to 256, and contexts and split counts
/// that give one position, partial warp tiles, several tiles per warp, splits past the context
/// and the most splits. Queries are scaled up so that the softmax is peaked: a position lost or
/// misplaced shows.
#[test]
fn decode_attention_matches_an_f64_softmax_over_the_cache() {
    for (heads, kv_heads, head_dim) in [(4, 2, 32), (8, 1, 64), (16, 2, 256), (20, 2, 128)] {
        let mut config = demo_config_json();
        config["num_attention_heads"] = heads.into();
        config["num_key_value_heads"] = kv_heads.into();
        config["head_dim"] = head_dim.into();
        let config = ModelConfig::from_json_str(&config.to_string()).unwrap();
        let model = random_model(config).unwrap();
        let gpu = cuda(&model, 1);
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut uniform = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // The last three: a token's share of the splits of a batch whose contexts sum to the
        // third number (8 splits of 256 positions; 8 of 128; one).
        for (positions, splits, batch) in [
            (1, 256, None),
            (37, 1, None),
            (300, 256, None),
            (1000, 3, None),
            (2000, 256, None),
            (2000, 256, Some(40_000)),
            (1000, 66, Some(4_100)),
            (37, 66, Some(131_000)),
        ] {
            let row = kv_heads * head_dim;
            let q: Vec<f32> = (0..heads * head_dim).map(|_| uniform() * 4.0).collect();
            let gate: Vec<f32> = (0..heads * head_dim).map(|_| uniform() * 3.0).collect();
            let bf16 = |v: f32| half::bf16::from_f32(v);
            let keys: Vec<half::bf16> = (0..positions * row).map(|_| bf16(uniform())).collect();
            let values: Vec<half::bf16> = (0..positions * row).map(|_| bf16(uniform())).collect();
            let bits = |v: &[half::bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
            let got = gpu
                .attention_over_cache(&q, &bits(&keys), &bits(&values), &gate, splits, batch)
                .unwrap();
            let group = heads / kv_heads;
            let scale = 1.0 / (head_dim as f64).sqrt();
            let mut want = vec![0.0f32; heads * head_dim];
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q[h * head_dim..(h + 1) * head_dim];
                let at = |p: usize| p * row + kvh * head_dim;
                let scores: Vec<f64> = (0..positions)
                    .map(|p| {
                        let k = &keys[at(p)..at(p) + head_dim];
                        qh.iter()
                            .zip(k)
                            .map(|(&a, b)| a as f64 * b.to_f64())
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for i in 0..head_dim {
                    let o: f64 = (0..positions)
                        .map(|p| weights[p] * values[at(p) + i].to_f64())
                        .sum::<f64>()
                        / total;
                    let g = gate[h * head_dim + i] as f64;
                    want[h * head_dim + i] = (o / (1.0 + (-g).exp())) as f32;
                }
            }
            let err = relative_error(&got, &want);
            // Queries and probabilities round to bf16 on the tensor cores (2^-9 relative).
            assert!(
                err < 1e-2,
                "{heads} heads over {kv_heads} KV heads of {head_dim}, {positions} positions, \
                 {splits} splits, batch context {batch:?}: relative error {err:.2e}"
            );
            println!(
                "attention {heads}/{kv_heads} heads of {head_dim}, {positions} positions, \
                 {splits} splits, batch context {batch:?}: relative error {err:.2e}"
            );
        }
    }
}

/// What one sequence produces on its own from `prompt`: its greedy ids, the logits of each
/// step, and the ids sampled with `seed` from the same start.
struct AloneRun {
    greedy: Vec<u32>,
    logits: Vec<Vec<f32>>,
    sampled: Vec<u32>,
}

/// The entries of `states` at the indices `members` lists.
fn members_of<'a, T>(states: &'a mut [T], members: &[usize]) -> Vec<&'a mut T> {
    states
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| members.contains(i))
        .map(|(_, s)| s)
        .collect()
}

fn sample_draw(seed: u64, vocab: usize) -> DeviceDraw {
    DeviceDraw {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        allowed: vocab,
        penalties: Penalties::NONE,
        greedy: false,
        seed,
    }
}

fn alone(gpu: &CudaBackend, prompt: &[u32], steps: usize, seed: u64) -> AloneRun {
    let vocab = gpu.config().vocab_size;
    let mut greedy_state = gpu.new_state().unwrap();
    let first = argmax(
        &gpu.prefill(&mut greedy_state, prompt, LogitsFor::Last)
            .unwrap(),
    );
    let mut logits_state = gpu.fork(&greedy_state).unwrap();
    let mut sampled_state = gpu.fork(&greedy_state).unwrap();
    let mut run = AloneRun {
        greedy: vec![first],
        logits: Vec::new(),
        sampled: vec![first],
    };
    for step in 0..steps {
        let last = *run.greedy.last().unwrap();
        run.greedy.push(
            gpu.decode_greedy(&mut [&mut greedy_state], &[last])
                .unwrap()[0],
        );
        run.logits
            .push(gpu.decode(&mut [&mut logits_state], &[last]).unwrap());
        let last = *run.sampled.last().unwrap();
        let draw = sample_draw(seed + step as u64, vocab);
        run.sampled.push(
            gpu.decode_sample(&mut [&mut sampled_state], &[last], &[draw])
                .unwrap()[0],
        );
    }
    run
}

/// Prompts of different lengths (so different positions and contexts): the fixture's, a single
/// token, and generated ones, `count` in all.
fn batch_prompts(dir: &Path, vocab: u32, count: usize) -> Vec<Vec<u32>> {
    let mut all = prompts(dir);
    all.push(vec![3]);
    for n in 0.. {
        if all.len() >= count {
            break;
        }
        all.push((0..5 + 13 * n).map(|i| (i * 37 + 11 * n) % vocab).collect());
    }
    all.truncate(count);
    all
}

/// A batched decode step (a token of each of several sequences in one pass) computes for every
/// sequence exactly what its own step computes while it runs the decode kernels: the same greedy
/// ids, bit-identical logits and the same sampled ids, with prompts of different lengths, in
/// batches whose members change (a sequence leaving mid-way, so the batch tables are rewritten
/// and another batch size's graph is captured), on bf16 weights (quantised ones take a tensor-core
/// product in batches: `quantized_batches_decode_like_the_cpu`).
#[test]
fn batched_decode_matches_each_sequence_decoded_alone() {
    let dir = &fixtures()[0];
    let model = Model::load(dir).unwrap();
    let vocab = model.config.vocab_size as u32;
    let batch_prompts = batch_prompts(dir, vocab, 10);
    let gpu = cuda(&model, 3 * batch_prompts.len());
    let steps = 10;
    let runs: Vec<AloneRun> = batch_prompts
        .iter()
        .enumerate()
        .map(|(i, p)| alone(&gpu, p, steps, 1000 * i as u64))
        .collect();

    let mut greedy = Vec::new();
    for p in &batch_prompts {
        let mut s = gpu.new_state().unwrap();
        gpu.prefill(&mut s, p, LogitsFor::Last).unwrap();
        greedy.push(s);
    }
    let mut logits_states: Vec<_> = greedy.iter().map(|s| gpu.fork(s).unwrap()).collect();
    let mut sampled: Vec<_> = greedy.iter().map(|s| gpu.fork(s).unwrap()).collect();
    // Sequence 1 leaves the batch after this many steps.
    let leaves = 4;
    for step in 0..steps {
        let members: Vec<usize> = (0..batch_prompts.len())
            .filter(|&i| i != 1 || step < leaves)
            .collect();
        let pick = |states| members_of(states, &members);
        let tokens: Vec<u32> = members.iter().map(|&i| runs[i].greedy[step]).collect();
        let ids = gpu.decode_greedy(&mut pick(&mut greedy), &tokens).unwrap();
        let logits = gpu.decode(&mut pick(&mut logits_states), &tokens).unwrap();
        let sampled_tokens: Vec<u32> = members.iter().map(|&i| runs[i].sampled[step]).collect();
        let draws: Vec<DeviceDraw> = members
            .iter()
            .map(|&i| sample_draw(1000 * i as u64 + step as u64, vocab as usize))
            .collect();
        let drawn = gpu
            .decode_sample(&mut pick(&mut sampled), &sampled_tokens, &draws)
            .unwrap();
        for (row, &i) in members.iter().enumerate() {
            let label = format!("sequence {i}, step {step}");
            assert_eq!(ids[row], runs[i].greedy[step + 1], "greedy id: {label}");
            let row_logits = &logits[row * vocab as usize..(row + 1) * vocab as usize];
            assert!(
                row_logits == runs[i].logits[step].as_slice(),
                "logits: {label}"
            );
            assert_eq!(drawn[row], runs[i].sampled[step + 1], "sampled id: {label}");
        }
    }
}

/// Greedy `steps` decode steps of `prompts` (each prefilled first) as one batch, each sequence's
/// logits bit for bit those of the same sequence decoded alone (a fork of its state).
fn batch_decodes_as_each_alone(
    gpu: &CudaBackend,
    vocab: usize,
    prompts: &[Vec<u32>],
    steps: usize,
    label: &str,
) {
    let n = prompts.len();
    let (mut batch, mut solo, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for p in prompts {
        let mut s = gpu.new_state().unwrap();
        next.push(argmax(&gpu.prefill(&mut s, p, LogitsFor::Last).unwrap()));
        solo.push(gpu.fork(&s).unwrap());
        batch.push(s);
    }
    for step in 0..steps {
        let mut refs: Vec<_> = batch.iter_mut().collect();
        let got = gpu.decode(&mut refs, &next).unwrap();
        for (i, alone) in solo.iter_mut().enumerate() {
            let want = gpu.decode(&mut [alone], &[next[i]]).unwrap();
            assert!(
                got[i * vocab..(i + 1) * vocab] == want[..],
                "{label}, batch of {n}, sequence {i}, step {step}: logits differ from the \
                 sequence decoded alone"
            );
            next[i] = argmax(&want);
        }
    }
}

/// Small batches multiply each weight row with every sequence's input in turn (`matvec_tokens`:
/// bf16 batches of up to four, quantised ones of two), in the order one sequence's step does,
/// and every other kernel of a batched step keeps that order too: so each sequence's logits are
/// bit for bit those of its step alone. (Larger quantised batches take the tensor-core product,
/// checked against the CPU in `quantized_batches_decode_like_the_cpu`.)
#[test]
fn small_batches_decode_bit_for_bit_as_each_sequence_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = &fixtures()[0];
    let formats = [
        ("bf16", dir.clone(), 4),
        ("4-bit", quantized_fixture(&tmp.path().join("q4"), 4, 64), 2),
        ("8-bit", quantized_fixture(&tmp.path().join("q8"), 8, 32), 2),
    ];
    for (label, path, largest) in &formats {
        let model = Model::load(path).unwrap();
        let vocab = model.config.vocab_size;
        let prompts = batch_prompts(dir, vocab as u32, *largest);
        let gpu = cuda(&model, 2 * prompts.len());
        for n in 2..=prompts.len() {
            batch_decodes_as_each_alone(&gpu, vocab, &prompts[..n], 3, label);
        }
    }
}

/// Quantised batched decode steps against the CPU backend, each sequence's logits within the
/// calibrated spread: batches large enough for the widest tensor-core product blocks and the
/// grouped routed experts, then a smaller batch (a rewritten batch table, another graph).
#[test]
fn quantized_batches_decode_like_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = &fixtures()[0];
    for (bits, group_size) in [(4, 64), (8, 32)] {
        let out = quantized_fixture(&tmp.path().join(format!("q{bits}")), bits, group_size);
        let model = Arc::new(Model::load(&out).unwrap());
        let vocab = model.config.vocab_size;
        let cpu = CpuBackend::new(model.clone());
        let cpu_bf16 = CpuBackend::with_bf16_activations(model.clone());
        let batch_prompts = batch_prompts(dir, vocab as u32, 18);
        let gpu = cuda(&model, 2 * batch_prompts.len());
        let mut cpus = Vec::new();
        let mut spreads = Vec::new();
        let mut gpus = Vec::new();
        let mut next = Vec::new();
        for p in &batch_prompts {
            let (mut c, mut c16, mut g) = (
                cpu.new_state().unwrap(),
                cpu_bf16.new_state().unwrap(),
                gpu.new_state().unwrap(),
            );
            let want = cpu.prefill(&mut c, p, LogitsFor::Last).unwrap();
            let spread = relative_error(
                &cpu_bf16.prefill(&mut c16, p, LogitsFor::Last).unwrap(),
                &want,
            );
            let err = relative_error(&gpu.prefill(&mut g, p, LogitsFor::Last).unwrap(), &want);
            assert!(
                err <= SPREADS * spread,
                "{bits}-bit, prefill of {} tokens: error {err} above {SPREADS} x spread {spread}",
                p.len()
            );
            next.push(argmax(&want));
            cpus.push(c);
            spreads.push(c16);
            gpus.push(g);
        }
        for step in 0..6 {
            // 18 sequences for three steps (32-token product blocks, the routed experts grouped
            // by expert as in prefill), then 9 (16-token blocks, the decode MoE kernels).
            let members: Vec<usize> = (0..batch_prompts.len())
                .filter(|&i| step < 3 || (1..10).contains(&i))
                .collect();
            let tokens: Vec<u32> = members.iter().map(|&i| next[i]).collect();
            // The batch's greedy step, on copies of its states, picks the argmax of its logits.
            let mut forks: Vec<_> = members
                .iter()
                .map(|&i| gpu.fork(&gpus[i]).unwrap())
                .collect();
            let mut fork_refs: Vec<_> = forks.iter_mut().collect();
            let ids = gpu.decode_greedy(&mut fork_refs, &tokens).unwrap();
            drop(forks);
            let got = gpu
                .decode(&mut members_of(&mut gpus, &members), &tokens)
                .unwrap();
            for (row, &i) in members.iter().enumerate() {
                assert_eq!(ids[row], argmax(&got[row * vocab..(row + 1) * vocab]));
                let want = cpu.decode(&mut [&mut cpus[i]], &[next[i]]).unwrap();
                let bf16 = cpu_bf16.decode(&mut [&mut spreads[i]], &[next[i]]).unwrap();
                let spread = relative_error(&bf16, &want);
                let err = relative_error(&got[row * vocab..(row + 1) * vocab], &want);
                println!(
                    "{bits}-bit, sequence {i}, step {step}: GPU error {err:.2e}, bf16 spread {spread:.2e}"
                );
                assert!(
                    err <= SPREADS * spread,
                    "{bits}-bit, sequence {i}, step {step}: error {err} above {SPREADS} x spread {spread}"
                );
                next[i] = argmax(&want);
            }
        }
    }
}
