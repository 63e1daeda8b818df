//! `deltafin replay`: the I/O-only half of the overlap measurement. Reads, for every token of a
//! router trace (from `run --trace-routes`), the expert records each MoE layer chose, through the
//! same expert store a run uses, without computing anything. Seconds per token here versus a
//! `run --compute-only` of the same prompt (no expert reads) and a normal run show how well
//! compute hides under I/O.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deltafin_engine::experts::ExpertStore;
use deltafin_engine::traces::Trace;
use deltafin_format::ModelDir;

use crate::model_args::StoreArgs;
use crate::size;

#[derive(clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    model: crate::model_path::ModelPath,
    /// Router trace recorded on this model by `deltafin run --trace-routes`.
    #[arg(long)]
    trace: PathBuf,
    /// Expert cache budget (e.g. 512MiB, 4G).
    #[arg(long, value_parser = size::parse_size, default_value = "0", allow_negative_numbers = true)]
    ram_budget: u64,
    #[command(flatten)]
    store: StoreArgs,
    /// Write per-token timings as JSON (same `steps` schema as `run --stats-json`).
    #[arg(long)]
    stats_json: Option<PathBuf>,
}

pub fn run(a: &ReplayArgs) -> Result<()> {
    let dir = ModelDir::open(&a.model)?;
    let trace = Trace::read_for(&a.trace, &dir.manifest.config).context("--trace")?;
    let first_moe = trace.shape.first_moe as usize;
    let mut store_opts = a.store.options(a.ram_budget, &dir)?;
    if store_opts.prefetch {
        bail!("--prefetch on: a replay has no hidden states to predict the next layer's experts from; leave it off");
    }
    let _network = crate::pull_cmd::attach_source(&mut store_opts, &dir, a.store.allow_network)?;
    let store = ExpertStore::open(&dir, store_opts).context("opening the expert store")?;
    let k = trace.shape.top_k as usize;
    let mut steps = Vec::new();
    let t_all = Instant::now();
    for (pos, ids) in &trace.records {
        let c0 = store.counters();
        let t = Instant::now();
        for (i, chunk) in ids.chunks(k).enumerate() {
            let experts: Vec<usize> = chunk.iter().map(|&e| e as usize).collect();
            store.get(first_moe + i, &experts)?;
        }
        let secs = t.elapsed().as_secs_f64();
        let d = store.counters().since(&c0);
        steps.push(serde_json::json!({
            "kind": if *pos == 0 || steps.is_empty() { "first" } else { "token" },
            "position": pos,
            "seconds": secs,
            "io_wait_s": d.read_wait_ns as f64 * 1e-9,
            "expert_bytes_read": d.bytes_read_demand,
        }));
    }
    let total = t_all.elapsed().as_secs_f64();
    let n = trace.records.len().max(1);
    let counters = store.counters();
    eprintln!("--- deltafin replay (I/O only, no compute) ---");
    eprintln!("tokens replayed      {}", trace.records.len());
    eprintln!("seconds per token    {:.4}", total / n as f64);
    eprintln!(
        "expert bytes read    {} ({} per token), io {}",
        size::human(counters.bytes_read_demand),
        size::human(counters.bytes_read_demand / n as u64),
        store.io_mode()
    );
    if let Some(p) = &a.stats_json {
        let json = serde_json::json!({
            "mode": "io_only",
            "tokens": trace.records.len(),
            "seconds_per_token": total / n as f64,
            "expert_bytes_read_demand": counters.bytes_read_demand,
            "io_mode": store.io_mode().to_string(),
            "steps": steps,
        });
        std::fs::write(p, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
