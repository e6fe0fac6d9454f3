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
/// FP8 → bf16 dequant (the weights the vendor GEMM reads for FP8 checkpoints): bit-exact
/// against the f32-product-then-round definition, over stacked groups and odd blocks.
fn dequant_case(name: &str, rows: u32, cols: u32, group_rows: u32, block: [u32; 2]) -> OpCase {
    OpCase::new(
        format!("linear/dequant_{name}"),
        move |rng: &mut Rng| -> Result<Instance> {
            let w = WeightLayout {
                wtype: WeightType::Fp8 { block },
                rows,
                cols,
                group_rows,
            };
            let (wb, sb) = random_weight(rng, &w);
            Ok(Instance {
                op: Box::new(crate::kernels::linear::DequantOp { w }),
                buffers: vec![
                    ("w", wb),
                    ("w_scale", sb.unwrap_or_default()),
                    ("y", vec![0xA5; (rows * cols * 4) as usize]),
                ],
                outputs: vec![("y", Compare::Exact)],
                detail: format!("[{rows}, {cols}] blocks {block:?} groups of {group_rows}"),
            })
        },
    )
}

/// f32 activations to bf16 hi / lo rows (the vendor GEMM's x), bit-exact, from a strided view
/// with NaN around it; and the reduction that adds the GEMM's partial terms into a view.
fn split_cases() -> Vec<OpCase> {
    let split = OpCase::new(
        "linear/split_bf16_hilo",
        |rng: &mut Rng| -> Result<Instance> {
            let (xv, xlen) = padded(7, 96, 5);
            let x = view_buffer(rng, xlen, &xv, 3.0);
            Ok(Instance {
                op: Box::new(crate::kernels::elementwise::SplitBf16Op { x: xv }),
                buffers: vec![("x", f32_bytes(&x)), ("y", vec![0x5A; 7 * 96 * 4])],
                outputs: vec![("y", Compare::Exact)],
                detail: "T7 K96 strided".into(),
            })
        },
    );
    let reduce = OpCase::new(
        "linear/split_reduce4_acc",
        |rng: &mut Rng| -> Result<Instance> {
            let (yv, ylen) = padded(5, 70, 3);
            let p = normals(rng, 4 * 5 * 70, 1.0);
            Ok(Instance {
                op: Box::new(crate::kernels::linear::SplitReduceOp {
                    tokens: 5,
                    n_out: 70,
                    splits: 4,
                    y: yv,
                    accumulate: true,
                }),
                buffers: vec![
                    ("partials", f32_bytes(&p)),
                    ("y", f32_bytes(&view_buffer(rng, ylen, &yv, 1.0))),
                ],
                outputs: vec![("y", Compare::F32 { rel_l2: TOL })],
                detail: "T5 N70 4 terms".into(),
            })
        },
    );
    vec![split, reduce]
}

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
    v.push(dequant_case("b128", 300, 640, 150, [128, 128]));
    v.push(dequant_case("b3x20", 37, 120, 37, [3, 20]));
    v.extend(split_cases());
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

/// The vendor BLAS (`Backend::gemm_bf16`, cuBLAS on CUDA) on strided bf16 `x` and f32 `y`
/// views with NaN around them, over and into `y`, at the batch sizes the model hands it
/// (DenseGemm::Auto: from 8 tokens). The reference is float64 from the same bf16 values. On a
/// backend without one the case checks that the call declines (`Ok(false)`) and writes
/// nothing.
pub struct VendorGemmCase {
    pub tokens: u32,
    pub k: u32,
    pub n: u32,
    pub accumulate: bool,
    /// 1: one dense GEMM; more: the per-head form, one strided-batched call where row
    /// `t · heads + h` of x and y belongs to head `h`, whose weights are rows `h·n ..` of W.
    pub heads: u32,
}

/// cuBLAS accumulates in f32 (CUBLAS_COMPUTE_32F); split-K adds a few more f32 roundings.
const VENDOR_TOL: f64 = 2e-5;

/// The weights start this many elements into their buffer (NaN before them): the model
/// hands the GEMM the hi and lo halves of one dequantised buffer.
const W_OFF: u64 = 6;

pub fn vendor_gemm_cases() -> Vec<VendorGemmCase> {
    vec![
        VendorGemmCase {
            tokens: 1,
            k: 576,
            n: 100,
            accumulate: false,
            heads: 1,
        },
        VendorGemmCase {
            tokens: 8,
            k: 1040,
            n: 333,
            accumulate: true,
            heads: 1,
        },
        VendorGemmCase {
            tokens: 33,
            k: 2048,
            n: 130,
            accumulate: false,
            heads: 1,
        },
        VendorGemmCase {
            tokens: 3,
            k: 192,
            n: 72,
            accumulate: false,
            heads: 5,
        },
    ]
}

