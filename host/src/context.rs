//! The GPU side: a CUDA context with normkern's kernels loaded ([`Context`]), and the executor
//! that launches them on one of the caller's streams ([`Gpu`]).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::{
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
};
use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nvrtc::Ptx;
use normkern_gpu::kernel::Entry;

use crate::error::{Error, Result};
use crate::executor::private::Sealed;
use crate::executor::{Device, Executor, Launch};
use crate::plan::{Memo, PORTABLE_CLUSTER, TileMemo};
use crate::tensor::Dtype;

/// The kernels for one target architecture, built by `cargo xtask build-ptx`: the PTX and the
/// cubin ptxas assembled from it.
struct Build {
    arch: u32,
    ptx: &'static str,
    cubin: &'static [u8],
}

/// One build per target architecture, newest first.
const BUILDS: [Build; 2] = [
    Build {
        arch: 90,
        ptx: include_str!("../ptx/normkern_sm90.ptx"),
        cubin: include_bytes!("../cubin/normkern_sm90.cubin"),
    },
    Build {
        arch: 80,
        ptx: include_str!("../ptx/normkern_sm80.ptx"),
        cubin: include_bytes!("../cubin/normkern_sm80.cubin"),
    },
];

/// What the driver loaded normkern's kernels from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelImage {
    /// Machine code assembled ahead of time (a device of the build's major architecture, e.g.
    /// sm_90 code on an H100/H200, sm_80 code on an A100 or an sm_86/sm_89 GPU): loads in
    /// milliseconds.
    Cubin,
    /// PTX, compiled by the driver at load time: the fallback for newer architectures and for
    /// drivers older than the ptxas that made the cubins. The first load on a machine takes
    /// seconds; the driver caches the result (`~/.nv/ComputeCache`) for later processes.
    Ptx,
}

/// A kernel as loaded: its function and what the driver says of it.
struct Loaded {
    function: CudaFunction,
    /// The most threads a block may have (its registers decide).
    max_threads: usize,
}

/// Occupancy questions the plans ask: (kernel id, block, cluster, shared bytes).
type OccupancyKey = (usize, usize, usize, usize);

/// A CUDA device with normkern's kernels loaded. Share it by reference; launches go to the
/// stream of a [`Gpu`] ([`Context::on`]), so one context serves any number of streams.
pub struct Context {
    cuda: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    /// Every kernel of the tables this PTX has, by kernel id (looked up on every launch).
    kernels: HashMap<usize, Loaded, foldhash::fast::FixedState>,
    ptx_arch: u32,
    kernel_image: KernelImage,
    /// The most blocks a cluster may have (`Device::max_cluster`).
    max_cluster: usize,
    sm_count: usize,
    /// Dynamic shared memory one block may opt into (bytes).
    shared_opt_in: usize,
    grid_limit: Option<usize>,
    /// Answers of the driver's occupancy calculator, asked once per distinct question.
    occupancy: Memo<OccupancyKey, usize>,
    /// Row tiles the launch plans chose.
    tiles: TileMemo,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.cuda.ordinal())
            .field("ptx_arch", &self.ptx_arch)
            .field("kernel_image", &self.kernel_image)
            .field("sm_count", &self.sm_count)
            .field("grid_limit", &self.grid_limit)
            .finish()
    }
}

