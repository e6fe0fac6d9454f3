//! Sparse MLA decode cases.
//!
//! Every case fills every cache row (and every stride gap) that no valid index references
//! with NaN, poisons the outputs with NaN before the call, and compares with the float64
//! reference of the (dequantised) cache:
//! - `out`: relative L2 error ≤ 1e-2 (a bf16 path, docs/math.md); on the scalar (f32) lowering
//!   every element must also be within one bf16 rounding step of the reference;
//! - `lse`: absolute error ≤ 1e-3; rows with no valid index: `out == 0` and `lse == +inf`;
//! - NaN anywhere fails.
//!
//! `fp8_ds_mla` rows are built by hand from the published layout (random e4m3 bytes, f32
//! scales of either flavour, bf16 rope), not by the encoder, so the decode is checked
//! independently of the cache write.

use super::{i32_bytes, within, Case, Outcome};
use crate::mla::{
    CacheFormat, CacheGeometry, CacheStrides, DecodeLayout, DecodeShape, LseLayout, MlaDims,
    ScaleFlavour, FP8_TILE,
};
use crate::reference::cache::decode_row;
use crate::reference::numerics::{bf16_bits, bf16_from_bits, round_bf16};
use crate::reference::sparse_mla::{decode, slot_of, DecodeInputs};
use crate::runtime::{Backend, DecodeBuffers, DecodeOptions};
use crate::util::{rel_l2, Rng};
use crate::Result;
use std::collections::HashSet;

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
    /// Distinct valid slots in the order of head 0's score, lowest first, with q times 32:
    /// that row's running max grows at almost every step, by a hundred nats or more over a
    /// long list — far past where P = exp(s − m) would overflow (f16 at 11, f32 at 88) if a
    /// kernel kept a stale max.
    Rising,
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
    /// How the hand-built fp8 rows' scales are drawn.
    pub flavour: ScaleFlavour,
    pub pattern: IndexPattern,
    /// Pass `topk_length` (including values above topk and negative ones, which the
    /// kernels clamp to `[0, topk]`).
    pub topk_length: bool,
    pub splits: Option<u32>,
    /// Multi-token decode: `tokens = batch · s_q`, lse written in FlashMLA's
    /// `[batch, heads, s_q]` layout. 1: one token per request, lse `[tokens, heads]`.
    pub s_q: u32,
    /// Bytes of padding after each cache row (0: packed). Pages are padded too when it is not
    /// 0. 16 keeps every row 16-byte aligned; 4 (a stride of whole words, what the kernels
    /// accept) leaves most rows off 16 bytes, so the tensor-core kernels take their word-wise
    /// copies instead of 16-byte and bulk ones.
    pub stride_pad: u32,
    /// fp8_ds_mla scales drawn from another band than the flavour's.
    pub band: ScaleBand,
    /// How q's values are drawn.
    pub q_range: QRange,
}

/// How a case's q is drawn (the tensor-core kernels hold q scaled by a power of two per warp,
/// chosen from its largest |q|: these reach the ends of that choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QRange {
    /// Standard normal.
    Normal,
    /// The latent part (the first 512 of 576) all zero, the rope part normal times 8: the
    /// largest |q| of the latent is 0.
    LatentZero,
    /// Each head's q normal times its own 2^u, u uniform in [-12, 2]: heads of one warp
    /// 14 binades apart. Gains stay small: with 2^6 and the wide scale band lse reached
    /// ~1100, where f32 cannot hold the suite's 1e-3 absolute tolerance (a stress case).
    HeadsWide,
}

