//! Register-resident A operands of split-K products ([`super::ksplit`]).
//!
//! **Resident A.** When the A operand of such products is a tile gathered once before the
//! pipeline and read by nothing else (q), each warp loads the A fragments of its own K slices
//! straight from global memory into registers: no shared memory for it and no `ldmatrix` of
//! it per step.
//!
//! An A view multiplied by an e4m3 B operand is held as e4m3 terms where the GPU has the
//! e4m3 product, else as f16 in the K order of the widened bytes ([`Cx::resident_gather`]).

use super::e4m3::{bf16_hi, bf16_lo, scale_pair};
use super::ksplit::{all_products, split_shape};
use super::{add, bin, intr, let_, lt, mul, u, var, Cx};
use crate::kir::ir::*;
use crate::Result;
use std::collections::HashSet;

/// The largest biased f32 exponent of σ, the per-warp power of two a resident q is scaled by
/// (σ ≤ 2^64). The bf16 views (q's rope) are scaled by σ too but are not in the max σ is
/// chosen from: with σ up to 2^126 a latent of zeros overflowed them to inf; with 2^64 they
/// stay finite for every |x| < 2^64. A latent whose largest |q| is below 2^-50 (the f16 form)
/// or 2^-57 (the e4m3 terms) keeps less precision, on scores that small.
const SIGMA_MAX_FIELD: u32 = 127 + 64;

/// The A fragments of one view of a resident tile, for this warp's slice.
#[derive(Clone, Debug)]
pub(super) struct ResidentView {
    pub col0: u32,
    pub cols: u32,
    /// For an e4m3 B operand: the view held as e4m3 `hi` (`regs`) and `lo` (`lo_regs`), in
    /// the m16n8k32 fragment layout, of the values times the row's power of two.
    pub permuted: bool,
    /// Private array `[fm, k steps of the slice, 4]` (k16 steps of bf16, k32 steps of e4m3).
    pub regs: String,
    /// The e4m3 view's `lo` terms, shaped like `regs` (empty for bf16).
    pub lo_regs: String,
    /// The e4m3 view's f16 form where the GPU has no e4m3 product ([`Func::E4m3MmaNative`]
    /// false): `[fm, k16 steps, 4]`, K order permuted to match the widened B bytes (empty for
    /// bf16 views).
    pub f16_regs: String,
    pub gk: u32,
}

#[derive(Clone, Debug, Default)]
pub(super) struct ResidentA {
    pub views: Vec<ResidentView>,
    /// With an e4m3 view: private `[1]` f32, the inverse of the power of two this warp
    /// scaled every view of the tile by.
    pub unscale: Option<String>,
}

/// Tiles that can live in registers: bf16, gathered whole outside any pipeline, and used
/// only as the A operand of split-K products.
pub(super) fn resident_candidates(cx: &Cx) -> HashSet<String> {
    let mut out = HashSet::new();
    if cx.ws.is_none() {
        return out;
    }
    let products = all_products(&cx.kernel.body);
    'tiles: for t in &cx.kernel.shared_tiles {
        if t.elem != TileElem::Bf16 {
            continue;
        }
        let uses: Vec<_> = products
            .iter()
            .filter(|p| p.1.tile == t.name || p.2.tile == t.name)
            .collect();
        if uses.is_empty() {
            continue;
        }
        let mut gk = None;
        for (acc, a, b, _) in &uses {
            if b.tile == t.name || a.tile != t.name {
                continue 'tiles;
            }
            let Some(decl) = cx.kernel.acc_tile(acc) else {
                continue 'tiles;
            };
            let Some((g, _)) = split_shape(cx, decl) else {
                continue 'tiles;
            };
            if *gk.get_or_insert(g) != g {
                continue 'tiles;
            }
        }
        // written only by whole-row gathers outside pipelines, read by nothing else
        let mut ok = true;
        let row_words = t.cols / 2;
        check_uses(&cx.kernel.body, &t.name, row_words, false, &mut ok);
        if ok {
            out.insert(t.name.clone());
        }
    }
    out
}

