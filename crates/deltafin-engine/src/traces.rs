//! Router traces: which routed experts every token chose in every MoE layer.
//!
//! File format (`--trace-routes FILE`), little-endian, appendable:
//! ```text
//! header (24 bytes, written once when the file is created or empty):
//!   magic    [u8; 8]  = b"DFROUTE1"
//!   n_layers u32      decoder layers of the model
//!   first_moe u32     index of the first MoE layer (layers first_moe..n_layers are traced)
//!   n_experts u32     routed experts per layer
//!   top_k    u32      experts chosen per token per layer in this file
//! records, one per token of every forward pass (4 + (n_layers − first_moe) × top_k × 2 bytes each):
//!   position u32      the token's position in its sequence (0 = first prompt token)
//!   experts  [u16; (n_layers − first_moe) × top_k]   expert ids, layer-major, ascending per layer
//! ```
//! Appending to a file written for a different shape is refused. A truncated final record (an
//! interrupted run) is ignored by the reader. Read it from Python with
//! `numpy.fromfile(f, dtype=np.uint8)[24:]` and a structured dtype of the record layout above.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::EngineError;

/// Magic bytes at the start of every trace file.
pub const MAGIC: &[u8; 8] = b"DFROUTE1";
/// Header size in bytes.
pub const HEADER_BYTES: usize = 24;

/// Shape of the traced model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceShape {
    pub n_layers: u32,
    pub first_moe: u32,
    pub n_experts: u32,
    pub top_k: u32,
}

impl std::fmt::Display for TraceShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers, MoE from layer {}, {} experts, top-{}",
            self.n_layers, self.first_moe, self.n_experts, self.top_k
        )
    }
}

impl TraceShape {
    /// Whether the trace's layers and experts are those of the model `c`: the same number of
    /// layers, the same first MoE layer and the same number of routed experts. The top-k may
    /// differ (a trace taken with `--experts-per-token` still ranks the same experts).
    pub fn fits(&self, c: &deltafin_format::ModelConfig) -> bool {
        let n = c.num_hidden_layers();
        let first = (0..n).find(|&l| c.is_moe_layer(l)).unwrap_or(n);
        self.n_layers as usize == n
            && self.first_moe as usize == first
            && self.n_experts as usize == c.n_routed_experts()
    }

    fn moe_layers(&self) -> usize {
        (self.n_layers - self.first_moe) as usize
    }

    /// Bytes per token record.
    pub fn record_bytes(&self) -> usize {
        4 + self.moe_layers() * self.top_k as usize * 2
    }

