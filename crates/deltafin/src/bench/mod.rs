//! `deltafin bench`: the benchmark protocol of REFERENCES.md §6.
//!
//! Every run is a fresh `deltafin run` process (this executable) writing `--stats-json`; runs of
//! the compared configurations are interleaved in balanced order (A B B A A B …, so neither pays
//! the first-run penalty systematically); every run's generated ids are checked identical (and
//! equal to `--expected-ids`) before any timing is shown; then median, min and max of each
//! metric, the storage floor and the per-step time split, as a table, JSON and an SVG chart.
//!
//! Configurations: `--config NAME=ARGS` adds extra `deltafin run` arguments, split on whitespace
//! with '…' / "…" quoting, e.g. `--config direct='--io direct' --config buffered='--io buffered'`.
//! Without `--config` there is one configuration, `default`, with no extra arguments.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

mod chart;
mod report;
mod table;

use chart::plot_svg;
use report::{build_report, verify_ids};
use table::print_table;

use crate::report::{RunReport, Step};
use crate::size;
use crate::OutputFile;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: crate::ModelPath,
    /// Runs per configuration (each a fresh process).
    #[arg(long, default_value_t = 6, allow_negative_numbers = true)]
    runs: usize,
    /// Prompt text (default, without --prompt-ids: the demo's prompt, "Routed experts stream
    /// from disk while the backbone stays resident.").
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens generated per run (end-of-sequence is ignored, so every run decodes exactly N).
    #[arg(long, default_value_t = 32, allow_negative_numbers = true)]
    new_tokens: usize,
    /// Expected generated ids (comma-separated); every run of an equivalent configuration must
    /// produce exactly these.
    #[arg(long, value_delimiter = ',')]
    expected_ids: Option<Vec<u32>>,
    /// A configuration to compare: NAME=EXTRA RUN ARGS (repeatable), e.g.
    /// `--config direct='--io direct --prefetch off'`.
    #[arg(long = "config", value_name = "NAME=ARGS")]
    configs: Vec<String>,
    /// Run every process in a fresh memory cgroup of this size (page cache included), through
    /// with-memory-limit.sh (shipped inside this executable), and drop the page cache before
    /// each run (cold cache; root).
    #[arg(long, value_parser = size::parse_size, allow_negative_numbers = true)]
    memory_limit: Option<u64>,
    /// Expert cache budget passed to every run (unless a --config sets its own). Default with
    /// --memory-limit: the limit minus the backbone minus 512 MiB for everything else, since
    /// `run`'s own default (a quarter of the cgroup limit) would leave most of the limit unused.
    #[arg(long, value_parser = size::parse_size, allow_hyphen_values = true)]
    ram_budget: Option<u64>,
    /// Drop the page cache before each run even without --memory-limit (root).
    #[arg(long)]
    drop_caches: bool,
    /// Read bandwidth for the storage floor: GB/s (1e9 bytes/s), the JSON written by
    /// bench/fio-floor.sh, or `fio` to run fio-floor.sh (shipped inside this executable; needs
    /// `fio`) on the model before and after the runs and use the mean (~25 s each; FIO_RUNTIME
    /// sets fio's seconds).
    #[arg(long, value_name = "GBPS|FILE", allow_negative_numbers = true)]
    floor_bandwidth: Option<String>,
    /// A replacement for with-memory-limit.sh (default: the copy shipped inside this
    /// executable, written to the work directory).
    #[arg(long)]
    limit_script: Option<PathBuf>,
    /// Write the full report (every run's statistics included) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write an SVG chart of where each decode step's time goes (median run of each configuration).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Directory for the per-run stats files (default: a temporary directory, removed afterwards).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

/// What the report reads from each run's `--stats-json`.
impl RunReport {
    /// Decode steps that count for the steady rate: every decode (or speculative verify) step
    /// but the first.
    fn steady_steps(&self) -> &[Step] {
        let first = self.steps.iter().position(|s| s.kind != "prefill");
        match first {
            Some(i) if i + 1 < self.steps.len() => &self.steps[i + 1..],
            _ => &[],
        }
    }

    /// Generated tokens of the steady steps.
    fn steady_tokens(&self) -> f64 {
        self.steady_steps().iter().map(|s| s.tokens.max(1) as f64).sum()
    }

    /// Routed-expert bytes read on demand per steady decode token.
    fn demand_bytes_per_token(&self) -> Option<f64> {
        let s = self.steady_steps();
        (!s.is_empty()).then(|| s.iter().map(|x| x.expert_bytes_read as f64).sum::<f64>() / self.steady_tokens())
    }

