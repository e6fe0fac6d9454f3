//! The model-op kernels of MoE routing and sampling compile: CUDA C through NVRTC to machine
//! code for sm_80, sm_89, sm_90 and sm_120 (ptxas report printed; no spills), and WGSL
//! through naga's full validation within the portable WebGPU limits. NVRTC absent: skipped
//! with the reason, unless SPARSE_MLA_REQUIRE names `nvrtc`.

mod common;

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kernels::moe_route::moe_route_kernel;
use sparse_mla::kernels::sampler::{sample_kernel, SampleMode};
use sparse_mla::kir::{lower, Kernel, Lowering};
use sparse_mla::runtime::cuda::{compile, nvrtc_unavailable, nvrtc_version};

const ARCHS: [&str; 4] = ["sm_80", "sm_89", "sm_90", "sm_120"];

/// Every variant, lowered as the backends run them (scalar lowering).
fn kernels() -> Vec<Kernel> {
    let mut v = vec![moe_route_kernel().expect("moe_route")];
    for mode in SampleMode::all() {
        v.push(sample_kernel(&mode).expect("sampler"));
    }
    v.into_iter()
        .map(|k| lower(&k, Lowering::Scalar).expect("lower"))
        .collect()
}

#[test]
fn routing_and_sampling_kernels_compile_for_every_arch() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let (major, minor) = nvrtc_version().expect("nvrtc version");
    let mut failures = Vec::new();
    for k in kernels() {
        let src = cuda::emit(&k).expect("emit");
        for arch in ARCHS {
            match compile(&k.name, &src, arch, true) {
                Ok(c) => {
                    let report: Vec<&str> = c
                        .log
                        .lines()
                        .filter(|l| l.contains("registers") || l.contains("spill"))
                        .map(str::trim)
                        .collect();
                    eprintln!(
                        "NVRTC {major}.{minor} {arch} {}: {} | shared {} B",
                        k.name,
                        report.join(" | "),
                        k.shared_bytes()
                    );
                    if report.iter().any(|l| {
                        l.contains("spill")
                            && !l.contains("0 bytes spill stores, 0 bytes spill loads")
                    }) {
                        failures.push(format!("{arch} {}: spills: {}", k.name, report.join(" | ")));
                    }
                }
                Err(e) => failures.push(format!("{arch} {}: {e}", k.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn routing_and_sampling_kernels_validate_as_portable_wgsl() {
    for k in kernels() {
        wgsl::check_portable_limits(&k).expect("portable limits");
        let src = wgsl::emit(&k).expect("emit");
        if let Err(e) = wgsl::validate(&k.name, &src) {
            panic!("{e}");
        }
    }
}
