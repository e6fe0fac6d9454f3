//! GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) decode.
//!
//! - [`config`]: HF `config.json`, read and checked (nothing guessed);
//! - [`weights`]: safetensors checkpoints (single or sharded, mmapped; bf16 / f16 / f32 /
//!   block-scaled FP8);
//! - [`params`]: the tensors a config implies, checked before any compute, then put on the
//!   device in their checkpoint dtype;
//! - [`device`]: the model's handle on a runtime backend (pooled tensors, the model ops);
//! - [`cache`]: the paged latent and indexer-key caches shared by the sequences, the block table;
//! - [`forward`]: the forward pass, written once over [`device::Device`], for any number of
//!   sequences per step;
//! - [`shard`]: the same forward split over N ranks (heads, MLP width, experts), summed
//!   through a collective;
//! - [`rope`], [`sampler`], [`tokenizer`]: the pieces around it.
//!
//! The model runs on every runtime backend ([`crate::runtime::Backend`]): the CPU reference
//! (float64 per op), wgpu and CUDA — one stack, one door to the kernels.

pub mod cache;
pub mod config;
pub mod device;
pub mod forward;
pub mod memory;
pub mod params;
pub mod rope;
pub mod sampler;
pub mod shard;
pub mod synthetic;
#[cfg(feature = "cli")]
pub mod tokenizer;
pub mod weights;

pub use cache::{CacheOptions, KvCache, SeqId};
pub use config::{Arch, ModelConfig};
pub use forward::{ForwardTrace, Logits, Model, Sequence, StepInput};
pub use sampler::{Sampler, SamplerConfig};
pub use shard::{ShardedCache, ShardedModel, ShardedSequence};
#[cfg(feature = "cli")]
pub use tokenizer::TextTokenizer;
