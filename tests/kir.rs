//! The description language refuses what it cannot print, with errors that say why.

use sparse_mla::emit::{cuda, wgsl};
use sparse_mla::kir::builder::*;
use sparse_mla::kir::ir::*;
use sparse_mla::kir::{lower, Lowering};
use sparse_mla::Error;

#[test]
fn type_mismatch_is_reported_by_finish() {
    let mut b = KernelBuilder::new("bad_types", 64);
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[1]");
    let x = b.let_("x", u(1) + f(2.0));
    b.store(&out, u(0), x.as_f32());
    match b.finish() {
        Err(Error::Kir { kernel, message }) => {
            assert_eq!(kernel, "bad_types");
            assert!(message.contains("u32 vs f32"), "{message}");
        }
        other => panic!("expected a kir error, got {other:?}"),
    }
}

#[test]
fn mma_shape_mismatch_is_reported() {
    let mut b = KernelBuilder::new("bad_mma", 64);
    let a = b.shared_tile("a", TileElem::Bf16, 16, 32);
    let bt = b.shared_tile("b", TileElem::Bf16, 8, 16);
    let acc = b.acc_tile("acc", 16, 8);
    b.mma(&acc, a.all(), bt.all(), BLayout::NK);
    let err = b
        .finish()
        .expect_err("K 32 vs 16 must be refused")
        .to_string();
    assert!(err.contains("mma into acc"), "{err}");
}

#[test]
fn emitters_refuse_unlowered_kernels() {
    let mut b = KernelBuilder::new("unlowered", 64);
    let acc = b.acc_tile("acc", 2, 2);
    b.acc_fill(&acc, 1.0);
    let k = b.finish().expect("valid description");
    assert!(wgsl::emit(&k).is_err());
    assert!(cuda::emit(&k).is_err());
    let lowered = lower(&k, Lowering::Scalar).expect("lowers");
    assert!(lowered.is_lowered());
    wgsl::validate(&lowered.name, &wgsl::emit(&lowered).expect("emits")).expect("naga accepts it");
}

#[test]
fn workgroup_memory_over_the_portable_limit_is_refused() {
    let mut b = KernelBuilder::new("too_big", 64);
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[1]");
    let big = b.shared("big", Ty::F32, 5000); // 20000 B > 16 KiB
    b.shared_store(&big, local_id(), f(1.0));
    b.barrier();
    b.store(&out, u(0), big.at(u(0)));
    let k = lower(&b.finish().expect("valid"), Lowering::Scalar).expect("lowers");
    match wgsl::check_portable_limits(&k) {
        Err(Error::ResourceLimit { needed, limit, .. }) => {
            assert_eq!(needed, 20000);
            assert_eq!(limit, 16384);
        }
        other => panic!("expected a resource-limit error, got {other:?}"),
    }
}

#[test]
fn non_finite_constants_print_on_both_targets() {
    // WGSL literals must be finite: +inf comes from bits; CUDA spells it from bits too.
    let mut b = KernelBuilder::new("inf_store", 64);
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[1]");
    b.if_(local_id().eq_(u(0)), |b| {
        b.store(&out, u(0), f(f32::INFINITY))
    });
    let k = lower(&b.finish().expect("valid"), Lowering::Scalar).expect("lowers");
    let w = wgsl::emit(&k).expect("wgsl");
    wgsl::validate(&k.name, &w).expect("naga accepts the non-finite constant");
    assert!(w.contains("0x7f800000"));
    assert!(cuda::emit(&k).expect("cuda").contains("0x7f800000"));
}

