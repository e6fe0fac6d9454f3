//! The online softmax ([`TileOp::OnlineSoftmax`]) on tensor-core fragments, its row state in
//! registers. The definition is the op's expansion (see `kir::ops::online_softmax_update`);
//! this computes the same thing without the shared row arrays and their barriers.
//!
//! State: the threads that hold S's rows (and any output whose warps hold the same rows)
//! keep the running max `m` of those rows in registers; a thread of a warp that holds S
//! keeps a *partial* row sum `l` over its own columns, rescaled by `alpha` each step like the
//! whole sum would be, so that the partials add up to `l`. One step:
//! 1. row max of the thread's scores, then of the row's quad (`shfl.xor` 1, 2); when S is
//!    spread over several warps along N, or other warps hold the outputs' rows, the quads'
//!    maxima go to a small shared table (with the old max, for threads whose rows are
//!    spread otherwise than S's), and one barrier;
//! 2. every thread that needs a row — S holders for P, output holders for alpha — computes
//!    `m_new = max(m, that row of the table)` and `alpha = exp(m − m_new)` itself;
//! 3. `p = exp(s − m_new)` in the S fragments, the partial sums, the outputs rescaled, P
//!    into `p_tile`, one barrier before anyone reads it.
//!
//! Both exponentials (P and alpha) are [`Func::ExpFast`], `ex2.approx`: two instructions where
//! `expf` is about eight, on the chain of every step. P is rounded to bf16 / f16 right after
//! and alpha rescales f32 sums, so its relative error (about 2^-22 + |x| · 2^-24 for the
//! exponent x ≤ 0; the terms with large |x| are negligible anyway) is far below what they
//! keep. On the H200 the decode kernels ran 1.03–1.14× faster with it, rel L2 and lse as
//! before (benches/NOTES.md, v28). P's exponent is one FMA, `s · log2 e − m · log2 e`, into
//! `ex2` itself ([`Func::Exp2Fast`]); a masked score makes it −inf, so P is 0 without a select
//! (benches/NOTES.md, v30).
//!
//! **Scores held in rows** ([`RowsForm`], `Lowering::MmaWs`'s `row_softmax`): when S is a
//! split-K sum held one row a thread (a few adjacent lanes a row), step 1 needs no table: the
//! row max is the thread's own and a few shuffles, and each row's holders compute `m_new`,
//! `alpha` and P at once. The outputs' holders need `alpha` of their rows: each row's first
//! lane writes it to the table beside P, and they read it after P's barrier — one workgroup
//! barrier a step instead of two (benches/NOTES.md, v31).
//!
//! The shared `m` and `l` arrays hold the state only between loops: the registers are read
//! from them before the pipeline whose compute stage holds the op and written back after it
//! (the partials summed across the quad and the warps), so the code after the loop reads them
//! as the definition says. An op outside a pipeline, or one whose state other code of the loop
//! reads or writes, does the same around itself, every time. Sums are added in another order
//! than the definition's, so `l` may differ from it by rounding.

use super::rows::RowsForm;
use super::{
    add, bin, exp2_fast, exp_fast, fma, for_const, intr, let_, lt, mul, priv_load, shared_load, u,
    var, AccInfo, Cx,
};
use crate::kir::expr::select;
use crate::kir::ir::*;
use crate::kir::ops::is_masked;
use crate::Result;

/// The rows a thread holds of an accumulator layout: `row0 + 16·i + 8·h + lane_group` for
/// `i < fmw`, `h < 2`, in the warps below `used`. Register arrays of the state are indexed
/// `2·i + h`.
#[derive(Clone)]
pub(super) struct RowSet {
    pub(super) row0: Expr,
    pub(super) fmw: u32,
    pub(super) used: u32,
    /// This step's rescale factor of these rows (private array).
    pub(super) alpha: String,
}

/// One row of a [`rows_loop`](Cx::rows_loop): fragment row `i`, half `h`.
pub(super) struct RowAt {
    pub(super) i: Expr,
    pub(super) h: Expr,
    /// `2·i + h`: the row's index in the registers of its row set.
    pub(super) slot: Expr,
    pub(super) row: Expr,
}

