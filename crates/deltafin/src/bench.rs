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

/// Median, min and max (median of an even count: mean of the two middle values).
#[derive(Debug, Clone, Copy, Serialize)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

fn spread(mut v: Vec<f64>) -> Option<Spread> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: v[0],
        max: v[n - 1],
    })
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
const WITH_MEMORY_LIMIT_SH: &str = include_str!("../../../bench/with-memory-limit.sh");
/// bench/fio-floor.sh, shipped for `--floor-bandwidth fio` likewise.
const FIO_FLOOR_SH: &str = include_str!("../../../bench/fio-floor.sh");

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

/// Checks that every run of a configuration produced the same ids, that all configurations with
/// the model's routing agree with each other, and with `expected` when given. Returns the ids of
/// the equivalent configurations (or of the first configuration if none is equivalent).
fn verify_ids(configs: &[Config], runs: &[Run], expected: Option<&[u32]>) -> Result<Vec<u32>> {
    let mut problems = Vec::new();
    let mut per_config: Vec<Option<&[u32]>> = vec![None; configs.len()];
    for r in runs {
        let ids = r.stats.generated_ids.as_slice();
        match per_config[r.config] {
            None => per_config[r.config] = Some(ids),
            Some(first) if first != ids => problems.push(format!(
                "{} run {} generated {:?}, its run 1 generated {:?}",
                configs[r.config].name,
                r.index + 1,
                ids,
                first
            )),
            _ => {}
        }
    }
    let equivalent = |ci: usize| runs.iter().any(|r| r.config == ci && !r.stats.non_default_routing);
    let mut reference: Option<(usize, &[u32])> = None;
    for (ci, ids) in per_config.iter().enumerate() {
        let Some(ids) = *ids else { continue };
        if !equivalent(ci) {
            continue;
        }
        match reference {
            None => reference = Some((ci, ids)),
            Some((rc, rids)) if rids != ids => problems.push(format!(
                "configuration {} generated {:?} but {} generated {:?} (both claim the model's routing)",
                configs[ci].name, ids, configs[rc].name, rids
            )),
            _ => {}
        }
        if let Some(exp) = expected {
            if exp != ids {
                problems.push(format!(
                    "configuration {} generated {:?}, --expected-ids says {:?}",
                    configs[ci].name, ids, exp
                ));
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "generated ids differ, so no timing is reported:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(reference
        .map(|(_, ids)| ids)
        .or(per_config.first().copied().flatten())
        .unwrap_or_default()
        .to_vec())
}

fn build_report(
    a: &BenchArgs,
    dir: &deltafin_format::ModelDir,
    configs: &[Config],
    runs: &[Run],
    floor: Option<&(f64, String)>,
    reference: &[u32],
    budget: Option<u64>,
) -> Value {
    let m = &dir.manifest;
    let rec = m.experts.records.first().map(|r| r.length).unwrap_or(0);
    let summaries: Vec<Value> = configs
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let rs: Vec<&Run> = runs.iter().filter(|r| r.config == ci).collect();
            let col = |f: &dyn Fn(&Run) -> Option<f64>| spread(rs.iter().filter_map(|r| f(r)).collect());
            let steady = col(&|r| r.stats.steady_decode_tokens_per_s);
            let s_per_tok = col(&|r| r.stats.steady_decode_tokens_per_s.map(|x| 1.0 / x));
            let demand = col(&|r| r.stats.demand_bytes_per_token());
            let spec = col(&|r| {
                let n = r.stats.generated_ids.len().max(1) as f64;
                Some(r.stats.expert_bytes_read_speculative as f64 / n)
            });
            let floor_s = match (floor, demand) {
                (Some((bw, _)), Some(d)) => Some(d.median / bw),
                _ => None,
            };
            let ratio = match (floor_s, s_per_tok) {
                (Some(f), Some(s)) if f > 0.0 => Some(s.median / f),
                _ => None,
            };
            let first = rs.first().map(|r| &r.stats);
            json!({
                "name": c.name,
                "args": c.args,
                "equivalent": !rs.iter().any(|r| r.stats.non_default_routing),
                "io_mode": first.and_then(|s| s.io_mode.clone()),
                "cache_policy": first.and_then(|s| s.cache_policy.clone()),
                "prefetch": first.and_then(|s| s.prefetch),
                "batch_form": first.and_then(|s| s.batch_form.clone()),
                "experts_per_token": first.and_then(|s| s.experts_per_token),
                "ram_budget": first.and_then(|s| s.ram_budget),
                "steady_decode_tokens_per_s": steady,
                "seconds_per_token": s_per_tok,
                "ttft_s": col(&|r| Some(r.stats.ttft_s)),
                "prefill_tokens_per_s": col(&|r| Some(r.stats.prefill_tokens_per_s)),
                "demand_bytes_per_token": demand,
                "speculative_bytes_per_generated_token": spec,
                "hit_rate": col(&|r| Some(r.stats.hit_rate)),
                "peak_rss_bytes": col(&|r| r.stats.peak_rss_bytes.map(|x| x as f64)),
                "cgroup_peak_bytes": col(&|r| r.cgroup.as_ref().and_then(|c| c["peak_bytes"].as_f64())),
                "step_io_wait_s": col(&|r| r.stats.steady_mean(|s| s.io_wait_s)),
                "step_expert_compute_s": col(&|r| r.stats.steady_mean(|s| s.expert_compute_s)),
                "step_attention_s": col(&|r| r.stats.steady_mean(|s| s.attention_s)),
                "step_other_s": col(&|r| r.stats.steady_mean(|s| s.other_s)),
                "storage_floor_s_per_token": floor_s,
                "seconds_per_token_over_floor": ratio,
                "wall_s": col(&|r| Some(r.wall_s)),
            })
        })
        .collect();
    json!({
        "model": a.model.canonicalize().unwrap_or_else(|_| a.model.to_path_buf()),
        "model_shape": {
            "layers": m.config.num_hidden_layers(),
            "routed_experts": m.config.n_routed_experts(),
            "top_k": m.config.num_experts_per_tok(),
            "expert_record_bytes": rec,
            "expert_pack_bytes": m.experts.bytes,
            "backbone_bytes": m.backbone.bytes,
        },
        "machine": machine(),
        "protocol": {
            "runs_per_config": a.runs,
            "new_tokens": a.new_tokens,
            "prompt": a.prompt,
            "prompt_ids": a.prompt_ids,
            "order": balanced_order(configs.len(), a.runs).iter().map(|&(c, _)| configs[c].name.clone()).collect::<Vec<_>>(),
            "memory_limit_bytes": a.memory_limit,
            "ram_budget_bytes": budget,
            "cold_cache": a.memory_limit.is_some() || a.drop_caches,
            "steady_rate": "decode steps after the first",
        },
        "floor": floor.map(|(bw, src)| json!({"bandwidth_bytes_per_s": bw, "source": src})),
        "ids_verified": true,
        "generated_ids": reference,
        "expected_ids": a.expected_ids,
        "configs": summaries,
        "runs": runs.iter().map(|r| json!({
            "config": configs[r.config].name,
            "index": r.index,
            "position": r.position,
            "wall_s": r.wall_s,
            "cgroup": r.cgroup,
            "stats": r.stats,
        })).collect::<Vec<_>>(),
    })
}

