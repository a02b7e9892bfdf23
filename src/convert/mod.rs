//! `lily convert`: a Hugging Face checkpoint (bf16, f16 or f32) to an MLX-LM quantised checkpoint.
//!
//! The output is what `mlx_lm.convert -q` writes for this model: tensors renamed under
//! `language_model.`, experts stacked as `switch_mlp.{gate,up,down}_proj`, conv1d moved to
//! `[channels, kernel, 1]`, the `+1` folded into the RMSNorm weights, float tensors cast to the
//! checkpoint's `dtype` (A_log excepted), every linear layer and the embedding quantised when the
//! group size divides its inputs (routers and shared-expert gates at 8 bits, group 64), and
//! `config.json` with the `quantization` block. Tokenizer, template and generation files are copied.
//!
//! Conversion streams: the source stays memory-mapped, each output tensor is produced a block of
//! rows at a time and written straight into its shard (see `writer`), so memory stays bounded
//! whatever the model size. Everything is written into a staging directory that is renamed into
//! place only after the result loads back.

mod writer;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::{Map, Value};

use self::writer::{StagingDir, TensorHeader, shard_file_name, write_index, write_json};
use crate::checkpoint::{Checkpoint, DType, convert_from_f32, round_to};
use crate::config::{LayerKind, ModelConfig};
use crate::model::{Layout, Matrix, Mixer, Model, Storage};
use crate::quant::{QuantSpec, Quantization, quantize_row};

/// What MLX-LM's predicate for this model gives the routers (`mlp.gate`) and shared-expert gates.
const GATE_SPEC: QuantSpec = QuantSpec {
    bits: 8,
    group_size: 64,
};

/// MLX-LM's shard size: a new file starts before one would pass 5 GiB.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5 << 30;

/// Source values converted and quantised at a time (per output tensor): 4 MiB of f32.
const BLOCK_VALUES: usize = 1 << 20;

/// Files copied from the source directory as they are, besides those named `tokenizer*`.
const COPIED_FILES: [&str; 8] = [
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
];

/// How to convert.
pub struct ConvertOptions {
    /// Bits and group size of every quantised matrix but the gates.
    pub spec: QuantSpec,
    /// Largest shard file, in bytes (a tensor larger than this gets a file of its own).
    pub max_shard_bytes: usize,
    /// Draw a progress bar on stderr (when it is a terminal).
    pub progress: bool,
}

/// What a conversion did.
#[derive(Debug)]
pub struct ConvertSummary {
    /// Bytes of source tensors read.
    pub source_bytes: usize,
    /// Bytes of tensors written.
    pub written_bytes: usize,
    pub tensors: usize,
    pub shards: usize,
    pub seconds: f64,
}

/// Converts the checkpoint in `src` into a new MLX-LM checkpoint directory `dst`.
pub fn convert(src: &Path, dst: &Path, options: &ConvertOptions) -> Result<ConvertSummary> {
    convert_inner(src, dst, options)
        .with_context(|| format!("converting {} into {}", src.display(), dst.display()))
}

