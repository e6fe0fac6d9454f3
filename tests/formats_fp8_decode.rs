//! fp8_ds_mla decode, checked independently of the encoder and of the reference decoder:
//! rows are assembled byte by byte from the published layout, and the expected values come
//! from the e4m3fn definition written out here (sign, 4-bit exponent with bias 7, 3-bit
//! mantissa, subnormals m·2^-9). With one valid slot per token the softmax weight is exactly
//! 1, so `out` must be the dequantised latent (rounded once to bf16) and `lse` the scaled
//! score. Then the cache-write kernel and the decode are run back to back on each backend.

mod common;

use half::bf16;
use sparse_mla::mla::*;
use sparse_mla::reference::sparse_mla::{decode, DecodeInputs};
use sparse_mla::runtime::{Backend, BackendKind, CacheWriteBuffers, DecodeBuffers, DecodeOptions};
use sparse_mla::testing::{compare, test_seed};
use sparse_mla::util::Rng;

/// e4m3fn by its definition, in f64 (independent of `reference::numerics`).
fn e4m3_value(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f64;
    if e == 0 {
        sign * m * 2f64.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

fn bytes_u16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn backends() -> Vec<(BackendKind, &'static dyn Backend)> {
    [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda]
        .into_iter()
        .filter_map(|k| common::backend(k).map(|b| (k, b)))
        .collect()
}

/// Slot `s` holds bytes that together cover every finite e4m3 code, tile scales of the
/// flavour (pow2 or arbitrary), and a known rope.
fn hand_built_row(s: usize, flavour: ScaleFlavour) -> (Vec<u8>, Vec<f64>) {
    let mut row = Vec::with_capacity(656);
    let mut values = Vec::with_capacity(576);
    let codes: Vec<u8> = (0u8..=255).filter(|b| b & 0x7F != 0x7F).collect();
    let latent: Vec<u8> = (0..512)
        .map(|i| codes[(i * 7 + s * 61) % codes.len()])
        .collect();
    let scales: Vec<f32> = (0..4)
        .map(|t| match flavour {
            ScaleFlavour::Pow2 => 2f32.powi(-8 + ((s + t) % 5) as i32),
            ScaleFlavour::Arbitrary => 0.0013 + 0.00071 * (s * 4 + t) as f32,
        })
        .collect();
    row.extend_from_slice(&latent);
    for sc in &scales {
        row.extend_from_slice(&sc.to_le_bytes());
    }
    for (i, &b) in latent.iter().enumerate() {
        values.push(e4m3_value(b) * scales[i / 128] as f64);
    }
    for i in 0..64 {
        let v = bf16::from_f32(((s * 64 + i) as f32 * 0.37).sin());
        row.extend_from_slice(&v.to_bits().to_le_bytes());
        values.push(v.to_f64());
    }
    assert_eq!(row.len(), 656);
    (row, values)
}

#[test]
fn hand_built_fp8_rows_decode_to_their_published_values() {
    let (tokens, heads, topk, slots) = (6u32, 8u32, 4u32, 6u32);
    for flavour in [ScaleFlavour::Pow2, ScaleFlavour::Arbitrary] {
        let mut cache = Vec::new();
        let mut values = Vec::new();
        for s in 0..slots as usize {
            let (row, v) = hand_built_row(s, flavour);
            cache.extend(row);
            values.push(v);
        }
        // Token t reads slot (t * 5) % 6 once; its other entries are invalid.
        let slot_of = |t: u32| (t * 5) % slots;
        let indices: Vec<i32> = (0..tokens)
            .flat_map(|t| [-1, slot_of(t) as i32, slots as i32 + 3, -7])
            .collect();
        let mut rng = Rng::new(test_seed());
        let q: Vec<u16> = (0..tokens * heads * 576)
            .map(|_| bf16::from_f32(rng.normal() * 0.05).to_bits())
            .collect();
        let scale = 0.0625f32;
        let shape = DecodeShape {
            tokens,
            heads,
            topk,
            num_pages: 2,
            page_size: 3,
            dims: MlaDims::PRODUCTION,
            format: CacheFormat::Fp8DsMla,
            scale,
            has_topk_length: false,
        };
        for (kind, b) in backends() {
            let qb = b.upload(&bytes_u16(&q)).unwrap();
            let cb = b.upload(&cache).unwrap();
            let ib = b
                .upload(
                    &indices
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<u8>>(),
                )
                .unwrap();
            let ob = b
                .upload(&vec![0xFF; (tokens * heads * 512 * 2) as usize])
                .unwrap();
            let lb = b
                .upload(&vec![0xFF; (tokens * heads * 4) as usize])
                .unwrap();
            b.sparse_mla_decode(
                &shape,
                &DecodeBuffers {
                    q: &qb,
                    kv_cache: &cb,
                    indices: &ib,
                    topk_length: None,
                    out: &ob,
                    lse: &lb,
                    layout: DecodeLayout::default(),
                },
                &DecodeOptions::default(),
            )
            .unwrap();
            let out = b.download(&ob).unwrap();
            let lse = b.download(&lb).unwrap();
            let mut mismatched = 0;
            let (mut got_out, mut want_out, mut got_lse, mut want_lse) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for t in 0..tokens as usize {
                let k = &values[slot_of(t as u32) as usize];
                for h in 0..heads as usize {
                    let row = t * heads as usize + h;
                    for (c, &kc) in k.iter().take(512).enumerate() {
                        let at = (row * 512 + c) * 2;
                        let got = bf16::from_bits(u16::from_le_bytes([out[at], out[at + 1]]));
                        // the kernel's f32 product, rounded once to bf16 (±0 alike: the sum
                        // of one −0 term is +0)
                        let want = bf16::from_f32(kc as f32);
                        if got.to_f32() != want.to_f32() {
                            mismatched += 1;
                        }
                        got_out.push(got.to_f64());
                        want_out.push(kc);
                    }
                    let qv = &q[row * 576..(row + 1) * 576];
                    let dot: f64 = qv
                        .iter()
                        .zip(k)
                        .map(|(a, b)| bf16::from_bits(*a).to_f64() * b)
                        .sum();
                    let l = f32::from_le_bytes(lse[row * 4..row * 4 + 4].try_into().unwrap());
                    got_lse.push(l as f64);
                    want_lse.push(scale as f64 * dot);
                }
            }
            // NaN-aware: an unwritten (poisoned) or NaN output is an infinite error
            let max_err = compare(&got_out, &want_out).worst_abs;
            let max_lse_err = compare(&got_lse, &want_lse).worst_abs;
            eprintln!(
                "{} {flavour:?}: one valid slot per token, out vs dequantised latent: max abs error {max_err:.3e} (bf16 rounding), {mismatched} elements not the bf16 of the f32 product; lse max error {max_lse_err:.3e}",
                kind.name()
            );
            assert_eq!(mismatched, 0, "{} {flavour:?}", kind.name());
            assert!(
                max_lse_err <= 1e-3,
                "{} {flavour:?}: lse error {max_lse_err}",
                kind.name()
            );
        }
    }
}

#[test]
fn cache_write_then_decode_matches_the_reference_on_every_backend() {
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let (tokens, heads, topk) = (4u32, 16u32, 256u32);
    let (num_pages, page_size) = (5u32, 64u32);
    let slots = num_pages * page_size;
    for flavour in [ScaleFlavour::Pow2, ScaleFlavour::Arbitrary] {
        let cw = CacheWriteShape {
            tokens: slots,
            num_pages,
            page_size,
            dims: MlaDims::PRODUCTION,
            format: CacheFormat::Fp8DsMla,
            flavour,
            strides: CacheStrides::default(),
        };
        let latent: Vec<u16> = (0..slots * 512)
            .map(|_| bf16::from_f32(rng.normal()).to_bits())
            .collect();
        let rope: Vec<u16> = (0..slots * 64)
            .map(|_| bf16::from_f32(rng.normal()).to_bits())
            .collect();
        let mapping: Vec<i32> = rng
            .distinct(slots as u64, slots as usize)
            .into_iter()
            .map(|s| s as i32)
            .collect();
        let mut cache = vec![0u8; (slots * 656) as usize];
        sparse_mla::reference::cache::write_rows(&cw, &latent, &rope, &mapping, &mut cache)
            .unwrap();
        let q: Vec<u16> = (0..tokens * heads * 576)
            .map(|_| bf16::from_f32(rng.normal()).to_bits())
            .collect();
        let indices: Vec<i32> = (0..tokens)
            .flat_map(|_| rng.distinct(slots as u64, topk as usize))
            .map(|s| s as i32)
            .collect();
        let shape = DecodeShape {
            tokens,
            heads,
            topk,
            num_pages,
            page_size,
            dims: MlaDims::PRODUCTION,
            format: CacheFormat::Fp8DsMla,
            scale: 0.0625,
            has_topk_length: false,
        };
        let qf: Vec<f32> = q.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        let reference = decode(&DecodeInputs {
            shape,
            q: &qf,
            cache: &cache,
            indices: &indices,
            topk_length: None,
        });
        for (kind, b) in backends() {
            let lb = b.upload(&bytes_u16(&latent)).unwrap();
            let rb = b.upload(&bytes_u16(&rope)).unwrap();
            let mb = b
                .upload(
                    &mapping
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<u8>>(),
                )
                .unwrap();
            let cb = b.upload(&vec![0xFF; cache.len()]).unwrap();
            b.cache_write(
                &cw,
                &CacheWriteBuffers {
                    latent: &lb,
                    rope: &rb,
                    slot_mapping: &mb,
                    kv_cache: &cb,
                },
            )
            .unwrap();
            assert!(
                b.download(&cb).unwrap() == cache,
                "{} {flavour:?}: written cache differs from the reference encoder (seed {seed})",
                kind.name()
            );
            let qb = b.upload(&bytes_u16(&q)).unwrap();
            let ib = b
                .upload(
                    &indices
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<u8>>(),
                )
                .unwrap();
            let ob = b
                .upload(&vec![0xFF; shape.out_elems() as usize * 2])
                .unwrap();
            let lsb = b
                .upload(&vec![0xFF; (tokens * heads * 4) as usize])
                .unwrap();
            let run = b
                .sparse_mla_decode(
                    &shape,
                    &DecodeBuffers {
                        q: &qb,
                        kv_cache: &cb,
                        indices: &ib,
                        topk_length: None,
                        out: &ob,
                        lse: &lsb,
                        layout: DecodeLayout::default(),
                    },
                    &DecodeOptions::default(),
                )
                .unwrap();
            let out: Vec<f64> = b
                .download(&ob)
                .unwrap()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
                .collect();
            let lse: Vec<f64> = b
                .download(&lsb)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect();
            // NaN-aware comparisons: the outputs were poisoned, so an unwritten one fails
            let out_cmp = compare(&out, &reference.out);
            let (rel, max_abs) = (out_cmp.rel_l2, out_cmp.worst_abs);
            let lse_cmp = compare(&lse, &reference.lse);
            let lse_err = lse_cmp.worst_abs;
            eprintln!(
                "{} {flavour:?}: cache write (byte-exact) then fp8 decode, T {tokens} H {heads} topk {topk}, splits {}: rel L2 {rel:.2e}, max abs {max_abs:.2e}, lse max error {lse_err:.2e} vs the float64 reference of the dequantised cache (seed {seed})",
                kind.name(),
                run.splits
            );
            assert!(
                out_cmp.within(1e-2, f64::INFINITY) && lse_cmp.within(f64::INFINITY, 1e-3),
                "{} {flavour:?} (SPARSE_MLA_SEED={seed}): out {out_cmp}; lse {lse_cmp}",
                kind.name()
            );
        }
    }
}
