//! The bench report: every run's ids checked, then each metric's median and spread per
//! configuration, the floor and the time split, as the JSON `--json` writes.

use super::*;

/// Median, min and max (median of an even count: mean of the two middle values).
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

pub(super) fn spread(mut v: Vec<f64>) -> Option<Spread> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: v[0],
        max: v[n - 1],
    })
}

/// Checks that every run of a configuration produced the same ids, that all configurations with
/// the model's routing agree with each other, and with `expected` when given. Returns the ids of
/// the equivalent configurations (or of the first configuration if none is equivalent).
pub(super) fn verify_ids(configs: &[Config], runs: &[Run], expected: Option<&[u32]>) -> Result<Vec<u32>> {
    let mut problems = Vec::new();
    let mut per_config: Vec<Option<&[u32]>> = vec![None; configs.len()];
    for r in runs {
        let ids = r.stats.generated_ids.as_slice();
        match per_config[r.config] {
            None => per_config[r.config] = Some(ids),
            Some(first) if first != ids => problems.push(format!(
                "{} run {} generated {:?}, its run 1 generated {:?}",
                configs[r.config].name,
                r.index + 1,
                ids,
                first
            )),
            _ => {}
        }
    }
    let equivalent = |ci: usize| runs.iter().any(|r| r.config == ci && !r.stats.non_default_routing);
    let mut reference: Option<(usize, &[u32])> = None;
    for (ci, ids) in per_config.iter().enumerate() {
        let Some(ids) = *ids else { continue };
        if !equivalent(ci) {
            continue;
        }
        match reference {
            None => reference = Some((ci, ids)),
            Some((rc, rids)) if rids != ids => problems.push(format!(
                "configuration {} generated {:?} but {} generated {:?} (both claim the model's routing)",
                configs[ci].name, ids, configs[rc].name, rids
            )),
            _ => {}
        }
        if let Some(exp) = expected {
            if exp != ids {
                problems.push(format!(
                    "configuration {} generated {:?}, --expected-ids says {:?}",
                    configs[ci].name, ids, exp
                ));
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "generated ids differ, so no timing is reported:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(reference
        .map(|(_, ids)| ids)
        .or(per_config.first().copied().flatten())
        .unwrap_or_default()
        .to_vec())
}

pub(super) fn build_report(
    a: &BenchArgs,
    dir: &deltafin_format::ModelDir,
    configs: &[Config],
    runs: &[Run],
    floor: Option<&(f64, String)>,
    reference: &[u32],
    budget: Option<u64>,
) -> Value {
    let m = &dir.manifest;
    let rec = m.experts.records.first().map(|r| r.length).unwrap_or(0);
    let summaries: Vec<Value> = configs
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let rs: Vec<&Run> = runs.iter().filter(|r| r.config == ci).collect();
            let col = |f: &dyn Fn(&Run) -> Option<f64>| spread(rs.iter().filter_map(|r| f(r)).collect());
            let steady = col(&|r| r.stats.steady_decode_tokens_per_s);
            let s_per_tok = col(&|r| r.stats.steady_decode_tokens_per_s.map(|x| 1.0 / x));
            let demand = col(&|r| r.stats.demand_bytes_per_token());
            let spec = col(&|r| {
                let n = r.stats.generated_ids.len().max(1) as f64;
                Some(r.stats.expert_bytes_read_speculative as f64 / n)
            });
            let floor_s = match (floor, demand) {
                (Some((bw, _)), Some(d)) => Some(d.median / bw),
                _ => None,
            };
            let ratio = match (floor_s, s_per_tok) {
                (Some(f), Some(s)) if f > 0.0 => Some(s.median / f),
                _ => None,
            };
            let first = rs.first().map(|r| &r.stats);
            json!({
                "name": c.name,
                "args": c.args,
                "equivalent": !rs.iter().any(|r| r.stats.non_default_routing),
                "io_mode": first.and_then(|s| s.io_mode.clone()),
                "cache_policy": first.and_then(|s| s.cache_policy.clone()),
                "prefetch": first.and_then(|s| s.prefetch),
                "batch_form": first.and_then(|s| s.batch_form.clone()),
                "experts_per_token": first.and_then(|s| s.experts_per_token),
                "ram_budget": first.and_then(|s| s.ram_budget),
                "steady_decode_tokens_per_s": steady,
                "seconds_per_token": s_per_tok,
                "ttft_s": col(&|r| Some(r.stats.ttft_s)),
                "prefill_tokens_per_s": col(&|r| Some(r.stats.prefill_tokens_per_s)),
                "demand_bytes_per_token": demand,
                "speculative_bytes_per_generated_token": spec,
                "hit_rate": col(&|r| Some(r.stats.hit_rate)),
                "peak_rss_bytes": col(&|r| r.stats.peak_rss_bytes.map(|x| x as f64)),
                "cgroup_peak_bytes": col(&|r| r.cgroup.as_ref().and_then(|c| c["peak_bytes"].as_f64())),
                "step_io_wait_s": col(&|r| r.stats.steady_mean(|s| s.io_wait_s)),
                "step_expert_compute_s": col(&|r| r.stats.steady_mean(|s| s.expert_compute_s)),
                "step_attention_s": col(&|r| r.stats.steady_mean(|s| s.attention_s)),
                "step_other_s": col(&|r| r.stats.steady_mean(|s| s.other_s)),
                "storage_floor_s_per_token": floor_s,
                "seconds_per_token_over_floor": ratio,
                "wall_s": col(&|r| Some(r.wall_s)),
            })
        })
        .collect();
    json!({
        "model": a.model.canonicalize().unwrap_or_else(|_| a.model.to_path_buf()),
        "model_shape": {
            "layers": m.config.num_hidden_layers(),
            "routed_experts": m.config.n_routed_experts(),
            "top_k": m.config.num_experts_per_tok(),
            "expert_record_bytes": rec,
            "expert_pack_bytes": m.experts.bytes,
            "backbone_bytes": m.backbone.bytes,
        },
        "machine": machine(),
        "protocol": {
            "runs_per_config": a.runs,
            "new_tokens": a.new_tokens,
            "prompt": a.prompt,
            "prompt_ids": a.prompt_ids,
            "order": balanced_order(configs.len(), a.runs).iter().map(|&(c, _)| configs[c].name.clone()).collect::<Vec<_>>(),
            "memory_limit_bytes": a.memory_limit,
            "ram_budget_bytes": budget,
            "cold_cache": a.memory_limit.is_some() || a.drop_caches,
            "steady_rate": "decode steps after the first",
        },
        "floor": floor.map(|(bw, src)| json!({"bandwidth_bytes_per_s": bw, "source": src})),
        "ids_verified": true,
        "generated_ids": reference,
        "expected_ids": a.expected_ids,
        "configs": summaries,
        "runs": runs.iter().map(|r| json!({
            "config": configs[r.config].name,
            "index": r.index,
            "position": r.position,
            "wall_s": r.wall_s,
            "cgroup": r.cgroup,
            "stats": r.stats,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads() {
        let s = spread(vec![3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        assert!(spread(vec![]).is_none());
    }
}
