//! sparse-mla: sparse MLA decode (DeepSeek-V3.2, GLM-5) over a virtual block table, written
//! once in a small kernel description language ([`kir`]) and printed as WGSL (run through
//! wgpu) and as self-contained CUDA C (compiled at run time by NVRTC).
//!
//! Layout, bottom up:
//! - [`kir`]: the kernel description language (scalar IR + tile ops) and its lowerings;
//! - [`emit`]: WGSL and CUDA C printers of lowered kir (they know nothing about MLA);
//! - [`kernels`]: each kernel described once (sparse MLA decode split + combine, ...);
//! - [`reference`](mod@reference): plain-Rust float64 references of every kernel;
//! - [`runtime`]: CPU reference, wgpu and CUDA behind one small trait;
//! - [`model`]: GLM-5 / DeepSeek-V3.2 forward pass;
//! - [`chat`]: chat templates (Jinja, from the model's tokenizer_config.json);
//! - [`serve`]: `mla-serve`, the OpenAI-compatible server with continuous batching;
//! - [`cli`]: what the model binaries share (model directory, device, loading).

#[cfg(feature = "cli")]
pub mod chat;
#[cfg(feature = "cli")]
pub mod cli;
pub mod conformance;
pub mod emit;
pub mod error;
pub mod export;
pub mod kernels;
pub mod kir;
pub mod mla;
pub mod model;
pub mod reference;
pub mod runtime;
#[cfg(feature = "serve")]
pub mod serve;
pub mod testing;
pub mod util;

pub use error::{Error, Result};
