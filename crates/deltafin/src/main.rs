//! The `deltafin` command line: parses the arguments and dispatches to one module per command
//! (the flags several commands share are in `model_args`).

mod bench;
mod cache_cmd;
mod chat;
mod convert_cmd;
mod cuda_info;
mod demo;
mod device_args;
mod info_cmd;
mod log;
mod model_args;
mod model_path;
mod pull_cmd;
mod replay;
mod report;
mod run_cmd;
mod sampling_args;
mod serve;
mod size;
mod synth_cmd;
mod term;
mod warm_cmd;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use deltafin_kernels::SimdLevel;

use convert_cmd::{cmd_convert, cmd_convert_dry_run, BackboneDtype, ExpertDtype};
// `bench` names these by their old paths.
pub(crate) use model_path::ModelPath;
pub(crate) use run_cmd::OutputFile;

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
    /// Research: cap the SIMD level of the CPU kernels at `portable`, `avx2` or `avx512` (the
    /// best the CPU supports at or below it; default: the CPU's best). Levels differ within f32
    /// rounding. Without the flag, the environment variable DELTAFIN_KERNELS_SIMD is read.
    #[arg(long, global = true, value_name = "LEVEL", value_parser = parse_simd, help_heading = "Research options")]
    simd: Option<SimdLevel>,
    #[command(subcommand)]
    cmd: Cmd,
}

fn parse_simd(s: &str) -> Result<SimdLevel, String> {
    s.parse()
}

/// `--simd`, else the environment variable `DELTAFIN_KERNELS_SIMD`, capping the kernels' SIMD
/// level before the first kernel runs.
///
/// Errors: the variable holds no level (named with its value).
fn cap_simd(flag: Option<SimdLevel>) -> Result<()> {
    let level = match (flag, std::env::var("DELTAFIN_KERNELS_SIMD")) {
        (Some(l), _) => l,
        (None, Ok(v)) if !v.is_empty() => v
            .parse()
            .map_err(|e: String| anyhow::anyhow!("DELTAFIN_KERNELS_SIMD={v:?}: {e}"))?,
        _ => return Ok(()),
    };
    deltafin_kernels::cap_simd_level(level).map_err(|e| anyhow::anyhow!("--simd: {e}"))?;
    Ok(())
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
    Run(run_cmd::RunArgs),
    /// Ask the embedded trained model (a small DeepSeek-V3-architecture MoE) a question with an
    /// expert pack four times the expert cache budget, so experts stream from disk (no download).
    Demo(demo::DemoArgs),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    log::init(cli.verbose);
    if let Err(e) = cap_simd(cli.simd) {
        eprintln!("error: {}", one_line(&e));
        return ExitCode::FAILURE;
    }
    // A panic is a bug: report it on one line (where and why), not Rust's multi-line default.
    // Panics on compute-pool threads become errors of their command (or 500s of the server's
    // request); the process never waits on a dead thread.
    std::panic::set_hook(Box::new(|info| {
        let msg = deltafin_engine::panic_message(info.payload());
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
        Cmd::Run(args) => run_cmd::run(&args),
        Cmd::Demo(args) => demo::run(args),
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
