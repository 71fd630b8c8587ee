//! Which instructions the kernels may use: what this CPU has ([`Isa::detect`]), the levels from
//! portable up to AMX ([`Level`]), the vector width a product runs at ([`Simd`]), and
//! `OCCULT_KERNELS`, which caps the level for a process ([`process_level`]). AMX counts only
//! once Linux has granted this process the tile state, which detection asks for.
//!
//! Every kernel and vector-math function has a form that takes an [`Isa`], so that tests run
//! each level this CPU supports in one process (`Isa::detect().at(level)`), and always the
//! portable one; the plain forms use [`isa`], this process's.

use std::sync::OnceLock;

/// A level of instruction sets, each including those below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// No kernel of ours: candle's matmul, scalar element-wise math.
    Portable,
    /// AVX2 and FMA: eight-lane kernels for f32 and bf16 (widened in registers).
    Avx2,
    /// AVX-512 F (with BW and VL for f32 by bf16): sixteen-lane kernels; bf16 by bf16 runs
    /// eight-lane here, as on a CPU without BF16.
    Avx512,
    /// AVX-512 with BF16: bf16 by bf16 multiplies with `vdpbf16ps` (two products a lane per
    /// instruction), in the dot tiles and the outer products ([`super::outer_dp`]).
    Avx512Bf16,
    /// AVX-512 with AMX tile multiplies for bf16 weights.
    Amx,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 5] = [
        Level::Portable,
        Level::Avx2,
        Level::Avx512,
        Level::Avx512Bf16,
        Level::Amx,
    ];

    /// The name `OCCULT_KERNELS` takes.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Bf16 => "avx512bf16",
            Level::Amx => "amx",
        }
    }

    /// The level named `s` (as [`Level::name`] writes it).
    pub fn parse(s: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == s)
    }

    /// The levels this CPU can run, lowest (portable) first.
    pub fn supported() -> Vec<Level> {
        let top = Isa::detect().level();
        Level::ALL.into_iter().filter(|&l| l <= top).collect()
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The vector width one of our kernels runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// Eight f32 lanes (AVX2 and FMA).
    Avx2,
    /// Sixteen f32 lanes (AVX-512).
    Avx512,
}

/// The instruction sets the kernels use, as found on this CPU (or capped to a level).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa {
    /// AVX2 and FMA: the eight-lane kernels, for every operand pair.
    pub avx2: bool,
    /// AVX-512 F: the sixteen-lane f32 kernel.
    pub avx512f: bool,
    /// AVX-512 BF16 (with F): the bf16 kernel's `vdpbf16ps` and `vcvtneps2bf16`.
    pub avx512bf16: bool,
    /// AVX-512 BW and VL (with F): f32 activations with bf16 weights on sixteen lanes.
    pub avx512bw: bool,
    /// AMX-TILE and AMX-BF16, granted by the OS (with AVX-512 F): bf16 weights on tile
    /// multiplies ([`super::amx`]).
    pub amx: bool,
}

impl Isa {
    /// Nothing: the portable level.
    pub const NONE: Isa = Isa {
        avx2: false,
        avx512f: false,
        avx512bf16: false,
        avx512bw: false,
        amx: false,
    };