/// A typed window of another tile's rows (fp8_ds_mla: f32 scales and bf16 rope inside the
/// gathered 656-byte row) takes no shared memory, starts at its parent's offset plus its
/// byte offset, and is refused where it cannot be printed (WGSL) or does not fit its parent.
#[test]
fn tile_aliases_share_their_parents_rows() {
    use sparse_mla::kir::shared_plan::shared_layout;
    let build = |offset: u32| {
        let mut b = KernelBuilder::new("alias", 128);
        let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[1]");
        let rows = b.shared_tile("rows", TileElem::E4m3, 16, 656);
        let scales = b.shared_alias(&rows, "scales", TileElem::F32, offset, 4);
        b.store(&out, u(0), scales.at(u(1), u(2)));
        b.finish()
    };
    let k = build(512).expect("a 16-byte aligned window inside the row");
    let lowered = lower(
        &k,
        Lowering::Mma {
            stages: 1,
            min_workgroups: 0,
            l2_ahead: 0,
        },
    )
    .expect("the tensor-core lowering places it");
    let (offsets, total) = shared_layout(&lowered.shared);
    let at = |n: &str| lowered.shared.iter().position(|d| d.name == n).expect(n);
    assert_eq!(offsets[at("scales")], offsets[at("rows")] + 512);
    assert_eq!(
        lowered.shared_bytes(),
        lowered
            .shared
            .iter()
            .filter(|d| d.name != "scales")
            .map(|d| d.len as u64 * 4)
            .sum::<u64>(),
        "an alias takes no memory"
    );
    assert!(total >= lowered.shared_bytes());
    // row 1, column 2 of the window: word 656 / 4 + 2 of the alias's own base
    let src = cuda::emit(&lowered).expect("emits");
    assert!(
        src.contains("scales[166u]") || src.contains("scales[164u + 2u]"),
        "{src}"
    );
    assert!(
        lower(&k, Lowering::Scalar).is_err(),
        "WGSL has no typed views"
    );
    for bad in [500, 656] {
        assert!(build(bad).is_err(), "offset {bad} must be refused");
    }
}

#[test]
fn a_pipeline_bound_that_reads_a_buffer_is_refused() {
    let mut b = KernelBuilder::new("bound", 128);
    let n = b.buffer("n", Elem::U32, Access::Read, "[1]");
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[1]");
    let rows = b.shared_tile("rows", TileElem::Bf16, 16, 64);
    let count = n.at(u(0));
    b.pipeline_bounded(
        "step",
        count.clone(),
        Some(count),
        |b, _| b.gather_rows(&rows, 0, 32, &out, |_, r| r.as_i32()),
        |_, _| {},
    );
    let err = b
        .finish()
        .expect_err("a bound must be known before any load");
    assert!(err.to_string().contains("step bound"), "{err}");
}

/// The v7 split kernel's first index loads need only the workgroup's first lets (its step
/// bound reads no buffer), so the lowering issues them ahead of q's loads and the ring's
/// set-up, whose latency they overlap (the T = 1 chain: index -> row copy -> step).
#[test]
fn the_first_index_loads_go_out_before_q_and_the_ring_set_up() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        for heads in [16, 64] {
            let cfg = DecodeConfig::tensor_core_v7(MlaDims::PRODUCTION, format, heads);
            let (split, _) = lowered_kernels(&cfg).expect("lowers");
            let src = cuda::emit(&split).expect("emits");
            let at = |needle: &str| {
                src.find(needle)
                    .unwrap_or_else(|| panic!("{needle} not in {}", split.name))
            };
            let first_index = at("= indices[");
            assert!(first_index < at("load the q rows"), "{}", split.name);
            assert!(
                first_index < at("the ring's mbarriers initialised"),
                "{}",
                split.name
            );
            // and not behind topk_length: guarded by the load-free bound only
            assert!(
                src[..first_index].contains("(0u < step_bound)"),
                "{}",
                split.name
            );
        }
    }
}

