//! Deterministic synthetic models (random weights, real layout) of the DeepSeek-V3 and Kimi K3
//! architectures, for the embedded demo, tests and benchmarks. Their text output is meaningless.
//!
//! - [`write_checkpoint`]: a Hugging Face checkpoint (bf16 safetensors) to feed `convert`.
//! - [`write_model_dir`]: a deltafin model directory written directly, with no source checkpoint
//!   (`deltafin synth`); the only way to get the multi-GB `bench` preset in seconds.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
use crate::convert::{encode_matrix, Progress};
use crate::family::TensorRole;
use crate::manifest::{
    matrix_dims, record_layout, tensor_xxh3, write_manifest, BackboneIndex, ExpertPackIndex, ExpertRecord,
    ExpertTensorLayout, Manifest, StoredDtype, TensorRecord, COPIED_FILES,
};
use crate::{io_err, FormatError, ModelConfig};

/// Shape of a synthetic checkpoint.
#[derive(Debug, Clone)]
pub struct SynthSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub first_k_dense_replace: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub seed: u64,
}

impl SynthSpec {
    /// The `demo` preset: 6 layers (1 dense), 64 routed experts (top-6) of 512 → 256, YaRN,
    /// grouped routing. ~68 MB expert pack in MXFP4.
    pub fn demo(vocab_size: usize) -> Self {
        SynthSpec {
            vocab_size,
            hidden_size: 512,
            intermediate_size: 1024,
            moe_intermediate_size: 256,
            num_hidden_layers: 6,
            first_k_dense_replace: 1,
            num_attention_heads: 8,
            q_lora_rank: Some(256),
            kv_lora_rank: 128,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 32,
            v_head_dim: 32,
            n_routed_experts: 64,
            num_experts_per_tok: 6,
            n_shared_experts: 1,
            n_group: 4,
            topk_group: 2,
            seed: 0xDE17AF1,
        }
    }

    /// The `tiny` preset, for tests: 3 layers (1 dense), 8 routed experts (top-2) of 128 → 64,
    /// grouped routing; an expert pack of ~100 KB written in well under a second.
    pub fn tiny(vocab_size: usize) -> Self {
        SynthSpec {
            vocab_size,
            hidden_size: 128,
            intermediate_size: 256,
            moe_intermediate_size: 64,
            num_hidden_layers: 3,
            first_k_dense_replace: 1,
            num_attention_heads: 2,
            q_lora_rank: Some(64),
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 16,
            v_head_dim: 16,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_shared_experts: 1,
            n_group: 2,
            topk_group: 1,
            seed: 0x7147,
        }
    }

    /// The `bench` preset: DeepSeek-V3's shape scaled so its expert pack (13.7 GB = 12.75 GiB) is
    /// three times a 4 GiB memory limit: 17 layers (1 dense), 256 routed experts (top-8, 8 groups,
    /// top-4 groups) of 2048 → 1024, one shared expert, MLA with q_lora, YaRN. One MXFP4 expert
    /// record is 3 × (1 MiB + 64 KiB) = 3.19 MiB; a decode token reads 16 × 8 of them (408 MiB)
    /// when nothing is cached. Backbone ~0.24 GB in int8.
    pub fn bench(vocab_size: usize) -> Self {
        SynthSpec {
            vocab_size,
            hidden_size: 2048,
            intermediate_size: 4096,
            moe_intermediate_size: 1024,
            num_hidden_layers: 17,
            first_k_dense_replace: 1,
            num_attention_heads: 16,
            q_lora_rank: Some(512),
            kv_lora_rank: 256,
            qk_nope_head_dim: 64,
            qk_rope_head_dim: 32,
            v_head_dim: 64,
            n_routed_experts: 256,
            num_experts_per_tok: 8,
            n_shared_experts: 1,
            n_group: 8,
            topk_group: 4,
            seed: 0xBE7C4,
        }
    }

