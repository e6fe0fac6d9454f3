//! Config parsing: production configs, and every error names its key.

use super::*;

/// A complete GLM-5-shaped config (production values from docs/models.md) as JSON.
pub(crate) fn glm5_json() -> Value {
    serde_json::json!({
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
        "rms_norm_eps": 1e-5, "first_k_dense_replace": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "eos_token_id": [154820, 154827, 154829]
    })
}

/// DeepSeek-V3.2 in the older layout real checkpoints use: `rope_scaling` + `rope_theta`.
fn deepseek_json() -> Value {
    serde_json::json!({
        "model_type": "deepseek_v32",
        "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128,
        "rms_norm_eps": 1e-6, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
        "eos_token_id": 1
    })
}

fn parse(v: &Value) -> Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string(), "config.json")
}

fn err_of(v: &Value) -> String {
    match parse(v) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn production_configs_parse_with_the_design_facts() {
    let glm = parse(&glm5_json()).unwrap();
    assert_eq!(glm.arch, Arch::Glm5);
    assert_eq!(glm.softmax_scale(), 0.0625);
    assert_eq!(glm.indexer_rope_style, RopeStyle::Interleaved);
    assert_eq!(glm.mlp_layer_types[2], MlpKind::Dense);
    assert_eq!(glm.mlp_layer_types[3], MlpKind::Moe);
    assert!(glm.indexer_types.iter().all(|t| *t == IndexerKind::Full));
    assert_eq!(glm.cache_scale_flavour(), ScaleFlavour::Arbitrary);
    assert!(glm.is_eos(154827));

    let ds = parse(&deepseek_json()).unwrap();
    assert_eq!(ds.arch, Arch::DeepseekV32);
    assert_eq!(ds.indexer_rope_style, RopeStyle::HalfSplit);
    assert_eq!(ds.mla_rope_style, RopeStyle::Interleaved);
    assert!(
        (ds.softmax_scale() - 0.135234).abs() < 1e-6,
        "{}",
        ds.softmax_scale()
    );
    assert_eq!(ds.fp8, Some(Fp8Blocks { block: [128, 128] }));
    assert_eq!(ds.cache_scale_flavour(), ScaleFlavour::Pow2);
}

#[test]
fn unsupported_model_type_is_named() {
    let mut v = glm5_json();
    v["model_type"] = "deepseek_v3".into();
    let e = err_of(&v);
    assert!(e.contains("model_type") && e.contains("deepseek_v3"), "{e}");
}

#[test]
fn missing_key_is_named() {
    for key in [
        "kv_lora_rank",
        "index_topk",
        "n_group",
        "norm_topk_prob",
        "rms_norm_eps",
    ] {
        let mut v = glm5_json();
        v.as_object_mut().unwrap().remove(key);
        let e = err_of(&v);
        assert!(
            e.contains(&format!("`{key}`")) && e.contains("missing"),
            "{key}: {e}"
        );
    }
    let mut v = glm5_json();
    v.as_object_mut().unwrap().remove("first_k_dense_replace");
    assert!(err_of(&v).contains("first_k_dense_replace"));
    let mut v = glm5_json();
    v.as_object_mut().unwrap().remove("rope_parameters");
    assert!(err_of(&v).contains("rope_theta"));
}

#[test]
fn wrong_type_is_named() {
    let mut v = glm5_json();
    v["hidden_size"] = "big".into();
    let e = err_of(&v);
    assert!(e.contains("`hidden_size`") && e.contains("integer"), "{e}");
}

#[test]
fn contradictions_are_named() {
    let mut v = glm5_json();
    v["mlp_layer_types"] = serde_json::json!(vec!["dense"; 78]);
    let e = err_of(&v);
    assert!(
        e.contains("mlp_layer_types") && e.contains("first_k_dense_replace"),
        "{e}"
    );

    let mut v = deepseek_json();
    v["indexer_rope_interleave"] = true.into();
    let e = err_of(&v);
    assert!(
        e.contains("indexer_rope_interleave") && e.contains("half-split"),
        "{e}"
    );

    let mut v = glm5_json();
    v["num_key_value_heads"] = 8.into();
    assert!(err_of(&v).contains("num_key_value_heads"));

    let mut v = glm5_json();
    v["qk_head_dim"] = 192.into();
    assert!(err_of(&v).contains("qk_head_dim"));

    let mut v = glm5_json();
    v["rope_theta"] = 10000.into();
    assert!(err_of(&v).contains("rope_theta"));

    let mut v = deepseek_json();
    v["indexer_types"] = serde_json::json!(["full", "shared"]);
    assert!(err_of(&v).contains("indexer_types"));

    let mut v = glm5_json();
    v["n_group"] = 3.into();
    assert!(err_of(&v).contains("n_group"));
}

#[test]
fn glm_indexer_types_follow_transformers() {
    let mut v = glm5_json();
    v["num_hidden_layers"] = 4.into();
    v["indexer_types"] = serde_json::json!(["full", "shared", "full", "shared"]);
    let c = parse(&v).unwrap();
    assert_eq!(c.indexer_types[1], IndexerKind::Shared);

    let mut v = glm5_json();
    v["num_hidden_layers"] = 4.into();
    v["index_topk_pattern"] = "FSSF".into();
    let c = parse(&v).unwrap();
    assert_eq!(
        c.indexer_types,
        vec![
            IndexerKind::Full,
            IndexerKind::Shared,
            IndexerKind::Shared,
            IndexerKind::Full
        ]
    );

    // freq 2, offset 2: max(i - 1, 0) % 2 == 0 → layers 0, 1, 3, 5 full.
    let mut v = glm5_json();
    v["num_hidden_layers"] = 6.into();
    v["index_topk_freq"] = 2.into();
    let c = parse(&v).unwrap();
    use IndexerKind::*;
    assert_eq!(
        c.indexer_types,
        vec![Full, Full, Shared, Full, Shared, Full]
    );

    let mut v = glm5_json();
    v["num_hidden_layers"] = 2.into();
    v["indexer_types"] = serde_json::json!(["shared", "full"]);
    assert!(err_of(&v).contains("layer 0"));
}

#[test]
fn null_q_lora_rank_is_refused() {
    let mut v = glm5_json();
    v["q_lora_rank"] = Value::Null;
    assert!(err_of(&v).contains("q_lora_rank"));
}

#[test]
fn not_json_names_the_file() {
    let e = ModelConfig::from_json_str("{", "/m/config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/m/config.json") && e.contains("JSON"), "{e}");
}

