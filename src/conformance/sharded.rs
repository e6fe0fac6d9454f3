//! Sharded-model conformance (docs/sharding.md): the tiny fixtures split over N ranks on one
//! backend, the collectives through host memory, against the unsharded forward of the same
//! backend and against transformers' goldens.
//!
//! - `model/tp<N>/<arch>`: the golden inputs (prompt, then the golden greedy tokens) run
//!   through the model sharded N ways and unsharded. Every indexer selection and routing
//!   decision must be the unsharded one, and the logits must agree to [`TP_REL`] (max |Δ|
//!   over max |logit|, and relative L2); with N = 1 they must be equal bit for bit (the
//!   sharded forward is then the unsharded op sequence). The sharded run must also pass the
//!   golden comparison with the bf16 tolerances, and no rank may hold the whole model.
//! - `model/tp_refused/<arch>`: 0 shards, a count that does not divide the heads, and a split
//!   of the FP8 fixture that would cut a 128 × 128 block are refused, naming `--tp`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::model::{
    compare_run, golden_failures, load_golden, per_token, run_golden, Golden, GoldenRun, BF16,
};
use super::{within, Outcome};
use crate::mla::CacheFormat;
use crate::model::{CacheOptions, Model, ShardedModel};
use crate::runtime::Backend;
use crate::util::rel_l2;
use crate::Result;

/// Sharded vs unsharded logits, relative (max |Δ| / max |logit|, and relative L2).
///
/// The two forwards sum the same terms in another order: a sublayer's output is summed over
/// ranks in f32 and then added to the residual once, where the unsharded kernel adds each
/// dot product as it finishes — differences of f32 rounding, ~1e-7 of the residual. Where
/// such a difference moves a value across a bf16 rounding boundary (the attention query, a
/// cache row, the attention output are stored as bf16) that element moves by up to 2^-8
/// relative, and these tiny random models carry it to the logits. Measured with 2 and 4
/// shards: rel L2 1.5e-4 to 2.3e-4 and max 2.1e-4 to 4.7e-4 on the CPU reference, rel L2
/// 1.5e-4 to 4.1e-4 and max 2.6e-4 to 7.0e-4 on lavapipe — the size of the change that ±1–2
/// ulp of noise added to the residual after every sublayer of the unsharded model makes
/// (rel L2 3.4e-4 to 4.8e-4, max 8.0e-4 on the CPU reference). 3e-3 keeps a factor of 4 over
/// the worst of those and stays 3× under the golden bound (rel L2 1e-2); a wrong shard moves
/// the logits far more (measured: every rank given the first heads' W_UK / W_UV, rel L2 1.1
/// to 1.5; o_proj's first columns on every rank, 1.1 to 1.6; expert ids not remapped to the
/// rank's, 8e-2 to 2e-1).
pub const TP_REL: f64 = 3e-3;

fn cache_opts() -> CacheOptions {
    CacheOptions {
        format: CacheFormat::Bf16,
        page_size: 4,
        max_seq_len: 64,
        ..Default::default()
    }
}

/// Where the decisions of the sharded run (`a`) differ from the unsharded one's (`b`), token
/// by token: a difference is a failure unless golden.json records the decision as a near-tie
/// (its margin under the bf16 tolerance: indexer 2e-2 relative, router 1e-2), where the
/// sharded sums' f32 rounding may tip it either way (NVIDIA's Vulkan driver tipped one router
/// choice of DeepSeek-V3.2 tp2 whose golden margin is that small). Returns (failures, near-ties
/// that flipped).
fn decision_diffs(a: &GoldenRun, b: &GoldenRun, g: &Golden) -> (Vec<String>, usize) {
    let margins = &g.meta["decision_margins"];
    let (mut out, mut ties) = (Vec::new(), 0);
    for (kind, x, y, limit) in [
        (
            "indexer",
            &a.trace.selected,
            &b.trace.selected,
            BF16.indexer_rel,
        ),
        ("router", &a.trace.routed, &b.trace.routed, BF16.router),
    ] {
        let (px, py) = (per_token(x), per_token(y));
        if px.keys().ne(py.keys()) {
            out.push(format!(
                "{kind}: traced layers differ from the unsharded model's"
            ));
            continue;
        }
        for (layer, rows) in &px {
            let other = &py[layer];
            if rows.len() != other.len() {
                out.push(format!(
                    "{kind}: layer {layer}: {} rows sharded, {} unsharded",
                    rows.len(),
                    other.len()
                ));
                continue;
            }
            for (t, (p, q)) in rows.iter().zip(other).enumerate() {
                if p == q {
                    continue;
                }
                match margins[kind][layer.to_string()][t].as_f64() {
                    Some(m) if m < limit => ties += 1,
                    m => out.push(format!(
                        "{kind}: layer {layer} token {t} differs from the unsharded model's (golden margin {m:?})"
                    )),
                }
            }
        }
    }
    (out, ties)
}

