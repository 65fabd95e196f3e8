//! The GPU side: a CUDA context with normkern's PTX loaded, and the executor that launches on a
//! caller's stream.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::{
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
};
use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use normkern_gpu::activation::Family;
use normkern_gpu::norm::Norm;
use normkern_gpu::variant::{ActVariant, Dtype, EntryName, TILES, Variant, act, tiles};

use crate::error::{Error, Result};
use crate::launch::{Executor, Kernel, Shape};

/// PTX built by `cargo xtask build-ptx`, one per target architecture, newest first.
const PTX: [(u32, &str); 2] = [
    (90, include_str!("../ptx/normkern_sm90.ptx")),
    (80, include_str!("../ptx/normkern_sm80.ptx")),
];

/// Kernel families compiled once per dtype (the norm families are compiled per [`Variant`]).
const DTYPE_FAMILIES: [&str; 1] = ["column_sum"];
const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

/// A CUDA device with normkern's kernels loaded. Share it by reference; every launch takes the
/// caller's stream, so one context serves any number of streams.
pub struct Context {
    cuda: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
    ptx_arch: u32,
    sm_count: usize,
    /// Dynamic shared memory one block may opt into (bytes).
    shared_opt_in: usize,
    grid_limit: Option<usize>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.cuda.ordinal())
            .field("ptx_arch", &self.ptx_arch)
            .field("sm_count", &self.sm_count)
            .field("grid_limit", &self.grid_limit)
            .finish()
    }
}

impl Context {
    /// Opens device `ordinal` (its primary context) and loads the PTX for its architecture.
    /// No driver or no such device is an [`Error`], never a panic.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics on the first driver call when libcuda is missing: ask first.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        let cuda = CudaContext::new(ordinal).map_err(|e| Error::NoDevice {
            ordinal,
            reason: Error::driver("cuCtxCreate")(e).to_string(),
        })?;
        Self::from_cuda(cuda)
    }

    /// Uses a CUDA context the caller already has (so normkern mixes with other cudarc code).
    pub fn from_cuda(cuda: Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = cuda
            .compute_capability()
            .map_err(Error::driver("cuDeviceGetAttribute"))?;
        let cc = (major * 10 + minor) as u32;
        let &(ptx_arch, ptx) = PTX
            .iter()
            .find(|(arch, _)| *arch <= cc)
            .ok_or(Error::UnsupportedDevice { major, minor })?;
        let module = cuda
            .load_module(Ptx::from_src(ptx))
            .map_err(Error::driver("cuModuleLoadData"))?;
        let mut names: Vec<EntryName> = Vec::new();
        let mut staged: Vec<EntryName> = Vec::new();
        for dtype in DTYPES {
            names.extend(DTYPE_FAMILIES.iter().map(|f| EntryName::new(f, dtype)));
            for (norm, residual) in Norm::ALL.iter().flat_map(|&n| [(n, false), (n, true)]) {
                let (fwd, bwd) = norm.families(residual);
                for vec in [true, false] {
                    for &vpt in tiles(vec, Norm::scalar_streams(residual)) {
                        let v = Variant {
                            dtype,
                            vec,
                            vpt,
                            cluster: false,
                        };
                        names.extend([v.entry_name(fwd), v.entry_name(bwd)]);
                    }
                }
                if ptx_arch >= 90 {
                    for vpt in TILES {
                        let v = Variant {
                            dtype,
                            vec: true,
                            vpt,
                            cluster: true,
                        };
                        names.extend([v.entry_name(fwd), v.entry_name(bwd)]);
                        if normkern_gpu::norm::staged(true, residual, vpt) {
                            staged.push(v.entry_name(bwd));
                        }
                    }
                }
            }
            for family in Family::ALL {
                for vec in [true, false] {
                    for (a, _) in act::ALL {
                        names.push(ActVariant { dtype, vec, act: a }.entry_name(family.prefix()));
                    }
                }
            }
        }
        let mut functions = HashMap::new();
        for name in names {
            let f = module
                .load_function(name.as_str())
                .map_err(Error::driver("cuModuleGetFunction"))?;
            functions.insert(name.as_str().to_owned(), f);
        }
        let sm_count = cuda
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(Error::driver("cuDeviceGetAttribute"))? as usize;
        let shared_opt_in = cuda
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(Error::driver("cuDeviceGetAttribute"))?;
        // The staged kernels size their ring to the block; the tile choice keeps them within this.
        for name in staged {
            functions[name.as_str()]
                .set_attribute(
                    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_opt_in,
                )
                .map_err(Error::driver("cuFuncSetAttribute"))?;
        }
        Ok(Context {
            cuda,
            _module: module,
            functions,
            ptx_arch,
            sm_count,
            shared_opt_in: shared_opt_in as usize,
            grid_limit: None,
        })
    }

    /// Caps every persistent grid at `blocks` blocks (default: at most as many as the device keeps
    /// resident); a grid of clusters keeps at least one whole cluster (up to 8 blocks). Results
    /// do not depend on it; tests use it to prove that.
    pub fn with_grid_limit(mut self, blocks: usize) -> Result<Self> {
        if blocks == 0 {
            return Err(Error::ZeroGrid);
        }
        self.grid_limit = Some(blocks);
        Ok(self)
    }

    /// The underlying cudarc context.
    pub fn cuda(&self) -> &Arc<CudaContext> {
        &self.cuda
    }

    /// The architecture of the PTX in use (90 for sm_90, 80 for sm_80).
    pub fn ptx_arch(&self) -> u32 {
        self.ptx_arch
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn function(&self, kernel: &Kernel) -> Result<&CudaFunction> {
        self.functions
            .get(kernel.entry_name().as_str())
            .ok_or(Error::Driver {
                name: "CUDA_ERROR_NOT_FOUND".into(),
                during: "kernel lookup",
            })
    }

    /// Checks that a stream (or a buffer's stream) belongs to this context.
    pub(crate) fn check_context(&self, what: &'static str, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.cuda {
            return Err(Error::WrongContext { what });
        }
        Ok(())
    }
}

