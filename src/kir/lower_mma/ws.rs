//! The mbarrier-ring form of the tensor-core lowering ([`crate::kir::Lowering::MmaWs`]).
//!
//! The kernel's one top-level pipeline becomes a ring of `stages` shared-memory stages
//! handed over with mbarriers instead of workgroup barriers:
//! - one warp — the last, which holds no rows of the small products — is also the *producer*:
//!   at step `i` it waits until every warp has released the stage of step `i - 1`
//!   (mbarrier `empty[stage]`, one arrival per warp), writes each row's validity flag for step
//!   `i + stages - 1`, issues its row copies (`cp.async.bulk` with a transaction count on
//!   sm_90 and later, `cp.async` before; the helper decides per row) and arrives on
//!   `full[stage]` once they are in flight; the source words of the step after (its top-k
//!   index loads) are computed right away, so they are in flight during the compute;
//! - every warp waits on `full[stage]`, computes, and releases the stage.
//!
//! No workgroup barrier orders a stage; the compute's own barriers (online softmax, split-K
//! sums) remain. A dedicated producer warp was tried first: a ninth warp makes ptxas allocate
//! registers for twelve (168 per thread), and the split-K product with q in registers spilled.
//! The ring starts zeroed, so a row without a source holds finite values (see
//! [`TileOp::GatherRows`] with flags).

use super::{
    add, bin, dedupe_barriers, for_const, intr, let_, local_id, lt, mul, shared_layout, u, var, Cx,
    Error, Result, MAX_SHARED_BYTES, WARP,
};
use crate::kir::ir::*;
use std::collections::HashSet;

/// mbarrier bookkeeping of the producer/consumer form.
#[derive(Clone, Debug)]
pub(super) struct WsInfo {
    /// Shared array of the mbarriers (two words each): `full[0..stages]`, then
    /// `empty[0..stages]`.
    pub bars: String,
}

impl WsInfo {
    pub(super) fn plan(cx: &mut Cx) -> Result<WsInfo> {
        let bars = cx.fresh("ring_barriers");
        cx.new_shared.push(SharedDecl {
            name: bars.clone(),
            ty: Ty::U32,
            len: 4 * cx.stages,
        });
        Ok(WsInfo { bars })
    }
}

/// Lower a kernel with one top-level pipeline into the producer/consumer form (see the
/// module doc); a kernel without a pipeline gets the plain tensor-core lowering.
pub fn lower_ws(kernel: &Kernel, stages: u32) -> Result<Kernel> {
    let at = kernel
        .body
        .iter()
        .position(|s| matches!(s, Stmt::Tile(TileOp::Pipeline { .. })));
    let Some(_) = at else {
        return super::lower(kernel, stages, 0);
    };
    let pipelines = kernel
        .body
        .iter()
        .filter(|s| matches!(s, Stmt::Tile(TileOp::Pipeline { .. })))
        .count();
    let err = |message: String| Error::Kir {
        kernel: kernel.name.clone(),
        message,
    };
    if pipelines != 1 || nested_pipeline(&kernel.body) {
        return Err(err(
            "the producer/consumer lowering takes exactly one pipeline, at the top level".into(),
        ));
    }
    let mut cx = Cx::new(kernel, stages, true)?;
    cx.min_workgroups = 1;
    let threads = cx.w;
    let info = cx.ws.clone().ok_or_else(|| err("no ring plan".into()))?;
    let lowered = cx.stmts(&kernel.body)?;

    let mut body = std::mem::take(&mut cx.prelude);
    body.push(Stmt::Comment(
        "ring stages zeroed (rows without a source stay finite), mbarriers initialised".into(),
    ));
    for name in cx.ring_arrays() {
        let decl = cx
            .new_shared
            .iter()
            .find(|d| d.name == name)
            .cloned()
            .ok_or_else(|| err(format!("no ring array {name}")))?;
        let i = cx.fresh("zero_i");
        body.push(Stmt::For {
            var: i.clone(),
            start: local_id(),
            end: u(decl.len),
            step: u(threads),
            body: vec![Stmt::SharedStore {
                arr: name.clone(),
                index: var(&i, Ty::U32),
                value: if decl.ty == Ty::F32 {
                    Expr::F32(0.0)
                } else {
                    u(0)
                },
            }],
        });
    }
    let mut init = Vec::new();
    for s in 0..stages {
        init.push(intr(Intrinsic::MbarInit {
            bars: info.bars.clone(),
            index: u(s),
            count: WARP,
        }));
        init.push(intr(Intrinsic::MbarInit {
            bars: info.bars.clone(),
            index: u(stages + s),
            count: threads / WARP,
        }));
    }
    body.push(Stmt::If {
        cond: bin(BinOp::Eq, local_id(), u(0)),
        then: init,
        els: vec![],
    });
    body.push(intr(Intrinsic::FenceProxyAsync));
    body.push(Stmt::Barrier);
    body.extend(lowered);
    let body = dedupe_barriers(body);

    let mut out = kernel.clone();
    out.min_workgroups = 1;
    out.body = body;
    out.shared_tiles.clear();
    out.acc_tiles.clear();
    out.shared.extend(cx.new_shared);
    out.privates.extend(cx.new_privates);
    out.doc.push(format!(
        "mbarrier ring: {stages} stages; warp {} also issues the gathers (cp.async.bulk on sm_90 and later, cp.async before).",
        threads / WARP - 1
    ));
    let (_, bytes) = shared_layout(&out.shared);
    if bytes > MAX_SHARED_BYTES {
        return Err(Error::ResourceLimit {
            kernel: kernel.name.clone(),
            resource: "shared memory per block (SM120 limit, bytes)".into(),
            needed: bytes,
            limit: MAX_SHARED_BYTES,
        });
    }
    Ok(out)
}

