//! The tokenizer (`tokenizer.json` through the `tokenizers` crate).

use std::path::Path;

use anyhow::{Context, Result, anyhow};

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a checkpoint directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Loads `tokenizer.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(Self { inner })
    }

    /// Encodes text; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))
            .context("encode")?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }
}
