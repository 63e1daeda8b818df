//! `deltafin chat`: a multi-turn conversation in the terminal with the model's chat template,
//! streamed output, the KV cache reused between turns, and Ctrl-C stopping the current answer.
//!
//! When stdin and stdout are terminals, lines are read with `rustyline` (cursor keys, editing,
//! history of the session's lines); otherwise (piped input, as scripts and tests use) plain
//! lines are read from stdin, with the prompt on stderr.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use deltafin_engine::session::{FinishReason, GenerationOutput, GenerationRequest, Session};
use deltafin_engine::CausalLm;
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Flags of `deltafin chat`.
#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: crate::model_path::ModelPath,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most per answer (capped by the context left).
    #[arg(long, default_value_t = 512, allow_negative_numbers = true)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: crate::sampling_args::SamplingArgs,
    /// Write answers exactly, control characters included, also to a terminal (where they are
    /// shown escaped by default, as `\u{1b}`).
    #[arg(long)]
    raw_output: bool,
    #[command(flatten)]
    load: crate::model_args::LoadArgs,
}

const HELP: &str =
    "commands: /stats (statistics of the last answer), /reset (new conversation), /exit; Ctrl-C stops an answer";

/// Runs the conversation loop until `/exit`, end of input or Ctrl-C at the prompt.
pub fn run(a: &ChatArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let dir = ModelDir::open(&a.model)?;
    let sampling = a.sampling.params(dir.manifest.config.vocab_size())?;
    let budget = crate::model_args::ram_budget(a.load.ram_budget);
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
    let (_network, model) =
        crate::model_args::open_model(&dir, budget, &a.load.store, &a.load.passes, &a.load.device, false)?;
    a.load.store.warm_pinned(model.as_ref());
    let model: Arc<dyn CausalLm> = Arc::from(model);
    let mut session = Session::new(Arc::clone(&model), Arc::clone(&tokenizer), eos);
    session.set_prefill_chunk(a.load.passes.prefill_chunk);
    session.set_speculate(a.load.passes.speculate);

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
    let text_out = crate::term::TextOut::for_stdout(a.raw_output);
    let mut input_lines = Input::new();
    loop {
        let line = match input_lines.read()? {
            Line::Text(l) => l,
            Line::Eof => {
                eprintln!();
                return Ok(());
            }
            Line::Interrupted => {
                eprintln!();
                std::process::exit(130);
            }
        };
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
                        crate::run_cmd::print_stats("chat: last answer", &o.stats, model.as_ref(), budget, &dir);
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
            sampling: sampling.clone(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            keep_special_tokens: false,
            constraint: None,
        };
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut stdout = std::io::stdout();
        let stop = || cancel.load(Ordering::SeqCst);
        let out = session.generate(&req, &stop, |d| {
            let _ = stdout.write_all(text_out.render(&d.text).as_bytes());
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

/// Where the user's lines come from.
enum Input {
    /// A terminal: line editing and history.
    Editor(Box<rustyline::DefaultEditor>),
    /// Piped or redirected input: plain lines.
    Plain(std::io::Stdin),
}

/// One read of [`Input`].
enum Line {
    Text(String),
    /// End of input (Ctrl-D on a terminal).
    Eof,
    /// Ctrl-C at the prompt.
    Interrupted,
}

impl Input {
    /// The line editor when stdin and stdout are terminals (and it can start), else plain reads.
    fn new() -> Self {
        let stdin = std::io::stdin();
        if stdin.is_terminal() && std::io::stdout().is_terminal() {
            if let Ok(e) = rustyline::DefaultEditor::new() {
                return Input::Editor(Box::new(e));
            }
        }
        Input::Plain(stdin)
    }

    /// The next line (without its newline for the editor; with it for plain reads).
    ///
    /// Errors: reading the terminal or stdin fails.
    fn read(&mut self) -> Result<Line> {
        match self {
            Input::Editor(e) => match e.readline("> ") {
                Ok(l) => {
                    if !l.trim().is_empty() {
                        let _ = e.add_history_entry(l.as_str());
                    }
                    Ok(Line::Text(l))
                }
                Err(rustyline::error::ReadlineError::Eof) => Ok(Line::Eof),
                Err(rustyline::error::ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(err) => Err(anyhow::Error::new(err).context("reading a line from the terminal")),
            },
            Input::Plain(stdin) => {
                eprint!("> ");
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 {
                    return Ok(Line::Eof);
                }
                Ok(Line::Text(line))
            }
        }
    }
}
