//! Writes into shared tiles: an accumulator's element pairs ([`TileOp::AccToShared`],
//! [`TileOp::AccForEach`]), [`TileOp::SharedMap`], [`TileOp::DequantRows`], and the split
//! `hi + lo` bf16 planes.

use super::context::Cx;
use super::e4m3::widen_scaled;
use crate::kir::expr::{
    add, bin, f32_from_bits, for_const, intr, let_, local_id, mul, priv_load, shared_load,
    tile_pair_store, u, var,
};
use crate::kir::ir::*;
use crate::Result;

impl Cx<'_> {
    /// For each element pair this thread holds of `acc`: `body(private index of the first,
    /// of the second)`, with `row`, `col` bound. Pairs are (c0, c1) and (c2, c3) of each
    /// fragment; in an interleaved accumulator (see `ksplit`), value `e` of fragments `2j` and
    /// `2j + 1`.
    pub(super) fn for_each_pair(
        &mut self,
        acc: &str,
        row: &str,
        col: &str,
        body: impl FnOnce(&mut Self, Expr, Expr) -> Result<Vec<Stmt>>,
    ) -> Result<Vec<Stmt>> {
        let info = self.acc(acc)?.clone();
        if let Some(rf) = info.rows.clone() {
            let lp = self.rows_pairs(&rf, row, col, body)?;
            return Ok(self.for_used_warps(&info, vec![lp]));
        }
        let (f, h) = (self.fresh("frag"), self.fresh("half"));
        let (fv, hv) = (var(&f, Ty::U32), var(&h, Ty::U32));
        if info.interleave {
            let e = self.fresh("e");
            let ev = var(&e, Ty::U32);
            let half_n = info.fnw / 2;
            // fragment pair `f`: fragments (f / half_n) * fnw + 2 (f % half_n) and the next
            let fa = add(
                mul(bin(BinOp::Div, fv.clone(), u(half_n)), u(info.fnw)),
                mul(bin(BinOp::Rem, fv.clone(), u(half_n)), u(2)),
            );
            let v = add(mul(hv.clone(), u(2)), ev.clone());
            let at0 = add(mul(fa.clone(), u(4)), v.clone());
            let at1 = add(mul(add(fa, u(1)), u(4)), v);
            let mut inner = vec![
                let_(
                    row,
                    add(
                        add(
                            info.row0.clone(),
                            mul(bin(BinOp::Div, fv.clone(), u(half_n)), u(16)),
                        ),
                        add(mul(hv, u(8)), self.lane.group.clone()),
                    ),
                ),
                let_(
                    col,
                    add(
                        add(
                            info.col0.clone(),
                            mul(bin(BinOp::Rem, fv, u(half_n)), u(16)),
                        ),
                        add(mul(self.lane.quad.clone(), u(4)), mul(ev, u(2))),
                    ),
                ),
            ];
            inner.extend(body(self, at0, at1)?);
            let lp = for_const(
                &f,
                info.frags() / 2,
                vec![for_const(&h, 2, vec![for_const(&e, 2, inner)])],
            );
            return Ok(self.for_used_warps(&info, vec![lp]));
        }
        let at = add(mul(fv.clone(), u(4)), mul(hv.clone(), u(2)));
        let mut inner = vec![
            let_(
                row,
                add(
                    add(
                        info.row0.clone(),
                        mul(bin(BinOp::Div, fv.clone(), u(info.fnw)), u(16)),
                    ),
                    add(mul(hv, u(8)), self.lane.group.clone()),
                ),
            ),
            let_(
                col,
                add(
                    add(
                        info.col0.clone(),
                        mul(bin(BinOp::Rem, fv, u(info.fnw)), u(8)),
                    ),
                    mul(self.lane.quad.clone(), u(2)),
                ),
            ),
        ];
        let at1 = add(at.clone(), u(1));
        inner.extend(body(self, at, at1)?);
        let lp = for_const(&f, info.frags(), vec![for_const(&h, 2, inner)]);
        Ok(self.for_used_warps(&info, vec![lp]))
    }

    /// The stores of [`TileOp::AccToShared`] (no barriers): each thread writes the element
    /// pairs it holds.
    pub(super) fn acc_to_shared_stores(&mut self, acc: &str, dst: &str) -> Result<Vec<Stmt>> {
        let info = self.tile(dst)?.clone();
        if info.ringed {
            return Err(self.err(format!(
                "accumulator {acc} written into {dst}, a tile a pipeline gathers into"
            )));
        }
        let (stride, elem, plane) = (info.stride, info.store, info.plane_words());
        let split = info
            .split
            .then(|| ["x0", "x1", "hi"].map(|n| self.fresh(n)));
        let (row, col) = (self.fresh("row"), self.fresh("col"));
        let (rv, cv) = (var(&row, Ty::U32), var(&col, Ty::U32));
        let acc_name = acc.to_string();
        let dst_name = dst.to_string();
        let s = self.for_each_pair(acc, &row, &col, |_, at, at1| {
            let v0 = priv_load(&acc_name, at);
            let v1 = priv_load(&acc_name, at1);
            Ok(match elem {
                TileElem::Bf16 if split.is_some() => {
                    let at = add(mul(rv.clone(), u(stride)), bin(BinOp::Shr, cv, u(1)));
                    let names = split.clone().unwrap_or_default();
                    split_store(&dst_name, at, plane, v0, v1, &names)
                }
                e => tile_pair_store(&dst_name, e, rv.clone(), stride, cv, v0, v1),
            })
        })?;
        Ok(s)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn shared_map(
        &mut self,
        dst: &str,
        row: &str,
        col: &str,
        (col0, cols): (u32, u32),
        value: &Expr,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.tile(dst)?.clone();
        let base = self.tile_base(&info)?;
        let (rows, stride, elem) = (info.decl.rows, info.stride, info.store);
        let per_word = 4 / elem.bytes();
        if col0 % per_word != 0 || cols % per_word != 0 || col0 + cols > info.decl.cols {
            return Err(self.err(format!(
                "shared_map into {dst}: columns {col0}..{} are not whole words of its {} storage",
                col0 + cols,
                if info.store != info.decl.elem {
                    "bf16"
                } else {
                    "row"
                }
            )));
        }
        let (word0, words_per_row) = (col0 / per_word, cols / per_word);
        let value = self.expr(value)?;
        let col_plus = |k: u32| {
            let c = col.to_string();
            value.clone().map(&mut |x| match x {
                Expr::Var(ref n, Ty::U32) if *n == c => add(x, u(k)),
                other => other,
            })
        };
        // One thread per 32-bit word of the window (padding excluded).
        let idx = self.fresh("word_i");
        let iv = var(&idx, Ty::U32);
        let word_value = match elem {
            TileElem::F32 => col_plus(0),
            TileElem::Bf16 => Expr::Call(Func::PackBf16x2, vec![col_plus(0), col_plus(1)]),
            TileElem::F16 => Expr::Call(Func::PackF16x2, vec![col_plus(0), col_plus(1)]),
            TileElem::U8 | TileElem::E4m3 => {
                let mut w = bin(BinOp::BitAnd, col_plus(0), u(0xFF));
                for k in 1..4 {
                    let byte = bin(BinOp::BitAnd, col_plus(k), u(0xFF));
                    w = bin(BinOp::BitOr, w, bin(BinOp::Shl, byte, u(8 * k)));
                }
                w
            }
        };
        let rv = var(row, Ty::U32);
        let cw = self.fresh("col_word");
        let at = add(add(base, mul(rv.clone(), u(stride))), var(&cw, Ty::U32));
        let store = if info.split {
            let names = ["x0", "x1", "hi"].map(|n| self.fresh(n));
            split_store(
                dst,
                at,
                info.plane_words(),
                col_plus(0),
                col_plus(1),
                &names,
            )
        } else {
            vec![Stmt::SharedStore {
                arr: dst.into(),
                index: at,
                value: word_value,
            }]
        };
        out.push(Stmt::Barrier);
        out.push(Stmt::For {
            var: idx,
            start: local_id(),
            end: u(rows * words_per_row),
            step: u(self.w),
            body: [
                vec![
                    let_(row, bin(BinOp::Div, iv.clone(), u(words_per_row))),
                    let_(&cw, add(bin(BinOp::Rem, iv, u(words_per_row)), u(word0))),
                    let_(col, mul(var(&cw, Ty::U32), u(per_word))),
                ],
                store,
            ]
            .concat(),
        });
        out.push(Stmt::Barrier);
        Ok(())
    }
}

