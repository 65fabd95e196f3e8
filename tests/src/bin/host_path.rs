//! What one normkern call asks of the host, without a GPU: the driver calls, heap allocations and
//! CPU time of each op, measured against a fake CUDA driver that runs nothing and counts every
//! call (`tests/fake-cuda/fake_cuda.rs`, built by `tests/build.rs`). The time is normkern's and
//! cudarc's own work per call (validation, launch plan, parameter block, event bookkeeping); the
//! real driver's launch comes on top (the bench's launch floor, on the GPU).
//!
//! ```sh
//! cargo run --release -p normkern-tests --bin host_path            # the table
//! cargo run --release -p normkern-tests --bin host_path -- --check # and exit 1 if a promise fails
//! cargo run --release -p normkern-tests --bin host_path -- --shapes 8192x8192 --calls 10 # plans
//! ```
//!
//! `--check` holds every op, once its shape has been seen, to the README's promises: no driver
//! query (function attributes, occupancy, device attributes, modules), no device allocation or
//! synchronization, no heap allocation, the same driver calls on every call, and with cudarc's
//! event tracking off no event wait, record or capture query. `tests/tests/host_path.rs` runs it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::{CStr, c_char};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use half::bf16;
use normkern::activation::{self, Activation, GatedBackward, GatedForward, GatedGrad, GatedInput};
use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{
    Context, Dtype, Gpu, KernelImage, NormBackward, NormForward, Rows, RowsMut, RowsRef,
    layer_norm, rms_norm,
};

/// Counts the program's heap allocations (the fake driver has its own allocator).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Set in the environment of the process that runs under the fake driver.
const UNDER_FAKE: &str = "NORMKERN_UNDER_FAKE_CUDA";

/// The driver calls a call may make every time: the launches and the workspace fills, cudarc's
/// current-context check, and with event tracking on the capture query and the operands' event
/// waits and records.
const PER_CALL: [&str; 3] = ["cuLaunchKernelEx", "cuMemsetD32Async", "cuCtxGetCurrent"];
const PER_CALL_TRACKED: [&str; 3] = ["cuStreamIsCapturing", "cuStreamWaitEvent", "cuEventRecord"];

/// The fake driver's counters and latest launches, through its `fake_cuda_*` exports.
struct Fake {
    _lib: libloading::Library,
    names: Vec<&'static str>,
    count: unsafe extern "C" fn(usize) -> u64,
    recent_launch: unsafe extern "C" fn(usize, *mut FakeLaunch),
    fail_next: unsafe extern "C" fn(usize, u32) -> bool,
    set_capture_status: unsafe extern "C" fn(u32),
}

/// `FakeLaunch` of the fake driver.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FakeLaunch {
    grid: u32,
    block: u32,
    shared_bytes: u32,
    cluster: u32,
    cooperative: u32,
    overlaps: u32,
    kernel: usize,
}

impl Fake {
    /// The `libcuda.so` this process loads, if it is the fake one.
    fn open() -> Result<Fake, String> {
        // SAFETY: loading the library cudarc loads (its initializers are the fake's: none).
        let lib = unsafe { libloading::Library::new("libcuda.so") }
            .map_err(|e| format!("no libcuda.so: {e}"))?;
        // SAFETY: the fake's exports, with these signatures (fake_cuda.rs).
        unsafe {
            let calls = *lib
                .get::<unsafe extern "C" fn() -> usize>(b"fake_cuda_calls")
                .map_err(|_| "the libcuda.so loaded is not the fake driver".to_string())?;
            let name = *lib
                .get::<unsafe extern "C" fn(usize) -> *const c_char>(b"fake_cuda_call_name")
                .map_err(|e| e.to_string())?;
            let count = *lib
                .get::<unsafe extern "C" fn(usize) -> u64>(b"fake_cuda_call_count")
                .map_err(|e| e.to_string())?;
            let recent_launch = *lib
                .get::<unsafe extern "C" fn(usize, *mut FakeLaunch)>(b"fake_cuda_recent_launch")
                .map_err(|e| e.to_string())?;
            let fail_next = *lib
                .get::<unsafe extern "C" fn(usize, u32) -> bool>(b"fake_cuda_fail_next")
                .map_err(|e| e.to_string())?;
            let set_capture_status = *lib
                .get::<unsafe extern "C" fn(u32)>(b"fake_cuda_set_capture_status")
                .map_err(|e| e.to_string())?;
            let names = (0..calls())
                .map(|i| CStr::from_ptr(name(i)).to_str().unwrap_or("?"))
                .collect();
            Ok(Fake {
                _lib: lib,
                names,
                count,
                recent_launch,
                fail_next,
                set_capture_status,
            })
        }
    }

