//! Every kernel of the standard set compiles: CUDA C through NVRTC all the way to machine code
//! (so ptxas checks the inline PTX) for sm_80, sm_89, sm_90 and sm_120; WGSL through naga's
//! full validation, within the portable 16 KiB of workgroup memory and 256 invocations. Every
//! CUDA kernel prints its ptxas report and must not spill or need more than SM120's 101376 B
//! of shared memory per block.

mod common;

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kernels::{standard_set, Target};
use sparse_mla::kir::shared_plan::{shared_layout, MAX_SHARED_BYTES};
use sparse_mla::runtime::cuda::{compile, nvrtc_unavailable, nvrtc_version};

const ARCHS: [&str; 4] = ["sm_80", "sm_89", "sm_90", "sm_120"];

#[test]
fn every_cuda_kernel_compiles_for_every_arch() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let (major, minor) = nvrtc_version().expect("nvrtc version");
    let set = standard_set().expect("standard set");
    let mut failures = Vec::new();
    let mut count = 0;
    for k in set.iter().filter(|k| k.target == Target::Cuda) {
        let src = cuda::emit(&k.kernel).expect("emit");
        assert!(
            !src.contains("#include"),
            "{}: CUDA C must be self-contained",
            k.kernel.name
        );
        for arch in ARCHS {
            match compile(&k.kernel.name, &src, arch, true) {
                Ok(c) => {
                    count += 1;
                    assert!(!c.cubin.is_empty());
                    let report: Vec<&str> = c
                        .log
                        .lines()
                        .filter(|l| l.contains("registers") || l.contains("spill"))
                        .map(str::trim)
                        .collect();
                    let (_, smem) = shared_layout(&k.kernel.shared);
                    eprintln!(
                        "NVRTC {major}.{minor} {arch} {}: {} | shared {smem} B",
                        k.kernel.name,
                        report.join(" | ")
                    );
                    if report.iter().any(|l| {
                        l.contains("spill")
                            && !l.contains("0 bytes spill stores, 0 bytes spill loads")
                    }) {
                        failures.push(format!(
                            "{arch} {}: spills: {}",
                            k.kernel.name,
                            report.join(" | ")
                        ));
                    }
                    if smem > MAX_SHARED_BYTES {
                        failures.push(format!(
                            "{arch} {}: {smem} B of shared memory > {MAX_SHARED_BYTES} (SM120)",
                            k.kernel.name
                        ));
                    }
                }
                Err(e) => failures.push(format!("{arch} {}: {e}", k.kernel.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(count >= ARCHS.len(), "no CUDA kernel was compiled");
}

#[test]
fn every_wgsl_kernel_validates_and_fits_portable_limits() {
    let set = standard_set().expect("standard set");
    let mut count = 0;
    for k in set.iter().filter(|k| k.target == Target::Wgsl) {
        wgsl::check_portable_limits(&k.kernel).expect("portable limits");
        let src = wgsl::emit(&k.kernel).expect("emit");
        if let Err(e) = wgsl::validate(&k.kernel.name, &src) {
            panic!("{e}");
        }
        eprintln!(
            "naga ok: {} ({} B workgroup memory, {} threads)",
            k.kernel.name,
            k.kernel.shared_bytes(),
            k.kernel.workgroup_size
        );
        count += 1;
    }
    assert!(count > 0, "no WGSL kernel in the standard set");
}

#[test]
fn a_compile_error_carries_nvrtc_log() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let err = compile(
        "broken",
        "extern \"C\" __global__ void broken() { undeclared = 1; }",
        "sm_90",
        false,
    )
    .expect_err("must not compile");
    let msg = err.to_string();
    assert!(msg.contains("undeclared"), "NVRTC log missing from: {msg}");
}