impl Cx<'_> {
    /// [`TileOp::DequantRows`]: each thread takes one word of the source (four e4m3 values)
    /// at a time — two pair conversions ([`Func::E4m3x2Prep`]), one scale, two bf16x2 words
    /// stored — between two barriers. Where warp groups split the heads over one ring, the
    /// destination is one tile for the whole workgroup (not a copy per group: see
    /// `ws::lower_ws`): every thread of every group takes its share, and the barriers are the
    /// workgroup's, so each row is decoded once for all the groups' warps.
    pub(super) fn dequant_rows(
        &mut self,
        (dst, src): (&str, &str),
        (row, group, per): (&str, &str, u32),
        scale: &Expr,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let (d, sr) = (self.tile(dst)?.clone(), self.tile(src)?.clone());
        if d.store != TileElem::Bf16 || d.split || sr.store != TileElem::E4m3 {
            return Err(self.err(format!(
                "dequant_rows into {dst}: the tensor-core lowering decodes an e4m3 tile into a \
                 plain bf16 one"
            )));
        }
        let (db, sb) = (self.tile_base(&d)?, self.tile_base(&sr)?);
        let units_per_row = d.decl.cols / 4;
        let units = d.decl.rows * units_per_row;
        let scale = self.expr(scale)?;
        let (start, step, barrier) = match self.group_expr().filter(|_| self.shares_ring()) {
            Some(g) => {
                let total = self.w * self.groups;
                (
                    add(mul(g, u(self.w)), local_id()),
                    total,
                    intr(Intrinsic::NamedBarrier {
                        id: 0,
                        threads: total,
                    }),
                )
            }
            None => (local_id(), self.w, Stmt::Barrier),
        };
        let (i, c4, x) = (
            self.fresh("unit"),
            self.fresh("unit_col"),
            self.fresh("e4m3x4"),
        );
        let (sc, p0, p1) = (
            self.fresh("unit_scale"),
            self.fresh("prep"),
            self.fresh("prep"),
        );
        let iv = var(&i, Ty::U32);
        let (rv, cv, xv) = (var(row, Ty::U32), var(&c4, Ty::U32), var(&x, Ty::U32));
        let scv = var(&sc, Ty::F32);
        // the operands' own widening of four bytes into two bf16x2, each value times its scale
        let (prep, w0, w1) = widen_scaled(xv, false, [&p0, &p1], Some((scv.clone(), scv)));
        let at = add(add(db, mul(rv.clone(), u(d.stride))), mul(cv.clone(), u(2)));
        let mut body = vec![
            let_(row, bin(BinOp::Div, iv.clone(), u(units_per_row))),
            let_(&c4, bin(BinOp::Rem, iv, u(units_per_row))),
            let_(group, bin(BinOp::Div, mul(cv.clone(), u(4)), u(per))),
            let_(
                &x,
                shared_load(src, Ty::U32, add(add(sb, mul(rv, u(sr.stride))), cv)),
            ),
            let_(&sc, scale),
        ];
        body.extend(prep);
        body.push(Stmt::SharedStore {
            arr: dst.into(),
            index: at.clone(),
            value: w0,
        });
        body.push(Stmt::SharedStore {
            arr: dst.into(),
            index: add(at, u(1)),
            value: w1,
        });
        out.push(barrier.clone());
        out.push(Stmt::For {
            var: i,
            start,
            end: u(units),
            step: u(step),
            body,
        });
        out.push(barrier);
        Ok(())
    }
}

