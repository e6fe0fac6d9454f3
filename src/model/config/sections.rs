//! The parts of `config.json` that need more than one key: routing, RoPE, layer kinds,
//! end-of-sequence ids and FP8 weight blocks.

use serde_json::{Map, Value};

use super::keys::Keys;
use super::*;
use crate::Result;

pub(super) fn positive_f64(k: &Keys, key: &str) -> Result<f64> {
    let v = k.f64(key)?;
    if v <= 0.0 {
        return Err(k.err(key, format!("must be positive, found {v}")));
    }
    Ok(v)
}

pub(super) fn routed_experts(k: &Keys) -> Result<usize> {
    // transformers re-routes the older `num_experts` to `n_routed_experts`.
    let n = k
        .opt_usize("n_routed_experts")?
        .map(|v| k.at_most("n_routed_experts", v, limits::EXPERTS))
        .transpose()?;
    let legacy = k
        .opt_usize("num_experts")?
        .map(|v| k.at_most("num_experts", v, limits::EXPERTS))
        .transpose()?;
    match (n, legacy) {
        (Some(a), Some(b)) if a != b => {
            Err(k.err("num_experts", format!("is {b} but n_routed_experts is {a}")))
        }
        (Some(a), _) | (None, Some(a)) if a > 0 => Ok(a),
        (Some(_), _) => Err(k.err("n_routed_experts", "must be at least 1, found 0")),
        (None, Some(_)) => Err(k.err("num_experts", "must be at least 1, found 0")),
        (None, None) => Err(k.err("n_routed_experts", "is missing")),
    }
}

pub(super) fn check_routing(
    k: &Keys,
    experts: usize,
    n_group: usize,
    topk_group: usize,
    per_tok: usize,
) -> Result<()> {
    if experts % n_group != 0 {
        return Err(k.err(
            "n_group",
            format!("is {n_group}, which does not divide n_routed_experts {experts}"),
        ));
    }
    let per_group = experts / n_group;
    if per_group < 2 {
        return Err(k.err(
            "n_group",
            format!("is {n_group}: groups of {per_group} expert(s), but a group's score is the sum of its top 2"),
        ));
    }
    if topk_group > n_group {
        return Err(k.err(
            "topk_group",
            format!("is {topk_group}, more than n_group {n_group}"),
        ));
    }
    if per_tok > topk_group * per_group {
        return Err(k.err(
            "num_experts_per_tok",
            format!(
                "is {per_tok}, more than the {} experts of topk_group {topk_group} groups",
                topk_group * per_group
            ),
        ));
    }
    Ok(())
}

