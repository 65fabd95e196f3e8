//! What a norm kernel instance does beyond its math, decided once from its key: whether it keeps
//! the next row in flight, where γ lives, whether rows arrive through shared memory, and so how
//! much shared memory a block needs. The kernels use these as constants; the tables hand the
//! shared-memory sizes to the host, whose launch plan reads them from there. The measurements
//! behind each choice are in `bench-results/h200.md`.

use super::segments::{SEGMENT_THREADS, combine_words};
use super::staged::staged_words_end;
use super::tile::SharedGamma;
use super::{Norm, NormKey, Normalization};
use crate::arch;
use crate::element::Element;
use crate::reduce::ROW_REDUCER_SHARED_WORDS;

/// Accesses per thread of the streaming instances: the row is re-read from memory (mostly L2)
/// instead of held in registers.
pub const STREAM: usize = 0;

/// Whether a forward register tile (`vpt` ≥ 1) of `elem_bytes` elements, of a block or of a
/// cluster's block (`cluster`), loads the next row before reducing this one: LayerNorm's 4-pack
/// tiles (at 16 bits, rows wider than 4096) but its f32 cluster tile. Their 512-thread blocks
/// (d = 8193..16384) fit one per SM, and the next row's loads hide the row's latency that no other
/// block on the SM would. RMSNorm's 4-pack tile keeps no next row: its registers then fit four
/// 256-thread blocks per SM on the one-shot grid ([`forward_tile_grid`]), or a 1024-thread block
/// that holds a row of 32768 16-bit elements the streaming tile would read twice. The narrower
/// tiles' blocks fit four or more per SM, a row each: there the next row's registers would cost
/// resident blocks, which hide the latency instead. The residual families hold f32 rows: no room.
/// LayerNorm's f32 cluster tile neither: without the next row its 512-thread blocks fit two per SM
/// instead of one, faster at its 256 KiB rows; its 16-bit cluster tiles were much slower without
/// it. LayerNorm's 2-pack tile was slower with it on H100s; its H200 A/B is still owed
/// (`bench-results/h200.md`, forty-third, forty-eighth and forty-ninth sessions).
pub const fn forward_prefetches(
    centered: bool,
    residual: bool,
    cluster: bool,
    elem_bytes: usize,
    vpt: usize,
) -> bool {
    centered && !residual && vpt >= 4 && !(cluster && elem_bytes == 4)
}

/// Whether a plain forward row past the preferred block (256 threads) tries the register tile of
/// `vpt` accesses before the others: the 4-pack tile, whose 512 threads fit two blocks per SM
/// where the 2-pack tile's 1024 fit one (`bench-results/h200.md`, forty-fourth session). The
/// residual families' rows are f32 in registers: the fewest accesses, more warps.
pub const fn forward_wide_block_first(residual: bool, vpt: usize) -> bool {
    !residual && vpt >= 4
}

/// The widest row (bytes of x) a forward block holds in registers (1024 threads of four 16-byte
/// packs), and the widest a cluster of 8 blocks does (of up to 512 threads each).
const FORWARD_BLOCK_ROW_BYTES: usize = 64 * 1024;
const FORWARD_CLUSTER_ROW_BYTES: usize = 256 * 1024;

/// The widest row (elements) of a forward that holds its row as f32 — LayerNorm's plain 4-pack
/// tile and both residual families' tiles — that does not take a cluster: a block holds no
/// 16-bit row of 32768 in registers, and streaming one from L2 is slower. And LayerNorm's widest
/// residual row that does take one (measured at 128 KiB only).
const F32_BLOCK_ROW_ELEMS: usize = 16384;
const LAYER_NORM_RESIDUAL_CLUSTER_ROW_BYTES: usize = 128 * 1024;

