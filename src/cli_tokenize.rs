//! `disagmoe tokenize`: text, JSONL and Parquet documents into token shards.

use std::path::PathBuf;

use clap::Args;
use disagmoe_train::data::tokenize::{tokenize, TokenizeOptions, TokenizeReport, DEFAULT_SHARD_TOKENS};

/// Arguments of `disagmoe tokenize`.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Text files (one document each), JSONL files (`.jsonl`/`.ndjson`/`.json`, one document per
    /// line), Parquet files (`.parquet`, one document per row), or directories of them.
    #[arg(long, required = true, num_args = 1.., value_name = "PATH")]
    pub input: Vec<PathBuf>,
    /// The directory to write (must not exist): `dataset.json` and Megatron `.bin`/`.idx` shards;
    /// train on it with `--data DIR`.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Hugging Face tokenizer.json. Default: byte-level (256 ids).
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// The JSON field / Parquet column holding each document's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// End-of-document token (its text, e.g. `<|endoftext|>`, or its id). Default: the
    /// tokenizer_config.json's eos_token beside the tokenizer, else a usual one it has; 0 for bytes.
    #[arg(long, value_name = "TOKEN|ID")]
    pub eos: Option<String>,
    /// Tokens per shard (a shard ends after the document that reaches it).
    #[arg(long, default_value_t = DEFAULT_SHARD_TOKENS)]
    pub shard_tokens: u64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs `disagmoe tokenize` and prints its JSON report.
pub fn run_tokenize(args: &TokenizeArgs) -> anyhow::Result<TokenizeReport> {
    let report = tokenize(&TokenizeOptions {
        inputs: args.input.clone(),
        out: args.out.clone(),
        tokenizer: args.tokenizer.clone(),
        text_field: args.text_field.clone(),
        eos: args.eos.clone(),
        shard_tokens: args.shard_tokens,
        progress: !args.quiet,
    })?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(report)
}