    /// One time component over the steady decode steps per generated token, seconds.
    fn steady_mean(&self, f: impl Fn(&Step) -> f64) -> Option<f64> {
        let s = self.steady_steps();
        (!s.is_empty()).then(|| s.iter().map(f).sum::<f64>() / self.steady_tokens())
    }
}

/// One finished run.
#[derive(Debug, Clone, Serialize)]
struct Run {
    config: usize,
    /// 0-based index within its configuration.
    index: usize,
    /// 0-based position in the overall order.
    position: usize,
    wall_s: f64,
    stats: RunReport,
    /// with-memory-limit.sh's report (limit, peak usage incl. page cache, OOM kills).
    cgroup: Option<Value>,
}

struct Config {
    name: String,
    args: Vec<String>,
}

/// Splits `s` on whitespace, honouring '…' and "…" quoting (no escapes, no expansion).
fn split_args(s: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => cur.push(c),
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                in_word = true;
            }
            None if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            None => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        bail!("unterminated quote in {s:?}");
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

fn parse_config(s: &str) -> Result<Config> {
    let (name, args) = s
        .split_once('=')
        .with_context(|| format!("--config {s:?}: expected NAME=ARGS, e.g. direct='--io direct'"))?;
    let name = name.trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        bail!("--config {s:?}: the name must be one non-empty word");
    }
    let args = split_args(args).with_context(|| format!("--config {name}"))?;
    for reserved in [
        "--model",
        "--prompt",
        "--prompt-ids",
        "--max-new-tokens",
        "--stats-json",
    ] {
        if args
            .iter()
            .any(|a| a == reserved || a.starts_with(&format!("{reserved}=")))
        {
            bail!("--config {name}: {reserved} is set by the bench itself");
        }
    }
    Ok(Config {
        name: name.to_string(),
        args,
    })
}

/// The arguments of one `deltafin run` of configuration `c`, from `run` on: the model, the
/// prompt, the new tokens, the stats file, the bench's `--ram-budget` unless `c` sets its own,
/// then `c`'s own arguments.
fn run_args(
    a: &BenchArgs,
    prompt_args: &[String],
    stats_path: &Path,
    budget: Option<u64>,
    c: &Config,
) -> Vec<std::ffi::OsString> {
    let mut v: Vec<std::ffi::OsString> = vec!["run".into(), "--model".into(), a.model.path().into()];
    v.extend(prompt_args.iter().map(Into::into));
    v.extend([
        "--max-new-tokens".into(),
        a.new_tokens.to_string().into(),
        "--ignore-eos".into(),
    ]);
    v.extend(["--stats-json".into(), stats_path.as_os_str().to_owned()]);
    if let Some(b) = budget.filter(|_| !c.args.iter().any(|x| x.starts_with("--ram-budget"))) {
        v.extend(["--ram-budget".into(), b.to_string().into()]);
    }
    v.extend(c.args.iter().map(Into::into));
    v
}

/// Balanced interleaving: round r runs the configurations forward when r is even, backward when
/// odd (A B B A A B …). Returns (config, index within config).
fn balanced_order(configs: usize, runs: usize) -> Vec<(usize, usize)> {
    let mut order = Vec::with_capacity(configs * runs);
    for r in 0..runs {
        if r % 2 == 0 {
            order.extend((0..configs).map(|c| (c, r)));
        } else {
            order.extend((0..configs).rev().map(|c| (c, r)));
        }
    }
    order
}

/// Read bandwidth for the storage floor, bytes/s, and where it came from.
fn floor_bandwidth(arg: &str) -> Result<(f64, String)> {
    if let Ok(gbps) = arg.parse::<f64>() {
        if !(gbps.is_finite() && gbps > 0.0) {
            bail!("--floor-bandwidth {arg}: must be a positive number of GB/s");
        }
        return Ok((gbps * 1e9, format!("--floor-bandwidth {arg} GB/s")));
    }
    let text =
        deltafin_fs::read_to_string(Path::new(arg)).with_context(|| format!("--floor-bandwidth: reading {arg}"))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("--floor-bandwidth: {arg} is not JSON"))?;
    let bw = v["bandwidth_bytes_per_s"].as_f64().with_context(|| {
        format!("--floor-bandwidth: {arg} has no bandwidth_bytes_per_s (write it with bench/fio-floor.sh)")
    })?;
    let what = format!(
        "fio {} O_DIRECT random reads, bs {} QD {} ({arg})",
        v["engine"].as_str().unwrap_or("?"),
        v["bs"],
        v["iodepth"]
    );
    Ok((bw, what))
}

