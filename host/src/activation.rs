//! Activations: `y = f(x)` and `dx = dy · f'(preact)` for ReLU, SiLU and GELU (exact and tanh
//! forms); gated forms `h = f(a) · b` (SwiGLU with SiLU, GeGLU with GELU) whose backward gives `da`
//! and `db` in one pass; and a backward that also returns `dbias = Σ_rows dx` through the same
//! deterministic group partials and fixed-order column sum as the norms' dγ.
//!
//! `a` and `b` are two row views: separate tensors, or the two halves of one `[rows, 2·d]` tensor
//! (the `_packed` functions). Every operand has its own row stride. The derivative is recomputed
//! from the saved pre-activation; it never round-trips through memory.

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use normkern_gpu::activation::{Family, Params};
use normkern_gpu::variant::{ActVariant, Dtype as KernelDtype, act};

use crate::context::{Context, Gpu};
use crate::emulator::Emulator;
use crate::error::{Error, Result};
use crate::launch::{Executor, Kernel, Shape, group_layout, launch_column_sum, packs_fit};
use crate::tensor::{Buffer, Dtype, Rows, RowsMut, RowsRef, expect_len};

/// The activation function. For the gated functions: `Silu` is SwiGLU, `GeluErf`/`GeluTanh` GeGLU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Relu,
    Silu,
    /// GELU with the exact erf.
    GeluErf,
    /// GELU with the tanh approximation.
    GeluTanh,
}

impl Activation {
    fn kernel_id(self) -> u32 {
        match self {
            Activation::Relu => act::RELU,
            Activation::Silu => act::SILU,
            Activation::GeluErf => act::GELU_ERF,
            Activation::GeluTanh => act::GELU_TANH,
        }
    }
}

/// f32 elements of workspace [`backward_dbias`] needs for `rows × d`.
pub fn workspace_len(rows: usize, d: usize) -> usize {
    group_layout(rows, d).1 * d
}

/// Threads per block of the elementwise kernels.
const THREADS: usize = 256;

/// A validated call: addresses and strides of up to three row inputs and two row outputs.
struct Call {
    family: Family,
    act: Activation,
    dtype: KernelDtype,
    rows: usize,
    d: usize,
    inputs: Vec<(u64, usize)>,
    outputs: Vec<(u64, usize)>,
    /// `(dbias, workspace)` for [`Family::BackwardDbias`].
    dbias: Option<(u64, u64)>,
}

impl Call {
    fn new<T: Dtype>(
        family: Family,
        act: Activation,
        (rows, d): (usize, usize),
        inputs: Vec<(u64, usize)>,
        outputs: Vec<(u64, usize)>,
    ) -> Self {
        Call {
            family,
            act,
            dtype: T::KERNEL,
            rows,
            d,
            inputs,
            outputs,
            dbias: None,
        }
    }

    /// Also writes dbias at `dbias.0`, through the workspace at `dbias.1`.
    fn with_dbias(self, dbias: Option<(u64, u64)>) -> Self {
        Call { dbias, ..self }
    }

    /// Contiguous operands of an elementwise op are one long row to the kernel: plain indices
    /// instead of row arithmetic, and 16-byte packs whenever the whole buffer allows them.
    fn flattened(mut self) -> Self {
        let len = self.rows * self.d;
        let contiguous = self.dbias.is_none()
            && self.rows > 0
            && self
                .inputs
                .iter()
                .chain(&self.outputs)
                .all(|o| o.1 == self.d)
            && len <= u32::MAX as usize;
        if contiguous {
            (self.rows, self.d) = (1, len);
            for operand in self.inputs.iter_mut().chain(self.outputs.iter_mut()) {
                operand.1 = len;
            }
        }
        self
    }

    fn run(self, exec: &dyn Executor) -> Result<()> {
        self.flattened().launch(exec)
    }

