//! The C plan helpers of `cuda/sparse_mla.h` make the same choices as the Rust runtime: the
//! header is compiled with the host C compiler and its kernel choice (the large-batch kernel,
//! v6 for a small bf16 call, or v6 / v7 by the v6 occupancy per SM: `DecodeConfig::for_call`
//! on the SM count and `v6_per_sm`), splits, chunk, grid, threads, shared memory and scratch sizes are compared with
//! what the CUDA backend launches (`for_call`, `lowered_kernels`, `DecodePlan::with_config`)
//! over a grid of shapes, SM counts, v6 occupancies and resident workgroup counts; its limit
//! checks reject what `check_shape` / `CacheGeometry` reject; `sparse_mla_v6_kernel` names the
//! kernel the runtime asks the occupancy of. A per-configuration header plans its one kernel
//! for every call.
//! Skipped, with the reason printed, when no C compiler is found (tools/test.sh requires one).

use sparse_mla::emit::cuda::dynamic_shared_bytes;
use sparse_mla::export::{c_header, config_files, ConfigRequest, ExportLowering, Lang};
use sparse_mla::kernels::sparse_mla_decode::{
    combine_grid, combine_groups, lowered_kernels, DecodeConfig, DecodePlan, WholeTokens,
};
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use sparse_mla::testing::test_seed;
use sparse_mla::util::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;

fn c_compiler() -> Option<String> {
    for cc in ["cc", "gcc", "clang"] {
        if Command::new(cc).arg("--version").output().is_ok() {
            return Some(cc.to_string());
        }
    }
    None
}

fn required(what: &str) -> bool {
    std::env::var("SPARSE_MLA_REQUIRE")
        .map(|r| r.split(',').any(|x| x.trim() == what))
        .unwrap_or(false)
}

const DRIVER: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include HEADER
int main(void) {
    /* lines of: format heads tokens topk num_slots lse_s_q sms v6_per_sm resident splits */
    int format; unsigned heads, tokens, topk, lse_s_q, sms, v6, resident, splits; unsigned long long slots;
    while (scanf("%d %u %u %u %llu %u %u %u %u %u", &format, &heads, &tokens, &topk, &slots, &lse_s_q, &sms, &v6,
                 &resident, &splits) == 10) {
        sparse_mla_decode_plan p;
        const char* err = sparse_mla_plan_decode(format, heads, tokens, topk, slots, lse_s_q, sms, v6, resident, splits,
                                                 &p);
        if (err) { printf("error %s\n", err); continue; }
        printf("ok %s %s %u %u %u %u %u %u %u %llu %llu %u %u %u", p.split_kernel, p.combine_kernel, p.splits, p.chunk,
               p.grid[0], p.grid[1], p.grid[2], p.threads, p.dynamic_smem, p.o_part_bytes, p.lse_part_bytes, p.block_h,
               p.block_n, p.combine_threads);
        if (p.splits > 1) printf(" combine %u %u %u %u", p.combine_grid[0], p.combine_grid[1], p.combine_grid[2], p.combine_groups);
        printf("\n");
    }
    {
        unsigned rw = 0, pw = 0;
        const char* e1 = sparse_mla_cache_strides(0, 10, 64, 0, 0, &rw, &pw);
        printf("strides %s %u %u\n", e1 ? e1 : "ok", rw, pw);
        e1 = sparse_mla_cache_strides(1, 10, 64, 658, 0, &rw, &pw);
        printf("strides %s\n", e1 ? e1 : "ok");
        e1 = sparse_mla_cache_strides(0, 1000000, 2048, 0, 0, &rw, &pw);
        printf("strides %s\n", e1 ? e1 : "ok");
    }
#ifdef V6_KERNEL
    {   /* the kernel whose occupancy is v6_per_sm, per head count */
        static const unsigned hs[] = {0, 1, 16, 17, 128, 4000};
        unsigned i;
        for (i = 0; i < sizeof hs / sizeof hs[0]; ++i) {
            sparse_mla_decode_plan p;
            const char* e = sparse_mla_v6_kernel(hs[i], &p);
            if (e) printf("v6 %u error %s\n", hs[i], e);
            else printf("v6 %u %s %u %u\n", hs[i], p.split_kernel, p.threads, p.dynamic_smem);
        }
    }
#endif
    return 0;
}
"#;