/// Where a case's hand-built fp8_ds_mla scales lie (the flavours keep them in a narrow band
/// near 2^-8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleBand {
    /// The flavour's own.
    Flavour,
    /// Log-uniform over 2^-14 .. 2^4 (18 binades, above 1 too), the softmax scale / 256 so
    /// the scores stay moderate: the f16 `P · V` of the tensor-core kernels lowers its
    /// running scale within a call.
    Wide,
    /// Log-uniform over 2^-36 .. 2^-30: that running scale rises from its start.
    Tiny,
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
        DecodeCase {
            name: String::new(),
            tokens,
            heads,
            topk,
            page_size,
            num_pages,
            format: CacheFormat::Bf16,
            flavour: ScaleFlavour::Arbitrary,
            pattern,
            topk_length,
            splits,
            s_q: 1,
            stride_pad: 0,
            band: ScaleBand::Flavour,
            q_range: QRange::Normal,
        }
        .named()
    }

    fn fp8(self, flavour: ScaleFlavour) -> Self {
        DecodeCase {
            format: CacheFormat::Fp8DsMla,
            flavour,
            ..self
        }
        .named()
    }

    fn mtp(self, s_q: u32) -> Self {
        DecodeCase { s_q, ..self }.named()
    }

    fn band(self, band: ScaleBand) -> Self {
        DecodeCase { band, ..self }.named()
    }

    fn q_range(self, q_range: QRange) -> Self {
        DecodeCase { q_range, ..self }.named()
    }

    fn strided(self, stride_pad: u32) -> Self {
        DecodeCase { stride_pad, ..self }.named()
    }

    /// The name's part for the strides: none when packed, `_strided` for rows padded by 16
    /// bytes, `_strided{pad}` otherwise (the decode cases' and the stress cases' names).
    pub(crate) fn stride_tag(&self) -> String {
        match self.stride_pad {
            0 => String::new(),
            16 => "_strided".to_string(),
            pad => format!("_strided{pad}"),
        }
    }

    fn named(mut self) -> Self {
        let mut name = String::new();
        if self.format == CacheFormat::Fp8DsMla {
            name.push_str(match self.flavour {
                ScaleFlavour::Pow2 => "fp8_pow2_",
                ScaleFlavour::Arbitrary => "fp8_",
            });
        }
        name.push_str(&format!(
            "t{}_h{}_k{}_p{}",
            self.tokens, self.heads, self.topk, self.page_size
        ));
        if self.s_q > 1 {
            name.push_str(&format!("_sq{}", self.s_q));
        }
        match self.pattern {
            IndexPattern::Valid => {}
            IndexPattern::Mixed => name.push_str("_mixed"),
            IndexPattern::SomeRowsEmpty => name.push_str("_empty_rows"),
            IndexPattern::Rising => name.push_str("_rising"),
        }
        if self.topk_length {
            name.push_str("_len");
        }
        name.push_str(&self.stride_tag());
        name.push_str(match self.band {
            ScaleBand::Flavour => "",
            ScaleBand::Wide => "_wide",
            ScaleBand::Tiny => "_tiny",
        });
        name.push_str(match self.q_range {
            QRange::Normal => "",
            QRange::LatentZero => "_q_latent0",
            QRange::HeadsWide => "_q_wide",
        });
        if let Some(s) = self.splits {
            name.push_str(&format!("_s{s}"));
        }
        self.name = name;
        self
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

    /// The buffer layout of the case: strides padded by `stride_pad`, FlashMLA's lse layout
    /// when `s_q > 1`.
    pub fn layout(&self) -> DecodeLayout {
        let row_bytes = self.format.row_bytes(MlaDims::PRODUCTION) as u64;
        let cache = if self.stride_pad > 0 {
            let row = row_bytes + self.stride_pad as u64;
            CacheStrides {
                row,
                page: row * self.page_size as u64 + 64,
            }
        } else {
            CacheStrides::default()
        };
        let lse = if self.s_q > 1 {
            LseLayout::BatchHeadsSq { s_q: self.s_q }
        } else {
            LseLayout::TokensHeads
        };
        DecodeLayout { cache, lse }
    }
}