/// q, register-resident in the v7 kernels, is staged through the ring's memory (one 16-byte
/// copy per chunk, then each warp's fragments from shared memory), taking no shared memory of
/// its own; the warp-group kernels load it from global memory (staged, they ran slower).
#[test]
fn resident_q_is_staged_through_the_ring_in_v7_only() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    for v7 in [
        DecodeConfig::tensor_core_v7(dims, CacheFormat::Bf16, 16),
        DecodeConfig::tensor_core_v7(dims, CacheFormat::Fp8DsMla, 16),
        // fp8's large-batch kernel is v7 with 64-row steps
        DecodeConfig::tensor_core_batch(dims, CacheFormat::Fp8DsMla, 16).expect("batch"),
    ] {
        let (split, _) = lowered_kernels(&v7).expect("lowers");
        let src = cuda::emit(&split).expect("emits");
        assert!(
            src.contains("A fragments from its staging rows"),
            "{}",
            split.name
        );
        let q = split
            .shared
            .iter()
            .find(|d| d.name == "q_tile")
            .expect("q staging");
        assert!(
            q.alias.is_some(),
            "{}: q takes no memory of its own",
            split.name
        );
    }
    {
        let batch = DecodeConfig::tensor_core_batch(dims, CacheFormat::Bf16, 16).expect("batch");
        let (split, _) = lowered_kernels(&batch).expect("lowers");
        let src = cuda::emit(&split).expect("emits");
        assert!(
            src.contains("straight from global memory"),
            "{}",
            split.name
        );
        assert!(
            !split.shared.iter().any(|d| d.name == "q_tile"),
            "{}",
            split.name
        );
    }
}

/// Where one ring stage holds q and the ring has two stages, q is staged in the last one
/// and the ring's set-up and first copies go out before q's loads (the rows fly while q
/// lands); where it does not fit a stage (fp8 32-head blocks: q 37 KB, a stage 21 KB), q
/// stays at the ring's start and the set-up waits for every thread's reads of it.
#[test]
fn q_staged_in_the_last_stage_lets_the_first_copies_go_before_it() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    for (format, heads, late) in [
        (CacheFormat::Bf16, 16, true),
        (CacheFormat::Bf16, 64, true),
        (CacheFormat::Fp8DsMla, 16, true),
        (CacheFormat::Fp8DsMla, 64, false),
    ] {
        let cfg = DecodeConfig::tensor_core_v7(MlaDims::PRODUCTION, format, heads);
        let (split, _) = lowered_kernels(&cfg).expect("lowers");
        let src = cuda::emit(&split).expect("emits");
        // in the kernel's body (the helpers above it define `copy_async`)
        let body = &src[src.find("__global__").expect("a kernel")..];
        let at = |needle: &str| {
            body.find(needle)
                .unwrap_or_else(|| panic!("{needle} not in {}", split.name))
        };
        let q = split
            .shared
            .iter()
            .find(|d| d.name == "q_tile")
            .expect("q staging");
        let (parent, offset) = q.alias.clone().expect("q aliases the ring");
        let ring = split
            .shared
            .iter()
            .find(|d| d.name == parent)
            .expect("the ring array");
        let stage_bytes = ring.len * 4 / 2;
        assert_eq!(
            offset,
            if late { stage_bytes } else { 0 },
            "{}: q's staging offset",
            split.name
        );
        assert!(
            offset + q.len * 4 <= ring.len * 4,
            "{}: q's staging inside the ring",
            split.name
        );
        let first_copy = at("copy_async(");
        assert_eq!(
            first_copy < at("load the q rows"),
            late,
            "{}: the first copies before q's loads",
            split.name
        );
        assert_eq!(
            at("the ring's mbarriers initialised") < at("load the q rows"),
            late,
            "{}: the ring's set-up before q's loads",
            split.name
        );
    }
}

#[test]
fn bf16_partials_are_written_as_pairs_and_fp8_partials_as_words() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    for heads in [16, 64] {
        for (config, pairs) in [
            (
                DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, heads),
                true,
            ),
            (
                DecodeConfig::tensor_core_v7(dims, CacheFormat::Bf16, heads),
                true,
            ),
            (
                DecodeConfig::tensor_core_v7(dims, CacheFormat::Fp8DsMla, heads),
                false,
            ),
            (DecodeConfig::cuda_scalar(dims, CacheFormat::Bf16), false),
        ] {
            let (split, _) = lowered_kernels(&config).expect("lowers");
            let src = cuda::emit(&split).expect("emits");
            assert_eq!(
                src.contains("store_f32x2(o_part"),
                pairs,
                "{}: pair stores of the partials",
                split.name
            );
            // the helper is printed only where it is called
            assert_eq!(
                src.contains("struct __align__(8) sparse_mla_f32x2"),
                pairs,
                "{}",
                split.name
            );
            assert_eq!(src.contains("o_part[at + 1u]"), !pairs, "{}", split.name);
        }
    }
}

