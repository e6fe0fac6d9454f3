//! The online-softmax tile op under the tensor-core lowering, on layouts the decode kernel
//! does not use: S and the output spread over warps in other ways (rows exchanged through
//! the shared table, or each warp holding whole rows with no exchange), the row state kept
//! in registers across a pipeline, or written back after every step when the loop also
//! reads it or the op is not in a pipeline. Each kernel runs on the CPU emulator of the
//! emitted CUDA C (tests/emu) and is checked against a float64 online softmax.

mod common;
mod emu;

use sparse_mla::kir::builder::*;
use sparse_mla::kir::ir::{Access, Elem, Expr, Kernel, TileElem};
use sparse_mla::kir::ops::{online_softmax_update, SoftmaxState, MASKED};
use sparse_mla::kir::{lower, Lowering};
use sparse_mla::runtime::gpu::Device;
use sparse_mla::util::Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// In a pipeline's compute stage: the state stays in registers for the whole loop.
    Pipeline,
    /// The same, but the loop also reads the shared row max after each step.
    PipelinePeek,
    /// In a plain loop: every step reads and writes the shared state.
    Loop,
}

/// threads, rows, S columns, output columns.
#[derive(Clone, Copy, Debug)]
struct Layout(u32, u32, u32, u32);

const STEPS: u32 = 3;

/// Offsets of the results in `out`: o [rows, d], s [rows, n], p [rows, n], m [rows],
/// l [rows], then the row max after each step [steps, rows].
fn offsets(Layout(_, rows, n, d): Layout) -> [u32; 7] {
    let o = 0;
    let s = o + rows * d;
    let p = s + rows * n;
    let m = p + rows * n;
    let l = m + rows;
    let peek = l + rows;
    [o, s, p, m, l, peek, peek + STEPS * rows]
}

fn kernel(layout: Layout, mode: Mode) -> Kernel {
    let Layout(threads, rows, n, d) = layout;
    let [o_at, s_at, p_at, m_at, l_at, peek_at, _] = offsets(layout);
    let name = format!("online_softmax_w{threads}_r{rows}_n{n}_d{d}_{mode:?}").to_lowercase();
    let mut b = KernelBuilder::new(name, threads);
    let scores = b.buffer("scores", Elem::F32, Access::Read, "[steps, rows, n]");
    let o_in = b.buffer("o_in", Elem::F32, Access::Read, "[rows, d]");
    let out = b.buffer("out", Elem::F32, Access::ReadWrite, "results");
    let s_tile = b.shared_tile("s_in", TileElem::F32, rows, n);
    let p_tile = b.shared_tile("p_tile", TileElem::F32, rows, n);
    let s = b.acc_tile("s", rows, n);
    let o = b.acc_tile("o", rows, d);
    let st = SoftmaxState::declare(&mut b, rows);
    st.init(&mut b);
    b.acc_for_each(&o, |b, e| {
        let at = b.let_("at", e.row.clone() * u(d) + e.col.clone());
        b.set(&e.v0, o_in.at(at.clone()));
        b.set(&e.v1, o_in.at(at + u(1)));
    });
    let step_body = |b: &mut KernelBuilder, step: Expr, from_tile: bool| {
        b.acc_for_each(&s, |b, e| {
            for (k, v) in [(0, &e.v0), (1, &e.v1)] {
                let c = e.col.clone() + u(k);
                let x = if from_tile {
                    s_tile.at(e.row.clone(), c)
                } else {
                    scores.at((step.clone() * u(rows) + e.row.clone()) * u(n) + c)
                };
                b.set(v, x);
            }
        });
        online_softmax_update(b, &st, &s, &[&o], &p_tile);
        if mode == Mode::PipelinePeek {
            b.for_threads("r", u(rows), |b, r| {
                let at = u(peek_at) + step * u(rows) + r.clone();
                b.store(&out, at, st.m.at(r));
            });
        }
    };
    match mode {
        Mode::Loop => b.for_("step", u(0), u(STEPS), u(1), |b, step| {
            step_body(b, step, false)
        }),
        Mode::Pipeline | Mode::PipelinePeek => b.pipeline(
            "step",
            u(STEPS),
            |b, step| {
                b.gather_rows(&s_tile, 0, n, &scores, |_, r| {
                    ((step * u(rows) + r) * u(n)).as_i32()
                })
            },
            |b, step| step_body(b, step, true),
        ),
    }
    b.acc_for_each(&o, |b, e| {
        let at = b.let_("at", u(o_at) + e.row.clone() * u(d) + e.col.clone());
        b.store(&out, at.clone(), e.v0.clone());
        b.store(&out, at + u(1), e.v1.clone());
    });
    b.acc_for_each(&s, |b, e| {
        let at = b.let_("at", u(s_at) + e.row.clone() * u(n) + e.col.clone());
        b.store(&out, at.clone(), e.v0.clone());
        b.store(&out, at + u(1), e.v1.clone());
    });
    b.for_threads("i", u(rows * n), |b, i| {
        let v = p_tile.at(i.clone() / u(n), i.clone() % u(n));
        b.store(&out, u(p_at) + i, v);
    });
    b.for_threads("r", u(rows), |b, r| {
        b.store(&out, u(m_at) + r.clone(), st.m.at(r.clone()));
        b.store(&out, u(l_at) + r.clone(), st.l.at(r));
    });
    b.finish().expect("valid description")
}

