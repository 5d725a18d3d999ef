//! Using a trained checkpoint: `disagmoe generate` (text, token by token through the KV cache) and
//! `disagmoe eval` (the held-out loss).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use disagmoe_models::generate::{generate, Sampling};
use disagmoe_models::{HfCheckpoint, MoeCausalLm};
use disagmoe_train::config::data::DEFAULT_EVAL_FRACTION;
use disagmoe_train::data::{tokenizer_for, PackedDataset, Packing, Tokenizer, BUNDLED_CORPUS_NAME};
use disagmoe_train::DefaultBackend;

/// `disagmoe generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json + safetensors), e.g. a run's `final/`.
    #[arg(long, value_name = "DIR")]
    pub model_dir: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to add at most (fewer when the end-of-sequence token comes).
    #[arg(long, default_value_t = 200, value_name = "N")]
    pub max_new_tokens: usize,
    /// Divides the logits before sampling; 0 is greedy.
    #[arg(long, default_value_t = 0.8, value_name = "T", allow_negative_numbers = true)]
    pub temperature: f64,
    /// Nucleus sampling: draw from the likeliest tokens holding this much probability (1: all).
    #[arg(long, default_value_t = 0.95, value_name = "P")]
    pub top_p: f64,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A `tokenizer.json` [default: the model directory's, else byte-level].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Keep going past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON line (prompt, text, token ids, speed) instead of streaming the text.
    #[arg(long)]
    pub json: bool,
}

/// The tokenizer to read a checkpoint's text with: `explicit`, else the directory's
/// `tokenizer.json`, else bytes (refused when the vocabulary cannot hold them).
fn checkpoint_tokenizer(dir: &Path, explicit: Option<&Path>, vocab: usize) -> anyhow::Result<Box<dyn Tokenizer>> {
    if explicit.is_none() && !dir.join("tokenizer.json").exists() && vocab < 256 {
        bail!(
            "{} has no tokenizer.json and its vocabulary ({vocab} ids) is too small for byte-level text (256 ids): \
             pass --tokenizer FILE",
            dir.display()
        );
    }
    Ok(tokenizer_for(explicit, Some(dir))?)
}

/// What `generate` produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generated {
    /// The prompt as given.
    pub prompt: String,
    /// The text of the new tokens.
    pub text: String,
    /// The prompt's token ids.
    pub prompt_tokens: Vec<i64>,
    /// The new token ids.
    pub tokens: Vec<i64>,
    /// New tokens per second (the prompt's pass included).
    pub tokens_per_s: f64,
    /// The tokenizer used.
    pub tokenizer: String,
}

/// The end-of-sequence ids of a checkpoint: `generation_config.json`'s, else `config.json`'s
/// `eos_token_id` (one id or a list; absent or null: none).
fn eos_ids(dir: &Path) -> anyhow::Result<Vec<i64>> {
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => return Ok(n.as_i64().into_iter().collect()),
            Some(serde_json::Value::Array(a)) => return Ok(a.iter().filter_map(|x| x.as_i64()).collect()),
            _ => {}
        }
    }
    Ok(Vec::new())
}

/// Streams text as tokens come: prints what the ids decode to beyond what was printed, holding
/// back an unfinished multi-byte character (shown as U+FFFD until its last byte arrives).
struct Stream<'a> {
    tokenizer: &'a dyn Tokenizer,
    ids: Vec<u32>,
    shown: usize,
}

impl Stream<'_> {
    fn push(&mut self, id: i64, out: &mut impl Write) -> anyhow::Result<()> {
        self.ids.push(id as u32);
        let text = self.tokenizer.decode(&self.ids)?;
        if !text.ends_with('\u{FFFD}') && text.len() > self.shown && text.is_char_boundary(self.shown) {
            write!(out, "{}", &text[self.shown..])?;
            out.flush()?;
            self.shown = text.len();
        }
        Ok(())
    }
}