fn check_uses(stmts: &[Stmt], tile: &str, row_words: u32, in_pipeline: bool, ok: &mut bool) {
    let expr_uses = |e: &Expr| {
        let mut hit = false;
        e.visit(&mut |x| match x {
            Expr::TileLoad { tile: t, .. } | Expr::TileWord { tile: t, .. } => hit |= t == tile,
            _ => {}
        });
        hit
    };
    for s in stmts {
        match s {
            Stmt::If { cond, then, els } => {
                *ok &= !expr_uses(cond);
                check_uses(then, tile, row_words, in_pipeline, ok);
                check_uses(els, tile, row_words, in_pipeline, ok);
            }
            Stmt::For {
                start, end, body, ..
            } => {
                *ok &= !expr_uses(start) && !expr_uses(end);
                check_uses(body, tile, row_words, in_pipeline, ok);
            }
            Stmt::Let { value, .. } | Stmt::Var { value, .. } | Stmt::Assign { value, .. } => {
                *ok &= !expr_uses(value)
            }
            Stmt::Store { index, value, .. }
            | Stmt::StoreWord { index, value, .. }
            | Stmt::SharedStore { index, value, .. }
            | Stmt::PrivateStore { index, value, .. } => {
                *ok &= !expr_uses(index) && !expr_uses(value)
            }
            Stmt::Tile(op) => match op {
                TileOp::GatherRows(g) => {
                    *ok &= !expr_uses(&g.src_word);
                    if g.dst == tile {
                        *ok &= !in_pipeline
                            && g.dst_word0 == 0
                            && g.words == row_words
                            && g.flags.is_none();
                    }
                }
                TileOp::AccForEach { body, .. } => {
                    check_uses(body, tile, row_words, in_pipeline, ok)
                }
                TileOp::AccToShared { dst, .. } => *ok &= dst != tile,
                TileOp::SharedMap { dst, value, .. } => *ok &= dst != tile && !expr_uses(value),
                TileOp::DequantRows {
                    dst, src, scale, ..
                } => *ok &= dst != tile && src != tile && !expr_uses(scale),
                TileOp::OnlineSoftmax { p_tile, .. } => *ok &= p_tile != tile,
                TileOp::MmaScaled { scale, .. } => *ok &= !expr_uses(scale),
                TileOp::Pipeline {
                    count,
                    load,
                    compute,
                    ..
                } => {
                    *ok &= !expr_uses(count);
                    check_uses(load, tile, row_words, true, ok);
                    check_uses(compute, tile, row_words, true, ok);
                }
                TileOp::AccFill { .. } | TileOp::AccRowReduce { .. } | TileOp::Mma { .. } => {}
            },
            Stmt::Comment(_) | Stmt::Barrier | Stmt::Intrinsic(_) => {}
        }
    }
}

/// Registers of the resident tiles' A views (after [`super::ksplit::declare`]: the views
/// take each accumulator's split).
pub(super) fn declare(cx: &mut Cx) -> Result<()> {
    let products = all_products(&cx.kernel.body);
    let tiles: Vec<String> = cx
        .tiles
        .iter()
        .filter(|(n, t)| !t.ringed && is_resident_tile(cx, n))
        .map(|(n, _)| n.clone())
        .collect();
    for t in tiles {
        let mut r = ResidentA::default();
        for (acc, a, b, _) in products.iter().filter(|p| p.1.tile == t) {
            let permuted = cx.tile(&b.tile)?.decl.elem == TileElem::E4m3;
            if r.views
                .iter()
                .any(|v| v.col0 == a.col0 && v.cols == a.cols && v.permuted == permuted)
            {
                continue;
            }
            let info = cx.acc(acc)?.clone();
            let gk = info.ksplit.as_ref().map(|k| k.gk).unwrap_or(1);
            let fm = info.decl.rows / 16;
            // e4m3: k32 steps of four bytes a register, twice (hi, lo)
            let k = if permuted { 32 } else { 16 };
            let len = fm * (a.cols / k / gk) * 4;
            let regs = cx.private(&format!("{t}_a{}", r.views.len()), Ty::U32, len);
            let (lo_regs, f16_regs) = if permuted {
                (
                    cx.private(&format!("{t}_a{}_lo", r.views.len()), Ty::U32, len),
                    cx.private(
                        &format!("{t}_a{}_f16", r.views.len()),
                        Ty::U32,
                        fm * (a.cols / 16 / gk) * 4,
                    ),
                )
            } else {
                (String::new(), String::new())
            };
            if permuted && r.unscale.is_none() {
                r.unscale = Some(cx.private(&format!("{t}_unscale"), Ty::F32, 1));
            }
            r.views.push(ResidentView {
                col0: a.col0,
                cols: a.cols,
                permuted,
                regs,
                lo_regs,
                f16_regs,
                gk,
            });
        }
        cx.resident_a.insert(t, r);
    }
    Ok(())
}

