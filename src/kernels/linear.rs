//! Linear layers (`y = x · Wᵀ`, nn.Linear's layout) with weights in their checkpoint dtype:
//! f32, bf16 or block-scaled e4m3 (`W = e4m3(q) × scale_inv[row / br, col / bc]`), activations
//! f32 (or bf16) in, f32 out, f32 accumulation. Described once; the scalar lowering runs it
//! on every target.
//!
//! - [`LinearOp`]: a dense linear, `y[t, n] (+)= Σ_k x[t, k] · W[n, k]`. Optionally adds into
//!   `y` (the residual add of the decoder folds into o_proj and down_proj this way).
//! - [`GroupedLinearOp`]: every output row picks its own block of weight rows — head
//!   `r % heads` (the absorbed W_UK and W_UV), or expert `ids[r]` (the routed experts, all of a
//!   layer's experts stacked in one buffer) — and, for experts, the `k` rows of a token are
//!   summed with their routing weights into one output row.
//!
//! Work split (decode is GEMV-shaped: the weights are the bytes): a workgroup of 256 threads
//! is 8 warps of 32 lanes; each warp owns 1 or 4 output columns `n` (weight rows), its lanes
//! reading consecutive 32-bit words of each, and `TB` tokens share each weight word read; K is
//! walked in chunks with the chunk of `x` staged in workgroup memory, and an x value a lane
//! reads from there serves all of its warp's rows (at 8 tokens and one row per warp, those
//! reads, one per FMA, bounded the kernel). Lane partial sums are reduced at the end.

use super::view::{load_f32, DType, View, ViewArgs, WeightLayout, WeightType};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::linear::{grouped_linear, linear, RowSelect};
use crate::reference::tensor::{f32s, i32s, read_view, write_view, HostWeight};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

/// Threads per workgroup.
pub const THREADS: u32 = 256;
/// Lanes that share one weight row.
const LANES: u32 = 32;
/// Weight rows (output columns) per workgroup.
pub const ROWS_PER_WG: u32 = THREADS / LANES;
/// Workgroup memory for the staged chunk of x, in f32 (8 KiB: within WebGPU's 16 KiB).
const STAGE: u32 = 2048;

/// Elements of K staged per barrier for `tokens_per_wg` tokens: the whole stage. Long chunks
/// matter: each lane then has many independent weight loads between two barriers, which is
/// what keeps a GEMV-shaped decode step at the memory's speed (v1 staged 256).
pub fn chunk_for(tokens_per_wg: u32) -> u32 {
    if BASELINE.load(std::sync::atomic::Ordering::Relaxed) {
        return THREADS;
    }
    (STAGE / tokens_per_wg.max(1)).max(THREADS) / THREADS * THREADS
}

/// The chunk of a linear (dense, or grouped at one token) for `tokens_per_wg` tokens and a K of `k_in` columns: a K
/// that fits in [`THREADS`] elements takes the 256-element chunk (every variant has it), so
/// that the walk over a chunk — whose trip count is the chunk's, a constant the CUDA compiler
/// unrolls — is not mostly words past K: the absorbed per-head weights (K = 128-192 on the
/// real models, 48 on the tiny one) walked 2048 columns for 128-192 (8-16x the work; lavapipe
/// ran the tiny model's decode step 4x slower).
pub fn chunk_for_k(tokens_per_wg: u32, k_in: u32) -> u32 {
    if k_in <= THREADS {
        THREADS
    } else {
        chunk_for(tokens_per_wg)
    }
}

static BASELINE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Benchmarks only: 0 = the policy of [`rows_per_warp`], otherwise that many rows per warp.
static ROWS_OVERRIDE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Benchmarks only: force the dense linear's rows per warp (1 or 4; 0 restores the policy),
/// so one run can compare them.
pub fn set_rows_per_warp(rows: u32) {
    ROWS_OVERRIDE.store(rows, std::sync::atomic::Ordering::Relaxed);
}

/// Tokens per workgroup of the dense linear for `rows` rows of x: 1, 4 or 8.
fn tokens_per_wg(rows: u32) -> u32 {
    match rows {
        0..=1 => 1,
        2..=4 => 4,
        _ => 8,
    }
}

/// Weight rows per warp of the dense linear for `tokens_per_wg` tokens: 1 at one token (the
/// weight loads bound it), 4 from 4 tokens (the x reads from workgroup memory would).
pub fn rows_per_warp(tokens_per_wg: u32) -> u32 {
    if baseline() {
        return 1;
    }
    match ROWS_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed) {
        r @ (1 | 4) => r,
        _ if tokens_per_wg <= 1 => 1,
        _ => 4,
    }
}

/// Benchmarks only: run the v1 configuration (256-element chunks, no split-K) so that one run
/// can show the previous version beside this one.
pub fn set_baseline(v1: bool) {
    BASELINE.store(v1, std::sync::atomic::Ordering::Relaxed);
}

