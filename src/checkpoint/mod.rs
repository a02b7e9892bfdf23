//! Checkpoint files: memory-mapped safetensors (single or sharded) and typed tensor look-up.
