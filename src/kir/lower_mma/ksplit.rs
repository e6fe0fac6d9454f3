//! Split-K products, register-resident A operands and e4m3 operands (the producer/consumer
//! form, [`super::lower_ws`]).
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
//! **Resident A.** When the A operand of such products is a tile gathered once before the
//! pipeline and read by nothing else (q), each warp loads the A fragments of its own K slices
//! straight from global memory into registers: no shared memory for it and no `ldmatrix` of
//! it per step.
//!
//! **e4m3 operands.** In an `[N, K]` product (the scores) on a GPU with a one-instruction
//! e4m3 product (sm_89, sm_120: [`Func::E4m3MmaNative`]), the e4m3 bytes are the B operand as
//! they are — `ldmatrix.x2` gives each lane the m16n8k32 layout directly, nothing converted —
//! and the resident A tile is held as two e4m3 terms (`hi`, `lo`, times a per-warp power of
//! two: [`Cx::resident_gather`]), two m16n8k32 products per 32 k. Elsewhere (sm_80, and sm_90,
//! whose ptxas turns that instruction into conversions and two f16 products), and in every
//! `[K, N]` product, an e4m3 tile is multiplied as bf16 (every e4m3 value is exact in bf16):
//! `ldmatrix` reads its bytes as 16-bit pairs and each register is widened to two bf16x2.
//! Read that way a lane holds 4 consecutive bytes, so the K order inside each 16-wide k step
//! is permuted — logical k `2q, 2q+1` is stored k `4q, 4q+1` and `2q+8, 2q+9` is `4q+2, 4q+3`
//! — and the A fragments are loaded with the same permutation (`[N, K]` products). In a
//! `[K, N]` product (`P · V`) `ldmatrix.trans` gives each lane bytes of two columns: the
//! accumulator is *interleaved*, its fragment pair `(2j, 2j+1)` holding the even and the odd
//! columns of 16 (see [`interleaved`]).
//!
//! **Per-row scales** ([`TileOp::MmaScaled`]): `[N, K]` — each product into a temporary,
//! added to the partial times the scale of its column; `[K, N]` (e4m3 B, `P · V`) — each
//! widened B value times the scale of its k row before it is rounded to bf16 (scaling the A
//! fragment (P) per tile instead cost 1.08x at fp8 H 128, benches/NOTES.md v15).

use super::{add, bin, for_const, intr, let_, lt, mul, priv_load, u, var, Cx, TileInfo};
use crate::kir::ir::*;
use crate::kir::walk::visit_tile_ops_with;
use crate::Result;
use std::collections::HashSet;

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
    /// The e4m3 view's bf16 form where the GPU has no e4m3 product ([`Func::E4m3MmaNative`]
    /// false): `[fm, k16 steps, 4]`, K order permuted to match the widened B bytes (empty for
    /// bf16 views).
    pub bf_regs: String,
    pub gk: u32,
}

