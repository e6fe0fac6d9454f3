//! Cache-write and virtual-block-table cases. Both are exact: the cache write must produce
//! the reference encoder's bytes (and leave every other byte of the cache as it was), the
//! conversion the reference's slots.

use super::{i32_bytes, i32s, Case, Outcome};
use crate::mla::{
    CacheFormat, CacheStrides, CacheWriteShape, MlaDims, ScaleFlavour, VbtShape, FP8_TILE,
};
use crate::reference::cache::write_rows;
use crate::reference::numerics::bf16_bits;
use crate::reference::vbt::positions_to_slots;
use crate::runtime::{Backend, CacheWriteBuffers, VbtBuffers};
use crate::util::Rng;
use crate::Result;

/// One cache-write case.
#[derive(Clone, Debug)]
pub struct CacheWriteCase {
    pub name: String,
    pub tokens: u32,
    pub num_pages: u32,
    pub page_size: u32,
    pub format: CacheFormat,
    pub flavour: ScaleFlavour,
    pub strided: bool,
}

impl CacheWriteCase {
    fn new(
        tokens: u32,
        num_pages: u32,
        page_size: u32,
        format: CacheFormat,
        flavour: ScaleFlavour,
        strided: bool,
    ) -> Self {
        let mut name = format.name().to_string();
        if format == CacheFormat::Fp8DsMla {
            name.push_str(match flavour {
                ScaleFlavour::Pow2 => "_pow2",
                ScaleFlavour::Arbitrary => "_arbitrary",
            });
        }
        name.push_str(&format!("_t{tokens}_p{page_size}x{num_pages}"));
        if strided {
            name.push_str("_strided");
        }
        CacheWriteCase {
            name,
            tokens,
            num_pages,
            page_size,
            format,
            flavour,
            strided,
        }
    }

    pub fn shape(&self) -> CacheWriteShape {
        let row_bytes = self.format.row_bytes(MlaDims::PRODUCTION) as u64;
        let strides = if self.strided {
            CacheStrides {
                row: row_bytes + 48,
                page: (row_bytes + 48) * self.page_size as u64 + 4,
            }
        } else {
            CacheStrides::default()
        };
        CacheWriteShape {
            tokens: self.tokens,
            num_pages: self.num_pages,
            page_size: self.page_size,
            dims: MlaDims::PRODUCTION,
            format: self.format,
            flavour: self.flavour,
            strides,
        }
    }
}

/// Both formats, both scale flavours, packed and padded strides, page sizes 1 to 64, slot
/// mappings with −1 and out-of-range slots. The first tokens of every case carry the
/// special values: an all-zero tile, all −0, subnormal bf16 inputs, values that become
/// subnormal e4m3, NaN and ±inf.
pub fn cache_write_cases() -> Vec<CacheWriteCase> {
    use CacheFormat::*;
    use ScaleFlavour::*;
    vec![
        CacheWriteCase::new(37, 8, 16, Bf16, Arbitrary, false),
        CacheWriteCase::new(21, 5, 16, Bf16, Arbitrary, true),
        CacheWriteCase::new(70, 4, 64, Fp8DsMla, Pow2, false),
        CacheWriteCase::new(70, 4, 64, Fp8DsMla, Arbitrary, false),
        CacheWriteCase::new(33, 12, 8, Fp8DsMla, Arbitrary, true),
        CacheWriteCase::new(300, 400, 1, Fp8DsMla, Pow2, true),
    ]
}

impl Case for CacheWriteCase {
    fn name(&self) -> String {
        format!("cache_write/{}", self.name)
    }

    fn run(&self, backend: &dyn Backend, seed: u64) -> Result<Outcome> {
        run_cache_write_case(backend, self, seed)
    }
}

/// bf16 bits of one token's `n` values: tile by tile, a random magnitude (so scales vary
/// over many binades); the special tokens first.
fn token_values(rng: &mut Rng, t: usize, n: usize) -> Vec<u16> {
    let tile = FP8_TILE as usize;
    (0..n)
        .map(|i| {
            let bits = |v: f32| bf16_bits(v);
            match t {
                0 => 0,                                                            // all-zero tiles
                1 => 0x8000,                                                       // all −0
                2 => (1 + rng.below(0x7F) as u16) | ((rng.below(2) as u16) << 15), // bf16 subnormals
                3 => {
                    // one large value per tile, the rest tiny: subnormal e4m3 bytes
                    if i % tile == 0 {
                        bits(100.0)
                    } else {
                        bits(rng.normal() * (2.0f32).powi(-(rng.below(12) as i32)))
                    }
                }
                4 if i == 5 => 0x7FC0,   // NaN
                5 if i == 130 => 0x7F80, // +inf
                5 if i == 300 => 0xFF80, // −inf
                _ => {
                    let e = ((i / tile + t) % 9) as i32 * 5 - 20;
                    bits(rng.normal() * (2.0f32).powi(e))
                }
            }
        })
        .collect()
}

