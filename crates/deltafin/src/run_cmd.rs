//! `deltafin run`: one prompt, one generation, its statistics (stderr lines, `--stats-json`)
//! and `--logits-out`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use deltafin_engine::generate::{generate, GenerateOptions, GenerateStats};
use deltafin_engine::speculate::Drafter;
use deltafin_engine::{BatchForm, CausalLm};
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;

use crate::model_args::{open_model, ram_budget, PassArgs, StoreArgs, BATCH_FORM_NOTE, NON_DEFAULT_ROUTING};
use crate::model_path::ModelPath;
use crate::report::RunReport;
use crate::{device_args, sampling_args, size, term};

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("prompt_input").required(true).multiple(false).args(["prompt", "prompt_ids"]))]
pub(crate) struct RunArgs {
    #[command(flatten)]
    model: ModelPath,
    /// Prompt text.
    #[arg(long, group = "prompt_input")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (no tokenizer involved).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as one user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    max_new_tokens: usize,
    /// Run even when the prompt plus --max-new-tokens exceed the model's context length
    /// (positions the model was never trained on; a warning says so). Without it, such a run is
    /// refused, as `serve` refuses such requests.
    #[arg(long)]
    allow_context_overflow: bool,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Write the generated text exactly, control characters included, also to a terminal
    /// (where they are shown escaped by default, as `\u{1b}`; a pipe or file always gets the
    /// exact text).
    #[arg(long)]
    raw_output: bool,
    /// Expert cache budget, e.g. 512MiB, 4G (default: a quarter of physical memory or of the memory cgroup limit, whichever is lower).
    #[arg(long, value_parser = size::parse_size, allow_hyphen_values = true)]
    ram_budget: Option<u64>,
    /// Write prompt ids, generated ids and every step's logits as JSON to this file.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Write the run's statistics (and a per-step time breakdown) as JSON to this file.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Append every token's routed-expert choices to this router trace file (binary format
    /// documented in the README).
    #[arg(long)]
    trace_routes: Option<PathBuf>,
    /// Measurement: append every one-token pass's next-layer expert predictions (what
    /// `--prefetch on` reads) to this file, a router trace of the MoE layers after the first,
    /// for `deltafin replay --predictions`. Output is unchanged.
    #[arg(long)]
    trace_predictions: Option<PathBuf>,
    /// RESEARCH ONLY: route each token to K experts instead of the model's top-k. Output is then
    /// not equivalent to the model, and every output says so.
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    experts_per_token: Option<usize>,
    /// MEASUREMENT ONLY: compute every chosen expert with one resident record per layer and read
    /// no experts (the compute-only side of the overlap measurement). Output is not the model's.
    #[arg(long)]
    compute_only: bool,
    #[command(flatten)]
    device: device_args::DeviceArgs,
    #[command(flatten)]
    sampling: sampling_args::SamplingArgs,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    passes: PassArgs,
}

