//! A stand-in for the CUDA driver (`libcuda.so`) that runs nothing and counts every call: what the
//! host-path check (`tests/src/bin/host_path.rs`) loads instead of the real driver, so that a
//! machine without a GPU can see which driver calls, and how many, one normkern call makes, and
//! time normkern's own host work without the driver's.
//!
//! It answers as one H200-like device would (sm_90, 132 SMs, 227 KiB of opt-in shared memory;
//! occupancy from threads and shared memory only, registers not modelled, so a plan's grid or tile
//! can differ from the H200's), hands out device addresses that no memory backs (copies and fills
//! do nothing: the check never reads results), and records the latest launches. `tests/build.rs`
//! compiles this file alone
//! into `libcuda.so` (no dependencies); it is not a crate of the workspace, so that no
//! `libcuda.so` lands where a program could load it by mistake.
//!
//! Besides the driver's functions it exports `fake_cuda_*` functions for the check: the call
//! names and counts, the latest launches, a failure of the next call of a function (the launch,
//! an event wait or record, a fill), and streams that say they are capturing a graph.

#![allow(non_snake_case)] // the driver's names
#![allow(clippy::missing_safety_doc)] // each function is the driver's, with its documented contract

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};

type CUresult = c_uint;
const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const INVALID_DEVICE: CUresult = 101;

/// Every driver function here, as an index into the counters, and its name.
macro_rules! calls {
    ($($name:ident),* $(,)?) => {
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        enum Call { $($name),* }
        /// NUL-terminated, for `fake_cuda_call_name`.
        const NAMES: &[&str] = &[$(concat!(stringify!($name), "\0")),*];
    };
}

calls!(
    cuInit,
    cuDriverGetVersion,
    cuDeviceGet,
    cuDeviceGetCount,
    cuDeviceGetAttribute,
    cuDeviceGetName,
    cuDeviceTotalMem_v2,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxRelease_v2,
    cuCtxGetCurrent,
    cuCtxSetCurrent,
    cuCtxSynchronize,
    cuGetErrorName,
    cuGetErrorString,
    cuModuleLoadData,
    cuModuleUnload,
    cuModuleGetFunction,
    cuFuncGetAttribute,
    cuFuncSetAttribute,
    cuOccupancyMaxActiveBlocksPerMultiprocessor,
    cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags,
    cuOccupancyMaxActiveClusters,
    cuStreamCreate,
    cuStreamCreateWithPriority,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuStreamWaitEvent,
    cuStreamIsCapturing,
    cuEventCreate,
    cuEventRecord,
    cuEventSynchronize,
    cuEventQuery,
    cuEventDestroy_v2,
    cuMemAlloc_v2,
    cuMemAllocAsync,
    cuMemFree_v2,
    cuMemFreeAsync,
    cuMemcpyHtoD_v2,
    cuMemcpyHtoDAsync_v2,
    cuMemcpyDtoH_v2,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyDtoDAsync_v2,
    cuMemsetD8Async,
    cuMemsetD32Async,
    cuLaunchKernel,
    cuLaunchKernelEx,
);

static COUNTS: [AtomicU64; NAMES.len()] = [const { AtomicU64::new(0) }; NAMES.len()];

/// A failure the check asked for: the code the function's next call returns (0: none).
static FAILURES: [AtomicU32; NAMES.len()] = [const { AtomicU32::new(0) }; NAMES.len()];

/// Counts a call; what it returns, unless the check asked for this call to fail. Functions the
/// check does not fail ignore it.
fn count(call: Call) -> CUresult {
    COUNTS[call as usize].fetch_add(1, Relaxed);
    FAILURES[call as usize].swap(0, Relaxed)
}

/// Writes `value` through a driver out-parameter; a null one is the driver's invalid value.
unsafe fn put<T>(out: *mut T, value: T) -> CUresult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    unsafe { out.write(value) };
    SUCCESS
}

/// Distinct non-null handles (contexts, modules, streams, events).
fn handle() -> *mut c_void {
    static NEXT: AtomicUsize = AtomicUsize::new(0x1000);
    NEXT.fetch_add(0x10, Relaxed) as *mut c_void
}

// --- the check's side ---------------------------------------------------------------------------

/// How many functions are counted.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_calls() -> usize {
    NAMES.len()
}

/// The name of counted function `i` (NUL-terminated, static), or null past the end.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_call_name(i: usize) -> *const c_char {
    NAMES.get(i).map_or(std::ptr::null(), |n| n.as_ptr().cast())
}

/// How many times function `i` was called.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_call_count(i: usize) -> u64 {
    COUNTS.get(i).map_or(0, |c| c.load(Relaxed))
}

