//! The link model a prediction uses, fitted to a real network ([`fit`]) from the transfers that
//! `disagmoe net-bench` times (issue 33): not the emulator's formula taken on trust.
//!
//! The model ([`NetLink`]), as the prediction's schedule uses it: a message of `b` bytes occupies
//! its sender's port (one message at a time, as the MPI transport's send thread sends them) for
//! `per_message + b / rate`, and arrives `latency` after that; concurrent flows into one port
//! share it (the simulator's max-min fair ports). What that gives for the benchmark's patterns:
//! - ping-pong (one message, time from the send's start to the receive's end): `latency +
//!   per_message + b / rate`;
//! - a burst from one sender to `k` peers, one message each, sent in turn: `latency + k x
//!   (per_message + b / rate)` to the last receive;
//! - an incast of `k` senders into one receiver: `latency + per_message + k x b / rate` (the
//!   receiver's port shared; each sender's overhead in parallel);
//! - an exchange of `k` messages each way between two ranks: as a burst, each direction on its
//!   own ports (full duplex), or twice that when a worker's sends and receives share its port
//!   (half duplex: [`NetLink::half_duplex`], chosen by the fit as the one that explains the
//!   measured exchanges better).
//!
//! [`fit`] takes the rate and the per-message cost from what each further message of a burst adds
//! (per size, the slope of the burst's time over its peers: messages back to back, as a step sends
//! them, free of the latency and of a shaper's head start after idle, e.g. `tc tbf`'s bucket), by
//! least squares over the sizes weighted by 1 / cost (overhead kept non-negative); the latency is
//! what the smallest ping-pong leaves. Every sample is then set beside the model: the ping-pongs
//! and single messages show the idle link's head start, and the incasts and exchanges, held out,
//! test the "concurrent flows share the receiving port" and "the two directions are independent"
//! parts ([`Fitted::incast_error`], [`Fitted::exchange_error`]).

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::runtime::transport::LinkModel;

/// A link as the prediction models it (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NetLink {
    /// Effective rate of a port, Gbit/s (payload bytes).
    pub gbps: f64,
    /// One-way latency after a message's last byte, microseconds.
    pub latency_us: f64,
    /// Time a message holds its sender's port besides its bytes (the MPI protocol's handshakes,
    /// TCP's per-message costs), microseconds.
    #[serde(default)]
    pub per_message_us: f64,
    /// A worker's sends and receives share its port (what a transport whose two directions do
    /// not overlap shows: an exchange taking as long as the sum of its two directions), instead
    /// of one port each way.
    #[serde(default)]
    pub half_duplex: bool,
}

impl From<LinkModel> for NetLink {
    /// The emulated link of `--link-gbps`/`--link-latency-us` (no per-message cost, full duplex).
    fn from(l: LinkModel) -> Self {
        Self { gbps: l.gbps, latency_us: l.latency_us, per_message_us: 0.0, half_duplex: false }
    }
}

/// What `net-bench` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// One message from rank 0 to rank 1.
    PingPong,
    /// Rank 0 sends one message to each of ranks 1..=k, in turn.
    Burst,
    /// Ranks 1..=k each send one message to rank 0 at once.
    Incast,
    /// Ranks 0 and 1 each send the other k messages at once.
    Exchange,
}

impl Pattern {
    /// The words of a table.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::PingPong => "ping-pong",
            Pattern::Burst => "burst 1->k",
            Pattern::Incast => "incast k->1",
            Pattern::Exchange => "exchange k<->k",
        }
    }
}

/// One timed pattern: the median of its repeats and their spread, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub pattern: Pattern,
    /// Peers (receivers of a burst, senders of an incast; 1 for ping-pong).
    pub peers: usize,
    /// Bytes of each message.
    pub bytes: usize,
    pub seconds: f64,
    pub min_s: f64,
    pub max_s: f64,
}

impl NetLink {
    /// Seconds the model gives for `pattern` with `peers` peers and messages of `bytes`.
    pub fn model_s(&self, pattern: Pattern, peers: usize, bytes: usize) -> f64 {
        let [l, o, inv] = self.coefficients();
        let f = features(pattern, peers, bytes, self.half_duplex);
        f[0] * l + f[1] * o + f[2] * inv
    }