#[test]
fn a_pair_store_needs_an_f32_buffer() {
    let mut b = KernelBuilder::new("pairs_into_words", 64);
    let words = b.buffer("words", Elem::U32, Access::ReadWrite, "[n]");
    b.store_f32x2(&words, u(0), f(1.0), f(2.0));
    let err = b.finish().expect_err("refused");
    assert!(err.to_string().contains("store_f32x2 into words"), "{err}");
}

#[test]
fn the_merged_kernel_meets_after_its_partials_and_launches_cooperatively() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, lowered_merged, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    for heads in [16, 128] {
        let config = DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, heads);
        let merged = lowered_merged(&config).expect("lowers");
        let (split, _) = lowered_kernels(&config).expect("lowers");
        assert!(merged.grid_dependency.cooperative, "{}", merged.name);
        assert!(!split.grid_dependency.cooperative, "{}", split.name);
        let src = cuda::emit(&merged).expect("emits");
        // the token's workgroups meet on its counter pair, with every head block and split
        let meet = src
            .find("group_sync(sync + 2u * (t), members);")
            .expect("group_sync on the token's counters");
        let partials = src.find("store_f32x2(o_part").expect("partial stores");
        assert!(
            partials < meet,
            "{}: the meeting precedes the partials",
            merged.name
        );
        // after it: the token's segments dealt out by rank, the partials read back
        let merge = &src[meet..];
        assert!(merge.contains("const unsigned rank = (split * head_blocks) + blockIdx.x;"));
        assert!(merge.contains("for (unsigned seg = rank; seg < segments; seg += members)"));
        assert!(merge.contains("o_part[") && merge.contains("lse_part["));
        assert!(src.contains("SPARSE_MLA_HELPER void group_sync(unsigned* c, unsigned count)"));
        // the split kernel has neither the meeting nor its helper
        let plain = cuda::emit(&split).expect("emits");
        assert!(!plain.contains("group_sync"), "{}", split.name);
    }
    // v7 (one warp group): the meeting after its partial stores too
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        let config = DecodeConfig::tensor_core_v7(dims, format, 16);
        let merged = lowered_merged(&config).expect("lowers");
        assert!(merged.grid_dependency.cooperative, "{}", merged.name);
        let src = cuda::emit(&merged).expect("emits");
        let meet = src.find("group_sync(sync + 2u * (t), members);");
        let partials = src.find(match format {
            CacheFormat::Bf16 => "store_f32x2(o_part",
            CacheFormat::Fp8DsMla => "o_part[at",
        });
        assert!(
            matches!((partials, meet), (Some(p), Some(m)) if p < m),
            "{}: partials then the meeting",
            merged.name
        );
    }
    // fp8_ds_mla's v6 kernels have no merged form (no room for the merge's shared memory)
    let fp8 = DecodeConfig::tensor_core_v6(dims, CacheFormat::Fp8DsMla, 16);
    let err = lowered_merged(&fp8).expect_err("refused");
    assert!(err.to_string().contains("config"), "{err}");
}

#[test]
fn a_group_sync_needs_u32_counters_and_cuda() {
    let mut b = KernelBuilder::new("meet_on_floats", 64);
    let floats = b.buffer("floats", Elem::F32, Access::ReadWrite, "[n]");
    b.group_sync(&floats, u(0), u(2));
    let err = b.finish().expect_err("refused");
    assert!(err.to_string().contains("group_sync on floats"), "{err}");

    let mut b = KernelBuilder::new("meet", 64);
    let counters = b.buffer("counters", Elem::U32, Access::ReadWrite, "[2]");
    b.group_sync(&counters, u(0), num_workgroups(0));
    let k = b.finish().expect("builds");
    assert!(k.grid_dependency.cooperative);
    let k = lower(&k, Lowering::Scalar).expect("lowers");
    assert!(cuda::emit(&k)
        .expect("CUDA prints it")
        .contains("group_sync(counters + 2u * (0u), gridDim.x);"));
    assert!(wgsl::emit(&k).is_err(), "WGSL has no group meeting");
}