/// Makes the next call of function `i` return `code`; false (and nothing armed) unless function
/// `i` honours failures (the launch, event waits and records, 32-bit fills) and `code` is one of
/// the driver's that cudarc can hold (its enum: an unknown value would be undefined behaviour).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_fail_next(i: usize, code: CUresult) -> bool {
    const FAILABLE: [Call; 4] = [
        Call::cuLaunchKernelEx,
        Call::cuStreamWaitEvent,
        Call::cuEventRecord,
        Call::cuMemsetD32Async,
    ];
    let failable = FAILABLE.iter().any(|&c| c as usize == i);
    if !failable || ![INVALID_VALUE, 400, 701].contains(&code) {
        return false;
    }
    FAILURES[i].store(code, Relaxed);
    true
}

/// A launch: grid, block, dynamic shared bytes, cluster size (1 without the attribute),
/// cooperative (0 or 1), overlapping the previous launch (0 or 1), and its kernel's name (the address of a NUL-terminated string kept for
/// the process's life).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FakeLaunch {
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
    pub cluster: u32,
    pub cooperative: u32,
    pub overlaps: u32,
    pub kernel: usize,
}

const NO_LAUNCH: FakeLaunch = FakeLaunch {
    grid: 0,
    block: 0,
    shared_bytes: 0,
    cluster: 0,
    cooperative: 0,
    overlaps: 0,
    kernel: 0,
};

/// How many of the latest launches are kept (a call makes one or two).
const KEPT_LAUNCHES: usize = 4;

/// The latest launches, the last first.
static LAUNCHES: std::sync::Mutex<[FakeLaunch; KEPT_LAUNCHES]> =
    std::sync::Mutex::new([NO_LAUNCH; KEPT_LAUNCHES]);

/// Copies into `out` the launch `back` launches before the last (0: the last; all zeros past
/// what is kept).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_recent_launch(back: usize, out: *mut FakeLaunch) {
    let launches = *LAUNCHES.lock().unwrap_or_else(|p| p.into_inner());
    unsafe { put(out, launches.get(back).copied().unwrap_or(NO_LAUNCH)) };
}

// --- device and context -------------------------------------------------------------------------

