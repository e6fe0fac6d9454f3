//! The GLM-5 / DeepSeek-V3.2 forward pass, written once over [`Device`] — so over every
//! runtime backend: the CPU reference, wgpu and CUDA run the same op sequence.
//!
//! Per layer (absorbed MLA, docs/models.md):
//! ```text
//! x = rmsnorm(h)
//! q_resid = rmsnorm(q_a(x)); q = q_b(q_resid) → per head [nope | rope]
//! q_full = [W_UKᵀ q_nope | RoPE(q_rope)] (per head), as bf16
//! [c | k_rope] = kv_a(x); cache[slot] = [rmsnorm(c) | RoPE(k_rope)]   (the cache-write kernel)
//! top-k slots: the layer's lightning indexer (its own key cache), or the nearest earlier
//!              full layer's on a GLM "shared" layer; logical positions → slots (block table)
//! out = sparse_mla_decode(q_full, cache, slots)                         (the decode kernel)
//! h += o_proj(W_UV out)
//! h += mlp(rmsnorm(h))            (dense SwiGLU, or routed experts + shared expert)
//! ```
//! A step takes any number of sequences, each with any number of new tokens (a prefill, one
//! decode token, or several for speculative decode): `T` query tokens in all, each with its
//! own position, causal top-k and cache slot. While a sequence holds no more than
//! `index_topk` positions every position is selected, so sparse equals dense there.

use std::path::Path;
use std::sync::Arc;

use super::cache::{CacheOptions, KvCache, SeqId};
use super::config::{ModelConfig, RopeStyle, INDEXER_NORM_EPS, LATENT_NORM_EPS};
use super::device::{BlockTables, Device, Index, Tensor};
use super::params::{
    check_checkpoint, upload_weights, LayerWeights, Mlp, MlpWeights, ModelWeights,
};
use super::rope::RopeTable;
use super::weights::Checkpoint;
use crate::kernels::rope::RopeLayout;
use crate::kernels::view::DType;
use crate::mla::{DecodeLayout, DecodeShape, VbtShape};
use crate::runtime::{Backend, CacheWriteBuffers, DecodeBuffers, DecodeOptions, VbtBuffers};
use crate::{Error, Result};

/// Which rows of the logits a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per sequence of the step: its last token.
    Last,
    /// One row per input token.
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

/// One sequence's share of a step: its new tokens.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
}

/// A cache with one sequence in it: the single-stream API of `mla-run` and the tests.
pub struct Sequence {
    pub cache: KvCache,
    pub id: SeqId,
}

impl Sequence {
    /// Positions written so far.
    pub fn len(&self) -> usize {
        self.cache.len(self.id).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn options(&self) -> CacheOptions {
        self.cache.options()
    }
}

/// A loaded model on a device.
pub struct Model {
    pub config: ModelConfig,
    device: Device,
    pub(super) weights: ModelWeights,
    rope: RopeTable,
    loaded_bytes: u64,
    graphs: std::sync::Mutex<Graphs>,
}

/// The per-step index inputs, on the device.
pub(super) struct StepIndex {
    ids: Index,
    positions: Index,
    req_of_token: Index,
    slots: Index,
    /// Row of the last token of each sequence of the step.
    last: Index,
    /// Positions each token sees (`positions + 1`), largest.
    max_seen: u32,
    /// Columns of the indexer's score rows: `max_seen`, or (in a recorded graph, which must
    /// serve many steps) `max_seen` rounded up to the score buffer's capacity.
    columns: u32,
}

/// The host side of a step's index inputs.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct HostIndex {
    ids: Vec<i32>,
    positions: Vec<i32>,
    req: Vec<i32>,
    slots: Vec<i32>,
    last: Vec<i32>,
    max_seen: u32,
}

/// What a recorded decode step depends on: the same key, the same graph.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GraphKey {
    seqs: Vec<usize>,
    columns: u32,
    which: Logits,
}

/// A decode step recorded as a CUDA graph, with everything it reads and writes kept out of
/// the pool while it lives.
struct RecordedStep {
    key: GraphKey,
    graph: Box<dyn crate::runtime::gpu::Graph>,
    index: StepIndex,
    logits: Tensor,
    held: Vec<(u64, crate::runtime::Buffer)>,
}

