//! Safetensors checkpoints as Hugging Face writes them: one `model.safetensors`, or shards
//! listed by `model.safetensors.index.json`. Files are memory-mapped; a tensor is converted to
//! f32 only when asked for.
//!
//! Dtypes: bf16, f16, f32, and block-scaled FP8 (DeepSeek / GLM releases): an `F8_E4M3`
//! `<name>` with an f32 (or bf16) `<name>_scale_inv` of `[ceil(rows / br), ceil(cols / bc)]`,
//! dequantised on load as `w[i][j] = e4m3(q[i][j]) × scale_inv[i / br][j / bc]`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use crate::reference::numerics::e4m3_to_f32;
use crate::{Error, Result};

/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Suffix of the inverse block scales of an FP8 weight.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

/// Where a tensor lives and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub shard: usize,
}

/// An open checkpoint: every tensor name → its shard, dtype and shape.
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorMeta>,
    fp8_block: Option<[usize; 2]>,
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    /// `fp8_block` (from the config's `quantization_config`) enables FP8 dequantisation.
    pub fn open(dir: &Path, fp8_block: Option<[usize; 2]>) -> Result<Self> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let files: Vec<PathBuf> = if index.is_file() {
            shard_files(&index)?
        } else if single.is_file() {
            vec![single]
        } else {
            return Err(Error::Model(format!(
                "model directory {} has neither {SINGLE_FILE} nor {INDEX_FILE}",
                dir.display()
            )));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let shard = open_shard(path)?;
            for (name, info) in shard.metadata.tensors() {
                let meta = TensorMeta {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    shard: i,
                };
                if let Some(prev) = tensors.insert(name.clone(), meta) {
                    return Err(Error::Model(format!(
                        "tensor `{name}` is in both {} and {}",
                        shards_path(&shards, prev.shard),
                        shard.path.display()
                    )));
                }
            }
            shards.push(shard);
        }
        Ok(Checkpoint {
            shards,
            tensors,
            fp8_block,
        })
    }

    /// All tensor names, sorted.
    /// Number of tensors in the checkpoint (every shard).
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.get(name)
    }

    /// The file a tensor is in (for messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.tensors
            .get(name)
            .map(|m| self.shards[m.shard].path.as_path())
    }

    fn bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let meta = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::Model(format!("tensor `{name}` not found in the checkpoint")))?;
        let shard = &self.shards[meta.shard];
        let info = shard.metadata.info(name).ok_or_else(|| {
            Error::Model(format!(
                "tensor `{name}` vanished from {}",
                shard.path.display()
            ))
        })?;
        let (a, b) = info.data_offsets;
        let data = shard
            .mmap
            .get(shard.data_start + a..shard.data_start + b)
            .ok_or_else(|| {
                Error::Model(format!(
                    "tensor `{name}` in {}: data offsets {a}..{b} run past the end of the file",
                    shard.path.display()
                ))
            })?;
        Ok((info, data))
    }

    /// Checks that `name` exists with `shape` and a dtype we can read (an FP8 weight also
    /// needs its `_scale_inv` of the right shape). The message names the tensor, the expected
    /// and the actual value.
    pub fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        let meta = self.tensors.get(name).ok_or_else(|| {
            Error::Model(format!(
                "tensor `{name}` (expected shape {shape:?}) is missing from the checkpoint"
            ))
        })?;
        let file = self.shards[meta.shard].path.display();
        if meta.shape != shape {
            return Err(Error::Model(format!(
                "tensor `{name}` in {file}: expected shape {shape:?}, found {:?}",
                meta.shape
            )));
        }
        match meta.dtype {
            Dtype::BF16 | Dtype::F16 | Dtype::F32 => Ok(()),
            Dtype::F8_E4M3 => self.check_scale_inv(name, shape).map(|_| ()),
            other => Err(Error::Model(format!(
                "tensor `{name}` in {file}: expected dtype BF16, F16, F32 or F8_E4M3 (with {name}{SCALE_INV_SUFFIX}), found {other:?}"
            ))),
        }
    }

    fn check_scale_inv(&self, name: &str, shape: &[usize]) -> Result<[usize; 2]> {
        let Some(block) = self.fp8_block else {
            return Err(Error::Model(format!(
                "tensor `{name}` is F8_E4M3 but config.json has no quantization_config with weight_block_size"
            )));
        };
        if shape.len() != 2 {
            return Err(Error::Model(format!(
                "tensor `{name}` is F8_E4M3 with shape {shape:?}; block-scaled FP8 needs a 2-D weight"
            )));
        }
        let scale_name = format!("{name}{SCALE_INV_SUFFIX}");
        let expected = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
        let meta = self.tensors.get(&scale_name).ok_or_else(|| {
            Error::Model(format!(
                "tensor `{scale_name}` (expected shape {expected:?}, the FP8 block scales of `{name}`) is missing"
            ))
        })?;
        if meta.shape != expected {
            return Err(Error::Model(format!(
                "tensor `{scale_name}`: expected shape {expected:?} ({block:?} blocks of {shape:?}), found {:?}",
                meta.shape
            )));
        }
        if !matches!(meta.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(Error::Model(format!(
                "tensor `{scale_name}`: expected dtype F32, BF16 or F16, found {:?}",
                meta.dtype
            )));
        }
        Ok(block)
    }

    /// The tensor's bytes as stored (little-endian, row-major), with its dtype and shape.
    pub fn raw(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8])> {
        let (info, data) = self.bytes(name)?;
        Ok((info.dtype, info.shape.clone(), data))
    }

    /// The FP8 block size of a checked `F8_E4M3` weight.
    pub fn fp8_block(&self, name: &str) -> Result<[usize; 2]> {
        let shape = self
            .tensors
            .get(name)
            .map(|m| m.shape.clone())
            .ok_or_else(|| Error::Model(format!("tensor `{name}` not found in the checkpoint")))?;
        self.check_scale_inv(name, &shape)
    }

    /// The tensor as f32 values, row-major. FP8 weights are dequantised with their scales.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let (info, data) = self.bytes(name)?;
        match info.dtype {
            Dtype::F8_E4M3 => {
                let shape = info.shape.clone();
                let block = self.check_scale_inv(name, &shape)?;
                let scales = self.read_f32(&format!("{name}{SCALE_INV_SUFFIX}"))?;
                Ok(dequant_fp8_blocks(
                    data,
                    &scales,
                    [shape[0], shape[1]],
                    block,
                ))
            }
            dtype => plain_to_f32(dtype, data).ok_or_else(|| {
                Error::Model(format!(
                    "tensor `{name}`: cannot read dtype {dtype:?} as f32"
                ))
            }),
        }
    }

    /// Names present in the files but not in `used` (nor the scales of used FP8 weights).
    pub fn unused<'a>(&'a self, used: &std::collections::HashSet<String>) -> Vec<&'a str> {
        self.names()
            .filter(|n| {
                if used.contains(*n) {
                    return false;
                }
                match n.strip_suffix(SCALE_INV_SUFFIX) {
                    Some(base) => !used.contains(base),
                    None => true,
                }
            })
            .collect()
    }
}

