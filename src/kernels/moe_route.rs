//! noaux_tc MoE routing (DeepSeek-V3 / GLM-5, docs/models.md): router logits in, the chosen
//! experts and their weights out. The definition is in [`crate::reference::moe_route`].
//!
//! One workgroup per token (grid-stride over tokens), the token's choice values `c = s + bias`
//! held in workgroup memory as order keys, so that every comparison is one u32 compare with
//! NaN below every number and −0 = +0. Selection is by rank, not by repeated argmax: an
//! expert's rank is the number of candidates that beat it (larger key, or an equal key and
//! a lower id), so the ranks of the candidates are a permutation, the expert of rank `j < top_k`
//! goes to output slot `j` (best first), and every slot is written exactly once. Groups are
//! ranked the same way. A rank costs a pass over the candidates per expert (at most
//! 4 × 1024 steps per thread at E = 1024), against `top_k` rounds of workgroup argmax for
//! the usual selection; at E = 256 it is 256 shared-memory reads per thread, one barrier.

use super::blocks::f32_order_key_zeros_equal;
use super::view::{DType, View, ViewArgs};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::moe_route::{moe_route, RouteParams};
use crate::reference::tensor::{f32s, put_f32s, put_i32s, read_view};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;
/// Routed experts a layer may have (the workgroup holds one key per expert and per group).
pub const MAX_EXPERTS: u32 = 1024;
/// Experts a token may choose.
pub const MAX_TOP_K: u32 = 32;

/// `1 / (1 + exp(−x))`, the router score; the same expression wherever it is needed, so a
/// recomputed score is the same bits.
fn sigmoid(x: Expr) -> Expr {
    f(1.0) / (f(1.0) + exp(-x))
}

/// The f32 of an order key (NaN for key 0).
fn key_value(key: Expr) -> Expr {
    super::blocks::f32_from_order_key(key)
}

/// `true` when (key `ka`, index `ia`) ranks before (`kb`, `ib`): a larger key, or the same
/// key and a lower index.
fn beats(ka: Expr, ia: Expr, kb: Expr, ib: Expr) -> Expr {
    ka.clone().gt(kb.clone()).or(ka.eq_(kb).and(ia.lt(ib)))
}