/// Compiles DRIVER against `header` (written into `dir`) with warnings as errors; `v6_kernel`:
/// with the lines of `sparse_mla_v6_kernel` (the standard header has it).
fn build_driver(cc: &str, dir: &Path, header: &str, header_text: &str, v6_kernel: bool) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(header), header_text).unwrap();
    std::fs::write(dir.join("driver.c"), DRIVER).unwrap();
    let exe = dir.join("driver");
    let out = Command::new(cc)
        .args(["-std=c99", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-DHEADER=\"{header}\""))
        .args(v6_kernel.then_some("-DV6_KERNEL"))
        .arg("-o")
        .arg(&exe)
        .arg(dir.join("driver.c"))
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cc} failed on {header}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Runs the driver on `input`, one output line per input line (then the strides lines). The
/// input is written from another thread: the driver's output would fill its pipe meanwhile.
fn run_driver(exe: &Path, input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(exe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

/// One planned call: (format, heads, tokens, topk, sms, v6_per_sm, resident, splits; 0: the
/// model).
type Case = (CacheFormat, u32, u32, u32, u32, u32, u32, u32);

fn input_line(&(format, heads, tokens, topk, sms, v6, resident, splits): &Case) -> String {
    format!(
        "{} {heads} {tokens} {topk} 65536 1 {sms} {v6} {resident} {splits}\n",
        (format == CacheFormat::Fp8DsMla) as u32
    )
}

fn shape_of(&(format, heads, tokens, topk, ..): &Case) -> DecodeShape {
    DecodeShape {
        tokens,
        heads,
        topk,
        num_pages: 1024,
        page_size: 64,
        dims: MlaDims::PRODUCTION,
        format,
        scale: 1.0,
        has_topk_length: false,
    }
}

/// The driver's line for a call launched with `config`: its kernels, threads, shared memory
/// and the plan `DecodePlan::with_config` makes for `resident` workgroups (the backend's).
fn expected_line(case: &Case, config: DecodeConfig) -> (String, DecodePlan) {
    let &(_, heads, tokens, _, sms, _, resident, splits) = case;
    let shape = shape_of(case);
    let (split, combine) = lowered_kernels(&config).unwrap();
    // the header's plans split every token alike (the runtime's whole-token kernels are not
    // exported)
    let plan = DecodePlan::with_config_whole(
        config,
        &shape,
        resident,
        sms,
        (splits > 0).then_some(splits),
        WholeTokens::Off,
    )
    .unwrap();
    let grid = plan.grid_split(&shape);
    let rows = tokens as u64 * heads as u64 * plan.splits as u64;
    let (o_bytes, l_bytes) = if plan.splits > 1 {
        (rows * 512 * 4, rows * 4)
    } else {
        (0, 0)
    };
    let want = format!(
        "ok {} {} {} {} {} {} {} {} {} {o_bytes} {l_bytes} {} {} {}",
        split.name,
        combine.name,
        plan.splits,
        plan.chunk,
        grid[0],
        grid[1],
        grid[2],
        split.workgroup_size,
        dynamic_shared_bytes(&split),
        config.block_h,
        config.block_n,
        combine.workgroup_size,
    );
    // the combine's groups and grid, as launches() computes them
    let want = if plan.splits > 1 {
        let threads = combine.workgroup_size;
        let g = combine_groups(tokens * heads, plan.splits, threads);
        let cg = combine_grid(heads, tokens, 512, g, threads);
        format!("{want} combine {} {} {} {g}", cg[0], cg[1], cg[2])
    } else {
        want
    };
    (want, plan)
}

#[test]
fn c_plan_matches_the_runtime_plan() {
    let Some(cc) = c_compiler() else {
        assert!(!required("g++"), "no C compiler found (required)");
        println!("SKIPPED c_plan_matches_the_runtime_plan: no C compiler (cc, gcc, clang)");
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("export_header");
    // the header exactly as `mla-export --all` writes it (the kernel structs are irrelevant here)
    let exe = build_driver(&cc, &dir, "sparse_mla.h", &c_header(&[]).unwrap(), true);

    let seed = test_seed();
    println!("c_plan_matches_the_runtime_plan: seed {seed} (SPARSE_MLA_SEED replays)");
    let mut rng = Rng::new(seed);
    let mut cases: Vec<Case> = Vec::new();
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        for heads in [1u32, 3, 8, 16, 17, 32, 64, 100, 128] {
            // around T * ceil(H / 16) * 2 = SMs for 84, 132 and 188 SMs
            for tokens in [1u32, 2, 8, 33, 41, 42, 65, 66, 93, 94, 128, 144, 1000] {
                for topk in [1u32, 31, 64, 100, 2048, 2049] {
                    for sms in [132u32, 188, 84] {
                        // bf16 v6 workgroups per SM: SM120 / sm_86/89 (1), H100/H200 (2), and
                        // a GPU with room for more (3: the rule is `>= 2`)
                        for v6 in [1u32, 2, 3] {
                            // the chosen kernel's occupancy x SMs, at times something odd
                            let resident = match rng.below(8) {
                                0 => [1u32, 377][rng.below(2) as usize],
                                r => sms * (1 + r as u32 % 2),
                            };
                            let splits = if rng.below(4) == 0 {
                                1 + rng.below(80) as u32
                            } else {
                                0
                            };
                            cases.push((format, heads, tokens, topk, sms, v6, resident, splits));
                        }
                    }
                }
            }
        }
    }
    let mut input: String = cases.iter().map(input_line).collect();
    // limits: tokens 0 and 65536, a cache of 8 GiB, lse_s_q not dividing T, heads 0, sms 0,
    // v6_per_sm 0 (both formats)
    input.push_str("0 16 0 2048 65536 1 132 2 132 0\n0 16 65536 2048 65536 1 132 2 132 0\n");
    input.push_str(
        "0 16 4 2048 7456541 1 132 2 132 0\n0 16 6 2048 65536 4 132 2 132 0\n0 0 6 2048 65536 1 132 2 132 0\n",
    );
    input.push_str("1 16 6 2048 65536 1 0 2 132 0\n");
    input.push_str("0 16 6 2048 65536 1 132 0 132 0\n1 64 6 2048 65536 1 132 0 132 0\n");
    let text = run_driver(&exe, &input);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        cases.len() + 8 + 3 + 6,
        "driver output:\n{text}"
    );
    let mut multi_split = 0;
    // (format, kernel family) -> calls
    let mut picked = std::collections::HashMap::new();
    for (line, case) in lines.iter().zip(&cases) {
        let &(format, heads, tokens, topk, sms, v6, resident, splits) = case;
        // what the CUDA backend runs (runtime/cuda.rs decode_kernel_choice) on a GPU of `sms`
        // SMs that holds `v6` bf16 v6 workgroups per SM
        let config = DecodeConfig::for_call(&shape_of(case), sms, || {
            Ok::<u32, std::convert::Infallible>(v6)
        })
        .unwrap();
        let (want, plan) = expected_line(case, config);
        assert_eq!(
            *line, want,
            "format {format:?} H {heads} T {tokens} topk {topk} sms {sms} v6_per_sm {v6} resident {resident} splits {splits}"
        );
        multi_split += (plan.splits > 1) as u32;
        let dims = MlaDims::PRODUCTION;
        let family = if Some(config) == DecodeConfig::tensor_core_batch(dims, format, heads) {
            "batch"
        } else if Some(config) == DecodeConfig::tensor_core_wide(dims, format) {
            "wide"
        } else if Some(config) == DecodeConfig::tensor_core_narrow_wide(dims, format, heads) {
            "narrow wide"
        } else if Some(config) == DecodeConfig::tensor_core_narrow(dims, format, heads) {
            "narrow"
        } else if Some(config) == DecodeConfig::tensor_core_v6_narrow(dims, format, heads) {
            "v6 narrow"
        } else if config == DecodeConfig::tensor_core_v6(dims, format, heads) {
            "v6"
        } else if config == DecodeConfig::tensor_core_v7(dims, format, heads) {
            "v7"
        } else {
            panic!("{config:?}: neither the large-batch kernel, v6 nor v7")
        };
        *picked
            .entry((format, family, heads <= 16, v6))
            .or_insert(0u32) += 1;
    }
    // the grid must exercise both the one-split and the combine paths
    assert!(multi_split > 20 && (multi_split as usize) < cases.len() - 20);
    // and every side of the rules: fp8's large batch at H <= 16 (bf16's large-batch kernel is
    // never planned); v7 in each head range at any v6_per_sm for both formats (since v42), and
    // bf16's smallest calls at H <= 16 on v6
    let count = |k: (CacheFormat, &str, bool, u32)| picked.get(&k).copied().unwrap_or(0);
    for v6 in [1u32, 2, 3] {
        let n = count((CacheFormat::Fp8DsMla, "batch", true, v6));
        assert!(n > 20, "fp8_ds_mla v6_per_sm {v6}: {n} large batches");
        let n = count((CacheFormat::Bf16, "batch", true, v6));
        assert_eq!(n, 0, "bf16 v6_per_sm {v6}: {n} large batches");
        let n = count((CacheFormat::Bf16, "v6", true, v6));
        assert!(n > 5, "bf16 v6 v6_per_sm {v6} H <= 16: {n} calls");
        let n = count((CacheFormat::Bf16, "v6", false, v6));
        assert_eq!(n, 0, "bf16 v6 in 32-head blocks, v6_per_sm {v6}: {n} calls");
        for small in [true, false] {
            for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
                let family = "v7";
                let n = count((format, family, small, v6));
                assert!(
                    n > 50,
                    "{format:?} {family} v6_per_sm {v6} H <= 16 {small}: {n} calls"
                );
            }
        }
    }
    // narrow calls (v7 in 16-head blocks above 16 heads) in both formats
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        let n: u32 = [1u32, 2, 3]
            .iter()
            .map(|&v6| count((format, "narrow", false, v6)))
            .sum();
        assert!(n > 10, "{format:?}: {n} narrow calls");
    }
    // and fp8's of 6 blocks or more on its large-batch kernel (64-row steps)
    let n: u32 = [1u32, 2, 3]
        .iter()
        .map(|&v6| count((CacheFormat::Fp8DsMla, "narrow wide", false, v6)))
        .sum();
    assert!(n > 5, "{n} fp8_ds_mla narrow calls on 64-row steps");
    // and bf16's wide calls on v7 in 64-head blocks (H 64 and 128), at every residency (where
    // v6 would not keep the call), and never fp8_ds_mla's
    for v6 in [1u32, 2, 3] {
        let n = count((CacheFormat::Bf16, "wide", false, v6));
        assert!(n > 20, "v6_per_sm {v6}: {n} bf16 wide calls");
        assert_eq!(count((CacheFormat::Fp8DsMla, "wide", false, v6)), 0);
    }
    // and bf16 v6 in 16-head blocks above 16 heads, at any residency
    for v6 in [1u32, 2, 3] {
        let n = count((CacheFormat::Bf16, "v6 narrow", false, v6));
        assert!(
            n > 5,
            "v6_per_sm {v6}: {n} bf16 calls on v6 in 16-head blocks"
        );
    }
    assert_eq!(
        [1u32, 2, 3]
            .iter()
            .map(|&v6| count((CacheFormat::Fp8DsMla, "v6 narrow", false, v6)))
            .sum::<u32>(),
        0
    );
    let tail = &lines[cases.len()..];
    assert!(tail[0].starts_with("error tokens:"), "{}", tail[0]);
    assert!(tail[1].starts_with("error tokens:"), "{}", tail[1]);
    assert!(tail[2].starts_with("error kv_cache:"), "{}", tail[2]);
    assert!(tail[3].starts_with("error lse_s_q:"), "{}", tail[3]);
    assert!(tail[4].starts_with("error heads:"), "{}", tail[4]);
    assert!(tail[5].starts_with("error sms:"), "{}", tail[5]);
    assert!(tail[6].starts_with("error v6_per_sm:"), "{}", tail[6]);
    assert!(tail[7].starts_with("error v6_per_sm:"), "{}", tail[7]);
    assert_eq!(tail[8], "strides ok 288 18432");
    assert!(tail[9].starts_with("strides row stride:"), "{}", tail[9]);
    assert!(tail[10].starts_with("strides kv_cache:"), "{}", tail[10]);
    // sparse_mla_v6_kernel: the kernel the runtime asks the occupancy of for `v6_per_sm`
    assert!(tail[11].starts_with("v6 0 error heads:"), "{}", tail[11]);
    for (line, heads) in tail[12..].iter().zip([1u32, 16, 17, 128, 4000]) {
        let v6 = DecodeConfig::tensor_core_v6(MlaDims::PRODUCTION, CacheFormat::Bf16, heads);
        let (split, _) = lowered_kernels(&v6).unwrap();
        let want = format!(
            "v6 {heads} {} {} {}",
            split.name,
            split.workgroup_size,
            dynamic_shared_bytes(&split)
        );
        assert_eq!(*line, want);
    }
}

