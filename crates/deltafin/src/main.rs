//! The `deltafin` command line: convert, run, demo.

mod bench;
mod cache_cmd;
mod chat;
mod cuda_info;
mod demo;
mod device_args;
mod info_cmd;
mod log;
mod pull_cmd;
mod replay;
mod sampling_args;
mod serve;
mod size;
mod synth_cmd;
mod term;
mod warm_cmd;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use deltafin_engine::experts::{CachePolicy, IoMode, StoreOptions};
use deltafin_engine::generate::{generate, GenerateOptions, GenerateStats};
use deltafin_engine::speculate::Drafter;
use deltafin_engine::{BatchForm, CausalLm};
use deltafin_format::convert::{convert, ConvertOptions, Progress};
use deltafin_format::{ModelDir, StoredDtype};
use deltafin_tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "deltafin",
    version,
    about = "Run Mixture-of-Experts models larger than memory, routed experts streamed from storage"
)]
struct Cli {
    /// More diagnostics on stderr: -v info, -vv debug, -vvv trace (default: warnings, such as
    /// HTTP retries). RUST_LOG, when set, replaces this (e.g. RUST_LOG=deltafin_pull=debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackboneDtype {
    Int8,
    Bf16,
    F32,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExpertDtype {
    Mxfp4,
    Bf16,
    F32,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a Hugging Face checkpoint directory into a deltafin model directory.
    Convert {
        /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).
        hf_dir: PathBuf,
        // The output model directory (created; must not exist or be empty unless --force).
        #[command(flatten)]
        model_dir: ModelPath,
        /// Storage of 2-D backbone matrices (norms and routers always stay f32).
        #[arg(long, value_enum, default_value = "int8")]
        backbone: BackboneDtype,
        /// Storage of routed experts. `f32` with `--backbone f32` is the lossless reference layout.
        #[arg(long, value_enum, default_value = "mxfp4")]
        experts: ExpertDtype,
        /// Replace an existing model directory.
        #[arg(long)]
        force: bool,
        /// Check the source completely (config, every safetensors header, tensor names, shapes,
        /// dtypes, quantization metadata) and report what would be written, without reading
        /// weights or writing anything.
        #[arg(long)]
        dry_run: bool,
    },
    /// Generate text from a converted model (greedy unless sampling flags say otherwise).
    Run(RunArgs),
    /// Ask the embedded trained model (a small DeepSeek-V3-architecture MoE) a question with an
    /// expert pack four times the expert cache budget, so experts stream from disk (no download).
    Demo {
        /// Where to keep the demo files (default: a temporary directory, removed afterwards).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Tokens to generate.
        #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
        max_new_tokens: usize,
        /// Write the generated text exactly, control characters included, also to a terminal
        /// (where they are shown escaped by default, as `\u{1b}`).
        #[arg(long)]
        raw_output: bool,
        /// Synthesize and run a random-weight model of the same family instead (meaningless text).
        #[arg(long)]
        random: bool,
        /// The question for the trained model (default: "What does json.dumps do?").
        #[arg(long)]
        prompt: Option<String>,
        /// Where to compute, as for `run`: `cpu` (the default), `cuda`, `cuda:N` or `auto`.
        #[arg(long, default_value = "cpu")]
        device: deltafin_engine::Device,
    },
    /// Serve the model over HTTP: OpenAI-compatible and Anthropic Messages APIs.
    Serve(serve::ServeArgs),
    /// Chat with the model in the terminal (multi-turn, streamed, KV cache reused).
    Chat(chat::ChatArgs),
    /// Write a deterministic random model directory directly: tiny, demo, bench (13.7 GB pack),
    /// k3-tiny or k3-bench (Kimi K3 structure).
    Synth(synth_cmd::SynthArgs),
    /// Benchmark `deltafin run` (fresh process per run, balanced order, ids verified, floor, chart).
    Bench(bench::BenchArgs),
    /// Measurement: read the experts a router trace chose, token by token, without computing
    /// (the I/O-only side of the compute/I-O overlap measurement; with --map-experts, a smaller
    /// model's routing on this model's pack: cache, pinning, warm-up and prefetch at scale).
    Replay(replay::ReplayArgs),
    /// What a model costs: resident bytes, expert bytes per token, decode state, storage floor.
    Info(info_cmd::InfoArgs),
    /// Install a model from an HTTP source: --full (download and convert) or --stream (backbone
    /// only; routed experts fetched on first use).
    Pull(pull_cmd::PullArgs),
    /// Fetch the most valuable missing experts of a streaming install (ranked by router traces).
    Warm(warm_cmd::WarmArgs),
    /// Expert cache of a model directory: stats, verify, gc.
    Cache(cache_cmd::CacheArgs),
}

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("prompt_input").required(true).multiple(false).args(["prompt", "prompt_ids"]))]
struct RunArgs {
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

/// A model directory, given positionally or with `--model` (either, not both), the same way
/// for every command.
#[derive(clap::Args, Clone, Debug)]
#[group(required = true, multiple = false)]
pub(crate) struct ModelPath {
    /// Model directory (positionally, or with --model).
    #[arg(value_name = "MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// Model directory (the same as the positional MODEL_DIR).
    #[arg(long = "model", value_name = "MODEL_DIR")]
    model: Option<PathBuf>,
}

impl ModelPath {
    /// The directory, however it was given (clap requires one of the two).
    pub(crate) fn path(&self) -> &Path {
        self.model_dir
            .as_deref()
            .or(self.model.as_deref())
            .unwrap_or(Path::new(""))
    }
}

impl std::ops::Deref for ModelPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.path()
    }
}

