//! Where an op's storages live, once for every op: candle's CPU storage runs in normkern's
//! emulator, candle's CUDA storage on normkern's kernels on candle's stream. An op writes one
//! generic body over normkern's [`Executor`] ([`Body`]); [`run`] hands it the operands as the
//! executor's buffers and collects the output as candle storage.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape};
use normkern::{Dtype, Emulator, Executor};

/// The dtypes normkern and candle share.
pub trait Elem: Dtype + candle_core::WithDType {}
impl Elem for f32 {}
impl Elem for half::f16 {}
impl Elem for half::bf16 {}

/// One op's work on any executor: `inputs` in x's dtype `T`, outputs of the lengths the op asked
/// for (the pieces of one buffer, which becomes the op's result), and an f32 workspace.
pub trait Body {
    /// The lengths of the outputs, the consecutive pieces of the op's result, when its first
    /// input has `elements` elements. One output (the default) has the first input's shape;
    /// several make a 1-D result that the op's caller splits.
    fn out_lens(&self, elements: usize) -> Vec<usize> {
        vec![elements]
    }

    /// f32 workspace elements the op needs when its first input has `elements` elements.
    fn workspace_len(&self, _elements: usize) -> normkern::Result<usize> {
        Ok(0)
    }

    /// Per input, the element at which the adapters cut it in two (each half an input of its
    /// own), for operands candle hands over packed in one tensor.
    fn splits(&self, _elements: usize) -> Vec<Option<usize>> {
        Vec::new()
    }

    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        workspace: E::Out<'a, f32>,
    ) -> normkern::Result<()>;
}

/// The next operand a body expects (the op's arity fixes them; a missing one is a bug here).
pub fn next<B>(operands: &mut impl Iterator<Item = B>) -> normkern::Result<B> {
    operands.next().ok_or(normkern::Error::Internal(
        "normkern-candle: an operand is missing",
    ))
}

pub fn wrap(e: normkern::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The elements of a contiguous layout.
fn span(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("normkern-candle: operand is not contiguous".into()).bt()
    })
}

/// The result's shape: the first input's for one output, 1-D for several.
fn out_shape(first: &Layout, out_lens: &[usize]) -> Shape {
    match out_lens {
        [_] => first.shape().clone(),
        lens => Shape::from(lens.iter().sum::<usize>()),
    }
}

/// A custom op's forward on CPU storages: `body` in the emulator.
pub fn cpu_op<B: Body>(body: &B, inputs: &[(&CpuStorage, &Layout)]) -> Result<(CpuStorage, Shape)> {
    let first = inputs[0].1;
    let lens = body.out_lens(first.shape().elem_count());
    Ok((cpu(body, inputs, &lens)?, out_shape(first, &lens)))
}

/// Runs `body` in the emulator on CPU storages of one dtype; its outputs (`out_lens`) are the
/// consecutive pieces of the returned storage.
fn cpu<B: Body>(
    body: &B,
    inputs: &[(&CpuStorage, &Layout)],
    out_lens: &[usize],
) -> Result<CpuStorage> {
    fn typed<B: Body, T: Elem>(
        body: &B,
        inputs: &[(&CpuStorage, &Layout)],
        out_lens: &[usize],
    ) -> Result<CpuStorage> {
        let elements = inputs.first().map_or(0, |(_, l)| l.shape().elem_count());
        let splits = body.splits(elements);
        let mut views = Vec::with_capacity(inputs.len() + splits.len());
        for (i, (s, l)) in inputs.iter().enumerate() {
            let (start, end) = span(l)?;
            let view = &s.as_slice::<T>()?[start..end];
            match splits.get(i).copied().flatten() {
                Some(mid) if mid <= view.len() => {
                    let (a, b) = view.split_at(mid);
                    views.extend([a, b]);
                }
                _ => views.push(view),
            }
        }
        let mut out = vec![T::from_f64(0.0); out_lens.iter().sum()];
        let mut workspace = vec![0f32; body.workspace_len(elements).map_err(wrap)?];
        let mut pieces = Vec::with_capacity(out_lens.len());
        let mut rest = &mut out[..];
        for &len in out_lens {
            let (piece, tail) = rest.split_at_mut(len);
            pieces.push(piece);
            rest = tail;
        }
        body.run(&Emulator::new(), views, pieces, &mut workspace[..])
            .map_err(wrap)?;
        Ok(T::to_cpu_storage_owned(out))
    }
    let dtype = same_dtype(inputs.iter().map(|(s, _)| s.dtype()))?;
    match dtype {
        DType::F32 => typed::<B, f32>(body, inputs, out_lens),
        DType::F16 => typed::<B, half::f16>(body, inputs, out_lens),
        DType::BF16 => typed::<B, half::bf16>(body, inputs, out_lens),
        other => Err(unsupported(other)),
    }
}

