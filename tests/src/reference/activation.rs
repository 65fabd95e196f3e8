//! Activations in f64 (erf from `libm`), straight from the definitions.

use std::f64::consts::{FRAC_2_SQRT_PI, PI, SQRT_2};

pub use normkern::activation::Activation;

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn gelu_tanh_u(x: f64) -> f64 {
    (2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)
}

/// `f(x)`.
pub fn apply(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Relu => {
            if x > 0.0 || x.is_nan() {
                x
            } else {
                0.0
            }
        }
        Activation::Silu => x * sigmoid(x),
        Activation::GeluErf => 0.5 * x * libm::erfc(-x / SQRT_2),
        // ½x(1 + tanh u) written as x·σ(2u): the same function, without the f64 cancellation of
        // 1 + tanh(u) for u below about −19.
        Activation::GeluTanh => x * sigmoid(2.0 * gelu_tanh_u(x)),
    }
}

/// `f'(x)`.
pub fn grad(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Relu => {
            if x.is_nan() {
                x
            } else if x > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        Activation::GeluErf => {
            0.5 * libm::erfc(-x / SQRT_2)
                + x * (-0.5 * x * x).exp() * FRAC_2_SQRT_PI / (2.0 * SQRT_2)
        }
        // ½(1 + tanh u) + ½x(1 − tanh²u)·u' with ½(1 + tanh u) = σ(2u), 1 − tanh²u = 4σ(2u)(1 − σ(2u)).
        Activation::GeluTanh => {
            let s = sigmoid(2.0 * gelu_tanh_u(x));
            s + 2.0 * x * s * (1.0 - s) * (2.0 / PI).sqrt() * (1.0 + 3.0 * 0.044715 * x * x)
        }
    }
}

pub const ALL: [Activation; 4] = [
    Activation::Relu,
    Activation::Silu,
    Activation::GeluErf,
    Activation::GeluTanh,
];
