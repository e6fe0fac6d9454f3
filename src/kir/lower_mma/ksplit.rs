//! Split-K products (the producer/consumer form, [`super::lower_ws`]).
//!
//! **Split-K.** A product whose accumulator has fewer m16n8 fragments than there are warps
//! (the scores `S = q · Kᵀ` of a decode step: `[heads, slots]`, K = 576) would leave most
//! warps idle and every busy one with a chain of K/16 dependent mma. Here the warps form `G`
//! groups over S's n fragments and `gk` slices of each product's K range: warp `w` computes,
//! for group `w / gk` and slice `w % gk`, partial fragments in registers (`part`). The first
//! op that reads S sums the partials: each warp stores its own to a shared scratch, one
//! barrier, and the warps that hold S — in rows: warp `i` holds m fragment `i` and all n
//! fragments — add them up.
//!
//! The A operands of these products may live in registers ([`super::resident`]) and their B
//! operands may be e4m3 ([`super::e4m3`]).

use super::e4m3::scale_at;
use super::{add, bin, fma, for_const, intr, let_, mul, priv_load, u, var, Cx};
use crate::kir::expr::priv_load_u;
use crate::kir::ir::*;
use crate::kir::walk::visit_tile_ops_with;
use crate::Result;

/// Most registers per thread that resident A fragments may take.
const A_REGISTER_BUDGET: u32 = 80;

/// How a split-K accumulator is spread.
#[derive(Clone, Debug)]
pub(super) struct KSplit {
    /// Slices of the K range (warps per group).
    pub gk: u32,
    /// n fragments per group.
    pub ng: u32,
    /// Private array of this warp's partial fragments `[fm, ng, 4]`.
    pub part: String,
    /// Temporary fragments of one scaled product.
    pub temp: String,
}

/// Every product (acc, A view, B tile, layout) inside the pipeline compute stages.
fn pipeline_products(body: &[Stmt]) -> Vec<(String, TileView, TileView, BLayout)> {
    let mut out = Vec::new();
    visit_tile_ops_with(body, false, &mut |op| {
        if let TileOp::Pipeline { compute, .. } = op {
            visit_tile_ops_with(compute, false, &mut |inner| match inner {
                TileOp::Mma {
                    acc,
                    a,
                    b,
                    b_layout,
                }
                | TileOp::MmaScaled {
                    acc,
                    a,
                    b,
                    b_layout,
                    ..
                } => out.push((acc.clone(), a.clone(), b.clone(), *b_layout)),
                _ => {}
            });
        }
    });
    out
}

/// Every product (acc, A view, B tile, layout) of the kernel.
pub(super) fn all_products(body: &[Stmt]) -> Vec<(String, TileView, TileView, BLayout)> {
    let mut out = Vec::new();
    visit_tile_ops_with(body, false, &mut |op| match op {
        TileOp::Mma {
            acc,
            a,
            b,
            b_layout,
        }
        | TileOp::MmaScaled {
            acc,
            a,
            b,
            b_layout,
            ..
        } => out.push((acc.clone(), a.clone(), b.clone(), *b_layout)),
        _ => {}
    });
    out
}

/// `(gk, ng)` for an accumulator whose products may be split along K, if any.
pub(super) fn split_shape(cx: &Cx, acc: &AccTileDecl) -> Option<(u32, u32)> {
    cx.ws.as_ref()?;
    let (fm, fn_) = (acc.rows / 16, acc.cols / 8);
    if fm * fn_ > 2 * cx.warps {
        return None;
    }
    let inside: Vec<_> = pipeline_products(&cx.kernel.body)
        .into_iter()
        .filter(|p| p.0 == acc.name)
        .collect();
    let everywhere = all_products(&cx.kernel.body)
        .into_iter()
        .filter(|p| p.0 == acc.name)
        .count();
    if inside.is_empty() || inside.len() != everywhere {
        return None;
    }
    if inside
        .iter()
        .any(|p| p.3 != BLayout::NK || p.1.cols % 16 != 0)
    {
        return None;
    }
    let e4m3_b = |p: &(String, TileView, TileView, BLayout)| {
        cx.kernel
            .shared_tile(&p.2.tile)
            .is_some_and(|t| t.elem == TileElem::E4m3)
    };
    for gk in [2u32, 4, 8] {
        if cx.warps % gk != 0 {
            continue;
        }
        let groups = cx.warps / gk;
        if fn_ % groups != 0 {
            continue;
        }
        if inside.iter().any(|p| (p.1.cols / 16) % gk != 0) {
            continue;
        }
        // an e4m3 B operand is multiplied 32 k at a time (m16n8k32)
        if inside
            .iter()
            .any(|p| e4m3_b(p) && p.1.cols % (32 * gk) != 0)
        {
            continue;
        }
        let regs: u32 = inside.iter().map(|p| fm * (p.1.cols / 16 / gk) * 4).sum();
        if regs <= A_REGISTER_BUDGET {
            return Some((gk, fn_ / groups));
        }
    }
    None
}