/// Whether a forward may split a row of `d` elements of `elem_bytes` over a cluster of blocks.
/// Forward rows are independent: with a row per SM or more, a block per row outruns a cluster
/// per row where the row fits a block's registers. Rows too wide for that but not for a
/// cluster's registers are the exception: a cluster reads them once where a block would read
/// them twice or stream them — RMSNorm's plain rows of 64–256 KiB, and past 16384 elements the
/// tiles that hold the row as f32 (LayerNorm's plain tiles, both residual families'): LayerNorm's
/// residual rows up to 128 KiB (measured there only), the others up to 256 KiB. f32 rows of 16384
/// elements were slower on clusters and keep a block. Wider rows would stream over a cluster as
/// well: not measured with many rows, they keep a block each (`bench-results/h200.md`,
/// forty-fourth, forty-seventh and forty-eighth sessions).
pub const fn forward_clusters(
    centered: bool,
    residual: bool,
    fewer_rows_than_sms: bool,
    d: usize,
    elem_bytes: usize,
) -> bool {
    let row_bytes = d.saturating_mul(elem_bytes);
    let (past_a_block, most_bytes) = match (centered, residual) {
        (false, false) => (
            row_bytes > FORWARD_BLOCK_ROW_BYTES,
            FORWARD_CLUSTER_ROW_BYTES,
        ),
        (true, true) => (
            d > F32_BLOCK_ROW_ELEMS,
            LAYER_NORM_RESIDUAL_CLUSTER_ROW_BYTES,
        ),
        _ => (d > F32_BLOCK_ROW_ELEMS, FORWARD_CLUSTER_ROW_BYTES),
    };
    fewer_rows_than_sms || (past_a_block && row_bytes <= most_bytes)
}

/// The fewest accesses per thread of a forward register tile. Plain LayerNorm's one-access tile
/// (the block tile of d = 1025..2048 at 16 bits) is issue-bound: two block reductions, γ and β and
/// the row's bookkeeping for each thread's one 16-byte access. Its two-access tile at half the
/// threads spreads that cost over twice the bytes: 2 (measured at 16 bits, when that tile still
/// prefetched the next row, see [`forward_prefetches`]; the same rule moves f32 rows of 513..1024
/// and single-element rows of 129..256 to two accesses, not measured). RMSNorm and the residual
/// families keep the one-access tile (their two-access tiles measured 0–4 points lower at
/// 32768×2048; `bench-results/h200.md`, twentieth session).
pub const fn forward_fewest_accesses(centered: bool, residual: bool) -> usize {
    if centered && !residual { 2 } else { 1 }
}

/// The most threads of a forward streaming block (rows too wide for the register tiles). Plain
/// rows of up to 64 KiB take 512: two blocks per SM, so one block's reductions and stores overlap
/// the other's loads, while their rows in flight (two per SM) stay within L2 for the passes that
/// re-read them. Wider rows overflowed L2 at 512 and the residual forms (two operands per access)
/// lost: they keep one 1024-thread block per SM. Measured at 16 bits (LayerNorm +8 points at
/// d = 32768); f32 rows follow by their bytes (`bench-results/h200.md`, twenty-first session).
pub const fn forward_stream_threads(residual: bool, row_bytes: usize) -> usize {
    if !residual && row_bytes <= 64 * 1024 {
        512
    } else {
        1024
    }
}

/// Whether a forward over segment teams (`super::segments`) of `vpt` accesses per thread takes a
/// one-shot grid — a block of [`forward_one_shot_threads`] per few rows, each team one row and no
/// next row in flight, finished blocks replaced by new ones — rather than the walk, whose teams
/// take a few rows each with the next one in flight ([`FORWARD_WALK_THREADS`]). One-shot
/// teams need no registers for a second row, so more warps stay resident. Plain LayerNorm waits
/// for two reductions per row: with 2 accesses per thread the walk's prefetch hides them better
/// (one-shot measured 2 points lower at d = 256, equal at 128); with 4 one-shot measured 4–6
/// points higher (the packed teams of d = 512, 1024 at 16 bits, since replaced by block tiles;
/// `bench-results/h200.md`, thirty-third session): the single-element teams of 4 keep it.
pub const fn forward_segments_one_shot(centered: bool, residual: bool, vpt: usize) -> bool {
    !centered || residual || vpt >= 4
}

/// How a forward block tile's grid covers the rows (its blocks walk them by grid stride, so a
/// grid limit still holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardTileGrid {
    /// A block per row; finished blocks are replaced by new ones.
    OneShot,
    /// The resident blocks, walking every row in balanced rounds.
    Persistent,
}

