//! Bad input gets an error at the launch boundary that names the argument, the expected
//! and the actual value, on every backend present, before any kernel runs. What the
//! boundary cannot see (the contents of device buffers) the kernels clamp; the conformance
//! cases feed them out-of-range slots, lengths and table entries.

mod common;

use sparse_mla::mla::*;
use sparse_mla::runtime::{
    check_topk_length, Backend, BackendKind, CacheWriteBuffers, DecodeBuffers, DecodeOptions,
    VbtBuffers,
};
use sparse_mla::Error;

/// The error must be an invalid-argument error naming `arg`, and its message must
/// contain every one of `needles` (the expected and the actual value).
fn expect_arg_error<T: std::fmt::Debug>(r: sparse_mla::Result<T>, arg: &str, needles: &[&str]) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            let msg = e.to_string();
            let Error::InvalidArgument { arg: got, .. } = &e else {
                unreachable!()
            };
            assert!(
                got.contains(arg),
                "error names `{got}`, wanted `{arg}`: {msg}"
            );
            for n in needles {
                assert!(msg.contains(n), "message lacks {n:?}: {msg}");
            }
        }
        other => panic!("expected an invalid-argument error for `{arg}`, got {other:?}"),
    }
}

fn backends() -> Vec<&'static dyn Backend> {
    [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda]
        .into_iter()
        .filter_map(common::backend)
        .collect()
}

fn shape(format: CacheFormat) -> DecodeShape {
    DecodeShape {
        tokens: 2,
        heads: 4,
        topk: 8,
        num_pages: 2,
        page_size: 4,
        dims: MlaDims::PRODUCTION,
        format,
        scale: 0.1,
        has_topk_length: false,
    }
}

struct DecodeBufs {
    q: sparse_mla::runtime::Buffer,
    cache: sparse_mla::runtime::Buffer,
    indices: sparse_mla::runtime::Buffer,
    out: sparse_mla::runtime::Buffer,
    lse: sparse_mla::runtime::Buffer,
}

fn decode_bufs(b: &dyn Backend, s: &DecodeShape) -> DecodeBufs {
    DecodeBufs {
        q: b.alloc(s.q_elems() * 2).unwrap(),
        cache: b.alloc(s.cache_bytes()).unwrap(),
        indices: b
            .upload(&vec![0u8; (s.tokens * s.topk) as usize * 4])
            .unwrap(),
        out: b.alloc(s.out_elems() * 2).unwrap(),
        lse: b.alloc((s.tokens * s.heads) as u64 * 4).unwrap(),
    }
}

fn run_decode(
    b: &dyn Backend,
    s: &DecodeShape,
    bufs: &DecodeBufs,
    layout: DecodeLayout,
) -> sparse_mla::Result<sparse_mla::runtime::DecodeRun> {
    b.sparse_mla_decode(
        s,
        &DecodeBuffers {
            q: &bufs.q,
            kv_cache: &bufs.cache,
            indices: &bufs.indices,
            topk_length: None,
            out: &bufs.out,
            lse: &bufs.lse,
            layout,
        },
        &DecodeOptions::default(),
    )
}

