//! WGSL printer. Bindings: group 0, binding 0 is the parameter block (a uniform struct),
//! bindings 1.. the storage buffers in declaration order. bf16 and byte buffers are
//! `array<u32>` (two bf16 / four bytes per word, little-endian); WGSL has no 16- or 8-bit
//! storage types, so packed data is written a whole word at a time.

use super::{f32_literal, header, special_f32, Dialect, Writer};
use crate::kir::ir::*;
use crate::{Error, Result};

/// Print a lowered kernel as a WGSL module with one compute entry point named after it.
pub fn emit(kernel: &Kernel) -> Result<String> {
    if !kernel.is_lowered() {
        return Err(Error::Kir {
            kernel: kernel.name.clone(),
            message: "WGSL emitter given a kernel with tile ops; lower it first".into(),
        });
    }
    if kernel.uses_intrinsics() {
        return Err(Error::Kir {
            kernel: kernel.name.clone(),
            message: "WGSL has no async copies, warp matrix ops or shuffles: this kernel was \
                      lowered for CUDA (tensor-core lowering); lower it with Lowering::Scalar"
                .into(),
        });
    }
    Ok(Printer { kernel }.module())
}

/// The WGSL type a buffer of `elem` is declared as.
fn array_elem(elem: Elem) -> &'static str {
    match elem {
        Elem::F32 => "f32",
        Elem::I32 => "i32",
        Elem::U32 | Elem::Bf16 | Elem::U8 => "u32",
    }
}

fn ty(t: Ty) -> &'static str {
    match t {
        Ty::F32 => "f32",
        Ty::I32 => "i32",
        Ty::U32 | Ty::Bf16 | Ty::F8E4M3 => "u32",
        Ty::Bool => "bool",
    }
}

const HELPERS: &str = r#"// bf16 bits (low 16 of a u32) -> f32: bf16 is the top half of an f32.
fn bf16_to_f32(bits: u32) -> f32 {
    return bitcast<f32>(bits << 16u);
}

// f32 -> bf16 bits, round to nearest even (NaN stays NaN).
fn f32_to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    return f32_to_bf16(lo) | (f32_to_bf16(hi) << 16u);
}

// e4m3 "fn" bits (low 8 of a u32) -> f32: no infinities, 0x7f / 0xff are NaN, max 448.
fn e4m3_to_f32(bits: u32) -> f32 {
    let sign = select(1.0, -1.0, (bits & 0x80u) != 0u);
    let e = (bits >> 3u) & 0xfu;
    let m = f32(bits & 7u);
    if ((bits & 0x7fu) == 0x7fu) {
        return bitcast<f32>(0x7fc00000u | ((bits & 0x80u) << 24u));
    }
    if (e == 0u) {
        return sign * m * (1.0 / 512.0);
    }
    return sign * (1.0 + m * 0.125) * exp2(f32(i32(e) - 7));
}

// Non-finite constants come from bits held in a variable: a WGSL literal must be finite.
fn f32_from_const_bits(bits: u32) -> f32 {
    var b = bits;
    return bitcast<f32>(b);
}
"#;

struct Printer<'k> {
    kernel: &'k Kernel,
}

