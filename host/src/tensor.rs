//! Storage dtypes and typed row views over device (or, for the emulator, host) buffers.

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr};
use normkern_gpu::kernel::Dtype as KernelDtype;

use crate::error::{Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A storage dtype normkern's kernels read and write: `f32`, `half::f16` or `half::bf16`.
/// All arithmetic is f32 whatever the storage.
pub trait Dtype: sealed::Sealed + DeviceRepr + Copy + Default + Send + Sync + 'static {
    #[doc(hidden)]
    const KERNEL: KernelDtype;
}
impl Dtype for f32 {
    const KERNEL: KernelDtype = KernelDtype::F32;
}
impl Dtype for half::f16 {
    const KERNEL: KernelDtype = KernelDtype::F16;
}
impl Dtype for half::bf16 {
    const KERNEL: KernelDtype = KernelDtype::Bf16;
}

/// Memory a [`Rows`] view can stand on: cudarc device views, or host slices for the emulator.
pub trait Buffer {
    /// The stored dtype.
    type Elem: Dtype;
    /// Elements available from the start of the view.
    fn elements(&self) -> usize;
}

impl<T: Dtype> Buffer for CudaView<'_, T> {
    type Elem = T;
    fn elements(&self) -> usize {
        self.len()
    }
}
impl<T: Dtype> Buffer for CudaViewMut<'_, T> {
    type Elem = T;
    fn elements(&self) -> usize {
        self.len()
    }
}
impl<T: Dtype> Buffer for &[T] {
    type Elem = T;
    fn elements(&self) -> usize {
        self.len()
    }
}
impl<T: Dtype> Buffer for &mut [T] {
    type Elem = T;
    fn elements(&self) -> usize {
        self.len()
    }
}

/// A `rows × d` matrix of rows laid `stride` elements apart in one buffer (stride ≥ d).
///
/// Built with [`Rows::new`] (dense) or [`Rows::with_stride`]; both check that the buffer is long
/// enough, so a view that exists is always in bounds.
#[derive(Debug)]
pub struct Rows<B> {
    pub(crate) data: B,
    pub(crate) rows: usize,
    pub(crate) d: usize,
    pub(crate) stride: usize,
}

/// Read-only rows on the device.
pub type RowsRef<'a, T> = Rows<CudaView<'a, T>>;
/// Writable rows on the device.
pub type RowsMut<'a, T> = Rows<CudaViewMut<'a, T>>;

impl<B: Buffer> Rows<B> {
    /// Dense rows: `stride == d`.
    pub fn new(data: B, rows: usize, d: usize) -> Result<Self> {
        Self::with_stride(data, rows, d, d)
    }

    /// Rows `stride` elements apart.
    pub fn with_stride(data: B, rows: usize, d: usize, stride: usize) -> Result<Self> {
        let what = "rows view";
        if d == 0 {
            return Err(Error::EmptyRow { what });
        }
        if stride < d {
            return Err(Error::StrideTooSmall { what, stride, d });
        }
        if rows > u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "rows",
                value: rows,
            });
        }
        if d > u32::MAX as usize {
            return Err(Error::TooLarge {
                what: "d",
                value: d,
            });
        }
        let needed = if rows == 0 {
            0
        } else {
            (rows.saturating_sub(1))
                .checked_mul(stride)
                .and_then(|n| n.checked_add(d))
                .ok_or(Error::ViewOverflow { rows, d, stride })?
        };
        if data.elements() < needed {
            return Err(Error::Length {
                what,
                expected: needed,
                actual: data.elements(),
            });
        }
        Ok(Rows {
            data,
            rows,
            d,
            stride,
        })
    }

    /// Rows in the view.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Elements per row.
    pub fn d(&self) -> usize {
        self.d
    }
    /// Elements from the start of one row to the start of the next.
    pub fn stride(&self) -> usize {
        self.stride
    }
    /// The underlying buffer.
    pub fn data(&self) -> &B {
        &self.data
    }
    /// Gives the buffer back.
    pub fn into_inner(self) -> B {
        self.data
    }

    pub(crate) fn expect_shape(&self, what: &'static str, rows: usize, d: usize) -> Result<()> {
        if self.rows != rows || self.d != d {
            return Err(Error::Shape {
                what,
                rows,
                d,
                actual_rows: self.rows,
                actual_d: self.d,
            });
        }
        Ok(())
    }
}

pub(crate) fn expect_len(what: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        return Err(Error::Length {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}
