//! `deltafin info`: what a model costs deltafin, from its config alone (a deltafin model
//! directory, a Hugging Face checkpoint directory, or a bare `config.json`): resident bytes, expert
//! record and pack bytes, expert bytes per decode token, decode-state bytes, and the decode time
//! per token the storage floor predicts at given read bandwidths.

use anyhow::Result;
use deltafin_format::footprint::Footprint;
use deltafin_format::{ModelConfig, ModelDir};

use crate::size;

#[derive(clap::Args)]
pub struct InfoArgs {
    // A deltafin model directory, a Hugging Face checkpoint directory, or a config.json file.
    #[command(flatten)]
    path: crate::model_path::ModelPath,
    /// Storage read bandwidths for the predicted seconds per token, GB/s (10^9 bytes/s).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1.0, 3.0, 7.0, 14.0], allow_negative_numbers = true)]
    bandwidth: Vec<f64>,
}

pub fn run(a: &InfoArgs) -> Result<()> {
    let p = &a.path;
    // `exists`: a FIFO in place of `manifest.json` is refused by the model directory's reader
    // (naming it), not mistaken for a Hugging Face directory.
    let dir = if p.join("manifest.json").exists() {
        Some(ModelDir::open(p)?)
    } else {
        None
    };
    let manifest = dir.as_ref().map(|d| d.manifest.clone());
    let cfg: ModelConfig = if let Some(m) = &manifest {
        m.config.clone()
    } else {
        let file = if p.is_dir() {
            p.join("config.json")
        } else {
            p.to_path_buf()
        };
        // The error names the file already.
        ModelConfig::from_file(&file)?.0
    };
    if let Some(b) = a.bandwidth.iter().find(|b| !(b.is_finite() && **b > 0.0)) {
        anyhow::bail!("--bandwidth {b}: must be a positive number of GB/s");
    }
    let mut f = Footprint::of(&cfg);
    let h = |b: u64| format!("{} ({b} bytes)", size::human(b));
    // A model directory: its stored layout (the dtypes it was converted with), not the defaults.
    let stored = manifest.as_ref().map(|m| {
        let record = m.experts.records.first().map_or(0, |r| r.length);
        let align = m.experts.record_align.max(1);
        f.expert_record = record;
        f.expert_stride = record.div_ceil(align) * align;
        f.expert_pack = m.experts.bytes;
        f.expert_bytes_per_token = (f.moe_layers * f.top_k) as u64 * f.expert_stride;
        (m.backbone.matrix_dtype.name(), m.backbone.bytes, m.experts.dtype.name())
    });
    println!("model                      {} ({})", cfg.family(), cfg.model_type());
    println!(
        "layers                     {} ({} MoE), hidden {}, vocab {}",
        cfg.num_hidden_layers(),
        f.moe_layers,
        cfg.hidden_size(),
        cfg.vocab_size()
    );
    println!(
        "routed experts             {} per MoE layer, top-{} per token",
        cfg.n_routed_experts(),
        f.top_k
    );
    let resident = stored.map_or(f.backbone_int8, |s| s.1);
    let expert_dtype = match stored {
        Some((backbone_dtype, backbone_bytes, expert_dtype)) => {
            println!(
                "resident backbone          {} ({backbone_dtype} matrices, as stored in this directory)",
                h(backbone_bytes)
            );
            if let Some(d) = &dir {
                println!("backbone checksums         {}", backbone_checksums(d)?);
                println!("expert record checksums    {}", record_checksums(d)?);
            }
            expert_dtype
        }
        None => {
            println!("resident backbone (int8)   {}", h(f.backbone_int8));
            println!("resident backbone (bf16)   {}", h(f.backbone_bf16));
            "mxfp4"
        }
    };
    let label = format!("one expert ({expert_dtype})");
    println!(
        "{label:<27}{}, {} with 4 KiB padding",
        h(f.expert_record),
        h(f.expert_stride)
    );
    println!(
        "expert pack                {} in {} records",
        h(f.expert_pack),
        f.expert_records
    );
    println!(
        "expert bytes per token     {} when nothing is cached",
        h(f.expert_bytes_per_token)
    );
    println!(
        "decode state per token     {} of context (f32 caches)",
        h(f.state_per_token)
    );
    println!(
        "decode state, fixed        {} per sequence (recurrent + conv states)",
        h(f.state_fixed)
    );
    for b in &a.bandwidth {
        let s = f.seconds_per_token(b * 1e9);
        let per_token = if s >= 0.1 {
            format!("{s:.3} s")
        } else {
            format!("{:.3} ms", s * 1e3)
        };
        println!(
            "storage floor at {b:>5.1} GB/s {per_token}/token ({:.2} tokens/s) with a cold expert cache",
            1.0 / s
        );
    }
    crate::cuda_info::print(resident, f.expert_record);
    Ok(())
}

/// The `backbone checksums` line of `info` for a model directory (issue #19, item 6).
fn backbone_checksums(d: &ModelDir) -> Result<String> {
    let n = d.manifest.backbone.tensors.len();
    Ok(if !d.backbone_checksummed() {
        "none: unverified (written by a deltafin before backbone checksums; re-run `deltafin convert` or `deltafin pull` to add them)".into()
    } else if deltafin_pull::fetch::source_checks_records(d)? == Some(false) {
        // Issue #19, item 7: the tensors came by byte range from a Hugging Face layout.
        if deltafin_pull::cache::backbone_verified(d)? {
            format!("xxh3 per tensor ({n} tensors), verified at load and by `deltafin cache verify`; the bytes they were converted from matched the source files' published sha256 (checked by `deltafin warm`)")
        } else {
            format!("xxh3 per tensor ({n} tensors), verified at load and by `deltafin cache verify`; unverifiable against the source: converted from byte ranges of a Hugging Face layout (no published checksum per range), so the checksums show the tensors intact since the install, not equal to the source (a `deltafin warm` that completes the source files checks them; `deltafin pull --full` downloads sha256-checked files)")
        }
    } else {
        format!("xxh3 per tensor ({n} tensors), verified at load and by `deltafin cache verify`")
    })
}

/// The `expert record checksums` line of `info` for a model directory (issue #19, item 7).
fn record_checksums(d: &ModelDir) -> Result<String> {
    Ok(match deltafin_pull::fetch::source_checks_records(d)? {
        None => "xxh3 per record, written by convert or pull".into(),
        Some(true) => "xxh3 per record, from the mirror's manifest: each fetched record is checked against it".into(),
        Some(false) => {
            let r = deltafin_pull::cache::verify_counts(d)?;
            format!(
                "unverifiable: {} present records were converted from byte ranges of a Hugging Face layout, which publishes a sha256 per file, not per record ({} verified: converted from whole source files whose sha256 matched, by a `deltafin warm` that completed them); `deltafin cache verify --source {}` compares them with the source",
                r.0,
                r.1,
                d.path.display()
            )
        }
    })
}