    fn header(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[..8].copy_from_slice(MAGIC);
        for (i, v) in [self.n_layers, self.first_moe, self.n_experts, self.top_k]
            .iter()
            .enumerate()
        {
            h[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        h
    }

    fn parse(h: &[u8], path: &Path) -> Result<Self, EngineError> {
        if h.len() < HEADER_BYTES || &h[..8] != MAGIC {
            return Err(EngineError::Invalid(format!(
                "{}: not a deltafin router trace (bad magic)",
                path.display()
            )));
        }
        let u = |i: usize| u32::from_le_bytes([h[8 + 4 * i], h[9 + 4 * i], h[10 + 4 * i], h[11 + 4 * i]]);
        let s = TraceShape {
            n_layers: u(0),
            first_moe: u(1),
            n_experts: u(2),
            top_k: u(3),
        };
        if s.first_moe > s.n_layers || s.top_k == 0 || s.top_k > s.n_experts || s.n_experts > u16::MAX as u32 + 1 {
            return Err(EngineError::Invalid(format!(
                "{}: inconsistent trace header {s:?}",
                path.display()
            )));
        }
        Ok(s)
    }
}

/// Appends token records to a trace file.
pub struct TraceWriter {
    path: PathBuf,
    shape: TraceShape,
    out: BufWriter<File>,
    buf: Vec<u8>,
}

impl TraceWriter {
    /// Opens `path` for appending, writing the header if the file is new or empty.
    ///
    /// Errors: I/O errors, or an existing file written for another shape.
    pub fn open(path: &Path, shape: TraceShape) -> Result<Self, EngineError> {
        let io = |e: std::io::Error| EngineError::Invalid(format!("{}: {e}", path.display()));
        let mut f = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        if len == 0 {
            f.write_all(&shape.header()).map_err(io)?;
        } else {
            let mut h = [0u8; HEADER_BYTES];
            let mut r = File::open(path).map_err(io)?;
            r.read_exact(&mut h).map_err(io)?;
            let existing = TraceShape::parse(&h, path)?;
            if existing != shape {
                return Err(EngineError::Invalid(format!(
                    "{}: the trace was recorded for another model or top-k ({existing}); this run is {shape}: use another file",
                    path.display()
                )));
            }
            // Drop a torn final record left by an interrupted run, so records stay aligned.
            let torn = (len - HEADER_BYTES as u64) % shape.record_bytes() as u64;
            if torn != 0 {
                f.set_len(len - torn).map_err(io)?;
            }
        }
        Ok(TraceWriter {
            path: path.to_path_buf(),
            shape,
            out: BufWriter::new(f),
            buf: Vec::new(),
        })
    }

    /// Appends one token: `routes[i]` are the experts layer `first_moe + i` chose.
    pub fn record(&mut self, position: usize, routes: &[&[usize]]) -> Result<(), EngineError> {
        let k = self.shape.top_k as usize;
        if routes.len() != self.shape.moe_layers() || routes.iter().any(|r| r.len() != k) {
            return Err(EngineError::Invalid(format!(
                "{}: route record does not match the trace shape",
                self.path.display()
            )));
        }
        self.buf.clear();
        self.buf.extend_from_slice(&(position as u32).to_le_bytes());
        for r in routes {
            for &e in r.iter() {
                self.buf.extend_from_slice(&(e as u16).to_le_bytes());
            }
        }
        self.out
            .write_all(&self.buf)
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", self.path.display())))
    }

    /// Flushes buffered records to the file.
    pub fn flush(&mut self) -> Result<(), EngineError> {
        self.out
            .flush()
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", self.path.display())))
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// A whole trace file in memory.
#[derive(Debug, Clone)]
pub struct Trace {
    pub shape: TraceShape,
    /// `[token][moe_layer * top_k + j]` expert ids.
    pub records: Vec<(u32, Vec<u16>)>,
}

impl Trace {
    /// [`Trace::read`], then checks that the trace was recorded for the model `c`
    /// ([`TraceShape::fits`]). Errors: those of `read`, or `PATH: recorded for another model
    /// (SHAPE)`.
    pub fn read_for(path: &Path, c: &deltafin_format::ModelConfig) -> Result<Self, EngineError> {
        let t = Self::read(path)?;
        if !t.shape.fits(c) {
            return Err(EngineError::Invalid(format!(
                "{}: recorded for another model ({})",
                path.display(),
                t.shape
            )));
        }
        Ok(t)
    }

    /// Reads a trace file (ignoring a torn final record).
    pub fn read(path: &Path) -> Result<Self, EngineError> {
        let bytes = std::fs::read(path).map_err(|e| EngineError::Invalid(format!("{}: {e}", path.display())))?;
        let shape = TraceShape::parse(&bytes, path)?;
        let rb = shape.record_bytes();
        let mut records = Vec::new();
        for rec in bytes[HEADER_BYTES..].chunks_exact(rb) {
            let pos = u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]);
            let ids: Vec<u16> = rec[4..]
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            if ids.iter().any(|&e| e as u32 >= shape.n_experts) {
                return Err(EngineError::Invalid(format!(
                    "{}: expert id out of range in record {}",
                    path.display(),
                    records.len()
                )));
            }
            records.push((pos, ids));
        }
        Ok(Trace { shape, records })
    }

    /// How often each (layer, expert) was chosen, ranked hottest first (ties: lower layer, then
    /// lower expert).
    pub fn heat_ranking(&self) -> Vec<((usize, usize), u64)> {
        let k = self.shape.top_k as usize;
        let first = self.shape.first_moe as usize;
        let mut counts = std::collections::HashMap::<(usize, usize), u64>::new();
        for (_, ids) in &self.records {
            for (i, &e) in ids.iter().enumerate() {
                *counts.entry((first + i / k, e as usize)).or_default() += 1;
            }
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_append_and_heat() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let shape = TraceShape {
            n_layers: 3,
            first_moe: 1,
            n_experts: 8,
            top_k: 2,
        };
        {
            let mut w = TraceWriter::open(&p, shape).unwrap();
            w.record(0, &[&[1, 5], &[2, 3]]).unwrap();
            w.record(1, &[&[1, 6], &[3, 7]]).unwrap();
        }
        {
            // Appending keeps the header and adds records.
            let mut w = TraceWriter::open(&p, shape).unwrap();
            w.record(0, &[&[1, 2], &[3, 4]]).unwrap();
        }
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 24 + 3 * 12);
        let t = Trace::read(&p).unwrap();
        assert_eq!(t.records.len(), 3);
        assert_eq!(t.records[1], (1, vec![1, 6, 3, 7]));
        let heat = t.heat_ranking();
        assert_eq!(heat[0], ((1, 1), 3));
        assert_eq!(heat[1], ((2, 3), 3));
        // Another shape is refused.
        let other = TraceShape { top_k: 3, ..shape };
        assert!(TraceWriter::open(&p, other).is_err());
        // A torn record is dropped by the reader and trimmed by the next writer.
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.extend_from_slice(&[1, 2, 3]);
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(Trace::read(&p).unwrap().records.len(), 3);
        TraceWriter::open(&p, shape).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 24 + 3 * 12);
        // Garbage is not a trace.
        std::fs::write(&p, b"hello world, not a trace at all").unwrap();
        assert!(Trace::read(&p).is_err());
    }
}
