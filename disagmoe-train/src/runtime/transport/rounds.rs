//! Rounds (feature `wire`): how a process transport moves messages whose payloads stay in device
//! memory through **one** communicator of grouped sends and receives, without the deadlocks of
//! unmatched point-to-point transfers (the `nccl` transport, [`super::super::nccl`]).
//!
//! Device-to-device transfers (NCCL's `ncclSend`/`ncclRecv`) must be posted on both sides, in the
//! same order per pair, and ops on one communicator run in the order they were posted: a rank that
//! posts a send before the receive its peer is waiting on, while the peer does the same, hangs
//! both. AF-Pipe's workers send whenever a task finishes, so no order can be agreed message by
//! message. Rounds agree on everything first: every rank, in lockstep,
//!
//! 1. takes what its worker queued since the last round (waiting at most `idle` for the first),
//!    each message with its device payloads already taken out on the worker's thread
//!    ([`outgoing`]: `Msg::detach_device`, each payload leaving its shape, a
//!    [`Packed::Remote`](crate::runtime::msg::Packed::Remote), and its buffer finished on the
//!    worker's stream);
//! 2. sends every peer, in one all-to-all of bytes, the envelopes for it with their payloads'
//!    shapes, and whether it is closing;
//! 3. posts, in one group, a send of each of its payload buffers and a receive of each payload the
//!    headers announced, per peer in the order of the headers, which both sides know now;
//! 4. puts each message back together ([`Envelope::from_bytes_with`], then the message's checks)
//!    and delivers it.
//!
//! The rounds stop when every rank has said it is closing (its worker dropped its endpoint), all in
//! the same round. A message that cannot be taken in (or sent: a destination out of the job) is
//! reported to the worker and the rounds go on. What breaks the lockstep (a collective failing, a
//! peer's header that cannot be read, a buffer that cannot be allocated) ends [`serve`] with an
//! error, on which the transport must end the whole job (the `nccl` transport aborts it through
//! MPI): peers would otherwise wait forever in a collective. Everything but the wire's two collectives and
//! its buffers is here and tested on the CPU ([`RoundWire`] over threads); the NCCL wire adds MPI's
//! all-to-all and NCCL's grouped transfers.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use super::Delivery;
use crate::error::{Result, TrainError};
use crate::runtime::msg::{DeviceTensor, Envelope, RemoteShape};

/// What rounds need of a job: two collectives and the device's buffers.
pub trait RoundWire {
    /// A payload's bytes in device memory, kept alive while a transfer uses it.
    type Buf: Send;
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks of the job.
    fn size(&self) -> usize;
    /// Collective: `out[r]` to rank `r` (this rank's own entry is not sent); returns what each
    /// rank sent this one (empty from itself).
    fn all_to_all(&mut self, out: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>;
    /// Collective in effect: every send and receive posted as one group, matched per peer in
    /// order; returns the received buffers in the order of `recvs`.
    fn transfer(&mut self, sends: Vec<(usize, Self::Buf)>, recvs: &[(usize, RemoteShape)]) -> Result<Vec<Self::Buf>>;
    /// A device payload's buffer to send (its values, contiguous, finished on the calling thread's
    /// stream): called on the worker's thread.
    fn export(t: &DeviceTensor) -> std::result::Result<Self::Buf, String>;
    /// A received buffer as a device payload of `shape`.
    fn import(&mut self, buf: Self::Buf, shape: &RemoteShape) -> Result<DeviceTensor>;
}

/// One message of a round's header: its payloads' shapes and its envelope's bytes.
#[derive(Debug, Clone, PartialEq)]
struct Announced {
    shapes: Vec<RemoteShape>,
    envelope: Vec<u8>,
}

/// What a rank tells a peer each round.
#[derive(Debug, Clone, PartialEq, Default)]
struct Header {
    closing: bool,
    messages: Vec<Announced>,
}

impl Header {
    /// `closing` (1 byte), the message count (u32), then per message: its shapes (u32 count, then
    /// rows and columns as u64 and the value size as u8 each) and its envelope (u64 length, bytes);
    /// little-endian.
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![self.closing as u8];
        b.extend((self.messages.len() as u32).to_le_bytes());
        for m in &self.messages {
            b.extend((m.shapes.len() as u32).to_le_bytes());
            for s in &m.shapes {
                b.extend((s.shape[0] as u64).to_le_bytes());
                b.extend((s.shape[1] as u64).to_le_bytes());
                b.push(s.elem_bytes);
            }
            b.extend((m.envelope.len() as u64).to_le_bytes());
            b.extend(&m.envelope);
        }
        b
    }

