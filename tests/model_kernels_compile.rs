//! Every model-op kernel variant ([`sparse_mla::kernels::model_set::model_kernels`]) compiles:
//! CUDA C through NVRTC to machine code for sm_80, sm_89, sm_90 and sm_120 with no spills,
//! and WGSL through naga within WebGPU's portable limits (16 KiB, 256 invocations).

mod common;

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kernels::model_set::model_kernels;
use sparse_mla::runtime::cuda::{compile, nvrtc_unavailable};

const ARCHS: [&str; 4] = ["sm_80", "sm_89", "sm_90", "sm_120"];

#[test]
fn every_model_kernel_compiles_for_every_arch() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let kernels = model_kernels().expect("model kernels");
    let sources: Vec<String> = kernels
        .iter()
        .map(|k| {
            let src = cuda::emit(k).expect("emit");
            assert!(!src.contains("#include"), "{}: not self-contained", k.name);
            src
        })
        .collect();
    // every (kernel, arch) is its own NVRTC program: compiled on all cores, reported in order
    let jobs: Vec<(usize, &str)> = (0..kernels.len())
        .flat_map(|i| ARCHS.map(|arch| (i, arch)))
        .collect();
    let compiled = common::par_map(&jobs, |&(i, arch)| {
        compile(&kernels[i].name, &sources[i], arch, true)
    });
    let mut failures = Vec::new();
    for (&(i, arch), result) in jobs.iter().zip(compiled) {
        let k = &kernels[i];
        match result {
            Ok(c) => {
                let report: Vec<&str> = c
                    .log
                    .lines()
                    .filter(|l| l.contains("registers") || l.contains("spill"))
                    .map(str::trim)
                    .collect();
                eprintln!("{arch} {}: {}", k.name, report.join(" | "));
                if report.iter().any(|l| {
                    l.contains("spill") && !l.contains("0 bytes spill stores, 0 bytes spill loads")
                }) {
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
