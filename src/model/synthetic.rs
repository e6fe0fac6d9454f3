//! GLM-5- and DeepSeek-V3.2-shaped models at true width with random weights made on the
//! device (no checkpoint, no upload): what the decode benchmark runs, a few layers of the
//! real thing. Weights are bf16 or block-scaled FP8 (e4m3 + f32 scales per 128 × 128, as the
//! FP8 releases ship; the embedding, lm_head and router stay bf16, as there), scaled so that
//! activations stay finite through the layers.

use super::config::{
    Arch, Fp8Blocks, IndexerKind, MlpKind, ModelConfig, RopeConfig, RopeScaling, RopeStyle,
};
use super::device::{Device, Vector, Weight};
use super::params::{
    AttentionWeights, IndexerWeights, LayerWeights, Mlp, MlpWeights, ModelWeights,
};
use super::Model;
use crate::kernels::fill::{FillMode, FillOp};
use crate::kernels::view::{WeightLayout, WeightType};
use crate::runtime::Backend;
use crate::{Error, Result};
use std::sync::Arc;

/// Which published model the shape follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// GLM-5: hidden 6144, 64 heads, q_lora 2048, nope 192, v 256, 256 experts of 2048,
    /// dense 12288, indexer 32 × 128, vocab 154880.
    Glm5,
    /// DeepSeek-V3.2: hidden 7168, 128 heads, q_lora 1536, nope 128, v 128, 256 experts of
    /// 2048 in 8 groups, dense 18432, indexer 64 × 128, vocab 129280.
    DeepseekV32,
}

impl Shape {
    pub fn name(&self) -> &'static str {
        match self {
            Shape::Glm5 => "glm5",
            Shape::DeepseekV32 => "deepseek-v32",
        }
    }

    /// Layers of the whole published model: (dense, MoE).
    pub fn full_layers(&self) -> (usize, usize) {
        match self {
            Shape::Glm5 => (3, 75),
            Shape::DeepseekV32 => (3, 58),
        }
    }
}

/// The config of `dense` dense layers followed by `moe` MoE layers of `shape`.
pub fn config(shape: Shape, dense: usize, moe: usize, fp8: bool) -> ModelConfig {
    let layers = dense + moe;
    let mut mlp = vec![MlpKind::Dense; dense];
    mlp.extend(std::iter::repeat_n(MlpKind::Moe, moe));
    let common = |arch,
                  hidden,
                  heads,
                  q_lora,
                  nope,
                  v,
                  inter,
                  n_group,
                  topk_group,
                  idx_heads,
                  vocab,
                  eps,
                  rope,
                  idx_style| ModelConfig {
        arch,
        vocab_size: vocab,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        q_lora_rank: q_lora,
        kv_lora_rank: 512,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: 64,
        v_head_dim: v,
        intermediate_size: inter,
        moe_intermediate_size: 2048,
        n_routed_experts: 256,
        n_shared_experts: 1,
        num_experts_per_tok: 8,
        n_group,
        topk_group,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        index_topk: 2048,
        index_n_heads: idx_heads,
        index_head_dim: 128,
        rms_norm_eps: eps,
        rope,
        mla_rope_style: RopeStyle::Interleaved,
        indexer_rope_style: idx_style,
        mlp_layer_types: mlp.clone(),
        indexer_types: vec![IndexerKind::Full; layers],
        tie_word_embeddings: false,
        eos_token_ids: Vec::new(),
        max_position_embeddings: Some(202_752),
        fp8: fp8.then_some(Fp8Blocks { block: [128, 128] }),
    };
    match shape {
        Shape::Glm5 => common(
            Arch::Glm5,
            6144,
            64,
            2048,
            192,
            256,
            12288,
            1,
            1,
            32,
            154_880,
            1e-5,
            RopeConfig {
                theta: 1e6,
                scaling: RopeScaling::Default,
            },
            RopeStyle::Interleaved,
        ),
        Shape::DeepseekV32 => common(
            Arch::DeepseekV32,
            7168,
            128,
            1536,
            128,
            128,
            18432,
            8,
            4,
            64,
            129_280,
            1e-6,
            RopeConfig {
                theta: 1e4,
                scaling: RopeScaling::Yarn {
                    factor: 40.0,
                    original_max_position_embeddings: 4096.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: Some(1.0),
                    mscale_all_dim: Some(1.0),
                    attention_factor: None,
                    truncate: true,
                },
            },
            RopeStyle::HalfSplit,
        ),
    }
}

struct Maker<'a> {
    device: &'a Device,
    seed: u32,
    fp8: bool,
}