    /// The `config.json` of this spec (deepseek_v3, YaRN from 256 positions).
    pub fn config_json(&self, bos: u32, eos: u32) -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "tie_word_embeddings": false,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        })
    }
}

/// Shape of a synthetic Kimi K3 model (`kimi_k3` wrapper around a `kimi_linear` text config
/// with every K3 feature: KDA with the lower-bound gate and full-rank output gate, gated NoPE
/// MLA, attention residuals, LatentMoE, SiTU).
#[derive(Debug, Clone)]
pub struct K3SynthSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub num_hidden_layers: usize,
    /// One-based, as in the released config.
    pub full_attn_layers: Vec<usize>,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub kda_num_heads: usize,
    pub kda_head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub attn_res_block_size: usize,
    pub seed: u64,
}

impl K3SynthSpec {
    /// The `k3-bench` preset: Kimi K3's structure scaled so the expert pack (12.3 GB) is three
    /// times a 4 GiB memory limit: 34 layers (layer 0 dense, MLA every fourth layer and the last,
    /// KDA elsewhere), 128 routed experts per layer (top-16, as K3) of 3 × 1792 × 1024 MXFP4
    /// (2.79 MiB a record) in a 1024-wide latent space of a 2048-wide model, two shared experts,
    /// attention-residual blocks of 6 layers. A decode token reads 33 × 16 records (1.54 GB)
    /// when nothing is cached.
    pub fn k3_bench(vocab_size: usize) -> Self {
        let mut full: Vec<usize> = (4..=34).step_by(4).collect();
        full.push(34);
        full.dedup();
        K3SynthSpec {
            vocab_size,
            hidden_size: 2048,
            intermediate_size: 4096,
            moe_intermediate_size: 1792,
            routed_expert_hidden_size: 1024,
            num_hidden_layers: 34,
            full_attn_layers: full,
            num_attention_heads: 16,
            q_lora_rank: 512,
            kv_lora_rank: 256,
            qk_nope_head_dim: 64,
            qk_rope_head_dim: 32,
            v_head_dim: 64,
            kda_num_heads: 16,
            kda_head_dim: 128,
            num_experts: 128,
            num_experts_per_token: 16,
            num_shared_experts: 2,
            attn_res_block_size: 6,
            seed: 0x0C3B3C4,
        }
    }

    /// The `k3-tiny` preset, for tests: 5 layers (KDA, KDA, KDA, MLA, MLA), 8 experts (top-4)
    /// in a 32-wide latent space of a 64-wide model, attention-residual blocks of 2.
    pub fn k3_tiny(vocab_size: usize) -> Self {
        K3SynthSpec {
            vocab_size,
            hidden_size: 64,
            intermediate_size: 128,
            moe_intermediate_size: 64,
            routed_expert_hidden_size: 32,
            num_hidden_layers: 5,
            full_attn_layers: vec![4, 5],
            num_attention_heads: 2,
            q_lora_rank: 32,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            kda_num_heads: 2,
            kda_head_dim: 32,
            num_experts: 8,
            num_experts_per_token: 4,
            num_shared_experts: 2,
            attn_res_block_size: 2,
            seed: 0x0C3717,
        }
    }

