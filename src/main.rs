//! The `lily` command line.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
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
    /// Read one JSON object on stdin (`messages`, `tools`, ...) and print the rendered chat prompt.
    Render {
        /// Checkpoint directory (holding the chat template).
        #[arg(long)]
        model: PathBuf,
    },
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