/// The register state of one online softmax and how its rows are spread.
#[derive(Clone)]
pub(super) struct SoftmaxRegs {
    /// The shared row max and row sum of the definition.
    pub(super) m: String,
    pub(super) l: String,
    pub(super) s: String,
    pub(super) outs: Vec<String>,
    pub(super) sets: Vec<RowSet>,
    /// The row set of S, and of each output.
    pub(super) s_set: usize,
    pub(super) out_sets: Vec<usize>,
    /// Running max of the rows of S's row set (private array), kept by every warp that
    /// holds that set. Threads of other row sets read the old max from the table.
    pub(super) m_reg: String,
    /// Partial row sums over this thread's columns of S (private array).
    pub(super) l_part: String,
    /// Words per row of the exchange table: the maxima of the warps along N, then (when an
    /// output's rows are spread otherwise than S's) the old running max.
    pub(super) stride: u32,
    /// Row maxima go through the shared table (else each S warp holds whole rows and every
    /// thread needs only rows it holds of S).
    pub(super) exchange: bool,
    /// Without the exchange: this step's row max of S (private array).
    pub(super) row_max: String,
    /// S held in rows ([`RowsForm`]): its state is one row a thread, `m_reg[0]` / `l_part[0]`,
    /// and `sets` are the outputs' only.
    pub(super) rows: Option<RowsForm>,
}

impl SoftmaxRegs {
    /// The scores' accumulator.
    pub(super) fn s_name(&self) -> &str {
        &self.s
    }
    /// The shared row sum of the definition.
    pub(super) fn l_name(&self) -> &str {
        &self.l
    }
    /// The accumulators the update rescales.
    pub(super) fn out_names(&self) -> &[String] {
        &self.outs
    }
}

/// A row set before registers are given to it.
pub(super) struct SetShape {
    /// Layouts with the same key hold the same rows in the same threads.
    pub(super) key: (u32, u32, u32),
    pub(super) row0: Expr,
    pub(super) fmw: u32,
    pub(super) used: u32,
}

/// How an online softmax's rows are spread over the threads.
struct Layout {
    sets: Vec<SetShape>,
    s_set: usize,
    out_sets: Vec<usize>,
    exchange: bool,
    /// See [`SoftmaxRegs::stride`].
    stride: u32,
}

fn set_shape(a: &AccInfo) -> SetShape {
    let gm = a.used / a.gn;
    if gm == 1 {
        // one warp along M: every warp that holds fragments holds all rows
        SetShape {
            key: (1, 0, a.fmw),
            row0: u(0),
            fmw: a.fmw,
            used: a.used,
        }
    } else {
        SetShape {
            key: (gm, a.gn, a.fmw),
            row0: a.row0.clone(),
            fmw: a.fmw,
            used: a.used,
        }
    }
}

pub(super) fn fmax(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Max, a, b)
}

/// `−m · log2 e` for P's exponent `s · log2 e − m · log2 e`, with a row masked so far (m =
/// MASKED) taking m = 0, so the product stays finite and a masked score still gives −inf.
pub(super) fn neg_m_log2e(m: Expr) -> Expr {
    let m_safe = select(is_masked(m.clone()), Expr::F32(0.0), m);
    bin(BinOp::Mul, m_safe, Expr::F32(-std::f32::consts::LOG2_E))
}

pub(super) fn fadd(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Add, a, b)
}

/// The index of `a`'s row set in `sets` (added if new; a set's warps the most any member has).
fn set_of(sets: &mut Vec<SetShape>, a: &AccInfo) -> usize {
    let shape = set_shape(a);
    match sets.iter().position(|x| x.key == shape.key) {
        Some(k) => {
            sets[k].used = sets[k].used.max(shape.used);
            k
        }
        None => {
            sets.push(shape);
            sets.len() - 1
        }
    }
}

