//! `deltafin demo`: the embedded default. By default it writes the embedded trained model (a
//! small DeepSeek-V3-architecture MoE trained on Python and Rust documentation,
//! train/demo_model/README.md) to a directory and asks it a question in a child `deltafin run`
//! process whose expert cache budget is a quarter of the expert pack, so routed experts really
//! stream from disk and the printed peak memory is that of generation alone. `--random`
//! instead synthesizes a deterministic random-weight checkpoint of the same family, converts it
//! and generates from it (its text is meaningless).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use deltafin_format::synth::{write_checkpoint, SynthSpec};
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;

use crate::convert_cmd::{cmd_convert, BackboneDtype, ExpertDtype};
use crate::size;

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

/// The trained model's files, as `deltafin convert` wrote them (crates/deltafin/demo-model/).
const TRAINED_FILES: &[(&str, &[u8])] = &[
    ("manifest.json", include_bytes!("../demo-model/manifest.json")),
    ("config.json", include_bytes!("../demo-model/config.json")),
    (
        "generation_config.json",
        include_bytes!("../demo-model/generation_config.json"),
    ),
    ("tokenizer.json", include_bytes!("../demo-model/tokenizer.json")),
    (
        "tokenizer_config.json",
        include_bytes!("../demo-model/tokenizer_config.json"),
    ),
    ("backbone.bin", include_bytes!("../demo-model/backbone.bin")),
    ("experts.pack", include_bytes!("../demo-model/experts.pack")),
];

/// The question the trained demo answers unless `--prompt` says otherwise.
pub const DEFAULT_PROMPT: &str = "What does json.dumps do?";

/// Flags of `deltafin demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Where to keep the demo files (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub max_new_tokens: usize,
    /// Write the generated text exactly, control characters included, also to a terminal
    /// (where they are shown escaped by default, as `\u{1b}`).
    #[arg(long)]
    pub raw_output: bool,
    /// Synthesize and run a random-weight model of the same family instead (meaningless text).
    #[arg(long)]
    pub random: bool,
    /// The question for the trained model (default: "What does json.dumps do?").
    #[arg(long)]
    pub prompt: Option<String>,
    /// Where to compute, as for `run`: `cpu` (the default), `cuda`, `cuda:N` or `auto`.
    #[arg(long, default_value = "cpu")]
    pub device: deltafin_engine::Device,
}

/// Runs the demo.
///
/// Errors: `max_new_tokens` 0, `--prompt` with `--random`, files that cannot be written, a
/// failing child run.
pub fn run(o: DemoArgs) -> Result<()> {
    if o.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if o.random && o.prompt.is_some() {
        bail!("--prompt applies to the trained model; --random generates from a fixed prompt");
    }
    let t0 = std::time::Instant::now();
    let (root, _guard) = match o.dir {
        Some(d) => (d, None),
        None => {
            let d = std::env::temp_dir().join(format!("deltafin-demo-{}", std::process::id()));
            (d.clone(), Some(TempDir(d)))
        }
    };
    let model = root.join("model");
    let prompt_args: Vec<String> = if o.random {
        random_model(&root, &model)?;
        vec![
            "--prompt".into(),
            "Routed experts stream from disk while the backbone stays resident.".into(),
            "--ignore-eos".into(),
        ]
    } else {
        eprintln!(
            "deltafin demo: a small DeepSeek-V3-architecture MoE trained on Python and Rust documentation \
             (8 layers, 64 routed experts, top-6; `deltafin demo --random` runs a random-weight model)."
        );
        eprintln!("files in {}", root.display());
        write_trained(&model)?;
        let q = o.prompt.unwrap_or_else(|| DEFAULT_PROMPT.to_string());
        eprintln!("question: {q}");
        vec!["--chat".into(), "--prompt".into(), q]
    };
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
        .args(&prompt_args)
        .args(["--max-new-tokens", &o.max_new_tokens.to_string()])
        .args(["--ram-budget", &budget.to_string()])
        .args(o.raw_output.then_some("--raw-output"))
        .args(["--device", &o.device.to_string()])
        .status()
        .context("starting `deltafin run`")?;
    if !status.success() {
        bail!("`deltafin run` failed ({status})");
    }
    eprintln!("demo finished in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// Writes the embedded trained model into `model` (created; an existing directory is replaced
/// only if it holds nothing but these files).
fn write_trained(model: &Path) -> Result<()> {
    if model.exists() {
        let foreign: Vec<String> = std::fs::read_dir(model)
            .with_context(|| format!("reading {}", model.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !TRAINED_FILES.iter().any(|(f, _)| f == n))
            .collect();
        if !foreign.is_empty() {
            bail!(
                "{}: holds files the demo did not write ({}); choose another --dir",
                model.display(),
                foreign.join(", ")
            );
        }
    }
    std::fs::create_dir_all(model).with_context(|| format!("creating {}", model.display()))?;
    for (name, bytes) in TRAINED_FILES {
        let p = model.join(name);
        std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Synthesizes the random-weight checkpoint into `root/hf-checkpoint` and converts it to `model`.
fn random_model(root: &Path, model: &Path) -> Result<()> {
    let hf = root.join("hf-checkpoint");
    eprintln!(
        "deltafin demo --random: a small DeepSeek-V3-architecture model with RANDOM weights (its text is meaningless)."
    );
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
    cmd_convert(&hf, model, BackboneDtype::Int8, ExpertDtype::Mxfp4, true)?;
    Ok(())
}
