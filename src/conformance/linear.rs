//! Cases of the linear kernels: dense and grouped, f32 / bf16 / block-scaled FP8 weights,
//! f32 and bf16 activations, strided views with NaN around them, the token-tile variants
//! (T = 1, 3, 11), adding into the output, stacked FP8 groups whose block grid restarts,
//! expert ids out of range.

use super::ops::{
    bf16_bytes, f32_bytes, i32_bytes, normals, view_buffer, Compare, Instance, OpCase,
};
use crate::kernels::linear::{GroupSelect, GroupedLinearOp, LinearOp};
use crate::kernels::view::{DType, View, WeightLayout, WeightType};
use crate::util::Rng;
use crate::Result;

/// f32 paths on bf16-exact inputs, f32 accumulation over up to a few thousand terms.
const TOL: f64 = 1e-5;

/// Random weights of `layout` and (FP8) their scales.
pub fn random_weight(rng: &mut Rng, l: &WeightLayout) -> (Vec<u8>, Option<Vec<u8>>) {
    let n = l.rows as usize * l.cols as usize;
    let scale = (l.cols as f32).powf(-0.5);
    match l.wtype {
        WeightType::F32 => (f32_bytes(&normals(rng, n, scale)), None),
        WeightType::Bf16 => (bf16_bytes(&normals(rng, n, scale)), None),
        WeightType::Fp8 { .. } => {
            let q: Vec<u8> = (0..n)
                .map(|_| loop {
                    let b = rng.below(256) as u8;
                    if b & 0x7F != 0x7F {
                        break b;
                    }
                })
                .collect();
            let s_n = (l.scale_bytes() / 4) as usize;
            // Scales over a few binades, as real block scales spread.
            let s: Vec<f32> = (0..s_n)
                .map(|_| {
                    scale / 64.0 * (2.0f32).powi(rng.below(5) as i32 - 2) * rng.uniform(0.5, 1.0)
                })
                .collect();
            (q, Some(f32_bytes(&s)))
        }
    }
}

fn act_bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => f32_bytes(v),
        DType::Bf16 => bf16_bytes(v),
    }
}

/// A strided view of `rows x cols` with some padding on both sides.
fn padded(rows: u32, cols: u32, pad: u32) -> (View, usize) {
    let v = View {
        offset: pad as u64 + 3,
        rows,
        cols,
        stride: cols + pad,
    };
    (v, v.end() as usize + pad as usize)
}

#[allow(clippy::too_many_arguments)]
fn dense_case(
    name: &str,
    tokens: u32,
    k: u32,
    n: u32,
    wtype: WeightType,
    group_rows: u32,
    x_dtype: DType,
    accumulate: bool,
    splits: u32,
) -> OpCase {
    OpCase::new(
        format!("linear/{name}"),
        move |rng: &mut Rng| -> Result<Instance> {
            let (xv, xlen) = padded(tokens, k, 5);
            let (yv, ylen) = padded(tokens, n, 7);
            let w = WeightLayout {
                wtype,
                rows: n,
                cols: k,
                group_rows,
            };
            let x = view_buffer(rng, xlen, &xv, 1.0);
            let y0 = if accumulate {
                view_buffer(rng, ylen, &yv, 1.0)
            } else {
                vec![f32::NAN; ylen]
            };
            let (wb, sb) = random_weight(rng, &w);
            let mut buffers = vec![
                ("x", act_bytes(&x, x_dtype)),
                ("w", wb),
                ("y", f32_bytes(&y0)),
            ];
            if let Some(s) = sb {
                buffers.push(("w_scale", s));
            }
            if splits > 1 {
                let n_p = (splits * tokens * n) as usize;
                buffers.push(("partials", f32_bytes(&vec![f32::NAN; n_p])));
            }
            Ok(Instance {
                op: Box::new(LinearOp {
                    x: xv,
                    x_dtype,
                    w,
                    y: yv,
                    accumulate,
                    splits,
                }),
                buffers,
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: format!("T{tokens} K{k} N{n} S{splits}"),
            })
        },
    )
}

