//! Every model-op kernel variant ([`sparse_mla::kernels::model_set::model_kernels`]) compiles:
//! CUDA C through NVRTC to machine code for sm_80, sm_89, sm_90 and sm_120 with no spills,
//! and WGSL through naga within WebGPU's portable limits (16 KiB, 256 invocations).

mod common;

use sparse_mla::emit::wgsl;
use sparse_mla::kernels::model_set::model_kernels;
use sparse_mla::runtime::cuda::nvrtc_unavailable;

#[test]
fn every_model_kernel_compiles_for_every_arch() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let kernels = model_kernels().expect("model kernels");
    // every (kernel, arch) is its own NVRTC program: compiled on all cores, reported in order
    let mut failures = Vec::new();
    for (i, arch, result) in common::compile_every_arch(&kernels) {
        let k = &kernels[i];
        match result {
            Ok(c) => {
                let (report, spills) = common::ptxas_report(&c.log);
                eprintln!("{arch} {}: {}", k.name, report.join(" | "));
                if spills {
                    failures.push(format!("{arch} {}: spills: {}", k.name, report.join(" | ")));
                }
            }
            Err(e) => failures.push(format!("{arch} {}: {e}", k.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(kernels.len() > 50, "only {} model kernels", kernels.len());
}

#[test]
fn every_model_kernel_validates_as_portable_wgsl() {
    let kernels = model_kernels().expect("model kernels");
    for k in &kernels {
        wgsl::check_portable_limits(k).unwrap_or_else(|e| panic!("{e}"));
        let src = wgsl::emit(k).expect("emit");
        wgsl::validate(&k.name, &src).unwrap_or_else(|e| panic!("{e}"));
    }
    eprintln!("naga: {} model kernels valid", kernels.len());
}
