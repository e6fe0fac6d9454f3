//! Cases of the lightning indexer's scores and the exact top-k: scores through a shuffled
//! block table (unassigned pages, several requests), the causal mask; top-k rows shorter
//! than k (all selected, scores unread — NaN there), ties at the threshold (lower positions
//! win), NaN scores, k not a multiple of anything, rows of up to 20 000 positions.

use super::ops::{f32_bytes, i32_bytes, normals, view_buffer, Compare, Instance, OpCase};
use crate::kernels::indexer::IndexerScoresOp;
use crate::kernels::topk::TopkOp;
use crate::kernels::view::View;
use crate::reference::numerics::bf16_bits;
use crate::util::Rng;
use crate::Result;

fn scores_case(tokens: u32, heads: u32, page_size: u32, columns: u32) -> OpCase {
    OpCase::new(
        format!("indexer/scores_t{tokens}_h{heads}_p{page_size}_s{columns}"),
        move |rng: &mut Rng| -> Result<Instance> {
            let d = 128u32;
            let requests = 3u32;
            let max_pages = columns.div_ceil(page_size) + 1;
            let num_pages = requests * max_pages + 2;
            let num_slots = num_pages * page_size;
            // Each request's pages are a random permutation of distinct physical pages; one
            // page of request 1 is left unassigned (-1): its positions score -inf.
            let perm = rng.distinct(num_pages as u64, (requests * max_pages) as usize);
            let mut bt: Vec<i32> = perm.iter().map(|&p| p as i32).collect();
            bt[(max_pages + 1) as usize] = -1;
            let req: Vec<i32> = (0..tokens).map(|t| (t % requests) as i32).collect();
            let pos: Vec<i32> = (0..tokens)
                .map(|t| {
                    if t == 0 {
                        columns as i32 - 1
                    } else {
                        rng.below(columns as u64) as i32
                    }
                })
                .collect();
            let keys: Vec<u8> = (0..num_slots * d)
                .flat_map(|_| bf16_bits(rng.normal()).to_le_bytes())
                .collect();
            let qv = View {
                offset: 7,
                rows: tokens * heads,
                cols: d,
                stride: d + 16,
            };
            let q = view_buffer(rng, qv.end() as usize, &qv, 1.0);
            let wv = View {
                offset: 1,
                rows: tokens,
                cols: heads,
                stride: heads + 3,
            };
            let w = view_buffer(rng, wv.end() as usize, &wv, 1.0);
            Ok(Instance {
                op: Box::new(IndexerScoresOp {
                    tokens,
                    heads,
                    head_dim: d,
                    q: qv,
                    w: wv,
                    columns,
                    num_slots,
                    page_size,
                    requests,
                    max_pages,
                    scale: (d as f32).powf(-0.5),
                    weight_scale: (heads as f32).powf(-0.5),
                }),
                buffers: vec![
                    ("q", f32_bytes(&q)),
                    ("w", f32_bytes(&w)),
                    ("keys", keys),
                    ("block_table", i32_bytes(&bt)),
                    ("req_of_token", i32_bytes(&req)),
                    ("positions", i32_bytes(&pos)),
                    (
                        "scores",
                        f32_bytes(&vec![f32::NAN; (tokens * columns) as usize]),
                    ),
                ],
                outputs: vec![("scores", Compare::F32 { rel_l2: 1e-5 })],
                detail: format!("{tokens}x{columns}"),
            })
        },
    )
}

/// How a top-k case draws its scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scores {
    Distinct,
    /// Few distinct values: many ties at the threshold.
    Ties,
    /// Some NaN and ±inf.
    Special,
}

fn topk_case(tokens: u32, columns: u32, topk: u32, kind: Scores) -> OpCase {
    OpCase::new(
        format!("indexer/topk_t{tokens}_s{columns}_k{topk}_{kind:?}").to_lowercase(),
        move |rng: &mut Rng| -> Result<Instance> {
            let n = (tokens * columns) as usize;
            let mut scores = match kind {
                Scores::Distinct => normals(rng, n, 1.0),
                Scores::Ties => (0..n).map(|_| rng.below(5) as f32 * 0.5).collect(),
                Scores::Special => normals(rng, n, 1.0),
            };
            if kind == Scores::Special {
                for (i, s) in scores.iter_mut().enumerate() {
                    match i % 11 {
                        3 => *s = f32::NAN,
                        5 => *s = f32::NEG_INFINITY,
                        7 if i % 3 == 0 => *s = f32::INFINITY,
                        9 => *s = -0.0,
                        _ => {}
                    }
                }
            }
            // Token 0: the whole row; token 1: fewer positions than k (all selected: the
            // scores of that row are NaN and must not be read); others random lengths.
            let pos: Vec<i32> = (0..tokens)
                .map(|t| match t {
                    0 => columns as i32 - 1,
                    1 => (topk.min(columns) as i32 - 2).max(0),
                    _ => rng.below(columns as u64) as i32,
                })
                .collect();
            if tokens > 1 {
                for v in &mut scores[columns as usize..2 * columns as usize] {
                    *v = f32::NAN;
                }
            }
            Ok(Instance {
                op: Box::new(TopkOp {
                    tokens,
                    columns,
                    topk,
                }),
                buffers: vec![
                    ("scores", f32_bytes(&scores)),
                    ("positions", i32_bytes(&pos)),
                    (
                        "indices",
                        i32_bytes(&vec![i32::MIN; (tokens * topk) as usize]),
                    ),
                ],
                outputs: vec![("indices", Compare::Exact)],
                detail: format!("k{topk}"),
            })
        },
    )
}

/// Every case of this module.
pub fn indexer_cases() -> Vec<OpCase> {
    vec![
        scores_case(4, 8, 4, 300),
        scores_case(3, 32, 64, 129),
        scores_case(2, 5, 1, 40),
        topk_case(4, 300, 37, Scores::Distinct),
        topk_case(3, 1000, 64, Scores::Ties),
        topk_case(5, 200, 50, Scores::Special),
        topk_case(2, 20_000, 2048, Scores::Distinct),
        // The models' widest rows: 2048 of 128 K positions.
        topk_case(2, 131_072, 2048, Scores::Ties),
        topk_case(3, 16, 8, Scores::Ties),
    ]
}
