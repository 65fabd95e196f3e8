//! normkern-candle's modules against the same model built from candle's elementary tensor ops
//! (which have gradients): outputs and the gradients of every input through candle's
//! `backward()`, on the CPU (normkern's emulator) and, with the `cuda` feature and a GPU, on CUDA.
//! The loss weights each output by a random tensor, so dy is random too.

use candle_core::{D, DType, Device, Result, Tensor, Var};
use normkern_candle::{GeGlu, LayerNorm, RmsNorm, SwiGlu};

/// The devices to test on: the CPU always, the GPU when there is one (or say why not).
fn devices() -> Vec<Device> {
    #[allow(unused_mut)]
    let mut devices = vec![Device::Cpu];
    #[cfg(feature = "cuda")]
    match Device::new_cuda(0) {
        Ok(gpu) => devices.push(gpu),
        Err(e) if std::env::var_os("NORMKERN_REQUIRE_GPU").is_some() => {
            panic!("NORMKERN_REQUIRE_GPU is set and there is no GPU: {e}")
        }
        Err(e) => eprintln!("skipping the GPU: {e}"),
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("skipping the GPU: built without the `cuda` feature");
    devices
}

/// Largest |a − b| relative to the largest |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f32>()?.max(1e-12);
    Ok((a - &b)?.abs()?.max(0)?.to_scalar::<f32>()? / scale)
}

/// Tolerance of a comparison in `dtype` (the elementary model computes in f32 from the same
/// rounded inputs; the normkern output is rounded once to `dtype`, the reference is not).
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        _ => 2e-2,
    }
}

/// Compares `fused(inputs)` with `elementary(inputs in f32)`: the output and each input's
/// gradient under the loss Σ out · r.
fn check(
    what: &str,
    device: &Device,
    dtype: DType,
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    elementary: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?))
        .collect::<Result<_>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = fused(&tensors)?;
    let r = Tensor::randn(0f32, 1.0, out.shape(), device)?;
    let grads = (out.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;

    let ref_vars: Vec<Var> = tensors
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F32)?))
        .collect::<Result<_>>()?;
    let ref_tensors: Vec<Tensor> = ref_vars.iter().map(|v| v.as_tensor().clone()).collect();
    let ref_out = elementary(&ref_tensors)?;
    let ref_grads = (&ref_out * &r)?.sum_all()?.backward()?;

    let tol = tolerance(dtype);
    let label = format!("{what} {dtype:?} on {device:?}");
    let diff = rel_diff(&out, &ref_out)?;
    assert!(
        diff < tol,
        "{label}: output off by {diff:e} (tolerance {tol:e})"
    );
    for (i, (v, rv)) in vars.iter().zip(&ref_vars).enumerate() {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{label}: no gradient for input {i}"));
        assert_eq!(g.dtype(), dtype, "{label}: gradient {i}");
        let rg = ref_grads
            .get(rv.as_tensor())
            .expect("the reference has gradients");
        let diff = rel_diff(g, rg)?;
        // Gradients sum over rows (dγ, dβ) or mix a row's terms (dx): allow a few roundings.
        assert!(
            diff < 4.0 * tol,
            "{label}: gradient of input {i} off by {diff:e}"
        );
        eprintln!("{label}: gradient {i} within {diff:.1e}");
    }
    Ok(())
}

fn rms_reference(x: &Tensor, w: &Tensor, eps: f64, offset: f64) -> Result<Tensor> {
    let rstd = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&rstd)?.broadcast_mul(&(w + offset)?)
}

