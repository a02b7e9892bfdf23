//! Lily: a single-process inference engine specialised for Qwen3.6-35B-A3B (`qwen3_5_moe`).
//!
//! The crate is laid out the way the engine works:
//! - [`config`]: the model's hyper-parameters and layer plan, read from `config.json`;
//! - [`checkpoint`]: memory-mapped safetensors files and tensor look-up;
//! - [`quant`]: MLX affine quantisation (settings, math, bit packing);
//! - [`model`]: the model's weights (described once, for every backend) and per-sequence state;
//! - [`backend`]: implementations of prefill and decode (the CPU reference today);
//! - [`convert`]: `lily convert`, bf16 checkpoints to MLX-LM quantised checkpoints;
//! - [`engine`]: sampling, stop conditions and the generation loop;
//! - [`text`]: tokenizer, streaming detokenisation and the chat template;
//! - `bench` (with the `cuda` feature): prefill and decode speed on the GPU.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod engine;
pub mod model;
pub mod quant;
pub mod server;
pub mod text;
