//! `deltafin convert`: a Hugging Face checkpoint into a deltafin model directory, with a
//! progress bar (also the progress sink of `pull --full`, `synth` and `demo`), and its
//! `--dry-run` report.

use std::path::Path;

use anyhow::{Context, Result};
use clap::ValueEnum;
use deltafin_format::convert::{convert, ConvertOptions, Progress};
use deltafin_format::StoredDtype;

use crate::{log, size};

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum BackboneDtype {
    Int8,
    Bf16,
    F32,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ExpertDtype {
    Mxfp4,
    Bf16,
    F32,
}

/// An indicatif progress bar in bytes, as the converter's and synthesizer's progress sink.
pub(crate) struct Bar(pub(crate) indicatif::ProgressBar);

impl Progress for Bar {
    fn start(&self, total: u64) {
        log::set_active_bar(&self.0);
        self.0.set_length(total);
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

pub(crate) fn progress_bar(message: &str) -> Bar {
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(message.to_string());
    log::set_active_bar(&pb);
    Bar(pb)
}

pub(crate) fn cmd_convert_dry_run(hf_dir: &Path, model_dir: &Path, force: bool) -> Result<()> {
    let p = deltafin_format::convert::plan(hf_dir).with_context(|| format!("checking {}", hf_dir.display()))?;
    let f = deltafin_format::footprint::Footprint::of(&p.config);
    eprintln!(
        "{}: complete {} ({}) checkpoint: {} backbone tensors, {} expert records, {} of source weights, {} tensors ignored",
        hf_dir.display(),
        p.config.family(),
        p.config.model_type(),
        p.backbone_tensors,
        p.expert_records,
        size::human(p.source_bytes),
        p.ignored_tensors.len()
    );
    eprintln!(
        "would write: backbone {} (int8) or {} (bf16), expert pack {} (MXFP4); nothing written (--dry-run)",
        size::human(f.backbone_int8),
        size::human(f.backbone_bf16),
        size::human(f.expert_pack)
    );
    let occupied = std::fs::read_dir(model_dir).is_ok_and(|mut d| d.next().is_some());
    if occupied && !force {
        eprintln!(
            "note: {} exists and is not empty: the real convert needs --force to replace it",
            model_dir.display()
        );
    }
    Ok(())
}

pub(crate) fn cmd_convert(
    hf_dir: &Path,
    model_dir: &Path,
    backbone: BackboneDtype,
    experts: ExpertDtype,
    force: bool,
) -> Result<()> {
    let opts = ConvertOptions {
        backbone: match backbone {
            BackboneDtype::Int8 => StoredDtype::Int8,
            BackboneDtype::Bf16 => StoredDtype::Bf16,
            BackboneDtype::F32 => StoredDtype::F32,
        },
        experts: match experts {
            ExpertDtype::Mxfp4 => StoredDtype::Mxfp4,
            ExpertDtype::Bf16 => StoredDtype::Bf16,
            ExpertDtype::F32 => StoredDtype::F32,
        },
        force,
    };
    let bar = progress_bar("converting");
    let t0 = std::time::Instant::now();
    let report = convert(hf_dir, model_dir, &opts, &bar).with_context(|| format!("converting {}", hf_dir.display()))?;
    bar.0.finish_and_clear();
    eprintln!(
        "converted {} -> {} in {:.1} s: backbone {} ({}), expert pack {} ({} records of {} bytes, {})",
        hf_dir.display(),
        model_dir.display(),
        t0.elapsed().as_secs_f64(),
        size::human(report.backbone_bytes),
        opts.backbone.name(),
        size::human(report.expert_pack_bytes),
        report.expert_records,
        report.record_stride,
        opts.experts.name(),
    );
    if !report
        .tokenizer_files
        .iter()
        .any(|f| f == "tokenizer.json" || f == "tiktoken.model")
    {
        eprintln!(
            "warning: {} has no tokenizer.json or tiktoken.model: the model runs only with `deltafin run --prompt-ids`, which prints token ids (chat and serve need a tokenizer)",
            hf_dir.display()
        );
    }
    if !report.ignored_tensors.is_empty() {
        let shown: Vec<&str> = report.ignored_tensors.iter().take(3).map(String::as_str).collect();
        let more = report.ignored_tensors.len() - shown.len();
        eprintln!(
            "ignored {} source tensors (MTP layers, non-text towers, rotary buffers): {}{}",
            report.ignored_tensors.len(),
            shown.join(", "),
            if more > 0 {
                format!(", and {more} more")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