/// Launches on one stream of a [`Context`].
pub(crate) struct Gpu<'a> {
    pub ctx: &'a Context,
    pub stream: &'a CudaStream,
}

/// A `#[repr(C)]` parameter block passed by value as the kernel's single argument.
#[repr(transparent)]
struct Params<P>(P);
// SAFETY: every parameter struct is `#[repr(C)]`, `Copy`, and holds only integers and floats.
unsafe impl<P: Copy> DeviceRepr for Params<P> {}

impl Executor for Gpu<'_> {
    fn max_threads(&self, kernel: &Kernel) -> Result<usize> {
        let f = self.ctx.function(kernel)?;
        let n = f
            .get_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
            .map_err(Error::driver("cuFuncGetAttribute"))?;
        Ok(n as usize)
    }

    fn resident_blocks(&self, kernel: &Kernel, block: usize, shared_bytes: usize) -> Result<usize> {
        let f = self.ctx.function(kernel)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(block as u32, shared_bytes, None)
            .map_err(Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        Ok(per_sm as usize * self.ctx.sm_count)
    }

    fn resident_clusters(
        &self,
        kernel: &Kernel,
        block: usize,
        cluster: usize,
        shared_bytes: usize,
    ) -> Result<usize> {
        let f = self.ctx.function(kernel)?;
        let mut attribute = cluster_attribute(cluster);
        let config = launch_config(
            Shape {
                grid: cluster,
                block,
                cluster,
                shared_bytes,
            },
            self.stream,
            &mut attribute,
        );
        let mut clusters: std::ffi::c_int = 0;
        // SAFETY: a live function of this context and a config whose one attribute outlives the call.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, f.cu_function(), &config) }
            .result()
            .map_err(Error::driver("cuOccupancyMaxActiveClusters"))?;
        Ok(clusters.max(0) as usize)
    }

    fn shared_opt_in(&self) -> usize {
        self.ctx.shared_opt_in
    }

    fn max_cluster(&self) -> usize {
        // The portable limit of sm_90; its PTX has the cluster instances.
        if self.ctx.ptx_arch >= 90 { 8 } else { 1 }
    }

    fn sm_count(&self) -> usize {
        self.ctx.sm_count
    }

    fn grid_limit(&self) -> Option<usize> {
        self.ctx.grid_limit
    }

    fn launch(&self, kernel: &Kernel, shape: Shape) -> Result<()> {
        let f = self.ctx.function(kernel)?;
        match kernel {
            Kernel::NormForward(_, _, p) => launch_one(f, self.stream, shape, *p),
            Kernel::NormBackward(_, _, p) => launch_one(f, self.stream, shape, *p),
            Kernel::ColumnSum(_, p) => launch_one(f, self.stream, shape, *p),
            Kernel::Activation(_, _, p) => launch_one(f, self.stream, shape, *p),
        }
    }
}

/// The launch attribute that makes `blocks` consecutive blocks one cluster.
fn cluster_attribute(blocks: usize) -> sys::CUlaunchAttribute {
    // SAFETY: an all-zero attribute is a valid (ignored) one; its value is set below.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attribute.value.clusterDim.x = blocks as u32;
    attribute.value.clusterDim.y = 1;
    attribute.value.clusterDim.z = 1;
    attribute
}

/// The driver's description of a clustered launch on `stream`, pointing at `attribute`.
fn launch_config(
    shape: Shape,
    stream: &CudaStream,
    attribute: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: shape.grid as u32,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: shape.block as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shape.shared_bytes as u32,
        hStream: stream.cu_stream(),
        attrs: attribute,
        numAttrs: 1,
    }
}

fn launch_one<P: Copy>(
    f: &CudaFunction,
    stream: &CudaStream,
    shape: Shape,
    params: P,
) -> Result<()> {
    let params = Params(params);
    if shape.cluster > 1 {
        // cudarc's launch builder has no cluster dimension: the driver call is made here, as the
        // builder would make it (the buffers' stream ordering is already held by the op's guards).
        stream
            .context()
            .bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        let mut attribute = cluster_attribute(shape.cluster);
        let config = launch_config(shape, stream, &mut attribute);
        let mut args = [&params as *const Params<P> as *mut std::ffi::c_void];
        // SAFETY: the op that built the parameters validated every buffer against them; the one
        // kernel argument is the parameter block, passed by value as the entry declares it.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(Error::driver("cuLaunchKernelEx"))?;
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (shape.grid as u32, 1, 1),
        block_dim: (shape.block as u32, 1, 1),
        shared_mem_bytes: shape.shared_bytes as u32,
    };
    let mut builder = stream.launch_builder(f);
    builder.arg(&params);
    // SAFETY: the op that built the parameters validated every buffer against them.
    unsafe { builder.launch(cfg) }.map_err(Error::driver("cuLaunchKernel"))?;
    Ok(())
}
