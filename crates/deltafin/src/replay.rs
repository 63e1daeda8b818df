//! `deltafin replay`: reads, for every token of a router trace (from `run --trace-routes`), the
//! expert records each MoE layer chose, through the same expert store, cache policies and I/O
//! engine a run uses, without computing anything. Two uses:
//!
//! - the I/O-only half of the overlap measurement: seconds per token here versus a
//!   `run --compute-only` of the same prompt (no expert reads) and a normal run show how well
//!   compute hides under I/O;
//! - cache, pinning, warm-up and prefetch at scale (`--map-experts`): a trace recorded on a
//!   small trained model (the demo) replayed on a large pack (the `bench` or `k3-bench`
//!   preset), its expert ids mapped onto the larger expert set ([`TraceMapper`]), cold start,
//!   under the `--ram-budget` limit. Reports bytes read per token against the no-cache need
//!   (top-k × MoE layers × record), hits, prefetch recall and wasted bytes, and the time spent
//!   waiting for reads.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use deltafin_engine::experts::ExpertStore;
use deltafin_engine::traces::{Trace, TraceMapper, TraceShape};
use deltafin_format::ModelDir;

use crate::model_args::StoreArgs;
use crate::size;

#[derive(clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    model: crate::model_path::ModelPath,
    /// Router trace recorded by `deltafin run --trace-routes` (on this model, or on a smaller one
    /// with --map-experts).
    #[arg(long)]
    trace: PathBuf,
    /// Expert cache budget (e.g. 512MiB, 4G).
    #[arg(long, value_parser = size::parse_size, default_value = "0", allow_negative_numbers = true)]
    ram_budget: u64,
    #[command(flatten)]
    store: StoreArgs,
    /// Replay traces (--trace, --pin-from, --predictions) recorded on a smaller model, their
    /// expert ids mapped onto this model's experts: layer j replays the trace's MoE layer
    /// j mod L; each trace expert owns a fixed block of b = max(this model's experts ÷ the
    /// trace's, ⌈this top-k ÷ the trace's⌉) experts, taken in turn; every token requests this
    /// model's top-k distinct experts per layer. Where b exceeds the ratio, blocks overlap and
    /// a member an earlier pick of the token took is replaced by the next free one (README,
    /// "Router trace format").
    #[arg(long)]
    map_experts: bool,
    /// Next-layer predictions recorded with the trace (`run --trace-predictions`): each layer's
    /// prediction is handed to the store when the layer before it is fetched, as a run does;
    /// with `--prefetch on` the store reads them speculatively, otherwise only recall is counted.
    #[arg(long)]
    predictions: Option<PathBuf>,
    /// Microseconds to pause after each MoE layer's records arrive, standing in for the expert
    /// compute of a run (speculative reads only use the disk while no demand read waits, which
    /// without compute is never). 0: no pause.
    #[arg(long, default_value_t = 0)]
    compute_us: u64,
    /// With `--cache-policy pinned`: wait for the pinned tier to be read before the first token
    /// (warm-up in idle time before a request). Without it the tier fills in the background
    /// while tokens are replayed, as `run` does.
    #[arg(long)]
    warm_idle: bool,
    /// Write per-token timings and the totals as JSON (same `steps` schema as `run --stats-json`).
    #[arg(long)]
    stats_json: Option<PathBuf>,
}

/// A trace file read for the model `dir`, mapped onto it when `map` (else it must fit).
fn load(path: &Path, dir: &ModelDir, map: bool) -> Result<Trace> {
    let c = &dir.manifest.config;
    if !map {
        return Ok(Trace::read_for(path, c)?);
    }
    let t = Trace::read(path)?;
    Ok(t.map_onto(TraceShape::for_model(c)?)?)
}