pub(crate) fn run(a: &RunArgs) -> Result<()> {
    let dir = ModelDir::open(&a.model)?;
    let budget = ram_budget(a.ram_budget);
    // A model directory without a tokenizer runs on token ids alone: --prompt-ids in, generated
    // ids out (what `convert` promises when the checkpoint has no tokenizer).
    let tokenizer = match Tokenizer::from_dir(&a.model) {
        Ok(t) => Some(t),
        Err(deltafin_tokenizer::TokenizerError::NoTokenizerFile { .. }) if a.prompt_ids.is_some() => None,
        Err(e @ deltafin_tokenizer::TokenizerError::NoTokenizerFile { .. }) => {
            bail!("{e}: --prompt needs a tokenizer (--prompt-ids runs without one and prints token ids)")
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("loading the tokenizer of {}", a.model.display()))),
    };
    let prompt_ids: Vec<u32> = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => {
            if a.chat {
                bail!("--chat needs --prompt text, not --prompt-ids");
            }
            let vocab = dir.manifest.config.vocab_size();
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                bail!(
                    "--prompt-ids: token id {bad} is outside the vocabulary of {} ({vocab} tokens, ids 0 to {})",
                    a.model.display(),
                    vocab - 1
                );
            }
            ids.clone()
        }
        (Some(text), None) => {
            let tokenizer = tokenizer.as_ref().context("--prompt needs a tokenizer")?;
            if a.chat {
                if let Some(e) = tokenizer.chat_template_error() {
                    bail!("--chat: {e}");
                }
                let tpl = tokenizer.chat_template().with_context(|| {
                    format!(
                        "--chat: {} has no chat template in tokenizer_config.json",
                        a.model.display()
                    )
                })?;
                let msg = serde_json::json!({"role": "user", "content": text});
                let rendered = tpl.render(&[msg], true, &serde_json::Value::Null)?;
                tokenizer.encode(&rendered, false)?
            } else {
                tokenizer.encode(text, true)?
            }
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to zero tokens");
    }
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let sampling = a.sampling.params(dir.manifest.config.vocab_size())?;
    // Claim the output files now so a bad path fails before a long generation, not after it.
    let logits_file = a
        .logits_out
        .as_deref()
        .map(|p| OutputFile::claim(p, "--logits-out"))
        .transpose()?;
    let stats_file = a
        .stats_json
        .as_deref()
        .map(|p| OutputFile::claim(p, "--stats-json"))
        .transpose()?;
    let (_network, mut model) = open_model(&dir, budget, &a.store, &a.passes, &a.device, false)?;
    let ctx = model.context_length();
    if prompt_ids.len().saturating_add(a.max_new_tokens) > ctx {
        let what = format!(
            "the prompt ({} tokens) plus --max-new-tokens {} exceed the model's context length ({ctx}, max_position_embeddings)",
            prompt_ids.len(),
            a.max_new_tokens
        );
        if !a.allow_context_overflow {
            bail!(
                "{what}: shorten the prompt or lower --max-new-tokens (--allow-context-overflow runs past it anyway)"
            );
        }
        eprintln!("warning: {what}: positions past it were never trained (--allow-context-overflow)");
    }
    if a.compute_only {
        model.routed_mut().set_compute_only()?;
        eprintln!("warning: --compute-only: experts are computed with stand-in records; output is not the model's");
    }
    a.store.warm_pinned(model.as_ref());
    if a.trace_predictions.is_some() {
        model.routed_mut().log_predictions();
    }
    if let Some(k) = a.experts_per_token {
        model.routed().set_experts_per_token(k)?;
        if model.routed().non_default_routing() {
            eprintln!(
                "warning: --experts-per-token {k} (the model uses {}): {NON_DEFAULT_ROUTING}",
                model.config().num_experts_per_tok()
            );
        }
    }
    let eos = match &tokenizer {
        Some(t) => deltafin_tokenizer::eos_token_ids_union(&a.model, t)?,
        None => {
            eprintln!(
                "note: {} has no tokenizer: printing the generated token ids",
                a.model.display()
            );
            deltafin_tokenizer::eos_token_ids_of_configs(&a.model)?
        }
    };
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        eos_token_ids: eos,
        ignore_eos: a.ignore_eos,
        record_logits: a.logits_out.is_some(),
        trace_routes: a.trace_routes.clone(),
        trace_predictions: a.trace_predictions.clone(),
        prefill_chunk: a.passes.prefill_chunk,
        speculate: a.passes.speculate,
        sampling,
    };
    let mut dec = tokenizer.as_ref().map(|t| t.stream_decoder(true));
    let text_out = term::TextOut::for_stdout(a.raw_output);
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<anyhow::Error> = None;
    let mut first = true;
    // Without a tokenizer each id is written as it comes, comma-separated as --prompt-ids takes.
    let mut piece = |id: u32| -> Result<String> {
        match dec.as_mut() {
            Some(d) => Ok(d.push(id)?),
            None => Ok(format!("{}{id}", if std::mem::take(&mut first) { "" } else { "," })),
        }
    };
    let out = generate(model.as_ref(), &prompt_ids, &opts, |id| match piece(id) {
        Ok(text) => {
            let text = text_out.render(&text);
            if let Err(e) = stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()) {
                write_err = Some(e.into());
                return false;
            }
            true
        }
        Err(e) => {
            write_err = Some(e);
            false
        }
    })?;
    if let Some(e) = write_err {
        return Err(e);
    }
    let tail = match dec {
        Some(d) => d.finish()?,
        None => String::new(),
    };
    writeln!(stdout, "{}", text_out.render(&tail))?;
    drop(stdout);
    if let Some(file) = logits_file {
        let json = serde_json::json!({
            "prompt_ids": prompt_ids,
            "generated_ids": out.generated_ids,
            "first_step_logits": out.step_logits.first(),
            "step_logits": out.step_logits,
        });
        file.write(&serde_json::to_vec(&json)?)?;
    }
    if let Some(file) = stats_file {
        file.write(&serde_json::to_vec_pretty(&RunReport::new(
            &out,
            model.as_ref(),
            budget,
        ))?)?;
    }
    print_stats("run", &out.stats, model.as_ref(), budget, &dir);
    Ok(())
}

