//! The interface every model family implements, and the routed-expert runtime they share.
//!
//! A family's file (`models/<family>.rs`) holds its weights and forward pass; generation, the
//! server session, traces and benchmarks only see [`CausalLm`] and [`DecodeState`]. The MoE
//! part common to all families (issue the reads of the chosen experts at once, compute each as
//! its record arrives, the shared experts meanwhile, optional next-layer prefetch, the research
//! and measurement controls, timings) is [`RoutedExperts`].

use std::any::Any;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use deltafin_format::model_dir::{Backbone, MatHandle};
use deltafin_format::{ModelConfig, ModelDir};
use deltafin_kernels::{silu, MatRef};

use crate::blocks::mla::MlaForm;
use crate::compute::{on_cpu, swiglu_rows, Cpu};
use crate::experts::{Expert, ExpertStore, StoreOptions};
use crate::moe::{route_softmax, route_softmax_masked, Routing};
use crate::EngineError;

/// Which routed experts each MoE layer chose for the last token: `(layer, routing)`.
pub type LayerRoutes = Vec<(usize, Routing)>;

/// What a multi-token pass ([`CausalLm::forward_batch`]) produced.
#[derive(Debug, Clone, Default)]
pub struct BatchOutput {
    /// Logits `[vocab_size]` of every position of the chunk (`all_logits`), or of its last
    /// position only.
    pub logits: Vec<Vec<f32>>,
    /// The routing of every MoE layer, one entry per position of the chunk.
    pub routes: Vec<LayerRoutes>,
}

/// Per-sequence decode state of a model (KV caches, recurrent states), one position per token.
pub trait DecodeState: Send + Any {
    /// Tokens held.
    fn len(&self) -> usize;

    /// Whether no token is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every position at or after `len` (rollback to a shorter prefix). Returns false
    /// when the state cannot go back that far (a recurrent state without a snapshot there); the
    /// caller then starts from an empty state.
    fn truncate(&mut self, len: usize) -> bool;

    /// Bytes held by the state.
    fn bytes(&self) -> usize;

    /// Accepts every position held: later rollbacks will not go before the current length. A
    /// state whose rollback reaches back a bounded number of positions (Kimi's KDA log) starts
    /// its window afresh here, so a sequence of forwards that is rolled back as a whole (a
    /// self-drafting run) fits in it. Cheap; the default has nothing to do.
    fn commit(&mut self) {}

    /// For the owning model to recover its concrete type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Cumulative time spent in the parts of the forward pass, nanoseconds (for per-step breakdowns:
/// the caller takes differences around a step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Profile {
    /// Attention (and other token mixers) including projections.
    pub attention_ns: u64,
    /// MoE and dense MLP blocks, including the time spent waiting for expert reads.
    pub mlp_ns: u64,
    /// Forward passes completed.
    pub forwards: u64,
}

/// Whose arithmetic a forward pass follows where implementations legitimately differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// The model's reference math: exact f32 dequantized weights, the reference's eps values.
    #[default]
    Reference,
    /// llama.cpp's CPU backend, for comparing against its goldens (`tests/fixtures/kimi_k3`):
    /// the inputs of MXFP4 matmuls are rounded through ggml's `Q8_0` first
    /// ([`deltafin_kernels::q8_0::round_trip`]), and eps values follow llama.cpp where they
    /// differ (Kimi: `rms_norm_eps` for the MLA `q_a`/`kv_a` norms, K3-SPEC §4, §9).
    /// Not meant for serving: it only adds rounding error.
    LlamaCppCpu,
}

/// A loaded causal language model: resident backbone plus routed experts behind a store.
pub trait CausalLm: Send + Sync {
    /// The resolved config this model was loaded from.
    fn config(&self) -> &ModelConfig;

    /// A fresh, empty decode state for one sequence.
    fn new_state(&self) -> Box<dyn DecodeState>;

    /// Runs one token at the next position of `state`; returns the logits `[vocab_size]` and
    /// the routing of every MoE layer.
    ///
    /// Errors: token id outside the vocabulary, a state of another model, expert read or
    /// checksum failures.
    fn forward(&self, state: &mut dyn DecodeState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError>;

    /// Returns `state` to its first `len` tokens (rollback after a rejected draft, or reuse of a
    /// shared prompt prefix). Returns false when it cannot go back that far (a recurrent state
    /// beyond its rollback window); the state is then unchanged and the caller starts over.
    fn rollback(&self, state: &mut dyn DecodeState, len: usize) -> bool {
        state.truncate(len)
    }

    /// Runs `tokens` (a chunk: prompt prefill or speculative verification) at the next
    /// positions of `state`; returns the logits of every position (`all_logits`) or of the last
    /// one, and every position's routing. Equals calling [`CausalLm::forward`] once per token
    /// (same greedy ids, logits within f32 rounding; families say how close).
    ///
    /// The default runs [`CausalLm::forward`] per token; families override it with a batched
    /// pass (expert-major MoE through [`RoutedExperts::run_batch`]).
    ///
    /// Errors: as [`CausalLm::forward`]; on an error `state` may hold part of the chunk (the
    /// caller truncates or resets it).
    fn forward_batch(
        &self,
        state: &mut dyn DecodeState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        token_at_a_time(tokens, all_logits, |t| self.forward(state, t))
    }

    /// Self-drafting pass (speculative decoding): runs `token` at the next position of `state`
    /// like [`CausalLm::forward`], but every MoE layer routes only among the routed experts
    /// already in the expert cache (plus the shared experts), so it reads nothing from storage.
    /// The logits are not the model's; the caller truncates `state` back after drafting.
    /// Returns `None` when the family does not support it (the default).
    ///
    /// Errors: as [`CausalLm::forward`].
    fn forward_draft(&self, state: &mut dyn DecodeState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        let _ = (state, token);
        Ok(None)
    }

    /// Whether [`CausalLm::forward_draft`] is implemented (self-drafting available).
    fn supports_draft(&self) -> bool {
        false
    }

    /// Activation bytes a batched pass holds per token of its chunk (for choosing the prefill
    /// chunk); the default assumes a handful of hidden-sized f32 buffers.
    fn batch_bytes_per_token(&self) -> usize {
        default_batch_bytes_per_token(self.config())
    }

    /// The routed-expert runtime (store, controls, timings).
    fn routed(&self) -> &RoutedExperts;

    /// Mutable access for the load-time controls (compute-only, prefetch).
    fn routed_mut(&mut self) -> &mut RoutedExperts;

    /// Switches the forward pass to `numerics` (see [`Numerics`]).
    ///
    /// Errors: the family does not implement `numerics` (only [`Numerics::Reference`] is
    /// universal; [`Numerics::LlamaCppCpu`] is implemented for kimi_linear / kimi_k3).
    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        reference_numerics_only(self.config(), numerics)
    }

