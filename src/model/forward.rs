//! The GLM-5 / DeepSeek-V3.2 forward pass, written once against [`ModelBackend`].
//!
//! Per layer (absorbed MLA, DESIGN §6):
//! ```text
//! x = rmsnorm(h)
//! q_resid = rmsnorm(q_a(x)); q = q_b(q_resid) → per head [nope | rope]; RoPE(q_rope)
//! [c | k_rope] = kv_a(x); c = rmsnorm(c); RoPE(k_rope); cache[slot] = [c | k_rope]
//! q_lat = W_UKᵀ q_nope (per head); out = sparse_mla([q_lat | q_rope], cache, top-k slots)
//! h += o_proj(W_UV out)
//! h += mlp(rmsnorm(h))            (dense SwiGLU, or routed experts + shared expert)
//! ```
//! The top-k slots come from the layer's lightning indexer (its own key cache) or, on a
//! GLM "shared" layer, from the nearest earlier full layer. While a sequence holds no more
//! than `index_topk` positions every position is selected, so sparse equals dense there.
//!
//! A prefill of T tokens is T query tokens in one call, each with its own causal top-k.

use std::path::Path;

use super::backend::{BlockTableRef, CacheLayout, IndexerCall, MlaCall, ModelBackend, Routing};
use super::config::{ModelConfig, INDEXER_NORM_EPS, LATENT_NORM_EPS};
use super::params::{check_checkpoint, upload_weights, LayerWeights, MlpWeights, ModelWeights};
use super::rope::RopeTable;
use super::weights::Checkpoint;
use crate::mla::CacheFormat;
use crate::{Error, Result};

/// How a sequence's caches are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    pub format: CacheFormat,
    /// Tokens per page.
    pub page_size: usize,
    /// Positions the sequence may hold (prompt + generated).
    pub max_seq_len: usize,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            format: CacheFormat::Bf16,
            page_size: 64,
            max_seq_len: 4096,
        }
    }
}

/// One sequence's state: per-layer latent caches, per-full-layer indexer key caches, and the
/// block table they share (one slot per position, the same slot in every layer).
pub struct Sequence<B: ModelBackend> {
    latent: Vec<B::Cache>,
    index_keys: Vec<Option<B::Cache>>,
    block_table: Vec<i32>,
    /// Physical pages not yet given to this sequence; handed out from the end, so the
    /// logical → physical map is not the identity and the block table is really exercised.
    free_pages: Vec<i32>,
    options: CacheOptions,
    len: usize,
}

impl<B: ModelBackend> Sequence<B> {
    /// Positions written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn options(&self) -> CacheOptions {
        self.options
    }

    /// The block table (`[max_pages]`, −1 for pages not yet assigned).
    pub fn block_table(&self) -> &[i32] {
        &self.block_table
    }

    /// The latent cache of a layer (for tests that read rows back).
    pub fn latent_cache(&self, layer: usize) -> Option<&B::Cache> {
        self.latent.get(layer)
    }

    fn table(&self) -> BlockTableRef<'_> {
        BlockTableRef {
            block_table: &self.block_table,
            page_size: self.options.page_size,
        }
    }

    /// Assigns pages for positions up to `new_len` and returns the slots of `len..new_len`.
    fn reserve(&mut self, new_len: usize) -> Result<Vec<i32>> {
        if new_len > self.options.max_seq_len {
            return Err(Error::arg(
                "sequence length",
                format!("at most max_seq_len = {}", self.options.max_seq_len),
                new_len,
            ));
        }
        let ps = self.options.page_size;
        for page in self.len.div_ceil(ps)..new_len.div_ceil(ps) {
            let phys = self
                .free_pages
                .pop()
                .ok_or_else(|| Error::Model("out of cache pages".into()))?;
            self.block_table[page] = phys;
        }
        let table = self.table();
        Ok((self.len..new_len).map(|p| table.slot(p as i32)).collect())
    }
}