impl AsRef<Path> for ModelPath {
    fn as_ref(&self) -> &Path {
        self.path()
    }
}

/// Multi-token pass settings shared by `run`, `chat` and `serve` (and `bench` through its
/// `--config` run arguments).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct PassArgs {
    /// Prompt tokens per batched prefill pass (expert-major: each expert the chunk selects is
    /// read once for the chunk); 1 = token at a time, 0 = as many as an eighth of --ram-budget
    /// holds (at least 32 MiB of activations, at most 4096 tokens). Greedy output does not depend
    /// on it (logits bit-identical; within f32 rounding on KDA / gated DeltaNet layers).
    #[arg(long, value_name = "TOKENS", default_value_t = 0, allow_negative_numbers = true)]
    pub(crate) prefill_chunk: usize,
    /// Speculative decoding: `off`, `lookup` (n-gram match in the context), `self` (the model
    /// routed among cached experts only), or `auto` (lookup when it matches, else self). Greedy
    /// output is identical with any setting; the draft length adapts to measured benefit.
    #[arg(long, default_value_t = deltafin_engine::generate::DEFAULT_SPECULATE, value_parser = parse_speculate)]
    pub(crate) speculate: deltafin_engine::speculate::SpeculateMode,
}

impl PassArgs {
    /// Warns (stderr) when `--speculate self` asks for a drafter `model`'s family lacks: the
    /// run then decodes plainly.
    pub(crate) fn warn_unsupported(&self, model: &dyn CausalLm) {
        if self.speculate == deltafin_engine::speculate::SpeculateMode::SelfDraft && !model.supports_draft() {
            eprintln!(
                "warning: --speculate self: the {} family has no self-drafting; decoding one token per step \
                 (use --speculate lookup or auto for prompt-lookup drafts)",
                model.config().family()
            );
        }
    }
}

fn parse_speculate(s: &str) -> Result<deltafin_engine::speculate::SpeculateMode, String> {
    s.parse()
}