    /// Bytes of the resident backbone.
    fn backbone_bytes(&self) -> usize;

    /// Vocabulary size (logits width).
    fn vocab_size(&self) -> usize {
        self.config().vocab_size()
    }

    /// Context length in tokens.
    fn context_length(&self) -> usize {
        self.config().max_position_embeddings()
    }

    /// The expert store.
    fn store(&self) -> &Arc<ExpertStore> {
        &self.routed().store
    }

    /// Counters of the GPU expert cache when the model computes on a GPU (`None` on the CPU).
    fn gpu_cache_stats(&self) -> Option<crate::gpu_experts::GpuCacheStats> {
        None
    }
}

/// Loads the model in `dir` with the family its manifest names, the backbone resident and the
/// expert store opened with `opts`.
///
/// Errors: a missing or malformed backbone tensor, unreadable files, O_DIRECT refused.
///
/// Every step's logits are checked ([`FiniteLogits`]): a NaN or infinite logit fails the step
/// with [`EngineError::NonFiniteLogits`] instead of being sampled from silently.
pub fn load_model(dir: &ModelDir, opts: StoreOptions) -> Result<Box<dyn CausalLm>, EngineError> {
    let model: Box<dyn CausalLm> = match &dir.manifest.config {
        ModelConfig::DeepseekV3(_) => Box::new(crate::models::DeepseekV3::load_with(dir, opts)?),
        ModelConfig::KimiLinear(_) => Box::new(crate::models::KimiLinear::load_with(dir, opts)?),
        ModelConfig::Qwen3Moe(_) => Box::new(crate::models::Qwen3Moe::load_with(dir, opts)?),
        ModelConfig::Mixtral(_) => Box::new(crate::models::Mixtral::load_with(dir, opts)?),
        ModelConfig::GptOss(_) => Box::new(crate::models::GptOss::load_with(dir, opts)?),
        ModelConfig::Qwen3Next(_) => Box::new(crate::models::Qwen3Next::load_with(dir, opts)?),
    };
    Ok(Box::new(FiniteLogits(model)))
}

/// A model whose steps fail with [`EngineError::NonFiniteLogits`] when a logit is NaN or
/// infinite (one pass over `vocab_size` floats per returned row, next to a forward pass that
/// reads every weight). Draft passes are not checked: their tokens are verified by a checked
/// pass before anything is emitted.
pub struct FiniteLogits(pub Box<dyn CausalLm>);

/// Fails when a row of `logits` (row `i` at position `first + i`) holds a non-finite value.
fn check_finite<'a>(first: usize, logits: impl IntoIterator<Item = &'a Vec<f32>>) -> Result<(), EngineError> {
    for (i, row) in logits.into_iter().enumerate() {
        if row.iter().any(|x| !x.is_finite()) {
            return Err(EngineError::NonFiniteLogits { position: first + i });
        }
    }
    Ok(())
}

impl CausalLm for FiniteLogits {
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }
    fn new_state(&self) -> Box<dyn DecodeState> {
        self.0.new_state()
    }
    fn forward(&self, state: &mut dyn DecodeState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        let position = state.len();
        let (logits, routes) = self.0.forward(state, token)?;
        check_finite(position, [&logits])?;
        Ok((logits, routes))
    }
    fn rollback(&self, state: &mut dyn DecodeState, len: usize) -> bool {
        self.0.rollback(state, len)
    }
    fn forward_batch(
        &self,
        state: &mut dyn DecodeState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        let start = state.len();
        let out = self.0.forward_batch(state, tokens, all_logits)?;
        // Without all_logits the one row is the chunk's last position.
        let first = if all_logits {
            start
        } else {
            (start + tokens.len()).saturating_sub(1)
        };
        check_finite(first, &out.logits)?;
        Ok(out)
    }
    fn forward_draft(&self, state: &mut dyn DecodeState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        self.0.forward_draft(state, token)
    }
    fn supports_draft(&self) -> bool {
        self.0.supports_draft()
    }
    fn batch_bytes_per_token(&self) -> usize {
        self.0.batch_bytes_per_token()
    }
    fn routed(&self) -> &RoutedExperts {
        self.0.routed()
    }
    fn routed_mut(&mut self) -> &mut RoutedExperts {
        self.0.routed_mut()
    }
    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        self.0.set_numerics(numerics)
    }
    fn backbone_bytes(&self) -> usize {
        self.0.backbone_bytes()
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn context_length(&self) -> usize {
        self.0.context_length()
    }
    fn store(&self) -> &Arc<ExpertStore> {
        self.0.store()
    }
    fn gpu_cache_stats(&self) -> Option<crate::gpu_experts::GpuCacheStats> {
        self.0.gpu_cache_stats()
    }
}

/// Downcasts a decode state to the concrete type a model expects.
///
/// Errors: the state was made by another model.
pub fn state_as<T: 'static>(state: &mut dyn DecodeState) -> Result<&mut T, EngineError> {
    state
        .as_any_mut()
        .downcast_mut::<T>()
        .ok_or_else(|| EngineError::Invalid("decode state belongs to another model".into()))
}

/// What a family model says about itself; [`CausalLm`] follows for every such model from the one
/// generic implementation below (issue #15, part 1: the per-family copies of the state
/// downcasts, the one-token/chunk dispatch and the accessors are written once here).
///
/// `State` is the family's decode state (KV cache, recurrent states). A family with a one-token
/// decode path and a batched chunk path implements [`FamilyModel::step`] and
/// [`FamilyModel::chunk`]: one token always goes through `step` (the decode path, which also
/// predicts and prefetches the next layer's experts), two or more through `chunk`, none returns
/// an empty [`BatchOutput`].
pub trait FamilyModel: Send + Sync {
    /// The family's decode state.
    type State: DecodeState + 'static;

    /// As [`CausalLm::config`].
    fn config(&self) -> &ModelConfig;