impl Printer<'_> {
    fn module(&self) -> String {
        let mut w = Writer::new(self.kernel);
        let k = self.kernel;
        for l in header(
            k,
            "WGSL",
            "group 0; binding 0 is `params`, buffer i is binding i + 1",
        ) {
            if l.is_empty() {
                w.line("//");
            } else {
                w.line(&format!("// {l}"));
            }
        }
        let groups = "x, y, z";
        w.line(&format!(
            "// Dispatch: workgroup ids ({groups}) as described above; one invocation per thread."
        ));
        w.line("");
        // Parameter block, padded to 16 bytes as uniform buffers require.
        w.line("struct Params {");
        w.indent += 1;
        for prm in &k.params {
            let line = format!("{}: {},", prm.name, ty(prm.ty));
            w.line(&line);
        }
        let padded = k.params.len().div_ceil(4).max(1) * 4;
        for i in k.params.len()..padded {
            w.line(&format!("pad{i}: u32,"));
        }
        w.indent -= 1;
        w.line("}");
        w.line("");
        w.line("@group(0) @binding(0) var<uniform> params: Params;");
        for (i, b) in k.buffers.iter().enumerate() {
            let access = match b.access {
                Access::Read => "read",
                Access::ReadWrite => "read_write",
            };
            let line = format!(
                "@group(0) @binding({}) var<storage, {access}> {}: array<{}>; // {} {}",
                i + 1,
                b.name,
                array_elem(b.elem),
                b.elem.name(),
                b.doc
            );
            w.line(&line);
        }
        w.line("");
        for s in &k.shared {
            let line = format!("var<workgroup> {}: array<{}, {}>;", s.name, ty(s.ty), s.len);
            w.line(&line);
        }
        w.line("");
        w.out.push_str(HELPERS);
        w.line("");
        w.line(&format!("@compute @workgroup_size({})", k.workgroup_size));
        w.line(&format!(
            "fn {}(@builtin(local_invocation_index) local_id: u32, @builtin(workgroup_id) wg_id: vec3<u32>, @builtin(num_workgroups) wg_count: vec3<u32>) {{",
            k.name
        ));
        w.indent += 1;
        for pv in &k.privates {
            let line = format!("var {}: array<{}, {}>;", pv.name, ty(pv.ty), pv.len);
            w.line(&line);
        }
        for s in &k.body {
            w.stmt(self, s);
        }
        w.indent -= 1;
        w.line("}");
        w.out
    }

    /// An operand: parenthesised unless atomic.
    fn operand(&self, e: &Expr) -> String {
        let s = self.expr(e);
        match e {
            // min / max print as calls: no parentheses needed
            Expr::Bin(BinOp::Min | BinOp::Max, ..) => s,
            Expr::Bin(..) | Expr::Un(..) => format!("({s})"),
            Expr::F32(v) if *v < 0.0 => format!("({s})"),
            Expr::I32(v) if *v < 0 => format!("({s})"),
            _ => s,
        }
    }

    fn expr(&self, e: &Expr) -> String {
        match e {
            Expr::F32(v) => match special_f32(*v) {
                Some(bits) => format!("f32_from_const_bits({bits:#010x}u)"),
                None => f32_literal(*v),
            },
            Expr::I32(v) => format!("{v}i"),
            Expr::U32(v) => format!("{v}u"),
            Expr::Bool(v) => v.to_string(),
            Expr::Var(n, _) => n.clone(),
            Expr::Param(n, _) => format!("params.{n}"),
            Expr::Builtin(b) => match b {
                Builtin::LocalId => "local_id".into(),
                Builtin::WorkgroupId(a) => format!("wg_id.{}", axis(*a)),
                Builtin::NumWorkgroups(a) => format!("wg_count.{}", axis(*a)),
            },
            Expr::Un(op, a) => {
                let a = self.operand(a);
                match op {
                    UnOp::Neg => format!("-{a}"),
                    UnOp::Not => format!("!{a}"),
                    UnOp::BitNot => format!("~{a}"),
                }
            }
            Expr::Bin(op, a, b) => {
                let (x, y) = (self.operand(a), self.operand(b));
                let sym = match op {
                    BinOp::Min => return format!("min({}, {})", self.expr(a), self.expr(b)),
                    BinOp::Max => return format!("max({}, {})", self.expr(a), self.expr(b)),
                    BinOp::Add => "+",
                    BinOp::Sub => "-",
                    BinOp::Mul => "*",
                    BinOp::Div => "/",
                    BinOp::Rem => "%",
                    BinOp::Lt => "<",
                    BinOp::Le => "<=",
                    BinOp::Gt => ">",
                    BinOp::Ge => ">=",
                    BinOp::Eq => "==",
                    BinOp::Ne => "!=",
                    BinOp::And => "&&",
                    BinOp::Or => "||",
                    BinOp::BitAnd => "&",
                    BinOp::BitOr => "|",
                    BinOp::BitXor => "^",
                    BinOp::Shl => "<<",
                    BinOp::Shr => ">>",
                };
                format!("{x} {sym} {y}")
            }
            Expr::Select(c, a, b) => {
                format!(
                    "select({}, {}, {})",
                    self.expr(b),
                    self.expr(a),
                    self.expr(c)
                )
            }
            Expr::Cvt(t, a) => {
                let from = a.ty();
                let x = self.expr(a);
                match (from, t) {
                    (Ty::Bf16, Ty::F32) => format!("bf16_to_f32({x})"),
                    (Ty::F8E4M3, Ty::F32) => format!("e4m3_to_f32({x})"),
                    (Ty::U32, Ty::Bf16) => format!("({x} & 0xffffu)"),
                    (Ty::U32, Ty::F8E4M3) => format!("({x} & 0xffu)"),
                    (f, t) if f == *t => x,
                    (_, t) => format!("{}({x})", ty(*t)),
                }
            }
            Expr::Call(func, args) => {
                let a: Vec<String> = args.iter().map(|x| self.expr(x)).collect();
                match func {
                    Func::Exp | Func::ExpFast => format!("exp({})", a[0]),
                    Func::Exp2Fast => format!("exp2({})", a[0]),
                    Func::Log => format!("log({})", a[0]),
                    Func::Sqrt => format!("sqrt({})", a[0]),
                    Func::Abs => format!("abs({})", a[0]),
                    Func::Fma => format!("fma({}, {}, {})", a[0], a[1], a[2]),
                    Func::PackBf16x2 => format!("pack_bf16x2({}, {})", a[0], a[1]),
                    Func::F32Bits => format!("bitcast<u32>({})", a[0]),
                    Func::F32FromBits => format!("bitcast<f32>({})", a[0]),
                    Func::Clz => format!("countLeadingZeros({})", a[0]),
                    Func::E4m3x2Prep => a[0].clone(),
                    Func::E4m3x2Lo => format!("e4m3_to_f32(({}) & 0xffu)", a[0]),
                    Func::E4m3x2Hi => format!("e4m3_to_f32((({}) >> 8u) & 0xffu)", a[0]),
                    // CUDA only (tensor-core operands): left undefined, so naga refuses it
                    Func::PackE4m3x4 => format!("pack_e4m3x4({})", a.join(", ")),
                    Func::E4m3MmaNative => "e4m3_mma_native()".to_string(),
                    Func::PackF16x2 => format!("pack2x16float(vec2<f32>({}, {}))", a[0], a[1]),
                    Func::F16Lo => format!("unpack2x16float({}).x", a[0]),
                    Func::F16Hi => format!("unpack2x16float({}).y", a[0]),
                    Func::MulF16x2 => format!(
                        "pack2x16float(unpack2x16float({}) * unpack2x16float({}))",
                        a[0], a[1]
                    ),
                    Func::E4m3x2F16 => format!(
                        "pack2x16float(vec2<f32>(e4m3_to_f32(({0}) & 0xffu), e4m3_to_f32((({0}) >> 8u) & 0xffu)))",
                        a[0]
                    ),
                    Func::E4m3F16Unit => "1.0".to_string(),
                }
            }
            Expr::Load { buf, elem, index } => {
                let i = self.expr(index);
                match elem {
                    Elem::Bf16 => {
                        format!("(({buf}[({i}) >> 1u] >> ((({i}) & 1u) * 16u)) & 0xffffu)")
                    }
                    Elem::U8 => format!("(({buf}[({i}) >> 2u] >> ((({i}) & 3u) * 8u)) & 0xffu)"),
                    _ => format!("{buf}[{i}]"),
                }
            }
            Expr::LoadWord { buf, index } => {
                let elem = self.kernel.buffer(buf).map(|b| b.elem).unwrap_or(Elem::U32);
                let i = self.expr(index);
                match elem {
                    Elem::F32 | Elem::I32 => format!("bitcast<u32>({buf}[{i}])"),
                    _ => format!("{buf}[{i}]"),
                }
            }
            Expr::SharedLoad { arr, index, .. } | Expr::PrivateLoad { arr, index, .. } => {
                format!("{arr}[{}]", self.expr(index))
            }
            Expr::TileLoad { tile, .. } => format!("/* unlowered tile load {tile} */ 0.0"),
            Expr::TileWord { tile, .. } => format!("/* unlowered tile word {tile} */ 0u"),
        }
    }
}