    fn counts(&self) -> Vec<u64> {
        // SAFETY: indices within the fake's table.
        (0..self.names.len())
            .map(|i| unsafe { (self.count)(i) })
            .collect()
    }

    /// Makes the next call of driver function `name` return `code`; false if the fake cannot (a
    /// function it does not fail, a code it does not give).
    #[must_use]
    fn fail_next(&self, name: &str, code: u32) -> bool {
        // SAFETY: an index within the fake's table.
        self.index(name)
            .is_some_and(|i| unsafe { (self.fail_next)(i, code) })
    }

    /// Driver function `name`'s index in the fake's table.
    fn index(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| *n == name)
    }

    /// Each driver function called since `before` (a [`Self::counts`]), with its calls.
    fn since(&self, before: &[u64]) -> Vec<(&'static str, u64)> {
        (self.names.iter().zip(before.iter().zip(self.counts())))
            .filter(|(_, (b, a))| a > *b)
            .map(|(n, (b, a))| (*n, a - b))
            .collect()
    }

    /// Makes every stream say it is capturing a graph (or not).
    fn set_capturing(&self, capturing: bool) {
        // SAFETY: the fake's export; 1 is CU_STREAM_CAPTURE_STATUS_ACTIVE.
        unsafe { (self.set_capture_status)(u32::from(capturing)) };
    }

    /// Calls of driver function `name` so far.
    fn calls_of(&self, name: &str) -> u64 {
        // SAFETY: an index within the fake's table.
        self.index(name).map_or(0, |i| unsafe { (self.count)(i) })
    }

    /// The `n` latest launches, in launch order, each with its kernel's name.
    fn launches(&self, n: usize) -> Vec<(FakeLaunch, &'static str)> {
        (0..n)
            .rev()
            .map(|back| {
                let mut launch = FakeLaunch::default();
                // SAFETY: writes one FakeLaunch; its kernel is a string the fake keeps for the
                // process.
                unsafe { (self.recent_launch)(back, &mut launch) };
                let kernel = match launch.kernel {
                    0 => "none",
                    k => unsafe { CStr::from_ptr(k as *const c_char) }
                        .to_str()
                        .unwrap_or("?"),
                };
                (launch, kernel)
            })
            .collect()
    }
}

/// The operands of every op at one shape, all bf16 but the f32 residual stream and statistics.
/// The fake driver backs no memory: only the addresses and lengths matter.
struct Operands {
    rows: usize,
    d: usize,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    da: CudaSlice<bf16>,
    residual: CudaSlice<f32>,
    h: CudaSlice<f32>,
    weight: CudaSlice<bf16>,
    bias: CudaSlice<bf16>,
    dweight: CudaSlice<bf16>,
    dbias: CudaSlice<bf16>,
    mean: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    workspace: CudaSlice<f32>,
}

impl Operands {
    fn new(stream: &Arc<CudaStream>, (rows, d): (usize, usize)) -> normkern::Result<Operands> {
        let bf = |n| stream.alloc_zeros::<bf16>(n).map_err(driver);
        let f = |n| stream.alloc_zeros::<f32>(n).map_err(driver);
        let n = rows * d;
        let workspace =
            layer_norm::workspace_len(rows, d)?.max(activation::workspace_len(rows, d)?);
        Ok(Operands {
            rows,
            d,
            x: bf(n)?,
            dy: bf(n)?,
            y: bf(n)?,
            dx: bf(n)?,
            da: bf(n)?,
            residual: f(n)?,
            h: f(n)?,
            weight: bf(d)?,
            bias: bf(d)?,
            dweight: bf(d)?,
            dbias: bf(d)?,
            mean: f(rows)?,
            rstd: f(rows)?,
            workspace: f(workspace)?,
        })
    }
}