/// Sharded `world` ways against unsharded, on one backend (see the module doc).
pub fn tp_case(
    backend: Arc<dyn Backend>,
    fixtures: &Path,
    arch: &str,
    world: usize,
) -> Result<Outcome> {
    let t0 = Instant::now();
    let dir = fixtures.join(arch);
    let g = load_golden(&dir)?;
    let whole = Model::load(&dir, backend.clone(), &mut |_, _| {})?;
    let sharded = ShardedModel::load(&dir, vec![backend; world], &mut |_, _| {})?;
    let vocab = whole.config.vocab_size;
    let mut seq = whole.new_sequence(cache_opts())?;
    let unsharded = run_golden(&g, vocab, &mut |t, w, tr| {
        whole.forward_traced(&mut seq, t, w, Some(tr))
    })?;
    let mut sseq = sharded.new_sequence(cache_opts())?;
    let ours = run_golden(&g, vocab, &mut |t, w, tr| {
        sharded.forward_traced(&mut sseq, t, w, Some(tr))
    })?;

    let (mut failures, ties) = decision_diffs(&ours, &unsharded, &g);
    let a: Vec<f64> = ours.logits.iter().map(|&x| x as f64).collect();
    let b: Vec<f64> = unsharded.logits.iter().map(|&x| x as f64).collect();
    let rel = rel_l2(&a, &b);
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_abs = crate::util::max_abs_diff(&a, &b);
    let max_rel = max_abs / scale.max(f64::MIN_POSITIVE);
    if world == 1 {
        if ours.logits != unsharded.logits {
            failures.push(format!(
                "one shard differs from the unsharded model: rel L2 {rel:.3e} (bit equality expected)"
            ));
        }
    } else {
        if !within(max_rel, TP_REL) {
            failures.push(format!(
                "sharded vs unsharded max |Δlogit| / max |logit| {max_rel:.3e} > {TP_REL:.0e}"
            ));
        }
        if !within(rel, TP_REL) {
            failures.push(format!(
                "sharded vs unsharded rel L2 {rel:.3e} > {TP_REL:.0e}"
            ));
        }
    }
    let c = compare_run(&g, vocab, &ours, BF16)?;
    failures.extend(
        golden_failures(&c, BF16)
            .into_iter()
            .map(|f| format!("golden: {f}")),
    );
    let ranks = sharded.rank_weight_bytes();
    let biggest = ranks.iter().copied().max().unwrap_or(0);
    if world > 1 && biggest >= whole.weight_bytes() {
        failures.push(format!(
            "a rank holds {biggest} B of weights, the whole model {} B",
            whole.weight_bytes()
        ));
    }
    Ok(Outcome {
        case: format!("model/tp{world}/{arch}"),
        seed: 0,
        rel_l2: rel,
        max_abs: max_rel,
        lse_err: c.rel_l2,
        // rel_l2 and max_abs: against the unsharded model (max_abs relative to max |logit|);
        // lse_err: the golden comparison's rel L2.
        detail: format!(
            "{} rows, {} decisions vs golden, {ties} near-ties flipped vs unsharded; ranks hold {:?} B of {} B",
            c.rows,
            c.decisions,
            ranks,
            whole.weight_bytes()
        ),
        seconds: t0.elapsed().as_secs_f64(),
        failures,
    })
}

/// Splits that cannot work are refused before any upload, naming `--tp`.
pub fn tp_refused_case(backend: Arc<dyn Backend>, fixtures: &Path, arch: &str) -> Result<Outcome> {
    let t0 = Instant::now();
    let mut failures = Vec::new();
    let mut expect = |dir: &Path, world: usize, words: &[&str]| match ShardedModel::load(
        dir,
        vec![backend.clone(); world],
        &mut |_, _| {},
    ) {
        Ok(_) => failures.push(format!("{} split {world} ways was accepted", dir.display())),
        Err(e) => {
            let e = e.to_string();
            if !words.iter().all(|w| e.contains(w)) {
                failures.push(format!(
                    "{world} shards of {}: the error does not say {words:?}: {e}",
                    dir.display()
                ));
            }
        }
    };
    let dir = fixtures.join(arch);
    expect(&dir, 0, &["--tp", "at least 1"]);
    // 4 heads: 3 does not divide them.
    expect(&dir, 3, &["--tp", "num_attention_heads"]);
    // The FP8 fixture's q_b_proj has 448 rows in 128-row blocks: 224 per rank cuts one.
    expect(
        &fixtures.join(format!("{arch}-fp8")),
        2,
        &["--tp", "q_b_proj", "cut a block"],
    );
    Ok(Outcome {
        case: format!("model/tp_refused/{arch}"),
        seed: 0,
        rel_l2: 0.0,
        max_abs: 0.0,
        lse_err: 0.0,
        detail: "0, 3 shards; FP8 blocks cut".into(),
        seconds: t0.elapsed().as_secs_f64(),
        failures,
    })
}