    /// A fresh, empty decode state for one sequence.
    fn new_state(&self) -> Self::State;

    /// One token at the next position of `state`: logits `[vocab_size]` and every MoE layer's
    /// routing. Errors: as [`CausalLm::forward`].
    fn step(&self, state: &mut Self::State, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError>;

    /// Two or more tokens at the next positions of `state`, as [`CausalLm::forward_batch`].
    fn chunk(&self, state: &mut Self::State, tokens: &[u32], all_logits: bool) -> Result<BatchOutput, EngineError>;

    /// The self-drafting pass ([`CausalLm::forward_draft`]); `None` (the default) when the
    /// family has none.
    fn draft_step(&self, state: &mut Self::State, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        let _ = (state, token);
        Ok(None)
    }

    /// Whether [`FamilyModel::draft_step`] is implemented.
    fn supports_draft(&self) -> bool {
        false
    }

    /// As [`CausalLm::rollback`]; the default truncates the state.
    fn rollback(&self, state: &mut Self::State, len: usize) -> bool {
        state.truncate(len)
    }

    /// As [`CausalLm::batch_bytes_per_token`].
    fn batch_bytes_per_token(&self) -> usize {
        default_batch_bytes_per_token(self.config())
    }

    /// As [`CausalLm::set_numerics`].
    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        reference_numerics_only(self.config(), numerics)
    }

    /// As [`CausalLm::routed`].
    fn routed(&self) -> &RoutedExperts;

    /// As [`CausalLm::routed_mut`].
    fn routed_mut(&mut self) -> &mut RoutedExperts;

    /// As [`CausalLm::backbone_bytes`].
    fn backbone_bytes(&self) -> usize;

    /// As [`CausalLm::gpu_cache_stats`].
    fn gpu_cache_stats(&self) -> Option<crate::gpu_experts::GpuCacheStats> {
        None
    }
}

/// The [`FamilyModel`] items every CPU family model answers alike, from its fields `config:
/// ModelConfig`, `backbone: Backbone` and `routed: RoutedExperts`: [`FamilyModel::config`],
/// [`FamilyModel::routed`], [`FamilyModel::routed_mut`] and [`FamilyModel::backbone_bytes`]
/// (the backbone's bytes), written once. A macro because each family is its own struct.
macro_rules! resident_items {
    () => {
        fn config(&self) -> &deltafin_format::ModelConfig {
            &self.config
        }

        fn routed(&self) -> &$crate::model::RoutedExperts {
            &self.routed
        }

        fn routed_mut(&mut self) -> &mut $crate::model::RoutedExperts {
            &mut self.routed
        }

        fn backbone_bytes(&self) -> usize {
            self.backbone.bytes()
        }
    };
}
pub(crate) use resident_items;

impl<M: FamilyModel> CausalLm for M {
    fn config(&self) -> &ModelConfig {
        FamilyModel::config(self)
    }

    fn new_state(&self) -> Box<dyn DecodeState> {
        Box::new(FamilyModel::new_state(self))
    }

    fn forward(&self, state: &mut dyn DecodeState, token: u32) -> Result<(Vec<f32>, LayerRoutes), EngineError> {
        self.step(state_as::<M::State>(state)?, token)
    }

    fn rollback(&self, state: &mut dyn DecodeState, len: usize) -> bool {
        state_as::<M::State>(state).is_ok_and(|s| FamilyModel::rollback(self, s, len))
    }

    fn forward_batch(
        &self,
        state: &mut dyn DecodeState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<BatchOutput, EngineError> {
        let s = state_as::<M::State>(state)?;
        match tokens {
            [] => Ok(BatchOutput::default()),
            [t] => {
                let (logits, routes) = self.step(s, *t)?;
                Ok(BatchOutput {
                    logits: vec![logits],
                    routes: vec![routes],
                })
            }
            _ => self.chunk(s, tokens, all_logits),
        }
    }

    fn forward_draft(&self, state: &mut dyn DecodeState, token: u32) -> Result<Option<Vec<f32>>, EngineError> {
        self.draft_step(state_as::<M::State>(state)?, token)
    }

    fn supports_draft(&self) -> bool {
        FamilyModel::supports_draft(self)
    }

    fn batch_bytes_per_token(&self) -> usize {
        FamilyModel::batch_bytes_per_token(self)
    }

    fn routed(&self) -> &RoutedExperts {
        FamilyModel::routed(self)
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        FamilyModel::routed_mut(self)
    }

    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        FamilyModel::set_numerics(self, numerics)
    }

    fn backbone_bytes(&self) -> usize {
        FamilyModel::backbone_bytes(self)
    }

    fn gpu_cache_stats(&self) -> Option<crate::gpu_experts::GpuCacheStats> {
        FamilyModel::gpu_cache_stats(self)
    }
}

/// `tokens` one at a time through `step` (the default [`CausalLm::forward_batch`]): the logits
/// of every position (`all_logits`) or of the last, every position's routing.
///
/// Errors: the first `step` error (`state` then holds the tokens before it).
pub fn token_at_a_time(
    tokens: &[u32],
    all_logits: bool,
    mut step: impl FnMut(u32) -> Result<(Vec<f32>, LayerRoutes), EngineError>,
) -> Result<BatchOutput, EngineError> {
    let mut out = BatchOutput::default();
    for (i, &t) in tokens.iter().enumerate() {
        let (logits, routes) = step(t)?;
        if all_logits || i + 1 == tokens.len() {
            out.logits.push(logits);
        }
        out.routes.push(routes);
    }
    Ok(out)
}

/// The default activation bytes a batched pass holds per token: a handful of hidden-sized f32
/// buffers.
fn default_batch_bytes_per_token(config: &ModelConfig) -> usize {
    16 * config.hidden_size() * 4
}

/// The default [`CausalLm::set_numerics`]: only [`Numerics::Reference`] is accepted.
///
/// Errors: any other numerics, naming the model type.
fn reference_numerics_only(config: &ModelConfig, numerics: Numerics) -> Result<(), EngineError> {
    match numerics {
        Numerics::Reference => Ok(()),
        other => Err(EngineError::Invalid(format!(
            "{other:?} numerics are not implemented for model_type {}",
            config.model_type()
        ))),
    }
}

/// A next-layer prediction: (MoE layer, predicted experts).
pub type Prediction = (usize, Vec<usize>);