    /// The `config.json` of this spec: the released K3 layout (`kimi_k3` wrapper, `text_config`
    /// of `model_type` `kimi_linear`, one-based layer lists).
    pub fn config_json(&self, bos: u32, eos: u32) -> Value {
        let kda: Vec<usize> = (1..=self.num_hidden_layers)
            .filter(|l| !self.full_attn_layers.contains(l))
            .collect();
        json!({
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "text_config": {
                "architectures": ["KimiLinearForCausalLM"],
                "model_type": "kimi_linear",
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_attention_heads,
                "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim,
                "mla_use_nope": true,
                "mla_use_output_gate": true,
                "linear_attn_config": {
                    "kda_layers": kda,
                    "full_attn_layers": self.full_attn_layers,
                    "head_dim": self.kda_head_dim,
                    "num_heads": self.kda_num_heads,
                    "short_conv_kernel_size": 4,
                    "use_full_rank_gate": true,
                    "gate_lower_bound": -5.0
                },
                "num_experts": self.num_experts,
                "num_experts_per_token": self.num_experts_per_token,
                "num_shared_experts": self.num_shared_experts,
                "moe_intermediate_size": self.moe_intermediate_size,
                "routed_expert_hidden_size": self.routed_expert_hidden_size,
                "latent_moe_use_norm": true,
                "first_k_dense_replace": 1,
                "moe_layer_freq": 1,
                "moe_renormalize": true,
                "moe_router_activation_func": "sigmoid",
                "routed_scaling_factor": 1.0,
                "num_expert_group": 1,
                "topk_group": 1,
                "hidden_act": "situ",
                "activation_situ_beta": 4.0,
                "activation_situ_linear_beta": 25.0,
                "attn_res_block_size": self.attn_res_block_size,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 1048576,
                "tie_word_embeddings": false,
                "bos_token_id": bos,
                "eos_token_id": eos
            },
            "bos_token_id": bos,
            "eos_token_id": eos,
            "tie_word_embeddings": false
        })
    }
}

/// The architecture and shape a preset writes.
#[derive(Debug, Clone)]
pub enum PresetSpec {
    DeepseekV3(SynthSpec),
    KimiK3(K3SynthSpec),
}

impl PresetSpec {
    /// The preset's `config.json`.
    pub fn config_json(&self, bos: u32, eos: u32) -> Value {
        match self {
            PresetSpec::DeepseekV3(s) => s.config_json(bos, eos),
            PresetSpec::KimiK3(s) => s.config_json(bos, eos),
        }
    }

    /// Seed of every tensor and record value.
    pub fn seed(&self) -> u64 {
        match self {
            PresetSpec::DeepseekV3(s) => s.seed,
            PresetSpec::KimiK3(s) => s.seed,
        }
    }
}

/// splitmix64: a small, fast, well-distributed deterministic generator.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes()
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Deterministic values for one tensor: norms ≈ 1, router bias small, matrices uniform with
/// variance ~ gain/fan_in (so activations neither vanish nor explode), all seeded by name.
fn values(name: &str, shape: &[usize], seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed ^ fnv(name));
    let n: usize = shape.iter().product();
    if name.ends_with("A_log") {
        // KDA decay rates: A = exp(A_log) in [1, 16), as the reference initialises them.
        return (0..n).map(|_| (8.5 + 7.5 * rng.uniform()).ln()).collect();
    }
    if name.ends_with("dt_bias") {
        return (0..n).map(|_| 0.5 * rng.uniform()).collect();
    }
    if shape.len() == 1 {
        if name.ends_with("e_score_correction_bias") {
            return (0..n).map(|_| 0.05 * rng.uniform()).collect();
        }
        return (0..n).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
    }
    // Fan-in is the last dimension (conv kernels are [P, 1, K]).
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    let gain = if name.contains("embed_tokens") {
        1.0
    } else if name.ends_with("mlp.gate.weight") || name.ends_with("block_sparse_moe.gate.weight") {
        4.0 / fan_in.sqrt()
    } else {
        (3.0 / fan_in).sqrt() * 1.5
    };
    (0..n).map(|_| gain * rng.uniform()).collect()
}