/// A per-configuration header carries one split kernel per head range and no large-batch
/// kernel: its plan is that kernel's for every call, large batches included, with the
/// backend's splits for that kernel.
#[test]
fn config_header_plans_its_one_kernel() {
    let Some(cc) = c_compiler() else {
        assert!(!required("g++"), "no C compiler found (required)");
        println!("SKIPPED config_header_plans_its_one_kernel: no C compiler (cc, gcc, clang)");
        return;
    };
    for (format, heads) in [
        (CacheFormat::Bf16, 16u32),
        (CacheFormat::Fp8DsMla, 3),
        (CacheFormat::Bf16, 64),
    ] {
        let req = ConfigRequest {
            shape: DecodeShape {
                tokens: 128,
                ..shape_of(&(format, heads, 1, 2048, 0, 0, 0, 0))
            },
            splits: None,
            sms: 132,
            per_sm: None,
            lang: Lang::Cuda,
            lowering: ExportLowering::Mma,
            arch: "sm_90".into(),
        };
        let files = config_files(&req).unwrap();
        let header = files
            .iter()
            .find(|f| f.path.extension().is_some_and(|e| e == "h"))
            .expect("a launch header");
        let name = header
            .path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        let text = String::from_utf8(header.contents.clone()).unwrap();
        let config = DecodeConfig::tensor_core(MlaDims::PRODUCTION, format, heads);
        let (split, _) = lowered_kernels(&config).unwrap();
        let batch = DecodeConfig::tensor_core_batch(MlaDims::PRODUCTION, format, heads)
            .filter(|_| DecodeConfig::plans_large_batch(format));
        // the comment names the one kernel, and the large-batch kernel it does not carry
        assert!(
            text.contains("ONE KERNEL.") && text.contains(&split.name),
            "{name}"
        );
        // it says plainly which kernel it is: v7 for both formats at any residency (bf16 above
        // 16 heads since v42), and no other variant of the standard set at its head count
        let v7 = DecodeConfig::tensor_core_v7(MlaDims::PRODUCTION, format, heads);
        let (v7_split, _) = lowered_kernels(&v7).unwrap();
        assert_eq!(split.name, v7_split.name, "{name}");
        assert!(text.contains("one fixed decode kernel, v7,"), "{name}");
        assert!(!text.contains("it runs v7 instead"), "{name}");
        if let Some(b) = batch {
            let (b_split, _) = lowered_kernels(&b).unwrap();
            assert!(
                text.contains(&format!(
                    "//   {}\n// It is not in this export",
                    b_split.name
                )),
                "{name}"
            );
        } else {
            assert!(!text.contains("large-batch kernel instead"), "{name}");
        }
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("export_header_config")
            .join(format!("{}_{heads}", format.name()));
        let exe = build_driver(&cc, &dir, &name, &text, false);
        let head_list: Vec<u32> = if heads <= 16 {
            vec![1, 3, 16]
        } else {
            vec![17, 64, 128]
        };
        let mut cases: Vec<Case> = Vec::new();
        for &h in &head_list {
            for tokens in [1u32, 65, 66, 1000] {
                for (sms, v6, resident) in [(132u32, 2u32, 264u32), (84, 1, 84)] {
                    cases.push((format, h, tokens, 2048, sms, v6, resident, 0));
                }
            }
        }
        let input: String = cases.iter().map(input_line).collect();
        let text = run_driver(&exe, &input);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), cases.len() + 3, "driver output:\n{text}");
        let mut large = 0;
        for (line, case) in lines.iter().zip(&cases) {
            let (want, _) = expected_line(case, config);
            assert_eq!(*line, want, "{name}: {case:?}");
            large +=
                (batch.is_some() && DecodeConfig::is_large_batch(&shape_of(case), case.4)) as u32;
        }
        assert!(
            batch.is_none() || large > 0,
            "{name}: no large batch among the calls"
        );
    }
}
