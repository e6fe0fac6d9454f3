//! Hugging Face `config.json` of GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`),
//! read the way transformers 5.17 reads it.
//!
//! Every value the forward pass uses is read from the file; none is guessed. A missing key, a
//! value of the wrong type, an unsupported model type or a pair of keys that contradict each
//! other is an [`Error::Model`] naming the key. What the config does not say, the model type
//! decides, as in transformers 5.17 (DESIGN §6): the RoPE layout of MLA and of the indexer, and
//! that DeepSeek-V3.2 has no "shared" indexer layers.

use std::path::Path;

use serde_json::{Map, Value};

use crate::mla::{MlaDims, ScaleFlavour};
use crate::{Error, Result};

/// The two architectures (HF `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// GLM-5 (`glm_moe_dsa`): indexer RoPE interleaved, "shared" indexer layers allowed.
    Glm5,
    /// DeepSeek-V3.2 (`deepseek_v32`): indexer RoPE half-split, every layer runs its indexer.
    DeepseekV32,
}

impl Arch {
    pub fn model_type(&self) -> &'static str {
        match self {
            Arch::Glm5 => "glm_moe_dsa",
            Arch::DeepseekV32 => "deepseek_v32",
        }
    }
}

/// How RoPE pairs the dimensions it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(x0, x1), (x2, x3), …`, pair i rotated by frequency i (DeepSeek's layout).
    Interleaved,
    /// Pairs `(x_i, x_{i + d/2})` (GPT-NeoX / Llama `rotate_half`).
    HalfSplit,
}

/// The RoPE frequencies: plain (`"default"`) or YaRN.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// The MLP of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    Dense,
    Moe,
}

/// Whether a layer runs its own lightning indexer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexerKind {
    /// Runs the indexer: its own key cache, scores and top-k.
    Full,
    /// Reuses the top-k of the nearest earlier full layer (GLM-5.x `indexer_types`).
    Shared,
}

/// Block-scaled FP8 weights (`quantization_config` with `quant_method: "fp8"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Blocks {
    /// `weight_block_size`: rows × columns of the weight covered by one `weight_scale_inv`.
    pub block: [usize; 2],
}

/// Everything the forward pass needs, read from `config.json` and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Dense MLP width (dense layers).
    pub intermediate_size: usize,
    /// Width of one routed expert; the shared expert block is `× n_shared_experts`.
    pub moe_intermediate_size: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub index_topk: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    /// Epsilon of the decoder-layer and final RMSNorms. The q_a / kv_a RMSNorms and the
    /// indexer LayerNorm use 1e-6 whatever this says (transformers hard-codes it).
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub mla_rope_style: RopeStyle,
    pub indexer_rope_style: RopeStyle,
    pub mlp_layer_types: Vec<MlpKind>,
    pub indexer_types: Vec<IndexerKind>,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: Option<usize>,
    pub fp8: Option<Fp8Blocks>,
}

/// Epsilon of q_a_layernorm and kv_a_layernorm (transformers builds them with the default).
pub const LATENT_NORM_EPS: f32 = 1e-6;
/// Epsilon of the indexer's key LayerNorm.
pub const INDEXER_NORM_EPS: f32 = 1e-6;

/// Typed access to the keys of one config object; errors name the file and the key.
struct Keys<'a> {
    map: &'a Map<String, Value>,
    source: &'a str,
}

impl<'a> Keys<'a> {
    fn err(&self, key: &str, what: impl std::fmt::Display) -> Error {
        Error::Model(format!("{}: key `{key}` {what}", self.source))
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    fn req(&self, key: &str) -> Result<&'a Value> {
        self.get(key).ok_or_else(|| {
            self.err(
                key,
                "is missing (the forward pass needs it; nothing is guessed)",
            )
        })
    }

    fn usize_of(&self, key: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(key, format!("must be a non-negative integer, found {v}")))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.usize_of(key, self.req(key)?)
    }

    fn positive(&self, key: &str) -> Result<usize> {
        let v = self.usize(key)?;
        if v == 0 {
            return Err(self.err(key, "must be at least 1, found 0"));
        }
        Ok(v)
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.usize_of(key, v)).transpose()
    }

    fn f64_of(&self, key: &str, v: &Value) -> Result<f64> {
        v.as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.err(key, format!("must be a finite number, found {v}")))
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.f64_of(key, self.req(key)?)
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| self.f64_of(key, v)).transpose()
    }

    fn bool_of(&self, key: &str, v: &Value) -> Result<bool> {
        v.as_bool()
            .ok_or_else(|| self.err(key, format!("must be true or false, found {v}")))
    }

    fn bool(&self, key: &str) -> Result<bool> {
        self.bool_of(key, self.req(key)?)
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| self.bool_of(key, v)).transpose()
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(key, format!("must be a string, found {v}")))
            })
            .transpose()
    }

    fn opt_str_list(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, format!("must be a list of strings, found {v}")))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.err(key, format!("must hold strings only, found {x}")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// A key the model type fixes: absent is fine, present must agree.
    fn must_agree_bool(&self, key: &str, implied: bool, why: &str) -> Result<()> {
        match self.opt_bool(key)? {
            Some(v) if v != implied => Err(self.err(
                key,
                format!("is {v}, but {why}; refusing to guess which one the checkpoint was trained with"),
            )),
            _ => Ok(()),
        }
    }
}

