//! Counters served at `GET /metrics` in the Prometheus text exposition format (version 0.0.4).
//!
//! The counters and gauges kept since the first release are written here by hand (their names
//! are unchanged); the queue depth and the latency histograms are `prometheus-client` metrics
//! appended to the same text.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use deltafin_engine::experts::StoreCounters;
use deltafin_engine::session::{FinishReason, GenerationOutput};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Reads the expert store's cumulative counters (live, also during a generation).
pub type StoreProbe = Box<dyn Fn() -> StoreCounters + Send + Sync>;

/// The `prometheus-client` part: queue depth and latency histograms.
struct Prom {
    registry: Registry,
    queue_depth: Gauge,
    ttft: Histogram,
    token_latency: Histogram,
}

impl Default for Prom {
    fn default() -> Self {
        let mut registry = Registry::default();
        let queue_depth = Gauge::default();
        // 5 ms to ~164 s (first tokens wait for the queue and the prompt's prefill).
        let ttft = Histogram::new(exponential_buckets(0.005, 2.0, 16));
        // 1 ms to ~33 s per decode step (streamed experts can make a step slow).
        let token_latency = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "deltafin_queue_depth",
            "Generation requests admitted and waiting for the running one (at most --max-queue).",
            queue_depth.clone(),
        );
        registry.register(
            "deltafin_time_to_first_token_seconds",
            "Seconds from a generation request's admission (queueing and prompt preparation included) to its first generated token.",
            ttft.clone(),
        );
        registry.register(
            "deltafin_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a generation.",
            token_latency.clone(),
        );
        Prom {
            registry,
            queue_depth,
            ttft,
            token_latency,
        }
    }
}

/// Server-wide counters.
#[derive(Default)]
pub struct Metrics {
    prom: Prom,
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    reused_prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    generations: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    active: AtomicU64,
    decode_steps: AtomicU64,
    decode_ns: AtomicU64,
    /// f64 bits of the last generation's steady decode rate.
    last_decode_tps: AtomicU64,
    store: Mutex<Option<StoreProbe>>,
}

impl Metrics {
    /// Counts one request (`status` 499 for one whose client went away before the response was sent in full).
    pub fn record_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_default() += 1;
        }
    }

    /// A generation request took a place in the queue.
    pub(crate) fn queue_entered(&self) {
        self.prom.queue_depth.inc();
    }

    /// A queued request started running or left (cancelled, failed before running).
    pub(crate) fn queue_left(&self) {
        self.prom.queue_depth.dec();
    }

    /// Time from admission to the first generated token.
    pub(crate) fn observe_ttft(&self, d: Duration) {
        self.prom.ttft.observe(d.as_secs_f64());
    }

    /// Time between two consecutive generated tokens.
    pub(crate) fn observe_token_latency(&self, d: Duration) {
        self.prom.token_latency.observe(d.as_secs_f64());
    }

    pub(crate) fn generation_started(&self) {
        self.active.store(1, Ordering::Relaxed);
    }

    pub(crate) fn add_completion_tokens(&self, n: u64) {
        self.completion_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set_store_probe(&self, probe: StoreProbe) {
        if let Ok(mut s) = self.store.lock() {
            *s = Some(probe);
        }
    }

    pub(crate) fn generation_finished(&self, out: Option<&GenerationOutput>) {
        self.active.store(0, Ordering::Relaxed);
        self.generations.fetch_add(1, Ordering::Relaxed);
        let Some(out) = out else {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if out.finish == FinishReason::Cancelled {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.prompt_tokens
            .fetch_add(out.prompt_tokens as u64, Ordering::Relaxed);
        self.reused_prompt_tokens
            .fetch_add(out.reused_tokens as u64, Ordering::Relaxed);
        let s = &out.stats;
        self.decode_steps
            .fetch_add(s.steady_decode_steps as u64, Ordering::Relaxed);
        self.decode_ns
            .fetch_add(s.steady_decode_time.as_nanos() as u64, Ordering::Relaxed);
        if let Some(r) = s.steady_decode_tokens_per_s() {
            self.last_decode_tps.store(r.to_bits(), Ordering::Relaxed);
        }
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(o, "{name}{labels} {v}");
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        let reqs: Vec<(String, String)> = self
            .requests
            .lock()
            .map(|m| {
                m.iter()
                    .map(|((e, s), n)| (format!("{{endpoint=\"{e}\",status=\"{s}\"}}"), n.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        metric(
            "deltafin_requests_total",
            "counter",
            "HTTP requests, each counted once by endpoint and status (499: the client closed the connection before the whole response was sent).",
            &reqs,
        );
        metric(
            "deltafin_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished generations.",
            &one(load(&self.prompt_tokens)),
        );
        metric(
            "deltafin_prompt_tokens_reused_total",
            "counter",
            "Prompt tokens whose KV cache was reused from the previous request.",
            &one(load(&self.reused_prompt_tokens)),
        );
        metric(
            "deltafin_completion_tokens_total",
            "counter",
            "Generated tokens (counted as they are produced).",
            &one(load(&self.completion_tokens)),
        );
        metric(
            "deltafin_generations_total",
            "counter",
            "Generations run (finished, cancelled or failed).",
            &one(load(&self.generations)),
        );
        metric(
            "deltafin_generations_cancelled_total",
            "counter",
            "Generations stopped because the client disconnected.",
            &one(load(&self.cancelled)),
        );
        metric(
            "deltafin_generations_failed_total",
            "counter",
            "Generations that failed with an engine error.",
            &one(load(&self.failed)),
        );
        metric(
            "deltafin_generation_active",
            "gauge",
            "1 while a generation runs.",
            &one(load(&self.active)),
        );
        metric(
            "deltafin_decode_steps_total",
            "counter",
            "Steady decode steps (the first decode step of each generation excluded).",
            &one(load(&self.decode_steps)),
        );
        let ns = self.decode_ns.load(Ordering::Relaxed);
        metric(
            "deltafin_decode_seconds_total",
            "counter",
            "Time spent in steady decode steps.",
            &one(format!("{:.6}", ns as f64 / 1e9)),
        );
        metric(
            "deltafin_decode_tokens_per_second",
            "gauge",
            "Steady decode rate of the last generation with at least two decode steps.",
            &one(format!(
                "{:.3}",
                f64::from_bits(self.last_decode_tps.load(Ordering::Relaxed))
            )),
        );
        let s = self
            .store
            .lock()
            .ok()
            .and_then(|p| p.as_ref().map(|probe| probe()))
            .unwrap_or_default();
        metric(
            "deltafin_expert_bytes_read_total",
            "counter",
            "Routed-expert bytes read from storage.",
            &one(s.bytes_read().to_string()),
        );
        metric(
            "deltafin_expert_cache_hits_total",
            "counter",
            "Routed-expert requests served from the cache.",
            &one(s.hits.to_string()),
        );
        metric(
            "deltafin_expert_cache_misses_total",
            "counter",
            "Routed-expert requests read from storage.",
            &one(s.misses.to_string()),
        );
        metric(
            "deltafin_expert_cache_hit_rate",
            "gauge",
            "hits / (hits + misses) since start.",
            &one(format!("{:.6}", s.hit_rate())),
        );
        // Without the OpenMetrics `# EOF` terminator: this text is version 0.0.4.
        let _ = prometheus_client::encoding::text::encode_registry(&mut o, &self.prom.registry);
        o
    }
}