/// bench/with-memory-limit.sh, shipped inside the executable so that `bench --memory-limit`
/// works for an installed binary without the source tree.
const WITH_MEMORY_LIMIT_SH: &str = include_str!("../../../../bench/with-memory-limit.sh");
/// bench/fio-floor.sh, shipped for `--floor-bandwidth fio` likewise.
const FIO_FLOOR_SH: &str = include_str!("../../../../bench/fio-floor.sh");

/// Writes the shipped script `text` as `work/name` and returns its path (run with `bash`).
///
/// Errors: the file cannot be written.
fn shipped_script(work: &Path, name: &str, text: &str) -> Result<PathBuf> {
    let p = work.join(name);
    std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
    Ok(p)
}

/// Runs fio-floor.sh (the shipped copy, written to `work`) on the model's expert pack, writing
/// its JSON to `out`.
fn measure_floor(model: &Path, work: &Path, out: &Path) -> Result<PathBuf> {
    let script = shipped_script(work, "fio-floor.sh", FIO_FLOOR_SH)?;
    let out = out.to_path_buf();
    eprintln!("measuring the storage floor: {} {}", script.display(), model.display());
    let status = Command::new("bash")
        .arg(&script)
        .arg(model)
        .env("FIO_FLOOR_OUT", &out)
        .status()
        .context("starting bench/fio-floor.sh")?;
    if !status.success() {
        bail!("bench/fio-floor.sh failed ({status})");
    }
    Ok(out)
}

fn drop_page_cache() -> Result<()> {
    // Dirty pages survive drop_caches: write them back first.
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n")
        .context("dropping the page cache (echo 3 > /proc/sys/vm/drop_caches) needs root")
}

fn machine() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let mem = read("/proc/meminfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")
                .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024);
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "mem_total_bytes": mem,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
    })
}

