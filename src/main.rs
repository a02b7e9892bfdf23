//! The `lily` command line.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, LogitsFor};
use lily::config::{eos_token_ids, parse_ids};
use lily::convert::{ConvertOptions, DEFAULT_MAX_SHARD_BYTES, convert};
use lily::engine::generate::{GenerationParams, generate};
use lily::engine::sampler::{SamplingParams, logprob_of};
use lily::engine::scheduler::SCORED_CHUNK;
use lily::model::Model;
use lily::quant::QuantSpec;
use lily::server::{ServeOptions, ServedModel};
use lily::text::chat_template::ChatTemplate;
use lily::text::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(name = "lily", version, about = "Inference engine for Qwen3.6-35B-A3B")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt (text streamed to stdout, or JSON with --json).
    Generate(GenerateArgs),
    /// Print the logits of every prompt position as JSON: `{"logits": [[...], ...]}`.
    Logits {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids, comma separated.
        #[arg(long, value_parser = parse_id_list)]
        prompt_ids: IdList,
        /// Compute with the prefill path (whole prompt at once) or the decode path (one token at a time).
        #[arg(long, value_enum, default_value_t = PathKind::Prefill)]
        path: PathKind,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Perplexity of a text (read on stdin) or of token ids: each token's negative
    /// log-likelihood given those before it in its window, over the model's whole vocabulary (as
    /// transformers computes it); prints `{"tokens", "windows", "scored", "nll", "perplexity"}`.
    Perplexity {
        /// Checkpoint directory (holding tokenizer.json, unless --ids is given).
        #[arg(long)]
        model: PathBuf,
        /// Token ids, comma separated, instead of text on stdin.
        #[arg(long, value_parser = parse_id_list)]
        ids: Option<IdList>,
        /// Tokens per window: the text is cut into windows that are each scored from a fresh
        /// state, so a window's first token is not scored (at most --context on CUDA).
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(2..))]
        window: u32,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Read text on stdin and print its token ids as a JSON array.
    Tokenize {
        /// Checkpoint directory (holding tokenizer.json).
        #[arg(long)]
        model: PathBuf,
    },
    /// Read one JSON object on stdin (`messages`, `tools`, ...) and print the rendered chat prompt.
    Render {
        /// Checkpoint directory (holding the chat template).
        #[arg(long)]
        model: PathBuf,
    },
    /// Compile every CUDA kernel with NVRTC (no GPU needed); exits non-zero on any error.
    #[cfg(feature = "cuda")]
    Kernels {
        /// Compile everything and report (the only mode).
        #[arg(long)]
        check: bool,
        /// A model's `config.json` whose shapes the shape-specialised modules are compiled for
        /// as well (repeatable; the family's full-size models always are).
        #[arg(long, requires = "check")]
        config: Vec<PathBuf>,
        /// Also write each compiled module's PTX into this folder, named by module and variant
        /// (what scripts/kernel_resources.sh reads registers from).
        #[arg(long, requires = "check")]
        ptx_dir: Option<PathBuf>,
    },
    /// Measure prefill and decode speed on the GPU.
    #[cfg(feature = "cuda")]
    Bench {
        /// Checkpoint directory; without it, --synthetic full-size weights are generated on the GPU.
        #[arg(long, conflicts_with = "synthetic")]
        model: Option<PathBuf>,
        /// Random full-size Qwen3.6-35B-A3B weights generated on the GPU (no disk).
        #[arg(long)]
        synthetic: bool,
        /// With --synthetic: the shapes of this config.json (another model of the family, or
        /// one with fewer layers) instead of Qwen3.6-35B-A3B's.
        #[arg(long, requires = "synthetic")]
        config: Option<PathBuf>,
        /// Weight format of synthetic weights.
        #[arg(long, value_enum, default_value_t = Quant::Q4)]
        quant: Quant,
        /// Prompt length.
        #[arg(long, default_value_t = 4096)]
        prompt: usize,
        /// Tokens to generate.
        #[arg(long = "gen", default_value_t = 128)]
        generate: usize,
        /// Launch kernels one by one instead of replaying CUDA graphs (for profilers).
        #[arg(long)]
        no_graphs: bool,
        /// Decode with the router's own launch instead of folded into the mixer's output
        /// projection (to measure what the fold gives).
        #[arg(long)]
        no_router_fold: bool,
        /// Decode steps to run, after the timed ones, inside a profiler range (for
        /// `ncu --profile-from-start off`; the prefill timed by part runs in one too).
        #[arg(long, default_value_t = 0)]
        profile_steps: usize,
        /// Also time each decode kernel's share of the replayed step: the step's graph is
        /// replayed truncated after each launch, this many times each.
        #[arg(long, default_value_t = 0)]
        critical_path: usize,
        /// Write a per-block timeline of one replayed decode step to this CSV file (needs
        /// LILY_TRACE_RECORDS=N in the environment, which compiles the block records in).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Prompt tokens per prefill chunk.
        #[arg(long, default_value_t = lily::backend::cuda::DEFAULT_PREFILL_CHUNK as u32,
              value_parser = clap::value_parser!(u32).range(1..))]
        prefill_chunk: u32,
        /// Also time decode of this many sequences at once (each with its own prompt of
        /// --prompt tokens), one token of each per step.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
        batch: u32,
        /// Also time a decode whose tokens are drawn on the GPU at this temperature (with
        /// --top-p, --top-k, --min-p and the penalties), as a sampling request's are; 0 with a
        /// penalty draws greedily.
        #[arg(long)]
        temperature: Option<f32>,
        #[arg(long, default_value_t = 1.0, requires = "temperature")]
        top_p: f32,
        /// 0 disables top-k.
        #[arg(long, default_value_t = 0, requires = "temperature")]
        top_k: usize,
        #[arg(long, default_value_t = 0.0, requires = "temperature")]
        min_p: f32,
        #[command(flatten)]
        penalties: PenaltyArgs,
    },
    /// Serve an OpenAI-compatible API (without --model, the embedded demo model).
    Serve(ServeArgs),
    /// Quantise a bf16 checkpoint into an MLX-LM checkpoint (affine, routers at 8 bits).
    Convert {
        /// Source checkpoint directory (the official bf16 layout).
        #[arg(long)]
        model: PathBuf,
        /// Output directory; must not exist yet.
        #[arg(long)]
        out: PathBuf,
        /// Bits per quantised weight.
        #[arg(long, default_value_t = 4, value_parser = parse_bits)]
        bits: u32,
        /// Weights sharing one scale and bias.
        #[arg(long, default_value_t = 64, value_parser = parse_group_size)]
        group_size: usize,
        /// Largest shard file in MiB.
        #[arg(long, default_value_t = DEFAULT_MAX_SHARD_BYTES >> 20)]
        shard_mib: usize,
    },
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (needs tokenizer.json in the checkpoint).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt token ids, comma separated (no tokenizer needed).
    #[arg(long, value_parser = parse_id_list)]
    prompt_ids: Option<IdList>,
    /// Wrap the prompt as a user message in the checkpoint's chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[command(flatten)]
    penalties: PenaltyArgs,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable); never emitted.
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object (ids, timings) instead of streaming text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The sampler's penalties on the ids a sequence has seen (`SamplingParams`).
#[derive(Args)]
struct PenaltyArgs {
    /// Positive logits of ids in the prompt or output divided by it, negative ones multiplied.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtracted from the logit of every id generated at least once.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtracted from an id's logit once per time it was generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
}

