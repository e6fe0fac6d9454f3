//! The conformance suite, written once and run on every backend: by `cargo test`
//! (tests/conformance.rs instantiates it per backend) and by `mla-check`.
//!
//! Every case draws fresh random inputs (the seed is reported so a failure can be replayed),
//! poisons its outputs before the call and checks that every output was written:
//! - [`decode`]: sparse MLA decode (bf16 and hand-built `fp8_ds_mla` rows, multi-token
//!   decode with FlashMLA's lse layout, strided caches) against the float64 reference;
//! - [`formats`]: the cache write (byte-exact against the reference encoder, the rest of the
//!   cache untouched) and the virtual-block-table conversion (exact).

pub mod decode;
pub mod elementwise;
pub mod formats;
pub mod indexer;
pub mod linear;
pub mod model;
pub mod ops;
pub mod routing;
pub mod sharded;
pub mod stress;

pub use decode::{
    decode_cases, make_inputs, run_decode_case, DecodeCase, DecodeData, IndexPattern,
};
pub use formats::{cache_write_cases, vbt_cases, CacheWriteCase, VbtCase};

use crate::runtime::Backend;
use crate::Result;

/// One conformance case: a name and a check on a backend. Every kernel's cases join the one
/// list in [`all_cases`], so `cargo test` and `mla-check` run the same suite everywhere.
pub trait Case: Send + Sync {
    fn name(&self) -> String;
    /// Run on `backend` with inputs drawn from `seed`, and judge against the reference.
    fn run(&self, backend: &dyn Backend, seed: u64) -> Result<Outcome>;
}

/// Every conformance case of every kernel.
pub fn all_cases() -> Vec<Box<dyn Case>> {
    let mut cases: Vec<Box<dyn Case>> = Vec::new();
    for c in decode_cases() {
        cases.push(Box::new(c));
    }
    for c in cache_write_cases() {
        cases.push(Box::new(c));
    }
    for c in vbt_cases() {
        cases.push(Box::new(c));
    }
    for c in model_op_cases() {
        cases.push(Box::new(c));
    }
    for c in linear::vendor_gemm_cases() {
        cases.push(Box::new(c));
    }
    cases
}

/// The cases of every model operation (linear layers, norms, RoPE, routing, top-k, ...).
pub fn model_op_cases() -> Vec<ops::OpCase> {
    let mut v = Vec::new();
    v.extend(linear::linear_cases());
    v.extend(elementwise::elementwise_cases());
    v.extend(indexer::indexer_cases());
    v.extend(routing::routing_cases());
    v
}

/// The result of one case on one backend.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub case: String,
    pub seed: u64,
    /// Relative L2 error of the main output vs the reference (0 for byte-exact checks).
    pub rel_l2: f64,
    /// Largest absolute element error of the main output (byte-exact checks: the number of
    /// bytes that differ).
    pub max_abs: f64,
    /// Largest lse error (decode cases; 0 elsewhere).
    pub lse_err: f64,
    /// What the backend chose, for the report (e.g. `splits 4`).
    pub detail: String,
    /// Wall time of the call including the download of its output.
    pub seconds: f64,
    /// Empty when the case passed; otherwise what failed.
    pub failures: Vec<String>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// `x <= tol`, false for NaN: a NaN error never passes.
pub(crate) fn within(x: f64, tol: f64) -> bool {
    x <= tol
}

pub(crate) fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(crate) fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