/// `x` with about four significant digits (0.000123, 0.0123, 1.234, 123.4, 12345).
fn sig(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 9) as usize;
    format!("{x:.digits$}")
}

fn fmt_spread(v: &Value, scale: f64) -> String {
    let g = |k: &str| v[k].as_f64().map(|x| x * scale);
    match (g("median"), g("min"), g("max")) {
        (Some(m), Some(lo), Some(hi)) => format!("{} [{}–{}]", sig(m), sig(lo), sig(hi)),
        _ => "n/a".into(),
    }
}

/// A table row: its label and how to format one configuration's summary.
type Row<'a> = (&'a str, Box<dyn Fn(&Value) -> String>);

fn print_table(report: &Value, configs: &[Config]) {
    let cs = report["configs"].as_array().cloned().unwrap_or_default();
    let mib = 1.0 / (1u64 << 20) as f64;
    let rows: Vec<Row> = vec![
        (
            "steady decode tok/s",
            Box::new(|c: &Value| fmt_spread(&c["steady_decode_tokens_per_s"], 1.0)),
        ),
        (
            "seconds per token",
            Box::new(|c: &Value| fmt_spread(&c["seconds_per_token"], 1.0)),
        ),
        (
            "time to first token s",
            Box::new(|c: &Value| fmt_spread(&c["ttft_s"], 1.0)),
        ),
        (
            "prefill tok/s",
            Box::new(|c: &Value| fmt_spread(&c["prefill_tokens_per_s"], 1.0)),
        ),
        (
            "demand MiB/token",
            Box::new(move |c: &Value| fmt_spread(&c["demand_bytes_per_token"], mib)),
        ),
        (
            "speculative MiB/token (run)",
            Box::new(move |c: &Value| fmt_spread(&c["speculative_bytes_per_generated_token"], mib)),
        ),
        (
            "cache hit rate %",
            Box::new(|c: &Value| fmt_spread(&c["hit_rate"], 100.0)),
        ),
        (
            "storage floor s/token",
            Box::new(|c: &Value| {
                c["storage_floor_s_per_token"]
                    .as_f64()
                    .map(sig)
                    .unwrap_or_else(|| "n/a (no --floor-bandwidth)".into())
            }),
        ),
        (
            "s/token ÷ floor",
            Box::new(|c: &Value| {
                c["seconds_per_token_over_floor"]
                    .as_f64()
                    .map(sig)
                    .unwrap_or_else(|| "n/a".into())
            }),
        ),
        (
            "step: io wait s",
            Box::new(|c: &Value| fmt_spread(&c["step_io_wait_s"], 1.0)),
        ),
        (
            "step: expert compute s",
            Box::new(|c: &Value| fmt_spread(&c["step_expert_compute_s"], 1.0)),
        ),
        (
            "step: attention s",
            Box::new(|c: &Value| fmt_spread(&c["step_attention_s"], 1.0)),
        ),
        (
            "step: other s",
            Box::new(|c: &Value| fmt_spread(&c["step_other_s"], 1.0)),
        ),
        (
            "peak RSS MiB",
            Box::new(move |c: &Value| fmt_spread(&c["peak_rss_bytes"], mib)),
        ),
        (
            "cgroup peak MiB (+cache)",
            Box::new(move |c: &Value| fmt_spread(&c["cgroup_peak_bytes"], mib)),
        ),
        (
            "io / cache / prefetch",
            Box::new(|c: &Value| {
                format!(
                    "{} / {} {} / {}",
                    c["io_mode"].as_str().unwrap_or("?"),
                    c["cache_policy"].as_str().unwrap_or("?"),
                    c["ram_budget"].as_u64().map(size::human).unwrap_or_default(),
                    c["prefetch"]
                        .as_bool()
                        .map(|b| if b { "on" } else { "off" })
                        .unwrap_or("?")
                )
            }),
        ),
        (
            "routing",
            Box::new(|c: &Value| {
                let form = match c["batch_form"].as_str() {
                    Some(f) if f != "exact" => format!(", {f} batched MLA (not bit-identical)"),
                    _ => String::new(),
                };
                if c["equivalent"].as_bool().unwrap_or(true) {
                    format!("model's{form}")
                } else {
                    format!("{} experts/token: NOT EQUIVALENT{form}", c["experts_per_token"])
                }
            }),
        ),
    ];
    let m = &report["machine"];
    let shape = &report["model_shape"];
    println!();
    println!("model    {}", report["model"].as_str().unwrap_or("?"));
    println!(
        "         {} layers, {} experts top-{}, record {}, expert pack {}, backbone {}",
        shape["layers"],
        shape["routed_experts"],
        shape["top_k"],
        size::human(shape["expert_record_bytes"].as_u64().unwrap_or(0)),
        size::human(shape["expert_pack_bytes"].as_u64().unwrap_or(0)),
        size::human(shape["backbone_bytes"].as_u64().unwrap_or(0)),
    );
    println!(
        "machine  {} cores, {}, {} RAM, Linux {}",
        m["cores"],
        m["cpu"].as_str().unwrap_or("?"),
        size::human(m["mem_total_bytes"].as_u64().unwrap_or(0)),
        m["kernel"].as_str().unwrap_or("?")
    );
    let p = &report["protocol"];
    println!(
        "protocol {} runs/config, {} new tokens, balanced order, {}{}",
        p["runs_per_config"],
        p["new_tokens"],
        if p["cold_cache"].as_bool().unwrap_or(false) {
            "page cache dropped before each run"
        } else {
            "warm page cache"
        },
        p["memory_limit_bytes"]
            .as_u64()
            .map(|l| format!(", memory cgroup limit {} (page cache included)", size::human(l)))
            .unwrap_or_default()
    );
    if let Some(f) = report["floor"].as_object() {
        println!(
            "floor    {:.3} GB/s: {}",
            f["bandwidth_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e9,
            f["source"].as_str().unwrap_or("")
        );
    }
    let ids = report["generated_ids"].as_array().map(|a| a.len()).unwrap_or(0);
    let not_equivalent: Vec<&str> = report["configs"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .filter(|c| !c["equivalent"].as_bool().unwrap_or(true))
                .filter_map(|c| c["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let scope = if not_equivalent.is_empty() {
        "in every run".to_string()
    } else {
        format!(
            "in every run of each configuration and across those with the model's routing (not {})",
            not_equivalent.join(", ")
        )
    };
    println!(
        "ids      identical {scope} ({ids} ids{}); values below: median [min–max]",
        if report["expected_ids"].is_array() {
            ", equal to --expected-ids"
        } else {
            ""
        }
    );
    println!();
    let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = rows.iter().map(|(_, f)| cs.iter().map(f).collect()).collect();
    let widths: Vec<usize> = (0..cs.len())
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain(std::iter::once(configs[i].name.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut head = format!("{:w0$}", "");
    for (c, w) in configs.iter().zip(&widths) {
        head.push_str(&format!("  {:<w$}", c.name));
    }
    println!("{head}");
    for ((name, _), row) in rows.iter().zip(&cells) {
        let mut line = format!("{name:w0$}");
        for (cell, w) in row.iter().zip(&widths) {
            line.push_str(&format!("  {cell:<w$}"));
        }
        println!("{line}");
    }
    println!();
}

/// Stacked bars, one per decode step, of each configuration's median run (by steady rate):
/// io wait, expert compute, attention, other; a dashed line at the storage floor.
fn plot_svg(configs: &[Config], runs: &[Run], report: &Value) -> String {
    const W: f64 = 900.0;
    const PANEL_H: f64 = 260.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 50.0;
    let parts: [(&str, &str); 4] = [
        ("io wait", "#d62728"),
        ("expert compute", "#1f77b4"),
        ("attention", "#2ca02c"),
        ("other", "#a0a0a0"),
    ];
    let h = TOP + PANEL_H * configs.len() as f64 + 30.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s.push_str(&format!(
        "<text x=\"{LEFT}\" y=\"20\" font-size=\"13\">Where each decode step's time goes (median run of each configuration; step 1, faded, is not in the steady rate)</text>\n"
    ));
    for (i, (name, color)) in parts.iter().enumerate() {
        let x = LEFT + i as f64 * 150.0;
        s.push_str(&format!(
            "<rect x=\"{x}\" y=\"30\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{}\" y=\"41\">{name}</text>\n",
            x + 16.0
        ));
    }
    if (0..configs.len()).any(|ci| report["configs"][ci]["storage_floor_s_per_token"].is_number()) {
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"36\" x2=\"{}\" y2=\"36\" stroke=\"black\" stroke-dasharray=\"5,3\"/><text x=\"{}\" y=\"41\">storage floor</text>\n",
            LEFT + 600.0,
            LEFT + 630.0,
            LEFT + 634.0
        ));
    }
    // The median run of a configuration by steady rate.
    let median_run = |ci: usize| {
        let mut rs: Vec<&Run> = runs.iter().filter(|r| r.config == ci).collect();
        rs.sort_by(|a, b| {
            let k = |r: &Run| r.stats.steady_decode_tokens_per_s.unwrap_or(0.0);
            k(a).total_cmp(&k(b))
        });
        rs.get(rs.len() / 2).copied()
    };
    // One y scale for every panel, so configurations compare at a glance.
    let ymax = (0..configs.len())
        .filter_map(median_run)
        .flat_map(|r| r.stats.steps.iter().filter(|s| s.kind == "decode"))
        .map(|s| {
            s.seconds
                .max(s.io_wait_s + s.expert_compute_s + s.attention_s + s.other_s)
        })
        .chain((0..configs.len()).filter_map(|ci| report["configs"][ci]["storage_floor_s_per_token"].as_f64()))
        .fold(1e-9, f64::max)
        * 1.1;
    for (ci, c) in configs.iter().enumerate() {
        let y0 = TOP + ci as f64 * PANEL_H + 20.0;
        let ph = PANEL_H - 60.0;
        let Some(run) = median_run(ci) else { continue };
        let steps: Vec<&Step> = run.stats.steps.iter().filter(|s| s.kind == "decode").collect();
        let floor = report["configs"][ci]["storage_floor_s_per_token"].as_f64();
        let plot_w = W - LEFT - RIGHT;
        s.push_str(&format!(
            "<text x=\"{LEFT}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{} (run {}, {} tok/s steady)</text>\n",
            y0 - 4.0,
            xml_escape(&c.name),
            run.index + 1,
            run.stats
                .steady_decode_tokens_per_s
                .map(|r| format!("{r:.3}"))
                .unwrap_or_else(|| "n/a".into())
        ));
        // Axes and y ticks.
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y0}\" x2=\"{LEFT}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{LEFT}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
            y0 + ph,
            y0 + ph,
            W - RIGHT,
            y0 + ph
        ));
        for k in 0..=4 {
            let v = ymax * k as f64 / 4.0;
            let y = y0 + ph - ph * k as f64 / 4.0;
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text><line x1=\"{LEFT}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#eee\"/>\n",
                LEFT - 4.0,
                y + 4.0,
                fmt_secs(v),
                W - RIGHT
            ));
        }
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">decode step</text>\n",
            LEFT + plot_w / 2.0,
            y0 + ph + 30.0
        ));
        let n = steps.len().max(1) as f64;
        let bw = plot_w / n;
        for (i, st) in steps.iter().enumerate() {
            let x = LEFT + i as f64 * bw;
            let mut y = y0 + ph;
            let vals = [st.io_wait_s, st.expert_compute_s, st.attention_s, st.other_s];
            for (v, (_, color)) in vals.iter().zip(parts.iter()) {
                let hh = ph * v / ymax;
                y -= hh;
                s.push_str(&format!(
                    "<rect x=\"{:.2}\" y=\"{y:.2}\" width=\"{:.2}\" height=\"{hh:.2}\" fill=\"{color}\"{}/>\n",
                    x + bw * 0.1,
                    bw * 0.8,
                    if i == 0 { " fill-opacity=\"0.5\"" } else { "" }
                ));
            }
            if steps.len() <= 40 || i % (steps.len() / 20).max(1) == 0 {
                s.push_str(&format!(
                    "<text x=\"{:.2}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\">{}</text>\n",
                    x + bw / 2.0,
                    y0 + ph + 13.0,
                    i + 1
                ));
            }
        }
        if let Some(f) = floor {
            let y = y0 + ph - ph * f / ymax;
            s.push_str(&format!(
                "<line x1=\"{LEFT}\" y1=\"{y:.2}\" x2=\"{}\" y2=\"{y:.2}\" stroke=\"black\" stroke-dasharray=\"5,3\"/><text x=\"{}\" y=\"{:.2}\" text-anchor=\"end\" font-size=\"10\">floor {}</text>\n",
                W - RIGHT,
                W - RIGHT,
                y - 3.0,
                fmt_secs(f)
            ));
        }
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_secs(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.2} s")
    } else {
        format!("{:.1} ms", v * 1e3)
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
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
    fn spreads() {
        let s = spread(vec![3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert!(spread(vec![]).is_none());
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