fn nested_pipeline(stmts: &[Stmt]) -> bool {
    fn inner(stmts: &[Stmt]) -> bool {
        stmts.iter().any(|s| match s {
            Stmt::Tile(TileOp::Pipeline { .. }) => true,
            Stmt::If { then, els, .. } => inner(then) || inner(els),
            Stmt::For { body, .. } => inner(body),
            Stmt::Tile(TileOp::AccForEach { body, .. }) => inner(body),
            _ => false,
        })
    }
    stmts.iter().any(|s| match s {
        Stmt::If { then, els, .. } => inner(then) || inner(els),
        Stmt::For { body, .. } => inner(body),
        Stmt::Tile(TileOp::Pipeline { load, compute, .. }) => inner(load) || inner(compute),
        _ => false,
    })
}

struct Gather<'a> {
    dst: &'a str,
    dst_word0: u32,
    words: u32,
    src: &'a str,
    row: &'a str,
    src_word: &'a Expr,
    flags: Option<&'a String>,
    srcs: String,
}

impl Cx<'_> {
    /// Shared arrays of the ring (tiles a pipeline's load stage writes).
    pub(super) fn ring_arrays(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .tiles
            .iter()
            .filter(|(_, t)| t.ringed)
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    fn ws_gathers<'a>(&mut self, load: &'a [Stmt]) -> Result<Vec<Gather<'a>>> {
        let mut out = Vec::new();
        for s in load {
            match s {
                Stmt::Tile(TileOp::GatherRows {
                    dst,
                    dst_word0,
                    words,
                    src,
                    row,
                    src_word,
                    flags,
                }) => {
                    let rows = self.tile(dst)?.decl.rows;
                    let srcs = self.private(&format!("{dst}_src"), Ty::I32, rows.div_ceil(WARP));
                    out.push(Gather {
                        dst,
                        dst_word0: *dst_word0,
                        words: *words,
                        src,
                        row,
                        src_word,
                        flags: flags.as_ref(),
                        srcs,
                    });
                }
                Stmt::Comment(_) => {}
                other => {
                    return Err(self.err(format!(
                        "pipeline load stage may hold only gathers, found {other:?}"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// The ring loop: the producer warp's issue of step `i + stages - 1`, then every warp's
    /// wait, compute and release of step `i`.
    pub(super) fn consumer_loop(
        &mut self,
        v: &str,
        count: &Expr,
        load: &[Stmt],
        compute: &[Stmt],
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self
            .ws
            .clone()
            .ok_or_else(|| self.err("no ring plan".into()))?;
        let s = self.stages;
        let gathers = self.ws_gathers(load)?;
        let rows = match gathers.first() {
            Some(g) => self.tile(g.dst)?.decl.rows,
            None => return Err(self.err(format!("pipeline {v} gathers nothing"))),
        };
        let slots = rows.div_ceil(WARP);
        let lane = self.lane.lane.clone();
        let producer = bin(BinOp::Eq, self.lane.warp.clone(), u(self.warps - 1));
        let count_name = self.fresh(&format!("{v}_count"));
        out.push(let_(&count_name, self.expr(count)?));
        let countv = var(&count_name, Ty::U32);

        // source words of step `at` (its index loads): each producer lane for rows
        // lane + 32 * slot
        let addr = |cx: &mut Cx, at: Expr| -> Result<Stmt> {
            let mut body = vec![let_(v, at.clone())];
            for g in &gathers {
                let slot = cx.fresh("slot");
                let r = cx.fresh("gather_row");
                let rv = var(&r, Ty::U32);
                let store = |value: Expr| Stmt::PrivateStore {
                    arr: g.srcs.clone(),
                    index: var(&slot, Ty::U32),
                    value,
                };
                body.push(for_const(
                    &slot,
                    slots,
                    vec![
                        let_(&r, add(lane.clone(), mul(var(&slot, Ty::U32), u(WARP)))),
                        Stmt::If {
                            cond: lt(rv.clone(), u(rows)),
                            then: vec![let_(g.row, rv), store(cx.expr(g.src_word)?)],
                            els: vec![store(Expr::I32(-1))],
                        },
                    ],
                ));
            }
            Ok(Stmt::If {
                cond: lt(at, countv.clone()),
                then: body,
                els: vec![],
            })
        };
        // flags and row copies of step `at` into its stage, then the arrival on full[stage]
        let issue = |cx: &mut Cx, at: Expr| -> Result<Vec<Stmt>> {
            let stage_name = cx.fresh("load_stage");
            let stage = var(&stage_name, Ty::U32);
            let mut body = vec![let_(
                &stage_name,
                if s > 1 {
                    bin(BinOp::Rem, at.clone(), u(s))
                } else {
                    u(0)
                },
            )];
            let saved = cx.stage.replace(stage.clone());
            let slot = cx.fresh("slot");
            let r = cx.fresh("gather_row");
            let rv = var(&r, Ty::U32);
            let mut row_body = Vec::new();
            let sw_names: Vec<String> = gathers.iter().map(|_| cx.fresh("src_i32")).collect();
            for (g, n) in gathers.iter().zip(&sw_names) {
                row_body.push(let_(
                    n,
                    Expr::PrivateLoad {
                        arr: g.srcs.clone(),
                        ty: Ty::I32,
                        index: Box::new(var(&slot, Ty::U32)),
                    },
                ));
            }
            let mut flagged = HashSet::new();
            for (g, n) in gathers.iter().zip(&sw_names) {
                let swv = var(n, Ty::I32);
                let valid = bin(BinOp::Ge, swv.clone(), Expr::I32(0));
                if let Some(flags) = g.flags {
                    if flagged.insert(flags.clone()) {
                        let ft = cx.tile(flags)?.clone();
                        let base = cx.tile_base(&ft)?;
                        row_body.push(Stmt::SharedStore {
                            arr: flags.clone(),
                            index: add(base, rv.clone()),
                            value: Expr::Select(
                                Box::new(valid.clone()),
                                Box::new(Expr::F32(1.0)),
                                Box::new(Expr::F32(0.0)),
                            ),
                        });
                    }
                }
                let t = cx.tile(g.dst)?.clone();
                let base = cx.tile_base(&t)?;
                row_body.push(Stmt::If {
                    cond: valid,
                    then: vec![intr(Intrinsic::CopyAsync {
                        bytes: 4 * g.words,
                        dst: g.dst.to_string(),
                        dst_word: add(add(base, mul(rv.clone(), u(t.stride))), u(g.dst_word0)),
                        src: g.src.to_string(),
                        src_word: Expr::Cvt(Ty::U32, Box::new(swv)),
                        bars: info.bars.clone(),
                        index: stage.clone(),
                    })],
                    els: vec![],
                });
            }
            cx.stage = saved;
            body.push(for_const(
                &slot,
                slots,
                vec![
                    let_(&r, add(lane.clone(), mul(var(&slot, Ty::U32), u(WARP)))),
                    Stmt::If {
                        cond: lt(rv, u(rows)),
                        then: row_body,
                        els: vec![],
                    },
                ],
            ));
            body.push(intr(Intrinsic::CopyArrive {
                bars: info.bars.clone(),
                index: stage,
            }));
            Ok(body)
        };

        out.push(Stmt::Comment(format!(
            "pipeline {v}: {s}-stage mbarrier ring; the last warp issues the first {} steps",
            s - 1
        )));
        let mut first = Vec::new();
        for k in 0..s - 1 {
            first.push(addr(self, u(k))?);
            first.push(Stmt::If {
                cond: lt(u(k), countv.clone()),
                then: issue(self, u(k))?,
                els: vec![],
            });
        }
        first.push(addr(self, u(s - 1))?);
        out.push(Stmt::If {
            cond: producer.clone(),
            then: first,
            els: vec![],
        });
        let resident = self.resident_softmax(load, compute)?;
        for r in &resident {
            out.extend(self.softmax_load(r)?);
            self.resident.insert(r.m.clone(), r.clone());
        }
        let it = self.fresh(&format!("{v}_i"));
        let itv = var(&it, Ty::U32);
        let stage_name = self.fresh("stage");
        let stage = var(&stage_name, Ty::U32);
        // the producer: step i + s - 1 into the stage step i - 1 released
        let ahead = self.fresh("ahead");
        let aheadv = var(&ahead, Ty::U32);
        let mut produce = vec![let_(&ahead, add(itv.clone(), u(s - 1)))];
        let mut when = Vec::new();
        if s > 1 {
            when.push(Stmt::If {
                cond: bin(BinOp::Ge, itv.clone(), u(1)),
                then: vec![intr(Intrinsic::MbarWait {
                    bars: info.bars.clone(),
                    index: add(
                        u(s),
                        bin(BinOp::Rem, bin(BinOp::Sub, itv.clone(), u(1)), u(s)),
                    ),
                    parity: bin(
                        BinOp::BitAnd,
                        bin(BinOp::Div, bin(BinOp::Sub, itv.clone(), u(1)), u(s)),
                        u(1),
                    ),
                })],
                els: vec![],
            });
        } else {
            when.push(Stmt::If {
                cond: bin(BinOp::Ge, itv.clone(), u(1)),
                then: vec![intr(Intrinsic::MbarWait {
                    bars: info.bars.clone(),
                    index: u(s),
                    parity: bin(BinOp::BitAnd, bin(BinOp::Sub, itv.clone(), u(1)), u(1)),
                })],
                els: vec![],
            });
        }
        when.extend(issue(self, aheadv.clone())?);
        when.push(addr(self, add(aheadv.clone(), u(1)))?);
        produce.push(Stmt::If {
            cond: lt(aheadv, countv.clone()),
            then: when,
            els: vec![],
        });
        let mut body = vec![
            Stmt::Comment(format!(
                "pipeline {v}: the producer warp issues the rows {} steps ahead",
                s - 1
            )),
            Stmt::If {
                cond: producer,
                then: produce,
                els: vec![],
            },
            let_(v, itv.clone()),
            let_(
                &stage_name,
                if s > 1 {
                    bin(BinOp::Rem, itv.clone(), u(s))
                } else {
                    u(0)
                },
            ),
            Stmt::Comment(format!("pipeline {v}: wait for this step's rows, compute")),
            intr(Intrinsic::MbarWait {
                bars: info.bars.clone(),
                index: stage.clone(),
                parity: bin(BinOp::BitAnd, bin(BinOp::Div, itv.clone(), u(s)), u(1)),
            }),
        ];
        let saved = self.stage.replace(stage.clone());
        body.extend(self.stmts(compute)?);
        self.stage = saved;
        body.push(Stmt::Comment(format!(
            "pipeline {v}: release the stage to the producer"
        )));
        // only a stage the producer will fill again is released (every arrival is waited for)
        body.push(intr(Intrinsic::SyncWarp));
        body.push(Stmt::If {
            cond: bin(
                BinOp::And,
                bin(BinOp::Eq, self.lane.lane.clone(), u(0)),
                lt(add(itv.clone(), u(s)), countv.clone()),
            ),
            then: vec![intr(Intrinsic::MbarArrive {
                bars: info.bars.clone(),
                index: add(u(s), stage),
            })],
            els: vec![],
        });
        out.push(Stmt::For {
            var: it,
            start: u(0),
            end: countv,
            step: u(1),
            body,
        });
        for r in &resident {
            self.resident.remove(&r.m);
            out.extend(self.softmax_store(r)?);
        }
        Ok(())
    }
}