impl Dialect for Printer<'_> {
    fn expr(&self, e: &Expr) -> String {
        Printer::expr(self, e)
    }

    fn decl(&self, name: &str, value: &Expr, mutable: bool) -> String {
        let kw = if mutable { "var" } else { "let" };
        format!("{kw} {name}: {} = {};", ty(value.ty()), self.expr(value))
    }

    fn store_word(&self, buf: &str, index: &Expr, value: &Expr) -> String {
        let elem = self.kernel.buffer(buf).map(|b| b.elem).unwrap_or(Elem::U32);
        let v = self.expr(value);
        let v = match elem {
            Elem::F32 => format!("bitcast<f32>({v})"),
            Elem::I32 => format!("bitcast<i32>({v})"),
            _ => v,
        };
        format!("{buf}[{}] = {v};", self.expr(index))
    }

    fn for_head(
        &self,
        var: &str,
        start: &Expr,
        end: &Expr,
        step: &Expr,
        _body: &[Stmt],
    ) -> Vec<String> {
        vec![format!(
            "for (var {var}: {} = {}; {var} < {}; {var} = {var} + {}) {{",
            ty(start.ty()),
            self.expr(start),
            self.expr(end),
            self.expr(step)
        )]
    }

    fn barrier(&self) -> &'static str {
        "workgroupBarrier();"
    }

    fn intrinsic(&self, _: &Intrinsic) -> String {
        "// (CUDA intrinsic: rejected by emit)".into()
    }
}

