//! The standard export set holds every formats kernel for both targets, the fp8 decode
//! fits the portable WebGPU limits, the generated headers document the 656-byte row, and
//! the CUDA fp8 decode converts e4m3 in hardware where the arch has it.

mod common;

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kernels::{standard_set, Target};
use sparse_mla::runtime::cuda::{compile, nvrtc_unavailable};

#[test]
fn standard_set_has_both_formats_the_cache_write_and_the_conversion() {
    let set = standard_set().expect("standard set");
    for target in [Target::Wgsl, Target::Cuda] {
        let names: Vec<&str> = set
            .iter()
            .filter(|k| k.target == target)
            .map(|k| k.kernel.name.as_str())
            .collect();
        for want in [
            "sparse_mla_decode_split_bf16",
            "sparse_mla_decode_split_fp8_ds_mla",
            "sparse_mla_decode_combine",
            "cache_write_bf16",
            "cache_write_fp8_ds_mla",
            "vbt_positions_to_slots",
        ] {
            assert!(
                names.iter().any(|n| n.starts_with(want)),
                "{} set lacks {want}: {names:?}",
                target.name()
            );
        }
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(
            unique.len(),
            names.len(),
            "duplicate kernel names: {names:?}"
        );
    }
}

#[test]
fn fp8_kernels_fit_the_portable_limits_and_document_the_row() {
    let set = standard_set().expect("standard set");
    for k in set.iter().filter(|k| k.kernel.name.contains("fp8_ds_mla")) {
        let bytes = k.kernel.shared_bytes();
        eprintln!(
            "{} {}: {bytes} B workgroup memory",
            k.target.name(),
            k.kernel.name
        );
        let src = match k.target {
            Target::Wgsl => {
                wgsl::check_portable_limits(&k.kernel).expect("portable limits");
                wgsl::emit(&k.kernel).expect("emit")
            }
            Target::Cuda => {
                // static shared memory up to 48 KB; above, dynamic up to SM120's 101376 B
                let dynamic = cuda::dynamic_shared_bytes(&k.kernel) as u64;
                assert!(
                    bytes <= 48 * 1024
                        || (dynamic >= bytes
                            && dynamic <= sparse_mla::kir::shared_plan::MAX_SHARED_BYTES),
                    "{}: {bytes} B of shared memory ({dynamic} B dynamic)",
                    k.kernel.name
                );
                cuda::emit(&k.kernel).expect("emit")
            }
        };
        for needle in [
            "656 bytes",
            "[512,528) 4 x f32 scales",
            "[528,656) 64 x bf16 rope",
        ] {
            assert!(
                src.contains(needle),
                "{}: header does not document the fp8_ds_mla row ({needle})",
                k.kernel.name
            );
        }
    }
}

#[test]
fn cuda_fp8_decode_uses_the_hardware_conversion_from_sm_89() {
    if let Some(why) = nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let set = standard_set().expect("standard set");
    let k = set
        .iter()
        .find(|k| k.target == Target::Cuda && k.kernel.name.contains("split_fp8_ds_mla"))
        .expect("fp8 decode in the set");
    let src = cuda::emit(&k.kernel).expect("emit");
    for (arch, hw) in [
        ("sm_80", false),
        ("sm_89", true),
        ("sm_90", true),
        ("sm_120", true),
    ] {
        let c = compile(&k.kernel.name, &src, arch, false).expect("compiles");
        assert_eq!(
            c.ptx.contains("cvt.rn.f16x2.e4m3x2"),
            hw,
            "{arch}: hardware e4m3 conversion expected: {hw}"
        );
    }
}
