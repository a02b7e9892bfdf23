//! Checkpoint files: memory-mapped safetensors (single or sharded) and typed tensor look-up.
//!
//! Files are mapped, never read into memory whole: a [`Tensor`] is a typed view of a byte range
//! of a mapping. Every error names the file and, where there is one, the tensor.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use memmap2::{Mmap, MmapMut, UncheckedAdvice};
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};

/// Element types lily computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

impl DType {
    /// The safetensors element type of the same name.
    pub fn safetensors(self) -> Dtype {
        match self {
            DType::BF16 => Dtype::BF16,
            DType::F16 => Dtype::F16,
            DType::F32 => Dtype::F32,
        }
    }

    /// The dtype a `config.json` names (`torch_dtype`, `dtype`), if lily computes with it.
    pub fn from_config_name(name: &str) -> Option<Self> {
        match name {
            "bfloat16" => Some(DType::BF16),
            "float16" => Some(DType::F16),
            "float32" => Some(DType::F32),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        })
    }
}

/// A contiguous byte range of a mapped file.
#[derive(Clone)]
pub struct Bytes {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// Tells the kernel these bytes will not be read again soon: their pages leave the process's
    /// resident set (they stay in the page cache, and a later read faults them back in). Streaming
    /// readers call this so that memory use stays bounded by what they hold, not what they read.
    pub fn release_resident(&self) {
        // SAFETY: the mapping is shared and read-only, so dropped pages are read again from the
        // file on the next access, unchanged; nothing in lily holds them across this call.
        let result = unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, self.start, self.len)
        };
        // Only a hint: if the kernel declines, memory use is merely higher.
        drop(result);
    }

    /// The sub-range `[offset, offset + len)`.
    pub fn slice(&self, offset: usize, len: usize) -> Bytes {
        assert!(offset + len <= self.len, "byte range outside the tensor");
        Bytes {
            map: self.map.clone(),
            start: self.start + offset,
            len,
        }
    }
}

/// A tensor in a checkpoint file: name, element type, shape and its bytes in the mapping.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub file: Arc<PathBuf>,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl Tensor {
    /// Fails unless the tensor has exactly `expected` as its shape.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        check_shape(&self.name, &self.file, &self.shape, expected)
    }

    /// The same bytes viewed as `[rows, cols]`; the element count must be the same.
    pub fn reshaped(&self, rows: usize, cols: usize) -> Tensor {
        debug_assert_eq!(rows * cols, self.shape.iter().product::<usize>());
        Tensor {
            shape: vec![rows, cols],
            ..self.clone()
        }
    }

    /// Converts the elements to f32 (for small tensors: norms, gates, biases).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.shape.iter().product()];
        convert_to_f32(self.dtype, self.bytes.as_slice(), &mut out);
        out
    }
}

/// A tensor of uint32 words in a checkpoint file: packed quantised values.
#[derive(Clone)]
pub struct PackedTensor {
    pub name: String,
    pub file: Arc<PathBuf>,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl PackedTensor {
    /// Fails unless the tensor has exactly `expected` as its shape.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        check_shape(&self.name, &self.file, &self.shape, expected)
    }
}

fn check_shape(name: &str, file: &Path, shape: &[usize], expected: &[usize]) -> Result<()> {
    ensure!(
        shape == expected,
        "tensor `{name}` in {} has shape {shape:?}, expected {expected:?}",
        file.display(),
    );
    Ok(())
}

