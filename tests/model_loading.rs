//! Checkpoint loading and forward-pass invariants that need no golden: FP8 block-scaled
//! weights, sharded checkpoints, tensor checks that name what is wrong, RoPE tables against
//! transformers', and prefill = step-by-step decode = any page size.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use sparse_mla::mla::CacheFormat;
use sparse_mla::model::config::ModelConfig;
use sparse_mla::model::rope::RopeTable;
use sparse_mla::model::weights::{
    dequant_fp8_blocks, quantize_fp8_blocks, write_checkpoint, Checkpoint,
};
use sparse_mla::model::{CacheOptions, Logits, Model};
use sparse_mla::runtime::cpu::CpuBackend;

fn cpu() -> std::sync::Arc<dyn sparse_mla::runtime::Backend> {
    std::sync::Arc::new(CpuBackend::new())
}
use sparse_mla::util::rel_l2;

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("sparse-mla-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn read_tensors(dir: &Path) -> Tensors {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn copy_config(from: &Path, to: &Path) {
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
}

fn bf16_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

/// Greedy prompt logits of the model in `dir` (all prefill rows).
fn prefill_logits(dir: &Path, opts: CacheOptions) -> Vec<f32> {
    let model = Model::load(dir, cpu(), &mut |_, _| {}).unwrap();
    let mut seq = model.new_sequence(opts).unwrap();
    let prompt: Vec<u32> = (0..20)
        .map(|i| (i * 37 + 5) % model.config.vocab_size as u32)
        .collect();
    model.forward(&mut seq, &prompt, Logits::All).unwrap()
}

fn opts() -> CacheOptions {
    CacheOptions {
        format: CacheFormat::Bf16,
        page_size: 4,
        max_seq_len: 64,
        ..Default::default()
    }
}

#[test]
fn sharded_checkpoint_loads_the_same_model() {
    let src = fixture("glm_moe_dsa-tiny");
    let tmp = TempDir::new("sharded");
    write_checkpoint(&tmp.0, &read_tensors(&src), 2).unwrap();
    copy_config(&src, &tmp.0);
    assert!(tmp.0.join("model.safetensors.index.json").is_file());
    assert!(!tmp.0.join("model.safetensors").exists());
    assert_eq!(prefill_logits(&tmp.0, opts()), prefill_logits(&src, opts()));
}

