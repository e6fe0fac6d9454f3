//! Every kernel of the standard set compiles: CUDA C through NVRTC all the way to machine code
//! (so ptxas checks the inline PTX) for sm_80, sm_89, sm_90 and sm_120; WGSL through naga's
//! full validation, within the portable 16 KiB of workgroup memory and 256 invocations. Every
//! CUDA kernel prints its ptxas report and must not spill, print a compiler warning, or need
//! more than SM120's 101376 B of shared memory per block.

mod common;

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kernels::sparse_mla_decode::{
    lowered_kernels, lowered_merged, lowered_whole, DecodeConfig,
};
use sparse_mla::kernels::{standard_set, Target};
use sparse_mla::kir::shared_plan::{shared_layout, MAX_SHARED_BYTES};
use sparse_mla::kir::{Kernel, Lowering, RowSoftmax};
use sparse_mla::mla::{CacheFormat, MlaDims};
use sparse_mla::runtime::cuda::{compile, nvrtc_unavailable, nvrtc_version};

/// Spills ptxas reports that are known, a few bytes, and outside the step loop (read off the
/// SASS, `tools/sass-loops.py`): `(arch, kernel name ends with, at most spill store bytes,
/// at most spill load bytes)`. Any other spill, or more bytes, fails.
const KNOWN_SPILLS: &[(&str, &str, u64, u64)] = &[
    // bf16 v7 in 64-head blocks (DecodeConfig::tensor_core_wide) at 255 registers: on sm_120
    // one word (the second row of a thread's heads) stored before the step loop and read
    // twice after it, two in its whole-token form; on sm_80 the whole-token form keeps two
    // words of its producer's step bounds on the stack, read once a step by the producer warp
    ("sm_120", "_ws2w8h4r_h64n32", 4, 8),
    ("sm_120", "_ws2w8h4r_h64n32_whole", 8, 16),
    ("sm_80", "_ws2w8h4r_h64n32_whole", 8, 16),
];

