//! The tensor-core lowering, run on the CPU: every kernel the CUDA backend would launch is
//! printed as CUDA C, compiled by g++ against an emulator of CUDA and of the PTX
//! instructions its helpers use (tests/emu), and the whole conformance suite runs on it
//! against the float64 reference — three times: the kernels the backend picks on a GPU of one
//! v6 workgroup per SM (`DecodeConfig::for_call`: v7, the large-batch kernel — bf16 in two warp
//! groups, fp8 on 64-row steps — for a large batch at H <= 16, v6 for a small bf16 call; bf16's
//! two-group kernel also on the shorter walks the backend took it for before v36, tests/emu)
//! compiled as for sm_120 (the sm_90+ copy paths, e4m3 products as m16n8k32 e4m3 mma) with
//! copies landing as late as allowed,
//! the choice made for 6 SMs (every fp8 call at H <= 16 on the large-batch kernel) and the
//! scores held in rows for the softmax (`DecodeConfig::with_row_softmax`: v7's and fp8's
//! large-batch form, and here bf16's two-group kernel's too, which the backend keeps in
//! fragments), the same with the sm_80 paths (e4m3 widened to bf16), copies landing at issue,
//! every kernel's scores in fragments (their form under `SPARSE_MLA_ROW_SOFTMAX=0`) and the
//! choice made for 96 SMs (fp8 at T <= 4 on v7, the narrow calls on v7 in 16-head blocks,
//! small bf16 calls on v6, above 16 heads in 16-head blocks, fp8's narrow calls of 6 blocks
//! or more on 64-row steps; the run fails if it planned none of the last three), and
//! the v6 kernels as for sm_90, each under a random warp schedule and the shared-memory race
//! detector — and a fourth time on the decode cases only, v7 with a one-stage ring (whose
//! producers must issue a step's rows before that step's wait: a misplaced issue deadlocks,
//! which the emulator reports); and one small fp8 case on v7 in 32-head blocks of 64-row
//! steps (its split-K scores summed by warps of two m fragments). Fragment layouts, ldmatrix
//! addressing, helper operand orders, the copy pipeline and its synchronisation are all
//! checked here without a GPU. `SPARSE_MLA_SEED` replays a run; `SPARSE_MLA_EMU_CASE`
//! picks cases by name. The four runs go at once, a thread each (their lines tagged `emuN`),
//! so that their kernel compiles use every core; `SPARSE_MLA_EMU_SERIAL=1` runs them one
//! after another. `SPARSE_MLA_EMU_DUMP=path` records a hash of every result read back, a
//! file per run, to show that a change to the emulator leaves the results bit for bit.

mod common;
mod emu;

use sparse_mla::conformance::{all_cases, decode_cases, Case, DecodeCase};
use sparse_mla::mla::CacheFormat;
use sparse_mla::runtime::gpu::GpuBackend;
use sparse_mla::testing::test_seed;