/// Is the v1 configuration selected?
pub fn baseline() -> bool {
    BASELINE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Compile-time knobs of the dense linear kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearConfig {
    /// Storage of W (FP8 block sizes are run-time parameters).
    pub w: WeightType,
    pub x: DType,
    /// Tokens per workgroup (1, 4 or 8): each weight word read serves that many tokens.
    pub tokens_per_wg: u32,
    /// `y += x · Wᵀ` instead of `y = x · Wᵀ`.
    pub accumulate: bool,
    /// Elements of K staged per barrier (a multiple of 256; `tokens_per_wg · chunk ≤ 2048`).
    pub chunk: u32,
    /// Split K over the grid's z: each split writes its partial sums to `partials`, and
    /// [`split_reduce_kernel`] adds them up.
    pub split: bool,
    /// Weight rows each warp owns (1, 2 or 4; the policy uses 1 and 4): every x value a lane reads from workgroup
    /// memory then serves that many rows, so at 4–8 tokens the shared-memory loads (one per
    /// FMA at one row) stop bounding the kernel.
    pub rows_per_warp: u32,
}

impl LinearConfig {
    pub fn name(&self) -> String {
        format!(
            "linear_x{}_w{}_t{}_c{}{}{}{}",
            self.x.name(),
            self.w.name(),
            self.tokens_per_wg,
            self.chunk,
            if self.rows_per_warp > 1 {
                format!("_r{}", self.rows_per_warp)
            } else {
                String::new()
            },
            if self.accumulate { "_acc" } else { "" },
            if self.split { "_split" } else { "" }
        )
    }
}

/// The FP8 scale parameters and buffer of a kernel.
struct Fp8Args {
    scale: Buf,
    group_rows: Expr,
    scale_group_rows: Expr,
    scale_cols: Expr,
    block_rows: Expr,
    /// `1 / block_cols` as an f32: the scale column of element `col` is
    /// `floor((col + 0.5) · inv_block_cols)`, exact for `col < 2^22` (the relative error of
    /// the product, ≤ 2^-23, stays under the half-column margin `0.5 / block_cols`) and three
    /// instructions where an integer division by a run-time value costs about twenty — once
    /// per weight word, the largest ALU cost of the FP8 GEMV after the e4m3 conversions.
    inv_block_cols: Expr,
    block_cols: Expr,
}

fn declare_weight(b: &mut KernelBuilder, wt: WeightType) -> (Buf, Option<Fp8Args>) {
    let w = b.buffer(
        "w",
        wt.elem(),
        Access::Read,
        &format!("[rows, k_in] {} weights (nn.Linear's [out, in])", wt.name()),
    );
    let fp8 = matches!(wt, WeightType::Fp8 { .. }).then(|| Fp8Args {
        scale: b.buffer(
            "w_scale",
            Elem::F32,
            Access::Read,
            "[groups * scale_group_rows, scale_cols] f32 inverse block scales",
        ),
        group_rows: b.param("group_rows", Ty::U32, "weight rows per stacked matrix"),
        scale_group_rows: b.param(
            "scale_group_rows",
            Ty::U32,
            "scale rows per stacked matrix: ceil(group_rows / block_rows)",
        ),
        scale_cols: b.param("scale_cols", Ty::U32, "ceil(k_in / block_cols)"),
        block_rows: b.param("block_rows", Ty::U32, "rows of an FP8 scale block"),
        block_cols: b.param(
            "block_cols",
            Ty::U32,
            "columns of an FP8 scale block (a multiple of 4); read by the v1 baseline only",
        ),
        inv_block_cols: b.param(
            "inv_block_cols",
            Ty::F32,
            "1 / block_cols rounded to f32 (block_cols: columns of an FP8 scale block, a multiple of 4; k_in < 2^22)",
        ),
    });
    (w, fp8)
}

/// First element of the scale row that weight row `wrow` uses.
fn scale_row_base(b: &mut KernelBuilder, f: &Fp8Args, wrow: &Expr) -> Expr {
    let g = wrow.clone() / f.group_rows.clone();
    let rr = wrow.clone() % f.group_rows.clone();
    b.let_(
        "scale_base",
        (g * f.scale_group_rows.clone() + rr / f.block_rows.clone()) * f.scale_cols.clone(),
    )
}

/// The element values of one weight word (`tag` names its temporaries).
fn word_values(b: &mut KernelBuilder, wt: WeightType, word: &Expr, tag: &str) -> Vec<Expr> {
    match wt {
        WeightType::F32 => vec![f32_from_bits(word.clone())],
        WeightType::Bf16 => vec![
            f32_from_bits(word.clone() << u(16)),
            f32_from_bits(word.clone() & u(0xffff_0000)),
        ],
        // Two bytes per conversion (one instruction for a pair on sm_89+: the e4m3 decode is
        // the largest ALU cost of the FP8 GEMV).
        WeightType::Fp8 { .. } => {
            let [v0, v1] = e4m3x2_to_f32(b, &format!("pairlo{tag}"), word.clone() & u(0xffff));
            let [v2, v3] = e4m3x2_to_f32(b, &format!("pairhi{tag}"), word.clone() >> u(16));
            vec![v0, v1, v2, v3]
        }
    }
}

/// Weight words a lane loads before it uses any of them. Measured on the H200 (GLM-5 FP8
/// stack, batch 1 / 8): 4 made the step 10 % / 26 % slower than 1 (registers: occupancy
/// fell, and the FP8 path is bound by its per-byte e4m3 conversions, not by loads in flight),
/// so 1 — with the body branch-free, which lets the CUDA compiler unroll the loop itself.
const UNROLL: u32 = 1;

/// This thread's share of one K chunk: for each of its words of each weight row `r` (`rows[r]`
/// = the row's first word and, for FP8, its scale row), `acc[r][t] += Σ_e W · xs[t, e]`
/// (times the word's block scale for FP8), each x value read once for all the rows. `kc` is
/// the chunk's first element; `row_words` bounds the row. Words are taken [`UNROLL`] at a time, all
/// loads first; a word past the chunk or the row reads as zero (its index clamped, never
/// out of bounds).
#[allow(clippy::too_many_arguments)]
fn chunk_dot(
    b: &mut KernelBuilder,
    wt: WeightType,
    w: &Buf,
    fp8: Option<&Fp8Args>,
    rows: &[(Expr, Option<Expr>)],
    kc: &Expr,
    row_words: &Expr,
    xs: &Shared,
    chunk: u32,
    lane: &Expr,
    acc: &[Vec<Expr>],
) {
    let pw = wt.per_word();
    let chunk_words = chunk / pw;
    let unroll = if BASELINE.load(std::sync::atomic::Ordering::Relaxed) {
        1
    } else {
        UNROLL
    };
    let tb = acc[0].len() as u32;
    b.for_(
        "wi",
        lane.clone(),
        u(chunk_words),
        u(LANES * unroll),
        |b, wi| {
            let mut words = Vec::new();
            for q in 0..unroll {
                let cw = b.let_(&format!("cw{q}"), wi.clone() + u(LANES * q));
                let gw = b.let_(&format!("gw{q}"), kc.clone() / u(pw) + cw.clone());
                let ok = b.let_(
                    &format!("ok{q}"),
                    cw.clone()
                        .lt(u(chunk_words))
                        .and(gw.clone().lt(row_words.clone())),
                );
                let raws: Vec<Expr> = rows
                    .iter()
                    .enumerate()
                    .map(|(r, (wbase, _))| {
                        let idx = select(ok.clone(), wbase.clone() + gw.clone(), wbase.clone());
                        b.let_(&format!("raw{q}_{r}"), w.word(idx))
                    })
                    .collect();
                words.push((cw, ok, raws));
            }
            for (q, (cw, ok, raws)) in words.into_iter().enumerate() {
                let xcol = b.let_(
                    &format!("xcol{q}"),
                    select(ok.clone(), cw.clone() * u(pw), u(0)),
                );
                // x of this word's columns, read once for all the warp's rows
                let xv: Vec<Vec<Expr>> = (0..tb)
                    .map(|t| {
                        (0..pw)
                            .map(|e| {
                                b.let_(
                                    &format!("x{q}_{t}_{e}"),
                                    xs.at(u(t * chunk) + xcol.clone() + u(e)),
                                )
                            })
                            .collect()
                    })
                    .collect();
                for (r, ((_, sbase), raw)) in rows.iter().zip(raws).enumerate() {
                    let word = b.let_(&format!("word{q}_{r}"), select(ok.clone(), raw, u(0)));
                    let vals: Vec<Expr> = word_values(b, wt, &word, &format!("{q}_{r}"))
                        .into_iter()
                        .enumerate()
                        .map(|(e, v)| b.let_(&format!("w{q}_{r}_{e}"), v))
                        .collect();
                    let scale = fp8.zip(sbase.as_ref()).map(|(f, sbase)| {
                        let col = kc.clone() + xcol.clone();
                        b.let_(
                            &format!("s{q}_{r}"),
                            f.scale.at(sbase.clone()
                                + if baseline() {
                                    col / f.block_cols.clone()
                                } else {
                                    ((col.as_f32() + crate::kir::builder::f(0.5))
                                        * f.inv_block_cols.clone())
                                    .as_u32()
                                }),
                        )
                    });
                    for (t, a) in acc[r].iter().enumerate() {
                        let mut part: Option<Expr> = None;
                        for (v, x) in vals.iter().zip(&xv[t]) {
                            part = Some(match part {
                                None => v.clone() * x.clone(),
                                Some(p) => fma(v.clone(), x.clone(), p),
                            });
                        }
                        let part = part.unwrap_or_else(|| f(0.0));
                        let part = match &scale {
                            Some(s) => part * s.clone(),
                            None => part,
                        };
                        b.set(a, a.clone() + part);
                    }
                }
            }
        },
    );
}

/// The dense linear kernel.
pub fn linear_kernel(cfg: &LinearConfig) -> Result<Kernel> {
    let tb = cfg.tokens_per_wg;
    if !(1..=LANES).contains(&tb) {
        return Err(Error::arg("tokens_per_wg", "1 to 32", tb));
    }
    let chunk = cfg.chunk;
    if chunk == 0 || chunk % THREADS != 0 || tb * chunk > STAGE.max(tb * THREADS) {
        return Err(Error::arg(
            "chunk",
            format!("a multiple of {THREADS} with tokens_per_wg x chunk <= {STAGE}"),
            chunk,
        ));
    }
    let rpw = cfg.rows_per_warp;
    if ![1, 2, 4].contains(&rpw) {
        return Err(Error::arg("rows_per_warp", "1, 2 or 4", rpw));
    }
    let rows_wg = ROWS_PER_WG * rpw;
    let mut b = KernelBuilder::new(cfg.name(), THREADS);
    b.doc(format!(
        "Linear: y[t, n] {}= sum_k x[t, k] * W[n, k]; x {} (strided view), W {} [n_out, k_in], y f32 (strided view), f32 accumulation.",
        if cfg.accumulate { "+" } else { "" },
        cfg.x.name(),
        cfg.w.name()
    ));
    b.doc(format!(
        "Grid: x = ceil(n_out / {rows_wg}), y = ceil(tokens / {tb}){}. Each workgroup: {rows_wg} weight rows ({rpw} per warp of {LANES} lanes over 32-bit words), {tb} tokens per weight word, K staged {chunk} at a time.",
        if cfg.split { ", z = splits (split z takes K from z * k_split, and writes partials[z, t, n])" } else { "" }
    ));
    if matches!(cfg.w, WeightType::Fp8 { .. }) {
        b.doc("FP8: W[n, k] = e4m3(w[n, k]) * w_scale[(n / group_rows) * scale_group_rows + (n % group_rows) / block_rows, k / block_cols].".to_string());
    }
    let tokens = b.param("tokens", Ty::U32, "T, rows of x and y");
    let n_out = b.param("n_out", Ty::U32, "N, weight rows = columns of y");
    let k_in = b.param("k_in", Ty::U32, "K, weight columns = columns of x");
    let k_split = b.param(
        "k_split",
        Ty::U32,
        "columns of K per split (a multiple of the chunk; K when not split)",
    );
    let xv = ViewArgs::declare(&mut b, "x", "x [T, K]");
    let yv = ViewArgs::declare(&mut b, "y", "y [T, N]");
    let x = b.buffer(
        "x",
        cfg.x.elem(),
        Access::Read,
        &format!("[T, K] {} activations (view x_off, x_stride)", cfg.x.name()),
    );
    let (w, fp8) = declare_weight(&mut b, cfg.w);
    let y = if cfg.split {
        b.buffer(
            "partials",
            Elem::F32,
            Access::ReadWrite,
            "[splits, T, N] f32 partial sums (packed)",
        )
    } else {
        b.buffer(
            "y",
            Elem::F32,
            Access::ReadWrite,
            "[T, N] f32 outputs (view y_off, y_stride)",
        )
    };
    let xs = b.shared("xs", Ty::F32, tb * chunk);

    let lane = b.let_("lane", local_id() % u(LANES));
    let rsub = b.let_("rsub", local_id() / u(LANES));
    let t0 = b.let_("t0", workgroup_id(1) * u(tb));
    let pw = cfg.w.per_word();
    let row_words = b.let_("row_words", k_in.clone() / u(pw));
    // The warp's rows n_r = first + r; one past N reads row 0 (never stored).
    let first = b.let_(
        "n_first",
        workgroup_id(0) * u(rows_wg) + rsub.clone() * u(rpw),
    );
    let mut ns = Vec::new();
    let mut n_oks = Vec::new();
    let mut rows = Vec::new();
    for r in 0..rpw {
        let n = b.let_(&format!("n{r}"), first.clone() + u(r));
        let n_ok = b.let_(&format!("n_ok{r}"), n.clone().lt(n_out.clone()));
        let safe = select(n_ok.clone(), n.clone(), u(0));
        let wbase = b.let_(&format!("wbase{r}"), safe.clone() * row_words.clone());
        let sbase = fp8.as_ref().map(|f| scale_row_base(&mut b, f, &safe));
        ns.push(n);
        n_oks.push(n_ok);
        rows.push((wbase, sbase));
    }
    let acc: Vec<Vec<Expr>> = (0..rpw)
        .map(|r| {
            (0..tb)
                .map(|t| b.var(&format!("acc{r}_{t}"), f(0.0)))
                .collect()
        })
        .collect();

    let k0 = b.let_("k0", workgroup_id(2) * k_split.clone());
    let k1 = b.let_("k1", (k0.clone() + k_split.clone()).min(k_in.clone()));
    b.comment("walk K in chunks: stage x[t0 .. t0 + TB, chunk] in workgroup memory, then each lane takes every 32nd word of its weight row");
    b.for_("kc", k0, k1.clone(), u(chunk), |b, kc| {
        b.barrier();
        for t in 0..tb {
            let tt = t0.clone() + u(t);
            b.for_threads("i", u(chunk), |b, i_| {
                let k = b.let_("k", kc.clone() + i_.clone());
                let ok = tt.clone().lt(tokens.clone()).and(k.clone().lt(k1.clone()));
                let dst = u(t * chunk) + i_;
                b.if_else(
                    ok,
                    |b| {
                        let v = load_f32(&x, cfg.x, xv.at(tt.clone(), k.clone()));
                        b.shared_store(&xs, dst.clone(), v)
                    },
                    |b| b.shared_store(&xs, dst.clone(), f(0.0)),
                );
            });
        }
        b.barrier();
        b.if_(n_oks[0].clone(), |b| {
            chunk_dot(
                b,
                cfg.w,
                &w,
                fp8.as_ref(),
                &rows,
                &kc,
                &row_words,
                &xs,
                chunk,
                &lane,
                &acc,
            );
        });
    });

    b.comment("reduce the 32 lane partials of each (row, token) through workgroup memory, one of the warp's rows at a time");
    let tt = b.let_("tt", t0.clone() + lane.clone());
    for (r, (n, n_ok)) in ns.iter().zip(&n_oks).enumerate() {
        b.barrier();
        for (t, a) in acc[r].iter().enumerate() {
            b.shared_store(
                &xs,
                (rsub.clone() * u(LANES) + lane.clone()) * u(tb) + u(t as u32),
                a.clone(),
            );
        }
        b.barrier();
        b.if_(
            lane.clone()
                .lt(u(tb))
                .and(n_ok.clone())
                .and(tt.clone().lt(tokens.clone())),
            |b| {
                let sum = b.var("sum", f(0.0));
                b.for_("l", u(0), u(LANES), u(1), |b, l| {
                    let v = xs.at((rsub.clone() * u(LANES) + l) * u(tb) + lane.clone());
                    b.set(&sum, sum.clone() + v);
                });
                if cfg.split {
                    let pi =
                        (workgroup_id(2) * tokens.clone() + tt.clone()) * n_out.clone() + n.clone();
                    b.store(&y, pi, sum.clone());
                } else {
                    let yi = b.let_("yi", yv.at(tt.clone(), n.clone()));
                    let out = if cfg.accumulate {
                        y.at(yi.clone()) + sum.clone()
                    } else {
                        sum.clone()
                    };
                    b.store(&y, yi, out);
                }
            },
        );
    }
    // ptxas otherwise trades registers for occupancy and spills on some targets; these
    // kernels are bandwidth-bound with enough workgroups in flight either way.
    let mut k = b.finish()?;
    k.min_workgroups = 1;
    Ok(k)
}

/// Adds up split-K partials: `y[t, n] (+)= Σ_z partials[z, t, n]`.
pub fn split_reduce_kernel(accumulate: &bool) -> Result<Kernel> {
    let mut b = KernelBuilder::new(
        format!(
            "linear_split_reduce{}",
            if *accumulate { "_acc" } else { "" }
        ),
        THREADS,
    );
    b.doc(format!(
        "Split-K reduction: y[t, n] {}= sum_z partials[z, t, n], in split order.",
        if *accumulate { "+" } else { "" }
    ));
    b.doc("Grid: x = min(ceil(tokens * n_out / 256), 65535), grid-stride.".to_string());
    let tokens = b.param("tokens", Ty::U32, "T");
    let n_out = b.param("n_out", Ty::U32, "N");
    let splits = b.param("splits", Ty::U32, "partial sums per output");
    let yv = ViewArgs::declare(&mut b, "y", "y [T, N]");
    let partials = b.buffer("partials", Elem::F32, Access::Read, "[splits, T, N] f32");
    let y = b.buffer("y", Elem::F32, Access::ReadWrite, "[T, N] f32 (view)");
    let total = b.let_("total", tokens.clone() * n_out.clone());
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(THREADS) + local_id(),
        total.clone(),
        stride,
        |b, e| {
            let sum = b.var("sum", f(0.0));
            b.for_("z", u(0), splits.clone(), u(1), |b, z| {
                b.set(
                    &sum,
                    sum.clone() + partials.at(z * total.clone() + e.clone()),
                );
            });
            let yi = b.let_("yi", yv.at(e.clone() / n_out.clone(), e % n_out.clone()));
            let out = if *accumulate {
                y.at(yi.clone()) + sum.clone()
            } else {
                sum.clone()
            };
            b.store(&y, yi, out);
        },
    );
    b.finish()
}