    /// Latency, per-message overhead (seconds) and seconds per byte.
    fn coefficients(&self) -> [f64; 3] {
        [self.latency_us * 1e-6, self.per_message_us * 1e-6, 8.0 / (self.gbps * 1e9)]
    }

    /// Seconds a message of `bytes` holds its sender's port.
    pub fn send_s(&self, bytes: f64) -> f64 {
        self.per_message_us * 1e-6 + bytes / self.bytes_per_s()
    }

    /// The rate in bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.gbps * 1e9 / 8.0
    }
}

/// The multipliers of latency, per-message overhead and seconds per byte in a pattern's time
/// (`half_duplex`: a port carries both directions).
fn features(pattern: Pattern, peers: usize, bytes: usize, half_duplex: bool) -> [f64; 3] {
    let (k, b) = (peers as f64, bytes as f64);
    match pattern {
        Pattern::PingPong => [1.0, 1.0, b],
        Pattern::Burst => [1.0, k, k * b],
        Pattern::Incast => [1.0, 1.0, k * b],
        // Both directions through each side's one port, or each on its own.
        Pattern::Exchange if half_duplex => [1.0, 2.0 * k, 2.0 * k * b],
        Pattern::Exchange => [1.0, k, k * b],
    }
}

/// A fitted link and how well it explains what was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fitted {
    pub link: NetLink,
    /// Per sample: the model's seconds and its relative error against the measured median.
    pub rows: Vec<FitRow>,
    /// Largest |relative error| over the fitted samples (ping-pong and bursts), over the held-out
    /// incasts and over the held-out exchanges (`None` without any).
    pub fit_error: f64,
    pub incast_error: Option<f64>,
    #[serde(default)]
    pub exchange_error: Option<f64>,
}

/// One sample beside the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitRow {
    #[serde(flatten)]
    pub sample: Sample,
    pub model_s: f64,
    /// (model - measured) / measured.
    pub error: f64,
    /// Whether the fit used it (the incasts and exchanges are held out).
    pub fitted: bool,
}

/// Solves the least squares of `rows` (features, measured seconds), each weighted by 1 / its
/// seconds, for the coefficients whose index is in `free` (the others 0); `None` when singular.
fn solve(rows: &[([f64; 3], f64)], free: &[usize]) -> Option<[f64; 3]> {
    let n = free.len();
    let mut a = vec![vec![0.0f64; n + 1]; n];
    for (f, t) in rows {
        let w = 1.0 / t;
        for (i, &fi) in free.iter().enumerate() {
            for (j, &fj) in free.iter().enumerate() {
                a[i][j] += w * f[fi] * f[fj];
            }
            a[i][n] += w * f[fi] * t;
        }
    }
    // Gaussian elimination with partial pivoting (at most 3 x 3).
    for c in 0..n {
        let p = (c..n).max_by(|&x, &y| a[x][c].abs().total_cmp(&a[y][c].abs()))?;
        if a[p][c].abs() < 1e-300 {
            return None;
        }
        a.swap(c, p);
        for r in 0..n {
            if r != c {
                let m = a[r][c] / a[c][c];
                for k in c..=n {
                    a[r][k] -= m * a[c][k];
                }
            }
        }
    }
    let mut x = [0.0; 3];
    for (i, &fi) in free.iter().enumerate() {
        x[fi] = a[i][n] / a[i][i];
    }
    Some(x)
}

