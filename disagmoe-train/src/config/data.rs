//! `[data]`: the corpus, its tokenizer, and the shape of a batch.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::data::blend::{check_blend, describe_blend, parse_blend, BlendSource};
use crate::error::{Result, TrainError};

/// `blend` in TOML: Megatron's syntax in a string, or a list of `{ weight, path }` tables (each
/// table's own error when one is malformed; an empty list refused).
fn blend_from_toml<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<BlendSource>, D::Error> {
    use serde::de::Error;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Blend {
        Text(String),
        Tables(Vec<toml::Table>),
    }
    let tables = match Blend::deserialize(d)
        .map_err(|_| D::Error::custom("blend is a string (`0.7 a 0.3 b`) or a list of { weight, path } tables"))?
    {
        Blend::Text(text) => return parse_blend(&[text]).map_err(D::Error::custom),
        Blend::Tables(t) if t.is_empty() => {
            return Err(D::Error::custom("blend is an empty list: give at least one { weight, path }, or leave it out"))
        }
        Blend::Tables(t) => t,
    };
    let sources = (tables.into_iter().enumerate())
        .map(|(i, t)| {
            toml::Value::Table(t).try_into().map_err(|e: toml::de::Error| D::Error::custom(format!("blend[{i}]: {e}")))
        })
        .collect::<std::result::Result<Vec<BlendSource>, _>>()?;
    check_blend(&sources).map_err(D::Error::custom)?;
    Ok(sources)
}

/// What a step reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataOptions {
    /// Training data: a UTF-8 text file, a `disagmoe tokenize` directory or a Megatron `.bin`/`.idx`
    /// pair. Default: the bundled public-domain corpus (flag `--data`, flat key `data`).
    pub path: Option<PathBuf>,
    /// A weighted mixture of datasets instead of `path` (Megatron's blend, [`crate::data::blend`]):
    /// in TOML `blend = "0.7 tokens/web 0.3 tokens/code"` or a list of `{ weight, path }` tables;
    /// on the command line `--data 0.7 tokens/web 0.3 tokens/code`. Empty: not a blend.
    #[serde(deserialize_with = "blend_from_toml", skip_serializing_if = "Vec::is_empty")]
    pub blend: Vec<BlendSource>,
    /// A Hugging Face `tokenizer.json`. Default: the checkpoint's own if it has one, else bytes.
    pub tokenizer: Option<PathBuf>,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Share of the corpus's windows held out for evaluation (evenly spread), never trained on.
    pub eval_fraction: f64,
    /// Evaluate the held-out windows every this many steps and at the last step (0: never).
    pub eval_every: usize,
    /// Batches of held-out windows one evaluation reads at most (fewer when the split is smaller).
    pub eval_batches: usize,
    /// Attention within each document of a packed window, and no loss on the token after an
    /// end-of-document: `auto` (on for data with a document index: a `disagmoe tokenize`
    /// directory or a Megatron pair; off for text), `on`, or `off`.
    pub document_mask: DocumentMask,
    /// Rotary positions under a document mask: `continue` (counted from each window's start, as
    /// Megatron packs by default) or `restart` (from each document's start, Megatron's
    /// `--reset-position-ids`; needs the mask).
    pub document_positions: DocumentPositions,
}

/// Where rotary positions count from in a window masked by document
/// ([`DataOptions::document_positions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DocumentPositions {
    /// From the window's start.
    #[default]
    Continue,
    /// From each document's start.
    Restart,
}

impl DocumentPositions {
    /// The names the option accepts.
    pub const NAMES: [&'static str; 2] = ["continue", "restart"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Continue => "continue",
            Self::Restart => "restart",
        }
    }
}

impl std::str::FromStr for DocumentPositions {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "continue" => Ok(Self::Continue),
            "restart" => Ok(Self::Restart),
            _ => Err(format!("unknown document positions {s:?} (allowed: {})", Self::NAMES.join(", "))),
        }
    }
}

/// Whether packed windows are masked by document ([`DataOptions::document_mask`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DocumentMask {
    /// On where the data has a document index (token shards), off for text.
    #[default]
    Auto,
    /// On: data without a document index (text) is refused.
    On,
    /// Off: windows attend across documents, as packed text always does.
    Off,
}

impl DocumentMask {
    /// The names the option accepts.
    pub const NAMES: [&'static str; 3] = ["auto", "on", "off"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl std::str::FromStr for DocumentMask {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ => Err(format!("unknown document mask {s:?} (allowed: {})", Self::NAMES.join(", "))),
        }
    }
}

/// Default [`DataOptions::eval_fraction`]: 2% of the windows.
pub const DEFAULT_EVAL_FRACTION: f64 = 0.02;

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            path: None,
            blend: Vec::new(),
            tokenizer: None,
            batch: 8,
            seq: 128,
            eval_fraction: DEFAULT_EVAL_FRACTION,
            eval_every: 0,
            eval_batches: 8,
            document_mask: DocumentMask::Auto,
            document_positions: DocumentPositions::Continue,
        }
    }
}

