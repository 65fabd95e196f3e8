//! Gated activations `h = f(a) · b` ([`SwiGlu`]: f = SiLU; [`GeGlu`]: f = GELU), forward and
//! backward on normkern's kernels (the backward gives da and db in one pass, f recomputed from a).

use candle_core::{CustomOp2, CustomOp3, Result, Tensor};
use normkern::activation::{self, Activation, GatedBackward, GatedForward, GatedGrad, GatedInput};
use normkern::{Buffer, Executor, Rows};

use crate::exec::{self, Body, Elem, next};

/// A gated activation over rows of the last dimension.
#[derive(Clone, Copy, Debug)]
struct Gated {
    activation: Activation,
    d: usize,
}

impl Gated {
    fn apply(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if a.shape() != b.shape() {
            candle_core::bail!(
                "normkern-candle: gated activation of a {:?} and b {:?}: same shape needed",
                a.shape(),
                b.shape()
            );
        }
        let gated = Gated {
            d: a.dims().last().copied().unwrap_or(1),
            ..*self
        };
        a.contiguous()?.apply_op2(&b.contiguous()?, GatedOp(gated))
    }

    fn rows(&self, elements: usize) -> usize {
        elements / self.d.max(1)
    }
}

/// The forward as a candle op: (a, b) → h.
struct GatedOp(Gated);

impl Body for GatedOp {
    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        _: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let Gated { activation, d } = self.0;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (a, b, h) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut outputs)?);
        let rows = self.0.rows(a.elements());
        activation::gated_forward(
            exec,
            GatedForward {
                activation,
                input: GatedInput::Separate {
                    a: Rows::new(a, rows, d)?,
                    b: Rows::new(b, rows, d)?,
                },
                h: Rows::new(h, rows, d)?,
            },
        )
    }
}

impl CustomOp2 for GatedOp {
    fn name(&self) -> &'static str {
        "normkern-gated"
    }

    exec::storage_forwards!(a la, b lb);

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _h: &Tensor,
        dh: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = a.elem_count();
        let packed = a.apply_op3_no_bwd(b, &dh.contiguous()?, &GatedBackwardOp(self.0))?;
        let da = packed.narrow(0, 0, n)?.reshape(a.shape())?;
        let db = packed.narrow(0, n, n)?.reshape(b.shape())?;
        Ok((Some(da), Some(db)))
    }
}

/// The backward as a candle op: (a, b, dh) → da and db packed in one 1-D tensor.
struct GatedBackwardOp(Gated);

impl Body for GatedBackwardOp {
    /// da and db.
    fn out_lens(&self, elements: usize) -> Vec<usize> {
        vec![elements, elements]
    }

    fn run<'a, E: Executor, T: Elem>(
        &self,
        exec: &E,
        inputs: Vec<E::In<'a, T>>,
        outputs: Vec<E::Out<'a, T>>,
        _: E::Out<'a, f32>,
    ) -> normkern::Result<()> {
        let Gated { activation, d } = self.0;
        let (mut inputs, mut outputs) = (inputs.into_iter(), outputs.into_iter());
        let (a, b, dh) = (next(&mut inputs)?, next(&mut inputs)?, next(&mut inputs)?);
        let (da, db) = (next(&mut outputs)?, next(&mut outputs)?);
        let rows = self.0.rows(a.elements());
        activation::gated_backward(
            exec,
            GatedBackward {
                activation,
                dh: Rows::new(dh, rows, d)?,
                input: GatedInput::Separate {
                    a: Rows::new(a, rows, d)?,
                    b: Rows::new(b, rows, d)?,
                },
                grad: GatedGrad::Separate {
                    da: Rows::new(da, rows, d)?,
                    db: Rows::new(db, rows, d)?,
                },
            },
        )
    }
}

impl CustomOp3 for GatedBackwardOp {
    fn name(&self) -> &'static str {
        "normkern-gated-backward"
    }

    exec::storage_forwards!(a la, b lb, dh ldh);
}

/// SwiGLU: `h = silu(a) · b`, gradients to a and b.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use normkern_candle::{GeGlu, SwiGlu};
///
/// let a = Tensor::new(&[[0f32, 1.0]], &Device::Cpu)?;
/// let b = Tensor::new(&[[3f32, 4.0]], &Device::Cpu)?;
/// let h = SwiGlu.forward(&a, &b)?.to_vec2::<f32>()?;
/// assert!(h[0][0] == 0.0 && (h[0][1] - 4.0 * 0.7310586).abs() < 1e-5);
/// let h = GeGlu::erf().forward(&a, &b)?.to_vec2::<f32>()?;
/// assert!((h[0][1] - 4.0 * 0.8413447).abs() < 1e-5);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SwiGlu;

impl SwiGlu {
    /// `a` and `b` of one shape `[..., d]`.
    pub fn forward(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Gated {
            activation: Activation::Silu,
            d: 0,
        }
        .apply(a, b)
    }
}

/// GeGLU: `h = gelu(a) · b`, with GELU's erf form or its tanh approximation.
#[derive(Clone, Copy, Debug)]
pub struct GeGlu {
    activation: Activation,
}

impl GeGlu {
    /// GELU as `x·Φ(x)` (erf), PyTorch's `approximate='none'`.
    pub fn erf() -> Self {
        GeGlu {
            activation: Activation::GeluErf,
        }
    }

    /// GELU's tanh approximation, PyTorch's `approximate='tanh'`.
    pub fn tanh() -> Self {
        GeGlu {
            activation: Activation::GeluTanh,
        }
    }

    /// `a` and `b` of one shape `[..., d]`.
    pub fn forward(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Gated {
            activation: self.activation,
            d: 0,
        }
        .apply(a, b)
    }
}
