//! RMSNorm and LayerNorm, forward and backward: one set of bodies over a [`Normalization`]
//! ([`RmsNorm`] or [`LayerNorm`]; LayerNorm centres the row, RMSNorm does not).
//!
//! Forward, per row: LayerNorm `μ = mean(x)`, `rstd = 1/sqrt(mean((x−μ)²) + eps)`,
//! `y = (x−μ)·rstd·γ + β` (β optional), saving fp32 μ and rstd; RMSNorm the same with μ = 0 and
//! no β, saving rstd. Where the row is on chip the variance is the exact two-pass one; a streamed
//! row (too wide for registers) is read once for both statistics, LayerNorm's variance from each
//! thread's moments merged exactly (`rows::Moments`), not from a sum of squares.
//! `γ + offset` (offset in fp32, Gemma's `1 + γ`) stands for γ everywhere; dγ does not see it.
//! Backward, per row: `x̂ = (x−μ)·rstd` (recomputed from x and the saved statistics, never stored;
//! with nothing saved the statistics themselves are recomputed from the row, one more reduction),
//! `dŷ = dy·γ`, `dx = rstd·(dŷ − mean(dŷ) − x̂·mean(dŷ·x̂))` (RMSNorm drops `mean(dŷ)`).
//! dγ = Σ_rows dy·x̂ and dβ = Σ_rows dy: each group of `rows_per_group` consecutive rows accumulates
//! its partials in fp32 registers and writes one row of each `[groups, d]` fp32 workspace;
//! [`crate::column_sum`] then adds the groups in a fixed order. The group count is a function of
//! the shape only ([`crate::column_sum::group_layout`]), so dγ and dβ are the same bits on any
//! grid and any GPU.
//!
//! Residual fusion (the `_res` kernels): the forward reads `x` and `residual`, writes
//! `h = x + residual` (fp32 sum, one rounding) to `residual_out` and normalizes h *as stored*, so a
//! backward that takes `residual_out` as its x sees exactly the row the forward normalized. The
//! backward adds the gradient arriving on `residual_out` into dx before its one rounding. Residual
//! rows are in the activations' dtype or f32 (a runtime flag, like the parameters'), so one
//! kernel covers both. A backward whose residual stream is in the activations' dtype takes the
//! plain segment teams and widest register tiles (of a block or a cluster) where the `_res` ones
//! lack the registers to keep a row in flight (`policy::plain_adds_dresidual`: x held packed or
//! staged, dresidual copied into shared memory while the row is reduced). The other plain
//! instances contain none of it: where the row comes from is a type parameter of the bodies
//! (`rows`).
//!
//! Rows of up to 256 16-bit elements are taken by segment teams ([`segments`], the `LANES`
//! instances): 8 to 32 lanes per row, several rows per warp, shuffles instead of block barriers.
//! Otherwise a block takes one row at a time. Register tiles (`VPT` = 1, 2, 4 accesses per thread)
//! load the whole row once and keep it on chip: 16-byte packs give every thread `VPT·16` bytes in
//! flight per operand. Rows too wide for one block's registers are split over a cluster of blocks
//! (sm_90; the `CLUSTER` instances, [`crate::reduce::Team`]): each block holds its share of the
//! row and [`crate::reduce::RowReducer`] adds the blocks' partial sums through distributed shared
//! memory; their backward has its rows copied into a ring in shared memory by the copy engine
//! (`staged`), as has RMSNorm's one-access block tile where its blocks have four warps or more
//! ([`policy::staged`]), and, as instances of their own (`NormKey::ring`, the `_v1r` entries),
//! LayerNorm's in blocks of four warps or more and either norm's in a small batch, where every
//! dγ group has a resident block ([`policy::block_takes_ring`]). Rows wider still, or any too wide
//! for a block before sm_90, use the streaming instance (`VPT` = [`STREAM`]), which reads the row
//! more than once (the later reads mostly hit L2), over a cluster where there is one.
//!
//! Parts: `params` (launch parameters), `rows` (where a row comes from, γ/β, statistics),
//! `forward`, `backward` (its register tile in `tile`, the staged ring in `staged`, segment teams
//! in `segments`),
//! [`policy`] (per-instance choices and shared memory), and the kernel table below.