/// The grid of a forward block tile — a block per row, `vpt` accesses per thread (or [`STREAM`]),
/// `resident_per_sm` of its blocks on an SM.
///
/// A tile without the next row in flight loses nothing by ending after its row, and the blocks that
/// start load while others reduce and store: one-shot measured 2–9 points higher for every such
/// tile (d = 2048–16384 at 16 bits, 1024–2048 at 32), except LayerNorm's residual tiles that copy γ
/// and β into shared memory ([`forward_params_in_shared`]), which then pay that copy per row — with
/// one block per SM nothing hides it (2 points lower at 4096×16384).
///
/// A tile that prefetches (LayerNorm's 4-pack, [`forward_prefetches`]) goes one-shot where four or
/// more blocks per SM hide a row's latency instead; with one or two, one-shot measured 5–18 points
/// lower (H100, `bench-results/h200.md`, fortieth session), and a walk of 4 rows per block 1.6–3.3
/// lower than the persistent rounds (forty-first session).
///
/// A streaming tile re-reads its row from L2: plain rows in blocks of which two or more fit an SM
/// ([`forward_stream_threads`]: rows of up to 64 KiB) go one-shot too, so one block's passes
/// overlap the next one's loads rather than the persistent rounds ending together (RMSNorm /
/// LayerNorm at 2048×32768, 16 bits: 9.2 and 6.1 points higher, f32 rows at 16384: 8.9); single
/// blocks per SM (128 KiB rows: LayerNorm 1.5 lower) and the residual forms (LayerNorm's 5 lower at
/// 2048×32768) keep their balanced rounds (H100, forty-first session).
pub const fn forward_tile_grid(
    centered: bool,
    residual: bool,
    vec: bool,
    vpt: usize,
    resident_per_sm: usize,
) -> ForwardTileGrid {
    use ForwardTileGrid::{OneShot, Persistent};
    let one_shot = if vpt == STREAM {
        !residual && resident_per_sm >= 2
    } else if forward_prefetches(centered, residual, false, 0, vpt) {
        // (A block tile: its element size does not matter.)
        resident_per_sm >= 4
    } else {
        resident_per_sm >= 2 || !forward_params_in_shared(centered, residual, vec, vpt, 0)
    };
    if one_shot { OneShot } else { Persistent }
}

/// The forward walk's blocks (segment teams where [`forward_segments_one_shot`] is false): this
/// many threads, each team walking [`FORWARD_WALK_ROWS_PER_TEAM`] rows with the next one in
/// flight — a grid of `rows / (teams per block · 4)` blocks, finished blocks replaced by new ones
/// (but never fewer blocks than a team per row keeps resident: a small batch still spreads over
/// the SMs), rather than a persistent grid of [`SEGMENT_THREADS`]-thread blocks walking all rows.
/// Plain LayerNorm at d = 128 and 256 (16 bits) measured 1.5–2 points higher than the persistent
/// walk; 256-thread blocks of 1–8 rows a team 3–14 points lower, 64-thread blocks of 2 level with
/// it (`bench-results/h200.md`, thirty-fourth session). f32 and single-element rows that take the
/// walk follow by the same rule, not measured.
pub const FORWARD_WALK_THREADS: usize = 128;
pub const FORWARD_WALK_ROWS_PER_TEAM: usize = 4;

/// The fewest bytes a one-shot forward block moves (its rows' loads and stores): blocks that move
/// less end faster than the SM starts new ones (RMSNorm d = 128, 16 bits: 2 KiB blocks measured 13
/// points below 4 KiB ones).
pub const FORWARD_ONE_SHOT_BLOCK_BYTES: usize = 4096;

/// Threads of a one-shot forward block of `lanes`-lane segment teams whose rows move `row_bytes`
/// each: the fewest warps (at most [`SEGMENT_THREADS`]) that move
/// [`FORWARD_ONE_SHOT_BLOCK_BYTES`]. Small blocks, because a block's registers come free only
/// when its last warp ends; blocks of a warp or two measured best, 128 threads below both
/// (`bench-results/h200.md`, thirty-second session).
pub const fn forward_one_shot_threads(lanes: usize, row_bytes: usize) -> usize {
    if lanes == 0 {
        return SEGMENT_THREADS;
    }
    let mut threads = arch::WARP;
    while threads < SEGMENT_THREADS
        && (threads / lanes).saturating_mul(row_bytes) < FORWARD_ONE_SHOT_BLOCK_BYTES
    {
        threads *= 2;
    }
    threads
}

