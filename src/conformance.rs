//! The conformance suite, written once and run on every backend: by `cargo test`
//! (tests/conformance.rs instantiates it per backend) and by `mla-check`.
//!
//! Every case draws fresh random inputs (the seed is reported so a failure can be replayed),
//! fills every cache row that no valid index references with NaN, poisons the outputs with
//! NaN before the call, and compares with the float64 reference:
//! - `out`: relative L2 error ≤ 1e-2 (a bf16 path, DESIGN §3); on the scalar (f32) lowering
//!   every element must also be within one bf16 rounding step of the reference;
//! - `lse`: absolute error ≤ 1e-3; rows with no valid index: `out == 0` and `lse == +inf`;
//! - NaN anywhere fails.

use crate::mla::{CacheFormat, DecodeShape, MlaDims};
use crate::reference::numerics::{bf16_bits, bf16_from_bits, round_bf16};
use crate::reference::sparse_mla::{decode, slot_of, DecodeInputs};
use crate::runtime::{Backend, DecodeBuffers, DecodeOptions};
use crate::util::{rel_l2, Rng};
use crate::Result;
use std::collections::HashSet;

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
    cases
}

impl Case for DecodeCase {
    fn name(&self) -> String {
        format!("decode/{}", self.name)
    }

    fn run(&self, backend: &dyn Backend, seed: u64) -> Result<Outcome> {
        run_decode_case(backend, self, seed)
    }
}

/// How a case fills its index lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexPattern {
    /// Distinct valid slots.
    Valid,
    /// A mix: valid, −1, other negatives, ≥ num_slots, and duplicates.
    Mixed,
    /// Every other token has no valid index at all.
    SomeRowsEmpty,
}

/// One conformance case.
#[derive(Clone, Debug)]
pub struct DecodeCase {
    pub name: String,
    pub tokens: u32,
    pub heads: u32,
    pub topk: u32,
    pub page_size: u32,
    pub num_pages: u32,
    pub format: CacheFormat,
    pub pattern: IndexPattern,
    pub topk_length: bool,
    pub splits: Option<u32>,
}

impl DecodeCase {
    #[allow(clippy::too_many_arguments)]
    fn new(
        tokens: u32,
        heads: u32,
        topk: u32,
        page_size: u32,
        num_pages: u32,
        pattern: IndexPattern,
        topk_length: bool,
        splits: Option<u32>,
    ) -> Self {
        let mut name = format!("t{tokens}_h{heads}_k{topk}_p{page_size}");
        match pattern {
            IndexPattern::Valid => {}
            IndexPattern::Mixed => name.push_str("_mixed"),
            IndexPattern::SomeRowsEmpty => name.push_str("_empty_rows"),
        }
        if topk_length {
            name.push_str("_len");
        }
        if let Some(s) = splits {
            name.push_str(&format!("_s{s}"));
        }
        DecodeCase {
            name,
            tokens,
            heads,
            topk,
            page_size,
            num_pages,
            format: CacheFormat::Bf16,
            pattern,
            topk_length,
            splits,
        }
    }

    pub fn shape(&self, scale: f32) -> DecodeShape {
        DecodeShape {
            tokens: self.tokens,
            heads: self.heads,
            topk: self.topk,
            num_pages: self.num_pages,
            page_size: self.page_size,
            dims: MlaDims::PRODUCTION,
            format: self.format,
            scale,
            has_topk_length: self.topk_length,
        }
    }
}

/// The standard sparse-decode cases: H ∈ {1, 3, 8, 16, 64, 128}, topk ∈ {1, 7, 64, 2048},
/// page sizes {1, 16, 64}, T up to 64, invalid and duplicate indices, empty rows,
/// `topk_length`, forced and heuristic splits. Sized so the whole suite runs in seconds on
/// lavapipe.
pub fn decode_cases() -> Vec<DecodeCase> {
    use IndexPattern::*;
    vec![
        DecodeCase::new(4, 1, 1, 1, 64, Valid, false, None),
        DecodeCase::new(5, 3, 7, 16, 4, Mixed, false, None),
        DecodeCase::new(3, 3, 7, 1, 50, Mixed, true, None),
        DecodeCase::new(16, 8, 64, 64, 4, Mixed, false, None),
        DecodeCase::new(8, 16, 64, 16, 16, Mixed, true, None),
        DecodeCase::new(64, 8, 7, 16, 8, Mixed, false, None),
        DecodeCase::new(64, 1, 64, 64, 2, SomeRowsEmpty, false, None),
        DecodeCase::new(6, 16, 64, 1, 300, SomeRowsEmpty, true, Some(3)),
        DecodeCase::new(4, 64, 64, 16, 8, Mixed, false, None),
        DecodeCase::new(2, 128, 64, 64, 2, Mixed, false, Some(1)),
        DecodeCase::new(2, 8, 2048, 64, 40, Mixed, false, None),
        DecodeCase::new(1, 128, 2048, 64, 40, Valid, false, None),
        DecodeCase::new(2, 16, 2048, 16, 160, Mixed, true, Some(7)),
        DecodeCase::new(3, 3, 2048, 1, 3000, Valid, false, Some(1)),
    ]
}

