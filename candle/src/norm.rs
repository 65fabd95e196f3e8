//! [`RmsNorm`] and [`LayerNorm`] over the last dimension, forward and backward on normkern's
//! kernels. The forward saves nothing: the backward recomputes the statistics from x (which it
//! reads anyway) and returns dx, dγ and dβ from one normkern call.

use candle_core::{CustomOp2, CustomOp3, Module, Result, Tensor};
use normkern::{Buffer, Executor, NormBackward, NormForward, Rows, layer_norm, rms_norm};

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

    /// normkern's forward of this norm, with β when there is one.
    fn forward<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        args: NormForward<'a, E, T>,
        bias: Option<E::In<'a, T>>,
    ) -> normkern::Result<()> {
        let args = args.eps(self.eps).weight_offset(self.weight_offset);
        match (self.kind, bias) {
            (Kind::Rms, _) => rms_norm::forward(exec, args),
            (Kind::Layer { .. }, Some(bias)) => layer_norm::forward(exec, args.bias(bias)),
            (Kind::Layer { .. }, None) => layer_norm::forward(exec, args),
        }
    }

    /// normkern's backward of this norm, with dβ when there is β.
    fn backward<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        args: NormBackward<'a, E, T>,
        dbias: Option<E::Out<'a, T>>,
    ) -> normkern::Result<()> {
        let args = args.eps(self.eps).weight_offset(self.weight_offset);
        match (self.kind, dbias) {
            (Kind::Rms, _) => rms_norm::backward(exec, args),
            (Kind::Layer { .. }, Some(dbias)) => layer_norm::backward(exec, args.dbias(dbias)),
            (Kind::Layer { .. }, None) => layer_norm::backward(exec, args),
        }
    }

    fn apply(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.check(x, bias)?;
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

    /// γ, or γ and β concatenated: the residual ops take the parameters as one operand (candle's
    /// custom ops have at most three), and the concatenation's backward splits dγ and dβ again.
    fn params(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        match bias {
            Some(bias) => Tensor::cat(&[weight.flatten_all()?, bias.flatten_all()?], 0),
            None => weight.flatten_all(),
        }
    }

    /// `h = x + residual`, then the norm of h: returns (y, h).
    fn apply_residual(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        if x.shape() != residual.shape() {
            candle_core::bail!(
                "normkern-candle: x {:?} and residual {:?} differ in shape",
                x.shape(),
                residual.shape()
            );
        }
        self.check(x, bias)?;
        let n = x.elem_count();
        let packed = x.contiguous()?.apply_op3(
            &residual.contiguous()?,
            &self.params(weight, bias)?,
            ResidualForward(*self),
        )?;
        let y = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let h = packed.narrow(0, n, n)?.reshape(x.shape())?;
        Ok((y, h))
    }

    fn check(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<()> {
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
        Ok(())
    }

    /// The split of the residual ops' parameter operand into γ and β.
    fn params_split(&self) -> Option<usize> {
        (self.kind == (Kind::Layer { bias: true })).then_some(self.d)
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
        let d = self.0.d;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (x, weight, y) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut outputs)?);
        let rows = self.0.rows(x.elements());
        let args = NormForward::new(Rows::new(x, rows, d)?, weight, Rows::new(y, rows, d)?);
        self.0.forward(exec, args, inputs.next())
    }
}

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        "normkern-norm"
    }

    exec::storage_forwards!(x lx, w lw);

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

    exec::storage_forwards!(x lx, w lw, b lb);

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
    fn out_lens(&self, elements: usize) -> Vec<usize> {
        self.0.gradient_lens(elements)
    }

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
        let d = self.0.d;
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
        );
        self.0.backward(exec, args, outputs.next())
    }
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "normkern-norm-backward"
    }

    exec::storage_forwards!(x lx, w lw, dy ldy);
}

/// The residual forward as a candle op: (x, residual, γ‖β) → [y; h] packed in one 1-D tensor.
struct ResidualForward(Norm);

impl Body for ResidualForward {
    /// y and h.
    fn out_lens(&self, elements: usize) -> Vec<usize> {
        vec![elements, elements]
    }

    fn splits(&self, _elements: usize) -> Vec<Option<usize>> {
        vec![None, None, self.0.params_split()]
    }

    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        _: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let d = self.0.d;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (x, residual, weight) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut inputs)?);
        let (y, h) = (next(&mut outputs)?, next(&mut outputs)?);
        let rows = self.0.rows(x.elements());
        let args = NormForward::new(Rows::new(x, rows, d)?, weight, Rows::new(y, rows, d)?)
            .residual(Rows::new(residual, rows, d)?, Rows::new(h, rows, d)?);
        self.0.forward(exec, args, inputs.next())
    }
}

impl CustomOp3 for ResidualForward {
    fn name(&self) -> &'static str {
        "normkern-norm-residual"
    }

    exec::storage_forwards!(x lx, r lr, p lp);

    /// dy and dh arrive packed like y and h; h is the forward's own output. dx is the gradient
    /// of x and of the residual alike (h = x + residual).
    fn bwd(
        &self,
        x: &Tensor,
        _residual: &Tensor,
        params: &Tensor,
        packed: &Tensor,
        grads: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count();
        let h = packed.narrow(0, n, n)?;
        let out = h.apply_op3_no_bwd(params, &grads.contiguous()?, &ResidualBackward(self.0))?;
        let dx = out.narrow(0, 0, n)?.reshape(x.shape())?;
        let dparams = out
            .narrow(0, n, params.elem_count())?
            .reshape(params.shape())?;
        Ok((Some(dx.clone()), Some(dx), Some(dparams)))
    }
}