/// Whether a forward register tile keeps γ and β in shared memory: LayerNorm's packed residual
/// tiles of a block or cluster. Each thread copies its own accesses of them into its own slots
/// once and reads them back for every row. Their blocks are the widest (1024 threads at
/// d = 16384, which re-read 64 KB of γ and β per row from L1 and L2); in the other families
/// the slots measured mixed, as low as −8 points (`bench-results/h200.md`, seventeenth session).
/// Segment teams' rows are short: their γ stays in L1.
pub const fn forward_params_in_shared(
    centered: bool,
    residual: bool,
    vec: bool,
    vpt: usize,
    lanes: usize,
) -> bool {
    centered && residual && vec && vpt != STREAM && lanes == 0
}

/// The first word of a forward block's γ and β slots ([`forward_params_in_shared`]) and the end
/// of its dynamic shared memory: the reducer's words (segment teams sum by shuffles alone: none),
/// then γ's slots and LayerNorm's β's: per access and thread, 8 f32 in two 16-byte halves, each
/// half of a block's threads consecutive (no bank conflicts).
pub const fn forward_words(
    centered: bool,
    residual: bool,
    vec: bool,
    vpt: usize,
    lanes: usize,
    threads: usize,
) -> (usize, usize) {
    let end = if lanes != 0 {
        0
    } else {
        ROW_REDUCER_SHARED_WORDS
    };
    if forward_params_in_shared(centered, residual, vec, vpt, lanes) {
        let slots = end.next_multiple_of(4);
        let params = 1 + centered as usize;
        (slots, slots + params * vpt * threads * 8)
    } else {
        (end, end)
    }
}

/// Whether a backward register tile or segment team loads the next row before reducing this
/// one. The widest tile of a wide source (the `_res` families hold the row as f32) has no
/// registers left for a second row: it would spill. LayerNorm's widest plain tile makes room by
/// holding γ in shared memory and by its group's first row through `arch::opaque` (no row
/// pointers carried from group to group: it spilled 40–92 bytes at 255 registers before); without
/// the prefetch it spilled nothing but measured 9 points slower (8192×8192: 65.1 → 56.0 % of copy,
/// `bench-results/h200.md`, eighteenth session), so it keeps it.
pub const fn backward_prefetches(wide: bool, vpt: usize) -> bool {
    !(wide && vpt >= 4)
}

/// Elements of a row past which a plain backward (no residual family, no dresidual) of 16-bit
/// elements in 16-byte packs prefers blocks of [`BACKWARD_WIDE_ROW_THREADS`]: rows of more than
/// 512 packs, whose 256-thread tile would be the widest (4 accesses a thread at 255 registers: one
/// block of 8 warps per SM, with nothing to run while it reduces a row). 512 threads of 2 accesses
/// (126 registers) keep 16 warps, and clusters of them split wider rows. Rows of 4096 lost with
/// 512 threads of one access, the residual families lost everywhere, and f32 rows were mixed
/// (8192 gained 2.7, 4096 and 16384 lost 0.5 and 2.4): they keep 256 (`bench-results/h200.md`,
/// forty-sixth session).
pub const BACKWARD_WIDE_ROW_ELEMS: usize = 4096;
pub const BACKWARD_WIDE_ROW_THREADS: usize = 512;

/// Whether a backward's row of `d` elements of `elem_bytes` bytes (in 16-byte packs: `vec`)
/// prefers blocks of [`BACKWARD_WIDE_ROW_THREADS`] ([`BACKWARD_WIDE_ROW_ELEMS`]); `plain`: no
/// residual family and no dresidual.
pub const fn backward_prefers_wide_blocks(
    plain: bool,
    vec: bool,
    elem_bytes: usize,
    d: usize,
) -> bool {
    plain && vec && elem_bytes == 2 && d > BACKWARD_WIDE_ROW_ELEMS
}

