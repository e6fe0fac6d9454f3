//! A split-K accumulator held in rows ([`RowsForm`], [`crate::kir::Lowering::MmaWs`]'s
//! `row_softmax`): where it applies ([`Cx::rows_form`]), its split-K sum ([`Cx::rows_sum`])
//! its element pairs ([`Cx::rows_pairs`]), and the online softmax on it (its registers, their
//! load and store, the step: [`Cx::softmax_step_rows`]; the fragment form and what both share
//! are in [`super::softmax`]). Everything else about the accumulator (its products, their
//! partials' scratch) is as in the fragment form ([`super::ksplit`]).

use super::ksplit::add_slices;
use super::softmax::{fadd, fmax, neg_m_log2e, SetShape, SoftmaxRegs};
use super::{
    add, bin, exp2_fast, exp_fast, fma, for_const, intr, let_, mul, priv_load, shared_load, u, var,
    ws, Cx, WARP,
};
use crate::kir::ir::*;
use crate::kir::walk::visit_tile_ops_with;
use crate::kir::RowSoftmax;
use crate::Result;

/// A split-K accumulator `[rows, cols]` held in rows ([`crate::kir::Lowering::MmaWs`]'s
/// `row_softmax`): in warps below `used`, `lanes` adjacent lanes hold one row, each `cols`
/// adjacent columns of it — lane `l` of warp `w` row `w · (32 / lanes) + l / lanes`, columns
/// from `(l % lanes) · cols`. Its split-K sum reads whole 16-byte runs of the partials, and
/// a row's maximum and sum are `log2(lanes)` shuffles, with no shared table between warps.
#[derive(Clone, Debug)]
pub(super) struct RowsForm {
    pub(super) lanes: u32,
    pub(super) cols: u32,
    pub(super) used: u32,
    /// This thread's row and first column (u32 variables).
    pub(super) row: Expr,
    pub(super) col0: Expr,
    /// `lane % lanes == 0`: the lane that writes the row's shared state.
    pub(super) first: Expr,
}

