//! Activations: `y = f(x)` and `dx = dy · f'(preact)` for ReLU, SiLU and GELU (exact and tanh
//! forms); gated forms `h = f(a) · b` (SwiGLU with SiLU, GeGLU with GELU) whose backward gives `da`
//! and `db` in one pass; and a backward that also returns `dbias = Σ_rows dx` through the same
//! deterministic group partials and fixed-order column sum as the norms' dγ.
//!
//! `a` and `b` are two row views, or the two halves of each row of one `[rows, 2·d]` tensor
//! ([`GatedInput::Packed`]). Every operand has its own row stride. The derivative is recomputed
//! from the saved pre-activation; it never round-trips through memory.
//!
//! ```
//! use normkern::activation::{self, Activation};
//! use normkern::{Emulator, Rows};
//!
//! let (rows, d) = (2, 8);
//! let x = vec![1.0f32; rows * d];
//! let mut y = vec![0.0f32; rows * d];
//! let x_rows = Rows::new(&x[..], rows, d)?;
//! let forward = activation::Forward::new(Activation::Silu, x_rows, Rows::new(&mut y[..], rows, d)?);
//! activation::forward(&Emulator::new(), forward)?;
//! assert!((y[0] - 0.7310586).abs() < 1e-5);
//! # Ok::<(), normkern::Error>(())
//! ```

use normkern_gpu::activation::kernels::dbias_columns;
pub use normkern_gpu::activation::kernels::dbias_group_layout;
use normkern_gpu::activation::{ActivationKey, Family, KERNELS, Params};
use normkern_gpu::kernel::Dtype as KernelDtype;

use crate::distributed::{Across, launch_backward};
use crate::error::{Error, Result};
use crate::executor::{Device, Executor, Launch};
use crate::plan::{
    GradientPlan, GradientsOf, ParamGradients, Partials, check_gradients, full_grid, gradient_plan,
    gradient_workspace_len, packs_fit,
};
use crate::tensor::{Buffer, Dtype, Rows, expect_len};

pub use normkern_gpu::activation::Activation;

/// The arguments of [`forward`]: `y = f(x)`.
#[must_use = "the arguments do nothing until passed to activation::forward"]
pub struct Forward<'a, E: Executor, T: Dtype> {
    /// The function f.
    pub activation: Activation,
    /// `rows × d` input.
    pub x: Rows<E::In<'a, T>>,
    /// x's shape, its own stride.
    pub y: Rows<E::Out<'a, T>>,
}

impl<'a, E: Executor, T: Dtype> Forward<'a, E, T> {
    /// `y = activation(x)`.
    pub fn new(activation: Activation, x: Rows<E::In<'a, T>>, y: Rows<E::Out<'a, T>>) -> Self {
        Forward { activation, x, y }
    }
}

/// The arguments of [`backward`]: `dx = dy · f'(preact)`, and optionally `dbias = Σ_rows dx`.
#[must_use = "the arguments do nothing until passed to activation::backward"]
pub struct Backward<'a, E: Executor, T: Dtype> {
    /// The function f of the forward.
    pub activation: Activation,
    /// The forward's input.
    pub preact: Rows<E::In<'a, T>>,
    /// dy in, dx out: separate buffers or one.
    pub grad: Gradient<'a, E, T>,
    /// Also writes dbias, bitwise reproducible on any grid and GPU.
    pub dbias: Option<Dbias<'a, E, T>>,
    /// How dbias is summed over the rows; the default picks a deterministic way.
    pub param_gradients: ParamGradients,
}

/// The gradient of an activation backward: read from `dy`, written to `dx`, or written over dy.
pub enum Gradient<'a, E: Executor, T: Dtype> {
    /// dy read, dx written: `rows × d` each, their own strides.
    Separate {
        /// The gradient arriving on the forward's output.
        dy: Rows<E::In<'a, T>>,
        /// The gradient of its input.
        dx: Rows<E::Out<'a, T>>,
    },
    /// dx is written over dy (every element is read before it is written, by the same thread).
    InPlace(Rows<E::Out<'a, T>>),
}

/// dbias (`d` elements) and the workspace of its group partials (at least [`workspace_len`] f32).
pub struct Dbias<'a, E: Executor, T: Dtype> {
    /// `d` elements: `Σ_rows dx`.
    pub dbias: E::Out<'a, T>,
    /// At least [`workspace_len`] f32 for the group partials, **allocated zeroed**
    /// ([`ParamGradients`] says why).
    pub workspace: E::Out<'a, f32>,
}