/// Fits a [`NetLink`] to `samples` (see the module doc); fails, naming what is missing, when the
/// samples cannot determine a rate (bursts to at least two peer counts at two message sizes or
/// more, times that grow with the bytes).
pub fn fit(samples: &[Sample]) -> Result<Fitted> {
    // Per message size, what one more message of a burst adds (least squares of the burst's time
    // over its peers): back-to-back messages, as the transport's send thread sends them, without
    // the latency or an idle link's head start.
    let mut sizes: Vec<usize> = samples.iter().filter(|s| s.pattern == Pattern::Burst).map(|s| s.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut per_message: Vec<([f64; 3], f64)> = Vec::new();
    for &b in &sizes {
        let pts: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.pattern == Pattern::Burst && s.bytes == b)
            .map(|s| (s.peers as f64, s.seconds))
            .collect();
        let n = pts.len() as f64;
        let (mk, mt) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
        let sxx: f64 = pts.iter().map(|p| (p.0 - mk).powi(2)).sum();
        if sxx == 0.0 {
            continue;
        }
        let slope = pts.iter().map(|p| (p.0 - mk) * (p.1 - mt)).sum::<f64>() / sxx;
        if slope > 0.0 {
            per_message.push(([0.0, 1.0, b as f64], slope));
        }
    }
    if per_message.len() < 2 {
        return Err(TrainError::option(
            "samples",
            format!(
                "a link fit needs bursts to two peer counts or more at two message sizes or more, whose time grows \
                 with each message; got {} such sizes (run net-bench on 3 ranks or more, with 2 sizes or more)",
                per_message.len()
            ),
        ));
    }
    // Larger messages must cost more each (sizes ascend).
    if per_message.last().map(|r| r.1) <= per_message.first().map(|r| r.1) {
        return Err(TrainError::option(
            "samples",
            "the measured times do not grow with the message size: no rate fits them",
        ));
    }
    // Per-message cost = overhead + bytes / rate, least squares weighted by 1 / cost, overhead
    // kept >= 0. (Relative errors would let the smallest messages set the rate, and a shaper's
    // bucket lets those through at the veth's speed; absolute ones would let only the largest.)
    let residual =
        |x: &[f64; 3]| -> f64 { per_message.iter().map(|(f, t)| (f[1] * x[1] + f[2] * x[2] - t).powi(2) / t).sum() };
    let best = [&[1usize, 2][..], &[2]]
        .iter()
        .filter_map(|free| solve(&per_message, free))
        .filter(|x| x[1] >= 0.0 && x[2] > 0.0)
        .min_by(|a, b| residual(a).total_cmp(&residual(b)))
        .ok_or_else(|| {
            TrainError::option("samples", "the measured times do not grow with the message size: no rate fits them")
        })?;
    // Latency: what the smallest message's one-way time (ping-pong, else a burst to one peer)
    // leaves after its port time.
    let smallest = |p: Pattern| samples.iter().filter(|s| s.pattern == p && s.peers == 1).min_by_key(|s| s.bytes);
    let latency_s = smallest(Pattern::PingPong)
        .or_else(|| smallest(Pattern::Burst))
        .map_or(0.0, |s| (s.seconds - best[1] - s.bytes as f64 * best[2]).max(0.0));
    let mut link = NetLink {
        gbps: 8.0 / best[2] / 1e9,
        latency_us: latency_s * 1e6,
        per_message_us: best[1] * 1e6,
        half_duplex: false,
    };
    // Full or half duplex: whichever explains the exchanges better (mean |relative error|).
    let exchange_error = |l: &NetLink| {
        let e: Vec<f64> = samples
            .iter()
            .filter(|s| s.pattern == Pattern::Exchange)
            .map(|s| ((l.model_s(s.pattern, s.peers, s.bytes) - s.seconds) / s.seconds).abs())
            .collect();
        e.iter().sum::<f64>() / e.len().max(1) as f64
    };
    let half = NetLink { half_duplex: true, ..link };
    if exchange_error(&half) < exchange_error(&link) {
        link = half;
    }
    let rows: Vec<FitRow> = samples
        .iter()
        .map(|s| {
            let model_s = link.model_s(s.pattern, s.peers, s.bytes);
            let fitted = matches!(s.pattern, Pattern::PingPong | Pattern::Burst);
            FitRow { sample: *s, model_s, error: (model_s - s.seconds) / s.seconds, fitted }
        })
        .collect();
    let worst =
        |p: &[Pattern]| rows.iter().filter(|r| p.contains(&r.sample.pattern)).map(|r| r.error.abs()).reduce(f64::max);
    Ok(Fitted {
        link,
        fit_error: worst(&[Pattern::PingPong, Pattern::Burst]).unwrap_or(0.0),
        incast_error: worst(&[Pattern::Incast]),
        exchange_error: worst(&[Pattern::Exchange]),
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(pattern: Pattern, peers: usize, bytes: usize, seconds: f64) -> Sample {
        Sample { pattern, peers, bytes, seconds, min_s: seconds, max_s: seconds }
    }

    /// Times made by a known link (and a little noise) give that link back; an incast whose port
    /// is shared as the model says is within its noise, one that collapses is reported.
    #[test]
    fn a_fit_recovers_the_link_that_made_the_times() {
        let truth = NetLink { gbps: 0.2, latency_us: 60.0, per_message_us: 150.0, half_duplex: false };
        let mut samples = Vec::new();
        let mut noise = 1.0f64;
        for bytes in [1024, 16 << 10, 128 << 10, 1 << 20] {
            for (pattern, k) in [(Pattern::PingPong, 1), (Pattern::Burst, 1), (Pattern::Burst, 2), (Pattern::Burst, 3)]
            {
                noise = if noise > 1.0 { 0.99 } else { 1.01 };
                samples.push(sample(pattern, k, bytes, truth.model_s(pattern, k, bytes) * noise));
            }
            samples.push(sample(Pattern::Incast, 3, bytes, truth.model_s(Pattern::Incast, 3, bytes)));
        }
        let f = fit(&samples).unwrap();
        let rel = |a: f64, b: f64| (a - b).abs() / b;
        assert!(rel(f.link.gbps, truth.gbps) < 0.02, "{:?}", f.link);
        assert!(rel(f.link.per_message_us, truth.per_message_us) < 0.1, "{:?}", f.link);
        assert!(rel(f.link.latency_us, truth.latency_us) < 0.3, "{:?}", f.link);
        assert!(f.fit_error < 0.03 && f.incast_error.unwrap() < 0.03, "{f:?}");
        // An incast that takes twice what sharing the port would: the check says so.
        samples.push(sample(Pattern::Incast, 3, 1 << 20, 2.0 * truth.model_s(Pattern::Incast, 3, 1 << 20)));
        assert!(fit(&samples).unwrap().incast_error.unwrap() > 0.4);
    }

    /// Exchanges that take as long as both directions one after the other make the fit choose a
    /// half-duplex port; exchanges as fast as one direction, a full-duplex one.
    #[test]
    fn the_fit_chooses_the_duplex_the_exchanges_show() {
        for half in [false, true] {
            let truth = NetLink { gbps: 0.1, latency_us: 20.0, per_message_us: 30.0, half_duplex: half };
            let mut samples = Vec::new();
            for bytes in [16 << 10, 128 << 10, 1 << 20] {
                for (p, k) in [(Pattern::Burst, 1), (Pattern::Burst, 3), (Pattern::Exchange, 1), (Pattern::Exchange, 3)]
                {
                    samples.push(sample(p, k, bytes, truth.model_s(p, k, bytes)));
                }
            }
            let f = fit(&samples).unwrap();
            assert_eq!(f.link.half_duplex, half, "{f:?}");
            assert!(f.exchange_error.unwrap() < 1e-6 && f.incast_error.is_none(), "{f:?}");
        }
    }

    /// No latency in the times: the fit keeps it at zero instead of going negative.
    #[test]
    fn latency_and_overhead_stay_non_negative() {
        let truth = NetLink { gbps: 1.0, latency_us: 0.0, per_message_us: 0.0, half_duplex: false };
        let samples: Vec<Sample> = [1000, 100_000, 1_000_000]
            .iter()
            .flat_map(|&b| [(Pattern::PingPong, 1), (Pattern::Burst, 1), (Pattern::Burst, 3)].map(|(p, k)| (p, k, b)))
            .map(|(p, k, b)| sample(p, k, b, truth.model_s(p, k, b) * if b == 1000 { 0.9 } else { 1.0 }))
            .collect();
        let f = fit(&samples).unwrap();
        assert!(f.link.latency_us >= 0.0 && f.link.per_message_us >= 0.0, "{:?}", f.link);
        assert!((f.link.gbps - 1.0).abs() < 0.05, "{:?}", f.link);
    }

    #[test]
    fn too_few_sizes_or_no_rate_are_refused_with_the_reason() {
        let one = [
            sample(Pattern::PingPong, 1, 1000, 1e-3),
            sample(Pattern::Burst, 1, 1000, 1e-3),
            sample(Pattern::Burst, 2, 1000, 2e-3),
        ];
        assert!(fit(&one).unwrap_err().to_string().contains("two message sizes"));
        let b = |k, bytes, t| sample(Pattern::Burst, k, bytes, t);
        let flat = [b(1, 1000, 1e-3), b(2, 1000, 2e-3), b(1, 1_000_000, 1e-3), b(2, 1_000_000, 1.5e-3)];
        assert!(fit(&flat).unwrap_err().to_string().contains("do not grow"));
    }
}