/// Loads per thread a streaming pass over a plain row keeps in flight (`rows::stream_accesses`):
/// one at a time, the streaming tile (one 1024-thread block per SM) had 16 KB of loads in flight
/// per SM. Sources of two operands per access (`RowSource::WIDE`, the residual families) keep one:
/// 1024 threads leave them no room. Four or eight in the pass that reads the row from DRAM
/// measured no faster, and eight spilled the cluster instances (`bench-results/h200.md`,
/// twenty-fourth session).
pub const STREAM_DEPTH: usize = 2;

/// Whether a backward register tile holds γ in shared memory rather than in registers:
/// LayerNorm's block tiles of two or more accesses per thread, and the segment teams of one
/// access a lane (`lanes` ≠ 0, both norms). The block tiles' rows, dγ and dβ fill the registers:
/// the widest plain tile needs the room for the next row (it waits on two reductions per row, so
/// it needs one in flight), the two-access tile to keep two blocks per SM (128 registers) without
/// spilling, the widest residual tile to stay within 255. The segment teams keep three blocks per
/// SM at 80 registers with the next row prefetched, where ptxas spilled half of γ and reloaded it
/// every row; with γ in shared memory (8 KB a block) they fit (LayerNorm's dβ and μ besides:
/// on sm_90; RMSNorm's sm_80 build spilled with γ in registers). Their one multi-access instance
/// takes single elements (4 a lane) and keeps γ in registers: 256 threads' γ would need 66 KB.
pub const fn gamma_in_shared(centered: bool, vpt: usize, lanes: usize) -> bool {
    (centered && vpt >= 2 && lanes == 0) || (vpt == 1 && lanes != 0)
}

/// Whether a plain backward instance adds a dresidual in the activations' dtype: the packed
/// segment teams (one access a lane) and the widest register tiles. Of a block, the `_res`
/// instances hold the row as f32 without room for the next one; of a cluster, the [`staged`] ring
/// keeps rows in flight that the `_res` tile (one row in registers at most) does not: with a bf16
/// stream, RMSNorm 4096×16384 measured 46 → 83 % of copy (`bench-results/h200.md`, twenty-third
/// session). Narrower cluster tiles would gain registers with it (RMSNorm's 2-access tile, 117 →
/// 164 at 16 bits) and are not where the stream was slow. Elsewhere the `_res` instances, which
/// prefetch dresidual with the row, are as fast or faster, and the plain ones compile none of it.
pub const fn plain_adds_dresidual(vpt: usize, lanes: usize) -> bool {
    (lanes != 0 && vpt == 1) || (lanes == 0 && vpt == 4)
}

/// Whether a backward instance stages its rows through shared memory
/// (`super::staged::StagedRows`): the plain packed register tiles of a cluster, and RMSNorm's
/// one-access block tile (rows of 257–2048 16-bit elements), where [`block_stages_rows`] says.
/// A cluster's blocks wait on each other every row, so each row waits for the slowest block's
/// loads; the one-access block tile runs one block per dγ group, a few per SM, each with one row
/// prefetched. The copy engine keeps three rows in flight where registers held one, and holds no
/// registers for them. LayerNorm's one-access tile and both norms' wider block tiles measured
/// no faster or slower staged (`bench-results/h200.md`, eighteenth session).
pub const fn staged(
    centered: bool,
    vec: bool,
    cluster: bool,
    residual: bool,
    vpt: usize,
    lanes: usize,
) -> bool {
    vec && !residual && vpt != STREAM && lanes == 0 && (cluster || (!centered && vpt == 1))
}

/// Whether a launch of a [`staged`] block tile of `threads` threads takes the ring rather than
/// its register prefetch (both are compiled; the ring's words are reserved either way): blocks
/// of at least four warps, rows of at least 2 KiB of each operand. Narrower rows take many
/// small groups and blocks, where a bulk copy per operand and row measured slower than the
/// prefetch (RMSNorm 262144×512: 79.8 → 73.3 % of copy). sm_80 builds, without bulk copies
/// ([`arch::SM_90`]), prefetch.
pub const fn block_stages_rows(threads: usize) -> bool {
    arch::SM_90 && threads >= 128
}

