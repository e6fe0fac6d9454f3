//! The model split over N ranks (docs/sharding.md): attention heads, the dense and
//! shared-expert intermediate dim (tensor parallelism) and the routed experts (expert
//! parallelism) divided between them; the latent cache, the indexer, the router, the norms
//! and the embedding on every rank; the LM head on rank 0, which computes the logits.
//!
//! Each rank is a [`Model`] whose config has `heads / N` attention heads and whose weights
//! are its shard, with a [`KvCache`] of its own. The ranks run in lockstep on one thread,
//! sublayer by sublayer: every rank computes its part of a sublayer's output, a
//! [`Collective`] sums the parts, and every rank continues from the same sum. Rank 0's part
//! accumulates into its residual stream `h` (as the unsharded forward's does) and every other
//! rank's into zeros, so the sum is the next `h` itself: no add kernel, and with one rank the
//! op sequence is the unsharded model's, bit for bit. Steps run eagerly (no CUDA graphs).

pub mod collective;
pub mod plan;

use std::path::Path;
use std::sync::Arc;

use super::cache::{CacheOptions, KvCache, SeqId};
use super::config::ModelConfig;
use super::device::{Device, Index, Tensor};
use super::forward::{ForwardTrace, Logits, Model, StepInput};
use super::params::{check_checkpoint, shard_tensor_count, upload_shard};
use super::weights::Checkpoint;
use crate::runtime::Backend;
use crate::{Error, Result};
use collective::{Collective, HostCollective};
use plan::{check_tp, ShardSpec};

/// A model sharded over `world` ranks.
pub struct ShardedModel {
    /// The whole model's config.
    pub config: ModelConfig,
    ranks: Vec<Model>,
    collective: Box<dyn Collective>,
    loaded_bytes: u64,
}

/// One cache per rank, kept in lockstep (the same sequences, pages and slots on every rank).
pub struct ShardedCache {
    ranks: Vec<KvCache>,
}

impl ShardedCache {
    /// A new sequence, the same id on every rank.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let ids = self
            .ranks
            .iter_mut()
            .map(|c| c.add_sequence())
            .collect::<Result<Vec<_>>>()?;
        lockstep(&ids, "sequence ids")?;
        Ok(ids[0])
    }

    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        self.ranks
            .iter_mut()
            .try_for_each(|c| c.remove_sequence(id))
    }

    /// Positions written so far.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.ranks[0].len(id)
    }

    /// Device bytes of every rank's caches.
    pub fn bytes(&self) -> u64 {
        self.ranks.iter().map(|c| c.bytes()).sum()
    }

    pub fn options(&self) -> CacheOptions {
        self.ranks[0].options()
    }
}

/// A sharded cache with one sequence in it.
pub struct ShardedSequence {
    pub cache: ShardedCache,
    pub id: SeqId,
}