/// The float64 online softmax of the same steps: (o, p of the last step, m, l, m per step).
type Expected = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

fn expected(layout: Layout, scores: &[f32], o_in: &[f32]) -> Expected {
    let Layout(_, rows, n, d) = layout;
    let (rows, n, d) = (rows as usize, n as usize, d as usize);
    let mut o: Vec<f64> = o_in.iter().map(|&x| x as f64).collect();
    let mut p = vec![0.0; rows * n];
    let mut m = vec![MASKED as f64; rows];
    let mut l = vec![0.0; rows];
    let mut peek = Vec::new();
    for step in 0..STEPS as usize {
        for r in 0..rows {
            let row = &scores[(step * rows + r) * n..][..n];
            let m_new = row.iter().fold(m[r], |a, &x| a.max(x as f64));
            let alpha = (m[r] - m_new).exp();
            let mut sum = 0.0;
            for c in 0..n {
                let x = row[c];
                let v = if x < -1.0e38 {
                    0.0
                } else {
                    (x as f64 - m_new).exp()
                };
                p[r * n + c] = v;
                sum += v;
            }
            l[r] = l[r] * alpha + sum;
            for c in 0..d {
                o[r * d + c] *= alpha;
            }
            m[r] = m_new;
        }
        peek.extend_from_slice(&m);
    }
    (o, p, m, l, peek)
}

fn max_err(got: &[f32], want: &[f64], scale: f64) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                (g as f64 - w).abs() / scale.max(w.abs())
            }
        })
        .fold(0.0, f64::max)
}