/// The standard sparse-decode cases: H ∈ {1, 3, 8, 16, 64, 128}, topk ∈ {1, 7, 64, 2048},
/// page sizes {1, 16, 64}, T up to 64, invalid and duplicate indices, empty rows,
/// `topk_length`, forced and heuristic splits; the same for hand-built `fp8_ds_mla` rows
/// with both scale flavours; multi-token decode with s_q = 2 (FlashMLA's lse layout, one
/// split and several); padded cache strides. Sized so the whole suite runs in seconds on
/// lavapipe.
pub fn decode_cases() -> Vec<DecodeCase> {
    use IndexPattern::*;
    use ScaleFlavour::*;
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
        // as many splits as the config allows (512 portable, more than a combine workgroup's
        // threads: each thread folds several splits' lse)
        DecodeCase::new(2, 8, 2048, 64, 40, Mixed, true, Some(512)),
        // the combine's split groups: 4 (9 rows, 4 splits) and 1 (1024 rows: a workgroup per row)
        DecodeCase::new(3, 3, 64, 16, 8, Mixed, true, Some(4)),
        DecodeCase::new(64, 16, 64, 16, 16, Mixed, false, Some(2)),
        // one token's 32 splits merged in the kernel where a backend merges (32 workgroups
        // meet; token 0's topk_length would be 0, so none here)
        DecodeCase::new(1, 16, 2048, 64, 40, Mixed, false, Some(32)),
        // a bf16 call of more than 16 heads small enough for v6 in 16-head blocks
        // (DecodeConfig::tensor_core_v6_narrow), its last block half full
        DecodeCase::new(1, 40, 2048, 64, 40, Mixed, false, None),
        // bf16 wide calls (12 blocks of 64 heads: DecodeConfig::is_wide_call on up to 132
        // SMs): v7 in 64-head blocks, four warp groups over one ring
        DecodeCase::new(12, 64, 256, 16, 200, Mixed, true, None),
        DecodeCase::new(6, 128, 512, 64, 40, Mixed, false, None),
        // fp8_ds_mla rows
        DecodeCase::new(4, 1, 1, 1, 64, Valid, false, None).fp8(Pow2),
        DecodeCase::new(5, 3, 7, 16, 4, Mixed, false, None).fp8(Arbitrary),
        DecodeCase::new(8, 16, 64, 16, 16, Mixed, true, None).fp8(Pow2),
        DecodeCase::new(6, 16, 64, 1, 300, SomeRowsEmpty, true, Some(3)).fp8(Arbitrary),
        DecodeCase::new(2, 128, 64, 64, 2, Mixed, false, Some(1)).fp8(Arbitrary),
        DecodeCase::new(2, 8, 2048, 64, 40, Mixed, false, None).fp8(Arbitrary),
        DecodeCase::new(1, 64, 2048, 64, 40, Valid, false, None).fp8(Pow2),
        // an fp8_ds_mla narrow call of 8 16-head blocks: its large-batch kernel (64-row steps)
        // in 16-head blocks (DecodeConfig::tensor_core_narrow_wide)
        DecodeCase::new(1, 128, 2048, 64, 40, Mixed, false, None).fp8(Arbitrary),
        // scales far from the flavours' band: the tensor-core kernels' f16 P . V changes
        // its running scale within a call (down, and up)
        DecodeCase::new(2, 16, 2048, 64, 40, Mixed, false, None)
            .fp8(Arbitrary)
            .band(ScaleBand::Wide),
        DecodeCase::new(3, 64, 2048, 16, 160, Mixed, true, None)
            .fp8(Arbitrary)
            .band(ScaleBand::Wide),
        DecodeCase::new(2, 8, 2048, 64, 40, Mixed, false, None)
            .fp8(Arbitrary)
            .band(ScaleBand::Tiny),
        // q at the ends of the tensor-core kernels' per-warp power of two: a latent of zeros
        // (its largest |q| is 0, the rope's is not), and heads 14 binades apart
        DecodeCase::new(2, 16, 2048, 64, 40, Mixed, false, None)
            .fp8(Arbitrary)
            .q_range(QRange::LatentZero),
        DecodeCase::new(2, 32, 128, 16, 16, Mixed, false, None)
            .fp8(Arbitrary)
            .q_range(QRange::HeadsWide),
        DecodeCase::new(2, 16, 64, 16, 16, Mixed, false, None).q_range(QRange::HeadsWide),
        // a row whose running max grows at almost every step, by hundreds of nats over the
        // list: the online softmax's rescale on every step, and no stale max survives (one
        // split: the whole list's growth, over 88 nats for every softmax scale drawn)
        DecodeCase::new(2, 16, 2048, 64, 40, Rising, false, Some(1)),
        DecodeCase::new(2, 16, 2048, 64, 40, Rising, false, None).fp8(Arbitrary),
        // multi-token decode (MTP): tokens = batch · s_q, lse [batch, heads, s_q]
        DecodeCase::new(4, 16, 64, 16, 16, Mixed, true, None).mtp(2),
        DecodeCase::new(6, 8, 128, 64, 8, Mixed, false, Some(1)).mtp(2),
        DecodeCase::new(6, 8, 128, 64, 8, Mixed, true, Some(3))
            .fp8(Pow2)
            .mtp(2),
        // padded row and page strides: rows 16-byte aligned, and rows one word apart (most of
        // them off 16 bytes: the kernels' word-wise copies), also above 16 heads
        DecodeCase::new(5, 8, 64, 16, 8, Mixed, false, None).strided(16),
        DecodeCase::new(5, 8, 64, 16, 8, Mixed, true, Some(2))
            .fp8(Arbitrary)
            .strided(16),
        DecodeCase::new(5, 8, 64, 16, 8, Mixed, false, None).strided(4),
        DecodeCase::new(3, 64, 2048, 16, 160, Mixed, true, None).strided(4),
        DecodeCase::new(2, 16, 2048, 64, 40, Mixed, false, Some(4))
            .fp8(Arbitrary)
            .strided(4),
    ]
}

