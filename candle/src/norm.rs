//! [`RmsNorm`] and [`LayerNorm`] over the last dimension, forward and backward on normkern's
//! kernels. The forward saves nothing: the backward recomputes the statistics from x (which it
//! reads anyway) and returns dx, dγ and dβ from one normkern call.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Module, Result, Shape, Tensor};
use normkern::{Buffer, Executor, NormBackward, NormForward, Rows, layer_norm, rms_norm};

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaStorage;

use crate::exec::{self, Body, Elem, next};

/// Which norm, and whether LayerNorm has a β.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Rms,
    Layer { bias: bool },
}

/// The settings both directions share.
#[derive(Clone, Copy, Debug)]
struct Norm {
    kind: Kind,
    eps: f32,
    weight_offset: f32,
    /// The normalized (last) dimension.
    d: usize,
}

impl Norm {
    fn rows(&self, elements: usize) -> usize {
        elements / self.d.max(1)
    }

    fn apply(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let last = x.dims().last().copied().unwrap_or(1);
        if last != self.d || bias.is_some_and(|b| b.elem_count() != self.d) {
            candle_core::bail!(
                "normkern-candle: x {:?} is normalized over its last dimension, γ has {} elements \
                 and β {:?}",
                x.shape(),
                self.d,
                bias.map(Tensor::elem_count)
            );
        }
        let x = x.contiguous()?;
        let weight = weight.contiguous()?;
        match bias {
            Some(bias) => x.apply_op3(&weight, &bias.contiguous()?, Forward(*self)),
            None => x.apply_op2(&weight, Forward(*self)),
        }
    }

    /// dx, dγ and, for LayerNorm with β, dβ: one backward call, whose packed result is split here.
    fn gradients(&self, x: &Tensor, weight: &Tensor, dy: &Tensor) -> Result<Vec<Tensor>> {
        let n = x.elem_count();
        let packed = x.apply_op3_no_bwd(weight, &dy.contiguous()?, &Backward(*self))?;
        let mut grads = vec![packed.narrow(0, 0, n)?.reshape(x.shape())?];
        let params = if self.kind == (Kind::Layer { bias: true }) {
            2
        } else {
            1
        };
        for p in 0..params {
            grads.push(
                packed
                    .narrow(0, n + p * self.d, self.d)?
                    .reshape(weight.shape())?,
            );
        }
        Ok(grads)
    }

    fn gradient_lens(&self, elements: usize) -> Vec<usize> {
        let params = if self.kind == (Kind::Layer { bias: true }) {
            2
        } else {
            1
        };
        std::iter::once(elements)
            .chain(std::iter::repeat_n(self.d, params))
            .collect()
    }
}

/// The forward as a candle op: (x, γ) or (x, γ, β) → y.
struct Forward(Norm);

impl Body for Forward {
    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        _: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let Norm {
            kind,
            eps,
            weight_offset,
            d,
        } = self.0;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (x, weight, y) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut outputs)?);
        let rows = self.0.rows(x.elements());
        let args = NormForward::new(Rows::new(x, rows, d)?, weight, Rows::new(y, rows, d)?)
            .eps(eps)
            .weight_offset(weight_offset);
        match (kind, inputs.next()) {
            (Kind::Rms, _) => rms_norm::forward(exec, args),
            (Kind::Layer { .. }, Some(bias)) => layer_norm::forward(exec, args.bias(bias)),
            (Kind::Layer { .. }, None) => layer_norm::forward(exec, args),
        }
    }
}

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        "normkern-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = exec::cpu(self, &[(x, lx), (w, lw)], &[lx.shape().elem_count()])?;
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = exec::cuda(self, &[(x, lx), (w, lw)], &[lx.shape().elem_count()])?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.0.gradients(x, weight, dy)?.into_iter();
        Ok((grads.next(), grads.next()))
    }
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "normkern-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = exec::cpu(
            self,
            &[(x, lx), (w, lw), (b, lb)],
            &[lx.shape().elem_count()],
        )?;
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = exec::cuda(
            self,
            &[(x, lx), (w, lw), (b, lb)],
            &[lx.shape().elem_count()],
        )?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.0.gradients(x, weight, dy)?.into_iter();
        Ok((grads.next(), grads.next(), grads.next()))
    }
}

