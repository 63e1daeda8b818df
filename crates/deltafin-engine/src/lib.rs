//! deltafin's engine: model forward passes, the routed-expert store, and generation.
//!
//! - [`blocked_attention`]: query-tile × key-tile attention of a chunk's rows over shared
//!   cached keys (batched passes), bit-identical to the per-(token, head) loop.
//! - [`blocks`]: mixer blocks shared by model families (Kimi Delta Attention) with their
//!   per-sequence state.
//! - [`experts`]: reading routed-expert records from `experts.pack` on demand into a byte-budgeted
//!   cache, verifying checksums, counting bytes and hits.
//! - [`model`]: the [`model::CausalLm`] interface every family implements, [`model::load_model`],
//!   and the routed-expert runtime the families share.
//! - [`models`]: one file per model family (`deepseek_v3`, `kimi_linear`, `qwen3_moe`, `mixtral`,
//!   `gpt_oss`, `qwen3_next`), built from
//!   shared blocks ([`rope`], [`moe`], [`gqa`]).
//! - [`generate`]: the greedy decode loop with timing statistics.

pub mod blocked_attention;
pub mod blocks;
pub mod compute;
pub mod constraint;
pub mod device;
pub mod experts;
pub mod generate;
pub mod gpu_experts;
pub mod gqa;
pub mod mem;
pub mod model;
pub mod models;
pub mod moe;
pub mod rope;
pub mod sampler;
pub mod session;
pub mod speculate;
pub mod traces;

use std::path::PathBuf;

/// Errors while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] deltafin_format::FormatError),
    #[error(transparent)]
    Tokenizer(#[from] deltafin_tokenizer::TokenizerError),
    #[error(transparent)]
    Kda(#[from] blocks::kda::KdaError),
    #[error("{path}: reading expert (layer {layer}, expert {expert}): {error}")]
    ExpertIo {
        path: PathBuf,
        layer: usize,
        expert: usize,
        error: std::io::Error,
    },
    #[error("{path}: expert (layer {layer}, expert {expert}) failed its checksum: expected xxh3 {expected}, found {found} (the expert pack is corrupted; re-run `deltafin convert`)")]
    ExpertChecksum {
        path: PathBuf,
        layer: usize,
        expert: usize,
        expected: String,
        found: String,
    },
    #[error("{dir}: routed expert (layer {layer}, expert {expert}) is not local yet in this streaming install and network use is not allowed: fetch it with `deltafin warm {dir} --allow-network` (or `deltafin pull <source> {dir} --full`), or run with --allow-network")]
    ExpertNotLocal { dir: PathBuf, layer: usize, expert: usize },
    #[error("{dir}: fetching routed expert (layer {layer}, expert {expert}) from {url}: {message}")]
    ExpertFetch {
        dir: PathBuf,
        layer: usize,
        expert: usize,
        url: String,
        message: String,
    },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    /// A forward pass produced a NaN or infinite logit: the weights or the config's values are
    /// broken (a model directory edited after convert, or values no checkpoint should hold).
    #[error("the model produced a non-finite logit (NaN or infinity) at token position {position}: its weights or config values are broken (check rms_norm_eps, rope_theta and rope_scaling, then re-run `deltafin convert`)")]
    NonFiniteLogits { position: usize },
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    /// `Ok` when every id of `tokens` is below `vocab_size`, else
    /// [`EngineError::TokenOutOfRange`] naming the first that is not.
    ///
    /// # Errors
    /// As said.
    pub fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<(), EngineError> {
        match tokens.iter().find(|&&t| t as usize >= vocab_size) {
            Some(&id) => Err(EngineError::TokenOutOfRange { id, vocab_size }),
            None => Ok(()),
        }
    }
}

/// The one of `all` whose command-line name (`name`) is `s`: the `FromStr` of an option's
/// enum.
///
/// Errors: `unknown {what} {s:?} (expected a, b or c)`, listing the names of `all` in order.
pub(crate) fn parse_name<T: Copy>(s: &str, what: &str, all: &[T], name: fn(T) -> &'static str) -> Result<T, String> {
    if let Some(&v) = all.iter().find(|&&v| name(v) == s) {
        return Ok(v);
    }
    let names: Vec<&str> = all.iter().map(|&v| name(v)).collect();
    let expected = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.concat(),
    };
    Err(format!("unknown {what} {s:?} (expected {expected})"))
}

/// `name()` (the name on the command line), [`std::fmt::Display`] (that name) and
/// [`std::str::FromStr`] (one of the names, else [`parse_name`]'s one-line error naming `$what`)
/// of an option's fieldless enum, from its variants and their names in order: written once for
/// every such option.
macro_rules! cli_names {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Name as on the command line.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $crate::parse_name(s, $what, &[$($ty::$variant),+], $ty::name)
            }
        }
    };
}
pub(crate) use cli_names;

pub use blocks::mla::MlaForm;
pub use device::{load_model_on, Device, GpuOptions};
pub use gpu_experts::GpuCacheStats;
pub use model::BatchForm;
pub use model::{load_model, panic_message, CausalLm, DecodeState, LayerRoutes, Numerics, Profile};

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use crate::experts::{CachePolicy, IoMode};
    use crate::speculate::SpeculateMode;

    /// The option enums read their names, and a wrong one gets the same message as before
    /// [`super::parse_name`] (word for word).
    #[test]
    fn option_names_parse_and_list_the_choices() {
        assert_eq!(IoMode::from_str("buffered"), Ok(IoMode::Buffered));
        assert_eq!(
            IoMode::from_str("x").unwrap_err(),
            "unknown I/O mode \"x\" (expected direct or buffered)"
        );
        assert_eq!(CachePolicy::from_str("pinned"), Ok(CachePolicy::Pinned));
        assert_eq!(
            CachePolicy::from_str("LRU").unwrap_err(),
            "unknown cache policy \"LRU\" (expected lru, lfu or pinned)"
        );
        assert_eq!(SpeculateMode::from_str("self"), Ok(SpeculateMode::SelfDraft));
        assert_eq!(
            SpeculateMode::from_str("").unwrap_err(),
            "unknown speculation mode \"\" (expected off, auto, lookup or self)"
        );
    }
}
