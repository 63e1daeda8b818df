//! Sampling flags shared by `run` and `chat`, with the server's field names and ranges
//! (semantics in [`deltafin_engine::sampler`]). Every flag is honoured; a value out of range is
//! an error naming the flag.

use anyhow::{bail, Result};
use deltafin_engine::sampler::SamplingParams;

/// How `run` and `chat` choose tokens (default: greedy, exact).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct SamplingArgs {
    /// Sampling temperature (0 = greedy, exact).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 or -1 = off, as the server's `top_k`).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = parse_top_k)]
    top_k: usize,
    /// Drop tokens whose probability is below this fraction of the most likely token's (0 to 1;
    /// 0 = off), as vLLM's `min_p`.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Subtracted once from the logit of every token generated so far (-2 to 2; 0 = off), as
    /// OpenAI's `presence_penalty`; applies under greedy decoding too.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated so far (-2 to 2; 0 = off),
    /// as OpenAI's `frequency_penalty`; applies under greedy decoding too.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Penalty for tokens of the prompt or output: positive logits divided by it, negative ones
    /// multiplied (> 0; 1 = off), as transformers' and vLLM's `repetition_penalty`.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// Add BIAS (-100 to 100) to token ID's logit before choosing, as OpenAI's `logit_bias`
    /// (also under greedy decoding; +100 forces the token, -100 bans it). Repeatable.
    #[arg(long, value_name = "ID=BIAS", allow_hyphen_values = true, value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Seed for sampling.
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The checked settings for a model of `vocab_size` tokens.
    ///
    /// Errors: a value out of range, or a `--logit-bias` id outside the vocabulary, naming the
    /// flag.
    pub(crate) fn params(&self, vocab_size: usize) -> Result<SamplingParams> {
        if !(0.0..=2.0).contains(&self.temperature) {
            bail!("--temperature {} must be between 0 and 2", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p {} must be greater than 0 and at most 1", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("--min-p {} must be between 0 and 1", self.min_p);
        }
        for (flag, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{flag} {v} must be between -2 and 2");
            }
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r.is_finite()) {
            bail!("--repetition-penalty {r} must be greater than 0 (1 = off)");
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                bail!(
                    "--logit-bias {id}={bias}: token id {id} is outside the vocabulary ({vocab_size} tokens, ids 0 to {})",
                    vocab_size.saturating_sub(1)
                );
            }
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: r,
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
        })
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

/// `--logit-bias ID=BIAS`: a token id and a bias from -100 to 100.
fn parse_logit_bias(v: &str) -> std::result::Result<(u32, f32), String> {
    let (id, bias) = v
        .split_once('=')
        .ok_or_else(|| format!("{v:?} is not ID=BIAS (e.g. 42=-100)"))?;
    let id = id
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("{v:?}: {id:?} is not a token id"))?;
    let bias = bias
        .trim()
        .parse::<f32>()
        .ok()
        .filter(|b| (-100.0..=100.0).contains(b))
        .ok_or_else(|| format!("{v:?}: the bias must be a number from -100 to 100"))?;
    Ok((id, bias))
}