/// Inputs of one case, on the host.
pub struct DecodeData {
    pub shape: DecodeShape,
    pub q: Vec<f32>,
    pub cache: Vec<u8>,
    pub indices: Vec<i32>,
    pub topk_length: Option<Vec<i32>>,
}

/// Draw a case's inputs from `seed`. Unreferenced cache rows hold NaN.
pub fn make_inputs(case: &DecodeCase, seed: u64) -> DecodeData {
    let mut rng = Rng::new(seed);
    let scale = rng.uniform(0.03, 0.1);
    let shape = case.shape(scale);
    let (t_n, k_n) = (case.tokens as usize, case.topk as usize);
    let slots = shape.num_slots();
    let q: Vec<f32> = (0..shape.q_elems())
        .map(|_| round_bf16(rng.normal()))
        .collect();
    let mut indices = vec![-1i32; t_n * k_n];
    for t in 0..t_n {
        let row = &mut indices[t * k_n..(t + 1) * k_n];
        let distinct = rng.distinct(slots, k_n.min(slots as usize));
        for (j, v) in row.iter_mut().enumerate() {
            *v = distinct.get(j).map(|&s| s as i32).unwrap_or(-1);
        }
        match case.pattern {
            IndexPattern::Valid => {}
            IndexPattern::Mixed => {
                for j in 0..k_n {
                    match rng.below(8) {
                        0 => row[j] = -1,
                        1 => row[j] = -(1 + rng.below(1 << 20) as i32),
                        2 => row[j] = (slots + rng.below(1000)) as i32,
                        3 if j > 0 => row[j] = row[rng.below(j as u64) as usize],
                        _ => {}
                    }
                }
            }
            IndexPattern::SomeRowsEmpty => {
                if t % 2 == 1 {
                    for v in row.iter_mut() {
                        *v = if rng.below(2) == 0 {
                            -1
                        } else {
                            slots as i32 + 7
                        };
                    }
                }
            }
        }
    }
    let topk_length = case.topk_length.then(|| {
        (0..t_n)
            .map(|t| match t % 4 {
                0 => 0,
                1 => k_n as i32,
                _ => rng.below(k_n as u64 + 1) as i32,
            })
            .collect::<Vec<i32>>()
    });
    // Random rows, then NaN in every row no valid entry references.
    let row_bytes = shape.row_bytes() as usize;
    let mut cache = Vec::with_capacity(slots as usize * row_bytes);
    for _ in 0..slots as usize * row_bytes / 2 {
        cache.extend_from_slice(&bf16_bits(rng.normal()).to_le_bytes());
    }
    let data = DecodeData {
        shape,
        q,
        cache,
        indices,
        topk_length,
    };
    let inputs = data.inputs();
    let mut used = HashSet::new();
    for t in 0..t_n {
        for j in 0..k_n {
            if let Some(s) = slot_of(&inputs, t, j) {
                used.insert(s);
            }
        }
    }
    let mut cache = data.cache.clone();
    for s in 0..slots as usize {
        if !used.contains(&s) {
            for c in cache[s * row_bytes..(s + 1) * row_bytes].chunks_exact_mut(2) {
                c.copy_from_slice(&0x7FC0u16.to_le_bytes());
            }
        }
    }
    DecodeData { cache, ..data }
}

impl DecodeData {
    pub fn inputs(&self) -> DecodeInputs<'_> {
        DecodeInputs {
            shape: self.shape,
            q: &self.q,
            cache: &self.cache,
            indices: &self.indices,
            topk_length: self.topk_length.as_deref(),
        }
    }
}