fn shards_path(shards: &[Shard], i: usize) -> String {
    shards
        .get(i)
        .map(|s| s.path.display().to_string())
        .unwrap_or_default()
}

fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| io_err(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Model(format!("{}: not valid JSON: {e}", index.display())))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Model(format!("{}: no `weight_map` object", index.display())))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::Model(format!(
                "{}: weight_map entry of `{name}` is not a file name",
                index.display()
            ))
        })?;
        // A shard is a file next to the index, as every Hugging Face checkpoint has it: a
        // name that leaves the directory (`../x`, `/etc/passwd`) or is not a safetensors
        // file (`config.json`) is refused, not opened.
        let plain = !file.is_empty()
            && !file.contains(['/', '\\'])
            && file != ".."
            && file.ends_with(".safetensors");
        if !plain {
            return Err(Error::Model(format!(
                "{}: weight_map entry of `{name}` is {file:?}; shards must be .safetensors files in the model directory (a plain file name)",
                index.display()
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    let mut paths = Vec::with_capacity(files.len());
    for f in files {
        let p = dir.join(&f);
        if !p.is_file() {
            return Err(Error::Model(format!(
                "shard {f} listed in {} is missing from {}",
                index.display(),
                dir.display()
            )));
        }
        paths.push(p);
    }
    if paths.is_empty() {
        return Err(Error::Model(format!(
            "{}: weight_map is empty",
            index.display()
        )));
    }
    Ok(paths)
}

fn open_shard(path: PathBuf) -> Result<Shard> {
    let file = File::open(&path).map_err(|e| io_err(&path, e))?;
    // SAFETY: the map is read-only; a checkpoint changed on disk while we run is outside what
    // this loader promises (as for every mmap-based safetensors reader).
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(&path, e))?;
    let (header, metadata) = SafeTensors::read_metadata(&mmap)
        .map_err(|e| Error::Model(format!("{}: not a safetensors file: {e}", path.display())))?;
    Ok(Shard {
        path,
        data_start: 8 + header,
        mmap,
        metadata,
    })
}

/// Little-endian bf16 / f16 / f32 bytes to f32; `None` for other dtypes.
pub fn plain_to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

/// `w[i][j] = e4m3(q[i][j]) × scale_inv[i / block_r][j / block_c]` for a `[rows, cols]` weight.
pub fn dequant_fp8_blocks(
    q: &[u8],
    scale_inv: &[f32],
    shape: [usize; 2],
    block: [usize; 2],
) -> Vec<f32> {
    let [rows, cols] = shape;
    let scale_cols = cols.div_ceil(block[1]);
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        for j in 0..cols {
            let s = scale_inv[(i / block[0]) * scale_cols + j / block[1]];
            out.push(e4m3_to_f32(q[i * cols + j]) * s);
        }
    }
    out
}

/// Block-scaled FP8 quantisation of a `[rows, cols]` weight, the inverse of
/// [`dequant_fp8_blocks`]: per block `scale_inv = amax / 448` (1 for an all-zero block),
/// `q = e4m3(w / scale_inv)`. Returns (e4m3 bytes, scale_inv `[ceil(r/br), ceil(c/bc)]`).
/// Used by tests and by tools that make FP8 checkpoints.
pub fn quantize_fp8_blocks(w: &[f32], shape: [usize; 2], block: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    use crate::reference::numerics::{f32_to_e4m3, E4M3_MAX};
    let [rows, cols] = shape;
    let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut scales = vec![0.0f32; sr * sc];
    for (bi, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((bi / sc) * block[0], (bi % sc) * block[1]);
        let mut amax = 0.0f32;
        for i in r0..(r0 + block[0]).min(rows) {
            for j in c0..(c0 + block[1]).min(cols) {
                amax = amax.max(w[i * cols + j].abs());
            }
        }
        *s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    }
    let q = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            f32_to_e4m3(w[k] / scales[(i / block[0]) * sc + j / block[1]])
        })
        .collect();
    (q, scales)
}