impl Cx<'_> {
    /// The row set of each output of the online softmax of `s` (added to `sets`); each must
    /// have S's rows.
    pub(super) fn out_sets(
        &self,
        s: &str,
        outs: &[String],
        sets: &mut Vec<SetShape>,
    ) -> Result<Vec<usize>> {
        let rows = self.acc(s)?.decl.rows;
        let mut out = Vec::new();
        for o in outs {
            let oi = self.acc(o)?;
            if oi.decl.rows != rows {
                return Err(self.err(format!(
                    "online softmax of {s} ({rows} rows): output {o} has {} rows",
                    oi.decl.rows
                )));
            }
            out.push(set_of(sets, oi));
        }
        Ok(out)
    }

    /// Registers for the rescale factors of each row set.
    pub(super) fn row_sets(&mut self, sets: Vec<SetShape>) -> Vec<RowSet> {
        sets.into_iter()
            .map(|x| RowSet {
                row0: x.row0,
                fmw: x.fmw,
                used: x.used,
                alpha: self.private("row_alpha", Ty::F32, 2 * x.fmw),
            })
            .collect()
    }

    fn softmax_layout(&self, s: &str, outs: &[String]) -> Result<Layout> {
        let si = self.acc(s)?;
        let mut sets: Vec<SetShape> = Vec::new();
        let s_set = set_of(&mut sets, si);
        let out_sets = self.out_sets(s, outs, &mut sets)?;
        let other_rows = out_sets.iter().any(|&k| k != s_set);
        let exchange = si.gn > 1 || other_rows || sets[s_set].used != si.used;
        Ok(Layout {
            sets,
            s_set,
            out_sets,
            exchange,
            stride: si.gn + other_rows as u32,
        })
    }

    /// The shared table of the row exchange, sized for the largest online softmax.
    pub(super) fn declare_softmax_table(&mut self) -> Result<()> {
        let mut ops = Vec::new();
        super::visit_tile_ops_with(&self.kernel.body, false, &mut |op| {
            if let TileOp::OnlineSoftmax { s, outs, .. } = op {
                ops.push((s.clone(), outs.clone()));
            }
        });
        let mut len = 0;
        for (s, outs) in ops {
            if self.acc(&s)?.rows.is_some() {
                // the rescale factors, one a row
                len = len.max(self.acc(&s)?.decl.rows);
                continue;
            }
            let layout = self.softmax_layout(&s, &outs)?;
            if layout.exchange {
                len = len.max(self.acc(&s)?.decl.rows * layout.stride);
            }
        }
        if len > 0 {
            let name = self.fresh("row_exchange");
            self.new_shared.push(SharedDecl {
                alias: None,
                name: name.clone(),
                ty: Ty::F32,
                len,
            });
            self.softmax_table = Some(name);
        }
        Ok(())
    }

    /// Registers for the state of one online softmax.
    fn softmax_regs(
        &mut self,
        s: &str,
        (m, l): (&str, &str),
        outs: &[String],
    ) -> Result<SoftmaxRegs> {
        let rows = self.acc(s)?.decl.rows;
        for arr in [m, l] {
            match self.kernel.shared.iter().find(|d| d.name == arr) {
                Some(d) if d.ty == Ty::F32 && d.len >= rows => {}
                _ => {
                    return Err(self.err(format!(
                        "online softmax of {s}: row state {arr} must be a shared f32 array of \
                         at least {rows}"
                    )))
                }
            }
        }
        if let Some(rf) = self.acc(s)?.rows.clone() {
            return self.softmax_regs_rows(s, (m, l), outs, rf);
        }
        let Layout {
            sets,
            s_set,
            out_sets,
            exchange,
            stride,
        } = self.softmax_layout(s, outs)?;
        let sets = self.row_sets(sets);
        let fmw_s = sets[s_set].fmw;
        let m_reg = self.private(&format!("{m}_reg"), Ty::F32, 2 * fmw_s);
        let l_part = self.private(&format!("{l}_part"), Ty::F32, 2 * fmw_s);
        let row_max = if exchange {
            String::new()
        } else {
            self.private("row_max_step", Ty::F32, 2 * fmw_s)
        };
        Ok(SoftmaxRegs {
            m: m.to_string(),
            l: l.to_string(),
            s: s.to_string(),
            outs: outs.to_vec(),
            sets,
            s_set,
            out_sets,
            m_reg,
            l_part,
            stride,
            exchange,
            row_max,
            rows: None,
        })
    }

    pub(super) fn table(&self) -> Result<String> {
        self.softmax_table
            .clone()
            .ok_or_else(|| self.err("online softmax without its exchange table".into()))
    }

    /// `body` for every row this thread holds of a row set, in the warps that hold it.
    pub(super) fn rows_loop(
        &mut self,
        (row0, fmw, used): (&Expr, u32, u32),
        body: impl FnOnce(&mut Self, &RowAt) -> Result<Vec<Stmt>>,
    ) -> Result<Vec<Stmt>> {
        let (i, h) = (self.fresh("mi"), self.fresh("half"));
        let (iv, hv) = (var(&i, Ty::U32), var(&h, Ty::U32));
        let at = RowAt {
            row: add(
                add(row0.clone(), mul(iv.clone(), u(16))),
                add(mul(hv.clone(), u(8)), self.lane.group.clone()),
            ),
            slot: add(mul(iv.clone(), u(2)), hv.clone()),
            i: iv,
            h: hv,
        };
        let inner = body(self, &at)?;
        let lp = for_const(&i, fmw, vec![for_const(&h, 2, inner)]);
        Ok(if used == self.warps {
            vec![lp]
        } else {
            vec![Stmt::If {
                cond: lt(self.lane.warp.clone(), u(used)),
                then: vec![lp],
                els: vec![],
            }]
        })
    }

    /// Lower one [`TileOp::OnlineSoftmax`].
    ///
    /// `after_barrier`: a workgroup barrier was just placed before it (S's split-K sum) with
    /// no other op between.
    pub(super) fn online_softmax(
        &mut self,
        s: &str,
        (m, l): (&str, &str),
        outs: &[String],
        p_tile: &str,
        after_barrier: bool,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        if let Some(r) = self.resident.get(m).cloned() {
            if r.s == s && r.l == l && r.outs == outs {
                out.extend(self.softmax_step(&r, p_tile, after_barrier)?);
                return Ok(());
            }
        }
        let r = self.softmax_regs(s, (m, l), outs)?;
        out.extend(self.softmax_load(&r)?);
        out.extend(self.softmax_step(&r, p_tile, after_barrier)?);
        out.extend(self.softmax_store(&r)?);
        Ok(())
    }

    /// The online softmaxes of a pipeline's compute stage whose state can stay in registers
    /// for the whole loop: one op per state, and nothing else in the loop touches it.
    pub(super) fn resident_softmax(
        &mut self,
        load: &[Stmt],
        compute: &[Stmt],
    ) -> Result<Vec<SoftmaxRegs>> {
        let mut found = Vec::new();
        for (at, st) in compute.iter().enumerate() {
            if let Stmt::Tile(TileOp::OnlineSoftmax { s, m, l, outs, .. }) = st {
                if self.resident.contains_key(m) {
                    continue;
                }
                let names = [m.as_str(), l.as_str()];
                let elsewhere = compute
                    .iter()
                    .enumerate()
                    .any(|(k, x)| k != at && uses_shared(x, &names))
                    || load.iter().any(|x| uses_shared(x, &names));
                if !elsewhere {
                    found.push(self.softmax_regs(s, (m, l), outs)?);
                }
            }
        }
        Ok(found)
    }

    /// Registers from the shared state: every holder of a row reads its max; the partial sums
    /// start as `l` in one lane per row (the first warp along N, quad lane 0), 0 elsewhere.
    pub(super) fn softmax_load(&mut self, r: &SoftmaxRegs) -> Result<Vec<Stmt>> {
        let mut out = vec![Stmt::Comment(format!(
            "online softmax: row state {} / {} into registers",
            r.m, r.l
        ))];
        if let Some(rf) = &r.rows {
            out.extend(self.softmax_load_rows(r, rf)?);
            return Ok(out);
        }
        let set = r.sets[r.s_set].clone();
        out.extend(self.rows_loop((&set.row0, set.fmw, set.used), |_, at| {
            Ok(vec![Stmt::PrivateStore {
                arr: r.m_reg.clone(),
                index: at.slot.clone(),
                value: shared_load(&r.m, Ty::F32, at.row.clone()),
            }])
        })?);
        let s = self.acc(&r.s)?.clone();
        let first = bin(
            BinOp::And,
            bin(BinOp::Eq, s.wn.clone(), u(0)),
            bin(BinOp::Eq, self.lane.quad.clone(), u(0)),
        );
        out.extend(self.rows_loop((&s.row0, s.fmw, s.used), |_, at| {
            Ok(vec![Stmt::PrivateStore {
                arr: r.l_part.clone(),
                index: at.slot.clone(),
                value: Expr::Select(
                    Box::new(first),
                    Box::new(shared_load(&r.l, Ty::F32, at.row.clone())),
                    Box::new(Expr::F32(0.0)),
                ),
            }])
        })?);
        Ok(out)
    }

    /// Registers back to the shared state: `l` = the sum of the partials (quad, then warps
    /// along N through the table), `m` from the lane that writes `l`.
    pub(super) fn softmax_store(&mut self, r: &SoftmaxRegs) -> Result<Vec<Stmt>> {
        let s = self.acc(&r.s)?.clone();
        let m_s = r.m_reg.clone();
        let mut out = vec![Stmt::Comment(format!(
            "online softmax: row state {} / {} back to shared memory (partial sums added up)",
            r.m, r.l
        ))];
        if let Some(rf) = &r.rows {
            out.extend(self.softmax_store_rows(r, rf, &m_s)?);
            return Ok(out);
        }
        let cross = s.gn > 1;
        let table = if cross { self.table()? } else { String::new() };
        if !cross {
            // Barrier: threads may still read the state (write-after-read).
            out.push(Stmt::Barrier);
        }
        let x = self.fresh("row_sum");
        let xv = var(&x, Ty::F32);
        let quad0 = bin(BinOp::Eq, self.lane.quad.clone(), u(0));
        let write_state = |row: Expr, slot: Expr, value: Expr| {
            vec![
                Stmt::SharedStore {
                    arr: r.l.clone(),
                    index: row.clone(),
                    value,
                },
                Stmt::SharedStore {
                    arr: r.m.clone(),
                    index: row,
                    value: priv_load(&m_s, slot),
                },
            ]
        };
        out.extend(self.rows_loop((&s.row0, s.fmw, s.used), |cx, ra| {
            let (slot, row) = (ra.slot.clone(), ra.row.clone());
            let mut b = vec![Stmt::Var {
                name: x.clone(),
                value: priv_load(&r.l_part, slot.clone()),
            }];
            b.extend(cx.lanes_reduce(&x, 4, BinOp::Add));
            let then = if cross {
                vec![Stmt::SharedStore {
                    arr: table.clone(),
                    index: add(mul(row, u(r.stride)), s.wn.clone()),
                    value: xv.clone(),
                }]
            } else {
                write_state(row, slot, xv.clone())
            };
            b.push(Stmt::If {
                cond: quad0.clone(),
                then,
                els: vec![],
            });
            Ok(b)
        })?);
        if cross {
            out.push(Stmt::Barrier);
            let first = bin(
                BinOp::And,
                bin(BinOp::Eq, s.wn.clone(), u(0)),
                quad0.clone(),
            );
            let y = self.fresh("row_sum");
            let yv = var(&y, Ty::F32);
            out.extend(self.rows_loop((&s.row0, s.fmw, s.used), |_, ra| {
                let (slot, row) = (ra.slot.clone(), ra.row.clone());
                let at = |g: u32| add(mul(row.clone(), u(r.stride)), u(g));
                let mut then = vec![Stmt::Var {
                    name: y.clone(),
                    value: shared_load(&table, Ty::F32, at(0)),
                }];
                for g in 1..s.gn {
                    then.push(Stmt::Assign {
                        name: y.clone(),
                        value: fadd(yv.clone(), shared_load(&table, Ty::F32, at(g))),
                    });
                }
                then.extend(write_state(row.clone(), slot, yv.clone()));
                Ok(vec![Stmt::If {
                    cond: first,
                    then,
                    els: vec![],
                }])
            })?);
        }
        out.push(Stmt::Barrier);
        Ok(out)
    }

    /// One step on the registers (see the module comment).
    fn softmax_step(
        &mut self,
        r: &SoftmaxRegs,
        p_tile: &str,
        after_barrier: bool,
    ) -> Result<Vec<Stmt>> {
        if r.rows.is_some() {
            return self.softmax_step_rows(r, p_tile, after_barrier);
        }
        let s = self.acc(&r.s)?.clone();
        let sset = r.sets[r.s_set].clone();
        let table = if r.exchange {
            self.table()?
        } else {
            String::new()
        };
        let quad0 = bin(BinOp::Eq, self.lane.quad.clone(), u(0));
        // the element of fragment (i, j) of S at value 2h + e
        let s_elem = |ra: &RowAt, j: Expr, e: Expr| {
            add(
                mul(add(mul(ra.i.clone(), u(s.fnw)), j), u(4)),
                add(mul(ra.h.clone(), u(2)), e),
            )
        };
        let mut out = vec![Stmt::Comment(
            "online softmax (registers): row max of this thread's scores and its quad".into(),
        )];
        // 1. the row max
        let x = self.fresh("row_max_part");
        let xv = var(&x, Ty::F32);
        out.extend(self.rows_loop((&s.row0, s.fmw, s.used), |cx, ra| {
            let (slot, row) = (ra.slot.clone(), ra.row.clone());
            let at = |j: u32, e: u32| priv_load(&r.s, s_elem(ra, u(j), u(e)));
            let mut b = vec![Stmt::Var {
                name: x.clone(),
                value: fmax(at(0, 0), at(0, 1)),
            }];
            for j in 1..s.fnw {
                for e in 0..2 {
                    b.push(Stmt::Assign {
                        name: x.clone(),
                        value: fmax(xv.clone(), at(j, e)),
                    });
                }
            }
            b.extend(cx.lanes_reduce(&x, 4, BinOp::Max));
            b.push(if r.exchange {
                let at = mul(row, u(r.stride));
                let mut then = vec![Stmt::SharedStore {
                    arr: table.clone(),
                    index: add(at.clone(), s.wn.clone()),
                    value: xv.clone(),
                }];
                if r.stride > s.gn {
                    // the old max, for the threads whose rows are spread otherwise
                    then.push(Stmt::If {
                        cond: bin(BinOp::Eq, s.wn.clone(), u(0)),
                        then: vec![Stmt::SharedStore {
                            arr: table.clone(),
                            index: add(at, u(s.gn)),
                            value: priv_load(&r.m_reg, slot),
                        }],
                        els: vec![],
                    });
                }
                Stmt::If {
                    cond: quad0.clone(),
                    then,
                    els: vec![],
                }
            } else {
                Stmt::PrivateStore {
                    arr: r.row_max.clone(),
                    index: slot,
                    value: xv.clone(),
                }
            });
            Ok(b)
        })?);
        if r.exchange {
            out.push(Stmt::Barrier);
        }
        // 2. m_new and alpha, by every thread for the rows it holds
        out.push(Stmt::Comment(
            "online softmax: new row max and rescale, in every thread that holds the row".into(),
        ));
        for (k, set) in r.sets.clone().into_iter().enumerate() {
            let own = k == r.s_set;
            let (mo, mx) = (self.fresh("m_old"), self.fresh("m_new"));
            let (ov, mv) = (var(&mo, Ty::F32), var(&mx, Ty::F32));
            out.extend(self.rows_loop((&set.row0, set.fmw, set.used), |_, ra| {
                let (slot, row) = (ra.slot.clone(), ra.row.clone());
                let tab =
                    |g: u32| shared_load(&table, Ty::F32, add(mul(row.clone(), u(r.stride)), u(g)));
                let m_old = if own {
                    priv_load(&r.m_reg, slot.clone())
                } else {
                    tab(s.gn)
                };
                let mut b = vec![
                    let_(&mo, m_old),
                    Stmt::Var {
                        name: mx.clone(),
                        value: ov.clone(),
                    },
                ];
                if r.exchange {
                    for g in 0..s.gn {
                        b.push(Stmt::Assign {
                            name: mx.clone(),
                            value: fmax(mv.clone(), tab(g)),
                        });
                    }
                } else {
                    b.push(Stmt::Assign {
                        name: mx.clone(),
                        value: fmax(mv.clone(), priv_load(&r.row_max, slot.clone())),
                    });
                }
                b.push(Stmt::PrivateStore {
                    arr: set.alpha.clone(),
                    index: slot.clone(),
                    value: exp_fast(bin(BinOp::Sub, ov.clone(), mv.clone())),
                });
                if own {
                    b.push(Stmt::PrivateStore {
                        arr: r.m_reg.clone(),
                        index: slot,
                        value: mv.clone(),
                    });
                }
                Ok(b)
            })?);
        }
        // 3. P, the partial row sums, the outputs rescaled
        out.push(Stmt::Comment(
            "online softmax: P = exp(s - m_new) (0 where masked), partial row sums, outputs \
             rescaled"
                .into(),
        ));
        let (j, e, at, p, sum) = (
            self.fresh("nj"),
            self.fresh("e"),
            self.fresh("at"),
            self.fresh("p"),
            self.fresh("p_sum"),
        );
        let (jv, ev, atv, pv, sumv) = (
            var(&j, Ty::U32),
            var(&e, Ty::U32),
            var(&at, Ty::U32),
            var(&p, Ty::F32),
            var(&sum, Ty::F32),
        );
        let neg_m = self.fresh("neg_m_log2e");
        let neg_mv = var(&neg_m, Ty::F32);
        // The bf16 two-group kernel keeps P as exp(s − m) behind a select: with the FMA form
        // below its loop lost 22 of 1126 instructions but ran 0.98x at T 128, where every
        // one-group kernel gained 1.01-1.14x (H200, benches/NOTES.md v32).
        let fma_exponent = self.groups <= 1;
        out.extend(self.rows_loop((&s.row0, s.fmw, s.used), |_, ra| {
            let slot = ra.slot.clone();
            // p = 2^(s·log2 e − m·log2 e): one FMA and `ex2` an element. A masked score
            // (MASKED, −3e38) makes the FMA −inf, so p = 0 with no select, as long as
            // m·log2 e is finite: a row masked so far (m = MASKED) takes m = 0.
            let score = priv_load(&r.s, atv.clone());
            let prob = if fma_exponent {
                exp2_fast(fma(
                    score,
                    Expr::F32(std::f32::consts::LOG2_E),
                    neg_mv.clone(),
                ))
            } else {
                select(
                    is_masked(score.clone()),
                    Expr::F32(0.0),
                    exp_fast(bin(BinOp::Sub, score, priv_load(&r.m_reg, slot.clone()))),
                )
            };
            let per_elem = vec![
                let_(&at, s_elem(ra, jv.clone(), ev.clone())),
                let_(&p, prob),
                Stmt::PrivateStore {
                    arr: r.s.clone(),
                    index: atv.clone(),
                    value: pv.clone(),
                },
                Stmt::Assign {
                    name: sum.clone(),
                    value: fadd(sumv.clone(), pv.clone()),
                },
            ];
            let mut b = Vec::new();
            if fma_exponent {
                b.push(let_(&neg_m, neg_m_log2e(priv_load(&r.m_reg, slot.clone()))));
            }
            b.extend([
                Stmt::Var {
                    name: sum.clone(),
                    value: Expr::F32(0.0),
                },
                for_const(&j, s.fnw, vec![for_const(&e, 2, per_elem)]),
                Stmt::PrivateStore {
                    arr: r.l_part.clone(),
                    index: slot.clone(),
                    value: fadd(
                        bin(
                            BinOp::Mul,
                            priv_load(&r.l_part, slot.clone()),
                            priv_load(&sset.alpha, slot),
                        ),
                        sumv.clone(),
                    ),
                },
            ]);
            Ok(b)
        })?);
        out.extend(self.rescale_outs(r)?);
        // 4. P for P · V
        if !r.exchange {
            // Barrier: P · V of the previous step may still read p_tile (write-after-read).
            out.push(Stmt::Barrier);
        }
        out.extend(self.acc_to_shared_stores(&r.s, p_tile)?);
        out.push(Stmt::Barrier);
        Ok(out)
    }

    /// Every output accumulator times its rows' `alpha` (in the row sets' registers).
    pub(super) fn rescale_outs(&mut self, r: &SoftmaxRegs) -> Result<Vec<Stmt>> {
        let mut out = Vec::new();
        for (o, &k) in r.outs.iter().zip(&r.out_sets) {
            let oi = self.acc(o)?.clone();
            let alpha = r.sets[k].alpha.clone();
            let (f, h) = (self.fresh("frag"), self.fresh("half"));
            let (fv, hv) = (var(&f, Ty::U32), var(&h, Ty::U32));
            let a = self.fresh("alpha");
            let slot = add(
                mul(bin(BinOp::Div, fv.clone(), u(oi.fnw)), u(2)),
                hv.clone(),
            );
            let e0 = add(mul(fv, u(4)), mul(hv, u(2)));
            let scale = |at: Expr| Stmt::PrivateStore {
                arr: o.clone(),
                index: at.clone(),
                value: bin(BinOp::Mul, priv_load(o, at), var(&a, Ty::F32)),
            };
            let body = vec![
                let_(&a, priv_load(&alpha, slot)),
                scale(e0.clone()),
                scale(add(e0, u(1))),
            ];
            let lp = for_const(&f, oi.frags(), vec![for_const(&h, 2, body)]);
            out.extend(self.for_used_warps(&oi, vec![lp]));
        }
        Ok(out)
    }

    /// `x = op(x, x of lane ^ mask)` for the masks below `lanes`: the value over `lanes`
    /// adjacent lanes (a power of two), in each of them.
    pub(super) fn lanes_reduce(&mut self, x: &str, lanes: u32, op: BinOp) -> Vec<Stmt> {
        let xv = var(x, Ty::F32);
        let mut b = Vec::new();
        let mut mask = 1;
        while mask < lanes {
            let o = self.fresh("other");
            b.push(intr(Intrinsic::ShflXor {
                dst: o.clone(),
                value: xv.clone(),
                lane_mask: mask,
            }));
            b.push(Stmt::Assign {
                name: x.to_string(),
                value: bin(op, xv.clone(), var(&o, Ty::F32)),
            });
            mask *= 2;
        }
        b
    }
}

