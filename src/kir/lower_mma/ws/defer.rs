//! Each ring step's closing `O += P · V` deferred into the next step
//! ([`crate::kir::DeferPv`]): where it may go, and the statements that run it there and after
//! the loop.

use super::super::{add, bin, let_, local_id, u, var, Cx, Result};
use crate::kir::expr::select;
use crate::kir::ir::*;
use std::collections::HashSet;

/// The deferred P · V of a ring loop ([`Cx::deferred_pv`]).
pub(in super::super) struct DeferredPv {
    /// The lowered step's statements after its last workgroup barrier: the product, split
    /// off the step.
    pub tail: Vec<Stmt>,
    /// P's tile zeroed, then a barrier: what step 0's deferred product reads as P (empty for
    /// [`crate::kir::DeferPv::Early`], which skips step 0's).
    pub zero_p: Vec<Stmt>,
    /// [`crate::kir::DeferPv::Early`]: before the step's wait, skipped at step 0.
    pub early: bool,
}

/// `stmts` with every read of the variable `from` reading `to` instead.
fn rename_var(stmts: &[Stmt], from: &str, to: &str) -> Vec<Stmt> {
    stmts
        .iter()
        .cloned()
        .map(|st| {
            st.map(
                &mut |e| match e {
                    Expr::Var(n, t) if n == from => Expr::Var(to.to_string(), t),
                    e => e,
                },
                &mut |s| s,
            )
        })
        .collect()
}

/// Does `stmts` hold a barrier of any kind, at any depth?
fn has_barrier(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::Barrier => true,
        Stmt::Intrinsic(
            Intrinsic::NamedBarrier { .. }
            | Intrinsic::MbarWait { .. }
            | Intrinsic::MbarArrive { .. }
            | Intrinsic::MbarInit { .. },
        ) => true,
        Stmt::If { then, els, .. } => has_barrier(then) || has_barrier(els),
        Stmt::For { body, .. } => has_barrier(body),
        _ => false,
    })
}

