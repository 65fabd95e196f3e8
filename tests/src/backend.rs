//! Tests written once for both executors: a [`Backend`] makes buffers, views of them and copies
//! back, in host memory for the [`Emulator`] ([`Host`]) or on the GPU ([`Device`]).

use std::marker::PhantomData;
use std::sync::Arc;

use normkern::cudarc::driver::{CudaSlice, CudaStream};
use normkern::{Context, Emulator, Executor, Gpu};

use crate::TestDtype;

/// Where a test runs its ops: buffers, views and copies for one executor.
pub trait Backend {
    type Exec: Executor;
    type Buf<T: TestDtype>;
    /// `"emulator"` or `"gpu"`, for messages.
    fn name(&self) -> &'static str;
    fn exec(&self) -> &Self::Exec;
    /// A buffer holding `data` (16-byte aligned).
    fn upload<T: TestDtype>(&self, data: &[T]) -> Self::Buf<T>;
    /// The buffer's contents, after every launch so far has finished.
    fn download<T: TestDtype>(&self, buf: &Self::Buf<T>) -> Vec<T>;
    /// The buffer from element `offset` on, as an input.
    fn input<T: TestDtype>(
        buf: &Self::Buf<T>,
        offset: usize,
    ) -> <Self::Exec as Executor>::In<'_, T>;
    /// The buffer from element `offset` on, as an output.
    fn output<T: TestDtype>(
        buf: &mut Self::Buf<T>,
        offset: usize,
    ) -> <Self::Exec as Executor>::Out<'_, T>;
}

/// The CPU emulator over host memory.
pub struct Host(pub Emulator);

/// A host buffer whose storage is 16-byte aligned, as device allocations are, so the kernels'
/// 16-byte accesses serve it (an offset of one element breaks that on purpose).
pub struct HostBuf<T> {
    words: Vec<[u64; 2]>,
    len: usize,
    element: PhantomData<T>,
}

impl<T: TestDtype> HostBuf<T> {
    fn new(data: &[T]) -> Self {
        let bytes = std::mem::size_of_val(data);
        let mut buf = HostBuf {
            words: vec![[0; 2]; bytes.div_ceil(16).max(1)],
            len: data.len(),
            element: PhantomData,
        };
        buf.as_mut_slice().copy_from_slice(data);
        buf
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the words hold `len` elements of a plain floating-point dtype (any bits valid),
        // and their alignment (8) is at least the dtype's.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as for `as_slice`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

impl Backend for Host {
    type Exec = Emulator;
    type Buf<T: TestDtype> = HostBuf<T>;

    fn name(&self) -> &'static str {
        "emulator"
    }
    fn exec(&self) -> &Emulator {
        &self.0
    }
    fn upload<T: TestDtype>(&self, data: &[T]) -> HostBuf<T> {
        HostBuf::new(data)
    }
    fn download<T: TestDtype>(&self, buf: &HostBuf<T>) -> Vec<T> {
        buf.as_slice().to_vec()
    }
    fn input<T: TestDtype>(buf: &HostBuf<T>, offset: usize) -> &[T] {
        &buf.as_slice()[offset..]
    }
    fn output<T: TestDtype>(buf: &mut HostBuf<T>, offset: usize) -> &mut [T] {
        &mut buf.as_mut_slice()[offset..]
    }
}

/// The GPU: a context on one stream.
pub struct Device<'a> {
    gpu: Gpu<'a>,
    stream: &'a Arc<CudaStream>,
}

impl<'a> Device<'a> {
    /// The test process's shared GPU, or `None` (with the reason printed) when there is none.
    pub fn shared() -> Option<Device<'static>> {
        let (ctx, stream) = crate::gpu()?;
        Some(Device::new(ctx, stream))
    }

    /// `ctx` on `stream`.
    pub fn new(ctx: &'a Context, stream: &'a Arc<CudaStream>) -> Self {
        let gpu = ctx.on(stream).expect("the stream belongs to the context");
        Device { gpu, stream }
    }

    pub fn stream(&self) -> &'a Arc<CudaStream> {
        self.stream
    }
}

impl<'s> Backend for Device<'s> {
    type Exec = Gpu<'s>;
    type Buf<T: TestDtype> = CudaSlice<T>;

    fn name(&self) -> &'static str {
        "gpu"
    }
    fn exec(&self) -> &Gpu<'s> {
        &self.gpu
    }
    fn upload<T: TestDtype>(&self, data: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(data).expect("upload")
    }
    fn download<T: TestDtype>(&self, buf: &CudaSlice<T>) -> Vec<T> {
        self.stream.synchronize().expect("synchronize");
        self.stream.clone_dtoh(buf).expect("download")
    }
    fn input<T: TestDtype>(
        buf: &CudaSlice<T>,
        offset: usize,
    ) -> normkern::cudarc::driver::CudaView<'_, T> {
        buf.slice(offset..)
    }
    fn output<T: TestDtype>(
        buf: &mut CudaSlice<T>,
        offset: usize,
    ) -> normkern::cudarc::driver::CudaViewMut<'_, T> {
        buf.slice_mut(offset..)
    }
}
