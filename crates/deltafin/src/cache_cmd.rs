//! `deltafin cache stats|verify|gc`: the expert cache of a model directory.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use deltafin_format::ModelDir;
use deltafin_pull::cache;

use crate::size;

#[derive(clap::Args)]
pub(crate) struct CacheArgs {
    #[command(subcommand)]
    cmd: CacheCmd,
}

#[derive(clap::Subcommand)]
enum CacheCmd {
    /// Records present per MoE layer, bytes, and the coverage of router traces.
    Stats {
        #[command(flatten)]
        model_dir: crate::model_path::ModelPath,
        /// Router traces (from `run --trace-routes`): report the share of their expert choices
        /// whose record is present.
        #[arg(long, value_name = "FILE", num_args = 1..)]
        traces: Vec<PathBuf>,
    },
    /// Re-check the backbone's tensor checksums and the checksum of every present record (exit
    /// status 1 if any fails).
    Verify {
        #[command(flatten)]
        model_dir: crate::model_path::ModelPath,
        /// Streaming installs: also read every present record again from the install's source
        /// and compare; a local copy that differs from two agreeing reads is replaced by them.
        /// Records of a Hugging Face layout have no per-record checksum: this is how they are
        /// checked against the source.
        #[arg(long)]
        source: bool,
        /// With --source: also stream each source file with a published sha256 whole through
        /// sha256 (reads the whole checkpoint, stores nothing), to tell whether the source is
        /// still the checkpoint that was installed.
        #[arg(long, requires = "source")]
        whole_files: bool,
        /// With --source: records read at once.
        #[arg(long, default_value_t = 4, allow_negative_numbers = true,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
        concurrency: usize,
    },
    /// Remove work files of interrupted pulls/converts, torn or failing journal entries, and the
    /// blocks of records that never completed. Run it while nothing else uses the directory.
    Gc {
        #[command(flatten)]
        model_dir: crate::model_path::ModelPath,
    },
}

