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
        model_dir: crate::ModelPath,
        /// Router traces (from `run --trace-routes`): report the share of their expert choices
        /// whose record is present.
        #[arg(long, value_name = "FILE", num_args = 1..)]
        traces: Vec<PathBuf>,
    },
    /// Re-check the checksum of every present record (exit status 1 if any fails).
    Verify {
        #[command(flatten)]
        model_dir: crate::ModelPath,
    },
    /// Remove work files of interrupted pulls/converts, torn or failing journal entries, and the
    /// blocks of records that never completed. Run it while nothing else uses the directory.
    Gc {
        #[command(flatten)]
        model_dir: crate::ModelPath,
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
        CacheCmd::Verify { model_dir } => {
            let r = cache::verify(model_dir)?;
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