/// Routed experts of one model: the store plus the controls and timings every family shares.
pub struct RoutedExperts {
    pub store: Arc<ExpertStore>,
    /// The model's top-k.
    default_top_k: usize,
    /// Most experts the router can select, and why (for the `--experts-per-token` error).
    max_top_k: (usize, String),
    /// Routed experts per token actually used (the config's top-k unless overridden).
    experts_per_token: AtomicUsize,
    /// Whether to predict the next MoE layer's experts and prefetch them.
    prefetch: bool,
    /// Compute-only measurement mode: one resident stand-in record per MoE layer (None for dense
    /// layers); no expert reads. Output is not the model's.
    compute_only: Option<Vec<Option<Arc<Expert>>>>,
    moe_layers: Vec<bool>,
    attention_ns: AtomicU64,
    mlp_ns: AtomicU64,
    forwards: AtomicU64,
    /// Arithmetic of batched passes.
    batch_form: BatchForm,
    /// Measurement (`run --trace-predictions`): every next-layer prediction `(layer, experts)`
    /// since the last [`RoutedExperts::take_predictions`], in the order made; None when off.
    prediction_log: Option<Mutex<Vec<Prediction>>>,
}

/// The arithmetic of batched passes (prompt chunks, speculative verification). Every form
/// computes the same model; they differ in f32 rounding only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BatchForm {
    /// Every position bit-identical to token-at-a-time decoding (MLA weight-absorbed, as the
    /// one-token path computes it). The default.
    #[default]
    Exact,
    /// Prompt chunks of at least [`crate::blocks::mla::DECOMPRESSED_MIN_TOKENS`] tokens
    /// compute MLA in the decompressed form where it needs fewer multiply-adds
    /// ([`MlaForm::Auto`]): logits within f32 rounding of token at a time, not bit for bit, so a
    /// near-tied router choice can fall the other way and greedy ids can differ. Verification
    /// passes stay exact, so speculation still never changes greedy output. Opt-in (research
    /// option `--batch-form fast`).
    Fast,
    /// The decompressed MLA form for every batched pass, whatever its size (tests of that path
    /// on small models).
    FastAlways,
}

impl FromStr for BatchForm {
    type Err = String;

    /// `exact` (or empty), `fast` or `fast-always`, as the research option `--batch-form` takes.
    ///
    /// Errors: any other value, named.
    fn from_str(s: &str) -> Result<BatchForm, String> {
        match s {
            "" | "exact" => Ok(BatchForm::Exact),
            "fast" => Ok(BatchForm::Fast),
            "fast-always" => Ok(BatchForm::FastAlways),
            other => Err(format!(
                "unknown batch form {other:?} (expected exact, fast or fast-always)"
            )),
        }
    }
}

impl BatchForm {
    /// The name [`FromStr`] reads (`exact`, `fast`, `fast-always`).
    pub fn name(self) -> &'static str {
        match self {
            BatchForm::Exact => "exact",
            BatchForm::Fast => "fast",
            BatchForm::FastAlways => "fast-always",
        }
    }

    /// The MLA form of a batched pass.
    pub fn mla(self) -> MlaForm {
        match self {
            BatchForm::Exact => MlaForm::Absorbed,
            BatchForm::Fast => MlaForm::Auto,
            BatchForm::FastAlways => MlaForm::Decompressed,
        }
    }
}

impl RoutedExperts {
    /// Opens the expert store of `dir` with `opts` (prefetch of predicted experts on when
    /// `opts.prefetch` is).
    ///
    /// Errors: the store cannot open `experts.pack` (missing file, O_DIRECT refused).
    pub fn open(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        let c = &dir.manifest.config;
        let prefetch = opts.prefetch;
        let store = Arc::new(ExpertStore::open(dir, opts)?);
        Ok(RoutedExperts {
            store,
            default_top_k: c.num_experts_per_tok(),
            max_top_k: c.max_experts_per_tok(),
            experts_per_token: AtomicUsize::new(c.num_experts_per_tok()),
            prefetch,
            compute_only: None,
            moe_layers: (0..c.num_hidden_layers()).map(|l| c.is_moe_layer(l)).collect(),
            attention_ns: AtomicU64::new(0),
            mlp_ns: AtomicU64::new(0),
            forwards: AtomicU64::new(0),
            batch_form: BatchForm::Exact,
            prediction_log: None,
        })
    }

    /// Makes every forward pass that predicts the next MoE layer's experts (one-token passes)
    /// log its predictions for [`RoutedExperts::take_predictions`], whether or not prefetch
    /// reads them. Output is unchanged.
    pub fn log_predictions(&mut self) {
        self.prediction_log = Some(Mutex::new(Vec::new()));
    }

    /// The predictions `(next MoE layer, experts)` logged since the last call, in the order
    /// made (empty unless [`RoutedExperts::log_predictions`] was called).
    pub fn take_predictions(&self) -> Vec<Prediction> {
        self.prediction_log.as_ref().map_or_else(Vec::new, |m| {
            std::mem::take(&mut *m.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
        })
    }

    fn log_prediction(&self, layer: usize, experts: &[usize]) {
        if let Some(m) = &self.prediction_log {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((layer, experts.to_vec()));
        }
    }

    /// The arithmetic of batched passes ([`BatchForm`]).
    pub fn batch_form(&self) -> BatchForm {
        self.batch_form
    }

    /// Sets the arithmetic of batched passes ([`BatchForm::Exact`] until set).
    pub fn set_batch_form(&mut self, form: BatchForm) {
        self.batch_form = form;
    }

    /// Routed experts used per token (the config's top-k unless overridden).
    pub fn experts_per_token(&self) -> usize {
        self.experts_per_token.load(Ordering::Relaxed)
    }

    /// Whether routing differs from the model's own (`--experts-per-token` set to another value):
    /// output is then not equivalent to the model.
    pub fn non_default_routing(&self) -> bool {
        self.experts_per_token() != self.default_top_k
    }

    /// Research control (`--experts-per-token K`): route every token to `k` experts instead of
    /// the config's top-k. Output is then NOT the model's; callers must label it.
    ///
    /// Errors: `k` is 0 or more than the router can select.
    pub fn set_experts_per_token(&self, k: usize) -> Result<(), EngineError> {
        let (max, why) = &self.max_top_k;
        if k == 0 || k > *max {
            return Err(EngineError::Invalid(format!(
                "--experts-per-token {k}: must be between 1 and {max} ({why})"
            )));
        }
        self.experts_per_token.store(k, Ordering::Relaxed);
        Ok(())
    }

    /// MEASUREMENT ONLY (`--compute-only`): reads one record per MoE layer now and computes every
    /// chosen expert with it, so a run measures compute with no expert I/O. Output is not the
    /// model's.
    pub fn set_compute_only(&mut self) -> Result<(), EngineError> {
        let mut v = Vec::with_capacity(self.moe_layers.len());
        for (l, &moe) in self.moe_layers.iter().enumerate() {
            v.push(if moe {
                Some(self.store.get(l, &[0])?.remove(0))
            } else {
                None
            });
        }
        self.compute_only = Some(v);
        Ok(())
    }

    /// Whether compute-only measurement mode is on.
    pub fn compute_only(&self) -> bool {
        self.compute_only.is_some()
    }

    /// Turns next-layer expert prediction and prefetch on or off.
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
    }

