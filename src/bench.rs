//! `lily bench`: prefill and decode speed of the CUDA backend, against the device's measured
//! copy bandwidth, on a checkpoint or on full-size synthetic weights generated on the GPU.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, ensure};

use crate::backend::cuda::weights::WeightFormat;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{Backend, LogitsFor, RunChoice};
use crate::config::{LayerKind, ModelConfig};
use crate::engine::sampler::{Sampler, SamplingParams};
use crate::model::Model;

/// Qwen3.6-35B-A3B's text configuration, for synthetic runs.
const FULL_SIZE_CONFIG: &str = include_str!("../configs/qwen3.6-35b-a3b.json");

/// Replays of the decode step before the traced one (`--trace`).
const TRACE_WARMUP: usize = 8;

/// What to benchmark.
pub struct BenchArgs {
    pub model: Option<std::path::PathBuf>,
    /// A `config.json` whose shapes synthetic weights take instead of Qwen3.6-35B-A3B's.
    pub config: Option<std::path::PathBuf>,
    pub format: WeightFormat,
    pub prompt: usize,
    pub generate: usize,
    pub use_graphs: bool,
    /// Decode with the router's own launch instead of folding it into the mixer's output
    /// projection (`CudaOptions::fold_router`).
    pub no_router_fold: bool,
    /// Decode steps to run inside a profiler range after the timed ones (see `CudaBackend::profile`).
    pub profile_steps: usize,
    /// Replays per truncated step for the decode critical path (0: not timed; see
    /// `CudaBackend::decode_critical_path`).
    pub critical_path: usize,
    /// Where to write a per-block timeline of one replayed decode step (`CudaBackend::decode_trace`).
    pub trace: Option<std::path::PathBuf>,
    /// Prompt tokens per prefill chunk (`CudaOptions::prefill_chunk`).
    pub prefill_chunk: usize,
    /// Sequences decoded together in a second decode measurement (1: none).
    pub batch: usize,
    /// Also time a decode whose tokens are drawn on the GPU with these parameters.
    pub sampling: Option<SamplingParams>,
}

/// A batched decode measurement: `batch` sequences, each with its own prompt, one token of each
/// per step.
struct BatchedDecode {
    batch: usize,
    steps: usize,
    seconds: f64,
    /// Per-kernel shares of the batched step and its replayed time (`--critical-path`).
    critical: Option<(Vec<crate::backend::cuda::timing::KernelShare>, f64)>,
}

impl BatchedDecode {
    fn tok_s(&self) -> f64 {
        (self.batch * self.steps) as f64 / self.seconds
    }

    fn step_ms(&self) -> f64 {
        self.seconds * 1e3 / self.steps as f64
    }
}