/// Is `report`'s spill one of [`KNOWN_SPILLS`] for `kernel` on `arch`, within its bytes?
fn known_spill(arch: &str, kernel: &str, report: &[&str]) -> bool {
    let bytes = |line: &str, what: &str| -> Option<u64> {
        let end = line.find(what)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    KNOWN_SPILLS.iter().any(|&(a, tail, stores, loads)| {
        a == arch
            && kernel.ends_with(tail)
            && report.iter().filter(|l| l.contains("spill")).all(|l| {
                bytes(l, " bytes spill stores").is_some_and(|b| b <= stores)
                    && bytes(l, " bytes spill loads").is_some_and(|b| b <= loads)
            })
    })
}

#[test]
fn every_cuda_kernel_compiles_for_every_arch() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let (major, minor) = nvrtc_version().expect("nvrtc version");
    let set = standard_set().expect("standard set");
    let mut kernels: Vec<Kernel> = set
        .into_iter()
        .filter(|k| k.target == Target::Cuda)
        .map(|k| k.kernel)
        .collect();
    // the merged split kernels the backend runs (not exported: two launches are the
    // integration interface)
    for heads in [16, 128] {
        let dims = MlaDims::PRODUCTION;
        for config in [
            DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, heads),
            DecodeConfig::tensor_core_v7(dims, CacheFormat::Bf16, heads),
            DecodeConfig::tensor_core_v7(dims, CacheFormat::Fp8DsMla, heads),
        ] {
            kernels.push((*lowered_merged(&config).expect("merged kernel")).clone());
        }
    }
    // the whole-token split kernels the backend runs at batches just past a wave (not
    // exported either): every tensor-core configuration the plan picks
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        let dims = MlaDims::PRODUCTION;
        let mut configs = vec![
            DecodeConfig::tensor_core_v6(dims, format, 16),
            DecodeConfig::tensor_core_v6(dims, format, 128),
            DecodeConfig::tensor_core_v7(dims, format, 16),
            DecodeConfig::tensor_core_v7(dims, format, 128),
        ];
        configs.extend(DecodeConfig::tensor_core_batch(dims, format, 16));
        configs.extend(DecodeConfig::tensor_core_narrow(dims, format, 64));
        configs.extend(DecodeConfig::tensor_core_narrow_wide(dims, format, 64));
        configs.extend(DecodeConfig::tensor_core_v6_narrow(dims, format, 64));
        // bf16's wide-call kernel (its split form is in the standard set). Its scores in
        // fragments, `SPARSE_MLA_ROW_SOFTMAX=0`, spill 24 B and reload 288 B on sm_120: a form
        // the backend never picks, not checked here.
        configs.extend(DecodeConfig::tensor_core_wide(dims, format));
        for config in configs {
            let k = (*lowered_whole(&config).expect("whole-token kernel")).clone();
            if !kernels.iter().any(|x| x.name == k.name) {
                kernels.push(k);
            }
        }
    }
    // bf16's narrow-call kernel (fp8's is its H <= 16 v7 kernel, merged above)
    let narrow = DecodeConfig::tensor_core_narrow(MlaDims::PRODUCTION, CacheFormat::Bf16, 64)
        .expect("a narrow configuration above 16 heads");
    kernels.push((*lowered_merged(&narrow).expect("merged kernel")).clone());
    // fp8's large-batch kernel (v7 with 64-row steps) merges too
    let batch = DecodeConfig::tensor_core_batch(MlaDims::PRODUCTION, CacheFormat::Fp8DsMla, 16)
        .expect("an fp8_ds_mla large-batch configuration at 16 heads");
    kernels.push((*lowered_merged(&batch).expect("merged kernel")).clone());
    // the other way to hold the scores for the softmax (`SPARSE_MLA_ROW_SOFTMAX=0|1`): every
    // v7 and large-batch kernel, split and merged, in fragments and in rows
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        let dims = MlaDims::PRODUCTION;
        let mut configs = vec![
            DecodeConfig::tensor_core_v7(dims, format, 16),
            DecodeConfig::tensor_core_v7(dims, format, 128),
        ];
        configs.extend(DecodeConfig::tensor_core_batch(dims, format, 16));
        configs.extend(DecodeConfig::tensor_core_narrow(dims, format, 64));
        configs.extend(DecodeConfig::tensor_core_narrow_wide(dims, format, 64));
        for config in configs {
            if !matches!(config.lowering, Lowering::MmaWs { .. }) {
                continue;
            }
            let mut forms = Vec::new();
            for form in [RowSoftmax::Off, RowSoftmax::Rows] {
                let rows = config.with_row_softmax(form);
                let (split, _) = lowered_kernels(&rows).expect("row-form split kernel");
                forms.push((*split).clone());
                if rows.has_merged_form() {
                    forms.push((*lowered_merged(&rows).expect("merged kernel")).clone());
                }
            }
            for k in forms {
                if !kernels.iter().any(|x| x.name == k.name) {
                    kernels.push(k);
                }
            }
        }
    }
    // every (kernel, arch) is its own NVRTC program: compiled on all cores, reported in order
    let mut failures = Vec::new();
    let mut count = 0;
    for (i, arch, result) in common::compile_every_arch(&kernels) {
        let kernel = &kernels[i];
        match result {
            Ok(c) => {
                count += 1;
                assert!(!c.cubin.is_empty());
                let (report, spills) = common::ptxas_report(&c.log);
                let (_, smem) = shared_layout(&kernel.shared);
                eprintln!(
                    "NVRTC {major}.{minor} {arch} {}: {} | shared {smem} B",
                    kernel.name,
                    report.join(" | ")
                );
                if spills && !known_spill(arch, &kernel.name, &report) {
                    failures.push(format!(
                        "{arch} {}: spills: {}",
                        kernel.name,
                        report.join(" | ")
                    ));
                }
                // integrators compile these files with nvcc: not one front-end warning
                // (unused helpers or locals, pointless comparisons)
                let warnings: Vec<&str> =
                    c.log.lines().filter(|l| l.contains("warning #")).collect();
                if !warnings.is_empty() {
                    failures.push(format!(
                        "{arch} {}: compiler warnings: {}",
                        kernel.name,
                        warnings.join(" | ")
                    ));
                }
                if smem > MAX_SHARED_BYTES {
                    failures.push(format!(
                        "{arch} {}: {smem} B of shared memory > {MAX_SHARED_BYTES} (SM120)",
                        kernel.name
                    ));
                }
            }
            Err(e) => failures.push(format!("{arch} {}: {e}", kernel.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        count >= common::NVRTC_ARCHS.len(),
        "no CUDA kernel was compiled"
    );
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

/// Programmatic dependent launch is safe only if a kernel touches no global memory before it
/// has waited for its predecessor: in every CUDA kernel of the standard set, the body opens
/// with declarations only, then `grid_wait_previous()`, then `grid_launch_dependents()`.
#[test]
fn every_cuda_kernel_waits_for_its_predecessor_first() {
    let set = standard_set().expect("standard set");
    let mut count = 0;
    for k in set.iter().filter(|k| k.target == Target::Cuda) {
        let src = cuda::emit(&k.kernel).expect("emit");
        let name = &k.kernel.name;
        let open = src
            .find(&format!("{name}(const {name}_params p"))
            .and_then(|at| src[at..].find('{').map(|b| at + b + 1))
            .unwrap_or_else(|| panic!("{name}: no kernel body"));
        let body: Vec<&str> = src[open..].lines().map(str::trim).collect();
        let wait = body
            .iter()
            .position(|l| l.starts_with("grid_wait_previous();"))
            .unwrap_or_else(|| panic!("{name}: no grid_wait_previous()"));
        for l in &body[..wait] {
            let declaration = l.is_empty()
                || l.starts_with("__shared__")
                || l.starts_with("extern __shared__")
                || l.contains("* const ") && l.contains("(dyn_smem + ")
                // a typed window of another shared array (SharedDecl::alias)
                || l.contains("* const ") && l.contains("((unsigned char*)") && l.contains("// [")
                || l.ends_with("];") && !l.contains('=');
            assert!(declaration, "{name}: `{l}` before grid_wait_previous()");
        }
        assert!(
            body[wait + 1].starts_with("grid_launch_dependents();"),
            "{name}: grid_launch_dependents() must follow the wait"
        );
        count += 1;
    }
    assert!(count > 0, "no CUDA kernel in the standard set");
}