/// With `l2_ahead`, the producers of v7 and of the large-batch kernel ask L2 for the rows of
/// the step that many steps past the ring's copies — in the loop from index words loaded one
/// issue earlier, guarded by the step count — and for the first steps' before the loop;
/// without it nothing is prefetched.
#[test]
fn the_producers_ask_l2_for_rows_ahead_only_when_told() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        for config in [
            DecodeConfig::tensor_core_v7(dims, format, 16),
            DecodeConfig::tensor_core_v7(dims, format, 64),
            DecodeConfig::tensor_core_batch(dims, format, 16).expect("batch"),
        ] {
            // what production runs: one step ahead for bf16 at H <= 16 (v7 and two groups)
            let production = u32::from(format == CacheFormat::Bf16 && config.block_h == 16);
            assert_eq!(config.l2_ahead(), production, "{config:?}");
            let (split, _) = lowered_kernels(&config.with_l2_ahead(0)).expect("lowers");
            let src = cuda::emit(&split).expect("emits");
            assert!(!src.contains("prefetch_l2("), "{}", split.name);
            for ahead in [1u32, 3] {
                let config = config.with_l2_ahead(ahead);
                let (split, _) = lowered_kernels(&config).expect("lowers");
                // (v7 holds its scores in rows: `p1r_`)
                let rows = config.label().contains(" r");
                let tag = format!("p{ahead}{}_", if rows { "r" } else { "" });
                assert!(split.name.contains(&tag), "{}", split.name);
                let src = cuda::emit(&split).expect("emits");
                let body = &src[src.find("__global__").expect("a kernel")..];
                let in_loop = body.find("for (unsigned step_i").expect("the ring loop");
                let prologue = body[..in_loop].matches("prefetch_l2(").count();
                let looped = body[in_loop..].matches("prefetch_l2(").count();
                assert_eq!(looped, 1, "{}: one prefetch site in the loop", split.name);
                // after the step's wait for its own rows (with one stage they are issued at
                // the step's top, and must not queue behind the prefetches)
                let lp = &body[in_loop..];
                assert!(
                    lp.find("prefetch_l2(") > lp.find("wait for this step's rows"),
                    "{}: the prefetch after the step's wait",
                    split.name
                );
                // the first steps past the copies (not step 0 with a one-stage ring)
                let stages = if config.groups() > 1 && format == CacheFormat::Bf16 {
                    1
                } else {
                    2
                };
                let expect = (stages - 1..stages - 1 + ahead).filter(|&a| a > 0).count();
                assert_eq!(prologue, expect, "{}: prologue prefetches", split.name);
                assert!(
                    body.contains(&format!("(ahead + {ahead}u) < step")),
                    "{}: the loop's prefetch guarded by the step count",
                    split.name
                );
                assert!(
                    body.contains("_l2[slot"),
                    "{}: words loaded ahead",
                    split.name
                );
            }
        }
    }
}

