//! Expert-store read benchmark: direct vs buffered I/O through the real store (reader pool,
//! checksums, `Fetch` in completion order), on a synthetic pack of ~2 MiB MXFP4 records.
//!
//! ```text
//! cargo run --release -p deltafin-engine --example store_bench -- \
//!     --dir /work/tmp-bench [--gb 2] [--rounds 2] [--qd 8] [--top-k 8] [--budget-mib 0] \
//!     [--modes direct,buffered] [--requests N] [--reuse]
//! ```
//!
//! The first run writes `DIR/model` (a manifest derived from the `dsv3_b` fixture, a pack of
//! random records with real checksums). Each measurement drops the page cache first (root only;
//! the output says whether it could) and opens a fresh store. Without `--reuse` every record is
//! read exactly once, `top-k` experts of one layer per fetch (a cold decode); with `--reuse`,
//! `--requests` fetches draw experts from a skewed distribution, so caches can hit (run it under
//! `bench/with-memory-limit.sh` to see buffered I/O lose its page cache). Modes alternate in
//! balanced order (A B B A …). Reports GB/s of bytes read, the share of wall time the caller
//! waited, and the process CPU time (user + system) per GB.

use std::path::{Path, PathBuf};
use std::time::Instant;

use deltafin_engine::experts::{CachePolicy, ExpertStore, IoMode, StoreOptions};
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::ModelDir;
use serde_json::{json, Value};

const HIDDEN: usize = 2048;
const INTER: usize = 640;
const EXPERTS: usize = 256;

struct Args {
    dir: PathBuf,
    gb: f64,
    rounds: usize,
    qd: usize,
    top_k: usize,
    budget: u64,
    modes: Vec<IoMode>,
    requests: usize,
    reuse: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        dir: PathBuf::from("/work/tmp-bench"),
        gb: 2.0,
        rounds: 2,
        qd: 8,
        top_k: 8,
        budget: 0,
        modes: vec![IoMode::Direct, IoMode::Buffered],
        requests: 0,
        reuse: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "--reuse" {
            a.reuse = true;
            continue;
        }
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{k}: {e}"));
        match k.as_str() {
            "--dir" => a.dir = v.into(),
            "--gb" => a.gb = num(&v)?,
            "--rounds" => a.rounds = num(&v)? as usize,
            "--qd" => a.qd = num(&v)? as usize,
            "--top-k" => a.top_k = num(&v)? as usize,
            "--budget-mib" => a.budget = (num(&v)? * 1048576.0) as u64,
            "--requests" => a.requests = num(&v)? as usize,
            "--modes" => {
                a.modes = v.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    Ok(a)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Writes `dir/model` with enough MoE layers of 256 experts to reach `gb` × 10⁹ bytes.
fn create(dir: &Path, gb: f64) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let model = dir.join("model");
    if model.join("manifest.json").exists() {
        return Ok(model);
    }
    std::fs::create_dir_all(dir)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_b");
    let tmp = dir.join("template");
    let _ = std::fs::remove_dir_all(&tmp);
    convert(&src, &tmp, &ConvertOptions::default(), &NoProgress)?;
    let mut m: Value = serde_json::from_slice(&std::fs::read(tmp.join("manifest.json"))?)?;
    // MXFP4: values rows × cols/2, then one E8M0 scale per 32 values.
    let mat = |rows: usize, cols: usize| (rows * cols / 2, rows * cols / 32);
    let mut layout = Vec::new();
    let mut off = 0usize;
    for (name, rows, cols) in [
        ("gate_proj", INTER, HIDDEN),
        ("up_proj", INTER, HIDDEN),
        ("down_proj", HIDDEN, INTER),
    ] {
        let (v, s) = mat(rows, cols);
        layout.push(json!({"name": name, "rows": rows, "cols": cols, "dtype": "mxfp4",
            "offset": off, "scales_offset": off + v, "bytes": v + s}));
        off += v + s;
    }
    let length = off as u64;
    let stride = length.div_ceil(4096) * 4096;
    let layers = ((gb * 1e9) / (EXPERTS as f64 * stride as f64)).ceil().max(1.0) as usize;
    let cfg = &mut m["config"];
    cfg["hidden_size"] = json!(HIDDEN);
    cfg["moe_intermediate_size"] = json!(INTER);
    cfg["n_routed_experts"] = json!(EXPERTS);
    cfg["num_experts_per_tok"] = json!(8);
    cfg["n_group"] = json!(8);
    cfg["topk_group"] = json!(4);
    cfg["first_k_dense_replace"] = json!(1);
    cfg["num_hidden_layers"] = json!(1 + layers);
    let pack_path = tmp.join("experts.pack");
    let mut pack = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&pack_path)?);
    let mut records = Vec::new();
    let mut rng = Rng(0x00C0_FFEE);
    let mut buf = vec![0u8; stride as usize];
    let mut offset = 0u64;
    for l in 1..=layers {
        for e in 0..EXPERTS {
            for c in buf[..length as usize].chunks_exact_mut(8) {
                c.copy_from_slice(&rng.next().to_le_bytes());
            }
            let h = xxhash_rust::xxh3::xxh3_64(&buf[..length as usize]);
            std::io::Write::write_all(&mut pack, &buf)?;
            records.push(json!({"layer": l, "expert": e, "offset": offset, "length": length,
                "xxh3": format!("{h:016x}")}));
            offset += stride;
        }
    }
    let f = pack.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    m["experts"]["layout"] = json!(layout);
    m["experts"]["records"] = json!(records);
    m["experts"]["bytes"] = json!(offset);
    std::fs::write(tmp.join("manifest.json"), serde_json::to_vec(&m)?)?;
    std::fs::rename(&tmp, &model)?;
    eprintln!(
        "wrote {}: {layers} MoE layers × {EXPERTS} records of {length} bytes (stride {stride}), {:.2} GB",
        model.display(),
        offset as f64 / 1e9
    );
    Ok(model)
}