/// The split-K plan of an accumulator (registers named later by [`declare`]).
pub(super) fn plan_for(cx: &Cx, acc: &AccTileDecl) -> Option<KSplit> {
    split_shape(cx, acc).map(|(gk, ng)| KSplit {
        gk,
        ng,
        part: String::new(),
        temp: String::new(),
    })
}

/// Registers and scratch of the split-K accumulators.
pub(super) fn declare(cx: &mut Cx) -> Result<()> {
    let names: Vec<String> = cx
        .accs
        .iter()
        .filter(|(_, a)| a.ksplit.is_some())
        .map(|(n, _)| n.clone())
        .collect();
    let mut scratch = 0;
    for n in names {
        let a = cx.accs[&n].clone();
        let ks = a.ksplit.clone().unwrap_or_else(unreachable_split);
        let fm = a.decl.rows / 16;
        // twice the fragments: the second half is the odd k steps' chain of one product
        let len = fm * ks.ng * 4;
        let part = cx.private(&format!("{n}_part"), Ty::F32, 2 * len);
        let temp = cx.private(&format!("{n}_term"), Ty::F32, 2 * len);
        if let Some(k) = cx.accs.get_mut(&n).and_then(|a| a.ksplit.as_mut()) {
            k.part = part;
            k.temp = temp;
        }
        scratch = scratch.max(ks.gk * a.decl.rows * scratch_stride(a.decl.cols));
    }
    if scratch > 0 {
        let name = cx.fresh("split_k_partials");
        cx.new_shared.push(SharedDecl {
            alias: None,
            name: name.clone(),
            ty: Ty::F32,
            len: scratch,
        });
        cx.split_scratch = Some(name);
    }
    Ok(())
}

#[cold]
fn unreachable_split() -> KSplit {
    KSplit {
        gk: 1,
        ng: 1,
        part: String::new(),
        temp: String::new(),
    }
}

/// Row stride (f32) of the partials scratch: padded so a warp's stores spread over banks.
pub(super) fn scratch_stride(cols: u32) -> u32 {
    cols + 4
}

