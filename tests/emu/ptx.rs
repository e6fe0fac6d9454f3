//! A translator of the inline PTX in the emitted CUDA C into calls of the emulator's
//! instruction functions (`ptx::` in prelude.h), so that the helpers the emitter prints run
//! as printed: `asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));` becomes
//! `ptx::cvt_rn_bf16x2_f32((r), (float)(hi), (float)(lo));`, the operands in the order of
//! the asm string, each bound to its constraint's C++ expression. An instruction the
//! emulator does not model is a C++ compile error naming it.
//!
//! Handled: `asm` / `asm volatile` statements with string templates, output / input /
//! clobber sections; instructions separated by `;`, `{ }` scope blocks, `.reg .pred` /
//! `.reg .b32` / `.reg .b64` declarations, `@p` / `@!p` guards, vector operands `{a, b}`,
//! memory operands `[x]` / `[x+imm]`, immediates, the sink `_`.

/// Translate every asm statement of `src`.
pub fn translate(src: &str) -> Result<String, String> {
    let mut out = String::with_capacity(src.len());
    let bytes = src.as_bytes();
    let mut i = 0;
    while i < src.len() {
        if let Some(len) = asm_start(src, i) {
            let open = i + len; // at '('
            let close = matching_paren(src, open)?;
            let inner = &src[open + 1..close];
            let mut end = close + 1;
            while end < src.len() && bytes[end].is_ascii_whitespace() {
                end += 1;
            }
            if end >= src.len() || bytes[end] != b';' {
                return Err(format!("asm statement without ';' at byte {i}"));
            }
            out.push_str(&statement(inner)?);
            i = end + 1;
        } else {
            let c = src[i..].chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    Ok(out)
}

/// `asm(` or `asm volatile(` starting at `i` (as a whole word): the length up to the '('.
fn asm_start(src: &str, i: usize) -> Option<usize> {
    let rest = &src[i..];
    if !rest.starts_with("asm") {
        return None;
    }
    if i > 0 {
        let prev = src.as_bytes()[i - 1];
        if prev.is_ascii_alphanumeric() || prev == b'_' {
            return None;
        }
    }
    let mut j = 3;
    let b = rest.as_bytes();
    let skip_ws = |j: &mut usize| {
        while *j < b.len() && b[*j].is_ascii_whitespace() {
            *j += 1;
        }
    };
    skip_ws(&mut j);
    if rest[j..].starts_with("volatile") {
        j += "volatile".len();
        skip_ws(&mut j);
    }
    (j < b.len() && b[j] == b'(').then_some(j)
}

fn matching_paren(src: &str, open: usize) -> Result<usize, String> {
    let b = src.as_bytes();
    let mut depth = 0;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'"' => i = skip_string(b, i)?,
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Ok(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    Err("unbalanced parentheses in an asm statement".into())
}

/// Index of the closing quote of the string starting at `i`.
fn skip_string(b: &[u8], i: usize) -> Result<usize, String> {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Ok(j),
            _ => j += 1,
        }
    }
    Err("unterminated string in an asm statement".into())
}

/// Split at top-level `sep` (outside strings and brackets).
fn split_top(s: &str, sep: u8) -> Result<Vec<String>, String> {
    let b = s.as_bytes();
    let mut parts = Vec::new();
    let (mut depth, mut start, mut i) = (0i32, 0, 0);
    while i < b.len() {
        match b[i] {
            b'"' => i = skip_string(b, i)?,
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(s[start..i].to_string());
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    parts.push(s[start..].to_string());
    Ok(parts)
}

struct Operand {
    constraint: String,
    expr: String,
}

impl Operand {
    fn output(&self) -> bool {
        self.constraint.starts_with('=') || self.constraint.starts_with('+')
    }
    /// The C++ expression for this operand as an instruction argument.
    fn arg(&self) -> String {
        if self.output() {
            return format!("({})", self.expr);
        }
        let ty = match self.constraint.trim_start_matches(['=', '+', '&']) {
            "r" => "unsigned",
            "f" => "float",
            "h" => "unsigned short",
            "l" => "unsigned long long",
            "d" => "double",
            _ => return format!("({})", self.expr),
        };
        format!("(({ty})({}))", self.expr)
    }
}

fn operands(section: &str) -> Result<Vec<Operand>, String> {
    let mut out = Vec::new();
    for part in split_top(section, b',')? {
        let p = part.trim();
        if p.is_empty() {
            continue;
        }
        let b = p.as_bytes();
        if b[0] != b'"' {
            return Err(format!("asm operand without a constraint: {p}"));
        }
        let q = skip_string(b, 0)?;
        let constraint = p[1..q].to_string();
        let rest = p[q + 1..].trim();
        if !rest.starts_with('(') || !rest.ends_with(')') {
            return Err(format!("asm operand without (expr): {p}"));
        }
        out.push(Operand {
            constraint,
            expr: rest[1..rest.len() - 1].to_string(),
        });
    }
    Ok(out)
}

/// The template: adjacent string literals, concatenated and unescaped.
fn template(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'"' {
            let q = skip_string(b, i)?;
            let lit = &s[i + 1..q];
            let mut chars = lit.chars();
            while let Some(c) = chars.next() {
                if c == '\\' {
                    match chars.next() {
                        Some('n') | Some('t') => out.push(' '),
                        Some(o) => out.push(o),
                        None => {}
                    }
                } else {
                    out.push(c);
                }
            }
            i = q + 1;
        } else if b[i].is_ascii_whitespace() {
            i += 1;
        } else {
            return Err(format!("unexpected text in an asm template: {}", &s[i..]));
        }
    }
    Ok(out)
}

fn statement(inner: &str) -> Result<String, String> {
    let sections = split_top(inner, b':')?;
    let tmpl = template(&sections[0])?;
    let mut ops = Vec::new();
    if let Some(outs) = sections.get(1) {
        ops.extend(operands(outs)?);
    }
    if let Some(ins) = sections.get(2) {
        ops.extend(operands(ins)?);
    }
    let mut code = String::from("{ unsigned long long emu_sink_ = 0; (void)emu_sink_; ");
    for piece in tmpl.split(';') {
        // scope braces (not those of vector operands) are the unbalanced ones
        let mut inst = piece.trim();
        let balance = |s: &str| s.matches('{').count() as i32 - s.matches('}').count() as i32;
        while balance(inst) > 0 {
            match inst.strip_prefix('{') {
                Some(rest) => inst = rest.trim(),
                None => break,
            }
        }
        while balance(inst) < 0 {
            match inst.strip_suffix('}') {
                Some(rest) => inst = rest.trim(),
                None => break,
            }
        }
        if inst.is_empty() {
            continue;
        }
        code.push_str(&instruction(inst, &ops)?);
        code.push(' ');
    }
    code.push('}');
    Ok(code)
}

fn instruction(inst: &str, ops: &[Operand]) -> Result<String, String> {
    if let Some(decl) = inst.strip_prefix(".reg") {
        let decl = decl.trim();
        let (ty, names) = decl
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("bad .reg declaration: {inst}"))?;
        let cty = match ty {
            ".pred" => "bool",
            ".b32" | ".u32" | ".s32" => "unsigned",
            ".b64" | ".u64" | ".s64" => "unsigned long long",
            ".f32" => "float",
            other => return Err(format!("unsupported .reg type {other}")),
        };
        return Ok(format!("{cty} {};", names.trim()));
    }
    let (guard, inst) = match inst.strip_prefix('@') {
        Some(rest) => {
            let (g, body) = rest
                .split_once(char::is_whitespace)
                .ok_or_else(|| format!("guard without instruction: {inst}"))?;
            (Some(g.to_string()), body.trim())
        }
        None => (None, inst),
    };
    let (mnemonic, rest) = match inst.split_once(char::is_whitespace) {
        Some((m, r)) => (m, r.trim()),
        None => (inst, ""),
    };
    let mut args = Vec::new();
    if !rest.is_empty() {
        for a in split_top(rest, b',')? {
            operand_args(a.trim(), ops, &mut args)?;
        }
    }
    let call = format!("ptx::{}({});", mangle(mnemonic), args.join(", "));
    Ok(match guard {
        Some(g) => match g.strip_prefix('!') {
            Some(p) => format!("if (!{p}) {{ {call} }}"),
            None => format!("if ({g}) {{ {call} }}"),
        },
        None => call,
    })
}

fn operand_args(a: &str, ops: &[Operand], out: &mut Vec<String>) -> Result<(), String> {
    if let Some(v) = a.strip_prefix('{').and_then(|x| x.strip_suffix('}')) {
        for x in split_top(v, b',')? {
            operand_args(x.trim(), ops, out)?;
        }
        return Ok(());
    }
    if let Some(m) = a.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        let (base, off) = match m.split_once('+') {
            Some((b, o)) => (b.trim(), Some(o.trim())),
            None => (m.trim(), None),
        };
        let base = scalar(base, ops)?;
        out.push(match off {
            Some(o) => format!("ptx::Mem{{(unsigned long long)({base}) + {o}ull}}"),
            None => format!("ptx::Mem{{(unsigned long long)({base})}}"),
        });
        return Ok(());
    }
    out.push(scalar(a, ops)?);
    Ok(())
}