impl DataOptions {
    /// Checks the section; the error names the option and the allowed values.
    pub fn validate(&self) -> Result<()> {
        if !self.blend.is_empty() {
            check_blend(&self.blend)?;
            if let Some(path) = &self.path {
                return Err(TrainError::option(
                    "data",
                    format!("give one dataset (path {}) or a blend, not both", path.display()),
                ));
            }
        }
        if self.batch == 0 {
            return Err(TrainError::option("batch", "must be at least 1"));
        }
        if self.seq < 2 {
            return Err(TrainError::option("seq", format!("must be at least 2 tokens, got {}", self.seq)));
        }
        if self.batch.checked_mul(self.seq).is_none() {
            return Err(TrainError::option(
                "seq",
                format!("batch ({}) x seq ({}) tokens per step is beyond any memory", self.batch, self.seq),
            ));
        }
        if !(0.0..=0.5).contains(&self.eval_fraction) {
            return Err(TrainError::option(
                "eval_fraction",
                format!("must be in 0..=0.5 (a share of the corpus held out), got {}", self.eval_fraction),
            ));
        }
        if self.eval_every > 0 && self.eval_fraction == 0.0 {
            return Err(TrainError::option("eval_every", "needs held-out data: eval_fraction must be above 0"));
        }
        if self.document_positions == DocumentPositions::Restart && self.document_mask == DocumentMask::Off {
            return Err(TrainError::option(
                "document_positions",
                "restart needs document masks: set document_mask to auto or on (or positions to continue)",
            ));
        }
        if self.eval_batches == 0 {
            return Err(TrainError::option("eval_batches", "must be at least 1"));
        }
        Ok(())
    }

    /// Reads `path` as a blend when it is one (`data = "0.7 tokens/web 0.3 tokens/code"`, or the
    /// values of `--data`: see [`crate::data::blend::is_blend`]).
    pub fn blend_from_path(&mut self) -> Result<()> {
        let Some(text) = self.path.as_ref().and_then(|p| p.to_str()) else { return Ok(()) };
        if crate::data::blend::is_blend(&[text]) {
            if !self.blend.is_empty() {
                return Err(TrainError::option("data", "give one blend (data or blend), not both"));
            }
            self.blend = parse_blend(&[text])?;
            self.path = None;
        }
        Ok(())
    }

    /// The data in words: the blend in Megatron's syntax, the path, or the bundled corpus.
    pub fn describe(&self) -> String {
        match &self.path {
            _ if !self.blend.is_empty() => describe_blend(&self.blend),
            Some(p) => p.display().to_string(),
            None => crate::data::BUNDLED_CORPUS_NAME.into(),
        }
    }

    /// Whether the run's windows will be masked by document: `on`, or `auto` with a source that
    /// has a document index (token shards; text, the bundled corpus included, has none).
    pub fn masks_documents(&self) -> bool {
        use crate::data::{data_kind, DataKind};
        let indexed = |p: &std::path::Path| data_kind(p) != DataKind::Text;
        match self.document_mask {
            DocumentMask::Off => false,
            DocumentMask::On => true,
            DocumentMask::Auto => {
                self.path.as_deref().is_some_and(indexed) || self.blend.iter().any(|s| indexed(&s.path))
            }
        }
    }

    /// Tokens in one step's batch.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `run_config_toml` fuzz target's check: `batch = 2^32`, `seq = 2^32` validated,
    /// and the tokens per step (`batch x seq`) overflowed.
    #[test]
    fn tokens_per_step_that_overflow_are_refused() {
        let d = DataOptions { batch: 1 << 32, seq: 1 << 32, ..DataOptions::default() };
        let e = d.validate().unwrap_err().to_string();
        assert!(e.contains("seq") && e.contains("tokens per step"), "{e}");
        let d = DataOptions { batch: 1 << 20, seq: 1 << 20, ..DataOptions::default() };
        assert!(d.validate().is_ok());
        assert_eq!(d.tokens_per_step(), 1 << 40);
    }

    #[test]
    fn a_blend_is_read_from_toml_in_either_form_and_from_the_flat_key() {
        use crate::config::RunConfig;
        let want = vec![
            BlendSource { weight: 0.7, path: "tokens/web".into() },
            BlendSource { weight: 0.3, path: "tokens/code".into() },
        ];
        for text in [
            "[data]\nblend = \"0.7 tokens/web 0.3 tokens/code\"\n",
            "[data]\nblend = [{ weight = 0.7, path = \"tokens/web\" }, { weight = 0.3, path = \"tokens/code\" }]\n",
            "data = \"0.7 tokens/web 0.3 tokens/code\"\n",
            "blend = \"0.7 tokens/web   0.3 tokens/code\"\n",
        ] {
            let cfg = RunConfig::from_toml_str(text).unwrap();
            assert_eq!((cfg.data.blend.clone(), cfg.data.path.clone()), (want.clone(), None), "{text}");
            cfg.data.validate().unwrap();
            assert_eq!(cfg.data.describe(), "0.7 tokens/web 0.3 tokens/code");
        }
        let e = RunConfig::from_toml_str("[data]\nblend = \"-1 a 2 b\"\n").unwrap_err();
        assert!(e.contains("at least 0"), "{e}");
        let cfg = RunConfig::from_toml_str("[data]\npath = \"c.txt\"\nblend = \"1 a\"\n").unwrap();
        let e = cfg.data.validate().unwrap_err().to_string();
        assert!(e.contains("not both"), "{e}");
        let e = RunConfig::from_toml_str("[data]\nblend = [{ weight = 0.0, path = \"a\" }]\n").unwrap_err();
        assert!(e.contains("sum to 0"), "{e}");
        let e = RunConfig::from_toml_str("[data]\nblend = [{ weight = 1.0, pth = \"a\" }]\n").unwrap_err();
        assert!(e.contains("blend[0]") && e.contains("pth"), "{e}");
        let e = RunConfig::from_toml_str("[data]\nblend = []\n").unwrap_err();
        assert!(e.contains("empty list"), "{e}");
    }
}
