//! The conformance suite on every backend present. Each test is written once (in
//! `sparse_mla::conformance`) and instantiated per backend below; an absent backend is
//! reported as skipped with its reason (or fails, when SPARSE_MLA_REQUIRE names it).
//! Decode, cache-write and block-table cases all run, each line printing its errors.

mod common;

use sparse_mla::conformance::all_cases;
use sparse_mla::runtime::BackendKind;
use sparse_mla::util::Rng;

fn suite(kind: BackendKind) {
    let Some(backend) = common::backend(kind) else {
        return;
    };
    let mut failed = Vec::new();
    for case in all_cases() {
        let seed = Rng::fresh_seed();
        match case.run(backend, seed) {
            Ok(o) => {
                // max_abs: the largest output error vs the float64 reference (decode), or
                // the number of differing bytes / entries (cache write, conversion).
                eprintln!(
                    "{:<6} {:<52} rel_l2 {:.2e} max_abs {:.2e} lse_err {:.2e} {:<18} {:>8.1} ms {}",
                    kind.name(),
                    o.case,
                    o.rel_l2,
                    o.max_abs,
                    o.lse_err,
                    o.detail,
                    o.seconds * 1e3,
                    if o.passed() { "ok" } else { "FAIL" }
                );
                if !o.passed() {
                    failed.push(format!(
                        "{} (seed {seed}): {}",
                        o.case,
                        o.failures.join("; ")
                    ));
                }
            }
            Err(e) => failed.push(format!("{} (seed {seed}): error: {e}", case.name())),
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

macro_rules! backend_tests {
    ($($name:ident => $kind:expr),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                suite($kind);
            }
        )*
    };
}

backend_tests! {
    conformance_cpu => BackendKind::Cpu,
    conformance_wgpu => BackendKind::Wgpu,
    conformance_cuda => BackendKind::Cuda,
}