/// Inputs of one case, on the host. `cache` holds packed rows (what the reference reads);
/// `device_cache` the same rows at the case's strides, NaN in the gaps.
pub struct DecodeData {
    pub shape: DecodeShape,
    pub layout: DecodeLayout,
    pub q: Vec<f32>,
    pub cache: Vec<u8>,
    pub device_cache: Vec<u8>,
    pub indices: Vec<i32>,
    pub topk_length: Option<Vec<i32>>,
}

/// One `fp8_ds_mla` row built from the published layout: 512 random e4m3 bytes (never the
/// NaN codes 0x7F / 0xFF), four f32 scales of the flavour, 64 random bf16 rope values.
fn hand_built_fp8_row(rng: &mut Rng, flavour: ScaleFlavour, band: ScaleBand) -> Vec<u8> {
    let dims = MlaDims::PRODUCTION;
    let mut row = Vec::with_capacity(CacheFormat::Fp8DsMla.row_bytes(dims) as usize);
    for _ in 0..dims.latent {
        let mut b = rng.below(256) as u8;
        while b & 0x7F == 0x7F {
            b = rng.below(256) as u8;
        }
        row.push(b);
    }
    for _ in 0..dims.latent / FP8_TILE {
        let s = match (band, flavour) {
            (ScaleBand::Wide, _) => (2.0f32).powf(rng.uniform(-14.0, 4.0)),
            (ScaleBand::Tiny, _) => (2.0f32).powf(rng.uniform(-36.0, -30.0)),
            (_, ScaleFlavour::Pow2) => (2.0f32).powi(-9 + rng.below(3) as i32),
            (_, ScaleFlavour::Arbitrary) => rng.uniform(0.001, 0.006),
        };
        row.extend_from_slice(&s.to_le_bytes());
    }
    for _ in 0..dims.rope {
        row.extend_from_slice(&bf16_bits(rng.normal()).to_le_bytes());
    }
    row
}