/// How a grouped linear picks the weight rows of output row `r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupSelect {
    /// Head `r % heads`.
    Heads,
    /// Expert `ids[r]` (an i32 buffer); ids outside `[0, groups)` contribute nothing.
    Experts,
}

/// Compile-time knobs of the grouped linear kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupedConfig {
    pub w: WeightType,
    pub x: DType,
    pub select: GroupSelect,
    /// Sum the rows of a token with their routing weights (experts' down projection).
    pub combine: bool,
    pub accumulate: bool,
    /// Elements of K staged per barrier (0: 2048).
    pub chunk: u32,
}

impl GroupedConfig {
    pub fn name(&self) -> String {
        format!(
            "grouped_linear_x{}_w{}_{}{}{}{}",
            self.x.name(),
            self.w.name(),
            match self.select {
                GroupSelect::Heads => "heads",
                GroupSelect::Experts => "experts",
            },
            if self.combine { "_combine" } else { "" },
            if self.accumulate { "_acc" } else { "" },
            if self.chunk == 0 || self.chunk == STAGE {
                String::new()
            } else {
                format!("_c{}", self.chunk)
            }
        )
    }
}

/// The grouped linear kernel.
pub fn grouped_kernel(cfg: &GroupedConfig) -> Result<Kernel> {
    let mut b = KernelBuilder::new(cfg.name(), THREADS);
    b.doc(format!(
        "Grouped linear: z[r, n] = sum_k x[r / x_div, k] * W[g(r) * n_out + n, k], g(r) = {}; x {}, W {}, f32 accumulation.",
        match cfg.select {
            GroupSelect::Heads => "r % heads",
            GroupSelect::Experts => "ids[r] (ids outside [0, groups) contribute nothing)",
        },
        cfg.x.name(),
        cfg.w.name()
    ));
    if cfg.combine {
        b.doc(format!(
            "Combine: y[t, n] {}= sum_(j < per_token) route_w[t * per_token + j] * z[t * per_token + j, n].",
            if cfg.accumulate { "+" } else { "" }
        ));
        b.doc(format!(
            "Grid: x = ceil(n_out / {ROWS_PER_WG}), y = rows / per_token."
        ));
    } else {
        b.doc(format!(
            "y[r, n] {}= z[r, n]. Grid: x = ceil(n_out / {ROWS_PER_WG}), y = rows.",
            if cfg.accumulate { "+" } else { "" }
        ));
    }
    let rows = b.param("rows", Ty::U32, "R, output rows before combining");
    let n_out = b.param("n_out", Ty::U32, "N, weight rows per group = columns of y");
    let k_in = b.param("k_in", Ty::U32, "K, weight columns = columns of x");
    let x_div = b.param("x_div", Ty::U32, "output rows per row of x");
    let groups = b.param("groups", Ty::U32, "weight groups (heads or experts)");
    let per_token = b.param(
        "per_token",
        Ty::U32,
        "rows summed into one output row (1 without combine)",
    );
    let xv = ViewArgs::declare(&mut b, "x", "x [R / x_div, K]");
    let yv = ViewArgs::declare(&mut b, "y", "y");
    let x = b.buffer(
        "x",
        cfg.x.elem(),
        Access::Read,
        &format!("[R / x_div, K] {} activations", cfg.x.name()),
    );
    let (w, fp8) = declare_weight(&mut b, cfg.w);
    let ids = (cfg.select == GroupSelect::Experts)
        .then(|| b.buffer("ids", Elem::I32, Access::Read, "[R] i32 expert of each row"));
    let route_w = cfg.combine.then(|| {
        b.buffer(
            "route_w",
            Elem::F32,
            Access::Read,
            "[R] f32 routing weight of each row",
        )
    });
    let y = b.buffer("y", Elem::F32, Access::ReadWrite, "f32 outputs");
    let chunk = if cfg.chunk == 0 { STAGE } else { cfg.chunk };
    let xs = b.shared("xs", Ty::F32, chunk);

    let lane = b.let_("lane", local_id() % u(LANES));
    let rsub = b.let_("rsub", local_id() / u(LANES));
    let n = b.let_("n", workgroup_id(0) * u(ROWS_PER_WG) + rsub.clone());
    let out_row = b.let_("out_row", workgroup_id(1));
    let n_ok = b.let_("n_ok", n.clone().lt(n_out.clone()));
    let pw = cfg.w.per_word();
    let row_words = b.let_("row_words", k_in.clone() / u(pw));
    let acc = b.var("acc", f(0.0));

    b.for_("j", u(0), per_token.clone(), u(1), |b, j| {
        let r = b.let_("r", out_row.clone() * per_token.clone() + j);
        let (g, valid) = match &ids {
            None => (r.clone() % groups.clone(), Expr::Bool(true)),
            Some(ids) => {
                let id = b.let_("id", ids.at(r.clone()));
                let valid = b.let_(
                    "valid",
                    id.clone()
                        .ge(i(0))
                        .and(id.clone().as_u32().lt(groups.clone())),
                );
                (select(valid.clone(), id.as_u32(), u(0)), valid)
            }
        };
        let g = b.let_("g", g);
        let xrow = b.let_("xrow", r.clone() / x_div.clone());
        let wrow = b.let_(
            "wrow",
            g * n_out.clone() + select(n_ok.clone(), n.clone(), u(0)),
        );
        let wbase = b.let_("wbase", wrow.clone() * row_words.clone());
        let sbase = fp8.as_ref().map(|fa| scale_row_base(b, fa, &wrow));
        let part = b.var("part", f(0.0));
        b.for_("kc", u(0), k_in.clone(), u(chunk), |b, kc| {
            b.barrier();
            b.for_threads("i", u(chunk), |b, i_| {
                let k = b.let_("k", kc.clone() + i_.clone());
                b.if_else(
                    k.clone().lt(k_in.clone()),
                    |b| {
                        let v = load_f32(&x, cfg.x, xv.at(xrow.clone(), k.clone()));
                        b.shared_store(&xs, i_.clone(), v)
                    },
                    |b| b.shared_store(&xs, i_.clone(), f(0.0)),
                );
            });
            b.barrier();
            b.if_(n_ok.clone().and(valid.clone()), |b| {
                chunk_dot(
                    b,
                    cfg.w,
                    &w,
                    fp8.as_ref(),
                    &[(wbase.clone(), sbase.clone())],
                    &kc,
                    &row_words,
                    &xs,
                    chunk,
                    &lane,
                    &[vec![part.clone()]],
                );
            });
        });
        let weight = match &route_w {
            Some(rw) => select(valid.clone(), rw.at(r.clone()), f(0.0)),
            None => f(1.0),
        };
        b.set(&acc, acc.clone() + weight * part.clone());
    });

    b.comment("reduce the 32 lane partials of each row through workgroup memory");
    b.barrier();
    b.shared_store(&xs, local_id(), acc.clone());
    b.barrier();
    b.if_(lane.clone().eq_(u(0)).and(n_ok.clone()), |b| {
        let sum = b.var("sum", f(0.0));
        b.for_("l", u(0), u(LANES), u(1), |b, l| {
            b.set(&sum, sum.clone() + xs.at(rsub.clone() * u(LANES) + l));
        });
        let yi = b.let_("yi", yv.at(out_row.clone(), n.clone()));
        let out = if cfg.accumulate {
            y.at(yi.clone()) + sum.clone()
        } else {
            sum.clone()
        };
        b.store(&y, yi, out);
    });
    let _ = rows;
    // ptxas otherwise trades registers for occupancy and spills on some targets; these
    // kernels are bandwidth-bound with enough workgroups in flight either way.
    let mut k = b.finish()?;
    k.min_workgroups = 1;
    Ok(k)
}

