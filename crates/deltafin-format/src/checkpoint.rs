//! Reading a Hugging Face checkpoint's safetensors files: one `*.safetensors`, or shards named by
//! `model.safetensors.index.json`.
//!
//! Every file's header is validated by the `safetensors` crate (header length within the file,
//! offsets contiguous and in range, byte size = product(shape) × dtype size) before any tensor is
//! read. Tensor bytes are then read with positioned reads rather than through a memory map, so a
//! file truncated or replaced while we run yields an I/O error, never a SIGBUS.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::FormatError;

/// Name prefixes of non-text towers in multimodal checkpoints (Kimi K2.5 etc.): skipped.
const IGNORED_PREFIXES: &[&str] = &[
    "vision_tower.",
    "mm_projector.",
    "multi_modal_projector.",
    "vision_model.",
];

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Name as written in the file.
    pub file_name: String,
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

struct Shard {
    path: PathBuf,
    file: File,
}

/// An opened checkpoint: every tensor of every shard, keyed by its name with any
/// `language_model.` prefix removed (`model.layers.0.self_attn.q_a_proj.weight`, `lm_head.weight`).
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Names skipped because they belong to a non-text tower.
    pub skipped: Vec<String>,
}

fn io_err(path: &Path, e: std::io::Error) -> FormatError {
    FormatError::Io {
        path: path.to_path_buf(),
        error: e,
    }
}

impl Checkpoint {
    /// Opens the safetensors files of a checkpoint directory and validates their headers.
    ///
    /// Errors: no safetensors file, a shard named by the index that is missing, a malformed or
    /// truncated file (named), the same tensor in two files, or an index entry pointing at a file
    /// that does not hold that tensor.
    pub fn open(dir: &Path) -> Result<Self, FormatError> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut weight_map: Option<HashMap<String, String>> = None;
        let files: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| io_err(&index_path, e))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| FormatError::Json {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| FormatError::Config {
                    path: index_path.clone(),
                    field: "weight_map".into(),
                    message: "missing or not an object".into(),
                })?;
            let mut wm = HashMap::new();
            let mut files: Vec<String> = Vec::new();
            for (name, file) in map {
                let f = file.as_str().ok_or_else(|| FormatError::Config {
                    path: index_path.clone(),
                    field: format!("weight_map.{name}"),
                    message: "expected a file name".into(),
                })?;
                if f.contains('/') || f.contains("..") {
                    return Err(FormatError::Config {
                        path: index_path.clone(),
                        field: format!("weight_map.{name}"),
                        message: format!("file name {f:?} must be a plain file in the checkpoint directory"),
                    });
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
                wm.insert(name.clone(), f.to_string());
            }
            files.sort();
            weight_map = Some(wm);
            files
        } else {
            let mut files: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| io_err(dir, e))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(FormatError::Checkpoint {
                path: dir.to_path_buf(),
                message: "no *.safetensors file (and no model.safetensors.index.json)".into(),
            });
        }
        let mut shards = Vec::new();
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        let mut skipped = Vec::new();
        for (si, fname) in files.iter().enumerate() {
            let path = dir.join(fname);
            let file = File::open(&path).map_err(|e| io_err(&path, e))?;
            let entries = read_header(&path, &file)?;
            for mut e in entries {
                e.shard = si;
                if let Some(wm) = &weight_map {
                    if let Some(f) = wm.get(&e.file_name) {
                        if f != fname {
                            return Err(FormatError::Checkpoint {
                                path: index_path.clone(),
                                message: format!("tensor {} is indexed in {f} but found in {fname}", e.file_name),
                            });
                        }
                    }
                }
                if IGNORED_PREFIXES.iter().any(|p| e.file_name.starts_with(p)) {
                    skipped.push(e.file_name.clone());
                    continue;
                }
                let key = e
                    .file_name
                    .strip_prefix("language_model.")
                    .unwrap_or(&e.file_name)
                    .to_string();
                if let Some(prev) = tensors.get(&key) {
                    return Err(FormatError::Checkpoint {
                        path: path.clone(),
                        message: format!("tensor {key} also appears in {}", files[prev.shard]),
                    });
                }
                tensors.insert(key, e);
            }
            shards.push(Shard { path, file });
        }
        if let Some(wm) = &weight_map {
            for (name, f) in wm {
                let key = name.strip_prefix("language_model.").unwrap_or(name);
                if !tensors.contains_key(key) && !skipped.contains(name) {
                    return Err(FormatError::Checkpoint {
                        path: dir.join(f),
                        message: format!("tensor {name} listed in model.safetensors.index.json is not in this file"),
                    });
                }
            }
        }
        Ok(Checkpoint {
            shards,
            tensors,
            skipped,
        })
    }

    /// All tensor names (prefix removed), sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// Metadata of one tensor, if present.
    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The file holding a tensor.
    pub fn shard_path(&self, e: &TensorEntry) -> &Path {
        &self.shards[e.shard].path
    }

    /// Total bytes of the tensors whose names satisfy `pred`.
    pub fn bytes_where(&self, pred: impl Fn(&str) -> bool) -> u64 {
        self.tensors.iter().filter(|(k, _)| pred(k)).map(|(_, e)| e.len).sum()
    }

    /// Reads a tensor as f32 (row-major), checking its shape.
    ///
    /// Errors: missing tensor, shape mismatch, dtype other than F32/BF16/F16 (FP8 and packed
    /// integer sources are named as such), or a read error.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, FormatError> {
        let e = self.tensors.get(name).ok_or_else(|| FormatError::MissingTensor {
            tensor: name.to_string(),
            path: self
                .shards
                .first()
                .map(|s| s.path.parent().unwrap_or(Path::new(".")).to_path_buf())
                .unwrap_or_default(),
        })?;
        let path = &self.shards[e.shard].path;
        if e.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: path.clone(),
                tensor: e.file_name.clone(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        check_dtype(path, &e.file_name, e.dtype)?;
        let mut bytes = vec![0u8; e.len as usize];
        self.shards[e.shard]
            .file
            .read_exact_at(&mut bytes, e.offset)
            .map_err(|err| io_err(path, err))?;
        Ok(decode_f32(e.dtype, &bytes))
    }
}

