//! DualPipe's fixed per-rank program, transcribed from `DualPipe.step` in deepseek-ai/DualPipe
//! (`dualpipe/dualpipe.py`, the schedule of the DeepSeek-V3 technical report).
//!
//! `ranks` pipeline ranks each hold two model chunks: stage `r` of the forward direction and stage
//! `ranks - 1 - r` of the reverse one. Half of the micro-batches enter at rank 0, half at the last
//! rank. A rank's *phase 0* is the direction that enters in its own half of the pipeline, *phase 1*
//! the other. Each rank runs the same eight-part program, one step at a time (a step waits for
//! the previous one and for its inputs):
//!
//! 1. `nF0`: forwards of phase 0 (warm-up);
//! 2. `nF0F1`: forwards of both phases;
//! 3. `nB1W1F1`: a zero-bubble backward of phase 1, its weight gradients, a forward of phase 1;
//! 4. `nF0B1F1B0` (the steady phase): pairs of one forward chunk overlapped with one backward
//!    chunk of the other phase, whose computation hides each other's all-to-all;
//! 5. `nB1F1B0`: a backward of phase 1, then a pair;
//! 6. `nB1B0`: backwards of both phases (the second half zero-bubble);
//! 7. `nWB0`: deferred weight gradients, zero-bubble backwards of phase 0;
//! 8. `nW`: the remaining weight gradients.
//!
//! [`dualpipe_program`] returns that list of steps; [`super::baselines::build_baseline`] turns
//! each step into ops on the rank's forward, backward and weight-gradient compute streams and its
//! communication stream.

use crate::error::{CoreError, Result};

/// One step of a DualPipe rank's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DualStep {
    /// Forward chunk of the next micro-batch of `phase`.
    Forward {
        /// Phase (0 or 1, see the module documentation).
        phase: usize,
        /// The output is sent only after the next step's computation (the reference program
        /// posts this send late, in warm-up, to order the point-to-point exchanges).
        send_after_next: bool,
    },
    /// Backward chunk of the oldest forwarded micro-batch of `phase`.
    Backward {
        /// Phase.
        phase: usize,
        /// Zero bubble: only the input gradients; the weight gradients wait for a later
        /// [`DualStep::Weight`].
        zero_bubble: bool,
    },
    /// A forward chunk of `forward` and a backward chunk of `backward`, overlapped.
    ForwardBackward {
        /// Phase of the forward chunk.
        forward: usize,
        /// Phase of the backward chunk.
        backward: usize,
    },
    /// Weight gradients of the oldest zero-bubble backward.
    Weight,
}

/// Checks DualPipe's preconditions: an even number of ranks and an even number of micro-batches,
/// at least twice the ranks.
pub fn check_dualpipe(ranks: usize, micro_batches: usize) -> Result<()> {
    if ranks < 2 || !ranks.is_multiple_of(2) {
        return Err(CoreError::InvalidField {
            field: "dualpipe.pipeline_ranks".into(),
            value: ranks.to_string(),
            allowed: "an even number >= 2".into(),
        });
    }
    if micro_batches < 2 * ranks || !micro_batches.is_multiple_of(2) {
        return Err(CoreError::InvalidField {
            field: "dualpipe.micro_batches".into(),
            value: micro_batches.to_string(),
            allowed: format!("an even number >= {} (twice the pipeline ranks)", 2 * ranks),
        });
    }
    Ok(())
}