fn fp8_params(l: &WeightLayout) -> Vec<(String, ParamValue)> {
    match l.wtype {
        WeightType::Fp8 { block } => {
            let (sr, sc) = l.scale_grid();
            vec![
                ("group_rows".into(), ParamValue::U32(l.group_rows)),
                ("scale_group_rows".into(), ParamValue::U32(sr)),
                ("scale_cols".into(), ParamValue::U32(sc)),
                ("block_rows".into(), ParamValue::U32(block[0])),
                ("block_cols".into(), ParamValue::U32(block[1])),
                (
                    "inv_block_cols".into(),
                    ParamValue::F32(1.0 / block[1] as f32),
                ),
            ]
        }
        _ => Vec::new(),
    }
}

fn weight_bindings(l: &WeightLayout) -> Vec<Binding> {
    let mut v = vec![Binding::read(
        "w",
        l.bytes(),
        format!("[{}, {}] {} weights", l.rows, l.cols, l.wtype.name()),
    )];
    if l.scale_bytes() > 0 {
        v.push(Binding::read(
            "w_scale",
            l.scale_bytes(),
            "f32 FP8 block scales",
        ));
    }
    v
}

fn host_weight<'a>(bufs: &'a HostBuffers<'_>, l: &WeightLayout) -> Result<HostWeight<'a>> {
    let w = HostWeight {
        layout: *l,
        values: bufs.get("w")?,
        scales: if l.scale_bytes() > 0 {
            Some(bufs.get("w_scale")?)
        } else {
            None
        },
    };
    w.check("w")?;
    Ok(w)
}