/// Writes `config.json` and `model.safetensors` (bf16) of a synthetic checkpoint into `dir`.
/// Returns the bytes of weights written.
pub fn write_checkpoint(dir: &Path, spec: &SynthSpec, bos: u32, eos: u32) -> Result<u64, FormatError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let config = spec.config_json(bos, eos);
    let cpath = dir.join("config.json");
    let cfg = ModelConfig::from_value(&config, &cpath)?;
    let mut tensors: Vec<(String, Vec<usize>)> =
        cfg.backbone_tensors().into_iter().map(|t| (t.name, t.shape)).collect();
    for l in cfg.moe_layers() {
        for e in 0..cfg.n_routed_experts() {
            for m in cfg.expert_matrices() {
                let src = cfg.expert_source(l, e, &m);
                tensors.push((src.tensor, src.shape));
            }
        }
    }
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s)| {
            let v = values(&n, &s, spec.seed);
            let bytes: Vec<u8> = v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
                .collect();
            (n, s, bytes)
        })
        .collect();
    let total: u64 = data.iter().map(|d| d.2.len() as u64).sum();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::BF16, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| FormatError::Output {
                    path: dir.into(),
                    message: format!("tensor {n}: {e}"),
                })
        })
        .collect::<Result<_, _>>()?;
    let wpath = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &wpath).map_err(|e| FormatError::Output {
        path: wpath.clone(),
        message: e.to_string(),
    })?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| FormatError::Json {
        path: cpath.clone(),
        message: e.to_string(),
    })?;
    std::fs::write(&cpath, text).map_err(io_err(&cpath))?;
    let gpath = dir.join("generation_config.json");
    std::fs::write(
        &gpath,
        json!({"bos_token_id": bos, "eos_token_id": eos, "do_sample": false}).to_string(),
    )
    .map_err(io_err(&gpath))?;
    Ok(total)
}

/// Names accepted by [`Preset::by_name`].
pub const PRESET_NAMES: &[&str] = &["tiny", "demo", "bench", "k3-tiny", "k3-bench"];

/// How routed-expert records are filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFill {
    /// Random f32 weights (as [`write_checkpoint`] makes them, rounded to bf16) quantized to
    /// MXFP4: byte-identical to `convert` of the same checkpoint, but ~100 MB/s per core.
    Quantized,
    /// Uniformly random E2M1 nibbles with one fixed E8M0 scale per matrix chosen so the weights'
    /// RMS matches [`write_checkpoint`]'s (1.5 / sqrt(fan_in)); generated at GB/s.
    RandomMxfp4,
}

/// A named synthetic model: shape and how its experts are filled.
#[derive(Debug, Clone)]
pub struct Preset {
    pub name: &'static str,
    pub spec: PresetSpec,
    pub fill: ExpertFill,
}

impl Preset {
    /// `tiny` (tests; random MXFP4 records like `bench`), `demo` (the demo's shape and values:
    /// its files equal `deltafin demo`'s converted model), `bench` (see [`SynthSpec::bench`]),
    /// `k3-tiny` and `k3-bench` (Kimi K3 structure, see [`K3SynthSpec`]).
    /// `vocab_size` comes from the tokenizer written beside the model.
    pub fn by_name(name: &str, vocab_size: usize) -> Option<Preset> {
        use PresetSpec::{DeepseekV3, KimiK3};
        let (name, spec, fill) = match name {
            "tiny" => ("tiny", DeepseekV3(SynthSpec::tiny(vocab_size)), ExpertFill::RandomMxfp4),
            "demo" => ("demo", DeepseekV3(SynthSpec::demo(vocab_size)), ExpertFill::Quantized),
            "bench" => (
                "bench",
                DeepseekV3(SynthSpec::bench(vocab_size)),
                ExpertFill::RandomMxfp4,
            ),
            "k3-tiny" => (
                "k3-tiny",
                KimiK3(K3SynthSpec::k3_tiny(vocab_size)),
                ExpertFill::RandomMxfp4,
            ),
            "k3-bench" => (
                "k3-bench",
                KimiK3(K3SynthSpec::k3_bench(vocab_size)),
                ExpertFill::RandomMxfp4,
            ),
            _ => return None,
        };
        Some(Preset { name, spec, fill })
    }
}

/// The tokenizer a synthetic model ships: a directory holding its files (any of
/// [`COPIED_FILES`](crate::manifest::COPIED_FILES)) and the BOS/EOS ids the configs name.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    pub dir: PathBuf,
    pub bos: u32,
    pub eos: u32,
}

