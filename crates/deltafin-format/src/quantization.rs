//! `quantization_config` of a source checkpoint's `config.json`: which quantized source format
//! its tensors use and with which parameters (the decoders are in [`crate::source_dtypes`]).
//!
//! Two methods are read:
//! - `quant_method: "fp8"` (DeepSeek-V3, Kimi K2): `weight_block_size` `[bm, bn]` of the block
//!   FP8 weights, `fmt` `"e4m3"` when present.
//! - `quant_method: "compressed-tensors"` (Kimi K2 Thinking / K2.5, Kimi K3): `format`
//!   (`pack-quantized`, `mxfp4-pack-quantized`, or `mixed-precision` with a `format` per group),
//!   `config_groups` (each with `targets` and `weights`: `num_bits`, `type`, `strategy`,
//!   `group_size`, `symmetric`) and `ignore`.
//!
//! Module matching `[CT_MATCH]` follows compressed-tensors `utils/match.py` (`match_name`,
//! `is_match`, `match_targets`): a target `re:<pattern>` matches a module name when the pattern
//! matches at its start (Python `re.match`); any other target matches a module whose name equals
//! it, or whose class has that name. Checkpoints carry no classes, so of the class targets only
//! `Linear` is recognized, and it matches every module stored with `weight_packed` (a quantized
//! linear layer's weight). A module matched by `ignore` is not quantized; when several groups
//! match, the one matched most specifically wins (exact name, then regex, then class). `re:`
//! patterns follow Python's `re` (fancy-regex: look-behind as in Kimi K3's `ignore` list).

use std::path::Path;

use serde_json::Value;

use crate::FormatError;

/// Quantization of a source checkpoint, from `config.json`'s `quantization_config`.
#[derive(Debug, Clone)]
pub enum SourceQuantization {
    /// DeepSeek block FP8: `[bm, bn]` = `weight_block_size` (rows, columns of a block).
    BlockFp8 { block: [usize; 2] },
    /// compressed-tensors.
    CompressedTensors(CompressedTensorsConfig),
}

/// The parts of a compressed-tensors `quantization_config` that decide how a weight decodes.
#[derive(Debug, Clone)]
pub struct CompressedTensorsConfig {
    /// Top-level `format`.
    pub format: String,
    /// `config_groups`, in file order.
    pub groups: Vec<CtGroup>,
    /// `ignore`: modules left unquantized.
    pub ignore: Vec<Target>,
}

/// One entry of `config_groups`.
#[derive(Debug, Clone)]
pub struct CtGroup {
    /// Key in `config_groups` (`group_0` ...).
    pub name: String,
    pub targets: Vec<Target>,
    /// The group's own `format`, else the top-level one.
    pub format: String,
    pub weights: CtWeights,
}

/// `config_groups.<g>.weights`.
#[derive(Debug, Clone, PartialEq)]
pub struct CtWeights {
    pub num_bits: u32,
    /// `int` or `float`.
    pub kind: String,
    /// `group`, `channel`, `tensor`, `block`, `tensor_group` ...
    pub strategy: String,
    pub group_size: Option<usize>,
    pub symmetric: bool,
}

/// A `targets` / `ignore` entry `[CT_MATCH]`.
#[derive(Debug, Clone)]
pub enum Target {
    /// A module name or a class name.
    Name(String),
    /// `re:<pattern>`, anchored at the start of the module name.
    Regex { source: String, re: fancy_regex::Regex },
}

/// How specifically a target matched a module; lower is more specific.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum MatchKind {
    Exact,
    Regex,
    Class,
}

impl Target {
    fn parse(s: &str) -> Result<Target, String> {
        match s.strip_prefix("re:") {
            Some(p) => {
                let re = fancy_regex::Regex::new(&format!("^(?:{p})")).map_err(|e| format!("regex {p:?}: {e}"))?;
                Ok(Target::Regex {
                    source: s.to_string(),
                    re,
                })
            }
            None => Ok(Target::Name(s.to_string())),
        }
    }

    /// Whether this target matches a quantized linear module called by any of `names`.
    fn matches(&self, names: &[&str]) -> Option<MatchKind> {
        match self {
            Target::Name(n) if names.contains(&n.as_str()) => Some(MatchKind::Exact),
            Target::Name(n) if n == "Linear" => Some(MatchKind::Class),
            Target::Name(_) => None,
            // Python's `re` semantics (look-around included, as in Kimi K3's `ignore` pattern); a
            // match that exceeds the backtracking limit counts as no match.
            Target::Regex { re, .. } => names
                .iter()
                .any(|m| re.is_match(m).unwrap_or(false))
                .then_some(MatchKind::Regex),
        }
    }

    /// The target as written in the config.
    pub fn as_str(&self) -> &str {
        match self {
            Target::Name(n) => n,
            Target::Regex { source, .. } => source,
        }
    }
}