pub(crate) fn run(a: &CacheArgs) -> Result<()> {
    match &a.cmd {
        CacheCmd::Stats { model_dir, traces } => {
            let s = cache::stats(model_dir, traces)?;
            println!("{}: {}", model_dir.display(), s.kind);
            println!("{:>6} {:>9} {:>12}", "layer", "present", "bytes");
            for l in &s.layers {
                println!(
                    "{:>6} {:>4}/{:<4} {:>12}",
                    l.layer,
                    l.present,
                    l.total,
                    size::human(l.bytes)
                );
            }
            println!(
                "total: {} of {} records present ({:.1} %), {} of {}; expert pack on disk: {}",
                s.present,
                s.total,
                100.0 * s.present as f64 / s.total.max(1) as f64,
                size::human(s.present_bytes),
                size::human(s.total_bytes),
                size::human(s.pack_disk_bytes)
            );
            if let Some(c) = s.trace_coverage {
                println!(
                    "trace coverage: {:.1} % of the traces' expert choices are present",
                    100.0 * c
                );
            }
        }
        CacheCmd::Verify {
            model_dir,
            source,
            whole_files,
            concurrency,
        } => {
            let r = cache::verify(model_dir)?;
            for (name, why) in &r.backbone.failures {
                println!("FAILED backbone tensor {name}: {why}");
            }
            for (l, e, why) in &r.failures {
                println!("FAILED layer {l} expert {e}: {why}");
            }
            if r.bad_journal_entries > 0 {
                println!(
                    "note: {} damaged journal entries are ignored (their records count as missing; `deltafin cache gc` drops them)",
                    r.bad_journal_entries
                );
            }
            if r.torn_journal_bytes > 0 {
                println!(
                    "note: a torn final journal entry ({} bytes, from an interruption) is ignored",
                    r.torn_journal_bytes
                );
            }
            if !r.backbone.failures.is_empty() {
                bail!(
                    "{}: {} of {} tensors of backbone.bin failed verification{}: the file is damaged; re-run `deltafin convert` (or `deltafin pull`) to write it again",
                    model_dir.display(),
                    r.backbone.failures.len(),
                    r.backbone.failures.len() + r.backbone.verified + r.backbone.unverified,
                    match r.failures.len() {
                        0 => String::new(),
                        n => format!(", and {n} expert records"),
                    }
                );
            }
            if !r.ok() {
                // Only a streaming install has a source to fetch dropped records from; in a
                // converted (or fully pulled) model the pack itself is damaged.
                let streaming = ModelDir::open(model_dir)?.manifest.stream.is_some();
                let fix = if streaming {
                    format!(
                        "`deltafin cache gc {}` drops them so they are fetched again",
                        model_dir.display()
                    )
                } else {
                    "the expert pack is damaged: re-run `deltafin convert` (or `deltafin pull`) to write it again"
                        .to_string()
                };
                bail!(
                    "{}: {} of {} present records failed verification; {fix}",
                    model_dir.display(),
                    r.failures.len(),
                    r.checked,
                );
            }
            if r.backbone.unverified > 0 {
                println!(
                    "backbone: unverified: {} tensors have no checksum (written by a deltafin before backbone checksums; re-run `deltafin convert` or `deltafin pull` to add them)",
                    r.backbone.unverified
                );
            } else {
                println!("backbone: {} tensors verified", r.backbone.verified);
            }
            if r.verified > 0 {
                println!(
                    "source: {} present records are the ones converted from source files whose sha256 matched the published one (by `deltafin warm`)",
                    r.verified
                );
            }
            if r.unverifiable > 0 && !source {
                println!(
                    "note: unverifiable: {} present records were converted from byte ranges of a Hugging Face layout, which publishes no checksum for them: their xxh3 was computed on arrival, so this shows them intact since, not equal to the source; `deltafin cache verify --source {}` compares them with it (and a `deltafin warm` that completes a source file checks its sha256)",
                    r.unverifiable,
                    model_dir.display()
                );
            }
            if *source {
                verify_source(model_dir, *whole_files, *concurrency)?;
            }
            println!("ok: {} present records of {} verified", r.checked, r.total);
        }
        CacheCmd::Gc { model_dir } => {
            let r = cache::gc(model_dir)
                .with_context(|| format!("cache gc {} (it rewrites files there)", model_dir.display()))?;
            for p in &r.removed {
                println!("removed {}", p.display());
            }
            println!(
                "gc: {} journal entries dropped, {} incomplete records freed ({})",
                r.journal_entries_dropped,
                r.records_freed,
                size::human(r.pack_bytes_freed)
            );
        }
    }
    Ok(())
}

/// `cache verify --source`: see [`cache::verify_source`].
fn verify_source(model_dir: &std::path::Path, whole_files: bool, concurrency: usize) -> Result<()> {
    let http = std::sync::Arc::new(deltafin_pull::Http::new(crate::pull_cmd::http_defaults())?);
    let r = cache::verify_source(model_dir, http, whole_files, concurrency)?;
    for f in &r.files_hashed {
        println!("source file {f}: sha256 as published at install");
    }
    for f in &r.files_without_sha256 {
        println!("source file {f}: no published sha256, not checked whole");
    }
    for (f, why) in &r.files_changed {
        println!("FAILED source file {f}: {why}");
    }
    for (l, e, why) in &r.replaced {
        println!("FAILED layer {l} expert {e}: differs from the source ({why}); replaced by the source's bytes");
    }
    for (l, e, why) in &r.unstable {
        println!("FAILED layer {l} expert {e}: the source sent different bytes on two reads ({why}); left as it is");
    }
    if !r.files_changed.is_empty() {
        bail!(
            "{}: {} source files changed since the install: records fetched from them may not belong to this model; install it again (`deltafin pull --force`)",
            model_dir.display(),
            r.files_changed.len()
        );
    }
    if !r.ok() {
        bail!(
            "{}: {} of {} present records differed from the source ({} replaced by its bytes, {} unstable reads left as they are); run `deltafin cache verify --source` again to confirm",
            model_dir.display(),
            r.replaced.len() + r.unstable.len(),
            r.checked,
            r.replaced.len(),
            r.unstable.len()
        );
    }
    println!("source: {} present records equal the source's", r.checked);
    Ok(())
}
