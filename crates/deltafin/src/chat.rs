//! `deltafin chat`: a multi-turn conversation in the terminal with the model's chat template,
//! streamed output, the KV cache reused between turns, and Ctrl-C stopping the current answer.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use deltafin_engine::sampler::SamplingParams;
use deltafin_engine::session::{FinishReason, GenerationOutput, GenerationRequest, Session};
use deltafin_engine::{load_model, CausalLm};
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::size;

/// Flags of `deltafin chat`.
#[derive(clap::Args)]
pub struct ChatArgs {
    /// Model directory written by `deltafin convert`.
    #[arg(long)]
    model: PathBuf,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most per answer (capped by the context left).
    #[arg(long, default_value_t = 512, allow_negative_numbers = true)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy, exact).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 or -1 = off, as the server's `top_k`).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_top_k)]
    top_k: usize,
    /// Seed for sampling.
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Expert cache budget, e.g. 512MiB, 4G (default: a quarter of physical memory or of the memory cgroup limit, whichever is lower).
    #[arg(long, value_parser = size::parse_size, allow_hyphen_values = true)]
    ram_budget: Option<u64>,
    #[command(flatten)]
    store: crate::StoreArgs,
    #[command(flatten)]
    passes: crate::PassArgs,
}

const HELP: &str =
    "commands: /stats (statistics of the last answer), /reset (new conversation), /exit; Ctrl-C stops an answer";

/// Runs the conversation loop until `/exit`, end of input or Ctrl-C at the prompt.
pub fn run(a: &ChatArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if !(0.0..=2.0).contains(&a.temperature) {
        bail!("--temperature {} must be between 0 and 2", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be greater than 0 and at most 1", a.top_p);
    }
    let dir = ModelDir::open(&a.model)?;
    let budget = crate::ram_budget(a.ram_budget);
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&a.model).with_context(|| format!("loading the tokenizer of {}", a.model.display()))?,
    );
    if let Some(e) = tokenizer.chat_template_error() {
        bail!("{e}");
    }
    if tokenizer.chat_template().is_none() {
        bail!(
            "{} has no chat template in tokenizer_config.json; use `deltafin run`",
            a.model.display()
        );
    }
    let eos = deltafin_tokenizer::eos_token_ids_union(&a.model, &tokenizer)?;
    let mut store_opts = a.store.options(budget, &dir)?;
    let network = crate::pull_cmd::attach_source(&mut store_opts, &dir, a.store.allow_network)?;
    crate::pull_cmd::warn_unfetched_records(&network, &dir, false)?;
    let model = load_model(&dir, store_opts)?;
    if a.store.cache_policy == deltafin_engine::experts::CachePolicy::Pinned {
        model.store().warm_pinned();
    }
    let model: Arc<dyn CausalLm> = Arc::from(model);
    let mut session = Session::new(Arc::clone(&model), Arc::clone(&tokenizer), eos);
    session.set_prefill_chunk(a.passes.prefill_chunk);
    a.passes.warn_unsupported(model.as_ref());
    session.set_speculate(a.passes.speculate);

    // Ctrl-C during an answer stops it; at the prompt it leaves.
    let generating = Arc::new(AtomicBool::new(false));
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let (generating, cancel) = (Arc::clone(&generating), Arc::clone(&cancel));
        ctrlc::set_handler(move || {
            if generating.load(Ordering::SeqCst) {
                cancel.store(true, Ordering::SeqCst);
            } else {
                eprintln!();
                std::process::exit(130);
            }
        })
        .context("installing the Ctrl-C handler")?;
    }

    let fresh = || -> Vec<Value> {
        a.system
            .iter()
            .map(|s| json!({"role": "system", "content": s}))
            .collect()
    };
    let mut messages = fresh();
    let mut last: Option<GenerationOutput> = None;
    eprintln!("deltafin chat: {} ({HELP})", a.model.display());
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            return Ok(());
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            "/reset" => {
                messages = fresh();
                session.reset();
                eprintln!("(new conversation)");
                continue;
            }
            cmd if cmd.starts_with('/')
                && !cmd.starts_with("//")
                && !cmd.contains(char::is_whitespace)
                && cmd != "/stats" =>
            {
                eprintln!("unknown command {cmd} ({HELP}; start a message with // to send a literal /)");
                continue;
            }
            "/stats" => {
                match &last {
                    Some(o) => {
                        crate::print_stats("chat: last answer", &o.stats, model.as_ref(), budget, &dir);
                        if o.reused_tokens > 0 {
                            eprintln!(
                                "reused prompt tokens {} of {} (KV cache kept from the previous turn; the prefill \
                                 lines above cover the other {})",
                                o.reused_tokens,
                                o.prompt_tokens,
                                o.prompt_tokens - o.reused_tokens
                            );
                        } else {
                            eprintln!("reused prompt tokens 0 of {}", o.prompt_tokens);
                        }
                    }
                    None => eprintln!("no answer yet"),
                }
                continue;
            }
            _ => {}
        }
        let input = input.strip_prefix('/').filter(|r| r.starts_with('/')).unwrap_or(input);
        messages.push(json!({"role": "user", "content": input}));
        let rendered = match tokenizer.chat_template() {
            Some(t) => t.render(&messages, true, &Value::Null),
            None => bail!("no chat template"),
        };
        let prompt = match rendered
            .map_err(anyhow::Error::from)
            .and_then(|r| Ok(tokenizer.encode(&r, false)?))
        {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {e:#}");
                messages.pop();
                continue;
            }
        };
        let left = session.context_length().saturating_sub(prompt.len());
        if left == 0 {
            eprintln!(
                "the conversation ({} tokens) fills the context ({} tokens); /reset to start over",
                prompt.len(),
                session.context_length()
            );
            messages.pop();
            continue;
        }
        let req = GenerationRequest {
            prompt,
            max_new_tokens: a.max_tokens.min(left).max(1),
            sampling: SamplingParams {
                temperature: a.temperature,
                top_p: a.top_p,
                top_k: a.top_k,
                seed: a.seed,
            },
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            keep_special_tokens: false,
        };
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut stdout = std::io::stdout();
        let stop = || cancel.load(Ordering::SeqCst);
        let out = session.generate(&req, &stop, |d| {
            let _ = stdout.write_all(d.text.as_bytes());
            let _ = stdout.flush();
            true
        });
        generating.store(false, Ordering::SeqCst);
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                eprintln!("\nerror: {e}");
                messages.pop();
                continue;
            }
        };
        println!();
        match out.finish {
            FinishReason::Cancelled => eprintln!("[stopped]"),
            FinishReason::Length => eprintln!("[length limit: {} tokens]", out.generated_ids.len()),
            _ => {}
        }
        messages.push(json!({"role": "assistant", "content": out.text}));
        last = Some(out);
    }
}

/// `--top-k`: a count, or 0 / -1 for no top-k filter (the server's convention).
fn parse_top_k(v: &str) -> std::result::Result<usize, String> {
    match v.trim() {
        "-1" => Ok(0),
        t => t
            .parse::<usize>()
            .map_err(|_| format!("{v:?} is not a token count (0 or -1 = off)")),
    }
}