impl ShardedSequence {
    pub fn len(&self) -> usize {
        self.cache.len(self.id).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Errors unless every rank produced the same value (the caches are driven in lockstep, so
/// anything else is a bug here, not the user's).
fn lockstep<T: PartialEq + std::fmt::Debug>(per_rank: &[T], what: &str) -> Result<()> {
    match per_rank.iter().position(|v| *v != per_rank[0]) {
        None => Ok(()),
        Some(r) => Err(Error::Model(format!(
            "sharded caches out of lockstep: {what} of rank {r} is {:?}, rank 0's {:?}",
            per_rank[r], per_rank[0]
        ))),
    }
}

impl ShardedModel {
    /// Loads `dir` split over `backends.len()` ranks, rank r on `backends[r]` (the same
    /// backend may be given several times: N shards on one device).
    pub fn load(
        dir: &Path,
        backends: Vec<Arc<dyn Backend>>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir, config.fp8.map(|f| f.block))?;
        Self::from_checkpoint(config, &ckpt, backends, progress)
    }

    /// Checks the checkpoint and the split (before anything is uploaded), then uploads each
    /// rank's shard to its device, rank by rank.
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        backends: Vec<Arc<dyn Backend>>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let world = backends.len();
        check_tp(&config, Some(ckpt), world)?;
        check_checkpoint(&config, ckpt)?;
        let total = Self::tensor_count(&config, world);
        let mut done = 0;
        let mut ranks = Vec::with_capacity(world);
        let mut loaded_bytes = 0;
        for (rank, backend) in backends.into_iter().enumerate() {
            let spec = ShardSpec { rank, world };
            let device = Device::new(backend);
            let (weights, bytes) =
                upload_shard(&config, ckpt, &device, spec, rank == 0, &mut |d, _| {
                    progress(done + d, total)
                })?;
            done += shard_tensor_count(&config, spec, rank == 0);
            loaded_bytes += bytes;
            let rank_config = ModelConfig {
                num_attention_heads: config.num_attention_heads / world,
                ..config.clone()
            };
            ranks.push(Model::from_parts(rank_config, device, weights));
        }
        Ok(ShardedModel {
            config,
            ranks,
            collective: Box::new(HostCollective),
            loaded_bytes,
        })
    }

    /// Tensors [`ShardedModel::load`] reads, over all ranks (for progress bars).
    pub fn tensor_count(config: &ModelConfig, world: usize) -> usize {
        (0..world)
            .map(|rank| shard_tensor_count(config, ShardSpec { rank, world }, rank == 0))
            .sum()
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's device: where the logits are.
    pub fn device(&self) -> &Device {
        self.ranks[0].device()
    }

    pub fn collective_name(&self) -> &'static str {
        self.collective.name()
    }

    /// Device bytes of each rank's weights.
    pub fn rank_weight_bytes(&self) -> Vec<u64> {
        self.ranks.iter().map(|m| m.weight_bytes()).collect()
    }

    /// Device bytes of every rank's weights.
    pub fn weight_bytes(&self) -> u64 {
        self.rank_weight_bytes().iter().sum()
    }

    /// Device bytes of every rank's activation pool.
    pub fn pool_bytes(&self) -> u64 {
        self.ranks.iter().map(|m| m.device().pool_bytes()).sum()
    }

    /// Checkpoint bytes read at load, over all ranks.
    pub fn loaded_bytes(&self) -> u64 {
        self.loaded_bytes
    }

    /// A cache per rank for `opts` (every rank's latent and indexer-key caches hold every
    /// token: the latent is shared by all heads).
    pub fn new_cache(&self, opts: CacheOptions) -> Result<ShardedCache> {
        let ranks = self
            .ranks
            .iter()
            .map(|m| m.new_cache(opts))
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardedCache { ranks })
    }

    /// A cache holding one empty sequence.
    pub fn new_sequence(&self, opts: CacheOptions) -> Result<ShardedSequence> {
        let mut cache = self.new_cache(CacheOptions {
            max_seqs: 1,
            ..opts
        })?;
        let id = cache.add_sequence()?;
        Ok(ShardedSequence { cache, id })
    }

    /// [`Model::forward`]: the logits on the host.
    pub fn forward(
        &self,
        seq: &mut ShardedSequence,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_traced(seq, tokens, which, None)
    }

