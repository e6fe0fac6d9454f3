//! Virtual-block-table conversion (docs/math.md), described once: logical top-k positions
//! become physical cache slots through vLLM's block table,
//! `slot = block_table[r, pos / page_size] · page_size + pos % page_size` with
//! `r = req_of_token[t]`; −1 when `pos < 0`, `pos / page_size >= max_pages`, the block id is
//! negative, `r` is outside the table, or the slot would not fit in an i32 (the last two so
//! that no input can make the kernel read outside `block_table` or wrap). Reference:
//! [`crate::reference::vbt`].
//!
//! One thread per entry of `[tokens, topk]`, in a grid-stride loop.

use super::{pack_params, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::mla::VbtShape;
use crate::Result;
use std::sync::{Arc, OnceLock};

pub const THREADS: u32 = 256;
pub const NAME: &str = "vbt_positions_to_slots";

/// The conversion kernel.
pub fn kernel() -> Result<Kernel> {
    let mut b = KernelBuilder::new(NAME, THREADS);
    b.doc(
        "Virtual block table: logical top-k positions -> physical slots (vLLM's block table)."
            .to_string(),
    );
    b.doc("slots[t, j] = block_table[r, pos / page_size] * page_size + pos % page_size, r = req_of_token[t], pos = positions[t, j];".to_string());
    b.doc("-1 when pos < 0, pos / page_size >= max_pages, the block id < 0, r outside [0, requests), or block id > max_block.".to_string());
    b.doc(
        "Grid: x = min(ceil(tokens * topk / 256), 65535); a grid-stride loop covers the rest."
            .to_string(),
    );
    let entries = b.param("entries", Ty::U32, "tokens x topk");
    let topk = b.param("topk", Ty::U32, "entries per token");
    let requests = b.param("requests", Ty::U32, "rows of block_table");
    let max_pages = b.param("max_pages", Ty::U32, "columns of block_table");
    let page_size = b.param("page_size", Ty::U32, "slots per page (>= 1)");
    let max_block = b.param(
        "max_block",
        Ty::U32,
        "largest block id whose slots fit in an i32: (2^31 - page_size) / page_size",
    );
    let positions = b.buffer(
        "positions",
        Elem::I32,
        Access::Read,
        "[tokens, topk] logical positions (-1: none)",
    );
    let block_table = b.buffer(
        "block_table",
        Elem::I32,
        Access::Read,
        "[requests, max_pages] block ids (-1: none)",
    );
    let req_of_token = b.buffer(
        "req_of_token",
        Elem::I32,
        Access::Read,
        "[tokens] block_table row of each token",
    );
    let slots = b.buffer(
        "slots",
        Elem::I32,
        Access::ReadWrite,
        "[tokens, topk] physical slots (-1: invalid)",
    );

    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(THREADS) + local_id(),
        entries,
        stride,
        |b, e| {
            let t = b.let_("t", e.clone() / topk);
            let r = b.let_("r", req_of_token.at(t));
            let pos = b.let_("pos", positions.at(e.clone()));
            let pos_u = b.let_("pos_u", pos.clone().max(i(0)).as_u32());
            let page = b.let_("page", pos_u.clone() / page_size.clone());
            let in_table = b.let_(
                "in_table",
                r.clone()
                    .ge(i(0))
                    .and(r.clone().as_u32().lt(requests))
                    .and(pos.ge(i(0)))
                    .and(page.clone().lt(max_pages.clone())),
            );
            b.comment("read the table only at an entry inside it");
            let entry = select(in_table.clone(), r.as_u32() * max_pages + page, u(0));
            let block = b.let_("block", block_table.at(entry));
            let valid = in_table
                .and(block.clone().ge(i(0)))
                .and(block.clone().as_u32().le(max_block.clone()));
            let slot = (block.as_u32() * page_size.clone() + pos_u % page_size.clone()).as_i32();
            b.store(&slots, e, select(valid, slot, i(-1)));
        },
    );
    b.finish()
}

/// The lowered kernel, built once per process.
pub fn lowered_kernel() -> Result<Arc<Kernel>> {
    static K: OnceLock<Arc<Kernel>> = OnceLock::new();
    if let Some(k) = K.get() {
        return Ok(k.clone());
    }
    let k = Arc::new(crate::kir::lower(&kernel()?, crate::kir::Lowering::Scalar)?);
    Ok(K.get_or_init(|| k).clone())
}

/// The launch of one conversion. Buffers are bound by name: `positions`, `block_table`,
/// `req_of_token`, `slots`.
pub fn launch(shape: &VbtShape) -> Result<Launch> {
    shape.validate()?;
    let k = lowered_kernel()?;
    let entries = shape.tokens * shape.topk;
    let params = pack_params(
        &k,
        &[
            ("entries", ParamValue::U32(entries)),
            ("topk", ParamValue::U32(shape.topk)),
            ("requests", ParamValue::U32(shape.requests)),
            ("max_pages", ParamValue::U32(shape.max_pages)),
            ("page_size", ParamValue::U32(shape.page_size)),
            ("max_block", ParamValue::U32(shape.max_block())),
        ],
    )?;
    Ok(Launch {
        kernel: k,
        grid: [entries.div_ceil(THREADS).min(65535), 1, 1],
        params,
    })
}