fn convert_inner(src: &Path, dst: &Path, options: &ConvertOptions) -> Result<ConvertSummary> {
    let started = Instant::now();
    let config_path = src.join("config.json");
    let config_text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("cannot read {}", config_path.display()))?;
    let root: Value = serde_json::from_str(&config_text)
        .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    let config = ModelConfig::from_json_str(&config_text)
        .with_context(|| format!("invalid {}", config_path.display()))?;
    ensure!(
        config.quantization.is_none(),
        "{} already describes a quantised checkpoint (it has a `quantization` block)",
        config_path.display()
    );
    let checkpoint = Checkpoint::open(src)?;
    let Layout::HuggingFace { prefix } = Layout::detect(&checkpoint)? else {
        bail!(
            "{} is already in MLX-LM's layout: convert from the original checkpoint",
            src.display()
        );
    };
    // Loading checks every tensor's presence, shape and dtype before anything is written.
    let model = Model::from_checkpoint(config, &checkpoint)
        .with_context(|| format!("reading the source checkpoint in {}", src.display()))?;

    let mut plan = Plan {
        model: &model,
        checkpoint: &checkpoint,
        source_prefix: prefix,
        spec: options.spec,
        dtype: target_dtype(&root),
        outputs: Vec::new(),
        overrides: Vec::new(),
    };
    plan.build()?;
    let quantization = Quantization::new(options.spec, std::mem::take(&mut plan.overrides));

    let staging = StagingDir::create(dst)?;
    let shards = split_into_shards(&plan.outputs, options.max_shard_bytes);
    let written_bytes: usize = plan.outputs.iter().map(Output::byte_len).sum();
    write_shards(staging.path(), &shards, written_bytes, options.progress)?;
    copy_side_files(src, staging.path())?;
    write_json(
        &staging.path().join("config.json"),
        &output_config(&root, src, &quantization)?,
    )?;
    Model::load(staging.path()).context("checking that the converted checkpoint loads")?;
    staging.commit(dst)?;

    Ok(ConvertSummary {
        source_bytes: plan.outputs.iter().map(Output::source_bytes).sum(),
        written_bytes,
        tensors: plan.outputs.iter().map(|o| o.headers().len()).sum(),
        shards: shards.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Writes the shard files and their index into `dir`.
fn write_shards(
    dir: &Path,
    shards: &[Vec<&Output>],
    total_bytes: usize,
    show_progress: bool,
) -> Result<()> {
    let progress = progress_bar(show_progress, total_bytes);
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = shard_file_name(i, shards.len());
        let headers: Vec<TensorHeader> = shard.iter().flat_map(|o| o.headers()).collect();
        for h in &headers {
            weight_map.insert(h.name.clone(), file.clone());
        }
        writer::write_safetensors(&dir.join(&file), &headers, |out| {
            let mut out = progress.wrap_write(out);
            for output in shard {
                output
                    .write(&mut out)
                    .with_context(|| format!("converting `{}`", output.name))?;
            }
            Ok(())
        })?;
    }
    progress.finish_and_clear();
    let parameters = shards.iter().flatten().map(|o| o.parameters()).sum();
    write_index(dir, total_bytes, parameters, weight_map)
}

/// The dtype MLX-LM casts float tensors to: `torch_dtype`, else the text model's `dtype`
/// (`text_config.dtype`; in a text-only config, its own), when it is a float type (otherwise
/// tensors keep their own).
fn target_dtype(root: &Value) -> Option<DType> {
    let text = root.get("text_config").unwrap_or(root);
    let named = match root.get("torch_dtype").filter(|v| !v.is_null()) {
        Some(v) => Some(v),
        None => text.get("dtype"),
    };
    named
        .and_then(Value::as_str)
        .and_then(DType::from_config_name)
}

/// How one output is encoded.
#[derive(Clone, Copy)]
enum Encoding {
    /// One tensor of this dtype.
    Dense(DType),
    /// `.weight` (packed words), `.scales` and `.biases`; values are rounded to `dtype` first (as
    /// MLX-LM casts before quantising), and scales and biases are stored in it.
    Quantized { spec: QuantSpec, dtype: DType },
}

/// One output: a dense tensor, or a quantised matrix (three tensors written together).
struct Output {
    /// The dense tensor's name, or the quantised module's path.
    name: String,
    /// The shape of the values (for a quantised matrix, before packing).
    shape: Vec<usize>,
    /// The source, as dense matrices whose rows follow each other.
    rows: Vec<Matrix>,
    /// Add one to every value (the RMSNorm weights MLX-LM folds).
    add_one: bool,
    encoding: Encoding,
}

impl Output {
    fn headers(&self) -> Vec<TensorHeader> {
        match self.encoding {
            Encoding::Dense(dtype) => vec![TensorHeader {
                name: self.name.clone(),
                dtype: dtype.safetensors(),
                shape: self.shape.clone(),
            }],
            Encoding::Quantized { spec, dtype } => {
                let (&cols, outer) = self.shape.split_last().expect("matrices have two axes");
                let with_last = |last: usize| [outer, &[last]].concat();
                let groups = with_last(spec.groups_per_row(cols));
                vec![
                    TensorHeader {
                        name: format!("{}.weight", self.name),
                        dtype: Dtype::U32,
                        shape: with_last(spec.words_per_row(cols)),
                    },
                    TensorHeader {
                        name: format!("{}.scales", self.name),
                        dtype: dtype.safetensors(),
                        shape: groups.clone(),
                    },
                    TensorHeader {
                        name: format!("{}.biases", self.name),
                        dtype: dtype.safetensors(),
                        shape: groups,
                    },
                ]
            }
        }
    }

    fn byte_len(&self) -> usize {
        self.headers().iter().map(TensorHeader::byte_len).sum()
    }

    /// Bytes of source tensors this output reads.
    fn source_bytes(&self) -> usize {
        self.rows.iter().map(Matrix::stored_bytes).sum()
    }

    /// Parameters as MLX-LM counts them: the values before quantisation.
    fn parameters(&self) -> usize {
        self.shape.iter().product()
    }

    /// Writes the output's tensors, a block of source rows at a time.
    fn write(&self, out: &mut dyn Write) -> Result<()> {
        let (mut scales, mut biases) = (Vec::new(), Vec::new());
        let mut bytes = Vec::new();
        for part in &self.rows {
            let cols = part.cols;
            let block_rows = (BLOCK_VALUES / cols).max(1);
            for start in (0..part.rows).step_by(block_rows) {
                let count = block_rows.min(part.rows - start);
                let values = self.source_rows(part, start, count);
                // Done with these source rows: their pages need not stay resident.
                part.row_block(start, count).release_resident();
                bytes.clear();
                match self.encoding {
                    Encoding::Dense(dtype) => convert_from_f32(dtype, &values, &mut bytes),
                    Encoding::Quantized { spec, dtype } => {
                        let q = quantize_rows(spec, &values, cols);
                        bytes.extend(q.words.iter().flat_map(|w| w.to_le_bytes()));
                        convert_from_f32(dtype, &q.scales, &mut scales);
                        convert_from_f32(dtype, &q.biases, &mut biases);
                    }
                }
                out.write_all(&bytes)?;
            }
        }
        out.write_all(&scales)?;
        out.write_all(&biases)?;
        Ok(())
    }

    /// Rows `[start, start + count)` of `part` as f32, with the `+1` applied and, before
    /// quantisation, rounded to the dtype MLX-LM casts to.
    fn source_rows(&self, part: &Matrix, start: usize, count: usize) -> Vec<f32> {
        let mut values = vec![0.0f32; count * part.cols];
        values
            .par_chunks_exact_mut(part.cols)
            .enumerate()
            .for_each(|(i, row)| {
                part.rows_to_f32(start + i, row);
                if self.add_one {
                    row.iter_mut().for_each(|v| *v += 1.0);
                }
                if let Encoding::Quantized { dtype, .. } = self.encoding {
                    round_to(dtype, row);
                }
            });
        values
    }
}

/// Packed words, scales and biases of a block of rows.
struct QuantizedRows {
    words: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
}

fn quantize_rows(spec: QuantSpec, values: &[f32], cols: usize) -> QuantizedRows {
    let rows = values.len() / cols;
    let (words_per_row, groups) = (spec.words_per_row(cols), spec.groups_per_row(cols));
    let mut q = QuantizedRows {
        words: vec![0; rows * words_per_row],
        scales: vec![0.0; rows * groups],
        biases: vec![0.0; rows * groups],
    };
    values
        .par_chunks_exact(cols)
        .zip(q.words.par_chunks_exact_mut(words_per_row))
        .zip(q.scales.par_chunks_exact_mut(groups))
        .zip(q.biases.par_chunks_exact_mut(groups))
        .for_each(|(((row, words), scales), biases)| {
            quantize_row(spec, row, words, scales, biases)
        });
    q
}

/// Builds the list of outputs from the loaded source model.
struct Plan<'a> {
    model: &'a Model,
    checkpoint: &'a Checkpoint,
    source_prefix: &'static str,
    spec: QuantSpec,
    /// What float tensors are cast to (`None`: each keeps its dtype).
    dtype: Option<DType>,
    outputs: Vec<Output>,
    /// Modules quantised otherwise than `spec` (the gates), for `config.json`.
    overrides: Vec<(String, QuantSpec)>,
}

