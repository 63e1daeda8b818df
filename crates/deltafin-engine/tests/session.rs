//! The generation session on the tiny `dsv3_a` fixture: KV-cache reuse gives exactly the ids of
//! a fresh run, sampling is reproducible by seed, stop strings and cancellation end it.

use std::path::Path;
use std::sync::Arc;

use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::models::DeepseekV3;
use deltafin_engine::sampler::SamplingParams;
use deltafin_engine::session::{FinishReason, GenerationOutput, GenerationRequest, Session};
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::ModelDir;
use deltafin_tokenizer::Tokenizer;

fn session(tmp: &Path) -> Session {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
    let out = tmp.join("m");
    convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(&out).unwrap());
    let eos = deltafin_tokenizer::eos_token_ids_union(&out, &tok).unwrap();
    let model: Arc<dyn deltafin_engine::CausalLm> =
        Arc::new(DeepseekV3::load(&ModelDir::open(&out).unwrap(), 1 << 20).unwrap());
    Session::new(model, tok, eos)
}

fn req(prompt: Vec<u32>, n: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_new_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Generates from `[0, 5]` (up to 30 tokens) with a callback that returns false at the
/// `steps`-th delta: the request must end `Cancelled` with exactly `steps` generated ids.
fn cancelled_after(s: &mut Session, steps: usize) -> GenerationOutput {
    let mut n = 0;
    let out = s
        .generate(&req(vec![0, 5], 30), &|| false, |_| {
            n += 1;
            n < steps
        })
        .unwrap();
    assert_eq!(out.finish, FinishReason::Cancelled);
    assert_eq!(out.generated_ids.len(), steps);
    out
}

#[test]
fn reuse_matches_a_fresh_run_and_the_greedy_loop() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = session(tmp.path());
    let never = || false;
    let first: Vec<u32> = vec![0, 10, 20, 30, 40, 50];
    let a = s.generate(&req(first.clone(), 8), &never, |_| true).unwrap();
    assert_eq!(a.reused_tokens, 0);
    // The next prompt extends the previous one (prompt + answer + more).
    let mut second = first.clone();
    second.extend(&a.generated_ids);
    second.extend([60, 70]);
    let reused = s.generate(&req(second.clone(), 12), &never, |_| true).unwrap();
    assert_eq!(reused.reused_tokens, first.len() + a.generated_ids.len() - 1);
    s.reset();
    let fresh = s.generate(&req(second.clone(), 12), &never, |_| true).unwrap();
    assert_eq!(fresh.reused_tokens, 0);
    assert_eq!(reused.generated_ids, fresh.generated_ids);
    // And both equal the plain greedy loop.
    let opts = GenerateOptions {
        max_new_tokens: 12,
        eos_token_ids: vec![],
        ignore_eos: true,
        record_logits: false,
        trace_routes: None,
        ..Default::default()
    };
    let plain = generate(s.model().as_ref(), &second, &opts, |_| true).unwrap();
    assert_eq!(plain.generated_ids, fresh.generated_ids);
    // The prefill statistics: the same distinct experts as the plain loop on the same prompt
    // (bytes differ: the expert cache is warm by then), fewer when a prefix is reused, and the
    // first (cold) request read some.
    assert_eq!(fresh.stats.prefill_unique_experts, plain.stats.prefill_unique_experts);
    assert!(fresh.stats.prefill_unique_experts > 0 && fresh.stats.moe_layers == plain.stats.moe_layers);
    assert!(reused.stats.prefill_unique_experts < fresh.stats.prefill_unique_experts);
    assert!(a.stats.prefill_expert_bytes > 0, "a cold prefill reads experts");
    // A prompt that diverges early keeps only the shared prefix.
    let other = s.generate(&req(vec![0, 10, 99], 2), &never, |_| true).unwrap();
    assert_eq!(other.reused_tokens, 2);
}