fn axis(a: u8) -> &'static str {
    match a {
        0 => "x",
        1 => "y",
        _ => "z",
    }
}

/// Validate WGSL with naga (parse + full validation), returning naga's message on failure.
/// A build without the `wgpu` feature has no naga: there it refuses (never passes unchecked).
#[cfg(not(feature = "wgpu"))]
pub fn validate(name: &str, _source: &str) -> Result<()> {
    Err(Error::Compile {
        kernel: name.into(),
        target: "WGSL (naga)".into(),
        log: "this build of sparse-mla has no naga (built without the `wgpu` feature)".into(),
    })
}

/// Validate WGSL with naga (parse + full validation), returning naga's message on failure.
#[cfg(feature = "wgpu")]
pub fn validate(name: &str, source: &str) -> Result<naga::Module> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| Error::Compile {
        kernel: name.into(),
        target: "WGSL (naga parse)".into(),
        log: e.emit_to_string(source),
    })?;
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::default(),
    );
    validator.validate(&module).map_err(|e| Error::Compile {
        kernel: name.into(),
        target: "WGSL (naga validation)".into(),
        log: e.emit_to_string(source),
    })?;
    Ok(module)
}

/// The portable (WebGPU default) workgroup-memory limit our WGSL kernels keep within.
pub const PORTABLE_WORKGROUP_BYTES: u64 = 16 * 1024;
/// The portable (WebGPU default) invocations-per-workgroup limit.
pub const PORTABLE_INVOCATIONS: u32 = 256;

/// Check a lowered kernel against the portable WebGPU limits (naga and wgpu do not check
/// workgroup memory size).
pub fn check_portable_limits(kernel: &Kernel) -> Result<()> {
    if kernel.shared_bytes() > PORTABLE_WORKGROUP_BYTES {
        return Err(Error::ResourceLimit {
            kernel: kernel.name.clone(),
            resource: "workgroup memory (bytes, portable WebGPU limit)".into(),
            needed: kernel.shared_bytes(),
            limit: PORTABLE_WORKGROUP_BYTES,
        });
    }
    if kernel.workgroup_size > PORTABLE_INVOCATIONS {
        return Err(Error::ResourceLimit {
            kernel: kernel.name.clone(),
            resource: "invocations per workgroup (portable WebGPU limit)".into(),
            needed: kernel.workgroup_size as u64,
            limit: PORTABLE_INVOCATIONS as u64,
        });
    }
    Ok(())
}