/// `rows × d` of a buffer, read or written.
fn rows<T: Dtype>(b: &CudaSlice<T>, (rows, d): (usize, usize)) -> normkern::Result<RowsRef<'_, T>> {
    Rows::new(b.as_view(), rows, d)
}

fn rows_mut<T: Dtype>(
    b: &mut CudaSlice<T>,
    (rows, d): (usize, usize),
) -> normkern::Result<RowsMut<'_, T>> {
    Rows::new(b.as_view_mut(), rows, d)
}

fn driver(e: normkern::cudarc::driver::DriverError) -> normkern::Error {
    normkern::Error::Driver {
        name: e.to_string(),
        during: "allocating an operand",
    }
}

type Op = fn(&Gpu<'_>, &mut Operands) -> normkern::Result<()>;

/// Every op the check covers: the norms as the README calls them, the residual forms, the
/// activations with dbias and the gated activation.
const OPS: [(&str, Op); 10] = [
    ("rms_norm fwd", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, s)?;
        let args = NormForward::new(rows(&o.x, s)?, o.weight.as_view(), y);
        rms_norm::forward(gpu, args.rstd(o.rstd.as_view_mut()))
    }),
    ("rms_norm bwd", |gpu, o| {
        let s = (o.rows, o.d);
        let dx = rows_mut(&mut o.dx, s)?;
        let (weight, rstd) = (o.weight.as_view(), o.rstd.as_view());
        let (dy, x) = (rows(&o.dy, s)?, rows(&o.x, s)?);
        let args = NormBackward::new(
            dy,
            x,
            weight,
            dx,
            o.dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        );
        rms_norm::backward(gpu, args.rstd(rstd))
    }),
    ("layer_norm fwd", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, s)?;
        let args = NormForward::new(rows(&o.x, s)?, o.weight.as_view(), y)
            .bias(o.bias.as_view())
            .mean(o.mean.as_view_mut());
        layer_norm::forward(gpu, args.rstd(o.rstd.as_view_mut()))
    }),
    ("layer_norm bwd", |gpu, o| {
        let s = (o.rows, o.d);
        let dx = rows_mut(&mut o.dx, s)?;
        let (dy, x) = (rows(&o.dy, s)?, rows(&o.x, s)?);
        let args = NormBackward::new(
            dy,
            x,
            o.weight.as_view(),
            dx,
            o.dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        );
        let args = args.mean_rstd(o.mean.as_view(), o.rstd.as_view());
        layer_norm::backward(gpu, args.dbias(o.dbias.as_view_mut()))
    }),
    ("rms_norm fwd + residual (f32)", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, s)?;
        let residual = rows(&o.residual, s)?;
        let h = rows_mut(&mut o.h, s)?;
        let args = NormForward::new(rows(&o.x, s)?, o.weight.as_view(), y);
        rms_norm::forward(gpu, args.residual(residual, h))
    }),
    ("rms_norm bwd + dresidual (f32)", |gpu, o| {
        let s = (o.rows, o.d);
        let dx = rows_mut(&mut o.dx, s)?;
        let h = rows(&o.h, s)?;
        let dresidual = rows(&o.residual, s)?;
        let args = NormBackward::new(
            rows(&o.dy, s)?,
            h,
            o.weight.as_view(),
            dx,
            o.dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        );
        rms_norm::backward(gpu, args.dresidual(dresidual))
    }),
    ("silu fwd", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, s)?;
        let args = activation::Forward::new(Activation::Silu, rows(&o.x, s)?, y);
        activation::forward(gpu, args)
    }),
    ("silu bwd + dbias", |gpu, o| {
        let s = (o.rows, o.d);
        let dx = rows_mut(&mut o.dx, s)?;
        let args = activation::Backward::new(Activation::Silu, rows(&o.dy, s)?, rows(&o.x, s)?, dx);
        activation::backward(
            gpu,
            args.dbias(o.dbias.as_view_mut(), o.workspace.as_view_mut()),
        )
    }),
    ("swiglu fwd", |gpu, o| {
        let s = (o.rows, o.d);
        let h = rows_mut(&mut o.y, s)?;
        let input = GatedInput::Separate {
            a: rows(&o.x, s)?,
            b: rows(&o.dy, s)?,
        };
        let args = GatedForward {
            activation: Activation::Silu,
            input,
            h,
        };
        activation::gated_forward(gpu, args)
    }),
    ("swiglu bwd", |gpu, o| swiglu_backward(gpu, o, o.rows)),
];