pub(super) fn rope_config(k: &Keys) -> Result<RopeConfig> {
    // transformers 5.x: `rope_parameters`; older checkpoints: `rope_scaling` + `rope_theta`.
    let (params, params_key): (Option<&Map<String, Value>>, &str) =
        match (k.get("rope_parameters"), k.get("rope_scaling")) {
            (Some(_), Some(_)) => {
                let a = k.get("rope_parameters");
                let b = k.get("rope_scaling");
                if a != b {
                    return Err(k.err(
                        "rope_scaling",
                        "and `rope_parameters` are both present and differ",
                    ));
                }
                (a.and_then(|v| v.as_object()), "rope_parameters")
            }
            (Some(v), None) => (
                Some(
                    v.as_object()
                        .ok_or_else(|| k.err("rope_parameters", "must be an object"))?,
                ),
                "rope_parameters",
            ),
            (None, Some(v)) => (
                Some(
                    v.as_object()
                        .ok_or_else(|| k.err("rope_scaling", "must be an object"))?,
                ),
                "rope_scaling",
            ),
            (None, None) => (None, "rope_parameters"),
        };
    let inner_source = format!("{} ({params_key})", k.source);
    let empty = Map::new();
    let p = Keys {
        map: params.unwrap_or(&empty),
        source: &inner_source,
    };
    let theta = match (p.opt_f64("rope_theta")?, k.opt_f64("rope_theta")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(k.err(
                "rope_theta",
                format!("is {b} but {params_key}.rope_theta is {a}"),
            ))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            return Err(k.err(
                "rope_theta",
                "is missing (neither top level nor in rope_parameters)",
            ))
        }
    };
    if theta <= 0.0 {
        return Err(k.err("rope_theta", format!("must be positive, found {theta}")));
    }
    let rope_type = match (p.opt_str("rope_type")?, p.opt_str("type")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(p.err("type", format!("is \"{b}\" but rope_type is \"{a}\"")))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => "default",
    };
    if p.opt_f64("partial_rotary_factor")?
        .is_some_and(|f| f != 1.0)
    {
        return Err(p.err("partial_rotary_factor", "is not 1; not supported"));
    }
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "yarn" => {
            if theta <= 1.0 {
                return Err(k.err(
                    "rope_theta",
                    format!(
                        "is {theta}; YaRN divides by ln(rope_theta), so it must be more than 1"
                    ),
                ));
            }
            let factor = p.f64("factor")?;
            if factor <= 0.0 {
                return Err(p.err("factor", format!("must be positive, found {factor}")));
            }
            // transformers: `beta_fast or 32`, `beta_slow or 1` (0 means the default too).
            let beta = |key: &str, default: f64| -> Result<f64> {
                Ok(p.opt_f64(key)?.filter(|&b| b != 0.0).unwrap_or(default))
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: p.f64("original_max_position_embeddings")?,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                mscale: p.opt_f64("mscale")?,
                mscale_all_dim: p.opt_f64("mscale_all_dim")?,
                attention_factor: p.opt_f64("attention_factor")?,
                truncate: p.opt_bool("truncate")?.unwrap_or(true),
            }
        }
        other => {
            return Err(p.err(
                "rope_type",
                format!("is \"{other}\"; supported: \"default\" and \"yarn\""),
            ))
        }
    };
    Ok(RopeConfig { theta, scaling })
}

