//! RMSNorm forward and backward.
//!
//! Forward, per row: `rstd = 1/sqrt(mean(x²) + eps)`, `y = x·rstd·γ`; saves fp32 `rstd`.
//! Backward, per row: `x̂ = x·rstd` (recomputed from x and the saved rstd, never stored),
//! `dŷ = dy·γ`, `dx = rstd·(dŷ − x̂·mean(dŷ·x̂))`. dγ = Σ_rows dy·x̂: each group of
//! `rows_per_group` consecutive rows accumulates its partial in fp32 registers and writes one row
//! of the `[groups, d]` fp32 workspace; [`crate::reduce::column_sum`] then adds the groups in a
//! fixed order. The group count is a function of the shape only, so dγ is the same bits on any
//! grid and any GPU.
//!
//! One block works on one row at a time. Register tiles (`VPT` = 1, 2, 4 accesses per thread)
//! load the whole row once and keep it on chip: 16-byte packs give every thread `VPT·16` bytes in
//! flight per operand. Rows too wide for registers use the streaming instance (`VPT` = 0), which
//! reads the row twice — the second read mostly hits L2.

use crate::arch;
use crate::element::{Access, Element, Pack, load_f32s, row_addr, store_f32s};
use crate::reduce::BlockReducer;
use crate::variant::export_family;

/// Launch parameters of the forward. Row strides are in elements; `rstd == 0` skips saving it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardParams {
    pub x: u64,
    pub y: u64,
    pub gamma: u64,
    pub rstd: u64,
    pub x_stride: u64,
    pub y_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub eps: f32,
    /// `1/d`, rounded once on the host.
    pub inv_d: f32,
}

/// Launch parameters of the backward (dx and the dγ partials).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BackwardParams {
    pub x: u64,
    pub dy: u64,
    pub gamma: u64,
    pub rstd: u64,
    pub dx: u64,
    /// `[groups, d]` fp32 workspace.
    pub partials: u64,
    pub x_stride: u64,
    pub dy_stride: u64,
    pub dx_stride: u64,
    pub rows: u32,
    pub d: u32,
    pub rows_per_group: u32,
    pub groups: u32,
    pub inv_d: f32,
    pub _pad: u32,
}

/// The forward; launch one block per row, any grid (blocks walk rows by grid stride).
///
/// # Safety
/// The params describe valid, non-overlapping buffers laid out as the [`crate::variant::Variant`]
/// requires; the block is a multiple of 32 threads with enough of them to cover the row in `VPT`.
pub unsafe fn forward<T: Element, const VEC: bool, const VPT: usize>(p: &ForwardParams) {
    unsafe {
        if VPT == 0 {
            forward_stream::<T, VEC>(p)
        } else {
            forward_regs::<T, VEC, VPT>(p)
        }
    }
}

#[inline(always)]
unsafe fn forward_regs<T: Element, const VEC: bool, const VPT: usize>(p: &ForwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let elem = |k: usize| (tid + k * threads) * len;
    // γ is the same for every row: load it once per block.
    let mut gamma: [Pack; VPT] = [[0; 4]; VPT];
    for (k, g) in gamma.iter_mut().enumerate() {
        if elem(k) < d {
            *g = unsafe { Access::<T, VEC>::load(p.gamma, elem(k)) };
        }
    }
    // As in the backward: the next row's loads are issued before this row's reduction and stores.
    let load_row = |row: usize| {
        let x_row = row_addr::<T>(p.x, row, p.x_stride);
        let mut x: [Pack; VPT] = [[0; 4]; VPT];
        for (k, xk) in x.iter_mut().enumerate() {
            if elem(k) < d {
                *xk = unsafe { Access::<T, VEC>::load(x_row, elem(k)) };
            }
        }
        x
    };
    let rows = p.rows as usize;
    let mut row = arch::block_idx();
    let mut next = if row < rows {
        load_row(row)
    } else {
        [[0; 4]; VPT]
    };
    while row < rows {
        let x = next;
        if row + arch::grid_dim() < rows {
            next = load_row(row + arch::grid_dim());
        }
        let mut sum_sq = 0.0f32;
        for xk in &x {
            for i in 0..len {
                let v = T::get(xk, i);
                sum_sq += v * v;
            }
        }
        let rstd = arch::rsqrt(unsafe { reducer.sum(sum_sq) } * p.inv_d + p.eps);
        if tid == 0 && p.rstd != 0 {
            unsafe { (p.rstd as *mut f32).add(row).write(rstd) };
        }
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        for k in 0..VPT {
            if elem(k) < d {
                let mut y: Pack = [0; 4];
                for i in 0..len {
                    T::set(&mut y, i, T::get(&x[k], i) * rstd * T::get(&gamma[k], i));
                }
                unsafe { Access::<T, VEC>::store(y_row, elem(k), &y) };
            }
        }
        row += arch::grid_dim();
    }
}

