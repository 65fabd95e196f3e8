//! Which compiled instance of a kernel family to launch, and its PTX entry name.
//!
//! Every family is instantiated for each storage dtype × access (16-byte packs or scalars) × tile
//! (`vpt` accesses per thread kept in registers: 1, 2 or 4; or 0 = stream the row from memory
//! more than once, for rows too wide for registers). The host picks a [`Variant`]; on the GPU it
//! names a PTX entry (`rms_norm_fwd_bf16_v4`), in the emulator it selects the same generic body.

/// Storage dtype of a kernel's row operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
    pub const fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

/// Accesses per thread held in registers; `STREAM` re-reads the row instead.
pub const TILES: [usize; 4] = [1, 2, 4, STREAM];
/// The tile value of the streaming instances.
pub const STREAM: usize = 0;

/// The tiles a family is compiled with for one access kind: all of [`TILES`], except that a
/// family exported with `scalar_streams` has only [`STREAM`] for single-element access.
pub const fn tiles(vec: bool, scalar_streams: bool) -> &'static [usize] {
    if vec || !scalar_streams {
        &TILES
    } else {
        &[STREAM]
    }
}

/// One compiled instance of a kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    pub dtype: Dtype,
    /// 16-byte packs (true) or single elements (false).
    pub vec: bool,
    /// Accesses per thread in registers (1, 2, 4), or [`STREAM`].
    pub vpt: usize,
    /// A row is shared by the blocks of a cluster (sm_90 only, packed access only); launch with
    /// clusters of more than one block.
    pub cluster: bool,
}

/// A PTX entry name, formatted without allocating.
#[derive(Clone, Copy)]
pub struct EntryName {
    buf: [u8; 48],
    len: usize,
}

