//! Timing support shared by the bench binary and the demo: CUDA-event timing and the device copy
//! bandwidth that every result is reported against.

use std::sync::Arc;

use normkern::cudarc::driver::sys::{self, CUevent_flags};
use normkern::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use normkern::cudarc::nvrtc::Ptx;

/// Medians of one call's device time (CUDA events around it on the stream) and host time (what
/// the call itself takes on the CPU: validation, planning and enqueueing), in µs, not over the
/// timed calls, each of which follows an event record and a synchronize.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub device_us: f64,
    /// Over calls issued back to back, as a training loop issues them: where the GPU is the
    /// slower, the calls queue up behind it (which the driver's enqueueing may feel).
    pub host_us: f64,
    /// Over calls each issued on an idle stream (after a synchronize): a host-bound loop's
    /// case, where the GPU keeps up, and how [`launch_floor`] times its empty launches.
    pub host_idle_us: f64,
}

/// How long the GPU spins before each timed call (ns): longer than any call's host time, so the
/// call is enqueued before the GPU reaches it.
const SPIN_NS: u64 = 50_000;

/// Where [`time_on`] enqueues each timed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    /// Behind a kernel that spins for [`SPIN_NS`]: the events around the call then time its
    /// device work alone, as in a busy stream (and as `tests/peers/peers.py` times the peers),
    /// not the host's enqueueing, which is the separate host time.
    BehindSpin,
    /// On an idle stream: the start event fires as soon as it is recorded, so the device time
    /// includes the call's host time and launch latency — a lone call's latency (the small-batch
    /// latency table), and the bench's timing before 2026-12-02.
    Idle,
}

/// Times `reps` calls of `f` after `warmup` untimed ones (and [`WARM_UP`]), each behind a spin
/// kernel ([`Queue::BehindSpin`]), or on an idle stream when `NORMKERN_BENCH_IDLE=1` (for
/// comparisons with old figures): [`Timing`] medians.
pub fn time(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    f: impl FnMut(usize),
) -> Timing {
    let queue = if idle_timing() {
        Queue::Idle
    } else {
        Queue::BehindSpin
    };
    time_on(ctx, stream, (warmup, reps), queue, f)
}

/// Whether `NORMKERN_BENCH_IDLE=1` asks [`time`] for the idle-stream timing.
pub fn idle_timing() -> bool {
    std::env::var("NORMKERN_BENCH_IDLE").is_ok_and(|v| v == "1")
}

/// The shortest warm-up of every timed op: the GPU kept busy this long before its first timed
/// call. The first op the bench times at a shape follows the making of its inputs on the CPU,
/// with the GPU idle; at 524288×128 the same kernel read 78.5–85.6 % of copy over five runs of
/// one call while the ops after it varied by under 1 point (`bench-results/h200.md`, twentieth
/// session); 20 warm-up calls of 70 µs are 1.4 ms. (Whether this warm-up removes the spread has
/// not been measured yet.)
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(200);

/// Times `reps` calls of `f`, each enqueued as `queue` says, after `warmup` untimed ones and at
/// least [`WARM_UP`] of them: [`Timing`] medians.
pub fn time_on(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    (warmup, reps): (usize, usize),
    queue: Queue,
    mut f: impl FnMut(usize),
) -> Timing {
    let started = std::time::Instant::now();
    let mut warmed = 0;
    while warmed < warmup || started.elapsed() < WARM_UP {
        f(warmed);
        warmed += 1;
        // A short queue, so the time waited is the GPU's work.
        if warmed % 8 == 0 {
            stream.synchronize().expect("sync");
        }
    }
    let warmup = warmed;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut device = Vec::with_capacity(reps);
    let spin = (queue == Queue::BehindSpin).then(|| {
        let module = ctx
            .load_module(Ptx::from_src(TIMING_KERNELS))
            .expect("timing kernels");
        module.load_function("spin").expect("spin kernel")
    });
    for i in 0..reps {
        if let Some(spin) = &spin {
            // SAFETY: the kernel reads its one u64 parameter and the global timer, nothing else.
            unsafe { stream.launch_builder(spin).arg(&SPIN_NS).launch(ONE_THREAD) }.expect("spin");
        }
        let start = ctx.new_event(flags).expect("event");
        let end = ctx.new_event(flags).expect("event");
        start.record(stream).expect("record");
        f(warmup + i);
        end.record(stream).expect("record");
        end.synchronize().expect("sync");
        device.push(start.elapsed_ms(&end).expect("elapsed") as f64 * 1e3);
    }
    let mut next = warmup + reps;
    let host = host_medians(stream, reps, &mut || {
        f(next);
        next += 1;
    });
    Timing {
        device_us: median(device),
        host_us: host.back_to_back_us,
        host_idle_us: host.idle_us,
    }
}

/// Median host times (µs) of something enqueued on a stream.
#[derive(Clone, Copy, Debug)]
pub struct HostTime {
    /// Over `reps` issued back to back.
    pub back_to_back_us: f64,
    /// Over `reps` more, each issued on an idle stream (after a synchronize, not timed).
    pub idle_us: f64,
}