impl Plan<'_> {
    fn build(&mut self) -> Result<()> {
        let model = self.model;
        let c = &model.config;
        let out = Layout::MLX_PREFIX;
        self.matrix(
            format!("{out}embed_tokens"),
            vec![c.vocab_size, c.hidden_size],
            vec![model.embed_tokens.clone()],
            None,
        )?;
        for (i, layer) in model.layers.iter().enumerate() {
            let p = format!("layers.{i}.");
            self.vector(&format!("{p}input_layernorm.weight"), true, true)?;
            match (&layer.mixer, c.layer_kinds[i]) {
                (Mixer::Attention(a), LayerKind::FullAttention) => {
                    let s = format!("{p}self_attn.");
                    for (name, w) in [
                        ("q_proj", &a.q_proj),
                        ("k_proj", &a.k_proj),
                        ("v_proj", &a.v_proj),
                        ("o_proj", &a.o_proj),
                    ] {
                        self.layer_matrix(&format!("{s}{name}"), w, None)?;
                    }
                    self.vector(&format!("{s}q_norm.weight"), true, true)?;
                    self.vector(&format!("{s}k_norm.weight"), true, true)?;
                }
                (Mixer::DeltaNet(d), LayerKind::LinearAttention) => {
                    let l = format!("{p}linear_attn.");
                    for (name, w) in [
                        ("in_proj_qkv", &d.in_proj_qkv),
                        ("in_proj_z", &d.in_proj_z),
                        ("in_proj_b", &d.in_proj_b),
                        ("in_proj_a", &d.in_proj_a),
                        ("out_proj", &d.out_proj),
                    ] {
                        self.layer_matrix(&format!("{l}{name}"), w, None)?;
                    }
                    self.conv1d(&format!("{l}conv1d.weight"))?;
                    // MLX-LM's cast skips A_log.
                    self.vector(&format!("{l}A_log"), false, false)?;
                    self.vector(&format!("{l}dt_bias"), false, true)?;
                    self.vector(&format!("{l}norm.weight"), false, true)?;
                }
                _ => bail!("layer {i} does not match the configuration's layer plan"),
            }
            self.vector(&format!("{p}post_attention_layernorm.weight"), true, true)?;

            let m = format!("{p}mlp.");
            let moe = &layer.moe;
            self.layer_matrix(&format!("{m}gate"), &moe.router, Some(GATE_SPEC))?;
            let (e, inter, h) = (c.num_experts, c.moe_intermediate_size, c.hidden_size);
            let stacked: [(&str, Vec<Matrix>, [usize; 3]); 3] = [
                (
                    "gate_proj",
                    moe.experts.iter().map(|x| x.gate.clone()).collect(),
                    [e, inter, h],
                ),
                (
                    "up_proj",
                    moe.experts.iter().map(|x| x.up.clone()).collect(),
                    [e, inter, h],
                ),
                (
                    "down_proj",
                    moe.experts.iter().map(|x| x.down.clone()).collect(),
                    [e, h, inter],
                ),
            ];
            for (name, parts, shape) in stacked {
                self.matrix(
                    format!("{out}{m}switch_mlp.{name}"),
                    shape.to_vec(),
                    parts,
                    None,
                )?;
            }
            let shared = &moe.shared_expert;
            for (name, w) in [
                ("gate_proj", &shared.gate),
                ("up_proj", &shared.up),
                ("down_proj", &shared.down),
            ] {
                self.layer_matrix(&format!("{m}shared_expert.{name}"), w, None)?;
            }
            self.layer_matrix(
                &format!("{m}shared_expert_gate"),
                &moe.shared_expert_gate,
                Some(GATE_SPEC),
            )?;
        }
        self.vector("norm.weight", true, true)?;
        if !c.tie_word_embeddings {
            self.matrix(
                "language_model.lm_head".to_string(),
                vec![c.vocab_size, c.hidden_size],
                vec![model.lm_head.clone()],
                None,
            )?;
        }
        Ok(())
    }

    /// A linear layer's weight under the text model's prefix.
    fn layer_matrix(&mut self, module: &str, w: &Matrix, gate: Option<QuantSpec>) -> Result<()> {
        self.matrix(
            format!("{}{module}", Layout::MLX_PREFIX),
            vec![w.rows, w.cols],
            vec![w.clone()],
            gate,
        )
    }

    /// A weight matrix: quantised when the group size divides its inputs (as MLX-LM decides),
    /// with `gate`'s setting instead of the default for the gates.
    fn matrix(
        &mut self,
        path: String,
        shape: Vec<usize>,
        rows: Vec<Matrix>,
        gate: Option<QuantSpec>,
    ) -> Result<()> {
        let source_dtype = match rows.first().map(|m| &m.storage) {
            Some(Storage::Dense { dtype, .. }) => *dtype,
            _ => bail!("`{path}`: the source must hold dense (unquantised) weights"),
        };
        let dtype = self.dtype.unwrap_or(source_dtype);
        let cols = *shape.last().expect("matrices have two axes");
        let (name, encoding) = if self.spec.fits(cols) {
            let spec = gate.unwrap_or(self.spec);
            ensure!(
                spec.fits(cols),
                "`{path}` has {cols} inputs, which groups of {} do not divide",
                spec.group_size
            );
            if gate.is_some() {
                self.overrides.push((path.clone(), spec));
            }
            (path, Encoding::Quantized { spec, dtype })
        } else {
            (format!("{path}.weight"), Encoding::Dense(dtype))
        };
        self.outputs.push(Output {
            name,
            shape,
            rows,
            add_one: false,
            encoding,
        });
        Ok(())
    }

    /// A vector (norm weight, A_log, dt_bias), read from the source checkpoint as stored.
    fn vector(&mut self, name: &str, add_one: bool, cast: bool) -> Result<()> {
        let t = self
            .checkpoint
            .tensor(&format!("{}{name}", self.source_prefix))?;
        let len = t.shape.iter().product();
        let dtype = if cast { self.dtype } else { None }.unwrap_or(t.dtype);
        self.outputs.push(Output {
            name: format!("{}{name}", Layout::MLX_PREFIX),
            shape: vec![len],
            rows: vec![Matrix::dense(&t.reshaped(1, len), 1, len)?],
            add_one,
            encoding: Encoding::Dense(dtype),
        });
        Ok(())
    }

    /// The depthwise convolution, `[channels, 1, kernel]` becoming MLX's `[channels, kernel, 1]`
    /// (the same element order).
    fn conv1d(&mut self, name: &str) -> Result<()> {
        let t = self
            .checkpoint
            .tensor(&format!("{}{name}", self.source_prefix))?;
        let &[channels, _, kernel] = t.shape.as_slice() else {
            bail!("tensor `{}` is not three-dimensional", t.name);
        };
        self.outputs.push(Output {
            name: format!("{}{name}", Layout::MLX_PREFIX),
            shape: vec![channels, kernel, 1],
            rows: vec![Matrix::dense(
                &t.reshaped(channels, kernel),
                channels,
                kernel,
            )?],
            add_one: false,
            encoding: Encoding::Dense(self.dtype.unwrap_or(t.dtype)),
        });
        Ok(())
    }
}