fn is_resident_tile(cx: &Cx, name: &str) -> bool {
    // a tile of the description's own (not a window of another) registered without shared
    // memory, or with only its staging rows: a window of the ring (`layout`)
    cx.kernel
        .shared_tile(name)
        .is_some_and(|t| t.alias.is_none())
        && cx
            .new_shared
            .iter()
            .filter(|s| s.name == name)
            .all(|s| s.alias.is_some())
}

impl Cx<'_> {
    /// The resident registers of A view `a` (permuted or not), if the tile is resident.
    pub(super) fn resident_view(&self, a: &TileView, permuted: bool) -> Option<ResidentView> {
        self.resident_a.get(&a.tile).and_then(|r| {
            r.views
                .iter()
                .find(|v| v.col0 == a.col0 && v.cols == a.cols && v.permuted == permuted)
                .cloned()
        })
    }

    /// Load this warp's A fragments of every view of a resident tile from global memory:
    /// the tile's gather (`src_word(row)`, −1 for zeros) done straight into registers.
    ///
    /// A view multiplied by an e4m3 operand, where the GPU has the e4m3 product
    /// ([`Func::E4m3MmaNative`]), is held as two e4m3 terms, `hi = e4m3(x·σ)` and
    /// `lo = e4m3(x·σ − hi)` (about bf16's 8 significant bits together). σ is a power of two
    /// per warp, from the largest |x| of the warp's slice of those views: that one lands in
    /// [128, 256), well inside e4m3's ±448, and e4m3 keeps its relative precision for values
    /// within 2^10 of it. The tile's bf16 views are scaled by the same σ, exactly, so every
    /// product into the split-K partials is σ times the true one; [`Cx::materialize`]
    /// multiplies by `unscale = 1/σ`. Elsewhere the view is f16 times a power of two σ' (the
    /// largest |x| in [2^14, 2^15)), its K order permuted to match the e4m3 bytes widened to
    /// f16 (one `cvt` a pair, where bf16 took four instructions more), the bf16 views are
    /// scaled by σ' / unit (the widened bytes are the values over `unit`,
    /// [`Func::E4m3F16Unit`]), and `unscale = unit / σ'`.
    pub(super) fn resident_gather(&mut self, g: &RowGather) -> Result<Vec<Stmt>> {
        let (dst, src, row, src_word) =
            (g.dst.as_str(), g.src.as_str(), g.row.as_str(), &g.src_word);
        let r = self.resident_a.get(dst).cloned().unwrap_or_default();
        let info = self.tile(dst)?.clone();
        let fm = info.decl.rows / 16;
        let staged = self.is_staged(dst);
        let mut out = vec![Stmt::Comment(if staged {
            format!("{dst}: this warp's A fragments from its staging rows into registers")
        } else {
            format!("{dst}: this warp's A fragments straight from global memory into registers")
        })];
        // source words of the lane's rows (g and g + 8 of each m fragment), where they are
        // read from global memory
        let mut rows_sw: Vec<String> = Vec::new();
        if !staged {
            let src_word = self.expr(src_word)?;
            for i in 0..fm {
                for h in 0..2 {
                    let rv = add(u(16 * i + 8 * h), self.lane.group.clone());
                    let name = self.fresh(&format!("{dst}_row_src"));
                    let bound = src_word.clone().map(&mut |x| match x {
                        Expr::Var(ref n, Ty::U32) if n == row => rv.clone(),
                        other => other,
                    });
                    out.push(let_(&name, bound));
                    rows_sw.push(name);
                }
            }
        }
        // word `word` of the row of lane row `h` (0..2 fm), 0 for a missing row: from the
        // staging rows where the tile has them (`layout`), else from global memory
        let stride = info.stride;
        let lane_group = self.lane.group.clone();
        let load = |h: u32, word: Expr| {
            if staged {
                let r = add(u(16 * (h / 2) + 8 * (h % 2)), lane_group.clone());
                return Expr::SharedLoad {
                    arr: dst.to_string(),
                    ty: Ty::U32,
                    index: Box::new(add(mul(r, u(stride)), word)),
                };
            }
            let sw = var(&rows_sw[h as usize], Ty::I32);
            let load = Expr::LoadWord {
                buf: src.to_string(),
                index: Box::new(add(Expr::Cvt(Ty::U32, Box::new(sw.clone())), word)),
            };
            Expr::Select(
                Box::new(bin(BinOp::Ge, sw, Expr::I32(0))),
                Box::new(load),
                Box::new(u(0)),
            )
        };
        let gk = r.views.first().map_or(1, |v| v.gk);
        let slice = bin(BinOp::Rem, self.lane.warp.clone(), u(gk));
        // a bf16 view's registers (k16 steps), times `sigma` if given
        let bf16_view = |cx: &Cx, regs: &str, v: &ResidentView, sigma: Option<&Expr>| {
            let steps = v.cols / 16 / v.gk;
            let k0 = mul(slice.clone(), u(steps));
            let mut st = Vec::new();
            for i in 0..fm {
                for kk in 0..steps {
                    for reg in 0..4u32 {
                        let h = 2 * i + reg % 2; // a0, a2: row g; a1, a3: row g + 8
                        let hi_k = reg / 2; // a2, a3: k + 8
                        let kstep_word = add(u(v.col0 / 2), mul(add(k0.clone(), u(kk)), u(8)));
                        let word_in_step = add(cx.lane.quad.clone(), u(4 * hi_k));
                        let mut value = load(h, add(kstep_word, word_in_step));
                        if let Some(sg) = sigma {
                            value = scale_pair(value, sg.clone(), sg.clone());
                        }
                        st.push(Stmt::PrivateStore {
                            arr: regs.to_string(),
                            index: u((i * steps + kk) * 4 + reg),
                            value,
                        });
                    }
                }
            }
            st
        };
        let Some(unscale) = r.unscale.clone() else {
            for v in &r.views {
                out.extend(bf16_view(self, &v.regs, v, None));
            }
            return Ok(out);
        };
        // -- both forms: every word of the e4m3 views loaded once, their largest |x| over the warp
        let mx = self.fresh("q_absmax");
        out.push(Stmt::Var {
            name: mx.clone(),
            value: Expr::F32(0.0),
        });
        // (view, register index) -> the two loaded words
        let mut words: Vec<Vec<[String; 2]>> = Vec::new();
        for v in &r.views {
            let mut vw = Vec::new();
            if v.permuted {
                let steps = v.cols / 32 / v.gk;
                for i in 0..fm {
                    for kk in 0..steps {
                        for reg in 0..4u32 {
                            // row g (a0, a2) or g + 8 (a1, a3); k 4q..4q+3, + 16 for a2 / a3
                            let h = 2 * i + reg % 2;
                            let k = add(
                                add(
                                    mul(add(mul(slice.clone(), u(steps)), u(kk)), u(32)),
                                    u(16 * (reg / 2)),
                                ),
                                mul(self.lane.quad.clone(), u(4)),
                            );
                            let w0 = add(u(v.col0 / 2), bin(BinOp::Shr, k, u(1)));
                            let pair = [self.fresh("q_pair"), self.fresh("q_pair")];
                            for (n, w) in [w0.clone(), add(w0, u(1))].into_iter().enumerate() {
                                out.push(let_(&pair[n], load(h, w)));
                                let xv = var(&pair[n], Ty::U32);
                                out.push(Stmt::Assign {
                                    name: mx.clone(),
                                    value: bin(
                                        BinOp::Max,
                                        var(&mx, Ty::F32),
                                        bin(
                                            BinOp::Max,
                                            Expr::Call(Func::Abs, vec![bf16_lo(xv.clone())]),
                                            Expr::Call(Func::Abs, vec![bf16_hi(xv)]),
                                        ),
                                    ),
                                });
                            }
                            vw.push(pair);
                        }
                    }
                }
            }
            words.push(vw);
        }
        // the whole warp: its lanes hold the slice between them
        for mask in [1u32, 2, 4, 8, 16] {
            let other = self.fresh("q_absmax_peer");
            out.push(intr(Intrinsic::ShflXor {
                dst: other.clone(),
                value: var(&mx, Ty::F32),
                lane_mask: mask,
            }));
            out.push(Stmt::Assign {
                name: mx.clone(),
                value: bin(BinOp::Max, var(&mx, Ty::F32), var(&other, Ty::F32)),
            });
        }
        let e = bin(
            BinOp::BitAnd,
            bin(
                BinOp::Shr,
                Expr::Call(Func::F32Bits, vec![var(&mx, Ty::F32)]),
                u(23),
            ),
            u(0xFF),
        );
        let e_name = self.fresh("q_absmax_exp");
        out.push(let_(&e_name, e));
        let e = var(&e_name, Ty::U32);
        // σ = 2^(top - e) for the max's biased exponent e (max·σ in [2^(top-127),
        // 2^(top-126))), at most 2^64 (SIGMA_MAX_FIELD): lets of its biased exponent and its
        // value pushed to `out`; σ and 1/σ
        let sigma = |cx: &mut Self, top: u32, out: &mut Vec<Stmt>| {
            let field = cx.fresh("q_scale_exp");
            out.push(let_(
                &field,
                Expr::Select(
                    Box::new(lt(e.clone(), u(top + 127 - SIGMA_MAX_FIELD))),
                    Box::new(u(SIGMA_MAX_FIELD)),
                    Box::new(bin(BinOp::Sub, u(top + 127), e.clone())),
                ),
            ));
            let fv = var(&field, Ty::U32);
            let name = cx.fresh("q_scale");
            out.push(let_(
                &name,
                Expr::Call(Func::F32FromBits, vec![bin(BinOp::Shl, fv.clone(), u(23))]),
            ));
            let inverse = Expr::Call(
                Func::F32FromBits,
                vec![bin(BinOp::Shl, bin(BinOp::Sub, u(254), fv), u(23))],
            );
            (var(&name, Ty::F32), inverse)
        };
        // -- the e4m3 form (σ: the max in [128, 256), well inside e4m3's ±448)
        let mut native = Vec::new();
        let (sg, inverse) = sigma(self, 134, &mut native);
        native.push(Stmt::PrivateStore {
            arr: unscale.clone(),
            index: u(0),
            value: inverse,
        });
        for (v, vw) in r.views.iter().zip(&words) {
            if !v.permuted {
                native.extend(bf16_view(self, &v.regs, v, Some(&sg)));
                continue;
            }
            for (at, pair) in vw.iter().enumerate() {
                let xs: Vec<String> = (0..4).map(|_| self.fresh("q_x")).collect();
                for (n, w) in pair.iter().enumerate() {
                    let pv = var(w, Ty::U32);
                    native.push(let_(&xs[2 * n], mul(bf16_lo(pv.clone()), sg.clone())));
                    native.push(let_(&xs[2 * n + 1], mul(bf16_hi(pv), sg.clone())));
                }
                let x = |k: usize| var(&xs[k], Ty::F32);
                let hi = self.fresh("q_hi");
                native.push(let_(
                    &hi,
                    Expr::Call(Func::PackE4m3x4, vec![x(0), x(1), x(2), x(3)]),
                ));
                let hv = var(&hi, Ty::U32);
                let preps = [self.fresh("q_hi_pair"), self.fresh("q_hi_pair")];
                native.push(let_(
                    &preps[0],
                    Expr::Call(
                        Func::E4m3x2Prep,
                        vec![bin(BinOp::BitAnd, hv.clone(), u(0xFFFF))],
                    ),
                ));
                native.push(let_(
                    &preps[1],
                    Expr::Call(Func::E4m3x2Prep, vec![bin(BinOp::Shr, hv.clone(), u(16))]),
                ));
                let back = |k: usize| {
                    let p = var(&preps[k / 2], Ty::U32);
                    let f = if k % 2 == 0 {
                        Func::E4m3x2Lo
                    } else {
                        Func::E4m3x2Hi
                    };
                    bin(BinOp::Sub, x(k), Expr::Call(f, vec![p]))
                };
                native.push(Stmt::PrivateStore {
                    arr: v.regs.clone(),
                    index: u(at as u32),
                    value: hv,
                });
                native.push(Stmt::PrivateStore {
                    arr: v.lo_regs.clone(),
                    index: u(at as u32),
                    value: Expr::Call(Func::PackE4m3x4, vec![back(0), back(1), back(2), back(3)]),
                });
            }
        }
        // -- the f16 form, where the GPU has no e4m3 product: the e4m3 views as f16 times σ
        // (the max in [2^14, 2^15): every bf16 value within 2^28 of it is exact in f16), in
        // the K order of the widened bytes. The widened bytes are the values over `unit`
        // (E4M3_F16_UNIT), so those products are σ / unit times the true ones, and the bf16
        // views are scaled by σ / unit too (powers of two: exact)
        let mut fallback = Vec::new();
        let (f16_sg, inverse) = sigma(self, 141, &mut fallback);
        let unit = Expr::Call(Func::E4m3F16Unit, vec![]);
        let bf16_sigma = self.fresh("q_scale");
        fallback.push(let_(
            &bf16_sigma,
            bin(BinOp::Div, f16_sg.clone(), unit.clone()),
        ));
        fallback.push(Stmt::PrivateStore {
            arr: unscale,
            index: u(0),
            value: mul(inverse, unit),
        });
        for (v, vw) in r.views.iter().zip(&words) {
            if !v.permuted {
                let sg = var(&bf16_sigma, Ty::F32);
                fallback.extend(bf16_view(self, &v.regs, v, Some(&sg)));
                continue;
            }
            // the words of register `reg` of k32 step `kk` hold k 4q..4q+3 of k16 step
            // 2·kk + reg / 2: that step's registers reg % 2 (k 4q, 4q+1) and reg % 2 + 2
            let steps = v.cols / 32 / v.gk;
            for (at, pair) in vw.iter().enumerate() {
                let (at, reg) = (at as u32 / 4, at as u32 % 4);
                let (i, kk) = (at / steps, at % steps);
                let base = (i * 2 * steps + 2 * kk + reg / 2) * 4 + reg % 2;
                for (n, w) in pair.iter().enumerate() {
                    let pv = var(w, Ty::U32);
                    fallback.push(Stmt::PrivateStore {
                        arr: v.f16_regs.clone(),
                        index: u(base + 2 * n as u32),
                        value: Expr::Call(
                            Func::PackF16x2,
                            vec![
                                mul(bf16_lo(pv.clone()), f16_sg.clone()),
                                mul(bf16_hi(pv), f16_sg.clone()),
                            ],
                        ),
                    });
                }
            }
        }
        out.push(Stmt::If {
            cond: Expr::Call(Func::E4m3MmaNative, vec![]),
            then: native,
            els: fallback,
        });
        Ok(out)
    }
}