/// Rows in flight per block of a [`staged`] instance. Each stage holds the block's share of x and
/// dy (2 operands × `vpt` accesses × 16 bytes per thread: at 4 accesses × 256 threads, 32 KiB);
/// four keep three rows loading while one is worked on (two during pass 1 where a dresidual is
/// added: pass 2 reads the row's stage again, so the stage before it is the one refilled).
/// RMSNorm's f32 2-access cluster tile takes three: ptxas gives it 64 registers (its ring index
/// divided in 32 bits, `StagedRows::stage`), so a row of 65536 f32 fits its 1024-thread blocks
/// over a cluster of 8, whose stage is 64 KiB — four of those do not fit an SM's 227 KiB, and
/// without the ring that row streamed from L2, read twice. (Should a ptxas take more registers,
/// the launch plan, which reads the kernel's limits, streams the row as before.) LayerNorm's
/// takes 80 registers, too many for 1024 threads: a deeper ring would not help it, and the plan
/// splits its rows of 65536 over clusters of 16 instead. A rule per
/// instance, not "the deepest ring that fits": the depth is a constant of the instance, which
/// serves every block size, and the 16-bit 2-access tiles (blocks of 512 at most) keep four.
pub const fn staged_stages(centered: bool, bytes: usize, vpt: usize, cluster: bool) -> usize {
    if !centered && bytes == 4 && vpt == 2 && cluster {
        3
    } else {
        4
    }
}

/// Whether a [`staged`] backward takes its rows two at a time where it can (saved statistics, no
/// dresidual; `super::staged`): the 16-bit one-access ring instances ([`has_ring_instance`]),
/// whose blocks each run one row's chain of load, reduction and store at a time; a second row's
/// sums ride in the same block exchange (RMSNorm one value a row, LayerNorm two). ptxas: RMSNorm's
/// 87 registers → 117, LayerNorm's 96 → 128 — four 128-thread blocks per SM (enough for 512 groups
/// on 132 SMs), two of 256 as before. On an H100: RMSNorm faster at 65536×1024 and small batches
/// of rows of 512, a little slower at 16384×1024 (fifty-fifth session); LayerNorm +1.7–2.0 points
/// in small batches (4096×1024, 8192×512), level at 65536×1024, 0.6 lower at 32768×2048
/// (fifty-sixth; `bench-results/h200.md`). Not the block instances (their budget of 80 would
/// spill) nor f32 rows (1024-thread blocks need 64).
pub const fn pairs_rows(bytes: usize, vpt: usize, ring: bool) -> bool {
    bytes == 2 && vpt == 1 && ring
}

/// Whether a backward block tile (`key`, its `ring` unset) has a ring instance
/// (`NormKey::ring`, sm_90): the plain packed one-access tiles, which stage a row in one pass.
pub const fn has_ring_instance(key: NormKey) -> bool {
    !key.residual && key.vec && key.vpt == 1 && !key.cluster && key.lanes == 0
}

/// Whether a backward block tile (`key`, its `ring` unset) of `threads` threads runs its ring
/// instance instead ([`has_ring_instance`]): LayerNorm's where [`block_stages_rows`] (rows of
/// 1024–2048 16-bit elements), and either norm's where the batch is small (`small_batch`: every
/// dγ group has a resident block of its own, so rows in flight per SM, not blocks, hide the
/// latency: the copy engine keeps three where the register prefetch keeps one). Why an instance
/// of its own: compiled with the ring beside the prefetch, as RMSNorm's block instance is, ptxas
/// gives the tile 96 registers at 16 bits, which the ring's blocks run faster with but which cost
/// the prefetch's 64-thread blocks (rows of 512) two blocks per SM; the block instance, prefetch
/// only, keeps 80. Measured both ways in `bench-results/h200.md` (twenty-eighth to thirtieth
/// sessions).
pub const fn block_takes_ring(key: NormKey, threads: usize, small_batch: bool) -> bool {
    has_ring_instance(key)
        && (small_batch || (matches!(key.norm, Norm::Layer) && block_stages_rows(threads)))
}