    /// The header in `bytes`, or why they are not one; nothing is allocated beyond what the bytes
    /// hold.
    fn from_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        struct Cursor<'a>(&'a [u8]);
        impl<'a> Cursor<'a> {
            fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
                if self.0.len() < n {
                    return Err(format!("{n} bytes wanted, {} left", self.0.len()));
                }
                let (head, rest) = self.0.split_at(n);
                self.0 = rest;
                Ok(head)
            }
            fn u64(&mut self) -> std::result::Result<u64, String> {
                Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
            }
            fn u32(&mut self) -> std::result::Result<u32, String> {
                Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
            }
            fn len(&mut self, each: usize) -> std::result::Result<usize, String> {
                let n = self.u32()? as usize;
                // Each item takes at least `each` bytes: a count past what is left is refused
                // before anything is reserved.
                if n.saturating_mul(each) > self.0.len() {
                    return Err(format!("{n} items claimed in {} bytes", self.0.len()));
                }
                Ok(n)
            }
        }
        let mut c = Cursor(bytes);
        let closing = match c.take(1)?[0] {
            0 => false,
            1 => true,
            x => return Err(format!("closing flag {x}")),
        };
        let mut messages = Vec::with_capacity(c.len(12)?);
        for _ in 0..messages.capacity() {
            let mut shapes = Vec::with_capacity(c.len(17)?);
            for _ in 0..shapes.capacity() {
                let (rows, cols) = (c.u64()? as usize, c.u64()? as usize);
                let elem_bytes = c.take(1)?[0];
                if !matches!(elem_bytes, 2 | 4) || rows.checked_mul(cols).and_then(|n| n.checked_mul(4)).is_none() {
                    return Err(format!("a payload of [{rows}, {cols}] with {elem_bytes}-byte values"));
                }
                shapes.push(RemoteShape { shape: [rows, cols], elem_bytes });
            }
            let n = usize::try_from(c.u64()?).map_err(|e| e.to_string())?;
            messages.push(Announced { shapes, envelope: c.take(n)?.to_vec() });
        }
        match c.0.len() {
            0 => Ok(Header { closing, messages }),
            n => Err(format!("{n} bytes left over")),
        }
    }
}

/// A message for `dst` as a round takes it: the envelope with its device payloads taken out, and
/// their buffers ([`RoundWire::export`], on the calling worker's thread).
pub struct Outgoing<B> {
    dst: usize,
    env: Envelope,
    shapes: Vec<RemoteShape>,
    bufs: Vec<B>,
}

/// `env` for `dst`, its device payloads exported for the wire `W`.
pub fn outgoing<W: RoundWire>(dst: usize, mut env: Envelope) -> std::result::Result<Outgoing<W::Buf>, String> {
    let tensors = env.msg.detach_device();
    let shapes =
        tensors.iter().map(|t| RemoteShape { shape: t.shape, elem_bytes: t.rows.elem_bytes() as u8 }).collect();
    let bufs = tensors.iter().map(W::export).collect::<std::result::Result<_, _>>()?;
    Ok(Outgoing { dst, env, shapes, bufs })
}

