//! `deltafin synth`: writes a deterministic deltafin model directory with random weights directly
//! (no source checkpoint), for tests (`tiny`, `k3-tiny`), the demo's shape (`demo`) and
//! benchmarks (`bench`: a 13.7 GB expert pack in DeepSeek-V3's shape; `k3-bench`: 12.3 GB in
//! Kimi K3's).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use deltafin_format::synth::{write_model_dir, Preset, TokenizerFiles, PRESET_NAMES};
use deltafin_tokenizer::Tokenizer;

use crate::size;

// The synthetic tokenizer is the demo's, so that `--preset demo` gives the demo's vocabulary
// (and hence its embedding shape).
use crate::demo::{BOS, CHAT_TEMPLATE, CORPUS, EOS, SPECIALS};

#[derive(clap::Args)]
pub struct SynthArgs {
    /// Which model: tiny (tests, instant), demo (the demo's shape), bench (13.7 GB expert pack,
    /// DeepSeek-V3 shape), k3-tiny (tests), k3-bench (12.3 GB expert pack, Kimi K3 structure).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(PRESET_NAMES))]
    preset: String,
    /// Output model directory (must not exist or be empty unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing model directory.
    #[arg(long)]
    force: bool,
}

/// Removes a directory when dropped.
struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(a: &SynthArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    // The tokenizer is written first (its vocabulary sizes the embeddings) into a scratch
    // directory beside the output, then copied into the model directory.
    let parent = match a.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    let name = a
        .out
        .file_name()
        .with_context(|| format!("--out {} has no directory name", a.out.display()))?
        .to_string_lossy()
        .into_owned();
    let tok_dir = TempDir(parent.join(format!(".{name}.tokenizer.tmp")));
    deltafin_tokenizer::synth::write_byte_level_tokenizer(&tok_dir.0, CORPUS, 256, SPECIALS, BOS, EOS, CHAT_TEMPLATE)
        .with_context(|| format!("writing the synthetic tokenizer beside {}", a.out.display()))?;
    let (vocab, bos, eos) = tokenizer_ids(&tok_dir.0)?;
    let Some(preset) = Preset::by_name(&a.preset, vocab) else {
        bail!("unknown preset {:?} (one of {})", a.preset, PRESET_NAMES.join(", "));
    };
    let bar = crate::convert_cmd::progress_bar(&format!("synth {}", preset.name));
    let tokenizer = TokenizerFiles {
        dir: tok_dir.0.clone(),
        bos,
        eos,
    };
    let report = write_model_dir(&a.out, &preset, &tokenizer, a.force, &bar)
        .with_context(|| format!("synthesizing the {} preset", preset.name))?;
    bar.0.finish_and_clear();
    let m = deltafin_format::ModelDir::open(&a.out)?;
    let c = &m.manifest.config;
    eprintln!(
        "synthesized {} -> {} in {:.1} s (RANDOM weights: text output is meaningless)",
        preset.name,
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    let moe = c.moe_layers().count();
    let em = c.expert_matrices();
    eprintln!(
        "  {} ({}): {} layers ({} MoE), hidden {}, {} routed experts per MoE layer (top-{}) of {} -> {}, vocab {}",
        c.family(),
        c.model_type(),
        c.num_hidden_layers(),
        moe,
        c.hidden_size(),
        c.n_routed_experts(),
        c.num_experts_per_tok(),
        em[0].cols,
        em[0].rows,
        c.vocab_size()
    );
    eprintln!(
        "  backbone {} (int8), expert pack {} ({} MXFP4 records of {} bytes)",
        size::human(report.backbone_bytes),
        size::human(report.expert_pack_bytes),
        report.expert_records,
        report.record_stride
    );
    Ok(())
}

fn tokenizer_ids(dir: &Path) -> Result<(usize, u32, u32)> {
    let tok = Tokenizer::from_dir(dir)?;
    let bos = tok
        .token_to_id(BOS)
        .context("synthetic tokenizer lacks its BOS token")?;
    let eos = tok
        .token_to_id(EOS)
        .context("synthetic tokenizer lacks its EOS token")?;
    Ok((tok.vocab_size(), bos, eos))
}