/// Does `s` read or write any of the shared arrays `names` (tile ops and their expansions
/// included)?
fn uses_shared(s: &Stmt, names: &[&str]) -> bool {
    let hit = |n: &str| names.contains(&n);
    let expr = |e: &Expr| {
        let mut found = false;
        e.visit(&mut |x| {
            if let Expr::SharedLoad { arr, .. } = x {
                found |= hit(arr);
            }
        });
        found
    };
    let all = |v: &[Stmt]| v.iter().any(|s| uses_shared(s, names));
    match s {
        Stmt::Let { value, .. } | Stmt::Var { value, .. } | Stmt::Assign { value, .. } => {
            expr(value)
        }
        Stmt::Store { index, value, .. }
        | Stmt::StoreWord { index, value, .. }
        | Stmt::PrivateStore { index, value, .. } => expr(index) || expr(value),
        Stmt::SharedStore { arr, index, value } => hit(arr) || expr(index) || expr(value),
        Stmt::If { cond, then, els } => expr(cond) || all(then) || all(els),
        Stmt::For {
            start,
            end,
            step,
            body,
            ..
        } => expr(start) || expr(end) || expr(step) || all(body),
        Stmt::Comment(_) | Stmt::Barrier => false,
        Stmt::Intrinsic(i) => match i {
            Intrinsic::CpAsync {
                dst,
                dst_word,
                src_word,
                valid,
                ..
            } => hit(dst) || expr(dst_word) || expr(src_word) || expr(valid),
            Intrinsic::LdMatrix {
                arr, word, dst0, ..
            } => hit(arr) || expr(word) || expr(dst0),
            Intrinsic::MmaBf16 { c0, a0, b0, .. }
            | Intrinsic::MmaE4m3 { c0, a0, b0, .. }
            | Intrinsic::MmaF16 { c0, a0, b0, .. } => expr(c0) || expr(a0) || expr(b0),
            Intrinsic::ShflXor { value, .. } => expr(value),
            Intrinsic::VoteAny { pred, .. } => expr(pred),
            Intrinsic::StoreF32x2 { index, v0, v1, .. } => expr(index) || expr(v0) || expr(v1),
            Intrinsic::PrefetchL2 { word, .. } => expr(word),
            Intrinsic::GroupSync { group, count, .. } => expr(group) || expr(count),
            Intrinsic::CopyAsync {
                dst,
                dst_word,
                src_word,
                bars,
                index,
                ..
            } => hit(dst) || hit(bars) || expr(dst_word) || expr(src_word) || expr(index),
            Intrinsic::MbarInit { bars, index, .. }
            | Intrinsic::MbarArrive { bars, index }
            | Intrinsic::CopyArrive { bars, index } => hit(bars) || expr(index),
            Intrinsic::MbarWait {
                bars,
                index,
                parity,
            } => hit(bars) || expr(index) || expr(parity),
            Intrinsic::CpAsyncCommit
            | Intrinsic::CpAsyncWait { .. }
            | Intrinsic::NamedBarrier { .. }
            | Intrinsic::SyncWarp
            | Intrinsic::FenceProxyAsync => false,
        },
        Stmt::Tile(op) => match op {
            TileOp::GatherRows(g) => expr(&g.src_word),
            TileOp::AccFill { .. } | TileOp::Mma { .. } | TileOp::AccToShared { .. } => false,
            TileOp::MmaScaled { scale, .. } => expr(scale),
            TileOp::AccForEach { body, .. } => all(body),
            TileOp::AccRowReduce { dst, .. } => hit(dst),
            TileOp::SharedMap { value, .. } => expr(value),
            TileOp::DequantRows { scale, .. } => expr(scale),
            TileOp::Pipeline {
                count,
                load,
                compute,
                ..
            } => expr(count) || all(load) || all(compute),
            TileOp::OnlineSoftmax {
                m, l, expansion, ..
            } => hit(m) || hit(l) || all(expansion),
        },
    }
}