impl Cx<'_> {
    /// The row form of split-K accumulator `a` ([`RowsForm`]), where it is asked for and fits:
    /// the op reading its sum is an online softmax of it (or a per-element map), never a row
    /// reduction, a store to shared memory or a softmax's output; the holder warps — the
    /// lower half, as for fragments (the upper half issues the copies meanwhile, see `ws`) —
    /// give each row a power of two of lanes, each an even number of columns.
    pub(super) fn rows_form(&mut self, a: &AccTileDecl) -> Option<RowsForm> {
        if self.row_softmax == RowSoftmax::Off {
            return None;
        }
        let mut softmax = false;
        let mut other = false;
        visit_tile_ops_with(&self.kernel.body, false, &mut |op| match op {
            TileOp::OnlineSoftmax { s, outs, .. } => {
                softmax |= *s == a.name;
                other |= outs.contains(&a.name);
            }
            TileOp::AccRowReduce { acc, .. } | TileOp::AccToShared { acc, .. } => {
                other |= *acc == a.name
            }
            _ => {}
        });
        if !softmax || other {
            return None;
        }
        let used = self.warps - ws::producer_warps(self.warps);
        let threads = used * WARP;
        if used == 0 || threads % a.rows != 0 {
            return None;
        }
        let lanes = threads / a.rows;
        if !lanes.is_power_of_two() || lanes > WARP || a.cols % lanes != 0 {
            return None;
        }
        let cols = a.cols / lanes;
        if cols % 2 != 0 {
            return None;
        }
        let (row, col0) = (
            self.fresh(&format!("{}_row", a.name)),
            self.fresh(&format!("{}_col", a.name)),
        );
        let lane = self.lane.lane.clone();
        self.prelude.push(let_(
            &row,
            add(
                mul(self.lane.warp.clone(), u(WARP / lanes)),
                bin(BinOp::Div, lane.clone(), u(lanes)),
            ),
        ));
        let within = bin(BinOp::Rem, lane, u(lanes));
        self.prelude.push(let_(&col0, mul(within.clone(), u(cols))));
        Some(RowsForm {
            lanes,
            cols,
            used,
            row: var(&row, Ty::U32),
            col0: var(&col0, Ty::U32),
            first: bin(BinOp::Eq, within, u(0)),
        })
    }
    /// The split-K sum of `acc` held in rows (after the partials' barrier): each holder thread
    /// adds its `cols` adjacent columns of every slice — whole 16-byte runs of a row — column
    /// by column. `(gk, rows, stride)`: the slices, the accumulator's rows and the scratch's
    /// row stride.
    pub(super) fn rows_sum(
        &mut self,
        acc: &str,
        rf: &RowsForm,
        scratch: &str,
        (gk, rows, stride): (u32, u32, u32),
    ) -> Vec<Stmt> {
        let (c, g) = (self.fresh("c"), self.fresh("g"));
        let cv = var(&c, Ty::U32);
        let (sum, cell) = (self.fresh("sum"), self.fresh("cell"));
        let body = add_slices(
            (scratch, acc, cv.clone()),
            (&sum, &cell, &g),
            add(mul(rf.row.clone(), u(stride)), add(rf.col0.clone(), cv)),
            (gk, rows * stride),
        );
        vec![for_const(&c, rf.cols, body)]
    }

    /// The loop over this thread's element pairs of an accumulator held in rows: its columns
    /// two at a time, `row` and `col` bound, `body(private index of the first, of the second)`.
    pub(super) fn rows_pairs(
        &mut self,
        rf: &RowsForm,
        row: &str,
        col: &str,
        body: impl FnOnce(&mut Self, Expr, Expr) -> Result<Vec<Stmt>>,
    ) -> Result<Stmt> {
        let k = self.fresh("pair");
        let at = mul(var(&k, Ty::U32), u(2));
        let mut inner = vec![
            let_(row, rf.row.clone()),
            let_(col, add(rf.col0.clone(), at.clone())),
        ];
        inner.extend(body(self, at.clone(), add(at, u(1)))?);
        Ok(for_const(&k, rf.cols / 2, inner))
    }

    /// [`Self::softmax_regs`] of an S held in rows: registers for one row a thread, and row
    /// sets for the outputs' rescale factors.
    pub(super) fn softmax_regs_rows(
        &mut self,
        s: &str,
        (m, l): (&str, &str),
        outs: &[String],
        rf: RowsForm,
    ) -> Result<SoftmaxRegs> {
        let mut shapes: Vec<SetShape> = Vec::new();
        let out_sets = self.out_sets(s, outs, &mut shapes)?;
        let sets = self.row_sets(shapes);
        Ok(SoftmaxRegs {
            m: m.to_string(),
            l: l.to_string(),
            s: s.to_string(),
            outs: outs.to_vec(),
            sets,
            s_set: 0,
            out_sets,
            m_reg: self.private(&format!("{m}_reg"), Ty::F32, 1),
            l_part: self.private(&format!("{l}_part"), Ty::F32, 1),
            stride: 1,
            exchange: false,
            row_max: String::new(),
            rows: Some(rf),
        })
    }

    /// [`Self::softmax_load`] of an S held in rows: the row's max in every lane of the row,
    /// its sum in the first.
    pub(super) fn softmax_load_rows(
        &mut self,
        r: &SoftmaxRegs,
        rf: &RowsForm,
    ) -> Result<Vec<Stmt>> {
        let s = self.acc(&r.s)?.clone();
        Ok(self.for_used_warps(
            &s,
            vec![
                Stmt::PrivateStore {
                    arr: r.m_reg.clone(),
                    index: u(0),
                    value: shared_load(&r.m, Ty::F32, rf.row.clone()),
                },
                Stmt::PrivateStore {
                    arr: r.l_part.clone(),
                    index: u(0),
                    value: Expr::Select(
                        Box::new(rf.first.clone()),
                        Box::new(shared_load(&r.l, Ty::F32, rf.row.clone())),
                        Box::new(Expr::F32(0.0)),
                    ),
                },
            ],
        ))
    }

    /// [`Self::softmax_store`] of an S held in rows (`m_s`: its running max's registers).
    pub(super) fn softmax_store_rows(
        &mut self,
        r: &SoftmaxRegs,
        rf: &RowsForm,
        m_s: &str,
    ) -> Result<Vec<Stmt>> {
        let s = self.acc(&r.s)?.clone();
        let mut out = Vec::new();
        // the row's partial sums over its lanes; its first lane writes the state, after
        // the warp's lanes meet (they read it at the start, and a loop of no steps has no
        // barrier between)
        let x = self.fresh("row_sum");
        let xv = var(&x, Ty::F32);
        let mut b = vec![Stmt::Var {
            name: x.clone(),
            value: priv_load(&r.l_part, u(0)),
        }];
        b.extend(self.lanes_reduce(&x, rf.lanes, BinOp::Add));
        b.push(intr(Intrinsic::SyncWarp));
        b.push(Stmt::If {
            cond: rf.first.clone(),
            then: vec![
                Stmt::SharedStore {
                    arr: r.l.clone(),
                    index: rf.row.clone(),
                    value: xv,
                },
                Stmt::SharedStore {
                    arr: r.m.clone(),
                    index: rf.row.clone(),
                    value: priv_load(m_s, u(0)),
                },
            ],
            els: vec![],
        });
        out.extend(self.for_used_warps(&s, b));
        out.push(Stmt::Barrier);
        Ok(out)
    }

    /// One step with S held in rows ([`RowsForm`]): each holder thread has one row's `cols`
    /// adjacent columns, so the row max is its own then `log2(lanes)` shuffles — no exchange
    /// between warps, no barrier before P. Each row's first lane writes its `alpha` to the
    /// table beside P; after P's barrier every output holder reads the factors of its rows
    /// and rescales. The table and `p_tile` were last read before the barrier at S's split-K
    /// sum (else one is placed here).
    pub(super) fn softmax_step_rows(
        &mut self,
        r: &SoftmaxRegs,
        p_tile: &str,
        after_barrier: bool,
    ) -> Result<Vec<Stmt>> {
        let s = self.acc(&r.s)?.clone();
        let rf = r
            .rows
            .clone()
            .ok_or_else(|| self.err("row softmax without its row form".into()))?;
        let table = self.table()?;
        let mut out = Vec::new();
        if !after_barrier {
            // Barrier: the previous step's P · V and rescale may still read p_tile and the
            // table (write-after-read).
            out.push(Stmt::Barrier);
        }
        out.push(Stmt::Comment(
            "online softmax (rows): row max over the row's lanes, alpha, P, partial row sum".into(),
        ));
        // the thread's max and (below) its sum of P as trees: log2(cols) dependent
        // instructions, not cols - 1, on the chain of the step
        let x = self.fresh("row_max_part");
        let xv = var(&x, Ty::F32);
        let mut b = vec![Stmt::Var {
            name: x.clone(),
            value: tree(&r.s, rf.cols, fmax),
        }];
        b.extend(self.lanes_reduce(&x, rf.lanes, BinOp::Max));
        let (mo, mx, al) = (
            self.fresh("m_old"),
            self.fresh("m_new"),
            self.fresh("alpha"),
        );
        let (ov, mv, alv) = (var(&mo, Ty::F32), var(&mx, Ty::F32), var(&al, Ty::F32));
        b.push(let_(&mo, priv_load(&r.m_reg, u(0))));
        b.push(let_(&mx, fmax(ov.clone(), xv)));
        b.push(let_(&al, exp_fast(bin(BinOp::Sub, ov, mv.clone()))));
        b.push(Stmt::PrivateStore {
            arr: r.m_reg.clone(),
            index: u(0),
            value: mv.clone(),
        });
        // p = 2^(s·log2 e − m·log2 e), as in the fragment form (a row masked so far takes
        // m = 0, so a masked score gives −inf and p = 0)
        let neg_m = self.fresh("neg_m_log2e");
        let neg_mv = var(&neg_m, Ty::F32);
        b.push(let_(&neg_m, neg_m_log2e(mv)));
        let (c, sum) = (self.fresh("c"), self.fresh("p_sum"));
        let (cv, sumv) = (var(&c, Ty::U32), var(&sum, Ty::F32));
        b.push(for_const(
            &c,
            rf.cols,
            vec![Stmt::PrivateStore {
                arr: r.s.clone(),
                index: cv.clone(),
                value: exp2_fast(fma(
                    priv_load(&r.s, cv),
                    Expr::F32(std::f32::consts::LOG2_E),
                    neg_mv,
                )),
            }],
        ));
        b.push(let_(&sum, tree(&r.s, rf.cols, fadd)));
        b.push(Stmt::PrivateStore {
            arr: r.l_part.clone(),
            index: u(0),
            value: fadd(
                bin(BinOp::Mul, priv_load(&r.l_part, u(0)), alv.clone()),
                sumv,
            ),
        });
        b.push(Stmt::If {
            cond: rf.first.clone(),
            then: vec![Stmt::SharedStore {
                arr: table.clone(),
                index: rf.row.clone(),
                value: alv,
            }],
            els: vec![],
        });
        out.extend(self.for_used_warps(&s, b));
        // P for P · V, then the barrier after which the table and P are read
        out.extend(self.acc_to_shared_stores(&r.s, p_tile)?);
        out.push(Stmt::Barrier);
        out.push(Stmt::Comment(
            "online softmax (rows): the outputs rescaled by their rows' alpha".into(),
        ));
        // (the row form's sets are the outputs' only)
        for set in r.sets.clone() {
            out.extend(self.rows_loop((&set.row0, set.fmw, set.used), |_, ra| {
                Ok(vec![Stmt::PrivateStore {
                    arr: set.alpha.clone(),
                    index: ra.slot.clone(),
                    value: shared_load(&table, Ty::F32, ra.row.clone()),
                }])
            })?);
        }
        out.extend(self.rescale_outs(r)?);
        Ok(out)
    }
}

/// `op` over `arr[0 .. n]` (n a power of two) as a balanced tree.
fn tree(arr: &str, n: u32, op: fn(Expr, Expr) -> Expr) -> Expr {
    fn span(arr: &str, lo: u32, n: u32, op: fn(Expr, Expr) -> Expr) -> Expr {
        if n == 1 {
            priv_load(arr, u(lo))
        } else {
            op(
                span(arr, lo, n / 2, op),
                span(arr, lo + n / 2, n - n / 2, op),
            )
        }
    }
    span(arr, 0, n, op)
}