#[inline(always)]
unsafe fn forward_stream<T: Element, const VEC: bool>(p: &ForwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let accesses = d.div_ceil(len);
    let mut row = arch::block_idx();
    while row < p.rows as usize {
        let x_row = row_addr::<T>(p.x, row, p.x_stride);
        let mut sum_sq = 0.0f32;
        let mut a = tid;
        while a < accesses {
            let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
            for i in 0..len {
                let v = T::get(&x, i);
                sum_sq += v * v;
            }
            a += threads;
        }
        let rstd = arch::rsqrt(unsafe { reducer.sum(sum_sq) } * p.inv_d + p.eps);
        if tid == 0 && p.rstd != 0 {
            unsafe { (p.rstd as *mut f32).add(row).write(rstd) };
        }
        let y_row = row_addr::<T>(p.y, row, p.y_stride);
        let mut a = tid;
        while a < accesses {
            let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
            let g = unsafe { Access::<T, VEC>::load(p.gamma, a * len) };
            let mut y: Pack = [0; 4];
            for i in 0..len {
                T::set(&mut y, i, T::get(&x, i) * rstd * T::get(&g, i));
            }
            unsafe { Access::<T, VEC>::store(y_row, a * len, &y) };
            a += threads;
        }
        row += arch::grid_dim();
    }
}

/// The backward: dx, and one dγ partial row per group; launch any grid (blocks walk groups by
/// grid stride), then [`crate::reduce::column_sum`] over the partials.
///
/// # Safety
/// As for [`forward`]; `partials` holds `groups · d` f32, 16-byte aligned.
pub unsafe fn backward<T: Element, const VEC: bool, const VPT: usize>(p: &BackwardParams) {
    unsafe {
        if VPT == 0 {
            backward_stream::<T, VEC>(p)
        } else {
            backward_regs::<T, VEC, VPT>(p)
        }
    }
}

#[inline(always)]
unsafe fn backward_regs<T: Element, const VEC: bool, const VPT: usize>(p: &BackwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let elem = |k: usize| (tid + k * threads) * len;
    let mut gamma: [Pack; VPT] = [[0; 4]; VPT];
    for (k, g) in gamma.iter_mut().enumerate() {
        if elem(k) < d {
            *g = unsafe { Access::<T, VEC>::load(p.gamma, elem(k)) };
        }
    }
    let rows = p.rows as usize;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        let mut dgamma = [[0.0f32; 8]; VPT];
        // Loads of row r+1 are issued before row r's reduction and stores, so a block always has
        // a row in flight: with only a couple of blocks per SM that is what hides memory latency.
        let load_row = |row: usize| {
            let x_row = row_addr::<T>(p.x, row, p.x_stride);
            let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
            let mut x: [Pack; VPT] = [[0; 4]; VPT];
            let mut dy: [Pack; VPT] = [[0; 4]; VPT];
            for k in 0..VPT {
                if elem(k) < d {
                    x[k] = unsafe { Access::<T, VEC>::load(x_row, elem(k)) };
                    dy[k] = unsafe { Access::<T, VEC>::load(dy_row, elem(k)) };
                }
            }
            (x, dy, unsafe { (p.rstd as *const f32).add(row).read() })
        };
        let mut next = if first < end {
            load_row(first)
        } else {
            ([[0; 4]; VPT], [[0; 4]; VPT], 0.0)
        };
        for row in first..end {
            let (x, dy, rstd) = next;
            if row + 1 < end {
                next = load_row(row + 1);
            }
            let mut dot = 0.0f32;
            for k in 0..VPT {
                for i in 0..len {
                    dot += T::get(&dy[k], i) * T::get(&gamma[k], i) * (T::get(&x[k], i) * rstd);
                }
            }
            let mean_dot = unsafe { reducer.sum(dot) } * p.inv_d;
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            for k in 0..VPT {
                if elem(k) < d {
                    let mut dx: Pack = [0; 4];
                    for i in 0..len {
                        let x_hat = T::get(&x[k], i) * rstd;
                        let dy_i = T::get(&dy[k], i);
                        let dy_hat = dy_i * T::get(&gamma[k], i);
                        T::set(&mut dx, i, rstd * (dy_hat - x_hat * mean_dot));
                        dgamma[k][i] += dy_i * x_hat;
                    }
                    unsafe { Access::<T, VEC>::store(dx_row, elem(k), &dx) };
                }
            }
        }
        let partial_row = p.partials + (group * d * 4) as u64;
        for (k, dg) in dgamma.iter().enumerate() {
            if elem(k) < d {
                unsafe { store_f32s::<VEC>(partial_row, elem(k), dg, len) };
            }
        }
        group += arch::grid_dim();
    }
}