    /// Whether next-layer prediction is wanted: prefetch on, or predictions logged (families
    /// then call [`Self::prefetch`]).
    pub fn prefetch_enabled(&self) -> bool {
        self.prefetch || self.prediction_log.is_some()
    }

    /// Starts speculative reads of `experts` of MoE layer `layer` (a prediction); the store
    /// runs them only while no demand read is pending.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) {
        if self.compute_only.is_none() {
            self.log_prediction(layer, experts);
            if self.prefetch {
                self.store.prefetch(layer, experts);
            }
        }
    }

    /// Cumulative forward-pass timings.
    pub fn profile(&self) -> Profile {
        Profile {
            attention_ns: self.attention_ns.load(Ordering::Relaxed),
            mlp_ns: self.mlp_ns.load(Ordering::Relaxed),
            forwards: self.forwards.load(Ordering::Relaxed),
        }
    }

    /// Runs `f` and counts its time as attention.
    pub fn time_attention<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.attention_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Runs `f` and counts its time as MLP / MoE.
    pub fn time_mlp<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.mlp_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Counts one completed forward pass.
    pub fn count_forward(&self) {
        self.forwards.fetch_add(1, Ordering::Relaxed);
    }

    /// The routed part of a MoE block for one token of layer `layer`: reads every chosen
    /// expert not in the cache at once (`routing.experts`), computes `expert(record)` for each
    /// on the compute pool as its record arrives, and `shared()` meanwhile; returns
    /// `(Σ_i routing.weights[i] · expert_i, shared)`, the sum in the order of
    /// `routing.experts` (whatever the arrival order), so the result does not depend on timing.
    /// `predict_next` runs after the reads are issued, and only with prefetch on or predictions
    /// logged: it returns
    /// the next MoE layer and its predicted experts.
    ///
    /// Output widths: every expert output and the shared output have the same width `out_dim`.
    ///
    /// Errors: expert read or checksum failures, a failed prediction.
    pub fn run<E, S, P>(
        &self,
        layer: usize,
        routing: &Routing,
        out_dim: usize,
        expert: E,
        shared: Option<S>,
        predict_next: P,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>), EngineError>
    where
        E: Fn(&Expert) -> Vec<f32> + Sync,
        S: FnOnce() -> Vec<f32> + Send,
        P: FnOnce() -> Result<Option<(usize, Vec<usize>)>, EngineError>,
    {
        let fetch = match &self.compute_only {
            Some(_) => None,
            None => Some(self.store.fetch(layer, &routing.experts)?),
        };
        if self.prefetch_enabled() && self.compute_only.is_none() {
            if let Some((next, predicted)) = predict_next()? {
                self.prefetch(next, &predicted);
            }
        }
        let outs: Vec<OnceLock<Result<Vec<f32>, String>>> = routing.experts.iter().map(|_| OnceLock::new()).collect();
        let shared_out: OnceLock<Result<Vec<f32>, String>> = OnceLock::new();
        let expert = &expert;
        rayon::in_place_scope(|s| -> Result<(), EngineError> {
            if let Some(f) = shared {
                let slot = &shared_out;
                s.spawn(move |_| {
                    let _ = slot.set(caught(f));
                });
            }
            match fetch {
                Some(fetch) => {
                    for r in fetch {
                        let (i, e) = r?;
                        let slot = &outs[i];
                        s.spawn(move |_| {
                            let _ = slot.set(caught(|| expert(&e)));
                        });
                    }
                }
                None => {
                    // Compute-only measurement: every chosen expert is computed with this
                    // layer's resident stand-in record (same shape and cost, different values).
                    let stand_in = self
                        .compute_only
                        .as_ref()
                        .and_then(|v| v[layer].clone())
                        .ok_or_else(|| {
                            EngineError::Invalid(format!("layer {layer}: compute-only mode without a resident record"))
                        })?;
                    for slot in &outs {
                        let e = stand_in.clone();
                        s.spawn(move |_| {
                            let _ = slot.set(caught(|| expert(&e)));
                        });
                    }
                }
            }
            Ok(())
        })?;
        let mut out = vec![0f32; out_dim];
        for (o, w) in outs.iter().zip(&routing.weights) {
            let o = o
                .get()
                .ok_or_else(|| EngineError::Invalid(format!("layer {layer}: an expert output is missing")))?
                .as_ref()
                .map_err(|m| panicked(layer, m))?;
            deltafin_kernels::axpy(*w, o, &mut out);
        }
        let shared_out = shared_out.into_inner().transpose().map_err(|m| panicked(layer, &m))?;
        Ok((out, shared_out))
    }
    /// The routed part of a MoE block for a chunk of `n = routings.len()` tokens of layer
    /// `layer`, expert-major: every expert chosen by any token of the chunk is read ONCE
    /// (ascending expert id, which is file order) and applied to all the tokens that chose it
    /// by `expert(record, tokens)` (`tokens`: ascending chunk positions; returns
    /// `[tokens.len(), out_dim]`, a matrix-matrix product), on the compute pool as each record
    /// arrives; `shared()` runs meanwhile. Returns `(out: [n, out_dim], shared)` with
    /// `out[t] = Σ_i routings[t].weights[i] · expert_i(t)` summed in the order of
    /// `routings[t].experts` exactly as [`Self::run`] sums it (the experts are combined in
    /// ascending id, which is router order), so each token's result equals a one-token
    /// [`Self::run`] whenever `expert` equals the one-token computation row by row.
    ///
    /// Memory: at most `window = top_k + readers` records are held at once (being read or
    /// computed), whatever the size of the chunk's union of experts: the next record is asked
    /// for only when one is done. Held records are never evicted (store rule), and records the
    /// cache cannot make room for are simply not cached, so a union larger than the cache
    /// budget neither deadlocks nor grows memory beyond `budget + window × record` plus the
    /// store's read buffers.
    ///
    /// Errors: expert read or checksum failures.
    pub fn run_batch<E, S>(
        &self,
        layer: usize,
        routings: &[Routing],
        out_dim: usize,
        expert: E,
        shared: Option<S>,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>), EngineError>
    where
        E: Fn(&Expert, &[usize]) -> Vec<f32> + Sync,
        S: FnOnce() -> Vec<f32> + Send,
    {
        let n = routings.len();
        let mut union: Vec<usize> = routings.iter().flat_map(|r| r.experts.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        // members[u]: (token, weight) of every token that chose union[u], tokens ascending.
        let mut members: Vec<Vec<(usize, f32)>> = vec![Vec::new(); union.len()];
        for (t, r) in routings.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                if let Ok(u) = union.binary_search(&e) {
                    members[u].push((t, w));
                }
            }
        }
        let tokens: Vec<Vec<usize>> = members.iter().map(|m| m.iter().map(|&(t, _)| t).collect()).collect();
        let window = (self.default_top_k + self.store.readers()).max(1);
        let stand_in = match &self.compute_only {
            Some(v) => Some(v[layer].clone().ok_or_else(|| {
                EngineError::Invalid(format!("layer {layer}: compute-only mode without a resident record"))
            })?),
            None => None,
        };
        let mut acc = vec![0f32; n * out_dim];
        let shared_out: OnceLock<Result<Vec<f32>, String>> = OnceLock::new();
        // Each task sends its result, or its panic's message: a task that unwound without
        // sending would leave the loop below waiting forever.
        let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<Vec<f32>, String>)>();
        let expert = &expert;
        let tokens = &tokens;
        rayon::in_place_scope(|s| -> Result<(), EngineError> {
            if let Some(f) = shared {
                let slot = &shared_out;
                s.spawn(move |_| {
                    let _ = slot.set(caught(f));
                });
            }
            let mut fetches: std::collections::VecDeque<(usize, crate::experts::Fetch<'_>)> = Default::default();
            let mut outs: Vec<Option<Vec<f32>>> = vec![None; union.len()];
            let (mut next_issue, mut next_combine, mut computing) = (0, 0, 0);
            let mut combine = |u: usize, o: Vec<f32>, outs: &mut Vec<Option<Vec<f32>>>, next: &mut usize| {
                outs[u] = Some(o);
                while *next < outs.len() {
                    let Some(o) = outs[*next].take() else { break };
                    for (j, &(t, w)) in members[*next].iter().enumerate() {
                        deltafin_kernels::axpy(
                            w,
                            &o[j * out_dim..(j + 1) * out_dim],
                            &mut acc[t * out_dim..(t + 1) * out_dim],
                        );
                    }
                    *next += 1;
                }
            };
            loop {
                // Ask for more records while fewer than `window` are held.
                while next_issue < union.len() && fetches.len() + computing < window {
                    if stand_in.is_none() {
                        fetches.push_back((next_issue, self.store.fetch(layer, &[union[next_issue]])?));
                    } else {
                        let e = stand_in
                            .clone()
                            .ok_or_else(|| EngineError::Invalid("no stand-in".into()))?;
                        let (tx, u) = (tx.clone(), next_issue);
                        computing += 1;
                        s.spawn(move |_| {
                            let o = caught(|| expert(&e, &tokens[u]));
                            let _ = tx.send((u, o));
                        });
                    }
                    next_issue += 1;
                }
                if let Some((u, mut f)) = fetches.pop_front() {
                    let (_, e) = f
                        .next()
                        .ok_or_else(|| EngineError::Invalid(format!("layer {layer}: expert fetch ended early")))??;
                    drop(f);
                    let tx = tx.clone();
                    computing += 1;
                    s.spawn(move |_| {
                        let o = caught(|| expert(&e, &tokens[u]));
                        drop(e); // the record is released before the slot is counted free
                        let _ = tx.send((u, o));
                    });
                    while let Ok((u, o)) = rx.try_recv() {
                        computing -= 1;
                        combine(u, o.map_err(|m| panicked(layer, &m))?, &mut outs, &mut next_combine);
                    }
                } else if computing > 0 {
                    let (u, o) = wait_for(&rx)
                        .map_err(|_| EngineError::Invalid(format!("layer {layer}: an expert computation failed")))?;
                    computing -= 1;
                    combine(u, o.map_err(|m| panicked(layer, &m))?, &mut outs, &mut next_combine);
                } else {
                    break;
                }
            }
            if next_combine != union.len() {
                return Err(EngineError::Invalid(format!(
                    "layer {layer}: an expert output is missing"
                )));
            }
            Ok(())
        })?;
        let shared_out = shared_out.into_inner().transpose().map_err(|m| panicked(layer, &m))?;
        Ok((acc, shared_out))
    }

    /// The routed part of a self-drafting MoE block for one token ([`CausalLm::forward_draft`]):
    /// `route(allowed)` routes with `allowed[e]` true exactly for the experts of `layer` resident
    /// in the cache now (`allowed`: `[n_experts]`), and the chosen experts are computed with
    /// those records by `expert` ([`Self::run_with`]): no reads, no change to the cache. Returns
    /// `(routed out: [out_dim], shared out, routing)`; a routing that names an expert outside
    /// `allowed` contributes nothing for it.
    pub fn run_draft<R, E, S>(
        &self,
        layer: usize,
        n_experts: usize,
        route: R,
        out_dim: usize,
        expert: E,
        shared: Option<S>,
    ) -> (Vec<f32>, Option<Vec<f32>>, Routing)
    where
        R: FnOnce(&[bool]) -> Routing,
        E: Fn(&Expert) -> Vec<f32> + Sync,
        S: FnOnce() -> Vec<f32> + Send,
    {
        let resident = self.store.resident(layer);
        let mut allowed = vec![false; n_experts];
        for (e, _) in &resident {
            if let Some(a) = allowed.get_mut(*e) {
                *a = true;
            }
        }
        let mut routing = route(&allowed);
        // Keep (expert, weight) pairs aligned with the records actually held.
        let mut records = Vec::with_capacity(routing.experts.len());
        let mut weights = Vec::with_capacity(routing.experts.len());
        let mut experts = Vec::with_capacity(routing.experts.len());
        for (&e, &w) in routing.experts.iter().zip(&routing.weights) {
            if let Some((_, x)) = resident.iter().find(|(r, _)| *r == e) {
                records.push(x.clone());
                weights.push(w);
                experts.push(e);
            }
        }
        drop(resident);
        (routing.experts, routing.weights) = (experts, weights);
        let (out, shared_out) = self.run_with(&routing, &records, out_dim, expert, shared);
        (out, shared_out, routing)
    }

    /// The routed part of a MoE block for one token, computed with records the caller already
    /// holds (`records[i]` for `routing.experts[i]`; self-drafting with resident experts): no
    /// reads. Sums in router order like [`Self::run`]; `shared()` runs meanwhile.
    pub fn run_with<E, S>(
        &self,
        routing: &Routing,
        records: &[Arc<Expert>],
        out_dim: usize,
        expert: E,
        shared: Option<S>,
    ) -> (Vec<f32>, Option<Vec<f32>>)
    where
        E: Fn(&Expert) -> Vec<f32> + Sync,
        S: FnOnce() -> Vec<f32> + Send,
    {
        let outs: Vec<OnceLock<Vec<f32>>> = records.iter().map(|_| OnceLock::new()).collect();
        let shared_out: OnceLock<Vec<f32>> = OnceLock::new();
        let expert = &expert;
        rayon::in_place_scope(|s| {
            if let Some(f) = shared {
                let slot = &shared_out;
                s.spawn(move |_| {
                    let _ = slot.set(f());
                });
            }
            for (slot, e) in outs.iter().zip(records) {
                s.spawn(move |_| {
                    let _ = slot.set(expert(e));
                });
            }
        });
        let mut out = vec![0f32; out_dim];
        for (o, w) in outs.iter().zip(&routing.weights) {
            if let Some(o) = o.get() {
                deltafin_kernels::axpy(*w, o, &mut out);
            }
        }
        (out, shared_out.into_inner())
    }
}