impl Context {
    /// Opens device `ordinal` (its primary context) and loads the kernels for its architecture.
    /// No driver or no such device is an [`Error`], never a panic.
    ///
    /// ```no_run
    /// let ctx = normkern::Context::new(0)?;
    /// let stream = ctx.cuda().new_stream().unwrap();
    /// let gpu = ctx.on(&stream)?;
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn new(ordinal: usize) -> Result<Self> {
        // Loaded at run time, cudarc panics on the first driver call when libcuda is missing: ask
        // first. Linked (the `dynamic-linking` feature), the program does not start without it.
        #[cfg(not(feature = "dynamic-linking"))]
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
    /// Loads the cubin when the device runs it, else the PTX (see [`KernelImage`]).
    ///
    /// ```no_run
    /// use normkern::cudarc::driver::CudaContext;
    ///
    /// let cuda = CudaContext::new(0).unwrap(); // yours, shared with your other kernels
    /// let ctx = normkern::Context::from_cuda(cuda.clone())?;
    /// println!("kernels for sm_{} from {:?}", ctx.ptx_arch(), ctx.kernel_image());
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn from_cuda(cuda: Arc<CudaContext>) -> Result<Self> {
        Self::load(cuda, None, None)
    }

    /// Like [`Context::from_cuda`], loading the kernels from the given image only: `Ptx` makes
    /// the driver compile them (tests of the path newer GPUs take); `Cubin` fails with
    /// [`Error::UnsupportedDevice`] on a device whose major architecture has no cubin here.
    ///
    /// ```no_run
    /// use normkern::{Context, KernelImage, cudarc::driver::CudaContext};
    ///
    /// let ptx = Context::from_cuda_with_image(CudaContext::new(0).unwrap(), KernelImage::Ptx)?;
    /// assert_eq!(ptx.kernel_image(), KernelImage::Ptx);
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn from_cuda_with_image(cuda: Arc<CudaContext>, image: KernelImage) -> Result<Self> {
        Self::load(cuda, Some(image), None)
    }

    /// Like [`Context::from_cuda`], with the kernels built for an older architecture than the
    /// device's: `80` runs the sm_80 build (A100, and the sm_86/sm_89 GPUs) on an H100 or H200,
    /// compiled from its PTX by the driver, so that its code paths (no clusters, no bulk copies)
    /// can be tested where there is no such GPU. An architecture without a build here, or newer
    /// than the device, is [`Error::NoBuildForArch`].
    ///
    /// ```no_run
    /// use normkern::{Context, KernelImage, cudarc::driver::CudaContext};
    ///
    /// let a100_build = Context::from_cuda_with_ptx_arch(CudaContext::new(0).unwrap(), 80)?;
    /// assert_eq!((a100_build.ptx_arch(), a100_build.kernel_image()), (80, KernelImage::Ptx));
    /// # Ok::<(), normkern::Error>(())
    /// ```
    pub fn from_cuda_with_ptx_arch(cuda: Arc<CudaContext>, arch: u32) -> Result<Self> {
        Self::load(cuda, Some(KernelImage::Ptx), Some(arch))
    }

    /// Loads the build for `arch` (default: the newest the device runs) from `image` (default:
    /// the cubin where it runs, else the PTX).
    fn load(cuda: Arc<CudaContext>, image: Option<KernelImage>, arch: Option<u32>) -> Result<Self> {
        let (major, minor) = cuda
            .compute_capability()
            .map_err(Error::driver("cuDeviceGetAttribute"))?;
        let cc = (major.max(0) as u32)
            .saturating_mul(10)
            .saturating_add(minor.max(0) as u32);
        let build = BUILDS
            .iter()
            .find(|b| b.arch <= cc && arch.is_none_or(|a| a == b.arch))
            .ok_or(match arch {
                Some(arch) => Error::NoBuildForArch { arch, major, minor },
                None => Error::UnsupportedDevice { major, minor },
            })?;
        let ptx_arch = build.arch;
        // A cubin runs on devices of its major architecture at or above its minor one.
        let cubin_runs = build.arch / 10 == cc / 10;
        let load_ptx = || {
            cuda.load_module(Ptx::from_src(build.ptx))
                .map_err(Error::driver("cuModuleLoadData (PTX)"))
        };
        let load_cubin = || {
            cuda.load_module(Ptx::from_binary(build.cubin.to_vec()))
                .map_err(Error::driver("cuModuleLoadData (cubin)"))
        };
        let (module, kernel_image) = match image {
            Some(KernelImage::Ptx) => (load_ptx()?, KernelImage::Ptx),
            Some(KernelImage::Cubin) if cubin_runs => (load_cubin()?, KernelImage::Cubin),
            Some(KernelImage::Cubin) => return Err(Error::UnsupportedDevice { major, minor }),
            // A driver older than the cubins' ptxas rejects them; its JIT still takes the PTX.
            None if cubin_runs => match load_cubin() {
                Ok(module) => (module, KernelImage::Cubin),
                Err(_) => (load_ptx()?, KernelImage::Ptx),
            },
            None => (load_ptx()?, KernelImage::Ptx),
        };
        let attribute = |a| {
            cuda.attribute(a)
                .map_err(Error::driver("cuDeviceGetAttribute"))
        };
        let sm_count = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let shared_opt_in =
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let mut kernels = HashMap::default();
        let mut non_portable_clusters = true;
        for entry in normkern_gpu::kernels().filter(|e| e.min_arch <= ptx_arch) {
            let function = module
                .load_function(entry.name)
                .map_err(Error::driver("cuModuleGetFunction"))?;
            // Clusters of more than the portable 8 blocks (sm_90's GPCs take 16), where a plan
            // asks for them and the occupancy query finds them resident.
            if ptx_arch >= 90 && entry.min_arch >= 90 {
                non_portable_clusters &= function
                    .set_attribute(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                    .is_ok();
            }
            // Kernels whose shared memory grows with the block (the staged ring) may use what
            // the device offers; the plans keep their blocks within it.
            if entry.large_shared {
                function
                    .set_attribute(
                        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared_opt_in,
                    )
                    .map_err(Error::driver("cuFuncSetAttribute"))?;
            }
            let max_threads = function
                .get_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
                .map_err(Error::driver("cuFuncGetAttribute"))?;
            let loaded = Loaded {
                function,
                max_threads: max_threads.max(0) as usize,
            };
            kernels.insert(entry.id, loaded);
        }
        Ok(Context {
            cuda,
            _module: module,
            kernels,
            ptx_arch,
            kernel_image,
            max_cluster: match (ptx_arch >= 90, non_portable_clusters) {
                (false, _) => 1,
                (true, false) => PORTABLE_CLUSTER,
                (true, true) => normkern_gpu::arch::MAX_CLUSTER,
            },
            sm_count: sm_count.max(0) as usize,
            shared_opt_in: shared_opt_in.max(0) as usize,
            grid_limit: None,
            occupancy: Memo::default(),
            tiles: TileMemo::default(),
        })
    }

    /// Caps every persistent grid at `blocks` blocks (default: at most as many as the device keeps
    /// resident); a grid of clusters keeps at least one whole cluster (up to 16 blocks). Results
    /// do not depend on it; tests use it to prove that.
    pub fn with_grid_limit(mut self, blocks: usize) -> Result<Self> {
        if blocks == 0 {
            return Err(Error::ZeroGrid);
        }
        self.grid_limit = Some(blocks);
        Ok(self)
    }

    /// The executor that runs normkern's ops on `stream`, which must belong to this context.
    pub fn on<'a>(&'a self, stream: &'a CudaStream) -> Result<Gpu<'a>> {
        self.check_context("stream", stream)?;
        Ok(Gpu { ctx: self, stream })
    }

    /// The underlying cudarc context.
    pub fn cuda(&self) -> &Arc<CudaContext> {
        &self.cuda
    }

    /// The architecture of the PTX in use (90 for sm_90, 80 for sm_80).
    pub fn ptx_arch(&self) -> u32 {
        self.ptx_arch
    }

    /// Whether the kernels were loaded as machine code or compiled from PTX by the driver.
    pub fn kernel_image(&self) -> KernelImage {
        self.kernel_image
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn kernel(&self, kernel: Entry) -> Result<&Loaded> {
        self.kernels.get(&kernel.id).ok_or(Error::Internal(
            "a kernel the plan chose is not loaded (it is not in this architecture's PTX)",
        ))
    }

    /// Checks that a stream (or a buffer's stream) belongs to this context.
    fn check_context(&self, what: &'static str, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.cuda {
            return Err(Error::WrongContext { what });
        }
        Ok(())
    }
}

impl Device for Context {
    fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn max_cluster(&self) -> usize {
        self.max_cluster
    }

    fn overlaps_launches(&self) -> bool {
        self.ptx_arch >= OVERLAP_MIN_ARCH
    }

    fn shared_opt_in(&self) -> usize {
        self.shared_opt_in
    }

    fn grid_limit(&self) -> Option<usize> {
        self.grid_limit
    }

    fn max_threads(&self, kernel: Entry) -> Result<usize> {
        Ok(self.kernel(kernel)?.max_threads)
    }

    fn tile_memo(&self) -> Option<&TileMemo> {
        Some(&self.tiles)
    }

    fn resident_blocks(&self, kernel: Entry, block: usize, shared_bytes: usize) -> Result<usize> {
        let f = &self.kernel(kernel)?.function;
        self.occupancy
            .get_or((kernel.id, block, 1, shared_bytes), || {
                let per_sm = f
                    .occupancy_max_active_blocks_per_multiprocessor(
                        block as u32,
                        shared_bytes,
                        None,
                    )
                    .map_err(Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
                Ok((per_sm as usize).saturating_mul(self.sm_count))
            })
    }

    fn resident_clusters(
        &self,
        kernel: Entry,
        block: usize,
        cluster: usize,
        shared_bytes: usize,
    ) -> Result<usize> {
        let f = &self.kernel(kernel)?.function;
        self.occupancy
            .get_or((kernel.id, block, cluster, shared_bytes), || {
                let mut attribute = cluster_attribute(cluster);
                let shape = (cluster, block, shared_bytes);
                let config = launch_config(
                    shape,
                    std::ptr::null_mut(),
                    std::slice::from_mut(&mut attribute),
                );
                let mut clusters: std::ffi::c_int = 0;
                // SAFETY: a live function of this context and a config whose one attribute outlives
                // the call.
                unsafe {
                    sys::cuOccupancyMaxActiveClusters(&mut clusters, f.cu_function(), &config)
                }
                .result()
                .map_err(Error::driver("cuOccupancyMaxActiveClusters"))?;
                Ok(clusters.max(0) as usize)
            })
    }
}

/// Runs normkern's ops on one stream of a [`Context`]: made by [`Context::on`].
#[derive(Clone, Copy, Debug)]
pub struct Gpu<'a> {
    ctx: &'a Context,
    stream: &'a CudaStream,
}

impl Gpu<'_> {
    /// The context.
    pub fn context(&self) -> &Context {
        self.ctx
    }

    /// The stream launches go to.
    pub fn stream(&self) -> &CudaStream {
        self.stream
    }
}

impl Sealed for Gpu<'_> {}

impl<'s> Executor for Gpu<'s> {
    type In<'a, T: Dtype> = CudaView<'a, T>;
    type Out<'a, T: Dtype> = CudaViewMut<'a, T>;
    type Guard<'g>
        = SyncOnDrop<'g>
    where
        Self: 'g;

