//! Activations, forward and backward, plain and gated, and a backward with a fused dbias.
//!
//! The functions and their derivatives ([`functions`]) are public `#[inline]` device functions
//! for fusion into other Rust kernels. The backward recomputes `f'(preact)` from the saved
//! pre-activation, so the derivative never round-trips through memory. SiLU and GELU are a few
//! dozen instructions per element, so the kernels stay memory-bound only with fast forms (IEEE
//! division made them arithmetic-bound).
//!
//! Kernels ([`kernels`]) walk `rows × d` elements in 16-byte packs (or single elements for
//! unaligned views), with every operand on its own row stride; fp32 math, one rounding at the
//! store.

pub mod functions;
pub mod kernels;

pub use functions::*;
pub use kernels::{Family, Params};

use crate::kernel::Dtype;
#[cfg(not(target_arch = "nvptx64"))]
use crate::kernel::{Table, no_shared};
#[cfg(not(target_arch = "nvptx64"))]
use kernels::dbias_shared;
use kernels::{backward, backward_dbias, forward, gated_backward, gated_forward};

/// The activation function. For the gated kernels: `Silu` is SwiGLU, `GeluErf`/`GeluTanh` GeGLU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Activation {
    Relu = act::RELU,
    Silu = act::SILU,
    /// GELU with the exact erf.
    GeluErf = act::GELU_ERF,
    /// GELU with the tanh approximation.
    GeluTanh = act::GELU_TANH,
}

/// The activations as the `ACT` const parameter of the kernels.
pub mod act {
    pub const RELU: u32 = 0;
    pub const SILU: u32 = 1;
    pub const GELU_ERF: u32 = 2;
    pub const GELU_TANH: u32 = 3;
}

/// What selects one compiled activation kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActivationKey {
    pub family: Family,
    pub activation: Activation,
    pub dtype: Dtype,
    /// 16-byte packs (every operand aligned, `d` and strides multiples of the pack) or single
    /// elements (any layout).
    pub vec: bool,
}

/// Declares the activation kernels: for each line, every activation × dtype × access. Entry
/// names: `<name>_<activation>_<dtype>_<v|s>`.
macro_rules! activation_kernels {
    (
        activations: $acts:tt;
        $( $name:literal => $family:ident, $body:ident, $shared:path, $registers:literal; )*
    ) => {
        $(
            #[cfg(target_arch = "nvptx64")]
            activation_kernels!(@export $name, $body, $acts);
        )*
        #[cfg(not(target_arch = "nvptx64"))]
        pub static KERNELS: Table<ActivationKey, Params> = Table::new(&[$(
            activation_kernels!(@line $name, $family, $body, $shared, $registers, $acts)
        ),*]);
    };
    (@export $name:literal, $body:ident, [$($an:literal $act:ident),*]) => {
        $(
            activation_kernels!(@export_one concat!($name, "_", $an, "_f32_v"), $body, F32, true, $act);
            activation_kernels!(@export_one concat!($name, "_", $an, "_f32_s"), $body, F32, false, $act);
            activation_kernels!(@export_one concat!($name, "_", $an, "_f16_v"), $body, F16, true, $act);
            activation_kernels!(@export_one concat!($name, "_", $an, "_f16_s"), $body, F16, false, $act);
            activation_kernels!(@export_one concat!($name, "_", $an, "_bf16_v"), $body, Bf16, true, $act);
            activation_kernels!(@export_one concat!($name, "_", $an, "_bf16_s"), $body, Bf16, false, $act);
        )*
    };
    (@export_one $entry:expr, $body:ident, $t:ident, $vec:literal, $act:ident) => {
        $crate::kernel::kernel!(export $entry, Params,
            $body::<$crate::element::$t, $vec, { Activation::$act as u32 }>);
    };
    (@line $name:literal, $family:ident, $body:ident, $shared:path, $registers:literal, [$($an:literal $act:ident),*]) => {
        &[$(
            &[
                activation_kernels!(@entry concat!($name, "_", $an, "_f32_v"), $family, $body, $shared, $registers, F32, true, $act),
                activation_kernels!(@entry concat!($name, "_", $an, "_f32_s"), $family, $body, $shared, 0, F32, false, $act),
                activation_kernels!(@entry concat!($name, "_", $an, "_f16_v"), $family, $body, $shared, $registers, F16, true, $act),
                activation_kernels!(@entry concat!($name, "_", $an, "_f16_s"), $family, $body, $shared, 0, F16, false, $act),
                activation_kernels!(@entry concat!($name, "_", $an, "_bf16_v"), $family, $body, $shared, $registers, Bf16, true, $act),
                activation_kernels!(@entry concat!($name, "_", $an, "_bf16_s"), $family, $body, $shared, 0, Bf16, false, $act),
            ]
        ),*]
    };
    (@entry $entry:expr, $family:ident, $body:ident, $shared:path, $registers:literal, $t:ident, $vec:literal, $act:ident) => {
        $crate::kernel::kernel!(table $entry,
            ActivationKey {
                family: Family::$family,
                activation: Activation::$act,
                dtype: Dtype::$t,
                vec: $vec,
            },
            80, $shared, false, $registers,
            $body::<$crate::element::$t, $vec, { Activation::$act as u32 }>)
    };
}

activation_kernels! {
    // Entry-name part and function of every activation.
    activations: ["relu" Relu, "silu" Silu, "gelu_erf" GeluErf, "gelu_tanh" GeluTanh];

    // Entry-name part, family, body, dynamic shared bytes for a block size, register budget of
    // the 16-byte-pack instances (0: ptxas's choice; the one-element instances always take
    // ptxas's). The dbias kernel's eight rows of packs in flight take ~125 registers: 128 keeps
    // two blocks of 256 threads on an SM on every target (sm_80's own choice was 130, one block).
    "act_fwd" => Forward, forward, no_shared, 0;
    "act_bwd" => Backward, backward, no_shared, 0;
    "act_bwd_dbias" => BackwardDbias, backward_dbias, dbias_shared, 128;
    "glu_fwd" => GatedForward, gated_forward, no_shared, 0;
    "glu_bwd" => GatedBackward, gated_backward, no_shared, 0;
}
