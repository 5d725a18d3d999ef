//! The envelope's bytes (feature `wire`): bincode under a bounded claim ([`Envelope::from_bytes`]),
//! and long messages put back together from their pieces ([`Reassembly`]). Every process transport
//! (MPI, NCCL) moves envelopes as these bytes.

use std::collections::HashMap;

use crate::runtime::msg::Envelope;

impl Envelope {
    /// The envelope as bytes for a process transport (bincode).
    pub fn to_bytes(&self) -> Vec<u8> {
        bincode::serde::encode_to_vec(self, bincode::config::standard()).expect("envelopes serialise")
    }

    /// An envelope from [`Envelope::to_bytes`]; the decoder's complaint if the bytes are not one,
    /// or if what they decode to is malformed ([`Msg::check`]).
    ///
    /// Every well-formed envelope decodes, whatever its size and content, and memory stays bounded
    /// by the message whatever its length fields claim. bincode's limit counts the bytes each
    /// decoded value takes in memory, not the bytes read: a small `usize` or `u64` is one byte on
    /// the wire (a varint) and claims 8. So the limit is [`CLAIM_PER_BYTE`] times the message's
    /// size (rounded up to a power of 4) plus [`CLAIM_SLACK`], at most `32 n + 1 MiB` for `n`
    /// bytes: a string's declared length (allocated before its bytes are read) cannot reserve more,
    /// a sequence reserves at most serde's cautious 1 MiB before its elements arrive, and every
    /// element consumes input bytes.
    pub fn from_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        Self::from_bytes_with(bytes, |_| Ok(()))
    }

    /// [`Self::from_bytes`] for a message whose device payloads travel beside it: `join` puts them
    /// back (`Msg::attach_device`) before the message is checked.
    pub fn from_bytes_with(
        bytes: &[u8],
        join: impl FnOnce(&mut Envelope) -> std::result::Result<(), String>,
    ) -> std::result::Result<Self, String> {
        fn limited<const L: usize>(
            bytes: &[u8],
        ) -> std::result::Result<(Envelope, usize), bincode::error::DecodeError> {
            bincode::serde::decode_from_slice(bytes, bincode::config::standard().with_limit::<L>())
        }
        /// One monomorphised decoder per size class (bincode's limit is a type-level constant).
        macro_rules! by_size {
            ($($log4:literal)+) => {
                match bytes.len() {
                    $(n if n <= 1 << (2 * $log4) => limited::<{ CLAIM_PER_BYTE * (1 << (2 * $log4)) + CLAIM_SLACK }>(bytes),)+
                    // Over 16 TiB: the bytes themselves are already more than any claim.
                    _ => limited::<{ usize::MAX }>(bytes),
                }
            };
        }
        let decoded = by_size!(6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22);
        match decoded {
            Ok((mut env, used)) if used == bytes.len() => {
                join(&mut env)?;
                env.msg.check().map(|()| env)
            }
            Ok((_, used)) => Err(format!("{} bytes left over after an envelope of {used}", bytes.len() - used)),
            Err(e) => Err(format!("{e} ({} bytes)", bytes.len())),
        }
    }
}

/// The most bytes of memory a decoded envelope's values claim per byte on the wire: the widest
/// element any message holds is 8 bytes (`usize`, `u64`, `f64`), and the narrowest encoding of one
/// is a single varint byte. (No message holds a `u128` or a zero-sized element; a new field of
/// either kind must raise this.)
pub const CLAIM_PER_BYTE: usize = 8;

/// What a decode may claim beyond [`CLAIM_PER_BYTE`] per byte.
pub const CLAIM_SLACK: usize = 1 << 20;

/// Tag of a message sent whole.
pub const TAG_WHOLE: i32 = 1;
/// Tag of the 8-byte little-endian length of a message sent in pieces.
pub const TAG_HEAD: i32 = 2;
/// Tag of a piece of a long message.
pub const TAG_PIECE: i32 = 3;

/// Puts long messages back together from their length head and pieces, per sender (a process
/// transport keeps the order of one sender's messages). Only what has arrived is held: a wrong
/// length head reserves nothing, and more bytes than it declared is an error.
#[derive(Debug, Default)]
pub struct Reassembly {
    partial: HashMap<i32, (usize, Vec<u8>)>,
}

