//! The ring pipeline of [`TileOp::Pipeline`]: the loads of the next steps in flight while a
//! step computes.

use super::context::Cx;
use super::gather::{Gather, GatherPlan};
use crate::kir::expr::{add, bin, for_const, intr, let_, lt, u, var};
use crate::kir::ir::*;
use crate::Result;

impl Cx<'_> {
    /// The ring pipeline: loads of steps `step + 1 .. step + stages - 1` are in flight while
    /// step `step` computes. One commit group per step (empty past the end), so
    /// `wait_group(stages - 1)` always means "this step's copies have landed". The source
    /// addresses of each load are computed one iteration before its copies are issued, so
    /// the index loads they need are off the critical path.
    ///
    /// With `l2_ahead` = k > 0 the addresses are computed k iterations earlier still, and
    /// each iteration, right after issuing its copies, asks L2 for the rows of the step k
    /// past them: a queue of k + 1 address registers per gather row (`a[0]` the copies',
    /// `a[k]` the prefetch's), shifted by one each iteration.
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
            op: Gather<'a>,
            plan: GatherPlan,
            srcs: String,
            // the address queue past `srcs` (`l2_ahead` arrays; empty without the prefetch)
            queue: Vec<String>,
        }
        let mut gathers = Vec::new();
        for op in self.load_gathers(v, load)? {
            let plan = self.gather_plan(&op)?;
            let srcs = self.private(&format!("{}_src", op.dst), Ty::I32, plan.passes);
            let queue = (0..self.l2_ahead)
                .map(|_| self.private(&format!("{}_src_ahead", op.dst), Ty::I32, plan.passes))
                .collect();
            gathers.push(G {
                op,
                plan,
                srcs,
                queue,
            });
        }
        let k = self.l2_ahead;
        // the address array `j` of a gather's queue: 0 the copies', k the newest
        let slot = |g: &G, j: u32| -> String {
            match j {
                0 => g.srcs.clone(),
                j => g.queue[j as usize - 1].clone(),
            }
        };
        // address phase of step `at` into queue entry `j`, if the step exists
        let addr_into = |cx: &mut Self, at: Expr, j: u32| -> Result<Stmt> {
            let mut body = vec![let_(v, at.clone())];
            for g in &gathers {
                body.push(cx.gather_addr(&g.plan, &g.op, &slot(g, j))?);
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
                if let Some(c) = &g.op.comment {
                    body.push(Stmt::Comment(c.clone()));
                }
                body.push(cx.gather_copy(&g.plan, &g.op, &g.srcs)?);
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
                addr_into(self, var(&pre, Ty::U32), 0)?,
                copy(self, var(&pre, Ty::U32))?,
                intr(Intrinsic::CpAsyncCommit),
            ];
            out.push(for_const(&pre, s - 1, body));
        }
        for j in 0..=k {
            out.push(addr_into(self, u(s - 1 + j), j)?);
        }
        let it = self.fresh(&format!("{v}_i"));
        let itv = var(&it, Ty::U32);
        let mut body = vec![Stmt::Comment(format!(
            "pipeline {v}: copy the rows {} steps ahead, then the addresses of the step after",
            s - 1
        ))];
        body.push(copy(self, add(itv.clone(), u(s - 1)))?);
        if k > 0 {
            body.push(Stmt::Comment(format!(
                "pipeline {v}: ask L2 for the rows {k} steps past the copies"
            )));
            let far = add(itv.clone(), u(s - 1 + k));
            let mut ask = Vec::new();
            for g in &gathers {
                ask.push(self.gather_l2(&g.plan, &g.op, &slot(g, k)));
            }
            body.push(Stmt::If {
                cond: lt(far, count.clone()),
                then: ask,
                els: vec![],
            });
            // shift the queue: entry j takes entry j + 1's addresses
            for g in &gathers {
                for j in 0..k {
                    let p = self.fresh("queue_pass");
                    body.push(for_const(
                        &p,
                        g.plan.passes,
                        vec![Stmt::PrivateStore {
                            arr: slot(g, j),
                            index: var(&p, Ty::U32),
                            value: Expr::PrivateLoad {
                                arr: slot(g, j + 1),
                                ty: Ty::I32,
                                index: Box::new(var(&p, Ty::U32)),
                            },
                        }],
                    ));
                }
            }
        }
        body.push(addr_into(self, add(itv.clone(), u(s + k)), k)?);
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
        body.extend(self.units_step()?);
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