/// SwiGLU's backward with da viewed as `da_rows` rows (the others `rows × d`).
fn swiglu_backward(gpu: &Gpu<'_>, o: &mut Operands, da_rows: usize) -> normkern::Result<()> {
    let s = (o.rows, o.d);
    let grad = GatedGrad::Separate {
        da: rows_mut(&mut o.da, (da_rows, o.d))?,
        db: rows_mut(&mut o.dx, s)?,
    };
    let input = GatedInput::Separate {
        a: rows(&o.x, s)?,
        b: rows(&o.dy, s)?,
    };
    let args = GatedBackward {
        activation: Activation::Silu,
        dh: rows(&o.y, s)?,
        input,
        grad,
    };
    activation::gated_backward(gpu, args)
}

/// Calls the ops must reject before any driver call: a bad eps, a workspace too small, outputs
/// of the wrong shape.
const REJECTED: [(&str, Op); 8] = [
    ("rms_norm fwd, eps -1", |gpu, o| {
        let s = (o.rows, o.d);
        let args = NormForward::new(rows(&o.x, s)?, o.weight.as_view(), rows_mut(&mut o.y, s)?);
        rms_norm::forward(gpu, args.eps(-1.0))
    }),
    ("rms_norm bwd, a workspace of 1 f32", |gpu, o| {
        let s = (o.rows, o.d);
        let args = NormBackward::new(
            rows(&o.dy, s)?,
            rows(&o.x, s)?,
            o.weight.as_view(),
            rows_mut(&mut o.dx, s)?,
            o.dweight.as_view_mut(),
            o.workspace.slice_mut(0..1),
        );
        rms_norm::backward(gpu, args)
    }),
    ("layer_norm fwd, y a row short", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, (o.rows - 1, o.d))?;
        let args = NormForward::new(rows(&o.x, s)?, o.weight.as_view(), y);
        layer_norm::forward(gpu, args.bias(o.bias.as_view()))
    }),
    ("silu fwd, y an element narrower", |gpu, o| {
        let s = (o.rows, o.d);
        let y = rows_mut(&mut o.y, (o.rows, o.d - 1))?;
        activation::forward(
            gpu,
            activation::Forward::new(Activation::Silu, rows(&o.x, s)?, y),
        )
    }),
    ("layer_norm bwd, dbias an element short", |gpu, o| {
        let s = (o.rows, o.d);
        let args = NormBackward::new(
            rows(&o.dy, s)?,
            rows(&o.x, s)?,
            o.weight.as_view(),
            rows_mut(&mut o.dx, s)?,
            o.dweight.as_view_mut(),
            o.workspace.as_view_mut(),
        );
        let dbias = o.dbias.slice_mut(1..);
        layer_norm::backward(
            gpu,
            args.mean_rstd(o.mean.as_view(), o.rstd.as_view())
                .dbias(dbias),
        )
    }),
    ("silu bwd + dbias, a workspace of 1 f32", |gpu, o| {
        let s = (o.rows, o.d);
        let dx = rows_mut(&mut o.dx, s)?;
        let args = activation::Backward::new(Activation::Silu, rows(&o.dy, s)?, rows(&o.x, s)?, dx);
        let args = args.dbias(o.dbias.as_view_mut(), o.workspace.slice_mut(0..1));
        activation::backward(gpu, args)
    }),
    ("swiglu fwd, packed ab of d columns", |gpu, o| {
        let s = (o.rows, o.d);
        let args = GatedForward {
            activation: Activation::Silu,
            input: GatedInput::Packed(rows(&o.x, s)?),
            h: rows_mut(&mut o.y, s)?,
        };
        activation::gated_forward(gpu, args)
    }),
    ("swiglu bwd, da a row short", |gpu, o| {
        swiglu_backward(gpu, o, o.rows - 1)
    }),
];