#[test]
fn conformance_on_the_emulated_tensor_core_lowering() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    let filter = std::env::var("SPARSE_MLA_EMU_CASE").ok();
    // The four runs at once, a thread each (the emulator's state is per thread), so that
    // their g++ compiles and emulated launches use every core; each run's results do not
    // depend on the others'. Lines are tagged with their run.
    let start = std::time::Instant::now();
    let serial = std::env::var("SPARSE_MLA_EMU_SERIAL").is_ok_and(|v| v == "1");
    let runs: Vec<(Vec<String>, String)> = if serial {
        (0..4).map(|mode| run(mode, filter.as_deref())).collect()
    } else {
        std::thread::scope(|s| {
            let runs: Vec<_> = (0..4)
                .map(|mode| {
                    let filter = filter.as_deref();
                    s.spawn(move || run(mode, filter))
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    };
    for (_, summary) in &runs {
        eprintln!("{summary}");
    }
    eprintln!("emu: all runs in {:.1} s", start.elapsed().as_secs_f64());
    let failed: Vec<String> = runs.into_iter().flat_map(|(f, _)| f).collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// One run of the suite on the emulator in `mode`: the failures and a summary line.
fn run(mode: u32, filter: Option<&str>) -> (Vec<String>, String) {
    let seed = test_seed();
    let config = emu::EmuConfig::mode(mode, seed);
    eprintln!("emu run {mode}: {}", config.describe());
    // A small GPU: 6 resident workgroups, so the split heuristic splits small cases.
    let backend = GpuBackend::new(emu::EmuDevice::with(6, config));
    let cases: Vec<Box<dyn Case>> = if config.one_stage {
        decode_cases()
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Case>)
            .collect()
    } else {
        all_cases()
    };
    let mut failed = Vec::new();
    let (mut ran, mut merged, run_start) = (0, 0, std::time::Instant::now());
    for case in cases {
        if filter.is_some_and(|f| !case.name().contains(f)) {
            continue;
        }
        ran += 1;
        let start = std::time::Instant::now();
        match case.run(&backend, seed) {
            Ok(o) => {
                merged += o.detail.ends_with(" merged") as u32;
                eprintln!(
                    "emu{mode} {:<40} rel_l2 {:.2e} lse_err {:.2e} {:<10} {:>6.1} s {}",
                    o.case,
                    o.rel_l2,
                    o.lse_err,
                    o.detail,
                    start.elapsed().as_secs_f64(),
                    if o.passed() { "ok" } else { "FAIL" }
                );
                if !o.passed() {
                    failed.push(format!(
                        "{} (SPARSE_MLA_SEED={seed}, {}): {}",
                        o.case,
                        config.describe(),
                        o.failures.join("; ")
                    ));
                }
            }
            Err(e) => failed.push(format!(
                "{} (SPARSE_MLA_SEED={seed}, {}): error: {e}",
                case.name(),
                config.describe()
            )),
        }
    }
    // a run that merges must have run the merged kernel on some decode case (the suite has
    // small multi-split bf16 calls), or its merge path went untested
    let all_decode = filter.is_none_or(|f| f.starts_with("decode") && "decode/".contains(f));
    if config.merge.is_some() && ran > 0 && merged == 0 && all_decode {
        failed.push(format!(
            "run {mode} ({}): no case ran the merged kernel",
            config.describe()
        ));
    }
    // run 1 (the backend's choice on 96 SMs) must have planned the narrow-call kernel of
    // both formats (the suite's H 128 T 1 bf16 and H 64 T 1 fp8_ds_mla cases), or it went
    // untested
    let narrow = backend
        .device()
        .narrow_plans
        .each_ref()
        .map(|n| n.load(std::sync::atomic::Ordering::Relaxed));
    if mode == 1 && all_decode && narrow.contains(&0) {
        failed.push(format!(
            "run {mode} ({}): narrow-call kernels planned [bf16, fp8] {narrow:?}: each should be",
            config.describe()
        ));
    }
    // runs 0 and 2 (whole tokens forced) must have run the whole-token kernels of both
    // formats, or that path went untested
    let whole = backend
        .device()
        .whole_plans
        .each_ref()
        .map(|n| n.load(std::sync::atomic::Ordering::Relaxed));
    if matches!(mode, 0 | 2) && all_decode && whole.contains(&0) {
        failed.push(format!(
            "run {mode} ({}): calls planned with whole tokens [bf16, fp8] {whole:?}: each should be",
            config.describe()
        ));
    }
    // and bf16 v6 in 16-head blocks above 16 heads (the suite's H 40 T 1 case)
    let v6_narrow = backend
        .device()
        .v6_narrow_plans
        .load(std::sync::atomic::Ordering::Relaxed);
    if mode == 1 && all_decode && v6_narrow == 0 {
        failed.push(format!(
            "run {mode} ({}): no call planned bf16 v6 in 16-head blocks above 16 heads",
            config.describe()
        ));
    }
    // and fp8's narrow calls of 6 blocks or more on its 64-row kernel (the H 128 T 1 case)
    let narrow_wide = backend
        .device()
        .narrow_wide_plans
        .load(std::sync::atomic::Ordering::Relaxed);
    if mode == 1 && all_decode && narrow_wide == 0 {
        failed.push(format!(
            "run {mode} ({}): no fp8_ds_mla narrow call planned on 64-row steps",
            config.describe()
        ));
    }
    // and bf16's wide calls on v7 in 64-head blocks (runs 0 and 1 plan as the backend does:
    // on 6 SMs every bf16 case of whole 64-head blocks, on 96 the H 64 T 12 and H 128 T 6 ones)
    let wide = backend.device().heads_plans[0].load(std::sync::atomic::Ordering::Relaxed);
    if matches!(mode, 0 | 1) && all_decode && wide == 0 {
        failed.push(format!(
            "run {mode} ({}): no bf16 wide call planned on v7 in 64-head blocks",
            config.describe()
        ));
    }
    let summary = format!(
        "emu run {mode}: {ran} cases, {} failed ({merged} merged, {} narrow), {:.1} s ({})",
        failed.len(),
        narrow[0] + narrow[1],
        run_start.elapsed().as_secs_f64(),
        config.describe()
    );
    (failed, summary)
}

/// v7 in 32-head blocks of 64-row steps (fp8_ds_mla, one stage): the split-K scores are
/// summed by 4 warps of 2 x 2 fragments each, two m fragments a warp — the sum once covered
/// only a warp's first m fragment, and heads 16-31 of every block took unsummed scores
/// (rel L2 ~0.5-0.7, on the H200 too). One small case; the kernel compile is most of its time.
#[test]
fn split_k_scores_summed_over_two_m_fragments_a_warp() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    let seed = test_seed();
    let config = emu::EmuConfig {
        arch: 900,
        block: Some((32, 64, 1)),
        ..emu::EmuConfig::mode(3, seed)
    };
    let backend = GpuBackend::new(emu::EmuDevice::with(6, config));
    let name = "decode/fp8_t2_h128_k64_p64_mixed_s1";
    let case = decode_cases()
        .into_iter()
        .find(|c| c.name() == name)
        .unwrap_or_else(|| panic!("no case {name}"));
    let o = case
        .run(&backend, seed)
        .unwrap_or_else(|e| panic!("{name} ({}): {e}", config.describe()));
    eprintln!(
        "{} rel_l2 {:.2e} lse_err {:.2e} {}",
        o.case, o.rel_l2, o.lse_err, o.detail
    );
    assert!(
        o.passed(),
        "{name} (SPARSE_MLA_SEED={seed}, {}): {}",
        config.describe(),
        o.failures.join("; ")
    );
}

/// The merged kernels (split and combine in one launch) with the scores held in rows
/// (`DecodeConfig::with_row_softmax`, v7's default): the suite's run 0 takes that form but
/// keeps two launches, and run 1 merges in the fragment form. Here run 1's setting (the choice for 96
/// SMs, merged wherever it can) with sm_90's helpers — the H200's path, where run 0 takes
/// sm_120's — on the long top-k lists, in rows (its fp8 calls
/// run v7 there; its small bf16 calls v6, which has no row form); at least one case must have
/// run merged.
#[test]
fn merged_kernels_with_the_scores_held_in_rows() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    let seed = test_seed();
    let config = emu::EmuConfig {
        row_softmax: Some(emu::RowSoftmax::Rows),
        arch: 900,
        ..emu::EmuConfig::mode(1, seed)
    };
    let backend = GpuBackend::new(emu::EmuDevice::with(6, config));
    let mut failed = Vec::new();
    let long = decode_cases()
        .into_iter()
        .filter(|c| c.name().contains("k2048"));
    let merged = run_cases(&backend, long, seed, &mut failed);
    assert!(
        failed.is_empty(),
        "SPARSE_MLA_SEED={seed}, {}: {}",
        config.describe(),
        failed.join("\n")
    );
    assert!(merged > 0, "{}: no case ran merged", config.describe());
}

/// Runs `cases` on `backend`, a line each; what failed (with why) into `failed`. Returns
/// how many ran merged.
fn run_cases(
    backend: &GpuBackend<emu::EmuDevice>,
    cases: impl IntoIterator<Item = DecodeCase>,
    seed: u64,
    failed: &mut Vec<String>,
) -> u32 {
    let mut merged = 0;
    for case in cases {
        match case.run(backend, seed) {
            Ok(o) => {
                merged += o.detail.ends_with(" merged") as u32;
                eprintln!(
                    "{} rel_l2 {:.2e} lse_err {:.2e} {}",
                    o.case, o.rel_l2, o.lse_err, o.detail
                );
                if !o.passed() {
                    failed.push(format!("{}: {}", o.case, o.failures.join("; ")));
                }
            }
            Err(e) => failed.push(format!("{}: error: {e}", case.name())),
        }
    }
    merged
}

/// Head-group kernels forced on every decode case of more than 16 heads, each head count
/// (not only whole 64-head blocks: a last block part empty): bf16's wide-call kernel
/// (`DecodeConfig::tensor_core_wide`, `SPARSE_MLA_DECODE_KERNEL=wide`: 64 heads as four
/// groups of 2 warps) as run 0 (sm_120's helpers, copies landing late, whole tokens before
/// split ones) and as run 1 (sm_80's helpers, copies landing at issue); and, as run 0,
/// fp8_ds_mla's 32-head blocks as two groups of 4 warps (`32x32x2w4h2`, scores in fragments:
/// a form mla-bench's variants time, not one the backend picks). The groups walk the same
/// steps apart: group 0's producers refill a stage only once every thread of every group has
/// released it, which the race detector checks, and each group writes its own heads.
///
/// fp8_ds_mla's values decoded once a step into a shared tile (`Fp8Values::Shared`, the
/// variants' `v`), a form the backend does not pick either: in the 64-head form as run 0,
/// where every thread of every group decodes its share of the one tile between workgroup
/// barriers, and on the planned kernels (one warp group) as run 1.
#[test]
fn head_groups_over_one_ring_on_the_decode_cases() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    let seed = test_seed();
    let mut failed = Vec::new();
    let wide = ((64, 32, 2), 2, 4);
    let (per_warp, shared) = (emu::Fp8Values::PerWarp, emu::Fp8Values::Shared);
    for (mode, form, format, values) in [
        (0, Some(wide), CacheFormat::Bf16, per_warp),
        (1, Some(wide), CacheFormat::Bf16, per_warp),
        (
            0,
            Some(((32, 32, 2), 4, 2)),
            CacheFormat::Fp8DsMla,
            per_warp,
        ),
        (0, Some(wide), CacheFormat::Fp8DsMla, shared),
        (1, None, CacheFormat::Fp8DsMla, shared),
    ] {
        let config = emu::EmuConfig {
            heads: form,
            merge: None,
            row_softmax: None,
            fp8_values: values,
            ..emu::EmuConfig::mode(mode, seed)
        };
        let backend = GpuBackend::new(emu::EmuDevice::with(6, config));
        let mut wrong = Vec::new();
        let cases = decode_cases()
            .into_iter()
            .filter(|c| c.heads > 16 && c.format == format);
        run_cases(&backend, cases, seed, &mut wrong);
        failed.extend(
            wrong
                .into_iter()
                .map(|w| format!("{}: {w}", config.describe())),
        );
        let plans = &backend.device().heads_plans;
        let [bf16, fp8] = [0, 1].map(|i| plans[i].load(std::sync::atomic::Ordering::Relaxed));
        let grouped = form.is_some();
        if (bf16 > 0) != (grouped && format == CacheFormat::Bf16)
            || (fp8 > 0) != (grouped && format != CacheFormat::Bf16)
        {
            failed.push(format!(
                "{}: calls planned on head groups: bf16 {bf16}, fp8_ds_mla {fp8}",
                config.describe()
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "SPARSE_MLA_SEED={seed}: {}",
        failed.join("\n")
    );
}