/// Which rows of the logits a forward returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[1, vocab]` for the last token.
    Last,
    /// `[tokens, vocab]`, one row per input token.
    All,
}

/// What a forward decided, for tests and debugging, as `(layer, k, [tokens, k] rows)`:
/// per full-indexer layer the logical positions each query token attended to (−1 padded),
/// per MoE layer the experts each token was routed to.
#[derive(Clone, Debug, Default)]
pub struct ForwardTrace {
    pub selected: Vec<(usize, usize, Vec<i32>)>,
    pub routed: Vec<(usize, usize, Vec<i32>)>,
}

/// A loaded model on a backend.
pub struct Model<B: ModelBackend> {
    pub config: ModelConfig,
    backend: B,
    weights: ModelWeights<B::Tensor>,
    rope: RopeTable,
}

impl<B: ModelBackend> Model<B> {
    /// Loads `dir/config.json` and the safetensors checkpoint in `dir`. Every tensor the config
    /// implies is checked (presence, dtype, shape) before anything is uploaded.
    /// `progress(done, total)` is called after each tensor.
    pub fn load(dir: &Path, backend: B, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(Error::Model(format!(
                "model directory {} has no config.json",
                dir.display()
            )));
        }
        let config = ModelConfig::from_file(&config_path)?;
        let ckpt = Checkpoint::open(dir, config.fp8.map(|f| f.block))?;
        Self::from_checkpoint(config, &ckpt, backend, progress)
    }

    /// Builds the model from an opened checkpoint (checked first).
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        backend: B,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        check_checkpoint(&config, ckpt)?;
        let weights = upload_weights(&config, ckpt, &backend, progress)?;
        let rope = RopeTable::new(&config.rope, config.qk_rope_head_dim);
        Ok(Model {
            config,
            backend,
            weights,
            rope,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Number of tensors [`Model::load`] reads (for progress bars).
    pub fn tensor_count(config: &ModelConfig) -> usize {
        super::params::expected_tensors(config).len()
    }

    /// An empty sequence with caches for `opts.max_seq_len` positions.
    pub fn new_sequence(&self, opts: CacheOptions) -> Result<Sequence<B>> {
        if opts.page_size == 0 || opts.max_seq_len == 0 {
            return Err(Error::arg("page_size / max_seq_len", "at least 1", 0));
        }
        let c = &self.config;
        opts.format.check_dims(c.mla_dims())?;
        let num_pages = opts.max_seq_len.div_ceil(opts.page_size);
        let latent_layout = CacheLayout {
            num_pages,
            page_size: opts.page_size,
            row_bytes: opts.format.row_bytes(c.mla_dims()) as usize,
        };
        let key_layout = CacheLayout {
            row_bytes: 2 * c.index_head_dim,
            ..latent_layout
        };
        let mut latent = Vec::with_capacity(c.num_hidden_layers);
        let mut index_keys = Vec::with_capacity(c.num_hidden_layers);
        for layer in &self.weights.layers {
            latent.push(self.backend.alloc_cache(latent_layout)?);
            index_keys.push(match layer.indexer {
                Some(_) => Some(self.backend.alloc_cache(key_layout)?),
                None => None,
            });
        }
        Ok(Sequence {
            latent,
            index_keys,
            block_table: vec![-1; num_pages],
            free_pages: (0..num_pages as i32).collect(),
            options: opts,
            len: 0,
        })
    }

    /// Runs `tokens` at the next positions of `seq` and returns logits (row-major
    /// `[rows, vocab]`, rows per `which`).
    pub fn forward(
        &self,
        seq: &mut Sequence<B>,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_traced(seq, tokens, which, None)
    }

    /// [`Model::forward`], recording the indexer's selections into `trace`.
    pub fn forward_traced(
        &self,
        seq: &mut Sequence<B>,
        tokens: &[u32],
        which: Logits,
        mut trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::arg("tokens", "at least one token", 0));
        }
        let b = &self.backend;
        let c = &self.config;
        let start = seq.len;
        let end = start + tokens.len();
        let slots = seq.reserve(end)?;
        let positions: Vec<u32> = (start as u32..end as u32).collect();

        let mut h = b.embedding(&self.weights.embed, tokens)?;
        let mut selected: Option<B::Index> = None;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let x = b.rms_norm(&h, &layer.input_norm, c.rms_norm_eps)?;
            let attn = self.attention(
                l,
                layer,
                &x,
                seq,
                &slots,
                &positions,
                &mut selected,
                trace.as_deref_mut(),
            )?;
            h = b.add(&h, &attn)?;
            let x = b.rms_norm(&h, &layer.post_norm, c.rms_norm_eps)?;
            let y = self.mlp(l, &layer.mlp, &x, trace.as_deref_mut())?;
            h = b.add(&h, &y)?;
        }
        seq.len = end;

        let h = match which {
            Logits::All => h,
            Logits::Last => b.slice_rows(&h, tokens.len() - 1, 1)?,
        };
        let h = b.rms_norm(&h, &self.weights.norm, c.rms_norm_eps)?;
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        b.download(&b.linear(&h, head)?)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        layer: &LayerWeights<B::Tensor>,
        x: &B::Tensor,
        seq: &mut Sequence<B>,
        slots: &[i32],
        positions: &[u32],
        selected: &mut Option<B::Index>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<B::Tensor> {
        let b = &self.backend;
        let c = &self.config;
        let w = &layer.attn;
        let t = positions.len();
        let heads = c.num_attention_heads;
        let (nope, rope, lat) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank);

        // Query: [nope | rope] per head; q_lat = W_UKᵀ q_nope.
        let q_resid = b.rms_norm(&b.linear(x, &w.q_a)?, &w.q_a_norm, LATENT_NORM_EPS)?;
        let q = b.reshape(b.linear(&q_resid, &w.q_b)?, t * heads, nope + rope)?;
        let q_rope = b.rope(
            &b.slice_cols(&q, nope, rope)?,
            0,
            positions,
            &self.rope,
            c.mla_rope_style,
        )?;
        let q_nope = b.reshape(b.slice_cols(&q, 0, nope)?, t, heads * nope)?;
        let q_lat = b.reshape(b.head_linear(&q_nope, &w.w_uk_t, heads)?, t * heads, lat)?;
        let q_full = b.reshape(b.concat_cols(&q_lat, &q_rope)?, t, heads * (lat + rope))?;

        // This token's cache row: [rmsnorm(c) | RoPE(k_rope)].
        let kv = b.linear(x, &w.kv_a)?;
        let latent = b.rms_norm(&b.slice_cols(&kv, 0, lat)?, &w.kv_a_norm, LATENT_NORM_EPS)?;
        let k_rope = b.rope(
            &b.slice_cols(&kv, lat, rope)?,
            0,
            positions,
            &self.rope,
            c.mla_rope_style,
        )?;
        let row = b.concat_cols(&latent, &k_rope)?;
        let fmt = seq.options.format;
        b.write_latent_rows(
            &mut seq.latent[l],
            &row,
            slots,
            fmt,
            c.mla_dims(),
            c.cache_scale_flavour(),
        )?;

        if let Some(iw) = &layer.indexer {
            let logical = self.indexer(l, iw, x, &q_resid, seq, slots, positions)?;
            if let Some(tr) = trace {
                let k = b.download_index(&logical)?;
                tr.selected.push((l, k.len() / t, k));
            }
            *selected = Some(b.positions_to_slots(&logical, seq.table())?);
        }
        let slots_k = selected.as_ref().ok_or_else(|| {
            Error::Model(format!(
                "layer {l} is a shared-indexer layer with no earlier full layer"
            ))
        })?;
        let call = MlaCall {
            heads,
            dims: c.mla_dims(),
            format: fmt,
            scale: c.softmax_scale(),
        };
        let out = b.sparse_mla(&q_full, &seq.latent[l], slots_k, call)?;
        let o = b.head_linear(&out, &w.w_uv, heads)?;
        b.linear(&o, &w.o_proj)
    }

    /// Writes this layer's indexer keys and returns the logical top-k positions `[T, K]`.
    #[allow(clippy::too_many_arguments)]
    fn indexer(
        &self,
        l: usize,
        w: &super::params::IndexerWeights<B::Tensor>,
        x: &B::Tensor,
        q_resid: &B::Tensor,
        seq: &mut Sequence<B>,
        slots: &[i32],
        positions: &[u32],
    ) -> Result<B::Index> {
        let b = &self.backend;
        let c = &self.config;
        let t = positions.len();
        let (hi, d) = (c.index_n_heads, c.index_head_dim);
        let k = b.layer_norm(
            &b.linear(x, &w.wk)?,
            &w.k_norm_w,
            &w.k_norm_b,
            INDEXER_NORM_EPS,
        )?;
        let k = b.rope(&k, 0, positions, &self.rope, c.indexer_rope_style)?;
        let cache = seq.index_keys[l]
            .as_mut()
            .ok_or_else(|| Error::Model(format!("layer {l}: no indexer key cache")))?;
        b.write_index_keys(cache, &k, slots)?;

        let total = positions.last().map(|&p| p as usize + 1).unwrap_or(0);
        let topk = c.index_topk.min(total);
        if total <= c.index_topk {
            // Every earlier-or-equal position is selected: no scores needed.
            let mut idx = vec![-1i32; t * topk];
            for (r, &p) in positions.iter().enumerate() {
                for s in 0..=p as usize {
                    idx[r * topk + s] = s as i32;
                }
            }
            return b.upload_index(t, topk, &idx);
        }
        let q = b.reshape(b.linear(q_resid, &w.wq_b)?, t * hi, d)?;
        let q = b.rope(&q, 0, positions, &self.rope, c.indexer_rope_style)?;
        let weights = b.linear(x, &w.weights_proj)?;
        let call = IndexerCall {
            heads: hi,
            head_dim: d,
            softmax_scale: (d as f32).powf(-0.5),
            weight_scale: (hi as f32).powf(-0.5),
            topk,
        };
        let cache = seq.index_keys[l]
            .as_ref()
            .ok_or_else(|| Error::Model(format!("layer {l}: no indexer key cache")))?;
        b.indexer_topk(&q, &weights, cache, seq.table(), positions, call)
    }

    fn mlp(
        &self,
        l: usize,
        mlp: &MlpWeights<B::Tensor>,
        x: &B::Tensor,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<B::Tensor> {
        let b = &self.backend;
        let c = &self.config;
        match mlp {
            MlpWeights::Dense(m) => {
                let hmid = b.silu_mul(&b.linear(x, &m.gate)?, &b.linear(x, &m.up)?)?;
                b.linear(&hmid, &m.down)
            }
            MlpWeights::Moe {
                router,
                bias,
                experts,
                shared,
            } => {
                let logits = b.linear(x, router)?;
                let routing = Routing {
                    top_k: c.num_experts_per_tok,
                    n_group: c.n_group,
                    topk_group: c.topk_group,
                    norm_topk_prob: c.norm_topk_prob,
                    routed_scaling_factor: c.routed_scaling_factor,
                };
                let (ids, weights) = b.moe_route(&logits, bias, routing)?;
                if let Some(tr) = trace {
                    tr.routed.push((l, routing.top_k, b.download_index(&ids)?));
                }
                let y = b.moe_experts(x, &ids, &weights, experts)?;
                match shared {
                    Some(s) => {
                        let hmid = b.silu_mul(&b.linear(x, &s.gate)?, &b.linear(x, &s.up)?)?;
                        b.add(&y, &b.linear(&hmid, &s.down)?)
                    }
                    None => Ok(y),
                }
            }
        }
    }
}