    fn launch(self, exec: &dyn Executor) -> Result<()> {
        let (rows, d) = (self.rows, self.d);
        let (rows_per_group, groups) = group_layout(rows, d);
        if rows > 0 {
            let mut addrs: Vec<u64> = self
                .inputs
                .iter()
                .chain(&self.outputs)
                .map(|o| o.0)
                .collect();
            addrs.extend(self.dbias.map(|(_, ws)| ws));
            let strides: Vec<usize> = self
                .inputs
                .iter()
                .chain(&self.outputs)
                .map(|o| o.1)
                .collect();
            let vec = packs_fit(self.dtype.bytes(), d, &addrs, &strides);
            let len = if vec { 16 / self.dtype.bytes() } else { 1 };
            let accesses = rows * (d / len);
            if accesses > u32::MAX as usize {
                return Err(Error::TooLarge {
                    what: "rows × d",
                    value: rows * d,
                });
            }
            let mut p = Params {
                rows: rows as u32,
                d: d as u32,
                rows_per_group: rows_per_group as u32,
                groups: groups as u32,
                partials: self.dbias.map_or(0, |(_, ws)| ws),
                ..Params::default()
            };
            for (i, (addr, stride)) in self.inputs.iter().enumerate() {
                p.inputs[i] = *addr;
                p.input_strides[i] = *stride as u64;
            }
            for (i, (addr, stride)) in self.outputs.iter().enumerate() {
                p.outputs[i] = *addr;
                p.output_strides[i] = *stride as u64;
            }
            let variant = ActVariant {
                dtype: self.dtype,
                vec,
                act: self.act.kernel_id(),
            };
            let kernel = Kernel::Activation(self.family, variant, p);
            let grid = if self.dbias.is_some() {
                exec.full_grid(groups * (d / len).div_ceil(THREADS))
            } else {
                exec.full_grid(accesses.div_ceil(THREADS * self.family.unroll()))
            };
            exec.launch(
                &kernel,
                Shape {
                    grid,
                    block: THREADS,
                    cluster: 1,
                    shared_bytes: 0,
                },
            )?;
        }
        if let Some((dbias, workspace)) = self.dbias {
            launch_column_sum(exec, self.dtype, (workspace, dbias), None, groups, d)?;
        }
        Ok(())
    }
}

fn same_shape<A: Buffer, B: Buffer>(
    what: &'static str,
    reference: &Rows<A>,
    other: &Rows<B>,
) -> Result<()> {
    other.expect_shape(what, reference.rows, reference.d)
}

/// `(address, stride)` of a device row view, and the guard that orders it on `stream`.
fn dev<'a, T>(
    v: &'a Rows<CudaView<'_, T>>,
    stream: &'a CudaStream,
) -> ((u64, usize), SyncOnDrop<'a>) {
    let (p, g) = v.data.device_ptr(stream);
    ((p, v.stride), g)
}

fn dev_mut<'a, T>(
    v: &'a mut Rows<CudaViewMut<'_, T>>,
    stream: &'a CudaStream,
) -> ((u64, usize), SyncOnDrop<'a>) {
    let stride = v.stride;
    let (p, g) = v.data.device_ptr_mut(stream);
    ((p, stride), g)
}

fn check_streams(
    ctx: &Context,
    stream: &CudaStream,
    operands: &[(&'static str, &CudaStream)],
) -> Result<()> {
    ctx.check_context("stream", stream)?;
    operands
        .iter()
        .try_for_each(|(what, s)| ctx.check_context(what, s))
}

/// Host `(address, stride)` of a row view over a slice.
fn host<T>(v: &Rows<&[T]>) -> (u64, usize) {
    (v.data.as_ptr() as u64, v.stride)
}
fn host_mut<T>(v: &mut Rows<&mut [T]>) -> (u64, usize) {
    (v.data.as_mut_ptr() as u64, v.stride)
}

/// `y = f(x)` on `stream`.
pub fn forward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    x: &RowsRef<'_, T>,
    y: &mut RowsMut<'_, T>,
) -> Result<()> {
    same_shape("y", x, y)?;
    check_streams(
        ctx,
        stream,
        &[("x", x.data.stream()), ("y", y.data.stream())],
    )?;
    let (xa, _x) = dev(x, stream);
    let (ya, _y) = dev_mut(y, stream);
    let call = Call::new::<T>(Family::Forward, act, (x.rows, x.d), vec![xa], vec![ya]);
    call.run(&Gpu { ctx, stream })
}

/// `dx = dy · f'(preact)` on `stream`.
pub fn backward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    dy: &RowsRef<'_, T>,
    preact: &RowsRef<'_, T>,
    dx: &mut RowsMut<'_, T>,
) -> Result<()> {
    same_shape("preact", dy, preact)?;
    same_shape("dx", dy, dx)?;
    check_streams(
        ctx,
        stream,
        &[
            ("dy", dy.data.stream()),
            ("preact", preact.data.stream()),
            ("dx", dx.data.stream()),
        ],
    )?;
    let (dya, _dy) = dev(dy, stream);
    let (pa, _p) = dev(preact, stream);
    let (dxa, _dx) = dev_mut(dx, stream);
    let call = Call::new::<T>(
        Family::Backward,
        act,
        (dy.rows, dy.d),
        vec![dya, pa],
        vec![dxa],
    );
    call.run(&Gpu { ctx, stream })
}