#[inline(always)]
unsafe fn backward_stream<T: Element, const VEC: bool>(p: &BackwardParams) {
    let mut reducer = BlockReducer::new();
    let len = Access::<T, VEC>::LEN;
    let (tid, threads, d) = (arch::thread_idx(), arch::block_dim(), p.d as usize);
    let accesses = d.div_ceil(len);
    let rows = p.rows as usize;
    let mut group = arch::block_idx();
    while group < p.groups as usize {
        let first = group * p.rows_per_group as usize;
        let end = (first + p.rows_per_group as usize).min(rows);
        // Too wide for registers: the group's dγ partial accumulates in its own workspace row,
        // which only this block touches (each thread re-reads exactly what it wrote).
        let partial_row = p.partials + (group * d * 4) as u64;
        for row in first..end {
            let rstd = unsafe { (p.rstd as *const f32).add(row).read() };
            let x_row = row_addr::<T>(p.x, row, p.x_stride);
            let dy_row = row_addr::<T>(p.dy, row, p.dy_stride);
            let mut dot = 0.0f32;
            let mut a = tid;
            while a < accesses {
                let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { Access::<T, VEC>::load(p.gamma, a * len) };
                for i in 0..len {
                    dot += T::get(&dy, i) * T::get(&g, i) * (T::get(&x, i) * rstd);
                }
                a += threads;
            }
            let mean_dot = unsafe { reducer.sum(dot) } * p.inv_d;
            let dx_row = row_addr::<T>(p.dx, row, p.dx_stride);
            let mut a = tid;
            while a < accesses {
                let x = unsafe { Access::<T, VEC>::load(x_row, a * len) };
                let dy = unsafe { Access::<T, VEC>::load(dy_row, a * len) };
                let g = unsafe { Access::<T, VEC>::load(p.gamma, a * len) };
                let mut dgamma = if row == first {
                    [0.0f32; 8]
                } else {
                    unsafe { load_f32s::<VEC>(partial_row, a * len, len) }
                };
                let mut dx: Pack = [0; 4];
                for i in 0..len {
                    let x_hat = T::get(&x, i) * rstd;
                    let dy_i = T::get(&dy, i);
                    T::set(&mut dx, i, rstd * (dy_i * T::get(&g, i) - x_hat * mean_dot));
                    dgamma[i] += dy_i * x_hat;
                }
                unsafe { Access::<T, VEC>::store(dx_row, a * len, &dx) };
                unsafe { store_f32s::<VEC>(partial_row, a * len, &dgamma, len) };
                a += threads;
            }
        }
        group += arch::grid_dim();
    }
}

export_family!("rms_norm_fwd", ForwardParams, forward);
export_family!("rms_norm_bwd", BackwardParams, backward);

/// The forward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn forward_body(v: crate::variant::Variant) -> unsafe fn(&ForwardParams) {
    crate::variant::select_family!(v, ForwardParams, forward)
}

/// The backward body a variant names, for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
pub fn backward_body(v: crate::variant::Variant) -> unsafe fn(&BackwardParams) {
    crate::variant::select_family!(v, BackwardParams, backward)
}
