//! The model on every backend, beyond the goldens: several sequences in one step equal the
//! same sequences run one at a time; a decode step in steady state allocates nothing on the
//! device; a failed step leaves its sequence as it was. Written once, instantiated per
//! backend (an absent backend is skipped with its reason, or fails when required).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use sparse_mla::model::{CacheOptions, Logits, Model, StepInput};
use sparse_mla::runtime::{Backend, BackendKind};
use sparse_mla::util::rel_l2;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn opts(max_seqs: usize) -> CacheOptions {
    CacheOptions {
        page_size: 4,
        max_seq_len: 48,
        max_seqs,
        ..Default::default()
    }
}

/// Three sequences of different lengths, prefilled together and then decoded together
/// (each with its own top-k over its own history), against each run alone.
fn batch_equals_separate(backend: Arc<dyn Backend>, name: &str) {
    let model = Model::load(&fixture(name), backend, &mut |_, _| {}).unwrap();
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = vec![
        (0..13).map(|i| (i * 31 + 5) % vocab as u32).collect(),
        (0..3).map(|i| (i * 17 + 2) % vocab as u32).collect(),
        (0..10).map(|i| (i * 7 + 11) % vocab as u32).collect(),
    ];
    let decode: Vec<u32> = vec![42, 7, 300 % vocab as u32];
    // Alone.
    let mut alone = Vec::new();
    for (p, &d) in prompts.iter().zip(&decode) {
        let mut seq = model.new_sequence(opts(1)).unwrap();
        let mut rows = model.forward(&mut seq, p, Logits::Last).unwrap();
        for k in 0..4 {
            rows.extend(model.forward(&mut seq, &[d + k], Logits::Last).unwrap());
        }
        alone.push(rows);
    }
    // Together.
    let mut cache = model.new_cache(opts(4)).unwrap();
    let ids: Vec<_> = (0..3).map(|_| cache.add_sequence().unwrap()).collect();
    let inputs: Vec<StepInput> = ids
        .iter()
        .zip(&prompts)
        .map(|(&seq, p)| StepInput { seq, tokens: p })
        .collect();
    let first = model.step(&mut cache, &inputs, Logits::Last, None).unwrap();
    let first = model.device().download(&first).unwrap();
    let mut together: Vec<Vec<f32>> = (0..3)
        .map(|i| first[i * vocab..(i + 1) * vocab].to_vec())
        .collect();
    for k in 0..4 {
        let toks: Vec<[u32; 1]> = decode.iter().map(|&d| [d + k]).collect();
        let inputs: Vec<StepInput> = ids
            .iter()
            .zip(&toks)
            .map(|(&seq, t)| StepInput { seq, tokens: t })
            .collect();
        let l = model.step(&mut cache, &inputs, Logits::Last, None).unwrap();
        let l = model.device().download(&l).unwrap();
        for i in 0..3 {
            together[i].extend_from_slice(&l[i * vocab..(i + 1) * vocab]);
        }
    }
    for i in 0..3 {
        let e = rel_l2(&f64s(&together[i]), &f64s(&alone[i]));
        eprintln!("{name}: sequence {i}: batched vs alone rel L2 {e:.2e}");
        assert!(
            e < 1e-4,
            "{name}: sequence {i}: batched vs alone rel L2 {e}"
        );
    }
    // Ending a sequence gives its pages back.
    let free = cache.free_pages();
    cache.remove_sequence(ids[0]).unwrap();
    assert!(cache.free_pages() > free);
}

/// After warm-up, a decode step of the same shape takes every buffer from the pool.
fn steady_decode_allocates_nothing(backend: Arc<dyn Backend>, name: &str) {
    let model = Model::load(&fixture(name), backend, &mut |_, _| {}).unwrap();
    let mut seq = model.new_sequence(opts(1)).unwrap();
    model
        .forward(&mut seq, &[1, 2, 3, 4, 5, 6, 7, 8, 9], Logits::Last)
        .unwrap();
    // Warm up past the length where the indexer starts scoring (index_topk 8) and a page turn.
    for t in 0..6 {
        model.forward(&mut seq, &[10 + t], Logits::Last).unwrap();
    }
    let before = model.device().allocations();
    for t in 0..3 {
        model.forward(&mut seq, &[20 + t], Logits::Last).unwrap();
    }
    let made = model.device().allocations() - before;
    eprintln!("{name}: device allocations in 3 steady decode steps: {made}");
    assert_eq!(
        made, 0,
        "{name}: a steady decode step allocated device buffers"
    );
}

/// A step that fails (a token past the vocabulary) changes nothing: the next step gives what
/// it would have given without the failed one.
fn failed_step_changes_nothing(backend: Arc<dyn Backend>, name: &str) {
    let model = Model::load(&fixture(name), backend, &mut |_, _| {}).unwrap();
    let vocab = model.config.vocab_size as u32;
    let run = |fail: bool| {
        let mut seq = model.new_sequence(opts(1)).unwrap();
        model
            .forward(&mut seq, &[3, 1, 4, 1, 5], Logits::Last)
            .unwrap();
        if fail {
            let e = model
                .forward(&mut seq, &[9, vocab], Logits::Last)
                .unwrap_err();
            assert!(e.to_string().contains("vocabulary"), "{e}");
            assert_eq!(seq.len(), 5);
        }
        model.forward(&mut seq, &[9, 2, 6], Logits::All).unwrap()
    };
    assert_eq!(
        run(true),
        run(false),
        "{name}: a failed step changed the sequence"
    );
}

macro_rules! device_tests {
    ($($backend:ident => $kind:expr;)*) => {
        $(
            mod $backend {
                use super::*;
                fn each(check: fn(Arc<dyn Backend>, &str)) {
                    if let Some(b) = common::backend_arc($kind) {
                        for name in ["glm_moe_dsa-tiny", "deepseek_v32-tiny"] {
                            check(b.clone(), name);
                        }
                    }
                }
                #[test]
                fn batch_equals_separate() {
                    each(super::batch_equals_separate);
                }
                #[test]
                fn steady_decode_allocates_nothing() {
                    each(super::steady_decode_allocates_nothing);
                }
                #[test]
                fn failed_step_changes_nothing() {
                    each(super::failed_step_changes_nothing);
                }
            }
        )*
    };
}

device_tests! {
    cpu => BackendKind::Cpu;
    wgpu => BackendKind::Wgpu;
    cuda => BackendKind::Cuda;
}