impl Reassembly {
    /// Takes one received frame from `src`; returns a whole message when one is complete.
    pub fn take(&mut self, src: i32, tag: i32, bytes: Vec<u8>) -> std::result::Result<Option<Vec<u8>>, String> {
        match tag {
            TAG_WHOLE if self.partial.contains_key(&src) => Err("a whole message in the middle of a long one".into()),
            TAG_WHOLE => Ok(Some(bytes)),
            TAG_HEAD => {
                let Ok(head) = <[u8; 8]>::try_from(&bytes[..]) else {
                    return Err(format!("a length head of {} bytes (8 expected)", bytes.len()));
                };
                if self.partial.contains_key(&src) {
                    return Err("a length head in the middle of a long message".into());
                }
                let n = usize::try_from(u64::from_le_bytes(head)).map_err(|_| "a length beyond memory".to_string())?;
                self.partial.insert(src, (n, Vec::new()));
                Ok(None)
            }
            TAG_PIECE => {
                let Some((n, buf)) = self.partial.get_mut(&src) else {
                    return Err("a piece of a long message without its length head".into());
                };
                if bytes.len() > *n - buf.len() {
                    return Err(format!("{} bytes for a message of {n}", buf.len() + bytes.len()));
                }
                buf.extend_from_slice(&bytes);
                if buf.len() < *n {
                    return Ok(None);
                }
                Ok(self.partial.remove(&src).map(|(_, b)| b))
            }
            other => Err(format!("a frame with tag {other} (allowed: {TAG_WHOLE}, {TAG_HEAD}, {TAG_PIECE})")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::msg::{AuxSums, HostTensor, Msg, Packed};

    #[test]
    fn envelopes_round_trip_and_damaged_bytes_are_refused_with_the_reason() {
        let env = Envelope { src: 3, step: 7, sent_us: 11, deliver_us: 13, msg: Msg::Shutdown };
        let bytes = env.to_bytes();
        let back = Envelope::from_bytes(&bytes).unwrap();
        assert_eq!((back.src, back.step, back.sent_us, back.deliver_us), (3, 7, 11, 13));
        assert!(matches!(back.msg, Msg::Shutdown));
        // Cut short, trailing bytes, nonsense: each an error, none a panic.
        for (what, damaged) in [
            ("cut", bytes[..bytes.len() - 1].to_vec()),
            ("trailing", [&bytes[..], &[0u8]].concat()),
            ("nonsense", vec![0xff; 64]),
            ("empty", Vec::new()),
        ] {
            let e = Envelope::from_bytes(&damaged).err().unwrap_or_else(|| panic!("{what}: decoded"));
            assert!(!e.is_empty(), "{what}");
        }
    }

    #[test]
    fn malformed_messages_are_refused_before_use() {
        let t = |shape: Vec<usize>, n: usize| Packed::from(HostTensor { shape, data: vec![0.0; n] });
        let env = |msg| Envelope { src: 1, step: 1, sent_us: 0, deliver_us: 0, msg };
        let good = Msg::Dispatch {
            mb: 0,
            layer: 0,
            tokens: vec![0, 2],
            y: t(vec![2, 3], 6),
            weights: Some(t(vec![2, 2], 4)),
            ids: vec![0, 1, 1, 3],
        };
        assert!(Envelope::from_bytes(&env(good).to_bytes()).is_ok());
        // Found by fuzzing: a string whose length field claims 2^50 bytes used to be allocated
        // before its bytes were read (an abort of the process); now the claim is refused.
        let mut huge = vec![1, 2, 3, 4, 7, 2, 0xfd];
        huge.extend_from_slice(&(1u64 << 50).to_le_bytes());
        huge.extend_from_slice(b"short");
        let e = Envelope::from_bytes(&huge).expect_err("a 2^50-byte string in 17 bytes");
        assert!(e.contains("imit"), "{e}");
        for (what, msg) in [
            ("values", Msg::Combine { mb: 0, layer: 0, tokens: vec![0], spans: Vec::new(), out: t(vec![1, 3], 2) }),
            ("rows", Msg::Combine { mb: 0, layer: 0, tokens: vec![0, 1], spans: Vec::new(), out: t(vec![1, 3], 3) }),
            ("overflow", Msg::Residual { mb: 0, layer: 0, x: t(vec![usize::MAX, 2], 0), aux: AuxSums::default() }),
            ("odd bf16", Msg::GradCombine { mb: 0, layer: 0, g: Packed::Bf16 { shape: vec![1], bits: vec![0; 3] } }),
            (
                "fp8 scales",
                Msg::GradCombine {
                    mb: 0,
                    layer: 0,
                    g: Packed::Fp8 { shape: vec![2, 3], block: 2, codes: vec![0; 6], scales: vec![1.0; 3] },
                },
            ),
            (
                "fp8 block 0",
                Msg::GradCombine {
                    mb: 0,
                    layer: 0,
                    g: Packed::Fp8 { shape: vec![1, 3], block: 0, codes: vec![0; 3], scales: vec![] },
                },
            ),
            (
                "ids",
                Msg::Dispatch {
                    mb: 0,
                    layer: 0,
                    tokens: vec![0],
                    y: t(vec![1, 3], 3),
                    weights: Some(t(vec![1, 2], 2)),
                    ids: vec![0],
                },
            ),
        ] {
            let e = Envelope::from_bytes(&env(msg).to_bytes()).expect_err(what);
            assert!(e.contains("for"), "{what}: {e}");
        }
    }

    /// Every well-formed envelope decodes to itself: thousands of random ones of every kind, with
    /// values and sizes over their whole range (`wire_samples`), multi-MiB tensors among them.
    #[test]
    fn every_well_formed_envelope_of_every_kind_decodes_to_itself() {
        use crate::runtime::wire_samples::{Sampler, KINDS};
        use rand::{rngs::StdRng, RngCore, SeedableRng};
        let mut rng = StdRng::seed_from_u64(29);
        let mut sampler = Sampler::new(move || rng.next_u64());
        let (mut kinds, mut largest) = (std::collections::BTreeSet::new(), 0);
        for i in 0..(KINDS * 150) {
            let env = sampler.envelope(i);
            env.msg.check().unwrap_or_else(|e| panic!("sample {i} is malformed: {e}"));
            let bytes = env.to_bytes();
            let back = Envelope::from_bytes(&bytes).unwrap_or_else(|e| {
                panic!("sample {i} ({}, {} bytes) does not decode: {e}", env.msg.kind(), bytes.len())
            });
            assert!(back == env, "sample {i} ({}) decodes to another envelope", env.msg.kind());
            kinds.insert(env.msg.kind());
            largest = largest.max(bytes.len());
        }
        assert_eq!(kinds.len(), KINDS, "every kind sampled: {kinds:?}");
        assert!(largest > 4 << 20, "a multi-MiB envelope among the samples (largest {largest} bytes)");
    }

    /// The envelopes `--placement ep` failed on under MPI (issue 29): token and expert ids of one
    /// varint byte each claim 4 bytes when decoded, so a message just under 64 KiB claimed more
    /// than a 64 KiB limit. Every size around each of the decoder's size classes decodes.
    #[test]
    fn messages_of_small_ids_decode_at_every_size() {
        for n in [100, 4000, 6000, 16_000, 16_383, 16_384, 20_000, 70_000, 300_000] {
            let tokens: Vec<u32> = (0..n).map(|i| (i % 100) as u32).collect();
            let msg = Msg::Dispatch {
                mb: 0,
                layer: 1,
                ids: tokens.iter().flat_map(|&t| [t % 8, 7 - t % 8]).collect(),
                weights: Some(HostTensor { shape: vec![n, 2], data: vec![0.5; 2 * n] }.into()),
                y: HostTensor { shape: vec![n, 0], data: Vec::new() }.into(),
                tokens,
            };
            let env = Envelope { src: 1, step: 2, sent_us: 3, deliver_us: 4, msg };
            let bytes = env.to_bytes();
            let back =
                Envelope::from_bytes(&bytes).unwrap_or_else(|e| panic!("{n} tokens, {} bytes: {e}", bytes.len()));
            assert!(back == env, "{n} tokens");
        }
        // A shape of small dimensions (8 bytes each when decoded) and a long trace of empty names.
        let x = HostTensor { shape: vec![1; 60_000], data: vec![2.0] };
        let env = Envelope {
            src: 0,
            step: 0,
            sent_us: 0,
            deliver_us: 0,
            msg: Msg::GradCombine { mb: 0, layer: 0, g: x.into() },
        };
        assert!(Envelope::from_bytes(&env.to_bytes()).unwrap() == env);
    }

    #[test]
    fn long_messages_are_put_back_together_and_bad_frames_refused() {
        let mut r = Reassembly::default();
        assert_eq!(r.take(0, TAG_WHOLE, vec![1]).unwrap(), Some(vec![1]));
        assert_eq!(r.take(2, TAG_HEAD, 5u64.to_le_bytes().to_vec()).unwrap(), None);
        assert_eq!(r.take(2, TAG_PIECE, vec![1, 2, 3]).unwrap(), None);
        assert_eq!(r.take(3, TAG_WHOLE, vec![9]).unwrap(), Some(vec![9]), "other senders go on");
        assert_eq!(r.take(2, TAG_PIECE, vec![4, 5]).unwrap(), Some(vec![1, 2, 3, 4, 5]));
        // A huge declared length reserves nothing; too many bytes, a piece without a head, a
        // short head, a whole message inside a long one, an unknown tag: each an error.
        assert_eq!(r.take(4, TAG_HEAD, u64::MAX.to_le_bytes().to_vec()).unwrap(), None);
        assert!(r.take(4, TAG_WHOLE, vec![1]).unwrap_err().contains("middle"));
        assert_eq!(r.take(5, TAG_HEAD, 2u64.to_le_bytes().to_vec()).unwrap(), None);
        assert!(r.take(5, TAG_PIECE, vec![1, 2, 3]).unwrap_err().contains("3 bytes for a message of 2"));
        assert!(r.take(6, TAG_PIECE, vec![1]).unwrap_err().contains("without its length head"));
        assert!(r.take(7, TAG_HEAD, vec![1, 2]).unwrap_err().contains("8 expected"));
        assert!(r.take(8, 99, vec![]).unwrap_err().contains("allowed"));
    }
}