impl<'a, E: Executor, T: Dtype> Backward<'a, E, T> {
    /// dx into its own buffer.
    pub fn new(
        activation: Activation,
        dy: Rows<E::In<'a, T>>,
        preact: Rows<E::In<'a, T>>,
        dx: Rows<E::Out<'a, T>>,
    ) -> Self {
        Backward {
            activation,
            preact,
            grad: Gradient::Separate { dy, dx },
            dbias: None,
            param_gradients: ParamGradients::Auto,
        }
    }

    /// dx written over dy.
    pub fn in_place(
        activation: Activation,
        dy: Rows<E::Out<'a, T>>,
        preact: Rows<E::In<'a, T>>,
    ) -> Self {
        Backward {
            activation,
            preact,
            grad: Gradient::InPlace(dy),
            dbias: None,
            param_gradients: ParamGradients::Auto,
        }
    }

    /// Also writes `dbias = Σ_rows dx` through `workspace` (at least [`workspace_len`] f32).
    pub fn dbias(self, dbias: E::Out<'a, T>, workspace: E::Out<'a, f32>) -> Self {
        Backward {
            dbias: Some(Dbias { dbias, workspace }),
            ..self
        }
    }

    /// Sums dbias over the rows as `strategy` says.
    pub fn param_gradients(self, strategy: ParamGradients) -> Self {
        Backward {
            param_gradients: strategy,
            ..self
        }
    }
}

/// The gated inputs `a` and `b`: two row views, or the halves of each row of one.
pub enum GatedInput<'a, E: Executor, T: Dtype> {
    /// Two `rows × d` views.
    Separate {
        /// The gate's input: `f(a)`.
        a: Rows<E::In<'a, T>>,
        /// What the gate scales.
        b: Rows<E::In<'a, T>>,
    },
    /// `[rows, 2·d]`: a is each row's first half, b its second.
    Packed(Rows<E::In<'a, T>>),
}

/// The gradients of the gated inputs: two row views, or the halves of each row of one.
pub enum GatedGrad<'a, E: Executor, T: Dtype> {
    /// Two `rows × d` views.
    Separate {
        /// The gradient of a.
        da: Rows<E::Out<'a, T>>,
        /// The gradient of b.
        db: Rows<E::Out<'a, T>>,
    },
    /// `[rows, 2·d]`: da is each row's first half, db its second.
    Packed(Rows<E::Out<'a, T>>),
}

/// The arguments of [`gated_forward`]: `h = f(a) · b`.
#[must_use = "the arguments do nothing until passed to activation::gated_forward"]
pub struct GatedForward<'a, E: Executor, T: Dtype> {
    /// The gate's function: SiLU for SwiGLU, a GELU for GeGLU.
    pub activation: Activation,
    /// a and b.
    pub input: GatedInput<'a, E, T>,
    /// `rows × d`.
    pub h: Rows<E::Out<'a, T>>,
}

/// The arguments of [`gated_backward`]: `da = dh · b · f'(a)`, `db = dh · f(a)` in one pass.
#[must_use = "the arguments do nothing until passed to activation::gated_backward"]
pub struct GatedBackward<'a, E: Executor, T: Dtype> {
    /// The gate's function of the forward.
    pub activation: Activation,
    /// `rows × d`: the gradient arriving on h.
    pub dh: Rows<E::In<'a, T>>,
    /// The forward's a and b.
    pub input: GatedInput<'a, E, T>,
    /// da and db.
    pub grad: GatedGrad<'a, E, T>,
}

/// f32 elements of workspace a backward with dbias needs for `rows × d`: the partial rows of
/// [`dbias_group_layout`]`(rows, d)`'s groups.
///
/// ```
/// assert!(normkern::activation::workspace_len(4096, 11008)? >= 11008);
/// # Ok::<(), normkern::Error>(())
/// ```
pub fn workspace_len(rows: usize, d: usize) -> Result<usize> {
    gradient_workspace_len(
        GradientsOf::Activation,
        Partials::Own(ParamGradients::Auto),
        rows,
        d,
        1,
    )
}