impl Maker<'_> {
    fn next_seed(&mut self) -> u32 {
        self.seed = self.seed.wrapping_mul(0x0100_0193).wrapping_add(0x9e37);
        self.seed
    }

    fn fill(&mut self, buf: &crate::runtime::Buffer, mode: FillMode) -> Result<()> {
        let words = u32::try_from(buf.len() / 4)
            .map_err(|_| Error::arg("weight", "at most 2^32 words", buf.len()))?;
        let seed = self.next_seed();
        self.device
            .run_op(&FillOp { words, mode, seed }, &[("dst", buf)])
    }

    /// A `[groups · rows, cols]` weight (groups of `rows`), FP8 when asked and `quantized`.
    fn weight(&mut self, groups: u32, rows: u32, cols: u32, quantized: bool) -> Result<Weight> {
        let fp8 = self.fp8 && quantized;
        let wtype = if fp8 {
            WeightType::Fp8 { block: [128, 128] }
        } else {
            WeightType::Bf16
        };
        let layout = WeightLayout::stacked(wtype, groups, rows, cols);
        layout.validate("synthetic weight")?;
        let values = self.device.backend().alloc(layout.bytes())?;
        // Unit-variance activations in, about unit variance out.
        let k = (cols as f32).sqrt();
        let scales = if fp8 {
            self.fill(&values, FillMode::E4m3)?;
            let s = self.device.backend().alloc(layout.scale_bytes())?;
            // The e4m3 fill has an rms of about 1.13.
            let c = 1.0 / (1.13 * k);
            self.fill(
                &s,
                FillMode::F32 {
                    lo: 0.75 * c,
                    hi: 1.25 * c,
                },
            )?;
            Some(s)
        } else {
            self.fill(
                &values,
                FillMode::Bf16 {
                    scale: 3f32.sqrt() / k,
                },
            )?;
            None
        };
        Ok(Weight {
            layout,
            values,
            scales,
        })
    }

    fn vector(&mut self, len: usize, lo: f32, hi: f32) -> Result<Vector> {
        let buf = self.device.backend().alloc(len as u64 * 4)?;
        self.fill(&buf, FillMode::F32 { lo, hi })?;
        Ok(Vector {
            len: len as u32,
            buf,
        })
    }

    fn mlp(&mut self, hidden: u32, inter: u32) -> Result<Mlp> {
        Ok(Mlp {
            gate_up: self.weight(2, inter, hidden, true)?,
            down: self.weight(1, hidden, inter, true)?,
            inter,
        })
    }
}

/// A model of `dense` + `moe` layers of `shape` with random weights on `backend`.
pub fn build(
    shape: Shape,
    dense: usize,
    moe: usize,
    fp8: bool,
    backend: Arc<dyn Backend>,
    seed: u32,
) -> Result<Model> {
    let c = config(shape, dense, moe, fp8);
    let device = Device::new(backend);
    let mut m = Maker {
        device: &device,
        seed,
        fp8,
    };
    let u = |v: usize| v as u32;
    let (h, heads, lat) = (
        u(c.hidden_size),
        u(c.num_attention_heads),
        u(c.kv_lora_rank),
    );
    let embed = m.weight(1, u(c.vocab_size), h, false)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let attn = AttentionWeights {
            q_a: m.weight(1, u(c.q_lora_rank), h, true)?,
            q_a_norm: m.vector(c.q_lora_rank, 0.9, 1.1)?,
            q_b: m.weight(1, heads * u(c.qk_head_dim()), u(c.q_lora_rank), true)?,
            kv_a: m.weight(1, lat + u(c.qk_rope_head_dim), h, true)?,
            kv_a_norm: m.vector(c.kv_lora_rank, 0.9, 1.1)?,
            w_uk_t: m.weight(1, heads * lat, u(c.qk_nope_head_dim), false)?,
            w_uv: m.weight(1, heads * u(c.v_head_dim), lat, false)?,
            o_proj: m.weight(1, h, heads * u(c.v_head_dim), true)?,
        };
        let indexer = Some(IndexerWeights {
            wq_b: m.weight(
                1,
                u(c.index_n_heads * c.index_head_dim),
                u(c.q_lora_rank),
                true,
            )?,
            wk: m.weight(1, u(c.index_head_dim), h, true)?,
            k_norm_w: m.vector(c.index_head_dim, 0.9, 1.1)?,
            k_norm_b: m.vector(c.index_head_dim, -0.1, 0.1)?,
            weights_proj: m.weight(1, u(c.index_n_heads), h, false)?,
        });
        let mlp = match c.mlp_layer_types[l] {
            MlpKind::Dense => MlpWeights::Dense(m.mlp(h, u(c.intermediate_size))?),
            MlpKind::Moe => {
                let e = u(c.n_routed_experts);
                let inter = u(c.moe_intermediate_size);
                MlpWeights::Moe {
                    router: m.weight(1, e, h, false)?,
                    bias: m.vector(c.n_routed_experts, -0.01, 0.01)?,
                    experts_gate_up: m.weight(2 * e, inter, h, true)?,
                    experts_down: m.weight(e, h, inter, true)?,
                    experts: e,
                    expert_base: 0,
                    inter,
                    shared: Some(m.mlp(h, inter * u(c.n_shared_experts))?),
                }
            }
        };
        layers.push(LayerWeights {
            input_norm: m.vector(c.hidden_size, 0.9, 1.1)?,
            post_norm: m.vector(c.hidden_size, 0.9, 1.1)?,
            attn,
            indexer,
            mlp,
        });
    }
    let weights = ModelWeights {
        embed,
        layers,
        norm: m.vector(c.hidden_size, 0.9, 1.1)?,
        lm_head: Some(m.weight(1, u(c.vocab_size), h, false)?),
    };
    device.backend().synchronize()?;
    Ok(Model::from_parts(c, device, weights))
}