/// Writes a (possibly sharded) checkpoint: `tensors` as (name, dtype, shape, bytes), split
/// over `shards` files (`model-0000i-of-0000n.safetensors` + index.json) when `shards > 1`.
/// For tests and tools; real checkpoints come from their publishers.
pub fn write_checkpoint(
    dir: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    shards: usize,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let shards = shards.max(1);
    let per = tensors.len().div_ceil(shards).max(1);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards)
        };
        let mut views = HashMap::new();
        for (name, dtype, shape, bytes) in chunk {
            let view = TensorView::new(*dtype, shape.clone(), bytes)
                .map_err(|e| Error::Model(format!("tensor `{name}`: {e}")))?;
            views.insert(name.clone(), view);
            weight_map.insert(name.clone(), file.clone().into());
        }
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| Error::Model(format!("{}: {e}", path.display())))?;
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let path = dir.join(INDEX_FILE);
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&index).unwrap_or_default(),
        )
        .map_err(|e| io_err(&path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_block_roundtrip_is_within_e4m3_precision() {
        let (rows, cols) = (130, 200); // partial blocks on both axes
        let mut rng = crate::util::Rng::new(7);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * 0.05).collect();
        let (q, s) = quantize_fp8_blocks(&w, [rows, cols], [128, 128]);
        assert_eq!(s.len(), 2 * 2);
        let d = dequant_fp8_blocks(&q, &s, [rows, cols], [128, 128]);
        for (a, b) in d.iter().zip(&w) {
            // e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4, plus the subnormal step.
            assert!(
                (a - b).abs() <= b.abs() / 16.0 + s[0] / 512.0 + 1e-9,
                "{a} vs {b}"
            );
        }
    }
}
