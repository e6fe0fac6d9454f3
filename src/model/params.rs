//! The tensors a config implies (HF names and shapes), their check against a checkpoint
//! before any compute, and their upload to a backend in the form the forward uses.

use std::collections::HashSet;

use super::backend::{Mlp, ModelBackend};
use super::config::{IndexerKind, MlpKind, ModelConfig};
use super::weights::Checkpoint;
use crate::{Error, Result};

/// One expected tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

fn spec(name: String, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name,
        shape: shape.to_vec(),
    }
}

/// Every tensor the forward pass reads, in load order.
pub fn expected_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let h = c.hidden_size;
    let heads = c.num_attention_heads;
    let mut v = vec![spec("model.embed_tokens.weight".into(), &[c.vocab_size, h])];
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        v.push(spec(format!("{p}.input_layernorm.weight"), &[h]));
        v.push(spec(format!("{p}.post_attention_layernorm.weight"), &[h]));
        v.push(spec(format!("{a}.q_a_proj.weight"), &[c.q_lora_rank, h]));
        v.push(spec(format!("{a}.q_a_layernorm.weight"), &[c.q_lora_rank]));
        v.push(spec(
            format!("{a}.q_b_proj.weight"),
            &[heads * c.qk_head_dim(), c.q_lora_rank],
        ));
        v.push(spec(
            format!("{a}.kv_a_proj_with_mqa.weight"),
            &[c.kv_lora_rank + c.qk_rope_head_dim, h],
        ));
        v.push(spec(
            format!("{a}.kv_a_layernorm.weight"),
            &[c.kv_lora_rank],
        ));
        v.push(spec(
            format!("{a}.kv_b_proj.weight"),
            &[heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank],
        ));
        v.push(spec(
            format!("{a}.o_proj.weight"),
            &[h, heads * c.v_head_dim],
        ));
        if c.indexer_types[l] == IndexerKind::Full {
            let i = format!("{a}.indexer");
            v.push(spec(
                format!("{i}.wq_b.weight"),
                &[c.index_n_heads * c.index_head_dim, c.q_lora_rank],
            ));
            v.push(spec(format!("{i}.wk.weight"), &[c.index_head_dim, h]));
            v.push(spec(format!("{i}.k_norm.weight"), &[c.index_head_dim]));
            v.push(spec(format!("{i}.k_norm.bias"), &[c.index_head_dim]));
            v.push(spec(
                format!("{i}.weights_proj.weight"),
                &[c.index_n_heads, h],
            ));
        }
        let m = format!("{p}.mlp");
        match c.mlp_layer_types[l] {
            MlpKind::Dense => {
                v.push(spec(
                    format!("{m}.gate_proj.weight"),
                    &[c.intermediate_size, h],
                ));
                v.push(spec(
                    format!("{m}.up_proj.weight"),
                    &[c.intermediate_size, h],
                ));
                v.push(spec(
                    format!("{m}.down_proj.weight"),
                    &[h, c.intermediate_size],
                ));
            }
            MlpKind::Moe => {
                v.push(spec(format!("{m}.gate.weight"), &[c.n_routed_experts, h]));
                v.push(spec(
                    format!("{m}.gate.e_score_correction_bias"),
                    &[c.n_routed_experts],
                ));
                let mi = c.moe_intermediate_size;
                for e in 0..c.n_routed_experts {
                    v.push(spec(format!("{m}.experts.{e}.gate_proj.weight"), &[mi, h]));
                    v.push(spec(format!("{m}.experts.{e}.up_proj.weight"), &[mi, h]));
                    v.push(spec(format!("{m}.experts.{e}.down_proj.weight"), &[h, mi]));
                }
                if c.n_shared_experts > 0 {
                    let si = mi * c.n_shared_experts;
                    v.push(spec(
                        format!("{m}.shared_experts.gate_proj.weight"),
                        &[si, h],
                    ));
                    v.push(spec(format!("{m}.shared_experts.up_proj.weight"), &[si, h]));
                    v.push(spec(
                        format!("{m}.shared_experts.down_proj.weight"),
                        &[h, si],
                    ));
                }
            }
        }
    }
    v.push(spec("model.norm.weight".into(), &[h]));
    if !c.tie_word_embeddings {
        v.push(spec("lm_head.weight".into(), &[c.vocab_size, h]));
    }
    v
}

