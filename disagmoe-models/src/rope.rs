//! Rotary position embeddings (RoPE): default, linear and YaRN frequency tables, half-split rotation
//! as in transformers' `rotate_half`, and the interleaved layout DeepSeek checkpoints use.
//!
//! The tables are computed the way transformers computes them, in f32: `inv_freq[i] =
//! 1 / theta^(2i / d)` (YaRN blends interpolated and extrapolated frequencies with a linear ramp),
//! `angle = position * inv_freq`, `emb = cat(angle, angle)`, and cos/sin multiplied by the YaRN
//! attention factor.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// How rotary position embeddings are scaled (`rope_scaling` / `rope_parameters` in `config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: "default"` or no scaling).
    Default,
    /// Position interpolation: positions divided by `factor` (`rope_type: "linear"`).
    Linear {
        /// Interpolation factor (> 0).
        factor: f64,
    },
    /// YaRN (`rope_type: "yarn"`): NTK-by-parts interpolation plus an attention factor.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length of pre-training.
        original_max_position_embeddings: usize,
        /// Rotations above which dimensions are extrapolated (default 32).
        beta_fast: f64,
        /// Rotations below which dimensions are interpolated (default 1).
        beta_slow: f64,
        /// DeepSeek's `mscale` (with `mscale_all_dim`, sets the attention factor).
        mscale: Option<f64>,
        /// DeepSeek's `mscale_all_dim`.
        mscale_all_dim: Option<f64>,
        /// Explicit attention factor (overrides the one derived from `factor`).
        attention_factor: Option<f64>,
        /// Round the correction range to whole dimensions (default true; GPT-OSS sets false).
        truncate: bool,
    },
}

impl RopeScaling {
    /// Parses a `rope_scaling` / `rope_parameters` object: returns `rope_theta` if the object has one,
    /// and the scaling. `field` names the object in errors.
    pub fn from_hf(field: &str, v: &Value) -> Result<(Option<f64>, RopeScaling)> {
        let obj = match v {
            Value::Null => return Ok((None, RopeScaling::Default)),
            Value::Object(o) => o,
            other => return Err(ModelError::config(field, format!("must be an object or null, got {other}"))),
        };
        let num = |k: &str| obj.get(k).and_then(Value::as_f64);
        let theta = num("rope_theta");
        let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
        let factor = || -> Result<f64> {
            match num("factor") {
                Some(f) if f > 0.0 => Ok(f),
                Some(f) => Err(ModelError::config(format!("{field}.factor"), format!("must be > 0, got {f}"))),
                None => Err(ModelError::config(
                    format!("{field}.factor"),
                    format!("is required for rope_type \"{kind}\" (a number > 0)"),
                )),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "yarn" => RopeScaling::Yarn {
                factor: factor()?,
                original_max_position_embeddings: match obj
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_u64)
                {
                    Some(n) if n > 0 => n as usize,
                    _ => {
                        return Err(ModelError::config(
                            format!("{field}.original_max_position_embeddings"),
                            "is required for rope_type \"yarn\" (a positive integer)",
                        ))
                    }
                },
                beta_fast: num("beta_fast").unwrap_or(32.0),
                beta_slow: num("beta_slow").unwrap_or(1.0),
                mscale: num("mscale"),
                mscale_all_dim: num("mscale_all_dim"),
                attention_factor: num("attention_factor"),
                truncate: obj.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            },
            other => {
                return Err(ModelError::config(
                    format!("{field}.rope_type"),
                    format!("`{other}` is not supported; allowed: \"default\", \"linear\", \"yarn\""),
                ))
            }
        };
        Ok((theta, scaling))
    }

    /// The object transformers 4.x writes as `rope_scaling` (`null` for default RoPE).
    pub fn to_hf(&self) -> Value {
        match self {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => serde_json::json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let mut v = serde_json::json!({
                    "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original_max_position_embeddings,
                    "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate,
                });
                let o = v.as_object_mut().expect("object");
                for (k, x) in
                    [("mscale", mscale), ("mscale_all_dim", mscale_all_dim), ("attention_factor", attention_factor)]
                {
                    if let Some(x) = x {
                        o.insert(k.into(), serde_json::json!(x));
                    }
                }
                v
            }
        }
    }
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Precomputed frequencies of one rotary embedding.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
    attention_scaling: f32,
}