/// A dense linear: `y [T, N] (+)= x [T, K] · W [N, K]ᵀ`. Buffers: `x`, `w`, `w_scale` (FP8),
/// `y`, and with `splits > 1` `partials` (`[splits, T, N]` f32 scratch).
#[derive(Clone, Copy, Debug)]
pub struct LinearOp {
    pub x: View,
    pub x_dtype: DType,
    pub w: WeightLayout,
    pub y: View,
    pub accumulate: bool,
    /// Split K over this many workgroup layers (1: none). [`LinearOp::splits_for`] picks it.
    pub splits: u32,
}

impl LinearOp {
    fn validate(&self) -> Result<()> {
        self.x.validate("x")?;
        self.y.validate("y")?;
        self.w.validate("w")?;
        if self.x.cols != self.w.cols {
            return Err(Error::arg(
                "x",
                format!("{} columns (the weight's in-features)", self.w.cols),
                self.x.cols,
            ));
        }
        if self.y.cols != self.w.rows || self.y.rows != self.x.rows {
            return Err(Error::arg(
                "y",
                format!("[{}, {}]", self.x.rows, self.w.rows),
                format!("[{}, {}]", self.y.rows, self.y.cols),
            ));
        }
        Ok(())
    }

    fn config(&self) -> LinearConfig {
        LinearConfig {
            w: match self.w.wtype {
                WeightType::Fp8 { .. } => WeightType::Fp8 { block: [0, 0] },
                other => other,
            },
            x: self.x_dtype,
            tokens_per_wg: self.tokens_per_wg(),
            accumulate: self.accumulate,
            chunk: chunk_for_k(self.tokens_per_wg(), self.w.cols),
            split: self.splits > 1,
            rows_per_warp: rows_per_warp(self.tokens_per_wg()),
        }
    }

    fn tokens_per_wg(&self) -> u32 {
        tokens_per_wg(self.x.rows)
    }

    /// How many splits of K fill `workgroups` workgroups (the device's parallelism) for this
    /// shape: 1 when the outputs alone fill it, at most 16, at least one chunk per split.
    pub fn splits_for(x_rows: u32, w: &WeightLayout, workgroups: u32) -> u32 {
        if baseline() {
            return 1;
        }
        let tb = tokens_per_wg(x_rows);
        let wgs = w.rows.div_ceil(ROWS_PER_WG * rows_per_warp(tb)) * x_rows.div_ceil(tb);
        if wgs >= workgroups {
            return 1;
        }
        let chunks = w.cols.div_ceil(chunk_for_k(tb, w.cols));
        workgroups.div_ceil(wgs.max(1)).min(16).min(chunks).max(1)
    }

    /// K columns per split (whole chunks).
    fn k_split(&self) -> u32 {
        let chunk = chunk_for_k(self.tokens_per_wg(), self.w.cols);
        let chunks = self.w.cols.div_ceil(chunk);
        chunks.div_ceil(self.splits.max(1)) * chunk
    }
}

