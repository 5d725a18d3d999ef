//! Text generation: the prompt in one cached forward pass, then one token at a time through the
//! [`crate::kv_cache`], greedy or sampled (temperature, nucleus), seeded.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};
use crate::families::MoeCausalLm;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits before the softmax; 0 is greedy (the most likely token, the lowest id on
    /// a tie, as `torch.argmax`).
    pub temperature: f64,
    /// Nucleus sampling: draw from the most likely tokens whose probabilities first add up to at
    /// least `top_p` (1: every token).
    pub top_p: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_p: 1.0, seed: 0 }
    }

    /// Refuses values outside the allowed ranges, naming them.
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::InvalidInput(format!(
                "temperature {} is not allowed: a finite value >= 0 (0 is greedy)",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidInput(format!("top_p {} is not allowed: 0 < top_p <= 1", self.top_p)));
        }
        Ok(())
    }
}

/// Chooses the next token from one row of logits.
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded with `sampling.seed`; refuses invalid settings.
    pub fn new(sampling: Sampling) -> Result<Self> {
        sampling.check()?;
        Ok(Self { sampling, rng: StdRng::seed_from_u64(sampling.seed) })
    }

    /// The next token id for `logits` (one per vocabulary entry).
    pub fn next(&mut self, logits: &[f32]) -> usize {
        let greedy = |l: &[f32]| {
            l.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
        };
        if self.sampling.temperature == 0.0 {
            return greedy(logits);
        }
        // Softmax of logits / T in f64, most likely first (ties: lower id first).
        let t = self.sampling.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut probs: Vec<(usize, f64)> =
            logits.iter().enumerate().map(|(i, &x)| (i, ((x as f64 - max) / t).exp())).collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        if !(total.is_finite() && total > 0.0) {
            // Non-finite logits leave nothing to draw from; the most likely token stands.
            return greedy(logits);
        }
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        // The nucleus: the most likely tokens until their mass reaches top_p (at least one).
        let mut kept = 0;
        let mut mass = 0.0;
        for &(_, p) in &probs {
            kept += 1;
            mass += p / total;
            if mass >= self.sampling.top_p {
                break;
            }
        }
        let nucleus = &probs[..kept];
        let sum: f64 = nucleus.iter().map(|p| p.1).sum();
        let mut draw = self.rng.random::<f64>() * sum;
        for &(id, p) in nucleus {
            if draw < p {
                return id;
            }
            draw -= p;
        }
        nucleus[kept - 1].0
    }
}

/// Up to `max_new_tokens` tokens after `prompt`, ending early after a token of `stop`; calls
/// `on_token` with each as it is chosen. The prompt runs in one cached forward pass, then each new
/// token in one pass over its own position.
pub fn generate<B: Backend>(
    model: &MoeCausalLm<B>,
    prompt: &[i64],
    max_new_tokens: usize,
    stop: &[i64],
    sampling: Sampling,
    device: &B::Device,
    mut on_token: impl FnMut(i64),
) -> Result<Vec<i64>> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidInput("the prompt has no tokens: give at least one".into()));
    }
    if let Some(max) = model.config().max_positions() {
        if prompt.len() > max || max_new_tokens > max - prompt.len() {
            return Err(ModelError::InvalidInput(format!(
                "a prompt of {} tokens and {max_new_tokens} new ones go past the model's {max} positions \
                 (max_position_embeddings): at most {} new tokens",
                prompt.len(),
                max.saturating_sub(prompt.len())
            )));
        }
    }
    let mut sampler = Sampler::new(sampling)?;
    let ids = model.input_ids(&[prompt.to_vec()], device)?;
    let mut cache = model.new_cache();
    let mut logits = model.forward_cached(ids, &mut cache); // [1, S, V]
    let mut out = Vec::with_capacity(max_new_tokens);
    while out.len() < max_new_tokens {
        let [_, s, v] = logits.dims();
        let last: Vec<f32> = logits
            .narrow(1, s - 1, 1)
            .reshape([v])
            .into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| ModelError::InvalidInput(format!("logits cannot be read back: {e:?}")))?;
        let next = sampler.next(&last) as i64;
        out.push(next);
        on_token(next);
        if stop.contains(&next) || out.len() == max_new_tokens {
            break;
        }
        let step = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![next], [1, 1]), device);
        logits = model.forward_cached(step, &mut cache);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_stays_in_the_nucleus() {
        let mut g = Sampler::new(Sampling::greedy()).unwrap();
        assert_eq!(g.next(&[0.5, 2.0, 2.0, -1.0]), 1);
        // Probabilities 0.6, 0.3, 0.1 at T = 1: top_p 0.5 keeps only the first, 0.8 the first two.
        let logits = [0.3f32.ln(), 0.6f32.ln(), 0.1f32.ln()];
        let mut one = Sampler::new(Sampling { temperature: 1.0, top_p: 0.5, seed: 3 }).unwrap();
        assert!((0..200).all(|_| one.next(&logits) == 1));
        let mut two = Sampler::new(Sampling { temperature: 1.0, top_p: 0.8, seed: 3 }).unwrap();
        let draws: Vec<usize> = (0..2000).map(|_| two.next(&logits)).collect();
        assert!(!draws.contains(&2));
        let first = draws.iter().filter(|&&d| d == 1).count() as f64 / draws.len() as f64;
        assert!((first - 2.0 / 3.0).abs() < 0.05, "share of the likelier token {first}");
        // The same seed draws the same tokens.
        let mut again = Sampler::new(Sampling { temperature: 1.0, top_p: 0.8, seed: 3 }).unwrap();
        assert_eq!((0..2000).map(|_| again.next(&logits)).collect::<Vec<_>>(), draws);
    }

    #[test]
    fn bad_settings_are_named_with_the_allowed_range() {
        for (t, p, what) in
            [(-1.0, 1.0, "temperature"), (f64::NAN, 1.0, "temperature"), (1.0, 0.0, "top_p"), (1.0, 1.5, "top_p")]
        {
            let e = Sampler::new(Sampling { temperature: t, top_p: p, seed: 0 }).err().unwrap().to_string();
            assert!(e.contains(what) && e.contains("allowed"), "{e}");
        }
    }
}
