//! The flags every model-running command shares (`run`, `chat`, `serve`, `replay`; `bench`
//! hands them to `run` through `--config`), the default expert cache budget, and
//! [`open_model`], the one path that opens a model with them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use deltafin_engine::experts::{CachePolicy, IoMode, StoreOptions};
use deltafin_engine::{BatchForm, CausalLm};
use deltafin_format::ModelDir;

use crate::device_args::DeviceArgs;
use crate::pull_cmd::{self, NetworkUse};
use crate::size;

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
    /// Research: the arithmetic of batched passes. `exact` (default): every position
    /// bit-identical to token-at-a-time decoding. `fast`: prompt chunks of 16 or more tokens
    /// compute MLA in the decompressed form where it needs fewer multiply-adds (logits within
    /// f32 rounding, so greedy ids can differ where a router choice is near-tied; speculative
    /// verification stays exact). `fast-always`: the decompressed form for every batched pass.
    /// Without the flag, the environment variable DELTAFIN_BATCH_FORM is read.
    #[arg(long, value_name = "FORM", value_parser = parse_batch_form, help_heading = "Research options")]
    pub(crate) batch_form: Option<BatchForm>,
}

fn parse_batch_form(s: &str) -> Result<BatchForm, String> {
    s.parse()
}

impl PassArgs {
    /// `--batch-form`, else the environment variable `DELTAFIN_BATCH_FORM`, else `exact`.
    ///
    /// Errors: the variable holds no form (named with its value).
    fn batch_form(&self) -> Result<BatchForm> {
        if let Some(f) = self.batch_form {
            return Ok(f);
        }
        match std::env::var("DELTAFIN_BATCH_FORM") {
            Ok(v) => v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("DELTAFIN_BATCH_FORM={v:?}: {e}")),
            Err(_) => Ok(BatchForm::Exact),
        }
    }

    /// Sets the batch form of a freshly loaded `model` and warns (stderr) about what differs
    /// from the model's own arithmetic: a non-default batch form (labelled), and `--speculate
    /// self` for a family without a drafter (the run then decodes plainly).
    ///
    /// Errors: as [`Self::batch_form`].
    pub(crate) fn apply(&self, model: &mut dyn CausalLm) -> Result<()> {
        let form = self.batch_form()?;
        model.routed_mut().set_batch_form(form);
        if form != BatchForm::Exact {
            eprintln!("warning: --batch-form {} (research): {BATCH_FORM_NOTE}", form.name());
        }
        self.warn_unsupported(model);
        Ok(())
    }

    /// Warns (stderr) when `--speculate self` asks for a drafter `model`'s family lacks: the
    /// run then decodes plainly.
    fn warn_unsupported(&self, model: &dyn CausalLm) {
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
    /// 1.4–5.9 points of the no-cache need less than `lru` on every workload (on the
    /// `k3-bench` pack: within ±2 points, ahead on code and chat, behind on prose; bench/NOTES.md,
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
    /// Research: bytes of each chunk of a demand read of expert records (rounded up to 4 KiB;
    /// default 512 KiB): a fetch's records complete one after the other at full queue depth.
    /// Without the flag, the environment variable DELTAFIN_DEMAND_CHUNK is read.
    #[arg(long, value_name = "BYTES", value_parser = parse_demand_chunk, help_heading = "Research options")]
    demand_chunk: Option<usize>,
}

fn parse_demand_chunk(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?} is not a positive number of bytes")),
    }
}

fn parse_io(s: &str) -> Result<IoMode, String> {
    s.parse::<IoMode>().map_err(|e| e.to_string())
}

fn parse_policy(s: &str) -> Result<CachePolicy, String> {
    s.parse::<CachePolicy>().map_err(|e| e.to_string())
}

impl StoreArgs {
    /// Fills the pinned tier of `model`'s expert cache when `--cache-policy pinned` asks for one
    /// (before the first token, so that its reads are not counted against it).
    pub(crate) fn warm_pinned(&self, model: &dyn CausalLm) {
        if self.cache_policy == CachePolicy::Pinned {
            model.store().warm_pinned();
        }
    }

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
        o.demand_chunk = match (self.demand_chunk, std::env::var("DELTAFIN_DEMAND_CHUNK")) {
            (Some(n), _) => n,
            (None, Ok(v)) => parse_demand_chunk(&v).map_err(|e| anyhow::anyhow!("DELTAFIN_DEMAND_CHUNK: {e}"))?,
            (None, Err(_)) => 0,
        };
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

/// The flags of the commands that load a model and keep it for many generations (`chat`,
/// `serve`): the expert cache budget ([`ram_budget`]), then what [`open_model`] takes.
#[derive(clap::Args)]
pub(crate) struct LoadArgs {
    /// Expert cache budget, e.g. 512MiB, 4G (default: a quarter of physical memory or of the memory cgroup limit, whichever is lower).
    #[arg(long, value_parser = size::parse_size, allow_hyphen_values = true)]
    pub(crate) ram_budget: Option<u64>,
    #[command(flatten)]
    pub(crate) device: DeviceArgs,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    #[command(flatten)]
    pub(crate) passes: PassArgs,
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

/// The label every output carries when routing differs from the model's.
pub(crate) const NON_DEFAULT_ROUTING: &str = "non-default routing: output not equivalent to the model";

/// The label of a non-default [`BatchForm`] (research option `--batch-form`).
pub(crate) const BATCH_FORM_NOTE: &str = "long prompt chunks compute MLA in the decompressed form: \
     logits within f32 rounding of token-at-a-time decoding, not bit for bit (greedy ids can differ \
     where a router choice is near-tied)";

/// Opens the model of `dir` the one way `run`, `chat` and `serve` share: the expert store from
/// `store` with a cache of `budget` bytes; a streaming install's source attached, with a warning
/// about records it cannot fetch (`serving`: refused when none is local, as every request would
/// fail); the model loaded where `device` says; `passes` applied (batch form and its warnings).
/// The caller fills the pinned tier ([`StoreArgs::warm_pinned`]) once the run is set up, and
/// keeps the returned [`NetworkUse`] until the command ends: dropping it reports what was fetched.
///
/// Errors: inconsistent store flags or an unreadable trace, a source that cannot be attached, a
/// failed load (missing device, backbone), a bad batch form.
pub(crate) fn open_model(
    dir: &ModelDir,
    budget: u64,
    store: &StoreArgs,
    passes: &PassArgs,
    device: &DeviceArgs,
    serving: bool,
) -> Result<(NetworkUse, Box<dyn CausalLm>)> {
    let mut opts = store.options(budget, dir)?;
    let network = pull_cmd::attach_source(&mut opts, dir, store.allow_network)?;
    pull_cmd::warn_unfetched_records(&network, dir, serving)?;
    let mut model = device.load(dir, opts)?;
    passes.apply(model.as_mut())?;
    Ok((network, model))
}