fn drop_caches() -> bool {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The fetches of one measurement: (layer, experts).
fn requests(a: &Args, layers: &[usize], seed: u64) -> Vec<(usize, Vec<usize>)> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::new();
    if !a.reuse {
        // Every record once: each layer's experts shuffled, cut into top-k groups, layers shuffled.
        for &l in layers {
            let mut ex: Vec<usize> = (0..EXPERTS).collect();
            for i in (1..ex.len()).rev() {
                ex.swap(i, rng.below(i + 1));
            }
            for g in ex.chunks(a.top_k) {
                out.push((l, g.to_vec()));
            }
        }
        for i in (1..out.len()).rev() {
            out.swap(i, rng.below(i + 1));
        }
    } else {
        // Skewed: expert ids drawn as min of two uniforms (density 2(1-x)), so low ids are hot.
        for _ in 0..a.requests.max(1) {
            let l = layers[rng.below(layers.len())];
            let mut ex = Vec::new();
            while ex.len() < a.top_k {
                let e = rng.below(EXPERTS).min(rng.below(EXPERTS));
                if !ex.contains(&e) {
                    ex.push(e);
                }
            }
            out.push((l, ex));
        }
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse()?;
    let model = create(&a.dir, a.gb)?;
    let dir = ModelDir::open(&model)?;
    let layers: Vec<usize> = (0..dir.manifest.config.num_hidden_layers())
        .filter(|&l| dir.manifest.config.is_moe_layer(l))
        .collect();
    println!(
        "pack {:.2} GB, record {} bytes, qd {}, top-k {}, budget {} MiB, {}",
        dir.manifest.experts.bytes as f64 / 1e9,
        dir.manifest.experts.records[0].length,
        a.qd,
        a.top_k,
        a.budget >> 20,
        if a.reuse {
            "skewed reuse"
        } else {
            "each record once (cold)"
        }
    );
    println!(
        "{:>6} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>12} {:>10}",
        "round", "mode", "GB read", "s", "GB/s", "wait%", "hit%", "cpu s/GB", "experts/s"
    );
    let mut order = Vec::new();
    for r in 0..a.rounds {
        // A B B A …: whichever mode runs first in a pair pays any warm-up.
        let mut m = a.modes.clone();
        if r % 2 == 1 {
            m.reverse();
        }
        order.extend(m.into_iter().map(|m| (r, m)));
    }
    let mut results: Vec<(IoMode, f64, f64, f64)> = Vec::new();
    for (round, mode) in order {
        let dropped = drop_caches();
        let reqs = requests(&a, &layers, 0x1234 + round as u64);
        let store = ExpertStore::open(
            &dir,
            StoreOptions {
                io: mode,
                policy: CachePolicy::Lru,
                readers: a.qd,
                ..StoreOptions::new(a.budget)
            },
        )?;
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        for (l, ex) in &reqs {
            for r in store.fetch(*l, ex)? {
                let (_, e) = r?;
                std::hint::black_box(e.as_bytes()[0]);
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let c = store.counters();
        let gb = c.bytes_read() as f64 / 1e9;
        println!(
            "{:>6} {:>9} {:>8.2} {:>8.2} {:>8.3} {:>9.1} {:>8.1} {:>12.2} {:>10.0}{}",
            round,
            mode.to_string(),
            gb,
            secs,
            gb / secs,
            100.0 * c.read_wait_ns as f64 / 1e9 / secs,
            100.0 * c.hit_rate(),
            cpu / gb.max(1e-9),
            (c.hits + c.misses) as f64 / secs,
            if dropped {
                ""
            } else {
                "  (page cache NOT dropped: not root?)"
            }
        );
        results.push((mode, gb / secs, cpu / gb.max(1e-9), (c.hits + c.misses) as f64 / secs));
    }
    println!("summary (median [min, max] over rounds):");
    for mode in &a.modes {
        let col = |f: fn(&(IoMode, f64, f64, f64)) -> f64| {
            let mut v: Vec<f64> = results.iter().filter(|r| r.0 == *mode).map(f).collect();
            v.sort_by(f64::total_cmp);
            let med = if v.len() % 2 == 1 {
                v[v.len() / 2]
            } else {
                (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
            };
            format!("{med:.3} [{:.3}, {:.3}]", v[0], v[v.len() - 1])
        };
        println!(
            "  {:>9}: GB/s {}  cpu s/GB {}  experts/s {}",
            mode.to_string(),
            col(|r| r.1),
            col(|r| r.2),
            col(|r| r.3)
        );
    }
    Ok(())
}
