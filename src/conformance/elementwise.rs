//! Cases of the row and element-wise model kernels: RMSNorm, LayerNorm, RoPE (both pairings,
//! YaRN-like scaled tables, several heads per position), SiLU·mul over two halves of one row,
//! casts, the embedding gather (an id past the vocabulary gives NaN), the key-cache write
//! (slots out of range skipped, the rest of the cache untouched).

use super::linear::random_weight;
use super::ops::{bf16_bytes, f32_bytes, i32_bytes, view_buffer, Compare, Instance, OpCase};
use crate::kernels::elementwise::{CastOp, EmbeddingOp, KeyWriteOp, SiluMulOp};
use crate::kernels::norm::{NormKind, NormOp};
use crate::kernels::rope::{RopeLayout, RopeOp};
use crate::kernels::view::{DType, View, WeightLayout, WeightType};
use crate::util::Rng;
use crate::Result;

const TOL: f64 = 1e-5;

fn padded(rows: u32, cols: u32, pad: u32) -> (View, usize) {
    let v = View {
        offset: 2 * pad as u64,
        rows,
        cols,
        stride: cols + pad,
    };
    (v, v.end() as usize + pad as usize)
}

fn norm_case(kind: NormKind, rows: u32, cols: u32) -> OpCase {
    OpCase::new(
        format!("norm/{kind:?}_r{rows}_c{cols}").to_lowercase(),
        move |rng: &mut Rng| -> Result<Instance> {
            let (xv, xl) = padded(rows, cols, 6);
            let (yv, yl) = padded(rows, cols, 2);
            // A large common offset tests LayerNorm's centring.
            let mut x = view_buffer(rng, xl, &xv, 2.0);
            if kind == NormKind::Layer {
                x.iter_mut().filter(|v| !v.is_nan()).for_each(|v| *v += 3.0);
            }
            let w: Vec<f32> = (0..cols).map(|_| rng.uniform(0.5, 1.5)).collect();
            let mut buffers = vec![
                ("x", f32_bytes(&x)),
                ("w", f32_bytes(&w)),
                ("y", f32_bytes(&vec![f32::NAN; yl])),
            ];
            if kind == NormKind::Layer {
                let b: Vec<f32> = (0..cols).map(|_| rng.normal() * 0.1).collect();
                buffers.push(("bias", f32_bytes(&b)));
            }
            Ok(Instance {
                op: Box::new(NormOp {
                    kind,
                    x: xv,
                    y: yv,
                    eps: if kind == NormKind::Rms { 1e-6 } else { 1e-5 },
                }),
                buffers,
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: format!("[{rows}, {cols}]"),
            })
        },
    )
}

fn rope_case(layout: RopeLayout, tokens: u32, group: u32, width: u32, in_place: bool) -> OpCase {
    OpCase::new(
        format!(
            "rope/{layout:?}_t{tokens}_g{group}_w{width}{}",
            if in_place { "_in_place" } else { "" }
        )
        .to_lowercase(),
        move |rng: &mut Rng| -> Result<Instance> {
            let rows = tokens * group;
            // The rope part of a wider row (as q's rope columns), into another wide row.
            let xv = View {
                offset: 5,
                rows,
                cols: width,
                stride: width + 48,
            };
            let yv = View {
                offset: 512,
                rows,
                cols: width,
                stride: width + 512,
            };
            let x = view_buffer(rng, xv.end() as usize + 3, &xv, 1.0);
            let half = width / 2;
            let table_rows = 300u32;
            let factor = rng.uniform(0.8, 1.3);
            let mut table = Vec::with_capacity((table_rows * width) as usize);
            for p in 0..table_rows {
                let ang: Vec<f32> = (0..half)
                    .map(|i| p as f32 * 10000f32.powf(-((2 * i) as f32) / width as f32))
                    .collect();
                table.extend(ang.iter().map(|a| a.cos() * factor));
                table.extend(ang.iter().map(|a| a.sin() * factor));
            }
            let positions: Vec<i32> = (0..tokens)
                .map(|_| rng.below(table_rows as u64) as i32)
                .collect();
            Ok(Instance {
                op: Box::new(RopeOp {
                    layout,
                    x: xv,
                    y: yv,
                    group,
                    table_rows,
                    in_place: false,
                }),
                buffers: vec![
                    ("x", f32_bytes(&x)),
                    ("positions", i32_bytes(&positions)),
                    ("table", f32_bytes(&table)),
                    ("y", f32_bytes(&vec![f32::NAN; yv.end() as usize + 7])),
                ],
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: format!("{rows} rows"),
            })
        },
    )
}

