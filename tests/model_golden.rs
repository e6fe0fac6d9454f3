//! Whole-model goldens: the forward pass on a backend against logits that Hugging Face
//! transformers computed for the same tiny checkpoints (tools/make_fixtures.py; versions and
//! margins in each fixture's golden.json).
//!
//! Written once, generic over [`ModelBackend`]: a backend joins with one line in
//! `golden_tests!` at the bottom.
//!
//! Tolerances (bf16 cache): max |logit − golden| ≤ 3e-2 and relative L2 ≤ 1e-2 over all
//! prefill and decode logits (measured on the CPU backend: GLM 4.9e-3 / 2.5e-3, DeepSeek
//! 7.6e-3 / 3.1e-3, with logits within ±2.4); the greedy tokens must be identical, and so
//! must every indexer top-k set and every token's routed experts. The goldens are float32
//! runs of the bf16 weights, so the only rounding between us and them is the kernel's own:
//! q, cache rows and out in bf16, indexer q and keys in bf16 (about 2^-9 relative each). For
//! scale, transformers itself run in bf16 moves these logits by up to 0.12 (GLM) and 1.7
//! (DeepSeek) (`hf_bf16_vs_f32_max_abs` in golden.json). The fixtures were chosen so that
//! no top-k decision is closer than the margins recorded in golden.json.
//!
//! The fp8_ds_mla cache rounds the latent to e4m3 (3 mantissa bits): a smoke bound of
//! relative L2 ≤ 0.25 (measured 0.048 GLM, 0.080 DeepSeek); tokens not required equal.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use sparse_mla::mla::CacheFormat;
use sparse_mla::model::{CacheOptions, ForwardTrace, Logits, Model};
use sparse_mla::runtime::{Backend, BackendKind};
use sparse_mla::util::rel_l2;

pub const ARCHS: [&str; 2] = ["glm_moe_dsa-tiny", "deepseek_v32-tiny"];

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// One fixture's golden outputs.
pub struct Golden {
    pub prompt_ids: Vec<u32>,
    /// `[prompt, vocab]`
    pub prefill: Vec<f32>,
    /// `[steps, vocab]`: logits after feeding `generated[i]`.
    pub decode: Vec<f32>,
    /// `[steps + 1]`: greedy choices (from the last prefill row, then each decode row).
    pub generated: Vec<u32>,
    pub meta: serde_json::Value,
}

