//! `config.json` of Kimi Linear (`model_type` `kimi_linear`) and Kimi K3 (`kimi_k3`, whose
//! `text_config` is a `kimi_linear` config with the K3 keys), resolved into concrete
//! hyperparameters, and the tensor tables of both.
//!
//! Defaults follow transformers 5.24 `models/kimi_linear/configuration_kimi_linear.py`; the K3
//! keys (`mla_use_output_gate`, `linear_attn_config.use_full_rank_gate` / `gate_lower_bound`,
//! `routed_expert_hidden_size`, `latent_moe_use_norm`, `hidden_act: "situ"`,
//! `activation_situ_*`, `attn_res_block_size`) follow `../shared/K3-SPEC.md` §0. Layer lists in
//! `linear_attn_config` are one-based, as in the released configs. [KL_LAYER_LISTS]

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::family::{
    check_layer_count, decoder_backbone, glu_expert_matrices, glu_mlp_tensors, is_beyond_layers, mla_tensors,
    mla_widths, noaux_router_tensors, shared_experts_tensors, tensors, whole, BackboneTensor, ExpertGroups,
    ExpertMatrix, ExpertSource, Family, MoeDecoderSizes, TensorRole,
};
use crate::json::{
    bool_or as bool_of, check_range, eos_bos, f32_in, field_err as err, get, opt_usize, require_nonzero, require_only,
    resolve_aliases, text_config, usize_or as usize_of, Aliases, Range,
};
use crate::FormatError;

/// Token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixerKind {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda,
    /// Multi-head latent attention without RoPE (`mla_use_nope`).
    Mla,
}

/// Gated feed-forward activation `act(gate) * up'`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GluActivation {
    /// SwiGLU: `silu(g) * u`.
    Silu,
    /// SiTU-GLU (K3): `β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)`; without `linear_beta` the up
    /// branch is `u`. [SITU] (K3-SPEC §5)
    Situ { beta: f32, linear_beta: Option<f32> },
}

/// Concrete hyperparameters of a Kimi Linear / Kimi K3 text model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KimiLinearConfig {
    /// Top-level `model_type`: `kimi_linear` or `kimi_k3`.
    pub model_type: String,
    /// `vocab_size` … `num_attention_heads` (MLA heads); dense MLP layers are those below
    /// `first_k_dense_replace`, and the shared MLP uses `num_shared_experts ×
    /// moe_intermediate_size`.
    #[serde(flatten)]
    pub sizes: MoeDecoderSizes,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// Width of the shared (un-rotated: NoPE) key part.
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// MLA output gate `o ⊙ σ(x W_g^T)` (K3).
    pub mla_use_output_gate: bool,
    /// KDA head width `d` (keys and values).
    pub kda_head_dim: usize,
    pub kda_num_heads: usize,
    /// Depthwise causal convolution kernel of q, k, v.
    pub short_conv_kernel_size: usize,
    /// Full-rank KDA output gate `g_proj [P, H]` (K3) instead of `g_b_proj(g_a_proj(x))`.
    pub use_full_rank_gate: bool,
    /// K3's decay gate `g = lower_bound · σ(exp(A_log)·u)` instead of
    /// `-exp(A_log) · softplus(u)`. [KDA_GATE]
    pub gate_lower_bound: Option<f32>,
    /// Token mixer of each layer (zero-based).
    pub mixers: Vec<MixerKind>,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    /// LatentMoE width (K3): routed experts run on `routed_expert_down_proj(x)`.
    pub routed_expert_hidden_size: Option<usize>,
    /// RMSNorm of the routed experts' weighted sum before `routed_expert_up_proj` (K3).
    pub latent_moe_use_norm: bool,
    /// Layers `< first_k_dense_replace` use a dense MLP; the rest are MoE.
    pub first_k_dense_replace: usize,
    /// Renormalise the chosen experts' weights to sum to 1 (`moe_renormalize`).
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    pub n_group: usize,
    pub topk_group: usize,
    pub activation: GluActivation,
    /// Attention residuals (K3): a bank entry every this many layers. [ATTN_RES]
    pub attn_res_block_size: Option<usize>,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