pub mod backward;
pub mod forward;
pub mod params;
pub mod policy;
mod rows;
pub mod segments;
mod staged;
mod tile;

pub use params::{BackwardParams, ForwardParams};
pub use policy::{
    FORWARD_ONE_SHOT_BLOCK_BYTES, FORWARD_WALK_ROWS_PER_TEAM, FORWARD_WALK_THREADS,
    ForwardTileGrid, STREAM, forward_clusters, forward_fewest_accesses, forward_one_shot_threads,
    forward_prefetches, forward_segments_one_shot, forward_stream_threads, forward_tile_grid,
    forward_wide_block_first,
};

use crate::kernel::Dtype;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::Table;
use backward::backward;
use forward::forward;
#[cfg(not(target_arch = "nvptx64"))]
use policy::{
    backward_large_shared, backward_register_budget, backward_shared_bytes, forward_large_shared,
    forward_register_budget, forward_shared_bytes,
};

/// Which norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Norm {
    Rms,
    Layer,
}

/// A norm as a type parameter of the kernel bodies.
pub trait Normalization: 'static {
    const NORM: Norm;
    /// Subtracts the row's mean (LayerNorm) before scaling by its rstd.
    const CENTERED: bool;
}

/// RMSNorm: `y = x·rstd·γ`, `rstd = 1/sqrt(mean(x²) + eps)`.
pub struct RmsNorm;
/// LayerNorm: `y = (x−μ)·rstd·γ + β`.
pub struct LayerNorm;

impl Normalization for RmsNorm {
    const NORM: Norm = Norm::Rms;
    const CENTERED: bool = false;
}
impl Normalization for LayerNorm {
    const NORM: Norm = Norm::Layer;
    const CENTERED: bool = true;
}

/// What selects one compiled norm kernel, forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormKey {
    pub norm: Norm,
    /// The residual kernels (`_res`): h = x + residual in the forward, dresidual in the backward.
    pub residual: bool,
    pub dtype: Dtype,
    /// 16-byte packs (every operand aligned, `d` and strides multiples of the pack) or single
    /// elements (any layout).
    pub vec: bool,
    /// Accesses per thread held in registers, or [`STREAM`].
    pub vpt: usize,
    /// A row is shared by the blocks of a thread-block cluster (sm_90, packed access only).
    pub cluster: bool,
    /// A row is taken by a team of this many lanes of a warp (`segments`), several rows per
    /// warp; 0: by the block or the cluster.
    pub lanes: usize,
    /// A backward block tile the host launches only where it stages its rows through the copy
    /// engine's ring ([`policy::block_takes_ring`]); its block instance is then sized for the
    /// register prefetch alone.
    pub ring: bool,
}

impl NormKey {
    /// A call's key before its launch plan picks the access, tile and cluster.
    pub const fn call(norm: Norm, residual: bool, dtype: Dtype) -> Self {
        NormKey {
            norm,
            residual,
            dtype,
            vec: false,
            vpt: STREAM,
            cluster: false,
            lanes: 0,
            ring: false,
        }
    }
}