pub(super) fn mlp_layer_types(k: &Keys, layers: usize) -> Result<Vec<MlpKind>> {
    let from_list = k
        .opt_str_list("mlp_layer_types")?
        .map(|list| -> Result<Vec<MlpKind>> {
            if list.len() != layers {
                return Err(k.err(
                    "mlp_layer_types",
                    format!(
                        "has {} entries but num_hidden_layers is {layers}",
                        list.len()
                    ),
                ));
            }
            list.iter()
                .map(|s| match *s {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" => Ok(MlpKind::Moe),
                    other => Err(k.err(
                        "mlp_layer_types",
                        format!("holds \"{other}\"; expected \"dense\" or \"sparse\""),
                    )),
                })
                .collect()
        })
        .transpose()?;
    let from_first_k = k.opt_usize("first_k_dense_replace")?.map(|n| {
        (0..layers)
            .map(|i| if i < n { MlpKind::Dense } else { MlpKind::Moe })
            .collect::<Vec<_>>()
    });
    match (from_list, from_first_k) {
        (Some(a), Some(b)) if a != b => Err(k.err(
            "mlp_layer_types",
            format!(
                "disagrees with first_k_dense_replace = {} (layer {} differs)",
                k.opt_usize("first_k_dense_replace")?.unwrap_or(0),
                a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0)
            ),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(k.err(
            "first_k_dense_replace",
            "is missing (and there is no mlp_layer_types): which layers are dense is not guessed",
        )),
    }
}

pub(super) fn indexer_types(k: &Keys, arch: Arch, layers: usize) -> Result<Vec<IndexerKind>> {
    let parse = |key: &str, s: &str| match s {
        "full" => Ok(IndexerKind::Full),
        "shared" => Ok(IndexerKind::Shared),
        other => Err(k.err(
            key,
            format!("holds \"{other}\"; expected \"full\" or \"shared\""),
        )),
    };
    let types: Vec<IndexerKind> = if let Some(list) = k.opt_str_list("indexer_types")? {
        list.iter()
            .map(|s| parse("indexer_types", s))
            .collect::<Result<_>>()?
    } else if let Some(v) = k.get("index_topk_pattern") {
        // transformers 5.17 (glm_moe_dsa): a string "FSSF…" or a list.
        match v {
            Value::String(s) => s
                .chars()
                .map(|c| match c {
                    'F' => Ok(IndexerKind::Full),
                    'S' => Ok(IndexerKind::Shared),
                    other => Err(k.err(
                        "index_topk_pattern",
                        format!("holds '{other}'; expected 'F' or 'S'"),
                    )),
                })
                .collect::<Result<_>>()?,
            _ => k
                .opt_str_list("index_topk_pattern")?
                .unwrap_or_default()
                .iter()
                .map(|s| parse("index_topk_pattern", s))
                .collect::<Result<_>>()?,
        }
    } else if arch == Arch::Glm5 && (k.has("index_topk_freq") || k.has("index_skip_topk_offset")) {
        // transformers 5.17: layer i is full when max(i - offset + 1, 0) % freq == 0.
        let freq = k.opt_usize("index_topk_freq")?.unwrap_or(1).max(1);
        let offset = k.opt_usize("index_skip_topk_offset")?.unwrap_or(2);
        (0..layers)
            .map(|i| {
                if (i + 1).saturating_sub(offset) % freq == 0 {
                    IndexerKind::Full
                } else {
                    IndexerKind::Shared
                }
            })
            .collect()
    } else {
        vec![IndexerKind::Full; layers]
    };
    if types.len() != layers {
        return Err(k.err(
            "indexer_types",
            format!(
                "has {} entries but num_hidden_layers is {layers}",
                types.len()
            ),
        ));
    }
    if arch == Arch::DeepseekV32 && types.contains(&IndexerKind::Shared) {
        return Err(k.err(
            "indexer_types",
            "marks layers \"shared\", but deepseek_v32 runs the indexer in every layer (transformers ignores the key)",
        ));
    }
    if types[0] == IndexerKind::Shared {
        return Err(k.err(
            "indexer_types",
            "starts with \"shared\": layer 0 has no earlier full layer to take its top-k from",
        ));
    }
    Ok(types)
}

pub(super) fn eos_token_ids(k: &Keys, vocab: usize) -> Result<Vec<u32>> {
    let id = |v: &Value| -> Result<u32> {
        let x = v.as_u64().ok_or_else(|| {
            k.err(
                "eos_token_id",
                format!("must be a token id (a non-negative integer), found {v}"),
            )
        })?;
        if x >= vocab as u64 {
            return Err(k.err(
                "eos_token_id",
                format!("holds {x}, not a token id of this model (vocab_size is {vocab})"),
            ));
        }
        Ok(x as u32)
    };
    match k.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

pub(super) fn fp8_blocks(k: &Keys) -> Result<Option<Fp8Blocks>> {
    let Some(q) = k.get("quantization_config") else {
        return Ok(None);
    };
    let map = q
        .as_object()
        .ok_or_else(|| k.err("quantization_config", "must be an object"))?;
    let source = format!("{} (quantization_config)", k.source);
    let qk = Keys {
        map,
        source: &source,
    };
    match qk.opt_str("quant_method")? {
        Some("fp8") => {}
        Some(other) => {
            return Err(qk.err(
                "quant_method",
                format!("is \"{other}\"; only block-scaled \"fp8\" weights are supported"),
            ))
        }
        None => return Err(qk.err("quant_method", "is missing")),
    }
    if let Some(fmt) = qk.opt_str("fmt")? {
        if fmt != "e4m3" {
            return Err(qk.err("fmt", format!("is \"{fmt}\"; only e4m3 is supported")));
        }
    }
    let block = qk.req("weight_block_size")?;
    let dims: Vec<usize> = block
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().map(|x| x as usize))
                .collect()
        })
        .unwrap_or_default();
    if dims.len() != 2 || dims.contains(&0) || dims.iter().any(|&d| d > limits::DIM) {
        return Err(qk.err(
            "weight_block_size",
            format!(
                "must be two positive integers of at most {}, found {block}",
                limits::DIM
            ),
        ));
    }
    Ok(Some(Fp8Blocks {
        block: [dims[0], dims[1]],
    }))
}