impl Cx<'_> {
    /// Where the ring loop runs each step's closing P · V ([`crate::kir::DeferPv`]): `None`
    /// at the end of the step (`lowered` as it is); else the product, split off the end of
    /// `lowered`, and what goes before the loop. Deferred, step `i - 1`'s product runs in step
    /// `i`, before its first workgroup barrier: the stage it reads is refilled only after that
    /// barrier, and P is rewritten only after the step's later ones, so neither needs another
    /// barrier; the last step's product follows the loop.
    ///
    /// It needs a ring the form applies to ([`crate::kir::DeferPv::unmet`]; warp groups are not
    /// built, as bf16's grouped kernel has one stage) and a step that ends in `O += P · V`
    /// alone after its last barrier. A kernel outside that is an error
    /// (`DecodeConfig::with_defer_pv` asks only where it holds).
    pub(in super::super) fn deferred_pv(
        &mut self,
        v: &str,
        compute: &[Stmt],
        lowered: &mut Vec<Stmt>,
    ) -> Result<Option<DeferredPv>> {
        use crate::kir::DeferPv;
        let form = self.defer_pv;
        if form == DeferPv::Off {
            return Ok(None);
        }
        let refuse = |cx: &Self, why: &str| -> Result<Option<DeferredPv>> {
            Err(cx.err(format!(
                "P . V deferred ({}: SPARSE_MLA_DEFER_PV={}) needs {why}",
                form.suffix(),
                form.env_value()
            )))
        };
        let ring = (self.stages, self.groups);
        if let Some(why) = form.unmet(ring, self.row_softmax, self.units.is_some()) {
            return refuse(self, why);
        }
        let last_op = compute.iter().rfind(|s| !matches!(s, Stmt::Comment(_)));
        let a = match last_op {
            Some(Stmt::Tile(TileOp::Mma { a, .. } | TileOp::MmaScaled { a, .. })) => a,
            _ => return refuse(self, "a step that ends in a product"),
        };
        let ringed = self.tile(&a.tile)?.ringed;
        let decl = self.new_shared.iter().find(|d| d.name == a.tile).cloned();
        let Some(decl) = decl.filter(|d| d.alias.is_none() && !ringed) else {
            return refuse(self, "the product's A operand in a tile of its own (P)");
        };
        let Some(last_barrier) = lowered.iter().rposition(|s| matches!(s, Stmt::Barrier)) else {
            return refuse(self, "a workgroup barrier before the step's product");
        };
        let tail = &lowered[last_barrier + 1..];
        if tail.is_empty() || has_barrier(tail) {
            return refuse(self, "a product after the step's last barrier");
        }
        // the product may read only what is bound before the loop (and the stage, renamed)
        let mut reads = HashSet::new();
        crate::kir::walk::free_reads(tail, &mut reads);
        let mut head = HashSet::new();
        crate::kir::walk::collect_names(&lowered[..=last_barrier], &mut head);
        if let Some(n) = reads.iter().find(|n| *n == v || head.contains(*n)) {
            let why = format!("a product that reads nothing the step computes (it reads `{n}`)");
            return refuse(self, &why);
        }
        let tail = lowered.split_off(last_barrier + 1);
        if form == DeferPv::Early {
            return Ok(Some(DeferredPv {
                tail,
                zero_p: Vec::new(),
                early: true,
            }));
        }
        let z = self.fresh("zero_p");
        let zero_p = vec![
            Stmt::Comment(format!(
                "{}: zeros, the P of the deferred P . V before the first step",
                decl.name
            )),
            Stmt::For {
                var: z.clone(),
                start: local_id(),
                end: u(decl.len),
                step: u(self.w),
                body: vec![Stmt::SharedStore {
                    arr: decl.name.clone(),
                    index: var(&z, Ty::U32),
                    value: if decl.ty == Ty::F32 {
                        Expr::F32(0.0)
                    } else {
                        u(0)
                    },
                }],
            },
            Stmt::Barrier,
        ];
        Ok(Some(DeferredPv {
            tail,
            zero_p,
            early: false,
        }))
    }

    /// Step `it`'s run of the previous step's product, into `body` (the step's names, then
    /// its wait, last): with [`crate::kir::DeferPv::Early`] before the wait, skipped at step
    /// 0; else after it, on step `it`'s own stage at step 0.
    pub(in super::super) fn deferred_pv_in_step(
        &mut self,
        (v, it, stage): (&str, &Expr, &str),
        deferred: &DeferredPv,
        body: &mut Vec<Stmt>,
    ) {
        let s = self.stages;
        let prev = self.fresh("prev_stage");
        let before = bin(BinOp::Rem, add(it.clone(), u(s - 1)), u(s));
        let mut pv = vec![Stmt::Comment(format!(
            "pipeline {v}: O += P . V of the previous step{}",
            if deferred.early {
                ""
            } else {
                " (P is 0 before the first)"
            }
        ))];
        if deferred.early {
            // before the wait, in its own block: skipped at step 0
            let wait = body.pop();
            pv.push(let_(&prev, before));
            pv.extend(rename_var(&deferred.tail, stage, &prev));
            body.push(Stmt::If {
                cond: bin(BinOp::Gt, it.clone(), u(0)),
                then: pv,
                els: vec![],
            });
            body.extend(wait);
        } else {
            // step i - 1's stage; at step 0, this step's own (landed, finite) rows under a P
            // that is all zeros, so the product adds exactly 0 without a branch that would
            // keep it apart from the scores
            pv.push(let_(
                &prev,
                select(
                    bin(BinOp::Eq, it.clone(), u(0)),
                    var(stage, Ty::U32),
                    before,
                ),
            ));
            pv.extend(rename_var(&deferred.tail, stage, &prev));
            body.extend(pv);
        }
    }

    /// After the loop of `count` steps: the last step's product, on the stage that step
    /// computed on (named `stage`, as in the step).
    pub(in super::super) fn deferred_pv_last(
        &self,
        (v, count, stage): (&str, Expr, &str),
        deferred: DeferredPv,
        out: &mut Vec<Stmt>,
    ) {
        let mut last = vec![let_(
            stage,
            bin(
                BinOp::Rem,
                bin(BinOp::Sub, count.clone(), u(1)),
                u(self.stages),
            ),
        )];
        last.extend(deferred.tail);
        out.push(Stmt::Comment(format!(
            "pipeline {v}: O += P . V of the last step"
        )));
        out.push(Stmt::If {
            cond: bin(BinOp::Gt, count, u(0)),
            then: last,
            els: vec![],
        });
    }
}