/// Expert-store settings shared by `run`, `bench` and `serve`.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct StoreArgs {
    /// How expert records are read: `direct` (O_DIRECT into aligned buffers, bypassing the page
    /// cache) or `buffered` (page cache). Direct is the default: under a memory limit it was
    /// 1.33× faster at a third of the CPU (bench/NOTES.md).
    #[arg(long, default_value = "direct", value_parser = parse_io)]
    io: IoMode,
    /// Expert cache policy: `lfu` (LFU with dynamic aging), `lru`, or `pinned` (a tier filled
    /// from router-trace heat, see --pin-from, plus LRU for the rest). Default `lfu`: with the
    /// trained model's routing on the 12.8 GiB `bench` pack at a third of the pack it read
    /// 1.4–5.9 points of the no-cache need less than `lru` on every workload (bench/NOTES.md,
    /// "At scale").
    #[arg(long, default_value = "lfu", value_parser = parse_policy)]
    cache_policy: CachePolicy,
    /// Router trace file(s) (from --trace-routes) whose hottest experts fill the pinned tier;
    /// needs --cache-policy pinned.
    #[arg(long, value_name = "TRACES", num_args = 1..)]
    pin_from: Vec<PathBuf>,
    /// Share of --ram-budget reserved for the pinned tier.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    pinned_fraction: f64,
    /// Predict the next MoE layer's experts with its router and read them speculatively while
    /// the disk is idle: `on` or `off`. Default off: with the trained model's routing on the
    /// 12.8 GiB `bench` pack a decode step leaves the disk almost no idle time, so speculative
    /// reads saved under 1 % of the demand bytes and added 5–7 % of the no-cache need in reads
    /// (bench/NOTES.md, "At scale").
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    prefetch: String,
    /// Expert reader threads = most reads in flight (0: max(top_k, 8); at most 1024).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024), allow_negative_numbers = true)]
    readers: u16,
    /// Streaming installs: fetch routed experts that are not local yet from the install's source.
    #[arg(long)]
    pub(crate) allow_network: bool,
}

fn parse_io(s: &str) -> Result<IoMode, String> {
    s.parse::<IoMode>().map_err(|e| e.to_string())
}

fn parse_policy(s: &str) -> Result<CachePolicy, String> {
    s.parse::<CachePolicy>().map_err(|e| e.to_string())
}

impl StoreArgs {
    /// Store options for a cache of `budget` bytes over the model in `dir`. Errors:
    /// inconsistent pinning flags, an unreadable trace, or a trace recorded for another model.
    pub(crate) fn options(&self, budget: u64, dir: &ModelDir) -> Result<StoreOptions> {
        self.options_with(budget, &|p| {
            Ok(deltafin_engine::traces::Trace::read_for(p, &dir.manifest.config)?)
        })
    }

    /// [`StoreArgs::options`] with `load` reading each `--pin-from` trace (`replay
    /// --map-experts` maps traces of a smaller model onto this one).
    pub(crate) fn options_with(
        &self,
        budget: u64,
        load: &dyn Fn(&std::path::Path) -> Result<deltafin_engine::traces::Trace>,
    ) -> Result<StoreOptions> {
        let mut o = StoreOptions::new(budget);
        o.io = self.io;
        o.policy = self.cache_policy;
        o.prefetch = self.prefetch == "on";
        o.readers = usize::from(self.readers);
        if !(0.0..=1.0).contains(&self.pinned_fraction) {
            bail!("--pinned-fraction {} must be between 0 and 1", self.pinned_fraction);
        }
        o.pinned_fraction = self.pinned_fraction;
        match (self.cache_policy, self.pin_from.is_empty()) {
            (CachePolicy::Pinned, true) => {
                bail!("--cache-policy pinned needs --pin-from TRACES (router traces from --trace-routes)")
            }
            (CachePolicy::Pinned, false) => {
                let mut heat = std::collections::HashMap::<(usize, usize), u64>::new();
                for p in &self.pin_from {
                    let t = load(p).context("--pin-from")?;
                    for (k, n) in t.heat_ranking() {
                        *heat.entry(k).or_default() += n;
                    }
                }
                let mut ranked: Vec<_> = heat.into_iter().collect();
                ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                o.pinned = ranked.into_iter().map(|(k, _)| k).collect();
            }
            (_, false) => bail!("--pin-from needs --cache-policy pinned"),
            (_, true) => {}
        }
        Ok(o)
    }
}

/// The label every output carries when routing differs from the model's.
pub(crate) const NON_DEFAULT_ROUTING: &str = "non-default routing: output not equivalent to the model";

/// The label of a non-default [`BatchForm`] (research override `DELTAFIN_BATCH_FORM`).
pub(crate) const BATCH_FORM_NOTE: &str = "long prompt chunks compute MLA in the decompressed form: \
     logits within f32 rounding of token-at-a-time decoding, not bit for bit (greedy ids can differ \
     where a router choice is near-tied)";

