//! The bit-exact number routines of `kir::numeric` (correctly rounded f32 division and
//! f32 → e4m3fn), run as generated code on every GPU backend present and compared bit for
//! bit with Rust's IEEE arithmetic and the reference encoder. The cache-write kernel's
//! fp8 bytes are only as identical across backends as these routines are.

mod common;

use sparse_mla::kir::builder::*;
use sparse_mla::kir::ir::{Access, Elem, Kernel, Ty};
use sparse_mla::kir::{lower, numeric, Lowering};
use sparse_mla::reference::numerics::f32_to_e4m3;
use sparse_mla::runtime::gpu::Device;
use sparse_mla::util::Rng;

const THREADS: u32 = 256;

/// `quot[i] = div_rn(a[i], d[i])`, `code[i] = f32_to_e4m3(x[i])`, one element per thread.
fn numeric_kernel() -> Kernel {
    let mut b = KernelBuilder::new("numeric_check", THREADS);
    b.doc("Test kernel: kir::numeric on n elements; grid x = ceil(n / 256).");
    let n = b.param("n", Ty::U32, "elements");
    let a = b.buffer("a", Elem::U32, Access::Read, "[n] f32 bits");
    let d = b.buffer("d", Elem::U32, Access::Read, "[n] f32 bits");
    let x = b.buffer("x", Elem::U32, Access::Read, "[n] f32 bits");
    let quot = b.buffer("quot", Elem::U32, Access::ReadWrite, "[n] f32 bits");
    let code = b.buffer("code", Elem::U32, Access::ReadWrite, "[n] e4m3 bytes");
    let idx = b.let_("idx", workgroup_id(0) * u(THREADS) + local_id());
    b.if_(idx.clone().lt(n), |b| {
        let q = numeric::div_rn(b, a.at(idx.clone()), d.at(idx.clone()));
        b.store(&quot, idx.clone(), q);
        let c = numeric::f32_to_e4m3(b, x.at(idx.clone()));
        b.store(&code, idx.clone(), c);
    });
    let k = b.finish().expect("description");
    lower(&k, Lowering::Scalar).expect("lowering")
}

struct Inputs {
    a: Vec<u32>,
    d: Vec<u32>,
    x: Vec<u32>,
}

/// Dividends of every kind (bf16 values, full f32, subnormals, zeros), positive normal
/// divisors (448, the smallest normal, random), and e4m3 inputs that sit on and next to
/// every rounding boundary, around 448 / 464, in the subnormal grid, plus NaN and inf.
fn inputs(seed: u64, n: usize) -> Inputs {
    let mut rng = Rng::new(seed);
    let mut a = Vec::with_capacity(n);
    let mut d = Vec::with_capacity(n);
    let mut x = Vec::with_capacity(n);
    let boundaries: Vec<f32> = (0u8..0x7E)
        .map(|c| {
            let lo = sparse_mla::reference::numerics::e4m3_to_f32(c);
            let hi = sparse_mla::reference::numerics::e4m3_to_f32(c + 1);
            ((lo as f64 + hi as f64) / 2.0) as f32
        })
        .collect();
    for i in 0..n {
        let bits = rng.next_u64();
        let av = match i % 6 {
            0 => (bits as u32) & 0xFFFF_0000, // any bf16 (incl. subnormal)
            1 => (bits as u32) & 0x807F_FFFF, // f32 subnormal / zero
            2 => ((bits as u32) & 0x80FF_FFFF) | (100 << 23), // near 1
            3 => {
                if i % 12 == 3 {
                    0x8000_0000
                } else {
                    0
                }
            } // ±0
            _ => {
                let e = 90 + rng.below(80) as u32;
                ((bits as u32) & 0x807F_FFFF) | (e << 23)
            }
        };
        let dv = match i % 5 {
            0 => 448.0f32.to_bits(),
            1 => 0x0080_0000, // smallest normal, the scale floor
            _ => {
                let e = 1 + rng.below(253) as u32;
                ((bits >> 32) as u32 & 0x007F_FFFF) | (e << 23)
            }
        };
        let xv = match i % 8 {
            0 => {
                let m = boundaries[rng.below(boundaries.len() as u64) as usize];
                let s = if bits & 1 == 1 { -m } else { m };
                // on the boundary, or one f32 ulp either side
                (s.to_bits() as i64 + (rng.below(3) as i64 - 1)) as u32
            }
            1 => (440.0f32 + 30.0 * rng.unit() as f32).to_bits() | ((bits as u32) & 0x8000_0000),
            2 => ((rng.unit() as f32) / 64.0).to_bits(), // subnormal e4m3 range
            3 => [
                0x7FC0_0000,
                0x7F80_0000,
                0xFF80_0000,
                0x8000_0000,
                0,
                0x0000_0001,
            ][rng.below(6) as usize],
            _ => {
                let e = 100 + rng.below(40) as u32;
                ((bits as u32) & 0x807F_FFFF) | (e << 23)
            }
        };
        a.push(av);
        d.push(dv);
        x.push(xv);
    }
    Inputs { a, d, x }
}