/// The program of rank `rank` of `ranks` for `micro_batches` micro-batches (both directions
/// together), step by step as `DualPipe.step` runs it.
pub fn dualpipe_program(ranks: usize, rank: usize, micro_batches: usize) -> Result<Vec<DualStep>> {
    check_dualpipe(ranks, micro_batches)?;
    if rank >= ranks {
        return Err(CoreError::InvalidField {
            field: "dualpipe.rank".into(),
            value: rank.to_string(),
            allowed: format!("0..{ranks}"),
        });
    }
    use DualStep::{Backward as B, ForwardBackward as FB, Weight as W};
    let f = |phase, send_after_next| DualStep::Forward { phase, send_after_next };
    let half_ranks = ranks / 2;
    let h = rank.min(ranks - 1 - rank);
    let half = micro_batches / 2;
    let middle = h == half_ranks - 1;
    let outer = half_ranks - h - 1;
    let mut p = Vec::with_capacity(3 * micro_batches);
    // 1. nF0
    p.extend((0..2 * outer).map(|_| f(0, false)));
    // 2. nF0F1: outer ranks send each phase-0 output after the following phase-1 forward; the
    //    middle ranks keep their last phase-1 output until after the next step.
    for i in 0..=h {
        p.push(f(0, !middle));
        p.push(f(1, middle && i == h));
    }
    // 3. nB1W1F1
    for _ in 0..outer {
        p.extend([B { phase: 1, zero_bubble: true }, W, f(1, false)]);
    }
    // 4. nF0B1F1B0: the middle ranks do not overlap their first pair.
    for i in 0..half + h + 1 - ranks {
        if i == 0 && middle {
            p.extend([f(0, true), B { phase: 1, zero_bubble: false }]);
        } else {
            p.push(FB { forward: 0, backward: 1 });
        }
        p.push(FB { forward: 1, backward: 0 });
    }
    // 5. nB1F1B0
    for _ in 0..outer {
        p.extend([B { phase: 1, zero_bubble: false }, FB { forward: 1, backward: 0 }]);
    }
    // 6. nB1B0: zero bubble from the middle of the part on (the reference switches at
    //    `step_6 // 2`, where `step_6 = h + 1`).
    let (mut zero_bubble, step_6) = (false, h + 1);
    let switch = step_6 / 2;
    for i in 0..=h {
        if i == switch && !h.is_multiple_of(2) {
            zero_bubble = true;
        }
        p.push(B { phase: 1, zero_bubble });
        if i == switch && h.is_multiple_of(2) {
            zero_bubble = true;
        }
        p.push(B { phase: 0, zero_bubble });
    }
    // 7. nWB0
    for _ in 0..outer {
        p.extend([W, B { phase: 0, zero_bubble: true }]);
    }
    // 8. nW
    p.extend((0..=h).map(|_| W));
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forwards and backwards per phase, zero-bubble backwards, weight steps.
    fn census(p: &[DualStep]) -> ([usize; 2], [usize; 2], usize, usize) {
        let (mut fwd, mut bwd, mut zb, mut w) = ([0; 2], [0; 2], 0, 0);
        for s in p {
            match *s {
                DualStep::Forward { phase, .. } => fwd[phase] += 1,
                DualStep::Backward { phase, zero_bubble } => {
                    bwd[phase] += 1;
                    zb += usize::from(zero_bubble);
                }
                DualStep::ForwardBackward { forward, backward } => {
                    fwd[forward] += 1;
                    bwd[backward] += 1;
                }
                DualStep::Weight => w += 1,
            }
        }
        (fwd, bwd, zb, w)
    }

    #[test]
    fn every_rank_runs_each_micro_batch_once_per_phase_and_every_deferred_weight_gradient() {
        for ranks in [2, 4, 8, 16] {
            for micro_batches in [2 * ranks, 2 * ranks + 2, 10 * ranks] {
                for rank in 0..ranks {
                    let p = dualpipe_program(ranks, rank, micro_batches).unwrap();
                    let (fwd, bwd, zb, w) = census(&p);
                    let half = micro_batches / 2;
                    assert_eq!((fwd, bwd), ([half; 2], [half; 2]), "ranks {ranks} rank {rank} mbs {micro_batches}");
                    assert_eq!(zb, w, "ranks {ranks} rank {rank}");
                    // A weight step never comes before the zero-bubble backward it belongs to.
                    let mut owed = 0i64;
                    for s in &p {
                        match s {
                            DualStep::Backward { zero_bubble: true, .. } => owed += 1,
                            DualStep::Weight => {
                                owed -= 1;
                                assert!(owed >= 0);
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn two_ranks_warm_up_with_one_forward_per_phase_then_pair_forward_with_backward() {
        // Both ranks of a 2-rank pipeline are middle ranks.
        let p = dualpipe_program(2, 0, 8).unwrap();
        use DualStep::*;
        assert_eq!(
            p,
            vec![
                Forward { phase: 0, send_after_next: false },
                Forward { phase: 1, send_after_next: true },
                Forward { phase: 0, send_after_next: true },
                Backward { phase: 1, zero_bubble: false },
                ForwardBackward { forward: 1, backward: 0 },
                ForwardBackward { forward: 0, backward: 1 },
                ForwardBackward { forward: 1, backward: 0 },
                ForwardBackward { forward: 0, backward: 1 },
                ForwardBackward { forward: 1, backward: 0 },
                Backward { phase: 1, zero_bubble: false },
                Backward { phase: 0, zero_bubble: true },
                Weight,
            ]
        );
    }

    #[test]
    fn odd_or_too_few_micro_batches_are_rejected_with_the_rule() {
        let e = dualpipe_program(4, 0, 6).unwrap_err().to_string();
        assert!(e.contains("micro_batches") && e.contains(">= 8"), "{e}");
        assert!(dualpipe_program(4, 0, 9).is_err());
        assert!(dualpipe_program(3, 0, 12).is_err());
    }
}