impl ModelConfig {
    /// Reads and checks `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses the text of a `config.json`; `source` names it in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::Model(format!("{source}: not valid JSON: {e}")))?;
        let map = value
            .as_object()
            .ok_or_else(|| Error::Model(format!("{source}: expected a JSON object at the top")))?;
        Self::from_map(map, source)
    }

    fn from_map(map: &Map<String, Value>, source: &str) -> Result<Self> {
        let k = Keys { map, source };
        let arch = match k.opt_str("model_type")? {
            Some("glm_moe_dsa") => Arch::Glm5,
            Some("deepseek_v32") => Arch::DeepseekV32,
            Some(other) => {
                return Err(k.err(
                    "model_type",
                    format!("is \"{other}\"; supported: \"glm_moe_dsa\" (GLM-5) and \"deepseek_v32\" (DeepSeek-V3.2)"),
                ))
            }
            None => return Err(k.err("model_type", "is missing")),
        };

        let num_hidden_layers = k.positive("num_hidden_layers")?;
        let num_attention_heads = k.positive("num_attention_heads")?;
        if let Some(kv) = k.opt_usize("num_key_value_heads")? {
            if kv != num_attention_heads {
                return Err(k.err(
                    "num_key_value_heads",
                    format!("is {kv} but num_attention_heads is {num_attention_heads}; MLA expands one latent to every head, so they must be equal"),
                ));
            }
        }
        if k.get("q_lora_rank").is_none() && map.contains_key("q_lora_rank") {
            return Err(k.err(
                "q_lora_rank",
                "is null; the lightning indexer reads the q_a latent, so a q_lora_rank is required",
            ));
        }
        let qk_nope_head_dim = k.positive("qk_nope_head_dim")?;
        let qk_rope_head_dim = k.positive("qk_rope_head_dim")?;
        if qk_rope_head_dim % 2 != 0 {
            return Err(k.err(
                "qk_rope_head_dim",
                format!("must be even, found {qk_rope_head_dim}"),
            ));
        }
        if let Some(qk) = k.opt_usize("qk_head_dim")? {
            if qk != qk_nope_head_dim + qk_rope_head_dim {
                return Err(k.err(
                    "qk_head_dim",
                    format!(
                        "is {qk} but qk_nope_head_dim + qk_rope_head_dim = {}",
                        qk_nope_head_dim + qk_rope_head_dim
                    ),
                ));
            }
        }
        let index_head_dim = k.positive("index_head_dim")?;
        if index_head_dim < qk_rope_head_dim {
            return Err(k.err(
                "index_head_dim",
                format!("is {index_head_dim}, smaller than qk_rope_head_dim {qk_rope_head_dim} (the indexer rotates its first qk_rope_head_dim values)"),
            ));
        }

        // Things neither model has; refuse rather than compute something else.
        if let Some(act) = k.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(k.err(
                    "hidden_act",
                    format!("is \"{act}\"; only \"silu\" is supported"),
                ));
            }
        }
        if k.opt_bool("attention_bias")? == Some(true) {
            return Err(k.err("attention_bias", "is true; neither GLM-5 nor DeepSeek-V3.2 has attention biases and they are not supported"));
        }
        if let Some(f) = k.opt_usize("moe_layer_freq")? {
            if f != 1 {
                return Err(k.err("moe_layer_freq", format!("is {f}; only 1 is supported (every layer past first_k_dense_replace is MoE)")));
            }
        }
        if let Some(s) = k.opt_str("scoring_func")? {
            if s != "sigmoid" {
                return Err(k.err(
                    "scoring_func",
                    format!("is \"{s}\"; only \"sigmoid\" routing is supported"),
                ));
            }
        }
        if let Some(s) = k.opt_str("topk_method")? {
            if s != "noaux_tc" {
                return Err(k.err(
                    "topk_method",
                    format!("is \"{s}\"; only \"noaux_tc\" routing is supported"),
                ));
            }
        }

        // RoPE layouts: transformers 5.17 has no key for them, the model type decides.
        let (mla_rope_style, indexer_rope_style) = match arch {
            Arch::Glm5 => (RopeStyle::Interleaved, RopeStyle::Interleaved),
            Arch::DeepseekV32 => (RopeStyle::Interleaved, RopeStyle::HalfSplit),
        };
        k.must_agree_bool(
            "rope_interleave",
            true,
            &format!(
                "transformers 5.17's {} applies interleaved RoPE in MLA",
                arch.model_type()
            ),
        )?;
        k.must_agree_bool(
            "indexer_rope_interleave",
            indexer_rope_style == RopeStyle::Interleaved,
            &format!(
                "transformers 5.17's {} applies {} RoPE in the indexer",
                arch.model_type(),
                if indexer_rope_style == RopeStyle::Interleaved {
                    "interleaved"
                } else {
                    "half-split"
                }
            ),
        )?;

        let n_routed_experts = routed_experts(&k)?;
        let n_group = k.positive("n_group")?;
        let topk_group = k.positive("topk_group")?;
        let num_experts_per_tok = k.positive("num_experts_per_tok")?;
        check_routing(
            &k,
            n_routed_experts,
            n_group,
            topk_group,
            num_experts_per_tok,
        )?;

        let cfg = ModelConfig {
            arch,
            vocab_size: k.positive("vocab_size")?,
            hidden_size: k.positive("hidden_size")?,
            num_hidden_layers,
            num_attention_heads,
            q_lora_rank: k.positive("q_lora_rank")?,
            kv_lora_rank: k.positive("kv_lora_rank")?,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim: k.positive("v_head_dim")?,
            intermediate_size: k.positive("intermediate_size")?,
            moe_intermediate_size: k.positive("moe_intermediate_size")?,
            n_routed_experts,
            n_shared_experts: k.usize("n_shared_experts")?,
            num_experts_per_tok,
            n_group,
            topk_group,
            routed_scaling_factor: k.f64("routed_scaling_factor")? as f32,
            norm_topk_prob: k.bool("norm_topk_prob")?,
            index_topk: k.positive("index_topk")?,
            index_n_heads: k.positive("index_n_heads")?,
            index_head_dim,
            rms_norm_eps: positive_f64(&k, "rms_norm_eps")? as f32,
            rope: rope_config(&k)?,
            mla_rope_style,
            indexer_rope_style,
            mlp_layer_types: mlp_layer_types(&k, num_hidden_layers)?,
            indexer_types: indexer_types(&k, arch, num_hidden_layers)?,
            tie_word_embeddings: k.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            eos_token_ids: eos_token_ids(&k)?,
            max_position_embeddings: k.opt_usize("max_position_embeddings")?,
            fp8: fp8_blocks(&k)?,
        };
        Ok(cfg)
    }

    /// Width of one query/key head in the non-absorbed form: nope + rope.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The widths of a cache row: latent (kv_lora_rank) + rope.
    pub fn mla_dims(&self) -> MlaDims {
        MlaDims {
            latent: self.kv_lora_rank as u32,
            rope: self.qk_rope_head_dim as u32,
        }
    }

    /// Softmax scale of MLA: `qk_head_dim^-0.5`, times `mscale²` under YaRN with
    /// `mscale_all_dim` (transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = self.rope.scaling
        {
            if m != 0.0 {
                let ms = yarn_get_mscale(factor, m);
                scale *= ms * ms;
            }
        }
        scale as f32
    }

    /// How fp8_ds_mla tile scales are chosen when this model writes its cache (DESIGN §4).
    pub fn cache_scale_flavour(&self) -> ScaleFlavour {
        match self.arch {
            Arch::DeepseekV32 => ScaleFlavour::Pow2,
            Arch::Glm5 => ScaleFlavour::Arbitrary,
        }
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }
}