/// [`HostTime`] of `enqueue` on `stream`.
pub fn host_medians(stream: &CudaStream, reps: usize, enqueue: &mut dyn FnMut()) -> HostTime {
    let mut timed = |idle: bool| {
        let mut host = Vec::with_capacity(reps);
        for _ in 0..reps {
            if idle {
                stream.synchronize().expect("sync");
            }
            let start = std::time::Instant::now();
            enqueue();
            host.push(start.elapsed().as_secs_f64() * 1e6);
        }
        stream.synchronize().expect("sync");
        median(host)
    };
    HostTime {
        back_to_back_us: timed(false),
        idle_us: timed(true),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median of `reps` device timings (µs) of `f`; see [`time`].
pub fn median_us(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    warmup: usize,
    reps: usize,
    f: impl FnMut(usize),
) -> f64 {
    time(ctx, stream, warmup, reps, f).device_us
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), 1 GiB each way: what
/// every result is reported against.
pub fn copy_bandwidth(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, reps: usize) -> f64 {
    copy_timing(ctx, stream, 1 << 28, reps).0
}

/// Bandwidth (GB/s, read + write) and [`Timing`] of a device-to-device copy of `n` f32.
pub fn copy_timing(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    n: usize,
    reps: usize,
) -> (f64, Timing) {
    let src: CudaSlice<f32> = stream.clone_htod(&vec![1.5f32; n]).expect("alloc");
    let mut dst: CudaSlice<f32> = stream.alloc_zeros(n).expect("alloc");
    let timing = time(ctx, stream, 5, reps, |_| {
        stream.memcpy_dtod(&src, &mut dst).expect("copy")
    });
    (
        2.0 * (n * 4) as f64 / (timing.device_us * 1e-6) / 1e9,
        timing,
    )
}

/// An empty kernel (what one launch costs the host when the kernel does nothing), and one that
/// spins for `ns` nanoseconds of the global timer (what [`time`] enqueues calls behind).
const TIMING_KERNELS: &str = "
.version 7.0
.target sm_80
.address_size 64
.visible .entry empty()
{
    ret;
}
.visible .entry spin(.param .u64 ns)
{
    .reg .u64 %rd<5>;
    .reg .pred %p;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
SPIN:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra SPIN;
    ret;
}
";

/// [`TIMING_KERNELS`]' empty kernel built for sm_90, which cluster launches need.
const CLUSTER_TIMING_KERNEL: &str = "
.version 7.8
.target sm_90
.address_size 64
.visible .entry empty()
{
    ret;
}
";

const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// Host times of one launch of an empty kernel, by how it is launched: the floor under any
/// call's host time (a call that enqueues n kernels costs at least n of these).
#[derive(Clone, Copy, Debug)]
pub struct LaunchFloor {
    /// Through cudarc (`cuLaunchKernel`).
    pub plain: HostTime,
    /// `cuLaunchKernelEx` without attributes, as normkern launches a kernel that is neither
    /// cooperative nor in clusters.
    pub ex: HostTime,
    /// `cuLaunchKernelEx` with the cooperative attribute, as the backwards' single launch
    /// (in-launch dγ/dβ sums) goes; `None` where the device refuses it.
    pub cooperative: Option<HostTime>,
    /// `cuLaunchKernelEx` with clusters of two blocks (the wide rows' kernels); `None` where
    /// the device has no clusters (before sm_90).
    pub cluster: Option<HostTime>,
}

/// [`LaunchFloor`] over `reps` launches of each kind (back to back, then each on an idle stream).
pub fn launch_floor(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, reps: usize) -> LaunchFloor {
    let module = ctx
        .load_module(Ptx::from_src(TIMING_KERNELS))
        .expect("empty kernel");
    let empty = module.load_function("empty").expect("empty kernel");
    let config = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let plain = host_medians(stream, reps, &mut || {
        // SAFETY: the kernel takes no arguments and touches nothing.
        unsafe { stream.launch_builder(&empty).launch(config) }.expect("launch");
    });
    // The driver launches into the context current on this thread.
    ctx.bind_to_thread().expect("context");
    // One launch of `function` on two blocks through `cuLaunchKernelEx`, with `attribute` if any.
    let launch_ex = |function: &CudaFunction, attribute: Option<sys::CUlaunchAttribute>| {
        // On the stack: an allocation here would be timed with the launch.
        let mut attributes = [attribute.unwrap_or(
            // SAFETY: an all-zero attribute is a valid one (and not passed: `numAttrs` is 0).
            unsafe { std::mem::zeroed() },
        )];
        let used = usize::from(attribute.is_some());
        let launch = sys::CUlaunchConfig {
            gridDimX: 2,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: used as u32,
        };
        // SAFETY: the kernel takes no arguments and touches nothing; the configuration names a
        // live stream and the attributes, which outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                function.cu_function(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
        .result()
    };
    // A launch kind the device refuses gives no figure rather than no bench.
    let floor_of = |function: &CudaFunction, attribute: Option<sys::CUlaunchAttribute>| {
        launch_ex(function, attribute).is_ok().then(|| {
            host_medians(stream, reps, &mut || {
                launch_ex(function, attribute).expect("a launch that worked once");
            })
        })
    };
    // SAFETY (both attributes): an all-zero attribute is a valid one; its id and value are set.
    let mut cooperative: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    cooperative.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    cooperative.value.cooperative = 1;
    let mut cluster: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    cluster.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    cluster.value.clusterDim.x = 2;
    cluster.value.clusterDim.y = 1;
    cluster.value.clusterDim.z = 1;
    // Clusters need code built for sm_90 or later: no module, no figure.
    let cluster_module = ctx.load_module(Ptx::from_src(CLUSTER_TIMING_KERNEL)).ok();
    let cluster_kernel = cluster_module.and_then(|m| m.load_function("empty").ok());
    LaunchFloor {
        plain,
        ex: floor_of(&empty, None).expect("a launch through cuLaunchKernelEx"),
        cooperative: floor_of(&empty, Some(cooperative)),
        cluster: cluster_kernel.and_then(|f| floor_of(&f, Some(cluster))),
    }
}