/// With `l2_ahead` = k, v6's ring (every thread gathers) asks L2, right after each
/// iteration's copies, for the rows of the step k past them, from addresses computed one
/// iteration before (a queue of k + 1 address registers per gather row, shifted each
/// iteration), guarded by the step count; without it nothing is prefetched. Production's v6
/// asks for none (slower on the H200, benches/NOTES.md v25): the prefetch is a bench variant.
#[test]
fn v6_asks_l2_for_rows_ahead_only_when_told() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    for heads in [16, 64] {
        let config = DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, heads);
        assert_eq!(config.l2_ahead(), 0, "{config:?}");
        let (split, _) = lowered_kernels(&config).expect("lowers");
        let src = cuda::emit(&split).expect("emits");
        assert!(!src.contains("prefetch_l2("), "{}", split.name);
        assert!(!src.contains("_src_ahead"), "{}", split.name);
        for ahead in [1u32, 2] {
            let (split, _) = lowered_kernels(&config.with_l2_ahead(ahead)).expect("lowers");
            assert!(split.name.contains(&format!("p{ahead}_")), "{}", split.name);
            let src = cuda::emit(&split).expect("emits");
            let body = &src[src.find("__global__").expect("a kernel")..];
            let in_loop = body.find("for (unsigned step_i").expect("the ring loop");
            let (pro, lp) = body.split_at(in_loop);
            assert!(
                !pro.contains("prefetch_l2("),
                "{}: none before the loop",
                split.name
            );
            assert_eq!(lp.matches("prefetch_l2(").count(), 1, "{}", split.name);
            // after this iteration's copies, before its wait for them
            let copy = lp.find("cp_async_16(").expect("copies");
            let ask = lp.find("prefetch_l2(").expect("prefetch");
            let wait = lp.find("cp_async_wait<").expect("wait");
            assert!(
                copy < ask && ask < wait,
                "{}: copies, prefetch, wait",
                split.name
            );
            let stages = match config.lowering {
                sparse_mla::kir::Lowering::Mma { stages, .. } => stages,
                _ => unreachable!("v6 is Lowering::Mma"),
            };
            assert!(
                lp.contains(&format!("(step_i + {}u) < step_count", stages - 1 + ahead)),
                "{}: the prefetch guarded by the step count",
                split.name
            );
            // the queue: `ahead` arrays past the copies' own, each shifted once an iteration
            assert!(
                pro.matches("_src_ahead").count() >= ahead as usize,
                "{}: the prologue fills the queue",
                split.name
            );
            let shifts = lp
                .lines()
                .filter(|l| {
                    l.contains("[queue_pass") && l.contains("] = ") && l.contains("_src_ahead")
                })
                .count();
            assert_eq!(shifts, ahead as usize, "{}: queue shifts", split.name);
        }
    }
}

#[test]
fn shared_addresses_are_pointer_terms_only_where_the_kernel_asks() {
    // (i + 2) * 4: with the kernel's index_terms, the constant part is its own term (an
    // immediate offset for the compiler) and the product is distributed; without, a subscript
    let mut b = KernelBuilder::new("terms", 64);
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[64]");
    let sh = b.shared("sh", Ty::F32, 4 * 66);
    let at = (local_id() + u(2)) * u(4);
    b.shared_store(&sh, at.clone(), f(1.0));
    b.barrier();
    b.store(&out, local_id(), sh.at(at));
    let plain = lower(&b.finish().expect("valid"), Lowering::Scalar).expect("lowers");
    assert!(!plain.index_terms, "off by default");
    let text = cuda::emit(&plain).expect("emits");
    assert!(
        text.contains("sh[(threadIdx.x + 2u) * 4u] = 1.0f;"),
        "{text}"
    );
    let mut termed = plain.clone();
    termed.index_terms = true;
    let text = cuda::emit(&termed).expect("emits");
    assert!(
        text.contains("*(sh + (threadIdx.x * 4u) + 8u) = 1.0f;"),
        "{text}"
    );
    assert!(
        text.contains("= *(sh + (threadIdx.x * 4u) + 8u);"),
        "{text}"
    );
    assert!(!text.contains("sh[(threadIdx"), "{text}");
}