fn main() -> ExitCode {
    let cli = Cli::parse();
    log::init(cli.verbose);
    // A panic is a bug: report it on one line (where and why), not Rust's multi-line default.
    // Panics on compute-pool threads become errors of their command (or 500s of the server's
    // request); the process never waits on a dead thread.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        // "panicked" stays in the line: tests and scripts look for it.
        eprintln!(
            "error: internal error: panicked{at}: {} (a bug, please report it)",
            msg.replace('\n', " ")
        );
    }));
    if !matches!(cli.cmd, Cmd::Serve(_) | Cmd::Chat(_)) {
        // Like other Unix command-line tools, end quietly when the reader of our output goes
        // away (`deltafin run … | head`) instead of failing on EPIPE. The server and chat keep
        // Rust's default (SIGPIPE ignored) so a closed socket or pipe is an error they handle.
        // SAFETY: called before any other thread exists; SIG_DFL is a valid disposition.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let r = match cli.cmd {
        Cmd::Convert {
            hf_dir,
            model_dir,
            backbone,
            experts,
            force,
            dry_run,
        } => {
            if dry_run {
                cmd_convert_dry_run(&hf_dir, &model_dir, force)
            } else {
                cmd_convert(&hf_dir, &model_dir, backbone, experts, force)
            }
        }
        Cmd::Run(args) => cmd_run(&args),
        Cmd::Demo {
            dir,
            max_new_tokens,
            raw_output,
            random,
            prompt,
            device,
        } => demo::run(demo::DemoOptions {
            dir,
            max_new_tokens,
            raw_output,
            random,
            prompt,
            device,
        }),
        Cmd::Serve(args) => serve::run(&args),
        Cmd::Chat(args) => chat::run(&args),
        Cmd::Synth(args) => synth_cmd::run(&args),
        Cmd::Bench(args) => bench::run(&args),
        Cmd::Replay(args) => replay::run(&args),
        Cmd::Info(args) => info_cmd::run(&args),
        Cmd::Pull(args) => pull_cmd::run(&args),
        Cmd::Warm(args) => warm_cmd::run(&args),
        Cmd::Cache(args) => cache_cmd::run(&args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, `a: b: c`, skipping a cause whose text the line already
/// holds (our error types print their `io::Error` source themselves, so `{:#}` would repeat it).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if line.contains(&s) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&s);
    }
    line
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

fn cmd_convert_dry_run(hf_dir: &Path, model_dir: &Path, force: bool) -> Result<()> {
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

/// Default expert cache budget: a quarter of the memory this process may use, that is of
/// physical memory (`MemTotal`) or of the memory cgroup's limit when that is lower (cgroup v1
/// `memory.limit_in_bytes` or v2 `memory.max`, found through `/proc/self/cgroup`); 4 GiB if
/// neither can be read.
fn default_ram_budget() -> u64 {
    let total = deltafin_engine::mem::meminfo_bytes("MemTotal");
    let limit = deltafin_engine::mem::cgroup_memory_limit();
    match (total, limit) {
        (Some(t), Some(l)) => t.min(l) / 4,
        (Some(t), None) => t / 4,
        (None, Some(l)) => l / 4,
        (None, None) => 4 << 30,
    }
}

/// The expert cache budget: `--ram-budget` or [`default_ram_budget`]; warns (stderr) when an
/// explicit budget exceeds the memory this process may use (the cache would then push the
/// machine into swap or the OOM killer long before it fills).
pub(crate) fn ram_budget(requested: Option<u64>) -> u64 {
    let Some(b) = requested else {
        return default_ram_budget();
    };
    let total = deltafin_engine::mem::meminfo_bytes("MemTotal");
    let limit = deltafin_engine::mem::cgroup_memory_limit();
    if let Some(m) = [total, limit].into_iter().flatten().min() {
        if b > m {
            eprintln!(
                "warning: --ram-budget {} exceeds the memory this process may use ({}); the expert cache \
                 cannot grow that large without swapping or being killed",
                size::human(b),
                size::human(m)
            );
        }
    }
    b
}

fn cmd_run(a: &RunArgs) -> Result<()> {
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
    let mut store_opts = a.store.options(budget, &dir)?;
    let network = pull_cmd::attach_source(&mut store_opts, &dir, a.store.allow_network)?;
    pull_cmd::warn_unfetched_records(&network, &dir, false)?;
    let mut model = a.device.load(&dir, store_opts)?;
    a.passes.warn_unsupported(model.as_ref());
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
    if a.store.cache_policy == CachePolicy::Pinned {
        model.store().warm_pinned();
    }
    if a.trace_predictions.is_some() {
        model.routed_mut().log_predictions();
    }
    if model.routed().batch_form() != BatchForm::Exact {
        eprintln!(
            "warning: DELTAFIN_BATCH_FORM={}: {BATCH_FORM_NOTE}",
            model.routed().batch_form().name()
        );
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
        file.write(&serde_json::to_vec_pretty(&stats_json(&out, model.as_ref(), budget))?)?;
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

/// The `--stats-json` document (schema in the README, consumed by `deltafin bench`).
fn stats_json(out: &deltafin_engine::generate::GenerateOutput, model: &dyn CausalLm, budget: u64) -> serde_json::Value {
    let s = &out.stats;
    serde_json::json!({
        "generated_ids": out.generated_ids,
        "prompt_tokens": s.prompt_tokens,
        "ttft_s": s.ttft.as_secs_f64(),
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "steady_decode_tokens_per_s": s.steady_decode_tokens_per_s(),
        "steady_decode_steps": s.steady_decode_steps,
        "expert_bytes_read_demand": s.experts.bytes_read_demand,
        "expert_bytes_read_speculative": s.experts.bytes_read_speculative,
        "prefetch_issued": s.experts.prefetch_issued,
        "prefetch_useful": s.experts.prefetch_useful,
        "prefetch_wasted_bytes": s.experts.prefetch_wasted_bytes,
        "prefetch_recall": s.experts.prefetch_recall(),
        "io_wait_s": s.experts.read_wait_ns as f64 * 1e-9,
        "expert_hits": s.experts.hits,
        "expert_misses": s.experts.misses,
        "hit_rate": s.experts.hit_rate(),
        "peak_rss_bytes": s.peak_rss_bytes,
        "io_mode": model.store().io_mode().to_string(),
        "cache_policy": model.store().options().policy.to_string(),
        "prefetch": model.store().options().prefetch,
        "non_default_routing": model.routed().non_default_routing(),
        "batch_form": model.routed().batch_form().name(),
        "compute_only": model.routed().compute_only(),
        "experts_per_token": model.routed().experts_per_token(),
        "ram_budget": budget,
        "finish_reason": s.finish_reason,
        "prefill_chunk": s.prefill_chunk,
        "prefill_expert_bytes": s.prefill_expert_bytes,
        "prefill_unique_experts": s.prefill_unique_experts,
        "prefill_unique_expert_bytes": s.prefill_unique_experts as u64 * model.store().record_bytes(),
        "moe_layers": s.moe_layers,
        "speculation": {
            "mode": s.speculate,
            "stats": s.speculation,
            "tokens_per_pass": s.speculation.tokens_per_pass(),
            "acceptance_lookup": s.speculation.acceptance(Drafter::Lookup),
            "acceptance_self": s.speculation.acceptance(Drafter::SelfDraft),
            "bytes_per_pass_token": s.speculation.bytes_per_pass_token(),
        },
        "steps": s.steps,
        "gpu_expert_cache": model.gpu_cache_stats().map(gpu_cache_json),
    })
}

/// The GPU expert cache's counters in `--stats-json`.
fn gpu_cache_json(g: deltafin_engine::GpuCacheStats) -> serde_json::Value {
    serde_json::json!({
        "budget_bytes": g.budget_bytes,
        "resident_bytes": g.resident_bytes,
        "hits": g.hits,
        "misses": g.misses,
        "hit_rate": g.hit_rate(),
        "evictions": g.evictions,
        "bytes_uploaded": g.bytes_uploaded,
        "upload_s": g.upload_ns as f64 * 1e-9,
    })
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
            "batched arithmetic   {} (DELTAFIN_BATCH_FORM): {BATCH_FORM_NOTE}",
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
