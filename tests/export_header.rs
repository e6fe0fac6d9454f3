//! The C plan helpers of `cuda/sparse_mla.h` make the same choices as the Rust runtime: the
//! header is compiled with the host C compiler and its variant, splits, chunk, grid and scratch
//! sizes are compared with `DecodePlan::with_config` over a grid of shapes and resident
//! workgroup counts; its limit checks reject what `check_shape` / `CacheGeometry` reject.
//! Skipped, with the reason printed, when no C compiler is found (tools/test.sh requires one).

use sparse_mla::export::{c_header, decode_variants, ExportLowering};
use sparse_mla::kernels::sparse_mla_decode::{combine_grid, combine_groups, DecodePlan};
use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
use sparse_mla::testing::test_seed;
use sparse_mla::util::Rng;
use std::path::PathBuf;
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
#include "sparse_mla.h"
int main(void) {
    /* lines of: format heads tokens topk num_slots lse_s_q resident splits */
    int format; unsigned heads, tokens, topk, lse_s_q, resident, splits; unsigned long long slots;
    while (scanf("%d %u %u %u %llu %u %u %u", &format, &heads, &tokens, &topk, &slots, &lse_s_q, &resident, &splits) == 8) {
        sparse_mla_decode_plan p;
        const char* err = sparse_mla_plan_decode(format, heads, tokens, topk, slots, lse_s_q, resident, splits, &p);
        if (err) { printf("error %s\n", err); continue; }
        printf("ok %s %s %u %u %u %u %u %u %u %llu %llu %u", p.split_kernel, p.combine_kernel, p.splits, p.chunk,
               p.grid[0], p.grid[1], p.grid[2], p.threads, p.dynamic_smem, p.o_part_bytes, p.lse_part_bytes, p.block_n);
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
    return 0;
}
"#;

#[test]
fn c_plan_matches_the_runtime_plan() {
    let Some(cc) = c_compiler() else {
        assert!(!required("g++"), "no C compiler found (required)");
        println!("SKIPPED c_plan_matches_the_runtime_plan: no C compiler (cc, gcc, clang)");
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("export_header");
    std::fs::create_dir_all(&dir).unwrap();
    // the header exactly as `mla-export --all` writes it (the kernel structs are irrelevant here)
    std::fs::write(dir.join("sparse_mla.h"), c_header(&[]).unwrap()).unwrap();
    std::fs::write(dir.join("driver.c"), DRIVER).unwrap();
    let exe = dir.join("driver");
    let out = Command::new(&cc)
        .args(["-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(dir.join("driver.c"))
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cc} failed on sparse_mla.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let seed = test_seed();
    println!("c_plan_matches_the_runtime_plan: seed {seed} (SPARSE_MLA_SEED replays)");
    let mut rng = Rng::new(seed);
    let mut cases = Vec::new();
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        for heads in [1u32, 8, 16, 17, 32, 64, 100, 128] {
            for tokens in [1u32, 2, 8, 32, 128, 1000] {
                for topk in [1u32, 31, 64, 100, 2048, 2049] {
                    let resident = [132u32, 264, 188, 1, 377][rng.below(5) as usize];
                    let splits = if rng.below(4) == 0 {
                        1 + rng.below(80) as u32
                    } else {
                        0
                    };
                    cases.push((format, heads, tokens, topk, resident, splits));
                }
            }
        }
    }
    let mut input = String::new();
    for (format, heads, tokens, topk, resident, splits) in &cases {
        input.push_str(&format!(
            "{} {heads} {tokens} {topk} 65536 1 {resident} {splits}\n",
            (*format == CacheFormat::Fp8DsMla) as u32
        ));
    }
    // limits: tokens 0 and 65536, a cache of 8 GiB, lse_s_q not dividing T, heads 0
    input.push_str("0 16 0 2048 65536 1 132 0\n0 16 65536 2048 65536 1 132 0\n");
    input.push_str(
        "0 16 4 2048 7456541 1 132 0\n0 16 6 2048 65536 4 132 0\n0 0 6 2048 65536 1 132 0\n",
    );
    let run = {
        use std::io::Write;
        let mut child = Command::new(&exe)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let text = String::from_utf8(run.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), cases.len() + 5 + 3, "driver output:\n{text}");
    let mut multi_split = 0;
    for (line, (format, heads, tokens, topk, resident, splits)) in lines.iter().zip(&cases) {
        let shape = DecodeShape {
            tokens: *tokens,
            heads: *heads,
            topk: *topk,
            num_pages: 1024,
            page_size: 64,
            dims: MlaDims::PRODUCTION,
            format: *format,
            scale: 1.0,
            has_topk_length: false,
        };
        let variant = decode_variants(ExportLowering::Mma, *format)
            .unwrap()
            .into_iter()
            .find(|v| v.contains(*heads))
            .unwrap();
        let plan = DecodePlan::with_config(
            variant.config,
            &shape,
            *resident,
            (*splits > 0).then_some(*splits),
        )
        .unwrap();
        let first = &variant.split.name;
        let grid = plan.grid_split(&shape);
        let rows = *tokens as u64 * *heads as u64 * plan.splits as u64;
        let (o_bytes, l_bytes) = if plan.splits > 1 {
            (rows * 512 * 4, rows * 4)
        } else {
            (0, 0)
        };
        let want = format!(
            "ok {first} {} {} {} {} {} {} {} {} {o_bytes} {l_bytes} {}",
            variant.combine.name,
            plan.splits,
            plan.chunk,
            grid[0],
            grid[1],
            grid[2],
            variant.split.workgroup_size,
            variant.dynamic_smem(),
            variant.config.block_n
        );
        // the combine's groups and grid, as launches() computes them
        let want = if plan.splits > 1 {
            let threads = variant.combine.workgroup_size;
            let g = combine_groups(*tokens * *heads, plan.splits, threads);
            let cg = combine_grid(*heads, *tokens, 512, g, threads);
            format!("{want} combine {} {} {} {g}", cg[0], cg[1], cg[2])
        } else {
            want
        };
        assert_eq!(
            *line, want,
            "format {format:?} H {heads} T {tokens} topk {topk} resident {resident} splits {splits}"
        );
        multi_split += (plan.splits > 1) as u32;
    }
    // the grid must exercise both the one-split and the combine paths
    assert!(multi_split > 20 && (multi_split as usize) < cases.len() - 20);
    let tail = &lines[cases.len()..];
    assert!(tail[0].starts_with("error tokens:"), "{}", tail[0]);
    assert!(tail[1].starts_with("error tokens:"), "{}", tail[1]);
    assert!(tail[2].starts_with("error kv_cache:"), "{}", tail[2]);
    assert!(tail[3].starts_with("error lse_s_q:"), "{}", tail[3]);
    assert!(tail[4].starts_with("error heads:"), "{}", tail[4]);
    assert_eq!(tail[5], "strides ok 288 18432");
    assert!(tail[6].starts_with("strides row stride:"), "{}", tail[6]);
    assert!(tail[7].starts_with("strides kv_cache:"), "{}", tail[7]);
}
