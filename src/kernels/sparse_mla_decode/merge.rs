//! The split kernel that merges its own partials: split and combine in one launch.
//!
//! After writing its partial rows, each workgroup of token `t` meets the token's other
//! `ceil(H / block_h) · S` workgroups ([`KernelBuilder::group_sync`] on the token's pair of
//! counter words), and then the token's workgroups merge its rows together: the (head,
//! column chunk) segments of the token are dealt out round-robin by the workgroup's rank.
//! A segment is merged as the combine kernel merges it, with wider lanes (4 columns) and
//! 8 splits' loads issued before any is folded, so that one workgroup's share is about one
//! L2 round trip. What it saves against two launches: the combine kernel's launch behind the
//! split kernel's last workgroup, and the lse round trip that starts each of its workgroups
//! (at T = 1 the combine was 4.1–4.4 µs of a 13.8 µs call on the H200, benches/NOTES.md
//! v18).
//!
//! The wait needs every workgroup of a token resident at once: the kernel is launched
//! cooperatively ([`crate::kir::ir::GridDependency::cooperative`]), and the host takes this
//! form only where the whole grid fits the GPU at once ([`merge_groups`] says how the
//! segments are cut).

use super::combine::{
    max_combine_groups, merge_segment, merge_shared, MergeForm, MergeGeom, MergeIo,
};
use super::io::{Owner, SplitIo};
use super::DecodeConfig;
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Ty};

/// The merge's form: 4 columns a lane, 8 splits loaded a pass, at least 2 groups (a chunk of
/// at most 2W columns: 512 at 256 threads, d_v).
pub(super) const FORM: MergeForm = MergeForm {
    per_lane: 4,
    unroll: Some(8),
    min_groups: 2,
};

/// What the merged kernel adds to the split kernel's interface.
pub(super) struct MergeExtra {
    pub sync: Buf,
    pub groups: Expr,
}

/// Declare the merged kernel's extra parameter and buffer (after the split kernel's).
pub(super) fn declare(b: &mut KernelBuilder) -> MergeExtra {
    b.doc("Merged form: the splits of each token merge in the same launch (a cooperative launch: every workgroup resident at once). sync: 2 u32 words per token, zero before the first launch and left zero by each.".to_string());
    let groups = b.param(
        "merge_groups",
        Ty::U32,
        "G of the in-kernel merge: a power of two in [2, W / 16]",
    );
    let sync = b.buffer(
        "sync",
        Elem::U32,
        Access::ReadWrite,
        "[tokens, 2] meeting counters (zeroed once)",
    );
    MergeExtra { sync, groups }
}

/// The merge at the end of the split kernel: with more than one split, the workgroups of a
/// split token meet, then merge its (head, chunk) segments round-robin.
pub(super) fn merge_in_kernel(
    b: &mut KernelBuilder,
    cfg: &DecodeConfig,
    io: &SplitIo,
    extra: &MergeExtra,
    own: &Owner,
) {
    let (t, split) = (&own.t, &own.split);
    let mio = MergeIo {
        heads: io.heads.clone(),
        splits: io.splits.clone(),
        whole_tokens: io.whole_tokens.clone(),
        lse_s_q: io.lse_s_q.clone(),
        groups: extra.groups.clone(),
        o_part: io.o_part.clone(),
        lse_part: io.lse_part.clone(),
        out: io.out.clone(),
        lse_out: io.lse_out.clone(),
        sh: merge_shared(b, FORM, cfg.threads),
    };
    let block_h = cfg.block_h;
    let dv = cfg.dims.d_v();
    // (the merged form has no whole tokens: the plan never gives it any)
    b.if_(io.splits.clone().gt(u(1)), |b| {
        b.comment("the token's workgroups meet: every partial of the token is written");
        let head_blocks = b.let_(
            "head_blocks",
            (io.heads.clone() + u(block_h - 1)) / u(block_h),
        );
        let members = b.let_("members", head_blocks.clone() * io.splits.clone());
        b.group_sync(&extra.sync, t.clone(), members.clone());
        b.comment("then merge the token's (head, column chunk) segments, dealt out by rank");
        let rank = b.let_("rank", split.clone() * head_blocks + workgroup_id(0));
        let geom = MergeGeom::new(b, FORM, cfg.threads, &mio);
        let chunks = b.let_(
            "chunks",
            (u(dv) + geom.chunk.clone() - u(1)) / geom.chunk.clone(),
        );
        let segments = b.let_("segments", io.heads.clone() * chunks.clone());
        b.for_("seg", rank, segments, members, |b, seg| {
            let h = b.let_("mh", seg.clone() / chunks.clone());
            let z = b.let_("mz", seg % chunks.clone());
            merge_segment(b, cfg, FORM, &mio, Some(&geom), (h, t.clone(), z));
            // the next segment's groups write the shared arrays this one's meeting reads
            b.barrier();
        });
    });
}