/// `y = f(x)`. Example: the module's.
pub fn forward<E: Executor, T: Dtype>(exec: &E, mut args: Forward<'_, E, T>) -> Result<()> {
    args.y.expect_shape("y", args.x.rows, args.x.d)?;
    exec.prepare()?;
    let (x, _x) = exec.input("x", &args.x.data)?;
    let (y, _y) = exec.output("y", &mut args.y.data)?;
    let mut call = Call::new::<T>(Family::Forward, args.activation, (args.x.rows, args.x.d));
    call.inputs = [(x, args.x.stride), (0, 0), (0, 0)];
    call.outputs = [(y, args.y.stride), (0, 0)];
    call.run(exec, None)
}

/// `dx = dy · f'(preact)`, and with [`Backward::dbias`] `dbias = Σ_rows dx`. With no rows, dbias
/// is zero.
///
/// ```
/// use normkern::activation::{self, Activation, Backward};
/// use normkern::{Emulator, Rows};
///
/// let (rows, d) = (3, 2);
/// let preact = [1.0f32, -1.0, 2.0, -2.0, 0.5, -0.5];
/// let mut dy = [1.0f32; 6];
/// let (mut dbias, mut workspace) = ([0.0f32; 2], vec![0.0f32; activation::workspace_len(rows, d)?]);
/// // ReLU: dx = dy where preact > 0, else 0; written over dy; dbias = Σ_rows dx.
/// let args = Backward::in_place(Activation::Relu, Rows::new(&mut dy[..], rows, d)?, Rows::new(&preact[..], rows, d)?)
///     .dbias(&mut dbias[..], &mut workspace[..]);
/// activation::backward(&Emulator::new(), args)?;
/// assert_eq!((dy, dbias), ([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], [3.0, 0.0]));
/// # Ok::<(), normkern::Error>(())
/// ```
pub fn backward<E: Executor, T: Dtype>(exec: &E, args: Backward<'_, E, T>) -> Result<()> {
    backward_across(exec, args, None)
}

/// [`backward`] on one device (`across` = `None`) or as one rank of several (dbias partials
/// laid out and met as `across` says).
pub(crate) fn backward_across<E: Executor, T: Dtype>(
    exec: &E,
    mut args: Backward<'_, E, T>,
    across: Option<Across<'_>>,
) -> Result<()> {
    let (rows, d) = (args.preact.rows, args.preact.d);
    let strategy = args.param_gradients;
    let partials = match &across {
        None => Partials::Own(strategy),
        Some(a) if matches!(strategy, ParamGradients::Auto | ParamGradients::TwoPass) => a.partials,
        Some(_) => {
            return Err(Error::Argument {
                what: "param_gradients",
                problem: "a backward across ranks sums its gradients its own way: leave it Auto",
            });
        }
    };
    match &args.grad {
        Gradient::Separate { dy, dx } => {
            dy.expect_shape("dy", rows, d)?;
            dx.expect_shape("dx", rows, d)?;
        }
        Gradient::InPlace(dy) => dy.expect_shape("dy", rows, d)?,
    }
    if let Some(db) = &args.dbias {
        expect_len("dbias", db.dbias.elements(), d)?;
        check_gradients(partials, T::KERNEL, T::KERNEL)?;
        if strategy == ParamGradients::LockedPartials {
            return Err(Error::Argument {
                what: "ParamGradients::LockedPartials",
                problem: "a benchmark baseline of the norm backwards only",
            });
        }
        let needed = gradient_workspace_len(GradientsOf::Activation, partials, rows, d, 1)?;
        if db.workspace.elements() < needed {
            return Err(Error::WorkspaceTooSmall {
                needed,
                actual: db.workspace.elements(),
            });
        }
    }
    exec.prepare()?;
    let (preact, _preact) = exec.input("preact", &args.preact.data)?;
    let (dy, dx, _grad) = match &mut args.grad {
        Gradient::Separate { dy, dx } => {
            let (dy_address, dy_guard) = exec.input("dy", &dy.data)?;
            let (dx_address, dx_guard) = exec.output("dx", &mut dx.data)?;
            let guards = (Some(dy_guard), dx_guard);
            ((dy_address, dy.stride), (dx_address, dx.stride), guards)
        }
        Gradient::InPlace(dy) => {
            let (address, guard) = exec.output("dy", &mut dy.data)?;
            ((address, dy.stride), (address, dy.stride), (None, guard))
        }
    };
    let (dbias, _dbias) = match &mut args.dbias {
        Some(db) => {
            let (dbias, dbias_guard) = exec.output("dbias", &mut db.dbias)?;
            let (workspace, ws_guard) = exec.output("workspace", &mut db.workspace)?;
            (Some((dbias, workspace)), Some((dbias_guard, ws_guard)))
        }
        None => (None, None),
    };
    let family = if dbias.is_some() {
        Family::BackwardDbias
    } else {
        Family::Backward
    };
    let mut call = Call::new::<T>(family, args.activation, (rows, d));
    call.inputs = [dy, (preact, args.preact.stride), (0, 0)];
    call.outputs = [dx, (0, 0)];
    call.dbias = dbias;
    call.partials = partials;
    call.run(exec, across)
}

