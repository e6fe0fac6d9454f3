//! The tensors a config implies (HF names and shapes), their check against a checkpoint
//! before any compute, and their upload to a backend in the form the forward uses.

use std::collections::HashSet;

use safetensors::Dtype;

use super::config::{IndexerKind, MlpKind, ModelConfig};
use super::device::{Device, Vector, Weight};
use super::shard::plan::{check_cut, cut_bytes, cuts, Cut, ShardSpec};
use super::weights::{plain_to_f32, Checkpoint, SCALE_INV_SUFFIX};
use crate::kernels::view::{WeightLayout, WeightType};
use crate::reference::numerics::bf16_bits;
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

/// How many tensors [`expected_tensors`] lists, counted without building the list.
pub fn expected_tensor_count(c: &ModelConfig) -> usize {
    let mut n = 2 + usize::from(!c.tie_word_embeddings);
    for l in 0..c.num_hidden_layers {
        n += 9;
        if c.indexer_types[l] == IndexerKind::Full {
            n += 5;
        }
        n += match c.mlp_layer_types[l] {
            MlpKind::Dense => 3,
            MlpKind::Moe => 2 + 3 * c.n_routed_experts + 3 * usize::from(c.n_shared_experts > 0),
        };
    }
    n
}

/// Refuses a config that implies more tensors than the checkpoint holds, before the list of
/// expected tensors is built (a config claiming 10⁹ layers must fail here, at once, not after
/// allocating names for all of them).
pub fn check_tensor_count(c: &ModelConfig, ckpt: &Checkpoint) -> Result<()> {
    let want = expected_tensor_count(c);
    let have = ckpt.len();
    if want > have && want <= 2 * have + 64 {
        // Close to the checkpoint's size (a tensor or a layer missing): building the list
        // costs no more than the checkpoint itself, and its first miss is the better message.
        for s in expected_tensors(c) {
            ckpt.check(&s.name, &s.shape)?;
        }
    }
    if want > have {
        return Err(Error::Model(format!(
            "config.json implies {want} weight tensors ({} layers, {} routed experts per MoE layer) \
             but the checkpoint holds only {have}: num_hidden_layers or n_routed_experts does not \
             match the weights",
            c.num_hidden_layers, c.n_routed_experts
        )));
    }
    Ok(())
}

/// Checks presence, dtype and shape of every expected tensor (first mismatch is the error)
/// and lists the extra ones at debug level.
pub fn check_checkpoint(c: &ModelConfig, ckpt: &Checkpoint) -> Result<Vec<TensorSpec>> {
    check_tensor_count(c, ckpt)?;
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
pub struct AttentionWeights {
    pub q_a: Weight,
    pub q_a_norm: Vector,
    pub q_b: Weight,
    pub kv_a: Weight,
    pub kv_a_norm: Vector,
    /// W_UKᵀ per head, bf16 `[heads · kv_lora, qk_nope]`: `q_lat_h = W_UK_hᵀ q_nope_h`.
    pub w_uk_t: Weight,
    /// W_UV per head, bf16 `[heads · v_head, kv_lora]`: `o_h = W_UV_h out_h`.
    pub w_uv: Weight,
    pub o_proj: Weight,
}

pub struct IndexerWeights {
    pub wq_b: Weight,
    pub wk: Weight,
    pub k_norm_w: Vector,
    pub k_norm_b: Vector,
    pub weights_proj: Weight,
}

/// A SwiGLU MLP with gate and up stacked into one `[2 · inter, hidden]` weight (two groups):
/// `down(silu(x · gateᵀ) ⊙ (x · upᵀ))`.
pub struct Mlp {
    pub gate_up: Weight,
    pub down: Weight,
    pub inter: u32,
}

#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum MlpWeights {
    Dense(Mlp),
    Moe {
        router: Weight,
        bias: Vector,
        /// The routed experts' gate and up: `[experts · 2 · inter, hidden]`, groups of `inter`.
        experts_gate_up: Weight,
        /// The routed experts' down: `[experts · hidden, inter]`, groups of `hidden`.
        experts_down: Weight,
        /// Routed experts held: all of them, or (expert parallelism) the `experts` from
        /// global id `expert_base` on.
        experts: u32,
        expert_base: u32,
        inter: u32,
        shared: Option<Mlp>,
    },
}