#[test]
fn decode_rejects_bad_shapes_and_buffers() {
    for b in backends() {
        eprintln!("decode boundary checks on {}", b.device_name());
        let s = shape(CacheFormat::Fp8DsMla);
        let good = decode_bufs(b, &s);
        run_decode(b, &s, &good, DecodeLayout::default()).expect("a valid call runs");

        let wrong_q = DecodeBufs {
            q: b.alloc(s.q_elems() * 2 - 2).unwrap(),
            ..decode_bufs(b, &s)
        };
        expect_arg_error(
            run_decode(b, &s, &wrong_q, DecodeLayout::default()),
            "q",
            &["9216 bytes", "9214 bytes"],
        );

        let small_cache = DecodeBufs {
            cache: b.alloc(s.cache_bytes() - 4).unwrap(),
            ..decode_bufs(b, &s)
        };
        expect_arg_error(
            run_decode(b, &s, &small_cache, DecodeLayout::default()),
            "kv_cache",
            &["at least 5248 bytes", "5244 bytes"],
        );

        let page0 = DecodeShape { page_size: 0, ..s };
        expect_arg_error(
            run_decode(b, &page0, &good, DecodeLayout::default()),
            "page_size",
            &["at least 1", "got 0"],
        );

        let misaligned = DecodeLayout {
            cache: CacheStrides { row: 658, page: 0 },
            ..Default::default()
        };
        expect_arg_error(
            run_decode(b, &s, &good, misaligned),
            "row stride",
            &["multiple of 4", "658 bytes"],
        );

        // Padded strides need a larger cache than packed rows.
        let padded = DecodeLayout {
            cache: CacheStrides { row: 672, page: 0 },
            ..Default::default()
        };
        expect_arg_error(
            run_decode(b, &s, &good, padded),
            "kv_cache",
            &["at least 5360 bytes", "row stride 672", "5248 bytes"],
        );

        let odd_s_q = DecodeLayout {
            lse: LseLayout::BatchHeadsSq { s_q: 3 },
            ..Default::default()
        };
        expect_arg_error(
            run_decode(b, &s, &good, odd_s_q),
            "lse layout s_q",
            &["divisor of tokens = 2", "got 3"],
        );

        let with_len = DecodeShape {
            has_topk_length: true,
            ..s
        };
        let short_len = b.alloc(4).unwrap();
        expect_arg_error(
            b.sparse_mla_decode(
                &with_len,
                &DecodeBuffers {
                    q: &good.q,
                    kv_cache: &good.cache,
                    indices: &good.indices,
                    topk_length: Some(&short_len),
                    out: &good.out,
                    lse: &good.lse,
                    layout: DecodeLayout::default(),
                },
                &DecodeOptions::default(),
            ),
            "topk_length",
            &["8 bytes", "4 bytes"],
        );
    }
}

#[test]
fn topk_length_values_are_checked_on_the_host_and_clamped_on_the_device() {
    check_topk_length(&[0, 8, 3], 8).expect("in range");
    expect_arg_error(
        check_topk_length(&[0, 9], 8),
        "topk_length[1]",
        &["[0, topk = 8]", "9"],
    );
    expect_arg_error(check_topk_length(&[-1], 8), "topk_length[0]", &["-1"]);
    // On the device, out-of-range lengths are clamped: see the conformance `_len` cases,
    // whose lengths include topk + 1.. and negative values.
}

fn cw_shape(format: CacheFormat) -> CacheWriteShape {
    CacheWriteShape {
        tokens: 3,
        num_pages: 2,
        page_size: 4,
        dims: MlaDims::PRODUCTION,
        format,
        flavour: ScaleFlavour::Pow2,
        strides: CacheStrides::default(),
    }
}