/// Generates and prints: the text as it comes (stdout), then the speed (stderr); or one JSON line.
pub fn run_generate(args: &GenerateArgs) -> anyhow::Result<Generated> {
    let device = Default::default();
    disagmoe_train::backend::probe::<DefaultBackend>(&device)?;
    let model = MoeCausalLm::<DefaultBackend>::from_pretrained(&args.model_dir, &device)
        .with_context(|| format!("cannot load the model in {}", args.model_dir.display()))?;
    let vocab = model.config().vocab_size();
    let tokenizer = checkpoint_tokenizer(&args.model_dir, args.tokenizer.as_deref(), vocab)?;
    let prompt: Vec<i64> = tokenizer.encode(&args.prompt)?.into_iter().map(i64::from).collect();
    if prompt.is_empty() {
        bail!("--prompt is empty: give some text to continue");
    }
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        bail!(
            "the tokenizer ({}) gives id {id}, beyond the model's vocabulary of {vocab}: pass the tokenizer the model \
             was trained with (--tokenizer)",
            tokenizer.describe()
        );
    }
    let stop = if args.ignore_eos { Vec::new() } else { eos_ids(&args.model_dir)? };
    let sampling = Sampling { temperature: args.temperature, top_p: args.top_p, seed: args.seed };
    sampling.check()?;
    let mut stdout = std::io::stdout();
    if !args.json {
        write!(stdout, "{}", args.prompt)?;
        stdout.flush()?;
    }
    let mut stream = Stream { tokenizer: tokenizer.as_ref(), ids: Vec::new(), shown: 0 };
    let mut failed = None;
    let t0 = Instant::now();
    let tokens = generate(&model, &prompt, args.max_new_tokens, &stop, sampling, &device, |id| {
        if !args.json && failed.is_none() {
            failed = stream.push(id, &mut stdout).err();
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    let seconds = t0.elapsed().as_secs_f64();
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    let generated = Generated {
        prompt: args.prompt.clone(),
        text: tokenizer.decode(&ids)?,
        prompt_tokens: prompt,
        tokens_per_s: tokens.len() as f64 / seconds.max(1e-9),
        tokens,
        tokenizer: tokenizer.describe(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&generated)?);
    } else {
        println!();
        eprintln!("{} tokens, {:.1} tokens/s", generated.tokens.len(), generated.tokens_per_s);
    }
    Ok(generated)
}

/// `disagmoe eval`.
#[derive(Debug, Clone, Args)]
pub struct EvalArgs {
    /// Checkpoint directory (config.json + safetensors), e.g. a run's `final/`.
    #[arg(long, value_name = "DIR")]
    pub model_dir: PathBuf,
    /// Corpus: a UTF-8 text file, a `disagmoe tokenize` directory or a Megatron `.bin`/`.idx`
    /// pair, or a blend of them as `train --data` takes it (`0.7 tokens/web 0.3 tokens/code`: each
    /// source evaluated on its own, the loss their mean weighted as the blend) [default: the
    /// bundled corpus].
    #[arg(long, value_name = "FILE|DIR|BLEND", num_args = 1.., allow_negative_numbers = true)]
    pub data: Option<Vec<PathBuf>>,
    /// A `tokenizer.json` [default: the model directory's, else byte-level].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per window (as in training).
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Windows per forward pass; the held-out split is read in full batches, as `train
    /// --eval-every` with the same --batch reads it.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// The held-out share of the corpus, as `train --eval-fraction` set it (the same windows).
    #[arg(long, default_value_t = DEFAULT_EVAL_FRACTION, value_name = "F")]
    pub eval_fraction: f64,
    /// Every window of the corpus instead of the held-out ones (e.g. a separate test file).
    #[arg(long)]
    pub whole: bool,
    /// Attention within each document of a window, no loss on the token after an
    /// end-of-document, as `train --document-mask` [default: auto, on for token shards].
    #[arg(long, value_name = "auto|on|off", default_value = "auto")]
    pub document_mask: disagmoe_train::DocumentMask,
    /// Rotary positions under the mask, as `train --document-positions`: continue or restart.
    #[arg(long, value_name = "continue|restart", default_value = "continue")]
    pub document_positions: disagmoe_train::DocumentPositions,
}

/// What `eval` measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    /// Mean next-token cross-entropy.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Tokens predicted (`seq - 1` per window, less those that begin another document under a
    /// document mask).
    pub tokens: usize,
    /// Windows read.
    pub windows: usize,
    /// `held-out` or `whole`.
    pub split: &'static str,
    /// The corpus.
    pub corpus: String,
    /// A blend's loss of each source (by its path as given); `loss` is their mean weighted as the
    /// blend.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_source: Option<std::collections::BTreeMap<String, f64>>,
}