/// `(address, stride)` of `a` and `b`, and the guards of the buffers they are in.
type GatedOperands<'g, E> = ([(u64, usize); 2], [Option<<E as Executor>::Guard<'g>>; 2]);

/// `(a, b)` of the gated inputs: their addresses and strides, after checking their shapes
/// against `rows × d`.
fn gated_input<'g, E: Executor, T: Dtype>(
    exec: &'g E,
    input: &'g GatedInput<'_, E, T>,
    (rows, d): (usize, usize),
) -> Result<GatedOperands<'g, E>> {
    match input {
        GatedInput::Separate { a, b } => {
            a.expect_shape("a", rows, d)?;
            b.expect_shape("b", rows, d)?;
            exec.prepare()?;
            let (a_address, a_guard) = exec.input("a", &a.data)?;
            let (b_address, b_guard) = exec.input("b", &b.data)?;
            Ok((
                [(a_address, a.stride), (b_address, b.stride)],
                [Some(a_guard), Some(b_guard)],
            ))
        }
        GatedInput::Packed(ab) => {
            ab.expect_shape("ab", rows, packed_width(d)?)?;
            exec.prepare()?;
            let (address, guard) = exec.input("ab", &ab.data)?;
            Ok((
                halves((address, ab.stride), d, T::KERNEL),
                [Some(guard), None],
            ))
        }
    }
}

/// `h = f(a) · b`.
///
/// ```
/// use normkern::activation::{self, Activation, GatedForward, GatedInput};
/// use normkern::{Emulator, Rows};
///
/// // SwiGLU over one [rows, 2·d] tensor: a is each row's first half, b its second.
/// let (rows, d) = (1, 2);
/// let ab = [0.0f32, 1.0, 3.0, 4.0];
/// let mut h = [0.0f32; 2];
/// activation::gated_forward(&Emulator::new(), GatedForward {
///     activation: Activation::Silu,
///     input: GatedInput::Packed(Rows::new(&ab[..], rows, 2 * d)?),
///     h: Rows::new(&mut h[..], rows, d)?,
/// })?;
/// // silu(0) · 3 = 0, silu(1) · 4 = 4 · 0.7310586.
/// assert!(h[0] == 0.0 && (h[1] - 2.9242344).abs() < 1e-5);
/// # Ok::<(), normkern::Error>(())
/// ```
pub fn gated_forward<E: Executor, T: Dtype>(
    exec: &E,
    mut args: GatedForward<'_, E, T>,
) -> Result<()> {
    let shape = (args.h.rows, args.h.d);
    let ([a, b], _inputs) = gated_input(exec, &args.input, shape)?;
    let (h, _h) = exec.output("h", &mut args.h.data)?;
    let mut call = Call::new::<T>(Family::GatedForward, args.activation, shape);
    call.inputs = [a, b, (0, 0)];
    call.outputs = [(h, args.h.stride), (0, 0)];
    call.run(exec, None)
}