impl EntryName {
    pub fn as_str(&self) -> &str {
        // Only ASCII pieces are ever pushed.
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
    /// `<family>_<dtype>`: the whole name of a family compiled once per dtype.
    pub fn new(family: &str, dtype: Dtype) -> Self {
        let mut n = EntryName {
            buf: [0; 48],
            len: 0,
        };
        n.push(family);
        n.push("_");
        n.push(dtype.name());
        n
    }
    fn push(&mut self, s: &str) {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
    }
}

impl Variant {
    /// `<family>_<dtype>_<v|s><1|2|4|x>[c]`, the scheme [`export_family!`] uses (`c`: the cluster
    /// instance).
    pub fn entry_name(&self, family: &str) -> EntryName {
        let mut n = EntryName::new(family, self.dtype);
        n.push(if self.vec { "_v" } else { "_s" });
        n.push(match self.vpt {
            1 => "1",
            2 => "2",
            4 => "4",
            _ => "x",
        });
        if self.cluster {
            n.push("c");
        }
        n
    }
}

/// Exports every instance of a kernel family as a PTX entry (nvptx only). `$body` is generic over
/// `<T: Element, const VEC: bool, const VPT: usize>` and takes `&$params`. With `scalar_streams`,
/// single-element access gets only the streaming instance (see [`tiles`]). With `cluster`, the
/// cluster instances: packed access only, every tile, in the sm_90 build only.
macro_rules! export_family {
    ($family:literal, $params:ty, $body:ident, cluster) => {
        $crate::variant::export_family!(@cl $family, $params, $body, "f32", F32);
        $crate::variant::export_family!(@cl $family, $params, $body, "f16", F16);
        $crate::variant::export_family!(@cl $family, $params, $body, "bf16", Bf16);
    };
    (@cl $family:literal, $params:ty, $body:ident, $dn:literal, $t:ident) => {
        #[cfg(target_feature = "sm_90")]
        const _: () = {
            $crate::variant::export_family!(@one concat!($family, "_", $dn, "_v1c"), $params, $body, $t, true, 1);
            $crate::variant::export_family!(@one concat!($family, "_", $dn, "_v2c"), $params, $body, $t, true, 2);
            $crate::variant::export_family!(@one concat!($family, "_", $dn, "_v4c"), $params, $body, $t, true, 4);
            $crate::variant::export_family!(@one concat!($family, "_", $dn, "_vxc"), $params, $body, $t, true, 0);
        };
    };
    ($family:literal, $params:ty, $body:ident $(, $mode:ident)?) => {
        $crate::variant::export_family!(@dt $family, $params, $body, "f32", F32 $(, $mode)?);
        $crate::variant::export_family!(@dt $family, $params, $body, "f16", F16 $(, $mode)?);
        $crate::variant::export_family!(@dt $family, $params, $body, "bf16", Bf16 $(, $mode)?);
    };
    (@dt $family:literal, $params:ty, $body:ident, $dn:literal, $t:ident) => {
        $crate::variant::export_family!(@tile $family, $params, $body, $dn, $t, "v", true);
        $crate::variant::export_family!(@tile $family, $params, $body, $dn, $t, "s", false);
    };
    (@dt $family:literal, $params:ty, $body:ident, $dn:literal, $t:ident, scalar_streams) => {
        $crate::variant::export_family!(@tile $family, $params, $body, $dn, $t, "v", true);
        $crate::variant::export_family!(@one concat!($family, "_", $dn, "_sx"), $params, $body, $t, false, 0);
    };
    (@tile $family:literal, $params:ty, $body:ident, $dn:literal, $t:ident, $pn:literal, $vec:literal) => {
        $crate::variant::export_family!(@one concat!($family, "_", $dn, "_", $pn, "1"), $params, $body, $t, $vec, 1);
        $crate::variant::export_family!(@one concat!($family, "_", $dn, "_", $pn, "2"), $params, $body, $t, $vec, 2);
        $crate::variant::export_family!(@one concat!($family, "_", $dn, "_", $pn, "4"), $params, $body, $t, $vec, 4);
        $crate::variant::export_family!(@one concat!($family, "_", $dn, "_", $pn, "x"), $params, $body, $t, $vec, 0);
    };
    (@one $name:expr, $params:ty, $body:ident, $t:ident, $vec:literal, $vpt:literal) => {
        #[cfg(target_arch = "nvptx64")]
        const _: () = {
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn entry(p: $params) {
                unsafe { $body::<$crate::element::$t, $vec, $vpt>(&p) }
            }
        };
    };
}
pub(crate) use export_family;

/// The host-side twin of [`export_family!`]: the generic body instance a [`Variant`] names, for the
/// emulator. Expands to a `match` over every instance.
#[cfg(not(target_arch = "nvptx64"))]
macro_rules! select_family {
    ($variant:expr, $params:ty, $body:ident) => {{
        use $crate::element::{Bf16, F16, F32};
        use $crate::variant::Dtype;
        let v: $crate::variant::Variant = $variant;
        let f: unsafe fn(&$params) = match (v.dtype, v.vec, v.vpt) {
            (Dtype::F32, true, 1) => $body::<F32, true, 1>,
            (Dtype::F32, true, 2) => $body::<F32, true, 2>,
            (Dtype::F32, true, 4) => $body::<F32, true, 4>,
            (Dtype::F32, true, _) => $body::<F32, true, 0>,
            (Dtype::F32, false, 1) => $body::<F32, false, 1>,
            (Dtype::F32, false, 2) => $body::<F32, false, 2>,
            (Dtype::F32, false, 4) => $body::<F32, false, 4>,
            (Dtype::F32, false, _) => $body::<F32, false, 0>,
            (Dtype::F16, true, 1) => $body::<F16, true, 1>,
            (Dtype::F16, true, 2) => $body::<F16, true, 2>,
            (Dtype::F16, true, 4) => $body::<F16, true, 4>,
            (Dtype::F16, true, _) => $body::<F16, true, 0>,
            (Dtype::F16, false, 1) => $body::<F16, false, 1>,
            (Dtype::F16, false, 2) => $body::<F16, false, 2>,
            (Dtype::F16, false, 4) => $body::<F16, false, 4>,
            (Dtype::F16, false, _) => $body::<F16, false, 0>,
            (Dtype::Bf16, true, 1) => $body::<Bf16, true, 1>,
            (Dtype::Bf16, true, 2) => $body::<Bf16, true, 2>,
            (Dtype::Bf16, true, 4) => $body::<Bf16, true, 4>,
            (Dtype::Bf16, true, _) => $body::<Bf16, true, 0>,
            (Dtype::Bf16, false, 1) => $body::<Bf16, false, 1>,
            (Dtype::Bf16, false, 2) => $body::<Bf16, false, 2>,
            (Dtype::Bf16, false, 4) => $body::<Bf16, false, 4>,
            (Dtype::Bf16, false, _) => $body::<Bf16, false, 0>,
        };
        f
    }};
}
#[cfg(not(target_arch = "nvptx64"))]
pub(crate) use select_family;

/// Activation functions, as the `ACT` const parameter of the activation kernels.
pub mod act {
    pub const RELU: u32 = 0;
    pub const SILU: u32 = 1;
    pub const GELU_ERF: u32 = 2;
    pub const GELU_TANH: u32 = 3;
    /// `(value, name)` of every activation, in entry-name order.
    pub const ALL: [(u32, &str); 4] = [
        (RELU, "relu"),
        (SILU, "silu"),
        (GELU_ERF, "gelu_erf"),
        (GELU_TANH, "gelu_tanh"),
    ];
}

/// One compiled instance of an activation kernel family: dtype × access × activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActVariant {
    pub dtype: Dtype,
    pub vec: bool,
    /// One of [`act`].
    pub act: u32,
}