/// [`backward`] writing `dx` over `dy`.
pub fn backward_in_place<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    dy: &mut RowsMut<'_, T>,
    preact: &RowsRef<'_, T>,
) -> Result<()> {
    same_shape("preact", dy, preact)?;
    check_streams(
        ctx,
        stream,
        &[("dy", dy.data.stream()), ("preact", preact.data.stream())],
    )?;
    let (pa, _p) = dev(preact, stream);
    let (dya, _dy) = dev_mut(dy, stream);
    let call = Call::new::<T>(
        Family::Backward,
        act,
        (preact.rows, preact.d),
        vec![dya, pa],
        vec![dya],
    );
    call.run(&Gpu { ctx, stream })
}

/// [`backward`] that also writes `dbias = Σ_rows dx` (`d` elements), bitwise reproducible on any
/// grid and GPU; `workspace` holds at least [`workspace_len`] f32. With no rows dbias is zero.
#[allow(clippy::too_many_arguments)]
pub fn backward_dbias<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    dy: &RowsRef<'_, T>,
    preact: &RowsRef<'_, T>,
    dx: &mut RowsMut<'_, T>,
    dbias: &mut CudaViewMut<'_, T>,
    workspace: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    validate_dbias(dy, preact, dx, dbias.len(), workspace.len())?;
    check_streams(
        ctx,
        stream,
        &[
            ("dy", dy.data.stream()),
            ("preact", preact.data.stream()),
            ("dx", dx.data.stream()),
            ("dbias", dbias.stream()),
            ("workspace", workspace.stream()),
        ],
    )?;
    let (dya, _dy) = dev(dy, stream);
    let (pa, _p) = dev(preact, stream);
    let (dxa, _dx) = dev_mut(dx, stream);
    let (dba, _db) = dbias.device_ptr_mut(stream);
    let (wsa, _ws) = workspace.device_ptr_mut(stream);
    let call = Call::new::<T>(
        Family::BackwardDbias,
        act,
        (dy.rows, dy.d),
        vec![dya, pa],
        vec![dxa],
    )
    .with_dbias(Some((dba, wsa)));
    call.run(&Gpu { ctx, stream })
}

fn validate_dbias<A: Buffer, B: Buffer, C: Buffer>(
    dy: &Rows<A>,
    preact: &Rows<B>,
    dx: &Rows<C>,
    dbias_len: usize,
    ws_len: usize,
) -> Result<()> {
    same_shape("preact", dy, preact)?;
    same_shape("dx", dy, dx)?;
    expect_len("dbias", dbias_len, dy.d)?;
    let needed = workspace_len(dy.rows, dy.d);
    if ws_len < needed {
        return Err(Error::WorkspaceTooSmall {
            needed,
            actual: ws_len,
        });
    }
    Ok(())
}

/// Gated forward `h = f(a) · b` on `stream` (`a`, `b`, `h` all `rows × d`).
pub fn gated_forward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    a: &RowsRef<'_, T>,
    b: &RowsRef<'_, T>,
    h: &mut RowsMut<'_, T>,
) -> Result<()> {
    same_shape("b", a, b)?;
    same_shape("h", a, h)?;
    check_streams(
        ctx,
        stream,
        &[
            ("a", a.data.stream()),
            ("b", b.data.stream()),
            ("h", h.data.stream()),
        ],
    )?;
    let (aa, _a) = dev(a, stream);
    let (ba, _b) = dev(b, stream);
    let (ha, _h) = dev_mut(h, stream);
    let call = Call::new::<T>(
        Family::GatedForward,
        act,
        (a.rows, a.d),
        vec![aa, ba],
        vec![ha],
    );
    call.run(&Gpu { ctx, stream })
}