#[test]
fn seeds_stops_and_cancellation() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = session(tmp.path());
    let never = || false;
    let sampled = |s: &mut Session, seed| {
        let mut r = req(vec![0, 5, 6, 7], 20);
        r.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(seed),
            ..Default::default()
        };
        s.generate(&r, &never, |_| true).unwrap().generated_ids
    };
    assert_eq!(sampled(&mut s, 3), sampled(&mut s, 3));
    // Deltas concatenate to the text; a stop string cuts it.
    let mut streamed = String::new();
    let full = s
        .generate(&req(vec![0, 5, 6, 7], 30), &never, |d| {
            streamed.push_str(&d.text);
            true
        })
        .unwrap();
    assert_eq!(streamed, full.text);
    let cut = full.text.char_indices().nth(4).map(|(i, _)| i).unwrap();
    let stop: String = full.text[cut..].chars().take(2).collect();
    let at = full.text.find(&stop).unwrap();
    let mut r = req(vec![0, 5, 6, 7], 30);
    r.stop = vec![stop];
    let mut streamed = String::new();
    let stopped = s
        .generate(&r, &never, |d| {
            streamed.push_str(&d.text);
            true
        })
        .unwrap();
    assert_eq!(stopped.finish, FinishReason::StopString(0));
    assert_eq!(stopped.text, full.text[..at]);
    assert_eq!(streamed, stopped.text);
    // The callback returning false cancels after that step.
    cancelled_after(&mut s, 3);
}

/// The adaptive speculation state lives as long as the session: two 20-token requests
/// together reach the first exploratory draft (after 32 plain steps) that neither reaches alone,
/// and each request's statistics count only its own steps.
#[test]
fn speculation_state_carries_across_requests() {
    use deltafin_engine::speculate::SpeculateMode;
    let tmp = tempfile::tempdir().unwrap();
    let mut s = session(tmp.path());
    s.set_speculate(SpeculateMode::SelfDraft);
    let never = || false;
    let a = s.generate(&req(vec![0, 10, 20], 20), &never, |_| true).unwrap();
    assert_eq!(a.stats.speculation.passes, 0, "no exploration within 20 steps");
    let mut next = vec![0, 10, 20];
    next.extend(&a.generated_ids);
    let b = s.generate(&req(next, 20), &never, |_| true).unwrap();
    assert!(
        b.stats.speculation.passes > 0,
        "the second request continues the first's count"
    );
    assert!(b.stats.speculation.plain_steps < 20);
    // Another mode starts afresh.
    s.set_speculate(SpeculateMode::Lookup);
    s.set_speculate(SpeculateMode::SelfDraft);
    let c = s.generate(&req(vec![0, 5], 20), &never, |_| true).unwrap();
    assert_eq!(c.stats.speculation.passes, 0);
}

/// Batched prefill chunks and speculative decoding in the session: greedy output, prefix reuse
/// and stop handling equal the plain session's; the KV cache stays in step with its tokens
/// after speculative passes that overshoot the end of a generation. 40 tokens per request: the
/// adaptive drafter's first try comes after 32 plain steps.
#[test]
fn chunked_prefill_and_speculation_match_the_plain_session() {
    use deltafin_engine::speculate::SpeculateMode;
    let tmp = tempfile::tempdir().unwrap();
    let mut plain = session(tmp.path());
    plain.set_prefill_chunk(1);
    plain.set_speculate(SpeculateMode::Off);
    let never = || false;
    let first: Vec<u32> = vec![0, 10, 20, 30, 40, 50, 10, 20];
    let a = plain.generate(&req(first.clone(), 40), &never, |_| true).unwrap();
    let mut second = first.clone();
    second.extend(&a.generated_ids);
    second.extend([60, 70]);
    let b = plain.generate(&req(second.clone(), 40), &never, |_| true).unwrap();
    for (mode, chunk) in [
        (SpeculateMode::Lookup, 3),
        (SpeculateMode::SelfDraft, 0),
        (SpeculateMode::Auto, 5),
    ] {
        let tmp2 = tempfile::tempdir().unwrap();
        let mut s = session(tmp2.path());
        s.set_prefill_chunk(chunk);
        s.set_speculate(mode);
        let a2 = s.generate(&req(first.clone(), 40), &never, |_| true).unwrap();
        assert_eq!(a2.generated_ids, a.generated_ids, "{mode}: first request");
        // The cache holds exactly the tokens the session says it holds.
        assert_eq!(s.cached_tokens()[..first.len()], first[..]);
        let b2 = s.generate(&req(second.clone(), 40), &never, |_| true).unwrap();
        // Plain decoding leaves the last generated token unprocessed; a verification pass that
        // covered it (speculation decides by measured cost, so timing-dependent) leaves it in the
        // cache too. Either way every cached token is reused.
        let plain_reuse = first.len() + a.generated_ids.len() - 1;
        assert!(
            (plain_reuse..=plain_reuse + 1).contains(&b2.reused_tokens),
            "{mode}: reuse {} (plain {plain_reuse})",
            b2.reused_tokens
        );
        assert_eq!(
            b2.generated_ids, b.generated_ids,
            "{mode}: second request (reused prefix)"
        );
        assert_eq!(b2.text, b.text);
        if mode != SpeculateMode::Lookup {
            let passes = a2.stats.speculation.passes + b2.stats.speculation.passes;
            assert!(passes > 0, "{mode}: no speculative pass ran");
        }
        // A cancellation mid-way through a speculative pass's tokens.
        let c = cancelled_after(&mut s, 4);
        let fresh = plain.generate(&req(vec![0, 5], 4), &never, |_| true).unwrap();
        assert_eq!(c.generated_ids, fresh.generated_ids, "{mode}: cancelled prefix");
    }
}