fn ints(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn floats(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn load_golden(dir: &Path) -> Golden {
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    Golden {
        prompt_ids: ints(&st, "prompt_ids"),
        prefill: floats(&st, "prefill_logits"),
        decode: floats(&st, "decode_logits"),
        generated: ints(&st, "generated_ids"),
        meta,
    }
}

/// What a run measured against a golden.
#[derive(Debug)]
pub struct Comparison {
    pub max_abs: f64,
    pub rel_l2: f64,
    pub tokens: Vec<u32>,
    pub golden_tokens: Vec<u32>,
    /// First (layer, token, ours, transformers') whose indexer top-k set differs, if any.
    pub first_selection_mismatch: Option<(usize, usize, Vec<i64>, Vec<i64>)>,
    /// First (layer, token, ours, transformers') whose routed experts differ, if any.
    pub first_routing_mismatch: Option<(usize, usize, Vec<i64>, Vec<i64>)>,
}

/// Prefill the golden prompt, then feed the golden greedy tokens one by one (so a single
/// diverging token cannot derail every later row), comparing every logit row.
pub fn compare(backend: Arc<dyn Backend>, name: &str, opts: CacheOptions) -> Comparison {
    let dir = fixture_dir(name);
    let g = load_golden(&dir);
    let model =
        Model::load(&dir, backend, &mut |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = model.config.vocab_size;
    let mut seq = model.new_sequence(opts).unwrap();
    let mut trace = ForwardTrace::default();
    let mut ours = model
        .forward_traced(&mut seq, &g.prompt_ids, Logits::All, Some(&mut trace))
        .unwrap();
    let mut tokens = vec![sparse_mla::model::sampler::argmax(
        &ours[ours.len() - vocab..],
    )];
    let steps = g.decode.len() / vocab;
    for i in 0..steps {
        let row = model
            .forward_traced(&mut seq, &[g.generated[i]], Logits::Last, Some(&mut trace))
            .unwrap();
        tokens.push(sparse_mla::model::sampler::argmax(&row));
        ours.extend(row);
    }
    let golden: Vec<f64> = g
        .prefill
        .iter()
        .chain(&g.decode)
        .map(|&x| x as f64)
        .collect();
    let ours: Vec<f64> = ours.iter().map(|&x| x as f64).collect();
    assert_eq!(ours.len(), golden.len());
    let max_abs = ours
        .iter()
        .zip(&golden)
        .map(|(a, b)| {
            if a.is_nan() {
                f64::INFINITY
            } else {
                (a - b).abs()
            }
        })
        .fold(0.0, f64::max);

    let first_selection_mismatch = first_mismatch(&trace.selected, g.meta.get("indexer_selected"));
    let first_routing_mismatch = first_mismatch(&trace.routed, g.meta.get("experts_routed"));
    Comparison {
        max_abs,
        rel_l2: rel_l2(&ours, &golden),
        tokens,
        golden_tokens: g.generated.clone(),
        first_selection_mismatch,
        first_routing_mismatch,
    }
}

/// The first (layer, token) whose decision (a set of positions or experts) differs from
/// transformers' (`golden`: layer → one sorted list per token).
fn first_mismatch(
    ours: &[(usize, usize, Vec<i32>)],
    golden: Option<&serde_json::Value>,
) -> Option<(usize, usize, Vec<i64>, Vec<i64>)> {
    let golden = golden?.as_object()?;
    let mut per_layer: std::collections::BTreeMap<usize, Vec<Vec<i64>>> = Default::default();
    for (layer, k, rows) in ours {
        for r in rows.chunks(*k) {
            let mut s: Vec<i64> = r.iter().filter(|&&p| p >= 0).map(|&p| p as i64).collect();
            s.sort();
            per_layer.entry(*layer).or_default().push(s);
        }
    }
    for (layer, rows) in golden {
        let layer: usize = layer.parse().ok()?;
        for (t, hf) in rows.as_array()?.iter().enumerate() {
            let hf: Vec<i64> = hf.as_array()?.iter().filter_map(|v| v.as_i64()).collect();
            let ours = per_layer
                .get(&layer)
                .and_then(|r| r.get(t))
                .cloned()
                .unwrap_or_default();
            if ours != hf {
                return Some((layer, t, ours, hf));
            }
        }
    }
    None
}

/// bf16 cache: the tolerances of the module doc.
pub fn check_bf16(backend: Arc<dyn Backend>, name: &str) {
    let opts = CacheOptions {
        format: CacheFormat::Bf16,
        page_size: 4,
        max_seq_len: 64,
        ..Default::default()
    };
    let c = compare(backend, name, opts);
    eprintln!(
        "{name} (bf16 cache): max |Δlogit| = {:.3e}, rel L2 = {:.3e}",
        c.max_abs, c.rel_l2
    );
    assert_eq!(
        c.first_routing_mismatch, None,
        "{name}: routed experts differ from transformers (layer, token, ours, theirs)"
    );
    assert_eq!(
        c.first_selection_mismatch, None,
        "{name}: indexer top-k differs from transformers"
    );
    assert!(
        c.max_abs <= 0.05,
        "{name}: max |Δlogit| {} > 0.05",
        c.max_abs
    );
    assert!(c.rel_l2 <= 1e-2, "{name}: relative L2 {} > 1e-2", c.rel_l2);
    assert_eq!(c.tokens, c.golden_tokens, "{name}: greedy tokens differ");
}

/// fp8_ds_mla cache: e4m3 latent, so only a loose closeness is asserted.
pub fn check_fp8(backend: Arc<dyn Backend>, name: &str) {
    let opts = CacheOptions {
        format: CacheFormat::Fp8DsMla,
        page_size: 16,
        max_seq_len: 64,
        ..Default::default()
    };
    let c = compare(backend, name, opts);
    eprintln!(
        "{name} (fp8_ds_mla cache): max |Δlogit| = {:.3e}, rel L2 = {:.3e}, tokens {:?} vs {:?}",
        c.max_abs, c.rel_l2, c.tokens, c.golden_tokens
    );
    assert!(
        c.rel_l2 <= 0.25,
        "{name}: relative L2 {} > 0.25 with the fp8 cache",
        c.rel_l2
    );
}

macro_rules! golden_tests {
    ($($backend:ident => $kind:expr;)*) => {
        $(
            mod $backend {
                use super::*;
                fn run(check: fn(Arc<dyn Backend>, &str), arch: &str) {
                    if let Some(b) = common::backend_arc($kind) {
                        eprintln!("{}: {}", stringify!($backend), b.device_name());
                        check(b, arch);
                    }
                }
                #[test]
                fn glm5_bf16_cache() {
                    run(check_bf16, ARCHS[0]);
                }
                #[test]
                fn deepseek_v32_bf16_cache() {
                    run(check_bf16, ARCHS[1]);
                }
                #[test]
                fn glm5_fp8_cache() {
                    run(check_fp8, ARCHS[0]);
                }
                #[test]
                fn deepseek_v32_fp8_cache() {
                    run(check_fp8, ARCHS[1]);
                }
            }
        )*
    };
}

golden_tests! {
    cpu => BackendKind::Cpu;
    wgpu => BackendKind::Wgpu;
    cuda => BackendKind::Cuda;
}