#[derive(Clone, Debug, Default)]
pub(super) struct ResidentA {
    pub views: Vec<ResidentView>,
    /// With an e4m3 view: private `[1]` f32, the inverse of the power of two this warp
    /// scaled every view of the tile by.
    pub unscale: Option<String>,
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

fn all_products(body: &[Stmt]) -> Vec<(String, TileView, TileView, BLayout)> {
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
fn split_shape(cx: &Cx, acc: &AccTileDecl) -> Option<(u32, u32)> {
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

/// Is `acc` the output of a `[K, N]` product with an e4m3 B operand?
pub(super) fn interleaved(cx: &Cx, acc: &str) -> bool {
    all_products(&cx.kernel.body)
        .iter()
        .any(|(a, _, b, layout)| {
            a == acc
                && *layout == BLayout::KN
                && cx
                    .kernel
                    .shared_tile(&b.tile)
                    .is_some_and(|t| t.elem == TileElem::E4m3)
        })
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
                TileOp::GatherRows {
                    dst,
                    dst_word0,
                    words,
                    src_word,
                    flags,
                    ..
                } => {
                    *ok &= !expr_uses(src_word);
                    if dst == tile {
                        *ok &= !in_pipeline
                            && *dst_word0 == 0
                            && *words == row_words
                            && flags.is_none();
                    }
                }
                TileOp::AccForEach { body, .. } => {
                    check_uses(body, tile, row_words, in_pipeline, ok)
                }
                TileOp::AccToShared { dst, .. } => *ok &= dst != tile,
                TileOp::SharedMap { dst, value, .. } => *ok &= dst != tile && !expr_uses(value),
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

/// Registers and scratch of the split-K accumulators and the resident tiles.
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
    // resident A views
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
            let (lo_regs, bf_regs) = if permuted {
                (
                    cx.private(&format!("{t}_a{}_lo", r.views.len()), Ty::U32, len),
                    cx.private(
                        &format!("{t}_a{}_bf16", r.views.len()),
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
                bf_regs,
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

/// The widening of one register of 4 e4m3 bytes (`x`) into two bf16x2: bytes (0, 1) and
/// (2, 3), or with `interleave` bytes (0, 2) and (1, 3). Each pair is converted at once
/// ([`Func::E4m3x2Prep`]: one `cvt.rn.f16x2.e4m3x2` on sm_89+) into the lets `prep`, then
/// its halves to f32 and the two packed as bf16x2; byte by byte it took two shifts, two masks
/// and two single-value conversions more per pair, the largest share of the fp8 step's
/// issued instructions (ncu, H200, benches/NOTES.md).
fn widen(x: Expr, interleave: bool, prep: [&str; 2]) -> (Vec<Stmt>, Expr, Expr) {
    widen_scaled(x, interleave, prep, None)
}

/// [`widen`], each bf16x2 output's low and high value times `scales` (f32) first: in a
/// `[K, N]` product both outputs hold the same two k rows, so one pair of scales serves.
fn widen_scaled(
    x: Expr,
    interleave: bool,
    prep: [&str; 2],
    scales: Option<(Expr, Expr)>,
) -> (Vec<Stmt>, Expr, Expr) {
    let (p0, p1) = if interleave {
        (
            bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, x.clone(), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF00)),
            ),
            bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x, u(16)), u(0xFF00)),
            ),
        )
    } else {
        (
            bin(BinOp::BitAnd, x.clone(), u(0xFFFF)),
            bin(BinOp::Shr, x, u(16)),
        )
    };
    let stmts = vec![
        let_(prep[0], Expr::Call(Func::E4m3x2Prep, vec![p0])),
        let_(prep[1], Expr::Call(Func::E4m3x2Prep, vec![p1])),
    ];
    let pack = |name: &str| {
        let v = var(name, Ty::U32);
        let (lo, hi) = (
            Expr::Call(Func::E4m3x2Lo, vec![v.clone()]),
            Expr::Call(Func::E4m3x2Hi, vec![v]),
        );
        let (lo, hi) = match &scales {
            Some((s_lo, s_hi)) => (
                bin(BinOp::Mul, lo, s_lo.clone()),
                bin(BinOp::Mul, hi, s_hi.clone()),
            ),
            None => (lo, hi),
        };
        Expr::Call(Func::PackBf16x2, vec![lo, hi])
    };
    (stmts, pack(prep[0]), pack(prep[1]))
}

/// A bf16x2 word times two f32 scales (low, high half), rounded back to bf16x2.
fn scale_pair(w: Expr, lo: Expr, hi: Expr) -> Expr {
    Expr::Call(
        Func::PackBf16x2,
        vec![
            bin(BinOp::Mul, bf16_lo(w.clone()), lo),
            bin(BinOp::Mul, bf16_hi(w), hi),
        ],
    )
}

/// The low bf16 of a word, as f32.
fn bf16_lo(w: Expr) -> Expr {
    Expr::Call(Func::F32FromBits, vec![bin(BinOp::Shl, w, u(16))])
}

/// The high bf16 of a word, as f32.
fn bf16_hi(w: Expr) -> Expr {
    Expr::Call(
        Func::F32FromBits,
        vec![bin(BinOp::BitAnd, w, u(0xFFFF_0000))],
    )
}

/// `scale` with its row variable bound to `row`.
fn scale_at(scale: &(String, Expr), row: Expr) -> Expr {
    let name = scale.0.clone();
    scale.1.clone().map(&mut |x| match x {
        Expr::Var(ref n, Ty::U32) if *n == name => row.clone(),
        other => other,
    })
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
    /// multiplies by `unscale = 1/σ`. Elsewhere the view is bf16, its K order permuted to
    /// match the widened e4m3 bytes, and `unscale = 1`.
    pub(super) fn resident_gather(
        &mut self,
        dst: &str,
        src: &str,
        row: &str,
        src_word: &Expr,
    ) -> Result<Vec<Stmt>> {
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
        // a bf16 view's registers (k16 steps), times `sigma` if given; `permuted`: the K
        // order of a widened e4m3 B operand (logical pair q, 4 + q stored as words 2q, 2q + 1)
        let bf16_view =
            |cx: &Cx, regs: &str, v: &ResidentView, permuted: bool, sigma: Option<&Expr>| {
                let steps = v.cols / 16 / v.gk;
                let k0 = mul(slice.clone(), u(steps));
                let mut st = Vec::new();
                for i in 0..fm {
                    for kk in 0..steps {
                        for reg in 0..4u32 {
                            let h = 2 * i + reg % 2; // a0, a2: row g; a1, a3: row g + 8
                            let hi_k = reg / 2; // a2, a3: k + 8
                            let kstep_word = add(u(v.col0 / 2), mul(add(k0.clone(), u(kk)), u(8)));
                            let word_in_step = if permuted {
                                add(mul(cx.lane.quad.clone(), u(2)), u(hi_k))
                            } else {
                                add(cx.lane.quad.clone(), u(4 * hi_k))
                            };
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
                out.extend(bf16_view(self, &v.regs, v, false, None));
            }
            return Ok(out);
        };
        // -- the e4m3 form: every word of the e4m3 views loaded once, their largest |x|
        let mut native = Vec::new();
        let mx = self.fresh("q_absmax");
        native.push(Stmt::Var {
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
                                native.push(let_(&pair[n], load(h, w)));
                                let xv = var(&pair[n], Ty::U32);
                                native.push(Stmt::Assign {
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
            native.push(intr(Intrinsic::ShflXor {
                dst: other.clone(),
                value: var(&mx, Ty::F32),
                lane_mask: mask,
            }));
            native.push(Stmt::Assign {
                name: mx.clone(),
                value: bin(BinOp::Max, var(&mx, Ty::F32), var(&other, Ty::F32)),
            });
        }
        // σ = 2^(134 - e) for the max's biased exponent e (max·σ in [128, 256)), at most
        // 2^126 so that 1/σ stays a normal f32
        let e = bin(
            BinOp::BitAnd,
            bin(
                BinOp::Shr,
                Expr::Call(Func::F32Bits, vec![var(&mx, Ty::F32)]),
                u(23),
            ),
            u(0xFF),
        );
        let field = self.fresh("q_scale_exp");
        native.push(let_(
            &field,
            Expr::Select(
                Box::new(lt(e.clone(), u(8))),
                Box::new(u(253)),
                Box::new(bin(BinOp::Sub, u(261), e)),
            ),
        ));
        let fv = var(&field, Ty::U32);
        let sg_name = self.fresh("q_scale");
        native.push(let_(
            &sg_name,
            Expr::Call(Func::F32FromBits, vec![bin(BinOp::Shl, fv.clone(), u(23))]),
        ));
        let sg = var(&sg_name, Ty::F32);
        native.push(Stmt::PrivateStore {
            arr: unscale.clone(),
            index: u(0),
            value: Expr::Call(
                Func::F32FromBits,
                vec![bin(BinOp::Shl, bin(BinOp::Sub, u(254), fv), u(23))],
            ),
        });
        for (v, vw) in r.views.iter().zip(&words) {
            if !v.permuted {
                native.extend(bf16_view(self, &v.regs, v, false, Some(&sg)));
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
        // -- the bf16 form: the e4m3 views permuted, nothing scaled
        let mut fallback = vec![Stmt::PrivateStore {
            arr: unscale,
            index: u(0),
            value: Expr::F32(1.0),
        }];
        for v in &r.views {
            if v.permuted {
                fallback.extend(bf16_view(self, &v.bf_regs, v, true, None));
            } else {
                fallback.extend(bf16_view(self, &v.regs, v, false, None));
            }
        }
        out.push(Stmt::If {
            cond: Expr::Call(Func::E4m3MmaNative, vec![]),
            then: native,
            els: fallback,
        });
        Ok(out)
    }

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
        // the k16 form: bf16 operands (an e4m3 B widened pair by pair, the A view in its bf16
        // form) — the only one for bf16 B, and e4m3's where the GPU has no e4m3 product
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
                    add(
                        bb.clone(),
                        mul(
                            add(
                                add(nf.clone(), mul(jv.clone(), u(8))),
                                bin(BinOp::BitAnd, cx.lane.r16.clone(), u(7)),
                            ),
                            u(tb.stride),
                        ),
                    ),
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
                let names = [cx.fresh("e4m3_pair"), cx.fresh("e4m3_pair")];
                let (lets, lo, hi) = widen(priv_load_u(&raw, u(0)), false, [&names[0], &names[1]]);
                n_body.extend(lets);
                n_body.push(Stmt::PrivateStore {
                    arr: bf.clone(),
                    index: u(0),
                    value: lo,
                });
                n_body.push(Stmt::PrivateStore {
                    arr: bf.clone(),
                    index: u(1),
                    value: hi,
                });
            } else {
                // bf16 [N, K]: matrices (n 0-7, k 0-7), (n 0-7, k 8-15) via x2
                let word = add(
                    add(
                        bb.clone(),
                        mul(
                            add(
                                add(nf.clone(), mul(jv.clone(), u(8))),
                                bin(BinOp::BitAnd, cx.lane.r16.clone(), u(7)),
                            ),
                            u(tb.stride),
                        ),
                    ),
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
                                if e4m3 { &v.bf_regs } else { &v.regs },
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
            m_body.push(intr(Intrinsic::MmaBf16 {
                c: target.clone(),
                c0: add(chain0, mul(add(mul(iv.clone(), u(ng)), jv.clone()), u(4))),
                a: af.clone(),
                a0: u(0),
                b: bf.clone(),
                b0: u(0),
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
                            value: Expr::Call(
                                Func::Fma,
                                vec![
                                    priv_load(&ks.temp, at.clone()),
                                    var(&sc_name, Ty::F32),
                                    priv_load(&ks.part, at),
                                ],
                            ),
                        },
                    ],
                )],
            ));
        }
        out.extend(body);
        Ok(())
    }

    /// The e4m3 `[N, K]` split-K product: per k32 step of the warp's slice, B's bytes by one
    /// `ldmatrix.x2` per n fragment (row n; k bytes 0-15, then 16-31: the m16n8k32 B layout
    /// as they land, nothing converted), times the resident view's `hi` terms, then its `lo`
    /// terms, into the same fragments (the fm x ng fragments are the independent chains; a
    /// second set of accumulators for the `lo` terms spilled the 32-head kernel).
    #[allow(clippy::too_many_arguments)]
    fn ksplit_e4m3(
        &mut self,
        body: &mut Vec<Stmt>,
        target: &str,
        v: &ResidentView,
        tb: &TileInfo,
        bb: Expr,
        b: &TileView,
        nf: &Expr,
        fm: u32,
        ng: u32,
        slice: Expr,
    ) {
        let steps = v.cols / 32 / v.gk;
        let af = self.private("a_frag", Ty::U32, 4);
        let bf = self.private("b_frag", Ty::U32, 2);
        let (kk, i, j) = (self.fresh("kk"), self.fresh("mi"), self.fresh("nj"));
        let (kkv, iv, jv) = (var(&kk, Ty::U32), var(&i, Ty::U32), var(&j, Ty::U32));
        let k_step = add(mul(slice, u(steps)), kkv.clone());
        let word = add(
            add(
                bb,
                mul(
                    add(
                        add(nf.clone(), mul(jv.clone(), u(8))),
                        bin(BinOp::BitAnd, self.lane.r16.clone(), u(7)),
                    ),
                    u(tb.stride),
                ),
            ),
            add(
                add(u(b.col0 / 4), mul(k_step, u(8))),
                mul(bin(BinOp::Shr, self.lane.r16.clone(), u(3)), u(4)),
            ),
        );
        let mut n_body = vec![intr(Intrinsic::LdMatrix {
            count: 2,
            trans: false,
            arr: b.tile.clone(),
            word,
            dst: bf.clone(),
            dst0: u(0),
        })];
        let mut m_body = Vec::new();
        for regs in [&v.regs, &v.lo_regs] {
            for r in 0..4 {
                m_body.push(Stmt::PrivateStore {
                    arr: af.clone(),
                    index: u(r),
                    value: priv_load_u(
                        regs,
                        add(mul(add(mul(iv.clone(), u(steps)), kkv.clone()), u(4)), u(r)),
                    ),
                });
            }
            m_body.push(intr(Intrinsic::MmaE4m3 {
                c: target.to_string(),
                c0: mul(add(mul(iv.clone(), u(ng)), jv.clone()), u(4)),
                a: af.clone(),
                a0: u(0),
                b: bf.clone(),
                b0: u(0),
            }));
        }
        n_body.push(for_const(&i, fm, m_body));
        body.push(for_const(&kk, steps, vec![for_const(&j, ng, n_body)]));
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
        // the holders of S's rows add the slices into their fragments
        let (f2, h2, e2, g2) = (
            self.fresh("frag"),
            self.fresh("half"),
            self.fresh("e"),
            self.fresh("g"),
        );
        let (fv2, hv2, ev2) = (var(&f2, Ty::U32), var(&h2, Ty::U32), var(&e2, Ty::U32));
        let row2 = add(
            add(info.row0.clone(), mul(hv2.clone(), u(8))),
            self.lane.group.clone(),
        );
        let col2 = add(
            add(info.col0.clone(), mul(fv2.clone(), u(8))),
            add(mul(self.lane.quad.clone(), u(2)), ev2.clone()),
        );
        let idx = add(add(mul(fv2, u(4)), mul(hv2, u(2))), ev2);
        let sum = self.fresh("sum");
        let sv = var(&sum, Ty::F32);
        let mut inner = vec![Stmt::Var {
            name: sum.clone(),
            value: priv_load(acc, idx.clone()),
        }];
        let cell = self.fresh("cell");
        inner.push(let_(&cell, add(mul(row2, u(stride)), col2)));
        inner.push(for_const(
            &g2,
            ks.gk,
            vec![Stmt::Assign {
                name: sum.clone(),
                value: bin(
                    BinOp::Add,
                    sv.clone(),
                    Expr::SharedLoad {
                        arr: scratch.clone(),
                        ty: Ty::F32,
                        index: Box::new(add(
                            mul(var(&g2, Ty::U32), u(rows * stride)),
                            var(&cell, Ty::U32),
                        )),
                    },
                ),
            }],
        ));
        inner.push(Stmt::PrivateStore {
            arr: acc.to_string(),
            index: idx,
            value: sv,
        });
        let lp = for_const(
            &f2,
            info.fnw,
            vec![for_const(&h2, 2, vec![for_const(&e2, 2, inner)])],
        );
        out.extend(self.for_used_warps(&info, vec![lp]));
        Ok(())
    }

    /// B fragments of an e4m3 `[K, N]` operand for n fragment pairs, each widened value
    /// times its k row's scale when `k_scales` (the lane's rows `2q, 2q + 1, 2q + 8, 2q + 9`)
    /// is given: see [`Cx::mma_e4m3_kn`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn e4m3_kn_b(
        &mut self,
        tb: &TileInfo,
        base: Expr,
        k_row: Expr,
        n_byte: Expr,
        raw: &str,
        bf: &str,
        k_scales: Option<&[Expr; 4]>,
    ) -> Vec<Stmt> {
        // matrices (k 0-7, 16 columns), (k 8-15, same columns): lanes 0-15 give the rows
        let word = add(
            add(
                base,
                mul(
                    add(k_row, bin(BinOp::BitAnd, self.lane.r16.clone(), u(15))),
                    u(tb.stride),
                ),
            ),
            bin(BinOp::Shr, n_byte, u(2)),
        );
        let mut out = vec![intr(Intrinsic::LdMatrix {
            count: 2,
            trans: true,
            arr: tb.decl.name.clone(),
            word,
            dst: raw.to_string(),
            dst0: u(0),
        })];
        // even fragment: b0 = bytes (0, 2) of the k 0-7 matrix, b1 = of the k 8-15 one;
        // odd fragment: bytes (1, 3)
        let names: Vec<String> = (0..4).map(|_| self.fresh("e4m3_pair")).collect();
        // with scales: matrix 0 holds k rows 2q, 2q + 1 of each lane, matrix 1 2q + 8, 2q + 9;
        // loaded after the fragment's ldmatrix, so they are not held across it
        let k_scales = k_scales.map(|k| self.bind_k_scales(k, &mut out));
        let pair = |i: usize| {
            k_scales
                .as_ref()
                .map(|k| (k[2 * i].clone(), k[2 * i + 1].clone()))
        };
        let (l0, e0, o0) = widen_scaled(
            priv_load_u(raw, u(0)),
            true,
            [&names[0], &names[1]],
            pair(0),
        );
        let (l1, e1, o1) = widen_scaled(
            priv_load_u(raw, u(1)),
            true,
            [&names[2], &names[3]],
            pair(1),
        );
        out.extend(l0);
        out.extend(l1);
        for (k, v) in [(0, e0), (1, e1), (2, o0), (3, o1)] {
            out.push(Stmt::PrivateStore {
                arr: bf.to_string(),
                index: u(k),
                value: v,
            });
        }
        out
    }

    /// The A fragment registers `af[0..4]` times the per-k scales of a `[K, N]` product's
    /// rows `k0 + 2q + {0, 1, 8, 9}`.
    pub(super) fn scale_a_frag(
        &mut self,
        af: &str,
        a0: Expr,
        scale: &(String, Expr),
        k0: Expr,
    ) -> Result<Vec<Stmt>> {
        let mut out = Vec::new();
        let ks = self.k_scales(scale, k0)?;
        let bound = self.bind_k_scales(&ks, &mut out);
        let sv = |k: usize| bound[k].clone();
        for r in 0..4u32 {
            let (lo, hi) = if r < 2 {
                (sv(0), sv(1))
            } else {
                (sv(2), sv(3))
            };
            let idx = add(a0.clone(), u(r));
            out.push(Stmt::PrivateStore {
                arr: af.to_string(),
                index: idx.clone(),
                value: scale_pair(priv_load_u(af, idx), lo, hi),
            });
        }
        Ok(out)
    }

    /// The per-k scales of a `[K, N]` product's rows `k0 + 2q + {0, 1, 8, 9}` (q: the
    /// lane's quad), the k rows of this lane's A and B fragment values, as expressions: the
    /// caller binds them ([`Cx::bind_k_scales`]) where they are used, so they are not held in
    /// registers across the fragment loads (the sm_120 32-head kernel is at 255).
    pub(super) fn k_scales(&mut self, scale: &(String, Expr), k0: Expr) -> Result<[Expr; 4]> {
        let q2 = mul(self.lane.quad.clone(), u(2));
        let at = |off: u32| self.expr(&scale_at(scale, add(add(k0.clone(), q2.clone()), u(off))));
        Ok([at(0)?, at(1)?, at(8)?, at(9)?])
    }

    /// Lets in `out` holding the four k scales; their values.
    fn bind_k_scales(&mut self, ks: &[Expr; 4], out: &mut Vec<Stmt>) -> [Expr; 4] {
        let names: Vec<String> = (0..4).map(|_| self.fresh("k_scale")).collect();
        for (n, e) in names.iter().zip(ks.iter()) {
            out.push(let_(n, e.clone()));
        }
        let v = |i: usize| var(&names[i], Ty::F32);
        [v(0), v(1), v(2), v(3)]
    }
}

impl Cx<'_> {
    /// `acc += A · B` with B an e4m3 `[K, N]` view (optionally scaled per k row) and A bf16 in
    /// shared memory: the accumulator is interleaved (fragment pair `(2j, 2j+1)` = 16
    /// columns, even and odd).
    pub(super) fn mma_e4m3_kn(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        scale: Option<(String, Expr)>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.acc(acc)?.clone();
        if !info.interleave {
            return Err(self.err(format!(
                "{acc}: an e4m3 [K, N] product needs an interleaved accumulator"
            )));
        }
        let ta = self.tile(&a.tile)?.clone();
        let tb = self.tile(&b.tile)?.clone();
        if a.cols % 16 != 0 || a.col0 % 8 != 0 || b.col0 % 16 != 0 {
            return Err(self.err(format!(
                "mma into {acc}: K must be a multiple of 16 and the e4m3 columns start on 16 bytes"
            )));
        }
        let (fmw, fnw) = (info.fmw, info.fnw);
        let ab = self.tile_base(&ta)?;
        let bb = self.tile_base(&tb)?;
        let af = self.private("a_frag", Ty::U32, 4 * fmw);
        let bf = self.private("b_frag", Ty::U32, 4);
        let raw = self.private("b_raw", Ty::U32, 2);
        let (kk, i, jp) = (self.fresh("kk"), self.fresh("mi"), self.fresh("np"));
        let (kkv, iv, jpv) = (var(&kk, Ty::U32), var(&i, Ty::U32), var(&jp, Ty::U32));
        let a_base = self.fresh("a_lane_word");
        let mut body = vec![let_(
            &a_base,
            add(
                add(
                    ab,
                    mul(
                        add(add(u(a.row0), info.row0.clone()), self.lane.r16.clone()),
                        u(ta.stride),
                    ),
                ),
                bin(BinOp::Shr, add(u(a.col0), self.lane.c8.clone()), u(1)),
            ),
        )];
        let mut k_body = vec![for_const(
            &i,
            fmw,
            vec![intr(Intrinsic::LdMatrix {
                count: 4,
                trans: false,
                arr: a.tile.clone(),
                word: add(
                    var(&a_base, Ty::U32),
                    add(mul(iv.clone(), u(16 * ta.stride)), mul(kkv.clone(), u(8))),
                ),
                dst: af.clone(),
                dst0: mul(iv.clone(), u(4)),
            })],
        )];
        let k_row = add(u(b.row0), mul(kkv.clone(), u(16)));
        let n_byte = add(add(u(b.col0), info.col0.clone()), mul(jpv.clone(), u(16)));
        let mma_pairs = |pair_body: &mut Vec<Stmt>| {
            for (half, b0) in [(0u32, 0u32), (1, 2)] {
                pair_body.push(for_const(
                    &i,
                    fmw,
                    vec![intr(Intrinsic::MmaBf16 {
                        c: acc.to_string(),
                        c0: mul(
                            add(
                                mul(iv.clone(), u(fnw)),
                                add(mul(jpv.clone(), u(2)), u(half)),
                            ),
                            u(4),
                        ),
                        a: af.clone(),
                        a0: mul(iv.clone(), u(4)),
                        b: bf.clone(),
                        b0: u(b0),
                    })],
                ));
            }
        };
        match &scale {
            None => {
                let mut pair_body = self.e4m3_kn_b(&tb, bb, k_row, n_byte, &raw, &bf, None);
                mma_pairs(&mut pair_body);
                k_body.push(for_const(&jp, fnw / 2, pair_body));
            }
            Some(sc) => {
                // The scales go on B (V, widened anyway), not on A (P): a scaled A fragment
                // is a bf16 unpack, two multiplies and a pack per register, per m fragment,
                // per tile; B's are two multiplies per widened register (1.02-1.06x on the
                // H200, benches/NOTES.md v15). Either way one bf16 rounding of a scaled
                // value. Where the GPU has the e4m3 score product (sm_89, sm_120) q is held
                // as two e4m3 terms and the 32-head kernel is at 255 registers: B's scales
                // spilled 8 B on sm_120 there, so those keep scaling A.
                let ks = self.k_scales(sc, k_row.clone())?;
                let mut on_b = Vec::new();
                let mut pair_b = self.e4m3_kn_b(
                    &tb,
                    bb.clone(),
                    k_row.clone(),
                    n_byte.clone(),
                    &raw,
                    &bf,
                    Some(&ks),
                );
                mma_pairs(&mut pair_b);
                on_b.push(for_const(&jp, fnw / 2, pair_b));
                let mut on_a = Vec::new();
                for m in 0..fmw {
                    on_a.extend(self.scale_a_frag(&af, u(4 * m), sc, k_row.clone())?);
                }
                let mut pair_a = self.e4m3_kn_b(&tb, bb, k_row, n_byte, &raw, &bf, None);
                mma_pairs(&mut pair_a);
                on_a.push(for_const(&jp, fnw / 2, pair_a));
                k_body.push(Stmt::If {
                    cond: Expr::Call(Func::E4m3MmaNative, vec![]),
                    then: on_a,
                    els: on_b,
                });
            }
        }
        body.push(for_const(&kk, a.cols / 16, k_body));
        out.extend(self.for_used_warps(&info, body));
        Ok(())
    }
}

fn priv_load_u(arr: &str, index: Expr) -> Expr {
    Expr::PrivateLoad {
        arr: arr.into(),
        ty: Ty::U32,
        index: Box::new(index),
    }
}

#[allow(dead_code)]
fn guard(cond: Expr, then: Vec<Stmt>) -> Stmt {
    Stmt::If {
        cond,
        then,
        els: vec![],
    }
}

#[allow(dead_code)]
fn lt_(a: Expr, b: Expr) -> Expr {
    lt(a, b)
}
