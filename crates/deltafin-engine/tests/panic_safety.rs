//! A panic in an expert computation (a kernel bug, a hyperparameter the checks missed, such as
//! gpt-oss `swiglu_limit` ≤ 0 making `f32::clamp` panic) fails the MoE block with an error
//! naming the panic: it neither hangs the caller (the batched path waits on a channel its
//! tasks send to) nor unwinds through the compute pool into the command.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use deltafin_engine::models::DeepseekV3;
use deltafin_engine::moe::Routing;
use deltafin_engine::CausalLm;
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::ModelDir;

/// Runs `f` on its own thread; fails the test instead of hanging when it never returns.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the MoE block hung (or panicked) instead of returning an error")
}

#[test]
fn a_panicking_expert_fails_the_block_with_an_error_not_a_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
    let out = tmp.path().join("m");
    convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    let model = DeepseekV3::load(&ModelDir::open(&out).unwrap(), 1 << 20).unwrap();
    let hidden = model.config().hidden_size();
    let layers = model.config().num_hidden_layers();
    let errors = within_a_minute(move || {
        let routed = model.routed();
        let routing = Routing {
            experts: vec![0, 1],
            weights: vec![0.5, 0.5],
        };
        let mut errors = Vec::new();
        for layer in 0..layers {
            let batch = routed.run_batch(
                layer,
                &[routing.clone(), routing.clone()],
                hidden,
                |_, _| -> Vec<f32> { panic!("min > max, or either was NaN") },
                None::<fn() -> Vec<f32>>,
            );
            let one = routed.run(
                layer,
                &routing,
                hidden,
                |_| -> Vec<f32> { panic!("min > max, or either was NaN") },
                None::<fn() -> Vec<f32>>,
                || Ok(None),
            );
            errors.push((batch.err().map(|e| e.to_string()), one.err().map(|e| e.to_string())));
        }
        errors
    });
    // Every MoE layer fails both ways, naming the panic (dense layers have no records to read).
    let moe: Vec<_> = errors
        .iter()
        .filter(|(b, o)| {
            b.as_deref().is_some_and(|m| m.contains("panicked")) || o.as_deref().is_some_and(|m| m.contains("panicked"))
        })
        .collect();
    assert!(!moe.is_empty(), "{errors:?}");
    for (b, o) in moe {
        for m in [b, o] {
            let m = m.as_deref().unwrap_or("");
            assert!(m.contains("an expert computation panicked: min > max"), "{errors:?}");
        }
    }
}
