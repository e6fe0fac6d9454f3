//! Row reductions of an accumulator: within a thread, the four lanes of a row, then across
//! the warps of a row through shared memory.

use super::context::Cx;
use crate::kir::expr::{add, bin, for_const, local_id, mul, priv_load, shared_load, u, var};
use crate::kir::ir::*;
use crate::Result;

impl Cx<'_> {
    pub(super) fn row_reduce(
        &mut self,
        acc: &str,
        op: Reduce,
        dst: &str,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.acc(acc)?.clone();
        let rows = info.decl.rows;
        let scratch = self
            .reduce_scratch
            .clone()
            .ok_or_else(|| self.err("row reduce without scratch".into()))?;
        let combine = match op {
            Reduce::Max => BinOp::Max,
            Reduce::Sum => BinOp::Add,
        };
        let (i, h) = (self.fresh("mi"), self.fresh("half"));
        let (iv, hv) = (var(&i, Ty::U32), var(&h, Ty::U32));
        let x = self.fresh("red");
        let xv = var(&x, Ty::F32);
        // element k of the thread's row (i, h): fragments (i, j), values 2h, 2h + 1
        let elem = |j: u32, e: u32| {
            priv_load(
                acc,
                add(
                    mul(add(mul(iv.clone(), u(info.fnw)), u(j)), u(4)),
                    add(mul(hv.clone(), u(2)), u(e)),
                ),
            )
        };
        let mut inner = vec![Stmt::Var {
            name: x.clone(),
            value: bin(combine, elem(0, 0), elem(0, 1)),
        }];
        for j in 1..info.fnw {
            for e in 0..2 {
                inner.push(Stmt::Assign {
                    name: x.clone(),
                    value: bin(combine, xv.clone(), elem(j, e)),
                });
            }
        }
        // the quad's four lanes hold the row's columns
        inner.extend(self.lanes_reduce(&x, 4, combine));
        let row = add(
            add(info.row0.clone(), mul(iv, u(16))),
            add(mul(hv, u(8)), self.lane.group.clone()),
        );
        inner.push(Stmt::If {
            cond: bin(BinOp::Eq, self.lane.quad.clone(), u(0)),
            then: vec![Stmt::SharedStore {
                arr: scratch.clone(),
                index: add(mul(info.wn.clone(), u(rows)), row),
                value: xv,
            }],
            els: vec![],
        });
        let per_warp = for_const(&i, info.fmw, vec![for_const(&h, 2, inner)]);
        out.extend(self.for_used_warps(&info, vec![per_warp]));
        out.push(Stmt::Barrier);
        // across the warps that share rows
        let (r, g, y) = (self.fresh("r"), self.fresh("g"), self.fresh("red"));
        let (r_v, g_v, y_v) = (var(&r, Ty::U32), var(&g, Ty::U32), var(&y, Ty::F32));
        let mut final_body = vec![Stmt::Var {
            name: y.clone(),
            value: shared_load(&scratch, Ty::F32, r_v.clone()),
        }];
        if info.gn > 1 {
            final_body.push(Stmt::For {
                var: g.clone(),
                start: u(1),
                end: u(info.gn),
                step: u(1),
                body: vec![Stmt::Assign {
                    name: y.clone(),
                    value: bin(
                        combine,
                        y_v.clone(),
                        shared_load(&scratch, Ty::F32, add(mul(g_v, u(rows)), r_v.clone())),
                    ),
                }],
            });
        }
        final_body.push(Stmt::SharedStore {
            arr: dst.into(),
            index: r_v,
            value: y_v,
        });
        out.push(Stmt::For {
            var: r,
            start: local_id(),
            end: u(rows),
            step: u(self.w),
            body: final_body,
        });
        out.push(Stmt::Barrier);
        Ok(())
    }
}
