//! `deltafin warm`: fetch the most valuable missing experts of a streaming install ahead of use.
//!
//! Missing records are ranked by how often the given router traces chose them (hottest first;
//! ties and experts never seen in a trace in (layer, expert) order), and fetched in that order
//! while their resident size (length rounded up to 4 KiB) fits in the byte budget. Each batch of
//! records is written, fsynced and journaled before the next starts
//! ([`deltafin_format::presence::commit_records`]), so the command can be killed at any moment
//! and resumed: a killed batch is simply fetched again.
//!
//! Records are written in the final packed layout from the start (the converter's record
//! encoder), so there is no older or slower cache layout to rewrite.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use deltafin_format::model_dir::ExpertRecord;
use deltafin_format::presence::{present_checksums, Journal};
use deltafin_format::ModelDir;

use crate::records::{fetch_records, trace_heat};
use crate::{io_err, Http, HttpRecordSource, PullError};

/// `warm` settings.
#[derive(Debug, Clone, Default)]
pub struct WarmOptions {
    /// Router traces (from `--trace-routes`) that rank the experts.
    pub traces: Vec<PathBuf>,
    /// Most bytes of records to fetch (resident size); None = every missing record.
    pub budget: Option<u64>,
    /// Network use allowed by the command line (the manifest's `allow_network` also allows it).
    pub allow_network: bool,
    /// Records fetched at once (0 = 4).
    pub concurrency: usize,
}

/// What `warm` did.
#[derive(Debug, Clone, Default)]
pub struct WarmReport {
    pub records_fetched: usize,
    /// Record bytes written.
    pub record_bytes: u64,
    /// Body bytes received over HTTP.
    pub bytes_fetched: u64,
    pub seconds: f64,
    /// Records present afterwards, of all records.
    pub present: usize,
    pub total: usize,
    /// Missing records the budget left out.
    pub left_out: usize,
    /// Source files this warm completed, streamed whole and checked against their sha256.
    pub whole: crate::whole::WholeFiles,
    /// Hugging Face layout: present records afterwards not verified against a source file's
    /// sha256 (0 for a mirror or a full install).
    pub unverifiable: usize,
}

/// (layer, expert).
type Key = (u32, u32);

fn resident(r: &ExpertRecord) -> u64 {
    r.length.div_ceil(4096) * 4096
}

/// `deltafin warm <model_dir>`: see the module docs.
///
/// Errors: not a streaming install is fine (nothing to do); network not allowed; unreadable
/// traces or traces of another model shape; fetch and write failures.
pub fn warm(
    model_dir: &Path,
    http: Arc<Http>,
    opts: &WarmOptions,
    progress: &dyn deltafin_format::convert::Progress,
) -> Result<WarmReport, PullError> {
    let t0 = Instant::now();
    let dir = ModelDir::open(model_dir)?;
    let total = dir.manifest.experts.records.len();
    // The traces are read (and checked against the model) even when nothing is missing, so a
    // wrong path or another model's trace is reported on a full install too.
    let heat = trace_heat(&opts.traces, &dir.manifest.config)?;
    let Some(stream) = dir.manifest.stream.clone() else {
        return Ok(WarmReport {
            present: total,
            total,
            ..WarmReport::default()
        });
    };
    let present = present_checksums(&dir)?;
    let mut missing: Vec<&ExpertRecord> = dir
        .manifest
        .experts
        .records
        .iter()
        .filter(|r| !present.contains_key(&(r.layer, r.expert)))
        .collect();
    missing.sort_by(|a, b| {
        let h = |r: &ExpertRecord| heat.get(&(r.layer, r.expert)).copied().unwrap_or(0);
        h(b).cmp(&h(a)).then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
    });
    let budget = opts.budget.unwrap_or(u64::MAX);
    let mut used = 0u64;
    let mut chosen = Vec::new();
    for r in &missing {
        if used + resident(r) > budget {
            break;
        }
        used += resident(r);
        chosen.push((r.layer, r.expert));
    }
    let left_out = missing.len() - chosen.len();
    let allowed = opts.allow_network || stream.allow_network;
    if !chosen.is_empty() && !allowed {
        return Err(PullError::Invalid(format!(
            "{}: {} expert records are missing; fetching them from {} needs --allow-network",
            model_dir.display(),
            missing.len(),
            stream.url
        )));
    }
    let src = HttpRecordSource::open(&dir, http.clone())?;
    let bytes: u64 = chosen
        .iter()
        .map(|&(l, e)| dir.record(l as usize, e as usize).length)
        .sum();
    progress.start(bytes);
    // Files this warm completes are streamed whole and checked (crate::whole); the rest by range.
    let mut index = src.index().clone();
    let (whole, handled) = if chosen.is_empty() {
        Default::default()
    } else {
        let pack_path = dir.expert_pack_path();
        let pack = deltafin_fs::open_regular_with(OpenOptions::new().write(true), 0, &pack_path)
            .map_err(io_err(&pack_path))?;
        let journal = Journal::open(&dir.path)?;
        crate::whole::warm_whole_files(
            &dir,
            &src,
            &present,
            &chosen,
            (&pack, &journal),
            &mut index.verified_xxh3,
            &|b| progress.advance(b),
        )?
    };
    if !whole.verified.is_empty() {
        for f in &whole.verified {
            if !whole.backbone_mismatch.iter().any(|(b, _)| b == f) && !index.verified_files.contains(f) {
                index.verified_files.push(f.clone());
            }
        }
        index.write(&dir.path, &stream.index)?;
    }
    let by_range: Vec<Key> = chosen.iter().filter(|k| !handled.contains(k)).copied().collect();
    let fetched = fetch_records(&dir, &src, &by_range, opts.concurrency, &|b| progress.advance(b))?;
    progress.finish();
    let fetched = fetched + whole.records_fetched;
    if let Some((file, why)) = whole.backbone_mismatch.first() {
        return Err(PullError::Invalid(format!(
            "{}: {why}: backbone.bin of this install was converted from corrupted bytes; install it again (`deltafin pull` into a new directory, or `--full`)",
            src.file_url(file)
        )));
    }
    if let Some((file, why)) = whole.failed.first() {
        return Err(PullError::Invalid(format!(
            "{why}: {file} is not the file published at install (or the connection corrupts it), so the {} expert records converted from it were not stored; {} other records were fetched",
            whole.records_refused, fetched
        )));
    }
    let unverifiable = if src.checks_records() {
        0
    } else {
        present_checksums(&dir)?
            .iter()
            .filter(|((l, e), h)| index.verified(*l, *e, **h) != Some(true))
            .count()
    };
    Ok(WarmReport {
        records_fetched: fetched,
        record_bytes: bytes,
        bytes_fetched: http.bytes_received(),
        seconds: t0.elapsed().as_secs_f64(),
        present: total - missing.len() + fetched,
        total,
        left_out,
        whole,
        unverifiable,
    })
}