#[cfg(feature = "cuda")]
impl PenaltyArgs {
    fn penalties(&self) -> lily::backend::Penalties {
        lily::backend::Penalties {
            repetition: self.repetition_penalty,
            presence: self.presence_penalty,
            frequency: self.frequency_penalty,
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    /// Checkpoint directory; without it, a small demo model with random weights is served.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the log says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $LILY_API_KEY if set).
    #[arg(long, env = "LILY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Sequences generated at once [default: 32; on CUDA, without it, as many up to 32 as the
    /// free GPU memory holds, for a GPU shared with other processes].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_batch: Option<u32>,
    /// Requests that may wait for a free slot; more get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Prompt tokens prefilled per engine step (long prompts are split into chunks this size;
    /// decode steps of other requests run between chunks) [default: 512 on the CPU, 4096 on
    /// CUDA, where a chunk reads every expert's weights once].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    prefill_chunk: Option<u32>,
    /// Sequence states kept so that prompts starting the same way (the next turn of a
    /// conversation, the same system prompt and tools) prefill only the rest; 0 turns it off.
    /// On CUDA each takes a sequence slot of `--context` tokens besides `--max-batch`'s, as far
    /// as the free GPU memory allows.
    #[arg(long, default_value_t = 8)]
    prefix_cache: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Seconds a shutdown waits for running requests before cancelling them.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args, Clone, Copy)]
struct DeviceArgs {
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Longest sequence (prompt + output) the GPU holds; `serve` refuses longer requests.
    #[arg(long, default_value_t = 32768, value_parser = clap::value_parser!(u32).range(2..))]
    context: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

fn parse_bits(s: &str) -> Result<u32, String> {
    s.parse()
        .ok()
        .filter(|b| QuantSpec::SUPPORTED_BITS.contains(b))
        .ok_or_else(|| format!("{s:?} is not one of {:?}", QuantSpec::SUPPORTED_BITS))
}

fn parse_group_size(s: &str) -> Result<usize, String> {
    s.parse()
        .ok()
        .filter(|g| QuantSpec::SUPPORTED_GROUP_SIZES.contains(g))
        .ok_or_else(|| format!("{s:?} is not one of {:?}", QuantSpec::SUPPORTED_GROUP_SIZES))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PathKind {
    Prefill,
    Decode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Quant {
    Q4,
    Q8,
    Bf16,
}

/// Token ids given on the command line.
#[derive(Clone, Debug)]
struct IdList(Vec<u32>);

fn parse_id_list(s: &str) -> Result<IdList, String> {
    let value = serde_json::Value::Array(
        s.split(',')
            .map(|t| {
                t.trim()
                    .parse::<u64>()
                    .map(Into::into)
                    .map_err(|_| format!("{t:?} is not a token id"))
            })
            .collect::<Result<_, _>>()?,
    );
    parse_ids(&value).map(IdList).map_err(|e| format!("{e:#}"))
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if let Err(e) = run(Cli::parse()) {
        // A reader that closed its end of the pipe (`lily logits ... | head`) wants no more
        // output: stop quietly, with the status a shell gives a process ended by SIGPIPE.
        let closed_pipe = e
            .chain()
            .filter_map(|cause| cause.downcast_ref::<std::io::Error>())
            .any(|io| io.kind() == std::io::ErrorKind::BrokenPipe);
        if closed_pipe {
            std::process::exit(141);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Writes a command's output to stdout, returning write errors (a closed pipe among them) rather
/// than panicking as `print!` does.
fn print_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    Ok(out.flush()?)
}

/// Runs `$body` with `$backend` bound to the backend `$device` asks for.
macro_rules! with_backend {
    ($model_dir:expr, $device:expr, |$backend:ident| $body:expr) => {{
        let model = Arc::new(Model::load($model_dir)?);
        match $device.device {
            Device::Cpu => {
                let $backend = CpuBackend::new(model);
                $body
            }
            Device::Cuda => cuda_backend!(model, $device, |$backend| $body),
        }
    }};
}

#[cfg(feature = "cuda")]
macro_rules! cuda_backend {
    ($model:expr, $device:expr, |$backend:ident| $body:expr) => {{
        let opts = lily::backend::cuda::CudaOptions {
            max_context: $device.context as usize,
            max_sequences: 1,
            spare_sequences: 0,
            fit_sequences: false,
            use_graphs: true,
            prefill_chunk: lily::backend::cuda::DEFAULT_PREFILL_CHUNK,
            fold_router: true,
        };
        let $backend = lily::backend::cuda::CudaBackend::new(&$model, opts)?;
        $body
    }};
}

#[cfg(not(feature = "cuda"))]
macro_rules! cuda_backend {
    ($model:expr, $device:expr, |$backend:ident| $body:expr) => {{
        let _ = &$model;
        anyhow::bail!("this lily was built without CUDA: rebuild with `--features cuda`")
    }};
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => {
            with_backend!(&args.model, args.device, |backend| run_generate(
                &backend, &args
            ))?;
        }
        Command::Logits {
            model,
            prompt_ids,
            path,
            device,
        } => {
            let logits = with_backend!(&model, device, |backend| logits(
                &backend,
                &prompt_ids.0,
                path
            ))?;
            print_out(&format!("{}\n", serde_json::json!({ "logits": logits })))?;
        }
        Command::Perplexity {
            model,
            ids,
            window,
            device,
        } => {
            let ids = match ids {
                Some(ids) => ids.0,
                None => Tokenizer::from_model_dir(&model)?.encode(&read_stdin()?)?,
            };
            anyhow::ensure!(ids.len() >= 2, "perplexity needs at least two tokens");
            let window = window as usize;
            anyhow::ensure!(
                device.device == Device::Cpu || window <= device.context as usize,
                "--window {window} is longer than --context {}",
                device.context
            );
            let scores =
                with_backend!(&model, device, |backend| perplexity(&backend, &ids, window))?;
            print_out(&format!("{}\n", serde_json::to_string(&scores)?))?;
        }
        Command::Serve(args) => serve(args)?,
        Command::Tokenize { model } => {
            let tokenizer = Tokenizer::from_model_dir(&model)?;
            let text = read_stdin()?;
            print_out(&format!(
                "{}\n",
                serde_json::to_string(&tokenizer.encode(&text)?)?
            ))?;
        }
        Command::Convert {
            model,
            out,
            bits,
            group_size,
            shard_mib,
        } => {
            let options = ConvertOptions {
                spec: QuantSpec::new(bits, group_size)?,
                max_shard_bytes: shard_mib.max(1) << 20,
                progress: true,
            };
            let s = convert(&model, &out, &options)?;
            let mb = |bytes: usize| bytes as f64 / 1e6;
            eprintln!(
                "wrote {}: {bits}-bit, group size {group_size}, {} tensors in {} shard(s), \
                 {:.1} MB from {:.1} MB in {:.1} s ({:.0} MB/s read)",
                out.display(),
                s.tensors,
                s.shards,
                mb(s.written_bytes),
                mb(s.source_bytes),
                s.seconds,
                mb(s.source_bytes) / s.seconds.max(1e-9),
            );
        }
        Command::Render { model } => {
            let template = ChatTemplate::from_model_dir(&model)?;
            let mut context: serde_json::Value =
                serde_json::from_str(&read_stdin()?).context("stdin is not a JSON object")?;
            let obj = context
                .as_object_mut()
                .context("stdin must hold one JSON object")?;
            obj.entry("add_generation_prompt").or_insert(true.into());
            print_out(&template.render(&context)?)?;
        }
        #[cfg(feature = "cuda")]
        Command::Kernels {
            check,
            config,
            ptx_dir,
        } => {
            anyhow::ensure!(check, "use `lily kernels --check`");
            let configs = config
                .iter()
                .map(|path| {
                    Ok((
                        path.display().to_string(),
                        lily::config::ModelConfig::from_file(path)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            lily::backend::cuda::kernels::check_all(&configs, ptx_dir.as_deref())?;
        }
        #[cfg(feature = "cuda")]
        Command::Bench {
            model,
            synthetic,
            config,
            quant,
            prompt,
            generate,
            no_graphs,
            no_router_fold,
            profile_steps,
            critical_path,
            trace,
            prefill_chunk,
            batch,
            temperature,
            top_p,
            top_k,
            min_p,
            penalties,
        } => {
            use lily::backend::cuda::weights::WeightFormat;
            anyhow::ensure!(
                model.is_some() || synthetic,
                "give --model DIR or --synthetic"
            );
            anyhow::ensure!(
                temperature.is_some() || penalties.penalties().is_none(),
                "the penalties are the sampled decode's: give --temperature (0 decodes greedily)"
            );
            let format = match quant {
                Quant::Q4 => WeightFormat::Affine { bits: 4, group: 64 },
                Quant::Q8 => WeightFormat::Affine { bits: 8, group: 64 },
                Quant::Bf16 => WeightFormat::Bf16,
            };
            lily::bench::run(&lily::bench::BenchArgs {
                model,
                config,
                format,
                prompt,
                generate,
                use_graphs: !no_graphs,
                no_router_fold,
                profile_steps,
                critical_path,
                trace,
                prefill_chunk: prefill_chunk as usize,
                batch: batch as usize,
                sampling: temperature.map(|temperature| SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    min_p,
                    repetition_penalty: penalties.repetition_penalty,
                    presence_penalty: penalties.presence_penalty,
                    frequency_penalty: penalties.frequency_penalty,
                    seed: Some(0),
                }),
            })?;
        }
    }
    Ok(())
}

/// What `lily perplexity` prints.
#[derive(serde::Serialize)]
struct Perplexity {
    tokens: usize,
    windows: usize,
    /// Tokens after the first of each window.
    scored: usize,
    /// Mean negative log-likelihood (nats) of the scored tokens.
    nll: f64,
    perplexity: f64,
}

/// Scores `ids` window by window, each from a fresh state.
fn perplexity<B: Backend>(backend: &B, ids: &[u32], window: usize) -> Result<Perplexity> {
    let vocab = backend.config().vocab_size;
    let (mut total, mut scored) = (0f64, 0usize);
    for tokens in ids.chunks(window) {
        let mut state = backend.new_state()?;
        for (c, chunk) in tokens.chunks(SCORED_CHUNK).enumerate() {
            let logits = backend.prefill(&mut state, chunk, LogitsFor::All)?;
            let first = c * SCORED_CHUNK;
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                if let Some(&next) = tokens.get(first + r + 1) {
                    total -= f64::from(logprob_of(row, next));
                    scored += 1;
                }
            }
        }
    }
    let nll = total / scored.max(1) as f64;
    Ok(Perplexity {
        tokens: ids.len(),
        windows: ids.len().div_ceil(window),
        scored,
        nll,
        perplexity: nll.exp(),
    })
}

/// Logits of every prompt position, by the prefill or the decode path.
fn logits<B: Backend>(backend: &B, ids: &[u32], path: PathKind) -> Result<Vec<Vec<f32>>> {
    let vocab = backend.config().vocab_size;
    let mut state = backend.new_state()?;
    let flat = match path {
        PathKind::Prefill => backend.prefill(&mut state, ids, LogitsFor::All)?,
        PathKind::Decode => {
            let mut all = Vec::with_capacity(ids.len() * vocab);
            for &id in ids {
                all.extend(backend.decode(&mut [&mut state], &[id])?);
            }
            all
        }
    };
    Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}

fn run_generate<B: Backend>(backend: &B, args: &GenerateArgs) -> Result<()> {
    let tokenizer = match (&args.prompt, args.json) {
        (Some(_), _) | (None, false) => Some(Tokenizer::from_model_dir(&args.model)?),
        (None, true) => Tokenizer::from_model_dir(&args.model).ok(),
    };
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.0.clone(),
        (Some(text), None) => {
            let tokenizer = tokenizer
                .as_ref()
                .context("a text prompt needs tokenizer.json")?;
            let text = if args.chat {
                let template = ChatTemplate::from_model_dir(&args.model)?;
                template.render(&serde_json::json!({
                    "messages": [{"role": "user", "content": text}],
                    "add_generation_prompt": true,
                }))?
            } else {
                text.clone()
            };
            tokenizer.encode(&text)?
        }
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let params = GenerationParams {
        max_tokens: args.max_tokens as usize,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            repetition_penalty: args.penalties.repetition_penalty,
            presence_penalty: args.penalties.presence_penalty,
            frequency_penalty: args.penalties.frequency_penalty,
            seed: args.seed,
        },
        stop: args.stop.clone(),
        eos_token_ids: eos_token_ids(&args.model, backend.config())?,
        end_after_ids: Vec::new(),
        min_tokens: 0,
    };
    let stream_text = !args.json;
    let mut stdout = std::io::stdout().lock();
    let result = generate(backend, tokenizer.as_ref(), &prompt_ids, &params, |text| {
        if stream_text {
            stdout.write_all(text.as_bytes())?;
            stdout.flush()?;
        }
        Ok(())
    })?;
    drop(stdout);
    if args.json {
        print_out(&format!("{}\n", serde_json::to_string(&result)?))
    } else {
        print_out("\n")
    }
}

/// `serve --max-batch` unless told otherwise.
const DEFAULT_MAX_BATCH: usize = 32;

/// Default `serve --prefill-chunk` per device: short on the CPU so that decode steps of other
/// requests are not held up long; on CUDA the backend's own chunk (`DEFAULT_PREFILL_CHUNK`).
const CPU_PREFILL_CHUNK: usize = 512;
const CUDA_PREFILL_CHUNK: usize = 4096;
#[cfg(feature = "cuda")]
const _: () = assert!(CUDA_PREFILL_CHUNK == lily::backend::cuda::DEFAULT_PREFILL_CHUNK);

fn serve(args: ServeArgs) -> Result<()> {
    let (model, served) = match &args.model {
        Some(dir) => ServedModel::load(dir)?,
        None => ServedModel::demo()?,
    };
    let options = ServeOptions {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        max_batch: args.max_batch.map_or(DEFAULT_MAX_BATCH, |n| n as usize),
        fit_max_batch: args.max_batch.is_none(),
        max_queue: args.max_queue,
        context: args.device.context as usize,
        prefill_chunk: args.prefill_chunk.map_or(
            match args.device.device {
                Device::Cpu => CPU_PREFILL_CHUNK,
                Device::Cuda => CUDA_PREFILL_CHUNK,
            },
            |n| n as usize,
        ),
        prefix_cache: args.prefix_cache,
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: std::time::Duration::from_secs(args.shutdown_grace),
    };
    match args.device.device {
        Device::Cpu => {
            let make_backend = move || {
                lily::server::page_in_weights(&model);
                Ok(CpuBackend::new(model))
            };
            lily::server::run(served, make_backend, options)
        }
        Device::Cuda => serve_on_cuda(model, served, options),
    }
}

/// Serves on the GPU: one CUDA sequence slot per `--max-batch`, each `--context` long, and, as
/// far as the free memory allows, one per `--prefix-cache` entry and one for the copy a sequence
/// starting from a cached prefix takes.
#[cfg(feature = "cuda")]
fn serve_on_cuda(model: Arc<Model>, served: ServedModel, options: ServeOptions) -> Result<()> {
    let cuda = lily::backend::cuda::CudaOptions {
        max_context: options.context.min(served.max_position_embeddings),
        max_sequences: options.max_batch,
        spare_sequences: options.prefix_cache + usize::from(options.prefix_cache > 0),
        fit_sequences: options.fit_max_batch,
        use_graphs: true,
        prefill_chunk: options.prefill_chunk,
        fold_router: true,
    };
    lily::server::run(
        served,
        move || lily::backend::cuda::CudaBackend::new(&model, cuda),
        options,
    )
}

#[cfg(not(feature = "cuda"))]
fn serve_on_cuda(_: Arc<Model>, _: ServedModel, _: ServeOptions) -> Result<()> {
    anyhow::bail!("this lily was built without CUDA: rebuild with `--features cuda`")
}

fn read_stdin() -> Result<String> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading stdin")?;
    Ok(text)
}
