//! The lightning indexer's scores (DeepSeek-V3.2 / GLM-5), described once:
//!
//! `I[t, s] = Σ_h relu(scale · q[t, h, :] · k_s) · w[t, h] · weight_scale` for every position
//! `s ≤ positions[t]` of token t's sequence, with q rounded to bf16 (as the reference model
//! computes it in bf16) and keys read as bf16 rows from the sequence's key cache through its
//! block table (`slot = block_table[r, s / page_size] · page_size + s % page_size`,
//! `r = req_of_token[t]`). Positions past the token's own (the causal mask), and positions
//! whose page is not assigned, score −inf. The top-k of each row is [`super::topk`].
//!
//! One workgroup of 128 threads per (token, 128 positions): each thread owns one position and
//! walks the query's heads in chunks of 8, with the chunk of q staged in workgroup memory and
//! 8 dot products in registers; the key row is re-read (from cache) once per chunk.

use super::view::{DType, View, ViewArgs};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::reference::numerics::{bf16_from_bits, round_bf16};
use crate::reference::tensor::{i32s, put_f32s, read_view};
use crate::reference::vbt::slot;
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 128;
/// Heads per chunk of q in workgroup memory.
const HEAD_CHUNK: u32 = 8;

/// Compile-time knobs: the key width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScoresConfig {
    pub head_dim: u32,
}