    /// What this CPU supports (nothing off x86-64), detected once per process.
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(detect_now)
    }

    /// The highest level these instruction sets reach.
    pub fn level(&self) -> Level {
        if self.amx {
            Level::Amx
        } else if self.avx512f && self.avx512bf16 {
            Level::Avx512Bf16
        } else if self.avx512f {
            Level::Avx512
        } else if self.avx2 {
            Level::Avx2
        } else {
            Level::Portable
        }
    }

    /// These instruction sets without those above `level`.
    pub fn at(self, level: Level) -> Isa {
        let avx512 = level >= Level::Avx512;
        Isa {
            avx2: self.avx2 && level >= Level::Avx2,
            avx512f: self.avx512f && avx512,
            avx512bf16: self.avx512bf16 && level >= Level::Avx512Bf16,
            avx512bw: self.avx512bw && avx512,
            amx: self.amx && level >= Level::Amx,
        }
    }

    /// Whether f32 activations times bf16 weights have a kernel here.
    pub fn mixed(&self) -> bool {
        self.simd_for(false, true).is_some()
    }

    /// The vector width our kernels run a product at for activations and weights in f32 or
    /// bf16 (`a_bf16`, `w_bf16`), or `None` where no kernel of ours runs it (bf16 activations
    /// with f32 weights have none anywhere).
    pub fn simd_for(&self, a_bf16: bool, w_bf16: bool) -> Option<Simd> {
        let wide = match (a_bf16, w_bf16) {
            (false, false) => self.avx512f,
            (true, true) => self.avx512bf16,
            (false, true) => self.avx512f && self.avx512bw,
            (true, false) => return None,
        };
        if wide {
            Some(Simd::Avx512)
        } else if self.avx2 {
            Some(Simd::Avx2)
        } else {
            None
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_now() -> Isa {
    use std::arch::is_x86_feature_detected as has;
    let f = has!("avx512f");
    Isa {
        avx2: has!("avx2") && has!("fma"),
        avx512f: f,
        avx512bf16: f && has!("avx512bf16"),
        avx512bw: f && has!("avx512bw") && has!("avx512vl"),
        // The AMX path packs activations with AVX-512 BW and BF16 (every CPU with AMX has
        // them).
        amx: f && has!("avx512bw") && has!("avx512bf16") && amx_granted(),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_now() -> Isa {
    Isa::NONE
}

/// The level `OCCULT_KERNELS` asks for: a [`Level::name`], or unset or `auto` for the highest
/// this CPU has (`None`). Another value is named on stderr, once, and taken as `auto`.
fn setting() -> Option<Level> {
    static SETTING: OnceLock<Option<Level>> = OnceLock::new();
    *SETTING.get_or_init(|| match std::env::var("OCCULT_KERNELS") {
        Err(_) => None,
        Ok(s) if s == "auto" => None,
        Ok(s) => Level::parse(&s).or_else(|| {
            let names: Vec<_> = Level::ALL.iter().map(|l| l.name()).collect();
            eprintln!(
                "OCCULT_KERNELS={s:?} is not auto or one of {}; using auto",
                names.join(", ")
            );
            None
        }),
    })
}

/// This process's level: what `OCCULT_KERNELS` asks for, capped to what the CPU has (a level
/// above it is named on stderr, once).
pub fn process_level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let top = Isa::detect().level();
        match setting() {
            None => top,
            Some(asked) if asked > top => {
                eprintln!("OCCULT_KERNELS={asked}: this CPU reaches {top}; using {top}");
                top
            }
            Some(asked) => asked,
        }
    })
}

/// This process's instruction sets: this CPU's, capped to [`process_level`].
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| Isa::detect().at(process_level()))
}

/// Whether this process can run the AMX kernel: the CPU has AMX-TILE and AMX-BF16, and the
/// operating system granted the tile state (asked for here, once per process; the grant is
/// process-wide and lasts).
fn amx_granted() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        #[allow(unused_unsafe)]
        // SAFETY: CPUID is on every x86-64 CPU; leaf 7 is read only where leaf 0 lists it.
        let (max_leaf, edx7) = unsafe {
            use std::arch::x86_64::__cpuid_count;
            let max = __cpuid_count(0, 0).eax;
            (max, if max >= 7 { __cpuid_count(7, 0).edx } else { 0 })
        };
        let amx_bf16 = edx7 >> 22 & 1 == 1;
        let amx_tile = edx7 >> 24 & 1 == 1;
        if max_leaf < 7 || !amx_bf16 || !amx_tile {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call; on kernels without it, it fails with an error code.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_cap_the_instruction_sets() {
        let all = Isa {
            avx2: true,
            avx512f: true,
            avx512bf16: true,
            avx512bw: true,
            amx: true,
        };
        assert_eq!(all.level(), Level::Amx);
        for level in Level::ALL {
            assert_eq!(all.at(level).level(), level, "{level}");
        }
        assert_eq!(all.at(Level::Portable), Isa::NONE);
        let avx2 = all.at(Level::Avx2);
        for (a, w) in [(false, false), (true, true), (false, true)] {
            assert_eq!(all.simd_for(a, w), Some(Simd::Avx512));
            assert_eq!(avx2.simd_for(a, w), Some(Simd::Avx2));
            assert_eq!(Isa::NONE.simd_for(a, w), None);
        }
        assert_eq!(all.simd_for(true, false), None);
        // AVX-512 F without BF16 (Skylake-X): bf16 products run on eight lanes.
        let skx = Isa {
            avx512bf16: false,
            amx: false,
            ..all
        };
        assert_eq!(skx.simd_for(true, true), Some(Simd::Avx2));
        assert_eq!(skx.simd_for(false, false), Some(Simd::Avx512));
        // The avx512 level is that CPU; avx512bf16 adds `vdpbf16ps` for bf16 by bf16.
        assert_eq!(all.at(Level::Avx512), Isa { avx2: true, ..skx });
        assert_eq!(
            all.at(Level::Avx512Bf16).simd_for(true, true),
            Some(Simd::Avx512)
        );
        assert!(!all.at(Level::Avx512Bf16).amx);
        for l in Level::ALL {
            assert_eq!(Level::parse(l.name()), Some(l));
        }
        assert_eq!(Level::parse("sse"), None);
        let supported = Level::supported();
        assert_eq!(supported[0], Level::Portable);
        assert_eq!(*supported.last().unwrap(), Isa::detect().level());
    }
}
