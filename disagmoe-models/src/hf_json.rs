//! Helpers every `config.json` parser shares: JSON with the offending field's path in errors, file
//! reading, and the usual numeric checks (each error names the field and the allowed values).

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::error::{ModelError, Result};

/// Deserialises `text`; a type error names the field's path.
pub(crate) fn parse_raw<T: DeserializeOwned>(text: &str) -> Result<T> {
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| ModelError::ConfigParse {
        path: "config.json".into(),
        field: e.path().to_string(),
        source: e.into_inner(),
    })
}

/// Reads `path` and parses it with `parse`, naming the file in parse errors.
pub(crate) fn read_config<T>(path: &Path, parse: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        action: "cannot read model config",
        path: path.into(),
        source,
    })?;
    parse(&text).map_err(|e| match e {
        ModelError::ConfigParse { field, source, .. } => ModelError::ConfigParse { path: path.into(), field, source },
        other => other,
    })
}

/// A positive integer field, with an optional default.
pub(crate) fn positive(field: &str, v: Option<i64>, default: Option<i64>) -> Result<usize> {
    match v.or(default) {
        None => Err(ModelError::config(field, "is required (a positive integer)")),
        Some(x) if x <= 0 => Err(ModelError::config(field, format!("must be a positive integer, got {x}"))),
        Some(x) => Ok(x as usize),
    }
}

/// A non-negative integer field with a default.
pub(crate) fn non_negative(field: &str, v: Option<i64>, default: i64) -> Result<usize> {
    match v.unwrap_or(default) {
        x if x < 0 => Err(ModelError::config(field, format!("must be >= 0, got {x}"))),
        x => Ok(x as usize),
    }
}

/// A finite positive number field with a default.
pub(crate) fn positive_f64(field: &str, v: Option<f64>, default: f64) -> Result<f64> {
    match v.unwrap_or(default) {
        x if x.is_finite() && x > 0.0 => Ok(x),
        x => Err(ModelError::config(field, format!("must be a finite number > 0, got {x}"))),
    }
}

/// Checks `model_type` (when the file gives one) against the one this parser reads.
pub(crate) fn expect_model_type(found: Option<&str>, expected: &str) -> Result<()> {
    match found {
        Some(mt) if mt != expected => Err(ModelError::config(
            "model_type",
            format!("`{mt}` is not supported by this loader; allowed: \"{expected}\""),
        )),
        _ => Ok(()),
    }
}

/// An optional token id (`pad_token_id`: absent, `null`, or an id inside the vocabulary).
pub(crate) fn token_id(field: &str, v: Option<&serde_json::Value>, vocab: usize) -> Result<Option<usize>> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(x) => match x.as_i64() {
            Some(id) if id >= 0 && (id as usize) < vocab => Ok(Some(id as usize)),
            _ => Err(ModelError::config(field, format!("must be null or a token id in 0..{vocab}, got {x}"))),
        },
    }
}
