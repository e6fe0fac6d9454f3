//! Gathers of global rows into shared tiles: `cp.async` copies spread over the threads, an
//! address phase apart from the copy phase.

use super::context::Cx;
use crate::kir::expr::{add, bin, for_const, intr, let_, local_id, lt, mul, u, var};
use crate::kir::ir::*;
use crate::Result;

pub(super) struct GatherPlan {
    pub(super) rows: u32,
    pub(super) tpr: u32,
    pub(super) rows_per_pass: u32,
    pub(super) passes: u32,
}

/// One row gather of a pipeline's load stage ([`TileOp::GatherRows`]), by reference, with
/// the comment that came before it; reads as the [`RowGather`] it wraps.
pub(super) struct Gather<'a> {
    pub(super) op: &'a RowGather,
    pub(super) comment: Option<String>,
}

impl std::ops::Deref for Gather<'_> {
    type Target = RowGather;
    fn deref(&self) -> &RowGather {
        self.op
    }
}

pub(super) fn floor_pow2(x: u32) -> u32 {
    if x == 0 {
        0
    } else {
        1 << (31 - x.leading_zeros())
    }
}

impl Cx<'_> {
    /// The gathers of pipeline `v`'s load stage, which may hold only those (and comments).
    pub(super) fn load_gathers<'a>(&self, v: &str, load: &'a [Stmt]) -> Result<Vec<Gather<'a>>> {
        let mut gathers = Vec::new();
        let mut comment = None;
        for st in load {
            match st {
                Stmt::Tile(TileOp::GatherRows(op)) => gathers.push(Gather {
                    op,
                    comment: comment.take(),
                }),
                Stmt::Comment(c) => comment = Some(c.clone()),
                other => {
                    return Err(self.err(format!(
                        "pipeline {v}: the load stage may hold only gathers, found {other:?}"
                    )))
                }
            }
        }
        Ok(gathers)
    }

    /// How a gather spreads over the threads: `tpr` consecutive threads share a row, each
    /// taking every `tpr`-th 16-byte chunk (so a warp reads contiguous runs); `passes` rounds
    /// of `W / tpr` rows.
    pub(super) fn gather_plan(&self, g: &RowGather) -> Result<GatherPlan> {
        let (dst, dst_word0, words) = (&g.dst, g.dst_word0, g.words);
        let info = self.tile(dst)?;
        let rows = info.decl.rows;
        if dst_word0 + words > info.stride {
            return Err(self.err(format!(
                "gather into {dst}: words {dst_word0}..{} exceed the row",
                dst_word0 + words
            )));
        }
        let chunks = words / 4;
        let tpr = floor_pow2((self.w / rows).max(1)).min(chunks.max(1).next_power_of_two());
        let rows_per_pass = self.w / tpr;
        Ok(GatherPlan {
            rows,
            tpr,
            rows_per_pass,
            passes: rows.div_ceil(rows_per_pass),
        })
    }

    /// `row` of pass `p` for this thread.
    pub(super) fn gather_row(plan: &GatherPlan, p: Expr) -> Expr {
        add(
            bin(BinOp::Div, local_id(), u(plan.tpr)),
            mul(p, u(plan.rows_per_pass)),
        )
    }

    /// The address phase of a gather: each thread's source word (or −1) per pass into the
    /// private array `srcs`. Its global loads (e.g. of top-k indices) complete while other
    /// work runs, when the copies are issued later.
    pub(super) fn gather_addr(
        &mut self,
        plan: &GatherPlan,
        g: &RowGather,
        srcs: &str,
    ) -> Result<Stmt> {
        let p = self.fresh("gather_pass");
        let r = self.fresh("gather_row");
        let rv = var(&r, Ty::U32);
        let store = |value: Expr| Stmt::PrivateStore {
            arr: srcs.into(),
            index: var(&p, Ty::U32),
            value,
        };
        let body = vec![
            let_(&r, Self::gather_row(plan, var(&p, Ty::U32))),
            Stmt::If {
                cond: lt(rv.clone(), u(plan.rows)),
                then: vec![let_(&g.row, rv), store(self.expr(&g.src_word)?)],
                els: vec![store(Expr::I32(-1))],
            },
        ];
        Ok(for_const(&p, plan.passes, body))
    }

    /// The copy phase of a gather: issue the copies (no commit, no wait) from the source
    /// words in `srcs`.
    pub(super) fn gather_copy(
        &mut self,
        plan: &GatherPlan,
        g: &RowGather,
        srcs: &str,
    ) -> Result<Stmt> {
        let (dst, src, flags) = (g.dst.as_str(), g.src.as_str(), g.flags.as_deref());
        let (dst_word0, words) = (g.dst_word0, g.words);
        let info = self.tile(dst)?.clone();
        let flag_at = match flags {
            Some(f) => {
                let t = self.tile(f)?.clone();
                Some((f.to_string(), self.tile_base(&t)?))
            }
            None => None,
        };
        let base = self.tile_base(&info)?;
        let tpr = plan.tpr;
        let chunks = words / 4;
        let p = self.fresh("gather_pass");
        let r = self.fresh("gather_row");
        let rv = var(&r, Ty::U32);
        let (sw, valid, dbase) = (
            self.fresh("src_word"),
            self.fresh("src_valid"),
            self.fresh("dst_word"),
        );
        let (swv, validv, dbv) = (
            var(&sw, Ty::U32),
            var(&valid, Ty::Bool),
            var(&dbase, Ty::U32),
        );
        let src_i = self.fresh("src_i32");
        let sub = bin(BinOp::Rem, local_id(), u(tpr));
        // copies of `bytes` for element indices c = sub + i·tpr < n, at word offset w0: a
        // constant trip count, so the loop unrolls and each copy's offset is an immediate
        let copy_loop = |cx: &mut Self, bytes: u32, n: u32, w0: u32| -> Stmt {
            let (i, c) = (cx.fresh("copy_i"), cx.fresh("chunk"));
            let cv = var(&c, Ty::U32);
            let step = bytes / 4;
            // this thread's first element is `sub`; the rest are constant offsets from it,
            // printed as separate pointer terms so they become instruction immediates
            let lane0 = mul(sub.clone(), u(step));
            let off = add(u(w0), mul(var(&i, Ty::U32), u(tpr * step)));
            let copy = intr(Intrinsic::CpAsync {
                bytes,
                dst: dst.to_string(),
                dst_word: bin(BinOp::Add, add(dbv.clone(), lane0.clone()), off.clone()),
                src: src.to_string(),
                src_word: bin(BinOp::Add, add(swv.clone(), lane0), off),
                valid: validv.clone(),
            });
            let body = if n % tpr == 0 {
                vec![copy]
            } else {
                vec![Stmt::If {
                    cond: lt(cv.clone(), u(n)),
                    then: vec![copy],
                    els: vec![],
                }]
            };
            let mut full = vec![let_(&c, add(sub.clone(), mul(var(&i, Ty::U32), u(tpr))))];
            full.extend(body);
            for_const(&i, n.div_ceil(tpr), full)
        };
        let mut row_body = vec![
            let_(
                &src_i,
                Expr::PrivateLoad {
                    arr: srcs.into(),
                    ty: Ty::I32,
                    index: Box::new(var(&p, Ty::U32)),
                },
            ),
            let_(&valid, bin(BinOp::Ge, var(&src_i, Ty::I32), Expr::I32(0))),
            let_(
                &sw,
                Expr::Select(
                    Box::new(validv.clone()),
                    Box::new(Expr::Cvt(Ty::U32, Box::new(var(&src_i, Ty::I32)))),
                    Box::new(u(0)),
                ),
            ),
            let_(
                &dbase,
                add(add(base, mul(rv.clone(), u(info.stride))), u(dst_word0)),
            ),
        ];
        if let Some((f, fbase)) = flag_at {
            row_body.push(Stmt::If {
                cond: bin(BinOp::Eq, sub.clone(), u(0)),
                then: vec![Stmt::SharedStore {
                    arr: f,
                    index: add(fbase, rv.clone()),
                    value: Expr::Select(
                        Box::new(validv.clone()),
                        Box::new(Expr::F32(1.0)),
                        Box::new(Expr::F32(0.0)),
                    ),
                }],
                els: vec![],
            });
        }
        let words_path = copy_loop(self, 4, words, 0);
        if chunks > 0 && dst_word0 % 4 == 0 {
            // 16-byte copies when the source row is 16-byte aligned, else 4-byte ones.
            let mut fast = vec![copy_loop(self, 16, chunks, 0)];
            if words % 4 != 0 {
                let tail = copy_loop(self, 4, words % 4, chunks * 4);
                fast.push(tail);
            }
            row_body.push(Stmt::If {
                cond: bin(BinOp::Eq, bin(BinOp::BitAnd, swv.clone(), u(3)), u(0)),
                then: fast,
                els: vec![words_path],
            });
        } else {
            row_body.push(words_path);
        }
        let body = vec![
            let_(&r, Self::gather_row(plan, var(&p, Ty::U32))),
            Stmt::If {
                cond: lt(rv, u(plan.rows)),
                then: row_body,
                els: vec![],
            },
        ];
        Ok(for_const(&p, plan.passes, body))
    }

    /// `let n = src;` and, where `n` (a source word, −1 for a row without a source) is a
    /// row, ask L2 for its `words` words ([`Intrinsic::PrefetchL2`]): one row's L2 prefetch,
    /// for v6's gathers ([`Self::gather_l2`]) and v7's producers alike.
    pub(super) fn l2_prefetch_row(&mut self, buf: &str, src: Expr, words: u32) -> Vec<Stmt> {
        let n = self.fresh("l2_src");
        let nv = var(&n, Ty::I32);
        vec![
            let_(&n, src),
            Stmt::If {
                cond: bin(BinOp::Ge, nv.clone(), Expr::I32(0)),
                then: vec![intr(Intrinsic::PrefetchL2 {
                    buf: buf.to_string(),
                    word: Expr::Cvt(Ty::U32, Box::new(nv)),
                    bytes: 4 * words,
                })],
                els: vec![],
            },
        ]
    }

    /// Ask L2 for the rows of gather `g` whose source words the address phase left in `srcs`
    /// (one thread per row, the first of the row's `tpr`, one `prefetch.global.L2` per 128-byte
    /// line of its words; rows without a source are skipped). A hint: no value changes.
    pub(super) fn gather_l2(&mut self, plan: &GatherPlan, g: &RowGather, srcs: &str) -> Stmt {
        let p = self.fresh("gather_pass");
        let r = self.fresh("gather_row");
        let first = bin(
            BinOp::And,
            lt(var(&r, Ty::U32), u(plan.rows)),
            bin(BinOp::Eq, bin(BinOp::Rem, local_id(), u(plan.tpr)), u(0)),
        );
        let word = Expr::PrivateLoad {
            arr: srcs.into(),
            ty: Ty::I32,
            index: Box::new(var(&p, Ty::U32)),
        };
        let body = vec![
            let_(&r, Self::gather_row(plan, var(&p, Ty::U32))),
            Stmt::If {
                cond: first,
                then: self.l2_prefetch_row(&g.src, word, g.words),
                els: vec![],
            },
        ];
        for_const(&p, plan.passes, body)
    }

    /// Issue the copies of one `GatherRows` (no commit, no wait).
    pub(super) fn gather(&mut self, g: &RowGather, out: &mut Vec<Stmt>) -> Result<()> {
        let plan = self.gather_plan(g)?;
        let srcs = self.private(&format!("{}_src", g.dst), Ty::I32, plan.passes);
        out.push(self.gather_addr(&plan, g, &srcs)?);
        out.push(self.gather_copy(&plan, g, &srcs)?);
        Ok(())
    }
}