/// `da = dh · b · f'(a)`, `db = dh · f(a)` in one pass.
///
/// ```
/// use normkern::activation::{self, Activation, GatedBackward, GatedGrad, GatedInput};
/// use normkern::{Emulator, Rows};
///
/// let (rows, d) = (1, 2);
/// let (a, b, dh) = ([0.0f32, 1.0], [3.0f32, 4.0], [1.0f32, 1.0]);
/// let (mut da, mut db) = ([0.0f32; 2], [0.0f32; 2]);
/// activation::gated_backward(&Emulator::new(), GatedBackward {
///     activation: Activation::Silu,
///     dh: Rows::new(&dh[..], rows, d)?,
///     input: GatedInput::Separate { a: Rows::new(&a[..], rows, d)?, b: Rows::new(&b[..], rows, d)? },
///     grad: GatedGrad::Separate { da: Rows::new(&mut da[..], rows, d)?, db: Rows::new(&mut db[..], rows, d)? },
/// })?;
/// // silu'(0) = 1/2, so da[0] = 3/2; db = silu(a).
/// assert!((da[0] - 1.5).abs() < 1e-6 && db[0] == 0.0 && (db[1] - 0.7310586).abs() < 1e-6);
/// # Ok::<(), normkern::Error>(())
/// ```
pub fn gated_backward<E: Executor, T: Dtype>(
    exec: &E,
    mut args: GatedBackward<'_, E, T>,
) -> Result<()> {
    let shape = (args.dh.rows, args.dh.d);
    // Every shape before the first operand is taken: with cudarc's event tracking, taking one
    // enqueues its event wait and record.
    match &args.grad {
        GatedGrad::Separate { da, db } => {
            da.expect_shape("da", shape.0, shape.1)?;
            db.expect_shape("db", shape.0, shape.1)?;
        }
        GatedGrad::Packed(dab) => dab.expect_shape("dab", shape.0, packed_width(shape.1)?)?,
    }
    let ([a, b], _inputs) = gated_input(exec, &args.input, shape)?;
    let (dh, _dh) = exec.input("dh", &args.dh.data)?;
    let (outputs, _outputs) = match &mut args.grad {
        GatedGrad::Separate { da, db } => {
            let (da_stride, db_stride) = (da.stride, db.stride);
            let (da_address, da_guard) = exec.output("da", &mut da.data)?;
            let (db_address, db_guard) = exec.output("db", &mut db.data)?;
            let outputs = [(da_address, da_stride), (db_address, db_stride)];
            (outputs, (da_guard, Some(db_guard)))
        }
        GatedGrad::Packed(dab) => {
            let stride = dab.stride;
            let (address, guard) = exec.output("dab", &mut dab.data)?;
            (halves((address, stride), shape.1, T::KERNEL), (guard, None))
        }
    };
    let mut call = Call::new::<T>(Family::GatedBackward, args.activation, shape);
    call.inputs = [(dh, args.dh.stride), a, b];
    call.outputs = outputs;
    call.run(exec, None)
}

/// `2·d`, the width of packed gated rows.
fn packed_width(d: usize) -> Result<usize> {
    d.checked_mul(2).ok_or(Error::TooLarge {
        what: "2 × d (packed rows)",
        value: d,
    })
}

/// `(a, b)` addresses of the two halves of packed `[rows, 2·d]` rows (validated, so the offset
/// of b lies inside the buffer).
fn halves(base: (u64, usize), d: usize, dtype: KernelDtype) -> [(u64, usize); 2] {
    let offset = d.wrapping_mul(dtype.bytes()) as u64;
    [base, (base.0.wrapping_add(offset), base.1)]
}

/// A validated call: addresses and strides of up to three row inputs and two row outputs, in the
/// order the family's kernels read them ([`Params`]); `(0, 0)` past the last.
pub(crate) struct Call {
    pub key: ActivationKey,
    pub rows: usize,
    pub d: usize,
    pub inputs: [(u64, usize); 3],
    pub outputs: [(u64, usize); 2],
    /// `(dbias, workspace)` for [`Family::BackwardDbias`].
    pub dbias: Option<(u64, u64)>,
    /// Where dbias's partials go (one device, or a rank's share).
    pub partials: Partials,
}

impl Call {
    fn new<T: Dtype>(family: Family, activation: Activation, (rows, d): (usize, usize)) -> Self {
        Call {
            key: ActivationKey {
                family,
                activation,
                dtype: T::KERNEL,
                vec: false,
            },
            rows,
            d,
            inputs: [(0, 0); 3],
            outputs: [(0, 0); 2],
            dbias: None,
            partials: Partials::Own(ParamGradients::Auto),
        }
    }

    fn run<E: Executor>(&self, exec: &E, across: Option<Across<'_>>) -> Result<()> {
        let Plan {
            elementwise,
            gradients,
        } = plan(self, exec.device())?;
        match gradients {
            Some(gradients) => launch_backward(exec, elementwise.as_ref(), &gradients, across),
            None => elementwise.map_or(Ok(()), |launch| exec.launch(&launch)),
        }
    }
}