impl super::Case for VendorGemmCase {
    fn name(&self) -> String {
        format!(
            "linear/cublas_bf16_t{}{}{}",
            self.tokens,
            if self.heads > 1 {
                format!("_heads{}", self.heads)
            } else {
                String::new()
            },
            if self.accumulate { "_acc" } else { "" }
        )
    }

    fn run(&self, backend: &dyn crate::runtime::Backend, seed: u64) -> Result<super::Outcome> {
        use crate::reference::numerics::round_bf16 as bf16_round;
        let mut rng = Rng::new(seed);
        let (t, k, n, heads) = (self.tokens, self.k, self.n, self.heads);
        let (xv, xlen) = padded(t * heads, k, 5);
        let (yv, ylen) = padded(t * heads, n, 7);
        let x: Vec<f32> = view_buffer(&mut rng, xlen, &xv, 1.0)
            .into_iter()
            .map(|v| if v.is_nan() { v } else { bf16_round(v) })
            .collect();
        let wv: Vec<f32> = normals(&mut rng, (heads * n * k) as usize, (k as f32).powf(-0.5))
            .into_iter()
            .map(bf16_round)
            .collect();
        let y0 = if self.accumulate {
            view_buffer(&mut rng, ylen, &yv, 1.0)
        } else {
            vec![super::ops::POISON; ylen]
        };
        let mut expected = y0.clone();
        for r in 0..(t * heads) as u64 {
            let h = r % heads as u64;
            for j in 0..n as u64 {
                let mut acc = 0.0f64;
                let wrow = (h * n as u64 + j) * k as u64;
                for c in 0..k as u64 {
                    acc += x[xv.index(r, c)] as f64 * wv[(wrow + c) as usize] as f64;
                }
                let e = &mut expected[yv.index(r, j)];
                *e = if self.accumulate {
                    (*e as f64 + acc) as f32
                } else {
                    acc as f32
                };
            }
        }
        let (xb, wb, yb) = (
            backend.upload(&bf16_bytes(&x))?,
            backend.upload(&bf16_bytes(
                &[vec![f32::NAN; W_OFF as usize], wv.clone()].concat(),
            ))?,
            backend.upload(&f32_bytes(&y0))?,
        );
        let shape = crate::runtime::GemmShape {
            m: t,
            n,
            k,
            x_off: xv.offset,
            x_stride: heads * xv.stride,
            w_off: W_OFF,
            y_off: yv.offset,
            y_stride: heads * yv.stride,
            accumulate: self.accumulate,
            batch: heads,
            x_batch: xv.stride as u64,
            w_batch: n as u64 * k as u64,
            y_batch: yv.stride as u64,
        };
        let t0 = std::time::Instant::now();
        let ran = backend.gemm_bf16(&shape, &xb, &wb, &yb)?;
        let got = backend.download(&yb)?;
        let seconds = t0.elapsed().as_secs_f64();
        let mut outcome = super::Outcome {
            case: self.name(),
            seed,
            rel_l2: 0.0,
            max_abs: 0.0,
            lse_err: 0.0,
            detail: format!("T{t} K{k} N{n} heads {heads}"),
            seconds,
            failures: Vec::new(),
        };
        if !ran {
            let why = backend.gemm_available().err().unwrap_or_default();
            outcome.detail = format!("declined: {why}");
            if backend.gemm_available().is_ok() {
                outcome
                    .failures
                    .push("the backend says it has a vendor BLAS but declined the call".into());
            }
            if got != f32_bytes(&y0) {
                outcome
                    .failures
                    .push("y changed although the call was declined".into());
            }
            return Ok(outcome);
        }
        let c = super::ops::compare_f32(&f32_bytes(&expected), &got);
        outcome.rel_l2 = c.rel_l2;
        outcome.max_abs = c.max_abs;
        if c.untouched_changed > 0 {
            outcome.failures.push(format!(
                "y: {} elements outside the output view changed",
                c.untouched_changed
            ));
        }
        if c.not_finite > 0 {
            outcome.failures.push(format!(
                "y: {} outputs NaN or infinite (unwritten?)",
                c.not_finite
            ));
        }
        if !super::within(c.rel_l2, VENDOR_TOL) {
            outcome.failures.push(format!(
                "y: relative L2 error {:.3e} > {VENDOR_TOL:.0e}",
                c.rel_l2
            ));
        }
        Ok(outcome)
    }
}
