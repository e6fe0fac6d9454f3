//! The whole-model conformance cases ([`sparse_mla::conformance::model`]) on every backend:
//! transformers goldens of both tiny models with bf16 and fp8_ds_mla caches, FP8 weights
//! against their dequantised copy, batched steps against separate ones, no device allocation
//! in a steady decode step, failed steps that change nothing, the model sharded 1, 2 and 4
//! ways on one backend against itself unsharded. An absent backend is skipped
//! with its reason (or fails when SPARSE_MLA_REQUIRE names it).

mod common;

use sparse_mla::conformance::model::{fixtures_dir, model_cases};
use sparse_mla::runtime::BackendKind;

fn run(kind: BackendKind, prefix: &str) {
    // The steady-decode case reads the backend's allocation and wait counters: it gets a
    // backend of its own, which no test running beside it touches.
    let backend = if prefix.starts_with("model/steady_decode") {
        common::fresh_backend_arc(kind)
    } else {
        common::backend_arc(kind)
    };
    let Some(backend) = backend else {
        return;
    };
    let fixtures = fixtures_dir();
    let mut failed = Vec::new();
    for case in model_cases().iter().filter(|c| c.name.starts_with(prefix)) {
        match case.run(backend.clone(), &fixtures) {
            Ok(o) => {
                eprintln!(
                    "{:<5} {:<40} rel_l2 {:.2e} max_abs {:.2e} logp {:.2e} {} {}",
                    kind.name(),
                    o.case,
                    o.rel_l2,
                    o.max_abs,
                    o.lse_err,
                    o.detail,
                    if o.passed() { "ok" } else { "FAIL" }
                );
                if !o.passed() {
                    failed.push(format!("{}: {}", o.case, o.failures.join("; ")));
                }
            }
            Err(e) => failed.push(format!("{}: error: {e}", case.name)),
        }
    }
    assert!(
        failed.is_empty(),
        "{} on {}:\n{}",
        kind.name(),
        backend.device_name(),
        failed.join("\n")
    );
}

macro_rules! model_tests {
    ($($backend:ident => $kind:expr;)*) => {
        $(
            mod $backend {
                use super::*;
                #[test]
                fn goldens() {
                    run($kind, "golden/");
                }
                #[test]
                fn fp8_weights() {
                    run($kind, "model/fp8_weights/");
                }
                #[test]
                fn batched_steps_equal_separate_ones() {
                    run($kind, "model/batch/");
                }
                #[test]
                fn steady_decode_allocates_nothing() {
                    run($kind, "model/steady_decode/");
                }
                #[test]
                fn failed_step_changes_nothing() {
                    run($kind, "model/failed_step/");
                }
                #[test]
                fn graph_replays_equal_eager_steps() {
                    run($kind, "model/graphs/");
                }
                #[test]
                fn sharded_equals_unsharded() {
                    run($kind, "model/tp");
                }
            }
        )*
    };
}

model_tests! {
    cpu => BackendKind::Cpu;
    wgpu => BackendKind::Wgpu;
    cuda => BackendKind::Cuda;
}