/// Declares the norm kernels: for each line, every dtype with packed access over the register
/// tiles, the streaming tile and the table's segment teams (`(vpt, lanes)`), with single-element
/// access over the same register and streaming tiles and the table's single-element segment teams
/// (`single all`) or the streaming tile only (`single stream`), and the cluster instances (packed,
/// every tile, sm_90). Entry names: `<name>_<dtype>_<v|s><tile suffix>[c]`, segment teams
/// `<name>_<dtype>_<v|s><vpt>l<lanes>`.
macro_rules! norm_kernels {
    (
        register_tiles: $tiles:tt;
        $( $table:ident: $params:ty = $body:ident, shared $shared:ident, large $large:ident,
            registers $registers:ident, segments $segs:tt, single segments $ssegs:tt {
            $( $name:literal => $norm:ident, residual $res:literal, single $single:ident, ring $ring:ident; )*
        } )*
    ) => {
        $( $(
            #[cfg(target_arch = "nvptx64")]
            norm_kernels!(@export $name, $params, $body, $norm, $res, $single, $ring, $tiles, $segs, $ssegs);
        )* )*
        $(
            #[cfg(not(target_arch = "nvptx64"))]
            pub static $table: Table<NormKey, $params> = Table::new(&[$(
                &[
                    norm_kernels!(@group $name, "f32", F32, $params, $body, ($shared, $large, $registers), $norm, $res, packed, $tiles, $segs),
                    norm_kernels!(@group $name, "f32", F32, $params, $body, ($shared, $large, $registers), $norm, $res, $single, $tiles, $ssegs),
                    norm_kernels!(@group $name, "f32", F32, $params, $body, ($shared, $large, $registers), $norm, $res, cluster, $tiles, []),
                    norm_kernels!(@ring $ring, $name, "f32", F32, $params, $body, ($shared, $large, $registers), $norm, $res),
                    norm_kernels!(@group $name, "f16", F16, $params, $body, ($shared, $large, $registers), $norm, $res, packed, $tiles, $segs),
                    norm_kernels!(@group $name, "f16", F16, $params, $body, ($shared, $large, $registers), $norm, $res, $single, $tiles, $ssegs),
                    norm_kernels!(@group $name, "f16", F16, $params, $body, ($shared, $large, $registers), $norm, $res, cluster, $tiles, []),
                    norm_kernels!(@ring $ring, $name, "f16", F16, $params, $body, ($shared, $large, $registers), $norm, $res),
                    norm_kernels!(@group $name, "bf16", Bf16, $params, $body, ($shared, $large, $registers), $norm, $res, packed, $tiles, $segs),
                    norm_kernels!(@group $name, "bf16", Bf16, $params, $body, ($shared, $large, $registers), $norm, $res, $single, $tiles, $ssegs),
                    norm_kernels!(@group $name, "bf16", Bf16, $params, $body, ($shared, $large, $registers), $norm, $res, cluster, $tiles, []),
                    norm_kernels!(@ring $ring, $name, "bf16", Bf16, $params, $body, ($shared, $large, $registers), $norm, $res),
                ]
            ),*]);
        )*
    };

    // The PTX entries of one line.
    (@export $name:literal, $params:ty, $body:ident, $norm:ident, $res:literal, $single:ident, $ring:ident, $tiles:tt, $segs:tt, $ssegs:tt) => {
        norm_kernels!(@export_dtype $name, "f32", F32, $params, $body, $norm, $res, $single, $tiles, $segs, $ssegs);
        norm_kernels!(@export_dtype $name, "f16", F16, $params, $body, $norm, $res, $single, $tiles, $segs, $ssegs);
        norm_kernels!(@export_dtype $name, "bf16", Bf16, $params, $body, $norm, $res, $single, $tiles, $segs, $ssegs);
        norm_kernels!(@export_ring $ring, $name, $params, $body, $norm, $res);
    };
    // The ring block tile (`NormKey::ring`): packed, one access per thread, sm_90 (its bulk
    // copies are the copy engine's only there).
    (@export_ring none, $name:literal, $params:ty, $body:ident, $norm:ident, $res:literal) => {};
    (@export_ring block, $name:literal, $params:ty, $body:ident, $norm:ident, $res:literal) => {
        #[cfg(target_feature = "sm_90")]
        const _: () = {
            norm_kernels!(@export_one concat!($name, "_f32_v1r"), $params, $body, F32, true, 1, $norm, $res, false, 0, true);
            norm_kernels!(@export_one concat!($name, "_f16_v1r"), $params, $body, F16, true, 1, $norm, $res, false, 0, true);
            norm_kernels!(@export_one concat!($name, "_bf16_v1r"), $params, $body, Bf16, true, 1, $norm, $res, false, 0, true);
        };
    };
    (@export_dtype $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $norm:ident,
        $res:literal, $single:ident, [$($vpt:literal $sfx:literal),*], [$(($svpt:literal, $slanes:literal)),*], $ssegs:tt) => {
        $( norm_kernels!(@export_one concat!($name, "_", $dn, "_v", $sfx), $params, $body, $t, true, $vpt, $norm, $res, false, 0, false); )*
        norm_kernels!(@export_one concat!($name, "_", $dn, "_vx"), $params, $body, $t, true, 0, $norm, $res, false, 0, false);
        $( norm_kernels!(@export_one concat!($name, "_", $dn, "_v", $svpt, "l", $slanes), $params, $body, $t, true, $svpt, $norm, $res, false, $slanes, false); )*
        norm_kernels!(@export_single $single, $name, $dn, $t, $params, $body, $norm, $res, [$($vpt $sfx),*], $ssegs);
        // Clusters exist from sm_90 on: only that build compiles these.
        #[cfg(target_feature = "sm_90")]
        const _: () = {
            $( norm_kernels!(@export_one concat!($name, "_", $dn, "_v", $sfx, "c"), $params, $body, $t, true, $vpt, $norm, $res, true, 0, false); )*
            norm_kernels!(@export_one concat!($name, "_", $dn, "_vxc"), $params, $body, $t, true, 0, $norm, $res, true, 0, false);
        };
    };
    (@export_single all, $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $norm:ident,
        $res:literal, [$($vpt:literal $sfx:literal),*], [$(($svpt:literal, $slanes:literal)),*]) => {
        $( norm_kernels!(@export_one concat!($name, "_", $dn, "_s", $sfx), $params, $body, $t, false, $vpt, $norm, $res, false, 0, false); )*
        norm_kernels!(@export_one concat!($name, "_", $dn, "_sx"), $params, $body, $t, false, 0, $norm, $res, false, 0, false);
        $( norm_kernels!(@export_one concat!($name, "_", $dn, "_s", $svpt, "l", $slanes), $params, $body, $t, false, $svpt, $norm, $res, false, $slanes, false); )*
    };
    (@export_single stream, $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $norm:ident,
        $res:literal, $tiles:tt, $ssegs:tt) => {
        norm_kernels!(@export_one concat!($name, "_", $dn, "_sx"), $params, $body, $t, false, 0, $norm, $res, false, 0, false);
    };
    (@export_one $entry:expr, $params:ty, $body:ident, $t:ident, $vec:literal, $vpt:literal, $norm:ident,
        $res:literal, $cluster:literal, $lanes:literal, $ring:literal) => {
        $crate::kernel::kernel!(export $entry, $params,
            $body::<$crate::element::$t, $vec, $vpt, $norm, $res, $cluster, $lanes, $ring>);
    };

    // The table entries of one line, one group per (dtype, access).
    (@group $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal, packed, [$($vpt:literal $sfx:literal),*], [$(($svpt:literal, $slanes:literal)),*]) => {
        &[
            $( norm_kernels!(@entry concat!($name, "_", $dn, "_v", $sfx), $t, $params, $body, $policy, $norm, $res, true, $vpt, false, 0, false, 80), )*
            norm_kernels!(@entry concat!($name, "_", $dn, "_vx"), $t, $params, $body, $policy, $norm, $res, true, 0, false, 0, false, 80),
            $( norm_kernels!(@entry concat!($name, "_", $dn, "_v", $svpt, "l", $slanes), $t, $params, $body, $policy, $norm, $res, true, $svpt, false, $slanes, false, 80), )*
        ]
    };
    (@group $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal, all, [$($vpt:literal $sfx:literal),*], [$(($svpt:literal, $slanes:literal)),*]) => {
        &[
            $( norm_kernels!(@entry concat!($name, "_", $dn, "_s", $sfx), $t, $params, $body, $policy, $norm, $res, false, $vpt, false, 0, false, 80), )*
            norm_kernels!(@entry concat!($name, "_", $dn, "_sx"), $t, $params, $body, $policy, $norm, $res, false, 0, false, 0, false, 80),
            $( norm_kernels!(@entry concat!($name, "_", $dn, "_s", $svpt, "l", $slanes), $t, $params, $body, $policy, $norm, $res, false, $svpt, false, $slanes, false, 80), )*
        ]
    };
    (@group $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal, stream, $tiles:tt, $ssegs:tt) => {
        &[
            norm_kernels!(@entry concat!($name, "_", $dn, "_sx"), $t, $params, $body, $policy, $norm, $res, false, 0, false, 0, false, 80),
        ]
    };
    (@group $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal, cluster, [$($vpt:literal $sfx:literal),*], []) => {
        &[
            $( norm_kernels!(@entry concat!($name, "_", $dn, "_v", $sfx, "c"), $t, $params, $body, $policy, $norm, $res, true, $vpt, true, 0, false, 90), )*
            norm_kernels!(@entry concat!($name, "_", $dn, "_vxc"), $t, $params, $body, $policy, $norm, $res, true, 0, true, 0, false, 90),
        ]
    };
    (@ring none, $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal) => {
        &[]
    };
    (@ring block, $name:literal, $dn:literal, $t:ident, $params:ty, $body:ident, $policy:tt,
        $norm:ident, $res:literal) => {
        &[
            norm_kernels!(@entry concat!($name, "_", $dn, "_v1r"), $t, $params, $body, $policy, $norm, $res, true, 1, false, 0, true, 90),
        ]
    };
    (@entry $entry:expr, $t:ident, $params:ty, $body:ident, ($shared:ident, $large:ident, $registers:ident),
        $norm:ident, $res:literal, $vec:literal, $vpt:literal, $cluster:literal, $lanes:literal, $ring:literal, $arch:literal) => {{
        const KEY: NormKey = NormKey {
            norm: <$norm as Normalization>::NORM,
            residual: $res,
            dtype: Dtype::$t,
            vec: $vec,
            vpt: $vpt,
            cluster: $cluster,
            lanes: $lanes,
            ring: $ring,
        };
        $crate::kernel::kernel!(table $entry, KEY, $arch,
            $shared::<$crate::element::$t, $norm, $vec, $vpt, $res, $cluster, $lanes, $ring>,
            $large(KEY),
            $registers(KEY),
            $body::<$crate::element::$t, $vec, $vpt, $norm, $res, $cluster, $lanes, $ring>)
    }};
}