/// Groups outputs into shards in order, starting a new one before one would pass `max_bytes`.
fn split_into_shards(outputs: &[Output], max_bytes: usize) -> Vec<Vec<&Output>> {
    let mut shards: Vec<Vec<&Output>> = Vec::new();
    let mut size = 0;
    for output in outputs {
        let len = output.byte_len();
        if shards.is_empty() || size + len > max_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("just pushed").push(output);
        size += len;
    }
    shards
}

fn progress_bar(enabled: bool, total_bytes: usize) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total_bytes as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} converting [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

/// `config.json` as MLX-LM saves it: the source's, in the wrapper form, with the
/// `generation_config.json` end-of-sequence id at the top, without `vision_config`, with the
/// `quantization` block (also as `quantization_config`), keys sorted.
fn output_config(root: &Value, src: &Path, quantization: &Quantization) -> Result<Value> {
    let source = root.as_object().context("config.json is not an object")?;
    let mut config = if source.contains_key("text_config") {
        source.clone()
    } else {
        // A text-only export: MLX-LM reads this model only in the wrapper form.
        let tie = source.get("tie_word_embeddings").cloned();
        let mut wrapper = Map::new();
        wrapper.insert(
            "architectures".into(),
            serde_json::json!(["Qwen3_5MoeForConditionalGeneration"]),
        );
        wrapper.insert("model_type".into(), "qwen3_5_moe".into());
        wrapper.insert("text_config".into(), root.clone());
        wrapper.insert("tie_word_embeddings".into(), tie.unwrap_or(false.into()));
        wrapper
    };
    let generation_path = src.join("generation_config.json");
    if generation_path.is_file() {
        let text = std::fs::read_to_string(&generation_path)
            .with_context(|| format!("cannot read {}", generation_path.display()))?;
        let generation: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", generation_path.display()))?;
        if let Some(eos) = generation
            .get("eos_token_id")
            .filter(|v| !v.is_null() && *v != &Value::Bool(false))
        {
            config.insert("eos_token_id".into(), eos.clone());
        }
    }
    config.remove("vision_config");
    let block = quantization.to_json();
    config.insert("quantization".into(), block.clone());
    config.insert("quantization_config".into(), block);
    let sorted: BTreeMap<String, Value> = config.into_iter().collect();
    Ok(Value::Object(sorted.into_iter().collect()))
}

/// Copies the tokenizer, chat template and generation files of `src` into `dst`.
fn copy_side_files(src: &Path, dst: &Path) -> Result<()> {
    let entries =
        std::fs::read_dir(src).with_context(|| format!("cannot read {}", src.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot read {}", src.display()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let wanted = name.starts_with("tokenizer") || COPIED_FILES.contains(&name.as_ref());
        if wanted && entry.path().is_file() {
            std::fs::copy(entry.path(), dst.join(name.as_ref())).with_context(|| {
                format!(
                    "cannot copy {} into {}",
                    entry.path().display(),
                    dst.display()
                )
            })?;
        }
    }
    Ok(())
}