/// Evaluates a checkpoint on the held-out windows of a corpus (or all of them) and prints
/// `{"loss", "perplexity", "tokens", ...}`.
pub fn run_eval(args: &EvalArgs) -> anyhow::Result<EvalReport> {
    let device = Default::default();
    disagmoe_train::backend::probe::<DefaultBackend>(&device)?;
    let model = MoeCausalLm::<DefaultBackend>::from_pretrained(&args.model_dir, &device)
        .with_context(|| format!("cannot load the model in {}", args.model_dir.display()))?;
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let vocab = model.config().vocab_size();
    let tokenizer = checkpoint_tokenizer(&args.model_dir, args.tokenizer.as_deref(), vocab)?;
    let tokenizer_path = disagmoe_train::data::tokenizer_file(args.tokenizer.as_deref(), Some(&args.model_dir));
    let packing = Packing { seq: args.seq, seed: 0, model_vocab: vocab, min_windows: 1 };
    let values: Vec<String> = args.data.iter().flatten().map(|p| p.to_string_lossy().into_owned()).collect();
    // One corpus (weight 1), or each source of a blend with its normalised weight.
    let sources: Vec<(f64, Option<PathBuf>)> = if disagmoe_train::data::blend::is_blend(&values) {
        let blend = disagmoe_train::data::blend::parse_blend(&values)?;
        let sum: f64 = blend.iter().map(|s| s.weight).sum();
        blend.into_iter().map(|s| (s.weight / sum, Some(s.path))).collect()
    } else {
        vec![(1.0, args.data.as_ref().and_then(|v| v.first().cloned()))]
    };
    let (mut loss, mut windows, mut split, mut per_source) = (0.0, 0, "held-out", std::collections::BTreeMap::new());
    let mut predicted = 0;
    for (weight, path) in &sources {
        let data = PackedDataset::open(path.as_deref(), tokenizer_path.as_deref(), tokenizer.as_ref(), packing)?;
        let data = data.with_document_mask(args.document_mask)?.with_document_positions(args.document_positions)?;
        let batches = if args.whole {
            split = "whole";
            data.window_batch(0..data.all_windows())
        } else {
            let data = data.hold_out(args.eval_fraction)?;
            let full = data.eval_windows() / args.batch * args.batch;
            if full == 0 {
                bail!(
                    "{} holds out {} windows of {} tokens at --eval-fraction {}, fewer than one batch of {}: raise it, \
                     lower --batch, or pass --whole",
                    data.source(),
                    data.eval_windows(),
                    args.seq,
                    args.eval_fraction,
                    args.batch
                );
            }
            data.eval_batch(0..full)
        };
        let (mut sum, n) = (0.0, batches.len());
        for start in (0..n).step_by(args.batch) {
            let range = start..(start + args.batch).min(n);
            let (rows, docs) = (batches.rows(range.clone())?, batches.documents(range)?);
            predicted += match &docs {
                Some(d) => d.crosses().iter().filter(|&&c| !c).count(),
                None => rows.len() * (args.seq - 1),
            };
            sum += disagmoe_train::single::evaluate_rows(&model, &rows, docs.as_ref(), &device)? * rows.len() as f64;
        }
        let source_loss = sum / n as f64;
        loss += weight * source_loss;
        windows += n;
        per_source.insert(
            path.as_ref().map_or_else(|| BUNDLED_CORPUS_NAME.to_string(), |p| p.display().to_string()),
            source_loss,
        );
    }
    let corpus = if sources.len() > 1 || values.len() > 1 {
        values.join(" ")
    } else {
        sources[0].1.as_ref().map_or_else(|| BUNDLED_CORPUS_NAME.to_string(), |p| p.display().to_string())
    };
    let blend = disagmoe_train::data::blend::is_blend(&values);
    let report = EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens: predicted,
        windows,
        split,
        corpus,
        per_source: blend.then_some(per_source),
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(report)
}