fn silu_case(rows: u32, cols: u32) -> OpCase {
    OpCase::new(
        format!("elementwise/silu_mul_r{rows}_c{cols}"),
        move |rng: &mut Rng| -> Result<Instance> {
            // One fused [rows, 2 * cols] projection: gate then up.
            let full = View::packed(rows, 2 * cols);
            let g = full.cols(0, cols)?;
            let up = full.cols(cols, cols)?;
            let (yv, yl) = padded(rows, cols, 3);
            let mut x: Vec<f32> = (0..rows * 2 * cols).map(|_| rng.normal() * 3.0).collect();
            x[0] = -120.0; // exp overflows: silu -> -0
            Ok(Instance {
                op: Box::new(SiluMulOp { g, u: up, y: yv }),
                buffers: vec![("x", f32_bytes(&x)), ("y", f32_bytes(&vec![f32::NAN; yl]))],
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: format!("[{rows}, {cols}]"),
            })
        },
    )
}

fn cast_case(to: DType, rows: u32, cols: u32) -> OpCase {
    OpCase::new(
        format!("elementwise/cast_to_{}_r{rows}_c{cols}", to.name()),
        move |rng: &mut Rng| -> Result<Instance> {
            let xv = View {
                offset: 3,
                rows,
                cols,
                stride: cols + 5,
            };
            let yv = View {
                offset: 4,
                rows,
                cols,
                stride: cols + 6,
            };
            let x = view_buffer(rng, xv.end() as usize + 1, &xv, 1.0);
            let (xb, y0, cmp) = match to {
                DType::Bf16 => (
                    f32_bytes(&x),
                    // bf16 NaN poison: 0x7fc0
                    [0xc0u8, 0x7f].repeat(yv.end() as usize + 2),
                    Compare::Exact,
                ),
                DType::F32 => (
                    bf16_bytes(&x),
                    f32_bytes(&vec![f32::NAN; yv.end() as usize + 2]),
                    Compare::F32 { rel_l2: 0.0 },
                ),
            };
            Ok(Instance {
                op: Box::new(CastOp { x: xv, y: yv, to }),
                buffers: vec![("x", xb), ("y", y0)],
                outputs: vec![("y", cmp)],
                detail: format!("[{rows}, {cols}]"),
            })
        },
    )
}

fn embedding_case(wtype: WeightType) -> OpCase {
    OpCase::new(
        format!("elementwise/embedding_{}", wtype.name()),
        move |rng: &mut Rng| -> Result<Instance> {
            let table = WeightLayout::new(wtype, 97, 72);
            let (tb, _) = random_weight(rng, &table);
            let tokens = 9u32;
            let mut ids: Vec<i32> = (0..tokens).map(|_| rng.below(97) as i32).collect();
            ids[3] = 96;
            ids[4] = 0;
            ids[7] = 97; // past the vocabulary: NaN row
            let (yv, yl) = padded(tokens, 72, 4);
            Ok(Instance {
                op: Box::new(EmbeddingOp {
                    table,
                    tokens,
                    y: yv,
                }),
                buffers: vec![
                    ("table", tb),
                    ("ids", i32_bytes(&ids)),
                    ("y", f32_bytes(&vec![f32::NAN; yl])),
                ],
                outputs: vec![("y", Compare::F32 { rel_l2: 0.0 })],
                detail: format!("{tokens} tokens"),
            })
        },
    )
}