/// Runs `f` on a compute task, turning a panic into its message: a task must not unwind into
/// the pool, where its waiter would block or the panic would resurface far from its cause.
/// (The panic hook has already reported the panic by the time this returns.)
fn caught<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| panic_message(p.as_ref()))
}

/// The message of a caught panic payload (`&str` or `String`, as `panic!` makes them; any
/// other payload is "a panic without a message"). Used by the compute pool here, the server's
/// worker thread and the binary's panic hook.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// The error of a compute task of MoE layer `layer` that panicked with `message`.
fn panicked(layer: usize, message: &str) -> EngineError {
    EngineError::Invalid(format!("layer {layer}: an expert computation panicked: {message}"))
}

/// Waits for the next result of a task spawned on the rayon pool. On a thread of the pool itself
/// it keeps running pool tasks meanwhile (a blocking receive there could wait for a task queued
/// behind itself); elsewhere it blocks.
fn wait_for<T>(rx: &std::sync::mpsc::Receiver<T>) -> Result<T, std::sync::mpsc::RecvError> {
    if rayon::current_thread_index().is_none() {
        return rx.recv();
    }
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err(std::sync::mpsc::RecvError),
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// [`swiglu`] for `n` tokens at once (matrix-matrix products): x `[n, cols of gate]` →
/// `[n, rows of down]`, each row bit-identical to [`swiglu`] of that row (the kernels'
/// `matmul` equals `n` matvecs bit for bit).
pub fn swiglu_batch(gate: MatRef<'_>, up: MatRef<'_>, down: MatRef<'_>, x: &[f32], n: usize) -> Vec<f32> {
    on_cpu(swiglu_rows(&Cpu, [&gate, &up, &down], x, n))
}

/// A MoE block with a softmax top-k router and SwiGLU routed experts and no shared expert
/// (Mixtral, Qwen3-MoE): `y = Σ_i w_i · expert_i(xn)` over the experts [`route_softmax`] picks
/// from `router · xn`, with top-k = [`RoutedExperts::experts_per_token`]. `next_router` is the
/// next MoE layer and its router, used with prefetch on to predict that layer's experts from
/// this hidden state. `draft`: the top-k is taken among the experts resident in the cache and
/// computed with those records, no reads ([`RoutedExperts::run_draft`], self-drafting).
/// xn: `[hidden]` → `[hidden]`; `logits` and `probs` are reused buffers.
///
/// Source: transformers `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`. [SOFTMAX_MOE]
///
/// Errors: expert read or checksum failures.
#[allow(clippy::too_many_arguments)]
pub fn softmax_moe(
    routed: &RoutedExperts,
    layer: usize,
    router: MatRef<'_>,
    next_router: Option<(usize, MatRef<'_>)>,
    norm_topk_prob: bool,
    xn: &[f32],
    logits: &mut Vec<f32>,
    probs: &mut Vec<f32>,
    draft: bool,
) -> Result<(Vec<f32>, Routing), EngineError> {
    let k = routed.experts_per_token();
    logits.resize(router.rows, 0.0);
    router.matvec(xn, logits);
    if draft {
        let (out, _, routing) = routed.run_draft(
            layer,
            router.rows,
            |allowed| route_softmax_masked(logits, k, norm_topk_prob, probs, Some(allowed)),
            xn.len(),
            |e| swiglu(e.matrix(0), e.matrix(1), e.matrix(2), xn),
            None::<fn() -> Vec<f32>>,
        );
        return Ok((out, routing));
    }
    let routing = route_softmax(logits, k, norm_topk_prob, probs);
    let predict = || -> Result<Option<(usize, Vec<usize>)>, EngineError> {
        let Some((next, r)) = next_router else {
            return Ok(None);
        };
        let mut l = vec![0f32; r.rows];
        r.matvec(xn, &mut l);
        let mut p = Vec::new();
        Ok(Some((next, route_softmax(&l, k, norm_topk_prob, &mut p).experts)))
    };
    let (out, _) = routed.run(
        layer,
        &routing,
        xn.len(),
        |e| swiglu(e.matrix(0), e.matrix(1), e.matrix(2), xn),
        None::<fn() -> Vec<f32>>,
        predict,
    )?;
    Ok((out, routing))
}

/// [`softmax_moe`] for a chunk of `nt` tokens, expert-major ([`RoutedExperts::run_batch`]):
/// the router as one matrix-matrix product, every expert chosen in the chunk read once and
/// applied to its tokens with [`swiglu_batch`]. xn: `[nt, hidden]` → `([nt, hidden]`, one
/// routing per token). Each token's output and routing equal [`softmax_moe`]'s bit for bit
/// (`matmul` rows equal `matvec`, the experts are summed in the same order); no next-layer
/// prediction (the chunk's union is read in file order instead).
///
/// Source: transformers `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`. [SOFTMAX_MOE]
///
/// Errors: expert read or checksum failures.
pub fn softmax_moe_batch(
    routed: &RoutedExperts,
    layer: usize,
    router: MatRef<'_>,
    norm_topk_prob: bool,
    xn: &[f32],
    nt: usize,
) -> Result<(Vec<f32>, Vec<Routing>), EngineError> {
    let k = routed.experts_per_token();
    let h = xn.len() / nt.max(1);
    let mut logits = vec![0f32; nt * router.rows];
    router.matmul(xn, nt, &mut logits);
    let mut probs = Vec::new();
    let routings: Vec<Routing> = logits
        .chunks_exact(router.rows)
        .map(|lg| route_softmax(lg, k, norm_topk_prob, &mut probs))
        .collect();
    let (out, _) = routed.run_batch(
        layer,
        &routings,
        h,
        |e, tokens| {
            let xs = gather_rows(xn, h, tokens);
            swiglu_batch(e.matrix(0), e.matrix(1), e.matrix(2), &xs, tokens.len())
        },
        None::<fn() -> Vec<f32>>,
    )?;
    Ok((out, routings))
}

/// Rows `tokens` of `x: [n, width]`, gathered into `[tokens.len(), width]` (the inputs of one
/// expert in an expert-major pass).
pub fn gather_rows(x: &[f32], width: usize, tokens: &[usize]) -> Vec<f32> {
    let mut xs = Vec::with_capacity(tokens.len() * width);
    for &t in tokens {
        xs.extend_from_slice(&x[t * width..(t + 1) * width]);
    }
    xs
}

/// `y += x` element by element (over the shorter of the two): a residual connection, a shared
/// expert's output or a bias added in place.
pub fn add_into(y: &mut [f32], x: &[f32]) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += b;
    }
}

