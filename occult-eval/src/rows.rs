//! The element types a hidden-state row may travel in, and their sizes: what byte counts of
//! rows across links are counted in.

/// Element sizes of the dtypes a hidden-state row may travel in.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum RowDtype {
    F32,
    Bf16,
    F16,
    Fp8,
}

impl RowDtype {
    pub fn bytes(self) -> u64 {
        match self {
            RowDtype::F32 => 4,
            RowDtype::Bf16 | RowDtype::F16 => 2,
            RowDtype::Fp8 => 1,
        }
    }
}