impl CompressedTensorsConfig {
    /// The group that quantizes the linear module called `names` (its name in the file, and
    /// without a `language_model.` prefix) `[CT_MATCH]`.
    ///
    /// Errors (one line naming the module): the module is in `ignore`, no group targets it, or
    /// two groups target it equally specifically.
    pub fn group_for(&self, names: &[&str]) -> Result<&CtGroup, String> {
        let module = names.first().copied().unwrap_or("");
        if let Some(t) = self.ignore.iter().find(|t| t.matches(names).is_some()) {
            return Err(format!(
                "module {module} is stored quantized but quantization_config.ignore lists it ({})",
                t.as_str()
            ));
        }
        let mut best: Option<(MatchKind, &CtGroup)> = None;
        let mut tie: Option<&CtGroup> = None;
        for g in &self.groups {
            let Some(k) = g.targets.iter().filter_map(|t| t.matches(names)).min() else {
                continue;
            };
            match best {
                Some((bk, _)) if k > bk => {}
                Some((bk, _)) if k == bk => tie = Some(g),
                _ => {
                    best = Some((k, g));
                    tie = None;
                }
            }
        }
        match (best, tie) {
            (None, _) => Err(format!(
                "module {module} is stored quantized but no quantization_config.config_groups entry targets it"
            )),
            (Some((_, g)), Some(t)) => Err(format!(
                "module {module} is targeted equally by config_groups {} and {}",
                g.name, t.name
            )),
            (Some((_, g)), None) => Ok(g),
        }
    }
}