#[allow(clippy::too_many_arguments)]
fn grouped_case(
    name: &str,
    rows: u32,
    x_div: u32,
    k: u32,
    n: u32,
    groups: u32,
    wtype: WeightType,
    select: GroupSelect,
    combine: Option<u32>,
    accumulate: bool,
) -> OpCase {
    OpCase::new(
        format!("linear/{name}"),
        move |rng: &mut Rng| -> Result<Instance> {
            let x_rows = rows.div_ceil(x_div);
            let (xv, xlen) = padded(x_rows, k, 4);
            let out_rows = rows / combine.unwrap_or(1);
            let (yv, ylen) = padded(out_rows, n, 2);
            // Experts' blocks restart per group (gate | up of one expert are two groups).
            let w = WeightLayout::stacked(wtype, groups * 2, n / 2, k);
            let x = view_buffer(rng, xlen, &xv, 1.0);
            let y0 = if accumulate {
                view_buffer(rng, ylen, &yv, 1.0)
            } else {
                vec![f32::NAN; ylen]
            };
            let (wb, sb) = random_weight(rng, &w);
            let mut buffers = vec![("x", f32_bytes(&x)), ("w", wb), ("y", f32_bytes(&y0))];
            if let Some(s) = sb {
                buffers.push(("w_scale", s));
            }
            if select == GroupSelect::Experts {
                let ids: Vec<i32> = (0..rows)
                    .map(|r| match r % 7 {
                        5 => -1,
                        6 if r % 2 == 0 => groups as i32,
                        _ => rng.below(groups as u64) as i32,
                    })
                    .collect();
                buffers.push(("ids", i32_bytes(&ids)));
            }
            if combine.is_some() {
                let rw: Vec<f32> = (0..rows).map(|_| rng.uniform(0.1, 2.5)).collect();
                buffers.push(("route_w", f32_bytes(&rw)));
            }
            Ok(Instance {
                op: Box::new(GroupedLinearOp {
                    x: xv,
                    x_dtype: DType::F32,
                    x_div,
                    w,
                    n_out: n,
                    select,
                    groups,
                    rows,
                    combine,
                    y: yv,
                    accumulate,
                }),
                buffers,
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: format!("R{rows} K{k} N{n} G{groups}"),
            })
        },
    )
}

/// Every linear case.
pub fn linear_cases() -> Vec<OpCase> {
    let fp8 = WeightType::Fp8 { block: [128, 128] };
    let fp8_odd = WeightType::Fp8 { block: [3, 20] };
    let fp8_odd2 = WeightType::Fp8 { block: [16, 36] };
    let (bf16, f32w) = (WeightType::Bf16, WeightType::F32);
    let (xf, xb) = (DType::F32, DType::Bf16);
    // (name, T, K, N, weights, group rows, x, accumulate, splits)
    let dense = [
        ("bf16_t1", 1, 576, 100, bf16, 100, xf, false, 1),
        ("bf16_t11_acc", 11, 300, 37, bf16, 37, xf, true, 1),
        ("f32_t3", 3, 64, 24, f32w, 24, xf, false, 1),
        ("bf16_xbf16_t2", 2, 512, 40, bf16, 40, xb, false, 1),
        // Two stacked groups of 100 rows: the second group's scales start a new block row.
        ("fp8_t5_groups_acc", 5, 320, 200, fp8, 100, xf, true, 1),
        ("fp8_t1", 1, 1024, 130, fp8, 130, xf, false, 1),
        // Split K: 2048-element chunks (T = 1) over 3 splits, the last one short; into y.
        ("fp8_t1_split3_acc", 1, 5000, 24, fp8, 24, xf, true, 3),
        // Block widths that are not powers of two (the scale column is found through an f32
        // reciprocal in the kernels): 3 x 20 blocks, K not a multiple of 20; 16 x 36 split.
        ("fp8_b3x20_t3", 3, 700, 50, fp8_odd, 50, xf, false, 1),
        (
            "fp8_b16x36_t1_split2",
            1,
            3000,
            20,
            fp8_odd2,
            20,
            xb,
            false,
            2,
        ),
        ("bf16_t3_split2", 3, 1100, 16, bf16, 16, xf, false, 2),
        ("bf16_t9_split2_acc", 9, 700, 20, bf16, 20, xb, true, 2),
    ];
    let mut v: Vec<OpCase> = dense
        .into_iter()
        .map(|(name, t, k, n, w, g, x, acc, splits)| {
            dense_case(name, t, k, n, w, g, x, acc, splits)
        })
        .collect();
    // (name, rows, x_div, K, N, groups, weights, select, combine, accumulate)
    let grouped = [
        (
            "heads_bf16",
            12,
            1,
            48,
            64,
            4,
            bf16,
            GroupSelect::Heads,
            None,
            false,
        ),
        (
            "experts_fp8_gate_up",
            12,
            3,
            128,
            64,
            6,
            fp8,
            GroupSelect::Experts,
            None,
            false,
        ),
        (
            "experts_bf16_down_combine_acc",
            12,
            1,
            96,
            40,
            5,
            bf16,
            GroupSelect::Experts,
            Some(3),
            true,
        ),
        (
            "experts_fp8_down_combine",
            8,
            1,
            2600,
            32,
            3,
            fp8,
            GroupSelect::Experts,
            Some(2),
            false,
        ),
    ];
    v.extend(
        grouped
            .into_iter()
            .map(|(name, r, xd, k, n, g, w, sel, comb, acc)| {
                grouped_case(name, r, xd, k, n, g, w, sel, comb, acc)
            }),
    );
    v
}
