//! GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) decode.
//!
//! - [`config`]: HF `config.json`, read and checked (nothing guessed);
//! - [`weights`]: safetensors checkpoints (single or sharded, mmapped; bf16 / f16 / f32 /
//!   block-scaled FP8);
//! - [`params`]: the tensors a config implies, checked before any compute, then uploaded;
//! - [`backend`]: the operations the forward needs, as a trait;
//! - [`forward`]: the forward pass, written once over that trait, with the paged caches;
//! - [`cpu`]: the CPU backend (f32, sparse MLA through the kernel reference);
//! - [`rope`], [`sampler`], [`tokenizer`]: the pieces around it.

pub mod backend;
pub mod config;
pub mod cpu;
pub mod forward;
pub mod params;
pub mod rope;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

pub use backend::ModelBackend;
pub use config::{Arch, ModelConfig};
pub use cpu::CpuBackend;
pub use forward::{CacheOptions, ForwardTrace, Logits, Model, Sequence};
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::TextTokenizer;
