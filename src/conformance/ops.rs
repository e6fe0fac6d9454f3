//! The conformance harness of the model operations ([`crate::runtime::Op`]), and the cases
//! of each op.
//!
//! A case draws fresh random inputs, gives every buffer its initial bytes (inputs; outputs
//! poisoned with NaN — or, for ops that add into an output, random values inside the view
//! and NaN around it), runs the op on the backend, and runs the op's float64 reference on
//! host copies of the same bytes. Outputs are compared element by element: where the
//! reference leaves NaN (bytes the op must not touch) the backend's bytes must be identical;
//! everywhere else the values are compared (relative L2 and max |error| for f32, exactly for
//! integers), so an output element the kernel never wrote (still NaN) fails.

use super::{Case, Outcome};
use crate::runtime::{Backend, HostBuffers, Op};
use crate::util::Rng;
use crate::{Error, Result};
use std::time::Instant;

/// How an output buffer is compared with the reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compare {
    /// f32 values: relative L2 (over the elements the reference computed) at most `rel_l2`.
    F32 { rel_l2: f64 },
    /// Byte for byte.
    Exact,
}

/// One instance of an op with its buffers' initial bytes.
pub struct Instance {
    pub op: Box<dyn Op>,
    /// Initial bytes of every binding, in any order.
    pub buffers: Vec<(&'static str, Vec<u8>)>,
    /// The outputs to compare.
    pub outputs: Vec<(&'static str, Compare)>,
    /// A note for the report (e.g. the shape).
    pub detail: String,
}

type Build = dyn Fn(&mut Rng) -> Result<Instance> + Send + Sync;

/// A conformance case of a model op.
pub struct OpCase {
    pub name: String,
    pub build: Box<Build>,
}

impl OpCase {
    pub fn new(
        name: impl Into<String>,
        build: impl Fn(&mut Rng) -> Result<Instance> + Send + Sync + 'static,
    ) -> Self {
        OpCase {
            name: name.into(),
            build: Box::new(build),
        }
    }
}

impl Case for OpCase {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn run(&self, backend: &dyn Backend, seed: u64) -> Result<Outcome> {
        let mut rng = Rng::new(seed);
        let inst = (self.build)(&mut rng)?;
        run_instance(backend, &self.name, seed, &inst)
    }
}

/// Runs one instance on `backend` and judges it against the op's reference.
pub fn run_instance(
    backend: &dyn Backend,
    name: &str,
    seed: u64,
    inst: &Instance,
) -> Result<Outcome> {
    let mut uploaded = Vec::with_capacity(inst.buffers.len());
    for (n, bytes) in &inst.buffers {
        uploaded.push((*n, backend.upload(bytes)?));
    }
    let named: Vec<(&str, &crate::runtime::Buffer)> =
        uploaded.iter().map(|(n, b)| (*n, b)).collect();
    let t0 = Instant::now();
    backend.run_op(inst.op.as_ref(), &named)?;
    let mut got = Vec::new();
    for (n, _) in &inst.outputs {
        let b = named
            .iter()
            .find(|(m, _)| m == n)
            .ok_or_else(|| Error::arg(*n, "a buffer of the instance", "none"))?;
        got.push(backend.download(b.1)?);
    }
    let seconds = t0.elapsed().as_secs_f64();

    // The reference on host copies of the same initial bytes.
    let mut host: Vec<(&'static str, Vec<u8>)> = inst.buffers.clone();
    let bindings = inst.op.bindings();
    {
        let mut hb = HostBuffers::new();
        for (n, bytes) in host.iter_mut() {
            if bindings.iter().any(|b| b.name == *n && b.written) {
                hb.add_write(n, bytes.as_mut_slice());
            } else {
                hb.add_read(n, bytes.as_slice());
            }
        }
        inst.op.reference(&mut hb)?;
    }

    let mut outcome = Outcome {
        case: name.to_string(),
        seed,
        rel_l2: 0.0,
        max_abs: 0.0,
        lse_err: 0.0,
        detail: inst.detail.clone(),
        seconds,
        failures: Vec::new(),
    };
    for ((n, cmp), actual) in inst.outputs.iter().zip(&got) {
        let expected = &host
            .iter()
            .find(|(m, _)| m == n)
            .ok_or_else(|| Error::arg(*n, "a buffer of the instance", "none"))?
            .1;
        if expected.len() != actual.len() {
            outcome.failures.push(format!(
                "{n}: {} bytes back, {} expected",
                actual.len(),
                expected.len()
            ));
            continue;
        }
        match cmp {
            Compare::Exact => {
                let diff = expected.iter().zip(actual).filter(|(a, b)| a != b).count();
                outcome.max_abs = outcome.max_abs.max(diff as f64);
                if diff > 0 {
                    let first = expected.iter().zip(actual).position(|(a, b)| a != b);
                    outcome.failures.push(format!(
                        "{n}: {diff} bytes differ from the reference (first at byte {first:?})"
                    ));
                }
            }
            Compare::F32 { rel_l2 } => {
                let c = compare_f32(expected, actual);
                outcome.rel_l2 = outcome.rel_l2.max(c.rel_l2);
                outcome.max_abs = outcome.max_abs.max(c.max_abs);
                if c.untouched_changed > 0 {
                    outcome.failures.push(format!(
                        "{n}: {} elements outside the op's outputs changed",
                        c.untouched_changed
                    ));
                }
                if c.not_finite > 0 {
                    outcome.failures.push(format!(
                        "{n}: {} outputs are NaN or infinite where the reference is finite (unwritten?)",
                        c.not_finite
                    ));
                }
                if !super::within(c.rel_l2, *rel_l2) {
                    outcome.failures.push(format!(
                        "{n}: relative L2 error {:.3e} > {rel_l2:.0e}",
                        c.rel_l2
                    ));
                }
            }
        }
    }
    Ok(outcome)
}

/// What [`compare_f32`] found.
#[derive(Clone, Copy, Debug, Default)]
pub struct F32Comparison {
    pub rel_l2: f64,
    pub max_abs: f64,
    /// Elements the reference left NaN (untouched) whose bits changed.
    pub untouched_changed: usize,
    /// Elements the reference computed (finite) that came back NaN or infinite.
    pub not_finite: usize,
}

/// Element-wise comparison of two f32 buffers, the first the reference (see the module doc).
/// Reference infinities must be matched exactly.
pub fn compare_f32(expected: &[u8], actual: &[u8]) -> F32Comparison {
    let mut c = F32Comparison::default();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (e, a) in expected.chunks_exact(4).zip(actual.chunks_exact(4)) {
        let (eb, ab) = (
            u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
            u32::from_le_bytes([a[0], a[1], a[2], a[3]]),
        );
        let (ev, av) = (f32::from_bits(eb) as f64, f32::from_bits(ab) as f64);
        if ev.is_nan() {
            if eb != ab {
                c.untouched_changed += 1;
            }
            continue;
        }
        if ev.is_infinite() {
            if ev != av {
                c.not_finite += 1;
            }
            continue;
        }
        if !av.is_finite() {
            c.not_finite += 1;
            continue;
        }
        num += (av - ev) * (av - ev);
        den += ev * ev;
        c.max_abs = c.max_abs.max((av - ev).abs());
    }
    c.rel_l2 = if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    if c.not_finite > 0 {
        c.rel_l2 = f64::NAN;
    }
    c
}

// ---------------------------------------------------------------- input helpers

/// A quiet NaN, the poison of outputs.
pub const POISON: f32 = f32::NAN;

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| crate::reference::numerics::bf16_bits(*x).to_le_bytes())
        .collect()
}

/// `n` normal values times `scale`.
pub fn normals(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// A buffer of `len` elements: NaN everywhere except the view's elements, which are random
/// (`fill`) — the input of an op that reads the view, or the initial output of one that adds
/// into it.
pub fn view_buffer(
    rng: &mut Rng,
    len: usize,
    view: &crate::kernels::view::View,
    scale: f32,
) -> Vec<f32> {
    let mut v = vec![POISON; len];
    for r in 0..view.rows as u64 {
        for c in 0..view.cols as u64 {
            v[view.index(r, c)] = rng.normal() * scale;
        }
    }
    v
}