/// The one device's attributes: an H200's where normkern or cudarc asks, 0 elsewhere.
fn attribute(attribute: c_int) -> c_int {
    match attribute {
        1 => 1024,    // max threads per block
        8 => 49152,   // max shared memory per block
        10 => 32,     // warp size
        16 => 132,    // multiprocessors
        39 => 2048,   // max threads per multiprocessor
        75 => 9,      // compute capability major
        76 => 0,      // compute capability minor
        81 => 233472, // shared memory per multiprocessor
        97 => 232448, // opt-in shared memory per block
        115 => 1,     // memory pools supported
        _ => 0,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    count(Call::cuInit);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    count(Call::cuDriverGetVersion);
    unsafe { put(version, 13000) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CUresult {
    count(Call::cuDeviceGet);
    if ordinal != 0 {
        return INVALID_DEVICE;
    }
    unsafe { put(device, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    count(Call::cuDeviceGetCount);
    unsafe { put(n, 1) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    _device: c_int,
) -> CUresult {
    count(Call::cuDeviceGetAttribute);
    unsafe { put(value, attribute(attrib)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    len: c_int,
    _device: c_int,
) -> CUresult {
    count(Call::cuDeviceGetName);
    let text = b"normkern fake CUDA device\0";
    if name.is_null() || (len as usize) < text.len() {
        return INVALID_VALUE;
    }
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, text.len()) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, _device: c_int) -> CUresult {
    count(Call::cuDeviceTotalMem_v2);
    unsafe { put(bytes, 141 << 30) }
}

static PRIMARY: AtomicUsize = AtomicUsize::new(0);
static CURRENT: AtomicUsize = AtomicUsize::new(0);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    ctx: *mut *mut c_void,
    _device: c_int,
) -> CUresult {
    count(Call::cuDevicePrimaryCtxRetain);
    let primary = match PRIMARY.load(Relaxed) {
        0 => {
            let h = handle() as usize;
            PRIMARY.store(h, Relaxed);
            h
        }
        h => h,
    };
    unsafe { put(ctx, primary as *mut c_void) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(_device: c_int) -> CUresult {
    count(Call::cuDevicePrimaryCtxRelease_v2);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    count(Call::cuCtxGetCurrent);
    unsafe { put(ctx, CURRENT.load(Relaxed) as *mut c_void) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    count(Call::cuCtxSetCurrent);
    CURRENT.store(ctx as usize, Relaxed);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    count(Call::cuCtxSynchronize);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, name: *mut *const c_char) -> CUresult {
    count(Call::cuGetErrorName);
    let text = match error {
        0 => c"CUDA_SUCCESS",
        1 => c"CUDA_ERROR_INVALID_VALUE",
        101 => c"CUDA_ERROR_INVALID_DEVICE",
        400 => c"CUDA_ERROR_INVALID_HANDLE",
        701 => c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        _ => c"CUDA_ERROR_UNKNOWN",
    };
    unsafe { put(name, text.as_ptr()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(_error: CUresult, text: *mut *const c_char) -> CUresult {
    count(Call::cuGetErrorString);
    unsafe { put(text, c"an error of the fake CUDA driver".as_ptr()) }
}

// --- modules and functions ----------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(
    module: *mut *mut c_void,
    _image: *const c_void,
) -> CUresult {
    count(Call::cuModuleLoadData);
    unsafe { put(module, handle()) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(_module: *mut c_void) -> CUresult {
    count(Call::cuModuleUnload);
    SUCCESS
}

/// A function's handle is its name, copied and kept for the process's life (launches report it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    _module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    count(Call::cuModuleGetFunction);
    if name.is_null() {
        return INVALID_VALUE;
    }
    let name: &'static std::ffi::CStr = Box::leak(unsafe { std::ffi::CStr::from_ptr(name) }.into());
    unsafe { put(function, name.as_ptr().cast_mut().cast()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    _function: *mut c_void,
) -> CUresult {
    count(Call::cuFuncGetAttribute);
    // Max threads per block (0): what 64 registers a thread allow; others 0.
    unsafe { put(value, if attrib == 0 { 1024 } else { 0 }) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetAttribute(
    _function: *mut c_void,
    _attrib: c_int,
    _value: c_int,
) -> CUresult {
    count(Call::cuFuncSetAttribute);
    SUCCESS
}

/// Blocks of `block` threads and `shared` bytes one SM keeps: its threads' and shared memory's
/// limits (registers not modelled).
fn blocks_per_sm(block: c_int, shared: usize) -> c_int {
    let by_threads = 2048 / block.max(1);
    let by_shared = 233472 / (shared + 1024);
    by_threads.min(by_shared as c_int).min(32)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    _function: *mut c_void,
    block: c_int,
    shared: usize,
) -> CUresult {
    count(Call::cuOccupancyMaxActiveBlocksPerMultiprocessor);
    unsafe { put(blocks, blocks_per_sm(block, shared)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    blocks: *mut c_int,
    _function: *mut c_void,
    block: c_int,
    shared: usize,
    _flags: c_uint,
) -> CUresult {
    count(Call::cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags);
    unsafe { put(blocks, blocks_per_sm(block, shared)) }
}

/// The driver's launch description (`CUlaunchConfig`) and one attribute of it.
#[repr(C)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_bytes: c_uint,
    stream: *mut c_void,
    attributes: *const LaunchAttribute,
    attribute_count: c_uint,
}

#[repr(C)]
pub struct LaunchAttribute {
    id: c_uint,
    pad: [u8; 4],
    value: [c_uint; 16],
}

const ATTRIBUTE_COOPERATIVE: c_uint = 2;
const ATTRIBUTE_CLUSTER_DIMENSION: c_uint = 4;
const ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: c_uint = 6;

/// The cluster size, the cooperative flag and the overlap flag (programmatic stream
/// serialization) a config asks for.
unsafe fn launch_attributes(config: &LaunchConfig) -> (u32, u32, u32) {
    let attributes = if config.attributes.is_null() {
        &[][..]
    } else {
        unsafe { std::slice::from_raw_parts(config.attributes, config.attribute_count as usize) }
    };
    let mut found = (1, 0, 0);
    for a in attributes {
        match a.id {
            ATTRIBUTE_CLUSTER_DIMENSION => found.0 = a.value[0],
            ATTRIBUTE_COOPERATIVE => found.1 = a.value[0],
            ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION => found.2 = a.value[0],
            _ => {}
        }
    }
    found
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveClusters(
    clusters: *mut c_int,
    _function: *mut c_void,
    config: *const LaunchConfig,
) -> CUresult {
    count(Call::cuOccupancyMaxActiveClusters);
    let Some(config) = (unsafe { config.as_ref() }) else {
        return INVALID_VALUE;
    };
    let (cluster, _, _) = unsafe { launch_attributes(config) };
    let per_sm = blocks_per_sm(config.block[0] as c_int, config.shared_bytes as usize);
    // Clusters sit within a GPC: H200's 132 SMs as 7 GPCs of at most 18 (an estimate).
    let per_gpc = (per_sm * 18) / cluster.max(1) as c_int;
    unsafe { put(clusters, per_gpc * 7) }
}

// --- streams and events -------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CUresult {
    count(Call::cuStreamCreate);
    unsafe { put(stream, handle()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut *mut c_void,
    _flags: c_uint,
    _priority: c_int,
) -> CUresult {
    count(Call::cuStreamCreateWithPriority);
    unsafe { put(stream, handle()) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(_stream: *mut c_void) -> CUresult {
    count(Call::cuStreamDestroy_v2);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CUresult {
    count(Call::cuStreamSynchronize);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(
    _stream: *mut c_void,
    _event: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    count(Call::cuStreamWaitEvent)
}

/// What `cuStreamIsCapturing` says of every stream: 0 none (the default), 1 active.
static CAPTURE_STATUS: AtomicU32 = AtomicU32::new(0);

/// Makes every stream report capture status `status` (0 none, 1 active, 2 invalidated: the
/// values of cudarc's enum; others are ignored).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_capture_status(status: c_uint) {
    if status <= 2 {
        CAPTURE_STATUS.store(status, Relaxed);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(
    _stream: *mut c_void,
    status: *mut c_uint,
) -> CUresult {
    count(Call::cuStreamIsCapturing);
    unsafe { put(status, CAPTURE_STATUS.load(Relaxed)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> CUresult {
    count(Call::cuEventCreate);
    unsafe { put(event, handle()) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(_event: *mut c_void, _stream: *mut c_void) -> CUresult {
    count(Call::cuEventRecord)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(_event: *mut c_void) -> CUresult {
    count(Call::cuEventSynchronize);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(_event: *mut c_void) -> CUresult {
    count(Call::cuEventQuery);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(_event: *mut c_void) -> CUresult {
    count(Call::cuEventDestroy_v2);
    SUCCESS
}

// --- memory: addresses without memory -----------------------------------------------------------

/// Device addresses, 256-byte aligned, never reused; nothing backs them.
fn allocate(bytes: usize) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1 << 40);
    let size = (bytes as u64).div_ceil(256).max(1) * 256;
    NEXT.fetch_add(size, Relaxed)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(address: *mut u64, bytes: usize) -> CUresult {
    count(Call::cuMemAlloc_v2);
    unsafe { put(address, allocate(bytes)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    address: *mut u64,
    bytes: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemAllocAsync);
    unsafe { put(address, allocate(bytes)) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(_address: u64) -> CUresult {
    count(Call::cuMemFree_v2);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(_address: u64, _stream: *mut c_void) -> CUresult {
    count(Call::cuMemFreeAsync);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoD_v2(_dst: u64, _src: *const c_void, _bytes: usize) -> CUresult {
    count(Call::cuMemcpyHtoD_v2);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    _dst: u64,
    _src: *const c_void,
    _bytes: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemcpyHtoDAsync_v2);
    SUCCESS
}

/// Device memory reads as zeros.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, _src: u64, bytes: usize) -> CUresult {
    count(Call::cuMemcpyDtoH_v2);
    if !dst.is_null() {
        unsafe { std::ptr::write_bytes(dst.cast::<u8>(), 0, bytes) };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    _src: u64,
    bytes: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemcpyDtoHAsync_v2);
    if !dst.is_null() {
        unsafe { std::ptr::write_bytes(dst.cast::<u8>(), 0, bytes) };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    _dst: u64,
    _src: u64,
    _bytes: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemcpyDtoDAsync_v2);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(
    _dst: u64,
    _value: u8,
    _n: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemsetD8Async);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD32Async(
    _dst: u64,
    _value: c_uint,
    _n: usize,
    _stream: *mut c_void,
) -> CUresult {
    count(Call::cuMemsetD32Async)
}

// --- launches -----------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernel(
    _function: *mut c_void,
    _grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _shared_bytes: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    count(Call::cuLaunchKernel);
    SUCCESS
}

/// Runs nothing; records the launch for `fake_cuda_recent_launch`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    function: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    let failed = count(Call::cuLaunchKernelEx);
    if failed != SUCCESS {
        return failed;
    }
    let Some(config) = (unsafe { config.as_ref() }) else {
        return INVALID_VALUE;
    };
    let (cluster, cooperative, overlaps) = unsafe { launch_attributes(config) };
    let mut launches = LAUNCHES.lock().unwrap_or_else(|p| p.into_inner());
    launches.copy_within(..KEPT_LAUNCHES - 1, 1);
    launches[0] = FakeLaunch {
        grid: config.grid[0],
        block: config.block[0],
        shared_bytes: config.shared_bytes,
        cluster,
        cooperative,
        overlaps,
        kernel: function as usize,
    };
    SUCCESS
}