/// `hi` then `lo` words of two f32 values in a split tile: `hi = bf16x2(v0, v1)`,
/// `lo = bf16x2(v0 - hi0, v1 - hi1)`. `names`: fresh names for v0, v1 and hi.
pub(super) fn split_store(
    arr: &str,
    at: Expr,
    plane: u32,
    v0: Expr,
    v1: Expr,
    names: &[String; 3],
) -> Vec<Stmt> {
    let [x0, x1, hi] = names;
    let (x0v, x1v, hiv) = (var(x0, Ty::F32), var(x1, Ty::F32), var(hi, Ty::U32));
    let hi0 = f32_from_bits(bin(BinOp::Shl, hiv.clone(), u(16)));
    let hi1 = f32_from_bits(bin(BinOp::BitAnd, hiv.clone(), u(0xFFFF_0000)));
    vec![
        let_(x0, v0),
        let_(x1, v1),
        let_(
            hi,
            Expr::Call(Func::PackBf16x2, vec![x0v.clone(), x1v.clone()]),
        ),
        Stmt::SharedStore {
            arr: arr.into(),
            index: at.clone(),
            value: hiv,
        },
        Stmt::SharedStore {
            arr: arr.into(),
            index: add(at, u(plane)),
            value: Expr::Call(
                Func::PackBf16x2,
                vec![bin(BinOp::Sub, x0v, hi0), bin(BinOp::Sub, x1v, hi1)],
            ),
        },
    ]
}