impl Op for LinearOp {
    fn name(&self) -> String {
        format!(
            "linear [{}, {}] x [{}, {}] {}",
            self.x.rows,
            self.x.cols,
            self.w.rows,
            self.w.cols,
            self.w.wtype.name()
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let mut v = vec![Binding::read(
            "x",
            self.x.min_bytes(self.x_dtype),
            format!(
                "x [{}, {}] {}",
                self.x.rows,
                self.x.cols,
                self.x_dtype.name()
            ),
        )];
        v.extend(weight_bindings(&self.w));
        if self.splits > 1 {
            v.push(Binding::write(
                "partials",
                self.splits as u64 * self.x.rows as u64 * self.w.rows as u64 * 4,
                format!(
                    "[{}, {}, {}] f32 split-K partials",
                    self.splits, self.x.rows, self.w.rows
                ),
            ));
        }
        v.push(Binding::write(
            "y",
            self.y.min_bytes(DType::F32),
            format!("y [{}, {}] f32", self.y.rows, self.y.cols),
        ));
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        if self.splits == 0 || self.splits > 65535 {
            return Err(Error::arg("splits", "1 to 65535", self.splits));
        }
        static K: KernelCache<LinearConfig> = KernelCache::new();
        let cfg = self.config();
        let k = lowered(&K, cfg, linear_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.x.rows)),
            ("n_out".into(), ParamValue::U32(self.w.rows)),
            ("k_in".into(), ParamValue::U32(self.w.cols)),
            (
                "k_split".into(),
                ParamValue::U32(if cfg.split {
                    self.k_split()
                } else {
                    self.w.cols
                }),
            ),
        ];
        p.extend(self.x.params("x"));
        p.extend(self.y.params("y"));
        p.extend(fp8_params(&self.w));
        let params = pack(&k, &p)?;
        let splits = if cfg.split {
            self.w.cols.div_ceil(self.k_split())
        } else {
            1
        };
        let grid = [
            self.w.rows.div_ceil(ROWS_PER_WG * cfg.rows_per_warp),
            self.x.rows.div_ceil(cfg.tokens_per_wg),
            splits,
        ];
        let mut v = vec![Launch {
            kernel: k,
            grid,
            params,
        }];
        if cfg.split {
            v.push(
                SplitReduceOp {
                    tokens: self.x.rows,
                    n_out: self.w.rows,
                    splits,
                    y: self.y,
                    accumulate: self.accumulate,
                }
                .launch()?,
            );
        }
        Ok(v)
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let x = read_view(bufs.get("x")?, self.x_dtype, &self.x, "x")?;
        let mut y = linear(&x, self.x.rows as usize, &host_weight(bufs, &self.w)?);
        let out = bufs.get_mut("y")?;
        if self.accumulate {
            let old = read_view(out, DType::F32, &self.y, "y")?;
            y.iter_mut().zip(&old).for_each(|(a, b)| *a += b);
        }
        write_view(out, DType::F32, &self.y, &y, "y")
    }
}

/// A grouped linear (see the module doc). Buffers: `x`, `w`, `w_scale` (FP8), `ids`
/// (experts: `[rows]` i32), `route_w` (combine: `[rows]` f32), `y`.
#[derive(Clone, Copy, Debug)]
pub struct GroupedLinearOp {
    pub x: View,
    pub x_dtype: DType,
    /// Output rows per row of x.
    pub x_div: u32,
    pub w: WeightLayout,
    /// Weight rows per group, the width of the output.
    pub n_out: u32,
    pub select: GroupSelect,
    /// Heads (for [`GroupSelect::Heads`]) or experts.
    pub groups: u32,
    /// Output rows before combining.
    pub rows: u32,
    /// `Some(k)`: sum every `k` rows with their routing weights.
    pub combine: Option<u32>,
    pub y: View,
    pub accumulate: bool,
}

impl GroupedLinearOp {
    fn validate(&self) -> Result<()> {
        self.x.validate("x")?;
        self.y.validate("y")?;
        self.w.validate("w")?;
        if self.x_div == 0 || self.groups == 0 || self.n_out == 0 || self.rows == 0 {
            return Err(Error::arg(
                "grouped linear",
                "x_div, groups, n_out and rows of at least 1",
                format!(
                    "{} / {} / {} / {}",
                    self.x_div, self.groups, self.n_out, self.rows
                ),
            ));
        }
        if self.x.cols != self.w.cols {
            return Err(Error::arg(
                "x",
                format!("{} columns (the weight's in-features)", self.w.cols),
                self.x.cols,
            ));
        }
        if self.x.rows != self.rows.div_ceil(self.x_div) {
            return Err(Error::arg(
                "x",
                format!("{} rows (rows / x_div)", self.rows.div_ceil(self.x_div)),
                self.x.rows,
            ));
        }
        if self.w.rows as u64 != self.groups as u64 * self.n_out as u64 {
            return Err(Error::arg(
                "w",
                format!("{} x {} rows", self.groups, self.n_out),
                self.w.rows,
            ));
        }
        let k = self.combine.unwrap_or(1);
        if k == 0 || self.rows % k != 0 {
            return Err(Error::arg(
                "combine",
                format!("a divisor of rows = {}", self.rows),
                k,
            ));
        }
        if self.combine.is_some() && self.select != GroupSelect::Experts {
            return Err(Error::arg("combine", "only with expert selection", "heads"));
        }
        if self.y.rows != self.rows / k || self.y.cols != self.n_out {
            return Err(Error::arg(
                "y",
                format!("[{}, {}]", self.rows / k, self.n_out),
                format!("[{}, {}]", self.y.rows, self.y.cols),
            ));
        }
        if self.y.rows > 65535 {
            return Err(Error::arg(
                "y",
                "at most 65535 rows per call (one workgroup row each)",
                self.y.rows,
            ));
        }
        Ok(())
    }

    fn config(&self) -> GroupedConfig {
        GroupedConfig {
            w: match self.w.wtype {
                WeightType::Fp8 { .. } => WeightType::Fp8 { block: [0, 0] },
                other => other,
            },
            x: self.x_dtype,
            select: self.select,
            combine: self.combine.is_some(),
            accumulate: self.accumulate,
            // one token's chunk (the whole stage, named 0), short K and the v1 baseline included
            chunk: match chunk_for_k(1, self.w.cols) {
                STAGE => 0,
                c => c,
            },
        }
    }
}

