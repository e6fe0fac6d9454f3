//! Hugging Face `config.json` of GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`),
//! read the way transformers 5.17 reads it.
//!
//! Every value the forward pass uses is read from the file; none is guessed. A missing key, a
//! value of the wrong type, an unsupported model type or a pair of keys that contradict each
//! other is an [`Error::Model`] naming the key. What the config does not say, the model type
//! decides, as in transformers 5.17 (docs/models.md): the RoPE layout of MLA and of the indexer, and
//! that DeepSeek-V3.2 has no "shared" indexer layers.

use std::path::Path;

use serde_json::{Map, Value};

use keys::Keys;
use sections::*;

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

/// Upper bounds on the sizes and counts a `config.json` may declare. Each is far beyond any
/// GLM-5 / DeepSeek-V3.2 checkpoint (the largest real values are in the comments) and small
/// enough that every size derived from them (tensor elements, bytes, tensor counts) fits a
/// `u64` without overflow and every index the kernels take fits a `u32`.
pub mod limits {
    /// Decoder layers (GLM-5: 78, DeepSeek-V3.2: 61).
    pub const LAYERS: usize = 1024;
    /// Attention heads and indexer heads (128 / 64).
    pub const HEADS: usize = 1024;
    /// Any width: hidden size, LoRA ranks, head dims, MLP widths (largest real: 18432).
    pub const DIM: usize = 1 << 18;
    /// Vocabulary (154880).
    pub const VOCAB: usize = 1 << 24;
    /// Routed experts, groups, experts per token (256).
    pub const EXPERTS: usize = 4096;
    /// Shared experts (1).
    pub const SHARED_EXPERTS: usize = 64;
    /// The indexer's top-k (2048).
    pub const INDEX_TOPK: usize = 1 << 20;
    /// Positions (token positions are 32-bit signed in the kernels).
    pub const POSITIONS: usize = i32::MAX as usize;
}

/// Epsilon of q_a_layernorm and kv_a_layernorm (transformers builds them with the default).
pub const LATENT_NORM_EPS: f32 = 1e-6;
/// Epsilon of the indexer's key LayerNorm.
pub const INDEXER_NORM_EPS: f32 = 1e-6;

impl ModelConfig {
    /// Reads and checks the `config.json` of a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::Model(format!(
                "model directory {} has no config.json",
                dir.display()
            )));
        }
        Self::from_file(&path)
    }

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

        let num_hidden_layers = k.bounded("num_hidden_layers", limits::LAYERS)?;
        let num_attention_heads = k.bounded("num_attention_heads", limits::HEADS)?;
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
        let qk_nope_head_dim = k.bounded("qk_nope_head_dim", limits::DIM)?;
        let qk_rope_head_dim = k.bounded("qk_rope_head_dim", limits::DIM)?;
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
        let index_head_dim = k.bounded("index_head_dim", limits::DIM)?;
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
        let n_group = k.bounded("n_group", limits::EXPERTS)?;
        let topk_group = k.bounded("topk_group", limits::EXPERTS)?;
        let num_experts_per_tok = k.bounded("num_experts_per_tok", limits::EXPERTS)?;
        check_routing(
            &k,
            n_routed_experts,
            n_group,
            topk_group,
            num_experts_per_tok,
        )?;

        let vocab_size = k.bounded("vocab_size", limits::VOCAB)?;
        let kv_lora_rank = k.bounded("kv_lora_rank", limits::DIM)?;
        if kv_lora_rank % 8 != 0 {
            return Err(k.err(
                "kv_lora_rank",
                format!("is {kv_lora_rank}; the cache kernels need a multiple of 8 (GLM-5 and DeepSeek-V3.2 use 512)"),
            ));
        }
        if qk_rope_head_dim % 8 != 0 {
            return Err(k.err(
                "qk_rope_head_dim",
                format!("is {qk_rope_head_dim}; the cache kernels need a multiple of 8 (GLM-5 and DeepSeek-V3.2 use 64)"),
            ));
        }
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size: k.bounded("hidden_size", limits::DIM)?,
            num_hidden_layers,
            num_attention_heads,
            q_lora_rank: k.bounded("q_lora_rank", limits::DIM)?,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim: k.bounded("v_head_dim", limits::DIM)?,
            intermediate_size: k.bounded("intermediate_size", limits::DIM)?,
            moe_intermediate_size: k.bounded("moe_intermediate_size", limits::DIM)?,
            n_routed_experts,
            n_shared_experts: k.at_most(
                "n_shared_experts",
                k.usize("n_shared_experts")?,
                limits::SHARED_EXPERTS,
            )?,
            num_experts_per_tok,
            n_group,
            topk_group,
            routed_scaling_factor: k.f32_of(
                "routed_scaling_factor",
                k.f64("routed_scaling_factor")?,
                false,
            )?,
            norm_topk_prob: k.bool("norm_topk_prob")?,
            index_topk: k.bounded("index_topk", limits::INDEX_TOPK)?,
            index_n_heads: k.bounded("index_n_heads", limits::HEADS)?,
            index_head_dim,
            rms_norm_eps: k.f32_of("rms_norm_eps", positive_f64(&k, "rms_norm_eps")?, true)?,
            rope: rope_config(&k)?,
            mla_rope_style,
            indexer_rope_style,
            mlp_layer_types: mlp_layer_types(&k, num_hidden_layers)?,
            indexer_types: indexer_types(&k, arch, num_hidden_layers)?,
            tie_word_embeddings: k.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            eos_token_ids: eos_token_ids(&k, vocab_size)?,
            max_position_embeddings: k
                .opt_usize("max_position_embeddings")?
                .map(|v| k.at_most("max_position_embeddings", v, limits::POSITIONS))
                .transpose()?,
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

    /// How fp8_ds_mla tile scales are chosen when this model writes its cache (docs/formats.md).
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

mod keys;
mod sections;
#[cfg(test)]
mod tests;
