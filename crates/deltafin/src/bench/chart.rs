//! The bench report as the SVG chart `--svg` writes: the per-step time split of each
//! configuration's median run against the storage floor.

use super::*;

/// Stacked bars, one per decode step, of each configuration's median run (by steady rate):
/// io wait, expert compute, attention, other; a dashed line at the storage floor.
pub(super) fn plot_svg(configs: &[Config], runs: &[Run], report: &Value) -> String {
    const W: f64 = 900.0;
    const PANEL_H: f64 = 260.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 50.0;
    let parts: [(&str, &str); 4] = [
        ("io wait", "#d62728"),
        ("expert compute", "#1f77b4"),
        ("attention", "#2ca02c"),
        ("other", "#a0a0a0"),
    ];
    let h = TOP + PANEL_H * configs.len() as f64 + 30.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s.push_str(&format!(
        "<text x=\"{LEFT}\" y=\"20\" font-size=\"13\">Where each decode step's time goes (median run of each configuration; step 1, faded, is not in the steady rate)</text>\n"
    ));
    for (i, (name, color)) in parts.iter().enumerate() {
        let x = LEFT + i as f64 * 150.0;
        s.push_str(&format!(
            "<rect x=\"{x}\" y=\"30\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{}\" y=\"41\">{name}</text>\n",
            x + 16.0
        ));
    }
    if (0..configs.len()).any(|ci| report["configs"][ci]["storage_floor_s_per_token"].is_number()) {
        s.push_str(&format!(
            "<line x1=\"{}\" y1=\"36\" x2=\"{}\" y2=\"36\" stroke=\"black\" stroke-dasharray=\"5,3\"/><text x=\"{}\" y=\"41\">storage floor</text>\n",
            LEFT + 600.0,
            LEFT + 630.0,
            LEFT + 634.0
        ));
    }
    // The median run of a configuration by steady rate.
    let median_run = |ci: usize| {
        let mut rs: Vec<&Run> = runs.iter().filter(|r| r.config == ci).collect();
        rs.sort_by(|a, b| {
            let k = |r: &Run| r.stats.steady_decode_tokens_per_s.unwrap_or(0.0);
            k(a).total_cmp(&k(b))
        });
        rs.get(rs.len() / 2).copied()
    };
    // One y scale for every panel, so configurations compare at a glance.
    let ymax = (0..configs.len())
        .filter_map(median_run)
        .flat_map(|r| r.stats.steps.iter().filter(|s| s.kind == "decode"))
        .map(|s| {
            s.seconds
                .max(s.io_wait_s + s.expert_compute_s + s.attention_s + s.other_s)
        })
        .chain((0..configs.len()).filter_map(|ci| report["configs"][ci]["storage_floor_s_per_token"].as_f64()))
        .fold(1e-9, f64::max)
        * 1.1;
    for (ci, c) in configs.iter().enumerate() {
        let y0 = TOP + ci as f64 * PANEL_H + 20.0;
        let ph = PANEL_H - 60.0;
        let Some(run) = median_run(ci) else { continue };
        let steps: Vec<&Step> = run.stats.steps.iter().filter(|s| s.kind == "decode").collect();
        let floor = report["configs"][ci]["storage_floor_s_per_token"].as_f64();
        let plot_w = W - LEFT - RIGHT;
        s.push_str(&format!(
            "<text x=\"{LEFT}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{} (run {}, {} tok/s steady)</text>\n",
            y0 - 4.0,
            xml_escape(&c.name),
            run.index + 1,
            run.stats
                .steady_decode_tokens_per_s
                .map(|r| format!("{r:.3}"))
                .unwrap_or_else(|| "n/a".into())
        ));
        // Axes and y ticks.
        s.push_str(&format!(
            "<line x1=\"{LEFT}\" y1=\"{y0}\" x2=\"{LEFT}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{LEFT}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
            y0 + ph,
            y0 + ph,
            W - RIGHT,
            y0 + ph
        ));
        for k in 0..=4 {
            let v = ymax * k as f64 / 4.0;
            let y = y0 + ph - ph * k as f64 / 4.0;
            s.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text><line x1=\"{LEFT}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#eee\"/>\n",
                LEFT - 4.0,
                y + 4.0,
                fmt_secs(v),
                W - RIGHT
            ));
        }
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">decode step</text>\n",
            LEFT + plot_w / 2.0,
            y0 + ph + 30.0
        ));
        let n = steps.len().max(1) as f64;
        let bw = plot_w / n;
        for (i, st) in steps.iter().enumerate() {
            let x = LEFT + i as f64 * bw;
            let mut y = y0 + ph;
            let vals = [st.io_wait_s, st.expert_compute_s, st.attention_s, st.other_s];
            for (v, (_, color)) in vals.iter().zip(parts.iter()) {
                let hh = ph * v / ymax;
                y -= hh;
                s.push_str(&format!(
                    "<rect x=\"{:.2}\" y=\"{y:.2}\" width=\"{:.2}\" height=\"{hh:.2}\" fill=\"{color}\"{}/>\n",
                    x + bw * 0.1,
                    bw * 0.8,
                    if i == 0 { " fill-opacity=\"0.5\"" } else { "" }
                ));
            }
            if steps.len() <= 40 || i % (steps.len() / 20).max(1) == 0 {
                s.push_str(&format!(
                    "<text x=\"{:.2}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\">{}</text>\n",
                    x + bw / 2.0,
                    y0 + ph + 13.0,
                    i + 1
                ));
            }
        }
        if let Some(f) = floor {
            let y = y0 + ph - ph * f / ymax;
            s.push_str(&format!(
                "<line x1=\"{LEFT}\" y1=\"{y:.2}\" x2=\"{}\" y2=\"{y:.2}\" stroke=\"black\" stroke-dasharray=\"5,3\"/><text x=\"{}\" y=\"{:.2}\" text-anchor=\"end\" font-size=\"10\">floor {}</text>\n",
                W - RIGHT,
                W - RIGHT,
                y - 3.0,
                fmt_secs(f)
            ));
        }
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_secs(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.2} s")
    } else {
        format!("{:.1} ms", v * 1e3)
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