/// Huge integers, narrowing and non-finite f32s (the hardening issue's examples): each a
/// clear error naming its key, never a wrapped size, a panic or an allocation.
#[test]
fn huge_and_narrowing_values_are_refused_by_key() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "num_attention_heads",
            serde_json::json!((1u64 << 60) + 4),
            "more than this runner accepts",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000u64),
            "more than this runner accepts",
        ),
        (
            "n_routed_experts",
            serde_json::json!(1_000_000_000u64),
            "more than this runner accepts",
        ),
        (
            "n_routed_experts",
            serde_json::json!((1u64 << 32) + 1),
            "more than this runner accepts",
        ),
        (
            "vocab_size",
            serde_json::json!(1u64 << 40),
            "more than this runner accepts",
        ),
        (
            "hidden_size",
            serde_json::json!(u64::MAX),
            "more than this runner accepts",
        ),
        (
            "kv_lora_rank",
            serde_json::json!(1u64 << 32),
            "more than this runner accepts",
        ),
        ("kv_lora_rank", serde_json::json!(7), "multiple of 8"),
        (
            "eos_token_id",
            serde_json::json!(4_294_967_525u64),
            "not a token id",
        ),
        (
            "eos_token_id",
            serde_json::json!([1, 154880]),
            "not a token id",
        ),
        (
            "routed_scaling_factor",
            serde_json::json!(1e39),
            "outside the f32 range",
        ),
        (
            "rms_norm_eps",
            serde_json::json!(1e300),
            "outside the f32 range",
        ),
        ("rms_norm_eps", serde_json::json!(1e-300), "0 as an f32"),
        (
            "max_position_embeddings",
            serde_json::json!(1u64 << 40),
            "more than this runner accepts",
        ),
        (
            "index_topk",
            serde_json::json!(1u64 << 40),
            "more than this runner accepts",
        ),
    ];
    for (key, value, want) in cases {
        let mut v = glm5_json();
        v[key] = value.clone();
        if key == "num_attention_heads" {
            v["num_key_value_heads"] = value.clone();
        }
        let e = err_of(&v);
        assert!(
            e.contains(&format!("`{key}`")) && e.contains(want),
            "{key} = {value}: {e}"
        );
    }
}

#[test]
fn yarn_with_rope_theta_one_is_refused() {
    let mut v = deepseek_json();
    v["rope_theta"] = serde_json::json!(1);
    let e = err_of(&v);
    assert!(
        e.contains("`rope_theta`") && e.contains("ln(rope_theta)"),
        "{e}"
    );
}

/// The largest values the limits allow still give sizes that fit a u64 (so the memory plan
/// and the tensor count can be computed before anything is allocated).
#[test]
fn the_limits_keep_every_derived_size_in_u64() {
    let l = |x: usize| x as u128;
    let biggest_expert_stack = l(limits::EXPERTS) * 3 * l(limits::DIM) * l(limits::DIM) * 4;
    let per_layer =
        biggest_expert_stack + 16 * l(limits::DIM) * l(limits::DIM) * l(limits::HEADS) * 4;
    assert!(per_layer * l(limits::LAYERS) < u64::MAX as u128);
    assert!(l(limits::VOCAB) * l(limits::DIM) * 4 < u64::MAX as u128);
    assert!(l(limits::HEADS) * l(limits::DIM) * 2 <= u32::MAX as u128);
}
