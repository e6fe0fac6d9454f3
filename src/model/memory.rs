//! The memory a model run needs, counted before anything is loaded: the weights as the
//! device will hold them (checkpoint dtype; f16 widened to f32; FP8 with f32 scales; the
//! absorbed W_UK / W_UV in bf16), the caches for the requested context, and the activations
//! of the largest step. A run that does not fit is refused with the numbers.

use safetensors::Dtype;

use super::cache::CacheOptions;
use super::config::{IndexerKind, ModelConfig};
use super::params::{check_tensor_count, expected_tensors};
use super::weights::{Checkpoint, SCALE_INV_SUFFIX};
use crate::{Error, Result};

/// Bytes of one part of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    pub weights: u64,
    pub caches: u64,
    pub activations: u64,
}

impl MemoryPlan {
    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.caches)
            .saturating_add(self.activations)
    }

    /// Refuses the plan when it needs more than `free` bytes of `what`.
    pub fn check(&self, free: u64, what: &str) -> Result<()> {
        if self.total() > free {
            return Err(Error::Model(format!(
                "the run needs {} of {what} memory (weights {}, caches {}, activations {}) but {} is free; \
                 lower --max-seq-len or use a smaller model",
                gib(self.total()),
                gib(self.weights),
                gib(self.caches),
                gib(self.activations),
                gib(free)
            )));
        }
        Ok(())
    }
}

/// `1.23 GiB` (or MiB below a GiB).
pub fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

fn elem_bytes(d: Dtype) -> u64 {
    match d {
        Dtype::F8_E4M3 => 1,
        Dtype::BF16 => 2,
        // f16 is widened to f32 on the device.
        _ => 4,
    }
}

/// Device bytes of the weights of `c` from the checkpoint's dtypes.
pub fn weight_bytes(c: &ModelConfig, ckpt: &Checkpoint) -> Result<u64> {
    check_tensor_count(c, ckpt)?;
    let mut total = 0u64;
    for s in expected_tensors(c) {
        let n: u64 = s.shape.iter().map(|&d| d as u64).product();
        let Some(meta) = ckpt.meta(&s.name) else {
            continue;
        };
        if s.name.ends_with("kv_b_proj.weight") {
            // W_UKᵀ and W_UV together hold kv_b_proj's elements, in bf16.
            total += n * 2;
            continue;
        }
        if s.shape.len() == 1 {
            total += n * 4;
            continue;
        }
        total += n * elem_bytes(meta.dtype);
        if meta.dtype == Dtype::F8_E4M3 {
            if let Some(sm) = ckpt.meta(&format!("{}{SCALE_INV_SUFFIX}", s.name)) {
                total += sm.shape.iter().map(|&d| d as u64).product::<u64>() * 4;
            }
        }
    }
    Ok(total)
}

/// Cache bytes for `opts` (saturating: a request past `u64` reads as "too much", never wraps).
pub fn cache_bytes(c: &ModelConfig, opts: &CacheOptions) -> u64 {
    let slots = (opts.pages() as u64).saturating_mul(opts.page_size as u64);
    let latent = slots
        .saturating_mul(opts.format.row_bytes(c.mla_dims()) as u64)
        .saturating_mul(c.num_hidden_layers as u64);
    let full = c
        .indexer_types
        .iter()
        .filter(|k| **k == IndexerKind::Full)
        .count() as u64;
    let keys = slots.saturating_mul(c.index_head_dim as u64 * 2 * full);
    let table = (opts.max_seqs as u64)
        .saturating_mul(opts.max_pages_per_seq() as u64)
        .saturating_mul(4);
    let rope = (opts.max_seq_len as u64).saturating_mul(c.qk_rope_head_dim as u64 * 4);
    latent
        .saturating_add(keys)
        .saturating_add(table)
        .saturating_add(rope)
}

/// Host bytes a cache needs while it is built (the RoPE table of `max_seq_len` positions in
/// f32 and as bytes for the upload, and the block table), whatever the device: checked
/// against host memory even when the device cannot say how much memory it has.
pub fn host_staging_bytes(c: &ModelConfig, opts: &CacheOptions) -> u64 {
    let rope = (opts.max_seq_len as u64).saturating_mul(c.qk_rope_head_dim as u64 * 4 * 2);
    let table = (opts.max_seqs as u64)
        .saturating_mul(opts.max_pages_per_seq() as u64)
        .saturating_mul(4 * 2);
    rope.saturating_add(table)
}

/// Activation bytes of a step of `tokens` tokens that see up to `context` positions (an
/// upper bound: every intermediate of one layer alive at once, plus the logits).
pub fn activation_bytes(c: &ModelConfig, tokens: u64, context: u64) -> u64 {
    let h = c.num_attention_heads as u64;
    let lat = c.kv_lora_rank as u64;
    let rope = c.qk_rope_head_dim as u64;
    let per_token = 4
        * (4 * c.hidden_size as u64
            + c.q_lora_rank as u64
            + h * c.qk_head_dim() as u64
            + h * (lat + rope) * 3 / 2
            + h * lat / 2
            + h * c.v_head_dim as u64
            + 2 * (lat + rope)
            + c.index_n_heads as u64 * (c.index_head_dim as u64 + 1)
            + 3 * c
                .intermediate_size
                .max(c.moe_intermediate_size * c.num_experts_per_tok) as u64
            + 2 * c.n_routed_experts as u64
            + 3 * c.index_topk.min(context as usize) as u64
            + c.vocab_size as u64);
    let scores = tokens.saturating_mul(context).saturating_mul(4);
    tokens.saturating_mul(per_token).saturating_add(scores)
}

/// The whole plan.
pub fn plan(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    opts: &CacheOptions,
    max_step_tokens: u64,
) -> Result<MemoryPlan> {
    Ok(MemoryPlan {
        weights: weight_bytes(c, ckpt)?,
        caches: cache_bytes(c, opts),
        activations: activation_bytes(c, max_step_tokens, opts.max_seq_len as u64),
    })
}