pub fn run(a: &ReplayArgs) -> Result<()> {
    let dir = ModelDir::open(&a.model)?;
    let cfg = &dir.manifest.config;
    let source = Trace::read(&a.trace).context("--trace")?;
    let target = TraceShape::for_model(cfg).context("--trace")?;
    let mut mapper = if a.map_experts {
        Some(TraceMapper::new(source.shape, target).context("--map-experts")?)
    } else {
        if !source.shape.fits(cfg) {
            bail!(
                "--trace: {}: recorded for another model ({}); --map-experts replays it mapped onto this one",
                a.trace.display(),
                source.shape
            );
        }
        None
    };
    let predictions = match &a.predictions {
        Some(p) => {
            let t = Trace::read(p).context("--predictions")?;
            let s = source.shape;
            if t.shape.n_layers != s.n_layers
                || t.shape.first_moe != s.first_moe + 1
                || t.shape.n_experts != s.n_experts
            {
                bail!(
                    "--predictions: {}: not a prediction trace of the --trace's model ({}; want the layers after its first MoE layer)",
                    p.display(),
                    t.shape
                );
            }
            Some(t)
        }
        None => None,
    };
    let mut store_opts = a.store.options_with(a.ram_budget, &|p| load(p, &dir, a.map_experts))?;
    if store_opts.prefetch && predictions.is_none() {
        bail!("--prefetch on: a replay has no hidden states to predict the next layer's experts from; give --predictions (from run --trace-predictions)");
    }
    if a.warm_idle && store_opts.policy != deltafin_engine::experts::CachePolicy::Pinned {
        bail!("--warm-idle warms the pinned tier: it needs --cache-policy pinned");
    }
    let _network = crate::pull_cmd::attach_source(&mut store_opts, &dir, a.store.allow_network)?;
    let store = ExpertStore::open(&dir, store_opts).context("opening the expert store")?;
    let first_moe = target.first_moe as usize;
    // Experts requested per layer: the model's top-k for a mapped trace, else the trace's own
    // (a trace taken with --experts-per-token replays its K).
    let k = if mapper.is_some() {
        target.top_k
    } else {
        source.shape.top_k
    } as usize;
    let layers = (target.n_layers - target.first_moe) as usize;
    let need_per_token = (k * layers) as u64 * store.record_bytes();

    // Warm-up of the pinned tier: in the background, or before the first token (--warm-idle).
    let t_warm = Instant::now();
    let warm_queued = if store.options().policy == deltafin_engine::experts::CachePolicy::Pinned {
        store.warm_pinned()
    } else {
        0
    };
    if a.warm_idle {
        while store.speculative_pending() > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let warm = store.counters();
    let warm_s = if a.warm_idle {
        t_warm.elapsed().as_secs_f64()
    } else {
        0.0
    };

    let compute = Duration::from_micros(a.compute_us);
    let mut pred_at = 0;
    let mut steps = Vec::new();
    let t_all = Instant::now();
    for (t, (pos, src_ids)) in source.records.iter().enumerate() {
        // This token's prediction record (predictions exist for one-token passes only).
        let pred = predictions.as_ref().and_then(|p| {
            let r = p.records.get(pred_at).filter(|r| r.0 == *pos)?;
            pred_at += 1;
            Some(&r.1)
        });
        let sk = source.shape.top_k as usize;
        // Predicted target experts per target layer (None where the trace has no prediction: the
        // first MoE layer of the source, or a token without a prediction record).
        let predicted: Vec<Option<Vec<usize>>> = (0..layers)
            .map(|j| {
                let pred = pred?;
                let ids = match mapper.as_mut() {
                    Some(m) => {
                        let s = m.source_layer(j);
                        let src = pred.get(s.checked_sub(1)? * sk..s * sk)?;
                        m.map_prediction(j, t, src)
                    }
                    None => pred.get(j.checked_sub(1)? * sk..j * sk)?.to_vec(),
                };
                Some(ids.into_iter().map(usize::from).collect())
            })
            .collect();
        let ids = match mapper.as_mut() {
            Some(m) => m.map_record(t, src_ids),
            None => src_ids.clone(),
        };
        let c0 = store.counters();
        let step = Instant::now();
        for (j, chunk) in ids.chunks(k).enumerate() {
            let experts: Vec<usize> = chunk.iter().map(|&e| e as usize).collect();
            let fetch = store.fetch(first_moe + j, &experts)?;
            if let Some(Some(p)) = predicted.get(j + 1) {
                store.prefetch(first_moe + j + 1, p);
            }
            fetch.in_order()?;
            if !compute.is_zero() {
                std::thread::sleep(compute);
            }
        }
        let secs = step.elapsed().as_secs_f64();
        let d = store.counters().since(&c0);
        steps.push(serde_json::json!({
            "kind": if t == 0 { "first" } else { "token" },
            "position": pos,
            "seconds": secs,
            "io_wait_s": d.read_wait_ns as f64 * 1e-9,
            "expert_bytes_read": d.bytes_read_demand,
            "expert_bytes_read_speculative": d.bytes_read_speculative,
        }));
    }
    let total = t_all.elapsed().as_secs_f64();
    let tokens = source.records.len();
    let n = tokens.max(1) as f64;
    let c = store.counters().since(&warm);
    let demand = c.bytes_read_demand as f64 / n;
    let spec = c.bytes_read_speculative as f64 / n;
    let warm_bytes = warm.bytes_read_speculative;
    let all = (c.bytes_read() + warm_bytes) as f64 / n;
    let need = need_per_token as f64;
    let mib = |b: f64| b / (1u64 << 20) as f64;
    eprintln!("--- deltafin replay (I/O only, no compute) ---");
    eprintln!(
        "trace                {} ({}{})",
        a.trace.display(),
        source.shape,
        if a.map_experts {
            format!(", mapped onto {target}")
        } else {
            String::new()
        }
    );
    eprintln!(
        "store                io {}, cache {} {}, prefetch {}, cold start",
        store.io_mode(),
        store.options().policy,
        size::human(store.budget()),
        if store.options().prefetch { "on" } else { "off" }
    );
    eprintln!("tokens replayed      {tokens}");
    eprintln!(
        "seconds per token    {:.4} (io wait {:.4})",
        total / n,
        c.read_wait_ns as f64 * 1e-9 / n
    );
    eprintln!(
        "no-cache need        {:.2} MiB per token ({k} × {layers} layers × {})",
        mib(need),
        size::human(store.record_bytes())
    );
    eprintln!(
        "bytes read per token demand {:.2} MiB ({:.3} × need), speculative {:.2} MiB, with warm-up {:.2} MiB ({:.3} × need)",
        mib(demand),
        demand / need,
        mib(spec),
        mib(all),
        all / need
    );
    eprintln!(
        "cache                {} hits, {} misses ({:.1} % hit rate), {} evictions",
        c.hits,
        c.misses,
        100.0 * c.hit_rate(),
        c.evictions
    );
    if warm_queued > 0 {
        eprintln!(
            "pinned warm-up       {warm_queued} records queued, {} read before the first token{}",
            size::human(warm_bytes),
            if a.warm_idle {
                format!(" ({warm_s:.2} s idle)")
            } else {
                String::new()
            }
        );
    }
    if predictions.is_some() {
        eprintln!(
            "prefetch             recall {:.1} %, {} issued, {} used, {} wasted",
            100.0 * c.prefetch_recall(),
            c.prefetch_issued,
            c.prefetch_useful,
            size::human(c.prefetch_wasted_bytes)
        );
    }
    if let Some(p) = &a.stats_json {
        let json = serde_json::json!({
            "mode": "io_only",
            "trace_shape": source.shape.to_string(),
            "mapped_onto": a.map_experts.then(|| target.to_string()),
            "tokens": tokens,
            "seconds_per_token": total / n,
            "io_wait_s_per_token": c.read_wait_ns as f64 * 1e-9 / n,
            "ram_budget": store.budget(),
            "cache_policy": store.options().policy.to_string(),
            "prefetch": store.options().prefetch,
            "compute_us": a.compute_us,
            "requests_per_token": k * layers,
            "record_bytes": store.record_bytes(),
            "need_bytes_per_token": need_per_token,
            "expert_bytes_read_demand": c.bytes_read_demand,
            "expert_bytes_read_speculative": c.bytes_read_speculative,
            "warm_bytes": warm_bytes,
            "warm_idle_s": warm_s,
            "demand_over_need": demand / need,
            "all_over_need": all / need,
            "hits": c.hits,
            "misses": c.misses,
            "hit_rate": c.hit_rate(),
            "prefetch_recall": c.prefetch_recall(),
            "prefetch_issued": c.prefetch_issued,
            "prefetch_useful": c.prefetch_useful,
            "prefetch_wasted_bytes": c.prefetch_wasted_bytes,
            "io_mode": store.io_mode().to_string(),
            "steps": steps,
        });
        std::fs::write(p, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
