//! The `lily` command line.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, LogitsFor};
use lily::convert::{ConvertOptions, DEFAULT_MAX_SHARD_BYTES, convert};
use lily::model::Model;
use lily::quant::QuantSpec;
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
    /// Read text on stdin and print its token ids as a JSON array.
    Tokenize {
        /// Checkpoint directory (holding tokenizer.json).
        #[arg(long)]
        model: PathBuf,
    },
    /// Print the logits of every prompt position as JSON: `{"logits": [[...], ...]}`.
    Logits {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids, comma separated.
        #[arg(long, value_parser = parse_ids)]
        prompt_ids: Ids,
        /// Compute with the prefill path (whole prompt at once) or the decode path (one token at a time).
        #[arg(long, value_enum, default_value_t = PathKind::Prefill)]
        path: PathKind,
    },
    /// Compile every CUDA kernel with NVRTC (no GPU needed); exits non-zero on any error.
    #[cfg(feature = "cuda")]
    Kernels {
        /// Compile everything and report (the only mode).
        #[arg(long)]
        check: bool,
    },
    /// Read one JSON object on stdin (`messages`, `tools`, ...) and print the rendered chat prompt.
    Render {
        /// Checkpoint directory (holding the chat template).
        #[arg(long)]
        model: PathBuf,
    },
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

/// Token ids given on the command line.
#[derive(Clone, Debug)]
struct Ids(Vec<u32>);

fn parse_ids(s: &str) -> Result<Ids, String> {
    let ids = s
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("{t:?} is not a token id"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Ids(ids))
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

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tokenize { model } => {
            let tokenizer = Tokenizer::from_model_dir(&model)?;
            let text = read_stdin()?;
            println!("{}", serde_json::to_string(&tokenizer.encode(&text)?)?);
        }
        Command::Logits {
            model,
            prompt_ids,
            path,
        } => {
            let backend = CpuBackend::new(Arc::new(Model::load(&model)?));
            let ids = prompt_ids.0;
            let vocab = backend.config().vocab_size;
            let mut state = backend.new_state()?;
            let logits = match path {
                PathKind::Prefill => backend.prefill(&mut state, &ids, LogitsFor::All)?,
                PathKind::Decode => {
                    let mut all = Vec::with_capacity(ids.len() * vocab);
                    for &id in &ids {
                        all.extend(backend.decode(&mut [&mut state], &[id])?);
                    }
                    all
                }
            };
            let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
            println!("{}", serde_json::json!({ "logits": rows }));
        }
        #[cfg(feature = "cuda")]
        Command::Kernels { check } => {
            anyhow::ensure!(check, "use `lily kernels --check`");
            lily::backend::cuda::kernels::check_all()?;
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
            print!("{}", template.render(&context)?);
        }
    }
    Ok(())
}

fn read_stdin() -> Result<String> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading stdin")?;
    Ok(text)
}
