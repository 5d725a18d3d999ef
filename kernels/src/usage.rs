//! Which implementation each family of operations ran, counted where [`crate::fused`] decides (a
//! fused operation or kernel, or `None`: the caller's reference composition). A run reads the
//! difference of two [`snapshot`]s into its summary (`"kernels": {"attention": "flash", ...}`), so
//! a kernel that silently stopped applying (another backend type, a tensor past what a kernel
//! indexes) shows as `"reference"` instead of only as a slower run.
//!
//! The counters are the process's: runs side by side in one process (tests) see each other's.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// A family of operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Causal attention.
    Attention = 0,
    /// The experts' products (SwiGLU, GPT-OSS's).
    Experts = 1,
    /// Routing, token permutation into expert order and the weighted combine.
    Dispatch = 2,
    /// RMSNorm, the SwiGLU activation, rotary embedding.
    Norms = 3,
    /// Dense linear layers.
    Linear = 4,
    /// Next-token cross-entropy.
    Loss = 5,
    /// AdamW and squared norms.
    Optimizer = 6,
}

impl Family {
    /// Every family, in the order of the summary.
    pub const ALL: [Family; 7] = [
        Family::Attention,
        Family::Experts,
        Family::Dispatch,
        Family::Norms,
        Family::Linear,
        Family::Loss,
        Family::Optimizer,
    ];

    /// Its name in summaries.
    pub fn name(self) -> &'static str {
        ["attention", "experts", "dispatch", "norms", "linear", "loss", "optimizer"][self as usize]
    }

    /// Whether the CubeCL kernels have an implementation of it (the others are Burn's own
    /// operations on a GPU backend).
    pub fn has_kernels(self) -> bool {
        matches!(self, Family::Attention | Family::Experts | Family::Dispatch)
    }
}

/// An implementation of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    /// The CubeCL flash-attention kernel.
    Flash = 0,
    /// The CubeCL grouped expert products.
    Grouped = 1,
    /// CubeCL's matmul expert by expert: the reference composition, chosen by measurement
    /// (`crate::cube::probe`) as the faster.
    Matmul = 2,
    /// The CubeCL routing, permute and combine kernels (token ids stay on the device).
    Device = 3,
    /// Our fused CPU operation (Burn's flex backend).
    FusedCpu = 4,
    /// The reference composition of Burn operations, because nothing of ours applied.
    Reference = 5,
}

impl Implementation {
    const ALL: [Implementation; 6] = [
        Implementation::Flash,
        Implementation::Grouped,
        Implementation::Matmul,
        Implementation::Device,
        Implementation::FusedCpu,
        Implementation::Reference,
    ];

    /// Its name in summaries.
    pub fn name(self) -> &'static str {
        ["flash", "grouped", "matmul", "device", "fused-cpu", "reference"][self as usize]
    }
}

const FAMILIES: usize = Family::ALL.len();
const IMPLS: usize = Implementation::ALL.len();

static COUNTS: [[AtomicU64; IMPLS]; FAMILIES] = [const { [const { AtomicU64::new(0) }; IMPLS] }; FAMILIES];

/// Counts one call of `family` that ran `how`.
pub fn record(family: Family, how: Implementation) {
    COUNTS[family as usize][how as usize].fetch_add(1, Ordering::Relaxed);
}

/// Counts `result`: `how` when there is one, [`Implementation::Reference`] when not; returns it.
pub(crate) fn tally<T>(family: Family, how: Implementation, result: Option<T>) -> Option<T> {
    record(family, if result.is_some() { how } else { Implementation::Reference });
    result
}

/// The counts so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot([[u64; IMPLS]; FAMILIES]);

/// The counts so far, to compare with a later one ([`Snapshot::since`]).
pub fn snapshot() -> Snapshot {
    Snapshot(std::array::from_fn(|f| std::array::from_fn(|i| COUNTS[f][i].load(Ordering::Relaxed))))
}

impl Snapshot {
    /// Each family called between `before` and this snapshot, with the implementations it ran,
    /// most calls first, joined by `+` (`"grouped"`, `"grouped+matmul"`, `"reference"`).
    pub fn since(&self, before: &Snapshot) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for f in Family::ALL {
            let mut ran: Vec<(u64, Implementation)> = Implementation::ALL
                .iter()
                .map(|&i| (self.0[f as usize][i as usize].saturating_sub(before.0[f as usize][i as usize]), i))
                .filter(|(n, _)| *n > 0)
                .collect();
            if ran.is_empty() {
                continue;
            }
            ran.sort_by(|a, b| b.0.cmp(&a.0).then((a.1 as usize).cmp(&(b.1 as usize))));
            let names: Vec<&str> = ran.iter().map(|(_, i)| i.name()).collect();
            out.insert(f.name().to_string(), names.join("+"));
        }
        out
    }
}

/// Whether every family with CubeCL kernels that ran in `used` (a [`Snapshot::since`]) ran only
/// the reference: on a CubeCL backend, the kernels all fell back. False when none of them ran.
pub fn all_fell_back(used: &BTreeMap<String, String>) -> bool {
    let with_kernels: Vec<&String> =
        Family::ALL.iter().filter(|f| f.has_kernels()).filter_map(|f| used.get(f.name())).collect();
    !with_kernels.is_empty() && with_kernels.iter().all(|how| how.as_str() == "reference")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_s_usage_is_the_difference_of_two_snapshots() {
        let before = snapshot();
        record(Family::Experts, Implementation::Grouped);
        record(Family::Experts, Implementation::Grouped);
        record(Family::Experts, Implementation::Matmul);
        assert_eq!(tally(Family::Attention, Implementation::Flash, None::<()>), None);
        let used = snapshot().since(&before);
        // (Other tests of this process may count too: only what this one did is asserted.)
        assert!(used["experts"].starts_with("grouped"), "{used:?}");
        assert!(used["experts"].contains("matmul"), "{used:?}");
        assert!(used["attention"].contains("reference"), "{used:?}");
        let mut fell = BTreeMap::new();
        fell.insert("attention".to_string(), "reference".to_string());
        fell.insert("norms".to_string(), "fused-cpu".to_string());
        assert!(all_fell_back(&fell));
        fell.insert("experts".to_string(), "matmul".to_string());
        assert!(!all_fell_back(&fell));
        assert!(!all_fell_back(&BTreeMap::new()));
    }
}