/// transformers' `yarn_get_mscale`.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn positive_f64(k: &Keys, key: &str) -> Result<f64> {
    let v = k.f64(key)?;
    if v <= 0.0 {
        return Err(k.err(key, format!("must be positive, found {v}")));
    }
    Ok(v)
}

fn routed_experts(k: &Keys) -> Result<usize> {
    // transformers re-routes the older `num_experts` to `n_routed_experts`.
    let n = k.opt_usize("n_routed_experts")?;
    let legacy = k.opt_usize("num_experts")?;
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

fn check_routing(
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

fn rope_config(k: &Keys) -> Result<RopeConfig> {
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

fn mlp_layer_types(k: &Keys, layers: usize) -> Result<Vec<MlpKind>> {
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

fn indexer_types(k: &Keys, arch: Arch, layers: usize) -> Result<Vec<IndexerKind>> {
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

fn eos_token_ids(k: &Keys) -> Result<Vec<u32>> {
    match k.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as u32)
                    .ok_or_else(|| k.err("eos_token_id", format!("must hold integers, found {v}")))
            })
            .collect(),
        Some(v) => Ok(vec![k.usize_of("eos_token_id", v)? as u32]),
    }
}

fn fp8_blocks(k: &Keys) -> Result<Option<Fp8Blocks>> {
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
    if dims.len() != 2 || dims.contains(&0) {
        return Err(qk.err(
            "weight_block_size",
            format!("must be two positive integers, found {block}"),
        ));
    }
    Ok(Some(Fp8Blocks {
        block: [dims[0], dims[1]],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete GLM-5-shaped config (production values from DESIGN §6) as JSON.
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
}