#[test]
fn cache_write_rejects_bad_shapes_and_buffers() {
    for b in backends() {
        eprintln!("cache-write boundary checks on {}", b.device_name());
        let s = cw_shape(CacheFormat::Fp8DsMla);
        let latent = b.alloc(3 * 512 * 2).unwrap();
        let rope = b.alloc(3 * 64 * 2).unwrap();
        let slots = b.upload(&[255u8; 12]).unwrap(); // all −1: nothing is written
        let cache = b.alloc(8 * 656).unwrap();
        let bufs = |latent, rope, slots, cache| CacheWriteBuffers {
            latent,
            rope,
            slot_mapping: slots,
            kv_cache: cache,
        };
        b.cache_write(&s, &bufs(&latent, &rope, &slots, &cache))
            .expect("a valid call runs");

        let short = b.alloc(3 * 512 * 2 - 2).unwrap();
        expect_arg_error(
            b.cache_write(&s, &bufs(&short, &rope, &slots, &cache)),
            "latent",
            &["3072 bytes ([3, 512] bf16)", "3070 bytes"],
        );
        expect_arg_error(
            b.cache_write(&s, &bufs(&latent, &short, &slots, &cache)),
            "rope",
            &["384 bytes", "3070 bytes"],
        );
        expect_arg_error(
            b.cache_write(&s, &bufs(&latent, &rope, &rope, &cache)),
            "slot_mapping",
            &["12 bytes ([3] i32)", "384 bytes"],
        );
        let small = b.alloc(8 * 656 - 4).unwrap();
        expect_arg_error(
            b.cache_write(&s, &bufs(&latent, &rope, &slots, &small)),
            "kv_cache",
            &["at least 5248 bytes", "5244 bytes"],
        );
        let page0 = CacheWriteShape { page_size: 0, ..s };
        expect_arg_error(
            b.cache_write(&page0, &bufs(&latent, &rope, &slots, &cache)),
            "page_size",
            &["at least 1", "got 0"],
        );
        let misaligned = CacheWriteShape {
            strides: CacheStrides { row: 657, page: 0 },
            ..s
        };
        expect_arg_error(
            b.cache_write(&misaligned, &bufs(&latent, &rope, &slots, &cache)),
            "row stride",
            &["multiple of 4", "656-byte fp8_ds_mla row", "657 bytes"],
        );
        let overlapping = CacheWriteShape {
            strides: CacheStrides { row: 0, page: 656 },
            ..s
        };
        expect_arg_error(
            b.cache_write(&overlapping, &bufs(&latent, &rope, &slots, &cache)),
            "page stride",
            &["at least page_size x row stride = 2624", "656 bytes"],
        );
        // Strides near u64::MAX: refused, never wrapped into small offsets.
        for strides in [
            CacheStrides {
                row: u64::MAX - 3,
                page: 0,
            },
            CacheStrides {
                row: 0,
                page: u64::MAX - 3,
            },
            CacheStrides {
                row: 1 << 62,
                page: 0,
            },
        ] {
            let huge = CacheWriteShape { strides, ..s };
            let e = b
                .cache_write(&huge, &bufs(&latent, &rope, &slots, &cache))
                .unwrap_err()
                .to_string();
            assert!(e.contains("stride"), "{strides:?}: {e}");
        }
        // A host-sized allocation the machine cannot give: an error with the number.
        if b.kind() == BackendKind::Cpu {
            let e = match b.alloc(u64::MAX) {
                Ok(_) => panic!("a u64::MAX allocation succeeded"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("18446744073709551615") || e.contains("host-sized"),
                "{e}"
            );
        }
        let narrow = CacheWriteShape {
            dims: MlaDims {
                latent: 256,
                rope: 64,
            },
            ..s
        };
        expect_arg_error(
            b.cache_write(&narrow, &bufs(&latent, &rope, &slots, &cache)),
            "cache",
            &["fp8_ds_mla only with latent 512 + rope 64", "latent 256"],
        );
    }
}

#[test]
fn block_table_conversion_rejects_bad_shapes_and_buffers() {
    for b in backends() {
        eprintln!("conversion boundary checks on {}", b.device_name());
        let s = VbtShape {
            tokens: 2,
            topk: 3,
            requests: 2,
            max_pages: 5,
            page_size: 16,
        };
        let positions = b.alloc(2 * 3 * 4).unwrap();
        let table = b.alloc(2 * 5 * 4).unwrap();
        let req = b.alloc(2 * 4).unwrap();
        let slots = b.alloc(2 * 3 * 4).unwrap();
        let bufs = |positions, table, req, slots| VbtBuffers {
            positions,
            block_table: table,
            req_of_token: req,
            slots,
        };
        b.positions_to_slots(&s, &bufs(&positions, &table, &req, &slots))
            .expect("a valid call runs");
        let page0 = VbtShape { page_size: 0, ..s };
        expect_arg_error(
            b.positions_to_slots(&page0, &bufs(&positions, &table, &req, &slots)),
            "page_size",
            &["at least 1", "got 0"],
        );
        expect_arg_error(
            b.positions_to_slots(&s, &bufs(&table, &table, &req, &slots)),
            "positions",
            &["24 bytes ([2, 3] i32)", "40 bytes"],
        );
        expect_arg_error(
            b.positions_to_slots(&s, &bufs(&positions, &positions, &req, &slots)),
            "block_table",
            &["40 bytes ([2, 5] i32)", "24 bytes"],
        );
        expect_arg_error(
            b.positions_to_slots(&s, &bufs(&positions, &table, &slots, &slots)),
            "req_of_token",
            &["8 bytes ([2] i32)", "24 bytes"],
        );
        expect_arg_error(
            b.positions_to_slots(&s, &bufs(&positions, &table, &req, &req)),
            "slots",
            &["24 bytes", "8 bytes"],
        );
    }
}