/// The residual backward as a candle op: (h, γ‖β, [dy; dh]) → [dx; dγ; dβ] in one 1-D tensor.
struct ResidualBackward(Norm);

impl Body for ResidualBackward {
    fn out_lens(&self, elements: usize) -> Vec<usize> {
        self.0.gradient_lens(elements)
    }

    fn splits(&self, elements: usize) -> Vec<Option<usize>> {
        // The gradients arrive as dy, then dh, each as long as h.
        vec![None, self.0.params_split(), Some(elements)]
    }

    fn workspace_len(&self, elements: usize) -> normkern::Result<usize> {
        Backward(self.0).workspace_len(elements)
    }

    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        workspace: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let d = self.0.d;
        // [h, γ, (β), dy, dh]: the backward needs no β, only its gradient.
        let mut inputs = inputs;
        let missing = || normkern::Error::Internal("normkern-candle: a gradient is missing");
        let dh = inputs.pop().ok_or_else(missing)?;
        let dy = inputs.pop().ok_or_else(missing)?;
        let mut inputs = inputs.into_iter();
        let (h, weight) = (next(&mut inputs)?, next(&mut inputs)?);
        let mut outputs = outputs.into_iter();
        let (dx, dweight) = (next(&mut outputs)?, next(&mut outputs)?);
        let rows = self.0.rows(h.elements());
        let args = NormBackward::new(
            Rows::new(dy, rows, d)?,
            Rows::new(h, rows, d)?,
            weight,
            Rows::new(dx, rows, d)?,
            dweight,
            workspace,
        )
        .dresidual(Rows::new(dh, rows, d)?);
        self.0.backward(exec, args, outputs.next())
    }
}

impl CustomOp3 for ResidualBackward {
    fn name(&self) -> &'static str {
        "normkern-norm-residual-backward"
    }

    exec::storage_forwards!(h lh, p lp, g lg);
}

/// RMSNorm over the last dimension: `y = x / sqrt(mean(x²) + eps) · (γ + offset)`.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use normkern_candle::RmsNorm;
///
/// let norm = RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6);
/// let x = Tensor::new(&[[2f32, -2.0, 2.0, -2.0]], &Device::Cpu)?;
/// let y = norm.forward(&x)?.to_vec2::<f32>()?;
/// assert!((y[0][0] - 1.0).abs() < 1e-5 && (y[0][1] + 1.0).abs() < 1e-5);
///
/// // The pre-norm residual step: h = x + residual, y = RmsNorm(h).
/// let (y, h) = norm.forward_residual(&x, &x.ones_like()?)?;
/// assert_eq!(h.to_vec2::<f32>()?, [[3.0, -1.0, 3.0, -1.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
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
        self.norm().apply(x, &self.weight, None)
    }
}

impl RmsNorm {
    /// The pre-norm residual step fused: `h = x + residual` (rounded to x's dtype), then
    /// `y = RmsNorm(h)`; returns `(y, h)`. Gradients reach x and residual (the same dx, as
    /// h = x + residual) and γ.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        self.norm().apply_residual(x, residual, &self.weight, None)
    }

    fn norm(&self) -> Norm {
        Norm {
            kind: Kind::Rms,
            eps: self.eps,
            weight_offset: self.weight_offset,
            d: self.weight.elem_count(),
        }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
}

/// LayerNorm over the last dimension: `y = (x − mean) / sqrt(var + eps) · (γ + offset) + β`,
/// β optional.
///
/// ```
/// use candle_core::{D, DType, Device, Tensor, Var};
/// use normkern_candle::LayerNorm;
///
/// let d = 8;
/// let gamma = Var::ones(d, DType::F32, &Device::Cpu)?;
/// let beta = Var::zeros(d, DType::F32, &Device::Cpu)?;
/// let norm = LayerNorm::new(gamma.as_tensor().clone(), Some(beta.as_tensor().clone()), 1e-5);
/// let x = Tensor::randn(3f32, 2.0, (16, d), &Device::Cpu)?;
/// let y = norm.forward(&x)?;
/// let mean = y.mean_keepdim(D::Minus1)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(mean < 1e-5);
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&beta).unwrap().dims(), &[d]);
/// # Ok::<(), candle_core::Error>(())
/// ```
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

impl LayerNorm {
    /// The pre-norm residual step fused: `h = x + residual` (rounded to x's dtype), then
    /// `y = LayerNorm(h)`; returns `(y, h)`. Gradients reach x and residual (the same dx) and γ, β.
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        self.norm()
            .apply_residual(x, residual, &self.weight, self.bias.as_ref())
    }

    fn norm(&self) -> Norm {
        Norm {
            kind: Kind::Layer {
                bias: self.bias.is_some(),
            },
            eps: self.eps,
            weight_offset: self.weight_offset,
            d: self.weight.elem_count(),
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        LayerNorm::forward(self, x)
    }
}