/// Run one cache-write case: a random cache (every byte, gaps included), random distinct
/// slots with some −1 and some past the end, then compare the whole buffer with the
/// reference's bytes.
pub fn run_cache_write_case(
    backend: &dyn Backend,
    case: &CacheWriteCase,
    seed: u64,
) -> Result<Outcome> {
    let mut rng = Rng::new(seed);
    let shape = case.shape();
    let g = shape.validate()?;
    let (t_n, l, r) = (
        shape.tokens as usize,
        shape.dims.latent as usize,
        shape.dims.rope as usize,
    );
    let mut latent = Vec::with_capacity(t_n * l);
    let mut rope = Vec::with_capacity(t_n * r);
    for t in 0..t_n {
        latent.extend(token_values(&mut rng, t, l));
        rope.extend((0..r).map(|_| bf16_bits(rng.normal())));
    }
    let slots_n = g.num_slots();
    let distinct = rng.distinct(slots_n, t_n.min(slots_n as usize));
    let slot_mapping: Vec<i32> = (0..t_n)
        .map(|t| match distinct.get(t) {
            _ if t % 7 == 6 => -1,
            _ if t % 11 == 10 => (slots_n + rng.below(100)) as i32,
            Some(&s) => s as i32,
            None => -1,
        })
        .collect();
    let before: Vec<u8> = (0..g.min_bytes()).map(|_| rng.below(256) as u8).collect();
    let mut want = before.clone();
    write_rows(&shape, &latent, &rope, &slot_mapping, &mut want)?;

    let u16_bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let lb = backend.upload(&u16_bytes(&latent))?;
    let rb = backend.upload(&u16_bytes(&rope))?;
    let sb = backend.upload(&i32_bytes(&slot_mapping))?;
    let cb = backend.upload(&before)?;
    let start = std::time::Instant::now();
    backend.cache_write(
        &shape,
        &CacheWriteBuffers {
            latent: &lb,
            rope: &rb,
            slot_mapping: &sb,
            kv_cache: &cb,
        },
    )?;
    let got = backend.download(&cb)?;
    let seconds = start.elapsed().as_secs_f64();

    let mut failures = Vec::new();
    let differ: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    if !differ.is_empty() {
        let written = slot_mapping
            .iter()
            .filter(|&&s| s >= 0 && (s as u64) < slots_n)
            .count();
        failures.push(format!(
            "{} of {} bytes differ ({written} rows written)",
            differ.len(),
            want.len()
        ));
        for &i in differ.iter().take(6) {
            let slot_of_byte = (0..slots_n).find(|&s| {
                let at = g.row_offset(s) as usize;
                (at..at + g.row_bytes as usize).contains(&i)
            });
            failures.push(format!(
                "byte {i} (slot {slot_of_byte:?}): got {:#04x}, want {:#04x}, was {:#04x}",
                got[i], want[i], before[i]
            ));
        }
    }
    Ok(Outcome {
        case: format!("cache_write/{}", case.name),
        seed,
        rel_l2: 0.0,
        max_abs: differ.len() as f64,
        lse_err: 0.0,
        detail: format!("{} B exact", want.len()),
        seconds,
        failures,
    })
}

/// One block-table conversion case.
#[derive(Clone, Debug)]
pub struct VbtCase {
    pub name: String,
    pub shape: VbtShape,
}

impl VbtCase {
    fn new(tokens: u32, topk: u32, requests: u32, max_pages: u32, page_size: u32) -> Self {
        VbtCase {
            name: format!("t{tokens}_k{topk}_r{requests}_m{max_pages}_p{page_size}"),
            shape: VbtShape {
                tokens,
                topk,
                requests,
                max_pages,
                page_size,
            },
        }
    }
}

/// Small and production-sized tables, page sizes 1 to 64; positions and tables with every
/// kind of invalid entry.
pub fn vbt_cases() -> Vec<VbtCase> {
    vec![
        VbtCase::new(5, 7, 3, 4, 16),
        VbtCase::new(9, 64, 4, 300, 1),
        VbtCase::new(64, 2048, 8, 40, 64),
    ]
}

