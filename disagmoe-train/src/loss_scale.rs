//! Dynamic loss scaling for f16 (`--precision f16`): the loss is multiplied by a scale before the
//! backward so that small gradients do not vanish below f16's smallest normal (6e-5), and the
//! gradients are divided by it again before clipping and the update. A step whose gradients
//! overflow (any non-finite value) is skipped and the scale halves; after `window` steps in a row
//! without an overflow it doubles (PyTorch's `GradScaler` policy and defaults: 2^16, 2000).
//!
//! The training loop owns the scaler (one for the run, whatever the placement: every worker of a
//! distributed run gets the same scale with each step and decides alike on the same global
//! gradient norm), and checkpoints its state.

use serde::{Deserialize, Serialize};

/// The state of the scaler, as a checkpoint keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The current scale.
    pub scale: f64,
    /// Steps without an overflow since the scale last changed.
    pub good_steps: usize,
}

/// A dynamic loss scale (or none: scale 1, never changing).
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    state: Option<LossScaleState>,
    window: usize,
}

/// The scale never goes below this (an overflow at scale 1 is not an f16 range problem).
const MIN_SCALE: f64 = 1.0;

impl LossScaler {
    /// No scaling.
    pub fn off() -> Self {
        Self { state: None, window: 0 }
    }

    /// Dynamic scaling from `initial` (or from a checkpoint's `resumed` state), doubling after
    /// `window` good steps.
    pub fn dynamic(initial: f64, window: usize, resumed: Option<LossScaleState>) -> Self {
        Self { state: Some(resumed.unwrap_or(LossScaleState { scale: initial, good_steps: 0 })), window }
    }

    /// The scale of the next step (1 when off).
    pub fn scale(&self) -> f64 {
        self.state.map_or(1.0, |s| s.scale)
    }

    /// The state to checkpoint (`None` when off).
    pub fn state(&self) -> Option<LossScaleState> {
        self.state
    }

    /// Records a step: `overflow` when its loss or gradients were not finite (the engine skipped
    /// its update). Halves the scale on overflow, doubles it after `window` good steps.
    pub fn update(&mut self, overflow: bool) {
        let window = self.window;
        if let Some(s) = &mut self.state {
            if overflow {
                s.scale = (s.scale * 0.5).max(MIN_SCALE);
                s.good_steps = 0;
            } else {
                s.good_steps += 1;
                if s.good_steps >= window {
                    s.scale *= 2.0;
                    s.good_steps = 0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_a_window_of_good_steps() {
        let mut s = LossScaler::dynamic(65536.0, 3, None);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 32768.0);
        s.update(false);
        assert_eq!(s.scale(), 65536.0);
        assert_eq!(s.state(), Some(LossScaleState { scale: 65536.0, good_steps: 0 }));
        let mut low = LossScaler::dynamic(1.0, 3, None);
        low.update(true);
        assert_eq!(low.scale(), 1.0, "never below 1");
        let mut off = LossScaler::off();
        off.update(true);
        assert_eq!((off.scale(), off.state()), (1.0, None));
        let resumed = LossScaler::dynamic(65536.0, 3, Some(LossScaleState { scale: 8.0, good_steps: 2 }));
        assert_eq!(resumed.scale(), 8.0);
    }
}