/// [`swiglu`] into caller buffers (no allocation once they have grown): `gate_buf`, `up_buf`
/// become `[rows of gate]`, `out: [rows of down]`.
pub fn swiglu_into(
    gate: MatRef<'_>,
    up: MatRef<'_>,
    down: MatRef<'_>,
    x: &[f32],
    gate_buf: &mut Vec<f32>,
    up_buf: &mut Vec<f32>,
    out: &mut [f32],
) {
    gate_buf.resize(gate.rows, 0.0);
    up_buf.resize(up.rows, 0.0);
    gate.matvec(x, gate_buf);
    up.matvec(x, up_buf);
    for (a, b) in gate_buf.iter_mut().zip(up_buf.iter()) {
        *a = silu(*a) * b;
    }
    down.matvec(gate_buf, out);
}

/// A gated feed-forward block's weights (SwiGLU or SiTU-GLU: dense MLP, shared experts),
/// resolved in the backbone once at load: `gate_proj`, `up_proj` `[intermediate, hidden]`,
/// `down_proj` `[hidden, intermediate]`.
#[derive(Debug, Clone, Copy)]
pub struct GluTensors {
    pub gate_proj: MatHandle,
    pub up_proj: MatHandle,
    pub down_proj: MatHandle,
}

/// Tensor names of a gated feed-forward block, as in the Hugging Face checkpoint:
/// `{prefix}.{gate,up,down}_proj.weight` under a prefix such as `model.layers.3.mlp` (a dense
/// MLP) or `model.layers.3.mlp.shared_experts` (shared experts).
#[derive(Debug, Clone)]
pub struct GluTensorNames {
    pub gate_proj: String,
    pub up_proj: String,
    pub down_proj: String,
}