    /// [`Model::forward_on_device`]: the logits on rank 0's device.
    pub fn forward_on_device(
        &self,
        seq: &mut ShardedSequence,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Tensor> {
        let input = [StepInput {
            seq: seq.id,
            tokens,
        }];
        self.step(&mut seq.cache, &input, which, None)
    }

    /// [`Model::forward_traced`]: the trace is rank 0's (every rank takes the same decisions:
    /// the indexer and the router are replicated and see the same residual stream).
    pub fn forward_traced(
        &self,
        seq: &mut ShardedSequence,
        tokens: &[u32],
        which: Logits,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Vec<f32>> {
        let input = [StepInput {
            seq: seq.id,
            tokens,
        }];
        let logits = self.step(&mut seq.cache, &input, which, trace)?;
        self.device().download(&logits)
    }

    /// [`Model::step`] over the ranks: the logits on rank 0's device. On an error no
    /// sequence has changed on any rank.
    pub fn step(
        &self,
        cache: &mut ShardedCache,
        inputs: &[StepInput],
        which: Logits,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        if cache.ranks.len() != self.ranks.len() {
            return Err(Error::arg(
                "sharded cache",
                format!("{} ranks", self.ranks.len()),
                cache.ranks.len(),
            ));
        }
        self.ranks[0].check_inputs(inputs)?;
        let grow: Vec<(SeqId, usize)> = inputs.iter().map(|i| (i.seq, i.tokens.len())).collect();
        let mut reservations = Vec::with_capacity(cache.ranks.len());
        for c in cache.ranks.iter_mut() {
            match c.reserve(&grow) {
                Ok(r) => reservations.push(r),
                Err(e) => {
                    for (c, r) in cache.ranks.iter_mut().zip(reservations) {
                        c.rollback(r);
                    }
                    return Err(e);
                }
            }
        }
        let result = self.step_reserved(cache, inputs, which, trace);
        if result.is_err() {
            for (c, r) in cache.ranks.iter_mut().zip(reservations) {
                c.rollback(r);
            }
        }
        result
    }

    fn step_reserved(
        &self,
        cache: &mut ShardedCache,
        inputs: &[StepInput],
        which: Logits,
        mut trace: Option<&mut ForwardTrace>,
    ) -> Result<Tensor> {
        let mut idx = Vec::with_capacity(self.ranks.len());
        let mut hosts = Vec::with_capacity(self.ranks.len());
        for (m, c) in self.ranks.iter().zip(cache.ranks.iter_mut()) {
            m.device().phase_start()?;
            c.sync_table(m.device())?;
            let host = m.host_index(c, inputs)?;
            idx.push(m.upload_index(&host)?);
            hosts.push(host);
        }
        lockstep(&hosts, "the step's positions and cache slots")?;
        let mut h = self
            .ranks
            .iter()
            .zip(&idx)
            .map(|(m, i)| m.embed(i))
            .collect::<Result<Vec<_>>>()?;
        let mut selected: Vec<Option<Index>> = vec![None; self.ranks.len()];
        for l in 0..self.config.num_hidden_layers {
            let mut outs = Vec::with_capacity(self.ranks.len());
            for (r, m) in self.ranks.iter().enumerate() {
                let out = self.part_output(r, &h[r])?;
                let tr = if r == 0 { trace.as_deref_mut() } else { None };
                m.attention_into(
                    l,
                    &h[r],
                    &out,
                    &mut cache.ranks[r],
                    &idx[r],
                    &mut selected[r],
                    tr,
                )?;
                outs.push(out);
            }
            h = self.reduce(outs)?;
            let mut outs = Vec::with_capacity(self.ranks.len());
            for (r, m) in self.ranks.iter().enumerate() {
                let out = self.part_output(r, &h[r])?;
                let tr = if r == 0 { trace.as_deref_mut() } else { None };
                m.mlp_into(l, &h[r], &out, tr)?;
                outs.push(out);
            }
            h = self.reduce(outs)?;
        }
        let h0 = h.swap_remove(0);
        self.ranks[0].head(h0, &idx[0], which)
    }

    /// Where rank `r` adds its part of a sublayer's output: rank 0 into its residual stream
    /// `h`, the others into zeros — so that the sum over ranks is the next `h`.
    fn part_output(&self, r: usize, h: &Tensor) -> Result<Tensor> {
        if r == 0 {
            Ok(h.clone())
        } else {
            self.ranks[r].device().zeros(h.rows(), h.cols())
        }
    }

    /// Sums the ranks' parts in place: each becomes that rank's next residual stream.
    fn reduce(&self, outs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let pairs: Vec<(&Device, &Tensor)> = self
            .ranks
            .iter()
            .map(|m| m.device())
            .zip(outs.iter())
            .collect();
        self.collective.all_reduce_sum(&pairs)?;
        Ok(outs)
    }
}