pub struct LayerWeights {
    pub input_norm: Vector,
    pub post_norm: Vector,
    pub attn: AttentionWeights,
    pub indexer: Option<IndexerWeights>,
    pub mlp: MlpWeights,
}

pub struct ModelWeights {
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    pub norm: Vector,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Weight>,
}

impl ModelWeights {
    /// Device bytes of every weight (scales included).
    pub fn bytes(&self) -> u64 {
        let mlp = |m: &Mlp| m.gate_up.bytes() + m.down.bytes();
        let mut total = self.embed.bytes() + self.lm_head.as_ref().map(|w| w.bytes()).unwrap_or(0);
        for l in &self.layers {
            let a = &l.attn;
            total += a.q_a.bytes() + a.q_b.bytes() + a.kv_a.bytes() + a.w_uk_t.bytes();
            total += a.w_uv.bytes() + a.o_proj.bytes();
            if let Some(i) = &l.indexer {
                total += i.wq_b.bytes() + i.wk.bytes() + i.weights_proj.bytes();
            }
            total += match &l.mlp {
                MlpWeights::Dense(m) => mlp(m),
                MlpWeights::Moe {
                    router,
                    experts_gate_up,
                    experts_down,
                    shared,
                    ..
                } => {
                    router.bytes()
                        + experts_gate_up.bytes()
                        + experts_down.bytes()
                        + shared.as_ref().map(mlp).unwrap_or(0)
                }
            };
        }
        total
    }
}

/// How a checkpoint tensor is stored on the device.
fn weight_type(ckpt: &Checkpoint, name: &str, dtype: Dtype) -> Result<WeightType> {
    Ok(match dtype {
        Dtype::BF16 => WeightType::Bf16,
        // f16 has no kernel of its own: widened to f32 (exact).
        Dtype::F32 | Dtype::F16 => WeightType::F32,
        Dtype::F8_E4M3 => {
            let b = ckpt.fp8_block(name)?;
            let block = [
                u32_of(b[0], "weight_block_size")?,
                u32_of(b[1], "weight_block_size")?,
            ];
            WeightType::Fp8 { block }
        }
        other => {
            return Err(Error::Model(format!(
                "tensor `{name}`: dtype {other:?} is not a weight dtype (BF16, F16, F32, F8_E4M3)"
            )))
        }
    })
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::Model(format!("{what} {v} does not fit the kernels' 32-bit sizes")))
}