/// What [`write_model_dir`] produced.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub backbone_bytes: u64,
    pub expert_pack_bytes: u64,
    pub expert_records: usize,
    /// Bytes of one expert record including alignment padding.
    pub record_stride: u64,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Rounds through bf16, as `convert` sees a bf16 checkpoint written by [`write_checkpoint`].
fn bf16_round(v: &mut [f32]) {
    for x in v {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

/// Writes a deltafin model directory for `preset` at `out_dir` directly: `backbone.bin` (int8
/// matrices, f32 norms and routers, encoded exactly as `convert` encodes [`write_checkpoint`]'s
/// values), `experts.pack` (MXFP4 records filled per the preset's [`ExpertFill`]),
/// `config.json`, `generation_config.json`, the files of `tokenizer.dir` and `manifest.json`
/// last.
///
/// Deterministic: the same arguments give byte-identical files, whatever the thread count
/// (every tensor and record is seeded by its name or (layer, expert), and written in order).
/// Crash-safe like `convert`: built in `.<name>.partial` beside `out_dir`, renamed into place
/// when complete. Pages of `experts.pack` are flushed and dropped from the page cache as it is
/// written, so a 13 GB pack neither fills memory nor leaves a warm cache behind.
///
/// Errors: `out_dir` exists and is not empty without `force`, an invalid spec, or an I/O error
/// (the partial output is then removed).
pub fn write_model_dir(
    out_dir: &Path,
    preset: &Preset,
    tokenizer: &TokenizerFiles,
    force: bool,
    progress: &dyn Progress,
) -> Result<SynthReport, FormatError> {
    let config = preset.spec.config_json(tokenizer.bos, tokenizer.eos);
    let cfg = ModelConfig::from_value(&config, &out_dir.join("config.json"))?;
    crate::staging::write_dir_atomically(out_dir, force, None, |tmp| {
        write_files(tmp, preset, &cfg, config, tokenizer, progress)
    })
}

/// E8M0 scale byte giving uniformly random E2M1 codes an RMS of `1.5 / sqrt(fan_in)`, the RMS of
/// [`write_checkpoint`]'s matrices. The RMS of the 16 E2M1 values is sqrt(68.5 / 8) ≈ 2.93.
fn random_scale_byte(fan_in: usize) -> u8 {
    let target = 1.5 / (fan_in as f64).sqrt() / (68.5f64 / 8.0).sqrt();
    (127.0 + target.log2().round()).clamp(1.0, 254.0) as u8
}

/// Fills one expert record (`rec` is the whole padded stride, zeroed).
fn fill_record(
    rec: &mut [u8],
    layout: &[ExpertTensorLayout],
    fill: ExpertFill,
    seed: u64,
    layer: usize,
    expert: usize,
) {
    match fill {
        ExpertFill::Quantized => {
            for lay in layout {
                let n = format!("model.layers.{layer}.mlp.experts.{expert}.{}.weight", lay.name);
                let mut w = values(&n, &[lay.rows, lay.cols], seed);
                bf16_round(&mut w);
                let b = encode_matrix(StoredDtype::Mxfp4, &w, lay.rows, lay.cols);
                rec[lay.offset as usize..lay.offset as usize + b.len()].copy_from_slice(&b);
            }
        }
        ExpertFill::RandomMxfp4 => {
            let mut rng = Rng(seed ^ (layer as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((expert as u64) << 32));
            for lay in layout {
                let (v0, s0, end) = (
                    lay.offset as usize,
                    lay.scales_offset as usize,
                    (lay.offset + lay.bytes) as usize,
                );
                for chunk in rec[v0..s0].chunks_mut(8) {
                    let r = rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&r[..chunk.len()]);
                }
                rec[s0..end].fill(random_scale_byte(lay.cols));
            }
        }
    }
}

/// Flushes what was written to `f` so far and drops it from the page cache.
fn flush_and_drop_cache(f: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    f.sync_data()?;
    // SAFETY: a valid open descriptor; POSIX_FADV_DONTNEED is advisory and cannot corrupt data.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    Ok(())
}

fn write_files(
    out: &Path,
    preset: &Preset,
    cfg: &ModelConfig,
    config: Value,
    tokenizer: &TokenizerFiles,
    progress: &dyn Progress,
) -> Result<SynthReport, FormatError> {
    use rayon::prelude::*;
    let (spec, fill) = (&preset.spec, preset.fill);
    let (bos, eos, tokenizer_dir) = (tokenizer.bos, tokenizer.eos, tokenizer.dir.as_path());

    let (layout, rec_len) = record_layout(&cfg.expert_matrices(), StoredDtype::Mxfp4);
    let stride = align_up(rec_len, RECORD_ALIGN);
    let moe_layers: Vec<usize> = cfg.moe_layers().collect();
    let n_records = moe_layers.len() * cfg.n_routed_experts();
    // Same storage roles as `convert`: int8 matrices, f32 vectors and routers.
    let table: Vec<(String, Vec<usize>, StoredDtype)> = cfg
        .backbone_tensors()
        .into_iter()
        .map(|t| {
            let d = match t.role {
                TensorRole::F32 => StoredDtype::F32,
                TensorRole::Matrix => StoredDtype::Int8,
            };
            (t.name, t.shape, d)
        })
        .collect();

    // Backbone: encode every tensor in parallel (each seeded by its name), lay out in order.
    let bb_total: u64 = table
        .iter()
        .map(|(_, s, d)| {
            let (r, c) = matrix_dims(s);
            (d.value_bytes(r, c) + d.scale_bytes(r, c)) as u64
        })
        .sum();
    progress.start(bb_total + n_records as u64 * stride);
    let encoded: Vec<(StoredDtype, Vec<u8>)> = table
        .par_iter()
        .map(|(n, shape, dtype)| {
            let dtype = *dtype;
            let (rows, cols) = matrix_dims(shape);
            let mut w = values(n, shape, spec.seed());
            bf16_round(&mut w);
            let bytes = encode_matrix(dtype, &w, rows, cols);
            progress.advance(bytes.len() as u64);
            (dtype, bytes)
        })
        .collect();
    let bb_path = out.join("backbone.bin");
    let mut bb = std::io::BufWriter::with_capacity(8 << 20, File::create(&bb_path).map_err(io_err(&bb_path))?);
    let mut pos = 0u64;
    let mut tensors = std::collections::BTreeMap::new();
    for ((n, shape, _), (dtype, bytes)) in table.iter().zip(&encoded) {
        let off = align_up(pos, TENSOR_ALIGN);
        bb.write_all(&vec![0u8; (off - pos) as usize])
            .map_err(io_err(&bb_path))?;
        bb.write_all(bytes).map_err(io_err(&bb_path))?;
        pos = off + bytes.len() as u64;
        let (rows, cols) = matrix_dims(shape);
        let scales_offset = (*dtype == StoredDtype::Int8).then(|| off + dtype.value_bytes(rows, cols) as u64);
        tensors.insert(
            n.clone(),
            TensorRecord {
                dtype: *dtype,
                shape: shape.clone(),
                offset: off,
                bytes: bytes.len() as u64,
                scales_offset,
                xxh3: tensor_xxh3(bytes),
            },
        );
    }
    drop(encoded);
    let bb_file = bb.into_inner().map_err(|e| io_err(&bb_path)(e.into_error()))?;
    bb_file.sync_all().map_err(io_err(&bb_path))?;
    let backbone_bytes = pos;

    // Expert pack: batches of records generated in parallel, written in (layer, expert) order by
    // a writer thread while the next batch is generated.
    let ep_path = out.join("experts.pack");
    let mut ep = File::create(&ep_path).map_err(io_err(&ep_path))?;
    let keys: Vec<(usize, usize)> = moe_layers
        .iter()
        .flat_map(|&l| (0..cfg.n_routed_experts()).map(move |e| (l, e)))
        .collect();
    // ~128 MiB per batch, at least one record per thread.
    let batch = ((128u64 << 20) / stride).max(rayon::current_num_threads() as u64) as usize;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(Vec<u8>, u64)>>(1);
    let records: Vec<ExpertRecord> = std::thread::scope(|scope| -> Result<Vec<ExpertRecord>, FormatError> {
        let writer = scope.spawn(|| -> Result<Vec<u64>, FormatError> {
            let mut hashes = Vec::with_capacity(n_records);
            let mut since_flush = 0u64;
            for batch in rx {
                for (rec, hash) in batch {
                    ep.write_all(&rec).map_err(io_err(&ep_path))?;
                    hashes.push(hash);
                    since_flush += rec.len() as u64;
                    progress.advance(rec.len() as u64);
                }
                if since_flush >= 512 << 20 {
                    flush_and_drop_cache(&ep).map_err(io_err(&ep_path))?;
                    since_flush = 0;
                }
            }
            flush_and_drop_cache(&ep).map_err(io_err(&ep_path))?;
            Ok(hashes)
        });
        for chunk in keys.chunks(batch) {
            let recs: Vec<(Vec<u8>, u64)> = chunk
                .par_iter()
                .map(|&(l, e)| {
                    let mut rec = vec![0u8; stride as usize];
                    fill_record(&mut rec, &layout, fill, spec.seed(), l, e);
                    let hash = xxhash_rust::xxh3::xxh3_64(&rec[..rec_len as usize]);
                    (rec, hash)
                })
                .collect();
            if tx.send(recs).is_err() {
                break; // the writer failed; its error is returned below
            }
        }
        drop(tx);
        let hashes = writer.join().map_err(|_| FormatError::Output {
            path: ep_path.clone(),
            message: "expert-pack writer thread panicked".into(),
        })??;
        Ok(keys
            .iter()
            .zip(hashes)
            .enumerate()
            .map(|(i, (&(l, e), h))| ExpertRecord {
                layer: l as u32,
                expert: e as u32,
                offset: i as u64 * stride,
                length: rec_len,
                xxh3: format!("{h:016x}"),
            })
            .collect())
    })?;

    // config.json, generation_config.json, tokenizer files.
    let mut tokenizer_files = Vec::new();
    for f in COPIED_FILES {
        let dst = out.join(f);
        match *f {
            "config.json" => {
                let text = serde_json::to_string_pretty(&config).map_err(|e| FormatError::Json {
                    path: dst.clone(),
                    message: e.to_string(),
                })?;
                std::fs::write(&dst, text).map_err(io_err(&dst))?;
            }
            "generation_config.json" => {
                let g = json!({"bos_token_id": bos, "eos_token_id": eos, "do_sample": false});
                std::fs::write(&dst, g.to_string()).map_err(io_err(&dst))?;
            }
            _ => {
                let src = tokenizer_dir.join(f);
                if !src.is_file() {
                    continue;
                }
                std::fs::copy(&src, &dst).map_err(io_err(&dst))?;
            }
        }
        File::open(&dst).and_then(|x| x.sync_all()).map_err(io_err(&dst))?;
        tokenizer_files.push(f.to_string());
    }

    let manifest = Manifest::new(
        cfg,
        config,
        BackboneIndex::new(backbone_bytes, StoredDtype::Int8, tensors),
        ExpertPackIndex::new(n_records as u64 * stride, StoredDtype::Mxfp4, layout, records),
        tokenizer_files,
        None,
    );
    write_manifest(out, &manifest)?;
    progress.finish();
    Ok(SynthReport {
        backbone_bytes,
        expert_pack_bytes: n_records as u64 * stride,
        expert_records: n_records,
        record_stride: stride,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::{convert, ConvertOptions, NoProgress};
    use crate::family::Family;
    use crate::ModelDir;

    /// A quantized synth model equals `convert` of the same synthetic checkpoint, byte for byte.
    #[test]
    fn quantized_synth_equals_convert_of_checkpoint() {
        let t = tempfile::tempdir().unwrap();
        let spec = SynthSpec::tiny(300);
        let hf = t.path().join("hf");
        write_checkpoint(&hf, &spec, 1, 2).unwrap();
        let conv = t.path().join("converted");
        convert(&hf, &conv, &ConvertOptions::default(), &NoProgress).unwrap();
        let syn = t.path().join("synth");
        let empty = t.path().join("no-tokenizer");
        std::fs::create_dir(&empty).unwrap();
        let tok = TokenizerFiles {
            dir: empty,
            bos: 1,
            eos: 2,
        };
        let mut preset = Preset {
            name: "tiny",
            spec: PresetSpec::DeepseekV3(spec.clone()),
            fill: ExpertFill::Quantized,
        };
        let r = write_model_dir(&syn, &preset, &tok, false, &NoProgress).unwrap();
        for f in ["backbone.bin", "experts.pack", "config.json", "generation_config.json"] {
            let (a, b) = (
                std::fs::read(conv.join(f)).unwrap(),
                std::fs::read(syn.join(f)).unwrap(),
            );
            assert!(a == b, "{f} differs");
        }
        let (a, b) = (ModelDir::open(&conv).unwrap(), ModelDir::open(&syn).unwrap());
        assert_eq!(a.manifest.backbone, b.manifest.backbone);
        assert_eq!(a.manifest.experts, b.manifest.experts);
        assert_eq!(r.expert_records, 2 * 8);
        assert!(!t.path().join(".synth.partial").exists());
        // An existing directory needs `force`; with it the model is replaced whole.
        preset.fill = ExpertFill::RandomMxfp4;
        let e = write_model_dir(&syn, &preset, &tok, false, &NoProgress);
        assert!(e.unwrap_err().to_string().contains("--force"));
        write_model_dir(&syn, &preset, &tok, true, &NoProgress).unwrap();
        assert!(ModelDir::open(&syn).unwrap().manifest.experts != a.manifest.experts);
    }

    /// Random MXFP4 records hold valid scales of the intended magnitude, and the bench preset
    /// meets the shape requirements.
    #[test]
    fn random_records_and_bench_shape() {
        assert_eq!(random_scale_byte(2048), 121);
        assert_eq!(random_scale_byte(1024), 121);
        let cfg_json = SynthSpec::bench(300).config_json(1, 2);
        let cfg = crate::DeepseekV3Config::from_value(&cfg_json, Path::new("bench")).unwrap();
        let (layout, len) = record_layout(&cfg.expert_matrices(), StoredDtype::Mxfp4);
        assert!(len >= 2 << 20, "record {len} bytes");
        assert!(cfg.num_experts_per_tok >= 8 && cfg.n_group > 1 && cfg.q_lora_rank.is_some());
        let moe = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).count() as u64;
        let pack = moe * cfg.n_routed_experts as u64 * align_up(len, RECORD_ALIGN);
        assert!(pack >= 12 << 30, "pack {pack} bytes");
        // One third of the pack exceeds a 4 GiB memory limit (the target condition).
        assert!(pack / 3 > 4 << 30);
        let mut rec = vec![0u8; align_up(len, RECORD_ALIGN) as usize];
        fill_record(&mut rec, &layout, ExpertFill::RandomMxfp4, 1, 1, 0);
        for lay in &layout {
            let s = &rec[lay.scales_offset as usize..(lay.offset + lay.bytes) as usize];
            assert!(s.iter().all(|&b| b == 121));
        }
        assert!(rec[len as usize..].iter().all(|&b| b == 0), "padding must be zero");
    }
}