/// Decodes `out.len()` little-endian elements of `dtype` from `bytes` into f32.
pub fn convert_to_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            let n = out.len().min(bytes.len() / 2);
            // The slice conversion uses the CPU's f16 instructions when it has them; it needs
            // 2-byte alignment, which a mapped tensor usually has.
            match bytemuck::try_cast_slice::<u8, u16>(&bytes[..2 * n]) {
                Ok(bits) if cfg!(target_endian = "little") => {
                    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
                    bits.reinterpret_cast::<half::f16>()
                        .convert_to_f32_slice(&mut out[..n]);
                }
                _ => {
                    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    }
                }
            }
        }
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// Appends `values` to `out` as little-endian elements of `dtype`, rounding to nearest-even.
pub fn convert_from_f32(dtype: DType, values: &[f32], out: &mut Vec<u8>) {
    out.reserve(values.len() * dtype.size());
    match dtype {
        DType::BF16 => {
            for &v in values {
                out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        }
        DType::F16 => {
            for &v in values {
                out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        DType::F32 => {
            for &v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Rounds `values` in place to the nearest values `dtype` can hold, as a cast to it would.
pub fn round_to(dtype: DType, values: &mut [f32]) {
    match dtype {
        DType::BF16 => values
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        DType::F16 => values
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        DType::F32 => {}
    }
}

struct TensorEntry {
    file: usize,
    dtype: Option<DType>,
    raw_dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

struct MappedFile {
    path: Arc<PathBuf>,
    map: Arc<Mmap>,
}

/// All safetensors files of a checkpoint directory, with an index of their tensors.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<MappedFile>,
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Opens `DIR/model.safetensors.index.json` and its shards, or else every `*.safetensors`
    /// file of the directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let paths = if index_path.exists() {
            shard_paths(dir, &index_path)?
        } else {
            let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot read checkpoint directory {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            paths.sort();
            ensure!(
                !paths.is_empty(),
                "no model.safetensors.index.json and no *.safetensors file in {}",
                dir.display()
            );
            paths
        };
        let mut checkpoint = Checkpoint {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for path in paths {
            checkpoint.add_file(path)?;
        }
        Ok(checkpoint)
    }

    /// A checkpoint held in memory: one safetensors file's bytes (`name` stands for its path in
    /// messages). Built-in models use this; the bytes are copied into an anonymous mapping.
    pub fn from_memory(name: &str, safetensors_bytes: &[u8]) -> Result<Self> {
        let mut anonymous = MmapMut::map_anon(safetensors_bytes.len().max(1))
            .context("cannot allocate memory for a checkpoint")?;
        anonymous[..safetensors_bytes.len()].copy_from_slice(safetensors_bytes);
        let map = anonymous
            .make_read_only()
            .context("cannot protect an in-memory checkpoint")?;
        let mut checkpoint = Checkpoint {
            dir: PathBuf::from(name),
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        checkpoint.add_mapping(PathBuf::from(name), map)?;
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the mapping is read-only; lily never writes checkpoint files while it runs.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        self.add_mapping(path, map)
    }

    fn add_mapping(&mut self, path: PathBuf, map: Mmap) -> Result<()> {
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
            let at_fault = tensor_at_fault(&map).map_or(String::new(), |t| format!(": {t}"));
            anyhow::anyhow!(
                "{} is not a valid safetensors file (truncated or corrupt): {e}{at_fault}",
                path.display()
            )
        })?;
        let data_start = 8 + header_len;
        let file_idx = self.files.len();
        for (name, info) in metadata.tensors() {
            if let Some(previous) = self.tensors.get(&name) {
                bail!(
                    "tensor `{name}` appears in both {} and {}",
                    self.files[previous.file].path.display(),
                    path.display()
                );
            }
            let (begin, end) = info.data_offsets;
            self.tensors.insert(
                name,
                TensorEntry {
                    file: file_idx,
                    dtype: match info.dtype {
                        Dtype::BF16 => Some(DType::BF16),
                        Dtype::F16 => Some(DType::F16),
                        Dtype::F32 => Some(DType::F32),
                        _ => None,
                    },
                    raw_dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + begin,
                    len: end - begin,
                },
            );
        }
        self.files.push(MappedFile {
            path: Arc::new(path),
            map: Arc::new(map),
        });
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of all tensors, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Looks up a floating-point tensor by name.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (entry, file) = self.entry(name)?;
        let Some(dtype) = entry.dtype else {
            bail!(
                "tensor `{name}` in {} has dtype {:?}; expected bf16, f16 or f32",
                file.path.display(),
                entry.raw_dtype
            );
        };
        Ok(Tensor {
            name: name.to_string(),
            file: file.path.clone(),
            dtype,
            shape: entry.shape.clone(),
            bytes: file.bytes(entry),
        })
    }

    /// Looks up a tensor of packed uint32 words by name.
    pub fn packed_tensor(&self, name: &str) -> Result<PackedTensor> {
        let (entry, file) = self.entry(name)?;
        ensure!(
            entry.raw_dtype == Dtype::U32,
            "tensor `{name}` in {} has dtype {:?}; packed quantised weights are U32",
            file.path.display(),
            entry.raw_dtype
        );
        Ok(PackedTensor {
            name: name.to_string(),
            file: file.path.clone(),
            shape: entry.shape.clone(),
            bytes: file.bytes(entry),
        })
    }

    fn entry(&self, name: &str) -> Result<(&TensorEntry, &MappedFile)> {
        let Some(entry) = self.tensors.get(name) else {
            bail!(
                "tensor `{name}` is missing from the checkpoint in {}",
                self.dir.display()
            );
        };
        Ok((entry, &self.files[entry.file]))
    }
}

impl MappedFile {
    fn bytes(&self, entry: &TensorEntry) -> Bytes {
        Bytes {
            map: self.map.clone(),
            start: entry.start,
            len: entry.len,
        }
    }
}

/// The shard files an index names, in a stable order, each checked to exist.
fn shard_paths(dir: &Path, index_path: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index_path)
        .with_context(|| format!("cannot read {}", index_path.display()))?;
    let index: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{}: field `weight_map` is missing", index_path.display()))?;
    let mut files: Vec<&str> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().with_context(|| {
            format!(
                "{}: weight_map entry for `{tensor}` is not a file name",
                index_path.display()
            )
        })?;
        ensure!(
            !file.contains('/') && !file.contains('\\') && file != ".." && file != ".",
            "{}: weight_map entry for `{tensor}` ({file:?}) is not a plain file name",
            index_path.display()
        );
        if !files.contains(&file) {
            files.push(file);
        }
    }
    files.sort_unstable();
    files
        .into_iter()
        .map(|f| {
            let path = dir.join(f);
            ensure!(
                path.is_file(),
                "{} names shard {f}, which is missing",
                index_path.display()
            );
            Ok(path)
        })
        .collect()
}

/// For a header the safetensors crate refused without naming a tensor (a size that does not
/// match the tensor's bytes): the first tensor whose shape and dtype need another number of
/// bytes than its data offsets give, described.
fn tensor_at_fault(file: &[u8]) -> Option<String> {
    let len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header = file.get(8..8usize.checked_add(len)?)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .find_map(|(name, info)| {
            let info: TensorInfo = serde_json::from_value(info).ok()?;
            let (begin, end) = info.data_offsets;
            let needed = info
                .shape
                .iter()
                .try_fold(info.dtype.bitsize(), |n, &d| n.checked_mul(d))
                .map(|bits| bits.div_ceil(8));
            let given = end.checked_sub(begin);
            (needed != given).then(|| {
                let needed = needed.map_or("more than 2^64".to_owned(), |n| n.to_string());
                format!(
                    "tensor `{name}` ({:?} {:?}) needs {needed} bytes, but its data offsets \
                     [{begin}, {end}] give {}",
                    info.dtype,
                    info.shape,
                    given.map_or("a negative count".to_owned(), |g| g.to_string())
                )
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_aligned_or_not() {
        let values: Vec<u16> = vec![
            0x0000, 0x8000, 0x3c00, 0xbc00, 0x0001, 0x03ff, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x3555,
        ];
        let want: Vec<f32> = values
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect();
        // With one byte of padding in front the view is not 2-byte aligned (allocations are).
        for offset in [0, 1] {
            let mut buf = vec![0u8; offset];
            for v in &values {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            let view = &buf[offset..];
            let mut got = vec![0.0f32; values.len()];
            convert_to_f32(DType::F16, view, &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "offset {offset}"
            );
        }
    }
}