/// The first word past the reducer's and γ's ([`gamma_in_shared`]) of a backward block of
/// `threads` threads with `vpt` accesses each.
pub(super) const fn gamma_end(centered: bool, vpt: usize, lanes: usize, threads: usize) -> usize {
    if gamma_in_shared(centered, vpt, lanes) {
        SharedGamma::BASE + vpt * threads * 8
    } else {
        ROW_REDUCER_SHARED_WORDS
    }
}

/// Dynamic shared memory of a forward block of `threads` threads ([`forward_words`]).
pub fn forward_shared_bytes<
    T: Element,
    N: Normalization,
    const VEC: bool,
    const VPT: usize,
    const RESIDUAL: bool,
    const CLUSTER: bool,
    const LANES: usize,
    const RING: bool,
>(
    threads: usize,
) -> usize {
    forward_words(N::CENTERED, RESIDUAL, VEC, VPT, LANES, threads).1 * 4
}

/// The words of a backward block of `threads` threads: where the dresidual slots start (see
/// [`plain_adds_dresidual`]; the end of the rest where there are none) and the end. In order: the
/// reducer's words, γ where [`gamma_in_shared`], the rows in flight where [`staged`] or the segment
/// teams' combine area, then one 16-byte slot per access and thread that dresidual is copied into
/// asynchronously while the row is reduced.
#[allow(clippy::too_many_arguments)]
pub(super) const fn backward_words(
    centered: bool,
    bytes: usize,
    vec: bool,
    vpt: usize,
    residual: bool,
    cluster: bool,
    lanes: usize,
    ring: bool,
    threads: usize,
) -> (usize, usize) {
    let end = gamma_end(centered, vpt, lanes, threads);
    let words = if lanes != 0 {
        combine_words(end, vpt, lanes).1
    } else if ring || staged(centered, vec, cluster, residual, vpt, lanes) {
        let stages = staged_stages(centered, bytes, vpt, cluster);
        staged_words_end(end, stages, vpt, threads)
    } else {
        end
    };
    if !residual && plain_adds_dresidual(vpt, lanes) {
        let slots = words.next_multiple_of(4);
        (slots, slots + vpt * threads * 4)
    } else {
        (words, words)
    }
}

/// Dynamic shared memory of a backward block of `threads` threads: the reducer's words, γ where
/// [`gamma_in_shared`], the rows in flight where [`staged`] or the segment teams' combine area,
/// and the dresidual slots where [`plain_adds_dresidual`].
pub fn backward_shared_bytes<
    T: Element,
    N: Normalization,
    const VEC: bool,
    const VPT: usize,
    const RESIDUAL: bool,
    const CLUSTER: bool,
    const LANES: usize,
    const RING: bool,
>(
    threads: usize,
) -> usize {
    instance_backward_words::<T, N, VEC, VPT, RESIDUAL, CLUSTER, LANES, RING>(threads).1 * 4
}

/// [`backward_words`] of one kernel instance.
#[inline(always)]
pub(super) const fn instance_backward_words<
    T: Element,
    N: Normalization,
    const VEC: bool,
    const VPT: usize,
    const RESIDUAL: bool,
    const CLUSTER: bool,
    const LANES: usize,
    const RING: bool,
>(
    threads: usize,
) -> (usize, usize) {
    backward_words(
        N::CENTERED,
        T::BYTES,
        VEC,
        VPT,
        RESIDUAL,
        CLUSTER,
        LANES,
        RING,
        threads,
    )
}

/// Whether a forward block may need more than the default 48 KiB of shared memory: those with
/// γ and β in it ([`forward_params_in_shared`]), whose slots grow with the block.
pub const fn forward_large_shared(key: NormKey) -> bool {
    forward_params_in_shared(
        matches!(key.norm, Norm::Layer),
        key.residual,
        key.vec,
        key.vpt,
        key.lanes,
    )
}

/// Whether a backward block may need more than the default 48 KiB of shared memory: the
/// [`staged`] ones, whose ring grows with the block, and those with dresidual slots (LayerNorm's
/// widest block tile holds γ there too: 48 KiB and a little more).
pub const fn backward_large_shared(key: NormKey) -> bool {
    staged_instance(key) || (!key.residual && plain_adds_dresidual(key.vpt, key.lanes))
}