fn layer_reference(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let rstd = (centered.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let y = centered.broadcast_mul(&rstd)?.broadcast_mul(w)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// σ(a) = 1 / (1 + e^(−a)) in ops that have gradients on every device (candle-nn's fused sigmoid
/// has no CUDA kernel without its `cuda` feature).
fn sigmoid(a: &Tensor) -> Result<Tensor> {
    (a.neg()?.exp()? + 1.0)?.recip()
}

fn randn(shape: &[usize], mean: f32) -> Result<Tensor> {
    Tensor::randn(mean, 1.0, shape, &Device::Cpu)
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn rms_norm_gradients_match_elementary_ops() -> Result<()> {
    for device in devices() {
        for dtype in DTYPES {
            // 3-D input, d not a multiple of the vector width, and a Gemma-style offset.
            for (shape, offset) in [(vec![2, 5, 64], 0.0), (vec![7, 300], 1.0)] {
                let d = shape[shape.len() - 1];
                let inputs = [randn(&shape, 0.5)?, randn(&[d], 0.0)?];
                check(
                    &format!("rms_norm {shape:?} offset {offset}"),
                    &device,
                    dtype,
                    &inputs,
                    |t| {
                        RmsNorm::new(t[1].clone(), 1e-5)
                            .with_weight_offset(offset)
                            .forward(&t[0])
                    },
                    |t| rms_reference(&t[0], &t[1], 1e-5, offset as f64),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn layer_norm_gradients_match_elementary_ops() -> Result<()> {
    for device in devices() {
        for dtype in DTYPES {
            let (shape, d) = ([3, 4, 96], 96);
            let inputs = [randn(&shape, 1.0)?, randn(&[d], 1.0)?, randn(&[d], 0.0)?];
            check(
                "layer_norm with β",
                &device,
                dtype,
                &inputs,
                |t| LayerNorm::new(t[1].clone(), Some(t[2].clone()), 1e-5).forward(&t[0]),
                |t| layer_reference(&t[0], &t[1], Some(&t[2]), 1e-5),
            )?;
            check(
                "layer_norm without β",
                &device,
                dtype,
                &inputs[..2],
                |t| LayerNorm::new(t[1].clone(), None, 1e-5).forward(&t[0]),
                |t| layer_reference(&t[0], &t[1], None, 1e-5),
            )?;
        }
    }
    Ok(())
}

#[test]
fn residual_forms_match_elementary_ops() -> Result<()> {
    for device in devices() {
        for dtype in DTYPES {
            let (shape, d) = ([5, 3, 128], 128);
            let inputs = [
                randn(&shape, 0.0)?,
                randn(&shape, 0.5)?,
                randn(&[d], 1.0)?,
                randn(&[d], 0.0)?,
            ];
            // y and h side by side, so the loss reaches both outputs.
            let both = |(y, h): (Tensor, Tensor)| Tensor::cat(&[y, h], 0);
            check(
                "rms_norm residual",
                &device,
                dtype,
                &inputs[..3],
                |t| both(RmsNorm::new(t[2].clone(), 1e-5).forward_residual(&t[0], &t[1])?),
                |t| {
                    let h = (&t[0] + &t[1])?;
                    both((rms_reference(&h, &t[2], 1e-5, 0.0)?, h))
                },
            )?;
            check(
                "layer_norm residual with β",
                &device,
                dtype,
                &inputs,
                |t| {
                    let norm = LayerNorm::new(t[2].clone(), Some(t[3].clone()), 1e-5);
                    both(norm.forward_residual(&t[0], &t[1])?)
                },
                |t| {
                    let h = (&t[0] + &t[1])?;
                    both((layer_reference(&h, &t[2], Some(&t[3]), 1e-5)?, h))
                },
            )?;
        }
    }
    Ok(())
}

#[test]
fn gated_activation_gradients_match_elementary_ops() -> Result<()> {
    for device in devices() {
        for dtype in DTYPES {
            let shape = [6, 2, 160];
            let inputs = [randn(&shape, 0.0)?, randn(&shape, 0.0)?];
            check(
                "swiglu",
                &device,
                dtype,
                &inputs,
                |t| SwiGlu.forward(&t[0], &t[1]),
                |t| (&t[0] * sigmoid(&t[0])?)? * &t[1],
            )?;
            check(
                "geglu (tanh)",
                &device,
                dtype,
                &inputs,
                |t| GeGlu::tanh().forward(&t[0], &t[1]),
                |t| {
                    // 0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³)))
                    let a = &t[0];
                    let inner = ((a + (a.powf(3.0)? * 0.044715)?)?
                        * (2.0f64 / std::f64::consts::PI).sqrt())?;
                    ((a * 0.5)? * (inner.tanh()? + 1.0)?)? * &t[1]
                },
            )?;
        }
    }
    Ok(())
}

#[test]
fn non_contiguous_inputs_give_the_contiguous_results() -> Result<()> {
    for device in devices() {
        let x = randn(&[64, 8], 0.0)?.to_device(&device)?;
        let w = randn(&[8], 1.0)?.to_device(&device)?;
        let transposed = x.t()?; // [8, 64], not contiguous
        let norm = RmsNorm::new(randn(&[64], 1.0)?.to_device(&device)?, 1e-5);
        let a = norm.forward(&transposed)?;
        let b = norm.forward(&transposed.contiguous()?)?;
        assert_eq!(rel_diff(&a, &b)?, 0.0);
        // γ of the wrong length is an error, not a silent reshaping.
        assert!(RmsNorm::new(w, 1e-5).forward(&transposed).is_err());
    }
    Ok(())
}
