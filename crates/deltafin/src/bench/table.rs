//! The bench report as the table `deltafin bench` prints.

use super::*;

/// `x` with about four significant digits (0.000123, 0.0123, 1.234, 123.4, 12345).
fn sig(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 9) as usize;
    format!("{x:.digits$}")
}

fn fmt_spread(v: &Value, scale: f64) -> String {
    let g = |k: &str| v[k].as_f64().map(|x| x * scale);
    match (g("median"), g("min"), g("max")) {
        (Some(m), Some(lo), Some(hi)) => format!("{} [{}–{}]", sig(m), sig(lo), sig(hi)),
        _ => "n/a".into(),
    }
}

/// A table row: its label and how to format one configuration's summary.
type Row<'a> = (&'a str, Box<dyn Fn(&Value) -> String>);

/// A row's format: the spread of summary field `key`, times `scale`, as [`fmt_spread`] writes it.
fn spread(key: &'static str, scale: f64) -> Box<dyn Fn(&Value) -> String> {
    Box::new(move |c: &Value| fmt_spread(&c[key], scale))
}

/// A row's format: summary field `key` with about four significant digits, or `absent`.
fn single(key: &'static str, absent: &'static str) -> Box<dyn Fn(&Value) -> String> {
    Box::new(move |c: &Value| c[key].as_f64().map(sig).unwrap_or_else(|| absent.into()))
}

pub(super) fn print_table(report: &Value, configs: &[Config]) {
    let cs = report["configs"].as_array().cloned().unwrap_or_default();
    let mib = 1.0 / (1u64 << 20) as f64;
    let rows: Vec<Row> = vec![
        ("steady decode tok/s", spread("steady_decode_tokens_per_s", 1.0)),
        ("seconds per token", spread("seconds_per_token", 1.0)),
        ("time to first token s", spread("ttft_s", 1.0)),
        ("prefill tok/s", spread("prefill_tokens_per_s", 1.0)),
        ("demand MiB/token", spread("demand_bytes_per_token", mib)),
        (
            "speculative MiB/token (run)",
            spread("speculative_bytes_per_generated_token", mib),
        ),
        ("cache hit rate %", spread("hit_rate", 100.0)),
        (
            "storage floor s/token",
            single("storage_floor_s_per_token", "n/a (no --floor-bandwidth)"),
        ),
        ("s/token ÷ floor", single("seconds_per_token_over_floor", "n/a")),
        ("step: io wait s", spread("step_io_wait_s", 1.0)),
        ("step: expert compute s", spread("step_expert_compute_s", 1.0)),
        ("step: attention s", spread("step_attention_s", 1.0)),
        ("step: other s", spread("step_other_s", 1.0)),
        ("peak RSS MiB", spread("peak_rss_bytes", mib)),
        ("cgroup peak MiB (+cache)", spread("cgroup_peak_bytes", mib)),
        (
            "io / cache / prefetch",
            Box::new(|c: &Value| {
                format!(
                    "{} / {} {} / {}",
                    c["io_mode"].as_str().unwrap_or("?"),
                    c["cache_policy"].as_str().unwrap_or("?"),
                    c["ram_budget"].as_u64().map(size::human).unwrap_or_default(),
                    c["prefetch"]
                        .as_bool()
                        .map(|b| if b { "on" } else { "off" })
                        .unwrap_or("?")
                )
            }),
        ),
        (
            "routing",
            Box::new(|c: &Value| {
                let form = match c["batch_form"].as_str() {
                    Some(f) if f != "exact" => format!(", {f} batched MLA (not bit-identical)"),
                    _ => String::new(),
                };
                if c["equivalent"].as_bool().unwrap_or(true) {
                    format!("model's{form}")
                } else {
                    format!("{} experts/token: NOT EQUIVALENT{form}", c["experts_per_token"])
                }
            }),
        ),
    ];
    let m = &report["machine"];
    let shape = &report["model_shape"];
    println!();
    println!("model    {}", report["model"].as_str().unwrap_or("?"));
    println!(
        "         {} layers, {} experts top-{}, record {}, expert pack {}, backbone {}",
        shape["layers"],
        shape["routed_experts"],
        shape["top_k"],
        size::human(shape["expert_record_bytes"].as_u64().unwrap_or(0)),
        size::human(shape["expert_pack_bytes"].as_u64().unwrap_or(0)),
        size::human(shape["backbone_bytes"].as_u64().unwrap_or(0)),
    );
    println!(
        "machine  {} cores, {}, {} RAM, Linux {}",
        m["cores"],
        m["cpu"].as_str().unwrap_or("?"),
        size::human(m["mem_total_bytes"].as_u64().unwrap_or(0)),
        m["kernel"].as_str().unwrap_or("?")
    );
    let p = &report["protocol"];
    println!(
        "protocol {} runs/config, {} new tokens, balanced order, {}{}",
        p["runs_per_config"],
        p["new_tokens"],
        if p["cold_cache"].as_bool().unwrap_or(false) {
            "page cache dropped before each run"
        } else {
            "warm page cache"
        },
        p["memory_limit_bytes"]
            .as_u64()
            .map(|l| format!(", memory cgroup limit {} (page cache included)", size::human(l)))
            .unwrap_or_default()
    );
    if let Some(f) = report["floor"].as_object() {
        println!(
            "floor    {:.3} GB/s: {}",
            f["bandwidth_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e9,
            f["source"].as_str().unwrap_or("")
        );
    }
    let ids = report["generated_ids"].as_array().map(|a| a.len()).unwrap_or(0);
    let not_equivalent: Vec<&str> = report["configs"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .filter(|c| !c["equivalent"].as_bool().unwrap_or(true))
                .filter_map(|c| c["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let scope = if not_equivalent.is_empty() {
        "in every run".to_string()
    } else {
        format!(
            "in every run of each configuration and across those with the model's routing (not {})",
            not_equivalent.join(", ")
        )
    };
    println!(
        "ids      identical {scope} ({ids} ids{}); values below: median [min–max]",
        if report["expected_ids"].is_array() {
            ", equal to --expected-ids"
        } else {
            ""
        }
    );
    println!();
    // Left-aligned columns two spaces apart, no rules: plain text that diffs and greps well.
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_header(std::iter::once(String::new()).chain(configs.iter().map(|c| c.name.clone())));
    for (name, f) in &rows {
        table.add_row(std::iter::once(name.to_string()).chain(cs.iter().map(f)));
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    for line in table.lines() {
        println!("{}", line.trim_end());
    }
    println!();
}