impl Rope {
    /// RoPE over `head_dim` (even) with base `theta` and optional scaling.
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let theta = theta as f32;
        let mut inv_freq: Vec<f32> =
            (0..head_dim / 2).map(|i| 1.0f32 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        let mut attention_scaling = 1.0f32;
        match scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let d = head_dim as f64;
                let base = theta as f64;
                let correction_dim = |rot: f64| {
                    d * ((*original_max_position_embeddings as f64) / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0) as f32, high.min(d - 1.0) as f32);
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let extrapolation = *f;
                    let interpolation = 1.0f32 / (*factor as f32 * (1.0 / extrapolation));
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    *f = interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
                }
                attention_scaling = match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => *a as f32,
                    (None, Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                        (yarn_mscale(*factor, *m) / yarn_mscale(*factor, *ma)) as f32
                    }
                    _ => yarn_mscale(*factor, 1.0) as f32,
                };
            }
        }
        Self { inv_freq, head_dim, attention_scaling }
    }

    /// `(cos, sin)` tables for positions `0..seq`.
    ///
    /// # Shapes
    /// - output: two `[1, 1, seq, head_dim]` tensors
    pub fn tables<B: Backend>(&self, seq: usize, device: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let d = self.head_dim;
        let mut cos = Vec::with_capacity(seq * d);
        let mut sin = Vec::with_capacity(seq * d);
        for p in 0..seq {
            for _half in 0..2 {
                for &f in &self.inv_freq {
                    let angle = (p as f32 * f) as f64;
                    cos.push(angle.cos() as f32 * self.attention_scaling);
                    sin.push(angle.sin() as f32 * self.attention_scaling);
                }
            }
        }
        (
            Tensor::from_data(TensorData::new(cos, [1, 1, seq, d]), device),
            Tensor::from_data(TensorData::new(sin, [1, 1, seq, d]), device),
        )
    }
}

/// The rotary tables of `docs`' rows: when their positions restart at each document
/// ([`Documents::restarting_positions`]), the rows of `cos`, `sin` (`[1, 1, S, D]`, positions
/// `0..S`) at each token's position within its document, `[B, 1, S, D]`; else the tables as they
/// are (every row counts positions from its start).
///
/// # Panics
/// If `docs` covers rows of another length than the tables.
pub fn document_tables<B: Backend>(
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    docs: Option<&disagmoe_kernels::documents::Documents>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let Some(d) = docs.filter(|d| d.restarts_positions()) else { return (cos, sin) };
    let [_, _, s, dim] = cos.dims();
    assert_eq!(d.seq(), s, "documents over rows of the tables' length");
    let positions: Vec<i64> = d.positions().into_iter().map(|p| p as i64).collect();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [d.batch() * s]), &cos.device());
    let at = |t: Tensor<B, 4>| t.reshape([s, dim]).select(0, idx.clone()).reshape([d.batch(), 1, s, dim]);
    (at(cos), at(sin))
}

/// `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = cat(-x[.., d/2..], x[.., ..d/2])`.
///
/// # Shapes
/// - x: `[batch, heads, seq, head_dim]`; cos, sin: `[1, 1, seq, head_dim]`
pub fn apply_rotary<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}

/// Reorders the last dimension from interleaved pairs `(x0, x1, x2, x3, ...)` to halves
/// `(x0, x2, ..., x1, x3, ...)`, as transformers' `apply_rotary_pos_emb_interleave` does before the
/// half-split rotation (DeepSeek checkpoints with `rope_interleave`).
///
/// # Shapes
/// - x: `[batch, heads, seq, d]` -> same
pub fn deinterleave<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let order: Vec<i64> = (0..d / 2).map(|i| 2 * i as i64).chain((0..d / 2).map(|i| 2 * i as i64 + 1)).collect();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(order, [d]), &x.device());
    x.select(3, idx)
}