/// Gated backward on `stream`: `da = dh · b · f'(a)`, `db = dh · f(a)` in one pass.
#[allow(clippy::too_many_arguments)]
pub fn gated_backward<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    dh: &RowsRef<'_, T>,
    a: &RowsRef<'_, T>,
    b: &RowsRef<'_, T>,
    da: &mut RowsMut<'_, T>,
    db: &mut RowsMut<'_, T>,
) -> Result<()> {
    for (what, shape) in [
        ("a", (a.rows, a.d)),
        ("b", (b.rows, b.d)),
        ("da", (da.rows, da.d)),
        ("db", (db.rows, db.d)),
    ] {
        if shape != (dh.rows, dh.d) {
            return Err(Error::Shape {
                what,
                rows: dh.rows,
                d: dh.d,
                actual_rows: shape.0,
                actual_d: shape.1,
            });
        }
    }
    check_streams(
        ctx,
        stream,
        &[
            ("dh", dh.data.stream()),
            ("a", a.data.stream()),
            ("b", b.data.stream()),
            ("da", da.data.stream()),
            ("db", db.data.stream()),
        ],
    )?;
    let (dha, _dh) = dev(dh, stream);
    let (aa, _a) = dev(a, stream);
    let (ba, _b) = dev(b, stream);
    let (daa, _da) = dev_mut(da, stream);
    let (dba, _db) = dev_mut(db, stream);
    let call = Call::new::<T>(
        Family::GatedBackward,
        act,
        (dh.rows, dh.d),
        vec![dha, aa, ba],
        vec![daa, dba],
    );
    call.run(&Gpu { ctx, stream })
}

/// `(a, b)` addresses of the two halves of packed `[rows, 2·d]` rows.
fn halves(base: (u64, usize), d: usize, bytes: usize) -> [(u64, usize); 2] {
    [base, (base.0 + (d * bytes) as u64, base.1)]
}

fn packed_width<A: Buffer>(
    what: &'static str,
    packed: &Rows<A>,
    rows: usize,
    d: usize,
) -> Result<()> {
    packed.expect_shape(what, rows, 2 * d)
}

/// [`gated_forward`] with `a` and `b` the two halves of each row of `ab` (`rows × 2d`).
pub fn gated_forward_packed<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    ab: &RowsRef<'_, T>,
    h: &mut RowsMut<'_, T>,
) -> Result<()> {
    packed_width("ab", ab, h.rows, h.d)?;
    check_streams(
        ctx,
        stream,
        &[("ab", ab.data.stream()), ("h", h.data.stream())],
    )?;
    let (aba, _ab) = dev(ab, stream);
    let (rows, d) = (h.rows, h.d);
    let (ha, _h) = dev_mut(h, stream);
    let call = Call::new::<T>(
        Family::GatedForward,
        act,
        (rows, d),
        halves(aba, d, T::KERNEL.bytes()).to_vec(),
        vec![ha],
    );
    call.run(&Gpu { ctx, stream })
}

/// [`gated_backward`] with `a`, `b` the halves of `ab` and `da`, `db` the halves of `dab`
/// (both `rows × 2d`).
pub fn gated_backward_packed<T: Dtype>(
    ctx: &Context,
    stream: &CudaStream,
    act: Activation,
    dh: &RowsRef<'_, T>,
    ab: &RowsRef<'_, T>,
    dab: &mut RowsMut<'_, T>,
) -> Result<()> {
    packed_width("ab", ab, dh.rows, dh.d)?;
    packed_width("dab", dab, dh.rows, dh.d)?;
    check_streams(
        ctx,
        stream,
        &[
            ("dh", dh.data.stream()),
            ("ab", ab.data.stream()),
            ("dab", dab.data.stream()),
        ],
    )?;
    let (dha, _dh) = dev(dh, stream);
    let (aba, _ab) = dev(ab, stream);
    let (daba, _dab) = dev_mut(dab, stream);
    let (rows, d, bytes) = (dh.rows, dh.d, T::KERNEL.bytes());
    let [a, b] = halves(aba, d, bytes);
    let call = Call::new::<T>(
        Family::GatedBackward,
        act,
        (rows, d),
        vec![dha, a, b],
        halves(daba, d, bytes).to_vec(),
    );
    call.run(&Gpu { ctx, stream })
}