fn scores_kernel(cfg: &ScoresConfig) -> Result<Kernel> {
    let d = cfg.head_dim;
    if d == 0 || d % 2 != 0 || HEAD_CHUNK * d > 2048 {
        return Err(Error::arg("head_dim", "an even width up to 256", d));
    }
    let mut b = KernelBuilder::new(format!("indexer_scores_d{d}"), THREADS);
    b.doc(format!(
        "Lightning indexer scores: scores[t, s] = sum_h relu(scale * bf16(q[t*heads + h, :]) . k_s) * w[t, h] * weight_scale, keys bf16 [num_slots, {d}]."
    ));
    b.doc("k_s at slot block_table[r, s / page_size] * page_size + s % page_size, r = req_of_token[t]; -inf for s > positions[t] or an unassigned page.".to_string());
    b.doc(format!(
        "Grid: x = ceil(columns / {THREADS}), y = tokens. One thread per position; q staged {HEAD_CHUNK} heads at a time."
    ));
    let tokens = b.param("tokens", Ty::U32, "T");
    let heads = b.param("heads", Ty::U32, "indexer heads");
    let columns = b.param("columns", Ty::U32, "S, columns of scores (the longest row)");
    let scale = b.param("scale", Ty::F32, "head_dim^-0.5, on each dot product");
    let weight_scale = b.param("weight_scale", Ty::F32, "heads^-0.5, on the head weights");
    let page_size = b.param("page_size", Ty::U32, "slots per page");
    let max_pages = b.param("max_pages", Ty::U32, "columns of block_table");
    let requests = b.param("requests", Ty::U32, "rows of block_table");
    let num_slots = b.param("num_slots", Ty::U32, "rows of the key cache");
    let qv = ViewArgs::declare(&mut b, "q", "q [T * heads, head_dim]");
    let wv = ViewArgs::declare(&mut b, "w", "w [T, heads]");
    let q = b.buffer(
        "q",
        Elem::F32,
        Access::Read,
        "[T * heads, head_dim] f32 (view)",
    );
    let w = b.buffer(
        "w",
        Elem::F32,
        Access::Read,
        "[T, heads] f32 head weights (view)",
    );
    let keys = b.buffer(
        "keys",
        Elem::Bf16,
        Access::Read,
        "[num_slots, head_dim] bf16",
    );
    let block_table = b.buffer(
        "block_table",
        Elem::I32,
        Access::Read,
        "[requests, max_pages] i32",
    );
    let req_of_token = b.buffer("req_of_token", Elem::I32, Access::Read, "[T] i32");
    let positions = b.buffer("positions", Elem::I32, Access::Read, "[T] i32");
    let scores = b.buffer(
        "scores",
        Elem::F32,
        Access::ReadWrite,
        "[T, columns] f32 (packed)",
    );
    let qs = b.shared("qs", Ty::F32, HEAD_CHUNK * d);
    let ws = b.shared("ws", Ty::F32, HEAD_CHUNK);

    let t = b.let_("t", workgroup_id(1));
    let s = b.let_("s", workgroup_id(0) * u(THREADS) + local_id());
    let pos = b.let_("pos", positions.at(t.clone()));
    let r = b.let_("r", req_of_token.at(t.clone()));
    let page = b.let_("page", s.clone() / page_size.clone());
    let in_row = b.let_(
        "in_row",
        s.clone()
            .lt(columns.clone())
            .and(pos.clone().ge(i(0)))
            .and(s.clone().le(pos.as_u32()))
            .and(r.clone().ge(i(0)))
            .and(r.clone().as_u32().lt(requests.clone()))
            .and(page.clone().lt(max_pages.clone())),
    );
    b.comment("the key's slot, read only for a position inside the row");
    let entry = select(in_row.clone(), r.as_u32() * max_pages.clone() + page, u(0));
    let block = b.let_(
        "block",
        select(in_row.clone(), block_table.at(entry), i(-1)),
    );
    let slot_u = b.let_(
        "slot",
        select(block.clone().ge(i(0)), block.clone().as_u32(), u(0)) * page_size.clone()
            + s.clone() % page_size.clone(),
    );
    let valid = b.let_(
        "valid",
        in_row
            .and(block.ge(i(0)))
            .and(slot_u.clone().lt(num_slots.clone())),
    );
    let kbase = b.let_("kbase", select(valid.clone(), slot_u, u(0)) * u(d / 2));
    let score = b.var("score", f(0.0));

    b.for_("h0", u(0), heads.clone(), u(HEAD_CHUNK), |b, h0| {
        b.comment("stage this chunk of heads of q (rounded to bf16) and their weights");
        b.barrier();
        b.for_threads("e", u(HEAD_CHUNK * d), |b, e| {
            let hh = b.let_("hh", h0.clone() + e.clone() / u(d));
            let c = b.let_("c", e.clone() % u(d));
            let ok = hh
                .clone()
                .lt(heads.clone())
                .and(t.clone().lt(tokens.clone()));
            let qi = select(
                ok.clone(),
                qv.at(t.clone() * heads.clone() + hh.clone(), c),
                qv.off.clone(),
            );
            let v = b.let_("qv", q.at(qi));
            let rounded = f32_from_bits((pack_bf16x2(v, f(0.0)) & u(0xffff)) << u(16));
            b.shared_store(&qs, e, select(ok, rounded, f(0.0)));
        });
        b.if_(local_id().lt(u(HEAD_CHUNK)), |b| {
            let hh = b.let_("hh", h0.clone() + local_id());
            let ok = hh
                .clone()
                .lt(heads.clone())
                .and(t.clone().lt(tokens.clone()));
            let wi = select(ok.clone(), wv.at(t.clone(), hh.clone()), wv.off.clone());
            let wval = b.let_("wval", w.at(wi));
            b.shared_store(
                &ws,
                local_id(),
                select(ok, wval * weight_scale.clone(), f(0.0)),
            );
        });
        b.barrier();
        b.if_(valid.clone(), |b| {
            let dots: Vec<_> = (0..HEAD_CHUNK)
                .map(|h| b.var(&format!("dot{h}"), f(0.0)))
                .collect();
            // Over the key's words (a loop from kbase, so the compiler does not unroll all of it).
            b.for_(
                "kw",
                kbase.clone(),
                kbase.clone() + u(d / 2),
                u(1),
                |b, kw| {
                    let word = b.let_("kword", keys.word(kw.clone()));
                    let k0 = b.let_("k0", f32_from_bits(word.clone() << u(16)));
                    let k1 = b.let_("k1", f32_from_bits(word & u(0xffff_0000)));
                    let c2 = b.let_("c2", (kw - kbase.clone()) * u(2));
                    for (h, dot) in dots.iter().enumerate() {
                        let base = u(h as u32 * d) + c2.clone();
                        let v = fma(k0.clone(), qs.at(base.clone()), dot.clone());
                        let v = fma(k1.clone(), qs.at(base + u(1)), v);
                        b.set(dot, v);
                    }
                },
            );
            for (h, dot) in dots.iter().enumerate() {
                let relu = (dot.clone() * scale.clone()).max(f(0.0));
                b.set(&score, fma(relu, ws.at(u(h as u32)), score.clone()));
            }
        });
    });
    b.comment("the row: scores inside it, -inf past the token's position");
    b.if_(
        s.clone().lt(columns.clone()).and(t.clone().lt(tokens)),
        |b| {
            let out = select(valid, score, f32_from_bits(u(0xff80_0000)));
            b.store(&scores, t * columns + s, out);
        },
    );
    b.finish()
}

/// Indexer scores for `tokens` query tokens. Buffers: `q` (view `[T·heads, head_dim]`), `w`
/// (view `[T, heads]`), `keys` (`[num_slots, head_dim]` bf16), `block_table`
/// (`[requests, max_pages]`), `req_of_token` (`[T]`), `positions` (`[T]`), `scores`
/// (`[T, columns]` f32, written in full).
#[derive(Clone, Copy, Debug)]
pub struct IndexerScoresOp {
    pub tokens: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub q: View,
    pub w: View,
    pub columns: u32,
    pub num_slots: u32,
    pub page_size: u32,
    pub requests: u32,
    pub max_pages: u32,
    pub scale: f32,
    pub weight_scale: f32,
}