/// Checks presence, dtype and shape of every expected tensor (first mismatch is the error)
/// and lists the extra ones at debug level.
pub fn check_checkpoint(c: &ModelConfig, ckpt: &Checkpoint) -> Result<Vec<TensorSpec>> {
    let specs = expected_tensors(c);
    for s in &specs {
        ckpt.check(&s.name, &s.shape)?;
    }
    let used: HashSet<String> = specs.iter().map(|s| s.name.clone()).collect();
    let extra = ckpt.unused(&used);
    if !extra.is_empty() {
        log::debug!(
            "{} tensors in the checkpoint are not used by the forward pass (ignored):",
            extra.len()
        );
        for n in &extra {
            log::debug!("  unused tensor {n}");
        }
    }
    Ok(specs)
}

/// Attention weights of one layer, in the absorbed form's layout.
pub struct AttentionWeights<T> {
    pub q_a: T,
    pub q_a_norm: T,
    pub q_b: T,
    pub kv_a: T,
    pub kv_a_norm: T,
    /// W_UKᵀ per head: `[heads · kv_lora, qk_nope]` (q_lat_h = W_UK_hᵀ q_nope_h).
    pub w_uk_t: T,
    /// W_UV per head: `[heads · v_head, kv_lora]` (o_h = W_UV_h out_h).
    pub w_uv: T,
    pub o_proj: T,
}

pub struct IndexerWeights<T> {
    pub wq_b: T,
    pub wk: T,
    pub k_norm_w: T,
    pub k_norm_b: T,
    pub weights_proj: T,
}

pub enum MlpWeights<T> {
    Dense(Mlp<T>),
    Moe {
        router: T,
        bias: T,
        experts: Vec<Mlp<T>>,
        shared: Option<Mlp<T>>,
    },
}

pub struct LayerWeights<T> {
    pub input_norm: T,
    pub post_norm: T,
    pub attn: AttentionWeights<T>,
    pub indexer: Option<IndexerWeights<T>>,
    pub mlp: MlpWeights<T>,
}

pub struct ModelWeights<T> {
    pub embed: T,
    pub layers: Vec<LayerWeights<T>>,
    pub norm: T,
    /// `None` when tied to the embedding.
    pub lm_head: Option<T>,
}

/// Reads tensors from the checkpoint and uploads them; `progress(done, total)` after each.
struct Uploader<'a, B: ModelBackend> {
    backend: &'a B,
    ckpt: &'a Checkpoint,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl<B: ModelBackend> Uploader<'_, B> {
    fn host(&mut self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let data = self.ckpt.read_f32(name)?;
        let shape = self
            .ckpt
            .meta(name)
            .map(|m| m.shape.clone())
            .ok_or_else(|| Error::Model(format!("tensor `{name}` not found")))?;
        self.done += 1;
        (self.progress)(self.done, self.total);
        Ok((data, shape))
    }

    /// A 1-D tensor becomes `[1, n]`, a 2-D one keeps its shape.
    fn get(&mut self, name: &str) -> Result<B::Tensor> {
        let (data, shape) = self.host(name)?;
        let (rows, cols) = match shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            other => {
                return Err(Error::Model(format!(
                    "tensor `{name}`: expected 1-D or 2-D, found {other:?}"
                )))
            }
        };
        self.backend.upload(rows, cols, &data)
    }

    fn mlp(&mut self, prefix: &str) -> Result<Mlp<B::Tensor>> {
        Ok(Mlp {
            gate: self.get(&format!("{prefix}.gate_proj.weight"))?,
            up: self.get(&format!("{prefix}.up_proj.weight"))?,
            down: self.get(&format!("{prefix}.down_proj.weight"))?,
        })
    }
}