/// Prefills `batch` sequences with distinct prompts of `prompt_len` tokens, then times `steps`
/// greedy decode steps of all of them together (after one untimed step, which captures the
/// batch's graph).
fn batched_decode(
    backend: &CudaBackend,
    batch: usize,
    prompt_len: usize,
    steps: usize,
    critical_path: usize,
) -> Result<BatchedDecode> {
    let vocab = backend.config().vocab_size as u32;
    let mut states = Vec::with_capacity(batch);
    let mut tokens = Vec::with_capacity(batch);
    for b in 0..batch as u32 {
        let prompt: Vec<u32> = (0..prompt_len as u32)
            .map(|i| (i.wrapping_add(b * 7919).wrapping_mul(2_654_435_761) >> 7) % vocab)
            .collect();
        let mut state = backend.new_state()?;
        let logits = backend.prefill(&mut state, &prompt, LogitsFor::Last)?;
        tokens.push(crate::backend::argmax(&logits));
        states.push(state);
    }
    let mut refs: Vec<&mut _> = states.iter_mut().collect();
    tokens = backend.decode_greedy(&mut refs, &tokens)?;
    backend.synchronize()?;
    let start = Instant::now();
    for _ in 0..steps {
        tokens = backend.decode_greedy(&mut refs, &tokens)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let critical = if critical_path > 0 {
        Some(backend.decode_critical_path(&mut refs, critical_path)?)
    } else {
        None
    };
    Ok(BatchedDecode {
        batch,
        steps,
        seconds,
        critical,
    })
}

/// Decode tokens/s of a run of `generate` tokens after `prompt`, each drawn on the device with
/// `params` as a sampling request's are (after one untimed step, which captures the drawing
/// step's graph).
fn sampled_decode(
    backend: &CudaBackend,
    prompt: &[u32],
    params: &SamplingParams,
    generate: usize,
) -> Result<f64> {
    let mut sampler = Sampler::new(params.clone(), prompt)?;
    let mut state = backend.new_state()?;
    let logits = backend.prefill(&mut state, prompt, LogitsFor::Last)?;
    let first = crate::backend::argmax(&logits);
    if sampler.penalises() {
        sampler.record(first);
        backend.load_penalty_history(&mut state, &sampler.penalty_history())?;
    }
    let mut next = sampler
        .device_draws(backend.config().vocab_size, backend.penalises_on_device())
        .context(
            "sampled decode: these parameters are not drawn on the GPU (give a temperature \
             above 0 or a penalty)",
        )?;
    let token = backend.decode_sample(&mut [&mut state], &[first], &[next()])?[0];
    backend.synchronize()?;
    let mut left = generate - 1;
    let start = Instant::now();
    if left > 0 {
        backend.decode_run(state, token, RunChoice::Drawn(&mut next), &mut |_| {
            left -= 1;
            Ok(left > 0)
        })?;
    }
    Ok((generate - 1) as f64 / start.elapsed().as_secs_f64())
}

/// The configuration synthetic weights take, and what to call it: `path`'s, else
/// Qwen3.6-35B-A3B's.
fn synthetic_config(path: Option<&std::path::Path>) -> Result<(ModelConfig, String)> {
    let Some(path) = path else {
        return Ok((
            ModelConfig::from_json_str(FULL_SIZE_CONFIG)?,
            "Qwen3.6-35B-A3B".to_string(),
        ));
    };
    Ok((
        ModelConfig::from_file(path)?,
        format!("model of {}", path.display()),
    ))
}

/// Runs the benchmark and prints a report (human-readable lines, then one JSON line).
pub fn run(args: &BenchArgs) -> Result<()> {
    // Written through a lock rather than `println!`, so that a closed pipe is an error, not a panic.
    let mut out = std::io::stdout().lock();
    ensure!(
        args.prompt > 0 && args.generate > 0,
        "--prompt and --gen must be positive"
    );
    let opts = CudaOptions {
        max_context: args.prompt
            + args.generate
            + args.profile_steps
            + args.critical_path
            + args.trace.as_ref().map_or(0, |_| TRACE_WARMUP + 1)
            + 2,
        max_sequences: args.batch.max(1),
        spare_sequences: 0,
        fit_sequences: false,
        use_graphs: args.use_graphs,
        prefill_chunk: args.prefill_chunk,
        fold_router: !args.no_router_fold,
    };
    let start = Instant::now();
    let (backend, source) = match &args.model {
        Some(dir) => (
            CudaBackend::new(&Model::load(dir)?, opts)?,
            dir.display().to_string(),
        ),
        None => {
            let (config, name) = synthetic_config(args.config.as_deref())?;
            (
                CudaBackend::synthetic(&config, args.format, opts)?,
                format!("synthetic {name}, {:?}", args.format),
            )
        }
    };
    let load_s = start.elapsed().as_secs_f64();
    let copy_bw = backend.copy_bandwidth()?;
    let vocab = backend.config().vocab_size as u32;

    // A deterministic prompt spread over the vocabulary.
    let prompt: Vec<u32> = (0..args.prompt as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab)
        .collect();
    let mut state = backend.new_state()?;
    backend.synchronize()?;
    let start = Instant::now();
    let logits = backend.prefill(&mut state, &prompt, LogitsFor::Last)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let first = crate::backend::argmax(&logits);

    // The first decode step captures the graph: keep it out of the timing. Then the decode as
    // `lily generate` runs it (`Backend::decode_run`).
    let token = backend.decode_greedy(&mut [&mut state], &[first])?[0];
    backend.synchronize()?;
    let mut last = token;
    let mut left = args.generate - 1;
    let start = Instant::now();
    if left > 0 {
        backend.decode_run(state, token, RunChoice::Greedy, &mut |id| {
            last = id;
            left -= 1;
            Ok(left > 0)
        })?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    let decode_tok_s = (args.generate - 1) as f64 / decode_s;

    // The same steps one at a time, each id read back before the next step is queued (as the
    // server's scheduler steps), on the same prompt again; the diagnostics below use its state.
    let mut state = backend.new_state()?;
    backend.prefill(&mut state, &prompt, LogitsFor::Last)?;
    let mut token = backend.decode_greedy(&mut [&mut state], &[first])?[0];
    backend.synchronize()?;
    let start = Instant::now();
    for _ in 1..args.generate {
        token = backend.decode_greedy(&mut [&mut state], &[token])?[0];
    }
    let stepwise_tok_s = (args.generate - 1) as f64 / start.elapsed().as_secs_f64();
    ensure!(
        args.generate == 1 || token == last,
        "the decode run chose {last} as its last token but the steps one at a time chose {token}"
    );
    let critical = if args.critical_path > 0 {
        Some(backend.decode_critical_path(&mut [&mut state], args.critical_path)?)
    } else {
        None
    };
    if let Some(path) = &args.trace {
        let records = backend.decode_trace(&mut state, TRACE_WARMUP)?;
        let mut csv = String::from("launch,name,block,sm,start_ns,waited_ns,end_ns\n");
        for r in &records {
            csv.push_str(&format!(
                "{},{},{},{},{},{},{}\n",
                r.launch,
                r.name,
                r.block,
                r.sm,
                r.start_ns,
                r.waited_ns.map(|w| w.to_string()).unwrap_or_default(),
                r.end_ns
            ));
        }
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
        writeln!(
            out,
            "trace              {} block records in {}",
            records.len(),
            path.display()
        )?;
    }
    if args.profile_steps > 0 {
        backend.profile(|| {
            for _ in 0..args.profile_steps {
                token = backend.decode_greedy(&mut [&mut state], &[token])?[0];
            }
            Ok(())
        })?;
    }
    drop(state);
    let sampled_tok_s = match &args.sampling {
        Some(params) => Some(sampled_decode(&backend, &prompt, params, args.generate)?),
        None => None,
    };
    let batched = if args.batch > 1 {
        Some(batched_decode(
            &backend,
            args.batch,
            args.prompt,
            args.generate - 1,
            args.critical_path,
        )?)
    } else {
        None
    };

    // A second prefill, with the parts timed on the GPU (events cost a little, so not the first),
    // inside a profiler range (`ncu --profile-from-start off` records only this prefill and the
    // --profile-steps decode steps).
    let mut state = backend.new_state()?;
    let mut split = Vec::new();
    backend.profile(|| {
        split = backend.time_prefill_parts(|| {
            backend.prefill(&mut state, &prompt, LogitsFor::Last)?;
            Ok(())
        })?;
        Ok(())
    })?;
    drop(state);
    let split_s: f64 = split.iter().map(|(_, ms)| ms / 1e3).sum();
    let flops = prefill_flops(backend.config(), args.prompt);
    let tensor_rate = backend.tensor_core_rate()?;

    let context = args.prompt + args.generate / 2;
    let bytes = backend.decode_bytes_per_token(context);
    let achieved = bytes as f64 * decode_tok_s;
    let limit_tok_s = copy_bw / bytes as f64;
    let memory = backend.memory_use()?;
    let device_in_use = backend.device_memory_in_use()?;

    writeln!(out, "model              {source}")?;
    writeln!(out, "load               {load_s:.1} s")?;
    writeln!(
        out,
        "weights on GPU     {:.2} GB",
        backend.weight_bytes() as f64 / 1e9
    )?;
    writeln!(
        out,
        "GPU memory used    {:.2} GB by lily: weights {:.2}, {} sequence slot(s) {:.2}, scratch \
         {:.2} ({:.2} GB in use on the device, by every process and the driver)",
        memory.total() as f64 / 1e9,
        memory.weights as f64 / 1e9,
        args.batch.max(1),
        memory.sequences as f64 / 1e9,
        memory.scratch as f64 / 1e9,
        device_in_use as f64 / 1e9
    )?;
    writeln!(
        out,
        "copy bandwidth     {:.0} GB/s (measured, read + write)",
        copy_bw / 1e9
    )?;
    writeln!(
        out,
        "prefill            {} tokens in {:.1} ms: {:.0} tok/s (time to first token)",
        args.prompt,
        prefill_s * 1e3,
        args.prompt as f64 / prefill_s
    )?;
    writeln!(
        out,
        "prefill work       {:.2} TFLOP: {:.1} TFLOP/s = {:.1}% of the measured fp16 tensor-core \
         rate ({:.0} TFLOP/s, wgmma m64n64k16)",
        flops / 1e12,
        flops / prefill_s / 1e12,
        100.0 * flops / prefill_s / tensor_rate,
        tensor_rate / 1e12
    )?;
    let parts: Vec<String> = split
        .iter()
        .map(|(part, ms)| {
            format!(
                "{} {ms:.1} ms ({:.0}%)",
                part.name(),
                100.0 * ms / 1e3 / split_s
            )
        })
        .collect();
    writeln!(
        out,
        "prefill split      {} (second run, {:.1} ms in all)",
        parts.join(", "),
        split_s * 1e3
    )?;
    writeln!(
        out,
        "decode             {decode_tok_s:.1} tok/s at ~{context} context ({:.3} ms/token; \
         {stepwise_tok_s:.1} tok/s with each id read back before the next step)",
        1e3 / decode_tok_s
    )?;
    writeln!(
        out,
        "decode traffic     {:.3} GB/token, {:.0} GB/s achieved = {:.1}% of copy bandwidth \
         (limit {limit_tok_s:.0} tok/s)",
        bytes as f64 / 1e9,
        achieved / 1e9,
        100.0 * achieved / copy_bw
    )?;
    if let (Some(tok_s), Some(p)) = (sampled_tok_s, &args.sampling) {
        writeln!(
            out,
            "decode sampled     {tok_s:.1} tok/s ({:.3} ms/token; drawn on the GPU at temperature \
             {}, top-p {}, top-k {}, min-p {}, repetition penalty {}, presence penalty {}, \
             frequency penalty {})",
            1e3 / tok_s,
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty
        )?;
    }
    if let Some(b) = &batched {
        writeln!(
            out,
            "decode batch {:<5} {:.1} tok/s in all, {:.1} per sequence ({:.3} ms/step) at \
             ~{context} context each",
            b.batch,
            b.tok_s(),
            b.tok_s() / b.batch as f64,
            b.step_ms()
        )?;
    }
    if let Some((shares, step_us)) = &critical {
        writeln!(
            out,
            "decode critical path, per kernel (step {step_us:.1} us replayed):"
        )?;
        print_shares(&mut out, shares, *step_us)?;
    }
    if let Some((shares, step_us)) = batched.as_ref().and_then(|b| b.critical.as_ref()) {
        writeln!(
            out,
            "decode batch {} critical path, per kernel (step {step_us:.1} us replayed):",
            args.batch
        )?;
        print_shares(&mut out, shares, *step_us)?;
    }
    writeln!(
        out,
        "{}",
        serde_json::json!({
            "prefill_tokens": args.prompt,
            "prefill_tok_s": args.prompt as f64 / prefill_s,
            "ttft_ms": prefill_s * 1e3,
            "prefill_tflop": flops / 1e12,
            "prefill_tflop_s": flops / prefill_s / 1e12,
            "tensor_core_tflop_s": tensor_rate / 1e12,
            "prefill_split_ms": split
                .iter()
                .map(|(part, ms)| (part.name().to_string(), serde_json::json!(ms)))
                .collect::<serde_json::Map<_, _>>(),
            "decode_tokens": args.generate,
            "decode_tok_s": decode_tok_s,
            "decode_stepwise_tok_s": stepwise_tok_s,
            "decode_sampled_tok_s": sampled_tok_s,
            "decode_bytes_per_token": bytes,
            "decode_gb_s": achieved / 1e9,
            "copy_gb_s": copy_bw / 1e9,
            "fraction_of_limit": achieved / copy_bw,
            "gpu_memory_gb": memory.total() as f64 / 1e9,
            "gpu_memory_sequences_gb": memory.sequences as f64 / 1e9,
            "gpu_memory_scratch_gb": memory.scratch as f64 / 1e9,
            "device_memory_in_use_gb": device_in_use as f64 / 1e9,
            "weights_gb": backend.weight_bytes() as f64 / 1e9,
            "last_token": last,
            "batch": args.batch,
            "batch_decode_tok_s": batched.as_ref().map(BatchedDecode::tok_s),
            "batch_step_ms": batched.as_ref().map(BatchedDecode::step_ms),
        })
    )?;
    Ok(())
}

fn print_shares(
    out: &mut impl Write,
    shares: &[crate::backend::cuda::timing::KernelShare],
    step_us: f64,
) -> Result<()> {
    for share in shares {
        writeln!(
            out,
            "  {:<22} {:>4} launches {:>8.1} us {:>6.2} us each {:>5.1}%",
            share.name,
            share.launches,
            share.critical_us,
            share.critical_us / share.launches as f64,
            100.0 * share.critical_us / step_us
        )?;
    }
    Ok(())
}

/// Floating-point operations of prefilling `tokens` tokens from an empty context, counting 2 per
/// multiply-add: every weight matrix a token passes through (mixer projections, router, its
/// routed experts and the shared expert), lm_head for the last token only, attention scores and
/// values over each token's causal context, and the DeltaNet recurrence (a state read, update
/// and output per state entry).
pub fn prefill_flops(c: &ModelConfig, tokens: usize) -> f64 {
    let h = c.hidden_size as f64;
    let t = tokens as f64;
    let attn_width = (c.num_attention_heads * c.head_dim) as f64;
    let kv_width = (c.num_key_value_heads * c.head_dim) as f64;
    let value_dim = c.linear_value_dim() as f64;
    let state = (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim) as f64;
    let deltanet_proj =
        (c.linear_conv_dim() as f64 + value_dim + 2.0 * c.linear_num_value_heads as f64) * h
            + value_dim * h;
    let attention_proj = (2.0 * attn_width + 2.0 * kv_width) * h + attn_width * h;
    let moe = (c.num_experts as f64 + 1.0) * h
        + 3.0
            * h
            * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
                as f64;
    let mut per_token_macs = 0.0;
    let mut attention_layers = 0.0;
    for kind in &c.layer_kinds {
        per_token_macs += moe;
        match kind {
            LayerKind::LinearAttention => per_token_macs += deltanet_proj + 3.0 * state,
            LayerKind::FullAttention => {
                per_token_macs += attention_proj;
                attention_layers += 1.0;
            }
        }
    }
    // Token i attends to i + 1 positions: scores and values, head_dim each, per query head.
    let causal_positions = t * (t + 1.0) / 2.0;
    let attention_macs = attention_layers * 2.0 * attn_width * causal_positions;
    let lm_head_macs = h * c.vocab_size as f64;
    2.0 * (per_token_macs * t + attention_macs + lm_head_macs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_weights_take_the_given_configuration() {
        let (default, name) = synthetic_config(None).unwrap();
        assert_eq!(
            (default.hidden_size, name.as_str()),
            (2048, "Qwen3.6-35B-A3B")
        );
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/qwen3.5-397b-a17b.json"
        );
        let (large, name) = synthetic_config(Some(std::path::Path::new(path))).unwrap();
        assert_eq!((large.hidden_size, large.num_experts), (4096, 512));
        assert!(name.ends_with("qwen3.5-397b-a17b.json"), "{name}");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nowhere.json");
        let err = format!("{:#}", synthetic_config(Some(&missing)).unwrap_err());
        assert!(err.contains("nowhere.json"), "{err}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, r#"{"model_type": "llama"}"#).unwrap();
        let err = format!("{:#}", synthetic_config(Some(&bad)).unwrap_err());
        assert!(
            err.contains("bad.json") && err.contains("model_type"),
            "{err}"
        );
    }

    #[test]
    fn prefill_work_of_the_full_model_is_its_active_weights_plus_attention() {
        let c = ModelConfig::from_json_str(FULL_SIZE_CONFIG).unwrap();
        let one = prefill_flops(&c, 1);
        // About 3B active parameters per token, lm_head (0.5B) and the embedding (not a product) included.
        assert!((4.0e9..6.0e9).contains(&one), "{one}");
        // Attention grows with the square of the prompt: 4x the tokens is more than 4x the work.
        let (short, long) = (prefill_flops(&c, 4096), prefill_flops(&c, 16384));
        assert!(long > 4.0 * short && long < 5.0 * short, "{short} {long}");
    }
}