/// What a call does when it is rejected or when the driver fails under it (event tracking on, so
/// every operand's event traffic shows): a rejected call makes no driver call at all; a failed
/// launch or event wait is an `Error::Driver` naming it, with no launch after it (a two-launch
/// backward stops at its first); the next call succeeds. On a stream capturing a graph every op
/// is `Error::CaptureWithEventTracking` before any event wait.
fn failures_broken(fake: &Fake, ctx: &Context) -> Result<Vec<String>, String> {
    const OUT_OF_RESOURCES: u32 = 701;
    const INVALID_HANDLE: u32 = 400;
    let mut out = Vec::new();
    unsafe { ctx.cuda().enable_event_tracking() };
    let stream = ctx.cuda().new_stream().map_err(|e| e.to_string())?;
    let gpu = ctx.on(&stream).map_err(|e| e.to_string())?;
    let mut small = Operands::new(&stream, (64, 4096)).map_err(|e| e.to_string())?;
    for ((what, op), expected) in REJECTED.into_iter().zip(REJECTED_AS) {
        let before = fake.counts();
        let result = op(&gpu, &mut small);
        let calls: u64 = fake.since(&before).iter().map(|&(_, n)| n).sum();
        match result {
            Err(e) if !format!("{e:?}").starts_with(expected) => {
                out.push(format!("{what}: rejected as {e:?}, not {expected}…"))
            }
            Err(_) if calls > 0 => out.push(format!("{what}: rejected after {calls} driver calls")),
            Err(_) => {}
            Ok(()) => out.push(format!("{what}: not rejected")),
        }
    }
    // A failed launch: the single-launch backward at 64×4096, the two-launch one at 16384×512.
    let mut two_pass = Operands::new(&stream, (16384, 512)).map_err(|e| e.to_string())?;
    let rms_bwd = OPS[1].1;
    for (shape, operands) in [("64×4096", &mut small), ("16384×512", &mut two_pass)] {
        let launches = fake.calls_of("cuLaunchKernelEx");
        if !fake.fail_next("cuLaunchKernelEx", OUT_OF_RESOURCES) {
            return Err("the fake driver cannot fail a launch".into());
        }
        let result = rms_bwd(&gpu, operands);
        let tried = fake.calls_of("cuLaunchKernelEx") - launches;
        let expected = Err(normkern::Error::Driver {
            name: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES".into(),
            during: "cuLaunchKernelEx",
        });
        if result != expected || tried != 1 {
            out.push(format!(
                "rms_norm bwd {shape}, its launch failing: {result:?} after {tried} launches"
            ));
        }
        if let Err(e) = rms_bwd(&gpu, operands) {
            out.push(format!("rms_norm bwd {shape} after a failed launch: {e}"));
        }
    }
    // A failed event wait (cudarc records it; normkern reports it before launching).
    let launches = fake.calls_of("cuLaunchKernelEx");
    if !fake.fail_next("cuStreamWaitEvent", INVALID_HANDLE) {
        return Err("the fake driver cannot fail an event wait".into());
    }
    let result = rms_bwd(&gpu, &mut small);
    let launched = fake.calls_of("cuLaunchKernelEx") - launches;
    match result {
        Err(normkern::Error::Driver { during, .. })
            if launched == 0 && during.contains("event") => {}
        other => out.push(format!(
            "rms_norm bwd, an event wait failing: {other:?}, {launched} launches"
        )),
    }
    if let Err(e) = rms_bwd(&gpu, &mut small) {
        out.push(format!("rms_norm bwd after a failed event wait: {e}"));
    }
    // A stream capturing a graph with event tracking on: every op refuses before any operand's
    // event wait (which would invalidate the capture), asking the driver only whether it captures
    // (and cudarc which context is current).
    fake.set_capturing(true);
    for (what, op) in OPS {
        let before = fake.counts();
        let result = op(&gpu, &mut small);
        let asked: Vec<String> = (fake.since(&before).into_iter())
            .filter(|(name, _)| !["cuStreamIsCapturing", "cuCtxGetCurrent"].contains(name))
            .map(|(name, n)| format!("{n} × {name}"))
            .collect();
        if result != Err(normkern::Error::CaptureWithEventTracking) || !asked.is_empty() {
            out.push(format!(
                "{what} while capturing: {result:?}, driver calls {asked:?}"
            ));
        }
    }
    fake.set_capturing(false);
    Ok(out)
}

