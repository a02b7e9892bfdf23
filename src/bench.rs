//! `lily bench`: prefill and decode speed of the CUDA backend, against the device's measured
//! copy bandwidth, on a checkpoint or on full-size synthetic weights generated on the GPU.

use std::time::Instant;

use anyhow::{Result, ensure};

use crate::backend::cuda::weights::WeightFormat;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{Backend, LogitsFor};
use crate::config::ModelConfig;
use crate::model::Model;

/// Qwen3.6-35B-A3B's text configuration, for synthetic runs.
const FULL_SIZE_CONFIG: &str = include_str!("../configs/qwen3.6-35b-a3b.json");

/// What to benchmark.
pub struct BenchArgs {
    pub model: Option<std::path::PathBuf>,
    pub format: WeightFormat,
    pub prompt: usize,
    pub generate: usize,
    pub use_graphs: bool,
    /// Decode steps to run inside a profiler range after the timed ones (see `CudaBackend::profile`).
    pub profile_steps: usize,
}

/// Runs the benchmark and prints a report (human-readable lines, then one JSON line).
pub fn run(args: &BenchArgs) -> Result<()> {
    ensure!(
        args.prompt > 0 && args.generate > 0,
        "--prompt and --gen must be positive"
    );
    let opts = CudaOptions {
        max_context: args.prompt + args.generate + args.profile_steps + 1,
        max_sequences: 1,
        use_graphs: args.use_graphs,
    };
    let start = Instant::now();
    let (backend, source) = match &args.model {
        Some(dir) => (
            CudaBackend::new(&Model::load(dir)?, opts)?,
            dir.display().to_string(),
        ),
        None => {
            let config = ModelConfig::from_json_str(FULL_SIZE_CONFIG)?;
            (
                CudaBackend::synthetic(&config, args.format, opts)?,
                format!("synthetic Qwen3.6-35B-A3B, {:?}", args.format),
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
    let mut token = crate::backend::argmax(&logits);

    // The first decode step captures the graph: keep it out of the timing.
    token = backend.decode_greedy(&mut [&mut state], &[token])?[0];
    backend.synchronize()?;
    let start = Instant::now();
    for _ in 1..args.generate {
        token = backend.decode_greedy(&mut [&mut state], &[token])?[0];
    }
    let decode_s = start.elapsed().as_secs_f64();
    let decode_tok_s = (args.generate - 1) as f64 / decode_s;
    if args.profile_steps > 0 {
        backend.profile(|| {
            for _ in 0..args.profile_steps {
                token = backend.decode_greedy(&mut [&mut state], &[token])?[0];
            }
            Ok(())
        })?;
    }
    let context = args.prompt + args.generate / 2;
    let bytes = backend.decode_bytes_per_token(context);
    let achieved = bytes as f64 * decode_tok_s;
    let limit_tok_s = copy_bw / bytes as f64;
    let used = backend.device_memory_used()?;

    println!("model              {source}");
    println!("load               {load_s:.1} s");
    println!(
        "weights on GPU     {:.2} GB",
        backend.weight_bytes() as f64 / 1e9
    );
    println!("GPU memory used    {:.2} GB", used as f64 / 1e9);
    println!(
        "copy bandwidth     {:.0} GB/s (measured, read + write)",
        copy_bw / 1e9
    );
    println!(
        "prefill            {} tokens in {:.1} ms: {:.0} tok/s (time to first token)",
        args.prompt,
        prefill_s * 1e3,
        args.prompt as f64 / prefill_s
    );
    println!(
        "decode             {decode_tok_s:.1} tok/s at ~{context} context ({:.3} ms/token)",
        1e3 / decode_tok_s
    );
    println!(
        "decode traffic     {:.3} GB/token, {:.0} GB/s achieved = {:.1}% of copy bandwidth \
         (limit {limit_tok_s:.0} tok/s)",
        bytes as f64 / 1e9,
        achieved / 1e9,
        100.0 * achieved / copy_bw
    );
    println!(
        "{}",
        serde_json::json!({
            "prefill_tokens": args.prompt,
            "prefill_tok_s": args.prompt as f64 / prefill_s,
            "ttft_ms": prefill_s * 1e3,
            "decode_tokens": args.generate,
            "decode_tok_s": decode_tok_s,
            "decode_bytes_per_token": bytes,
            "decode_gb_s": achieved / 1e9,
            "copy_gb_s": copy_bw / 1e9,
            "fraction_of_limit": achieved / copy_bw,
            "gpu_memory_gb": used as f64 / 1e9,
            "weights_gb": backend.weight_bytes() as f64 / 1e9,
            "last_token": token,
        })
    );
    Ok(())
}
