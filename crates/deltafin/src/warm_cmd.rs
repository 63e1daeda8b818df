//! `deltafin warm`: fetch the most valuable missing experts of a streaming install.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use deltafin_pull::warm::{warm, WarmOptions};
use deltafin_pull::Http;

use crate::convert_cmd::progress_bar;
use crate::size;

#[derive(clap::Args)]
pub(crate) struct WarmArgs {
    // The model directory of a streaming install (`deltafin pull --stream`).
    #[command(flatten)]
    model_dir: crate::model_path::ModelPath,
    /// Router traces (from `run --trace-routes`) ranking the experts: the most chosen first.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    traces: Vec<PathBuf>,
    /// Most bytes of expert records to fetch, e.g. 2G (default: every missing record).
    #[arg(long, value_parser = size::parse_size, allow_negative_numbers = true)]
    budget: Option<u64>,
    /// Allow fetching from the install's source (needed unless the install allows it).
    #[arg(long)]
    allow_network: bool,
    /// Records fetched at once.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    concurrency: usize,
}

pub(crate) fn run(a: &WarmArgs) -> Result<()> {
    let http = Arc::new(Http::new(crate::pull_cmd::fetch_options()?)?);
    let opts = WarmOptions {
        traces: a.traces.clone(),
        budget: a.budget,
        allow_network: a.allow_network,
        concurrency: a.concurrency,
    };
    let bar = progress_bar("warming");
    let r = warm(&a.model_dir, http.clone(), &opts, &bar);
    bar.0.finish_and_clear();
    // The errors name the model directory, the record or the URL themselves.
    let r = r?;
    eprintln!(
        "warm {}: fetched {} expert records ({} of records, {} over HTTP, {} retries) in {:.1} s; {} of {} records present{}",
        a.model_dir.display(),
        r.records_fetched,
        size::human(r.record_bytes),
        size::human(r.bytes_fetched),
        http.retries(),
        r.seconds,
        r.present,
        r.total,
        if r.left_out > 0 {
            format!(" ({} missing ones left out by --budget)", r.left_out)
        } else {
            String::new()
        }
    );
    let w = &r.whole;
    if !w.verified.is_empty() {
        eprintln!(
            "warm: {} source files streamed whole, sha256 as published: {} records converted from them are verified",
            w.verified.len(),
            w.records_verified
        );
    }
    for (l, e) in &w.replaced {
        eprintln!(
            "warm: layer {l} expert {e}: the present copy differed from the one converted from the sha256-checked source file; replaced"
        );
    }
    if r.unverifiable > 0 {
        eprintln!(
            "note: unverifiable: {} present records came by byte range from a Hugging Face layout (no published checksum per record); `deltafin cache verify --source {}` compares them with the source",
            r.unverifiable,
            a.model_dir.display()
        );
    }
    Ok(())
}