/// Removes a directory when dropped.
struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if a.new_tokens < 3 {
        bail!("--new-tokens must be at least 3 (the first decode step is excluded from the steady rate)");
    }
    let dir = deltafin_format::ModelDir::open(&a.model)?;
    let mut configs: Vec<Config> = a.configs.iter().map(|s| parse_config(s)).collect::<Result<_>>()?;
    if configs.is_empty() {
        configs.push(Config {
            name: "default".into(),
            args: Vec::new(),
        });
    }
    for (i, c) in configs.iter().enumerate() {
        if configs[..i].iter().any(|d| d.name == c.name) {
            bail!("--config {}: name used twice", c.name);
        }
    }
    let prompt_args: Vec<String> = match (&a.prompt, &a.prompt_ids) {
        (Some(t), None) => vec!["--prompt".into(), t.clone()],
        (None, Some(ids)) => vec![
            "--prompt-ids".into(),
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        ],
        (None, None) => vec![
            "--prompt".into(),
            "Routed experts stream from disk while the backbone stays resident.".into(),
        ],
        (Some(_), Some(_)) => bail!("give --prompt or --prompt-ids, not both"),
    };
    // The runs would refuse a prompt plus --new-tokens past the context (naming their own
    // --max-new-tokens); say it here, in the bench's terms, before any run. Configurations that
    // change the prompt (--chat) or allow the overflow are left to the runs.
    let passes_through = |flag: &str| configs.iter().any(|c| c.args.iter().any(|x| x == flag));
    if !passes_through("--chat") && !passes_through("--allow-context-overflow") {
        let prompt_len = match &prompt_args[..] {
            [f, ids] if f == "--prompt-ids" => ids.split(',').count(),
            [_, text] => deltafin_tokenizer::Tokenizer::from_dir(&a.model)
                .and_then(|t| t.encode(text, true))
                .map(|ids| ids.len())
                .unwrap_or(0),
            _ => 0,
        };
        let ctx = dir.manifest.config.max_position_embeddings();
        if prompt_len.saturating_add(a.new_tokens) > ctx {
            bail!(
                "--new-tokens {}: the prompt ({prompt_len} tokens) plus the new tokens exceed the model's context length ({ctx}); lower --new-tokens or shorten the prompt",
                a.new_tokens
            );
        }
    }
    if let Some(p) = a.limit_script.as_deref().filter(|p| !p.is_file()) {
        bail!("--limit-script {}: no such file", p.display());
    }
    let cold = a.memory_limit.is_some() || a.drop_caches;
    let budget = match (a.ram_budget, a.memory_limit) {
        (Some(b), _) => Some(b),
        (None, Some(limit)) => {
            let reserve = dir.manifest.backbone.bytes + (512 << 20);
            if limit <= reserve {
                bail!(
                    "--memory-limit {} leaves no room for an expert cache beside the {} backbone; raise it or pass --ram-budget",
                    size::human(limit),
                    size::human(dir.manifest.backbone.bytes)
                );
            }
            Some(limit - reserve)
        }
        (None, None) => None,
    };
    // Every configuration's `run` arguments parse before anything runs: a typo in the last
    // configuration fails now, not after the others' runs.
    for c in &configs {
        let argv = run_args(a, &prompt_args, Path::new("stats.json"), budget, c);
        if let Err(e) = <crate::Cli as clap::Parser>::try_parse_from(std::iter::once("deltafin".into()).chain(argv)) {
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or_default();
            bail!("--config {}: {}", c.name, first.trim_start_matches("error: "));
        }
    }
    // The report files are claimed before the runs: a bad path fails now, not after them.
    let json_file = a.json.as_deref().map(|p| OutputFile::claim(p, "--json")).transpose()?;
    let plot_file = a.plot.as_deref().map(|p| OutputFile::claim(p, "--plot")).transpose()?;
    let exe = std::env::current_exe().context("locating the deltafin executable")?;
    let (work, _guard) = match &a.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            (d.clone(), None)
        }
        None => {
            let d = std::env::temp_dir().join(format!("deltafin-bench-{}", std::process::id()));
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
            (d.clone(), Some(TempDir(d)))
        }
    };
    let limit_script = match (a.memory_limit, &a.limit_script) {
        (None, _) => None,
        (Some(_), Some(p)) => Some(p.clone()),
        (Some(_), None) => Some(shipped_script(&work, "with-memory-limit.sh", WITH_MEMORY_LIMIT_SH)?),
    };

    // `fio`: measured before and after the runs (the disk's speed drifts; both are reported and
    // their mean is the floor).
    let fio_mode = a.floor_bandwidth.as_deref() == Some("fio");
    let mut floor = match a.floor_bandwidth.as_deref() {
        Some("fio") => {
            let f = measure_floor(&a.model, &work, &work.join("fio-before.json"))?;
            Some(floor_bandwidth(&f.to_string_lossy())?)
        }
        Some(x) => Some(floor_bandwidth(x)?),
        None => None,
    };
    let order = balanced_order(configs.len(), a.runs);
    eprintln!(
        "deltafin bench: {} run(s) × {} configuration(s) [{}], {} new tokens each, order {}{}",
        a.runs,
        configs.len(),
        configs.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
        a.new_tokens,
        order
            .iter()
            .map(|&(c, _)| configs[c].name.as_str())
            .collect::<Vec<_>>()
            .join(" "),
        match a.memory_limit {
            Some(l) => format!(", memory limit {} (cold cache)", size::human(l)),
            None if a.drop_caches => ", cold cache".into(),
            None => String::new(),
        }
    );
    let mut runs: Vec<Run> = Vec::with_capacity(order.len());
    for (position, &(ci, index)) in order.iter().enumerate() {
        let c = &configs[ci];
        let stats_path = work.join(format!("run-{position:03}-{}.json", c.name));
        let cg_path = work.join(format!("run-{position:03}-{}.cgroup.json", c.name));
        let _ = std::fs::remove_file(&stats_path);
        let mut cmd = match (&limit_script, a.memory_limit) {
            (Some(script), Some(limit)) => {
                let mut cmd = Command::new("bash");
                cmd.arg(script).arg(limit.to_string()).arg(&exe);
                cmd.env("WITH_MEMORY_LIMIT_REPORT", &cg_path)
                    .env("WITH_MEMORY_LIMIT_QUIET", "1");
                cmd
            }
            _ => Command::new(&exe),
        };
        cmd.args(run_args(a, &prompt_args, &stats_path, budget, c))
            .stdout(std::process::Stdio::null());
        if cold {
            drop_page_cache()?;
        }
        let t = Instant::now();
        let out = cmd.output().with_context(|| format!("starting {}", exe.display()))?;
        let wall_s = t.elapsed().as_secs_f64();
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(8).collect();
            let oom = if out.status.code() == Some(137) && a.memory_limit.is_some() {
                " (killed: the memory limit is too small for this configuration?)"
            } else {
                ""
            };
            bail!(
                "run {} of configuration {} failed ({}){oom}:\n{}",
                index + 1,
                c.name,
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        let text = std::fs::read_to_string(&stats_path).with_context(|| {
            format!(
                "run {} of {} wrote no {} (does `deltafin run` support --stats-json?)",
                index + 1,
                c.name,
                stats_path.display()
            )
        })?;
        let stats: RunReport =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", stats_path.display()))?;
        let cgroup = std::fs::read_to_string(&cg_path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok());
        eprintln!(
            "  [{}/{}] {:<12} run {}: {:.1} s wall, steady decode {}",
            position + 1,
            order.len(),
            c.name,
            index + 1,
            wall_s,
            stats
                .steady_decode_tokens_per_s
                .map(|r| format!("{r:.3} tok/s"))
                .unwrap_or_else(|| "n/a".into())
        );
        runs.push(Run {
            config: ci,
            index,
            position,
            wall_s,
            stats,
            cgroup,
        });
    }

    if let (true, Some((before, _))) = (fio_mode, floor.clone()) {
        let f = measure_floor(&a.model, &work, &work.join("fio-after.json"))?;
        let (after, src) = floor_bandwidth(&f.to_string_lossy())?;
        floor = Some((
            (before + after) / 2.0,
            format!(
                "mean of fio before ({:.3} GB/s) and after ({:.3} GB/s) the runs; {src}",
                before / 1e9,
                after / 1e9
            ),
        ));
    }
    let reference = verify_ids(&configs, &runs, a.expected_ids.as_deref())?;
    let report = build_report(a, &dir, &configs, &runs, floor.as_ref(), &reference, budget);
    print_table(&report, &configs);
    if let (Some(p), Some(f)) = (&a.json, json_file) {
        f.write(&serde_json::to_vec_pretty(&report)?)?;
        eprintln!("report written to {}", p.display());
    }
    if let (Some(p), Some(f)) = (&a.plot, plot_file) {
        f.write(plot_svg(&configs, &runs, &report).as_bytes())?;
        eprintln!("chart written to {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_order_alternates() {
        let o: Vec<usize> = balanced_order(2, 4).into_iter().map(|(c, _)| c).collect();
        assert_eq!(o, [0, 1, 1, 0, 0, 1, 1, 0]);
        let o: Vec<usize> = balanced_order(3, 2).into_iter().map(|(c, _)| c).collect();
        assert_eq!(o, [0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn config_syntax() {
        let c = parse_config("direct=--io direct --prefetch off").unwrap();
        assert_eq!(c.name, "direct");
        assert_eq!(c.args, ["--io", "direct", "--prefetch", "off"]);
        let c = parse_config("q='--pin-from \"a b.trace\"' --ram-budget 1G").unwrap();
        assert_eq!(c.args, ["--pin-from \"a b.trace\"", "--ram-budget", "1G"]);
        let c = parse_config("plain=").unwrap();
        assert!(c.args.is_empty());
        assert!(parse_config("noequals").is_err());
        assert!(parse_config("x=--max-new-tokens 3").is_err());
        assert!(parse_config("x='open").is_err());
    }

    #[test]
    fn parses_stats_and_ignores_unknown_fields() {
        let j = r#"{"generated_ids":[5,6,7],"prompt_tokens":3,"ttft_s":0.5,"prefill_tokens_per_s":6.0,
            "steady_decode_tokens_per_s":2.0,"steady_decode_steps":1,"expert_bytes_read_demand":300,
            "expert_bytes_read_speculative":0,"expert_hits":1,"expert_misses":2,"hit_rate":0.33,
            "peak_rss_bytes":null,"io_mode":"direct","cache_policy":"lru","prefetch":false,
            "non_default_routing":false,"experts_per_token":8,"ram_budget":0,"new_field":1,
            "steps":[{"kind":"prefill","seconds":0.1,"io_wait_s":0.05,"expert_compute_s":0.02,"attention_s":0.01,"other_s":0.02,"expert_bytes_read":100},
                     {"kind":"decode","seconds":0.4,"io_wait_s":0.3,"expert_compute_s":0.05,"attention_s":0.02,"other_s":0.03,"expert_bytes_read":100},
                     {"kind":"decode","seconds":0.5,"io_wait_s":0.4,"expert_compute_s":0.05,"attention_s":0.02,"other_s":0.03,"expert_bytes_read":60}]}"#;
        let s: RunReport = serde_json::from_str(j).unwrap();
        assert_eq!(s.steady_steps().len(), 1);
        assert_eq!(s.demand_bytes_per_token(), Some(60.0));
        assert_eq!(s.steady_mean(|x| x.io_wait_s), Some(0.4));
    }
}