/// The routing kernel.
pub fn moe_route_kernel() -> Result<Kernel> {
    let mut b = KernelBuilder::new("moe_route", THREADS);
    b.doc("noaux_tc routing: s = sigmoid(logit), c = s + bias; groups of group_size consecutive experts scored by the sum of their two best c (one c for a group of one); the best topk_group groups kept; the top_k best c among their experts chosen, best first (ties to the lower id, NaN lowest).".to_string());
    b.doc("weights = chosen s (unbiased), divided by (sum of the chosen s + 1e-20) when norm = 1, times scale.".to_string());
    b.doc(format!(
        "Grid: x = min(tokens, 65535), a grid-stride loop over tokens; {THREADS} threads per token; experts <= {MAX_EXPERTS}, top_k <= {MAX_TOP_K}."
    ));
    let tokens = b.param("tokens", Ty::U32, "T, rows of logits");
    let experts = b.param("experts", Ty::U32, "E, routed experts");
    let n_group = b.param("n_group", Ty::U32, "expert groups (E % n_group = 0)");
    let group_size = b.param("group_size", Ty::U32, "E / n_group");
    let topk_group = b.param("topk_group", Ty::U32, "groups kept");
    let top_k = b.param("top_k", Ty::U32, "experts chosen per token");
    let norm = b.param("norm", Ty::U32, "1: normalise the weights (norm_topk_prob)");
    let scale = b.param("scale", Ty::F32, "routed_scaling_factor");
    let lv = ViewArgs::declare(&mut b, "logits", "logits [T, E]");
    let logits = b.buffer("logits", Elem::F32, Access::Read, "[T, E] f32 (view)");
    let bias = b.buffer(
        "bias",
        Elem::F32,
        Access::Read,
        "[E] f32 e_score_correction_bias",
    );
    let ids = b.buffer(
        "ids",
        Elem::I32,
        Access::ReadWrite,
        "[T, top_k] i32 chosen experts, best first",
    );
    let weights = b.buffer(
        "weights",
        Elem::F32,
        Access::ReadWrite,
        "[T, top_k] f32 routing weights",
    );
    let ckey = b.shared("ckey", Ty::U32, MAX_EXPERTS);
    let gkey = b.shared("gkey", Ty::U32, MAX_EXPERTS);
    let gkeep = b.shared("gkeep", Ty::U32, MAX_EXPERTS);
    let sel_id = b.shared("sel_id", Ty::U32, MAX_TOP_K);
    let sel_s = b.shared("sel_s", Ty::F32, MAX_TOP_K);

    b.for_("t", workgroup_id(0), tokens, num_workgroups(0), |b, t| {
        b.barrier();
        b.comment("choice values c = sigmoid(logit) + bias, as order keys");
        b.for_threads("e", experts.clone(), |b, e| {
            let x = b.let_("x", logits.at(lv.at(t.clone(), e.clone())));
            let c = b.let_("c", sigmoid(x) + bias.at(e.clone()));
            let k = f32_order_key_zeros_equal(b, c);
            b.shared_store(&ckey, e, k);
        });
        b.barrier();
        b.if_else(
            topk_group.clone().lt(n_group.clone()),
            |b| {
                b.comment("group scores: the sum of each group's two best c");
                b.for_threads("g", n_group.clone(), |b, g| {
                    let first = b.let_("first", g.clone() * group_size.clone());
                    let k1 = b.var("k1", u(0));
                    let k2 = b.var("k2", u(0));
                    b.for_(
                        "e",
                        first.clone(),
                        first.clone() + group_size.clone(),
                        u(1),
                        |b, e| {
                            let k = b.let_("k", ckey.at(e));
                            b.if_else(
                                k.clone().gt(k1.clone()),
                                |b| {
                                    b.set(&k2, k1.clone());
                                    b.set(&k1, k.clone());
                                },
                                |b| {
                                    b.set(
                                        &k2,
                                        select(k.clone().gt(k2.clone()), k.clone(), k2.clone()),
                                    )
                                },
                            );
                        },
                    );
                    let second = select(group_size.clone().gt(u(1)), key_value(k2.clone()), f(0.0));
                    let score = b.let_("score", key_value(k1.clone()) + second);
                    let gk = f32_order_key_zeros_equal(b, score);
                    b.shared_store(&gkey, g, gk);
                });
                b.barrier();
                b.comment("keep the groups ranked below topk_group");
                b.for_threads("g", n_group.clone(), |b, g| {
                    let kg = b.let_("kg", gkey.at(g.clone()));
                    let rank = b.var("rank", u(0));
                    b.for_("h", u(0), n_group.clone(), u(1), |b, h| {
                        let wins = beats(gkey.at(h.clone()), h, kg.clone(), g.clone());
                        b.set(&rank, rank.clone() + select(wins, u(1), u(0)));
                    });
                    b.shared_store(&gkeep, g, select(rank.lt(topk_group.clone()), u(1), u(0)));
                });
            },
            |b| {
                b.for_threads("g", n_group.clone(), |b, g| {
                    b.shared_store(&gkeep, g, u(1));
                });
            },
        );
        b.barrier();
        b.comment(
            "rank every candidate among the kept groups' experts; rank j < top_k goes to slot j",
        );
        b.for_threads("e", experts.clone(), |b, e| {
            b.if_(gkeep.at(e.clone() / group_size.clone()).eq_(u(1)), |b| {
                let ke = b.let_("ke", ckey.at(e.clone()));
                let rank = b.var("rank", u(0));
                b.for_("g", u(0), n_group.clone(), u(1), |b, g| {
                    b.if_(gkeep.at(g.clone()).eq_(u(1)), |b| {
                        let first = b.let_("first", g * group_size.clone());
                        b.for_(
                            "o",
                            first.clone(),
                            first + group_size.clone(),
                            u(1),
                            |b, o| {
                                let wins = beats(ckey.at(o.clone()), o, ke.clone(), e.clone());
                                b.set(&rank, rank.clone() + select(wins, u(1), u(0)));
                            },
                        );
                    });
                });
                b.if_(rank.clone().lt(top_k.clone()), |b| {
                    let x = logits.at(lv.at(t.clone(), e.clone()));
                    b.shared_store(&sel_id, rank.clone(), e.clone());
                    b.shared_store(&sel_s, rank.clone(), sigmoid(x));
                });
            });
        });
        b.barrier();
        b.comment("weights: the chosen scores, normalised in best-first order, scaled");
        b.if_(local_id().lt(top_k.clone()), |b| {
            let sum = b.var("sum", f(0.0));
            b.for_("j", u(0), top_k.clone(), u(1), |b, j| {
                b.set(&sum, sum.clone() + sel_s.at(j));
            });
            let w = b.let_("w", sel_s.at(local_id()));
            let w = b.let_(
                "wn",
                select(
                    norm.clone().eq_(u(1)),
                    w.clone() / (sum.clone() + f(1e-20)),
                    w,
                ),
            );
            let o = b.let_("o", t.clone() * top_k.clone() + local_id());
            b.store(&ids, o.clone(), sel_id.at(local_id()).as_i32());
            b.store(&weights, o, w * scale.clone());
        });
    });
    b.finish()
}