/// Split groups G of the in-kernel merge for a token of `heads` rows, `splits` splits and
/// `members` = ceil(H / block_h) · S workgroups of `threads` threads: the power of two in
/// [2, W / 16] that takes the fewest L2 round trips per workgroup — segments per workgroup
/// (`ceil(H · ceil(d_v / chunk) / members)`) times passes per segment (`ceil(S / 8G)`) —
/// the fewer groups on a tie (fewer loads past the last split).
pub fn merge_groups(heads: u32, splits: u32, members: u32, d_v: u32, threads: u32) -> u32 {
    let mut best = (u64::MAX, FORM.min_groups);
    let mut g = FORM.min_groups;
    while g <= max_combine_groups(threads) {
        let passes = splits.div_ceil(g * FORM.unroll.unwrap_or(1)) as u64;
        let cost = rounds_at(g, heads, members, d_v, threads) as u64 * passes;
        if cost < best.0 {
            best = (cost, g);
        }
        g *= 2;
    }
    best.1
}

/// Segments each workgroup merges one after another (the most of any) at [`merge_groups`]'s
/// choice: `ceil(H · ceil(d_v / chunk) / members)`. Above 1, the merge is a chain of rounds in
/// a few workgroups, where the combine kernel spreads them over many: on the H200 every call
/// of one round ran faster merged, every call of more rounds but two slower (0.87–0.99×,
/// benches/NOTES.md v19).
pub fn merge_rounds(heads: u32, splits: u32, members: u32, d_v: u32, threads: u32) -> u32 {
    let g = merge_groups(heads, splits, members, d_v, threads);
    rounds_at(g, heads, members, d_v, threads)
}

/// Segments per workgroup at `groups` groups: the token's `H · ceil(d_v / chunk)` segments
/// over its `members` workgroups.
fn rounds_at(groups: u32, heads: u32, members: u32, d_v: u32, threads: u32) -> u32 {
    let segments = heads as u64 * d_v.div_ceil(FORM.chunk(threads, groups)) as u64;
    segments.div_ceil(members.max(1) as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_groups_take_one_round_where_the_token_has_enough_workgroups() {
        // T = 1, H 16, 64 splits of one head block: 64 segments of 128 columns (G 8), one
        // each, one pass of 8 splits a group
        assert_eq!(merge_groups(16, 64, 64, 512, 256), 8);
        // 32 splits: 32 segments of 256 columns (G 4), one pass
        assert_eq!(merge_groups(16, 32, 32, 512, 256), 4);
        // few splits, many heads: whole rows (G 2), passes of 16 splits
        assert_eq!(merge_groups(128, 8, 32, 512, 256), 2);
        // one round where the token's workgroups are as many as its segments
        assert_eq!(merge_rounds(16, 64, 64, 512, 256), 1);
        assert_eq!(merge_rounds(16, 8, 8, 512, 256), 2);
        assert_eq!(merge_rounds(64, 2, 4, 512, 256), 16);
        for (h, s, m) in [(1, 2, 2), (128, 128, 512), (16, 3, 3), (64, 5, 10)] {
            let g = merge_groups(h, s, m, 512, 256);
            assert!(
                g.is_power_of_two() && (2..=16).contains(&g),
                "{h} {s} {m}: {g}"
            );
        }
    }
}
