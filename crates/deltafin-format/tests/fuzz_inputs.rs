//! Seeded, bounded fuzzers of the two untrusted JSON inputs (issue #19): `config.json` through
//! the config parser and what `deltafin info` computes from it, and `manifest.json` through the
//! model-directory loader and every backbone view. Each mutates real files (the test fixtures
//! of every family, a converted model directory) with values no model has, and asserts that
//! nothing panics and that every error is one line. They run in CI as ordinary tests and take a
//! few seconds in release mode.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::family::TensorRole;
use deltafin_format::footprint::Footprint;
use deltafin_format::{ModelConfig, ModelDir};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Values no sane field holds, and some that are just at a bound.
fn hostile(rng: &mut StdRng) -> Value {
    let all = [
        json!(0),
        json!(1),
        json!(2),
        json!(-1),
        json!(4096),
        json!(4097),
        json!(65537),
        json!(1u64 << 20),
        json!((1u64 << 20) + 1),
        json!(u32::MAX),
        json!(1u64 << 32),
        json!(1u64 << 40),
        json!(1u64 << 63),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1e39),
        json!(-1e39),
        json!(1e308),
        json!(1e-300),
        json!(0.5),
        json!(-0.0),
        json!(3.5),
        json!("x"),
        json!(""),
        json!(null),
        json!(true),
        json!([]),
        json!([0, 1, 99]),
        json!([-1]),
        json!({}),
        json!({"type": "yarn", "factor": 0}),
        json!({"rope_type": "yarn", "original_max_position_embeddings": 0}),
        json!({"rope_type": "longrope"}),
        json!(["full_attention", "linear_attention"]),
        json!(["sliding_attention"]),
    ];
    all[rng.random_range(0..all.len())].clone()
}

/// Keys worth adding to a config: fields of every family and their transformers aliases.
const KEYS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "num_experts_per_token",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "routed_scaling_factor",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "mlp_only_layers",
    "decoder_sparse_step",
    "partial_rotary_factor",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_conv_kernel_dim",
    "full_attention_interval",
    "linear_attn_config",
    "text_config",
    "eos_token_id",
    "model_type",
];

