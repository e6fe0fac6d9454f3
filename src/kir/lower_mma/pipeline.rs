//! The ring pipeline of [`TileOp::Pipeline`]: the loads of the next steps in flight while a
//! step computes.

use super::context::Cx;
use super::gather::GatherPlan;
use crate::kir::expr::{add, bin, for_const, intr, let_, lt, u, var};
use crate::kir::ir::*;
use crate::Result;

impl Cx<'_> {
    /// The ring pipeline: loads of steps `step + 1 .. step + stages - 1` are in flight while
    /// step `step` computes. One commit group per step (empty past the end), so
    /// `wait_group(stages - 1)` always means "this step's copies have landed". The source
    /// addresses of each load are computed one iteration before its copies are issued, so
    /// the index loads they need are off the critical path.
    pub(super) fn pipeline(
        &mut self,
        v: &str,
        count: &Expr,
        load: &[Stmt],
        compute: &[Stmt],
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let s = self.stages;
        let count_name = self.fresh(&format!("{v}_count"));
        out.push(let_(&count_name, self.expr(count)?));
        let count = var(&count_name, Ty::U32);
        // the gathers of the load stage, each with its source-word registers
        struct G<'a> {
            plan: GatherPlan,
            srcs: String,
            dst: &'a str,
            dst_word0: u32,
            words: u32,
            src: &'a str,
            row: &'a str,
            src_word: &'a Expr,
            flags: Option<&'a str>,
            comment: Option<String>,
        }
        let mut gathers = Vec::new();
        let mut comment = None;
        for st in load {
            match st {
                Stmt::Tile(TileOp::GatherRows {
                    dst,
                    dst_word0,
                    words,
                    src,
                    row,
                    src_word,
                    flags,
                }) => {
                    let plan = self.gather_plan(dst, *dst_word0, *words)?;
                    let srcs = self.private(&format!("{dst}_src"), Ty::I32, plan.passes);
                    gathers.push(G {
                        plan,
                        srcs,
                        dst,
                        dst_word0: *dst_word0,
                        words: *words,
                        src,
                        row,
                        src_word,
                        flags: flags.as_deref(),
                        comment: comment.take(),
                    });
                }
                Stmt::Comment(c) => comment = Some(c.clone()),
                other => {
                    return Err(self.err(format!(
                        "pipeline {v}: the load stage may hold only gathers, found {other:?}"
                    )))
                }
            }
        }
        // address phase of step `at`, if it exists
        let addr = |cx: &mut Self, at: Expr| -> Result<Stmt> {
            let mut body = vec![let_(v, at.clone())];
            for g in &gathers {
                body.push(cx.gather_addr(&g.plan, g.row, g.src_word, &g.srcs)?);
            }
            Ok(Stmt::If {
                cond: lt(at, count.clone()),
                then: body,
                els: vec![],
            })
        };
        // copy phase of step `at` into its ring stage, if it exists
        let copy = |cx: &mut Self, at: Expr| -> Result<Stmt> {
            let stage_name = cx.fresh("load_stage");
            let mut body = Vec::new();
            if s > 1 {
                body.push(let_(&stage_name, bin(BinOp::Rem, at.clone(), u(s))));
            }
            let saved = cx.stage.replace(var(&stage_name, Ty::U32));
            for g in &gathers {
                if let Some(c) = &g.comment {
                    body.push(Stmt::Comment(c.clone()));
                }
                body.push(cx.gather_copy(
                    &g.plan,
                    g.dst,
                    (g.dst_word0, g.words),
                    g.src,
                    &g.srcs,
                    g.flags,
                )?);
            }
            cx.stage = saved;
            Ok(Stmt::If {
                cond: lt(at, count.clone()),
                then: body,
                els: vec![],
            })
        };
        out.push(Stmt::Comment(format!(
            "pipeline {v}: {s}-stage ring of cp.async gathers; first load the steps ahead"
        )));
        // Barrier: the ring may still be read by earlier code (write-after-read).
        out.push(Stmt::Barrier);
        // Online-softmax row state that lives in registers while the loop runs.
        let resident = self.resident_softmax(load, compute)?;
        for r in &resident {
            out.extend(self.softmax_load(r)?);
            self.resident.insert(r.m.clone(), r.clone());
        }
        if s > 1 {
            let pre = self.fresh("prefetch");
            let body = vec![
                addr(self, var(&pre, Ty::U32))?,
                copy(self, var(&pre, Ty::U32))?,
                intr(Intrinsic::CpAsyncCommit),
            ];
            out.push(for_const(&pre, s - 1, body));
        }
        out.push(addr(self, u(s - 1))?);
        let it = self.fresh(&format!("{v}_i"));
        let itv = var(&it, Ty::U32);
        let mut body = vec![Stmt::Comment(format!(
            "pipeline {v}: copy the rows {} steps ahead, then the addresses of the step after",
            s - 1
        ))];
        body.push(copy(self, add(itv.clone(), u(s - 1)))?);
        body.push(addr(self, add(itv.clone(), u(s)))?);
        body.push(intr(Intrinsic::CpAsyncCommit));
        body.push(intr(Intrinsic::CpAsyncWait { pending: s - 1 }));
        body.push(Stmt::Barrier);
        body.push(Stmt::Comment(format!("pipeline {v}: compute")));
        body.push(let_(v, itv.clone()));
        let stage_name = self.fresh("stage");
        if s > 1 {
            body.push(let_(&stage_name, bin(BinOp::Rem, itv, u(s))));
        }
        let saved = self.stage.replace(var(&stage_name, Ty::U32));
        body.extend(self.stmts(compute)?);
        self.stage = saved;
        // Barrier: the next iteration's load overwrites the stage computed on one step ago.
        body.push(Stmt::Barrier);
        out.push(Stmt::For {
            var: it,
            start: u(0),
            end: count,
            step: u(1),
            body,
        });
        out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
        for r in &resident {
            self.resident.remove(&r.m);
            out.extend(self.softmax_store(r)?);
        }
        Ok(())
    }
}
