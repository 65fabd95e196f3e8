//! Launch parameters of the norm kernels: one `#[repr(C)]` block passed by value.

use crate::column_sum::GroupSums;

/// Launch parameters of the forward. Row strides are in elements; a statistic pointer of 0 skips
/// saving it, a `beta` of 0 means no bias (LayerNorm only; RMSNorm ignores `beta` and `mean`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardParams {
    pub x: u64,
    pub y: u64,
    pub gamma: u64,
    pub beta: u64,
    pub mean: u64,
    pub rstd: u64,
    pub x_stride: u64,
    pub y_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub eps: f32,
    /// `1/d`, rounded once on the host.
    pub inv_d: f32,
    /// Added to γ in fp32 (`y = x̂·(γ + offset)`, Gemma's `1 + γ`); 0 for plain γ.
    pub gamma_offset: f32,
    /// 1: γ and β are stored as f32 (whatever the activations' dtype); 0: in the activations' dtype.
    pub params_f32: u32,
    /// Residual families only: `h = x + residual` is written to `residual_out` and normalized.
    pub residual: u64,
    pub residual_out: u64,
    pub residual_stride: u64,
    pub residual_out_stride: u64,
    /// 1: stored as f32; 0: in the activations' dtype (each of the two on its own).
    pub residual_f32: u32,
    pub residual_out_f32: u32,
}

/// Launch parameters of the backward (dx and the dγ, dβ partials).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BackwardParams {
    pub x: u64,
    pub dy: u64,
    pub gamma: u64,
    /// Saved μ per row (LayerNorm only).
    pub mean: u64,
    /// Saved rstd per row, or 0: recompute μ and rstd from x (nothing saved by the forward).
    pub rstd: u64,
    pub dx: u64,
    /// `[groups, d]` fp32 dγ partials.
    pub partials: u64,
    /// `[groups, d]` fp32 dβ partials, or 0 for none (LayerNorm only).
    pub dbeta_partials: u64,
    pub x_stride: u64,
    pub dy_stride: u64,
    pub dx_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub rows_per_group: u32,
    pub groups: u32,
    pub inv_d: f32,
    /// As in the forward: dŷ = dy·(γ + offset); dγ does not see it.
    pub gamma_offset: f32,
    /// For recomputing the statistics when `rstd == 0`.
    pub eps: f32,
    /// 1: γ is stored as f32; 0: in the activations' dtype.
    pub params_f32: u32,
    /// Residual families only: 1 when x (the forward's `residual_out`) and `dresidual` are stored
    /// as f32 rather than in dy's dtype.
    pub x_f32: u32,
    /// Ring instances only (`NormKey::ring`): 1 to stage the rows through the ring in a block of
    /// any size (the host's choice, `policy::block_takes_ring`); 0 to stage them only where
    /// `policy::block_stages_rows` and prefetch them in registers elsewhere.
    pub stage_rows: u32,
    /// Residual families only: the gradient arriving on the forward's `residual_out`, added into
    /// dx; 0 for none.
    pub dresidual: u64,
    pub dresidual_stride: u64,
    /// What becomes of the partial rows: a column sum after this launch, the sums in this
    /// launch, or atomic adds (then `partials`/`dbeta_partials` are the f32 dγ/dβ themselves).
    pub sums: GroupSums,
}