norm_kernels! {
    // Accesses per thread held in registers, and their entry-name suffix. Every kernel also has
    // the streaming tile ([`STREAM`], suffix `x`).
    register_tiles: [1 "1", 2 "2", 4 "4"];

    // Segment teams `(vpt, lanes)`: the forward's reach a row of 256 16-bit elements (128 of f32)
    // with 2 accesses per lane. Wider rows take block tiles: teams of 4 accesses (d = 512 and
    // 1024 at 16 bits, a row per warp at most, 72–77 registers) measured 1.4–2.9 points slower
    // than a one-shot block per row of 1 or 2 accesses per thread, the shape of Liger's kernel,
    // which ncu found with 2.4–2.8 times their resident warps (`bench-results/h200.md`,
    // fifty-seventh session). The backward's hold one access per lane (d ≤ 256 at 16 bits): a
    // thread holds x, dy, γ, dγ, dβ and the next row, and two accesses took 200 registers, one
    // block per SM, slower at d = 512 than the block tile.
    FORWARD: ForwardParams = forward, shared forward_shared_bytes, large forward_large_shared,
        registers forward_register_budget, segments [(2, 8), (2, 16)],
        single segments [(4, 32)] {
        "rms_norm_fwd" => RmsNorm, residual false, single all, ring none;
        "layer_norm_fwd" => LayerNorm, residual false, single all, ring none;
        // Single-element access serves only views that are not 16-byte aligned: register tiles for
        // it would add a third to the residual kernels' PTX for a path that is slow anyway.
        "rms_norm_fwd_res" => RmsNorm, residual true, single stream, ring none;
        "layer_norm_fwd_res" => LayerNorm, residual true, single stream, ring none;
    }

    BACKWARD: BackwardParams = backward, shared backward_shared_bytes, large backward_large_shared,
        registers backward_register_budget, segments [(1, 16), (1, 32)],
        single segments [(4, 32)] {
        "rms_norm_bwd" => RmsNorm, residual false, single all, ring block;
        "layer_norm_bwd" => LayerNorm, residual false, single all, ring block;
        "rms_norm_bwd_res" => RmsNorm, residual true, single stream, ring none;
        "layer_norm_bwd_res" => LayerNorm, residual true, single stream, ring none;
    }
}
