//! Writing a checkpoint directory safely and in bounded memory: a staging directory beside the
//! destination that is renamed into place only when complete (and removed on failure), and
//! safetensors shards whose header is written first and whose tensors are then streamed in.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

/// A directory being written next to its final place. Dropped before [`StagingDir::commit`], it
/// is removed, so an interrupted conversion leaves nothing that looks like a checkpoint.
pub struct StagingDir {
    path: PathBuf,
    committed: bool,
}

impl StagingDir {
    /// Creates `.NAME.partial-PID` beside `dst`, which must not exist yet.
    pub fn create(dst: &Path) -> Result<Self> {
        ensure!(
            !dst.exists(),
            "{} already exists: choose a new output directory",
            dst.display()
        );
        let name = dst
            .file_name()
            .with_context(|| format!("{} does not name a directory", dst.display()))?;
        let parent = match dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        let path = parent.join(format!(
            ".{}.partial-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove the stale {}", path.display()))?;
        }
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self {
            path,
            committed: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the finished directory to `dst`.
    pub fn commit(mut self, dst: &Path) -> Result<()> {
        ensure!(
            !dst.exists(),
            "{} appeared while converting; the result is left in {}",
            dst.display(),
            self.path.display()
        );
        std::fs::rename(&self.path, dst).with_context(|| {
            format!("cannot rename {} to {}", self.path.display(), dst.display())
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the directory's name already marks it as incomplete.
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The name, element type and shape of one tensor to write.
#[derive(Clone, Debug)]
pub struct TensorHeader {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorHeader {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// The shard file names MLX-LM uses: `model.safetensors` alone, else `model-0000i-of-0000n`.
pub fn shard_file_name(index: usize, count: usize) -> String {
    if count == 1 {
        "model.safetensors".to_string()
    } else {
        format!("model-{:05}-of-{count:05}.safetensors", index + 1)
    }
}

/// Writes one safetensors file: the header for `tensors` (laid out in that order), then their
/// bytes as `fill` produces them. `fill` gets the file as a [`Write`] and must write exactly the
/// tensors' bytes, in order.
pub fn write_safetensors(
    path: &Path,
    tensors: &[TensorHeader],
    fill: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|t| {
            let len = t.byte_len();
            let info = TensorInfo {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + len),
            };
            offset += len;
            (t.name.clone(), info)
        })
        .collect();
    let format = HashMap::from([("format".to_string(), "mlx".to_string())]);
    let metadata = Metadata::new(Some(format), infos)
        .map_err(|e| anyhow::anyhow!("bad tensor header for {}: {e}", path.display()))?;
    let mut header = serde_json::to_vec(&metadata)?;
    // The data that follows starts 8-byte aligned, as the format recommends.
    header.resize(header.len().next_multiple_of(8), b' ');

    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = CountingWriter {
        inner: BufWriter::with_capacity(1 << 22, file),
        written: 0,
    };
    let result = (|| -> Result<()> {
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        let data_start = out.written;
        fill(&mut out)?;
        if out.written - data_start != offset {
            bail!(
                "wrote {} bytes of tensor data, expected {offset}",
                out.written - data_start
            );
        }
        out.inner.flush()?;
        out.inner.get_ref().sync_all()?;
        Ok(())
    })();
    result.with_context(|| format!("writing {}", path.display()))
}

/// Counts the bytes going through, to check each file gets exactly what its header promises.
struct CountingWriter<W> {
    inner: W,
    written: usize,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `model.safetensors.index.json` as MLX-LM does: totals, and the file of each tensor,
/// sorted by name.
pub fn write_index(
    dir: &Path,
    total_size: usize,
    total_parameters: usize,
    weight_map: BTreeMap<String, String>,
) -> Result<()> {
    let index = serde_json::json!({
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": weight_map,
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)
}

/// Writes `value` as JSON indented by four spaces (MLX-LM's style).
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut bytes = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut serializer = serde_json::Serializer::with_formatter(&mut bytes, formatter);
    serde::Serialize::serialize(value, &mut serializer)?;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