/// Draw a case's inputs from `seed`. Unreferenced cache rows hold NaN.
pub fn make_inputs(case: &DecodeCase, seed: u64) -> Result<DecodeData> {
    let mut rng = Rng::new(seed);
    let scale = rng.uniform(0.03, 0.1);
    let scale = if case.band == ScaleBand::Wide {
        scale / 256.0
    } else {
        scale
    };
    let shape = case.shape(scale);
    let layout = case.layout();
    let (t_n, k_n) = (case.tokens as usize, case.topk as usize);
    let slots = shape.num_slots();
    let head_gain: Vec<f32> = (0..case.tokens * case.heads)
        .map(|_| match case.q_range {
            QRange::HeadsWide => 2f32.powf(rng.uniform(-12.0, 2.0).round()),
            _ => 1.0,
        })
        .collect();
    let (d_qk, d_v) = (shape.dims.d_qk() as u64, shape.dims.d_v() as u64);
    let q: Vec<f32> = (0..shape.q_elems())
        .map(|i| {
            let (head, d) = ((i / d_qk) as usize, i % d_qk);
            let x = rng.normal();
            let x = if case.pattern == IndexPattern::Rising {
                32.0 * x
            } else {
                x
            };
            round_bf16(match case.q_range {
                QRange::Normal => x,
                QRange::LatentZero if d < d_v => 0.0,
                QRange::LatentZero => 8.0 * x,
                QRange::HeadsWide => x * head_gain[head],
            })
        })
        .collect();
    let mut indices = vec![-1i32; t_n * k_n];
    for t in 0..t_n {
        let row = &mut indices[t * k_n..(t + 1) * k_n];
        let distinct = rng.distinct(slots, k_n.min(slots as usize));
        for (j, v) in row.iter_mut().enumerate() {
            *v = distinct.get(j).map(|&s| s as i32).unwrap_or(-1);
        }
        match case.pattern {
            IndexPattern::Valid | IndexPattern::Rising => {}
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
    // Lengths in range, plus ones the kernels must clamp: above topk and negative.
    let topk_length = case.topk_length.then(|| {
        (0..t_n)
            .map(|t| match t % 6 {
                0 => 0,
                1 => k_n as i32,
                2 => k_n as i32 + 1 + rng.below(1000) as i32,
                3 => -(1 + rng.below(5) as i32),
                _ => rng.below(k_n as u64 + 1) as i32,
            })
            .collect::<Vec<i32>>()
    });
    let row_bytes = shape.row_bytes() as usize;
    let mut cache = Vec::with_capacity(slots as usize * row_bytes);
    for _ in 0..slots {
        match case.format {
            CacheFormat::Bf16 => {
                for _ in 0..row_bytes / 2 {
                    cache.extend_from_slice(&bf16_bits(rng.normal()).to_le_bytes());
                }
            }
            CacheFormat::Fp8DsMla => {
                cache.extend(hand_built_fp8_row(&mut rng, case.flavour, case.band))
            }
        }
    }
    if case.pattern == IndexPattern::Rising {
        // each token's list in the order of its head 0's score (as the reference computes
        // it: the decoded row, q in f64), lowest first
        let d = d_qk as usize;
        for t in 0..t_n {
            let qt = &q[t * case.heads as usize * d..][..d];
            let row = &mut indices[t * k_n..(t + 1) * k_n];
            let mut keyed: Vec<(f64, i32)> = row
                .iter()
                .map(|&s| {
                    let bytes = &cache[s as usize * row_bytes..(s as usize + 1) * row_bytes];
                    let k = decode_row(case.format, shape.dims, bytes);
                    let score: f64 = qt.iter().zip(&k).map(|(a, b)| *a as f64 * *b as f64).sum();
                    (score, s)
                })
                .collect();
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (v, (_, s)) in row.iter_mut().zip(keyed) {
                *v = s;
            }
        }
    }
    // NaN in every row that no valid entry references: 0xFF bytes are NaN as e4m3, as f32
    // scales and as bf16.
    let mut used = HashSet::new();
    {
        let inputs = DecodeInputs {
            shape,
            q: &q,
            cache: &cache,
            indices: &indices,
            topk_length: topk_length.as_deref(),
        };
        for t in 0..t_n {
            for j in 0..k_n {
                if let Some(s) = slot_of(&inputs, t, j) {
                    used.insert(s);
                }
            }
        }
    }
    for s in 0..slots as usize {
        if !used.contains(&s) {
            cache[s * row_bytes..(s + 1) * row_bytes].fill(0xFF);
        }
    }
    let g = CacheGeometry::new(
        shape.format,
        shape.dims,
        shape.num_pages,
        shape.page_size,
        layout.cache,
    )?;
    let mut device_cache = vec![0xFFu8; g.min_bytes() as usize];
    for s in 0..slots {
        let at = g.row_offset(s) as usize;
        let src = &cache[s as usize * row_bytes..(s as usize + 1) * row_bytes];
        device_cache[at..at + row_bytes].copy_from_slice(src);
    }
    Ok(DecodeData {
        shape,
        layout,
        q,
        cache,
        device_cache,
        indices,
        topk_length,
    })
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

/// Run one case on a backend and judge it against the float64 reference.
pub fn run_decode_case(backend: &dyn Backend, case: &DecodeCase, seed: u64) -> Result<Outcome> {
    let prepared = prepare_decode_case(case, seed)?;
    check_decode_case(backend, case, &prepared)
}

/// A case's inputs and its float64 reference (the slow half: the stress run computes these
/// on worker threads while the device runs earlier cases).
pub struct PreparedDecode {
    pub seed: u64,
    pub data: DecodeData,
    pub reference: crate::reference::sparse_mla::DecodeOutputs,
}

pub fn prepare_decode_case(case: &DecodeCase, seed: u64) -> Result<PreparedDecode> {
    let data = make_inputs(case, seed)?;
    let reference = decode(&data.inputs());
    Ok(PreparedDecode {
        seed,
        data,
        reference,
    })
}

/// Runs a prepared case on `backend` (outputs poisoned first) and compares every output
/// with the reference.
pub fn check_decode_case(
    backend: &dyn Backend,
    case: &DecodeCase,
    prepared: &PreparedDecode,
) -> Result<Outcome> {
    let (data, reference, seed) = (&prepared.data, &prepared.reference, prepared.seed);
    let shape = data.shape;
    let q: Vec<u8> = data
        .q
        .iter()
        .flat_map(|&v| bf16_bits(v).to_le_bytes())
        .collect();
    let qb = backend.upload(&q)?;
    let cb = backend.upload(&data.device_cache)?;
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
            layout: data.layout,
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
    let lse_raw: Vec<f64> = lse_bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
        .collect();
    // Back to [tokens, heads] order from the case's lse layout.
    let h_n = shape.heads as u64;
    let lse: Vec<f64> = (0..shape.tokens as u64 * h_n)
        .map(|i| lse_raw[data.layout.lse.index(i / h_n, i % h_n, h_n) as usize])
        .collect();

    let mut failures = Vec::new();
    let nan = out.iter().filter(|v| v.is_nan()).count();
    if nan > 0 {
        failures.push(format!("{nan} NaN (unwritten or poisoned) output elements"));
    }
    let rel = rel_l2(&out, &reference.out);
    if !within(rel, 1e-2) {
        failures.push(format!("out rel L2 {rel:.3e} > 1e-2"));
    }
    let mut max_abs = 0.0f64;
    // On an f32 path (P kept in f32) every element is the f32 result rounded once to bf16.
    let strict = !run.p_rounded;
    let mut off_by_more = 0;
    // f32 accumulation's slack scales with the outputs' magnitude (at least 1): an element
    // near 0 that sums terms of ~10^3 (scales far above the flavours', ScaleBand::Wide) is
    // off by more than 1e-5 in any f32 order
    let magnitude = reference.out.iter().fold(1.0f64, |m, r| m.max(r.abs()));
    // The weights' own f32 error, which the row's lse error measures (lse is held to 1e-3
    // below): P = exp(s − lse) is off, relative, by about that much (4x for the spread of the
    // scores' errors around it), and moves an element by that much of Σ P · |v|. Scores of
    // hundreds of nats (IndexPattern::Rising: q times 32) are off by ~1e-4 in f32, and an
    // element near 0 whose terms cancel then misses one bf16 step of its own value (lavapipe,
    // seed 1796452264209263194); elsewhere lse is off by ~1e-6 and this adds next to nothing.
    // The lse error is only a sample of the scores' errors: each score and lse held in f32
    // is off by up to half an f32 step of its magnitude, so the weights are off by at least
    // |lse| · 2^-23 whatever this row's lse error happened to be (lavapipe, seed
    // 1796393037883717468: lse 180.9 off by 2.5e-6, under one f32 step there, 1.5e-5, and an
    // element of 2.8e-4 from terms of 1.18 missed its bound by 0.6 %).
    let dv = shape.dims.d_v() as usize;
    let weights_err = |i: usize| {
        let r = reference.lse[i / dv];
        let e = (lse[i / dv] - r)
            .abs()
            .max(r.abs() * f64::from(f32::EPSILON));
        if e.is_finite() {
            4.0 * e * reference.out_abs[i]
        } else {
            0.0
        }
    };
    for (i, (o, r)) in out.iter().zip(&reference.out).enumerate() {
        let d = (o - r).abs();
        if d > max_abs || d.is_nan() {
            max_abs = d;
        }
        // one bf16 ulp of the value (ulp > |r|·2^-8), plus slack for f32 accumulation and
        // for the weights' error
        let step = r.abs() / 256.0 + 1e-5 * magnitude + weights_err(i);
        if strict && !within(d, step) {
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
            if *l != f64::INFINITY {
                failures.push(format!("row {i}: no valid index, lse {l} (want +inf)"));
            } else if out[i * dv..(i + 1) * dv].iter().any(|&v| v != 0.0) {
                failures.push(format!("row {i}: no valid index, out not all zero"));
            }
        } else {
            let e = (l - r).abs();
            if !within(e, 1e-3) {
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
        detail: format!(
            "splits {}{}{}",
            run.splits,
            if run.whole_tokens > 0 {
                format!(" whole {}", run.whole_tokens)
            } else {
                String::new()
            },
            if run.merged { " merged" } else { "" }
        ),
        seconds,
        failures,
    })
}