/// `keep_special_tokens` spells special tokens out in the text (a tool-call parser needs
/// markers such as `<|tool_calls_section_begin|>`); by default they are dropped.
#[test]
fn special_tokens_are_kept_only_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = session(tmp.path());
    let tok = Arc::clone(s.tokenizer());
    let never = || false;
    let is_special =
        |id: u32| tok.decode(&[id], true).unwrap().is_empty() && !tok.decode(&[id], false).unwrap().is_empty();
    let run = |s: &mut Session, seed: u64, keep: bool| {
        let mut r = req(vec![0, 5, 6, 7], 64);
        r.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: Some(seed),
            ..Default::default()
        };
        r.keep_special_tokens = keep;
        s.generate(&r, &never, |_| true).unwrap()
    };
    // A seed whose sample holds a special token (the fixture's random weights pick them).
    let seed = (0..200u64)
        .find(|&seed| run(&mut s, seed, false).generated_ids.iter().any(|&id| is_special(id)))
        .expect("some seed samples a special token");
    let plain = run(&mut s, seed, false);
    let kept = run(&mut s, seed, true);
    assert_eq!(plain.generated_ids, kept.generated_ids);
    assert_eq!(plain.text, tok.decode(&plain.generated_ids, true).unwrap());
    assert_eq!(kept.text, tok.decode(&kept.generated_ids, false).unwrap());
    assert_ne!(plain.text, kept.text);
}

/// A grammar that allows exactly `script`, one token after the other.
#[derive(Debug)]
struct Script(Vec<u32>);

#[derive(Debug)]
struct ScriptState {
    script: Vec<u32>,
    at: usize,
}

impl deltafin_engine::constraint::Grammar for Script {
    fn start(&self) -> Result<Box<dyn deltafin_engine::constraint::GrammarState>, String> {
        Ok(Box::new(ScriptState {
            script: self.0.clone(),
            at: 0,
        }))
    }
}

impl deltafin_engine::constraint::GrammarState for ScriptState {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let next = self.script.get(self.at).copied();
        for (i, l) in logits.iter_mut().enumerate() {
            if Some(i as u32) != next {
                *l = f32::NEG_INFINITY;
            }
        }
        next.map(|_| ()).ok_or_else(|| "past the end".into())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.script.get(self.at) != Some(&token) {
            return Err(format!("{token} is not next"));
        }
        self.at += 1;
        Ok(())
    }
    fn is_finished(&self) -> bool {
        self.at == self.script.len()
    }
}

/// A grammar decides every token, greedy or sampled, with every speculation mode (a repeating
/// script invites the lookup drafter), and the generation ends where it does, before
/// `max_new_tokens`, as an end of sequence.
#[test]
fn a_grammar_decides_the_tokens_and_where_they_end() {
    use deltafin_engine::speculate::SpeculateMode;
    let tmp = tempfile::tempdir().unwrap();
    let mut s = session(tmp.path());
    let never = || false;
    let script: Vec<u32> = [40, 41, 42].iter().cycle().take(12).copied().collect();
    let grammar: Arc<dyn deltafin_engine::constraint::Grammar> = Arc::new(Script(script.clone()));
    for mode in [
        SpeculateMode::Off,
        SpeculateMode::Lookup,
        SpeculateMode::SelfDraft,
        SpeculateMode::Auto,
    ] {
        s.set_speculate(mode);
        for sampling in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 1.0,
                seed: Some(4),
                ..Default::default()
            },
        ] {
            let r = GenerationRequest {
                sampling,
                constraint: Some(Arc::clone(&grammar)),
                ..req(vec![0, 10, 20, 40, 41, 42, 40, 41, 42], 30)
            };
            let out = s.generate(&r, &never, |_| true).unwrap();
            assert_eq!(out.generated_ids, script, "{mode:?}");
            assert_eq!(out.finish, FinishReason::Eos, "{mode:?}");
        }
    }
}