impl SourceQuantization {
    /// Reads `quantization_config` (top level, else inside `text_config`) of a parsed
    /// `config.json` at `path`. `Ok(None)` when there is none.
    ///
    /// Errors: a `quant_method` other than `fp8` / `compressed-tensors`, or a field missing or of
    /// the wrong type (named as `quantization_config.<field>`).
    pub fn from_config(raw: &Value, path: &Path) -> Result<Option<SourceQuantization>, FormatError> {
        let q = match raw
            .get("quantization_config")
            .or_else(|| raw.get("text_config").and_then(|t| t.get("quantization_config")))
        {
            None | Some(Value::Null) => return Ok(None),
            Some(q) => q,
        };
        let err = |field: &str, message: String| FormatError::Config {
            path: path.to_path_buf(),
            field: format!("quantization_config.{field}"),
            message,
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        match method {
            "fp8" => {
                if let Some(f) = q.get("fmt").and_then(Value::as_str) {
                    if f != "e4m3" {
                        return Err(err("fmt", format!("{f:?}: only e4m3 block FP8 is supported")));
                    }
                }
                let b = q
                    .get("weight_block_size")
                    .and_then(Value::as_array)
                    .ok_or_else(|| err("weight_block_size", "missing: needed to read block FP8 weights".into()))?;
                let dims: Vec<usize> = b
                    .iter()
                    .map(|v| v.as_u64().filter(|&x| x > 0).map(|x| x as usize))
                    .collect::<Option<_>>()
                    .filter(|d: &Vec<usize>| d.len() == 2)
                    .ok_or_else(|| err("weight_block_size", format!("{b:?}: expected two positive integers")))?;
                Ok(Some(SourceQuantization::BlockFp8 {
                    block: [dims[0], dims[1]],
                }))
            }
            "compressed-tensors" => {
                let format = q.get("format").and_then(Value::as_str).unwrap_or("").to_string();
                let targets = |v: Option<&Value>, field: &str| -> Result<Vec<Target>, FormatError> {
                    match v {
                        None | Some(Value::Null) => Ok(Vec::new()),
                        Some(Value::Array(a)) => a
                            .iter()
                            .map(|t| {
                                t.as_str()
                                    .ok_or_else(|| err(field, format!("{t}: expected a string")))
                                    .and_then(|s| Target::parse(s).map_err(|m| err(field, m)))
                            })
                            .collect(),
                        Some(other) => Err(err(field, format!("{other}: expected a list of strings"))),
                    }
                };
                let ignore = targets(q.get("ignore"), "ignore")?;
                let cg = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .ok_or_else(|| err("config_groups", "missing or not an object".into()))?;
                let mut groups = Vec::new();
                for (name, g) in cg {
                    let field = |f: &str| format!("config_groups.{name}.{f}");
                    let w = g
                        .get("weights")
                        .filter(|w| w.is_object())
                        .ok_or_else(|| err(&field("weights"), "missing: only weight quantization is read".into()))?;
                    let num_bits = w
                        .get("num_bits")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| err(&field("weights.num_bits"), "missing or not an integer".into()))?
                        as u32;
                    let group_size = match w.get("group_size") {
                        None | Some(Value::Null) => None,
                        Some(v) => Some(
                            v.as_u64()
                                .ok_or_else(|| err(&field("weights.group_size"), format!("{v}: not an integer")))?
                                as usize,
                        ),
                    };
                    groups.push(CtGroup {
                        name: name.clone(),
                        targets: targets(g.get("targets"), &field("targets"))?,
                        format: g.get("format").and_then(Value::as_str).unwrap_or(&format).to_string(),
                        weights: CtWeights {
                            num_bits,
                            kind: w.get("type").and_then(Value::as_str).unwrap_or("int").to_string(),
                            strategy: w
                                .get("strategy")
                                .and_then(Value::as_str)
                                .unwrap_or("tensor")
                                .to_string(),
                            group_size,
                            symmetric: w.get("symmetric").and_then(Value::as_bool).unwrap_or(true),
                        },
                    });
                }
                Ok(Some(SourceQuantization::CompressedTensors(CompressedTensorsConfig {
                    format,
                    groups,
                    ignore,
                })))
            }
            other => Err(err(
                "quant_method",
                format!("{other:?} is not supported (fp8 block FP8, compressed-tensors)"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ct(q: Value) -> CompressedTensorsConfig {
        match SourceQuantization::from_config(&json!({ "quantization_config": q }), Path::new("config.json")) {
            Ok(Some(SourceQuantization::CompressedTensors(c))) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reads_deepseek_fp8_block_size() {
        let raw = json!({"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
            "quant_method": "fp8", "weight_block_size": [128, 64]}});
        match SourceQuantization::from_config(&raw, Path::new("c.json")).unwrap() {
            Some(SourceQuantization::BlockFp8 { block }) => assert_eq!(block, [128, 64]),
            other => panic!("{other:?}"),
        }
        let raw = json!({"quantization_config": {"quant_method": "fp8"}});
        let e = SourceQuantization::from_config(&raw, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("quantization_config.weight_block_size"), "{e}");
        let raw = json!({"quantization_config": {"quant_method": "gptq"}});
        let e = SourceQuantization::from_config(&raw, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gptq"), "{e}");
        assert!(SourceQuantization::from_config(&json!({}), Path::new("c.json"))
            .unwrap()
            .is_none());
    }

    #[test]
    fn groups_are_chosen_by_targets_and_ignore_wins() {
        let c = ct(json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                    "strategy": "group", "group_size": 32, "symmetric": true}},
                "group_1": {"targets": ["re:.*mlp\\.experts\\.0\\..*"], "weights": {"num_bits": 8,
                    "type": "int", "strategy": "channel", "symmetric": true}},
                "group_2": {"targets": ["model.layers.1.mlp.experts.0.up_proj"], "weights": {"num_bits": 4,
                    "type": "int", "strategy": "group", "group_size": 128, "symmetric": true}}
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
        }));
        let g = |n: &str| c.group_for(&[n]).map(|g| g.name.clone());
        assert_eq!(g("model.layers.1.mlp.experts.3.down_proj").unwrap(), "group_0");
        assert_eq!(g("model.layers.1.mlp.experts.0.down_proj").unwrap(), "group_1");
        assert_eq!(g("model.layers.1.mlp.experts.0.up_proj").unwrap(), "group_2");
        // re: is anchored at the start only (Python re.match), so `.*` is needed to skip a prefix.
        let e = g("model.layers.0.self_attn.q_a_proj").unwrap_err();
        assert!(e.contains("ignore") && e.contains("re:.*self_attn.*"), "{e}");
        assert!(g("model.layers.0.mlp.gate_proj").unwrap_err().contains("ignore"));
        assert!(g("lm_head").unwrap_err().contains("lm_head"));
        let c2 = ct(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["re:experts"], "weights": {"num_bits": 4}}}}));
        let e = c2.group_for(&["model.layers.1.mlp.experts.0.up_proj"]).unwrap_err();
        assert!(e.contains("no quantization_config.config_groups"), "{e}");
        assert!(c2.group_for(&["experts.0"]).is_ok());
        let c3 = ct(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"a": {"targets": ["Linear"], "weights": {"num_bits": 4}},
                              "b": {"targets": ["Linear"], "weights": {"num_bits": 8}}}}));
        assert!(c3.group_for(&["x"]).unwrap_err().contains("equally"));
    }

    #[test]
    fn malformed_compressed_tensors_fields_are_named() {
        let raw = json!({"quantization_config": {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"targets": ["re:(unclosed"], "weights": {"num_bits": 4}}}}});
        let e = SourceQuantization::from_config(&raw, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("config_groups.group_0.targets"), "{e}");
        let raw = json!({"quantization_config": {"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": "four"}}}}});
        let e = SourceQuantization::from_config(&raw, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("weights.num_bits"), "{e}");
    }
}