impl Op for GroupedLinearOp {
    fn name(&self) -> String {
        format!(
            "grouped linear {} rows x [{} x {}, {}] {}",
            self.rows,
            self.groups,
            self.n_out,
            self.w.cols,
            self.w.wtype.name()
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let mut v = vec![Binding::read(
            "x",
            self.x.min_bytes(self.x_dtype),
            format!(
                "x [{}, {}] {}",
                self.x.rows,
                self.x.cols,
                self.x_dtype.name()
            ),
        )];
        v.extend(weight_bindings(&self.w));
        if self.select == GroupSelect::Experts {
            v.push(Binding::read(
                "ids",
                self.rows as u64 * 4,
                format!("[{}] i32 expert ids", self.rows),
            ));
        }
        if self.combine.is_some() {
            v.push(Binding::read(
                "route_w",
                self.rows as u64 * 4,
                format!("[{}] f32 routing weights", self.rows),
            ));
        }
        v.push(Binding::write(
            "y",
            self.y.min_bytes(DType::F32),
            format!("y [{}, {}] f32", self.y.rows, self.y.cols),
        ));
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<GroupedConfig> = KernelCache::new();
        let k = lowered(&K, self.config(), grouped_kernel)?;
        let per_token = self.combine.unwrap_or(1);
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.rows)),
            ("n_out".into(), ParamValue::U32(self.n_out)),
            ("k_in".into(), ParamValue::U32(self.w.cols)),
            ("x_div".into(), ParamValue::U32(self.x_div)),
            ("groups".into(), ParamValue::U32(self.groups)),
            ("per_token".into(), ParamValue::U32(per_token)),
        ];
        p.extend(self.x.params("x"));
        p.extend(self.y.params("y"));
        p.extend(fp8_params(&self.w));
        let params = pack(&k, &p)?;
        let grid = [self.n_out.div_ceil(ROWS_PER_WG), self.rows / per_token, 1];
        Ok(vec![Launch {
            kernel: k,
            grid,
            params,
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let x = read_view(bufs.get("x")?, self.x_dtype, &self.x, "x")?;
        let ids = match self.select {
            GroupSelect::Experts => i32s(bufs.get("ids")?),
            GroupSelect::Heads => Vec::new(),
        };
        let route_w = match self.combine {
            Some(_) => f32s(bufs.get("route_w")?),
            None => Vec::new(),
        };
        let select = match self.select {
            GroupSelect::Heads => RowSelect::Heads(self.groups),
            GroupSelect::Experts => RowSelect::Experts {
                ids: &ids,
                groups: self.groups,
            },
        };
        let mut y = grouped_linear(
            &x,
            self.x_div as usize,
            &host_weight(bufs, &self.w)?,
            self.n_out as usize,
            self.rows as usize,
            select,
            self.combine.map(|k| (k as usize, route_w.as_slice())),
        );
        let out = bufs.get_mut("y")?;
        if self.accumulate {
            let old = read_view(out, DType::F32, &self.y, "y")?;
            y.iter_mut().zip(&old).for_each(|(a, b)| *a += b);
        }
        write_view(out, DType::F32, &self.y, &y, "y")
    }
}

/// Every variant of the kernels, lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    let ws = [
        WeightType::F32,
        WeightType::Bf16,
        WeightType::Fp8 { block: [0, 0] },
    ];
    let lower = |k: Kernel| crate::kir::lower(&k, crate::kir::Lowering::Scalar);
    let mut v = Vec::new();
    for w in ws {
        for x in [DType::F32, DType::Bf16] {
            for tokens_per_wg in [1, 4, 8] {
                let chunk = (STAGE / tokens_per_wg).max(THREADS) / THREADS * THREADS;
                for accumulate in [false, true] {
                    // v1's 256-element chunk, this version's, and its split-K form (which writes
                    // partials: the reduction does the adding).
                    for (chunk, split) in [(THREADS, false), (chunk, false), (chunk, true)] {
                        if split && accumulate {
                            continue;
                        }
                        for rows_per_warp in [1, 4] {
                            let cfg = LinearConfig {
                                w,
                                x,
                                tokens_per_wg,
                                accumulate,
                                chunk,
                                split,
                                rows_per_warp,
                            };
                            if !v.iter().any(|k: &Kernel| k.name == cfg.name()) {
                                v.push(lower(linear_kernel(&cfg)?)?);
                            }
                        }
                    }
                }
            }
            for (select, combine) in [
                (GroupSelect::Heads, false),
                (GroupSelect::Experts, false),
                (GroupSelect::Experts, true),
            ] {
                for accumulate in [false, true] {
                    for chunk in [0, THREADS] {
                        let cfg = GroupedConfig {
                            w,
                            x,
                            select,
                            combine,
                            accumulate,
                            chunk,
                        };
                        v.push(lower(grouped_kernel(&cfg)?)?);
                    }
                }
            }
        }
    }
    for accumulate in [false, true] {
        v.push(lower(split_reduce_kernel(&accumulate)?)?);
    }
    v.push(lower(dequant_kernel(&())?)?);
    Ok(v)
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    /// Every chunk a dense or grouped linear picks for its K — the short-K chunk included —
    /// is one of [`all_variants`], so the NVRTC compile check covers the kernels that run.
    #[test]
    fn every_picked_chunk_is_a_checked_variant() {
        let names: Vec<String> = all_variants()
            .unwrap()
            .into_iter()
            .map(|k| k.name)
            .collect();
        for wtype in [
            WeightType::F32,
            WeightType::Bf16,
            WeightType::Fp8 { block: [128, 128] },
        ] {
            for k in [16, 48, 128, 192, 256, 260, 512, 2048, 5000, 7168] {
                for rows in [1, 3, 8, 32] {
                    for accumulate in [false, true] {
                        let w = WeightLayout::new(wtype, 64, k);
                        let splits = LinearOp::splits_for(rows, &w, 1024);
                        let op = LinearOp {
                            x: View::packed(rows, k),
                            x_dtype: DType::F32,
                            w,
                            y: View::packed(rows, 64),
                            accumulate: accumulate && splits == 1,
                            splits,
                        };
                        let cfg = op.config();
                        let name = cfg.name();
                        assert!(
                            names.contains(&name),
                            "{name} (K {k}, {rows} rows) unchecked"
                        );
                        let chunk = cfg.chunk;
                        assert!(
                            chunk == chunk_for(op.tokens_per_wg()) || k <= chunk,
                            "{name}"
                        );
                    }
                }
                let g = GroupedLinearOp {
                    x: View::packed(4, k),
                    x_dtype: DType::F32,
                    x_div: 1,
                    w: WeightLayout::new(wtype, 4 * 64, k),
                    n_out: 64,
                    select: GroupSelect::Heads,
                    groups: 4,
                    rows: 4,
                    combine: None,
                    y: View::packed(4, 64),
                    accumulate: false,
                };
                let name = g.config().name();
                assert!(names.contains(&name), "{name} (K {k}) unchecked");
                assert_eq!(g.config().chunk == THREADS, k <= THREADS, "{name}");
            }
        }
    }
}

#[cfg(test)]
mod scale_column_tests {
    /// The FP8 kernels' `floor((col + 0.5) · fl(1 / bc))` in f32 equals `col / bc` for every
    /// column below 2^22 and every block width the checkpoints use (and many they do not).
    #[test]
    fn scale_column_by_reciprocal_is_exact() {
        let mut widths: Vec<u32> = (4..=1024).step_by(4).collect();
        widths.extend([1536, 2048, 4096, 12 * 1024, 65532, 1 << 18, (1 << 22) - 4]);
        for bc in widths {
            let inv = 1.0f32 / bc as f32;
            let step = if bc <= 256 { 1 } else { 7 };
            let mut col = 0u32;
            while col < 1 << 22 {
                let got = ((col as f32 + 0.5) * inv) as u32;
                assert_eq!(got, col / bc, "col {col}, block_cols {bc}");
                col += step;
            }
            // the columns next to every block edge, exhaustively
            let mut edge = bc;
            while edge < 1 << 22 {
                for c in [edge - 1, edge] {
                    assert_eq!(((c as f32 + 0.5) * inv) as u32, c / bc, "col {c}, bc {bc}");
                }
                edge += bc;
            }
        }
    }
}

// ------------------------------------------------------------------ FP8 → bf16 dequant

