//! Bytes from another process: frames (tag, bytes) through the MPI transport's reassembly of long
//! messages, and every whole message, as well as the input itself, through the envelope decoder.
//! Neither may panic; a decoded envelope is well formed and encodes back to the same bytes; and
//! decoding never allocates more than a bounded multiple of what it was given (a length field that
//! claims terabytes reserves nothing). The other direction too: a well-formed envelope built from
//! the input's bytes (`wire_samples`, every message kind) decodes to itself.
#![no_main]

use disagmoe_fuzz::{peak_during, Counting};
use disagmoe_train::runtime::msg::Envelope;
use disagmoe_train::runtime::transport::Reassembly;
use disagmoe_train::runtime::wire_samples::Sampler;
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: Counting = Counting;

/// Decodes `bytes`, checking the round trip and the memory it took.
fn decode(bytes: &[u8]) {
    let (decoded, took) = peak_during(|| Envelope::from_bytes(bytes));
    // serde reserves at most 1 MiB per open sequence before its elements arrive; envelopes nest
    // at most 4 deep.
    let bound = 32 * bytes.len() + (4 << 20);
    assert!(took <= bound, "decoding {} bytes took {took} bytes (bound {bound})", bytes.len());
    if let Ok(env) = decoded {
        env.msg.check().expect("a decoded envelope is well formed");
        // Its encoding (canonical, whatever varint forms the input used) decodes to itself.
        let again = env.to_bytes();
        let back = Envelope::from_bytes(&again).expect("an encoded envelope decodes");
        assert_eq!(back.to_bytes(), again, "encode/decode round trip");
    }
}

/// Builds a well-formed envelope from `data` (read 8 bytes at a time, zeros once it runs out) and
/// checks that it decodes to itself.
fn round_trip(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else { return };
    let mut words = rest.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    });
    let env = Sampler::new(move || words.next().unwrap_or(0)).envelope(usize::from(kind));
    env.msg.check().expect("a sample is well formed");
    let back = Envelope::from_bytes(&env.to_bytes()).expect("a well-formed envelope decodes");
    assert!(back == env, "a well-formed envelope decodes to itself");
}

fuzz_target!(|data: &[u8]| {
    decode(data);
    round_trip(data);
    // Frames: [sender, tag, len_lo, len_hi, bytes...]
    let mut r = Reassembly::default();
    let mut rest = data;
    while rest.len() >= 4 {
        let (src, tag) = (i32::from(rest[0] % 4), i32::from(rest[1] % 5));
        let len = usize::from(u16::from_le_bytes([rest[2], rest[3]])).min(rest.len() - 4);
        let frame = rest[4..4 + len].to_vec();
        rest = &rest[4 + len..];
        match r.take(src, tag, frame) {
            Ok(Some(whole)) => decode(&whole),
            Ok(None) => {}
            Err(e) => assert!(!e.is_empty()),
        }
    }
});