/// The graph state of a model: off, the last eager key (a step seen twice is recorded), the
/// recorded step.
#[derive(Default)]
struct Graphs {
    on: bool,
    seen: Option<GraphKey>,
    recorded: Option<RecordedStep>,
    /// Replays so far (for reports and tests).
    replays: u64,
    records: u64,
}

fn rope_layout(s: RopeStyle) -> RopeLayout {
    match s {
        RopeStyle::Interleaved => RopeLayout::Interleaved,
        RopeStyle::HalfSplit => RopeLayout::HalfSplit,
    }
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::arg(what, "a value below 2^32", v))
}

impl Model {
    /// Loads `dir/config.json` and the safetensors checkpoint in `dir` onto `backend`. Every
    /// tensor the config implies is checked (presence, dtype, shape) before anything is
    /// uploaded. `progress(done, total)` is called after each tensor.
    pub fn load(
        dir: &Path,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir, config.fp8.map(|f| f.block))?;
        Self::from_checkpoint(config, &ckpt, backend, progress)
    }

    /// Builds the model from an opened checkpoint (checked first).
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        check_checkpoint(&config, ckpt)?;
        let device = Device::new(backend);
        let (weights, loaded_bytes) = upload_weights(&config, ckpt, &device, progress)?;
        let rope = RopeTable::new(&config.rope, config.qk_rope_head_dim);
        Ok(Model {
            config,
            device,
            weights,
            rope,
            loaded_bytes,
            graphs: Default::default(),
        })
    }

    /// A model from weights already on `device` (the synthetic benchmark models).
    pub fn from_parts(config: ModelConfig, device: Device, weights: ModelWeights) -> Self {
        let rope = RopeTable::new(&config.rope, config.qk_rope_head_dim);
        Model {
            config,
            device,
            weights,
            rope,
            loaded_bytes: 0,
            graphs: Default::default(),
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records decode steps as CUDA graphs and replays them (backends without graphs ignore
    /// it). A step is recorded the second time its shape is seen — one token per sequence,
    /// the same sequences, past `index_topk` positions (so the top-k width is fixed) — and
    /// replayed while the shape holds; its inputs are written before each replay.
    pub fn set_graphs(&self, on: bool) {
        if let Ok(mut g) = self.graphs.lock() {
            g.on = on;
            if !on {
                if let Some(r) = g.recorded.take() {
                    self.device.release(r.held);
                }
                g.seen = None;
            }
        }
    }

    /// (recordings, replays) of decode-step graphs so far.
    pub fn graph_counts(&self) -> (u64, u64) {
        self.graphs
            .lock()
            .map(|g| (g.records, g.replays))
            .unwrap_or((0, 0))
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes()
    }

    /// Checkpoint bytes read at load.
    pub fn loaded_bytes(&self) -> u64 {
        self.loaded_bytes
    }

    /// Number of tensors [`Model::load`] reads (for progress bars).
    pub fn tensor_count(config: &ModelConfig) -> usize {
        super::params::expected_tensor_count(config)
    }

    /// Caches for `opts` (every layer's latent cache, the indexer key caches, the page pool,
    /// the block table, the RoPE table).
    pub fn new_cache(&self, opts: CacheOptions) -> Result<KvCache> {
        opts.validate()?;
        let c = &self.config;
        opts.format.check_dims(c.mla_dims())?;
        let half = self.rope.inv_freq.len();
        let mut table = super::cache::try_filled(0, 0.0f32, "RoPE table")?;
        table
            .try_reserve_exact(opts.max_seq_len.saturating_mul(2 * half))
            .map_err(|_| {
                Error::Model(format!(
                    "cannot allocate the RoPE table of {} positions on the host; lower --max-seq-len",
                    opts.max_seq_len
                ))
            })?;
        for p in 0..opts.max_seq_len {
            let (cos, sin) = self.rope.cos_sin(p as u32);
            table.extend(cos);
            table.extend(sin);
        }
        let has_keys: Vec<bool> = self
            .weights
            .layers
            .iter()
            .map(|l| l.indexer.is_some())
            .collect();
        KvCache::new(
            &self.device,
            opts,
            opts.format.row_bytes(c.mla_dims()) as usize,
            c.index_head_dim,
            &has_keys,
            table,
            half,
        )
    }

    /// A cache holding one empty sequence.
    pub fn new_sequence(&self, opts: CacheOptions) -> Result<Sequence> {
        let mut cache = self.new_cache(CacheOptions {
            max_seqs: 1,
            ..opts
        })?;
        let id = cache.add_sequence()?;
        Ok(Sequence { cache, id })
    }

    /// Runs `tokens` at the next positions of `seq`; returns the logits row-major
    /// (`[rows, vocab]`, rows per `which`).
    pub fn forward(&self, seq: &mut Sequence, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.forward_traced(seq, tokens, which, None)
    }

    /// [`Model::forward`] with the logits left on the device (for the device sampler: only the
    /// sampled id then crosses to the host).
    pub fn forward_on_device(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Tensor> {
        let input = [StepInput {
            seq: seq.id,
            tokens,
        }];
        self.step(&mut seq.cache, &input, which, None)
    }

    /// [`Model::forward`], recording the indexer's selections and the routing into `trace`.
    pub fn forward_traced(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        which: Logits,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>> {
        let input = [StepInput {
            seq: seq.id,
            tokens,
        }];
        let logits = self.step(&mut seq.cache, &input, which, trace)?;
        self.device.download(&logits)
    }

    /// One step over several sequences: every input's tokens at its sequence's next positions.
    /// Returns the logits on the device (`[rows, vocab]` f32, rows per `which`: one per input
    /// for [`Logits::Last`], in input order). On an error no sequence has changed.
    pub fn step(
        &self,
        cache: &mut KvCache,
        inputs: &[StepInput],
        which: Logits,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        self.check_inputs(inputs)?;
        let grow: Vec<(SeqId, usize)> = inputs.iter().map(|i| (i.seq, i.tokens.len())).collect();
        let reservation = cache.reserve(&grow)?;
        let result = if trace.is_none() {
            self.step_graphed(cache, inputs, which)
        } else {
            None
        };
        let result = match result {
            Some(r) => r,
            None => self.step_reserved(cache, inputs, which, trace),
        };
        match result {
            Ok(l) => Ok(l),
            Err(e) => {
                cache.rollback(reservation);
                Err(e)
            }
        }
    }

    /// Refuses an empty step, a sequence twice in one step and tokens past the vocabulary.
    pub(super) fn check_inputs(&self, inputs: &[StepInput]) -> Result<()> {
        if inputs.is_empty() || inputs.iter().any(|i| i.tokens.is_empty()) {
            return Err(Error::arg("tokens", "at least one token per sequence", 0));
        }
        for (n, i) in inputs.iter().enumerate() {
            if inputs[..n].iter().any(|j| j.seq == i.seq) {
                return Err(Error::arg(
                    "inputs",
                    "each sequence at most once per step",
                    i.seq.0,
                ));
            }
            if let Some(&bad) = i
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(Error::arg(
                    "token id",
                    format!("below the vocabulary size {}", self.config.vocab_size),
                    bad,
                ));
            }
        }
        Ok(())
    }

    /// The step through a recorded graph, when graphs are on and the step qualifies; `None`
    /// to run it eagerly.
    fn step_graphed(
        &self,
        cache: &mut KvCache,
        inputs: &[StepInput],
        which: Logits,
    ) -> Option<Result<Tensor>> {
        let mut g = self.graphs.lock().ok()?;
        if !g.on || inputs.iter().any(|i| i.tokens.len() != 1) {
            return None;
        }
        let host = match self.host_index(cache, inputs) {
            Ok(h) => h,
            Err(e) => return Some(Err(e)),
        };
        if host.max_seen as usize <= self.config.index_topk {
            return None;
        }
        let key = GraphKey {
            seqs: inputs.iter().map(|i| i.seq.0).collect(),
            columns: super::device::score_capacity(host.max_seen),
            which,
        };
        if let Some(r) = g.recorded.as_ref().filter(|r| r.key == key) {
            let replay = (|| {
                cache.sync_table(&self.device)?;
                self.write_index(&r.index, &host)?;
                r.graph.replay()?;
                Ok(r.logits.clone())
            })();
            if replay.is_ok() {
                g.replays += 1;
            }
            return Some(replay);
        }
        if g.seen.as_ref() != Some(&key) {
            // First sight of this shape: run it eagerly (which warms the pool for it).
            g.seen = Some(key);
            return None;
        }
        if let Some(old) = g.recorded.take() {
            self.device.release(old.held);
        }
        let recorded = self.record(cache, &host, key);
        match recorded {
            Ok(Some(r)) => {
                let logits = r.logits.clone();
                g.recorded = Some(r);
                g.records += 1;
                Some(Ok(logits))
            }
            // No graphs on this backend: stay eager from now on.
            Ok(None) => {
                g.on = false;
                None
            }
            Err(e) => {
                log::warn!("recording the decode step as a graph failed ({e}); running eagerly");
                g.on = false;
                None
            }
        }
    }

    /// Records the step (its inputs already reserved) as a graph and runs it once.
    fn record(
        &self,
        cache: &mut KvCache,
        host: &HostIndex,
        key: GraphKey,
    ) -> Result<Option<RecordedStep>> {
        let d = &self.device;
        cache.sync_table(d)?;
        let mut index = self.upload_index(host)?;
        index.columns = key.columns;
        if !d.backend().begin_capture()? {
            return Ok(None);
        }
        d.begin_recording()?;
        let logits = self.run_layers(cache, &index, key.which, None);
        let ids = d.end_recording()?;
        let graph = d.backend().end_capture();
        let (logits, graph) = (logits?, graph?);
        let Some(graph) = graph else {
            return Ok(None);
        };
        let held = d.quarantine(&ids)?;
        graph.replay()?;
        Ok(Some(RecordedStep {
            key,
            graph,
            index,
            logits,
            held,
        }))
    }

    pub(super) fn host_index(&self, cache: &KvCache, inputs: &[StepInput]) -> Result<HostIndex> {
        let mut h = HostIndex {
            ids: Vec::new(),
            positions: Vec::new(),
            req: Vec::new(),
            slots: Vec::new(),
            last: Vec::new(),
            max_seen: 1,
        };
        for i in inputs {
            let end = cache.len(i.seq)?;
            let start = end - i.tokens.len();
            for (k, &t) in i.tokens.iter().enumerate() {
                h.ids.push(t as i32);
                h.positions.push((start + k) as i32);
                h.req.push(i.seq.0 as i32);
                h.slots.push(cache.slot(i.seq, start + k)?);
            }
            h.last.push(h.ids.len() as i32 - 1);
        }
        h.max_seen = h.positions.iter().map(|&p| p as u32 + 1).max().unwrap_or(1);
        Ok(h)
    }

    pub(super) fn upload_index(&self, h: &HostIndex) -> Result<StepIndex> {
        let t = u32_of(h.ids.len(), "tokens in a step")?;
        let d = &self.device;
        Ok(StepIndex {
            ids: d.index_from(t, 1, &h.ids)?,
            positions: d.index_from(t, 1, &h.positions)?,
            req_of_token: d.index_from(t, 1, &h.req)?,
            slots: d.index_from(t, 1, &h.slots)?,
            last: d.index_from(h.last.len() as u32, 1, &h.last)?,
            max_seen: h.max_seen,
            columns: h.max_seen,
        })
    }

    /// New values into a recorded step's index buffers (same shapes).
    fn write_index(&self, idx: &StepIndex, h: &HostIndex) -> Result<()> {
        let b = self.device.backend();
        let bytes = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        b.write(idx.ids.buffer(), &bytes(&h.ids))?;
        b.write(idx.positions.buffer(), &bytes(&h.positions))?;
        b.write(idx.req_of_token.buffer(), &bytes(&h.req))?;
        b.write(idx.slots.buffer(), &bytes(&h.slots))?;
        b.write(idx.last.buffer(), &bytes(&h.last))
    }

    fn step_reserved(
        &self,
        cache: &mut KvCache,
        inputs: &[StepInput],
        which: Logits,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        self.device.phase_start()?;
        cache.sync_table(&self.device)?;
        let host = self.host_index(cache, inputs)?;
        let idx = self.upload_index(&host)?;
        self.run_layers(cache, &idx, which, trace)
    }

    /// Every layer and the head, for a step whose index inputs are on the device.
    fn run_layers(
        &self,
        cache: &mut KvCache,
        idx: &StepIndex,
        which: Logits,
        mut trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        let h = self.embed(idx)?;
        let mut selected: Option<Index> = None;
        for l in 0..self.weights.layers.len() {
            self.attention_into(l, &h, &h, cache, idx, &mut selected, trace.as_deref_mut())?;
            self.mlp_into(l, &h, &h, trace.as_deref_mut())?;
        }
        self.head(h, idx, which)
    }

    /// The residual stream of a step's tokens: their embedding rows.
    pub(super) fn embed(&self, idx: &StepIndex) -> Result<Tensor> {
        let h = self.device.gather_rows(&self.weights.embed, &idx.ids)?;
        self.device.phase(None, "other")?;
        Ok(h)
    }

    /// Layer `l`'s attention of the residual stream `h`, added into `out` (`h` itself, or a
    /// sharded rank's zeroed output).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_into(
        &self,
        l: usize,
        h: &Tensor,
        out: &Tensor,
        cache: &mut KvCache,
        idx: &StepIndex,
        selected: &mut Option<Index>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<()> {
        let layer = &self.weights.layers[l];
        let x = self
            .device
            .rms_norm(h, &layer.input_norm, self.config.rms_norm_eps)?;
        self.attention(l, layer, &x, out, cache, idx, selected, trace)
    }

    /// Layer `l`'s MLP of the residual stream `h`, added into `out`.
    pub(super) fn mlp_into(
        &self,
        l: usize,
        h: &Tensor,
        out: &Tensor,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<()> {
        let layer = &self.weights.layers[l];
        let x = self
            .device
            .rms_norm(h, &layer.post_norm, self.config.rms_norm_eps)?;
        self.mlp(l, &layer.mlp, &x, out, trace)?;
        self.device.phase(Some(l), "mlp")
    }

    /// The final norm and the LM head: logits `[rows, vocab]`, rows per `which`.
    pub(super) fn head(&self, h: Tensor, idx: &StepIndex, which: Logits) -> Result<Tensor> {
        let d = &self.device;
        let h = match which {
            Logits::All => h,
            Logits::Last => d.select_rows(&h, &idx.last)?,
        };
        let h = d.rms_norm(&h, &self.weights.norm, self.config.rms_norm_eps)?;
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let logits = d.linear(&h, head)?;
        d.phase(None, "other")?;
        Ok(logits)
    }

    fn tables<'a>(&self, cache: &'a KvCache, idx: &'a StepIndex) -> BlockTables<'a> {
        BlockTables {
            buf: &cache.table,
            requests: cache.opts.max_seqs as u32,
            max_pages: cache.opts.max_pages_per_seq() as u32,
            page_size: cache.opts.page_size as u32,
            req_of_token: &idx.req_of_token,
            positions: &idx.positions,
        }
    }

    /// Attention of layer `l`: adds `o_proj(W_UV · sparse_mla(...))` into `out`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        layer: &LayerWeights,
        x: &Tensor,
        out: &Tensor,
        cache: &mut KvCache,
        idx: &StepIndex,
        selected: &mut Option<Index>,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<()> {
        let d = &self.device;
        let c = &self.config;
        let w = &layer.attn;
        let t = x.rows();
        let heads = c.num_attention_heads as u32;
        let (nope, rope, lat) = (
            c.qk_nope_head_dim as u32,
            c.qk_rope_head_dim as u32,
            c.kv_lora_rank as u32,
        );
        let mla_rope = rope_layout(c.mla_rope_style);

        // Query: [nope | rope] per head; q_full = [W_UKᵀ q_nope | RoPE(q_rope)].
        let q_resid = d.rms_norm(&d.linear(x, &w.q_a)?, &w.q_a_norm, LATENT_NORM_EPS)?;
        let q = d
            .linear(&q_resid, &w.q_b)?
            .reshape(t * heads, nope + rope)?;
        let q_full = d.empty(t * heads, lat + rope, DType::F32)?;
        d.head_linear_into(
            &q.cols_slice(0, nope)?,
            &w.w_uk_t,
            heads,
            &q_full.cols_slice(0, lat)?,
        )?;
        d.rope_into(
            &q.cols_slice(nope, rope)?,
            &q_full.cols_slice(lat, rope)?,
            heads,
            &idx.positions,
            &cache.rope,
            mla_rope,
        )?;
        let q_bf16 = d.cast(&q_full, DType::Bf16)?;

        // This token's cache row: [rmsnorm(c) | RoPE(k_rope)], written by the cache-write kernel.
        let kv = d.linear(x, &w.kv_a)?;
        let latent = d.rms_norm(&kv.cols_slice(0, lat)?, &w.kv_a_norm, LATENT_NORM_EPS)?;
        let k_rope = d.empty(t, rope, DType::F32)?;
        d.rope_into(
            &kv.cols_slice(lat, rope)?,
            &k_rope,
            1,
            &idx.positions,
            &cache.rope,
            mla_rope,
        )?;
        let latent_bf16 = d.cast(&latent, DType::Bf16)?;
        let rope_bf16 = d.cast(&k_rope, DType::Bf16)?;
        let opts = cache.opts;
        let write = cache.write_shape(c, t);
        d.backend().cache_write(
            &write,
            &CacheWriteBuffers {
                latent: latent_bf16.buffer(),
                rope: rope_bf16.buffer(),
                slot_mapping: idx.slots.buffer(),
                kv_cache: &cache.latent[l],
            },
        )?;

        if let Some(iw) = &layer.indexer {
            d.phase(Some(l), "attention")?;
            let logical = self.indexer(l, iw, x, &q_resid, cache, idx)?;
            if let Some(tr) = trace {
                tr.selected
                    .push((l, logical.cols as usize, d.download_index(&logical)?));
            }
            let slots = d.empty_index(t, logical.cols)?;
            let shape = VbtShape {
                tokens: t,
                topk: logical.cols,
                requests: opts.max_seqs as u32,
                max_pages: opts.max_pages_per_seq() as u32,
                page_size: opts.page_size as u32,
            };
            d.backend().positions_to_slots(
                &shape,
                &VbtBuffers {
                    positions: logical.buffer(),
                    block_table: &cache.table,
                    req_of_token: idx.req_of_token.buffer(),
                    slots: slots.buffer(),
                },
            )?;
            *selected = Some(slots);
            d.phase(Some(l), "indexer")?;
        }
        let slots_k = selected.as_ref().ok_or_else(|| {
            Error::Model(format!(
                "layer {l} is a shared-indexer layer with no earlier full layer"
            ))
        })?;

        let shape = DecodeShape {
            tokens: t,
            heads,
            topk: slots_k.cols,
            num_pages: opts.pages() as u32,
            page_size: opts.page_size as u32,
            dims: c.mla_dims(),
            format: opts.format,
            scale: c.softmax_scale(),
            has_topk_length: false,
        };
        let attn = d.empty(t * heads, lat, DType::Bf16)?;
        let lse = d.empty(t, heads, DType::F32)?;
        d.backend().sparse_mla_decode(
            &shape,
            &DecodeBuffers {
                q: q_bf16.buffer(),
                kv_cache: &cache.latent[l],
                indices: slots_k.buffer(),
                topk_length: None,
                out: attn.buffer(),
                lse: lse.buffer(),
                layout: DecodeLayout::default(),
            },
            &DecodeOptions::default(),
        )?;
        let v = c.v_head_dim as u32;
        let o = d.empty(t * heads, v, DType::F32)?;
        d.head_linear_into(&attn, &w.w_uv, heads, &o)?;
        d.linear_into(&o.reshape(t, heads * v)?, &w.o_proj, out, true)?;
        d.phase(Some(l), "attention")
    }

    /// Writes this layer's indexer keys and returns the logical top-k positions `[T, K]`.
    fn indexer(
        &self,
        l: usize,
        w: &super::params::IndexerWeights,
        x: &Tensor,
        q_resid: &Tensor,
        cache: &KvCache,
        idx: &StepIndex,
    ) -> Result<Index> {
        let d = &self.device;
        let c = &self.config;
        let t = x.rows();
        let (hi, dim) = (c.index_n_heads as u32, c.index_head_dim as u32);
        let rope = c.qk_rope_head_dim as u32;
        let style = rope_layout(c.indexer_rope_style);
        let keys = cache.keys[l]
            .as_ref()
            .ok_or_else(|| Error::Model(format!("layer {l}: no indexer key cache")))?;
        let num_slots = (cache.opts.pages() * cache.opts.page_size) as u32;
        // Keys: LayerNorm(wk x), RoPE on the first qk_rope columns, stored as bf16 rows.
        let k = d.layer_norm(
            &d.linear(x, &w.wk)?,
            &w.k_norm_w,
            &w.k_norm_b,
            INDEXER_NORM_EPS,
        )?;
        d.rope_in_place(
            &k.cols_slice(0, rope)?,
            1,
            &idx.positions,
            &cache.rope,
            style,
        )?;
        d.write_keys(&k, &idx.slots, keys, num_slots)?;

        let columns = idx.columns;
        let topk = (c.index_topk as u32).min(idx.max_seen);
        let tables = self.tables(cache, idx);
        let scores = if columns <= c.index_topk as u32 {
            // Every earlier-or-equal position is selected: the scores are not read.
            d.empty_with_capacity(
                t,
                columns,
                super::device::score_capacity(columns),
                DType::F32,
            )?
        } else {
            let q = d.linear(q_resid, &w.wq_b)?.reshape(t * hi, dim)?;
            d.rope_in_place(
                &q.cols_slice(0, rope)?,
                hi,
                &idx.positions,
                &cache.rope,
                style,
            )?;
            let weights = d.linear(x, &w.weights_proj)?;
            d.indexer_scores(
                &q,
                &weights,
                hi,
                keys,
                num_slots,
                &tables,
                columns,
                (dim as f32).powf(-0.5),
                (hi as f32).powf(-0.5),
            )?
        };
        d.topk(&scores, &idx.positions, topk)
    }

    /// The MLP of layer `l`, added into `out`.
    fn mlp(
        &self,
        l: usize,
        mlp: &MlpWeights,
        x: &Tensor,
        out: &Tensor,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<()> {
        let d = &self.device;
        let c = &self.config;
        match mlp {
            MlpWeights::Dense(m) => self.swiglu_into(m, x, out),
            MlpWeights::Moe {
                router,
                bias,
                experts_gate_up,
                experts_down,
                experts,
                expert_base,
                inter,
                shared,
            } => {
                let logits = d.linear(x, router)?;
                let (ids, weights) = d.moe_route(&logits, bias, c)?;
                if let Some(tr) = trace {
                    tr.routed
                        .push((l, ids.cols as usize, d.download_index(&ids)?));
                }
                // Expert parallelism: the global ids as this rank's weights number them (the
                // others' skipped). A model holding every expert needs no map.
                let local;
                let ids = if *experts == router.layout.rows {
                    &ids
                } else {
                    local = d.local_experts(&ids, *expert_base, *experts)?;
                    &local
                };
                let gu = d.expert_linear(x, experts_gate_up, *experts, ids)?;
                let a = d.silu_mul(&gu.cols_slice(0, *inter)?, &gu.cols_slice(*inter, *inter)?)?;
                d.expert_linear_combine(&a, experts_down, *experts, ids, &weights, out)?;
                match shared {
                    Some(s) => self.swiglu_into(s, x, out),
                    None => Ok(()),
                }
            }
        }
    }

    /// `out += down(silu(gate x) ⊙ up x)`.
    fn swiglu_into(&self, m: &Mlp, x: &Tensor, out: &Tensor) -> Result<()> {
        let d = &self.device;
        let gu = d.linear(x, &m.gate_up)?;
        let a = d.silu_mul(
            &gu.cols_slice(0, m.inter)?,
            &gu.cols_slice(m.inter, m.inter)?,
        )?;
        d.linear_into(&a, &m.down, out, true)
    }
}