/// Every path (object keys and array indices) of `v`, root excluded.
fn paths(v: &Value, prefix: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    match v {
        Value::Object(o) => {
            for (k, x) in o {
                prefix.push(json!(k));
                out.push(prefix.clone());
                paths(x, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                prefix.push(json!(i));
                out.push(prefix.clone());
                paths(x, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match k {
        Value::String(s) => &mut v[s.as_str()],
        Value::Number(n) => &mut v[n.as_u64().unwrap_or(0) as usize],
        _ => v,
    })
}

/// One to three mutations of `v`: a value replaced, a key removed, or a known key added (at the
/// top or in the text config) with a hostile value.
fn mutate(rng: &mut StdRng, v: &mut Value, keys: &[&str]) {
    for _ in 0..rng.random_range(1..=3) {
        let mut all = Vec::new();
        paths(v, &mut Vec::new(), &mut all);
        match rng.random_range(0..4) {
            0 | 1 if !all.is_empty() => {
                let p = &all[rng.random_range(0..all.len())];
                *at(v, p) = hostile(rng);
            }
            2 if !all.is_empty() => {
                let p = &all[rng.random_range(0..all.len())];
                let (last, parent) = p.split_last().unwrap_or((&Value::Null, &[]));
                if let (Some(o), Some(k)) = (at(v, parent).as_object_mut(), last.as_str()) {
                    o.remove(k);
                }
            }
            _ => {
                let k = keys[rng.random_range(0..keys.len())];
                let target = if v.get("text_config").is_some_and(Value::is_object) && rng.random_bool(0.5) {
                    &mut v["text_config"]
                } else {
                    &mut *v
                };
                if target.is_object() {
                    target[k] = hostile(rng);
                }
            }
        }
    }
}

/// Runs `f`, failing the test on a panic; returns its error text, asserting it is one line.
fn no_panic_one_line(what: &str, input: &Value, f: impl FnOnce() -> Result<(), String>) -> bool {
    let r = catch_unwind(AssertUnwindSafe(f));
    let Ok(r) = r else {
        panic!("{what} panicked on:\n{input}");
    };
    if let Err(e) = r {
        assert!(!e.contains('\n'), "{what}: a multi-line error:\n{e}\non:\n{input}");
        return false;
    }
    true
}

/// Runs `check` on `n` mutants of `base(i)` ([`mutate`] with `keys`, one generator seeded with
/// `seed`), each through [`no_panic_one_line`] (`what` names the check); returns how many it
/// accepted and how many it refused.
fn fuzz(
    what: &str,
    n: usize,
    seed: u64,
    keys: &[&str],
    base: impl Fn(usize) -> Value,
    check: impl Fn(&Value) -> Result<(), String>,
) -> (usize, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut accepted = 0;
    for i in 0..n {
        let mut v = base(i);
        mutate(&mut rng, &mut v, keys);
        if no_panic_one_line(what, &v, || check(&v)) {
            accepted += 1;
        }
    }
    (accepted, n - accepted)
}

fn fixture_configs() -> Vec<Value> {
    let mut out = Vec::new();
    for family in std::fs::read_dir(fixtures()).unwrap() {
        let family = family.unwrap().path();
        let Ok(cases) = std::fs::read_dir(&family) else {
            continue;
        };
        for case in cases {
            let p = case.unwrap().path().join("config.json");
            if let Ok(b) = std::fs::read(&p) {
                out.push(serde_json::from_slice(&b).unwrap());
            }
        }
    }
    assert!(
        out.len() >= 6,
        "fixture configs not found under {}",
        fixtures().display()
    );
    out
}

/// `config.json` mutations through [`ModelConfig::from_value`] and what `info` computes from a
/// config that parses (its footprint, tensor tables and expert sources): no panic, one-line
/// errors. Some mutants must still parse, or the fuzzer would only exercise the first check.
#[test]
fn fuzzed_configs_never_panic() {
    let bases = fixture_configs();
    let base = |i: usize| bases[i % bases.len()].clone();
    let (parsed, refused) = fuzz("config parsing", 4000, 19, KEYS, base, |v| {
        let c = ModelConfig::from_value(v, Path::new("config.json")).map_err(|e| e.to_string())?;
        let f = Footprint::of(&c);
        let _ = f.seconds_per_token(1e9);
        let mats = c.expert_matrices();
        for l in c.moe_layers().take(2) {
            for m in &mats {
                let _ = c.expert_source(l, c.n_routed_experts() - 1, m);
            }
        }
        let _ = (c.backbone_tensors().len(), c.max_experts_per_tok(), c.eos_token_id());
        // What a manifest stores must read back.
        let back: ModelConfig =
            serde_json::from_value(serde_json::to_value(&c).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        assert_eq!(back, c, "manifest round trip");
        Ok(())
    });
    assert!(parsed > 200 && refused > 1000, "{parsed} parsed, {refused} refused");
}

/// `manifest.json` mutations of a converted model through [`ModelDir::open`] and, when it
/// opens, [`ModelDir::load_backbone`] and a view of every resident tensor and record: no panic,
/// one-line errors.
#[test]
fn fuzzed_manifests_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    convert(
        &fixtures().join("deepseek_v3/dsv3_a"),
        &dir,
        &ConvertOptions::default(),
        &NoProgress,
    )
    .unwrap();
    let mpath = dir.join("manifest.json");
    let original: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    // The keys of the manifest (and its config) to add, beside the generic ones.
    let mut keys: Vec<&str> = KEYS.to_vec();
    keys.extend([
        "record_align",
        "bytes",
        "offset",
        "length",
        "shape",
        "scales_offset",
        "layout",
    ]);
    let (opened, refused) = fuzz(
        "model directory loading",
        1500,
        4,
        &keys,
        |_| original.clone(),
        |v| {
            std::fs::write(&mpath, serde_json::to_vec(v).unwrap()).unwrap();
            let d = ModelDir::open(&dir).map_err(|e| e.to_string())?;
            let bb = d.load_backbone().map_err(|e| e.to_string())?;
            for t in d.manifest.config.backbone_tensors() {
                match t.role {
                    TensorRole::Matrix => bb.matrix(&t.name).map(|_| ()),
                    TensorRole::F32 => bb.f32_tensor(&t.name).map(|_| ()),
                }
                .map_err(|e| e.to_string())?;
            }
            for l in d.manifest.config.moe_layers() {
                let r = d.record(l, d.manifest.config.n_routed_experts() - 1);
                assert!(r.offset + r.length <= d.manifest.experts.bytes);
            }
            Ok(())
        },
    );
    assert!(opened > 50 && refused > 500, "{opened} opened, {refused} refused");
    std::fs::write(&mpath, serde_json::to_vec(&original).unwrap()).unwrap();
    ModelDir::open(&dir).unwrap();
}