/// Threads per block of the elementwise kernels.
const THREADS: usize = 256;

/// The launches of an activation call: the elementwise kernel (none for no rows), then for dbias
/// the column sum of its partials.
pub(crate) struct Plan {
    pub elementwise: Option<Launch<ActivationKey, Params>>,
    pub gradients: Option<GradientPlan>,
}

// Launch arithmetic on validated sizes (rows, d < 2³², at most 8192 groups, packs of 4 or 8).
#[allow(clippy::arithmetic_side_effects)]
pub(crate) fn plan(call: &Call, device: &dyn Device) -> Result<Plan> {
    let (mut rows, mut d) = (call.rows, call.d);
    let (mut inputs, mut outputs) = (call.inputs, call.outputs);
    let used = |o: &&(u64, usize)| o.0 != 0;
    // Contiguous operands of an elementwise op are one long row to the kernel: plain indices
    // instead of row arithmetic, and 16-byte packs whenever the whole buffer allows them.
    let elements = rows.checked_mul(d).ok_or(Error::TooLarge {
        what: "rows × d",
        value: rows,
    })?;
    let contiguous = call.dbias.is_none()
        && rows > 0
        && (inputs.iter().chain(&outputs).filter(used)).all(|o| o.1 == d)
        && elements <= u32::MAX as usize;
    if contiguous {
        (rows, d) = (1, elements);
        for operand in inputs.iter_mut().chain(outputs.iter_mut()) {
            operand.1 = elements;
        }
    }
    let mut gradients = match call.dbias {
        Some((dbias, workspace)) => Some(gradient_plan(
            device,
            GradientsOf::Activation,
            call.partials,
            (rows, d),
            workspace,
            [dbias, 0],
            call.key.dtype,
        )?),
        None => None,
    };
    let (rows_per_group, groups, partials) = gradients
        .as_ref()
        .map_or((1, 0, 0), |g| (g.rows_per_group, g.groups, g.partials[0]));
    let mut elementwise = None;
    if rows > 0 {
        let mut addresses = [0u64; 6];
        let mut strides = [0usize; 5];
        for (i, o) in inputs.iter().chain(&outputs).enumerate() {
            (addresses[i], strides[i]) = *o;
        }
        addresses[5] = partials;
        let vec = packs_fit(call.key.dtype.bytes(), d, &addresses, &strides);
        let len = if vec { 16 / call.key.dtype.bytes() } else { 1 };
        let per_row = d / len;
        let accesses = rows * per_row;
        if accesses > u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "rows × d",
                value: elements,
            });
        }
        let mut params = Params {
            rows: rows as u32,
            d: d as u32,
            rows_per_group: rows_per_group as u32,
            groups: groups as u32,
            partials,
            // A dbias work item is a group × `columns` accesses of its rows, the block taking
            // THREADS / columns of the group's rows at once (`dbias_columns`).
            columns: dbias_columns(d, rows_per_group, per_row, THREADS) as u32,
            ..Params::default()
        };
        for (i, (address, stride)) in inputs.iter().enumerate() {
            params.inputs[i] = *address;
            params.input_strides[i] = *stride as u64;
        }
        for (i, (address, stride)) in outputs.iter().enumerate() {
            params.outputs[i] = *address;
            params.output_strides[i] = *stride as u64;
        }
        let key = ActivationKey { vec, ..call.key };
        let kernel = KERNELS
            .find(&key)
            .ok_or(Error::Internal("no activation kernel for this key"))?;
        let family = call.key.family;
        let tiles = if call.dbias.is_some() {
            groups * per_row.div_ceil(params.columns as usize)
        } else {
            accesses.div_ceil(THREADS * family.unroll())
        };
        let mut launch = Launch {
            kernel,
            grid: full_grid(device, tiles),
            block: THREADS,
            cluster: 1,
            shared_bytes: (kernel.shared_bytes)(THREADS),
            cooperative: false,
            overlaps_previous: false,
            params,
        };
        if let Some(gradients) = gradients.as_mut() {
            launch.params.sums = gradients.fit(device, &mut launch, tiles)?;
        }
        elementwise = Some(launch);
    }
    Ok(Plan {
        elementwise,
        gradients,
    })
}
