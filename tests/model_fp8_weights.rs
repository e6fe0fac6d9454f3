//! Block-scaled FP8 checkpoints (e4m3 weights + f32 `weight_scale_inv` per 128 × 128 block,
//! as DeepSeek-V3.2 and GLM-5-FP8 ship; tests/fixtures/*-fp8, made by
//! `examples/quantize_fp8.rs`) run with their weights FP8 on the device: on every backend the
//! model's weight bytes are a fraction of the same checkpoint dequantised to f32 (the
//! fixtures' scales are powers of two, so that copy is exact), and its logits equal that f32
//! checkpoint's: exactly on the CPU reference, within the bf16 path's rounding on a GPU.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::Dtype;
use sparse_mla::model::weights::{write_checkpoint, Checkpoint};
use sparse_mla::model::{CacheOptions, Logits, Model};
use sparse_mla::runtime::{Backend, BackendKind};
use sparse_mla::util::rel_l2;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The FP8 checkpoint dequantised to f32 (`e4m3 × scale_inv`, exact in f32), without its
/// quantization_config.
fn dequantised_copy(src: &Path, tag: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("mla-fp8-deq-{tag}-{}", std::process::id()));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let block = config["quantization_config"]["weight_block_size"]
        .as_array()
        .map(|b| {
            [
                b[0].as_u64().unwrap() as usize,
                b[1].as_u64().unwrap() as usize,
            ]
        });
    let ckpt = Checkpoint::open(src, block).unwrap();
    let mut tensors = Vec::new();
    for name in ckpt.names() {
        if name.ends_with("_scale_inv") {
            continue;
        }
        let meta = ckpt.meta(name).unwrap();
        let v = ckpt.read_f32(name).unwrap();
        tensors.push((
            name.to_string(),
            Dtype::F32,
            meta.shape.clone(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        ));
    }
    write_checkpoint(&dir, &tensors, 1).unwrap();
    let mut config = config;
    config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config");
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    TempDir(dir)
}

fn run(model: &Model) -> Vec<f32> {
    let mut seq = model
        .new_sequence(CacheOptions {
            page_size: 4,
            max_seq_len: 32,
            ..Default::default()
        })
        .unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 1) % 384).collect();
    let mut v = model.forward(&mut seq, &prompt, Logits::All).unwrap();
    for t in [5u32, 77, 300] {
        v.extend(model.forward(&mut seq, &[t], Logits::Last).unwrap());
    }
    v
}

fn fp8_equals_dequantised(backend: Arc<dyn Backend>, name: &str) {
    let src = fixture(name);
    let deq = dequantised_copy(&src, name);
    let fp8 = Model::load(&src, backend.clone(), &mut |_, _| {}).unwrap();
    let f32m = Model::load(&deq.0, backend, &mut |_, _| {}).unwrap();
    let (b8, b32) = (fp8.weight_bytes(), f32m.weight_bytes());
    eprintln!(
        "{name} on {}: weights on the device {b8} B as FP8, {b32} B as f32",
        fp8.device().backend().device_name()
    );
    // Every FP8 weight but kv_b_proj (which becomes the bf16 absorbed W_UK / W_UV in both)
    // costs 1 byte on the device instead of 4, plus one f32 scale per block.
    let ckpt = Checkpoint::open(&src, Some([128, 128])).unwrap();
    let fp8_elems: u64 = ckpt
        .names()
        .filter(|n| !n.contains("kv_b_proj"))
        .filter_map(|n| ckpt.meta(n))
        .filter(|m| m.dtype == Dtype::F8_E4M3)
        .map(|m| m.shape.iter().product::<usize>() as u64)
        .sum();
    assert!(fp8_elems > 10_000, "{name}: only {fp8_elems} FP8 weights");
    assert!(
        b32 - b8 >= fp8_elems * 29 / 10,
        "{name}: FP8 weights take {b8} B, the f32 copy {b32} B: {fp8_elems} FP8 weights not stored as FP8?"
    );
    let a: Vec<f64> = run(&fp8).iter().map(|&x| x as f64).collect();
    let b: Vec<f64> = run(&f32m).iter().map(|&x| x as f64).collect();
    let e = rel_l2(&a, &b);
    // The CPU reference computes both in f64: identical. A GPU sums in f32 in another order for
    // the two weight types; a 1e-7 difference that crosses a bf16 rounding boundary of q, a cache
    // row or the attention output moves that element by 2^-8 relative, so the bound there is the
    // bf16 path's (a wrong scale or e4m3 decode gives errors of order 1).
    let tol = if fp8.device().backend().kind() == BackendKind::Cpu {
        1e-6
    } else {
        1e-2
    };
    eprintln!(
        "{name}: FP8 weights vs dequantised f32 weights: logits rel L2 {e:.2e} (bound {tol:.0e})"
    );
    assert!(e <= tol, "{name}: FP8 vs dequantised logits rel L2 {e}");
}

macro_rules! fp8_tests {
    ($($backend:ident => $kind:expr;)*) => {
        $(
            mod $backend {
                use super::*;
                #[test]
                fn fp8_weights_equal_their_dequantised_f32() {
                    if let Some(b) = common::backend_arc($kind) {
                        for name in ["glm_moe_dsa-tiny-fp8", "deepseek_v32-tiny-fp8"] {
                            fp8_equals_dequantised(b.clone(), name);
                        }
                    }
                }
            }
        )*
    };
}

fp8_tests! {
    cpu => BackendKind::Cpu;
    wgpu => BackendKind::Wgpu;
    cuda => BackendKind::Cuda;
}