fn scalar(a: &str, ops: &[Operand]) -> Result<String, String> {
    if let Some(n) = a.strip_prefix('%') {
        let i: usize = n
            .parse()
            .map_err(|_| format!("bad operand placeholder %{n}"))?;
        let op = ops
            .get(i)
            .ok_or_else(|| format!("placeholder %{i} has no operand"))?;
        return Ok(op.arg());
    }
    if a == "_" {
        return Ok("emu_sink_".into());
    }
    if a.starts_with(|c: char| c.is_ascii_digit() || c == '-') {
        return Ok(format!("{a}u").replace("uu", "u"));
    }
    if a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Ok(a.to_string());
    }
    Err(format!("unsupported PTX operand `{a}`"))
}

/// `cp.async.bulk.shared::cluster.global` -> `cp_async_bulk_shared__cluster_global`.
pub fn mangle(mnemonic: &str) -> String {
    mnemonic.replace("::", "__").replace('.', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_operands_in_template_order() {
        let src = r#"asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));"#;
        let t = translate(src).unwrap();
        assert!(
            t.contains("ptx::cvt_rn_bf16x2_f32((r), ((float)(hi)), ((float)(lo)));"),
            "{t}"
        );
    }

    #[test]
    fn vectors_memory_and_blocks() {
        let src = r#"asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(a), "r"(ph) : "memory");"#;
        let t = translate(src).unwrap();
        assert!(t.contains("bool p;"), "{t}");
        assert!(t.contains("ptx::mbarrier_try_wait_parity_shared__cta_b64(p, ptx::Mem{(unsigned long long)(((unsigned)(a)))}, ((unsigned)(ph)));"), "{t}");
        assert!(t.contains("ptx::selp_u32((ok), 1u, 0u, p);"), "{t}");
    }
}
