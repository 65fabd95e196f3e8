//! The one error type of normkern.

/// Everything that can go wrong in normkern. Validation errors are returned before anything is
/// launched, so no output is touched by a call that fails.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
// Each variant's message says what its fields are.
#[allow(missing_docs)]
pub enum Error {
    /// The CUDA driver library (libcuda) could not be found on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The driver reported no CUDA device with this ordinal.
    #[error("no CUDA device {ordinal}: {reason}")]
    NoDevice { ordinal: usize, reason: String },
    /// The device's compute capability is older than the oldest embedded PTX (sm_80).
    #[error("compute capability {major}.{minor} is not supported (normkern needs sm_80 or newer)")]
    UnsupportedDevice { major: i32, minor: i32 },
    /// [`crate::Context::from_cuda_with_ptx_arch`] asked for an architecture normkern has no
    /// build of, or one newer than the device.
    #[error(
        "no kernels built for sm_{arch} that a device of compute capability {major}.{minor} runs (builds: sm_80, sm_90)"
    )]
    NoBuildForArch { arch: u32, major: i32, minor: i32 },
    /// A CUDA driver call failed; `name` is the driver's error name (e.g. `CUDA_ERROR_LAUNCH_FAILED`).
    #[error("CUDA driver error {name} during {during}")]
    Driver { name: String, during: &'static str },
    /// A kernel failed in the CPU emulator.
    #[error("{0}")]
    Emulator(String),
    /// The hidden size `d` must be at least 1.
    #[error("{what}: d must be at least 1")]
    EmptyRow { what: &'static str },
    /// A row stride smaller than the row.
    #[error("{what}: row stride {stride} is smaller than d = {d}")]
    StrideTooSmall {
        what: &'static str,
        stride: usize,
        d: usize,
    },
    /// A buffer too short for the shape it is viewed as, or of the wrong length.
    #[error("{what}: expected {expected} elements, got {actual}")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// Two operands whose shapes must agree do not.
    #[error("shape mismatch: {what} is {actual_rows}×{actual_d}, expected {rows}×{d}")]
    Shape {
        what: &'static str,
        rows: usize,
        d: usize,
        actual_rows: usize,
        actual_d: usize,
    },
    /// A size beyond what the kernels index (rows and d up to 2³² − 1, elements up to 2⁶³).
    #[error("{what}: {value} is larger than supported")]
    TooLarge { what: &'static str, value: usize },
    /// A view whose last element lies past the largest address: `(rows − 1) · stride + d`
    /// overflows.
    #[error(
        "rows view: (rows − 1) × stride + d overflows for {rows} rows of {d} elements, {stride} apart"
    )]
    ViewOverflow {
        rows: usize,
        d: usize,
        stride: usize,
    },
    /// eps must be finite and positive.
    #[error("eps must be finite and > 0, got {0}")]
    Eps(f32),
    /// A dtype combination the kernels do not implement.
    #[error("{what} in {dtype} with activations in {activations}: {supported}")]
    UnsupportedDtypes {
        what: &'static str,
        dtype: &'static str,
        activations: &'static str,
        supported: &'static str,
    },
    /// The weight offset must be finite.
    #[error("weight offset must be finite, got {0}")]
    WeightOffset(f32),
    /// A workspace smaller than the op needs (`rms_norm::workspace_len` and the like).
    #[error("workspace holds {actual} f32, the backward needs {needed}")]
    WorkspaceTooSmall { needed: usize, actual: usize },
    /// A buffer or stream belongs to another CUDA context than the normkern [`crate::Context`].
    #[error("{what} belongs to a different CUDA context")]
    WrongContext { what: &'static str },
    /// The stream is capturing a CUDA graph while cudarc orders buffers between streams with
    /// events (its default once a second stream exists): every buffer's event wait would break
    /// the capture, so nothing was enqueued. Turn cudarc's event tracking off while capturing
    /// (README, "CUDA graphs").
    #[error(
        "the stream is capturing a CUDA graph and cudarc's event tracking is on: waiting on a \
         buffer's event would invalidate the capture; turn event tracking off while capturing \
         (README, \"CUDA graphs\")"
    )]
    CaptureWithEventTracking,
    /// A grid limit of 0 blocks.
    #[error("grid limit must be at least 1 block")]
    ZeroGrid,
    /// An argument the operation does not take, or one it needs only together with another.
    #[error("{what}: {problem}")]
    Argument {
        what: &'static str,
        problem: &'static str,
    },
    /// The NCCL library (libnccl.so) could not be loaded (the `nccl` feature loads it at run
    /// time).
    #[error(
        "no NCCL: libnccl.so could not be loaded (install NCCL or point LD_LIBRARY_PATH at it)"
    )]
    NoNccl,
    /// An NCCL call failed; `name` is NCCL's result code.
    #[error("NCCL error {name} during {during}")]
    Nccl { name: String, during: &'static str },
    /// An invariant of normkern's own did not hold: a bug, please report it.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

#[cfg(feature = "nccl")]
impl Error {
    pub(crate) fn nccl(
        during: &'static str,
    ) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error {
        move |e| Error::Nccl {
            name: format!("{:?}", e.0),
            during,
        }
    }
}

/// normkern's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn driver(
        during: &'static str,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
        move |e| Error::Driver {
            name: e
                .error_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|_| format!("CUresult({})", e.0 as i32)),
            during,
        }
    }
}
