//! `[[phases]]`: a run whose step shape changes (long-context extension: 4K tokens for N steps,
//! then 16K, then 32K). Each phase trains its steps at its own sequence length (and batch); at a
//! boundary the run checkpoints and continues from the checkpoint under the next phase's shape,
//! with `allocation = auto` re-planned for it ([`crate::phases`]).

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// One phase of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunPhase {
    /// Tokens per sequence in this phase.
    pub seq: usize,
    /// Steps of this phase.
    pub steps: usize,
    /// Sequences per step in this phase (default: the run's `batch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
}

impl RunPhase {
    /// The phase for people: `64 tokens x 10 steps` (`, batch 4` when it has its own).
    pub fn describe(&self) -> String {
        let batch = self.batch.map_or(String::new(), |b| format!(", batch {b}"));
        format!("{} tokens x {} steps{batch}", self.seq, self.steps)
    }

    /// A `SEQxSTEPS` or `SEQxSTEPSxBATCH` phase of `--phases`.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            TrainError::option(
                "phases",
                format!("`{s}` is not a phase: give SEQxSTEPS or SEQxSTEPSxBATCH, e.g. 4096x1000 or 16384x200x8"),
            )
        };
        let parts: Vec<usize> = s.split('x').map(|p| p.trim().parse().map_err(|_| bad())).collect::<Result<_>>()?;
        match parts[..] {
            [seq, steps] => Ok(Self { seq, steps, batch: None }),
            [seq, steps, batch] => Ok(Self { seq, steps, batch: Some(batch) }),
            _ => Err(bad()),
        }
    }
}

/// The last step of each phase (1-based, cumulative); `None` when they overflow.
pub fn phase_ends(phases: &[RunPhase]) -> Option<Vec<usize>> {
    let mut end = 0usize;
    phases
        .iter()
        .map(|p| {
            end = end.checked_add(p.steps)?;
            Some(end)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    #[test]
    fn phases_are_read_from_toml_and_flags_and_give_the_steps() {
        let cfg = RunConfig::from_toml_str(
            "[[phases]]\nseq = 64\nsteps = 10\n[[phases]]\nseq = 128\nsteps = 5\nbatch = 4\n[data]\nbatch = 8\n",
        )
        .unwrap();
        assert_eq!(cfg.steps, 15, "steps left out: the phases' total");
        assert_eq!(cfg.phases[1], RunPhase { seq: 128, steps: 5, batch: Some(4) });
        cfg.validate().unwrap();
        let second = cfg.phase(1);
        assert_eq!((second.data.seq, second.data.batch, second.steps), (128, 4, 15));
        assert!(second.phases.is_empty());
        assert_eq!(cfg.phase(0).data.batch, 8, "a phase without its own batch keeps the run's");
        let written = toml::to_string(&cfg).unwrap();
        assert_eq!(RunConfig::from_toml_str(&written).unwrap(), cfg, "written back as\n{written}");
        // The run's own `seq` is not a phase's: only the phases' are checked.
        let mut odd = cfg.clone();
        odd.data.seq = 0;
        odd.validate().unwrap();
        odd.phases.clear();
        assert!(odd.validate().is_err());
        assert_eq!(RunPhase::parse("4096x1000").unwrap(), RunPhase { seq: 4096, steps: 1000, batch: None });
        assert_eq!(RunPhase::parse("16384x200x8").unwrap().batch, Some(8));
        for bad in ["4096", "4096x", "x10", "1x2x3x4", "-1x2", "64x1.5"] {
            let e = RunPhase::parse(bad).unwrap_err().to_string();
            assert!(e.contains("SEQxSTEPS"), "{bad}: {e}");
        }
    }

    #[test]
    fn phases_that_do_not_make_a_run_are_refused_naming_the_phase() {
        let read = |t: &str| RunConfig::from_toml_str(t).unwrap().validate().unwrap_err().to_string();
        let e = read("steps = 12\n[[phases]]\nseq = 64\nsteps = 10\n");
        assert!(e.contains("add up to 10") && e.contains("got 12"), "{e}");
        let e = read("[[phases]]\nseq = 64\nsteps = 2\n[[phases]]\nseq = 64\nsteps = 0\n");
        assert!(e.contains("phase 2") && e.contains("at least 1 step"), "{e}");
        let e = read("[[phases]]\nseq = 64\nsteps = 2\n[[phases]]\nseq = 0\nsteps = 2\n");
        assert!(e.contains("phase 2 (0 tokens x 2 steps)"), "{e}");
        let e = read("micro_batches = 4\nplacement = \"disagg\"\n[[phases]]\nseq = 64\nsteps = 2\nbatch = 6\n");
        assert!(e.contains("phase 1"), "{e}");
        let e = read("transport = \"mpi\"\nplacement = \"disagg\"\n[[phases]]\nseq = 64\nsteps = 2\n");
        assert!(e.contains("transport local"), "{e}");
        assert!(RunConfig::from_toml_str("[[phases]]\nseq = 64\nsteps = 2\nlr = 1\n").is_err(), "unknown phase keys");
    }
}