/// The backward as a candle op: (x, γ, dy) → dx, dγ (and dβ) packed in one 1-D tensor.
struct Backward(Norm);

impl Body for Backward {
    fn workspace_len(&self, elements: usize) -> normkern::Result<usize> {
        let (rows, d) = (self.0.rows(elements), self.0.d);
        match self.0.kind {
            Kind::Rms => rms_norm::workspace_len(rows, d),
            Kind::Layer { .. } => layer_norm::workspace_len(rows, d),
        }
    }

    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        workspace: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let Norm {
            kind,
            eps,
            weight_offset,
            d,
        } = self.0;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (x, weight, dy) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut inputs)?);
        let (dx, dweight) = (next(&mut outputs)?, next(&mut outputs)?);
        let rows = self.0.rows(x.elements());
        let args = NormBackward::new(
            Rows::new(dy, rows, d)?,
            Rows::new(x, rows, d)?,
            weight,
            Rows::new(dx, rows, d)?,
            dweight,
            workspace,
        )
        .eps(eps)
        .weight_offset(weight_offset);
        match (kind, outputs.next()) {
            (Kind::Rms, _) => rms_norm::backward(exec, args),
            (Kind::Layer { .. }, Some(dbias)) => layer_norm::backward(exec, args.dbias(dbias)),
            (Kind::Layer { .. }, None) => layer_norm::backward(exec, args),
        }
    }
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "normkern-norm-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let lens = self.0.gradient_lens(lx.shape().elem_count());
        let packed = exec::cpu(self, &[(x, lx), (w, lw), (dy, ldy)], &lens)?;
        Ok((packed, Shape::from(lens.iter().sum::<usize>())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let lens = self.0.gradient_lens(lx.shape().elem_count());
        let packed = exec::cuda(self, &[(x, lx), (w, lw), (dy, ldy)], &lens)?;
        Ok((packed, Shape::from(lens.iter().sum::<usize>())))
    }
}

/// RMSNorm over the last dimension: `y = x / sqrt(mean(x²) + eps) · (γ + offset)`.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    weight_offset: f32,
}

impl RmsNorm {
    /// γ is `[d]`, in x's dtype.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm {
            weight,
            eps: eps as f32,
            weight_offset: 0.0,
        }
    }

    /// Scales by `γ + offset` (Gemma's `1 + γ`); dγ is unchanged by it.
    pub fn with_weight_offset(mut self, offset: f32) -> Self {
        self.weight_offset = offset;
        self
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Normalizes `x` (`[..., d]`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let norm = Norm {
            kind: Kind::Rms,
            eps: self.eps,
            weight_offset: self.weight_offset,
            d: self.weight.elem_count(),
        };
        norm.apply(x, &self.weight, None)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
}

/// LayerNorm over the last dimension: `y = (x − mean) / sqrt(var + eps) · (γ + offset) + β`,
/// β optional.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    eps: f32,
    weight_offset: f32,
}

impl LayerNorm {
    /// γ and β are `[d]`, in x's dtype.
    pub fn new(weight: Tensor, bias: Option<Tensor>, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias,
            eps: eps as f32,
            weight_offset: 0.0,
        }
    }

    /// Scales by `γ + offset`; dγ is unchanged by it.
    pub fn with_weight_offset(mut self, offset: f32) -> Self {
        self.weight_offset = offset;
        self
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Normalizes `x` (`[..., d]`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let norm = Norm {
            kind: Kind::Layer {
                bias: self.bias.is_some(),
            },
            eps: self.eps,
            weight_offset: self.weight_offset,
            d: self.weight.elem_count(),
        };
        norm.apply(x, &self.weight, self.bias.as_ref())
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        LayerNorm::forward(self, x)
    }
}