/// [`staged`], of an instance's key, or a ring instance.
const fn staged_instance(key: NormKey) -> bool {
    key.ring
        || staged(
            matches!(key.norm, Norm::Layer),
            key.vec,
            key.cluster,
            key.residual,
            key.vpt,
            key.lanes,
        )
}

/// LayerNorm's plain 2-pack block tile, the one instance whose natural register allocation
/// costs a resident block (an SM has 65536 registers: 256-thread blocks fit two at up to 128,
/// four at up to 64, five at up to 48) and which fits the smaller budget without spilling.
const fn layer_norm_two_packs(key: NormKey) -> bool {
    layer_norm_block_tile(key, false) && key.vpt == 2
}

/// LayerNorm's packed register tiles of one block (no cluster, no segment team), plain or with
/// the residual add.
const fn layer_norm_block_tile(key: NormKey, residual: bool) -> bool {
    matches!(key.norm, Norm::Layer)
        && key.residual == residual
        && key.vec
        && key.vpt != STREAM
        && !key.cluster
        && key.lanes == 0
}

/// Registers per thread of a forward instance (0: ptxas's choice). LayerNorm's block tiles wait
/// on two reductions per row, so resident warps are what hides their loads. The plain 2-pack tile
/// takes 48 registers for sm_90 by ptxas's own choice (72 while it prefetched the next row, when
/// its budget was 64): five 256-thread blocks resident; the budget keeps it there (40 keep six
/// without spills: 0.8 points higher at d = 4096, 0.8 lower at 2048; H100, forty-third
/// session). The residual tiles hold the row as f32 (the stream may be f32): ptxas's own choice
/// gave the 2-pack tile 93 (two blocks) and the 4-pack 168 (one block of 256 threads, none of
/// 512); 64 and 128 keep four and two without spills.
/// Their cluster instances keep ptxas's choice (at most 128 since their statistics take one
/// exchange; 157–162 before, which spilled at a budget of 128). The streaming block instances: 64.
pub const fn forward_register_budget(key: NormKey) -> u32 {
    if layer_norm_two_packs(key) {
        48
    } else if layer_norm_block_tile(key, true) {
        match key.vpt {
            2 => 64,
            4 => 128,
            _ => 0,
        }
    } else if key.vpt == STREAM && !key.cluster {
        // The streaming block's 1024 threads (or two blocks of 512) fit 64 registers. LayerNorm's
        // one-pass statistics (`rows::Moments`) took ptxas's choice to 68–72.
        64
    } else {
        0
    }
}

/// A [`staged`] block tile (not a cluster's).
const fn staged_block_tile(key: NormKey) -> bool {
    !key.cluster && staged_instance(key)
}

/// Registers per thread of a backward instance (0: ptxas's choice). The LayerNorm 2-pack tile
/// (d = 2048..4096 at 16 bits): its dβ partials and μ took it to 153–161 registers, one block per
/// SM; it fits 128 without spilling.
pub const fn backward_register_budget(key: NormKey) -> u32 {
    if layer_norm_two_packs(key) {
        128
    } else if key.lanes != 0 && !key.residual {
        // Segment teams (256 threads): 80 keep three blocks per SM where ptxas's own choice
        // (101–128 at 16 bits) keeps two, which measured slower (RMSNorm 1048576×128 84.4 against
        // 77.2 % of copy, LayerNorm 77.9 against 75.8; eighteenth session). With γ in shared
        // memory ([`gamma_in_shared`]) and row addresses not carried from group to group
        // (`arch::opaque`) they fit 80 without spilling (sm_80 builds: with `arch::recomputed_on_sm80`).
        80
    } else if key.dtype.bytes() == 2 && staged_block_tile(key) && !key.ring {
        // The staged block tile compiles the ring and the register prefetch side by side
        // ([`block_stages_rows`]): ptxas's choice of 94 registers at 16 bits keeps ten 64-thread
        // blocks per SM instead of twelve, which cost the prefetch 8 points (262144×512: 79.9 →
        // 71.8 % of copy); 80 keep twelve, without spills on sm_90 since the group's first row
        // goes through `arch::opaque` (40 bytes before).
        80
    } else {
        0
    }
}