/// Uploads every weight (the checkpoint must have passed [`check_checkpoint`]).
pub fn upload_weights<B: ModelBackend>(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    backend: &B,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ModelWeights<B::Tensor>> {
    let total = expected_tensors(c).len();
    let mut up = Uploader {
        backend,
        ckpt,
        done: 0,
        total,
        progress,
    };
    let embed = up.get("model.embed_tokens.weight")?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let heads = c.num_attention_heads;
    let (nope, v, lat) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let input_norm = up.get(&format!("{p}.input_layernorm.weight"))?;
        let post_norm = up.get(&format!("{p}.post_attention_layernorm.weight"))?;
        // kv_b_proj is [heads · (nope + v), latent]: head h's rows are [W_UK_h (nope) | W_UV_h (v)].
        let (kv_b, _) = up.host(&format!("{a}.kv_b_proj.weight"))?;
        let mut w_uk_t = Vec::with_capacity(heads * lat * nope);
        let mut w_uv = Vec::with_capacity(heads * v * lat);
        for h in 0..heads {
            let base = h * (nope + v);
            for j in 0..lat {
                w_uk_t.extend((0..nope).map(|i| kv_b[(base + i) * lat + j]));
            }
            w_uv.extend_from_slice(&kv_b[(base + nope) * lat..(base + nope + v) * lat]);
        }
        let attn = AttentionWeights {
            q_a: up.get(&format!("{a}.q_a_proj.weight"))?,
            q_a_norm: up.get(&format!("{a}.q_a_layernorm.weight"))?,
            q_b: up.get(&format!("{a}.q_b_proj.weight"))?,
            kv_a: up.get(&format!("{a}.kv_a_proj_with_mqa.weight"))?,
            kv_a_norm: up.get(&format!("{a}.kv_a_layernorm.weight"))?,
            w_uk_t: backend.upload(heads * lat, nope, &w_uk_t)?,
            w_uv: backend.upload(heads * v, lat, &w_uv)?,
            o_proj: up.get(&format!("{a}.o_proj.weight"))?,
        };
        let indexer = match c.indexer_types[l] {
            IndexerKind::Full => {
                let i = format!("{a}.indexer");
                Some(IndexerWeights {
                    wq_b: up.get(&format!("{i}.wq_b.weight"))?,
                    wk: up.get(&format!("{i}.wk.weight"))?,
                    k_norm_w: up.get(&format!("{i}.k_norm.weight"))?,
                    k_norm_b: up.get(&format!("{i}.k_norm.bias"))?,
                    weights_proj: up.get(&format!("{i}.weights_proj.weight"))?,
                })
            }
            IndexerKind::Shared => None,
        };
        let m = format!("{p}.mlp");
        let mlp = match c.mlp_layer_types[l] {
            MlpKind::Dense => MlpWeights::Dense(up.mlp(&m)?),
            MlpKind::Moe => {
                let router = up.get(&format!("{m}.gate.weight"))?;
                let bias = up.get(&format!("{m}.gate.e_score_correction_bias"))?;
                let experts = (0..c.n_routed_experts)
                    .map(|e| up.mlp(&format!("{m}.experts.{e}")))
                    .collect::<Result<Vec<_>>>()?;
                let shared = if c.n_shared_experts > 0 {
                    Some(up.mlp(&format!("{m}.shared_experts"))?)
                } else {
                    None
                };
                MlpWeights::Moe {
                    router,
                    bias,
                    experts,
                    shared,
                }
            }
        };
        layers.push(LayerWeights {
            input_norm,
            post_norm,
            attn,
            indexer,
            mlp,
        });
    }
    let norm = up.get("model.norm.weight")?;
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(up.get("lm_head.weight")?)
    };
    Ok(ModelWeights {
        embed,
        layers,
        norm,
        lm_head,
    })
}