fn dequant_kernel(_: &()) -> Result<Kernel> {
    let wt = WeightType::Fp8 { block: [1, 4] };
    let mut b = KernelBuilder::new("dequant_fp8_to_bf16", ELEMENTWISE_THREADS);
    b.doc("Block-scaled e4m3 weights to a two-term bf16 split: v = e4m3(w[n, k]) * w_scale[(n / group_rows) * scale_group_rows + (n % group_rows) / block_rows, k / block_cols] (f32), y[n, k] = bf16(v) (hi) and y[rows + n, k] = bf16(v - hi) (lo), round to nearest even: hi + lo carries v to 2^-16 relative.".to_string());
    b.doc("For the vendor GEMM at decode batches where a tensor-core GEMM on bf16 beats the GEMV on FP8 (DenseGemm::Auto).".to_string());
    b.doc("Grid: x = min(ceil(rows * k_in / 4 / 256), 65535), grid-stride; one weight word (4 values) per item.".to_string());
    let words = b.param(
        "words",
        Ty::U32,
        "rows * k_in / 4 (the lo half starts 2 * words words into y)",
    );
    let row_words = b.param("row_words", Ty::U32, "k_in / 4");
    let (w, fp8) = declare_weight(&mut b, wt);
    let fa = fp8.expect("an FP8 weight declares its scales");
    let y = b.buffer(
        "y",
        Elem::Bf16,
        Access::ReadWrite,
        "[2 * rows, k_in] bf16 out: hi rows, then lo rows",
    );
    let stride = b.let_("stride", num_workgroups(0) * u(ELEMENTWISE_THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(ELEMENTWISE_THREADS) + local_id(),
        words.clone(),
        stride,
        |b, e| {
            let row = b.let_("row", e.clone() / row_words.clone());
            let col = b.let_("col", (e.clone() % row_words.clone()) * u(4));
            let base = scale_row_base(b, &fa, &row);
            let sc = b.let_(
                "sc",
                ((col.as_f32() + f(0.5)) * fa.inv_block_cols.clone()).as_u32(),
            );
            let s = b.let_("s", fa.scale.at(base + sc));
            let word = b.let_("word", w.word(e.clone()));
            let v = word_values(b, wt, &word, "");
            let vals: Vec<Expr> = (0..4)
                .map(|j| b.let_(&format!("v{j}"), v[j].clone() * s.clone()))
                .collect();
            for half in 0..2u32 {
                let (a, c) = (&vals[2 * half as usize], &vals[2 * half as usize + 1]);
                let hi = b.let_(&format!("hi{half}"), pack_bf16x2(a.clone(), c.clone()));
                let lo = pack_bf16x2(
                    a.clone() - f32_from_bits(hi.clone() << u(16)),
                    c.clone() - f32_from_bits(hi.clone() & u(0xffff_0000)),
                );
                let at = e.clone() * u(2) + u(half);
                b.store_word(&y, at.clone(), hi);
                b.store_word(&y, at + words.clone() * u(2), lo);
            }
        },
    );
    b.finish()
}

const ELEMENTWISE_THREADS: u32 = 256;

/// A block-scaled FP8 weight dequantised to a two-term bf16 split: `y` is `[2 * rows, cols]`
/// packed bf16, the rounded values (hi) then what rounding left (lo), so that the vendor's
/// bf16 GEMM over both sees the f32 dequantised weight to 2^-16. Buffers: `w`, `w_scale`, `y`.
#[derive(Clone, Copy, Debug)]
pub struct DequantOp {
    pub w: WeightLayout,
}

impl Op for DequantOp {
    fn name(&self) -> String {
        format!("dequant fp8 [{}, {}] to bf16", self.w.rows, self.w.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        let mut v = weight_bindings(&self.w);
        v.push(Binding::write(
            "y",
            self.w.rows as u64 * self.w.cols as u64 * 4,
            "bf16 hi and lo copies of the weights",
        ));
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.w.validate("w")?;
        if !matches!(self.w.wtype, WeightType::Fp8 { .. }) {
            return Err(Error::arg("w", "FP8 weights", self.w.wtype.name()));
        }
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), dequant_kernel)?;
        let words = self.w.rows as u64 * (self.w.cols / 4) as u64;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("words".into(), ParamValue::U32(words as u32)),
            ("row_words".into(), ParamValue::U32(self.w.cols / 4)),
        ];
        p.extend(fp8_params(&self.w));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [
                words.div_ceil(ELEMENTWISE_THREADS as u64).clamp(1, 65535) as u32,
                1,
                1,
            ],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let l = self.w;
        let (vals, scales) = (bufs.get("w")?.to_vec(), bufs.get("w_scale")?.to_vec());
        let y = bufs.get_mut("y")?;
        let f32_at = |b: &[u8], i: usize| {
            f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
        };
        use crate::reference::numerics::{bf16_bits, e4m3_to_f32, round_bf16};
        let n = l.rows as usize * l.cols as usize;
        for r in 0..l.rows {
            for c in 0..l.cols {
                let i = r as usize * l.cols as usize + c as usize;
                let v = e4m3_to_f32(vals[i]) * f32_at(&scales, l.scale_index(r, c));
                let hi = bf16_bits(v);
                let lo = bf16_bits(v - round_bf16(v));
                y[2 * i..2 * i + 2].copy_from_slice(&hi.to_le_bytes());
                y[2 * (n + i)..2 * (n + i) + 2].copy_from_slice(&lo.to_le_bytes());
            }
        }
        Ok(())
    }
}

/// `y [T, N] (+)= Σ_z partials[z, T, N]` in split order (the split-K reduction of the linear,
/// and the sum of the vendor GEMM's bf16 hi / lo terms). Buffers: `partials`, `y`.
#[derive(Clone, Copy, Debug)]
pub struct SplitReduceOp {
    pub tokens: u32,
    pub n_out: u32,
    pub splits: u32,
    pub y: View,
    pub accumulate: bool,
}

impl SplitReduceOp {
    fn launch(&self) -> Result<Launch> {
        static R: KernelCache<bool> = KernelCache::new();
        let r = lowered(&R, self.accumulate, split_reduce_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.tokens)),
            ("n_out".into(), ParamValue::U32(self.n_out)),
            ("splits".into(), ParamValue::U32(self.splits)),
        ];
        p.extend(self.y.params("y"));
        let total = self.tokens as u64 * self.n_out as u64;
        Ok(Launch {
            params: pack(&r, &p)?,
            kernel: r,
            grid: [total.div_ceil(THREADS as u64).clamp(1, 65535) as u32, 1, 1],
        })
    }

    fn partial_words(&self) -> u64 {
        self.splits as u64 * self.tokens as u64 * self.n_out as u64
    }
}

impl Op for SplitReduceOp {
    fn name(&self) -> String {
        format!(
            "sum of {} partials [{}, {}]",
            self.splits, self.tokens, self.n_out
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("partials", self.partial_words() * 4, "[splits, T, N] f32"),
            Binding::write("y", self.y.min_bytes(DType::F32), "y [T, N] f32 (view)"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.y.validate("y")?;
        if self.y.rows != self.tokens || self.y.cols != self.n_out || self.splits == 0 {
            return Err(Error::arg(
                "y",
                format!(
                    "a [{}, {}] view and at least one partial",
                    self.tokens, self.n_out
                ),
                format!(
                    "[{}, {}], {} partials",
                    self.y.rows, self.y.cols, self.splits
                ),
            ));
        }
        Ok(vec![self.launch()?])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let p = f32s(bufs.get("partials")?);
        let total = (self.tokens * self.n_out) as usize;
        let mut sum = vec![0.0f64; total];
        for z in 0..self.splits as usize {
            for (e, s) in sum.iter_mut().enumerate() {
                *s += p[z * total + e] as f64;
            }
        }
        let out = bufs.get_mut("y")?;
        if self.accumulate {
            let old = read_view(out, DType::F32, &self.y, "y")?;
            sum.iter_mut().zip(&old).for_each(|(a, b)| *a += b);
        }
        write_view(out, DType::F32, &self.y, &sum, "y")
    }
}
