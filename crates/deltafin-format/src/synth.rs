//! Deterministic synthetic Hugging Face checkpoints of the DeepSeek-V3 architecture (random
//! weights, real layout), for the embedded demo and for tests. Their text output is meaningless.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::convert::{backbone_names_and_shapes, expert_matrices};
use crate::{DeepseekV3Config, FormatError};

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
    if shape.len() == 1 {
        if name.ends_with("e_score_correction_bias") {
            return (0..n).map(|_| 0.05 * rng.uniform()).collect();
        }
        return (0..n).map(|_| 1.0 + 0.1 * rng.uniform()).collect();
    }
    let fan_in = shape[1] as f32;
    let gain = if name.contains("embed_tokens") {
        1.0
    } else if name.ends_with("mlp.gate.weight") {
        4.0 / fan_in.sqrt()
    } else {
        (3.0 / fan_in).sqrt() * 1.5
    };
    (0..n).map(|_| gain * rng.uniform()).collect()
}

/// Writes `config.json` and `model.safetensors` (bf16) of a synthetic checkpoint into `dir`.
/// Returns the bytes of weights written.
pub fn write_checkpoint(dir: &Path, spec: &SynthSpec, bos: u32, eos: u32) -> Result<u64, FormatError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e: std::io::Error| FormatError::Io {
            path: p.clone(),
            error: e,
        }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config = spec.config_json(bos, eos);
    let cpath = dir.join("config.json");
    let cfg = DeepseekV3Config::from_value(&config, &cpath)?;
    let mut tensors: Vec<(String, Vec<usize>)> = backbone_names_and_shapes(&cfg);
    for l in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for e in 0..cfg.n_routed_experts {
            for (m, r, c) in expert_matrices(&cfg) {
                tensors.push((format!("model.layers.{l}.mlp.experts.{e}.{m}.weight"), vec![r, c]));
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
    std::fs::write(&cpath, text).map_err(io(&cpath))?;
    let gpath = dir.join("generation_config.json");
    std::fs::write(
        &gpath,
        json!({"bos_token_id": bos, "eos_token_id": eos, "do_sample": false}).to_string(),
    )
    .map_err(io(&gpath))?;
    Ok(total)
}