impl Cx<'_> {
    /// One split-K product `acc += A · B` (B `[N, K]`, optionally scaled per row).
    pub(super) fn mma_ksplit(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        scale: Option<(String, Expr)>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.acc(acc)?.clone();
        let ks = info
            .ksplit
            .clone()
            .ok_or_else(|| self.err(format!("{acc} is not split along K")))?;
        let tb = self.tile(&b.tile)?.clone();
        let e4m3 = tb.decl.elem == TileElem::E4m3;
        if !(tb.store == TileElem::Bf16 || e4m3) {
            return Err(self.err(format!(
                "mma into {acc}: B tile {} must be bf16 or e4m3",
                tb.decl.name
            )));
        }
        let fm = info.decl.rows / 16;
        let steps = a.cols / 16 / ks.gk;
        let (gk, ng) = (ks.gk, ks.ng);
        let warp = self.lane.warp.clone();
        let slice = bin(BinOp::Rem, warp.clone(), u(gk));
        let group = bin(BinOp::Div, warp, u(gk));
        let mut body = Vec::new();
        if !self.partial_live.contains(acc) {
            let e = self.fresh("e");
            body.push(for_const(
                &e,
                fm * ng * 4,
                vec![Stmt::PrivateStore {
                    arr: ks.part.clone(),
                    index: var(&e, Ty::U32),
                    value: Expr::F32(0.0),
                }],
            ));
            self.partial_live.insert(acc.to_string());
        }
        let target = if scale.is_some() {
            let e = self.fresh("e");
            body.push(for_const(
                &e,
                fm * ng * 4,
                vec![Stmt::PrivateStore {
                    arr: ks.temp.clone(),
                    index: var(&e, Ty::U32),
                    value: Expr::F32(0.0),
                }],
            ));
            ks.temp.clone()
        } else {
            ks.part.clone()
        };
        let resident = self.resident_view(a, e4m3);
        let ta = self.tile(&a.tile)?.clone();
        if resident.is_none() && (e4m3 || ta.store != TileElem::Bf16) {
            return Err(self.err(format!(
                "mma into {acc}: with an e4m3 B operand the A operand ({}) must be a \
                 register-resident bf16 tile (gathered once before the pipeline, used by nothing \
                 else)",
                a.tile
            )));
        }
        let bb = self.tile_base(&tb)?;
        let ab = self.tile_base(&ta)?;
        // first n row of this warp's group; first k step of its slice (within the view)
        let n_first = self.fresh("n_first");
        body.push(let_(
            &n_first,
            add(u(b.row0), mul(group.clone(), u(8 * ng))),
        ));
        let nf = var(&n_first, Ty::U32);
        let mut native = Vec::new();
        if e4m3 {
            let v = resident
                .clone()
                .ok_or_else(|| self.err(format!("{acc}: no resident A")))?;
            self.ksplit_e4m3(
                &mut native,
                &target,
                &v,
                &tb,
                bb.clone(),
                b,
                &nf,
                fm,
                ng,
                slice.clone(),
            );
        }
        // the k16 form: bf16 operands — the only one for bf16 B — or, for e4m3 B where the GPU
        // has no e4m3 product, f16 ones (B widened a pair at a time, the A view's f16 form)
        let k16 = |cx: &mut Self, body: &mut Vec<Stmt>, e4m3: bool| -> Result<()> {
            let k_first = cx.fresh("k_first");
            body.push(let_(&k_first, mul(slice, u(steps))));
            let kf = var(&k_first, Ty::U32);
            let af = cx.private("a_frag", Ty::U32, 4);
            let bf = cx.private("b_frag", Ty::U32, 4);
            let raw = cx.private("b_raw", Ty::U32, 2);
            let (kk, i, j) = (cx.fresh("kk"), cx.fresh("mi"), cx.fresh("nj"));
            let (kkv, iv, jv) = (var(&kk, Ty::U32), var(&i, Ty::U32), var(&j, Ty::U32));
            // Two independent mma chains, even and odd k steps, into the two halves of the
            // target (added at the end): one chain of `steps` dependent mma was the S product's
            // latency (each waits for the previous one's accumulator).
            let frags = fm * ng * 4;
            let chains = if steps % 2 == 0 { 2 } else { 1 };
            let (pair, par) = (cx.fresh("kk_pair"), cx.fresh("chain"));
            let parv = var(&par, Ty::U32);
            if chains == 2 {
                let e = cx.fresh("e");
                body.push(for_const(
                    &e,
                    frags,
                    vec![Stmt::PrivateStore {
                        arr: target.clone(),
                        index: add(u(frags), var(&e, Ty::U32)),
                        value: Expr::F32(0.0),
                    }],
                ));
            }
            // B of n fragment j, k step kk (both relative): two u32 in bf[0..2]
            let mut k_body = Vec::new();
            let mut n_body = Vec::new();
            let kstep = add(kf.clone(), kkv.clone());
            if e4m3 {
                // bytes: k step = 16 bytes; one 8x8 b16 matrix per n fragment (x1)
                let word = add(
                    cx.b_row_word(bb.clone(), tb.stride, &nf, &jv),
                    add(u(b.col0 / 4), mul(kstep.clone(), u(4))),
                );
                n_body.push(intr(Intrinsic::LdMatrix {
                    count: 1,
                    trans: false,
                    arr: b.tile.clone(),
                    word,
                    dst: raw.clone(),
                    dst0: u(0),
                }));
                // bytes (0, 1) and (2, 3) as f16 pairs: the A view is f16 here
                let x = priv_load_u(&raw, u(0));
                for (k, pair) in [
                    bin(BinOp::BitAnd, x.clone(), u(0xFFFF)),
                    bin(BinOp::Shr, x, u(16)),
                ]
                .into_iter()
                .enumerate()
                {
                    n_body.push(Stmt::PrivateStore {
                        arr: bf.clone(),
                        index: u(k as u32),
                        value: Expr::Call(Func::E4m3x2F16, vec![pair]),
                    });
                }
            } else {
                // bf16 [N, K]: matrices (n 0-7, k 0-7), (n 0-7, k 8-15) via x2
                let word = add(
                    cx.b_row_word(bb.clone(), tb.stride, &nf, &jv),
                    add(
                        u(b.col0 / 2),
                        add(
                            mul(kstep.clone(), u(8)),
                            bin(BinOp::Shr, cx.lane.k_nk.clone(), u(1)),
                        ),
                    ),
                );
                n_body.push(intr(Intrinsic::LdMatrix {
                    count: 2,
                    trans: false,
                    arr: b.tile.clone(),
                    word,
                    dst: bf.clone(),
                    dst0: u(0),
                }));
            }
            // A fragments of m fragment i at this k step, then the mma
            let a_frag = |cx: &mut Cx, iv: Expr| -> Vec<Stmt> {
                match &resident {
                    Some(v) => (0..4)
                        .map(|r| Stmt::PrivateStore {
                            arr: af.clone(),
                            index: u(r),
                            value: priv_load_u(
                                if e4m3 { &v.f16_regs } else { &v.regs },
                                add(mul(add(mul(iv.clone(), u(steps)), kkv.clone()), u(4)), u(r)),
                            ),
                        })
                        .collect(),
                    None => {
                        let word = add(
                            add(
                                ab.clone(),
                                mul(
                                    add(add(u(a.row0), mul(iv, u(16))), cx.lane.r16.clone()),
                                    u(ta.stride),
                                ),
                            ),
                            add(
                                u(a.col0 / 2),
                                add(
                                    mul(add(kf.clone(), kkv.clone()), u(8)),
                                    bin(BinOp::Shr, cx.lane.c8.clone(), u(1)),
                                ),
                            ),
                        );
                        vec![intr(Intrinsic::LdMatrix {
                            count: 4,
                            trans: false,
                            arr: a.tile.clone(),
                            word,
                            dst: af.clone(),
                            dst0: u(0),
                        })]
                    }
                }
            };
            let mut m_body = a_frag(cx, iv.clone());
            let chain0 = if chains == 2 {
                mul(parv.clone(), u(frags))
            } else {
                u(0)
            };
            let (c, c0) = (
                target.clone(),
                add(chain0, mul(add(mul(iv.clone(), u(ng)), jv.clone()), u(4))),
            );
            let (a, b) = (af.clone(), bf.clone());
            m_body.push(intr(if e4m3 {
                Intrinsic::MmaF16 {
                    c,
                    c0,
                    a,
                    a0: u(0),
                    b,
                    b0: u(0),
                }
            } else {
                Intrinsic::MmaBf16 {
                    c,
                    c0,
                    a,
                    a0: u(0),
                    b,
                    b0: u(0),
                }
            }));
            n_body.push(for_const(&i, fm, m_body));
            k_body.push(for_const(&j, ng, n_body));
            if chains == 2 {
                let mut inner = vec![let_(&kk, add(mul(var(&pair, Ty::U32), u(2)), parv.clone()))];
                inner.extend(k_body);
                body.push(for_const(&pair, steps / 2, vec![for_const(&par, 2, inner)]));
                let e = cx.fresh("e");
                let ev = var(&e, Ty::U32);
                body.push(for_const(
                    &e,
                    frags,
                    vec![Stmt::PrivateStore {
                        arr: target.clone(),
                        index: ev.clone(),
                        value: bin(
                            BinOp::Add,
                            priv_load(&target, ev.clone()),
                            priv_load(&target, add(u(frags), ev)),
                        ),
                    }],
                ));
            } else {
                body.push(for_const(&kk, steps, k_body));
            }
            Ok(())
        };
        if e4m3 {
            let mut fallback = Vec::new();
            k16(self, &mut fallback, true)?;
            body.push(Stmt::If {
                cond: Expr::Call(Func::E4m3MmaNative, vec![]),
                then: native,
                els: fallback,
            });
        } else {
            k16(self, &mut body, false)?;
        }
        if let Some(sc) = &scale {
            // partial += term x the scale of its column (B row)
            let (f, e) = (self.fresh("frag"), self.fresh("e"));
            let (fv, ev) = (var(&f, Ty::U32), var(&e, Ty::U32));
            let n_of = add(
                add(nf.clone(), mul(bin(BinOp::Rem, fv.clone(), u(ng)), u(8))),
                add(
                    mul(self.lane.quad.clone(), u(2)),
                    bin(BinOp::BitAnd, ev.clone(), u(1)),
                ),
            );
            let at = add(mul(fv, u(4)), ev);
            let sc_name = self.fresh("row_scale");
            body.push(for_const(
                &f,
                fm * ng,
                vec![for_const(
                    &e,
                    4,
                    vec![
                        let_(&sc_name, self.expr(&scale_at(sc, n_of))?),
                        Stmt::PrivateStore {
                            arr: ks.part.clone(),
                            index: at.clone(),
                            value: fma(
                                priv_load(&ks.temp, at.clone()),
                                var(&sc_name, Ty::F32),
                                priv_load(&ks.part, at),
                            ),
                        },
                    ],
                )],
            ));
        }
        out.extend(body);
        Ok(())
    }

    /// The word where this lane's row of n fragment `j` starts in a `[N, K]` B tile (`base`,
    /// row `stride` words) for an `ldmatrix` of 8-row matrices: row `n_first + 8j + lane % 8`.
    pub(super) fn b_row_word(&self, base: Expr, stride: u32, n_first: &Expr, j: &Expr) -> Expr {
        add(
            base,
            mul(
                add(
                    add(n_first.clone(), mul(j.clone(), u(8))),
                    bin(BinOp::BitAnd, self.lane.r16.clone(), u(7)),
                ),
                u(stride),
            ),
        )
    }

    /// Sum the partials of a split-K accumulator into it (if any are pending).
    pub(super) fn materialize(&mut self, acc: &str, out: &mut Vec<Stmt>) -> Result<()> {
        if !self.partial_live.remove(acc) {
            return Ok(());
        }
        let info = self.acc(acc)?.clone();
        let ks = info
            .ksplit
            .clone()
            .ok_or_else(|| self.err(format!("{acc} is not split along K")))?;
        let scratch = self
            .split_scratch
            .clone()
            .ok_or_else(|| self.err("split-K without its scratch".into()))?;
        let (rows, cols) = (info.decl.rows, info.decl.cols);
        let stride = scratch_stride(cols);
        let fm = rows / 16;
        let warp = self.lane.warp.clone();
        let slice = bin(BinOp::Rem, warp.clone(), u(ks.gk));
        let group = bin(BinOp::Div, warp, u(ks.gk));
        out.push(Stmt::Comment(format!(
            "{acc}: split-K partials to shared memory, summed by the warps that hold its rows"
        )));
        // every warp stores its partial fragments
        let (f, h, e) = (self.fresh("frag"), self.fresh("half"), self.fresh("e"));
        let (fv, hv, ev) = (var(&f, Ty::U32), var(&h, Ty::U32), var(&e, Ty::U32));
        let row = add(
            add(
                mul(bin(BinOp::Div, fv.clone(), u(ks.ng)), u(16)),
                mul(hv.clone(), u(8)),
            ),
            self.lane.group.clone(),
        );
        let col = add(
            add(
                mul(group, u(8 * ks.ng)),
                mul(bin(BinOp::Rem, fv.clone(), u(ks.ng)), u(8)),
            ),
            add(mul(self.lane.quad.clone(), u(2)), ev.clone()),
        );
        let at = add(mul(add(mul(slice, u(rows)), row), u(stride)), col);
        let part_elem = priv_load(
            &ks.part,
            add(add(mul(fv.clone(), u(4)), mul(hv.clone(), u(2))), ev),
        );
        let unscale = all_products(&self.kernel.body)
            .iter()
            .filter(|p| p.0 == acc)
            .find_map(|p| self.resident_a.get(&p.1.tile))
            .and_then(|r| r.unscale.clone());
        out.push(for_const(
            &f,
            fm * ks.ng,
            vec![for_const(
                &h,
                2,
                vec![for_const(
                    &e,
                    2,
                    vec![Stmt::SharedStore {
                        arr: scratch.clone(),
                        index: at,
                        value: match &unscale {
                            // the products were σ times the true ones (resident e4m3 view)
                            Some(us) => mul(part_elem, priv_load(us, u(0))),
                            None => part_elem,
                        },
                    }],
                )],
            )],
        ));
        out.push(Stmt::Barrier);
        self.summed.insert(acc.to_string());
        if let Some(rf) = info.rows.clone() {
            let sum = self.rows_sum(acc, &rf, &scratch, (ks.gk, rows, stride));
            out.extend(self.for_used_warps(&info, sum));
            return Ok(());
        }
        // the holders of S's rows add the slices into their fragments: each holder warp's
        // whole `[fmw, fnw]` fragment grid (a warp may hold several m fragments: S
        // [32 x 64] on 4 holder warps is 2 x 2 fragments each)
        let (f2, h2, e2, g2) = (
            self.fresh("frag"),
            self.fresh("half"),
            self.fresh("e"),
            self.fresh("g"),
        );
        let (fv2, hv2, ev2) = (var(&f2, Ty::U32), var(&h2, Ty::U32), var(&e2, Ty::U32));
        // m and n fragment of fragment `f2` within the warp's grid
        let (m2, n2) = if info.fmw == 1 {
            (u(0), fv2.clone())
        } else {
            (
                bin(BinOp::Div, fv2.clone(), u(info.fnw)),
                bin(BinOp::Rem, fv2.clone(), u(info.fnw)),
            )
        };
        let row2 = add(
            add(
                add(info.row0.clone(), mul(m2, u(16))),
                mul(hv2.clone(), u(8)),
            ),
            self.lane.group.clone(),
        );
        let col2 = add(
            add(info.col0.clone(), mul(n2, u(8))),
            add(mul(self.lane.quad.clone(), u(2)), ev2.clone()),
        );
        let idx = add(add(mul(fv2, u(4)), mul(hv2, u(2))), ev2);
        let (sum, cell) = (self.fresh("sum"), self.fresh("cell"));
        let inner = add_slices(
            (&scratch, acc, idx),
            (&sum, &cell, &g2),
            add(mul(row2, u(stride)), col2),
            (ks.gk, rows * stride),
        );
        let lp = for_const(
            &f2,
            info.frags(),
            vec![for_const(&h2, 2, vec![for_const(&e2, 2, inner)])],
        );
        out.extend(self.for_used_warps(&info, vec![lp]));
        Ok(())
    }
}

/// `acc[idx] += Σ_g scratch[g · slice_words + cell]` over the `gk` slices of a split-K
/// scratch, with `cell` bound to `cell_at` first; `sum`, `cell` and `g` are fresh names.
pub(super) fn add_slices(
    (scratch, acc, idx): (&str, &str, Expr),
    (sum, cell, g): (&str, &str, &str),
    cell_at: Expr,
    (gk, slice_words): (u32, u32),
) -> Vec<Stmt> {
    vec![
        Stmt::Var {
            name: sum.to_string(),
            value: priv_load(acc, idx.clone()),
        },
        let_(cell, cell_at),
        for_const(
            g,
            gk,
            vec![Stmt::Assign {
                name: sum.to_string(),
                value: bin(
                    BinOp::Add,
                    var(sum, Ty::F32),
                    Expr::SharedLoad {
                        arr: scratch.to_string(),
                        ty: Ty::F32,
                        index: Box::new(add(
                            mul(var(g, Ty::U32), u(slice_words)),
                            var(cell, Ty::U32),
                        )),
                    },
                ),
            }],
        ),
        Stmt::PrivateStore {
            arr: acc.to_string(),
            index: idx,
            value: var(sum, Ty::F32),
        },
    ]
}
