//! The tables of compiled kernels: one per op family, each declared once in the family's module.
//!
//! A family's table macro expands every line twice from the same tokens: on nvptx into the PTX
//! entry points (`#[export_name]` kernels), on the host into a [`Table`] of [`Kernel`]s, each with
//! its entry name, the key the host's launch plan selects it by, and the same body as a function
//! pointer for the emulator. The host loads exactly the entries its table lists, so a kernel that
//! is declared is compiled, and one that is compiled is loadable; `tests` in the host crate check
//! the committed PTX against the tables on a machine without a GPU.

/// Storage dtype of a kernel's row operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

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

/// One compiled kernel of a family whose launch parameters are `P`, selected by key `K`.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Debug)]
pub struct Kernel<K: 'static, P: 'static> {
    /// The PTX entry name.
    pub name: &'static str,
    pub key: K,
    /// The oldest PTX target compiled with it: 90 for thread-block clusters, else 80.
    pub min_arch: u32,
    /// Dynamic shared memory (bytes) of one block of `threads` threads.
    pub shared_bytes: fn(usize) -> usize,
    /// Whether that can exceed the 48 KiB every kernel may use: the function must opt into the
    /// device's own limit when it is loaded.
    pub large_shared: bool,
    /// Registers per thread ptxas may use (`.maxnreg`, which `cargo xtask build-ptx` writes into
    /// the entry), or 0 for ptxas's own choice.
    pub max_registers: u32,
    /// The body, for the emulator; the same generic instance the PTX entry runs.
    pub body: unsafe fn(&P),
}

/// A family's kernels as its table macro declares them (per table line, groups of that line's
/// instances), and an index by key built on first use.
#[cfg(not(target_arch = "nvptx64"))]
pub struct Table<K: 'static, P: 'static> {
    lines: &'static [&'static [&'static [Kernel<K, P>]]],
    /// Keyed with foldhash's fixed-seed hasher: every launch looks kernels up here, and the keys
    /// are the tables' own (no hostile input for a keyed hash to guard against).
    index: std::sync::OnceLock<
        std::collections::HashMap<K, &'static Kernel<K, P>, foldhash::fast::FixedState>,
    >,
}

#[cfg(not(target_arch = "nvptx64"))]
impl<K: Clone + Eq + core::hash::Hash, P> Table<K, P> {
    /// The table of these lines (the family's macro writes it).
    pub const fn new(lines: &'static [&'static [&'static [Kernel<K, P>]]]) -> Self {
        Table {
            lines,
            index: std::sync::OnceLock::new(),
        }
    }

    /// Every kernel of the family.
    pub fn iter(&self) -> impl Iterator<Item = &'static Kernel<K, P>> + Clone {
        (self.lines.iter())
            .flat_map(|line| line.iter())
            .flat_map(|group| group.iter())
    }

    /// The kernel with this key, if the family has one.
    pub fn find(&self, key: &K) -> Option<&'static Kernel<K, P>> {
        let index = self
            .index
            .get_or_init(|| self.iter().map(|k| (k.key.clone(), k)).collect());
        index.get(key).copied()
    }
}

/// What the host needs of any kernel to load it, whatever its family.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub name: &'static str,
    pub min_arch: u32,
    pub large_shared: bool,
    pub max_registers: u32,
    /// The kernel's identity: the address of its table entry.
    pub id: usize,
}

#[cfg(not(target_arch = "nvptx64"))]
impl<K, P> Kernel<K, P> {
    /// The kernel's identity: the address of its table entry, which is unique and fixed.
    pub fn id(&'static self) -> usize {
        self as *const Self as usize
    }

    pub fn entry(&'static self) -> Entry {
        Entry {
            name: self.name,
            min_arch: self.min_arch,
            large_shared: self.large_shared,
            max_registers: self.max_registers,
            id: self.id(),
        }
    }
}

/// Dynamic shared memory of kernels that use none.
#[cfg(not(target_arch = "nvptx64"))]
pub const fn no_shared(_threads: usize) -> usize {
    0
}

/// One kernel from one table line: on nvptx its PTX entry point (an item), elsewhere its
/// [`Kernel`] (an expression). `$instance` is the generic body with every parameter given.
macro_rules! kernel {
    (export $name:expr, $params:ty, $($instance:tt)*) => {
        const _: () = {
            #[unsafe(export_name = $name)]
            unsafe extern "ptx-kernel" fn entry(p: $params) {
                unsafe { $($instance)*(&p) }
            }
        };
    };
    (table $name:expr, $key:expr, $min_arch:expr, $shared:expr, $large:expr, $registers:expr,
        $($instance:tt)*) => {
        $crate::kernel::Kernel {
            name: $name,
            key: $key,
            min_arch: $min_arch,
            shared_bytes: $shared,
            large_shared: $large,
            max_registers: $registers,
            body: $($instance)*,
        }
    };
}
pub(crate) use kernel;