/// Scores held in rows (`with_row_softmax`): every v7 and large-batch kernel's step loop has
/// one workgroup barrier fewer (no exchange of row maxima between warps), its row maxima
/// and sums go over the row's lanes only, and the default form is untouched by the option's
/// existence (same name, same text as before the option is asked for).
#[test]
fn scores_held_in_rows_drop_the_row_max_exchange_and_its_barrier() {
    use sparse_mla::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig};
    use sparse_mla::kir::RowSoftmax;
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    let loop_of = |src: &str| -> String {
        let body = &src[src.find("__global__").expect("a kernel")..];
        let at = body.find("for (unsigned step_i").expect("the ring loop");
        // the loop ends where the softmax state goes back to shared memory
        let end = body[at..]
            .find("back to shared memory")
            .expect("the state stored after the loop");
        body[at..at + end].to_string()
    };
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        for config in [
            DecodeConfig::tensor_core_v7(dims, format, 16),
            DecodeConfig::tensor_core_v7(dims, format, 128),
            DecodeConfig::tensor_core_batch(dims, format, 16).expect("batch"),
        ] {
            // production holds v7's scores in rows (v35) and fp8's large-batch kernel's (v36),
            // bf16's two-group kernel's in fragments
            let production = if config.groups() > 1 {
                RowSoftmax::Off
            } else {
                RowSoftmax::Rows
            };
            assert_eq!(config.row_softmax(), production, "{config:?}");
            let config = config.with_row_softmax(RowSoftmax::Off);
            let (frag, _) = lowered_kernels(&config).expect("lowers");
            let (rows, _) =
                lowered_kernels(&config.with_row_softmax(RowSoftmax::Rows)).expect("lowers");
            assert_ne!(frag.name, rows.name);
            assert_eq!(
                lowered_kernels(&config.with_row_softmax(RowSoftmax::Off))
                    .expect("lowers")
                    .0
                    .name,
                frag.name
            );
            assert_eq!(
                config.with_row_softmax(RowSoftmax::Rows).is_batch(),
                config.is_batch(),
                "{}: the large-batch kernel stays one",
                rows.name
            );
            let (a, b) = (
                loop_of(&cuda::emit(&frag).expect("emits")),
                loop_of(&cuda::emit(&rows).expect("emits")),
            );
            // a grouped kernel's barriers are named, one id per group (printed once a group)
            let barriers = |s: &str| {
                s.matches("__syncthreads()").count() + s.matches("named_barrier_sync<").count()
            };
            assert_eq!(
                barriers(&b) + config.groups() as usize,
                barriers(&a),
                "{}: one barrier a step fewer\n{b}",
                rows.name
            );
            assert!(a.contains("row_exchange"), "{}", frag.name);
            // the exchange table now holds only the rescale factors: one write a row (by its
            // first lane), read after P's barrier by the outputs' holders
            let writes = b.matches("row_exchange[").count() + b.matches("*(row_exchange").count();
            assert_eq!(b.matches("] = alpha").count(), 1, "{}:\n{b}", rows.name);
            assert!(writes >= 2, "{}:\n{b}", rows.name);
            assert!(!b.contains("rescale_vote"), "{}", rows.name);
        }
    }
}

/// The switches' forms on a planned kernel (`DecodeConfig::with_forms`, what
/// `SPARSE_MLA_ROW_SOFTMAX` does): unset keeps the kernel's own form (v7 and fp8's
/// large-batch kernel in rows, bf16's in fragments), `0` holds them in fragments, and a row
/// form is refused, with an error
/// naming the variable, only on the two-group kernel (bf16's large batch); fp8's one-group
/// large-batch kernel takes either.
#[test]
fn the_switches_set_a_kernels_forms_and_refuse_rows_on_two_groups() {
    use sparse_mla::kernels::sparse_mla_decode::DecodeConfig;
    use sparse_mla::kir::RowSoftmax;
    use sparse_mla::mla::{CacheFormat, DecodeShape, MlaDims};
    let dims = MlaDims::PRODUCTION;
    let shape = |format, heads, tokens| DecodeShape {
        tokens,
        heads,
        topk: 2048,
        num_pages: 1024,
        page_size: 64,
        dims,
        format,
        scale: 0.07,
        has_topk_length: false,
    };
    let (bf16, fp8) = (CacheFormat::Bf16, CacheFormat::Fp8DsMla);
    let v7 = DecodeConfig::tensor_core_v7(dims, bf16, 128);
    let s = shape(bf16, 128, 64);
    assert_eq!(v7.row_softmax(), DecodeConfig::V7_ROW_SOFTMAX);
    assert_eq!(v7.with_forms(None, &s).expect("kept"), v7);
    let frag = v7.with_forms(Some(RowSoftmax::Off), &s).expect("fragments");
    assert_eq!(frag.row_softmax(), RowSoftmax::Off);
    assert_eq!(frag.label(), "v7", "the fragment form is v7's plain label");
    assert_eq!(v7.label(), "v7 r");
    let two = DecodeConfig::tensor_core_batch(dims, bf16, 16).expect("batch");
    assert_eq!((two.groups(), two.row_softmax()), (2, RowSoftmax::Off));
    let s = shape(bf16, 16, 128);
    let e = two
        .with_forms(Some(RowSoftmax::Rows), &s)
        .expect_err("refused");
    let text = e.to_string();
    assert!(
        text.contains("SPARSE_MLA_ROW_SOFTMAX") && text.contains("16 heads x 128 tokens"),
        "{text}"
    );
    assert_eq!(
        two.with_forms(Some(RowSoftmax::Off), &s)
            .expect("fragments"),
        two
    );
    let one = DecodeConfig::tensor_core_batch(dims, fp8, 16).expect("batch");
    assert_eq!((one.groups(), one.row_softmax()), (1, RowSoftmax::Rows));
    let s = shape(fp8, 16, 128);
    assert_eq!(one.with_forms(None, &s).expect("kept"), one);
    let frag = one
        .with_forms(Some(RowSoftmax::Off), &s)
        .expect("one group takes fragments");
    assert!(frag.is_batch() && frag.row_softmax() == RowSoftmax::Off);
}