fn key_write_case() -> OpCase {
    OpCase::new(
        "elementwise/key_cache_write",
        move |rng: &mut Rng| -> Result<Instance> {
            let (tokens, width, num_slots) = (7u32, 128u32, 40u32);
            let xv = View {
                offset: 9,
                rows: tokens,
                cols: width,
                stride: width + 2,
            };
            let x = view_buffer(rng, xv.end() as usize, &xv, 1.0);
            let mut slots: Vec<i32> = rng
                .distinct(num_slots as u64, tokens as usize)
                .iter()
                .map(|&s| s as i32)
                .collect();
            slots[2] = -1;
            slots[5] = num_slots as i32; // out of range: skipped
            let cache: Vec<u8> = (0..num_slots * width * 2)
                .map(|_| rng.below(256) as u8)
                .collect();
            Ok(Instance {
                op: Box::new(KeyWriteOp { x: xv, num_slots }),
                buffers: vec![
                    ("x", f32_bytes(&x)),
                    ("slot_mapping", i32_bytes(&slots)),
                    ("cache", cache),
                ],
                outputs: vec![("cache", Compare::Exact)],
                detail: format!("{tokens} rows"),
            })
        },
    )
}

fn fill_case(mode: crate::kernels::fill::FillMode, tag: &'static str) -> OpCase {
    OpCase::new(
        format!("elementwise/fill_{tag}"),
        move |rng: &mut Rng| -> Result<Instance> {
            let words = 70_000 + rng.below(1000) as u32;
            Ok(Instance {
                op: Box::new(crate::kernels::fill::FillOp {
                    words,
                    mode,
                    seed: rng.below(1 << 32) as u32,
                }),
                // One word past the fill stays as it was.
                buffers: vec![("dst", vec![0xa5u8; (words as usize + 1) * 4])],
                outputs: vec![("dst", Compare::Exact)],
                detail: format!("{words} words"),
            })
        },
    )
}

fn copy_case() -> OpCase {
    OpCase::new(
        "elementwise/copy_words",
        move |rng: &mut Rng| -> Result<Instance> {
            let words = 50_000 + rng.below(1000) as u32;
            let src: Vec<u8> = (0..words * 4).map(|_| rng.below(256) as u8).collect();
            Ok(Instance {
                op: Box::new(crate::kernels::fill::CopyOp { words }),
                buffers: vec![
                    ("src", src),
                    ("dst", vec![0x5au8; (words as usize + 3) * 4]),
                ],
                outputs: vec![("dst", Compare::Exact)],
                detail: format!("{words} words"),
            })
        },
    )
}

/// Every case of this module.
pub fn elementwise_cases() -> Vec<OpCase> {
    vec![
        norm_case(NormKind::Rms, 5, 64),
        norm_case(NormKind::Rms, 3, 1536),
        // The model's width (4-column steps only) and a LayerNorm over 2 steps plus a tail.
        norm_case(NormKind::Rms, 2, 6144),
        norm_case(NormKind::Layer, 3, 2100),
        norm_case(NormKind::Layer, 6, 128),
        rope_case(RopeLayout::Interleaved, 5, 4, 64, false),
        rope_case(RopeLayout::HalfSplit, 3, 8, 64, false),
        rope_case(RopeLayout::Interleaved, 7, 1, 64, false),
        rope_case(RopeLayout::HalfSplit, 4, 8, 64, true),
        rope_case(RopeLayout::Interleaved, 3, 1, 64, true),
        silu_case(6, 96),
        cast_case(DType::Bf16, 4, 576),
        cast_case(DType::F32, 5, 37),
        embedding_case(WeightType::Bf16),
        embedding_case(WeightType::F32),
        key_write_case(),
        fill_case(crate::kernels::fill::FillMode::E4m3, "e4m3"),
        // Powers of two: a + b · u is exact with or without a fused multiply-add (NVRTC fuses).
        fill_case(
            crate::kernels::fill::FillMode::Bf16 { scale: 0.03125 },
            "bf16",
        ),
        fill_case(
            crate::kernels::fill::FillMode::F32 { lo: 0.5, hi: 1.5 },
            "f32",
        ),
        copy_case(),
    ]
}