fn run(dev: &emu::EmuDevice, layout: Layout, mode: Mode, seed: u64) -> Result<(), String> {
    let Layout(_, rows, n, d) = layout;
    let (ru, nu) = (rows as usize, n as usize);
    let mut rng = Rng::new(seed);
    let mut scores: Vec<f32> = (0..STEPS * rows * n)
        .map(|_| {
            if rng.below(5) == 0 {
                MASKED
            } else {
                rng.uniform(-8.0, 8.0)
            }
        })
        .collect();
    for step in 0..STEPS as usize {
        for c in 0..nu {
            // row 1: empty throughout; row 2: empty in the first step only
            scores[(step * ru + 1) * nu + c] = MASKED;
            if step == 0 {
                scores[2 * nu + c] = MASKED;
            }
        }
    }
    let o_in: Vec<f32> = (0..rows * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let kernel = lower(
        &kernel(layout, mode),
        Lowering::Mma {
            stages: 2,
            min_workgroups: 0,
            l2_ahead: 0,
        },
    )
    .map_err(|e| e.to_string())?;
    let module = dev.compile(&kernel).map_err(|e| e.to_string())?;
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let out_len = offsets(layout)[6] as u64 * 4;
    let bufs = [
        dev.alloc(scores.len() as u64 * 4)
            .map_err(|e| e.to_string())?,
        dev.alloc(o_in.len() as u64 * 4)
            .map_err(|e| e.to_string())?,
        dev.alloc(out_len).map_err(|e| e.to_string())?,
    ];
    dev.write(&bufs[0], &bytes(&scores))
        .map_err(|e| e.to_string())?;
    dev.write(&bufs[1], &bytes(&o_in))
        .map_err(|e| e.to_string())?;
    // the output starts as NaN (the emulator's fresh memory): an unwritten value shows
    dev.launch(
        &module,
        &kernel,
        [1, 1, 1],
        &[],
        &[&bufs[0], &bufs[1], &bufs[2]],
    )
    .map_err(|e| e.to_string())?;
    let raw = dev.read(&bufs[2], out_len).map_err(|e| e.to_string())?;
    let got: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let [o_at, s_at, p_at, m_at, l_at, peek_at, end] = offsets(layout).map(|x| x as usize);
    let (o, p, m, l, peek) = expected(layout, &scores, &o_in);
    let mut failures = Vec::new();
    let mut check = |what: &str, err: f64, tol: f64| {
        if err.is_nan() || err > tol {
            failures.push(format!("{what} error {err:.2e} > {tol:.0e}"));
        }
    };
    check("o", max_err(&got[o_at..s_at], &o, 1.0), 1e-5);
    check(
        "s (p of the last step)",
        max_err(&got[s_at..p_at], &p, 1.0),
        1e-5,
    );
    check("p_tile", max_err(&got[p_at..m_at], &p, 1.0), 1e-5);
    check("m", max_err(&got[m_at..l_at], &m, 1.0), 0.0);
    check("l", max_err(&got[l_at..peek_at], &l, 1e-30), 1e-5);
    if mode == Mode::PipelinePeek {
        check(
            "m after each step",
            max_err(&got[peek_at..end], &peek, 1.0),
            0.0,
        );
    }
    if got[l_at + 1] != 0.0 || got[m_at + 1] != MASKED {
        failures.push(format!(
            "empty row: m {} l {} (want MASKED, 0)",
            got[m_at + 1],
            got[l_at + 1]
        ));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

#[test]
fn online_softmax_on_tensor_core_layouts() {
    if let Some(why) = emu::gxx_unavailable() {
        common::skip("g++", &why);
        return;
    }
    let dev = emu::EmuDevice::new(1);
    let layouts = [
        // the decode kernel's H <= 16 shape: S over 4 warps along N, O over all 8
        Layout(256, 16, 32, 64),
        // S 2 x 4 warps, O 1 x 8: different rows per thread in S and O
        Layout(256, 32, 32, 128),
        // S and O 2 x 2 warps: the same rows, S split along N
        Layout(128, 32, 16, 16),
        // S and O 2 x 1 warps: each warp holds whole rows, no exchange
        Layout(64, 32, 8, 16),
        // one warp holds everything, the other holds nothing
        Layout(64, 16, 8, 8),
    ];
    let mut failed = Vec::new();
    for layout in layouts {
        for mode in [Mode::Pipeline, Mode::PipelinePeek, Mode::Loop] {
            let seed = Rng::fresh_seed();
            match run(&dev, layout, mode, seed) {
                Ok(()) => eprintln!("emu online softmax {layout:?} {mode:?}: ok"),
                Err(e) => failed.push(format!("{layout:?} {mode:?} (seed {seed}): {e}")),
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