fn same_dtype(mut dtypes: impl Iterator<Item = DType>) -> Result<DType> {
    let first = dtypes.next().unwrap_or(DType::F32);
    match dtypes.find(|d| *d != first) {
        None => Ok(first),
        Some(other) => Err(candle_core::Error::Msg(format!(
            "normkern-candle: operands in {first:?} and {other:?}; give γ and β x's dtype"
        ))
        .bt()),
    }
}

fn unsupported(dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "normkern-candle: {dtype:?} is not supported (f32, f16 and bf16 are)"
    ))
    .bt()
}

#[cfg(feature = "cuda")]
pub use cuda::cuda_op;

/// `cpu_fwd` and `cuda_fwd` of a candle custom op of 2 or 3 operands whose `self` is a [`Body`].
macro_rules! storage_forwards {
    ($($s:ident $l:ident),+) => {
        fn cpu_fwd(
            &self,
            $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            $crate::exec::cpu_op(self, &[$(($s, $l)),+])
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            $($s: &candle_core::cuda_backend::CudaStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, candle_core::Shape)> {
            $crate::exec::cuda_op(self, &[$(($s, $l)),+])
        }
    };
}
pub(crate) use storage_forwards;

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{DType, Layout, Result, Shape};
    use normkern::Context;

    use super::{Body, Elem, out_shape, same_dtype, span, unsupported, wrap};

    /// normkern's kernels, loaded once per CUDA context candle uses.
    fn context(cuda: &Arc<normkern::cudarc::driver::CudaContext>) -> Result<Arc<Context>> {
        static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<Context>>>> = OnceLock::new();
        let key = cuda.cu_ctx() as usize;
        let mut contexts = CONTEXTS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(ctx) = contexts.get(&key) {
            return Ok(ctx.clone());
        }
        let ctx = Arc::new(Context::from_cuda(cuda.clone()).map_err(wrap)?);
        contexts.insert(key, ctx.clone());
        Ok(ctx)
    }

    /// A custom op's forward on CUDA storages: `body` on candle's stream.
    pub fn cuda_op<B: Body>(
        body: &B,
        inputs: &[(&CudaStorage, &Layout)],
    ) -> Result<(CudaStorage, Shape)> {
        let first = inputs[0].1;
        let lens = body.out_lens(first.shape().elem_count());
        Ok((cuda(body, inputs, &lens)?, out_shape(first, &lens)))
    }

    /// Runs `body` on candle's stream over CUDA storages of one dtype; its outputs (`out_lens`,
    /// at most three) are the consecutive pieces of the returned storage.
    fn cuda<B: Body>(
        body: &B,
        inputs: &[(&CudaStorage, &Layout)],
        out_lens: &[usize],
    ) -> Result<CudaStorage> {
        fn typed<B: Body, T: Elem + CudaDType>(
            body: &B,
            inputs: &[(&CudaStorage, &Layout)],
            out_lens: &[usize],
        ) -> Result<CudaStorage> {
            let device = inputs[0].0.device.clone();
            let stream = device.cuda_stream();
            let ctx = context(stream.context())?;
            let gpu = ctx.on(&stream).map_err(wrap)?;
            let elements = inputs[0].1.shape().elem_count();
            let splits = body.splits(elements);
            let mut views = Vec::with_capacity(inputs.len() + splits.len());
            for (i, (s, l)) in inputs.iter().enumerate() {
                let (start, end) = span(l)?;
                let slice = s.as_cuda_slice::<T>()?;
                match splits.get(i).copied().flatten() {
                    Some(mid) if mid <= end - start => {
                        views.push(slice.slice(start..start + mid));
                        views.push(slice.slice(start + mid..end));
                    }
                    _ => views.push(slice.slice(start..end)),
                }
            }
            // SAFETY: normkern writes every element of its outputs (or fails before launching,
            // and then the buffer is dropped unread).
            let mut out = unsafe { device.alloc::<T>(out_lens.iter().sum())? };
            let ws_len = body.workspace_len(elements).map_err(wrap)?.max(1);
            let mut workspace = device.alloc_zeros::<f32>(ws_len)?;
            let ws = workspace.as_view_mut();
            match *out_lens {
                [_] => body.run(&gpu, views, vec![out.as_view_mut()], ws),
                [first, _] => {
                    let (p, q) = out.split_at_mut(first);
                    body.run(&gpu, views, vec![p, q], ws)
                }
                [first, second, _] => {
                    let (p, mut rest) = out.split_at_mut(first);
                    let (q, r) = rest.split_at_mut(second);
                    body.run(&gpu, views, vec![p, q, r], ws)
                }
                _ => Err(normkern::Error::Internal(
                    "normkern-candle: one to three outputs",
                )),
            }
            .map_err(wrap)?;
            Ok(CudaStorage::wrap_cuda_slice(out, device))
        }
        let dtype = same_dtype(inputs.iter().map(|(s, _)| s.dtype()))?;
        match dtype {
            DType::F32 => typed::<B, f32>(body, inputs, out_lens),
            DType::F16 => typed::<B, half::f16>(body, inputs, out_lens),
            DType::BF16 => typed::<B, half::bf16>(body, inputs, out_lens),
            other => Err(unsupported(other)),
        }
    }
}