/// How each of [`REJECTED`] must be rejected: the start of its error's `Debug` form (so that a
/// case failing elsewhere, e.g. while making its views, does not pass for it).
const REJECTED_AS: [&str; 8] = [
    "Eps(",
    "WorkspaceTooSmall",
    "Shape { what: \"y\"",
    "Shape { what: \"y\"",
    "Length { what: \"dbias\"",
    "WorkspaceTooSmall",
    "Shape { what: \"ab\"",
    "Shape { what: \"da\"",
];

/// Shapes that reach each launch plan: a small batch (the backward's single launch), a large one
/// at d = 4096, QK-norm's segment teams, two-pass narrow rows, and very wide rows (clusters).
const SHAPES: [(usize, usize); 5] = [
    (64, 4096),
    (16384, 4096),
    (1 << 20, 128),
    (16384, 512),
    (64, 1 << 20),
];

/// One op at one shape, measured over `calls` calls after the first.
struct Row {
    /// The kernels' build (`Context::ptx_arch`).
    build: u32,
    op: &'static str,
    shape: (usize, usize),
    tracked: bool,
    /// Driver calls beyond the per-call ones that the op's first call at the shape made: the
    /// plan's questions (occupancy), asked once per context and kept.
    first_call: u64,
    /// Each driver function's calls over the measured calls.
    driver: Vec<(&'static str, u64)>,
    allocations: u64,
    calls: u64,
    median_ns: f64,
    /// The launches of the last call, in order.
    launches: Vec<(FakeLaunch, &'static str)>,
}

fn measure(
    fake: &Fake,
    gpu: &Gpu<'_>,
    operands: &mut Operands,
    (op, run): (&'static str, Op),
    tracked: bool,
    calls: u64,
) -> normkern::Result<Row> {
    let before = fake.counts();
    run(gpu, operands)?;
    let first_call = (fake.since(&before).into_iter())
        .filter(|(name, _)| !PER_CALL.contains(name) && !PER_CALL_TRACKED.contains(name))
        .map(|(_, n)| n)
        .sum();
    // Warm the caches and the branch predictors, then count over the measured calls only.
    for _ in 0..16 {
        run(gpu, operands)?;
    }
    let (counts, allocations) = (fake.counts(), ALLOCATIONS.load(Relaxed));
    let mut times = Vec::with_capacity(calls as usize);
    for _ in 0..calls {
        let start = Instant::now();
        run(gpu, operands)?;
        times.push(start.elapsed().as_nanos() as f64);
    }
    // Less `times`' own allocation (its `with_capacity`).
    let allocations = ALLOCATIONS.load(Relaxed) - allocations - 1;
    let driver = fake.since(&counts);
    times.sort_by(f64::total_cmp);
    let launches = driver.iter().find(|&&(name, _)| name == "cuLaunchKernelEx");
    let launches_per_call = launches.map_or(0, |&(_, n)| n / calls) as usize;
    Ok(Row {
        build: gpu.context().ptx_arch(),
        op,
        shape: (operands.rows, operands.d),
        tracked,
        first_call,
        driver,
        allocations,
        calls,
        median_ns: times[times.len() / 2],
        launches: fake.launches(launches_per_call),
    })
}

/// The promises a row breaks, in words.
fn broken(row: &Row) -> Vec<String> {
    let mut out = Vec::new();
    if row.allocations > 0 {
        out.push(format!("{} heap allocations", row.allocations));
    }
    for &(name, n) in &row.driver {
        let allowed = PER_CALL.contains(&name) || (row.tracked && PER_CALL_TRACKED.contains(&name));
        if !allowed {
            out.push(format!("{n} × {name}"));
        } else if n % row.calls != 0 {
            out.push(format!(
                "{name} {n} times in {} calls (not a whole number per call)",
                row.calls
            ));
        }
    }
    if !row.driver.iter().any(|&(n, _)| n == "cuLaunchKernelEx") {
        out.push("no launch".into());
    }
    if row.build < 90 && row.launches.iter().any(|(l, _)| l.cluster > 1) {
        out.push("a cluster launch in a build without clusters".into());
    }
    // A column sum waits in the kernel for the backward before it (sm_90's `griddepcontrol`), so
    // it may overlap it there; sm_80's kernels do not wait, and no other kernel does.
    for (l, kernel) in &row.launches {
        let overlaps = row.build >= 90 && kernel.starts_with("column_sum");
        if (l.overlaps != 0) != overlaps {
            out.push(format!(
                "{kernel} overlapping the launch before it: {}",
                l.overlaps != 0
            ));
        }
    }
    out
}

fn per_call(row: &Row, name: &str) -> f64 {
    let n = row
        .driver
        .iter()
        .find(|&&(n, _)| n == name)
        .map_or(0, |&(_, n)| n);
    n as f64 / row.calls as f64
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os(UNDER_FAKE).is_none() {
        return run_under_fake();
    }
    let check = args.iter().any(|a| a == "--check");
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let calls = value("--calls")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000u64);
    // `--shapes RxD,…`: which plans (kernels, grid, block) other shapes get, without a GPU (under
    // the fake's occupancy answers, which ignore registers).
    let shapes = match value("--shapes").map(|v| parse_shapes(v)) {
        Some(Ok(shapes)) => shapes,
        Some(Err(e)) => {
            eprintln!("host_path: --shapes: {e}");
            return ExitCode::FAILURE;
        }
        None => SHAPES.to_vec(),
    };
    match report(check, calls.max(1), &shapes) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("host_path: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs this program again with the fake driver first on the library path.
#[cfg(target_os = "linux")]
fn run_under_fake() -> ExitCode {
    use std::os::unix::process::CommandExt;
    let dir = env!("NORMKERN_FAKE_CUDA_DIR");
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{dir}:{old}"),
        _ => dir.to_string(),
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("host_path: where am I? {e}");
            return ExitCode::FAILURE;
        }
    };
    let e = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", path)
        .env(UNDER_FAKE, "1")
        .exec();
    eprintln!("host_path: running under the fake driver: {e}");
    ExitCode::FAILURE
}

#[cfg(not(target_os = "linux"))]
fn run_under_fake() -> ExitCode {
    eprintln!("host_path: the fake CUDA driver is a Linux libcuda.so");
    ExitCode::FAILURE
}

/// `RxD,RxD,…`.
fn parse_shapes(list: &str) -> Result<Vec<(usize, usize)>, String> {
    list.split(',')
        .map(|shape| {
            let (rows, d) = shape.split_once('x').ok_or(format!("{shape}: not RxD"))?;
            let number = |v: &str| v.parse::<usize>().map_err(|e| format!("{shape}: {e}"));
            Ok((number(rows)?, number(d)?))
        })
        .collect()
}

fn report(check: bool, calls: u64, shapes: &[(usize, usize)]) -> Result<bool, String> {
    let sm90 = Context::new(0).map_err(|e| e.to_string())?;
    // The A100 build's plans (no clusters, no sm_90 kernels) on the same device.
    let sm80 =
        Context::from_cuda_with_ptx_arch(sm90.cuda().clone(), 80).map_err(|e| e.to_string())?;
    let fake = Fake::open()?;
    let mut ok = true;
    for broken in loading_broken(&sm90, &sm80) {
        ok = false;
        eprintln!("BROKEN loading: {broken}");
    }
    let failures = failures_broken(&fake, &sm90)?;
    println!(
        "{} rejected calls (no driver call each), 3 driver failures (a typed error, nothing \
         launched after), {} ops on a capturing stream with event tracking on (refused before \
         any event wait): {}",
        REJECTED.len(),
        OPS.len(),
        if failures.is_empty() {
            "as promised"
        } else {
            "BROKEN"
        }
    );
    for broken in failures {
        ok = false;
        eprintln!("BROKEN failures: {broken}");
    }
    println!(
        "normkern host path against the fake CUDA driver (an sm_90 device of {} SMs; nothing \
         runs): per call after the first of its shape, median of {calls} calls",
        sm90.sm_count()
    );
    println!(
        "| build | op | rows×d | event tracking | host ns/call | launches | fills | event waits + \
         records | heap allocs | driver queries, first call | kernels (grid×block) |"
    );
    println!("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|");
    // The range of the medians, by event tracking on / off.
    let mut range = [(f64::INFINITY, 0.0f64); 2];
    for (ctx, tracked) in [(&sm90, true), (&sm90, false), (&sm80, true), (&sm80, false)] {
        // A fresh stream per setting; with tracking off every buffer lives on it (the README's
        // capture setup). Both contexts share the device's primary CUDA context.
        if tracked {
            unsafe { ctx.cuda().enable_event_tracking() };
        } else {
            // SAFETY: every operand below is made and used on the one stream.
            unsafe { ctx.cuda().disable_event_tracking() };
        }
        let stream = ctx.cuda().new_stream().map_err(|e| e.to_string())?;
        let gpu = ctx.on(&stream).map_err(|e| e.to_string())?;
        for &shape in shapes {
            let mut operands = Operands::new(&stream, shape).map_err(|e| e.to_string())?;
            for op in OPS {
                let row = measure(&fake, &gpu, &mut operands, op, tracked, calls)
                    .map_err(|e| format!("sm_{} {} at {shape:?}: {e}", ctx.ptx_arch(), op.0))?;
                print_row(&row);
                let r = &mut range[usize::from(!tracked)];
                *r = (r.0.min(row.median_ns), r.1.max(row.median_ns));
                let broken = broken(&row);
                if !broken.is_empty() {
                    ok = false;
                    eprintln!(
                        "BROKEN sm_{} {} at {:?}: {}",
                        row.build,
                        row.op,
                        row.shape,
                        broken.join(", ")
                    );
                }
            }
        }
    }
    let [on, off] = range;
    println!(
        "normkern's and cudarc's host work per call ({} build): {:.0}–{:.0} ns with event \
         tracking on, {:.0}–{:.0} ns off; the driver's launch comes on top",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        on.0,
        on.1,
        off.0,
        off.1
    );
    if check {
        println!(
            "check: {}",
            if ok {
                "every promise holds"
            } else {
                "BROKEN (above)"
            }
        );
        Ok(ok)
    } else {
        Ok(true)
    }
}

/// What loading promises (`Context`'s docs), on the fake sm_90 device: the sm_90 cubin by
/// default, the sm_80 build from its PTX when asked, typed errors for a build that does not exist
/// or a device that does not.
fn loading_broken(sm90: &Context, sm80: &Context) -> Vec<String> {
    let mut out = Vec::new();
    let loaded = |c: &Context| (c.ptx_arch(), c.kernel_image());
    if loaded(sm90) != (90, KernelImage::Cubin) {
        out.push(format!("Context::new loaded {:?}", loaded(sm90)));
    }
    if loaded(sm80) != (80, KernelImage::Ptx) {
        out.push(format!("the sm_80 build loaded {:?}", loaded(sm80)));
    }
    for arch in [75, 89, 100] {
        match Context::from_cuda_with_ptx_arch(sm90.cuda().clone(), arch) {
            Err(normkern::Error::NoBuildForArch { .. }) => {}
            other => out.push(format!("sm_{arch} build: {:?}", other.map(|c| loaded(&c)))),
        }
    }
    match Context::new(1) {
        Err(normkern::Error::NoDevice { ordinal: 1, .. }) => {}
        other => out.push(format!("device 1: {:?}", other.map(|c| loaded(&c)))),
    }
    out
}

fn print_row(row: &Row) {
    let kernels: Vec<String> = (row.launches.iter())
        .map(|(l, kernel)| {
            let cluster = if l.cluster > 1 {
                format!(", clusters of {}", l.cluster)
            } else {
                String::new()
            };
            let cooperative = if l.cooperative != 0 {
                ", cooperative"
            } else {
                ""
            };
            let overlaps = if l.overlaps != 0 { ", overlapping" } else { "" };
            format!(
                "{kernel} ({}×{}{cluster}{cooperative}{overlaps})",
                l.grid, l.block
            )
        })
        .collect();
    let events = per_call(row, "cuStreamWaitEvent") + per_call(row, "cuEventRecord");
    println!(
        "| sm_{} | {} | {}×{} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
        row.build,
        row.op,
        row.shape.0,
        row.shape.1,
        if row.tracked { "on" } else { "off" },
        row.median_ns,
        per_call(row, "cuLaunchKernelEx"),
        per_call(row, "cuMemsetD32Async"),
        events,
        row.allocations as f64 / row.calls as f64,
        row.first_call,
        kernels.join(" then "),
    );
}