/// Reads checkpoint tensors and puts them on the device in their dtype; `progress(done,
/// total)` after each tensor.
struct Uploader<'a> {
    device: &'a Device,
    ckpt: &'a Checkpoint,
    spec: ShardSpec,
    /// The tensors split by rows or columns, with this rank's part (absent: whole).
    cuts: std::collections::HashMap<String, Cut>,
    done: usize,
    total: usize,
    bytes: u64,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl Uploader<'_> {
    fn tick(&mut self, bytes: u64) {
        self.done += 1;
        self.bytes += bytes;
        (self.progress)(self.done, self.total);
    }

    /// The bytes of this rank's part of tensor `name` (`[rows, cols]`) as the device stores
    /// them (f16 widened to f32), and the f32 bytes of the part's FP8 scales.
    fn device_bytes(
        &self,
        name: &str,
        wtype: WeightType,
        shape: [usize; 2],
        cut: Cut,
    ) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
        let (dtype, _, data) = self.ckpt.raw(name)?;
        let values = match (dtype, wtype) {
            (Dtype::F16, _) => cut_bytes(
                &f32_bytes(&plain_to_f32(dtype, data).unwrap_or_default()),
                4,
                shape,
                cut,
            ),
            _ => cut_bytes(data, dtype.bitsize() / 8, shape, cut),
        };
        let scales = match wtype {
            WeightType::Fp8 { block } => {
                let s = self.ckpt.read_f32(&format!("{name}{SCALE_INV_SUFFIX}"))?;
                let block = [block[0] as usize, block[1] as usize];
                check_cut(name, shape, cut, block, self.spec)?;
                let grid = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
                Some(cut_bytes(&f32_bytes(&s), 4, grid, cut.in_blocks(block)))
            }
            _ => None,
        };
        Ok((values, scales))
    }

    /// A 2-D weight as stored (this rank's part of it).
    fn weight(&mut self, name: &str) -> Result<Weight> {
        self.stacked(&[name.to_string()])
    }

    /// Several `[rows, cols]` tensors of one dtype stacked along the rows into one weight
    /// (groups of `rows`, or of this rank's part of them; FP8 block grids restart per group).
    fn stacked(&mut self, names: &[String]) -> Result<Weight> {
        let first = &names[0];
        let (dtype, shape, _) = self.ckpt.raw(first)?;
        let full = match shape.as_slice() {
            [r, c] => [*r, *c],
            other => {
                return Err(Error::Model(format!(
                    "tensor `{first}`: expected a 2-D weight, found shape {other:?}"
                )))
            }
        };
        let cut = self.cuts.get(first).copied().unwrap_or(Cut::Whole);
        let [rows, cols] = cut.shape(full);
        let wtype = weight_type(self.ckpt, first, dtype)?;
        let layout = WeightLayout::stacked(
            wtype,
            u32_of(names.len(), "stacked tensors")?,
            u32_of(rows, first)?,
            u32_of(cols, first)?,
        );
        layout
            .validate(first)
            .map_err(|e| Error::Model(format!("tensor `{first}`: {e}")))?;
        let values = self.device.backend().alloc(layout.bytes())?;
        let scales = match layout.scale_bytes() {
            0 => None,
            n => Some(self.device.backend().alloc(n)?),
        };
        let per_values = layout.bytes() / names.len() as u64;
        let per_scales = layout.scale_bytes() / names.len() as u64;
        for (g, name) in names.iter().enumerate() {
            let (d, s, _) = self.ckpt.raw(name)?;
            let name_cut = self.cuts.get(name).copied().unwrap_or(Cut::Whole);
            if d != dtype || s != shape || name_cut != cut {
                return Err(Error::Model(format!(
                    "tensor `{name}` is {d:?} {s:?}, but `{first}`, stacked with it, is {dtype:?} {shape:?}"
                )));
            }
            let (v, sc) = self.device_bytes(name, wtype, full, cut)?;
            self.device
                .backend()
                .write_at(&values, g as u64 * per_values, &v)?;
            if let (Some(buf), Some(sc)) = (&scales, sc) {
                self.device
                    .backend()
                    .write_at(buf, g as u64 * per_scales, &sc)?;
            }
            self.tick(v.len() as u64);
        }
        Ok(Weight {
            layout,
            values,
            scales,
        })
    }

    /// A 1-D parameter as f32.
    fn vector(&mut self, name: &str) -> Result<Vector> {
        let v = self.ckpt.read_f32(name)?;
        let buf = self.device.backend().upload(&f32_bytes(&v))?;
        self.tick(v.len() as u64 * 4);
        Ok(Vector {
            len: u32_of(v.len(), name)?,
            buf,
        })
    }

    /// A bf16 weight built on the host (the absorbed W_UK / W_UV).
    fn host_bf16(&mut self, rows: usize, cols: usize, values: &[f32]) -> Result<Weight> {
        let layout = WeightLayout::new(
            WeightType::Bf16,
            u32_of(rows, "rows")?,
            u32_of(cols, "cols")?,
        );
        layout.validate("absorbed attention weight")?;
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| bf16_bits(*v).to_le_bytes())
            .collect();
        Ok(Weight {
            layout,
            values: self.device.backend().upload(&bytes)?,
            scales: None,
        })
    }

    fn mlp(&mut self, prefix: &str) -> Result<Mlp> {
        let gate_up = self.stacked(&[
            format!("{prefix}.gate_proj.weight"),
            format!("{prefix}.up_proj.weight"),
        ])?;
        let inter = gate_up.layout.group_rows;
        Ok(Mlp {
            gate_up,
            down: self.weight(&format!("{prefix}.down_proj.weight"))?,
            inter,
        })
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Puts every weight on the device (the checkpoint must have passed [`check_checkpoint`]).
/// Matrices keep their checkpoint dtype (bf16, f32, block-scaled FP8; f16 is widened to f32);
/// 1-D parameters become f32; kv_b_proj becomes the absorbed W_UKᵀ and W_UV in bf16 (from an
/// FP8 kv_b_proj: dequantised, then rounded, as vLLM does for its absorbed MLA). Returns the
/// weights and the bytes read.
pub fn upload_weights(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    device: &Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(ModelWeights, u64)> {
    upload_shard(c, ckpt, device, ShardSpec::WHOLE, true, progress)
}

/// Tensors [`upload_shard`] reads for rank `spec` (every tensor but the other ranks' routed
/// experts, and lm_head unless `with_head`).
pub fn shard_tensor_count(c: &ModelConfig, spec: ShardSpec, with_head: bool) -> usize {
    let moe = c
        .mlp_layer_types
        .iter()
        .filter(|&&k| k == MlpKind::Moe)
        .count();
    let others = c.n_routed_experts - spec.part(c.n_routed_experts).1;
    expected_tensor_count(c) - 3 * others * moe - usize::from(!with_head && !c.tie_word_embeddings)
}

/// [`upload_weights`] for rank `spec` of a sharded model (docs/sharding.md): each tensor's
/// part is read from the checkpoint (memory-mapped) and written straight to `device`, so no
/// device holds more than its shard. `with_head`: whether this rank holds lm_head (only the
/// rank that computes the logits needs it; without it the weights' `lm_head` is `None` and
/// the rank must not compute logits). The config is the whole model's, checked by
/// [`super::shard::plan::check_tp`].
pub fn upload_shard(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    device: &Device,
    spec: ShardSpec,
    with_head: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(ModelWeights, u64)> {
    let total = shard_tensor_count(c, spec, with_head);
    let mut up = Uploader {
        device,
        ckpt,
        spec,
        cuts: cuts(c, spec),
        done: 0,
        total,
        bytes: 0,
        progress,
    };
    let embed = up.weight("model.embed_tokens.weight")?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    let (h0, heads) = spec.part(c.num_attention_heads);
    let (nope, v, lat) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let input_norm = up.vector(&format!("{p}.input_layernorm.weight"))?;
        let post_norm = up.vector(&format!("{p}.post_attention_layernorm.weight"))?;
        // kv_b_proj is [heads · (nope + v), latent]: head h's rows are [W_UK_h (nope) | W_UV_h (v)].
        // Read whole on the host; only this rank's heads go to the device.
        let kv_b_name = format!("{a}.kv_b_proj.weight");
        let kv_b = ckpt.read_f32(&kv_b_name)?;
        up.tick((heads * (nope + v) * lat) as u64 * 2);
        let mut w_uk_t = Vec::with_capacity(heads * lat * nope);
        let mut w_uv = Vec::with_capacity(heads * v * lat);
        for h in h0..h0 + heads {
            let base = h * (nope + v);
            for j in 0..lat {
                w_uk_t.extend((0..nope).map(|i| kv_b[(base + i) * lat + j]));
            }
            w_uv.extend_from_slice(&kv_b[(base + nope) * lat..(base + nope + v) * lat]);
        }
        let attn = AttentionWeights {
            q_a: up.weight(&format!("{a}.q_a_proj.weight"))?,
            q_a_norm: up.vector(&format!("{a}.q_a_layernorm.weight"))?,
            q_b: up.weight(&format!("{a}.q_b_proj.weight"))?,
            kv_a: up.weight(&format!("{a}.kv_a_proj_with_mqa.weight"))?,
            kv_a_norm: up.vector(&format!("{a}.kv_a_layernorm.weight"))?,
            w_uk_t: up.host_bf16(heads * lat, nope, &w_uk_t)?,
            w_uv: up.host_bf16(heads * v, lat, &w_uv)?,
            o_proj: up.weight(&format!("{a}.o_proj.weight"))?,
        };
        let indexer = match c.indexer_types[l] {
            IndexerKind::Full => {
                let i = format!("{a}.indexer");
                Some(IndexerWeights {
                    wq_b: up.weight(&format!("{i}.wq_b.weight"))?,
                    wk: up.weight(&format!("{i}.wk.weight"))?,
                    k_norm_w: up.vector(&format!("{i}.k_norm.weight"))?,
                    k_norm_b: up.vector(&format!("{i}.k_norm.bias"))?,
                    weights_proj: up.weight(&format!("{i}.weights_proj.weight"))?,
                })
            }
            IndexerKind::Shared => None,
        };
        let m = format!("{p}.mlp");
        let mlp = match c.mlp_layer_types[l] {
            MlpKind::Dense => MlpWeights::Dense(up.mlp(&m)?),
            MlpKind::Moe => {
                let router = up.weight(&format!("{m}.gate.weight"))?;
                let bias = up.vector(&format!("{m}.gate.e_score_correction_bias"))?;
                let (e0, e_n) = spec.part(c.n_routed_experts);
                let gate_up: Vec<String> = (e0..e0 + e_n)
                    .flat_map(|e| {
                        [
                            format!("{m}.experts.{e}.gate_proj.weight"),
                            format!("{m}.experts.{e}.up_proj.weight"),
                        ]
                    })
                    .collect();
                let down: Vec<String> = (e0..e0 + e_n)
                    .map(|e| format!("{m}.experts.{e}.down_proj.weight"))
                    .collect();
                let experts_gate_up = up.stacked(&gate_up)?;
                let experts_down = up.stacked(&down)?;
                let shared = if c.n_shared_experts > 0 {
                    Some(up.mlp(&format!("{m}.shared_experts"))?)
                } else {
                    None
                };
                MlpWeights::Moe {
                    router,
                    bias,
                    inter: experts_gate_up.layout.group_rows,
                    experts_gate_up,
                    experts_down,
                    experts: u32_of(e_n, "n_routed_experts")?,
                    expert_base: u32_of(e0, "n_routed_experts")?,
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
    let norm = up.vector("model.norm.weight")?;
    let lm_head = if c.tie_word_embeddings || !with_head {
        None
    } else {
        Some(up.weight("lm_head.weight")?)
    };
    let bytes = up.bytes;
    Ok((
        ModelWeights {
            embed,
            layers,
            norm,
            lm_head,
        },
        bytes,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::CpuBackend;

    /// A [256, 384] FP8 weight in 128 × 128 blocks (a distinct scale per block, distinct bytes
    /// per element), loaded through a shard's cut: the rank gets exactly its rows or columns
    /// and the scales of its blocks; a cut inside a block is refused naming --tp.
    #[test]
    fn fp8_shards_take_their_blocks() {
        let dir = std::env::temp_dir().join(format!("sparse-mla-fp8-cut-{}", std::process::id()));
        let (rows, cols) = (256usize, 384usize);
        let q: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8 & 0x7e).collect();
        let scales: Vec<f32> = (0..6).map(|i| 0.5 + i as f32).collect();
        let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        super::super::weights::write_checkpoint(
            &dir,
            &[
                ("w".into(), Dtype::F8_E4M3, vec![rows, cols], q.clone()),
                ("w_scale_inv".into(), Dtype::F32, vec![2, 3], f32b(&scales)),
            ],
            1,
        )
        .unwrap();
        let ckpt = Checkpoint::open(&dir, Some([128, 128])).unwrap();
        let device = Device::new(std::sync::Arc::new(CpuBackend::new()));
        let spec = ShardSpec { rank: 1, world: 2 };
        let mut progress = |_: usize, _: usize| {};
        let mut load = |cut: Cut| {
            let mut up = Uploader {
                device: &device,
                ckpt: &ckpt,
                spec,
                cuts: [("w".to_string(), cut)].into_iter().collect(),
                done: 0,
                total: 1,
                bytes: 0,
                progress: &mut progress,
            };
            up.weight("w").map(|w| {
                let b = device.backend();
                let s = w.scales.as_ref().map(|s| b.download(s).unwrap());
                (w.layout, b.download(&w.values).unwrap(), s.unwrap())
            })
        };
        // Columns 128..384 (blocks 1 and 2 of each block row).
        let (layout, v, s) = load(Cut::Cols(128, 256)).unwrap();
        assert_eq!((layout.rows, layout.cols), (256, 256));
        let want: Vec<u8> = (0..rows)
            .flat_map(|r| q[r * cols + 128..r * cols + 384].to_vec())
            .collect();
        assert_eq!(v, want);
        assert_eq!(s, f32b(&[1.5, 2.5, 4.5, 5.5]));
        // Rows 128..256 (the second block row).
        let (layout, v, s) = load(Cut::Rows(128, 128)).unwrap();
        assert_eq!((layout.rows, layout.cols), (128, 384));
        assert_eq!(v, q[128 * cols..].to_vec());
        assert_eq!(s, f32b(&[3.5, 4.5, 5.5]));
        // Columns 192..384 start inside block 1.
        let e = load(Cut::Cols(192, 192)).err().unwrap().to_string();
        assert!(e.contains("--tp") && e.contains("cut a block"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