fn bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// IEEE `a / d` with quotients below the normal range flushed to a signed zero (the
/// routine's documented domain).
fn expected_quotient(a: u32, d: u32) -> u32 {
    let q = f32::from_bits(a) / f32::from_bits(d);
    if q.abs() < f32::MIN_POSITIVE {
        q.to_bits() & 0x8000_0000
    } else {
        q.to_bits()
    }
}

fn check<D: Device>(dev: &D, what: &str) {
    let kernel = numeric_kernel();
    let module = dev.compile(&kernel).expect("compile");
    let seed = Rng::fresh_seed();
    let n = 1 << 20;
    let inp = inputs(seed, n);
    let upload = |v: &[u32]| {
        let b = dev.alloc(v.len() as u64 * 4).expect("alloc");
        dev.write(&b, &bytes(v)).expect("write");
        b
    };
    let (ab, db, xb) = (upload(&inp.a), upload(&inp.d), upload(&inp.x));
    let qb = upload(&vec![0xDEAD_BEEF; n]);
    let cb = upload(&vec![0xDEAD_BEEF; n]);
    let params = (n as u32).to_le_bytes();
    dev.launch(
        &module,
        &kernel,
        [(n as u32).div_ceil(THREADS), 1, 1],
        &params,
        &[&ab, &db, &xb, &qb, &cb],
    )
    .expect("launch");
    let quot = words(&dev.read(&qb, n as u64 * 4).expect("read"));
    let code = words(&dev.read(&cb, n as u64 * 4).expect("read"));
    let mut bad_q = Vec::new();
    let mut bad_c = Vec::new();
    for i in 0..n {
        let want = expected_quotient(inp.a[i], inp.d[i]);
        // The routine's domain is a finite dividend.
        let in_domain = f32::from_bits(inp.a[i]).is_finite();
        if in_domain && quot[i] != want {
            bad_q.push(format!(
                "{:#010x} / {:#010x}: got {:#010x}, want {want:#010x}",
                inp.a[i], inp.d[i], quot[i]
            ));
        }
        let want = f32_to_e4m3(f32::from_bits(inp.x[i])) as u32;
        if code[i] != want {
            bad_c.push(format!(
                "e4m3({:#010x} = {:e}): got {:#04x}, want {want:#04x}",
                inp.x[i],
                f32::from_bits(inp.x[i]),
                code[i]
            ));
        }
    }
    eprintln!(
        "{what}: {n} divisions and {n} e4m3 encodes, {} + {} mismatches (seed {seed})",
        bad_q.len(),
        bad_c.len()
    );
    bad_q.truncate(10);
    bad_c.truncate(10);
    assert!(
        bad_q.is_empty() && bad_c.is_empty(),
        "{what} (seed {seed}):\n{}\n{}",
        bad_q.join("\n"),
        bad_c.join("\n")
    );
}

#[test]
fn numeric_routines_are_bit_exact_on_wgpu() {
    match sparse_mla::runtime::wgpu::WgpuDevice::all() {
        Ok(devs) => {
            let mut ran = false;
            for d in devs.into_iter().flatten() {
                check(&d, &format!("wgpu {}", d.name()));
                ran = true;
            }
            if !ran {
                common::skip("wgpu", "no adapter could be opened");
            }
        }
        Err(e) => common::skip("wgpu", &e.to_string()),
    }
}

#[test]
fn numeric_routines_are_bit_exact_on_cuda() {
    match sparse_mla::runtime::cuda::CudaDevice::all() {
        Ok(devs) => {
            for d in devs.into_iter().flatten() {
                check(&d, &format!("cuda {}", d.name()));
            }
        }
        Err(e) => common::skip("cuda", &e.to_string()),
    }
}

#[test]
fn numeric_kernel_compiles_for_every_cuda_arch() {
    if let Some(why) = sparse_mla::runtime::cuda::nvrtc_unavailable() {
        common::skip("nvrtc", &why);
        return;
    }
    let kernel = numeric_kernel();
    let src = sparse_mla::emit::cuda::emit(&kernel).expect("emit");
    for arch in ["sm_80", "sm_89", "sm_90", "sm_120"] {
        if let Err(e) = sparse_mla::runtime::cuda::compile(&kernel.name, &src, arch, false) {
            panic!("{arch}: {e}");
        }
    }
}
