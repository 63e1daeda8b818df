//! The decode state of a hybrid model, whose layers mix tokens either with a recurrent state
//! (KDA in Kimi Linear / K3, gated DeltaNet in Qwen3-Next / Qwen3.5) or with attention over a
//! cache of the past (MLA latents, GQA keys and values): one state per layer and the length.
//!
//! What the two hybrid families share lives here: the `DecodeState` bookkeeping (length, commit,
//! bytes) and the order of a rollback (every recurrent layer must reach back first, then each
//! layer is rolled back or truncated). What a layer's state is, and how it rolls back, stays in
//! the family's file.

use std::fmt::Debug;

use crate::model::DecodeState;

/// One layer's decode state in a [`HybridState`].
pub trait LayerState: Clone + Debug + Send + Sync + 'static {
    /// Makes the positions decoded so far final (a recurrent state drops its rollback log;
    /// an attention cache has nothing to do).
    fn commit(&mut self);

    /// Bytes held (capacity of the buffers, f32 = 4 bytes).
    fn bytes(&self) -> usize;

    /// The shortest length this layer can roll back to: a recurrent state's committed length
    /// (its rollback window ends there), 0 for an attention cache (it truncates to any length).
    fn rollback_floor(&self) -> usize;
}

/// Per-sequence decode state of a hybrid model: `layers[l]` is layer `l`'s state, `dims` the
/// cache dimensions the family checks and truncates with, `len` the tokens decoded.
#[derive(Debug, Clone)]
pub struct HybridState<L, D> {
    pub(crate) layers: Vec<L>,
    pub(crate) dims: D,
    pub(crate) len: usize,
}

impl<L: LayerState, D> HybridState<L, D> {
    /// An empty state (no tokens) of `layers` and `dims`.
    pub(crate) fn new(layers: Vec<L>, dims: D) -> Self {
        HybridState { layers, dims, len: 0 }
    }

    /// Rolls the state back to `len` tokens: nothing to do when `len` is not shorter; refused
    /// (false, nothing changed) when a recurrent layer cannot reach back that far; otherwise
    /// `layer(l, dims, state)` rolls back or truncates each layer in order (false stops with
    /// false: the state is then broken and the caller resets it, as
    /// [`crate::model::CausalLm::rollback`] says).
    pub(crate) fn rollback(&mut self, len: usize, mut layer: impl FnMut(usize, &D, &mut L) -> bool) -> bool {
        if len >= self.len {
            return true;
        }
        if !self.layers.iter().all(|s| len >= s.rollback_floor()) {
            return false;
        }
        for (l, s) in self.layers.iter_mut().enumerate() {
            if !layer(l, &self.dims, s) {
                return false;
            }
        }
        self.len = len;
        true
    }
}

impl<L: LayerState, D: Clone + Debug + Send + Sync + 'static> DecodeState for HybridState<L, D> {
    fn len(&self) -> usize {
        self.len
    }

    /// Recurrent states roll back only through their model ([`crate::model::CausalLm::rollback`]
    /// needs the layer's weights); a bare truncate succeeds only when nothing is dropped.
    fn truncate(&mut self, len: usize) -> bool {
        len >= self.len
    }

    fn commit(&mut self) {
        for s in &mut self.layers {
            s.commit();
        }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().map(LayerState::bytes).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