    fn prepare(&self) -> Result<()> {
        // Only with event tracking do the operands' guards wait on events, which a capture may
        // not do; without it this costs two atomic loads and no driver call.
        if self.ctx.cuda.is_managing_stream_synchronization() {
            let status = self
                .stream
                .capture_status()
                .map_err(Error::driver("cuStreamIsCapturing"))?;
            if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::CaptureWithEventTracking);
            }
        }
        Ok(())
    }

    fn input<'g, T: Dtype>(
        &'g self,
        what: &'static str,
        buffer: &'g CudaView<'_, T>,
    ) -> Result<(u64, SyncOnDrop<'g>)> {
        self.ctx.check_context(what, buffer.stream())?;
        Ok(buffer.device_ptr(self.stream))
    }

    fn output<'g, T: Dtype>(
        &'g self,
        what: &'static str,
        buffer: &'g mut CudaViewMut<'_, T>,
    ) -> Result<(u64, SyncOnDrop<'g>)> {
        self.ctx.check_context(what, buffer.stream())?;
        Ok(buffer.device_ptr_mut(self.stream))
    }

    fn device(&self) -> &dyn Device {
        self.ctx
    }

    fn zero(&self, address: u64, words: usize) -> Result<()> {
        // SAFETY: the call validated the operand these words lie in; the stream is this one.
        unsafe { sys::cuMemsetD32Async(address, 0, words, self.stream.cu_stream()) }
            .result()
            .map_err(Error::driver("cuMemsetD32Async"))
    }

    fn launch<K: Sync, P: Copy + Sync>(&self, launch: &Launch<K, P>) -> Result<()> {
        let f = &self.ctx.kernel(launch.kernel.entry())?.function;
        // An error cudarc recorded while ordering the operands (an event wait or record) comes
        // out here, named for what failed.
        (self.ctx.cuda.check_err()).map_err(Error::driver("a buffer's event wait (cudarc)"))?;
        self.ctx
            .cuda
            .bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        // Each attribute only where it applies: clusters of more than one block, cooperative
        // launches, and overlapping ones (planned only where the kernels wait themselves,
        // `Device::overlaps_launches`; checked again here, as sm_80's kernels must not overlap).
        let wanted = [
            (launch.cluster > 1).then(|| cluster_attribute(launch.cluster)),
            launch.cooperative.then(cooperative_attribute),
            (launch.overlaps_previous && self.ctx.overlaps_launches()).then(overlap_attribute),
        ];
        let mut attributes = [cluster_attribute(1); 3];
        let used = (attributes.iter_mut().zip(wanted.into_iter().flatten()))
            .map(|(slot, attribute)| *slot = attribute)
            .count();
        let shape = (launch.grid, launch.block, launch.shared_bytes);
        let config = launch_config(shape, self.stream.cu_stream(), &mut attributes[..used]);
        let mut params = launch.params;
        let mut args = [&mut params as *mut P as *mut std::ffi::c_void];
        // SAFETY: the op that planned the launch validated every buffer the parameters point to;
        // the one kernel argument is the parameter block, passed by value as the entry declares.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(Error::driver("cuLaunchKernelEx"))
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

/// The launch attribute that makes all blocks of a launch resident at once.
fn cooperative_attribute() -> sys::CUlaunchAttribute {
    // SAFETY: as in `cluster_attribute`.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attribute.value.cooperative = 1;
    attribute
}

/// The oldest build whose kernels wait for the launch they overlap (`griddepcontrol`, sm_90).
const OVERLAP_MIN_ARCH: u32 = 90;

/// The launch attribute that lets a launch start while the previous one on its stream runs its
/// last blocks (programmatic dependent launch); the kernel waits for that one before reading
/// what it wrote.
fn overlap_attribute() -> sys::CUlaunchAttribute {
    // SAFETY: as in `cluster_attribute`.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    attribute
}

/// The driver's description of a launch of `(grid, block, shared bytes)` on `stream`, with
/// `attributes` (a cluster dimension, cooperative).
fn launch_config(
    (grid, block, shared_bytes): (usize, usize, usize),
    stream: sys::CUstream,
    attributes: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid as u32,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block as u32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes as u32,
        hStream: stream,
        attrs: attributes.as_mut_ptr(),
        numAttrs: attributes.len() as u32,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{BUILDS, Build};

    /// The kernel tables and the committed PTX agree, without a GPU: every kernel a table
    /// declares for an architecture is an entry of its PTX (the context can load it), and every
    /// entry of the PTX is declared (nothing compiled goes unused). A stale PTX fails here too.
    #[test]
    fn every_table_kernel_is_in_the_ptx_and_every_ptx_entry_in_a_table() {
        for Build { arch, ptx, .. } in BUILDS {
            let entries: BTreeSet<&str> = ptx
                .lines()
                .filter_map(|l| l.strip_prefix(".visible .entry "))
                .map(|l| l.trim_end_matches('('))
                .collect();
            let declared: BTreeSet<&str> = normkern_gpu::kernels()
                .filter(|k| k.min_arch <= arch)
                .map(|k| k.name)
                .collect();
            let missing: Vec<_> = declared.difference(&entries).collect();
            let undeclared: Vec<_> = entries.difference(&declared).collect();
            assert!(missing.is_empty(), "sm_{arch}: not in the PTX: {missing:?}");
            assert!(
                undeclared.is_empty(),
                "sm_{arch}: in no table: {undeclared:?}"
            );
        }
    }

    /// The cubins are ELF images with a code section per table kernel of their architecture
    /// (that they are assembled from today's PTX, byte for byte, is `cargo xtask build-ptx
    /// --check`'s job in CI).
    #[test]
    fn every_table_kernel_has_code_in_the_cubin() {
        for Build { arch, cubin, .. } in BUILDS {
            assert_eq!(&cubin[..4], b"\x7fELF", "sm_{arch}: not an ELF image");
            // Section names are NUL-terminated strings of the ELF string table.
            let sections: BTreeSet<&[u8]> = cubin
                .split(|&b| b == 0)
                .filter_map(|s| s.strip_prefix(b".text."))
                .collect();
            let missing: Vec<&str> = normkern_gpu::kernels()
                .filter(|k| k.min_arch <= arch && !sections.contains(k.name.as_bytes()))
                .map(|k| k.name)
                .collect();
            assert!(
                missing.is_empty(),
                "sm_{arch}: no code in the cubin for {missing:?}"
            );
        }
    }

    /// Names and identities are unique, so the context's map holds every kernel once.
    #[test]
    fn kernel_names_and_ids_are_unique() {
        let all: Vec<_> = normkern_gpu::kernels().collect();
        let names: BTreeSet<_> = all.iter().map(|k| k.name).collect();
        let ids: BTreeSet<_> = all.iter().map(|k| k.id).collect();
        assert_eq!(names.len(), all.len());
        assert_eq!(ids.len(), all.len());
    }

    /// Keys are unique within each table, so a plan's lookup names one kernel.
    #[test]
    fn keys_are_unique_within_each_table() {
        fn unique<K, P>(table: &normkern_gpu::kernel::Table<K, P>)
        where
            K: Clone + Eq + std::hash::Hash + std::fmt::Debug,
        {
            let keys: Vec<&K> = table.iter().map(|k| &k.key).collect();
            for (i, k) in keys.iter().enumerate() {
                assert!(!keys[..i].contains(k), "{k:?} twice");
            }
        }
        unique(&normkern_gpu::norm::FORWARD);
        unique(&normkern_gpu::norm::BACKWARD);
        unique(&normkern_gpu::activation::KERNELS);
        unique(&normkern_gpu::column_sum::KERNELS);
    }
}