/// The result of one case on one backend.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub case: String,
    pub seed: u64,
    /// Relative L2 error of the main output vs the reference (0 for byte-exact checks).
    pub rel_l2: f64,
    /// Largest absolute element error of the main output.
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

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Run one case on a backend and judge it against the float64 reference.
pub fn run_decode_case(backend: &dyn Backend, case: &DecodeCase, seed: u64) -> Result<Outcome> {
    let data = make_inputs(case, seed);
    let shape = data.shape;
    let reference = decode(&data.inputs());
    let q: Vec<u8> = data
        .q
        .iter()
        .flat_map(|&v| bf16_bits(v).to_le_bytes())
        .collect();
    let qb = backend.upload(&q)?;
    let cb = backend.upload(&data.cache)?;
    let ib = backend.upload(&i32_bytes(&data.indices))?;
    let tl = match &data.topk_length {
        Some(v) => Some(backend.upload(&i32_bytes(v))?),
        None => None,
    };
    // Poison: all-ones bytes are NaN in both bf16 and f32.
    let ob = backend.upload(&vec![0xFF; shape.out_elems() as usize * 2])?;
    let lb = backend.upload(&vec![0xFF; (shape.tokens * shape.heads) as usize * 4])?;
    let start = std::time::Instant::now();
    let run = backend.sparse_mla_decode(
        &shape,
        &DecodeBuffers {
            q: &qb,
            kv_cache: &cb,
            indices: &ib,
            topk_length: tl.as_ref(),
            out: &ob,
            lse: &lb,
        },
        &DecodeOptions {
            splits: case.splits,
        },
    )?;
    let out_bytes = backend.download(&ob)?;
    let seconds = start.elapsed().as_secs_f64();
    let lse_bytes = backend.download(&lb)?;
    let out: Vec<f64> = out_bytes
        .chunks_exact(2)
        .map(|c| bf16_from_bits(u16::from_le_bytes([c[0], c[1]])) as f64)
        .collect();
    let lse: Vec<f64> = lse_bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
        .collect();

    let mut failures = Vec::new();
    let nan = out.iter().filter(|v| v.is_nan()).count();
    if nan > 0 {
        failures.push(format!("{nan} NaN (unwritten or poisoned) output elements"));
    }
    let rel = rel_l2(&out, &reference.out);
    if !(rel <= 1e-2) {
        failures.push(format!("out rel L2 {rel:.3e} > 1e-2"));
    }
    let mut max_abs = 0.0f64;
    // On an f32 path (P kept in f32) every element is the f32 result rounded once to bf16.
    let strict = !run.p_bf16;
    let mut off_by_more = 0;
    for (o, r) in out.iter().zip(&reference.out) {
        let d = (o - r).abs();
        if d > max_abs || d.is_nan() {
            max_abs = d;
        }
        // one bf16 ulp of the value (ulp > |r|·2^-8), plus slack for f32 accumulation
        let step = r.abs() / 256.0 + 1e-5;
        if strict && !(d <= step) {
            off_by_more += 1;
        }
    }
    if off_by_more > 0 {
        failures.push(format!(
            "{off_by_more} output elements more than one bf16 step from the reference"
        ));
    }
    let mut lse_err = 0.0f64;
    for (i, (l, r)) in lse.iter().zip(&reference.lse).enumerate() {
        if r.is_infinite() {
            let dv = shape.dims.d_v() as usize;
            if *l != f64::INFINITY {
                failures.push(format!("row {i}: no valid index, lse {l} (want +inf)"));
            } else if out[i * dv..(i + 1) * dv].iter().any(|&v| v != 0.0) {
                failures.push(format!("row {i}: no valid index, out not all zero"));
            }
        } else {
            let e = (l - r).abs();
            if !(e <= 1e-3) {
                failures.push(format!("row {i}: lse {l} vs {r} (error {e:.3e} > 1e-3)"));
            }
            lse_err = lse_err.max(if e.is_nan() { f64::INFINITY } else { e });
        }
    }
    failures.truncate(8);
    Ok(Outcome {
        case: format!("decode/{}", case.name),
        seed,
        rel_l2: rel,
        max_abs,
        lse_err,
        detail: format!("splits {}", run.splits),
        seconds,
        failures,
    })
}
