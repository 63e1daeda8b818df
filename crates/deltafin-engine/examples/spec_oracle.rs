//! Verification efficiency of speculative decoding with a MEASUREMENT-ONLY oracle drafter that
//! proposes the recorded greedy continuation (so every draft is accepted): for each draft
//! length, expert union bytes and seconds per accepted token relative to plain decoding, and
//! where the time goes.
//!
//! ```text
//! cargo run --release -p deltafin-engine --example spec_oracle -- \
//!     MODEL_DIR BUDGET_BYTES PROMPT_IDS(comma-separated) NEW_TOKENS [KS=1,2,4,8] [ROUNDS=1]
//! ```
//!
//! Each measurement loads the model afresh (cold expert cache: O_DIRECT reads bypass the page
//! cache), runs the prompt in one batched pass, then decodes NEW_TOKENS either plainly or with
//! the oracle's K tokens per pass; rounds interleave the configurations (plain, K…, then the
//! reverse order). The first decode step is excluded (it pays one-off costs). Checks that every
//! configuration produces the plain greedy ids.

use std::time::Instant;

use deltafin_engine::experts::StoreOptions;
use deltafin_engine::sampler::{Sampler, SamplingParams};
use deltafin_engine::speculate::{SpeculateMode, Speculator};
use deltafin_engine::{load_model, CausalLm};
use deltafin_format::ModelDir;

struct Measure {
    ids: Vec<u32>,
    seconds: f64,
    tokens: usize,
    bytes: u64,
    io_wait_s: f64,
    attention_s: f64,
    mlp_s: f64,
    passes: u64,
}

fn run(dir: &ModelDir, budget: u64, prompt: &[u32], n: usize, k: usize, oracle: &[u32]) -> Measure {
    let model = load_model(dir, StoreOptions::new(budget)).expect("load");
    let model: &dyn CausalLm = model.as_ref();
    let mut st = model.new_state();
    let o = model.forward_batch(st.as_mut(), prompt, false).expect("prefill");
    let mut chooser = Sampler::new(SamplingParams::default());
    let mut ctx = prompt.to_vec();
    ctx.push(chooser.sample(&o.logits[0]));
    let mut spec = Speculator::new(SpeculateMode::Off);
    let mut measure_from = None;
    while ctx.len() < prompt.len() + n {
        if measure_from.is_none() && ctx.len() >= prompt.len() + 2 {
            measure_from = Some((
                ctx.len(),
                Instant::now(),
                model.store().counters(),
                model.routed().profile(),
                spec.stats,
            ));
        }
        let g = ctx.len() - prompt.len();
        let draft: Vec<u32> = if k == 0 {
            Vec::new()
        } else {
            oracle.iter().skip(g).take(k).copied().collect()
        };
        let s = spec
            .step_with_draft(model, st.as_mut(), &ctx, &draft, &mut chooser)
            .expect("step");
        ctx.extend(&s.tokens);
    }
    let (from, t, c0, p0, s0) = measure_from.expect("at least 3 new tokens");
    let seconds = t.elapsed().as_secs_f64();
    let c = model.store().counters().since(&c0);
    let p = model.routed().profile();
    ctx.truncate(prompt.len() + n);
    Measure {
        ids: ctx[prompt.len()..].to_vec(),
        seconds,
        tokens: prompt.len() + n - from,
        bytes: c.bytes_read_demand,
        io_wait_s: c.read_wait_ns as f64 * 1e-9,
        attention_s: (p.attention_ns - p0.attention_ns) as f64 * 1e-9,
        mlp_s: (p.mlp_ns - p0.mlp_ns) as f64 * 1e-9,
        passes: spec.stats.passes - s0.passes,
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: spec_oracle MODEL_DIR BUDGET_BYTES PROMPT_IDS NEW_TOKENS [KS=1,2,4,8] [ROUNDS=1]");
        std::process::exit(2);
    }
    let dir = ModelDir::open(std::path::Path::new(&a[1])).expect("model dir");
    let budget: u64 = a[2].parse().expect("budget");
    let prompt: Vec<u32> = a[3].split(',').map(|x| x.trim().parse().expect("id")).collect();
    let n: usize = a[4].parse().expect("new tokens");
    let ks: Vec<usize> = a
        .get(5)
        .map_or("1,2,4,8", String::as_str)
        .split(',')
        .map(|x| x.parse().expect("k"))
        .collect();
    let rounds: usize = a.get(6).map_or(1, |x| x.parse().expect("rounds"));
    // The oracle: the plain greedy continuation.
    let plain0 = run(&dir, budget, &prompt, n, 0, &[]);
    let oracle = plain0.ids.clone();
    let mut configs: Vec<usize> = vec![0];
    configs.extend(&ks);
    let mut results: Vec<Vec<Measure>> = configs.iter().map(|_| Vec::new()).collect();
    results[0].push(plain0);
    for r in 0..rounds {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..configs.len()).collect()
        } else {
            (0..configs.len()).rev().collect()
        };
        for ci in order {
            if r == 0 && ci == 0 {
                continue;
            }
            let m = run(&dir, budget, &prompt, n, configs[ci], &oracle);
            assert_eq!(m.ids, oracle, "k = {}: output differs from plain greedy", configs[ci]);
            results[ci].push(m);
        }
    }
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let per_tok = |ms: &[Measure], f: &dyn Fn(&Measure) -> f64| {
        med(&ms.iter().map(|m| f(m) / m.tokens as f64).collect::<Vec<_>>())
    };
    let plain_s = per_tok(&results[0], &|m| m.seconds);
    let plain_b = per_tok(&results[0], &|m| m.bytes as f64);
    println!("| drafted/pass | tokens/pass | MiB/token | × plain bytes | s/token | × plain time | io wait | expert compute | attention | other (s/token) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (ci, ms) in results.iter().enumerate() {
        let s = per_tok(ms, &|m| m.seconds);
        let b = per_tok(ms, &|m| m.bytes as f64);
        let io = per_tok(ms, &|m| m.io_wait_s);
        let mlp = per_tok(ms, &|m| (m.mlp_s - m.io_wait_s).max(0.0));
        let att = per_tok(ms, &|m| m.attention_s);
        let tpp = ms[0].tokens as f64 / ms[0].passes.max(1) as f64;
        println!(
            "| {} | {:.2} | {:.1} | {:.2} | {:.3} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} |",
            if configs[ci] == 0 {
                "plain".to_string()
            } else {
                configs[ci].to_string()
            },
            if configs[ci] == 0 { 1.0 } else { tpp },
            b / (1u64 << 20) as f64,
            b / plain_b.max(1.0),
            s,
            s / plain_s,
            io,
            mlp,
            att,
            (s - io - mlp - att).max(0.0)
        );
    }
    println!(
        "(median of {rounds} round(s); {} measured tokens per run)",
        results[0][0].tokens
    );
}
