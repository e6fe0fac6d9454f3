//! Plain-Rust references of every kernel, in float64 where the kernel accumulates in f32.
//! Each function documents the shapes it takes; conventions live in [`crate::mla`].

pub mod cache;
pub mod linear;
pub mod moe_route;
pub mod norm;
pub mod numerics;
pub mod rope;
pub mod sampler;
pub mod sparse_mla;
pub mod tensor;
pub mod vbt;
