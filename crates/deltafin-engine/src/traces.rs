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

impl TraceShape {
    /// The shape of a trace recorded on the model `c` with its own top-k.
    ///
    /// Errors: a model without MoE layers, or whose MoE layers are not one contiguous run (the
    /// trace format numbers MoE layers consecutively).
    pub fn for_model(c: &deltafin_format::ModelConfig) -> Result<Self, EngineError> {
        let n = c.num_hidden_layers();
        let first = (0..n).find(|&l| c.is_moe_layer(l)).unwrap_or(n);
        if first == n || (first..n).any(|l| !c.is_moe_layer(l)) {
            return Err(EngineError::Invalid(
                "router traces need a model whose MoE layers are one contiguous run".into(),
            ));
        }
        Ok(TraceShape {
            n_layers: n as u32,
            first_moe: first as u32,
            n_experts: c.n_routed_experts() as u32,
            top_k: c.num_experts_per_tok() as u32,
        })
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a fixed, seedable generator for the mapping's
/// permutations, so a mapped trace is the same on every machine.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A Fisher–Yates permutation of `0..n` seeded by `seed`.
fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    let mut s = seed;
    for i in (1..n).rev() {
        let j = (splitmix64(&mut s) % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

impl Trace {
    /// This trace's routing replayed on a larger model of shape `target`
    /// ([`TraceMapper`], which documents the mapping); positions are kept.
    ///
    /// Errors: those of [`TraceMapper::new`].
    pub fn map_onto(&self, target: TraceShape) -> Result<Trace, EngineError> {
        let mut m = TraceMapper::new(self.shape, target)?;
        let records = self
            .records
            .iter()
            .enumerate()
            .map(|(t, (pos, ids))| (*pos, m.map_record(t, ids)))
            .collect();
        Ok(Trace { shape: target, records })
    }
}

/// Maps the routing of a trace recorded on a small model onto a larger model's experts
/// (measurement: `deltafin replay --map-experts`). Deterministic; the same source expert always
/// maps to the same target records, so two traces mapped onto one target share records exactly
/// where their sources share experts (pinning from another workload's mapped trace is
/// meaningful).
///
/// With `Ls, Es, ks` the source's MoE layers, experts and top-k and `Lt, Et, kt` the
/// target's, `m = Et / Es` (an integer) and block size `b = max(m, ⌈kt/ks⌉)`:
/// - target MoE layer `j` replays source MoE layer `j mod Ls` (per-layer popularity and
///   co-occurrence kept; the `⌈Lt / Ls⌉` copies of a source layer are distinct records);
/// - source expert `e` owns the block of `b` target experts `π_j((e·b + q) mod Et)`, `q < b`,
///   with `π_j` a seeded permutation of `0..Et` per target layer. When `ks·m ≥ kt`, `b = m`
///   and the blocks are disjoint; otherwise (e.g. 64 experts top-6 onto 128 top-16: `b = 3`)
///   `Es·b > Et` and blocks overlap, each target expert in `⌊Es·b/Et⌋` or `⌈Es·b/Et⌉` blocks
///   (one or two there);
/// - each token's `ks` source picks yield exactly `kt` distinct target picks: pick `i`
///   (ascending source id) of record `t` wants `⌊kt/ks⌋` experts, plus one when
///   `(i + t) mod ks < kt mod ks`, taken from its block in turn (a per-(layer, expert) counter
///   `c`: members `c, c+1, …` mod `b`, the counter then advancing by the number wanted), so
///   every member is used and each is reused at about every `b·ks/kt`-th use of its source
///   expert (demo → `bench`: every 3rd; demo → `k3-bench`: 8 of 9 uses);
/// - with overlapping blocks, a member already taken in this token and layer by an earlier pick
///   is skipped (the pick takes its block's next free member); what a pick still lacks is
///   taken from the free members of the token's other picked blocks (picks in order, members
///   in block order), and only when those hold too few, from past its own block's end
///   (`π_j((e·b + q) mod Et)`, `q = b, b+1, …`). A target pick thus always belongs to a block
///   of one of the token's source picks unless their blocks hold fewer than `kt` experts.
///
/// The request count (`kt × Lt` per token) is the target's, so bytes read per token compare
/// with its no-cache need.
pub struct TraceMapper {
    source: TraceShape,
    target: TraceShape,
    /// Block size `b`.
    block: usize,
    /// `π_j` per target MoE layer.
    perms: Vec<Vec<u32>>,
    /// `[target layer][source expert]`: the member its next use starts at.
    turn: Vec<Vec<usize>>,
}

impl TraceMapper {
    /// A mapper from traces of `source` onto `target`.
    ///
    /// Errors: `Et` not a multiple of `Es`, `kt > Et`, or a shape without MoE layers.
    pub fn new(source: TraceShape, target: TraceShape) -> Result<Self, EngineError> {
        let (ls, es, ks) = (source.moe_layers(), source.n_experts as usize, source.top_k as usize);
        let (lt, et, kt) = (target.moe_layers(), target.n_experts as usize, target.top_k as usize);
        let unfit = |why: &str| {
            Err(EngineError::Invalid(format!(
                "cannot map a trace of {source} onto {target}: {why}"
            )))
        };
        if ls == 0 || lt == 0 {
            return unfit("no MoE layers");
        }
        if et % es != 0 {
            return unfit("the target's experts per layer must be a multiple of the trace's");
        }
        if kt > et {
            return unfit("the target's top-k exceeds its experts per layer");
        }
        Ok(TraceMapper {
            source,
            target,
            block: (et / es).max(kt.div_ceil(ks)),
            perms: (0..lt).map(|j| permutation(et, Self::seed(j))).collect(),
            turn: vec![vec![0; es]; lt],
        })
    }

    fn seed(j: usize) -> u64 {
        0xD17A_F1E5_u64 ^ ((j as u64) << 32)
    }

    /// The source MoE layer (0-based among MoE layers) that target MoE layer `j` replays.
    pub fn source_layer(&self, j: usize) -> usize {
        j % self.source.moe_layers()
    }

    /// Target MoE layers.
    pub fn target_layers(&self) -> usize {
        self.target.moe_layers()
    }

    /// Member `q` of source expert `e`'s sequence in target layer `j`: `π_j((e·b + q) mod Et)`
    /// (`q < b`: its block; beyond: past the block's end).
    fn member(&self, j: usize, e: u16, q: usize) -> u16 {
        let et = self.perms[j].len();
        self.perms[j][(e as usize * self.block + q) % et] as u16
    }

    /// Target experts for source picks `src` (ascending, `ks` of them or fewer) of target layer
    /// `j` in record `t`, each with the index in `src` of the pick it was drawn for, in drawing
    /// order; advances the turn counters when `advance`.
    fn draw(&mut self, j: usize, t: usize, src: &[u16], advance: bool) -> Vec<(u16, usize)> {
        let ks = self.source.top_k as usize;
        let kt = self.target.top_k as usize;
        let (b, et) = (self.block, self.perms[j].len());
        let (base, extra) = (kt / ks, kt % ks);
        let mut out: Vec<(u16, usize)> = Vec::with_capacity(kt);
        let taken = |out: &[(u16, usize)], x: u16| out.iter().any(|&(y, _)| y == x);
        let mut lack = Vec::with_capacity(src.len());
        // Each pick from its own block, in turn.
        for (i, &e) in src.iter().enumerate() {
            let want = base + usize::from((i + t) % ks < extra);
            let c = self.turn[j][e as usize];
            let mut got = 0;
            for q in 0..b {
                if got == want {
                    break;
                }
                let x = self.member(j, e, (c + q) % b);
                if !taken(&out, x) {
                    out.push((x, i));
                    got += 1;
                }
            }
            lack.push(want - got);
            if advance {
                self.turn[j][e as usize] = (c + want) % b;
            }
        }
        // Collisions (overlapping blocks only): the token's other picked blocks, then past the
        // pick's own block.
        for (i, &e) in src.iter().enumerate() {
            let others = src.iter().flat_map(|&f| (0..b).map(move |q| (f, q)));
            let beyond = (b..b + et).map(|q| (e, q));
            for (f, q) in others.chain(beyond) {
                if lack[i] == 0 {
                    break;
                }
                let x = self.member(j, f, q);
                if !taken(&out, x) {
                    out.push((x, i));
                    lack[i] -= 1;
                }
            }
        }
        out
    }

    /// Target experts (ascending) for source picks `src` of target layer `j` in record `t`
    /// ([`TraceMapper::draw`]).
    fn layer(&mut self, j: usize, t: usize, src: &[u16], advance: bool) -> Vec<u16> {
        let mut out: Vec<u16> = self.draw(j, t, src, advance).into_iter().map(|(x, _)| x).collect();
        out.sort_unstable();
        out
    }

    /// Maps record `t` (the source's `ids`, layer-major) to the target's ids, layer-major,
    /// ascending per layer; advances the turn counters.
    pub fn map_record(&mut self, t: usize, ids: &[u16]) -> Vec<u16> {
        let ks = self.source.top_k as usize;
        let mut out = Vec::with_capacity(self.target.moe_layers() * self.target.top_k as usize);
        for j in 0..self.target.moe_layers() {
            let s = self.source_layer(j);
            out.extend(self.layer(j, t, &ids[s * ks..(s + 1) * ks], true));
        }
        out
    }

    /// The target experts a prediction of source experts `src` for target layer `j` in record
    /// `t` names: the members the demand mapping would take next for them (so a prediction
    /// equal to the demand maps to exactly the demand's target experts). Counters unchanged.
    pub fn map_prediction(&mut self, j: usize, t: usize, src: &[u16]) -> Vec<u16> {
        self.layer(j, t, src, false)
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

    fn shape(n_layers: u32, first_moe: u32, n_experts: u32, top_k: u32) -> TraceShape {
        TraceShape {
            n_layers,
            first_moe,
            n_experts,
            top_k,
        }
    }

    /// The mapping onto a larger model: the target's shape and top-k per layer, ascending
    /// distinct ids inside the source expert's block, copies of a source layer on distinct
    /// records, every block member used in turn, and the same source expert on the same
    /// records in two traces.
    #[test]
    fn map_onto_a_larger_model() {
        // Source: 2 MoE layers × 4 experts, top-3. Target: 5 MoE layers × 8 experts, top-4.
        let src = Trace {
            shape: shape(3, 1, 4, 3),
            records: (0..12u32).map(|t| (t, vec![0, 1, 2, 1, 2, 3])).collect(),
        };
        let target = shape(6, 1, 8, 4);
        let a = src.map_onto(target).unwrap();
        let b = src.map_onto(target).unwrap();
        assert_eq!(a.records, b.records, "deterministic");
        assert_eq!(a.shape, target);
        assert_eq!(a.records.len(), 12);
        // Which source expert owns each target expert of each target layer.
        let owner = |j: usize, x: u16| -> usize {
            let p = permutation(8, TraceMapper::seed(j));
            p.iter().position(|&v| v == x as u32).unwrap() / 2
        };
        let mut used = std::collections::HashSet::new();
        for (t, (pos, ids)) in a.records.iter().enumerate() {
            assert_eq!(*pos, t as u32);
            assert_eq!(ids.len(), 5 * 4);
            for j in 0..5 {
                let layer = &ids[j * 4..(j + 1) * 4];
                assert!(layer.windows(2).all(|w| w[0] < w[1]), "ascending, distinct: {layer:?}");
                let want: &[usize] = if j % 2 == 0 { &[0, 1, 2] } else { &[1, 2, 3] };
                for &x in layer {
                    assert!(want.contains(&owner(j, x)), "layer {j}: {x} outside the picks' blocks");
                    used.insert((j, x));
                }
            }
        }
        // Every member of every picked block was used (3 blocks × 2 members × 5 layers), and no
        // target expert outside them.
        assert_eq!(used.len(), 5 * 3 * 2);
        // Copies of one source layer (target layers 0, 2, 4) use different records.
        let l0: Vec<u16> = a.records[0].1[0..4].to_vec();
        let l2: Vec<u16> = a.records[0].1[8..12].to_vec();
        assert_ne!(l0, l2);
        // Another trace that picks expert 3 of layer 1 alone gets records of the same block.
        let other = Trace {
            shape: shape(3, 1, 4, 3),
            records: vec![(0, vec![0, 1, 2, 0, 1, 3])],
        };
        let o = other.map_onto(target).unwrap();
        let blocks =
            |ids: &[u16], j: usize| -> Vec<usize> { ids[j * 4..(j + 1) * 4].iter().map(|&x| owner(j, x)).collect() };
        assert!(blocks(&o.records[0].1, 1).contains(&3));
        // A prediction equal to the demand maps to the demand's target experts.
        let mut m = TraceMapper::new(src.shape, target).unwrap();
        for (t, (_, ids)) in src.records.iter().enumerate() {
            let p = m.map_prediction(1, t, &[1, 2, 3]);
            let q = m.map_prediction(1, t, &[1, 2]);
            let r = m.map_record(t, ids);
            assert_eq!(p, r[4..8]);
            assert!(q.iter().all(|x| r[4..8].contains(x)), "a subset predicts a subset");
            assert_eq!(r, a.records[t].1);
        }
        // Shapes that cannot be mapped are refused.
        assert!(src.map_onto(shape(6, 1, 6, 4)).is_err(), "6 is not a multiple of 4");
        assert!(src.map_onto(shape(6, 1, 8, 9)).is_err(), "top-9 of 8 experts");
        assert!(src.map_onto(shape(2, 2, 8, 4)).is_err(), "no MoE layers");
    }

    /// Picks `k` distinct experts of `0..n` with weights `2^(n−1−e)` (expert 0 the hottest),
    /// ascending.
    fn skewed_picks(n: usize, k: usize, s: &mut u64) -> Vec<u16> {
        let mut w: Vec<u64> = (0..n).map(|e| 1u64 << (n - 1 - e)).collect();
        let mut out = Vec::with_capacity(k);
        for _ in 0..k {
            let mut r = splitmix64(s) % w.iter().sum::<u64>();
            let e = w.iter().position(|&x| {
                let hit = r < x;
                r = r.saturating_sub(x);
                hit
            });
            let e = e.unwrap();
            out.push(e as u16);
            w[e] = 0;
        }
        out.sort_unstable();
        out
    }

    /// Overlapping blocks (`ks·m < kt`, as the demo's 64 experts top-6 onto `k3-bench`'s 128
    /// top-16): exactly `kt` distinct picks per token, deterministic, each source expert's
    /// block fixed and picks outside the token's blocks only where those hold fewer than `kt`,
    /// per-layer popularity kept, a reuse of a source expert a reuse of a target record, and a
    /// correct prediction mapped to the demand.
    #[test]
    fn map_with_overlapping_blocks() {
        // Source: 2 MoE layers × 8 experts, top-3. Target: 3 MoE layers × 16 experts, top-8:
        // m = 2, 3 × 2 < 8, so blocks of b = ⌈8/3⌉ = 3 over 8 × 3 = 24 > 16 positions.
        let (ks, kt, b) = (3usize, 8usize, 3usize);
        let mut seed = 7u64;
        let src = Trace {
            shape: shape(3, 1, 8, 3),
            records: (0..400u32)
                .map(|t| {
                    let mut ids = skewed_picks(8, ks, &mut seed);
                    ids.extend(skewed_picks(8, ks, &mut seed));
                    (t, ids)
                })
                .collect(),
        };
        let target = shape(4, 1, 16, 8);
        let a = src.map_onto(target).unwrap();
        assert_eq!(a.records, src.map_onto(target).unwrap().records, "deterministic");
        let mut m = TraceMapper::new(src.shape, target).unwrap();
        assert_eq!(m.block, b);
        let block = |j: usize, e: u16| -> Vec<u16> { (0..b).map(|q| m.member(j, e, q)).collect() };
        let blocks: Vec<Vec<Vec<u16>>> = (0..3).map(|j| (0..8).map(|e| block(j, e)).collect()).collect();
        // Overlap: 24 block positions on 16 experts, each expert in one or two blocks.
        for bl in &blocks {
            let mut n = [0usize; 16];
            bl.iter().flatten().for_each(|&x| n[x as usize] += 1);
            assert!(n.iter().all(|&c| c == 1 || c == 2), "{n:?}");
        }
        let (mut used, mut drawn) = (vec![[0u64; 8]; 3], vec![[0u64; 8]; 3]);
        let mut target_uses = vec![[0u64; 16]; 3];
        let (mut outside, mut short) = (0, 0);
        // [layer][source expert]: the targets its previous use drew; (reuses sharing a record,
        // reuses with both draws inside the block).
        let mut last: Vec<Vec<Option<Vec<u16>>>> = vec![vec![None; 8]; 3];
        let (mut shared, mut in_block) = (0, 0);
        for (t, (_, ids)) in src.records.iter().enumerate() {
            let mapped = &a.records[t].1;
            for j in 0..3 {
                let s = j % 2;
                let picks = &ids[s * ks..(s + 1) * ks];
                let layer = &mapped[j * kt..(j + 1) * kt];
                assert!(
                    layer.windows(2).all(|w| w[0] < w[1]),
                    "{kt} distinct, ascending: {layer:?}"
                );
                // A prediction equal to the demand names the demand's targets.
                assert_eq!(m.map_prediction(j, t, picks), layer);
                let d = m.draw(j, t, picks, true);
                let mut xs: Vec<u16> = d.iter().map(|&(x, _)| x).collect();
                xs.sort_unstable();
                assert_eq!(xs, layer, "draw() is the mapping");
                // Targets outside the token's blocks: exactly what those blocks lack.
                let union: std::collections::BTreeSet<u16> =
                    picks.iter().flat_map(|&e| blocks[j][e as usize].clone()).collect();
                let out = layer.iter().filter(|x| !union.contains(x)).count();
                assert_eq!(out, kt.saturating_sub(union.len()), "layer {j} token {t}");
                outside += out;
                short += usize::from(union.len() < kt);
                for (i, &e) in picks.iter().enumerate() {
                    let mine: Vec<u16> = d.iter().filter(|&&(_, p)| p == i).map(|&(x, _)| x).collect();
                    assert!((kt / ks..=kt.div_ceil(ks)).contains(&mine.len()), "{mine:?}");
                    used[j][e as usize] += 1;
                    drawn[j][e as usize] += mine.len() as u64;
                    let own = &blocks[j][e as usize];
                    if let Some(prev) = last[j][e as usize].take() {
                        if prev.iter().chain(&mine).all(|x| own.contains(x)) {
                            in_block += 1;
                            shared += usize::from(mine.iter().any(|x| prev.contains(x)));
                        }
                    }
                    last[j][e as usize] = Some(mine);
                }
                for &x in layer {
                    target_uses[j][x as usize] += 1;
                }
            }
        }
        // Popularity: each use of a source expert yields ⌊kt/ks⌋ or ⌈kt/ks⌉ targets, so the
        // source's order by uses is the order by targets drawn wherever uses differ by more
        // than that ratio; the hottest target expert is in the hottest source expert's block.
        for j in 0..3 {
            for e in 0..8 {
                let (u, d) = (used[j][e], drawn[j][e]);
                assert!(
                    u * (kt / ks) as u64 <= d && d <= u * kt.div_ceil(ks) as u64,
                    "layer {j} expert {e}"
                );
            }
            let hottest_src = (0..8).max_by_key(|&e| used[j][e]).unwrap();
            let hottest = (0..16).max_by_key(|&x| target_uses[j][x]).unwrap() as u16;
            assert!(blocks[j][hottest_src].contains(&hottest), "layer {j}");
        }
        // Reuse: two uses drawing 2–3 of the same 3 members always share one; most reuses
        // stay inside the block.
        assert_eq!(shared, in_block);
        assert!(in_block > 400 * 3 * ks / 2, "{in_block}");
        // The fill from past a block's end is exercised (here blocks 0, 1 and 5 or 6 hold 6–7).
        assert!(outside > 0 && short > 0, "{outside} {short}");
        // Shapes it cannot map are still refused; kt ≤ Et is the only new limit.
        assert!(src.map_onto(shape(4, 1, 16, 17)).is_err());
    }
}