/// An output file claimed before a long job so that a bad path fails at once: opened for
/// writing without truncating it. [`OutputFile::write`] replaces its contents at the end; if it
/// is never written (the job failed), a file the claim created is removed again and a file that
/// existed before keeps its old contents, so a failed run loses nothing.
pub(crate) struct OutputFile {
    path: PathBuf,
    flag: &'static str,
    file: Option<std::fs::File>,
    created: bool,
}

impl OutputFile {
    /// Errors: the file cannot be opened or created for writing (`flag: creating PATH: cause`).
    pub(crate) fn claim(path: &Path, flag: &'static str) -> Result<Self> {
        let created = !path.exists();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("{flag}: creating {}", path.display()))?;
        Ok(OutputFile {
            path: path.to_path_buf(),
            flag,
            file: Some(file),
            created,
        })
    }

    /// Replaces the file's contents with `bytes` and syncs it.
    pub(crate) fn write(mut self, bytes: &[u8]) -> Result<()> {
        let mut f = self.file.take().expect("an OutputFile is written once");
        let what = || format!("{}: writing {}", self.flag, self.path.display());
        f.set_len(0).with_context(what)?;
        f.write_all(bytes).with_context(what)?;
        f.sync_all().with_context(what)?;
        Ok(())
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if self.file.is_some() && self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

pub(crate) fn print_stats(title: &str, s: &GenerateStats, model: &dyn CausalLm, budget: u64, dir: &ModelDir) {
    let decode = s
        .steady_decode_tokens_per_s()
        .map(|r| {
            let n = s.steady_decode_steps;
            format!("{r:.2} tok/s ({n} step{})", if n == 1 { "" } else { "s" })
        })
        .unwrap_or_else(|| "n/a (fewer than 2 decode steps)".into());
    let m = &dir.manifest;
    eprintln!("--- deltafin {title} ---");
    if model.routed().compute_only() {
        eprintln!("compute-only         stand-in expert records, no expert reads: output is not the model's");
    }
    if model.routed().non_default_routing() {
        eprintln!(
            "routing              {} experts per token (model: {}): {NON_DEFAULT_ROUTING}",
            model.routed().experts_per_token(),
            model.config().num_experts_per_tok()
        );
    }
    if model.routed().batch_form() != BatchForm::Exact {
        eprintln!(
            "batched arithmetic   {} (--batch-form, research): {BATCH_FORM_NOTE}",
            model.routed().batch_form().name()
        );
    }
    eprintln!("prompt tokens        {}", s.prompt_tokens);
    eprintln!(
        "generated tokens     {} (finish: {})",
        s.generated_tokens, s.finish_reason
    );
    eprintln!("time to first token  {:.3} s", s.ttft.as_secs_f64());
    eprintln!("prefill              {:.2} tok/s", s.prefill_tokens_per_s);
    eprintln!(
        "prefill experts      {} read ({:.2} MiB/prompt token), {} distinct (layer, expert) = {:.1} per MoE layer, {}",
        size::human(s.prefill_expert_bytes),
        s.prefill_expert_bytes as f64 / s.prompt_tokens.max(1) as f64 / (1u64 << 20) as f64,
        s.prefill_unique_experts,
        s.prefill_unique_experts as f64 / s.moe_layers.max(1) as f64,
        if s.prefill_chunk == 1 {
            "one token at a time".to_string()
        } else {
            format!("chunks of {} tokens", s.prefill_chunk)
        }
    );
    let sp = &s.speculation;
    if sp.passes == 0 && !s.speculate.is_empty() && s.speculate != "off" {
        let why = if s.speculate == "lookup" {
            "no prompt match"
        } else {
            "the drafter proposed nothing to verify"
        };
        eprintln!(
            "speculation          --speculate {}: no draft verified ({} plain steps: {why}, or the adaptive \
             length found drafting not worth it yet)",
            s.speculate, sp.plain_steps
        );
    }
    if sp.passes > 0 {
        eprintln!(
            "speculation          {} passes, {:.2} tokens/pass, acceptance lookup {:.0}% of {} / self {:.0}% of {}, {}/token verified, {} plain steps",
            sp.passes,
            sp.tokens_per_pass(),
            100.0 * sp.acceptance(Drafter::Lookup),
            sp.drafted[Drafter::Lookup as usize],
            100.0 * sp.acceptance(Drafter::SelfDraft),
            sp.drafted[Drafter::SelfDraft as usize],
            size::human(sp.bytes_per_pass_token() as u64),
            sp.plain_steps
        );
    }
    eprintln!("steady decode        {decode}");
    if let Some(g) = model.gpu_cache_stats() {
        eprintln!(
            "GPU expert cache     {} of {} resident, {} hits, {} misses ({} copied to the device in {:.3} s), {} evictions",
            size::human(g.resident_bytes),
            size::human(g.budget_bytes),
            g.hits,
            g.misses,
            size::human(g.bytes_uploaded),
            g.upload_ns as f64 * 1e-9,
            g.evictions
        );
    }
    eprintln!(
        "routed-expert bytes  {} read from storage ({} misses, {} hits, {} evictions)",
        size::human(s.experts.bytes_read_demand),
        s.experts.misses,
        s.experts.hits,
        s.experts.evictions
    );
    eprintln!("expert hit rate      {:.1}%", 100.0 * s.experts.hit_rate());
    let o = model.store().options();
    eprintln!(
        "expert store         io {}, cache {}, {} readers, waited {:.3} s for reads",
        model.store().io_mode(),
        o.policy,
        model.store().readers(),
        s.experts.read_wait_ns as f64 * 1e-9
    );
    if o.prefetch {
        eprintln!(
            "prefetch             {} experts predicted-read, {} used, recall {:.1}%, {} speculative read, {} wasted",
            s.experts.prefetch_issued,
            s.experts.prefetch_useful,
            100.0 * s.experts.prefetch_recall(),
            size::human(s.experts.bytes_read_speculative),
            size::human(s.experts.prefetch_wasted_bytes)
        );
    }
    eprintln!(
        "memory               backbone {} resident, expert cache budget {}, expert pack {} on disk ({}, {}×budget)",
        size::human(model.backbone_bytes() as u64),
        size::human(budget),
        size::human(m.experts.bytes),
        m.experts.dtype.name(),
        match m.experts.bytes as f64 / budget as f64 {
            _ if budget == 0 => "∞".to_string(),
            r if r < 100.0 => format!("{r:.2}"),
            r => format!("{r:.3e}"),
        }
    );
    match s.peak_rss_bytes {
        Some(p) => eprintln!("peak resident memory {}", size::human(p)),
        None => eprintln!("peak resident memory unavailable"),
    }
}