impl IndexerScoresOp {
    fn validate(&self) -> Result<()> {
        self.q.validate("q")?;
        self.w.validate("w")?;
        if (self.q.rows, self.q.cols) != (self.tokens * self.heads, self.head_dim) {
            return Err(Error::arg(
                "q",
                format!("[{}, {}]", self.tokens * self.heads, self.head_dim),
                format!("[{}, {}]", self.q.rows, self.q.cols),
            ));
        }
        if (self.w.rows, self.w.cols) != (self.tokens, self.heads) {
            return Err(Error::arg(
                "w",
                format!("[{}, {}]", self.tokens, self.heads),
                format!("[{}, {}]", self.w.rows, self.w.cols),
            ));
        }
        for (n, v) in [
            ("tokens", self.tokens),
            ("heads", self.heads),
            ("columns", self.columns),
            ("page_size", self.page_size),
            ("requests", self.requests),
            ("max_pages", self.max_pages),
        ] {
            if v == 0 {
                return Err(Error::arg(n, "at least 1", 0));
            }
        }
        if self.tokens > 65535 {
            return Err(Error::arg("tokens", "at most 65535 per call", self.tokens));
        }
        if self.num_slots as u64 * self.head_dim as u64 / 2 > u32::MAX as u64 {
            return Err(Error::arg(
                "num_slots",
                "a key cache under 2^32 words",
                self.num_slots,
            ));
        }
        Ok(())
    }
}

impl Op for IndexerScoresOp {
    fn name(&self) -> String {
        format!(
            "indexer scores {} tokens x {} heads x {} columns",
            self.tokens, self.heads, self.columns
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let t = self.tokens as u64;
        vec![
            Binding::read("q", self.q.min_bytes(DType::F32), "indexer q f32"),
            Binding::read(
                "w",
                self.w.min_bytes(DType::F32),
                "indexer head weights f32",
            ),
            Binding::read(
                "keys",
                self.num_slots as u64 * self.head_dim as u64 * 2,
                "bf16 key cache",
            ),
            Binding::read(
                "block_table",
                self.requests as u64 * self.max_pages as u64 * 4,
                "i32 block table",
            ),
            Binding::read("req_of_token", t * 4, "i32 request of each token"),
            Binding::read("positions", t * 4, "i32 position of each token"),
            Binding::write(
                "scores",
                t * self.columns as u64 * 4,
                format!("[{t}, {}] f32 scores", self.columns),
            ),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<ScoresConfig> = KernelCache::new();
        let k = lowered(
            &K,
            ScoresConfig {
                head_dim: self.head_dim,
            },
            scores_kernel,
        )?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.tokens)),
            ("heads".into(), ParamValue::U32(self.heads)),
            ("columns".into(), ParamValue::U32(self.columns)),
            ("scale".into(), ParamValue::F32(self.scale)),
            ("weight_scale".into(), ParamValue::F32(self.weight_scale)),
            ("page_size".into(), ParamValue::U32(self.page_size)),
            ("max_pages".into(), ParamValue::U32(self.max_pages)),
            ("requests".into(), ParamValue::U32(self.requests)),
            ("num_slots".into(), ParamValue::U32(self.num_slots)),
        ];
        p.extend(self.q.params("q"));
        p.extend(self.w.params("w"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [self.columns.div_ceil(THREADS), self.tokens, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let q = read_view(bufs.get("q")?, DType::F32, &self.q, "q")?;
        let w = read_view(bufs.get("w")?, DType::F32, &self.w, "w")?;
        let keys = bufs.get("keys")?;
        let bt = i32s(bufs.get("block_table")?);
        let req = i32s(bufs.get("req_of_token")?);
        let pos = i32s(bufs.get("positions")?);
        let (hn, d, cols) = (
            self.heads as usize,
            self.head_dim as usize,
            self.columns as usize,
        );
        let mut out = vec![f32::NEG_INFINITY; self.tokens as usize * cols];
        for t in 0..self.tokens as usize {
            let r = req[t];
            if r < 0 || r as u32 >= self.requests || pos[t] < 0 {
                continue;
            }
            let row = &bt[r as usize * self.max_pages as usize..][..self.max_pages as usize];
            let qt: Vec<f64> = q[t * hn * d..(t + 1) * hn * d]
                .iter()
                .map(|&v| round_bf16(v as f32) as f64)
                .collect();
            for s in 0..=(pos[t] as usize).min(cols.saturating_sub(1)) {
                let sl = slot(row, self.page_size, s as i32);
                if sl < 0 || sl as u32 >= self.num_slots {
                    continue;
                }
                let k: Vec<f64> = (0..d)
                    .map(|c| {
                        let o = (sl as usize * d + c) * 2;
                        bf16_from_bits(u16::from_le_bytes([keys[o], keys[o + 1]])) as f64
                    })
                    .collect();
                let mut score = 0.0f64;
                for h in 0..hn {
                    let dot: f64 = qt[h * d..(h + 1) * d]
                        .iter()
                        .zip(&k)
                        .map(|(a, b)| a * b)
                        .sum();
                    let relu = (dot * self.scale as f64).max(0.0);
                    score += relu * (w[t * hn + h] * self.weight_scale as f64);
                }
                out[t * cols + s] = score as f32;
            }
        }
        put_f32s(bufs.get_mut("scores")?, &out);
        Ok(())
    }
}

/// The kernel at the models' key width (128), lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    Ok(vec![crate::kir::lower(
        &scores_kernel(&ScoresConfig { head_dim: 128 })?,
        crate::kir::Lowering::Scalar,
    )?])
}