/// `dequant_rows` takes an e4m3 tile into a bf16 one and says so otherwise; the scalar
/// lowering prints it (as the `SharedMap` that defines it) as WGSL that naga accepts.
#[test]
fn dequant_rows_is_checked_and_lowers_to_wgsl() {
    let build = |dst_elem: TileElem, per: u32| {
        let mut b = KernelBuilder::new("dequant", 64);
        let out = b.buffer("out", Elem::F32, Access::ReadWrite, "[8]");
        let raw = b.shared_tile("raw", TileElem::E4m3, 4, 16);
        let scales = b.shared_tile("scales", TileElem::F32, 4, 2);
        let dst = b.shared_tile("dst", dst_elem, 4, 8);
        b.shared_map(&scales, |_, r, c| (r * u(2) + c).as_f32() + f(0.5));
        b.dequant_rows(&dst, &raw, per, |_, r, g| scales.at(r, g));
        b.store(&out, local_id().min(u(7)), dst.at(u(1), u(3)));
        b.finish()
    };
    let err = build(TileElem::F32, 4)
        .expect_err("an f32 destination")
        .to_string();
    assert!(err.contains("dequant_rows into dst"), "{err}");
    let err = build(TileElem::Bf16, 6)
        .expect_err("a group of 6")
        .to_string();
    assert!(err.contains("not a multiple of 4"), "{err}");
    let k = build(TileElem::Bf16, 4).expect("valid description");
    let lowered = lower(&k, Lowering::Scalar).expect("lowers");
    let text = wgsl::emit(&lowered).expect("emits");
    wgsl::validate(&lowered.name, &text).expect("naga accepts it");
}

/// `Fp8Values::Shared` (`SPARSE_MLA_FP8_VALUES=shared`) takes fp8_ds_mla's v7 kernels whose
/// P is bf16, and its kernel names say so; bf16, v6 and fp8's large-batch kernel (P in
/// f16) are left as they are.
#[test]
fn shared_fp8_values_apply_to_fp8_v7_kernels_only() {
    use sparse_mla::kernels::sparse_mla_decode::{DecodeConfig, Fp8Values};
    use sparse_mla::mla::{CacheFormat, MlaDims};
    let dims = MlaDims::PRODUCTION;
    let (bf16, fp8) = (CacheFormat::Bf16, CacheFormat::Fp8DsMla);
    let v7 = DecodeConfig::tensor_core_v7(dims, fp8, 128);
    let shared = v7.with_fp8_values(Fp8Values::Shared);
    assert_eq!(shared.fp8_values, Fp8Values::Shared);
    assert!(
        shared.split_name().ends_with("v_h32n32"),
        "{}",
        shared.split_name()
    );
    assert!(shared.label().ends_with(" v"), "{}", shared.label());
    assert_ne!(shared.split_name(), v7.split_name());
    for kept in [
        DecodeConfig::tensor_core_v7(dims, bf16, 128),
        DecodeConfig::tensor_core_v6(dims, fp8, 128),
    ]
    .into_iter()
    .chain(DecodeConfig::tensor_core_batch(dims, fp8, 16))
    {
        assert_eq!(
            kept.with_fp8_values(Fp8Values::Shared),
            kept,
            "{}",
            kept.split_name()
        );
    }
}