/// Runs rounds on `wire` until every rank is closing: `outbox` holds the worker's messages
/// ([`outgoing`]; closed when the worker drops its endpoint); arrivals go to `deliver`.
/// Returns an error only when a collective fails (the job cannot go on); a message that cannot be
/// taken in is delivered as an error naming its sender.
pub fn serve<W: RoundWire>(
    wire: &mut W,
    outbox: &Receiver<Outgoing<W::Buf>>,
    deliver: &Sender<Delivery>,
    idle: Duration,
) -> Result<()> {
    let (me, n) = (wire.rank(), wire.size());
    let fail = |what: String| TrainError::Worker { worker: me, cause: what };
    let mut closing = false;
    loop {
        // 1. What the worker queued.
        let mut batch = Vec::new();
        if !closing {
            match outbox.recv_timeout(idle) {
                Ok(m) => batch.push(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => closing = true,
            }
            loop {
                match outbox.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        closing = true;
                        break;
                    }
                }
            }
        }
        // 2. Headers to every peer; the payloads to send, per peer in header order.
        let mut headers: Vec<Header> = (0..n).map(|_| Header { closing, messages: Vec::new() }).collect();
        let mut sends = Vec::new();
        for Outgoing { dst, env, shapes, bufs } in batch {
            if dst == me || dst >= n {
                let _ = deliver.send(Err(fail(format!("rounds: a message for worker {dst} (this is {me} of {n})"))));
                continue;
            }
            sends.extend(bufs.into_iter().map(|b| (dst, b)));
            headers[dst].messages.push(Announced { shapes, envelope: env.to_bytes() });
        }
        let incoming = wire.all_to_all(headers.iter().map(Header::to_bytes).collect())?;
        // 3. What the peers announced, then one grouped transfer.
        let mut all_closing = closing;
        let mut announced = Vec::new();
        let mut recvs = Vec::new();
        for (peer, bytes) in incoming.iter().enumerate().filter(|(p, _)| *p != me) {
            match Header::from_bytes(bytes) {
                Ok(h) => {
                    all_closing &= h.closing;
                    for m in h.messages {
                        recvs.extend(m.shapes.iter().map(|s| (peer, *s)));
                        announced.push((peer, m));
                    }
                }
                // The peer's transfers cannot be matched without its header: the job cannot go on.
                Err(e) => return Err(fail(format!("rounds: worker {peer}'s header: {e}"))),
            }
        }
        let mut received = wire.transfer(sends, &recvs)?.into_iter();
        // 4. Each message put back together and checked.
        for (peer, m) in announced {
            let bufs: Vec<W::Buf> = received.by_ref().take(m.shapes.len()).collect();
            let tensors: Result<Vec<DeviceTensor>> =
                bufs.into_iter().zip(&m.shapes).map(|(b, s)| wire.import(b, s)).collect();
            let env = tensors
                .map_err(|e| e.to_string())
                .and_then(|tensors| Envelope::from_bytes_with(&m.envelope, |env| env.msg.attach_device(tensors)));
            let delivered = match env {
                Ok(env) if env.src == peer => Ok(env),
                Ok(env) => Err(format!("an envelope from worker {} on worker {peer}'s connection", env.src)),
                Err(e) => Err(e),
            };
            let delivered = delivered.map_err(|e| fail(format!("from worker {peer}: an undecodable message: {e}")));
            // A worker that has gone drops nothing on the floor that anyone waits for.
            let _ = deliver.send(delivered);
        }
        if all_closing {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::{Arc, Barrier, Mutex};

    use super::*;
    use crate::runtime::msg::mem_device::{mem, mem_of};
    use crate::runtime::msg::{AuxSums, HostTensor, Msg, Packed};

    /// Ranks as threads: the all-to-all through shared slots and a barrier, the transfers through
    /// a channel per ordered pair (a send never waits, as inside an NCCL group).
    struct MemWire {
        rank: usize,
        size: usize,
        slots: Arc<Mutex<Vec<Vec<Vec<u8>>>>>,
        barrier: Arc<Barrier>,
        to: Vec<Sender<Vec<f32>>>,
        from: Vec<Receiver<Vec<f32>>>,
        rounds: usize,
    }

    fn wires(size: usize) -> Vec<MemWire> {
        let slots = Arc::new(Mutex::new(vec![vec![Vec::new(); size]; size]));
        let barrier = Arc::new(Barrier::new(size));
        // channels[src][dst]
        let mut tx: Vec<Vec<Option<Sender<Vec<f32>>>>> = (0..size).map(|_| (0..size).map(|_| None).collect()).collect();
        let mut rx: Vec<Vec<Option<Receiver<Vec<f32>>>>> =
            (0..size).map(|_| (0..size).map(|_| None).collect()).collect();
        for (src, row) in tx.iter_mut().enumerate() {
            for (dst, slot) in row.iter_mut().enumerate() {
                let (t, r) = channel();
                *slot = Some(t);
                rx[dst][src] = Some(r);
            }
        }
        (0..size)
            .map(|rank| MemWire {
                rank,
                size,
                slots: slots.clone(),
                barrier: barrier.clone(),
                to: tx[rank].iter_mut().map(|t| t.take().unwrap()).collect(),
                from: rx[rank].iter_mut().map(|r| r.take().unwrap()).collect(),
                rounds: 0,
            })
            .collect()
    }

    impl RoundWire for MemWire {
        type Buf = Vec<f32>;
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn all_to_all(&mut self, out: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
            self.rounds += 1;
            self.slots.lock().unwrap()[self.rank] = out;
            self.barrier.wait();
            let got = self.slots.lock().unwrap().iter().map(|row| row[self.rank].clone()).collect();
            self.barrier.wait();
            Ok(got)
        }
        fn transfer(&mut self, sends: Vec<(usize, Vec<f32>)>, recvs: &[(usize, RemoteShape)]) -> Result<Vec<Vec<f32>>> {
            for (dst, buf) in sends {
                self.to[dst].send(buf).unwrap();
            }
            recvs
                .iter()
                .map(|(src, shape)| {
                    let buf = self.from[*src].recv().unwrap();
                    assert_eq!(buf.len(), shape.shape[0] * shape.shape[1], "sends and receives matched in order");
                    Ok(buf)
                })
                .collect()
        }
        fn export(t: &DeviceTensor) -> std::result::Result<Vec<f32>, String> {
            Ok(mem_of(t).data.clone())
        }
        fn import(&mut self, buf: Vec<f32>, shape: &RemoteShape) -> Result<DeviceTensor> {
            Ok(mem(HostTensor { shape: shape.shape.to_vec(), data: buf }))
        }
    }

    /// A message of every payload kind: device payloads, host ones, none.
    fn message(src: usize, i: usize) -> Msg {
        let t = |rows: usize, v: f32| HostTensor {
            shape: vec![rows, 3],
            data: (0..rows * 3).map(|j| v + j as f32).collect(),
        };
        let v = (src * 1000 + i) as f32;
        match i % 4 {
            0 => Msg::Dispatch {
                mb: i,
                layer: src,
                tokens: vec![0, 2],
                y: Packed::Device(mem(t(2, v))),
                weights: Some(Packed::Device(mem(HostTensor { shape: vec![2, 1], data: vec![v, -v] }))),
                ids: vec![1, 3],
            },
            1 => Msg::Residual { mb: i, layer: 0, x: Packed::F32(t(4, v)), aux: AuxSums::default() },
            2 => Msg::GradDispatch { mb: i, layer: 1, gy: Packed::Device(mem(t(1, v))), gw: None },
            _ => Msg::Heartbeat { busy_us: i as u64 },
        }
    }

    /// Every message arrives once, from its sender in its order, with its device payloads' values
    /// (which travelled apart) back in place; ranks that send at different paces and at different
    /// times all stop together once each has closed.
    #[test]
    fn rounds_deliver_every_message_with_its_device_payloads_and_stop_together() {
        let size = 3;
        let per_peer = 9;
        let handles: Vec<_> = wires(size)
            .into_iter()
            .map(|mut wire| {
                std::thread::spawn(move || {
                    let me = wire.rank;
                    let (tx, outbox) = channel();
                    let (deliver, arrived) = channel();
                    let sender = std::thread::spawn(move || {
                        for i in 0..per_peer {
                            for dst in (0..size).filter(|&d| d != me) {
                                let msg = message(me, i);
                                let env = Envelope { src: me, step: 1, sent_us: 0, deliver_us: 0, msg };
                                tx.send(outgoing::<MemWire>(dst, env).unwrap()).unwrap();
                            }
                            // Ranks at different paces: some rounds carry nothing from some.
                            std::thread::sleep(Duration::from_millis((me as u64 * 3 + i as u64) % 5));
                        }
                    });
                    serve(&mut wire, &outbox, &deliver, Duration::from_millis(1)).unwrap();
                    sender.join().unwrap();
                    let got: Vec<Envelope> = arrived.try_iter().map(|d: Delivery| d.unwrap()).collect();
                    (me, got, wire.rounds)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let rounds: Vec<usize> = results.iter().map(|r| r.2).collect();
        assert!(rounds.iter().all(|&r| r == rounds[0]), "every rank ran the same rounds: {rounds:?}");
        for (me, got, _) in results {
            for src in (0..size).filter(|&s| s != me) {
                let from: Vec<Msg> = got.iter().filter(|e| e.src == src).map(|e| e.msg.clone()).collect();
                assert_eq!(from.len(), per_peer, "worker {me} from {src}");
                for (i, msg) in from.into_iter().enumerate() {
                    let want = message(src, i);
                    let values = |m: &Msg| match m {
                        Msg::Dispatch { y, weights: Some(w), .. } => vec![y.clone().unpack(), w.clone().unpack()],
                        Msg::Residual { x, .. } => vec![x.clone().unpack()],
                        Msg::GradDispatch { gy, .. } => vec![gy.clone().unpack()],
                        _ => Vec::new(),
                    };
                    assert_eq!(values(&msg), values(&want), "worker {me}: message {i} from {src}");
                    assert_eq!(msg.kind(), want.kind());
                    if let Msg::Dispatch { y, .. } = &msg {
                        assert!(matches!(y, Packed::Device(_)), "a device payload arrives on the device");
                    }
                }
            }
        }
    }

    /// Headers round-trip, and damaged ones are refused with the reason before anything large is
    /// reserved.
    #[test]
    fn headers_round_trip_and_damaged_ones_are_refused() {
        let h = Header {
            closing: true,
            messages: vec![
                Announced { shapes: vec![RemoteShape { shape: [2, 3], elem_bytes: 4 }], envelope: vec![1, 2, 3] },
                Announced { shapes: Vec::new(), envelope: Vec::new() },
            ],
        };
        let bytes = h.to_bytes();
        assert_eq!(Header::from_bytes(&bytes), Ok(h));
        for cut in 0..bytes.len() {
            assert!(Header::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut claims = vec![0u8];
        claims.extend(u32::MAX.to_le_bytes());
        assert!(Header::from_bytes(&claims).unwrap_err().contains("claimed"));
        let mut odd = bytes.clone();
        odd[1 + 4 + 4 + 16] = 3;
        assert!(Header::from_bytes(&odd).unwrap_err().contains("3-byte values"));
        assert!(Header::from_bytes(&[2, 0, 0, 0, 0]).unwrap_err().contains("closing flag"));
        let mut extra = Header::default().to_bytes();
        extra.push(0);
        assert!(Header::from_bytes(&extra).unwrap_err().contains("left over"));
    }

    /// A message whose payloads do not fit its places is refused, naming the sender.
    #[test]
    fn a_message_without_its_payloads_is_refused() {
        let mut msg = message(0, 0);
        let tensors = msg.detach_device();
        assert_eq!(tensors.len(), 2);
        assert!(msg.check().unwrap_err().contains("without its values"), "not usable taken apart");
        let mut short = msg.clone();
        assert!(short.attach_device(tensors[..1].to_vec()).unwrap_err().contains("fewer"));
        let mut swapped = msg.clone();
        assert!(swapped.attach_device(vec![tensors[1].clone(), tensors[0].clone()]).unwrap_err().contains("place"));
        msg.attach_device(tensors).unwrap();
        msg.check().unwrap();
    }
}
