//! `deltafin demo`: the embedded default. Synthesizes a small deterministic DeepSeek-V3-architecture
//! checkpoint (random weights), converts it, and generates from it in a child `deltafin run`
//! process whose expert cache budget is a quarter of the expert pack, so routed experts really
//! stream from disk and the printed peak memory is that of generation alone.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use deltafin_format::synth::{write_checkpoint, SynthSpec};
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;

use crate::{cmd_convert, size, BackboneDtype, ExpertDtype};

/// Merge corpus of the synthetic byte-level tokenizer (demo and `synth` presets).
pub(crate) const CORPUS: &str =
    "Deltafin keeps the backbone resident and reads only the routed experts the router picks \
from local storage on demand. The model decides every token: no dropped experts, no lossy substitutes. \
Mixture-of-Experts language models activate only a few experts per token, so a workstation can run \
models far larger than its memory, as fast as the storage allows.";

/// Chat template of the synthetic models.
pub(crate) const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}{% elif m['role'] == 'assistant' %}<|Assistant|>{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}";

/// Beginning- and end-of-sequence tokens of the synthetic tokenizer.
pub(crate) const BOS: &str = "<|begin_of_sentence|>";
pub(crate) const EOS: &str = "<|end_of_sentence|>";
/// Special tokens of the synthetic tokenizer, in id order after the byte-level vocabulary.
pub(crate) const SPECIALS: &[&str] = &[BOS, EOS, "<|User|>", "<|Assistant|>"];

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the demo in `dir` (a temporary directory when `None`); `raw_output` is passed to the
/// child `deltafin run` as `--raw-output`.
///
/// Errors: `max_new_tokens` 0, files that cannot be written, a failing child run.
pub fn run(dir: Option<PathBuf>, max_new_tokens: usize, raw_output: bool) -> Result<()> {
    if max_new_tokens == 0 {
        anyhow::bail!("--max-new-tokens must be at least 1");
    }
    let t0 = std::time::Instant::now();
    let (root, _guard) = match dir {
        Some(d) => (d, None),
        None => {
            let d = std::env::temp_dir().join(format!("deltafin-demo-{}", std::process::id()));
            (d.clone(), Some(TempDir(d)))
        }
    };
    let hf = root.join("hf-checkpoint");
    let model = root.join("model");
    eprintln!("deltafin demo: a small DeepSeek-V3-architecture model with RANDOM weights (its text is meaningless).");
    eprintln!("files in {}", root.display());

    deltafin_tokenizer::synth::write_byte_level_tokenizer(&hf, CORPUS, 256, SPECIALS, BOS, EOS, CHAT_TEMPLATE)?;
    let tok = Tokenizer::from_dir(&hf)?;
    let bos = tok.token_to_id(BOS).context("demo tokenizer lacks its BOS token")?;
    let eos = tok.token_to_id(EOS).context("demo tokenizer lacks its EOS token")?;
    let spec = SynthSpec::demo(tok.vocab_size());
    let bytes = write_checkpoint(&hf, &spec, bos, eos)?;
    eprintln!(
        "synthesized checkpoint: {} layers, {} routed experts (top-{}), hidden {}, {} of bf16 weights",
        spec.num_hidden_layers,
        spec.n_routed_experts,
        spec.num_experts_per_tok,
        spec.hidden_size,
        size::human(bytes)
    );
    cmd_convert(&hf, &model, BackboneDtype::Int8, ExpertDtype::Mxfp4, true)?;
    let pack = ModelDir::open(&model)?.manifest.experts.bytes;
    let budget = (pack / 4) & !((1 << 20) - 1);
    eprintln!(
        "generating with an expert cache budget of {} for an expert pack of {} ({:.2}× the budget)\n",
        size::human(budget),
        size::human(pack),
        pack as f64 / budget.max(1) as f64
    );
    let exe = std::env::current_exe().context("locating the deltafin executable")?;
    let status = Command::new(exe)
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Routed experts stream from disk while the backbone stays resident.",
        ])
        .args(["--max-new-tokens", &max_new_tokens.to_string(), "--ignore-eos"])
        .args(["--ram-budget", &budget.to_string()])
        .args(raw_output.then_some("--raw-output"))
        .status()
        .context("starting `deltafin run`")?;
    if !status.success() {
        bail!("`deltafin run` failed ({status})");
    }
    eprintln!("demo finished in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