impl Emulator {
    /// [`forward`] on host memory, run by the CPU emulator.
    pub fn activation_forward<T: Dtype>(
        &self,
        act: Activation,
        x: &Rows<&[T]>,
        y: &mut Rows<&mut [T]>,
    ) -> Result<()> {
        same_shape("y", x, y)?;
        Call::new::<T>(
            Family::Forward,
            act,
            (x.rows, x.d),
            vec![host(x)],
            vec![host_mut(y)],
        )
        .run(self)
    }

    /// [`backward`] on host memory, run by the CPU emulator.
    pub fn activation_backward<T: Dtype>(
        &self,
        act: Activation,
        dy: &Rows<&[T]>,
        preact: &Rows<&[T]>,
        dx: &mut Rows<&mut [T]>,
    ) -> Result<()> {
        same_shape("preact", dy, preact)?;
        same_shape("dx", dy, dx)?;
        let inputs = vec![host(dy), host(preact)];
        Call::new::<T>(
            Family::Backward,
            act,
            (dy.rows, dy.d),
            inputs,
            vec![host_mut(dx)],
        )
        .run(self)
    }

    /// [`backward_dbias`] on host memory, run by the CPU emulator.
    #[allow(clippy::too_many_arguments)]
    pub fn activation_backward_dbias<T: Dtype>(
        &self,
        act: Activation,
        dy: &Rows<&[T]>,
        preact: &Rows<&[T]>,
        dx: &mut Rows<&mut [T]>,
        dbias: &mut [T],
        workspace: &mut [f32],
    ) -> Result<()> {
        validate_dbias(dy, preact, dx, dbias.len(), workspace.len())?;
        let inputs = vec![host(dy), host(preact)];
        let dbias = Some((dbias.as_mut_ptr() as u64, workspace.as_mut_ptr() as u64));
        Call::new::<T>(
            Family::BackwardDbias,
            act,
            (dy.rows, dy.d),
            inputs,
            vec![host_mut(dx)],
        )
        .with_dbias(dbias)
        .run(self)
    }

    /// [`gated_forward`] on host memory, run by the CPU emulator.
    pub fn gated_forward<T: Dtype>(
        &self,
        act: Activation,
        a: &Rows<&[T]>,
        b: &Rows<&[T]>,
        h: &mut Rows<&mut [T]>,
    ) -> Result<()> {
        same_shape("b", a, b)?;
        same_shape("h", a, h)?;
        let inputs = vec![host(a), host(b)];
        Call::new::<T>(
            Family::GatedForward,
            act,
            (a.rows, a.d),
            inputs,
            vec![host_mut(h)],
        )
        .run(self)
    }

    /// [`gated_backward_packed`] on host memory (`ab`, `dab` are `rows × 2d`), run by the CPU emulator.
    pub fn gated_backward_packed<T: Dtype>(
        &self,
        act: Activation,
        dh: &Rows<&[T]>,
        ab: &Rows<&[T]>,
        dab: &mut Rows<&mut [T]>,
    ) -> Result<()> {
        packed_width("ab", ab, dh.rows, dh.d)?;
        packed_width("dab", dab, dh.rows, dh.d)?;
        let (rows, d, bytes) = (dh.rows, dh.d, T::KERNEL.bytes());
        let [a, b] = halves(host(ab), d, bytes);
        let outputs = halves(host_mut(dab), d, bytes).to_vec();
        Call::new::<T>(
            Family::GatedBackward,
            act,
            (rows, d),
            vec![host(dh), a, b],
            outputs,
        )
        .run(self)
    }
}