/// `KimiLinearConfig.attribute_map` (transformers 5) stores the routed-expert count as
/// `n_routed_experts` and reads `num_local_experts` as it; the released configs write
/// `num_experts`, which this crate reads. [TRANSFORMERS_ATTRIBUTE_MAP]
const ALIASES: Aliases = &[
    ("n_routed_experts", "num_experts"),
    ("num_local_experts", "num_experts"),
];

/// `KimiLinearConfig`'s defaults of the [`MoeDecoderSizes`].
const SIZES: MoeDecoderSizes = MoeDecoderSizes {
    vocab_size: 163840,
    hidden_size: 2304,
    intermediate_size: 9216,
    moe_intermediate_size: 1024,
    num_hidden_layers: 27,
    num_attention_heads: 32,
};

/// One-based layer list `key` of `linear_attn_config`.
fn layer_list(lac: &Value, path: &Path, key: &str) -> Result<Option<Vec<usize>>, FormatError> {
    let field = format!("linear_attn_config.{key}");
    let Some(v) = get(lac, key) else { return Ok(None) };
    let a = v
        .as_array()
        .ok_or_else(|| err(path, &field, format!("expected a list of layer numbers, got {v}")))?;
    a.iter()
        .map(|x| {
            x.as_u64()
                .filter(|&n| n >= 1)
                .map(|n| n as usize)
                .ok_or_else(|| err(path, &field, format!("layer numbers are one-based integers, got {x}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl KimiLinearConfig {
    /// Resolves a parsed `config.json` (top level `kimi_linear`, or a `kimi_k3` wrapper whose
    /// `text_config` is `kimi_linear`). `path` names the file in errors.
    ///
    /// Errors: a field of the wrong type, inconsistent layer lists, or a setting this
    /// implementation does not run (named field).
    pub fn from_value(raw: &Value, path: &Path) -> Result<Self, FormatError> {
        let raw = &*resolve_aliases(raw, path, ALIASES)?;
        let tc = text_config(raw);
        let top = raw.get("model_type").and_then(Value::as_str).unwrap_or("kimi_linear");
        let n_layers = usize_of(tc, path, "num_hidden_layers", SIZES.num_hidden_layers)?;
        let empty = Value::Object(Default::default());
        let lac = get(tc, "linear_attn_config").unwrap_or(&empty);
        let full = layer_list(lac, path, "full_attn_layers")?;
        let kda = layer_list(lac, path, "kda_layers")?;
        // transformers' KimiLinearConfig: both lists → explicit kinds; otherwise every 4th
        // layer (zero-based, not 0) is full attention.
        let mixers = match (full, kda) {
            (Some(full), Some(kda)) => {
                let mut m: Vec<Option<MixerKind>> = vec![None; n_layers];
                for (list, kind, name) in [
                    (&full, MixerKind::Mla, "full_attn_layers"),
                    (&kda, MixerKind::Kda, "kda_layers"),
                ] {
                    for &l in list {
                        let field = format!("linear_attn_config.{name}");
                        let slot = m.get_mut(l - 1).ok_or_else(|| {
                            err(
                                path,
                                &field,
                                format!("layer {l} is beyond num_hidden_layers {n_layers}"),
                            )
                        })?;
                        if slot.is_some() {
                            return Err(err(path, &field, format!("layer {l} is listed twice")));
                        }
                        *slot = Some(kind);
                    }
                }
                m.iter()
                    .enumerate()
                    .map(|(i, k)| {
                        k.ok_or_else(|| {
                            err(
                                path,
                                "linear_attn_config",
                                format!("layer {} is in neither full_attn_layers nor kda_layers", i + 1),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            (None, None) => (0..n_layers)
                .map(|i| {
                    if i > 0 && i % 4 == 0 {
                        MixerKind::Mla
                    } else {
                        MixerKind::Kda
                    }
                })
                .collect(),
            _ => {
                return Err(err(
                    path,
                    "linear_attn_config",
                    "full_attn_layers and kda_layers must be given together",
                ))
            }
        };
        let act = get(tc, "hidden_act").and_then(Value::as_str).unwrap_or("silu");
        let activation = match act {
            "silu" | "swiglu" => GluActivation::Silu,
            "situ" => GluActivation::Situ {
                beta: f32_in(tc, path, "activation_situ_beta", 4.0, Range::Positive)?,
                linear_beta: match get(tc, "activation_situ_linear_beta") {
                    None => None,
                    Some(v) => Some(check_range(
                        path,
                        "activation_situ_linear_beta",
                        v.as_f64().ok_or_else(|| {
                            err(
                                path,
                                "activation_situ_linear_beta",
                                format!("expected a number or null, got {v}"),
                            )
                        })?,
                        Range::Positive,
                    )? as f32),
                },
            },
            other => {
                return Err(err(
                    path,
                    "hidden_act",
                    format!("{other:?} is not supported (silu, situ)"),
                ))
            }
        };
        require_only(tc, path, "moe_router_activation_func", "sigmoid")?;
        let freq = usize_of(tc, path, "moe_layer_freq", 1)?;
        if freq != 1 {
            return Err(err(path, "moe_layer_freq", format!("{freq} is not supported (only 1)")));
        }
        let q_lora_rank = opt_usize(tc, path, "q_lora_rank")?;
        let (eos, bos) = eos_bos(tc, raw);
        let num_attention_heads = usize_of(tc, path, "num_attention_heads", SIZES.num_attention_heads)?;
        let kv_heads = usize_of(tc, path, "num_key_value_heads", num_attention_heads)?;
        if kv_heads != num_attention_heads {
            return Err(err(
                path,
                "num_key_value_heads",
                "MLA needs num_key_value_heads == num_attention_heads",
            ));
        }
        let attn_res_block_size = match usize_of(tc, path, "attn_res_block_size", 0)? {
            0 => None,
            n => Some(n),
        };
        let n_experts = usize_of(tc, path, "num_experts", usize_of(tc, path, "num_local_experts", 256)?)?;
        let cfg = KimiLinearConfig {
            model_type: top.to_string(),
            // Reads `num_hidden_layers` and `num_attention_heads` again: the same values as
            // `n_layers` and `num_attention_heads` above.
            sizes: MoeDecoderSizes::read(tc, path, &SIZES)?,
            q_lora_rank,
            kv_lora_rank: usize_of(tc, path, "kv_lora_rank", 512)?,
            qk_nope_head_dim: usize_of(tc, path, "qk_nope_head_dim", 128)?,
            qk_rope_head_dim: usize_of(tc, path, "qk_rope_head_dim", 64)?,
            v_head_dim: usize_of(tc, path, "v_head_dim", 128)?,
            mla_use_output_gate: bool_of(tc, path, "mla_use_output_gate", false)?,
            kda_head_dim: usize_of(lac, path, "head_dim", 128)?,
            kda_num_heads: usize_of(lac, path, "num_heads", 32)?,
            short_conv_kernel_size: usize_of(lac, path, "short_conv_kernel_size", 4)?,
            use_full_rank_gate: bool_of(lac, path, "use_full_rank_gate", false)?,
            gate_lower_bound: get(lac, "gate_lower_bound")
                .map(|v| {
                    let field = "linear_attn_config.gate_lower_bound";
                    let x = v
                        .as_f64()
                        .ok_or_else(|| err(path, field, format!("expected a number, got {v}")))?;
                    Ok(check_range(path, field, x, Range::Finite)? as f32)
                })
                .transpose()?,
            mixers,
            num_experts: n_experts,
            num_experts_per_token: usize_of(
                tc,
                path,
                "num_experts_per_token",
                usize_of(tc, path, "num_experts_per_tok", 8)?,
            )?,
            num_shared_experts: usize_of(
                tc,
                path,
                "num_shared_experts",
                usize_of(tc, path, "n_shared_experts", 1)?,
            )?,
            routed_expert_hidden_size: match usize_of(tc, path, "routed_expert_hidden_size", 0)? {
                0 => None,
                n => Some(n),
            },
            latent_moe_use_norm: bool_of(tc, path, "latent_moe_use_norm", false)?,
            first_k_dense_replace: usize_of(tc, path, "first_k_dense_replace", 1)?,
            renormalize: bool_of(tc, path, "moe_renormalize", bool_of(tc, path, "norm_topk_prob", true)?)?,
            routed_scaling_factor: f32_in(tc, path, "routed_scaling_factor", 2.446, Range::Positive)?,
            n_group: usize_of(tc, path, "num_expert_group", usize_of(tc, path, "n_group", 1)?)?,
            topk_group: usize_of(tc, path, "topk_group", 1)?,
            activation,
            attn_res_block_size,
            rms_norm_eps: f32_in(tc, path, "rms_norm_eps", 1e-5, Range::NonNegative)?,
            max_position_embeddings: usize_of(
                tc,
                path,
                "max_position_embeddings",
                usize_of(tc, path, "model_max_length", 1048576)?,
            )?,
            eos_token_id: eos,
            bos_token_id: bos,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Fails fast on hyperparameters this implementation cannot run.
    pub fn validate(&self, path: &Path) -> Result<(), FormatError> {
        require_nonzero(
            path,
            &[
                ("vocab_size", self.vocab_size),
                ("max_position_embeddings", self.max_position_embeddings),
                ("hidden_size", self.hidden_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("linear_attn_config.head_dim", self.kda_head_dim),
                ("linear_attn_config.num_heads", self.kda_num_heads),
                ("linear_attn_config.short_conv_kernel_size", self.short_conv_kernel_size),
                ("num_expert_group", self.n_group),
            ],
        )?;
        for (k, v) in [
            ("attn_res_block_size", self.attn_res_block_size),
            ("routed_expert_hidden_size", self.routed_expert_hidden_size),
        ] {
            if v == Some(0) {
                return Err(err(path, k, "must be greater than 0 when set"));
            }
        }
        check_layer_count(
            path,
            "linear_attn_config",
            "layer kinds",
            self.mixers.len(),
            self.num_hidden_layers,
        )?;
        if self.mixers.contains(&MixerKind::Mla) && (self.num_attention_heads == 0 || self.kv_lora_rank == 0) {
            return Err(err(
                path,
                "num_attention_heads",
                "MLA layers need heads and kv_lora_rank > 0",
            ));
        }
        if self.has_moe() {
            if self.num_experts == 0 || self.num_experts_per_token == 0 {
                return Err(err(
                    path,
                    "num_experts",
                    "MoE layers need experts and num_experts_per_token > 0",
                ));
            }
            if !self.num_experts.is_multiple_of(self.n_group) || self.topk_group > self.n_group {
                return Err(err(
                    path,
                    "num_expert_group",
                    format!(
                        "num_experts {} / num_expert_group {} / topk_group {} are inconsistent",
                        self.num_experts, self.n_group, self.topk_group
                    ),
                ));
            }
            self.expert_groups().check(path, self.num_experts_per_token)?;
        }
        if self.latent_moe_use_norm && self.routed_expert_hidden_size.is_none() {
            return Err(err(
                path,
                "latent_moe_use_norm",
                "needs routed_expert_hidden_size (LatentMoE)",
            ));
        }
        Ok(())
    }

    /// Whether any layer is a MoE layer.
    pub fn has_moe(&self) -> bool {
        self.first_k_dense_replace < self.num_hidden_layers
    }

    /// Whether decoder layer `layer` (0-based) is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer < self.num_hidden_layers
    }

    /// Width routed experts run in: `routed_expert_hidden_size` (LatentMoE) or `hidden_size`.
    pub fn expert_width(&self) -> usize {
        self.routed_expert_hidden_size.unwrap_or(self.hidden_size)
    }

    /// KDA projection width `P = num_heads × head_dim`.
    pub fn kda_width(&self) -> usize {
        self.kda_num_heads * self.kda_head_dim
    }

    /// Shape of `A_log`: `[heads]` in K3, `[1, 1, heads, 1]` in transformers' Kimi Linear.
    pub fn a_log_shape(&self) -> Vec<usize> {
        if self.model_type == "kimi_k3" {
            vec![self.kda_num_heads]
        } else {
            vec![1, 1, self.kda_num_heads, 1]
        }
    }

    /// Checkpoint name of routed-expert matrix `m` of `expert` in `layer`.
    pub fn expert_tensor(&self, layer: usize, expert: usize, m: &str) -> String {
        format!("model.layers.{layer}.block_sparse_moe.experts.{expert}.{m}.weight")
    }

    /// The group-limited routing fields (`num_expert_group`, `topk_group`).
    fn expert_groups(&self) -> ExpertGroups<'static> {
        ExpertGroups {
            top_k_field: "num_experts_per_token",
            group_field: "num_expert_group",
            n_experts: self.num_experts,
            n_group: self.n_group,
            topk_group: self.topk_group,
        }
    }
}

crate::family::deref_to_sizes!(KimiLinearConfig);

impl Family for KimiLinearConfig {
    crate::family::family_items!(
        family: "kimi_linear", model_type: self.model_type, routed_experts: num_experts, top_k: num_experts_per_token
    );

    fn max_experts_per_tok(&self) -> (usize, String) {
        self.expert_groups().max_experts_per_tok()
    }

    /// The resident tensors with their shapes, in checkpoint order (K3-SPEC §7; transformers'
    /// hub names for Kimi Linear).
    fn backbone_tensors(&self) -> Vec<BackboneTensor> {
        use TensorRole::{Matrix, F32};
        let h = self.hidden_size;
        let mla = mla_widths!(self);
        let mut t = decoder_backbone("model", self.vocab_size, h, self.num_hidden_layers, |l, p| {
            let mut t: Vec<(String, Vec<usize>, TensorRole)> = Vec::new();
            if self.attn_res_block_size.is_some() {
                for site in ["self_attention_res", "mlp_res"] {
                    t.push((format!("{p}.{site}_norm.weight"), vec![h], F32));
                    t.push((format!("{p}.{site}_proj.weight"), vec![1, h], F32));
                }
            }
            let a = format!("{p}.self_attn");
            let mut t = match self.mixers[l] {
                MixerKind::Kda => {
                    let (pw, d, nh, kc) = (
                        self.kda_width(),
                        self.kda_head_dim,
                        self.kda_num_heads,
                        self.short_conv_kernel_size,
                    );
                    for x in ["q", "k", "v"] {
                        t.push((format!("{a}.{x}_proj.weight"), vec![pw, h], Matrix));
                    }
                    for x in ["q", "k", "v"] {
                        t.push((format!("{a}.{x}_conv1d.weight"), vec![pw, 1, kc], F32));
                    }
                    t.push((format!("{a}.A_log"), self.a_log_shape(), F32));
                    t.push((format!("{a}.dt_bias"), vec![pw], F32));
                    t.push((format!("{a}.f_a_proj.weight"), vec![d, h], Matrix));
                    t.push((format!("{a}.f_b_proj.weight"), vec![pw, d], Matrix));
                    t.push((format!("{a}.b_proj.weight"), vec![nh, h], F32));
                    if self.use_full_rank_gate {
                        t.push((format!("{a}.g_proj.weight"), vec![pw, h], Matrix));
                    } else {
                        t.push((format!("{a}.g_a_proj.weight"), vec![d, h], Matrix));
                        t.push((format!("{a}.g_b_proj.weight"), vec![pw, d], Matrix));
                    }
                    t.push((format!("{a}.o_norm.weight"), vec![d], F32));
                    t.push((format!("{a}.o_proj.weight"), vec![h, pw], Matrix));
                    tensors(t)
                }
                MixerKind::Mla => {
                    let mut t = tensors(t);
                    t.extend(mla_tensors(&a, h, &mla, self.mla_use_output_gate));
                    t
                }
            };
            if self.is_moe_layer(l) {
                let m = format!("{p}.block_sparse_moe");
                t.extend(noaux_router_tensors(&m, h, self.num_experts));
                if let Some(lat) = self.routed_expert_hidden_size {
                    let mut latent = vec![(format!("{m}.routed_expert_down_proj.weight"), vec![lat, h], Matrix)];
                    if self.latent_moe_use_norm {
                        latent.push((format!("{m}.routed_expert_norm.weight"), vec![lat], F32));
                    }
                    latent.push((format!("{m}.routed_expert_up_proj.weight"), vec![h, lat], Matrix));
                    t.extend(tensors(latent));
                }
                t.extend(shared_experts_tensors(
                    &m,
                    h,
                    self.moe_intermediate_size,
                    self.num_shared_experts,
                ));
            } else {
                t.extend(glu_mlp_tensors(&format!("{p}.mlp"), h, self.intermediate_size));
            }
            t
        });
        if self.attn_res_block_size.is_some() {
            // The output attention residual sits between the final norm and `lm_head` (last).
            let at = t.len() - 1;
            t.splice(
                at..at,
                tensors([
                    ("model.output_attn_res_norm.weight".into(), vec![h], F32),
                    ("model.output_attn_res_proj.weight".into(), vec![1, h], F32),
                ]),
            );
        }
        t
    }

    /// The matrices of one routed expert, as named in the checkpoint: `w1` (gate), `w3` (up)
    /// `[moe_intermediate, expert_width]` and `w2` (down) `[expert_width, moe_intermediate]`.
    fn expert_matrices(&self) -> Vec<ExpertMatrix> {
        let (w, i) = (self.expert_width(), self.moe_intermediate_size);
        glu_expert_matrices(["w1", "w3", "w2"], w, i)
    }

    fn expert_source(&self, layer: usize, expert: usize, m: &ExpertMatrix) -> ExpertSource {
        whole(self.expert_tensor(layer, expert, &m.name), m)
    }

    /// Names the converter deliberately skips: multi-token-prediction layers and the
    /// vision tower / projector of the K3 wrapper.
    fn is_ignored(&self, name: &str) -> bool {
        name.starts_with("mm_projector.")
            || name.starts_with("multi_modal_projector.")
            || is_beyond_layers(name, self.num_hidden_layers)
    }

    fn recurrent_state_values(&self) -> u128 {
        self.kda_num_heads as u128 * (self.kda_head_dim as u128).pow(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resolves_one_based_layer_lists_and_k3_keys() {
        let raw = json!({"model_type": "kimi_k3", "eos_token_id": 9, "text_config": {
            "model_type": "kimi_linear", "num_hidden_layers": 5, "hidden_size": 16,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4, 5], "head_dim": 8,
                "num_heads": 2, "use_full_rank_gate": true, "gate_lower_bound": -5.0},
            "num_experts": 4, "num_experts_per_token": 2, "routed_expert_hidden_size": 8,
            "latent_moe_use_norm": true, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 3, "eos_token_id": 7}});
        let c = KimiLinearConfig::from_value(&raw, Path::new("c.json")).unwrap();
        use MixerKind::*;
        assert_eq!(c.mixers, vec![Kda, Kda, Kda, Mla, Mla]);
        assert_eq!(c.gate_lower_bound, Some(-5.0));
        assert_eq!(
            c.activation,
            GluActivation::Situ {
                beta: 4.0,
                linear_beta: Some(25.0)
            }
        );
        assert_eq!(c.eos_token_id, vec![7, 9]);
        assert_eq!(c.a_log_shape(), vec![2]);
        assert!(c
            .backbone_tensors()
            .iter()
            .any(|t| t.name == "model.output_attn_res_proj.weight"));
    }

    #[test]
    fn rejects_bad_layer_lists() {
        let bad = |lac: Value| {
            let raw = json!({"model_type": "kimi_linear", "num_hidden_layers": 3, "linear_attn_config": lac});
            KimiLinearConfig::from_value(&raw, Path::new("c.json"))
                .unwrap_err()
                .to_string()
        };
        assert!(bad(json!({"kda_layers": [1, 2], "full_attn_layers": [2, 3]})).contains("listed twice"));
        assert!(bad(json!({"kda_layers": [1], "full_attn_layers": [3]})).contains("layer 2"));
        assert!(bad(json!({"kda_layers": [0], "full_attn_layers": [2, 3]})).contains("one-based"));
        assert!(bad(json!({"kda_layers": [1, 2, 4], "full_attn_layers": [3]})).contains("beyond"));
    }
}