impl Case for VbtCase {
    fn name(&self) -> String {
        format!("vbt/{}", self.name)
    }

    fn run(&self, backend: &dyn Backend, seed: u64) -> Result<Outcome> {
        run_vbt_case(backend, self, seed)
    }
}

/// Run one conversion case: positions in and past each request's pages, negative ones;
/// tables with unassigned (−1) pages and a huge block id whose slots overflow i32; tokens of
/// unknown requests (−1, past the table). Every output entry is poisoned first and checked.
pub fn run_vbt_case(backend: &dyn Backend, case: &VbtCase, seed: u64) -> Result<Outcome> {
    let mut rng = Rng::new(seed);
    let s = case.shape;
    let (t_n, k_n, r_n, m) = (
        s.tokens as usize,
        s.topk as usize,
        s.requests as usize,
        s.max_pages as usize,
    );
    let mut block_table: Vec<i32> = (0..r_n * m)
        .map(|_| match rng.below(10) {
            0 => -1,
            1 => -(2 + rng.below(100) as i32),
            _ => rng.below(100_000) as i32,
        })
        .collect();
    block_table[0] = i32::MAX; // its slots do not fit in an i32 (page_size > 1) or just fit
    let req_of_token: Vec<i32> = (0..t_n)
        .map(|t| match t % 5 {
            3 if t % 10 == 3 => -1,
            4 if t % 10 == 9 => s.requests as i32 + rng.below(4) as i32,
            _ => rng.below(s.requests as u64) as i32,
        })
        .collect();
    let span = (s.max_pages as u64 * s.page_size as u64).min(i32::MAX as u64);
    let positions: Vec<i32> = (0..t_n * k_n)
        .map(|_| match rng.below(10) {
            0 => -1,
            1 => -(2 + rng.below(1000) as i32),
            2 => (span + rng.below(1000)).min(i32::MAX as u64) as i32,
            _ => rng.below(span) as i32,
        })
        .collect();
    // Deterministic boundaries (random draws reach them rarely for pages past 1): token 0
    // of request 0 reads the last slot that fits an i32 (page 1), the first that does not
    // (page 2), the last position of its table and the first past it (block == max_block).
    let mut positions = positions;
    let mut req_of_token = req_of_token;
    {
        let ps = s.page_size as u64;
        let fits = ((i32::MAX as u64 + 1) / ps - 1) as i32; // slots up to i32::MAX exactly
        if m >= 3 {
            block_table[1] = fits;
            block_table[2] = fits.saturating_add(1);
        }
        req_of_token[0] = 0;
        let edge = [
            (ps + ps - 1).min(span - 1),
            (2 * ps).min(span - 1),
            span - 1,
            span.min(i32::MAX as u64),
            0,
        ];
        for (j, &p) in edge.iter().enumerate().take(k_n) {
            positions[j] = p as i32;
        }
    }
    let want = positions_to_slots(&s, &positions, &block_table, &req_of_token);

    let pb = backend.upload(&i32_bytes(&positions))?;
    let bb = backend.upload(&i32_bytes(&block_table))?;
    let rb = backend.upload(&i32_bytes(&req_of_token))?;
    let ob = backend.upload(&vec![0x5A; t_n * k_n * 4])?;
    let start = std::time::Instant::now();
    backend.positions_to_slots(
        &s,
        &VbtBuffers {
            positions: &pb,
            block_table: &bb,
            req_of_token: &rb,
            slots: &ob,
        },
    )?;
    let got = i32s(&backend.download(&ob)?);
    let seconds = start.elapsed().as_secs_f64();
    let mut failures = Vec::new();
    let differ: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    if !differ.is_empty() {
        failures.push(format!("{} of {} slots differ", differ.len(), want.len()));
        for &i in differ.iter().take(6) {
            let t = i / k_n;
            failures.push(format!(
                "[{t}, {}]: pos {} of request {}: got {}, want {}",
                i % k_n,
                positions[i],
                req_of_token[t],
                got[i],
                want[i]
            ));
        }
    }
    let invalid = want.iter().filter(|&&v| v < 0).count();
    Ok(Outcome {
        case: format!("vbt/{}", case.name),
        seed,
        rel_l2: 0.0,
        max_abs: differ.len() as f64,
        lse_err: 0.0,
        detail: format!("{invalid}/{} invalid", want.len()),
        seconds,
        failures,
    })
}
