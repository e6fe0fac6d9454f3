//! Virtual block table (docs/math.md, vLLM's semantics): logical positions → physical slots.
//!
//! `slot = block_table[r][pos / page_size] · page_size + pos % page_size`, −1 when
//! `pos < 0`, `pos / page_size >= max_pages`, or the block id is negative. Two more cases
//! give −1 so that no input can address outside the table or wrap an i32: a request row
//! `r` outside the table, and a slot past `i32::MAX`.

use crate::mla::VbtShape;

/// The physical slot of logical position `pos` of the sequence whose block table row is
/// `row` (`[max_pages]` block ids, −1 where none is assigned).
pub fn slot(row: &[i32], page_size: u32, pos: i32) -> i32 {
    if pos < 0 || page_size == 0 {
        return -1;
    }
    let (page, offset) = (pos as u64 / page_size as u64, pos as u64 % page_size as u64);
    match row.get(page as usize) {
        Some(&block) if block >= 0 => {
            let s = block as u64 * page_size as u64 + offset;
            if s > i32::MAX as u64 {
                -1
            } else {
                s as i32
            }
        }
        _ => -1,
    }
}

/// The conversion kernel's reference: `positions [tokens, topk]`, `block_table [requests,
/// max_pages]`, `req_of_token [tokens]` → `slots [tokens, topk]`.
pub fn positions_to_slots(
    shape: &VbtShape,
    positions: &[i32],
    block_table: &[i32],
    req_of_token: &[i32],
) -> Vec<i32> {
    let (t_n, k_n, m) = (
        shape.tokens as usize,
        shape.topk as usize,
        shape.max_pages as usize,
    );
    assert_eq!(positions.len(), t_n * k_n, "positions");
    assert_eq!(
        block_table.len(),
        shape.requests as usize * m,
        "block_table"
    );
    assert_eq!(req_of_token.len(), t_n, "req_of_token");
    let mut out = Vec::with_capacity(t_n * k_n);
    for t in 0..t_n {
        let r = req_of_token[t];
        let row = if r >= 0 && (r as u32) < shape.requests {
            Some(&block_table[r as usize * m..(r as usize + 1) * m])
        } else {
            None
        };
        for &pos in &positions[t * k_n..(t + 1) * k_n] {
            out.push(row.map_or(-1, |row| slot(row, shape.page_size, pos)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_vllm() {
        let row = [3, -1, 0];
        assert_eq!(slot(&row, 4, 0), 12);
        assert_eq!(slot(&row, 4, 3), 15);
        assert_eq!(slot(&row, 4, 4), -1, "unassigned page");
        assert_eq!(slot(&row, 4, 9), 1);
        assert_eq!(slot(&row, 4, 12), -1, "past the table");
        assert_eq!(slot(&row, 4, -1), -1);
        assert_eq!(slot(&[i32::MAX], 2, 0), -1, "slot past i32::MAX");
    }

    #[test]
    fn a_token_of_an_unknown_request_gets_no_slots() {
        let shape = VbtShape {
            tokens: 2,
            topk: 2,
            requests: 1,
            max_pages: 2,
            page_size: 4,
        };
        let slots = positions_to_slots(&shape, &[0, 5, 0, 5], &[2, 7], &[0, 1]);
        assert_eq!(slots, vec![8, 29, -1, -1]);
    }
}
