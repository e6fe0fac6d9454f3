//! The bounded stress run in CI: 10³ random sparse-decode launches (H 1–128, topk 1–4096,
//! T 1–256, page sizes, invalid-index patterns, splits, both cache formats) on each GPU
//! backend present — lavapipe on a CI machine — every output checked against the float64
//! reference, under a watchdog. The H200 run of 10⁴ launches is `mla-check --stress 10000`
//! (tools/gpu-check.sh). `SPARSE_MLA_STRESS_LAUNCHES` changes the count.

mod common;

use sparse_mla::conformance::stress::{run, StressOptions};
use sparse_mla::runtime::BackendKind;
use sparse_mla::testing::test_seed;

fn stress(kind: BackendKind) {
    let Some(backend) = common::backend(kind) else {
        return;
    };
    let launches = std::env::var("SPARSE_MLA_STRESS_LAUNCHES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let seed = test_seed();
    let opts = StressOptions {
        launches,
        seed,
        // Keeps 10³ launches near a minute on lavapipe (2 cores).
        max_pairs: 1 << 13,
        watchdog_s: 120.0,
        threads: 0,
    };
    let r = run(backend, &opts, &mut |_| {});
    eprintln!(
        "stress {} on {}: {} launches, {} wrong, {} errors, {} hangs, {} forced splits refused by the device; worst rel L2 {:.2e}, lse {:.2e}; slowest {:.2} s; {:.1} s in all (seed {seed})",
        kind.name(),
        backend.device_name(),
        r.launches,
        r.wrong,
        r.errors,
        r.hangs,
        r.refused_splits,
        r.worst_rel_l2,
        r.worst_lse,
        r.slowest_s,
        r.seconds
    );
    assert_eq!(r.launches, launches);
    assert!(
        r.passed(),
        "stress on {} (seed {seed}, SPARSE_MLA_SEED replays):\n{}",
        backend.device_name(),
        r.failures.join("\n")
    );
}

#[test]
fn stress_wgpu() {
    stress(BackendKind::Wgpu);
}

#[test]
fn stress_cuda() {
    stress(BackendKind::Cuda);
}