/// Decodes little-endian tensor bytes of a dtype accepted by [`check_dtype`] (F32, BF16, F16) to
/// f32; other dtypes give an empty vector (callers check the dtype first).
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => Vec::new(),
    }
}

/// Accepts the source dtypes this release converts; names the others.
pub fn check_dtype(path: &Path, tensor: &str, dtype: Dtype) -> Result<(), FormatError> {
    let why = match dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => return Ok(()),
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => "FP8 source weights (DeepSeek block FP8) are not supported yet; convert from a bf16 checkpoint",
        Dtype::I32 | Dtype::U8 | Dtype::I8 | Dtype::U32 => {
            "packed integer / quantized source weights (compressed-tensors int4 or MXFP4) are not supported yet; convert from a bf16 checkpoint"
        }
        _ => "unsupported dtype (supported: F32, BF16, F16)",
    };
    Err(FormatError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        dtype: format!("{dtype:?}"),
        message: why.to_string(),
    })
}

fn read_header(path: &Path, file: &File) -> Result<Vec<TensorEntry>, FormatError> {
    let len = file.metadata().map_err(|e| io_err(path, e))?.len();
    let bad = |m: String| FormatError::Safetensors {
        path: path.to_path_buf(),
        message: m,
    };
    if len < 8 {
        return Err(bad(format!("file is {len} bytes, too short for a safetensors header")));
    }
    let mut nb = [0u8; 8];
    file.read_exact_at(&mut nb, 0).map_err(|e| io_err(path, e))?;
    let n = u64::from_le_bytes(nb);
    if n > 100 << 20 || 8 + n > len {
        return Err(bad(format!(
            "header length {n} does not fit in the file ({len} bytes): truncated or not safetensors"
        )));
    }
    // Validate with the safetensors crate on a map of the file; only the header pages are touched.
    // SAFETY: the map is read-only and dropped before this function returns; we only let the
    // safetensors crate parse the header, whose extent we checked against the file length above.
    let mmap = unsafe { memmap2::Mmap::map(file) }.map_err(|e| io_err(path, e))?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| match e {
        safetensors::SafeTensorError::MetadataIncompleteBuffer => {
            match declared_data_end(&mmap[8..8 + n as usize]).map(|end| 8 + n + end) {
                Some(need) if need > len => bad(format!(
                    "file is truncated: its header needs {need} bytes, the file has {len}"
                )),
                _ => bad("invalid safetensors: tensor data does not match the header (trailing bytes or gaps)".into()),
            }
        }
        e => bad(format!("invalid safetensors: {e}")),
    })?;
    let data_start = 8 + n;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        // Recompute the absolute range from the view's position inside the map.
        let data = view.data();
        let off = data.as_ptr() as usize - mmap.as_ptr() as usize;
        let end = off as u64 + data.len() as u64;
        if (off as u64) < data_start || end > len {
            return Err(bad(format!("tensor {name}: data range {off}..{end} outside the file")));
        }
        out.push(TensorEntry {
            file_name: name,
            shard: 0,
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            offset: off as u64,
            len: data.len() as u64,
        });
    }
    Ok(out)
}