/// noaux_tc routing of `logits [T, E]` with `bias [E]`. Buffers: `logits` (view), `bias`
/// (`[E]` f32), `ids` (`[T, top_k]` i32, packed), `weights` (`[T, top_k]` f32, packed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRouteOp {
    /// `[T, E]` f32 router logits.
    pub logits: View,
    pub n_group: u32,
    pub topk_group: u32,
    pub top_k: u32,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl MoeRouteOp {
    fn validate(&self) -> Result<()> {
        self.logits.validate("logits")?;
        let e = self.logits.cols;
        if !(1..=MAX_EXPERTS).contains(&e) {
            return Err(Error::arg(
                "logits",
                format!("1 to {MAX_EXPERTS} experts (columns)"),
                e,
            ));
        }
        if self.n_group == 0 || e % self.n_group != 0 {
            return Err(Error::arg(
                "n_group",
                format!("a divisor of the {e} experts"),
                self.n_group,
            ));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(Error::arg(
                "topk_group",
                format!("1 to n_group = {}", self.n_group),
                self.topk_group,
            ));
        }
        let candidates = self.topk_group * (e / self.n_group);
        let most = candidates.min(MAX_TOP_K);
        if self.top_k == 0 || self.top_k > most {
            return Err(Error::arg(
                "top_k",
                format!(
                    "1 to {most} (at most {MAX_TOP_K}, and the {candidates} experts of the kept groups)"
                ),
                self.top_k,
            ));
        }
        if !self.routed_scaling_factor.is_finite() {
            return Err(Error::arg(
                "routed_scaling_factor",
                "a finite f32",
                self.routed_scaling_factor,
            ));
        }
        if self.logits.rows as u64 * self.top_k as u64 > u32::MAX as u64 {
            return Err(Error::arg(
                "logits",
                "fewer than 2^32 outputs (tokens x top_k)",
                self.logits.rows,
            ));
        }
        Ok(())
    }

    fn outputs(&self) -> u64 {
        self.logits.rows as u64 * self.top_k as u64
    }
}

impl Op for MoeRouteOp {
    fn name(&self) -> String {
        format!(
            "moe_route [{}, {}] groups {}/{} top {}",
            self.logits.rows, self.logits.cols, self.topk_group, self.n_group, self.top_k
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let (t, e, k) = (self.logits.rows, self.logits.cols, self.top_k);
        vec![
            Binding::read(
                "logits",
                self.logits.min_bytes(DType::F32),
                format!("[{t}, {e}] f32 router logits"),
            ),
            Binding::read("bias", e as u64 * 4, format!("[{e}] f32 correction bias")),
            Binding::write(
                "ids",
                self.outputs() * 4,
                format!("[{t}, {k}] i32 expert ids"),
            ),
            Binding::write(
                "weights",
                self.outputs() * 4,
                format!("[{t}, {k}] f32 routing weights"),
            ),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), |_| moe_route_kernel())?;
        let e = self.logits.cols;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.logits.rows)),
            ("experts".into(), ParamValue::U32(e)),
            ("n_group".into(), ParamValue::U32(self.n_group)),
            ("group_size".into(), ParamValue::U32(e / self.n_group)),
            ("topk_group".into(), ParamValue::U32(self.topk_group)),
            ("top_k".into(), ParamValue::U32(self.top_k)),
            ("norm".into(), ParamValue::U32(self.norm_topk_prob as u32)),
            ("scale".into(), ParamValue::F32(self.routed_scaling_factor)),
        ];
        p.extend(self.logits.params("logits"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [self.logits.rows.min(65535), 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let logits = read_view(bufs.get("logits")?, DType::F32, &self.logits, "logits")?;
        let e = self.logits.cols as usize;
        let bias: Vec<f64> = f32s(bufs.get("bias")?)[..e]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let params = RouteParams {
            n_group: self.n_group as usize,
            topk_group: self.topk_group as usize,
            top_k: self.top_k as usize,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor as f64,
        };
        let (ids, w) = moe_route(&logits, &bias, &params);
        put_i32s(bufs.get_mut("ids")?, &ids);
        let w: Vec<f32> = w.iter().map(|&v| v as f32).collect();
        put_f32s(bufs.get_mut("weights")?, &w);
        Ok(())
    }
}
