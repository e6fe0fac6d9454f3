//! The tensor-core lowering, run on the CPU: every kernel the CUDA backend would launch is
//! printed as CUDA C, compiled by g++ against an emulator of CUDA and of the PTX
//! instructions (tests/emu), and the whole conformance suite runs on it against the float64
//! reference. Fragment layouts, ldmatrix addressing, the cp.async ring and the cross-warp
//! reductions are all checked here without a GPU.

mod common;
mod emu;

use sparse_mla::conformance::all_cases;
use sparse_mla::runtime::gpu::GpuBackend;
use sparse_mla::util::Rng;

#[test]
fn conformance_on_the_emulated_tensor_core_lowering() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    // A small GPU: 6 resident workgroups, so the split heuristic splits small cases.
    let backend = GpuBackend::new(emu::EmuDevice::new(6));
    let filter = std::env::var("SPARSE_MLA_EMU_CASE").ok();
    let mut failed = Vec::new();
    for case in all_cases() {
        if filter
            .as_ref()
            .is_some_and(|f| !case.name().contains(f.as_str()))
        {
            continue;
        }
        let seed = Rng::fresh_seed();
        let start = std::time::Instant::now();
        match case.run(&backend, seed) {
            Ok(o) => {
                eprintln!(
                    "emu {:<40} rel_l2 {:.2e} lse_err {:.2e} {:<10} {:>6.1} s {}",
                    o.case,
                    o.rel_l2,
                    o.lse_err,
                    o.detail,
                    start.elapsed().as_secs_f64(),
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
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