/// End of the tensor data a safetensors header describes (the largest `data_offsets` end), if
/// the header is JSON of the expected shape.
fn declared_data_end(header: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(header).ok()?;
    v.as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(_, t)| t.get("data_offsets")?.get(1)?.as_u64())
        .try_fold(0u64, |m, e| Some(m.max(e?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn reads_f32_bf16_f16() {
        let dir = tempfile::tempdir().unwrap();
        let f32b: Vec<u8> = [1.0f32, -2.5].iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        let f16b: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("a", Dtype::F32, vec![2], f32b),
                ("language_model.b", Dtype::BF16, vec![1, 2], bf),
                ("c", Dtype::F16, vec![2], f16b),
            ],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.read_f32("a", &[2]).unwrap(), vec![1.0, -2.5]);
        assert_eq!(ck.read_f32("b", &[1, 2]).unwrap(), vec![1.0, -2.5]);
        assert_eq!(ck.read_f32("c", &[2]).unwrap(), vec![1.0, -2.5]);
        let e = ck.read_f32("a", &[3]).unwrap_err().to_string();
        assert!(e.contains("a") && e.contains("[3]") && e.contains("[2]"), "{e}");
        let e = ck.read_f32("zzz", &[1]).unwrap_err().to_string();
        assert!(e.contains("zzz"), "{e}");
    }

    #[test]
    fn rejects_fp8_with_a_clear_message() {
        let dir = tempfile::tempdir().unwrap();
        write_st(
            &dir.path().join("model.safetensors"),
            &[("w", Dtype::F8_E4M3, vec![2], vec![0, 1])],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        let e = ck.read_f32("w", &[2]).unwrap_err().to_string();
        assert!(
            e.contains("FP8") && e.contains("w") && e.contains("model.safetensors"),
            "{e}"
        );
    }

    #[test]
    fn truncated_and_garbage_files_are_errors_not_crashes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let b: Vec<u8> = (0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        write_st(&p, &[("w", Dtype::F32, vec![64], b)]);
        let full = std::fs::read(&p).unwrap();
        for cut in [0, 3, 8, 20, full.len() - 1] {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = Checkpoint::open(dir.path())
                .err()
                .expect("truncated file must fail")
                .to_string();
            assert!(e.contains("model.safetensors"), "cut {cut}: {e}");
        }
        // Header length pointing far past the end.
        let mut f = File::create(&p).unwrap();
        f.write_all(&u64::MAX.to_le_bytes()).unwrap();
        f.write_all(b"{}").unwrap();
        assert!(Checkpoint::open(dir.path()).is_err());
        // Not JSON.
        let mut f = File::create(&p).unwrap();
        f.write_all(&4u64.to_le_bytes()).unwrap();
        f.write_all(b"nope").unwrap();
        assert!(Checkpoint::open(dir.path()).is_err());
    }

    #[test]
    fn fuzzed_headers_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let b: Vec<u8> = (0..16u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        write_st(
            &p,
            &[("w", Dtype::F32, vec![4, 4], b.clone()), ("v", Dtype::F32, vec![16], b)],
        );
        let full = std::fs::read(&p).unwrap();
        let mut state = 0x9E3779B97F4A7C15u64;
        for _ in 0..300 {
            let mut m = full.clone();
            for _ in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let i = (state as usize) % m.len();
                m[i] = (state >> 32) as u8;
            }
            std::fs::write(&p, &m).unwrap();
            if let Ok(ck) = Checkpoint::open(dir.path()) {
                for n in ck.names().map(|s| s.to_string()).collect::<Vec<_>>() {
                    let e = ck.entry(&n).unwrap().clone();
                    let _ = ck.read_f32(&n, &e.shape);
                }
            }
        }
    }
}