#[test]
fn sharded_checkpoint_missing_shard_is_named() {
    let src = fixture("glm_moe_dsa-tiny");
    let tmp = TempDir::new("shard-missing");
    write_checkpoint(&tmp.0, &read_tensors(&src), 2).unwrap();
    copy_config(&src, &tmp.0);
    std::fs::remove_file(tmp.0.join("model-00002-of-00002.safetensors")).unwrap();
    let e = Model::load(&tmp.0, cpu(), &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

/// Quantises every linear weight of the GLM fixture to block-scaled FP8 (128 × 128, like
/// the DeepSeek / GLM releases), checks the loader dequantises exactly to e4m3 × scale_inv,
/// and that the model still runs close to the bf16 one.
#[test]
fn fp8_block_scaled_weights_are_dequantised_on_load() {
    let src = fixture("glm_moe_dsa-tiny");
    let tmp = TempDir::new("fp8");
    let block = [128usize, 128];
    let mut tensors = Tensors::new();
    let mut expected = Vec::new();
    for (name, dtype, shape, bytes) in read_tensors(&src) {
        let linear = shape.len() == 2 && name.contains("_proj") && !name.contains("weights_proj");
        if !linear {
            tensors.push((name, dtype, shape, bytes));
            continue;
        }
        let w = bf16_to_f32(&bytes);
        let (q, s) = quantize_fp8_blocks(&w, [shape[0], shape[1]], block);
        let scale_shape = vec![shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
        expected.push((
            name.clone(),
            dequant_fp8_blocks(&q, &s, [shape[0], shape[1]], block),
            w,
        ));
        let s_bytes: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((
            format!("{name}_scale_inv"),
            Dtype::F32,
            scale_shape,
            s_bytes,
        ));
        tensors.push((name, Dtype::F8_E4M3, shape, q));
    }
    assert!(
        expected.len() > 20,
        "expected many FP8 weights, got {}",
        expected.len()
    );
    write_checkpoint(&tmp.0, &tensors, 1).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block
    });
    std::fs::write(tmp.0.join("config.json"), config.to_string()).unwrap();

    let ckpt = Checkpoint::open(&tmp.0, Some(block)).unwrap();
    for (name, want, original) in &expected {
        let got = ckpt.read_f32(name).unwrap();
        assert_eq!(&got, want, "{name}: dequantised values");
        let a: Vec<f64> = got.iter().map(|&x| x as f64).collect();
        let b: Vec<f64> = original.iter().map(|&x| x as f64).collect();
        assert!(
            rel_l2(&a, &b) < 0.05,
            "{name}: e4m3 error {}",
            rel_l2(&a, &b)
        );
    }
    let fp8 = prefill_logits(&tmp.0, opts());
    let bf16 = prefill_logits(&src, opts());
    let err = rel_l2(
        &fp8.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        &bf16.iter().map(|&x| x as f64).collect::<Vec<_>>(),
    );
    eprintln!("fp8 weights vs bf16 weights: prefill logits rel L2 = {err:.3e}");
    // Every linear weight at 3 mantissa bits: a smoke bound; exactness is checked above.
    assert!(err < 0.3, "rel L2 {err}");

    // Without quantization_config the FP8 tensors are refused, by name.
    copy_config(&src, &tmp.0);
    let e = Model::load(&tmp.0, cpu(), &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("F8_E4M3") && e.contains("quantization_config"),
        "{e}"
    );
}

/// Rewrites the fixture with `edit` applied to its tensor list and returns the load error.
fn load_error(tag: &str, edit: impl FnOnce(&mut Tensors)) -> String {
    let src = fixture("deepseek_v32-tiny");
    let tmp = TempDir::new(tag);
    let mut t = read_tensors(&src);
    edit(&mut t);
    write_checkpoint(&tmp.0, &t, 1).unwrap();
    copy_config(&src, &tmp.0);
    match Model::load(&tmp.0, cpu(), &mut |_, _| {}) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named_with_its_shape() {
    let name = "model.layers.1.mlp.experts.5.up_proj.weight";
    let e = load_error("missing", |t| t.retain(|x| x.0 != name));
    assert!(
        e.contains(name) && e.contains("missing") && e.contains("[24, 96]"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named_with_expected_and_actual() {
    let name = "model.layers.0.self_attn.kv_b_proj.weight";
    let e = load_error("shape", |t| {
        let x = t.iter_mut().find(|x| x.0 == name).unwrap();
        x.2 = vec![x.2[1], x.2[0]];
    });
    assert!(
        e.contains(name) && e.contains("[192, 512]") && e.contains("[512, 192]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let name = "model.norm.weight";
    let e = load_error("dtype", |t| {
        let x = t.iter_mut().find(|x| x.0 == name).unwrap();
        x.1 = Dtype::I16;
    });
    assert!(e.contains(name) && e.contains("I16"), "{e}");
}

#[test]
fn extra_tensors_are_ignored() {
    let e = load_error("extra", |t| {
        t.push((
            "model.layers.3.eh_proj.weight".into(),
            Dtype::BF16,
            vec![2, 2],
            vec![0u8; 8],
        ));
    });
    assert_eq!(e, "");
}

#[test]
fn rope_tables_match_transformers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rope_cases.json");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for case in cases["cases"].as_array().unwrap() {
        let what = case["what"].as_str().unwrap();
        let cfg = ModelConfig::from_json_str(&case["config"].to_string(), what).unwrap();
        let table = RopeTable::new(&cfg.rope, cfg.qk_rope_head_dim);
        let hf: Vec<f64> = case["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(table.inv_freq.len(), hf.len(), "{what}");
        for (i, (a, b)) in table.inv_freq.iter().zip(&hf).enumerate() {
            assert!(
                ((*a as f64) - b).abs() <= 1e-6 * b.abs(),
                "{what}: inv_freq[{i}] {a} vs {b}"
            );
        }
        let af = case["attention_factor"].as_f64().unwrap();
        assert!(
            (table.attention_factor as f64 - af).abs() < 1e-6,
            "{what}: attention factor"
        );
        let sc = case["softmax_scale"].as_f64().unwrap();
        assert!(
            (cfg.softmax_scale() as f64 - sc).abs() < 1e-7,
            "{what}: softmax scale"
        );
    }
}

/// The same tokens through one prefill, token-by-token decode, or another page size give
/// the same logits: positions, causal top-k and the block table are consistent.
#[test]
fn prefill_equals_decode_and_page_size_does_not_matter() {
    for name in ["glm_moe_dsa-tiny", "deepseek_v32-tiny"] {
        let dir = fixture(name);
        let model = Model::load(&dir, cpu(), &mut |_, _| {}).unwrap();
        let v = model.config.vocab_size;
        let tokens: Vec<u32> = (0..24).map(|i| (i * 53 + 11) % v as u32).collect();

        let mut seq = model.new_sequence(opts()).unwrap();
        let all = model.forward(&mut seq, &tokens, Logits::All).unwrap();

        let mut seq = model
            .new_sequence(CacheOptions {
                page_size: 1,
                ..opts()
            })
            .unwrap();
        let mut stepped = model.forward(&mut seq, &tokens[..10], Logits::All).unwrap();
        for &t in &tokens[10..] {
            stepped.extend(model.forward(&mut seq, &[t], Logits::Last).unwrap());
        }
        let a: Vec<f64> = all.iter().map(|&x| x as f64).collect();
        let b: Vec<f64> = stepped.iter().map(|&x| x as f64).collect();
        assert!(
            rel_l2(&b, &a) < 1e-5,
            "{name}: prefill vs decode rel L2 {}",
            rel_l2(&b, &a)
        );

        let mut seq = model
            .new_sequence(CacheOptions {
                page_size: 64,
                ..opts()
            })
            .unwrap();
        let big_pages = model.forward(&mut seq, &tokens, Logits::All).unwrap();
        assert_eq!(big_pages, all, "{name}: page size changed the logits");
    }
}

#[test]
fn sequence_longer_than_max_seq_len_is_an_error() {
    let model = Model::load(&fixture("glm_moe_dsa-tiny"), cpu(), &mut |_, _| {}).unwrap();
    let mut seq = model
        .new_sequence(CacheOptions {
            max_seq_len: 4,
            ..opts()
        })
        .unwrap();
    let e = model
        .forward(&mut seq, &[1, 2, 3, 4, 5], Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_seq_len"), "{e}");
}

/// The fixtures' prompt text encodes to the ids the Hugging Face tokenizer gave when the
/// golden was made (golden.json `prompt_text`, golden.safetensors `prompt_ids`).
#[test]
fn prompt_text_encodes_to_the_golden_ids() {
    use sparse_mla::conformance::model::load_golden;
    use sparse_mla::model::TextTokenizer;
    for name in ["glm_moe_dsa-tiny", "deepseek_v32-tiny"] {
        let dir = fixture(name);
        let g = load_golden(&dir).unwrap();
        let text = g.meta["prompt_text"].as_str().unwrap();
        let tok = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(tok.encode(text).unwrap(), g.prompt_ids, "{name}: {text:?}");
        assert_eq!(tok.decode(&g.prompt_ids).unwrap(), text, "{name}");
    }
}

/// A config that claims more layers or experts than the checkpoint holds (within the
/// config limits) is refused from the tensor count, before the expected-tensor list (tens
/// of millions of names) is built.
#[test]
fn config_claiming_more_tensors_than_the_checkpoint_is_refused_at_once() {
    let src = fixture("glm_moe_dsa-tiny");
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    for (key, value) in [("num_hidden_layers", 1000u64), ("n_routed_experts", 4096)] {
        let dir = TempDir::new(&format!("count-{key}"));
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v[key] = value.into();
        if key == "num_hidden_layers" {
            for k in ["mlp_layer_types", "indexer_types", "layer_types"] {
                v.as_object_mut().unwrap().remove(k);
            }
        }
        std::fs::write(dir.0.join("config.json"), v.to_string()).unwrap();
        std::os::unix::fs::symlink(
            src.join("model.safetensors"),
            dir.0.join("model.safetensors"),
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        let e = match Model::load(&dir.0, cpu(), &mut |_, _| {}) {
            Ok(_) => panic!("{key} = {value} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("checkpoint holds only"), "{key}: {e}");
        assert!(
            t0.elapsed().as_secs_f64() < 2.0,
            "{key}: took {:?}",
            t0.elapsed()
        );
    }
}

/// A failed forward (a token id past the vocabulary) leaves the sequence and the page pool
/// exactly as they were: the next valid call works and gives the same logits as on a fresh
/// sequence.
#[test]
fn failed_forward_leaks_nothing() {
    let dir = fixture("glm_moe_dsa-tiny");
    let model = Model::load(&dir, cpu(), &mut |_, _| {}).unwrap();
    let small = CacheOptions {
        max_seq_len: 64,
        ..opts()
    };
    let mut seq = model.new_sequence(small).unwrap();
    let vocab = model.config.vocab_size as u32;
    for _ in 0..50 {
        assert!(model.forward(&mut seq, &[1, vocab], Logits::Last).is_err());
    }
    assert_eq!(seq.len(), 0);
    let got = model.forward(&mut seq, &[1, 2, 3], Logits::Last).unwrap();
    let mut fresh = model.new_sequence(small).unwrap();
    let want = model.forward(&mut fresh, &[1, 2, 3], Logits::Last).unwrap();
    assert_eq!(got, want);
}