impl GluTensorNames {
    /// Names under `prefix` (for example `model.layers.3.mlp.shared_experts`).
    pub fn new(prefix: &str) -> Self {
        GluTensorNames {
            gate_proj: format!("{prefix}.gate_proj.weight"),
            up_proj: format!("{prefix}.up_proj.weight"),
            down_proj: format!("{prefix}.down_proj.weight"),
        }
    }
}

impl GluTensors {
    /// Resolves the matrices named by `n` in `bb`.
    ///
    /// Errors: a missing or malformed tensor (named; the name carries the layer).
    pub fn resolve(bb: &Backbone, n: &GluTensorNames) -> Result<Self, EngineError> {
        Ok(GluTensors {
            gate_proj: bb.matrix_handle(&n.gate_proj)?,
            up_proj: bb.matrix_handle(&n.up_proj)?,
            down_proj: bb.matrix_handle(&n.down_proj)?,
        })
    }

    /// `[gate_proj, up_proj, down_proj]` as views into `bb`, the backbone that resolved them.
    pub fn view<'a>(&self, bb: &'a Backbone) -> [MatRef<'a>; 3] {
        [bb.mat(&self.gate_proj), bb.mat(&self.up_proj), bb.mat(&self.down_proj)]
    }
}

/// SwiGLU feed-forward (dense MLP, shared and routed experts of most families):
/// `down_proj(silu(gate_proj(x)) * up_proj(x))`. x: `[cols of gate]` → `[rows of down]`.
/// Source: Shazeer 2020, "GLU Variants Improve Transformer" (arXiv:2002.05202); transformers'
/// `DeepseekV3MLP`.
pub fn swiglu(gate: MatRef<'_>, up: MatRef<'_>, down: MatRef<'_>, x: &[f32]) -> Vec<f32> {
    let mut g = vec![0f32; gate.rows];
    let mut u = vec![0f32; up.rows];
    gate.matvec(x, &mut g);
    up.matvec(x, &mut u);
    for (a, b) in g.iter_mut().zip(&u) {
        *a = silu(*a) * b;
    }
    let mut out = vec![0f32; down.rows];
    down.matvec(&g, &mut out);
    out
}