impl ActVariant {
    /// `<family>_<act>_<dtype>_<v|s>`, the scheme [`export_activation_family!`] uses.
    pub fn entry_name(&self, family: &str) -> EntryName {
        let mut n = EntryName {
            buf: [0; 48],
            len: 0,
        };
        n.push(family);
        n.push("_");
        n.push(
            act::ALL
                .iter()
                .find(|(v, _)| *v == self.act)
                .map_or("?", |(_, name)| name),
        );
        n.push("_");
        n.push(self.dtype.name());
        n.push(if self.vec { "_v" } else { "_s" });
        n
    }
}

/// Exports every instance of an activation kernel family (nvptx only). `$body` is generic over
/// `<T: Element, const VEC: bool, const ACT: u32>` and takes `&$params`.
macro_rules! export_activation_family {
    ($family:literal, $params:ty, $body:ident) => {
        $crate::variant::export_activation_family!(@act $family, $params, $body, "relu", 0);
        $crate::variant::export_activation_family!(@act $family, $params, $body, "silu", 1);
        $crate::variant::export_activation_family!(@act $family, $params, $body, "gelu_erf", 2);
        $crate::variant::export_activation_family!(@act $family, $params, $body, "gelu_tanh", 3);
    };
    (@act $family:literal, $params:ty, $body:ident, $an:literal, $act:literal) => {
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_f32_v"), $params, $body, F32, true, $act);
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_f32_s"), $params, $body, F32, false, $act);
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_f16_v"), $params, $body, F16, true, $act);
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_f16_s"), $params, $body, F16, false, $act);
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_bf16_v"), $params, $body, Bf16, true, $act);
        $crate::variant::export_activation_family!(@one concat!($family, "_", $an, "_bf16_s"), $params, $body, Bf16, false, $act);
    };
    (@one $name:expr, $params:ty, $body:ident, $t:ident, $vec:literal, $act:literal) => {
        #[cfg(target_arch = "nvptx64")]
        const _: () = {
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn entry(p: $params) {
                unsafe { $body::<$crate::element::$t, $vec, $act>(&p) }
            }
        };
    };
}
pub(crate) use export_activation_family;

/// The host-side twin of [`export_activation_family!`], for the emulator.
#[cfg(not(target_arch = "nvptx64"))]
macro_rules! select_activation_family {
    ($variant:expr, $params:ty, $body:ident) => {{
        use $crate::element::{Bf16, F16, F32};
        use $crate::variant::Dtype;
        macro_rules! by_act {
            ($t:ident, $vec:literal, $a:expr) => {
                match $a {
                    0 => $body::<$t, $vec, 0> as unsafe fn(&$params),
                    1 => $body::<$t, $vec, 1>,
                    2 => $body::<$t, $vec, 2>,
                    _ => $body::<$t, $vec, 3>,
                }
            };
        }
        let v: $crate::variant::ActVariant = $variant;
        match (v.dtype, v.vec) {
            (Dtype::F32, true) => by_act!(F32, true, v.act),
            (Dtype::F32, false) => by_act!(F32, false, v.act),
            (Dtype::F16, true) => by_act!(F16, true, v.act),
            (Dtype::F16, false) => by_act!(F16, false, v.act),
            (Dtype::Bf16, true) => by_act!(Bf16, true, v.act),
            (Dtype::Bf16, false) => by_act!(Bf16, false, v.act),
        }
    }};
}
#[cfg(not(target_arch = "nvptx64"))]
pub(crate) use select_activation_family;
